"""The one composition of attention: projection → RoPE → cache → attention → output.

    (1) Q, K, V from X (or from X and a context)      :func:`einattn.equations.project_qkv`
        qk-norm, before RoPE or after it              :mod:`einattn.qk_norm`
        RoPE turns Q and K at their positions         :func:`einattn.rotary.turned`
        the temperature scales Q by its index         :mod:`einattn.temperature`
        a KV cache appends K and V, gives positions   :class:`einattn.KVCache`
    (2)–(4) Z from Q, K, V and the pieces of (3)     :func:`attention`, by the spec's impl
        (the value pairs of differential attention, a slot for every query)
        differential heads from Z, an output gate     :mod:`einattn.differential`, ``gate``
    (5) Y from Z                                      :func:`einattn.equations.combine_heads`

:func:`multi_head` runs it for the layer (:class:`einattn.MultiHeadAttention`),
:func:`einattn.functional.multi_head_attention` and the head- and sequence-parallel layers
(the ring's attention passed in as ``attend``); :func:`attention` runs (2)–(4) for
:func:`einattn.functional.attention` and :mod:`einattn.hf`. Every one of them reads its
options from one :class:`~einattn.spec.Spec`, and binds the pieces of (3) to the call in one
place (:func:`einattn.patterns.bind`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from . import (
    cross,
    differential,
    equations,
    gate,
    impls,
    masks,
    patterns,
    qk_norm,
    rotary,
    slots,
    temperature,
)
from ._checks import check_floating
from .cache import KVCache
from .errors import EinattnError
from .spec import Spec
from .static_cache import StaticKVCache


class Call(NamedTuple):
    """What one call of :func:`multi_head` brings besides its spec and weights: a
    ``context``, the ``mask`` and ``key_padding_mask``, ``causal``, pieces of its own
    (``pattern``), RoPE's ``positions``, a ``cache``, ``document_ids``, and what it returns."""

    context: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    key_padding_mask: torch.Tensor | None = None
    causal: bool = False
    pattern: object = None
    positions: torch.Tensor | None = None
    cache: object = None
    document_ids: torch.Tensor | None = None
    need_weights: bool = False
    return_intermediates: bool = False


def attention(Q, K, V, spec: Spec, mask, key_padding_mask, pieces: tuple, seen: bool,
              q0=None) -> dict[str, torch.Tensor]:
    """Equations (2)–(4) with the ``pieces`` of (3) bound to this call (its queries at
    positions ``q0 …``, by default the last of the keys'), Q scaled by the spec's ``s``:
    every stage where they are ``seen`` (the einsum path's S, A and Z), Z alone elsewhere."""
    return _attend(scaled(Q, spec.scale), K, V, spec, mask, key_padding_mask, pieces, seen, q0)


def _attend(Q, K, V, spec: Spec, mask, key_padding_mask, pieces: tuple, seen: bool, q0=None):
    """:func:`attention` on a Q already scaled (the ring's attention has this signature)."""
    M, pattern = _bound(Q, K, mask, key_padding_mask, pieces, q0)
    return impls.run(Q, K, V, M, pattern, spec, seen)


def choice(Q, K, V, spec: Spec, mask, key_padding_mask, pieces: tuple, seen: bool,
           q0=None) -> impls.auto.Choice:
    """Which impl :func:`attention` runs this call on, and why (nothing is run)."""
    M, pattern = _bound(Q, K, mask, key_padding_mask, pieces, q0)
    return impls.choice(Q, K, V, M, pattern, spec, seen)


def _bound(Q, K, mask, key_padding_mask, pieces: tuple, q0):
    """``(M, pattern)``: the call's mask ``M[n μ τ σ]`` (or None) and its bound pieces."""
    (n, n_heads, L_q, _), L_k = Q.shape, K.shape[2]
    pattern = patterns.bind(pieces, n=n, n_heads=n_heads, L_q=L_q, L_k=L_k, dtype=Q.dtype,
                            device=Q.device, q0=q0)
    M = None
    if mask is not None or key_padding_mask is not None:
        M = masks.attention_mask(n=n, n_heads=n_heads, L_q=L_q, L_k=L_k, dtype=Q.dtype,
                                 device=Q.device, mask=mask, key_padding_mask=key_padding_mask)
    return M, pattern


def call_pieces(spec: Spec, call: Call, alibi, sinks, document_ids) -> tuple:
    """The pieces of one call: the spec's (its window, softcap and pattern), then the call's
    (causal, ALiBi's slopes, the sinks (a zero one for ``zero_attn``), the documents, its
    own pattern)."""
    zero = (patterns.ZeroSink(),) if spec.zero_attn else ()
    return zero + spec.pieces + patterns.pieces_of(
        call.pattern, causal=call.causal, alibi=alibi, sinks=sinks, document_ids=document_ids)


def multi_head(x: torch.Tensor, w: dict, spec: Spec, call: Call, attend=_attend):
    """Equations (1)–(5): ``Y[n τ i]`` from ``X[n τ i]``, the weights ``w`` (``W``,
    ``W_O``, ``b``, ``b_O``, ``W_KV``, ``b_KV``, ``sinks``, ``alibi``, ``n_heads``,
    ``n_kv_heads``; ``d_value`` and those of the spec's options where it has them) and
    ``spec``; ``Y``, ``(Y, A)`` or ``(Y, stages)`` as ``call`` asks. ``attend`` runs
    (2)–(4) on the scaled Q (the ring's, for a sequence-parallel layer)."""
    cache = call.cache
    if cache is not None:
        check_cache(cache, call.context)
    Q, K, V = _projected(x, w, call.context)
    ids = call.document_ids if cache is None else None  # a cache's: every cached key's
    joined = call_pieces(spec, call, w["alibi"], w["sinks"], ids)
    if cache is not None:  # every check that can be made before the cache is touched
        _check_cached_call(cache, Q, V, w, spec, call)
    Q, K = _turned(x, Q, K, w, spec, call)
    seen = call.need_weights or call.return_intermediates
    if cache is None:
        stages = _attention(attend, Q, K, V, w, spec, call.mask, call.key_padding_mask,
                            joined, seen)
        return _outputs(x, Q, K, V, stages, w, spec, call)
    with cache.undo_on_error():  # a call that raises adds nothing to the cache
        K, V, padding = cache.append(K, V, call.key_padding_mask, call.document_ids)
        added, q0 = cache.seen_by(Q.shape[2])
        stages = _attention(attend, Q, K, V, w, spec, call.mask, padding, joined + added,
                            seen, q0)
        return _outputs(x, Q, K, V, stages, w, spec, call)


def _turned(x, Q, K, w: dict, spec: Spec, call: Call):
    """Q and K between (1) and the cache: qk-norm (before or after RoPE), RoPE at their
    positions, the temperature at the queries' indices."""
    norm = spec.qk_norm
    if norm is not None and not norm.after_rope:
        Q, K = qk_norm.applied(Q, K, w, norm)
    cache = call.cache
    positions, offset = (call.positions, 0) if cache is None or spec.rope is None else \
        cache.placed(call.positions, x.shape[1], x.device)
    Q, K = rotary.turned(Q, K, spec.rope_options, positions, offset=offset,
                         cross=call.context is not None)
    if norm is not None and norm.after_rope:
        Q, K = qk_norm.applied(Q, K, w, norm)
    if spec.temperature is not None:
        t = temperature.indices(cache, x.shape[0], x.shape[1], x.device)
        Q = temperature.scaled(Q, t, spec.temperature)
    return Q, K


def _attention(attend, Q, K, V, w: dict, spec: Spec, mask, padding, pieces: tuple,
               seen: bool, *q0):
    """(2)–(4) by ``attend`` on the scaled Q (``q0``: a cache's first query position):
    over the value pairs of differential attention, with the slot of ``bias_kv``."""
    Q = scaled(Q, spec.scale)
    if spec.differential is not None:
        V = differential.value_pairs(V)
    if not spec.bias_kv:
        return attend(Q, K, V, spec, mask, padding, pieces, seen, *q0)
    if attend is not _attend or w.get("bias_k") is None:
        raise EinattnError("bias_kv: this layer's attention (sequence-parallel, or weights "
                           "without bias_k and bias_v) cannot add the key every query sees")
    return slots.with_slot(attend, Q, K, V, spec, mask, padding, pieces, seen,
                           q0[0] if q0 else None, w["bias_k"], w["bias_v"])


def _outputs(x, Q, K, V, stages: dict, w: dict, spec: Spec, call: Call):
    """Differential heads and the gate where the spec has them, equation (5), and what the
    caller asked for: ``Y``, ``(Y, A)`` or ``(Y, stages)``."""
    Z, more, A = stages["Z"], {}, stages.get("A")
    if spec.differential is not None:
        lam = differential.weight(w, spec.differential)
        more = differential.combined(Z, lam, spec.differential, w["n_kv_heads"])
        Z, A = more["N"], None if A is None else differential.weights(A, lam)
    if spec.gate:
        G = gate.gate_logits(x, w.get("W_G"), w.get("b_G"), w["W_O"].shape[0])
        Z = gate.gated(Z, G)
        more |= {"G": G, "Z_g": Z}
    Y = equations.combine_heads(Z, w["W_O"], w["b_O"])
    if call.return_intermediates:  # Q itself: s · √a is folded into (2)–(4)'s copy only
        return Y, {"Q": Q, "K": K, "V": V, **stages, **more,
                   "Y_μ": equations.head_contributions(Z, w["W_O"]), "Y": Y}
    return (Y, A) if call.need_weights else Y


def _projected(x, w: dict, context):
    """Q, K, V by (1), or (1q) and (1kv) given ``W_KV``; then ``W_O`` must write x's width.
    The values are ``w["d_value"]`` wide where the weights say (else ``a``)."""
    check_floating("x", x)
    n_heads, n_kv_heads, W_O, d_value = w["n_heads"], w["n_kv_heads"], w["W_O"], w.get("d_value")
    QKV = (equations.project_qkv(x, w["W"], n_heads=n_heads, n_kv_heads=n_kv_heads, b=w["b"],
                                 context=context, d_value=d_value) if w["W_KV"] is None
           else cross.project(x, w["W"], context, w["W_KV"], n_heads=n_heads,
                              n_kv_heads=n_kv_heads, b_Q=w["b"], b_KV=w["b_KV"],
                              d_value=d_value))
    if W_O.ndim == 3 and W_O.shape[-1] != x.shape[-1]:
        raise EinattnError(f"index 'i' has size {W_O.shape[-1]} in W_O but {x.shape[-1]} in x: "
                           f"Y[n τ i] must have the model width of X[n τ i]")
    return QKV


def check_cache(cache, context) -> None:
    """``cache`` is a :class:`~einattn.KVCache` or a :class:`~einattn.StaticKVCache`, used
    for self-attention."""
    if not isinstance(cache, (KVCache, StaticKVCache)):
        raise EinattnError(f"cache must be an einattn.KVCache or StaticKVCache, got "
                           f"{type(cache).__name__}")
    if context is not None:
        raise EinattnError("a KVCache holds self-attention's keys and values; with a context "
                           "they would be appended again on every call: drop the cache or the "
                           "context")


def _check_cached_call(cache, Q, V, w: dict, spec: Spec, call: Call) -> None:
    """What a call with a cache is refused for, checked before the cache is touched: what the
    cache does not take, and the output weights of equation (5)."""
    cache.check_call(Q.shape[2], mask=call.mask, positions=call.positions,
                     document_ids=call.document_ids)
    W_O = w["W_O"]
    if not torch.compiler.is_compiling():  # Z[n μ τ b]: Q's heads, V's width (differential:
        n, heads, L, b = *Q.shape[:3], V.shape[-1]  # half the heads, the value pairs' width)
        shape = (n, heads, L, b) if spec.differential is None else (n, heads // 2, L, 2 * b)
        if not isinstance(W_O, torch.Tensor) or W_O.ndim != 3 \
                or W_O.shape[:2] != (shape[1], shape[3]):
            equations.HEADS.sizes(Z=shape, W_O=W_O)  # names the index and both sizes
    equations.check_b_O(w["b_O"], W_O)


def scaled(Q: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Q with ``s · √a`` folded in, so that equation (2)'s ``/ √a`` gives ``S = s · Q K``
    (``s`` checked by the spec that holds it)."""
    return Q if scale is None else Q * (scale * math.sqrt(Q.shape[-1]))
