"""``MultiHeadAttention``: the layer, holding ``W[(μ B a) i]`` and ``W_O[μ a i]``.

Everything about attention itself lives in :mod:`einattn.composition` (equations (1)–(5)
composed, from one :class:`~einattn.spec.Spec`); this module owns the parameters, their
initialisation, the layer's spec (its options, also attributes), argument checks at the
layer's boundary, and the conversions to and from PyTorch's ``nn.MultiheadAttention`` and
separate projections.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from . import _torch_mha, composition, layouts, rotary
from ._checks import check_factory, check_positive_int, refuse_is_causal
from .cache import KVCache
from .errors import EinattnError
from .spec import Spec


class Projections(NamedTuple):
    """The weights in ``nn.Linear`` layout ``(out, in)``, as reshape-based code keeps them."""

    W_q: torch.Tensor
    W_k: torch.Tensor
    W_v: torch.Tensor
    W_o: torch.Tensor
    b_q: torch.Tensor | None
    b_k: torch.Tensor | None
    b_v: torch.Tensor | None
    b_o: torch.Tensor | None


def _option(name: str) -> property:
    """An option of the layer, kept in its :attr:`~MultiHeadAttention.spec`; setting it
    makes a new spec, checked as the constructor checks it."""
    def get(self):
        return getattr(self._spec, name)

    def put(self, value) -> None:
        self.spec = self._spec.replace(**{name: value})
    return property(get, put, doc=f"``{name}``, kept in :attr:`spec`.")


class MultiHeadAttention(nn.Module):
    """Multi-head attention whose forward pass is equations (1)–(5) of docs/derivation.md.

    Parameters: ``W`` of shape ``(n_heads·3·d_head, d_model)``, meaning ``W[(μ B a) i]``
    (per head: its query, key and value rows, in that order); ``W_O`` of shape
    ``(n_heads, d_head, d_model)``, meaning ``W_O[μ a i]``; with ``bias=True`` also ``b``
    (layout ``(μ B a)``) and ``b_O`` (``d_model``). ``init="torch"`` follows
    ``nn.MultiheadAttention``; ``init="gpt2"`` draws weights from N(0, 0.02²).
    ``n_kv_heads`` makes it grouped-query attention (``W[(g C a) i]``); ``rope="half"`` or
    ``"interleaved"`` adds rotary position embeddings (:mod:`einattn.rotary`). ``pattern``:
    pieces of :mod:`einattn.patterns` (one, or a sequence) that every call applies, beside
    ``causal``, ``window``, ``softcap``, ``alibi`` and ``sinks``.
    ``batch_first=False`` takes and gives ``(L, n, d_model)``, as ``nn.MultiheadAttention``
    with ``batch_first=False`` does (masks, padding and weights keep einattn's indices).

    >>> layer = MultiHeadAttention(16, 4, causal=True)
    >>> layer(torch.randn(2, 5, 16)).shape
    torch.Size([2, 5, 16])
    """

    batch_first = True  # the default, for a layer pickled before the option existed

    def __init__(self, d_model: int, n_heads: int, *, d_head: int | None = None,
                 n_kv_heads: int | None = None, bias: bool = False, dropout: float = 0.0,
                 causal: bool = False, init: str = "torch", impl: str = "einsum",
                 block_size: int = 256, rope: str | None = None, rope_base: float = 10000.0,
                 rope_scaling: dict | None = None, rotary_dim: int | None = None,
                 scale: float | None = None, window: int | None = None,
                 softcap: float | None = None, alibi: bool = False, sinks: bool = False,
                 pattern=None, d_context: int | None = None, batch_first: bool = True,
                 device=None, dtype=None):
        super().__init__()
        d_head = _d_head(d_model, n_heads, d_head)
        self.d_model, self.n_heads, self.d_head = d_model, n_heads, d_head
        self.n_kv_heads, r = layouts.groups(n_heads, n_kv_heads)
        rows = self.n_kv_heads * (r + 2) * d_head
        self.spec = Spec(impl, block_size, dropout, scale, causal, window, softcap, pattern,
                         rope, rope_base, rope_scaling, rotary_dim)
        if rope is not None or rope_scaling is not None or rotary_dim is not None:
            rotary.check_options(rope, rope_base, rope_scaling, rotary_dim, d_head)
        for name, flag in (("alibi", alibi), ("sinks", sinks), ("batch_first", batch_first)):
            if not isinstance(flag, bool):
                raise EinattnError(f"{name} must be True or False, got {flag!r}")
        self.alibi, self.batch_first = alibi, batch_first
        if d_context is not None:
            check_positive_int("d_context", d_context)
        self.d_context = d_context
        self._make_parameters(rows, bias, sinks, check_factory(device, dtype))
        self.reset_parameters(init)

    @property
    def spec(self) -> Spec:
        """The layer's options (:class:`~einattn.spec.Spec`), made once and read by every
        call; each option is also an attribute (``layer.impl = "sdpa"`` makes a new spec)."""
        return self._spec

    @spec.setter
    def spec(self, spec: Spec) -> None:
        self._spec, self._inference = spec, spec.replace(dropout=0.0) if spec.dropout else spec

    impl = _option("impl")
    block_size = _option("block_size")
    dropout = _option("dropout")
    scale = _option("scale")
    causal = _option("causal")
    window = _option("window")
    softcap = _option("softcap")
    pattern = _option("pattern")
    rope = _option("rope")
    rope_base = _option("rope_base")
    rope_scaling = _option("rope_scaling")
    rotary_dim = _option("rotary_dim")

    def _call_spec(self, impl: str | None) -> Spec:
        """The spec of one call: without dropout outside training, with the call's impl."""
        spec = self._spec if self.training else self._inference
        return spec if impl is None or impl == spec.impl else spec.replace(impl=impl)

    def _make_parameters(self, rows: int, bias: bool, sinks: bool, kw: dict) -> None:
        """``W[(μ B a) i]`` (or ``W[(g C a) i]``), ``W_O[μ a i]``, the biases, the sinks.
        With a context of its own width ``j`` (``d_context``), ``W`` splits into
        ``W_Q[(μ a) i]`` and ``W_KV[(g B a) j]`` (:mod:`einattn.cross`), and ``b`` into
        ``b_Q``, ``b_KV``: no one weight can project two widths."""
        μ, a, i = self.n_heads, self.d_head, self.d_model
        kv = self.n_kv_heads * 2 * a
        projections = {"W": (rows, i)} if self.d_context is None else \
            {"W_Q": (μ * a, i), "W_KV": (kv, self.d_context)}
        for name, shape in projections.items():
            setattr(self, name, nn.Parameter(torch.empty(*shape, **kw)))
        self.W_O = nn.Parameter(torch.empty(μ, a, i, **kw))
        for name, (rows_of, _) in projections.items():  # b, or b_Q and b_KV
            bias_name = "b" + name[1:]
            setattr(self, bias_name, nn.Parameter(torch.empty(rows_of, **kw)) if bias else None)
        self.b_O = nn.Parameter(torch.empty(i, **kw)) if bias else None
        self.sinks = nn.Parameter(torch.empty(μ, **kw)) if sinks else None  # s[μ]
        if self.d_context is not None:  # read as None, as a layer without them is
            self.register_parameter("W", None)
            self.register_parameter("b", None)

    def reset_parameters(self, init: str = "torch") -> None:
        """``"torch"``: W xavier-uniform, W_O uniform(±1/√(μ·a)) as nn.Linear, biases 0
        (``nn.MultiheadAttention``'s scheme; ``W_Q`` and ``W_KV`` each xavier-uniform, as
        its separate projections are); ``"gpt2"``: weights N(0, 0.02²), biases 0. Sink
        logits ``s[μ]`` start at 0 either way."""
        weights = [self.W] if self.d_context is None else [self.W_Q, self.W_KV]
        biases = [self.b, self.b_O, self.sinks] if self.d_context is None \
            else [self.b_Q, self.b_KV, self.b_O, self.sinks]
        with torch.no_grad():
            if init == "torch":
                for W in weights:
                    nn.init.xavier_uniform_(W)
                bound = 1.0 / math.sqrt(self.n_heads * self.d_head)
                nn.init.uniform_(self.W_O, -bound, bound)
            elif init == "gpt2":
                for W in (*weights, self.W_O):
                    nn.init.normal_(W, std=0.02)
            else:
                raise EinattnError(f"init must be 'torch' or 'gpt2', got {init!r}")
            for bias in biases:
                if bias is not None:
                    bias.zero_()

    def extra_repr(self) -> str:
        grouped = f"n_kv_heads={self.n_kv_heads}, " if self.n_kv_heads != self.n_heads else ""
        return (f"d_model={self.d_model}, n_heads={self.n_heads}, {grouped}d_head={self.d_head}, "
                f"bias={self.b_O is not None}, dropout={self.dropout}, causal={self.causal}, "
                f"impl={self.impl!r}" + (f", rope={self.rope!r}" if self.rope else "")
                + "".join(f", {k}={getattr(self, k)!r}" for k in ("rope_scaling", "rotary_dim",
                                                                   "scale", "window", "softcap",
                                                                   "d_context")
                          if getattr(self, k) is not None)
                + (", alibi=True" if self.alibi else "")
                + (f", pattern={self.pattern!r}" if self.pattern else "")
                + (", sinks=True" if self.sinks is not None else "")
                + ("" if self.batch_first else ", batch_first=False"))

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, *,
                mask: torch.Tensor | None = None, key_padding_mask: torch.Tensor | None = None,
                causal: bool | None = None, need_weights: bool = False,
                return_intermediates: bool = False, impl: str | None = None,
                positions: torch.Tensor | None = None, cache: KVCache | None = None,
                document_ids: torch.Tensor | None = None, pattern=None, is_causal=None):
        """``Y[n τ i]`` from ``x`` ``(n, L_q, d_model)`` and optional ``context``
        ``(n, L_k, d_model)`` (``(L_q, n, d_model)``, ``(L_k, n, d_model)`` and a
        ``(L_q, n, d_model)`` output with ``batch_first=False``).

        ``mask``: bool (True = may attend) or float (added to the scores), shape (τ, σ),
        (n, τ, σ) or (n, μ, τ, σ). ``key_padding_mask``: bool ``(n, L_k)``, True = padding
        (ignored). ``causal`` overrides the constructor's; for L_q ≠ L_k it is aligned
        bottom-right. ``need_weights=True`` returns ``(Y, A)`` with the per-head weights
        ``A[n μ τ σ]`` as applied (after dropout). ``return_intermediates=True`` returns
        ``(Y, stages)``: a dict of every intermediate by its equation name
        (Q, K, V, S, A, Z, Y_μ, Y). ``impl`` overrides the constructor's ("einsum",
        "sdpa", "chunked", "flex", or "auto": per call the fastest of the four,
        :mod:`einattn.impls.auto`); all share the parameters and agree. ``positions``
        (``(L,)`` or ``(n, L)`` integers) places the tokens for RoPE; by default they follow
        the tokens already in ``cache``. With ``cache`` (a :class:`~einattn.KVCache`),
        this call's keys and values are appended to it and attention runs over all of it:
        with ``causal=True`` (here or in the constructor), ``layer(prompt, cache=c)`` then
        ``layer(next_token, cache=c)`` equals one causal forward over the whole sequence;
        ``key_padding_mask`` then marks the new keys (a :class:`~einattn.StaticKVCache`:
        the same with one shape for every call, for a compiled step). ``document_ids`` (integers
        ``(n, L)``, self-attention) packs several documents in one sequence: a token
        attends only within its own (with a cache, this call's tokens' ids). ``pattern``:
        pieces of :mod:`einattn.patterns` for this call, joined to the layer's own.
        ``is_causal`` (PyTorch's name) is refused: einattn's is ``causal``.
        """
        refuse_is_causal(is_causal)
        spec = self._call_spec(impl)
        w = self._attention_weights()
        self._check_input("x", x, w["W"])
        if self.d_context is not None:
            context = self._own_context(x, context)
        if context is not None:
            self._check_input("context", context, w["W"], self.d_context)
        if not self.batch_first:  # (L, n, d): the equations read X[n τ i]
            x, context = x.transpose(0, 1), None if context is None else context.transpose(0, 1)
        out = composition.multi_head(x, w, spec, composition.Call(
            context, mask, key_padding_mask, spec.causal if causal is None else causal, pattern,
            positions, cache, document_ids, need_weights, return_intermediates))
        return out if self.batch_first else _sequence_first(out)

    def _attention_weights(self) -> dict:
        """What forward hands :func:`einattn.composition.multi_head`: the parameters
        and head counts (:mod:`einattn.parallel` substitutes one rank's shards).

        A parameter is read from ``_parameters``, where ``nn.Module`` keeps it and
        ``torch.func.functional_call`` swaps it (why not as an attribute: docs/performance.md,
        "How the fast paths are fast"); a weight that is not kept there is read as its
        attribute: a parametrized one (``torch.nn.utils.parametrize``, ``weight_norm``), a
        pruned one, FSDP's views, ``nn.DataParallel``'s replicas."""
        p = self._parameters  # W_KV, b_KV: not asked of a fused layer, whose getattr would
        # raise and catch an AttributeError inside nn.Module on every call
        W, b, W_O, b_O, sinks, W_KV, b_KV = [
            None if name is None else p[name] if name in p else getattr(self, name, None)
            for name in (_FUSED if self.d_context is None else _SPLIT)]
        return {"W": W, "W_O": W_O, "b": b, "b_O": b_O, "sinks": sinks, "alibi": self.alibi,
                "W_KV": W_KV, "b_KV": b_KV, "n_heads": self.n_heads,
                "n_kv_heads": self.n_kv_heads}

    def _own_context(self, x: torch.Tensor, context):
        """The context a ``d_context`` layer projects through ``W_KV``: ``x`` itself where
        none is given and ``x`` has the context's width."""
        if context is not None:
            return context
        if self.d_context != self.d_model:
            raise EinattnError(f"this layer reads its keys and values from a context "
                               f"C[n σ j] of width j = d_context = {self.d_context} through "
                               f"W_KV[(g B a) j]: pass context=")
        return x

    def _check_input(self, name: str, t: torch.Tensor, W: torch.Tensor,
                     d_context: int | None = None) -> None:
        """``t`` is ``(n, L, d_model)``, or a ``d_context`` layer's context ``(n, L,
        d_context)``, in the dtype and on the device of the layer's weights."""
        if not isinstance(t, torch.Tensor):
            raise EinattnError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        width, size, index, weight = ("d_model", self.d_model, "i", "W") if d_context is None \
            else ("d_context", d_context, "j", "W_KV")
        if t.ndim != 3 or t.shape[-1] != size:
            raise EinattnError(f"{name} has shape {tuple(t.shape)} but the layer expects "
                               f"({'n, L' if self.batch_first else 'L, n'}, {width}={size}) "
                               f"(index {index!r} has size {size} in {weight})")
        if t.dtype != W.dtype:
            raise EinattnError(f"{name} is {t.dtype} but the layer's W is {W.dtype}; "
                               f"convert one with .to()")
        if t.device != W.device:
            raise EinattnError(f"{name} is on {t.device} but the layer's W is on {W.device}; "
                               f"move one with .to()")

    # -- conversions ---------------------------------------------------------------------

    @classmethod
    def from_projections(cls, W_q, W_k, W_v, W_o, *, n_heads: int, n_kv_heads: int | None = None,
                         b_q=None, b_k=None, b_v=None, b_o=None,
                         **layer_options) -> MultiHeadAttention:
        """A layer from ``nn.Linear``-layout weights ``W_q: ((μ a), i)``, ``W_k, W_v:
        ((g a), j)`` and ``W_o: (i, (μ a))``, the form every reshape-based implementation
        keeps. ``n_kv_heads`` defaults to what ``W_k``'s rows imply (``n_heads`` without
        grouped-query attention); ``j`` (``W_k``'s columns) other than ``i`` makes a
        ``d_context`` layer, whose keys and values come from a context of that width."""
        check_positive_int("n_heads", n_heads)
        if not isinstance(W_q, torch.Tensor) or W_q.ndim != 2:
            shape = tuple(W_q.shape) if isinstance(W_q, torch.Tensor) else type(W_q).__name__
            raise EinattnError(f"W_q must be a 2-D weight W_q[(μ a) i], got {shape}")
        rows, d_model = W_q.shape
        if rows % n_heads:
            raise EinattnError(f"W_q has {rows} rows, not divisible by n_heads={n_heads}")
        d_head = rows // n_heads
        keys_2d = isinstance(W_k, torch.Tensor) and W_k.ndim == 2
        if n_kv_heads is None and keys_2d:
            n_kv_heads = max(1, W_k.shape[0] // d_head)
        g, _ = layouts.groups(n_heads, n_kv_heads)
        kv, j = g * d_head, W_k.shape[1] if keys_2d else d_model
        expected = {"W_k": (W_k, "[(g a) j]", (kv, j)), "W_v": (W_v, "[(g a) j]", (kv, j)),
                    "W_o": (W_o, "[i (μ a)]", (d_model, rows)),
                    "b_q": (b_q, "[(μ a)]", (rows,)), "b_k": (b_k, "[(g a)]", (kv,)),
                    "b_v": (b_v, "[(g a)]", (kv,)), "b_o": (b_o, "[i]", (d_model,))}
        for name, (t, pattern, want) in expected.items():
            if t is not None and tuple(t.shape) != want:
                raise EinattnError(f"{name} has shape {tuple(t.shape)} but {name}{pattern} needs "
                                   f"{want}: from W_q, i = d_model = {d_model} and "
                                   f"(μ a) = {rows}; (g a) = {kv}; from W_k, j = {j}")
        _check_fixed("from_projections", layer_options)
        layer = cls(d_model, n_heads, d_head=d_head, n_kv_heads=g,
                    bias=any(v is not None for v in (b_q, b_k, b_v, b_o)),
                    d_context=None if j == d_model else j, device=W_q.device,
                    dtype=W_q.dtype, **layer_options)
        layer._load(W_q, W_k, W_v, W_o, b_q, b_k, b_v, b_o)
        return layer

    def _load(self, W_q, W_k, W_v, W_o, b_q, b_k, b_v, b_o) -> None:
        """Copy ``nn.Linear``-layout weights in; a bias not given is zero where the layer
        has biases."""
        with torch.no_grad():
            self._load_qkv(("W", "W_Q", "W_KV"), W_q, W_k, W_v)
            self.W_O.copy_(layouts.W_O_from_linear(W_o, n_heads=self.n_heads))
            if self.b_O is not None:
                b_q, b_k, b_v = (w.new_zeros(w.shape[0]) if t is None else t
                                 for t, w in ((b_q, W_q), (b_k, W_k), (b_v, W_v)))
                self._load_qkv(("b", "b_Q", "b_KV"), b_q, b_k, b_v)
                self.b_O.copy_(W_o.new_zeros(self.d_model) if b_o is None else b_o)

    def _load_qkv(self, names: tuple[str, str, str], q, k, v) -> None:
        """Query, key and value rows into ``W[(g C a) i]``, or into ``W_Q[(μ a) i]`` and
        ``W_KV[(g B a) j]`` (or the biases named so)."""
        fused, query, key_value = names
        if self.d_context is None:
            getattr(self, fused).copy_(layouts.fuse_qkv(q, k, v, n_heads=self.n_heads,
                                                        n_kv_heads=self.n_kv_heads))
            return
        getattr(self, query).copy_(q)
        g = self.n_kv_heads
        getattr(self, key_value).copy_(
            torch.stack([torch.unflatten(t, 0, (g, -1)) for t in (k, v)], 1).flatten(0, 2))

    @classmethod
    def from_fused(cls, W: torch.Tensor, W_O: torch.Tensor, b: torch.Tensor | None = None,
                   b_O: torch.Tensor | None = None, *, n_kv_heads: int | None = None,
                   **layer_options) -> MultiHeadAttention:
        """A layer holding copies of einattn's own weights: ``W[(μ B a) i]`` (or
        ``W[(g C a) i]`` with ``n_kv_heads``), ``W_O[μ a i]`` and the biases ``b``, ``b_O``
        (None for no bias; one given alone makes the other zero); ``n_heads``, ``d_head`` and
        ``d_model`` are read from ``W_O``."""
        n_heads, d_head, d_model = layouts.fused_sizes(W_O)
        _check_fixed("from_fused", layer_options)
        layouts.check_fused(W, b, W_O, b_O, *layouts.groups(n_heads, n_kv_heads))
        layer = cls(d_model, n_heads, d_head=d_head, n_kv_heads=n_kv_heads,
                    bias=b is not None or b_O is not None, device=W_O.device, dtype=W_O.dtype,
                    **layer_options)
        with torch.no_grad():  # a bias not given stays as initialised: zero
            for name, t in {"W": W, "W_O": W_O, "b": b, "b_O": b_O}.items():
                if t is not None:
                    getattr(layer, name).copy_(t)
        return layer

    def projections(self) -> Projections:
        """The inverse of :meth:`from_projections`: detached copies, in ``nn.Linear`` layout."""
        W_q, W_k, W_v = self._qkv("W", "W_Q", "W_KV")
        W_o = layouts.W_O_to_linear(self.W_O.detach())
        b_q = b_k = b_v = b_o = None
        if self.b_O is not None:
            b_q, b_k, b_v = self._qkv("b", "b_Q", "b_KV")
            b_o = self.b_O.detach()
        return Projections(*(None if t is None else t.clone()
                             for t in (W_q, W_k, W_v, W_o, b_q, b_k, b_v, b_o)))

    def _qkv(self, *names: str) -> tuple[torch.Tensor, ...]:
        """The query, key and value rows (``nn.Linear`` layout) of ``W`` or of ``W_Q`` and
        ``W_KV`` (or of the biases named so), detached."""
        fused, query, key_value = (getattr(self, name, None) for name in names)
        if self.d_context is None:
            return layouts.split_qkv(fused.detach(), n_heads=self.n_heads,
                                     n_kv_heads=self.n_kv_heads)
        K, V = torch.unflatten(key_value.detach(), 0, (self.n_kv_heads, 2, -1)).unbind(1)
        return query.detach(), K.flatten(0, 1), V.flatten(0, 1)

    @classmethod
    def from_torch(cls, mha: nn.MultiheadAttention, **layer_options) -> MultiHeadAttention:
        """An equivalent layer from ``nn.MultiheadAttention``: its weights, bias or none, its
        dropout and its ``batch_first`` (``layer_options`` override them); ``kdim = vdim``
        other than ``embed_dim`` makes a ``d_context`` layer."""
        return _torch_mha.from_torch(cls, mha, layer_options)

    def to_torch(self) -> nn.MultiheadAttention:
        """An equivalent ``nn.MultiheadAttention`` (this layer's ``batch_first``, dtype and
        device); a layer it cannot express is refused, naming the option."""
        return _torch_mha.to_torch(self)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        """``nn.Module``'s loading, after refusing an ``nn.MultiheadAttention`` state dict,
        whose keys name another layout (convert that module with :meth:`from_torch`)."""
        own = [name for name, p in self._parameters.items() if p is not None]
        _torch_mha.refuse_torch_state(state_dict, prefix, own)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)


# what _attention_weights reads, as W, b, W_O, b_O, sinks, W_KV, b_KV: a fused layer's W
# and b, or a d_context layer's W_Q, b_Q, W_KV and b_KV
_FUSED = ("W", "b", "W_O", "b_O", "sinks", None, None)
_SPLIT = ("W_Q", "b_Q", "W_O", "b_O", "sinks", "W_KV", "b_KV")


def _sequence_first(out):
    """The output of a ``batch_first=False`` layer: ``Y`` as ``(L, n, d_model)`` (a view);
    the weights and intermediates beside it keep einattn's indices."""
    if isinstance(out, tuple):
        return (out[0].transpose(0, 1), *out[1:])
    return out.transpose(0, 1)


def _check_fixed(method: str, layer_options: dict) -> None:
    fixed = {"d_model", "n_heads", "d_head", "bias", "device", "dtype",
             "d_context"} & set(layer_options)
    if fixed:
        raise EinattnError(f"{method} takes {', '.join(sorted(fixed))} from the weights; pass "
                           f".to(...) on the result to change dtype or device")


def _d_head(d_model: int, n_heads: int, d_head: int | None) -> int:
    check_positive_int("d_model", d_model)
    check_positive_int("n_heads", n_heads)
    if d_head is not None:
        check_positive_int("d_head", d_head)
        return d_head
    if d_model % n_heads:
        raise EinattnError(f"d_model={d_model} is not divisible by n_heads={n_heads}: index "
                           f"'a' would have size {d_model}/{n_heads}; pass d_head explicitly")
    return d_model // n_heads
