"""Attention on several devices: one layer split over a ``torch.distributed`` device mesh by
its heads, by its sequence, or by both at once.

* Heads (:mod:`einattn.head_parallel`, Megatron's tensor parallelism): rank k of a mesh of
  size w holds heads ``μ ∈ [k·μ/w, (k+1)·μ/w)`` whole, the rows of ``W[(μ B a) i]`` and the
  heads of ``W_O[μ a i]``; equation (5) is a sum over heads, so one all-reduce of the
  partial ``Y`` gives the layer's output.
* The sequence (:mod:`einattn.sequence_parallel`, ring attention): each rank holds its own
  tokens; the keys and values go round a ring of ranks (:mod:`einattn.ring`).
* Both (:func:`shard`), on a mesh with named dimensions, e.g. ``heads × seq``: rank
  ``(h, s)`` holds heads ``μ ∈ [h·μ/H, (h+1)·μ/H)`` of the tokens of the ``s``-th part of
  the sequence. Its forward runs the sequence-parallel equations on its heads (the ring of
  its ``seq`` dimension carries the keys and values of its own groups), and the head-parallel
  sum over ``heads``::

      Y[n τ i] = Σ over the ranks of heads of Z[n μ τ a] W_O[μ a i]  (μ the rank's heads,
                                                                       τ the rank's tokens)

The dimensions a layer is not sharded over are left alone, for data parallelism
(``torch.distributed.fsdp.fully_shard``). See docs/distributed.md.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh

from . import ring
from ._sharding import check_shardable
from .errors import EinattnError
from .head_parallel import (
    PLACEMENTS,
    HeadParallel,
    check_heads,
    gather_heads,
    place_heads,
    shard_heads,
)
from .module import MultiHeadAttention
from .sequence_parallel import (
    SequenceParallel,
    check_sequence,
    gather_sequence,
    place_sequence,
    shard_sequence,
    split_sequence,
)

__all__ = ["PLACEMENTS", "HeadParallel", "SequenceParallel", "gather_heads", "gather_sequence",
           "shard", "shard_heads", "shard_sequence", "split_sequence"]


def shard(layer: MultiHeadAttention, mesh: DeviceMesh, *, heads: str | None = None,
          sequence: str | None = None, layout: str = "zigzag") -> MultiHeadAttention:
    """Shard ``layer`` over the dimensions of ``mesh`` named ``heads`` and ``sequence``, in
    place; returns it, its parameter names unchanged.

    ``heads`` alone is :func:`shard_heads` on ``mesh[heads]``; ``sequence`` alone is
    :func:`shard_sequence` on ``mesh[sequence]``; both give each rank its heads of its
    tokens. Every rank of the mesh calls this, then calls the layer on its part of the
    sequence, ``split_sequence(x, mesh[sequence], layout=layout)`` (the same on every rank of
    a ``heads`` group), with its parts of ``key_padding_mask`` and ``document_ids``; it gets
    its tokens' outputs, which ``gather_sequence(y, mesh[sequence], layout=layout)`` puts in
    order. The parameters of the rank's heads are ``Shard(0)`` DTensors on ``mesh[heads]``;
    their gradients, and the others' (``b_O``; all of them without ``heads``), are the share
    of the rank's tokens: sum them over ``mesh[sequence]`` (an ``all_reduce`` on its group,
    or ``fully_shard`` on a mesh that holds that dimension with a gradient divide factor of
    1), never over the whole world, whose ``heads`` ranks hold the same tokens. The other
    dimensions of ``mesh`` are left alone, for ``fully_shard``, which comes after.
    """
    _check_dimensions(mesh, heads=heads, sequence=sequence)
    ring.check_layout(layout)
    check_shardable(layer, "shard")
    if heads is not None:
        check_heads(layer, mesh[heads])
    if sequence is not None:
        check_sequence(layer, layout)
    if heads is not None:  # every check passed: only now is the layer changed
        place_heads(layer, mesh[heads])
    if sequence is not None:
        place_sequence(layer, mesh[sequence], layout)
    return layer


def _check_dimensions(mesh, **dimensions) -> None:
    """``mesh`` has named dimensions; ``dimensions`` (heads, sequence) name one or two
    different ones of them."""
    if not isinstance(mesh, DeviceMesh):
        raise EinattnError(f"mesh must be a torch.distributed DeviceMesh, got "
                           f"{type(mesh).__name__}")
    names = mesh.mesh_dim_names
    if names is None:
        raise EinattnError("shard finds the mesh's dimensions by name, but this mesh has none: "
                           "init_device_mesh(..., mesh_dim_names=('heads', 'seq'))")
    given = {role: name for role, name in dimensions.items() if name is not None}
    listed = ", ".join(map(repr, names))
    if not given:
        raise EinattnError(f"shard needs heads= or sequence= (or both): the names of the mesh "
                           f"dimensions to split them over, among {listed}")
    for role, name in given.items():
        if not isinstance(name, str) or name not in names:
            raise EinattnError(f"{role}={name!r} is not a dimension of the mesh, whose "
                               f"dimensions are {listed}")
    if len(set(given.values())) < len(given):
        raise EinattnError(f"heads and sequence both name the mesh dimension "
                           f"{given['heads']!r}: each needs a dimension of its own")
