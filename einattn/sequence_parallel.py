"""Sequence parallelism on ``torch.distributed``: each rank of a device mesh holds its own
tokens, and attention runs round a ring (:mod:`einattn.ring`).

Equations (1) and (5) are position-wise, so a rank runs them on its tokens alone; equations
(2)–(4) need every key, and the keys and values of the ``g`` key/value heads go round the
ring of ranks, one block per step, while each rank merges what its queries have seen
((M1)–(M2)). :func:`split_sequence` cuts a whole sequence into the rank's part (its chunks
of the layout), :func:`gather_sequence` puts the parts back in order. Every pattern piece
reads the sequence's global positions, packed documents the whole sequence's ids.
See docs/distributed.md.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from . import _sharding, composition, ring
from .errors import EinattnError
from .module import MultiHeadAttention

__all__ = ["SequenceParallel", "check_sequence", "gather_sequence", "place_sequence",
           "shard_sequence", "split_sequence"]


def shard_sequence(layer: MultiHeadAttention, device_mesh: DeviceMesh, *,
                   layout: str = "zigzag") -> MultiHeadAttention:
    """Make ``layer`` run sequence-parallel (ring attention) over a 1-D ``device_mesh``, in
    place; returns it.

    Each rank then calls the layer on its own tokens, ``x`` of shape ``(n, L/R, d_model)``
    as :func:`split_sequence` cuts it (with those parts of ``key_padding_mask`` and
    ``document_ids``), and gets their outputs; :func:`gather_sequence` puts the outputs back
    in order. Equations (1) and (5) run on the rank's tokens alone; equations (2)–(4) run as
    ring attention (:mod:`einattn.ring`): the keys and values of the ``g`` key/value heads
    go round the ring, and their gradients come back the same way. RoPE turns each token at
    its global position, and the layer's ``window``, ``softcap``, ``alibi``, ``sinks``,
    ``pattern`` and the documents apply in the sequence's own positions. ``layout``:
    ``"zigzag"`` (rank k holds chunks k and 2R − 1 − k of 2R, which balances causal work) or
    ``"contiguous"`` (rank k holds chunk k of R). Parameters stay as they are, replicated:
    each rank's parameter gradients are its tokens' share, to be summed over the mesh's
    ranks (``all_reduce`` on ``device_mesh.get_group()``, or DistributedDataParallel on that
    group, which averages per-rank means). Each pair of chunks runs the chunked path's tiles
    (``impl="chunked"``) or one tile (``impl="einsum"``).
    """
    _sharding.check_shardable(layer, "shard_sequence")
    _sharding.check_mesh(device_mesh, "shard_sequence", "the sequence-parallel dimension, e.g. "
               "mesh['cp']")
    check_sequence(layer, layout)
    return place_sequence(layer, device_mesh, layout)


def check_sequence(layer: MultiHeadAttention, layout: str) -> None:
    """What a sequence-parallel layer needs of its layer: tokens along dim 1, a known
    ``layout``, RoPE that does not read the call's length."""
    if not layer.batch_first:
        raise EinattnError("shard_sequence cuts the tokens along dim 1 of x (n, L, d_model): "
                           "build the layer with batch_first=True")
    ring.check_layout(layout)
    if (layer.rope_scaling or {}).get("rope_type") == "dynamic":
        raise EinattnError("rope_scaling 'dynamic' scales by the longest position of the "
                           "call, which each rank sees differently: use another rope_type")


def place_sequence(layer: MultiHeadAttention, device_mesh: DeviceMesh,
                   layout: str) -> MultiHeadAttention:
    """:func:`shard_sequence` once its checks have passed: the ring of the 1-D
    ``device_mesh``, the class of :class:`SequenceParallel`."""
    layer.sequence_mesh, layer.layout = device_mesh, layout
    layer.ring = ring.Ring(device_mesh.get_group(), layout)
    layer.__class__ = _sharding.parallel_class(SequenceParallel, type(layer))
    return layer


def split_sequence(t: torch.Tensor, device_mesh: DeviceMesh, *, layout: str = "zigzag",
                   dim: int = 1) -> torch.Tensor:
    """This rank's part of a whole sequence ``t``: its chunks along ``dim``, in order."""
    _sharding.check_mesh(device_mesh, "split_sequence", "the sequence-parallel dimension")
    R, k = device_mesh.size(), device_mesh.get_local_rank()
    c = ring.check_length(t.shape[dim], R, ring.check_layout(layout), what=f"dim {dim} of t")
    return torch.cat([t.narrow(dim, j * c, c) for j in ring.chunks(k, R, layout)], dim=dim)


def gather_sequence(t: torch.Tensor, device_mesh: DeviceMesh, *, layout: str = "zigzag",
                    dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's part ``t`` (a collective: every rank calls it
    and gets the same tensor). Its backward gives each rank the gradient of its own part."""
    _sharding.check_mesh(device_mesh, "gather_sequence", "the sequence-parallel dimension")
    R = device_mesh.size()
    ring.check_layout(layout)
    dim = dim % t.ndim
    parts = DTensor.from_local(t, device_mesh, [Shard(dim)], run_check=False).full_tensor()
    c = ring.check_length(parts.shape[dim], R, layout, what=f"dim {dim} of the gathered t")
    held = [j for k in range(R) for j in ring.chunks(k, R, layout)]  # chunk order, by rank
    order = sorted(range(len(held)), key=held.__getitem__)
    return torch.cat([parts.narrow(dim, p * c, c) for p in order], dim=dim)


class SequenceParallel(_sharding.Sharded):
    """What :func:`shard_sequence` adds to a layer's class: a forward over this rank's
    tokens, whose attention is the ring's. ``isinstance(layer, SequenceParallel)`` tells
    whether a layer runs sequence-parallel."""

    sequence_mesh: DeviceMesh
    layout: str
    ring: ring.Ring

    def forward(self, x: torch.Tensor, context=None, *, mask=None, key_padding_mask=None,
                causal: bool | None = None, need_weights: bool = False,
                return_intermediates: bool = False, impl: str | None = None, positions=None,
                cache=None, document_ids=None, pattern=None):
        """``Y[n τ i]`` for this rank's tokens ``x`` ``(n, L/R, d_model)``: the layer's
        composition, equations (1)–(5), with (2)–(4) over the whole sequence, round the ring.
        ``key_padding_mask``: bool ``(n, L/R)``, True = padding, and ``document_ids``:
        integers ``(n, L/R)``, the document ``d[n τ]`` of each token: this rank's parts, as
        :func:`split_sequence` cuts them (the ids are gathered, ``n·L`` integers, so that
        each pair of chunks sees its keys' documents, and pairs that share none are
        skipped)."""
        _refuse_in_sequence(context=context, mask=mask, need_weights=need_weights,
                            return_intermediates=return_intermediates, positions=positions,
                            cache=cache, dropout=self.dropout if self.training else 0.0)
        spec = self._call_spec(impl)
        w = self._attention_weights()
        self._check_input("x", x, w["W"])
        R, named = self.ring.world, _sharding.dimension_of(self.sequence_mesh)
        L = ring.check_length(x.shape[1] * R, R, self.layout,
                              what=f"the whole sequence (x's length × the mesh size {R}{named})")
        _check_part("key_padding_mask", key_padding_mask, x, "bool")
        if _check_part("document_ids", document_ids, x, "integers"):
            document_ids = gather_sequence(document_ids, self.sequence_mesh, layout=self.layout)
        t = ring.positions(self.ring.rank, self.ring.world, x.shape[1], self.layout)
        call = composition.Call(key_padding_mask=key_padding_mask, pattern=pattern,
                                causal=spec.causal if causal is None else causal,
                                positions=t.to(x.device) if spec.rope else None,
                                document_ids=document_ids)
        block_size = _block_size(spec.impl, spec.block_size, L)
        return composition.multi_head(x, w, spec, call, functools.partial(
            _ring_attention, self.ring, block_size))

    def already(self) -> str:
        return (f"already runs sequence-parallel over "
                f"{_sharding.described(self.sequence_mesh)}; shard a fresh copy of it")

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, sequence over a mesh of size "
                f"{self.sequence_mesh.size()}, layout={self.layout!r}")


_ELSEWHERE = {
    "context": "cross-attention reads a context that is not cut with the sequence",
    "mask": "a mask of (τ, σ) spans the whole sequence; use key_padding_mask and causal",
    "need_weights": "the weights A[n μ τ σ] never exist whole on one rank",
    "return_intermediates": "the weights A[n μ τ σ] never exist whole on one rank",
    "positions": "each rank's positions follow from the layout (einattn.ring.positions)",
    "cache": "a KVCache is for decoding, one token at a time: decode with the layer "
             "unsharded (its parameters are the same on every rank)",
    "dropout": "each block runs the chunked path's tiles, and the ring draws no dropout "
               "masks across ranks: call layer.eval() or build the layer with dropout=0",
}


def _ring_attention(ring_: ring.Ring, block_size: int, Q, K, V, spec, mask, key_padding_mask,
                    pieces: tuple, seen: bool) -> dict[str, torch.Tensor]:
    """Equations (2)–(4) of this rank's queries over every rank's keys, in the signature
    the composition calls its attention by."""
    return {"Z": ring.attention(Q, K, V, key_padding_mask, ring_, pieces=pieces,
                                block_size=block_size)}


def _refuse_in_sequence(**given) -> None:
    """An EinattnError for the first forward argument ring attention does not take."""
    for name, value in given.items():
        if value is None or value is False or (isinstance(value, float) and value == 0.0):
            continue
        raise EinattnError(f"a sequence-parallel layer takes no {name}: {_ELSEWHERE[name]}")


def _check_part(name: str, t, x: torch.Tensor, kind: str) -> bool:
    """Whether ``t`` is given, once it is this rank's part ``(n, L/R)``, of ``kind`` "bool"
    (``key_padding_mask``) or "integers" (``document_ids``)."""
    if t is None:
        return False
    if isinstance(t, torch.Tensor) and tuple(t.shape) == x.shape[:2] and (
            t.dtype == torch.bool if kind == "bool" else
            not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)):
        return True
    got = f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else \
        type(t).__name__
    raise EinattnError(f"{name} is {got}, but a sequence-parallel layer needs {kind} "
                       f"(n, L/R) = {tuple(x.shape[:2])}: this rank's part, as "
                       f"split_sequence cuts it")


def _block_size(impl: str, block_size: int, L: int) -> int:
    """The side of the tiles within each pair of chunks: the layer's ``block_size`` for
    ``impl="chunked"``, the whole pair for ``"einsum"`` (one product each)."""
    if impl not in ("chunked", "einsum"):
        raise EinattnError(f"a sequence-parallel layer runs each block with impl 'chunked' or "
                           f"'einsum' (which give the log-sum-exp the ring merges); got "
                           f"impl={impl!r}")
    return block_size if impl == "chunked" else L
