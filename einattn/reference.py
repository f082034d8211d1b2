"""The textbook reshape-based form of multi-head attention, kept as an independent check.

Separate projections, heads split by ``view`` and ``transpose``, ``matmul``, softmax, heads
merged by ``transpose`` and ``reshape``, an output linear layer: the form of every seed
tutorial. It shares no code with :mod:`einattn.functional`, so agreement between the two
is evidence, not tautology. The converters to and from ``(W, W_O)`` are re-exported here.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .layouts import W_O_from_linear, W_O_to_linear, fuse_qkv, split_qkv

__all__ = [
    "ReshapeMultiHeadAttention",
    "W_O_from_linear",
    "W_O_to_linear",
    "fuse_qkv",
    "multi_head_attention",
    "split_qkv",
]


def multi_head_attention(x, W_q, W_k, W_v, W_o, *, n_heads, context=None, mask=None,
                         causal=False, b_q=None, b_k=None, b_v=None, b_o=None,
                         return_weights=False):
    """Textbook attention. ``mask`` is boolean (True = may attend) or float (added), of
    shape (L_q, L_k), (n, L_q, L_k) or (n, heads, L_q, L_k). Rows with no allowed key
    give zeros, as in einattn."""
    context = x if context is None else context
    n, L_q, _ = x.shape
    L_k = context.shape[1]
    d_head = W_q.shape[0] // n_heads

    def split(t, L):  # (n, L, heads*width) -> (n, heads, L, width): d_head, or V's own
        return t.view(n, L, n_heads, -1).transpose(1, 2)

    q = split(F.linear(x, W_q, b_q), L_q)
    k = split(F.linear(context, W_k, b_k), L_k)
    v = split(F.linear(context, W_v, b_v), L_k)
    scores = q @ k.transpose(-2, -1) / math.sqrt(d_head)
    allowed = torch.ones(L_q, L_k, dtype=torch.bool, device=x.device)
    if causal:
        allowed = allowed.tril(diagonal=L_k - L_q)
    if mask is not None:
        while mask.dim() < 4:
            mask = mask.unsqueeze(0 if mask.dim() < 3 else 1)
        if mask.dtype == torch.bool:
            allowed = allowed & mask
        else:
            scores = scores + mask
            allowed = allowed & (mask != float("-inf"))
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    weights = torch.where(allowed.any(dim=-1, keepdim=True), weights, torch.zeros_like(weights))
    out = (weights @ v).transpose(1, 2).reshape(n, L_q, -1)
    y = F.linear(out, W_o, b_o)
    return (y, weights) if return_weights else y


class ReshapeMultiHeadAttention(nn.Module):
    """The textbook layer: four ``nn.Linear`` projections and reshape-based heads."""

    def __init__(self, d_model: int, n_heads: int, *, bias: bool = False, device=None, dtype=None):
        super().__init__()
        self.n_heads = n_heads
        kw = {"bias": bias, "device": device, "dtype": dtype}
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (
            nn.Linear(d_model, d_model, **kw) for _ in range(4))

    def forward(self, x, context=None, *, mask=None, causal=False):
        p = (self.q_proj, self.k_proj, self.v_proj, self.out_proj)
        return multi_head_attention(
            x, *(m.weight for m in p), n_heads=self.n_heads, context=context, mask=mask,
            causal=causal, b_q=p[0].bias, b_k=p[1].bias, b_v=p[2].bias, b_o=p[3].bias)
