"""Equations (2)–(4) over tiles of queries × keys with O(L) memory: FlashAttention.

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
key/value group serves its ``r`` query heads where it lies, never repeated. Only
``Q, K, V, Z, lse`` (and the mask) are saved; the backward pass recomputes each tile's
``P = exp(S − lse)`` and, with ``D[n μ τ] = Σ_a dZ Z``, uses ``dS = P ∘ (dP − D)``.
Besides ``O(L·a)`` tensors such as ``Z`` and the gradients, the largest temporary is one
tile of at most ``SPAN · block_size²`` numbers per head (neighbouring tiles of a row of
queries run as one product): nothing of ``L_q × L_k`` elements, nor of ``L_q × block_size``. See
docs/chunked.md.

Attention dropout (``dropout > 0`` in :func:`attend`) multiplies each tile's ``P`` by a mask
``R`` drawn per tile from a seed, after RUNNING_SUM, and the backward draws the same ``R``
again (:mod:`einattn._tile_dropout`).

A query row with no admissible key keeps ``m = −∞`` and ``l = 0``: its ``Z`` is exact
zeros and its ``lse`` is ``−∞`` (an empty sum), which the backward pass reads as ``+∞``
(:func:`for_backward`), so that it recomputes ``P = 0`` there. No finite sentinel stands in
for ``−∞``.

Every tile runs in at least float32 (:func:`_accumulator`): float16 and bfloat16 inputs
are widened once, so that ``S − lse`` and ``dP − D`` are formed in the precision the
statistics were; under ``torch.autocast`` Q, K, V are cast to autocast's dtype first and
the forward and the recomputing backward run outside it, on the same numbers. A second
derivative (``create_graph=True``: Hessians, gradient penalties) and the ``torch.func``
transforms run the dense equations (2)–(4) instead, whose graph autograd can differentiate
again: correct, at O(L_q·L_k) memory.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as _F

from . import _autocast, _softmax
from . import functional as _functional  # not `from .functional import`: paths imports us
from . import masks as _masks
from . import patterns as _patterns
from ._checks import check_block_size
from ._tile_dropout import TileDropout
from .errors import EinattnError
from .notation import Equation

# Forward, per tile: functional.attention_scores, S = Q_t K_b / √a, equation (2g) itself
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


def attention(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, *,
              mask: torch.Tensor | None = None, causal: bool = False,
              block_size: int = 256, pattern: _patterns.Pattern | None = None) -> torch.Tensor:
    """``Z[n μ τ a] = softmax_σ(Q[n μ τ a] K[n μ σ a] / √a + M[n μ τ σ]) V[n μ σ a]``,
    exactly, over tiles of ``block_size`` queries × ``block_size`` keys with O(L) memory.

    ``K`` and ``V`` may have fewer heads than ``Q`` (grouped-query attention): ``g`` groups
    dividing the ``μ`` query heads, query head ``μ = (g r)`` reading group ``g``.
    ``mask``: bool (True = may attend) or float (added to the scores), broadcastable to
    ``(n, μ, τ, σ)`` as in :func:`einattn.masks.as_nmts`; a float mask gets a gradient.
    ``causal=True`` lets query τ see key σ iff ``σ ≤ τ + L_k − L_q`` (bottom-right),
    computed per tile from the indices; a ``pattern`` (:func:`einattn.patterns.build`,
    causal included) brings the other terms of equation (3) instead.
    ``V`` may have its own size of ``a``.

    >>> Q, K, V = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 7, 4), torch.randn(2, 3, 7, 4)
    >>> Z = attention(Q, K, V, causal=True, block_size=3)
    >>> from einattn import functional as F, masks
    >>> A = F.masked_softmax(F.attention_scores(Q, K), masks.causal_mask(5, 7))
    >>> torch.allclose(Z, F.weighted_values(A, V), atol=1e-6)
    True
    """
    check_block_size(block_size)
    _functional.check_qkv(Q, K, V)
    n, n_heads, L_q, _ = Q.shape
    if pattern is None:
        pattern = _patterns.build(n=n, n_heads=n_heads, L_q=L_q, L_k=K.shape[2],
                                  dtype=Q.dtype, device=Q.device, causal=causal)
    if mask is not None:
        mask = _masks.as_nmts(mask, name="mask", n=n, n_heads=n_heads, L_q=L_q,
                              L_k=K.shape[2], dtype=Q.dtype, device=Q.device)
    return attend(Q, K, V, mask, pattern, block_size)


def attend(Q, K, V, mask, pattern: _patterns.Pattern, block_size: int,
           dropout: float = 0.0) -> torch.Tensor:
    """:func:`attention` once its arguments are known good (``mask`` as ``as_nmts`` makes
    it), as :mod:`einattn.paths` calls it, with ``dropout`` on the weights ``A`` drawn per
    tile (:mod:`einattn._tile_dropout`; pass 0 outside training). Without a graph to record
    (``no_grad``, a decoding step) the forward runs alone, outside the ``autograd.Function``;
    autocast is switched off around the tiles only where it is on (the switch costs ~15 µs
    a call)."""
    low = _autocast.dtype(Q.device)
    if low is not None:  # Q, K, V in autocast's dtype, as SDPA is cast there
        Q, K, V = Q.to(low), K.to(low), V.to(low)
    if _softmax.transformed():  # no vmap or jvp rule for the Function below
        if dropout:
            raise EinattnError(f"impl='chunked' draws its dropout (got dropout={dropout}) per "
                               f"tile, which torch.func's transforms cannot run: use "
                               f"impl='einsum' under them, whose F.dropout follows vmap's "
                               f"randomness=")
        return _dense(Q, K, V, mask, pattern)
    args = (Q, K, V, mask, pattern, _tile_side(pattern, block_size))
    run = functools.partial(_run_dropping, dropout=dropout) if dropout else _run
    if low is None:
        return run(*args)
    with torch.autocast(Q.device.type, enabled=False):  # the same numbers forward, backward
        return run(*args)


@torch.compiler.disable
def _run_dropping(Q, K, V, mask, pattern, block_size: int, dropout: float) -> torch.Tensor:
    """:func:`_run` with dropout, outside ``torch.compile`` (a graph break): each call draws
    a seed, which a graph would hold as a constant and recompile for."""
    return _run(Q, K, V, mask, pattern, block_size, TileDropout.drawn(dropout))


def _run(Q, K, V, mask, pattern, block_size: int,
         drop: TileDropout | None = None) -> torch.Tensor:
    """Z by the ``autograd.Function`` where autograd records the call, else the forward."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (Q, K, V, mask, pattern.sinks)):
        apply = _Attention.apply if _TRACEABLE or not torch.compiler.is_compiling() \
            else _untraced_apply
        return apply(Q, K, V, mask, pattern.sinks, pattern, block_size, drop)
    return _forward(Q, K, V, mask, pattern, block_size, drop)[0]


# Dynamo traces the Function below, backward included, into the graph. torch 2.11's traced
# backward gave gradients 3.0 off (eager: 1e-15, the forward exact; measured on CPU and CUDA,
# tests/test_chunked.py's compile test), torch 2.13's are exact: before 2.13 the Function runs
# outside the graph (a graph break; fullgraph=True refuses it), never a wrong gradient.
_TRACEABLE = torch.__version__ >= "2.13"


def _tile_side(pattern, block_size: int) -> int:
    """The side of a tile: ``block_size``, or, under a sliding window of ``w`` keys, at most
    ``max(64, w // 2)``: a band of ``w`` keys cut into square tiles of side ``b`` covers
    ``b · (w + b)`` scores per ``b`` queries, so ``b ≤ w / 2`` wastes at most a third of
    them, where ``b = w`` wastes half (measured, causal w = 256 at L = 4096, one thread:
    forward 56.9 → 43.1 ms, forward+backward 165 → 127 ms, from b = 256 to 128)."""
    windows = [piece.w for piece in pattern.masks if isinstance(piece, _patterns.Window)]
    if not windows:
        return block_size
    return min(block_size, max(64, min(windows) // 2))


def _dense(Q, K, V, mask, pattern, block_size: int = 0,
           drop: TileDropout | None = None) -> torch.Tensor:
    """Equations (2g)–(4g) as written, which autograd differentiates to any order; with
    ``drop``, ``Z = (A ∘ R) V`` with the ``R`` the tiles of ``block_size`` draw."""
    stages = _functional._einsum_stages(Q, K, V, mask, pattern, 0.0, scratch=False)
    if drop is None:
        return stages["Z"]
    A = stages["A"]
    R = drop.dense(_tiles(Q, K, pattern, block_size), A.shape, A.device, A.dtype)
    return _functional.weighted_values(A * R, V)


class _Attention(torch.autograd.Function):
    """Forward saves Q, K, V, Z, lse (the mask, the sinks); backward recomputes P per tile."""

    @staticmethod
    def forward(ctx, Q, K, V, mask, sinks, pattern, block_size: int, drop):
        Z, lse = _forward(Q, K, V, mask, pattern, block_size, drop)
        ctx.save_for_backward(Q, K, V, Z, for_backward(lse), mask, sinks)
        ctx.pattern, ctx.block_size, ctx.drop = pattern, block_size, drop
        return Z

    @staticmethod
    def backward(ctx, dZ):
        Q, K, V, Z, lse, mask, sinks = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: a backward that can be differentiated
            return (*_dense_grads(ctx, Q, K, V, mask, sinks, dZ), None, None, None)
        with torch.autocast(dZ.device.type, enabled=False):
            grads = _backward(Q, K, V, Z, lse, mask, dZ, ctx.pattern, ctx.block_size,
                              mask_grad=ctx.needs_input_grad[3], drop=ctx.drop)
        return *grads, None, None, None


_untraced_apply = torch.compiler.disable(_Attention.apply)


def _dense_grads(ctx, Q, K, V, mask, sinks, dZ):
    """The gradients of Q, K, V (a float mask, the sinks) through the dense equations,
    with a graph of their own: what a second derivative differentiates."""
    inputs = (Q, K, V, mask, sinks)
    wanted = [t for t, need in zip(inputs, ctx.needs_input_grad, strict=False) if need]
    with torch.autocast(dZ.device.type, enabled=False):
        pattern = dataclasses.replace(ctx.pattern, sinks=sinks)  # the saved s[μ] itself
        Z = _dense(Q, K, V, mask, pattern, ctx.block_size, ctx.drop)
        grads = iter(torch.autograd.grad(Z, wanted, dZ, create_graph=True))
    return [next(grads) if need else None
            for need in ctx.needs_input_grad[:5]]


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    """Running statistics in at least float32, whatever the inputs' precision."""
    return torch.promote_types(dtype, torch.float32)


def _tile_logits(Q, K, mask, pattern, at, tile, acc) -> tuple[torch.Tensor, torch.Tensor]:
    """One tile's ``S[n μ τ σ]`` and its logits ``cap(S) + B + M`` (−∞ where masked)."""
    t0, t1, s0, s1, partial = tile
    tau, sigma = slice(t0, t1), slice(s0, s1)
    S = _functional.attention_scores(Q[:, :, tau], K[:, :, sigma]).to(acc)  # a new tensor:
    here = None if at is None else at.tile(tau, sigma)
    logits = pattern.scored(S, here) if pattern.scores else S  # masked in place below
    if mask is not None:
        M = _mask_tile(mask, tau, sigma)
        if M.dtype == torch.bool:
            logits.masked_fill_(~M, -_INF)
        else:
            logits += M
    if partial:  # a tile the pattern leaves wholly visible needs no mask
        logits.masked_fill_(~pattern.allowed(here), -_INF)
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
                merged[-1] = (t0, t1, n0, s1, m_partial or partial)
                continue
        merged.append((t0, t1, s0, s1, partial))
    return merged


def _tiles(Q, K, pattern, block_size: int) -> list:
    """The tiles ``(τ0, τ1, σ0, σ1, partial)`` the forward and the backward visit."""
    return _spans(pattern.tiles(Q.shape[2], K.shape[2], block_size), block_size)


def _grid(Q, K, pattern):
    """The index grid the pattern's pieces read, or None where it has none."""
    if len(pattern.masks) + len(pattern.scores) == 0:
        return None
    return _patterns.grid(Q.shape[0], Q.shape[1], Q.shape[2], K.shape[2], Q.device)


def _mask_tile(mask: torch.Tensor, tau: slice, sigma: slice) -> torch.Tensor:
    """The rows ``tau`` and keys ``sigma`` of a mask; axes of size 1 stay."""
    rows = mask if mask.shape[2] == 1 else mask[:, :, tau]
    return rows if rows.shape[3] == 1 else rows[:, :, :, sigma]


def _forward(Q, K, V, mask, pattern, block_size: int, drop: TileDropout | None = None):
    """``(Z, lse)``: over the split keys for a few queries whose keys fit one wide tile
    (a decoding step), over the tiles otherwise (always with dropout: the backward's)."""
    L_q = Q.shape[2]
    if 0 < L_q <= SPLIT_QUERIES and drop is None:
        reach = _reach(pattern, L_q, K.shape[2])
        if L_q * (reach[1] - reach[0]) <= SPAN * block_size * block_size:
            return _split_forward(Q, K, V, mask, pattern, block_size, reach)
    return _tiled_forward(Q, K, V, mask, pattern, block_size, drop)


def _tiled_forward(Q, K, V, mask, pattern, block_size: int, drop: TileDropout | None):
    n, n_heads, L_q, _ = Q.shape
    acc = _accumulator(Q.dtype)
    out_dtype, (Q, K, V) = Q.dtype, (t.to(acc) for t in (Q, K, V))  # tiles in ≥ float32
    m = Q.new_full((n, n_heads, L_q), -_INF, dtype=acc)  # running max m[n μ τ]
    l = Q.new_zeros((n, n_heads, L_q), dtype=acc)  # noqa: E741 running sum l[n μ τ]
    if pattern.sinks is not None:  # the sink: one more logit s_μ, whose value is zero
        m.copy_(pattern.sinks[:, None])
        l.copy_((pattern.sinks != -_INF)[:, None])  # exp(s_μ − m) = 1, or 0 for s_μ = −∞
    O = Q.new_zeros((n, n_heads, L_q, V.shape[3]), dtype=acc)  # noqa: E741 unnormalised Z
    at = _grid(Q, K, pattern)
    for tile in _tiles(Q, K, pattern, block_size):
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
    acc = _accumulator(Q.dtype)
    out_dtype, (Q, K, V) = Q.dtype, (t.to(acc) for t in (Q, K, V))
    lse_b = [] if pattern.sinks is None else \
        [pattern.sinks.to(acc)[:, None, None].expand(n, n_heads, L_q, 1)]
    if s1 <= s0:  # no admissible key: Z = 0, lse = −∞ (or the sink's s_μ)
        lse = lse_b[0][..., 0] if lse_b else Q.new_full((n, n_heads, L_q), -_INF)
        return Q.new_zeros((n, n_heads, L_q, V.shape[3]), dtype=out_dtype), lse
    _, S = _tile_logits(Q, K, mask, pattern, _grid(Q, K, pattern), (0, L_q, s0, s1, partial),
                        acc)
    short = -(s1 - s0) % block_size  # the last block, filled up with −∞ (no key)
    blocks = _F.pad(S, (0, short), value=-_INF) if short else S
    lse_b.insert(0, torch.logsumexp(torch.unflatten(blocks, -1, (-1, block_size)), dim=-1))
    lse = torch.logsumexp(torch.cat(lse_b, dim=3) if len(lse_b) > 1 else lse_b[0], dim=-1)
    dead = mask is not None or partial  # where no row can lack a key, lse is finite
    A = S.sub_((for_backward(lse) if dead else lse)[..., None]).exp_()  # 0 in a dead row
    return _functional.weighted_values(A, V[:, :, s0:s1]).to(out_dtype), lse


def _reach(pattern, L_q: int, L_k: int) -> tuple[int, int, bool]:
    """The keys ``[σ0, σ1)`` that some of the ``L_q`` queries may see (a window's band),
    and whether the mask pieces must be evaluated there (``False``: every key is seen)."""
    s0, s1 = 0, L_k
    for piece in pattern.masks:
        if hasattr(piece, "keys"):
            lo, hi = piece.keys(0, L_q - 1)
            s0, s1 = max(s0, lo), min(s1, hi + 1)
    partial = False
    for piece in pattern.masks:
        some, every = (False, False) if s1 <= s0 else \
            piece.judge(max(L_q, L_k))(0, L_q - 1, s0, s1 - 1)
        if not some:
            return s0, s0, False
        partial = partial or not every
    return s0, max(s0, s1), partial


def for_backward(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` as the backward pass reads it: ``+∞`` where a row saw no key (``−∞``), so
    that ``P = exp(S − lse)`` recomputes as 0 there."""
    return lse.masked_fill(lse == -_INF, _INF)


def _backward(Q, K, V, Z, lse, mask, dZ, pattern, block_size: int, *, mask_grad: bool,
              drop: TileDropout | None = None):
    g = K.shape[1]
    acc, dtypes = _accumulator(Q.dtype), (Q.dtype, K.dtype, V.dtype)
    Q, K, V, Z, dZ = (t.to(acc) for t in (Q, K, V, Z, dZ))  # every tile in ≥ float32
    D = (dZ * Z).sum(dim=-1)  # D[n μ τ] = Σ_a dZ Z = Σ_σ P dP
    dQ, dK, dV = (torch.zeros(t.shape, dtype=acc, device=t.device) for t in (Q, K, V))
    dM = torch.zeros(mask.shape, dtype=mask.dtype, device=mask.device) if mask_grad else None
    at = _grid(Q, K, pattern)
    for tile in _tiles(Q, K, pattern, block_size):
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
        if pattern.scores:  # through cap(S) + B back to S
            dS = pattern.score_grad(S, dS, at.tile(tau, sigma))
        dQ[:, :, tau] += QUERY_GRADS(dS=dS, K_b=K_b)
        dK[:, :, sigma] += KEY_GRADS(dS=dS, Q_t=Q_t, g=g)
    grads = [d.to(dtype) for d, dtype in zip((dQ, dK, dV), dtypes, strict=True)]
    return (*grads, dM, _sink_grad(pattern.sinks, lse, D))


def _sink_grad(sinks, lse, D):
    """``∂L/∂s_μ = −Σ_{n τ} A_sink[n μ τ] D[n μ τ]``, with ``A_sink = exp(s_μ − lse)`` the
    weight the sink took (its value is zero, so only the denominator it joins moves Z)."""
    if sinks is None:
        return None
    A_sink = torch.exp(sinks.to(lse.dtype)[:, None] - lse)
    return -(A_sink * D).sum(dim=(0, 2)).to(sinks.dtype)


def _broadcast_axes(mask_shape, tile_shape) -> list[int]:
    """The axes along which a mask of ``mask_shape`` broadcasts to ``tile_shape``."""
    return [k for k in range(4) if mask_shape[k] == 1 and tile_shape[k] != 1]
