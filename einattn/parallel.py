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

import functools

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from . import composition, ring
from .errors import EinattnError
from .masks import alibi_slopes
from .module import MultiHeadAttention

__all__ = ["HeadParallel", "SequenceParallel", "gather_heads", "gather_sequence", "shard_heads",
           "shard_sequence", "split_sequence"]

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
    _check_shardable(layer, "shard_heads")
    _check_mesh(device_mesh, "shard_heads", "the head-parallel dimension, e.g. mesh['tp']")
    w = device_mesh.size()
    g, r = layer.n_kv_heads, layer.n_heads // layer.n_kv_heads
    if g % w:
        what = (f"index 'μ' has size n_heads={g}, so W[(μ B a) i] cannot give each rank "
                f"whole heads" if r == 1 else
                f"index 'g' has size n_kv_heads={g}, so W[(g C a) i] cannot give each rank "
                f"whole key/value groups (of r={r} query heads each)")
        raise EinattnError(f"{what}: {g} is not divisible by the mesh size {w}")
    for name, placement in PLACEMENTS.items():
        p = getattr(layer, name)
        if p is not None:
            setattr(layer, name, nn.Parameter(distribute_tensor(p.detach(), device_mesh,
                                                                [placement]),
                                              requires_grad=p.requires_grad))
    k = device_mesh.get_local_rank()
    layer.device_mesh = device_mesh
    layer.n_local_heads, layer.n_local_kv_heads = layer.n_heads // w, g // w
    layer.local_heads = range(k * layer.n_local_heads, (k + 1) * layer.n_local_heads)
    layer.__class__ = _parallel_class(HeadParallel, type(layer))
    layer.register_forward_pre_hook(HeadParallel._to_local_heads, with_kwargs=True)
    layer.register_forward_hook(HeadParallel._to_all_heads, prepend=True)  # before others
    return layer


def _check_shardable(layer, how: str) -> None:
    """An unsharded MultiHeadAttention whose heads lie in the one fused W."""
    if not isinstance(layer, MultiHeadAttention):
        raise EinattnError(f"{how} needs an einattn.MultiHeadAttention, got "
                           f"{type(layer).__name__}")
    if layer.d_context is not None:
        raise EinattnError(f"{how} works on the fused W[(μ B a) i]; this layer projects a "
                           f"context of width d_context={layer.d_context} through W_Q and W_KV, "
                           f"which it does not shard yet")
    if isinstance(layer, HeadParallel):
        raise EinattnError(f"this layer is already sharded by heads over a mesh of size "
                           f"{layer.device_mesh.size()}; gather_heads(layer) returns an "
                           f"unsharded copy")
    if isinstance(layer, SequenceParallel):
        raise EinattnError(f"this layer already runs sequence-parallel over a mesh of size "
                           f"{layer.device_mesh.size()}; shard a fresh copy of it")


def _check_mesh(device_mesh, how: str, which: str) -> None:
    """A 1-D DeviceMesh."""
    if not isinstance(device_mesh, DeviceMesh):
        raise EinattnError(f"device_mesh must be a torch.distributed DeviceMesh, got "
                           f"{type(device_mesh).__name__}")
    if device_mesh.ndim != 1:
        raise EinattnError(f"{how} needs a 1-D device mesh, got {device_mesh.ndim}-D "
                           f"{tuple(device_mesh.shape)}; pass {which}")


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


class HeadParallel:
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

    device_mesh: DeviceMesh
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
        ``context``, a float ``mask``), and a per-head mask cut to this rank's heads. The
        rest (``cache``, ``positions``, ...) reaches the layer's forward as it is."""
        args = tuple(_replicated(t, self.device_mesh) for t in args)
        kwargs = {k: _replicated(v, self.device_mesh) for k, v in kwargs.items()}
        if "mask" in kwargs:
            kwargs["mask"] = self._local_mask(kwargs["mask"])
        return args, kwargs

    def _to_all_heads(self, args: tuple, out):
        """Forward hook: "g", the sum over ranks of the partial ``Y``, then ``+ b_O``; the
        weights ``A`` (``need_weights``) or the per-head stages (``return_intermediates``)
        gathered over the mesh along their head axis."""
        mesh = self.device_mesh
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

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, mesh size={self.device_mesh.size()}, "
                f"local heads μ={self.local_heads.start}..{self.local_heads.stop - 1}")


_CLASSES: dict[tuple[type, type], type] = {}


def _parallel_class(kind: type, cls: type) -> type:
    """``<kind><cls>`` (``HeadParallelMultiHeadAttention``), a subclass of ``kind`` (what
    a parallelism adds) and ``cls``, made once."""
    if (kind, cls) not in _CLASSES:
        _CLASSES[kind, cls] = type(f"{kind.__name__}{cls.__name__}", (kind, cls), {})
    return _CLASSES[kind, cls]


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


# -- sequence parallelism: ring attention -----------------------------------------------------

def shard_sequence(layer: MultiHeadAttention, device_mesh: DeviceMesh, *,
                   layout: str = "zigzag") -> MultiHeadAttention:
    """Make ``layer`` run sequence-parallel (ring attention) over a 1-D ``device_mesh``, in
    place; returns it.

    Each rank then calls the layer on its own tokens, ``x`` of shape ``(n, L/R, d_model)``
    as :func:`split_sequence` cuts it (with that part of ``key_padding_mask``), and gets
    their outputs; :func:`gather_sequence` puts the outputs back in order. Equations (1) and
    (5) run on the rank's tokens alone; equations (2)–(4) run as ring attention
    (:mod:`einattn.ring`): the keys and values of the ``g`` key/value heads go round the
    ring, and their gradients come back the same way. RoPE turns each token at its global
    position, and the layer's ``window``, ``softcap``, ``alibi`` and ``sinks`` apply in the
    sequence's own positions. ``layout``: ``"zigzag"`` (rank k holds chunks k and 2R − 1 − k
    of 2R, which balances causal work) or ``"contiguous"`` (rank k holds chunk k of R).
    Parameters stay as they are, replicated: each rank's parameter gradients are its tokens'
    share, to be summed over ranks by DistributedDataParallel or an ``all_reduce``. Each
    pair of chunks runs the chunked path's tiles (``impl="chunked"``) or one tile
    (``impl="einsum"``).
    """
    _check_shardable(layer, "shard_sequence")
    if not layer.batch_first:
        raise EinattnError("shard_sequence cuts the tokens along dim 1 of x (n, L, d_model): "
                           "build the layer with batch_first=True")
    _check_mesh(device_mesh, "shard_sequence", "the sequence-parallel dimension, e.g. "
                "mesh['cp']")
    ring.check_layout(layout)
    if (layer.rope_scaling or {}).get("rope_type") == "dynamic":
        raise EinattnError("rope_scaling 'dynamic' scales by the longest position of the "
                           "call, which each rank sees differently: use another rope_type")
    layer.device_mesh, layer.layout = device_mesh, layout
    layer.ring = ring.Ring(device_mesh.get_group(), layout)
    layer.__class__ = _parallel_class(SequenceParallel, type(layer))
    return layer


def split_sequence(t: torch.Tensor, device_mesh: DeviceMesh, *, layout: str = "zigzag",
                   dim: int = 1) -> torch.Tensor:
    """This rank's part of a whole sequence ``t``: its chunks along ``dim``, in order."""
    _check_mesh(device_mesh, "split_sequence", "the sequence-parallel dimension")
    R, k = device_mesh.size(), device_mesh.get_local_rank()
    c = ring.check_length(t.shape[dim], R, ring.check_layout(layout), what=f"dim {dim} of t")
    return torch.cat([t.narrow(dim, j * c, c) for j in ring.chunks(k, R, layout)], dim=dim)


def gather_sequence(t: torch.Tensor, device_mesh: DeviceMesh, *, layout: str = "zigzag",
                    dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's part ``t`` (a collective: every rank calls it
    and gets the same tensor). Its backward gives each rank the gradient of its own part."""
    _check_mesh(device_mesh, "gather_sequence", "the sequence-parallel dimension")
    R = device_mesh.size()
    ring.check_layout(layout)
    dim = dim % t.ndim
    parts = DTensor.from_local(t, device_mesh, [Shard(dim)], run_check=False).full_tensor()
    c = ring.check_length(parts.shape[dim], R, layout, what=f"dim {dim} of the gathered t")
    held = [j for k in range(R) for j in ring.chunks(k, R, layout)]  # chunk order, by rank
    order = sorted(range(len(held)), key=held.__getitem__)
    return torch.cat([parts.narrow(dim, p * c, c) for p in order], dim=dim)


class SequenceParallel:
    """What :func:`shard_sequence` adds to a layer's class: a forward over this rank's
    tokens, whose attention is the ring's. ``isinstance(layer, SequenceParallel)`` tells
    whether a layer runs sequence-parallel."""

    device_mesh: DeviceMesh
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
        L = ring.check_length(x.shape[1] * self.ring.world, self.ring.world, self.layout,
                              what="the whole sequence (x's length × the mesh size)")
        _check_part("key_padding_mask", key_padding_mask, x, "bool")
        if _check_part("document_ids", document_ids, x, "integers"):
            document_ids = gather_sequence(document_ids, self.device_mesh, layout=self.layout)
        t = ring.positions(self.ring.rank, self.ring.world, x.shape[1], self.layout)
        call = composition.Call(key_padding_mask=key_padding_mask, pattern=pattern,
                                causal=spec.causal if causal is None else causal,
                                positions=t.to(x.device) if spec.rope else None,
                                document_ids=document_ids)
        block_size = _block_size(spec.impl, spec.block_size, L)
        return composition.multi_head(x, w, spec, call, functools.partial(
            _ring_attention, self.ring, block_size))

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, sequence over a mesh of size "
                f"{self.device_mesh.size()}, layout={self.layout!r}")



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
