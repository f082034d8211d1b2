"""``impl="sdpa"``: equations (2)–(4) by ``F.scaled_dot_product_attention`` (fused kernels:
flash, memory efficient, or math), the pattern's mask and its additive terms (ALiBi's ``B``)
folded into SDPA's mask; causal alone over as many queries as keys is its ``is_causal``. A
pattern SDPA cannot take (a cap, a sink, a score of one's own) runs the einsum path's
equations instead (:func:`einattn.impls.routed`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import _softmax, masks
from ..errors import EinattnError


def run(Q, K, V, M, pattern, spec, seen: bool) -> dict[str, torch.Tensor]:
    """The impls' entry point: ``{"Z": Z}``."""
    return {"Z": _sdpa(Q, K, V, M, pattern, spec.dropout)}


def _sdpa(Q, K, V, mask, pattern, dropout: float) -> torch.Tensor:
    (_, μ, L_q, _), (_, g, L_k, _) = Q.shape, K.shape
    # top-left = bottom-right; an `if`, not bool(): under dynamic shapes L_q == L_k is a
    # SymBool that SDPA refuses, and a branch makes dynamo guard on it instead
    is_causal = True if pattern.causal_only and mask is None and L_q == L_k else False
    if (pattern.masks or pattern.scores) and not is_causal:  # folded into SDPA's mask
        at = pattern.grid()
        bias = pattern.bias(at)  # in ≥ float32; SDPA takes a float mask in Q's dtype
        mask = masks.combine(mask, pattern.allowed(at), None if bias is None
                             else bias.to(Q.dtype))
    if _softmax.transformed():  # the fused kernels have no vmap or forward-AD rule
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(Q, K, V, mask, dropout, is_causal,
                                                  enable_gqa=g != μ)
    # attn_mask, dropout_p, is_causal by position: torch's parser takes them 0.6 µs faster
    Z = F.scaled_dot_product_attention(Q, K, V, mask, dropout, is_causal, enable_gqa=g != μ)
    if torch.is_grad_enabled() and not torch.compiler.is_compiling() and Z.grad_fn is not None:
        # ~12 µs a training step at (2,5,16,4): the engine calls back into Python
        Z.grad_fn.register_prehook(_refuse_double_backward)
    return Z


def _refuse_double_backward(grad_outputs):
    """Run before SDPA's backward: with ``create_graph`` (grad mode on while it runs) the fused
    kernels' backward has no derivative of its own, so say which impls have one."""
    if torch.is_grad_enabled():
        raise EinattnError("impl='sdpa' has no second derivative (PyTorch's fused attention "
                           "kernels have no double backward); for Hessians, gradient "
                           "penalties and other create_graph=True uses take impl='einsum' "
                           "or impl='chunked'")
