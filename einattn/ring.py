"""Ring attention: one sequence over the ranks of a 1-D mesh (context parallelism).

The sequence is cut into chunks of equal length; rank k holds the queries, keys and values
of its chunks (:func:`chunks`). Each rank keeps its queries and passes its keys and values
around the ring: at step s it holds the block of rank ``k − s``, attends to it, and merges
the partial result into its own. A partial result over a set of keys is what the chunked
path keeps per tile (:mod:`einattn.chunked`): the normalised output ``Z`` and the log of
its softmax denominator ``lse``. Two of them, over disjoint sets of keys, merge exactly::

    lse[n μ τ] = log(exp(lse_1[n μ τ]) + exp(lse_2[n μ τ]))                          (M1)
    Z[n μ τ a] = exp(lse_1[n μ τ] − lse[n μ τ]) · Z_1[n μ τ a]
               + exp(lse_2[n μ τ] − lse[n μ τ]) · Z_2[n μ τ a]                         (M2)

since ``exp(lse)`` is the sum over both sets of ``exp(S)`` and each ``Z`` is its own set's
weighted sum divided by its own denominator. A set with no admissible key has
``lse = −∞`` and contributes nothing.

The backward pass goes round the ring again. With the whole row's ``Z`` and ``lse`` known,
each block's share of the gradients is the chunked path's tile backward
(``P = exp(S − lse)``, ``dS = P ∘ (dP − D)``, ``D = Σ_a dZ Z``): ``dQ`` stays on the rank,
``dK`` and ``dV`` travel with their block and are back with its owner after R steps.

The pattern of equation (3) is the whole sequence's, per pair of chunks: for query chunk
i and key chunk j of length c, its pieces bound to the queries' positions ``i·c …`` and the
keys' ``j·c …`` (:meth:`einattn.patterns.Pattern.at`), as one process would see them.
Under causal attention an earlier key chunk is wholly visible, the same chunk is causal
within itself, and a later one is skipped, as is a chunk wholly outside a sliding window,
or one whose keys share no document with the queries (packed documents: the pattern holds
the whole sequence's ids ``d[n σ]``, each pair reads its chunks'). A sink ``s_μ`` starts
each row's merge at ``lse = s_μ``, ``Z = 0``.
With ``layout="contiguous"`` rank k holds chunk k of R, and so rank R − 1 does R pairs of
work where rank 0 does one; with ``"zigzag"`` (Megatron's load balancing) rank k holds
chunks k and 2R − 1 − k of 2R, so every rank does the same number. Each pair runs the
chunked path's tiles (``impl="chunked"``) or one tile over the whole pair
(``impl="einsum"``: equations (2g)–(4g) as written, as one product each).
See docs/distributed.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import _autocast, chunked, patterns
from .errors import EinattnError
from .notation import Equation

LAYOUTS = ("zigzag", "contiguous")
MERGE_LSE = Equation("lse[n μ τ] = log(exp(lse_1[n μ τ]) + exp(lse_2[n μ τ]))")  # (M1)
MERGE_Z = Equation("Z[n μ τ a] = exp(lse_1[n μ τ] − lse[n μ τ]) · Z_1[n μ τ a] "
                   "+ exp(lse_2[n μ τ] − lse[n μ τ]) · Z_2[n μ τ a]")  # (M2)
_INF = float("inf")


def n_chunks(world: int, layout: str) -> int:
    """How many chunks the sequence is cut into: R, or 2R for zigzag."""
    return 2 * world if layout == "zigzag" else world


def chunks(rank: int, world: int, layout: str) -> tuple[int, ...]:
    """The chunks rank k holds, in order: ``(k,)``, or ``(k, 2R − 1 − k)`` for zigzag."""
    return (rank, 2 * world - 1 - rank) if layout == "zigzag" else (rank,)


def check_layout(layout) -> str:
    """``layout`` itself, once it is one of :data:`LAYOUTS`."""
    if layout not in LAYOUTS:
        raise EinattnError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, "
                           f"got {layout!r}")
    return layout


def check_length(L: int, world: int, layout: str, *, what: str) -> int:
    """The length of one chunk of a sequence of ``L`` positions."""
    parts = n_chunks(world, layout)
    if L % parts:
        per = "two chunks on each of" if layout == "zigzag" else "one chunk on each of"
        raise EinattnError(f"{what} has {L} positions, which layout={layout!r} cannot cut into "
                           f"{parts} equal chunks ({per} {world} ranks): pad the sequence to "
                           f"a multiple of {parts} and mark the padding in key_padding_mask")
    return L // parts


def positions(rank: int, world: int, L_local: int, layout: str) -> torch.Tensor:
    """The global positions ``t[τ]`` of rank k's ``L_local`` tokens (for RoPE)."""
    held = chunks(rank, world, layout)
    c = L_local // len(held)
    return torch.cat([torch.arange(j * c, (j + 1) * c) for j in held])


def pairs(q_chunks, k_chunks, c: int, pattern: patterns.Pattern) -> list:
    """``(q, k, pattern)`` for each query chunk q and key chunk k (positions in the ranks'
    lists of chunks of length ``c``) of which some query sees some key, with ``pattern``
    (the whole sequence's) bound to the pair: under causal, an earlier key chunk (whole),
    the same chunk (causally); a later one is skipped, and so is a chunk wholly outside a
    window or in no document of the queries'."""
    out = []
    for q, i in enumerate(q_chunks):
        for k, j in enumerate(k_chunks):
            pair = pattern.at(i * c, c, j * c, c)
            if pair.sees_any():
                out.append((q, k, pair))
    return out


def merge(Z: torch.Tensor, lse: torch.Tensor, Z_b: torch.Tensor,
          lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M1) and (M2): the partial results ``(Z, lse)`` and ``(Z_b, lse_b)`` over two disjoint
    sets of keys merged into the result over both::

        lse[n μ τ] = log(exp(lse_1[n μ τ]) + exp(lse_2[n μ τ]))
        Z[n μ τ a] = exp(lse_1[n μ τ] − lse[n μ τ]) · Z_1[n μ τ a] + exp(lse_2[n μ τ] − lse[n μ τ]) · Z_2[n μ τ a]

    (M1) runs as ``torch.logaddexp``, its form that never overflows; :data:`MERGE_Z` runs as
    written, with ``lse = 0`` on a row that sees no key on either side (``lse = −∞``), whose
    weights are then ``exp(−∞) = 0``: it stays ``Z = 0``, ``lse = −∞``.

    >>> S, V = torch.randn(1, 1, 3, 5), torch.randn(1, 1, 5, 2)
    >>> Z_1, Z_2 = (torch.softmax(S[..., k], -1) @ V[..., k, :] for k in (slice(2), slice(2, 5)))
    >>> Z, lse = merge(Z_1, S[..., :2].logsumexp(-1), Z_2, S[..., 2:].logsumexp(-1))
    >>> torch.allclose(Z, torch.softmax(S, -1) @ V), torch.allclose(lse, S.logsumexp(-1))
    (True, True)
    """  # noqa: E501 (the equations as they run, quoted whole)
    lse_new = torch.logaddexp(lse, lse_b)
    safe = lse_new.masked_fill(lse_new == -_INF, 0.0)  # exp(−∞ − 0) = 0 for an empty row
    return MERGE_Z(lse_1=lse, Z_1=Z, lse_2=lse_b, Z_2=Z_b, lse=safe), lse_new


class Ring:
    """The ring of a 1-D mesh: this rank, its neighbours, and the exchange of blocks."""

    def __init__(self, group: dist.ProcessGroup, layout: str) -> None:
        self.group, self.layout = group, layout
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.world)

    def chunks_of(self, step: int) -> tuple[int, ...]:
        """The chunks of the block held at ``step``: rank ``k − step``'s."""
        return chunks((self.rank - step) % self.world, self.world, self.layout)

    def pass_on(self, tensors: list) -> tuple[list, list]:
        """Start sending ``tensors`` to the next rank and receiving the previous rank's
        into new buffers; returns the buffers and the requests to wait on."""
        if self.world == 1:
            return list(tensors), []
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in received]
        return received, dist.batch_isend_irecv(ops)


def _wait(requests) -> None:
    for request in requests:
        request.wait()


def attention(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor,
              key_padding_mask: torch.Tensor | None, ring: Ring, *, pieces: tuple,
              block_size: int) -> torch.Tensor:
    """This rank's ``Z[n μ τ a]``: its queries against every rank's keys and values, as
    one process would compute it over the whole sequence with the ``pieces`` of equation
    (3) in the sequence's positions (a sink's logits ``s[μ]`` included); differentiable (the
    backward pass goes round the ring too). ``key_padding_mask``: this rank's
    ``(n, L_local)``, True = padding. Under ``torch.autocast`` Q, K, V are cast to its dtype
    first and the ring runs outside it, as the chunked path does, so that its backward
    recomputes the forward's numbers."""
    padding = None if key_padding_mask is None else \
        key_padding_mask.to(torch.uint8).contiguous()  # what is sent must be contiguous
    L = Q.shape[2] * ring.world
    low = _autocast.dtype(Q.device)
    whole = patterns.bind(pieces, n=Q.shape[0], n_heads=Q.shape[1], L_q=L, L_k=L,
                          dtype=Q.dtype if low is None else low, device=Q.device)
    how = (ring, whole, block_size)
    if low is None:
        return _RingAttention.apply(Q, K.contiguous(), V.contiguous(), padding, whole.sinks, how,
                                    *whole.tensors)
    with torch.autocast(Q.device.type, enabled=False):  # the same numbers forward, backward
        return _RingAttention.apply(Q.to(low), K.to(low).contiguous(), V.to(low).contiguous(),
                                    padding, whole.sinks, how, *whole.tensors)


def _slices(L_local: int, n_held: int) -> list[slice]:
    c = L_local // n_held
    return [slice(j * c, (j + 1) * c) for j in range(n_held)]


def _mask(padding, sigma: slice):
    """The keys ``σ`` of a block that may be attended to, as a mask ``(n, 1, 1, σ)``."""
    return None if padding is None else (padding[:, None, None, sigma] == 0)


def _schedule(ring: Ring, step: int, L_local: int, whole: patterns.Pattern) -> list:
    """``(τ slice, σ slice, pattern)`` for each pair of chunks that attend at ``step``."""
    mine, theirs = chunks(ring.rank, ring.world, ring.layout), ring.chunks_of(step)
    rows, cols = _slices(L_local, len(mine)), _slices(L_local, len(theirs))
    c = L_local // len(mine)
    return [(rows[q], cols[k], p) for q, k, p in pairs(mine, theirs, c, whole)]


class _RingAttention(torch.autograd.Function):
    """Forward: (M1)–(M2) over the ring's blocks, from the sink's ``lse = s_μ``, ``Z = 0``.
    Backward: each block's tile backward with the whole row's Z and lse; dK and dV travel
    home with their block. The tensors a ScoreMod captures come last: each rank's gradient of
    them is its queries' share, as its parameters' are."""

    @staticmethod
    def forward(ctx, Q, K, V, padding, sinks, how: tuple, *tensors):
        Z, lse = _forward(Q, K, V, padding, sinks, *how)
        ctx.save_for_backward(Q, K, V, padding, sinks, Z, lse)
        ctx.how = how
        return Z.to(Q.dtype)

    @staticmethod
    def backward(ctx, dZ):
        Q, K, V, padding, sinks, Z, lse = ctx.saved_tensors
        lse = chunked.for_backward(lse)
        with torch.autocast(dZ.device.type, enabled=False):
            dQ, dK, dV, dT = _backward(Q, K, V, padding, Z, lse, dZ, *ctx.how)
        D = (dZ.to(Z.dtype) * Z).sum(dim=-1)  # D[n μ τ] = Σ_a dZ Z
        return dQ, dK, dV, None, chunked.sink_grad(sinks, lse, D), None, *dT


def _forward(Q, K, V, padding, sinks, ring: Ring, whole: patterns.Pattern, block_size: int):
    acc = chunked.accumulator(Q.dtype)
    Z = Q.new_zeros((*Q.shape[:3], V.shape[3]), dtype=acc)
    lse = Q.new_full(Q.shape[:3], -_INF, dtype=acc)
    if sinks is not None:  # the sink: one more logit s_μ, whose value is zero
        lse.copy_(sinks[:, None])
    block = [t for t in (K, V, padding) if t is not None]
    for step in range(ring.world):
        following, requests = ring.pass_on(block) if step < ring.world - 1 else (None, [])
        K_b, V_b, pad_b = (*block, None)[:3]
        for tau, sigma, pattern in _schedule(ring, step, Q.shape[2], whole):
            Z_p, lse_p = chunked.forward(Q[:, :, tau], K_b[:, :, sigma], V_b[:, :, sigma],
                                          _mask(pad_b, sigma), pattern, block_size)
            Z[:, :, tau], lse[:, :, tau] = merge(Z[:, :, tau], lse[:, :, tau], Z_p.to(acc),
                                                 lse_p)
        _wait(requests)
        block = following
    return Z, lse


def _backward(Q, K, V, padding, Z, lse, dZ, ring: Ring, whole: patterns.Pattern,
              block_size: int):
    acc = chunked.accumulator(Q.dtype)
    dQ = torch.zeros(Q.shape, dtype=acc, device=Q.device)
    block = [t for t in (K, V, padding) if t is not None]
    grads = [torch.zeros(t.shape, dtype=acc, device=t.device) for t in (K, V)]  # dK_b, dV_b
    dT = [torch.zeros_like(t) for t in whole.tensors]
    for step in range(ring.world):
        following, requests = ring.pass_on(block) if step < ring.world - 1 else (None, [])
        K_b, V_b, pad_b = (*block, None)[:3]
        for tau, sigma, pattern in _schedule(ring, step, Q.shape[2], whole):
            dQ_p, dK_p, dV_p, _, _, dT_p = chunked.backward(
                Q[:, :, tau], K_b[:, :, sigma], V_b[:, :, sigma], Z[:, :, tau],
                lse[:, :, tau], _mask(pad_b, sigma), dZ[:, :, tau], pattern, block_size,
                mask_grad=False)
            for total, part in zip(dT, dT_p, strict=True):
                total += part
            dQ[:, :, tau] += dQ_p
            grads[0][:, :, sigma] += dK_p
            grads[1][:, :, sigma] += dV_p
        grads, sent = ring.pass_on(grads)  # the block's dK, dV so far follow it
        _wait(sent + requests)
        block = following
    return dQ.to(Q.dtype), grads[0].to(K.dtype), grads[1].to(V.dtype), dT
