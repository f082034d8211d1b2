"""The two forms of ring attention's steps, and the wrong forms of their mutations;
:func:`einattn.derivation.steps` registers them. Ring attention (:mod:`einattn.ring`) merges
partial results over disjoint sets of keys by their log-sum-exp::

    lse = log(exp(lse₁) + exp(lse₂))                                  (M1)
    Z   = exp(lse₁ − lse) Z₁ + exp(lse₂ − lse) Z₂                      (M2)

One form runs einattn's pieces (the chunked path's partial results, :func:`einattn.ring.merge`,
the layouts' chunks and their causal pairs) in one process; the other is the textbook
``softmax(Q Kᵀ / √a + M) V`` over all keys.
"""

from __future__ import annotations

import math

import torch

from . import chunked, patterns, ring

QKV = {"Q": "n μ τ a", "K": "n μ σ a", "V": "n μ σ a"}
BLOCK = 2  # the tiles inside each pair: several per chunk


def ring_sizes(s: dict[str, int]) -> dict[str, int]:
    """Self-attention over 8 positions (2 ranks × 2 zigzag chunks of 2), else ``s``."""
    return {**s, "τ": 8, "σ": 8}


def _softmax_attention(Q, K, V, causal: bool):
    """``softmax_σ(Q Kᵀ / √a + M) V``, with ``M`` the causal mask where asked."""
    S = Q @ K.mT / math.sqrt(Q.shape[-1])
    if causal:
        S = S.masked_fill(torch.ones(S.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    return torch.softmax(S, dim=-1) @ V


def textbook(Q, K, V):
    """``softmax_σ(Q Kᵀ / √a) V`` over all keys."""
    return _softmax_attention(Q, K, V, causal=False)


def causal_textbook(Q, K, V):
    """``softmax_σ(Q Kᵀ / √a + M) V`` with the causal mask ``M``."""
    return _softmax_attention(Q, K, V, causal=True)


def _partial(Q, K, V, keys: slice, pattern=None):
    """``(Z, lse)`` of the queries over the keys ``keys`` alone (no pattern: every one)."""
    K, V = K[:, :, keys], V[:, :, keys]
    pattern = pattern or patterns.build(n=Q.shape[0], n_heads=Q.shape[1], L_q=Q.shape[2],
                                        L_k=K.shape[2], dtype=Q.dtype, device=Q.device)
    return chunked.forward(Q, K, V, None, pattern, BLOCK)


def merged_halves(Q, K, V):
    """Two halves of the keys, each attended alone, merged by (M1)–(M2)."""
    return _halves(Q, K, V, ring.merge)


def _halves(Q, K, V, combine):
    h = K.shape[2] // 2
    return combine(*_partial(Q, K, V, slice(0, h)), *_partial(Q, K, V, slice(h, None)))[0]


def averaged(Z, lse, Z_b, lse_b):
    """Wrong: the halves' outputs averaged, as if each set held half the weight."""
    return (Z + Z_b) / 2, lse


def by_max(Z, lse, Z_b, lse_b):
    """Wrong: each half weighted by whether its lse is the larger, as a max would."""
    first = (lse >= lse_b)[..., None]
    return torch.where(first, Z, Z_b), torch.maximum(lse, lse_b)


def on_the_ring(Q, K, V, *, world: int = 2, layout: str = "zigzag", order=None):
    """Causal attention as the ranks of a ring compute it: each rank's chunks of queries
    against every rank's chunks of keys, pair by pair as :func:`einattn.ring.pairs` orders
    them (``order``: the chunks' global order), merged by (M1)–(M2), then put back in
    sequence order."""
    c = Q.shape[2] // ring.n_chunks(world, layout)
    Z, lse = torch.zeros_like(Q), torch.full(Q.shape[:3], -math.inf, dtype=Q.dtype)
    causal = patterns.build(n=Q.shape[0], n_heads=Q.shape[1], L_q=Q.shape[2], L_k=K.shape[2],
                            dtype=Q.dtype, device=Q.device, causal=True)
    for rank in range(world):
        mine = ring.chunks(rank, world, layout)
        for other in range(world):
            theirs = ring.chunks(other, world, layout)
            for q, k, pattern in ring.pairs(*(order or _global)(mine, theirs), c, causal):
                rows, cols = (slice(j * c, (j + 1) * c) for j in (mine[q], theirs[k]))
                Z[:, :, rows], lse[:, :, rows] = ring.merge(
                    Z[:, :, rows], lse[:, :, rows], *_partial(Q[:, :, rows], K, V, cols, pattern))
    return Z


def _global(mine, theirs):
    return mine, theirs


def by_rank(mine, theirs):
    """Wrong: the chunks ordered by where they lie on their rank, not in the sequence."""
    return tuple(range(len(mine))), tuple(range(len(theirs)))


def steps(s: dict[str, int]) -> list[tuple]:
    """``(name, lhs, rhs, sizes, inputs)`` of the ring's true steps."""
    r = ring_sizes(s)
    return [
        ("log-sum-exp merge (M1)–(M2) of two halves of the keys = softmax over all",
         merged_halves, textbook, s, QKV),
        ("ring attention, zigzag chunks pair by pair, causal = causal attention",
         on_the_ring, causal_textbook, r, QKV),
    ]


def mutations(s: dict[str, int]) -> list[tuple]:
    """``(name, lhs, rhs, sizes, inputs)`` of plausible wrong steps of the ring."""
    r = ring_sizes(s)
    return [
        ("merge by averaging the halves", lambda Q, K, V: _halves(Q, K, V, averaged),
         textbook, s, QKV),
        ("merge by the larger log-sum-exp", lambda Q, K, V: _halves(Q, K, V, by_max),
         textbook, s, QKV),
        ("zigzag chunks ordered by rank, not by position",
         lambda Q, K, V: on_the_ring(Q, K, V, order=by_rank), causal_textbook, r, QKV),
    ]
