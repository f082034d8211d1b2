"""The forms being compared: six ways to compute one bias-free self-attention layer.

    einsum       einattn, impl="einsum": equations (1)–(5) as written
    sdpa         einattn, impl="sdpa": (2)–(4) by F.scaled_dot_product_attention
    chunked      einattn, impl="chunked": exact attention over tiles, O(L) memory
    textbook     the lean reshape form: three F.linear, view/transpose, matmul, /√a,
                 softmax, matmul, transpose/reshape, F.linear; no mask handling
    torch_mha    nn.MultiheadAttention(batch_first=True), need_weights=False
    linear_sdpa  hand-fused: one nn.Linear to 3·d_model, split, SDPA, out nn.Linear

:func:`build` makes all of them from one seeded einattn layer's weights; :func:`step` is one
call of a form in a mode ("forward" or "forward+backward").
"""

from __future__ import annotations

import copy
import importlib
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..module import MultiHeadAttention

if TYPE_CHECKING:
    from .settings import Size

PATHS = ("einsum", "sdpa", "chunked", "textbook", "torch_mha", "linear_sdpa")
EINATTN = ("einsum", "sdpa", "chunked")
NAMES = {"einsum": "einattn einsum", "sdpa": "einattn sdpa", "chunked": "einattn chunked",
         "textbook": "textbook (reshape)", "torch_mha": "nn.MultiheadAttention",
         "linear_sdpa": "Linear+SDPA (fused)"}
MODES = ("forward", "forward+backward")


class Textbook(nn.Module):
    """The lean textbook form, the baseline: ``Q, K, V = X W_qᵀ, X W_kᵀ, X W_vᵀ`` split into
    heads, ``Z = softmax(Q Kᵀ / √a) V``, heads merged, ``Y = Z W_oᵀ`` (no mask handling but
    the causal one)."""

    def __init__(self, W_q, W_k, W_v, W_o, *, heads: int, causal: bool):
        super().__init__()
        self.W_q, self.W_k, self.W_v, self.W_o = (nn.Parameter(w.clone())
                                                  for w in (W_q, W_k, W_v, W_o))
        self.heads, self.causal = heads, causal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, L, d_model = x.shape
        d_head = d_model // self.heads
        q = F.linear(x, self.W_q).view(n, L, self.heads, d_head).transpose(1, 2)
        k = F.linear(x, self.W_k).view(n, L, self.heads, d_head).transpose(1, 2)
        v = F.linear(x, self.W_v).view(n, L, self.heads, d_head).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(d_head)
        if self.causal:
            future = torch.ones(L, L, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        z = torch.softmax(scores, dim=-1) @ v
        return F.linear(z.transpose(1, 2).reshape(n, L, d_model), self.W_o)


class LinearSDPA(nn.Module):
    """Hand-fused, as nanoGPT writes it: one Linear to 3·d_model, split, SDPA, out Linear."""

    def __init__(self, W_qkv, W_o, *, heads: int, causal: bool):
        super().__init__()
        d_model = W_o.shape[0]
        kw = {"bias": False, "dtype": W_o.dtype, "device": W_o.device}
        self.qkv = nn.Linear(d_model, 3 * d_model, **kw)
        self.out = nn.Linear(d_model, d_model, **kw)
        with torch.no_grad():
            self.qkv.weight.copy_(W_qkv)
            self.out.weight.copy_(W_o)
        self.heads, self.causal = heads, causal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, L, d_model = x.shape
        q, k, v = (t.view(n, L, self.heads, d_model // self.heads).transpose(1, 2)
                   for t in self.qkv(x).split(d_model, dim=2))
        z = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.out(z.transpose(1, 2).reshape(n, L, d_model))


class TorchMHA(nn.Module):
    """``nn.MultiheadAttention`` called as a self-attention layer, weights not returned."""

    def __init__(self, mha: nn.MultiheadAttention, *, causal: bool):
        super().__init__()
        self.mha, self.causal = mha, causal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.causal:
            return self.mha(x, x, x, need_weights=False)[0]
        L = x.shape[1]
        future = torch.ones(L, L, dtype=torch.bool, device=x.device).triu(1)  # True = blocked
        return self.mha(x, x, x, need_weights=False, attn_mask=future, is_causal=True)[0]


def with_impl(layer: MultiHeadAttention, impl: str) -> MultiHeadAttention:
    """The layer itself with another default ``impl``: a shallow copy sharing its parameters,
    no wrapper module around it."""
    form = copy.copy(layer)
    form.impl = impl
    return form


def _without_causal(layer: MultiHeadAttention) -> MultiHeadAttention:
    """A shallow copy with ``causal=False``, which ``to_torch`` converts (TorchMHA passes the
    causal mask on each call instead)."""
    form = copy.copy(layer)
    form.causal = False
    return form


def build(size: Size, *, seed: int = 0, dtype: torch.dtype = torch.float32,
          paths: tuple[str, ...] = PATHS) -> dict[str, nn.Module]:
    """The forms of one layer, from one seeded einattn layer's weights (all eval, bias-free)."""
    torch.manual_seed(seed)
    layer = MultiHeadAttention(size.d_model, size.heads, causal=size.causal, dtype=dtype)
    p = layer.projections()
    forms: dict[str, Callable[[], nn.Module]] = {
        "einsum": lambda: with_impl(layer, "einsum"),
        "sdpa": lambda: with_impl(layer, "sdpa"),
        "chunked": lambda: with_impl(layer, "chunked"),
        "textbook": lambda: Textbook(p.W_q, p.W_k, p.W_v, p.W_o, heads=size.heads,
                                     causal=size.causal),
        "torch_mha": lambda: TorchMHA(_without_causal(layer).to_torch(), causal=size.causal),
        "linear_sdpa": lambda: LinearSDPA(torch.cat([p.W_q, p.W_k, p.W_v]), p.W_o,
                                          heads=size.heads, causal=size.causal),
    }
    return {name: forms[name]().eval() for name in paths}


def unavailable() -> dict[str, str]:
    """Forms that cannot run here, with the reason (``chunked`` when einattn.chunked does not
    import)."""
    try:
        importlib.import_module("einattn.chunked")
    except ImportError as error:
        return {"chunked": f"einattn.chunked is not available ({error}); skipped"}
    return {}


def inputs(size: Size, *, seed: int = 1, dtype: torch.dtype = torch.float32):
    """``X[n τ i]`` (requiring grad) and the output gradient ``dY``."""
    g = torch.Generator().manual_seed(seed)
    shape = (size.n, size.L, size.d_model)
    x = torch.randn(*shape, generator=g, dtype=dtype).requires_grad_()
    return x, torch.randn(*shape, generator=g, dtype=dtype)


def step(form: Callable, mode: str, x: torch.Tensor, dy: torch.Tensor,
         params: list[torch.Tensor]) -> Callable[[], None]:
    """One call of ``form`` in ``mode``, as a function of no arguments: "forward" under
    ``torch.no_grad()``; "forward+backward" resets every gradient to None, then runs
    ``Y.backward(dY)``."""
    if mode == "forward":
        def forward() -> None:
            with torch.no_grad():
                form(x)
        return forward

    def forward_backward() -> None:
        for t in params:
            t.grad = None
        x.grad = None
        form(x).backward(dy)
    return forward_backward
