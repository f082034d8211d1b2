"""Masks: which keys σ a query τ may attend to, and how mask arguments are checked.

Polarity is fixed across einattn: a boolean mask is True where attention is *allowed*
(as in ``F.scaled_dot_product_attention`` and the NumPy seed); a float mask is *added* to
the scores (``-inf`` blocks). Every mask broadcasts to ``(n, μ, τ, σ)``: a 2-D mask is
``(τ, σ)``, a 3-D mask ``(n, τ, σ)``, a 4-D mask ``(n, μ, τ, σ)``; any of those axes may be 1.
"""

from __future__ import annotations

import torch

from . import _autocast
from .errors import EinattnError
from .patterns import Causal, alibi_slopes

__all__ = ["additive_causal_mask", "alibi_slopes", "as_nmts", "attention_mask", "causal_mask",
           "check_key_padding", "combine", "from_key_padding"]


def causal_mask(L_q: int, L_k: int | None = None, *, device=None) -> torch.Tensor:
    """Boolean ``(τ, σ)`` mask, True where key σ is not in the future of query τ.

    With ``L_q != L_k`` it is aligned bottom-right: query τ sits at absolute position
    ``τ + L_k − L_q``, so the last query sees every key (as decoding with a cache needs).

    >>> causal_mask(2, 3).int()
    tensor([[1, 1, 0],
            [1, 1, 1]], dtype=torch.int32)
    """
    L_k = L_q if L_k is None else L_k
    tau = torch.arange(L_q, device=device)[:, None] + (L_k - L_q)  # τ' = τ + L_k − L_q
    return Causal().allowed(None, None, tau, torch.arange(L_k, device=device)[None, :])


def additive_causal_mask(L_q: int, L_k: int | None = None, *, dtype=torch.float32,
                         device=None) -> torch.Tensor:
    """The derivation's additive ``M[τ σ]``: 0 where allowed, ``-inf`` in the future."""
    allowed = causal_mask(L_q, L_k, device=device)
    zero = torch.zeros((), dtype=dtype, device=device)
    return zero.masked_fill(~allowed, float("-inf"))


def as_nmts(mask: torch.Tensor, *, name: str, n: int, n_heads: int, L_q: int, L_k: int,
            dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    """Check a mask argument (dtype, device, values, shape) and view it as 4-D
    ``(n, μ, τ, σ)`` (axes of size 1 broadcast). A float mask may hold ``−∞`` (blocked) but
    not ``+∞``, which would turn its row NaN."""
    if not isinstance(mask, torch.Tensor):
        raise EinattnError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise EinattnError(
            f"{name} must be bool (True = may attend) or float (added to the scores), "
            f"got {mask.dtype}; for a mask where 0 = blocked pass `{name} != 0`")
    if device is not None and mask.device != device:
        raise EinattnError(f"{name} is on {mask.device} but the scores are on {device}")
    if mask.is_floating_point():
        mask = _checked_float(mask, name, dtype)
    expanders = {2: (None, None), 3: (slice(None), None), 4: (slice(None), slice(None))}
    if mask.ndim not in expanders:
        raise EinattnError(f"{name} has {mask.ndim} axes {tuple(mask.shape)}; expected "
                           f"(τ, σ), (n, τ, σ) or (n, μ, τ, σ)")
    full = mask[expanders[mask.ndim]] if mask.ndim < 4 else mask
    expected = (n, n_heads, L_q, L_k)
    for index, got, want in zip("nμτσ", full.shape, expected, strict=True):
        if got not in (1, want):
            raise EinattnError(
                f"{name} has shape {tuple(mask.shape)}: index {index!r} has size {got} in "
                f"{name} but {want} in the scores S[n μ τ σ] {expected}")
    return full


def _checked_float(mask: torch.Tensor, name: str, dtype: torch.dtype) -> torch.Tensor:
    """A float mask in the scores' dtype, without ``+∞`` (checked eagerly: a traced graph
    cannot branch on values)."""
    if mask.dtype != dtype:
        if _autocast.dtype(mask.device) is None:
            raise EinattnError(f"{name} is {mask.dtype} but the scores are {dtype}")
        mask = mask.to(dtype)  # under autocast the scores' dtype is autocast's, not the user's
    if not torch.compiler.is_compiling() and bool(torch.isposinf(mask).any()):
        raise EinattnError(f"{name} holds +inf, which would make every weight of its row NaN; "
                           f"a float mask adds to the scores: -inf blocks, 0 keeps")
    return mask


def from_key_padding(key_padding_mask: torch.Tensor, *, n: int, n_heads: int, L_q: int,
                     L_k: int, dtype: torch.dtype,
                     device: torch.device | None = None) -> torch.Tensor:
    """A ``(n, 1, 1, σ)`` boolean mask (True = may attend) from a key padding mask
    ``(n, σ)``, which is bool with True = padding, as in ``nn.MultiheadAttention``."""
    kpm = key_padding_mask
    if not isinstance(kpm, torch.Tensor) or kpm.shape != (n, L_k):
        shape = tuple(kpm.shape) if isinstance(kpm, torch.Tensor) else type(kpm).__name__
        raise EinattnError(f"key_padding_mask has shape {shape} but must be (n, σ) = ({n}, {L_k})")
    check_key_padding(kpm)
    return as_nmts(~kpm[:, None, None, :], name="key_padding_mask", n=n, n_heads=n_heads,
                   L_q=L_q, L_k=L_k, dtype=dtype, device=device)


def check_key_padding(kpm: torch.Tensor) -> None:
    """A key padding mask is bool, True = padding; anything else is refused in its words."""
    if kpm.dtype == torch.bool:
        return
    raise EinattnError(
        f"key_padding_mask must be bool with True = padding (a key no query attends to), "
        f"got {kpm.dtype}; from a mask where 1 = real token and 0 = padding (Hugging Face's "
        f"attention_mask) pass key_padding_mask=(attention_mask == 0); for an additive bias "
        f"on the scores pass it as mask=")


def combine(*masks: torch.Tensor | None) -> torch.Tensor | None:
    """One mask from several: boolean masks are and-ed; a float mask keeps its values
    where every boolean mask allows and gets ``-inf`` elsewhere."""
    present = [m for m in masks if m is not None]
    allowed = [m for m in present if m.dtype == torch.bool]
    additive = [m for m in present if m.dtype != torch.bool]
    bool_mask = None
    for m in allowed:
        bool_mask = m if bool_mask is None else bool_mask & m
    if not additive:
        return bool_mask
    float_mask = additive[0]
    for m in additive[1:]:
        float_mask = float_mask + m
    if bool_mask is None:
        return float_mask
    return torch.where(bool_mask, float_mask, float("-inf"))  # broadcast both ways


def attention_mask(*, n: int, n_heads: int, L_q: int, L_k: int, dtype: torch.dtype,
                   device: torch.device, mask: torch.Tensor | None = None,
                   key_padding_mask: torch.Tensor | None = None,
                   causal: bool = False) -> torch.Tensor | None:
    """The mask ``M[n μ τ σ]`` of equation (3), from a user mask (checked and broadcast),
    a key padding mask ``(n, σ)`` (bool, True = padding, ignored) and, with
    ``causal=True``, the bottom-right causal mask."""
    shape = {"n": n, "n_heads": n_heads, "L_q": L_q, "L_k": L_k, "dtype": dtype,
             "device": device}
    user = None if mask is None else as_nmts(mask, name="mask", **shape)
    padding = None
    if key_padding_mask is not None:
        padding = from_key_padding(key_padding_mask, **shape)
    future = causal_mask(L_q, L_k, device=device) if causal else None
    return combine(user, padding, future)
