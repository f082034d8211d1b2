"""Equations (2)–(4) over tiles of queries × keys with O(L) memory: FlashAttention.

Queries are cut into blocks ``τ ∈ t`` and keys into blocks ``σ ∈ b``, both of
``block_size``. For each tile ``(t, b)``, in order, with ``μ = (g r)``::

    S[n (g r) τ σ] = Q_t[n (g r) τ a] K_b[n g σ a] / √a     (+ M, causal from indices)
    m'[n μ τ]      = max(m[n μ τ], max_σ S[n μ τ σ])
    P[n μ τ σ]     = exp(S[n μ τ σ] − m'[n μ τ])
    l[n μ τ]       ← exp(m − m') l + Σ_σ P[n μ τ σ]
    O[n (g r) τ a] ← exp(m − m') O + P[n (g r) τ σ] V_b[n g σ a]

and at the end ``Z = O / l`` and ``lse = m + log l``, the log of the softmax denominator.
Ordinary multi-head attention is ``g = μ``, ``r = 1``; with grouped-query attention each
key/value group serves its ``r`` query heads where it lies, never repeated. Only
``Q, K, V, Z, lse`` (and the mask) are saved; the backward pass recomputes each tile's
``P = exp(S − lse)`` and, with ``D[n μ τ] = Σ_a dZ Z``, uses ``dS = P ∘ (dP − D)``.
Besides ``O(L·a)`` tensors such as ``Z`` and the gradients, the largest temporary is one
tile, ``block_size × block_size`` per head: nothing of ``L_q × L_k`` elements, nor of
``L_q × block_size``. See docs/chunked.md.

A query row with no admissible key keeps ``m = −∞`` and ``l = 0``: its ``Z`` is exact
zeros and its ``lse`` is set to ``+∞``, so that the backward pass recomputes ``P = 0``
there. No finite sentinel stands in for ``−∞``.

Every tile runs in at least float32 (:func:`_accumulator`): float16 and bfloat16 inputs
are widened once, so that ``S − lse`` and ``dP − D`` are formed in the precision the
statistics were; under ``torch.autocast`` Q, K, V are cast to autocast's dtype first and
the forward and the recomputing backward run outside it, on the same numbers. A second
derivative (``create_graph=True``: Hessians, gradient penalties) and the ``torch.func``
transforms run the dense equations (2)–(4) instead, whose graph autograd can differentiate
again: correct, at O(L_q·L_k) memory.
"""

from __future__ import annotations

import torch

from . import _autocast, _softmax
from . import functional as _functional  # not `from .functional import`: paths imports us
from . import masks as _masks
from .errors import EinattnError
from .notation import Equation

# Forward, per tile: functional.SCORES_GQA, S = Q_t K_b / √a, and functional.VALUES_GQA,
# O += P V_b, the equations (2g) and (4g) themselves. Backward, per tile:
VALUE_GRADS = Equation("dV_b[n g σ a] = P[n (g r) τ σ] dZ_t[n (g r) τ a]")
PROB_GRADS = Equation("dP[n (g r) τ σ] = dZ_t[n (g r) τ a] V_b[n g σ a]")
QUERY_GRADS = Equation("dQ_t[n (g r) τ a] = dS[n (g r) τ σ] K_b[n g σ a] / √a")
KEY_GRADS = Equation("dK_b[n g σ a] = dS[n (g r) τ σ] Q_t[n (g r) τ a] / √a")

_INF = float("inf")


def attention(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, *,
              mask: torch.Tensor | None = None, causal: bool = False,
              block_size: int = 256) -> torch.Tensor:
    """``Z[n μ τ a] = softmax_σ(Q[n μ τ a] K[n μ σ a] / √a + M[n μ τ σ]) V[n μ σ a]``,
    exactly, over tiles of ``block_size`` queries × ``block_size`` keys with O(L) memory.

    ``K`` and ``V`` may have fewer heads than ``Q`` (grouped-query attention): ``g`` groups
    dividing the ``μ`` query heads, query head ``μ = (g r)`` reading group ``g``.
    ``mask``: bool (True = may attend) or float (added to the scores), broadcastable to
    ``(n, μ, τ, σ)`` as in :func:`einattn.masks.as_nmts`; a float mask gets a gradient.
    ``causal=True`` lets query τ see key σ iff ``σ ≤ τ + L_k − L_q`` (bottom-right),
    computed per tile from the indices. ``V`` may have its own size of ``a``.

    >>> Q, K, V = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 7, 4), torch.randn(2, 3, 7, 4)
    >>> Z = attention(Q, K, V, causal=True, block_size=3)
    >>> from einattn import functional as F, masks
    >>> A = F.masked_softmax(F.attention_scores(Q, K), masks.causal_mask(5, 7))
    >>> torch.allclose(Z, F.weighted_values(A, V), atol=1e-6)
    True
    """
    check_block_size(block_size)
    for name, t, indices in (("Q", Q, "n μ τ a"), ("K", K, "n g σ a"), ("V", V, "n g σ a")):
        if not isinstance(t, torch.Tensor) or t.ndim != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise EinattnError(f"{name} must be 4-D {name}[{indices}], got {shape}")
    if not torch.compiler.is_compiling():  # checked eagerly, as an Equation's sizes are:
        _functional.SCORES_GQA.sizes(Q=Q, K=K)  # n and a agree, g divides μ; errors show (2g)
    for index, axis in (("n", 0), ("g", 1), ("σ", 2)):
        if V.shape[axis] != K.shape[axis]:
            raise EinattnError(f"index {index!r} has size {V.shape[axis]} in V but "
                               f"{K.shape[axis]} in K: every key K[n g σ a] needs its value "
                               f"V[n g σ a]")
    Q, K, V = _cast_for_autocast(Q, K, V)
    n, n_heads, L_q, _ = Q.shape
    if mask is not None:
        mask = _masks.as_nmts(mask, name="mask", n=n, n_heads=n_heads, L_q=L_q,
                              L_k=K.shape[2], dtype=Q.dtype, device=Q.device)
    if _softmax.transformed():  # no vmap or jvp rule for the Function below
        return _dense(Q, K, V, mask, bool(causal))
    with torch.autocast(Q.device.type, enabled=False):
        return _Attention.apply(Q, K, V, mask, bool(causal), block_size)


def _cast_for_autocast(Q, K, V):
    """Q, K, V in autocast's dtype where autocast is on (as SDPA is cast there), so that
    the tiles see the same numbers forward and backward."""
    low = _autocast.dtype(Q.device)
    if low is None:
        return Q, K, V
    return Q.to(low), K.to(low), V.to(low)


def _dense(Q, K, V, mask, causal: bool) -> torch.Tensor:
    """Equations (2g)–(4g) as written, which autograd differentiates to any order."""
    return _functional._einsum_stages(Q, K, V, mask, causal, 0.0, scratch=False)["Z"]


def check_block_size(block_size) -> int:
    """``block_size`` itself, once it is known to be a positive int."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise EinattnError(f"block_size (the number of queries τ and of keys σ per tile) must "
                           f"be a positive int, got {block_size!r}")
    return block_size


class _Attention(torch.autograd.Function):
    """Forward saves Q, K, V, Z, lse (and the mask); backward recomputes P per tile."""

    @staticmethod
    def forward(ctx, Q, K, V, mask, causal: bool, block_size: int):
        Z, lse = _forward(Q, K, V, mask, causal, block_size)
        ctx.save_for_backward(Q, K, V, Z, lse, mask)
        ctx.causal, ctx.block_size = causal, block_size
        return Z

    @staticmethod
    def backward(ctx, dZ):
        Q, K, V, Z, lse, mask = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: a backward that can be differentiated
            return (*_dense_grads(ctx, Q, K, V, mask, dZ), None, None)
        with torch.autocast(dZ.device.type, enabled=False):
            dQ, dK, dV, dM = _backward(Q, K, V, Z, lse, mask, dZ, ctx.causal, ctx.block_size,
                                       mask_grad=ctx.needs_input_grad[3])
        return dQ, dK, dV, dM, None, None


def _dense_grads(ctx, Q, K, V, mask, dZ):
    """The gradients of Q, K, V (and a float mask) through the dense equations, with a
    graph of their own: what a second derivative differentiates."""
    inputs = (Q, K, V, mask)
    wanted = [t for t, need in zip(inputs, ctx.needs_input_grad, strict=False) if need]
    with torch.autocast(dZ.device.type, enabled=False):
        grads = iter(torch.autograd.grad(_dense(Q, K, V, mask, ctx.causal), wanted, dZ,
                                         create_graph=True))
    return [next(grads) if need else None
            for need in ctx.needs_input_grad[:4]]


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    """Running statistics in at least float32, whatever the inputs' precision."""
    return torch.promote_types(dtype, torch.float32)


def _tiles(L_q: int, L_k: int, causal: bool, block_size: int):
    """``(τ0, τ1, σ0, σ1)`` per tile of queries ``[τ0, τ1)`` and keys ``[σ0, σ1)``. With
    ``causal``, a tile starts at its first row that sees one of its keys; a tile with no
    such row is skipped."""
    offset = L_k - L_q  # query τ sits at absolute position τ + offset: it sees σ ≤ τ + offset
    for t0 in range(0, L_q, block_size):
        t1 = min(t0 + block_size, L_q)
        for s0 in range(0, L_k, block_size):
            first = max(t0, s0 - offset) if causal else t0
            if first < t1:
                yield first, t1, s0, min(s0 + block_size, L_k)


def _tile_scores(Q, K, mask, causal: bool, tau: slice, sigma: slice, acc) -> torch.Tensor:
    """``S[n μ τ σ]`` for the queries ``tau`` and keys ``sigma`` of one tile, masked (−∞)."""
    S = _functional.SCORES_GQA(Q=Q[:, :, tau], K=K[:, :, sigma]).to(acc)  # a new tensor:
    if mask is not None:  # masked in place, one tile-sized tensor in all
        M = _mask_tile(mask, tau, sigma)
        if M.dtype == torch.bool:
            S.masked_fill_(~M, -_INF)
        else:
            S += M
    offset = K.shape[2] - Q.shape[2]
    if causal and sigma.stop - 1 > tau.start + offset:  # a key in the first row's future
        rows = torch.arange(tau.start, tau.stop, device=Q.device)[:, None]
        keys = torch.arange(sigma.start, sigma.stop, device=Q.device)[None, :]
        S.masked_fill_(keys > rows + offset, -_INF)
    return S


def _mask_tile(mask: torch.Tensor, tau: slice, sigma: slice) -> torch.Tensor:
    """The rows ``tau`` and keys ``sigma`` of a mask; axes of size 1 stay."""
    rows = mask if mask.shape[2] == 1 else mask[:, :, tau]
    return rows if rows.shape[3] == 1 else rows[:, :, :, sigma]


def _forward(Q, K, V, mask, causal: bool, block_size: int):
    n, n_heads, L_q, _ = Q.shape
    acc = _accumulator(Q.dtype)
    out_dtype, (Q, K, V) = Q.dtype, (t.to(acc) for t in (Q, K, V))  # tiles in ≥ float32
    m = Q.new_full((n, n_heads, L_q), -_INF, dtype=acc)  # running max m[n μ τ]
    l = Q.new_zeros((n, n_heads, L_q), dtype=acc)  # noqa: E741 running sum l[n μ τ]
    O = Q.new_zeros((n, n_heads, L_q, V.shape[3]), dtype=acc)  # noqa: E741 unnormalised Z
    for t0, t1, s0, s1 in _tiles(L_q, K.shape[2], causal, block_size):
        tau, sigma = slice(t0, t1), slice(s0, s1)
        S = _tile_scores(Q, K, mask, causal, tau, sigma, acc)
        m_old = m[:, :, tau]
        m_new = torch.maximum(m_old, S.amax(dim=-1))
        m_safe = m_new.masked_fill(m_new == -_INF, 0.0)  # no key yet: exp(−∞ − 0) = 0
        P = S.sub_(m_safe[..., None]).exp_()  # in place: S is not needed again
        rescale = torch.exp(m_old - m_safe)
        l[:, :, tau].mul_(rescale).add_(P.sum(dim=-1))  # the running statistics, in place
        PV = _functional.VALUES_GQA(A=P, V=V[:, :, sigma])
        O[:, :, tau].mul_(rescale[..., None]).add_(PV)
        m[:, :, tau] = m_new
    dead = l == 0  # no admissible key (or L_k = 0): Z = 0 and P = 0 in backward
    Z = O.div_(l.masked_fill(dead, 1.0)[..., None]).to(out_dtype)  # in O's memory
    lse = (m + torch.log(l)).masked_fill(dead, _INF)
    return Z, lse


def _backward(Q, K, V, Z, lse, mask, dZ, causal: bool, block_size: int, *, mask_grad: bool):
    L_q, L_k, g = Q.shape[2], K.shape[2], K.shape[1]
    acc, dtypes = _accumulator(Q.dtype), (Q.dtype, K.dtype, V.dtype)
    Q, K, V, Z, dZ = (t.to(acc) for t in (Q, K, V, Z, dZ))  # every tile in ≥ float32
    D = (dZ * Z).sum(dim=-1)  # D[n μ τ] = Σ_a dZ Z = Σ_σ P dP
    dQ, dK, dV = (torch.zeros(t.shape, dtype=acc, device=t.device) for t in (Q, K, V))
    dM = torch.zeros(mask.shape, dtype=mask.dtype, device=mask.device) if mask_grad else None
    for t0, t1, s0, s1 in _tiles(L_q, L_k, causal, block_size):
        tau, sigma = slice(t0, t1), slice(s0, s1)
        S = _tile_scores(Q, K, mask, causal, tau, sigma, acc)
        P = S.sub_(lse[:, :, tau, None]).exp_()  # the forward's weights A, for this tile
        Q_t, dZ_t, K_b, V_b = Q[:, :, tau], dZ[:, :, tau], K[:, :, sigma], V[:, :, sigma]
        dV[:, :, sigma] += VALUE_GRADS(P=P, dZ_t=dZ_t, g=g)
        dP = PROB_GRADS(dZ_t=dZ_t, V_b=V_b)
        dS = dP.sub_(D[:, :, tau, None]).mul_(P)  # dS = P ∘ (dP − D), in dP's memory
        dQ[:, :, tau] += QUERY_GRADS(dS=dS, K_b=K_b)
        dK[:, :, sigma] += KEY_GRADS(dS=dS, Q_t=Q_t, g=g)
        if dM is not None:  # M is added to S, so dM = dS, summed over its broadcast axes
            target = _mask_tile(dM, tau, sigma)
            axes = _broadcast_axes(target.shape, dS.shape)
            target += (dS.sum(dim=axes, keepdim=True) if axes else dS).to(dM.dtype)
    return (*(d.to(dtype) for d, dtype in zip((dQ, dK, dV), dtypes, strict=True)), dM)


def _broadcast_axes(mask_shape, tile_shape) -> list[int]:
    """The axes along which a mask of ``mask_shape`` broadcasts to ``tile_shape``."""
    return [k for k in range(4) if mask_shape[k] == 1 and tile_shape[k] != 1]
