"""A layer's plan for a cached call (issue 38, item 4: the small-call cost).

:func:`einattn.composition.multi_head` works out, on every call, much that is the same from
one decoding step to the next: the fused weight's layout and the contraction plans of
equations (1) and (5), the pieces of (3) and where the impl runs them. A :class:`Plan` holds
those, made once per layer and per (x's shape, dtype and device, the weights' shapes, the
spec, ``causal``, ALiBi), so that a step with a :class:`~einattn.KVCache` runs (1), RoPE at
the cache's positions, the cache's append, (2)–(4) and (5) with a few Python calls: the same
torch operations in the same order as the composition, so the same numbers bit for bit
(tests/test_decode_plan.py). What depends on the call is still checked on every call: ``x``
(by the layer), the cache's sizes and length (by its append), the biases.

A call the plan does not cover runs the composition: a context, a mask, positions, document
ids, a pattern of its own, weights or intermediates asked for, a cache of another kind, grad
mode, ``torch.compile`` or a ``torch.func`` transform, dropout, ALiBi or sinks, weights that
are not plain parameters, and the options of today's models (qk-norm, a temperature,
differential heads, a gate, ``bias_kv``, ``zero_attn``, ``d_value``, ``d_context``).

Measured in docs/performance.md ("How the fast paths are fast"): the decoding step of
``MultiHeadAttention(512, 8, impl="sdpa")`` at context 512.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _softmax, composition, equations, patterns, rotary
from .cache import KVCache
from .errors import EinattnError
from .spec import Spec

_PLANS = "_decode_plans"  # the layer's attribute that keeps its plans, by key
_MAX_PLANS = 64


class Plans(dict):
    """A layer's plans by key; copied and pickled empty (they hold callables, made again)."""

    def __reduce__(self):
        return Plans, ()


class Plan:
    """What one layer's cached calls of one key run: the planned contractions of (1)
    (``project``) and (5) (``heads``), the groups ``g`` and queries per group ``r``, the
    pieces of (3), and whether SDPA takes them as no mask at all (``direct``: causal alone,
    or nothing, seen by one query at the last position)."""

    __slots__ = ("direct", "g", "heads", "pieces", "project", "r", "spec")

    def __init__(self, spec: Spec, project, heads, g: int, r: int, pieces: tuple,
                 direct: bool) -> None:
        self.spec, self.project, self.heads, self.g, self.r = spec, project, heads, g, r
        self.pieces, self.direct = pieces, direct

    def __call__(self, x, W, b, W_O, b_O, cache: KVCache, key_padding_mask):
        """``Y[n τ i]`` of the call, its keys and values appended to ``cache``."""
        spec = self.spec
        Q, K, V = equations.split_fused(self.project(x, W), b, self.g, self.r)
        if spec.rope is not None:
            Q, K = rotary.turned(Q, K, spec.rope_options, None, offset=len(cache), cross=False)
        with cache.undo_on_error():  # a call that raises adds nothing to the cache
            K, V, padding = cache.append(K, V, key_padding_mask)
            if self.direct and padding is None:  # (2)–(4) as impl="sdpa" runs them here
                if spec.scale is not None:
                    Q = composition.scaled(Q, spec.scale)
                Z = F.scaled_dot_product_attention(Q, K, V, None, 0.0, False,
                                                   enable_gqa=self.r != 1)
            else:
                Z = composition.attention(Q, K, V, spec, None, padding, self.pieces,
                                          False)["Z"]
            Y = self.heads(Z, W_O)
            return Y if b_O is None else equations.output_bias(Y, b_O, W_O)


def step(layer, x: torch.Tensor, spec: Spec, cache, key_padding_mask, causal: bool):
    """``Y`` of a cached call by the layer's plan for it, or None where no plan covers the
    call (the caller then runs the composition). Only a call that brings no context, mask,
    positions, document ids or pattern of its own, and asks for ``Y`` alone, comes here."""
    if type(cache) is not KVCache or torch.is_grad_enabled() \
            or torch.compiler.is_compiling() or _softmax.transformed():
        return None
    p, d = layer._parameters, layer.__dict__  # as forward reads them (module.py says why):
    try:  # a parameter, or None as an attribute where the layer has none
        W, W_O = p["W"], p["W_O"]
        b = p["b"] if "b" in p else d["b"]
        b_O = p["b_O"] if "b_O" in p else d["b_O"]
        sinks = p["sinks"] if "sinks" in p else d["sinks"]
    except KeyError:  # a weight parametrized, pruned, sharded, or a d_context layer's
        return None
    if W is None or W_O is None or sinks is not None:
        return None
    layer._check_input("x", x, W)
    key = (x.shape, x.dtype, x.device, W.shape, W_O.shape, W_O.dtype, W_O.device, causal,
           layer.alibi)
    plans = layer.__dict__.get(_PLANS)
    if plans is None:
        plans = layer.__dict__[_PLANS] = Plans()
    made = plans.get(key)  # (the spec it was made for, the plan or None: not covered)
    if made is None or made[0] is not spec:
        if len(plans) >= _MAX_PLANS:  # prompts of many lengths: start again
            plans.clear()
        made = plans[key] = spec, _planned(layer, x, W, W_O, spec, causal)
    plan = made[1]
    return None if plan is None else plan(x, W, b, W_O, b_O, cache, key_padding_mask)


def _planned(layer, x, W, W_O, spec: Spec, causal: bool) -> Plan | None:
    """The plan for calls like this one, or None where the layer or the sizes are not what
    a plan covers (the composition then runs, and says what is wrong where something is)."""
    if layer.alibi or layer.d_context is not None or layer._extras or spec.dropout \
            or layer.d_value != layer.d_head or spec.qk_norm is not None \
            or spec.temperature is not None or spec.differential is not None \
            or spec.gate or spec.bias_kv or spec.zero_attn:
        return None
    n, L, d_model = x.shape
    μ, a = layer.n_heads, layer.d_head
    if W_O.shape != (μ, a, d_model) or W_O.dtype != x.dtype or W_O.device != x.device:
        return None
    try:
        g, r, _, _ = equations.head_widths(W, μ, layer.n_kv_heads, None)
    except EinattnError:
        return None
    grouped = equations.PROJECT if r == 1 else equations.PROJECT_GQA
    project = grouped.planned(X=x, W=W, **({"μ": g, "B": 3} if r == 1 else {"g": g,
                                                                            "C": r + 2}))
    heads = equations.HEADS.planned(Z=x.new_empty(n, μ, L, a), W_O=W_O)  # Z as (2)–(4) give it
    pieces = composition.call_pieces(spec, composition.Call(causal=causal), False, None, None)
    direct = spec.impl == "sdpa" and L == 1 and all(type(piece) is patterns.Causal
                                                    for piece in pieces)
    return Plan(spec, project, heads, g, r, pieces, direct)
