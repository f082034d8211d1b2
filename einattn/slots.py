"""One more key and value for every query (``nn.MultiheadAttention``'s ``add_bias_kv``): a
learned key ``k_b`` and value ``v_b`` of each key/value group, appended after the keys, in
the projected space (no projection of their own), visible to every query whatever the
mask, the padding and the pattern of equation (3)::

    (S1) S_b[n (g r) τ]     = Q[n (g r) τ a] k_b[g a] / √a          (× the scale s / (1/√a))
    (S2) A[n μ τ (σ | ∗)]   = softmax over the keys and the slot ∗ of (S[n μ τ σ] + M | S_b)
    (S3) Z[n (g r) τ b]     = A[n (g r) τ σ] V[n g σ b] + A[n (g r) τ ∗] v_b[g b]

It runs as equations (2)–(4) over ``L_k + 1`` keys, the mask and the mask pieces of the
pattern (causal, a window, documents, …) made one boolean mask over the ``L_k`` keys and
the slot's column allowed: every impl takes that. ``add_zero_attn``, a key and a value of
zeros, is not a slot: its logit is 0 for every query, a sink ``s_μ = 0`` (``zero_attn``).
"""

from __future__ import annotations

import torch

from . import masks, patterns
from .errors import EinattnError


def appended(K: torch.Tensor, V: torch.Tensor, k_b: torch.Tensor, v_b: torch.Tensor):
    """``K[n g (σ ∗) a]`` and ``V[n g (σ ∗) b]``: the slot after the ``L_k`` keys."""
    n, g = K.shape[:2]
    return tuple(torch.cat([T, t.view(1, g, 1, -1).expand(n, g, 1, T.shape[3]).to(T.dtype)],
                           dim=2) for T, t in ((K, k_b), (V, v_b)))


def with_slot(attend, Q, K, V, spec, mask, key_padding_mask, pieces: tuple, seen: bool, q0,
              k_b: torch.Tensor, v_b: torch.Tensor) -> dict:
    """Equations (2)–(4) with the slot (S1)–(S3), by ``attend`` (the composition's)."""
    if any(piece.KIND == "score" for piece in pieces):
        raise EinattnError("add_bias_kv's key is seen by every query, but a term of the "
                           "scores (softcap, ALiBi, a ScoreMod) would be read at its position: "
                           "drop one of them")
    (n, n_heads, L_q, _), L_k = Q.shape, K.shape[2]
    held = [piece for piece in pieces if piece.KIND == "mask"]
    M = masks.attention_mask(n=n, n_heads=n_heads, L_q=L_q, L_k=L_k, dtype=Q.dtype,
                             device=Q.device, mask=mask, key_padding_mask=key_padding_mask)
    if held:
        pattern = patterns.bind(held, n=n, n_heads=n_heads, L_q=L_q, L_k=L_k, dtype=Q.dtype,
                                device=Q.device, q0=q0)
        M = masks.combine(M, pattern.allowed(pattern.grid()))
    M = _slot_allowed(M, n, n_heads, L_q, L_k, Q)
    K, V = appended(K, V, k_b, v_b)
    rest = tuple(piece for piece in pieces if piece.KIND == "sink")
    return attend(Q, K, V, spec, M, None, rest, seen)


def _slot_allowed(M, n: int, n_heads: int, L_q: int, L_k: int, Q) -> torch.Tensor | None:
    """``M`` over ``L_k + 1`` keys, the last (the slot) allowed for every query."""
    if M is None:
        return None
    M = M[(None,) * (4 - M.ndim)].expand(n, n_heads, L_q, L_k)
    ok = torch.ones(n, n_heads, L_q, 1, dtype=torch.bool, device=Q.device) \
        if M.dtype == torch.bool else M.new_zeros(n, n_heads, L_q, 1)
    return torch.cat([M, ok], dim=-1)
