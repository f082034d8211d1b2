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
the softmax denominator. Each line is an :class:`~einattn.notation.Equation`
(tests/test_chunked.py runs them over tiles to the softmax); the tile loop runs the same
lines as in-place torch calls on tiles ``[(n μ) τ σ]`` (:func:`_online_step`), ``1/√a``
in each product's ``alpha``. Where every score is bounded (:func:`_bounded`: ``|S| ≤ max‖q‖
max‖k‖ / √a``, so
that ``exp(S)`` neither overflows nor underflows) the shift ``m`` is 0 throughout and a
tile is ``P = exp(S)``, ``l += Σ_σ P``, ``O += P V_b`` (:func:`_fixed_step`): the max, the
subtraction and the rescaling are not needed (``Z = O / l`` does not depend on the shift).
Why each call is as it is: docs/performance.md, "How the fast paths are fast".
The pattern of equation (3) (:mod:`einattn.patterns`) judges each tile
(:mod:`einattn.impls.tile_plan`): a tile it leaves empty is never visited, one it leaves
fully visible gets no mask work, a partial one its mask (kept per pattern and size), and a
sink ``s_μ`` starts each row at ``m = s_μ``, ``l = 1`` (one more key whose
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

import math

import torch
import torch.nn.functional as _F

from .._tile_dropout import TileDropout
from ..equations import attention_scores, weighted_values
from ..notation import Equation
from .tile_grads import WIDE_ROWS, Grads
from .tile_operands import Operands
from .tile_plan import SPAN, plan, tiles

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

__all__ = ["SPAN", "tiles"]  # the tiles visited, re-exported for the entry and the ring

_INF = float("inf")
_LOG2E = 1.0 / math.log(2.0)
# |x| within which exp(x) is a normal number, with room (float32: 87.3; float64: 708)
_EXP_RANGE = {torch.float32: 80.0, torch.float64: 700.0}


def accumulator(dtype: torch.dtype) -> torch.dtype:
    """Running statistics in at least float32, whatever the inputs' precision."""
    return torch.promote_types(dtype, torch.float32)


def _plan(pattern, block_size: int, op: Operands, finite: bool = False) -> list:
    """The tiles to visit (:func:`einattn.impls.tile_plan.plan`), their kept masks dropped
    where a key is not finite: a bias adds −∞ to a NaN (NaN), where a mask must fill it
    (a NaN behind the mask reaches no query; checked by one sum over K, on a CPU, unless
    known ``finite``: bounded scores, :func:`_bounded`)."""
    tiles = plan(pattern, block_size, op.q.dtype)
    if finite or not any(tile.bias is not None for tile in tiles) or (
            op.k.device.type == "cpu" and math.isfinite(op.k.sum().item())):
        return tiles
    return [tile._replace(bias=None) for tile in tiles]


def _logits(op: Operands, mask, pattern, at, tile):
    """One tile's scores ``S[n μ τ σ] = Q_t K_b / √a`` (in the call's memory ``"S"``) and its logits
    ``cap(S) + B + M`` as ``[(n μ) τ σ]`` (−∞ where masked: S itself where no term)."""
    t0, t1, s0, s1 = tile[:4]
    S = _scores(op, t0, t1, s0, s1)
    S4 = S.view(op.n, op.heads, t1 - t0, s1 - s0)
    logits = _masked(S4, mask, pattern, at, tile)
    return S4, logits.view(S.shape)


def _scores(op: Operands, t0: int, t1: int, s0: int, s1: int) -> torch.Tensor:
    """``S[(n μ) τ σ] = q_t k_bᵀ / √a`` of the tile: equation (2g)."""
    return op.product("S", op.q[:, t0:t1], op.per_head(op.k, s0, s1).transpose(1, 2),
                      op.scale)


def _bounded(op: Operands, pattern, mask, dZ=None, lse=None) -> bool:
    """Whether ``exp(S)`` itself may be summed over every key, shifted by no running max:
    where ``|S| ≤ max‖q‖ · max‖k‖ = B`` (Cauchy–Schwarz) keeps ``e^{±B}`` and ``L_k · e^B ·
    max|V|`` between the dtype's smallest normal number and its largest (a pattern of mask
    pieces alone, no mask tensor, on a CPU, outside ``torch.compile``). The shift cancels
    from ``Z = O / l``; without it a tile skips the max, the subtraction and the rescaling,
    two of its five passes. With ``dZ`` and ``lse`` (the backward's), ``e^{−lse} · 2a_v ·
    max|dZ| · max|V|`` too, for ``dZ e^{−lse}`` (:func:`backward`): ``e^{−lse} ≤ e^B`` where
    a row's keys are all here, not where ``lse`` is the whole row's of a ring's block."""
    if torch.compiler.is_compiling() or mask is not None or op.q.device.type != "cpu" \
            or not pattern.only_masks or not all(x.numel() for x in (op.q, op.k, op.v)):
        return False
    norms = [torch.linalg.vector_norm(x, dim=-1).amax() for x in (op.q, op.k)]
    v = _largest(op.v)
    bound = (norms[0] * norms[1]).item() * op.scale
    size = math.log(op.k.shape[1]) + math.log1p(v.item())
    if dZ is not None:
        size += max(bound, -lse.amin().item()) + math.log1p(
            2 * op.v.shape[2] * (_largest(dZ) * v).item())  # |dP|, |D| ≤ a_v max|dZ| max|V|
    return bound + size <= _EXP_RANGE[op.q.dtype]


def _largest(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` in one pass, with no ``|x|`` made (NaN where x holds one)."""
    low, high = torch.aminmax(x)
    return torch.maximum(-low, high)


def _masked(S, mask, pattern, at, tile):
    """``cap(S) + B + M`` of one tile's ``S[n μ τ σ]``, in its memory where there is no
    score term: ``mask`` sliced to the tile, then the pieces ``tile.which`` (a kept bias
    added, else evaluated on the tile's indices and filled with −∞)."""
    t0, t1, s0, s1, which = tile[:5]
    tau, sigma = slice(t0, t1), slice(s0, s1)
    here = None if at is None else at.tile(tau, sigma)
    logits = pattern.scored(S, here) if pattern.scores else S
    if mask is not None:
        M = _mask_tile(mask, tau, sigma)
        if M.dtype == torch.bool:
            logits.masked_fill_(~M, -_INF)
        else:
            logits += M
    bias = tile[5] if len(tile) > 5 else None
    if bias is not None:
        logits[..., tile[7]:] += bias  # from the tile's first column that a mask hides
    elif which:
        logits.masked_fill_(~pattern.allowed(here, which), -_INF)
    return logits


def _exp(X: torch.Tensor, shift: torch.Tensor, masked) -> torch.Tensor:
    """``exp(X − shift)`` in ``X``'s memory; where ``X`` may hold −∞ (``masked``), as
    ``2^((X − shift) · log₂ e)``: torch's CPU ``exp`` takes a slow path for −∞ and for
    arguments whose exp underflows (a tile a third masked: 5× its time), ``exp2`` does not
    (3 passes for 1: 4 × 256 × 256 scores, 0.5 ms → 0.1 ms)."""
    X.sub_(shift)
    return X.mul_(_LOG2E).exp2_() if masked else X.exp_()


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


def _statistics(op: Operands, sinks, a_v: int, fixed: bool):
    """``m[(n μ) τ 1] = −∞`` (0 where the shift is ``fixed``), ``l = 0``, ``O[(n μ) τ a] = 0``;
    a sink starts every row at ``m = s_μ``, ``l = 1`` (one more logit, whose value is zero;
    ``l = 0`` for −∞)."""
    q = op.q
    m = q.new_full((*q.shape[:2], 1), 0.0 if fixed else -_INF)
    l = q.new_zeros(m.shape)  # noqa: E741
    if sinks is not None:
        s = sinks.to(q.dtype)[None, :, None, None].expand(op.n, -1, 1, 1).flatten(0, 1)
        m.copy_(s)
        l.copy_(s != -_INF)
    return m, l, q.new_zeros((*q.shape[:2], a_v))


def _tiled_forward(Q, K, V, mask, pattern, block_size: int, drop: TileDropout | None):
    acc, out_dtype = accumulator(Q.dtype), Q.dtype
    op = Operands.of(Q, K, V, acc)  # tiles in ≥ float32
    fixed = _bounded(op, pattern, mask)
    stats = _statistics(op, pattern.sinks, V.shape[3], fixed)
    step, at = _fixed_step if fixed else _online_step, pattern.grid()
    for tile in _plan(pattern, block_size, op, finite=fixed):
        step(op, mask, pattern, at, tile, stats, drop)
    m, l, O = stats  # noqa: E741
    dead = l == 0  # no admissible key (or L_k = 0), no sink: Z = 0, lse = m + log 0 = −∞
    Z = O.div_(l.masked_fill(dead, 1.0))  # in O's memory
    shape = (op.n, op.heads, Q.shape[2])
    return Z.view(*shape, V.shape[3]).to(out_dtype), (m + torch.log(l)).view(shape)


def _online_step(op: Operands, mask, pattern, at, tile, stats, drop) -> None:
    """One tile of the online softmax: RUNNING_MAX, WEIGHTS (in S's memory), RESCALE,
    RUNNING_SUM, RUNNING_VALUES on the tile's rows of ``stats = (m, l, O)``."""
    t0, t1, s0, s1 = tile[:4]
    _, S = _logits(op, mask, pattern, at, tile)
    m_old, l_t = stats[0][:, t0:t1], stats[1][:, t0:t1]
    m_new = torch.maximum(m_old, S.amax(-1, keepdim=True))  # RUNNING_MAX
    m_safe = m_new.masked_fill(m_new == -_INF, 0.0)  # no key yet: exp(−∞ − 0) = 0
    P = _exp(S, m_safe, tile[4] or mask is not None)  # WEIGHTS, in S's memory
    c = m_old.sub(m_safe).exp_()  # RESCALE
    l_t.mul_(c).add_(P.sum(-1, keepdim=True))  # RUNNING_SUM
    _dropped(P, op, tile, drop)  # after the sum: the denominator is not dropped
    stats[2][:, t0:t1].mul_(c).baddbmm_(P, op.per_head(op.v, s0, s1))  # RUNNING_VALUES
    m_old.copy_(m_new)


def _fixed_step(op: Operands, mask, pattern, at, tile, stats, drop) -> None:
    """One tile where every score is bounded (:func:`_bounded`), so that the shift ``m`` is
    0 throughout: ``P = exp(S)`` (then times the tile's ``keep``), ``l += sum_σ P``,
    ``O += P V_b``: WEIGHTS, RUNNING_SUM and RUNNING_VALUES with ``c = 1``."""
    t0, t1, s0, s1 = tile[:4]
    P = _scores(op, t0, t1, s0, s1).exp_()
    _kept(P, op, pattern, at, tile)
    stats[1][:, t0:t1].add_(P.sum(-1, keepdim=True))
    _dropped(P, op, tile, drop)
    stats[2][:, t0:t1].baddbmm_(P, op.per_head(op.v, s0, s1))


def _dropped(P: torch.Tensor, op: Operands, tile, drop) -> torch.Tensor:
    """``P ∘ R`` in P's memory, ``R`` the tile's dropout mask (P itself without dropout)."""
    if drop is not None:
        P.mul_(drop.weights(tile, (op.n, op.heads, *P.shape[1:]), P.device,
                            P.dtype).view(P.shape))
    return P


def _kept(P: torch.Tensor, op: Operands, pattern, at, tile) -> None:
    """``P`` times the tile's mask (1 where a key may be seen, 0 where not), in P's memory:
    the plan's ``keep``, or the pieces ``which`` evaluated on the tile's indices."""
    keep = tile.keep
    if keep is None and tile.which:
        keep = pattern.allowed(at.tile(slice(tile.t0, tile.t1), slice(tile.s0, tile.s1)),
                               tile.which)
    if keep is not None:
        P.view(op.n, op.heads, *P.shape[1:])[..., tile.c0:].mul_(keep)


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
    S = attention_scores(Q, K[:, :, s0:s1])  # a new tensor
    S = _masked(S, mask, pattern, pattern.grid(), (0, L_q, s0, s1, partial))
    short = -(s1 - s0) % block_size  # the last block, filled up with −∞ (no key)
    blocks = _F.pad(S, (0, short), value=-_INF) if short else S
    lse_b.insert(0, torch.logsumexp(torch.unflatten(blocks, -1, (-1, block_size)), dim=-1))
    lse = torch.logsumexp(torch.cat(lse_b, dim=3) if len(lse_b) > 1 else lse_b[0], dim=-1)
    dead = mask is not None or partial or pattern.scores_mask  # else lse is finite
    A = _exp(S, (for_backward(lse) if dead else lse)[..., None], dead)  # 0 in a dead row
    return weighted_values(A, V[:, :, s0:s1]).to(out_dtype), lse


def for_backward(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` as the backward pass reads it: ``+∞`` where a row saw no key (``−∞``), so
    that ``P = exp(S − lse)`` recomputes as 0 there."""
    return lse.masked_fill(lse == -_INF, _INF)


def backward(Q, K, V, Z, lse, mask, dZ, pattern, block_size: int, *, mask_grad: bool,
             drop: TileDropout | None = None):
    """``(dQ, dK, dV, dM, ds, dT)`` over the tiles, each recomputing ``P = exp(S − lse)``
    from the forward's ``lse`` as :func:`for_backward` reads it (dM where ``mask_grad``, ds
    where the pattern has sinks, dT: the gradients of the pattern's ``tensors``). Where the
    scores are bounded (:func:`_bounded`), ``P = exp(S) e^{−lse}`` with ``e^{−lse}`` taken
    into ``dZ`` and ``D`` once: ``dV = exp(S)ᵀ (dZ e^{−lse})``, ``dS = exp(S) ∘ (dP e^{−lse}
    − D e^{−lse})``, one pass less per tile."""
    acc, (n, heads, L_q, a_v) = accumulator(Q.dtype), Z.shape
    op = Operands.of(Q, K, V, acc)  # every tile in ≥ float32
    dZ3 = dZ.to(acc).reshape(n * heads, L_q, a_v)
    D = torch.linalg.vecdot(dZ3, Z.to(acc).reshape(dZ3.shape))[..., None]  # Σ_a dZ Z = Σ_σ P dP
    grads = Grads.zeros(op, mask if mask_grad else None, pattern.tensors,
                         transposed=min(block_size, L_q) >= WIDE_ROWS)
    lse3, at = lse.to(acc).reshape(D.shape), pattern.grid()
    rows = (lse3, torch.cat([dZ3, D.neg()], dim=-1))  # dZ⁺ = [dZ | −D]
    if _bounded(op, pattern, mask, dZ3, lse3):
        rows = (None, rows[1].mul_(torch.exp(-lse3)))  # e^{−lse}: 0 where a row saw no key
    for tile in _plan(pattern, block_size, op):
        _tile_backward(op, mask, pattern, at, tile, rows, grads, drop)
    del rows, op  # dZ⁺, v⁺ and the tiles' memory, gone before the gradients are laid out
    ds = sink_grad(pattern.sinks, lse, D.view(lse.shape))
    return *grads.shaped(Q, K, V), grads.dM, ds, grads.dT


def _tile_backward(op: Operands, mask, pattern, at, tile, rows, grads: Grads, drop):
    """One tile's share of the gradients, from ``rows = (lse, dZ⁺)`` of every query (or
    ``(None, dZ⁺ e^{−lse})``, where ``P = exp(S) e^{−lse}``), ``dZ⁺ = [dZ | −D]``."""
    t0, t1, s0, s1 = tile[:4]
    lse, dZ = (None if x is None else x[:, t0:t1] for x in rows)
    if lse is None:
        S = P = _scores(op, t0, t1, s0, s1).exp_()
        _kept(P, op, pattern, at, tile)
    else:
        S, logits = _logits(op, mask, pattern, at, tile)
        P = _exp(logits, lse, tile[4] or mask is not None)  # the forward's weights A, here
    R = None if drop is None else \
        drop.weights(tile, (op.n, op.heads, *P.shape[1:]), P.device, P.dtype).view(P.shape)
    grads.add_keys(op, grads.dV, s0, s1, P if R is None else P * R, dZ[..., :-1])  # VALUE_GRADS
    dS = _score_grads(op, P, dZ, R, s0, s1)
    if grads.dM is not None or pattern.scores:
        dS = _through_terms(dS, S, grads, pattern, at, tile)
    grads.dQ[:, t0:t1].baddbmm_(dS, op.per_head(op.k, s0, s1), alpha=op.scale)  # QUERY_GRADS
    grads.add_keys(op, grads.dK, s0, s1, dS, op.q[:, t0:t1], op.scale)  # KEY_GRADS


def _score_grads(op: Operands, P, dZ, R, s0: int, s1: int) -> torch.Tensor:
    """``dS = P ∘ (dP − D)`` in the call's memory ``"dP"``: PROB_GRADS as ``dZ⁺ v⁺ᵀ = dZ V_bᵀ
    − D``, one product and one pass (a pass fewer than ``dP − D`` after the product);
    through the dropout ``dA = R ∘ (dZ V_bᵀ)``, then ``− D``."""
    if R is None:
        return op.product("dP", dZ, op.per_head(op.summing(), s0, s1).transpose(1, 2)).mul_(P)
    dP = op.product("dP", dZ[..., :-1], op.per_head(op.v, s0, s1).transpose(1, 2))
    return dP.mul_(R).add_(dZ[..., -1:]).mul_(P)


def _through_terms(dS: torch.Tensor, S, grads: Grads, pattern, at, tile) -> torch.Tensor:
    """A float mask's gradient ``dM += dS`` (summed where it broadcasts), and ``dS`` back
    through ``cap(S) + B`` to S (adding what a ScoreMod captures to ``dT``)."""
    tau, sigma = slice(tile[0], tile[1]), slice(tile[2], tile[3])
    dS4 = dS.view(S.shape)
    if grads.dM is not None:  # M is added to the logits: dM = dS, summed where it broadcasts
        target = _mask_tile(grads.dM, tau, sigma)
        axes = _broadcast_axes(target.shape, dS4.shape)
        target += (dS4.sum(dim=axes, keepdim=True) if axes else dS4).to(target.dtype)
    if pattern.scores:  # through cap(S) + B back to S (and what a ScoreMod captures)
        dS4, tensor_grads = pattern.score_grad(S, dS4, at.tile(tau, sigma))
        for total, part in zip(grads.dT, tensor_grads, strict=True):
            total += part
    return dS4.reshape(dS.shape)


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
