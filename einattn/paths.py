"""Fast paths for equations (2)–(4): the same ``Z[n μ τ a]`` from the same Q, K, V.

``"sdpa"`` hands them to ``F.scaled_dot_product_attention`` (fused kernels: flash, memory
efficient, or math); ``"chunked"`` runs :mod:`einattn.chunked`, exact attention over tiles
of queries × keys with O(L) memory. Both take grouped-query keys and values as they are,
``K[n g σ a]`` with ``μ = (g r)``, never repeated per head; both see einattn's masks with
einattn's meaning: True = may attend, float = added, causal aligned bottom-right.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import _softmax, chunked, masks
from .errors import EinattnError


def weighted_values(impl: str, Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor,
                    mask: torch.Tensor | None, causal: bool, dropout: float,
                    block_size: int) -> torch.Tensor:
    """``Z[n μ τ a]`` by ``impl`` ("sdpa" or "chunked")."""
    if impl == "sdpa":
        return _sdpa(Q, K, V, mask, causal, dropout)
    if dropout:
        raise EinattnError(f"impl='chunked' has no dropout (got dropout={dropout}); use "
                           f"impl='einsum' or 'sdpa' while training with dropout")
    return chunked.attention(Q, K, V, mask=mask, causal=causal, block_size=block_size)


def _sdpa(Q, K, V, mask, causal: bool, dropout: float) -> torch.Tensor:
    (_, μ, L_q, _), (_, g, L_k, _) = Q.shape, K.shape
    # top-left = bottom-right; an `if`, not bool(): under dynamic shapes L_q == L_k is a
    # SymBool that SDPA refuses, and a branch makes dynamo guard on it instead
    is_causal = True if causal and mask is None and L_q == L_k else False
    if causal and not is_causal:
        mask = masks.combine(mask, masks.causal_mask(L_q, L_k, device=Q.device))
    if _softmax.transformed(Q, K, V):  # the fused kernels have no vmap or forward-AD rule
        with sdpa_kernel(SDPBackend.MATH):
            return _call_sdpa(Q, K, V, mask, dropout, is_causal, g != μ)
    Z = _call_sdpa(Q, K, V, mask, dropout, is_causal, g != μ)
    if not torch.compiler.is_compiling() and Z.grad_fn is not None:
        Z.grad_fn.register_prehook(_refuse_double_backward)  # ~3 µs a training call
    return Z


def _refuse_double_backward(grad_outputs):
    """Run before SDPA's backward: with ``create_graph`` (grad mode on while it runs) the fused
    kernels' backward has no derivative of its own, so say which impls have one."""
    if torch.is_grad_enabled():
        raise EinattnError("impl='sdpa' has no second derivative (PyTorch's fused attention "
                           "kernels have no double backward); for Hessians, gradient "
                           "penalties and other create_graph=True uses take impl='einsum' "
                           "or impl='chunked'")


def _call_sdpa(Q, K, V, mask, dropout: float, is_causal: bool, grouped: bool) -> torch.Tensor:
    # attn_mask, dropout_p, is_causal by position: torch's parser takes them 0.6 µs faster
    return F.scaled_dot_product_attention(Q, K, V, mask, dropout, is_causal, enable_gqa=grouped)
