"""``MultiHeadAttention``: the layer, holding ``W[(μ B a) i]`` and ``W_O[μ a i]``.

Everything about attention itself lives in :mod:`einattn.composition` (equations (1)–(5)
composed, from one :class:`~einattn.spec.Spec`); this module owns the parameters, their
initialisation, the layer's spec (its options, also attributes), argument checks at the
layer's boundary, and the conversions to and from PyTorch's ``nn.MultiheadAttention`` and
separate projections.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from . import _decode, _layer_weights, _torch_mha, composition, layouts, rotary
from ._checks import check_factory, check_positive_int, refuse_is_causal
from .cache import KVCache
from .differential import Differential, check_heads
from .errors import EinattnError
from .qk_norm import QKNorm
from .spec import Spec
from .temperature import Temperature


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


def _fixed(name: str) -> property:
    """An option of the layer that its weights depend on, kept in its :attr:`spec`, read
    only (a layer with another is made anew)."""
    return property(lambda self: getattr(self._spec, name), doc=f"``{name}``, kept in "
                    f":attr:`spec`; fixed with the weights it has.")


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

    The attention of today's models (docs/models.md): ``d_value`` (b) values wider or
    narrower than the queries and keys (``W[(g e) i]``, ``e = (r a | a | b)``, and
    ``W_O[μ b i]``); ``qk_norm`` (:class:`~einattn.qk_norm.QKNorm`: gains ``gamma_Q``,
    ``gamma_K``); ``gate`` (an output gate, ``W_G[(μ b) i]``); ``differential``
    (:class:`~einattn.differential.Differential`: ``lambda_q1`` … ``lambda_k2``);
    ``temperature`` (:class:`~einattn.temperature.Temperature`); ``nn.MultiheadAttention``'s
    ``bias_kv`` (``bias_k[(g a)]``, ``bias_v[(g b)]``) and ``zero_attn``; and
    ``d_context=(j, k)``, keys and values from contexts of two widths.

    >>> layer = MultiHeadAttention(16, 4, causal=True)
    >>> layer(torch.randn(2, 5, 16)).shape
    torch.Size([2, 5, 16])
    """

    batch_first = True  # the default, for a layer pickled before the option existed
    _extras = ()  # the options' weights, by name: none in a layer pickled before them

    def __init__(self, d_model: int, n_heads: int, *, d_head: int | None = None,
                 n_kv_heads: int | None = None, bias: bool = False, dropout: float = 0.0,
                 causal: bool = False, init: str = "torch", impl: str = "einsum",
                 block_size: int = 256, rope: str | None = None, rope_base: float = 10000.0,
                 rope_scaling: dict | None = None, rotary_dim: int | None = None,
                 scale: float | None = None, window: int | None = None,
                 softcap: float | None = None, alibi: bool = False, sinks: bool = False,
                 pattern=None, d_context: int | tuple[int, int] | None = None,
                 batch_first: bool = True, d_value: int | None = None,
                 qk_norm: QKNorm | None = None, gate: bool = False,
                 differential: Differential | None = None,
                 temperature: Temperature | None = None, bias_kv: bool = False,
                 zero_attn: bool = False, device=None, dtype=None):
        super().__init__()
        d_head = _d_head(d_model, n_heads, d_head)
        self.d_model, self.n_heads, self.d_head = d_model, n_heads, d_head
        self.n_kv_heads, _ = layouts.groups(n_heads, n_kv_heads)
        self.d_value = d_head if d_value is None else check_positive_int("d_value", d_value)
        self.spec = Spec(impl, block_size, dropout, scale, causal, window, softcap, pattern,
                         rope, rope_base, rope_scaling, rotary_dim, qk_norm, temperature,
                         differential, gate, bias_kv, zero_attn)
        if differential is not None:
            check_heads(n_heads, self.n_kv_heads)
        if rope is not None or rope_scaling is not None or rotary_dim is not None:
            rotary.check_options(rope, rope_base, rope_scaling, rotary_dim, d_head)
        for name, flag in (("alibi", alibi), ("sinks", sinks), ("batch_first", batch_first)):
            if not isinstance(flag, bool):
                raise EinattnError(f"{name} must be True or False, got {flag!r}")
        if sinks and zero_attn:
            raise EinattnError("zero_attn is a sink of logit 0 for every head, and sinks=True "
                               "learns one: a pattern has one sink logit s[μ] per head")
        self.alibi, self.batch_first = alibi, batch_first
        self.d_context = _d_context(d_context)
        _layer_weights.make(self, bias, sinks, check_factory(device, dtype))
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
    qk_norm = _fixed("qk_norm")
    gate = _fixed("gate")
    differential = _fixed("differential")
    temperature = _fixed("temperature")
    bias_kv = _fixed("bias_kv")
    zero_attn = _fixed("zero_attn")

    def _call_spec(self, impl: str | None) -> Spec:
        """The spec of one call: without dropout outside training, with the call's impl."""
        spec = self._spec if self.training else self._inference
        return spec if impl is None or impl == spec.impl else spec.replace(impl=impl)

    def reset_parameters(self, init: str = "torch") -> None:
        """``"torch"``: W xavier-uniform, W_O uniform(±1/√(μ·b)) as nn.Linear, biases 0
        (``nn.MultiheadAttention``'s scheme; ``W_Q`` and ``W_KV`` each xavier-uniform, as
        its separate projections are); ``"gpt2"``: weights N(0, 0.02²), biases 0. Sink
        logits ``s[μ]`` start at 0 either way; the options' weights as
        :func:`einattn._layer_weights.reset` says."""
        _layer_weights.reset(self, init)

    def extra_repr(self) -> str:
        grouped = f"n_kv_heads={self.n_kv_heads}, " if self.n_kv_heads != self.n_heads else ""
        value = f", d_value={self.d_value}" if self.d_value != self.d_head else ""
        return (f"d_model={self.d_model}, n_heads={self.n_heads}, {grouped}d_head={self.d_head}"
                f"{value}, bias={self.b_O is not None}, dropout={self.dropout}, "
                f"causal={self.causal}, impl={self.impl!r}"
                + (f", rope={self.rope!r}" if self.rope else "")
                + "".join(f", {k}={getattr(self, k)!r}" for k in (
                    "rope_scaling", "rotary_dim", "scale", "window", "softcap", "d_context",
                    "qk_norm", "differential", "temperature") if getattr(self, k) is not None)
                + (", alibi=True" if self.alibi else "")
                + (f", pattern={self.pattern!r}" if self.pattern else "")
                + (", sinks=True" if self.sinks is not None else "")
                + "".join(f", {k}=True" for k in ("gate", "bias_kv", "zero_attn")
                          if getattr(self, k))
                + ("" if self.batch_first else ", batch_first=False"))

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None,
                value_context: torch.Tensor | None = None, *,
                mask: torch.Tensor | None = None, key_padding_mask: torch.Tensor | None = None,
                causal: bool | None = None, need_weights: bool = False,
                return_intermediates: bool = False, impl: str | None = None,
                positions: torch.Tensor | None = None, cache: KVCache | None = None,
                document_ids: torch.Tensor | None = None, pattern=None, is_causal=None):
        """``Y[n τ i]`` from ``x`` ``(n, L_q, d_model)`` and optional ``context``
        ``(n, L_k, d_model)`` (``(L_q, n, d_model)``, ``(L_k, n, d_model)`` and a
        ``(L_q, n, d_model)`` output with ``batch_first=False``); a ``d_context=(j, k)`` layer
        takes the keys' context ``(n, L_k, j)`` and the values' ``value_context``
        ``(n, L_k, k)``, as ``nn.MultiheadAttention(query, key, value)`` does.

        ``mask``: bool (True = may attend) or float (added to the scores), shape (τ, σ),
        (n, τ, σ) or (n, μ, τ, σ). ``key_padding_mask``: bool ``(n, L_k)``, True = padding
        (ignored). ``causal`` overrides the constructor's; for L_q ≠ L_k it is aligned
        bottom-right. ``need_weights=True`` returns ``(Y, A)`` with the per-head weights
        ``A[n μ τ σ]`` as applied (after dropout). ``return_intermediates=True`` returns
        ``(Y, stages)``: a dict of every intermediate by its equation name
        (Q, K, V, S, A, Z, Y_μ, Y; and Z_D, N of differential attention, G, Z_g of the
        gate). ``impl`` overrides the constructor's ("einsum", "sdpa", "chunked", "flex", or
        "auto": per call the fastest of the four, :mod:`einattn.impls.auto`); all share the
        parameters and agree. ``positions``
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
        if is_causal is not None:
            refuse_is_causal(is_causal)
        spec = self._call_spec(impl)
        if cache is not None and context is None and value_context is None and mask is None \
                and positions is None and document_ids is None and pattern is None \
                and not (need_weights or return_intermediates) and self.batch_first:
            y = _decode.step(self, x, spec, cache, key_padding_mask,
                             spec.causal if causal is None else causal)
            if y is not None:  # else no plan covers the call (_decode says which)
                return y
        w = self._attention_weights()
        self._check_input("x", x, w["W"])
        if self.d_context is not None:
            context = self._own_context(x, context, value_context)
        for name, t, at in (("context", context, 0), ("value_context", value_context, 1)):
            if t is not None:
                self._check_input(name, t, w["W"], self._context_width(name, at))
        if not self.batch_first:  # (L, n, d): the equations read X[n τ i]
            x, context, value_context = (None if t is None else t.transpose(0, 1)
                                         for t in (x, context, value_context))
        if value_context is not None:
            context = (context, value_context)
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
        w = {"W": W, "W_O": W_O, "b": b, "b_O": b_O, "sinks": sinks, "alibi": self.alibi,
             "W_KV": W_KV, "b_KV": b_KV, "n_heads": self.n_heads,
             "n_kv_heads": self.n_kv_heads,
             "d_value": self.d_value if self.d_value != self.d_head else None}
        for name in self._extras:  # the weights of the spec's options
            w[name] = p[name] if name in p else getattr(self, name)
        if isinstance(self.d_context, tuple):  # keys and values from contexts of their own
            w["W_KV"] = (self.W_K, self.W_V)
            w["b_KV"] = None if self.b_K is None else (self.b_K, self.b_V)
        return w

    def _own_context(self, x: torch.Tensor, context, value_context):
        """The context a ``d_context`` layer projects through ``W_KV``: ``x`` itself where
        none is given and ``x`` has the context's width; a ``d_context=(j, k)`` layer's two,
        both given."""
        if isinstance(self.d_context, tuple) and (context is None or value_context is None):
            raise EinattnError(f"this layer reads its keys from C_K[n σ j] (j = "
                               f"{self.d_context[0]}) through W_K[(g a) j] and its values from "
                               f"C_V[n σ j] (j = {self.d_context[1]}) through W_V[(g b) j]: pass "
                               f"context= and value_context=")
        if context is not None:
            return context
        if self.d_context != self.d_model:
            raise EinattnError(f"this layer reads its keys and values from a context "
                               f"C[n σ j] of width j = d_context = {self.d_context} through "
                               f"W_KV[(g B a) j]: pass context=")
        return x

    def _context_width(self, name: str, at: int) -> tuple:
        """What the ``context`` (``at`` 0) or ``value_context`` (1) must be: ``(width name,
        size, index, weight)``."""
        pair = isinstance(self.d_context, tuple)
        if at == 1 and not pair:
            raise EinattnError("value_context is for a layer with d_context=(j, k), whose keys "
                               "and values come from contexts of their own widths; pass the "
                               "one context as context=")
        if self.d_context is None:
            return "d_model", self.d_model, "i", "W"
        if not pair:
            return "d_context", self.d_context, "j", "W_KV"
        return f"d_context[{at}]", self.d_context[at], "j", ("W_K", "W_V")[at]

    def _check_input(self, name: str, t: torch.Tensor, W: torch.Tensor,
                     width: tuple | None = None) -> None:
        """``t`` is ``(n, L, d_model)``, or a context of the ``width`` that
        :meth:`_context_width` gives, in the dtype and on the device of the layer's weights."""
        if not isinstance(t, torch.Tensor):
            raise EinattnError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        width, size, index, weight = width or ("d_model", self.d_model, "i", "W")
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
        """A layer from ``nn.Linear``-layout weights ``W_q: ((μ a), i)``, ``W_k: ((g a), j)``,
        ``W_v: ((g b), k)`` and ``W_o: (i, (μ b))``, the form every reshape-based
        implementation keeps. ``n_kv_heads`` defaults to what ``W_k``'s rows imply
        (``n_heads`` without grouped-query attention); ``b`` other than ``a`` (``W_v``'s rows)
        makes a ``d_value`` layer; ``j`` (``W_k``'s columns) other than ``i`` makes a
        ``d_context`` layer, whose keys and values come from a context of that width, and
        ``k ≠ j`` one of ``d_context=(j, k)``, whose values come from a context of their own."""
        s = _layer_weights.projection_sizes(W_q, W_k, W_v, n_heads, n_kv_heads)
        _layer_weights.check_projections(s, {"W_k": W_k, "W_v": W_v, "W_o": W_o, "b_q": b_q,
                                             "b_k": b_k, "b_v": b_v, "b_o": b_o})
        _check_fixed("from_projections", layer_options)
        layer = cls(s["d_model"], n_heads, d_head=s["a"], n_kv_heads=s["g"],
                    d_value=None if s["b"] == s["a"] else s["b"],
                    bias=any(v is not None for v in (b_q, b_k, b_v, b_o)),
                    d_context=s["d_context"], device=W_q.device, dtype=W_q.dtype,
                    **layer_options)
        _layer_weights.load(layer, W_q, W_k, W_v, W_o, b_q, b_k, b_v, b_o)
        return layer

    @classmethod
    def from_fused(cls, W: torch.Tensor, W_O: torch.Tensor, b: torch.Tensor | None = None,
                   b_O: torch.Tensor | None = None, *, n_kv_heads: int | None = None,
                   d_head: int | None = None, **layer_options) -> MultiHeadAttention:
        """A layer holding copies of einattn's own weights: ``W[(μ B a) i]`` (or
        ``W[(g C a) i]`` with ``n_kv_heads``), ``W_O[μ a i]`` and the biases ``b``, ``b_O``
        (None for no bias; one given alone makes the other zero); ``n_heads``, ``d_head`` and
        ``d_model`` are read from ``W_O``. With ``d_head`` (a) other than ``W_O``'s width
        (b), ``W`` is ``W[(g e) i]``, ``e = (r a | a | b)``: values ``d_value = b`` wide."""
        n_heads, d_value, d_model = layouts.fused_sizes(W_O)
        _check_fixed("from_fused", layer_options)
        a = d_value if d_head is None else check_positive_int("d_head", d_head)
        layouts.check_fused(W, b, W_O, b_O, *layouts.groups(n_heads, n_kv_heads), a)
        layer = cls(d_model, n_heads, d_head=a, n_kv_heads=n_kv_heads,
                    d_value=None if a == d_value else d_value,
                    bias=b is not None or b_O is not None, device=W_O.device, dtype=W_O.dtype,
                    **layer_options)
        with torch.no_grad():  # a bias not given stays as initialised: zero
            for name, t in {"W": W, "W_O": W_O, "b": b, "b_O": b_O}.items():
                if t is not None:
                    getattr(layer, name).copy_(t)
        return layer

    def projections(self) -> Projections:
        """The inverse of :meth:`from_projections`: detached copies, in ``nn.Linear`` layout."""
        W_q, W_k, W_v = _layer_weights.qkv(self, "W")
        W_o = layouts.W_O_to_linear(self.W_O.detach())
        b_q = b_k = b_v = b_o = None
        if self.b_O is not None:
            b_q, b_k, b_v = _layer_weights.qkv(self, "b")
            b_o = self.b_O.detach()
        return Projections(*(None if t is None else t.clone()
                             for t in (W_q, W_k, W_v, W_o, b_q, b_k, b_v, b_o)))

    @classmethod
    def from_torch(cls, mha: nn.MultiheadAttention, **layer_options) -> MultiHeadAttention:
        """An equivalent layer from ``nn.MultiheadAttention``: its weights, bias or none, its
        dropout and its ``batch_first`` (``layer_options`` override them); ``kdim = vdim``
        other than ``embed_dim`` makes a ``d_context`` layer, ``kdim ≠ vdim`` one of
        ``d_context=(kdim, vdim)``; ``add_bias_kv`` and ``add_zero_attn`` make ``bias_kv``
        (torch's ``bias_k``, ``bias_v`` copied) and ``zero_attn``."""
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
    fixed = {"d_model", "n_heads", "d_head", "bias", "device", "dtype", "d_context",
             "d_value"} & set(layer_options)
    if fixed:
        raise EinattnError(f"{method} takes {', '.join(sorted(fixed))} from the weights; pass "
                           f".to(...) on the result to change dtype or device")


def _d_context(d_context):
    """``d_context``: None, a width ``j``, or the widths ``(j, k)`` of the keys' and the
    values' contexts."""
    if isinstance(d_context, tuple) and len(d_context) == 2:
        for width in d_context:
            check_positive_int("d_context", width)
        return d_context
    return None if d_context is None else check_positive_int("d_context", d_context)


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
