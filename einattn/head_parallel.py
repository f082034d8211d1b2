"""Head parallelism on ``torch.distributed``: each rank of a device mesh holds whole heads.

Megatron's tensor parallelism splits attention by heads. In einattn's layout that split is
a contiguous slice, because the fused weight ``W[(μ B a) i]`` keeps every head's query,
key and value rows together (with grouped-query attention ``W[(g C a) i]`` keeps every
key/value group together): on a mesh of size w, rank k holds rows
``[k·rows/w, (k+1)·rows/w)``, which are heads ``μ ∈ [k·μ/w, (k+1)·μ/w)`` complete. The
output weight ``W_O[μ a i]`` splits along the same μ, and equation (5) becomes a sum of
per-rank partial outputs::

    Y[n τ i] = Σ_ranks Z[n μ τ a] W_O[μ a i]   (μ running over the rank's own heads)

So each rank runs the layer's own forward (:func:`einattn.composition.multi_head`
unchanged) on its local shards and ``n_heads / w`` heads, and one all-reduce sums the
partial ``Y``. In backward the gradient of the input ``X[n τ i]`` is summed over ranks the
same way (Megatron's "f" and "g" operators). All of it is ``torch.distributed.tensor``: the
parameters are DTensors (``W``, ``b`` and ``W_O`` ``Shard(0)``, ``b_O`` ``Replicate()``),
the partial output is a ``Partial()`` DTensor made ``Replicate()`` (the all-reduce), and the
input is a ``Replicate()`` DTensor whose gradient is ``Partial()`` (the all-reduce in
backward). RoPE turns each head on its own, and a :class:`~einattn.KVCache` holds what the
rank's forward appends to it: the keys and values ``K[n g σ a]`` of its own groups only.
See docs/distributed.md.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from . import patterns
from ._sharding import (
    Sharded,
    check_mesh,
    check_shardable,
    described,
    dimension_of,
    parallel_class,
)
from .errors import EinattnError
from .masks import alibi_slopes
from .module import MultiHeadAttention

__all__ = ["PLACEMENTS", "HeadParallel", "check_heads", "gather_heads", "place_heads",
           "shard_heads"]

# Where each parameter lives on the mesh: the rows of W[(μ B a) i] and b[(μ B a)], and the
# heads of W_O[μ a i], are split in contiguous blocks (whole heads); b_O[i] is everywhere.
PLACEMENTS = {"W": Shard(0), "b": Shard(0), "W_O": Shard(0), "b_O": Replicate(),
              "sinks": Shard(0)}


def shard_heads(layer: MultiHeadAttention, device_mesh: DeviceMesh) -> MultiHeadAttention:
    """Split ``layer``'s heads over the ranks of a 1-D ``device_mesh``, in place; returns it.

    Rank k keeps heads ``μ ∈ [k·μ/w, (k+1)·μ/w)`` of a mesh of size w (with grouped-query
    attention, whole key/value groups ``g``): rows of ``W[(μ B a) i]`` and ``b``, and heads
    of ``W_O[μ a i]``, as ``Shard(0)`` DTensors; ``b_O`` is ``Replicate()``. Rank 0's
    parameters are the source (``distribute_tensor`` scatters them). Every rank must call
    this, and then call the layer with the same inputs; each gets the output of the whole
    layer. ``layer.n_heads`` stays the global count; ``layer.n_local_heads``,
    ``layer.n_local_kv_heads`` and ``layer.local_heads`` (a ``range`` of global μ) describe
    this rank's share. The layer's forward keeps all its arguments: with
    ``need_weights`` or ``return_intermediates`` the per-head tensors are gathered over the
    mesh, so they too equal the unsharded layer's; a ``cache`` (one
    :class:`~einattn.KVCache` per rank) holds the keys and values of the rank's own groups,
    ``K[n g σ a]`` with ``n_local_kv_heads`` groups; ``rope`` and ``positions`` work as on
    one device. Call the layer, not ``layer.forward``: the sum over ranks is a forward hook.
    """
    check_shardable(layer, "shard_heads")
    check_mesh(device_mesh, "shard_heads", "the head-parallel dimension, e.g. mesh['tp']")
    check_heads(layer, device_mesh)
    return place_heads(layer, device_mesh)


def check_heads(layer: MultiHeadAttention, device_mesh: DeviceMesh) -> None:
    """The mesh's size w divides the heads μ, or with grouped-query attention the key/value
    groups g, so that each rank gets whole ones."""
    w = device_mesh.size()
    g, r = layer.n_kv_heads, layer.n_heads // layer.n_kv_heads
    if g % w:
        what = (f"index 'μ' has size n_heads={g}, so W[(μ B a) i] cannot give each rank "
                f"whole heads" if r == 1 else
                f"index 'g' has size n_kv_heads={g}, so W[(g C a) i] cannot give each rank "
                f"whole key/value groups (of r={r} query heads each)")
        raise EinattnError(f"{what}: {g} is not divisible by the mesh size {w}"
                           f"{dimension_of(device_mesh)}")


def place_heads(layer: MultiHeadAttention, device_mesh: DeviceMesh) -> MultiHeadAttention:
    """:func:`shard_heads` once its checks have passed: the parameters made DTensors on the
    1-D ``device_mesh``, the class and the hooks of :class:`HeadParallel`."""
    for name, placement in PLACEMENTS.items():
        p = getattr(layer, name)
        if p is not None:
            setattr(layer, name, nn.Parameter(distribute_tensor(p.detach(), device_mesh,
                                                                [placement]),
                                              requires_grad=p.requires_grad))
    w, k = device_mesh.size(), device_mesh.get_local_rank()
    layer.heads_mesh = device_mesh
    layer.n_local_heads, layer.n_local_kv_heads = layer.n_heads // w, layer.n_kv_heads // w
    layer.local_heads = range(k * layer.n_local_heads, (k + 1) * layer.n_local_heads)
    layer.__class__ = parallel_class(HeadParallel, type(layer))
    layer.register_forward_pre_hook(HeadParallel._to_local_heads, with_kwargs=True)
    layer.register_forward_hook(HeadParallel._to_all_heads, prepend=True)  # before others
    return layer


def gather_heads(layer: MultiHeadAttention) -> MultiHeadAttention:
    """An unsharded ``MultiHeadAttention`` with the full parameters of a sharded ``layer``
    (every rank gets the same copy; a collective, so every rank must call it). For saving
    a single-device checkpoint, :meth:`~MultiHeadAttention.projections` or
    :meth:`~MultiHeadAttention.to_torch`."""
    if not isinstance(layer, HeadParallel):
        raise EinattnError(f"gather_heads needs a layer sharded by shard_heads, got "
                           f"{type(layer).__name__}")
    full = {name: None if p is None else p.detach().full_tensor()
            for name, p in ((n, getattr(layer, n)) for n in PLACEMENTS)}
    plain = MultiHeadAttention(
        layer.d_model, layer.n_heads, d_head=layer.d_head, n_kv_heads=layer.n_kv_heads,
        bias=layer.b is not None, dropout=layer.dropout, causal=layer.causal,
        impl=layer.impl, block_size=layer.block_size, rope=layer.rope,
        rope_base=layer.rope_base, rope_scaling=layer.rope_scaling, rotary_dim=layer.rotary_dim,
        scale=layer.scale, window=layer.window, softcap=layer.softcap, alibi=layer.alibi,
        sinks=layer.sinks is not None, pattern=layer.pattern, batch_first=layer.batch_first,
        device=full["W"].device, dtype=full["W"].dtype)
    with torch.no_grad():
        for name, t in full.items():
            if t is not None:
                getattr(plain, name).copy_(t)
    return plain.train(layer.training)


class HeadParallel(Sharded):
    """What :func:`shard_heads` adds to a layer's class: this rank's weights and heads.

    Not constructed directly: ``shard_heads`` changes a layer's class to a subclass of this
    and of its own class (as ``torch.distributed.fsdp.fully_shard`` does), so
    ``isinstance(layer, HeadParallel)`` tells whether a layer is sharded. The layer keeps
    its own ``forward``, with every argument it has; only :meth:`_attention_weights`
    changes (this rank's shards and head counts), and two forward hooks, registered by
    ``shard_heads``, carry Megatron's operators: :meth:`_to_local_heads` before the forward
    ("f" on the inputs, per-head masks cut to this rank's heads) and
    :meth:`_to_all_heads` after it ("g", the sum over ranks, then ``b_O``; per-head
    outputs gathered).
    """

    heads_mesh: DeviceMesh
    n_local_heads: int
    n_local_kv_heads: int
    local_heads: range

    def _attention_weights(self) -> dict:
        """This rank's shards of ``W``, ``b``, ``W_O`` and the sinks, its heads' ALiBi slopes
        and its head counts: equations (1)–(4) and the rank's terms of (5). No ``b_O``: it
        is added once, after the sum."""
        local = self.local_heads
        alibi = self.alibi and alibi_slopes(self.n_heads, dtype=self.W.dtype,
                                            device=self.W.device)[local.start:local.stop]
        return {"W": self.W.to_local(), "W_O": self.W_O.to_local(),
                "b": None if self.b is None else self.b.to_local(), "b_O": None,
                "sinks": None if self.sinks is None else self.sinks.to_local(),
                "alibi": alibi, "W_KV": None, "b_KV": None, "n_heads": self.n_local_heads,
                "n_kv_heads": self.n_local_kv_heads}

    def _to_local_heads(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Forward pre-hook: "f" on every input that requires a gradient (``x``,
        ``context``, a float ``mask``), and a per-head mask cut to this rank's heads; the
        layer's and the call's pieces of ``pattern`` checked to read no head index. The
        rest (``cache``, ``positions``, ...) reaches the layer's forward as it is."""
        _check_heads_free(self.pattern + patterns.pieces_of(kwargs.get("pattern")),
                          self.local_heads, self.W.device)
        args = tuple(_replicated(t, self.heads_mesh) for t in args)
        kwargs = {k: _replicated(v, self.heads_mesh) for k, v in kwargs.items()}
        if "mask" in kwargs:
            kwargs["mask"] = self._local_mask(kwargs["mask"])
        return args, kwargs

    def _to_all_heads(self, args: tuple, out):
        """Forward hook: "g", the sum over ranks of the partial ``Y``, then ``+ b_O``; the
        weights ``A`` (``need_weights``) or the per-head stages (``return_intermediates``)
        gathered over the mesh along their head axis."""
        mesh = self.heads_mesh
        Y_part, extra = out if isinstance(out, tuple) else (out, None)
        Y = _sum_over_ranks(Y_part, mesh)
        if self.b_O is not None:
            Y = Y + self.b_O.to_local()
        if extra is None:
            return Y
        if isinstance(extra, dict):
            return Y, {name: Y if name == "Y" else _gather_heads(t, mesh)
                       for name, t in extra.items()}
        return Y, _gather_heads(extra, mesh)

    def _local_mask(self, mask):
        """A per-head mask ``(n, μ, τ, σ)`` cut to this rank's heads; others pass as they are
        (the local check in einattn.composition sees them)."""
        if not isinstance(mask, torch.Tensor) or mask.ndim != 4 or mask.shape[1] == 1:
            return mask
        if mask.shape[1] != self.n_heads:
            raise EinattnError(f"mask has shape {tuple(mask.shape)}: index 'μ' has size "
                               f"{mask.shape[1]} in mask but {self.n_heads} in the scores "
                               f"S[n μ τ σ] (all heads, before sharding)")
        return mask[:, self.local_heads.start:self.local_heads.stop]

    def projections(self):
        """The full weights in ``nn.Linear`` layout, gathered from every rank (a
        collective: every rank must call it)."""
        return gather_heads(self).projections()

    def already(self) -> str:
        return f"is already sharded by heads over {described(self.heads_mesh)}; gather_heads" \
            "(layer) returns an unsharded copy"

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, mesh size={self.heads_mesh.size()}, "
                f"local heads μ={self.local_heads.start}..{self.local_heads.stop - 1}")


def _check_heads_free(pieces: tuple, local: range, device) -> None:
    """No piece of ``pattern`` reads the head index μ, which on this rank counts its own
    heads from 0 (the layer's ``local``): neither a sink nor ALiBi's slopes (the layer's
    ``sinks=`` and ``alibi=`` go with their heads) nor a function or predicate of μ."""
    if torch.compiler.is_compiling():
        return
    for piece in pieces:
        if _reads_head(piece, device):
            raise EinattnError(
                f"the pattern piece {piece!r} reads the head index μ, but on a head-sharded "
                f"layer μ counts the rank's own heads from 0 (here the layer's heads "
                f"{local.start}..{local.stop - 1}): give ALiBi and sinks as the layer's "
                f"alibi= and sinks=, which go with their heads; write a piece of one's own "
                f"for each rank's heads, or shard by the sequence alone")


def _reads_head(piece, device) -> bool:
    """Whether ``piece`` reads μ: a sink, ALiBi's slopes, or a piece whose value (a mask's
    ``allowed``, a function's own) at μ = 0, 1 runs along μ."""
    if piece.KIND == "sink" or isinstance(piece, patterns.ALiBi):
        return True
    zero = torch.zeros((1, 1, 1, 1), dtype=torch.long, device=device)
    mu = torch.arange(2, device=device).view(1, 2, 1, 1)
    with torch.no_grad():
        out = piece.allowed(zero, mu, zero + 1, zero) if piece.KIND == "mask" else \
            getattr(piece, "fn", piece.score)(zero.double(), zero, mu, zero + 1, zero)
    return isinstance(out, torch.Tensor) and out.ndim == 4 and out.shape[1] == 2


def _replicated(t, mesh: DeviceMesh):
    """Megatron's "f" for an input that needs a gradient: the same tensor on every rank,
    whose gradient (one partial sum per rank, from its heads) is all-reduced in backward.
    Anything else (None, a boolean mask, a tensor without grad) passes as it is."""
    if not isinstance(t, torch.Tensor) or not t.requires_grad:
        return t
    return DTensor.from_local(t, mesh, [Replicate()], run_check=False) \
        .to_local(grad_placements=[Partial()])


def _sum_over_ranks(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Megatron's "g": the sum over ranks of each rank's partial ``t`` (an all-reduce); the
    gradient, the same on every rank, passes back unchanged."""
    return DTensor.from_local(t, mesh, [Partial()], run_check=False).full_tensor()


def _gather_heads(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Every rank's heads (axis 1 of ``[n μ ...]`` or ``[n g ...]``), in order: an
    all-gather, whose backward keeps this rank's slice of the gradient."""
    return DTensor.from_local(t, mesh, [Shard(1)], run_check=False).full_tensor()
