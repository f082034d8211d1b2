"""Equations (2)–(4) over tiles of queries × keys with O(L) memory: FlashAttention's
forward and recomputing backward, the kernels of :mod:`einattn.impls.chunked` and of the
ring's blocks (:mod:`einattn.ring`).

Queries are cut into blocks ``τ ∈ t`` and keys into blocks ``σ ∈ b``, both of
``block_size``. For each tile ``(t, b)``, in order, with ``μ = (g r)``::

    S[n (g r) τ σ]     = Q_t[n (g r) τ a] K_b[n g σ a] / √a     (then cap(S) + B + M)
    m_new[n μ τ]       = max(m[n μ τ], max_σ(S[n μ τ σ]))                         RUNNING_MAX
    P[n μ τ σ]         = exp(S[n μ τ σ] − m_new[n μ τ])                                WEIGHTS
    c[n μ τ]           = exp(m[n μ τ] − m_new[n μ τ])                                  RESCALE
    l_new[n μ τ]       = c[n μ τ] · l[n μ τ] + sum_σ(P[n μ τ σ])                   RUNNING_SUM
    O_new[n (g r) τ a] = c[n (g r) τ] · O[n (g r) τ a] + P[n (g r) τ σ] V_b[n g σ a]

the last RUNNING_VALUES, and at the end ``Z = O / l`` and ``lse = m + log l``, the log of
the softmax denominator. Each line is an :class:`~einattn.notation.Equation` that the tile
loop runs, but for WEIGHTS, which runs in the storage of the tile's S, as ``S.sub_(m_new)
.exp_()`` (a fresh tile-sized tensor on every tile cost 20% of the forward; checked equal
in tests/test_chunked.py).
The pattern of equation (3) (:mod:`einattn.patterns`) is evaluated per tile from the
indices: a tile it leaves empty is never visited, one it leaves fully visible gets no mask
work, and a sink ``s_μ`` starts each row at ``m = s_μ``, ``l = 1`` (one more key whose
value is zero).
Ordinary multi-head attention is ``g = μ``, ``r = 1``; with grouped-query attention each
key/value group serves its ``r`` query heads where it lies, never repeated. The backward
pass recomputes each tile's ``P = exp(S − lse)`` and, with ``D[n μ τ] = Σ_a dZ Z``, uses
``dS = P ∘ (dP − D)``. Besides ``O(L·a)`` tensors such as ``Z`` and the gradients, the
largest temporary is one tile of at most ``SPAN · block_size²`` numbers per head
(neighbouring tiles of a row of queries run as one product): nothing of ``L_q × L_k``
elements, nor of ``L_q × block_size``. See docs/chunked.md.

With dropout (a :class:`~einattn._tile_dropout.TileDropout`) each tile's ``P`` is multiplied
by a mask ``R`` drawn per tile from a seed, after RUNNING_SUM, and the backward draws the same
``R`` again.

A query row with no admissible key keeps ``m = −∞`` and ``l = 0``: its ``Z`` is exact
zeros and its ``lse`` is ``−∞`` (an empty sum), which the backward pass reads as ``+∞``
(:func:`for_backward`), so that it recomputes ``P = 0`` there. No finite sentinel stands in
for ``−∞``. Every tile runs in at least float32 (:func:`accumulator`): float16 and bfloat16
inputs are widened once, so that ``S − lse`` and ``dP − D`` are formed in the precision the
statistics were.
"""

from __future__ import annotations

import torch
import torch.nn.functional as _F

from .._tile_dropout import TileDropout
from ..equations import attention_scores, weighted_values
from ..notation import Equation

# Forward, per tile: equations.attention_scores, S = Q_t K_b / √a, equation (2g) itself
# ((2) where g = μ); then the online softmax, equation (3) over the keys seen so far, with
# (4g) inside its last line (m_new with −∞ read as 0 where no key is seen yet):
RUNNING_MAX = Equation("m_new[n μ τ] = max(m[n μ τ], max_σ(S[n μ τ σ]))")
WEIGHTS = Equation("P[n μ τ σ] = exp(S[n μ τ σ] − m_new[n μ τ])")
RESCALE = Equation("c[n μ τ] = exp(m[n μ τ] − m_new[n μ τ])")
RUNNING_SUM = Equation("l_new[n μ τ] = c[n μ τ] · l[n μ τ] + sum_σ(P[n μ τ σ])")
RUNNING_VALUES = Equation("O_new[n (g r) τ a] = c[n (g r) τ] · O[n (g r) τ a] "
                          "+ P[n (g r) τ σ] V_b[n g σ a]")
# Backward, per tile:
VALUE_GRADS = Equation("dV_b[n g σ a] = P[n (g r) τ σ] dZ_t[n (g r) τ a]")
PROB_GRADS = Equation("dP[n (g r) τ σ] = dZ_t[n (g r) τ a] V_b[n g σ a]")
QUERY_GRADS = Equation("dQ_t[n (g r) τ a] = dS[n (g r) τ σ] K_b[n g σ a] / √a")
KEY_GRADS = Equation("dK_b[n g σ a] = dS[n (g r) τ σ] Q_t[n (g r) τ a] / √a")

_INF = float("inf")


def accumulator(dtype: torch.dtype) -> torch.dtype:
    """Running statistics in at least float32, whatever the inputs' precision."""
    return torch.promote_types(dtype, torch.float32)


def _tile_logits(Q, K, mask, pattern, at, tile, acc) -> tuple[torch.Tensor, torch.Tensor]:
    """One tile's ``S[n μ τ σ]`` and its logits ``cap(S) + B + M`` (−∞ where masked)."""
    t0, t1, s0, s1, partial = tile
    tau, sigma = slice(t0, t1), slice(s0, s1)
    S = attention_scores(Q[:, :, tau], K[:, :, sigma]).to(acc)  # a new tensor:
    here = None if at is None else at.tile(tau, sigma)
    logits = pattern.scored(S, here) if pattern.scores else S  # masked in place below
    if mask is not None:
        M = _mask_tile(mask, tau, sigma)
        if M.dtype == torch.bool:
            logits.masked_fill_(~M, -_INF)
        else:
            logits += M
    if partial:  # a tile the pattern leaves wholly visible needs no mask; else its pieces
        logits.masked_fill_(~pattern.allowed(here, partial), -_INF)  # that do not
    return S, logits


SPAN = 4  # the widest tile, in key blocks: neighbours in a row of tiles run as one


def _spans(tiles, block_size: int) -> list:
    """The pattern's tiles with neighbours merged, up to the area of ``SPAN`` tiles (a row of
    ``SPAN`` key blocks; for one decoding query, ``SPAN · block_size`` blocks): fewer, wider
    products (a window's band of keys in one), the same keys visited. Neighbours
    merge where they start at the same query (a causal tile starts at its first row that
    sees one of its keys), so no query meets a key it does not see in the same tile."""
    merged, area = [], SPAN * block_size * block_size  # a few queries: a longer row of keys
    for t0, t1, s0, s1, partial in tiles:
        if merged:
            m0, m1, n0, n1, m_partial = merged[-1]
            if (m0, m1, n1) == (t0, t1, s0) and (t1 - t0) * (s1 - n0) <= area:
                merged[-1] = (t0, t1, n0, s1, m_partial | partial)
                continue
        merged.append((t0, t1, s0, s1, partial))
    return merged


def tiles(pattern, block_size: int) -> list:
    """The tiles ``(τ0, τ1, σ0, σ1, partial)`` the forward and the backward visit."""
    return _spans(pattern.tiles(block_size, cut=True, which=True), block_size)


def _mask_tile(mask: torch.Tensor, tau: slice, sigma: slice) -> torch.Tensor:
    """The rows ``tau`` and keys ``sigma`` of a mask; axes of size 1 stay."""
    rows = mask if mask.shape[2] == 1 else mask[:, :, tau]
    return rows if rows.shape[3] == 1 else rows[:, :, :, sigma]


def forward(Q, K, V, mask, pattern, block_size: int, drop: TileDropout | None = None):
    """``(Z, lse)``: over the split keys for a few queries whose keys fit one wide tile
    (a decoding step), over the tiles otherwise (always with dropout: the backward's)."""
    L_q = Q.shape[2]
    if 0 < L_q <= SPLIT_QUERIES and drop is None:
        reach = pattern.reach()
        if L_q * (reach[1] - reach[0]) <= SPAN * block_size * block_size:
            return _split_forward(Q, K, V, mask, pattern, block_size, reach)
    return _tiled_forward(Q, K, V, mask, pattern, block_size, drop)


def _tiled_forward(Q, K, V, mask, pattern, block_size: int, drop: TileDropout | None):
    n, n_heads, L_q, _ = Q.shape
    acc = accumulator(Q.dtype)
    out_dtype, (Q, K, V) = Q.dtype, (t.to(acc) for t in (Q, K, V))  # tiles in ≥ float32
    m = Q.new_full((n, n_heads, L_q), -_INF, dtype=acc)  # running max m[n μ τ]
    l = Q.new_zeros((n, n_heads, L_q), dtype=acc)  # noqa: E741 running sum l[n μ τ]
    if pattern.sinks is not None:  # the sink: one more logit s_μ, whose value is zero
        m.copy_(pattern.sinks[:, None])
        l.copy_((pattern.sinks != -_INF)[:, None])  # exp(s_μ − m) = 1, or 0 for s_μ = −∞
    O = Q.new_zeros((n, n_heads, L_q, V.shape[3]), dtype=acc)  # noqa: E741 unnormalised Z
    at = pattern.grid()
    for tile in tiles(pattern, block_size):
        tau, sigma = slice(tile[0], tile[1]), slice(tile[2], tile[3])
        _, S = _tile_logits(Q, K, mask, pattern, at, tile, acc)
        m_old = m[:, :, tau]
        m_new = RUNNING_MAX(m=m_old, S=S)
        m_safe = m_new.masked_fill(m_new == -_INF, 0.0)  # no key yet: exp(−∞ − 0) = 0
        P = S.sub_(m_safe[..., None]).exp_()  # WEIGHTS, in S's memory (a tile, not two)
        c = RESCALE(m=m_old, m_new=m_safe)
        l[:, :, tau] = RUNNING_SUM(c=c, l=l[:, :, tau], P=P)
        if drop is not None:  # after the sum: the denominator is not dropped
            P.mul_(drop.weights(tile, P.shape, P.device, acc))
        O[:, :, tau] = RUNNING_VALUES(c=c, O=O[:, :, tau], P=P, V_b=V[:, :, sigma])
        m[:, :, tau] = m_new
    dead = l == 0  # no admissible key (or L_k = 0), no sink: Z = 0, lse = m + log 0 = −∞
    Z = O.div_(l.masked_fill(dead, 1.0)[..., None]).to(out_dtype)  # in O's memory
    return Z, m + torch.log(l)


# -- a few queries: split keys (flash-decoding) ----------------------------------------------
#
# A decoding step has one query (a few, speculating) and many keys. The keys [σ0, σ1) its
# pattern leaves are cut into blocks b of block_size, each block's log-sum-exp is taken as a
# tile's statistics are, for every block at once, and the blocks are merged by their
# log-sum-exp; no Python loop runs over the keys. The blocks' partial outputs are not formed
# one by one: Σ_b exp(lse_b − lse) Z_b = exp(S − lse) V is one product over every block's
# values, equation (4g), where a batched product per block would copy K and V out of a
# cache's storage (its batch axes n, g, b share no one stride): 8 MiB a step at context
# 4096. On a CPU each torch call costs ~5 µs here, so the path is few calls: the two
# log-sum-exps are one call each, which also take each block's max.
SPLIT_QUERIES = 8  # at most this many queries take the split keys


def _split_forward(Q, K, V, mask, pattern, block_size: int, reach):
    """``(Z, lse)`` over the keys of ``reach``, ``σ = (b σ')`` cut into blocks ``b``::

        S[n (g r) τ σ] = Q[n (g r) τ a] K[n g σ a] / √a    (then cap(S) + B + M)
        lse_b[n μ τ b] = log Σ_σ' exp S[n μ τ (b σ')]      (each block, as a tile from m = −∞)
        lse[n μ τ]     = log Σ_b exp lse_b[n μ τ b]        (a sink: one more lse_b = s_μ)
        Z[n (g r) τ a] = A[n (g r) τ σ] V[n g σ a],        A = exp(S − lse)

    A row with no admissible key has ``lse = −∞`` and ``Z = 0``."""
    (n, n_heads, L_q, _), (s0, s1, partial) = Q.shape, reach
    acc = accumulator(Q.dtype)
    out_dtype, (Q, K, V) = Q.dtype, (t.to(acc) for t in (Q, K, V))
    lse_b = [] if pattern.sinks is None else \
        [pattern.sinks.to(acc)[:, None, None].expand(n, n_heads, L_q, 1)]
    if s1 <= s0:  # no admissible key: Z = 0, lse = −∞ (or the sink's s_μ)
        lse = lse_b[0][..., 0] if lse_b else Q.new_full((n, n_heads, L_q), -_INF)
        return Q.new_zeros((n, n_heads, L_q, V.shape[3]), dtype=out_dtype), lse
    _, S = _tile_logits(Q, K, mask, pattern, pattern.grid(), (0, L_q, s0, s1, partial),
                        acc)
    short = -(s1 - s0) % block_size  # the last block, filled up with −∞ (no key)
    blocks = _F.pad(S, (0, short), value=-_INF) if short else S
    lse_b.insert(0, torch.logsumexp(torch.unflatten(blocks, -1, (-1, block_size)), dim=-1))
    lse = torch.logsumexp(torch.cat(lse_b, dim=3) if len(lse_b) > 1 else lse_b[0], dim=-1)
    dead = mask is not None or partial or pattern.scores_mask  # else lse is finite
    A = S.sub_((for_backward(lse) if dead else lse)[..., None]).exp_()  # 0 in a dead row
    return weighted_values(A, V[:, :, s0:s1]).to(out_dtype), lse


def for_backward(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` as the backward pass reads it: ``+∞`` where a row saw no key (``−∞``), so
    that ``P = exp(S − lse)`` recomputes as 0 there."""
    return lse.masked_fill(lse == -_INF, _INF)


def backward(Q, K, V, Z, lse, mask, dZ, pattern, block_size: int, *, mask_grad: bool,
             drop: TileDropout | None = None):
    """``(dQ, dK, dV, dM, ds, dT)`` over the tiles, each recomputing ``P = exp(S − lse)``
    from the forward's ``lse`` as :func:`for_backward` reads it (dM where ``mask_grad``, ds
    where the pattern has sinks, dT: the gradients of the pattern's ``tensors``)."""
    g = K.shape[1]
    acc, dtypes = accumulator(Q.dtype), (Q.dtype, K.dtype, V.dtype)
    Q, K, V, Z, dZ = (t.to(acc) for t in (Q, K, V, Z, dZ))  # every tile in ≥ float32
    D = (dZ * Z).sum(dim=-1)  # D[n μ τ] = Σ_a dZ Z = Σ_σ P dP
    dQ, dK, dV = (torch.zeros(t.shape, dtype=acc, device=t.device) for t in (Q, K, V))
    dM = torch.zeros(mask.shape, dtype=mask.dtype, device=mask.device) if mask_grad else None
    dT = [torch.zeros_like(t) for t in pattern.tensors]
    at = pattern.grid()
    for tile in tiles(pattern, block_size):
        tau, sigma = slice(tile[0], tile[1]), slice(tile[2], tile[3])
        S, logits = _tile_logits(Q, K, mask, pattern, at, tile, acc)
        P = logits.sub_(lse[:, :, tau, None]).exp_()  # the forward's weights A, for this tile
        Q_t, dZ_t, K_b, V_b = Q[:, :, tau], dZ[:, :, tau], K[:, :, sigma], V[:, :, sigma]
        R = None if drop is None else drop.weights(tile, P.shape, P.device, acc)
        dV[:, :, sigma] += VALUE_GRADS(P=P if R is None else P * R, dZ_t=dZ_t, g=g)
        dP = PROB_GRADS(dZ_t=dZ_t, V_b=V_b)
        dP = dP if R is None else dP.mul_(R)  # through the dropout: dA = R ∘ (dZ V)
        dS = dP.sub_(D[:, :, tau, None]).mul_(P)  # dS = P ∘ (dP − D), in dP's memory
        if dM is not None:  # M is added to the logits, so dM = dS, summed where it broadcasts
            target = _mask_tile(dM, tau, sigma)
            axes = _broadcast_axes(target.shape, dS.shape)
            target += (dS.sum(dim=axes, keepdim=True) if axes else dS).to(dM.dtype)
        if pattern.scores:  # through cap(S) + B back to S (and what a ScoreMod captures)
            dS, tensor_grads = pattern.score_grad(S, dS, at.tile(tau, sigma))
            for total, part in zip(dT, tensor_grads, strict=True):
                total += part
        dQ[:, :, tau] += QUERY_GRADS(dS=dS, K_b=K_b)
        dK[:, :, sigma] += KEY_GRADS(dS=dS, Q_t=Q_t, g=g)
    grads = [d.to(dtype) for d, dtype in zip((dQ, dK, dV), dtypes, strict=True)]
    return (*grads, dM, sink_grad(pattern.sinks, lse, D), dT)


def sink_grad(sinks, lse, D):
    """``∂L/∂s_μ = −Σ_{n τ} A_sink[n μ τ] D[n μ τ]``, with ``A_sink = exp(s_μ − lse)`` the
    weight the sink took (its value is zero, so only the denominator it joins moves Z)."""
    if sinks is None:
        return None
    A_sink = torch.exp(sinks.to(lse.dtype)[:, None] - lse)
    return -(A_sink * D).sum(dim=(0, 2)).to(sinks.dtype)


def _broadcast_axes(mask_shape, tile_shape) -> list[int]:
    """The axes along which a mask of ``mask_shape`` broadcasts to ``tile_shape``."""
    return [k for k in range(4) if mask_shape[k] == 1 and tile_shape[k] != 1]
