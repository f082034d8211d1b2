"""What head parallelism (:mod:`einattn.head_parallel`), sequence parallelism
(:mod:`einattn.sequence_parallel`) and the two on one mesh (:func:`einattn.parallel.shard`)
share: the checks of a layer and of a mesh, and the classes a sharded layer takes.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .errors import EinattnError
from .module import MultiHeadAttention


class Sharded:
    """What every parallelism adds to a layer's class: ``isinstance(layer, Sharded)`` tells
    whether a layer is sharded, and :meth:`already` says how."""

    def already(self) -> str:
        """How this layer is sharded, and what to do instead of sharding it again."""
        return "is already sharded: shard a fresh copy of it"


def check_shardable(layer, how: str) -> None:
    """An unsharded MultiHeadAttention whose heads lie in the one fused W, with no DTensor
    parameters (``fully_shard`` comes after)."""
    if not isinstance(layer, MultiHeadAttention):
        raise EinattnError(f"{how} needs an einattn.MultiHeadAttention, got "
                           f"{type(layer).__name__}")
    if layer.d_context is not None:
        raise EinattnError(f"{how} works on the fused W[(μ B a) i]; this layer projects a "
                           f"context of width d_context={layer.d_context} through W_Q and W_KV, "
                           f"which it does not shard yet")
    if isinstance(layer, Sharded):
        raise EinattnError(f"this layer {layer.already()}")
    distributed = [name for name, p in layer.named_parameters() if isinstance(p, DTensor)]
    if distributed:
        raise EinattnError(f"{how} needs the layer's own parameters, but {distributed[0]} is "
                           f"already a DTensor (fully_shard, or distribute_tensor): call {how} "
                           f"first, then fully_shard")


def check_mesh(device_mesh, how: str, which: str) -> None:
    """A 1-D DeviceMesh."""
    if not isinstance(device_mesh, DeviceMesh):
        raise EinattnError(f"device_mesh must be a torch.distributed DeviceMesh, got "
                           f"{type(device_mesh).__name__}")
    if device_mesh.ndim != 1:
        raise EinattnError(f"{how} needs a 1-D device mesh, got {device_mesh.ndim}-D "
                           f"{tuple(device_mesh.shape)}; pass {which}")


def dimension_of(device_mesh: DeviceMesh) -> str:
    """" (mesh dimension 'seq')" for a 1-D mesh with a name, "" for one without: what a
    message about its size adds."""
    names = device_mesh.mesh_dim_names
    return f" (mesh dimension {names[0]!r})" if names else ""


def described(device_mesh: DeviceMesh) -> str:
    """"a mesh of size 2 (mesh dimension 'seq')": a 1-D mesh, in a message."""
    return f"a mesh of size {device_mesh.size()}{dimension_of(device_mesh)}"


_CLASSES: dict[tuple[type, type], type] = {}


def parallel_class(kind: type, cls: type) -> type:
    """``<kind><cls>`` (``HeadParallelMultiHeadAttention``), a subclass of ``kind`` (what
    a parallelism adds) and ``cls``, made once."""
    if (kind, cls) not in _CLASSES:
        _CLASSES[kind, cls] = type(f"{kind.__name__}{cls.__name__}", (kind, cls), {})
    return _CLASSES[kind, cls]
