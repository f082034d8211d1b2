"""``impl="chunked"``: exact attention over tiles of queries × keys with O(L) memory
(:mod:`einattn.impls.tiles`), the tiles the pattern leaves empty skipped.

Only ``Q, K, V, Z, lse`` (and the mask, the sinks) are saved; the backward pass recomputes
each tile. Attention dropout (``dropout > 0`` in :func:`attend`) multiplies each tile's
weights by a mask ``R`` drawn per tile from a seed, and the backward draws the same ``R``
again (:mod:`einattn._tile_dropout`). Under ``torch.autocast`` Q, K, V are cast to
autocast's dtype first and the forward and the recomputing backward run outside it, on the
same numbers. A second derivative (``create_graph=True``: Hessians, gradient penalties) and
the ``torch.func`` transforms run the dense equations (2)–(4) instead (:mod:`einattn.impls.
einsum`), whose graph autograd can differentiate again: correct, at O(L_q·L_k) memory.
Where a query sees a band of keys (a sliding window), the tiles are cut to its width
(:func:`_tile_side`).
"""

from __future__ import annotations

import functools

import torch

from .. import _autocast, _softmax
from .. import masks as _masks
from .. import patterns as _patterns
from .._checks import check_block_size
from .._tile_dropout import TileDropout
from ..equations import check_qkv, weighted_values
from ..errors import EinattnError
from . import einsum
from .tile_plan import tiles
from .tiles import backward, for_backward, forward


def attention(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, *,
              mask: torch.Tensor | None = None, causal: bool = False,
              block_size: int = 256, pattern=None) -> torch.Tensor:
    """``Z[n μ τ a] = softmax_σ(Q[n μ τ a] K[n μ σ a] / √a + M[n μ τ σ]) V[n μ σ a]``,
    exactly, over tiles of ``block_size`` queries × ``block_size`` keys with O(L) memory.

    ``K`` and ``V`` may have fewer heads than ``Q`` (grouped-query attention): ``g`` groups
    dividing the ``μ`` query heads, query head ``μ = (g r)`` reading group ``g``.
    ``mask``: bool (True = may attend) or float (added to the scores), broadcastable to
    ``(n, μ, τ, σ)`` as in :func:`einattn.masks.as_nmts`; a float mask gets a gradient.
    ``causal=True`` lets query τ see key σ iff ``σ ≤ τ + L_k − L_q`` (bottom-right),
    computed per tile from the indices; ``pattern`` (pieces of :mod:`einattn.patterns`,
    as :func:`einattn.functional.attention` takes them) brings the other terms of (3).
    ``V`` may have its own size of ``a``.

    >>> Q, K, V = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 7, 4), torch.randn(2, 3, 7, 4)
    >>> Z = attention(Q, K, V, causal=True, block_size=3)
    >>> from einattn import functional as F, masks
    >>> A = F.masked_softmax(F.attention_scores(Q, K), masks.causal_mask(5, 7))
    >>> torch.allclose(Z, F.weighted_values(A, V), atol=1e-6)
    True
    """
    check_block_size(block_size)
    check_qkv(Q, K, V)
    n, n_heads, L_q, _ = Q.shape
    pattern = _patterns.build(n=n, n_heads=n_heads, L_q=L_q, L_k=K.shape[2], dtype=Q.dtype,
                              device=Q.device, causal=causal, pattern=pattern)
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
    tensors = pattern.tensors  # what a ScoreMod captures: its gradients come back too
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (Q, K, V, mask, pattern.sinks, *tensors)):
        apply = _Attention.apply if TRACEABLE or not torch.compiler.is_compiling() \
            else _untraced_apply
        return apply(Q, K, V, mask, pattern.sinks, pattern, block_size, drop, *tensors)
    return forward(Q, K, V, mask, pattern, block_size, drop)[0]


# Dynamo traces the Function below, backward included, into the graph. torch 2.11's traced
# backward gave gradients 3.0 off (eager: 1e-15, the forward exact; measured on CPU and CUDA,
# tests/test_chunked.py's compile test), torch 2.13's are exact: before 2.13 the Function runs
# outside the graph (a graph break; fullgraph=True refuses it), never a wrong gradient.
TRACEABLE = torch.__version__ >= "2.13"


def _tile_side(pattern, block_size: int) -> int:
    """The side of a tile: ``block_size``, or, where a query sees a band of at most ``w``
    keys (a sliding window's), at most ``max(64, w // 2)``: a band of ``w`` keys cut into
    square tiles of side ``b`` covers ``b · (w + b)`` scores per ``b`` queries, so
    ``b ≤ w / 2`` wastes at most a third of them, where ``b = w`` wastes half (measured,
    causal w = 256 at L = 4096, one thread: forward 56.9 → 43.1 ms, forward+backward 165 →
    127 ms, from b = 256 to 128)."""
    band = pattern.band()
    if band is None:
        return block_size
    return min(block_size, max(64, band // 2))


def _dense(Q, K, V, mask, pattern, block_size: int = 0,
           drop: TileDropout | None = None) -> torch.Tensor:
    """Equations (2g)–(4g) as written, which autograd differentiates to any order; with
    ``drop``, ``Z = (A ∘ R) V`` with the ``R`` the tiles of ``block_size`` draw."""
    stages = einsum.stages(Q, K, V, mask, pattern, 0.0, scratch=False)
    if drop is None:
        return stages["Z"]
    A = stages["A"]
    R = drop.dense(tiles(pattern, block_size), A.shape, A.device, A.dtype)
    return weighted_values(A * R, V)


class _Attention(torch.autograd.Function):
    """Forward saves Q, K, V, Z, lse (the mask, the sinks); backward recomputes P per tile.
    The tensors a ScoreMod captures come last, to receive their gradients."""

    @staticmethod
    def forward(ctx, Q, K, V, mask, sinks, pattern, block_size: int, drop, *tensors):
        Z, lse = forward(Q, K, V, mask, pattern, block_size, drop)
        ctx.save_for_backward(Q, K, V, Z, for_backward(lse), mask, sinks, *tensors)
        ctx.pattern, ctx.block_size, ctx.drop = pattern, block_size, drop
        return Z

    @staticmethod
    def backward(ctx, dZ):
        Q, K, V, Z, lse, mask, sinks, *tensors = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: a backward that can be differentiated
            dQ, dK, dV, dM, ds, *dT = _dense_grads(ctx, Q, K, V, mask, sinks, tensors, dZ)
            return dQ, dK, dV, dM, ds, None, None, None, *dT
        with torch.autocast(dZ.device.type, enabled=False):
            *grads, dT = backward(Q, K, V, Z, lse, mask, dZ, ctx.pattern, ctx.block_size,
                                  mask_grad=ctx.needs_input_grad[3], drop=ctx.drop)
        return *grads, None, None, None, *dT


_untraced_apply = torch.compiler.disable(_Attention.apply)


def _dense_grads(ctx, Q, K, V, mask, sinks, tensors, dZ):
    """The gradients of Q, K, V (a float mask, the sinks, what a ScoreMod captures) through
    the dense equations, with a graph of their own: what a second derivative
    differentiates."""
    inputs = (Q, K, V, mask, sinks, None, None, None, *tensors)
    wanted = [t for t, need in zip(inputs, ctx.needs_input_grad, strict=True) if need]
    with torch.autocast(dZ.device.type, enabled=False):
        pattern = ctx.pattern.with_sinks(sinks)  # the saved s[μ] itself
        Z = _dense(Q, K, V, mask, pattern, ctx.block_size, ctx.drop)
        grads = iter(torch.autograd.grad(Z, wanted, dZ, create_graph=True))
    return [next(grads) if need else None
            for i, need in enumerate(ctx.needs_input_grad) if i not in (5, 6, 7)]




def run(Q, K, V, M, pattern, spec, seen: bool) -> dict[str, torch.Tensor]:
    """The impls' entry point: ``{"Z": Z}`` with the spec's block size and dropout."""
    refusal = pattern.refusal("chunked")
    if refusal:
        raise EinattnError(refusal)
    return {"Z": attend(Q, K, V, M, pattern, spec.block_size, spec.dropout)}
