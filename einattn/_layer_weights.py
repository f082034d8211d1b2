"""The parameters of :class:`einattn.MultiHeadAttention`, and its conversions from and to
``nn.Linear``-layout weights (the layer's ``from_projections``, ``from_fused`` and
``projections`` run these).

The projections, by where the keys and values come from (``b``: the value width,
``d_value``, ``a`` unless set)::

    fused             W[(g e) i], e = (r a | a | b)      W[(g C a) i] where b = a
    d_context = j     W_Q[(μ a) i], W_KV[(g e) j], e = (a | b)
    d_context = (j, k)  W_Q[(μ a) i], W_K[(g a) j], W_V[(g b) k]

then ``W_O[μ b i]`` (differential attention: ``W_O[(q r) (e b) i]``, half the heads, each
two values wide), and the weights of the options: the gains of qk-norm, ``W_G`` of the
output gate, the four ``λ`` of differential attention, ``bias_k`` and ``bias_v``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from . import differential, layouts, qk_norm
from ._checks import check_positive_int
from .errors import EinattnError


def projection_shapes(layer) -> dict:
    """The projections' shapes, by the layer's ``d_context`` (module docstring)."""
    μ, g, a, b, i = layer.n_heads, layer.n_kv_heads, layer.d_head, layer.d_value, layer.d_model
    r = μ // g
    if layer.d_context is None:
        return {"W": (g * ((r + 1) * a + b), i)}
    if isinstance(layer.d_context, int):
        return {"W_Q": (μ * a, i), "W_KV": (g * (a + b), layer.d_context)}
    j, k = layer.d_context
    return {"W_Q": (μ * a, i), "W_K": (g * a, j), "W_V": (g * b, k)}


def option_shapes(layer, bias: bool) -> dict:
    """The weights of the spec's options (module docstring), by name."""
    spec, μ, g, a, b = layer.spec, layer.n_heads, layer.n_kv_heads, layer.d_head, layer.d_value
    shapes = qk_norm.shapes(spec.qk_norm, μ, g, a) | differential.shapes(spec.differential, a)
    if spec.gate:  # a gate per channel of the output heads Z (differential: (q r), 2b wide)
        heads, width, i = output_shape(layer)
        shapes |= {"W_G": (heads * width, i)} | ({"b_G": (heads * width,)} if bias else {})
    if spec.bias_kv:
        shapes |= {"bias_k": (g * a,), "bias_v": (g * b,)}
    return shapes


def output_shape(layer) -> tuple[int, int, int]:
    """``W_O[μ b i]``; differential attention's ``W_O[(q r) (e b) i]``."""
    if layer.spec.differential is not None:
        return layer.n_heads // 2, 2 * layer.d_value, layer.d_model
    return layer.n_heads, layer.d_value, layer.d_model


def make(layer, bias: bool, sinks: bool, kw: dict) -> None:
    """Every parameter, empty (:func:`reset` fills them); the projections of the other
    layouts read as None."""
    projections = projection_shapes(layer)
    absent = () if layer.d_context is None else ("W", "b") if "W_KV" in projections \
        else ("W", "b", "W_KV", "b_KV")
    for name in absent:  # read as None, as a layer without them is
        layer.register_parameter(name, None)
    for name, shape in projections.items():
        setattr(layer, name, nn.Parameter(torch.empty(*shape, **kw)))
    layer.W_O = nn.Parameter(torch.empty(*output_shape(layer), **kw))
    for name, shape in projections.items():  # b, or b_Q and b_KV (b_K, b_V)
        setattr(layer, "b" + name[1:], nn.Parameter(torch.empty(shape[0], **kw))
                if bias else None)
    layer.b_O = nn.Parameter(torch.empty(layer.d_model, **kw)) if bias else None
    layer.sinks = nn.Parameter(torch.empty(layer.n_heads, **kw)) if sinks else None  # s[μ]
    extras = option_shapes(layer, bias)
    for name, shape in extras.items():
        setattr(layer, name, nn.Parameter(torch.empty(*shape, **kw)))
    layer._extras = tuple(extras)


def reset(layer, init: str) -> None:
    """``"torch"``: the projections xavier-uniform, W_O uniform(±1/√(μ·b)) as nn.Linear,
    biases 0 (``nn.MultiheadAttention``'s scheme); ``"gpt2"``: weights N(0, 0.02²), biases
    0. Sink logits start at 0; the options' weights as their models start them (the gains
    at 1, or 0 under ``1 + γ``; each λ N(0, 0.1²); ``bias_k``, ``bias_v`` as
    ``nn.MultiheadAttention``'s: N(0, 1/rows))."""
    if init not in ("torch", "gpt2"):
        raise EinattnError(f"init must be 'torch' or 'gpt2', got {init!r}")
    weights = [getattr(layer, name) for name in projection_shapes(layer)]
    weights += [layer.W_G] if layer.spec.gate else []
    with torch.no_grad():
        for W in weights:
            nn.init.xavier_uniform_(W) if init == "torch" else nn.init.normal_(W, std=0.02)
        bound = 1.0 / math.sqrt(layer.W_O.shape[0] * layer.W_O.shape[1])
        nn.init.uniform_(layer.W_O, -bound, bound) if init == "torch" \
            else nn.init.normal_(layer.W_O, std=0.02)
        for name, p in layer.named_parameters(recurse=False):
            if name.startswith("bias_"):
                nn.init.normal_(p, std=p.shape[0] ** -0.5)
            elif name[0] in "bs":
                p.zero_()  # the biases, the sinks
            elif name.startswith("gamma"):
                p.fill_(qk_norm.initial(layer.spec.qk_norm))
            elif name.startswith("lambda"):
                nn.init.normal_(p, std=0.1)


# -- from and to nn.Linear layout ---------------------------------------------------------------

def projection_sizes(W_q, W_k, W_v, n_heads: int, n_kv_heads) -> dict:
    """The layer's sizes read from ``nn.Linear``-layout weights (``from_projections``)."""
    check_positive_int("n_heads", n_heads)
    if not isinstance(W_q, torch.Tensor) or W_q.ndim != 2:
        shape = tuple(W_q.shape) if isinstance(W_q, torch.Tensor) else type(W_q).__name__
        raise EinattnError(f"W_q must be a 2-D weight W_q[(μ a) i], got {shape}")
    rows, d_model = W_q.shape
    if rows % n_heads:
        raise EinattnError(f"W_q has {rows} rows, not divisible by n_heads={n_heads}")
    a = rows // n_heads
    two_d = [isinstance(t, torch.Tensor) and t.ndim == 2 for t in (W_k, W_v)]
    if n_kv_heads is None and two_d[0]:
        n_kv_heads = max(1, W_k.shape[0] // a)
    g, _ = layouts.groups(n_heads, n_kv_heads)
    j = W_k.shape[1] if two_d[0] else d_model
    k = W_v.shape[1] if two_d[1] else j
    b = W_v.shape[0] // g if two_d[1] and W_v.shape[0] % g == 0 and W_v.shape[0] else a
    context = None if j == k == d_model else j if j == k else (j, k)
    return {"d_model": d_model, "μ": n_heads, "g": g, "a": a, "b": b, "j": j, "k": k,
            "d_context": context}


def check_projections(s: dict, given: dict) -> None:
    """Each ``nn.Linear``-layout weight and bias ``given`` has the shape ``s`` implies."""
    μ, g, a, b, i = s["μ"], s["g"], s["a"], s["b"], s["d_model"]
    expected = {"W_k": ("[(g a) j]", (g * a, s["j"])), "W_v": ("[(g b) j]", (g * b, s["k"])),
                "W_o": ("[i (μ b)]", (i, μ * b)), "b_q": ("[(μ a)]", (μ * a,)),
                "b_k": ("[(g a)]", (g * a,)), "b_v": ("[(g b)]", (g * b,)),
                "b_o": ("[i]", (i,))}
    for name, (pattern, want) in expected.items():
        t = given[name]
        if t is not None and tuple(t.shape) != want:
            raise EinattnError(f"{name} has shape {tuple(t.shape)} but {name}{pattern} needs "
                               f"{want}: from W_q, i = d_model = {i} and (μ a) = {μ * a}; "
                               f"(g a) = {g * a}, (g b) = {g * b}; from W_k, j = {s['j']}")


def load(layer, W_q, W_k, W_v, W_o, b_q, b_k, b_v, b_o) -> None:
    """Copy ``nn.Linear``-layout weights in; a bias not given is zero where the layer has
    biases."""
    with torch.no_grad():
        _load_qkv(layer, "W", W_q, W_k, W_v)
        layer.W_O.copy_(layouts.W_O_from_linear(W_o, n_heads=layer.n_heads))
        if layer.b_O is not None:
            b_q, b_k, b_v = (w.new_zeros(w.shape[0]) if t is None else t
                             for t, w in ((b_q, W_q), (b_k, W_k), (b_v, W_v)))
            _load_qkv(layer, "b", b_q, b_k, b_v)
            layer.b_O.copy_(W_o.new_zeros(layer.d_model) if b_o is None else b_o)


def _load_qkv(layer, kind: str, q, k, v) -> None:
    """Query, key and value rows into the layer's projections of ``kind`` ("W" or "b")."""
    g = layer.n_kv_heads
    if layer.d_context is None:
        getattr(layer, kind).copy_(layouts.fuse_qkv(q, k, v, n_heads=layer.n_heads,
                                                    n_kv_heads=g))
        return
    getattr(layer, kind + "_Q").copy_(q)
    if isinstance(layer.d_context, int):
        getattr(layer, kind + "_KV").copy_(
            torch.cat([torch.unflatten(t, 0, (g, -1)) for t in (k, v)], 1).flatten(0, 1))
        return
    getattr(layer, kind + "_K").copy_(k)
    getattr(layer, kind + "_V").copy_(v)


def qkv(layer, kind: str) -> tuple[torch.Tensor, ...]:
    """The query, key and value rows (``nn.Linear`` layout) of the projections of ``kind``
    ("W" or "b"), detached: the inverse of :func:`_load_qkv`."""
    g, a = layer.n_kv_heads, layer.d_head
    if layer.d_context is None:
        return layouts.split_qkv(getattr(layer, kind).detach(), n_heads=layer.n_heads,
                                 n_kv_heads=g, d_value=layer.d_value)
    query = getattr(layer, kind + "_Q").detach()
    if isinstance(layer.d_context, int):
        K, V = torch.unflatten(getattr(layer, kind + "_KV").detach(), 0, (g, -1)).split(
            [a, layer.d_value], 1)
        return query, K.flatten(0, 1), V.flatten(0, 1)
    return query, getattr(layer, kind + "_K").detach(), getattr(layer, kind + "_V").detach()
