"""The impls of equations (2)–(4): the same ``Z[n μ τ a]`` from the same Q, K, V and the
same pattern of equation (3) (:mod:`einattn.patterns`).

``"einsum"`` runs the equations as written (:mod:`einattn.functional`); ``"sdpa"`` hands
them to ``F.scaled_dot_product_attention`` (fused kernels: flash, memory efficient, or
math), the pattern's mask folded into its mask; ``"chunked"`` runs :mod:`einattn.chunked`,
exact attention over tiles of queries × keys with O(L) memory that skips the tiles the
pattern leaves empty; ``"flex"`` runs :mod:`einattn.flex`, FlexAttention with the
pattern's mods. Each takes grouped-query keys and values as they are, ``K[n g σ a]`` with
``μ = (g r)``, never repeated per head, and einattn's masks with einattn's meaning: True =
may attend, float = added, causal aligned bottom-right.

:func:`nonfinite` and :func:`masked_nonfinite_dropped` keep a NaN or ±∞ behind a mask out of
the outputs of the queries that may not see it, on every impl (on the CPU, eagerly).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import _softmax, chunked, flex, masks, patterns
from . import functional as _functional  # not `from .functional import`: it imports us
from .errors import EinattnError


def run(Q, K, V, key_padding_mask, mask, pieces: tuple, dropout: float, impl: str,
        block_size: int, seen: bool, q0=None) -> dict[str, torch.Tensor]:
    """Equations (2)–(4) by ``impl``, with the ``pieces`` of (3) bound to this call (its
    queries at positions ``q0 …``, by default the last of the keys'): every stage where they
    are ``seen`` (on the einsum path, which alone has S and A), Z alone elsewhere."""
    (n, n_heads, L_q, _), L_k = Q.shape, K.shape[2]
    pattern = patterns.bind(pieces, n=n, n_heads=n_heads, L_q=L_q, L_k=L_k, dtype=Q.dtype,
                            device=Q.device, q0=q0)
    M = None
    if mask is not None or key_padding_mask is not None:
        M = masks.attention_mask(n=n, n_heads=n_heads, L_q=L_q, L_k=L_k, dtype=Q.dtype,
                                 device=Q.device, mask=mask, key_padding_mask=key_padding_mask)
    impl = "einsum" if seen else _routed(impl, pattern)
    stages = _stages(impl, Q, K, V, M, pattern, dropout, block_size, seen)
    if (M is not None or pattern.masks) and nonfinite(stages["Z"]):
        def again(K, V):
            return _stages(impl, Q, K, V, M, pattern, dropout, block_size, seen)
        stages = masked_nonfinite_dropped(again, Q, K, V, M, pattern, stages)
    return stages


def _routed(impl: str, pattern: patterns.Pattern) -> str:
    """Where ``impl`` runs this pattern: SDPA takes masks and biases (ALiBi) as its mask; a
    softcap or a sink runs the einsum path's equations. Under ``torch.compile`` the einsum
    path runs as SDPA, which Inductor fuses, where SDPA can take the pattern."""
    if impl == "sdpa" and not pattern.additive:
        return "einsum"
    if impl == "einsum" and pattern.additive and torch.compiler.is_compiling():
        return "sdpa"
    return impl


def _stages(impl: str, Q, K, V, M, pattern, dropout: float, block_size: int,
            seen: bool) -> dict[str, torch.Tensor]:
    if impl == "einsum":
        return _functional._einsum_stages(Q, K, V, M, pattern, dropout, scratch=not seen)
    if impl == "sdpa":
        return {"Z": _sdpa(Q, K, V, M, pattern, dropout)}
    if dropout and impl == "flex":
        raise EinattnError(f"impl='flex' has no dropout (got dropout={dropout}); use "
                           f"impl='chunked' (the same tiles, with dropout), 'einsum' or 'sdpa' "
                           f"while training with dropout")
    refusal = pattern.refusal(impl)
    if refusal:
        raise EinattnError(refusal)
    if impl == "chunked":  # checked already: not a second time
        return {"Z": chunked.attend(Q, K, V, M, pattern, block_size, dropout)}
    return {"Z": flex.attention(Q, K, V, M, pattern)}


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


def nonfinite(Z: torch.Tensor) -> bool:
    """Whether ``Z`` holds NaN or ±∞, checked where that costs no device sync and can
    branch: on the CPU, eagerly, outside the ``torch.func`` transforms."""
    if Z.device.type != "cpu" or torch.compiler.is_compiling() or _softmax.transformed():
        return False
    return not math.isfinite(Z.sum().item())


def masked_nonfinite_dropped(run, Q, K, V, M, pattern, stages: dict) -> dict:
    """The stages again with every key whose K or V is not finite set to zero, then NaN in
    the rows that may attend to one of those keys: a NaN or ±∞ behind the mask of a query
    (padding, the causal future, a bool mask) reaches no output of that query, where
    ``0 · NaN`` in equation (4) would have spread it."""
    bad = ~(torch.isfinite(K).all(-1) & torch.isfinite(V).all(-1))  # bad[n g σ]
    if not bad.any():
        return stages  # Q or an admissible input was not finite: it propagates
    stages = run(*(T.masked_fill(bad[..., None], 0.0) for T in (K, V)))
    n, n_heads, L_q, L_k = Q.shape[0], Q.shape[1], Q.shape[2], K.shape[2]
    allowed = torch.ones(L_q, L_k, dtype=torch.bool, device=Q.device)
    if pattern.masks:
        allowed = allowed & pattern.allowed(pattern.grid())
    if M is not None:
        allowed = allowed & (M if M.dtype == torch.bool else M != float("-inf"))
    bad = bad.repeat_interleave(n_heads // K.shape[1], dim=1)[:, :, None, :]  # [n μ 1 σ]
    poisoned = (allowed & bad).any(-1, keepdim=True).expand(n, n_heads, L_q, 1)
    return {k: v.masked_fill(poisoned, float("nan")) if k in ("A", "Z") else v
            for k, v in stages.items()}
