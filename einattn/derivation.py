"""The derivation's steps, registered so that tests and ``einattn verify`` check each one.

A step relates two forms of the same quantity: usually einattn's index equation and the
textbook or reshape-based form it replaces. ``steps()`` gives the true steps at chosen
sizes; ``mutations()`` gives plausible wrong steps that verification must reject.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F

from . import circuits, cross, functional, layouts, linear, reference, rotary
from . import field_steps as _field
from . import gradient_steps as _gradient
from . import model_steps as _models
from . import pattern_steps as _pattern
from . import ring_steps as _ring
from ._step import Step
from .cache import KVCache
from .notation import Equation


def default_sizes(n: int = 2, L: int = 5, d_model: int = 16, n_heads: int = 4,
                  L_k: int | None = None) -> dict[str, int]:
    """Index sizes for the steps; the default is the derivation's worked example: n=2, L=5,
    d_model=16, 4 heads."""
    return {"n": n, "τ": L, "σ": L if L_k is None else L_k, "i": d_model, "j": d_model,
            "μ": n_heads, "a": d_model // n_heads, "B": 3}


def with_value_width(s: dict[str, int]) -> dict[str, int]:
    """``s`` with ``c``, the value width of the linear-attention steps: a + 3, so that a
    swapped a and c cannot hide."""
    return {**s, "c": s["a"] + 3}


# The tensors the steps hold beyond one attention layer's (einattn.cli.TRACE_TENSORS), by
# their indices at with_value_width(sizes): the self-attention steps' scores (σ = τ, whatever
# L_k is); the circuits' W_QK (W_OV is as large); the per-head terms Y_μ, as large as A X in
# the OV circuit; the linear-attention steps' prefix sums H. `einattn verify` refuses sizes
# where the largest would not fit (RoPE's even a ≤ a + 1 < c). Not bounded: the sink step's
# logits with one more column, n μ τ (σ + 1), past S[n μ τ σ] only where σ > τ and S is largest.
TENSORS = ("S[n μ τ τ]", "W_QK[μ i j]", "Y_μ[n μ τ i]", "H[n μ τ a c]", "H[n μ σ a c]")


# -- the right-hand sides: textbook forms, written without einattn's equations ----------

def _split_heads(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    n, L, width = t.shape
    return t.view(n, L, n_heads, width // n_heads).transpose(1, 2)


def _projections(n_heads: int):
    def three_linears(X, W):  # P[n τ μ B a]: each linear's (μ a) opened, stacked at B
        W_q, W_k, W_v = layouts.split_qkv(W, n_heads=n_heads)
        return torch.stack([torch.unflatten(F.linear(X, w), -1, (n_heads, -1))
                            for w in (W_q, W_k, W_v)], dim=3)
    return three_linears


def _q_dot_k(X, W_Q, W_K):
    """S = Q·K with Q, K projected first (no scale: a pure contraction)."""
    Q = torch.einsum("nti,mai->nmta", X, W_Q)
    K = torch.einsum("nsj,maj->nmsa", X, W_K)
    return Q @ K.transpose(-2, -1)


def _fuse_by_formula(T):
    """Y[n, a·p + i] = T[n, a, i], with the index arithmetic written out."""
    n, A, P = T.shape
    Y = T.new_zeros(n, A * P)
    Y[:, torch.arange(A)[:, None] * P + torch.arange(P)[None, :]] = T
    return Y


def _concat_then_linear(Z, W_O):
    """Concatenate the heads along channels, then one linear layer."""
    heads = torch.cat(list(Z.unbind(1)), dim=-1)
    return heads @ W_O.reshape(-1, W_O.shape[-1])


def _bma_projection(n_heads: int):
    def in_torch_layout(X, W):
        return Equation("P[n τ μ B a] = X[n τ i] W[(B μ a) i]")(
            X=X, W=layouts.to_bma(W, n_heads=n_heads), μ=n_heads, B=3)
    return in_torch_layout


def _layers(n_heads: int, causal: bool):
    def einattn_layer(X, W, W_O):
        return functional.multi_head_attention(X, W, W_O, n_heads=n_heads, causal=causal)

    def reshape_layer(X, W, W_O):
        W_q, W_k, W_v = layouts.split_qkv(W, n_heads=n_heads)
        return reference.multi_head_attention(X, W_q, W_k, W_v, layouts.W_O_to_linear(W_O),
                                              n_heads=n_heads, causal=causal)
    return einattn_layer, reshape_layer


# -- the variations: grouped-query attention, circuits, RoPE, the KV cache, linear ----------

def _gqa_sizes(s: dict[str, int], g: int | None = None) -> dict[str, int]:
    """Self-attention sizes with μ = (g r): ``g``, else ``s["g"]``, else μ/2 groups of r = 2
    (μ even) or one group (multi-query) for odd μ."""
    g = g or s.get("g") or (s["μ"] // 2 if s["μ"] % 2 == 0 else 1)
    r = s["μ"] // g
    return {**s, "σ": s["τ"], "g": g, "r": r, "C": r + 2}


def _repeated(t: torch.Tensor, n_kv_heads: int, r: int) -> torch.Tensor:
    """``(n, L, (g a))`` as heads ``(n, g·r, L, a)``, each group's head repeated r times."""
    return _split_heads(t, n_kv_heads).repeat_interleave(r, dim=1)


def _gqa_layers(n_heads: int, n_kv_heads: int):
    def einattn_grouped(X, W, W_O):
        return functional.multi_head_attention(X, W, W_O, n_heads=n_heads,
                                               n_kv_heads=n_kv_heads, causal=True)

    def repeat_interleave_reference(X, W, W_O):
        """Three linears, each key/value head repeated for the r query heads of its group,
        causal SDPA, heads concatenated."""
        W_q, W_k, W_v = layouts.split_qkv(W, n_heads=n_heads, n_kv_heads=n_kv_heads)
        r = n_heads // n_kv_heads
        q = _split_heads(F.linear(X, W_q), n_heads)
        k, v = (_repeated(F.linear(X, w), n_kv_heads, r) for w in (W_k, W_v))
        return _concat_then_linear(F.scaled_dot_product_attention(q, k, v, is_causal=True), W_O)
    return einattn_grouped, repeat_interleave_reference


def _tiled(n_heads: int, n_kv_heads: int):
    """Wrong: query head μ reading group μ % g (the tiled order) where μ // r is meant."""
    grouped, _ = _gqa_layers(n_heads, n_kv_heads)

    def tiled(X, W, W_O):
        W_q, W_k, W_v = layouts.split_qkv(W, n_heads=n_heads, n_kv_heads=n_kv_heads)
        W_q = layouts.grouped_to_tiled(W_q, n_heads=n_heads, n_kv_heads=n_kv_heads)
        return grouped(X, layouts.fuse_qkv(W_q, W_k, W_v, n_heads=n_heads,
                                           n_kv_heads=n_kv_heads), W_O)
    return grouped, tiled


def _circuit_scores(n_heads: int, n_kv_heads: int):
    def through_W_QK(X, W):
        """X W_QK X: the unscaled scores from the QK circuit."""
        W_QK = circuits.qk_circuit(W, n_heads=n_heads, n_kv_heads=n_kv_heads)
        return torch.einsum("nti,mij,nsj->nmts", X, W_QK, X)

    def q_dot_k(X, W):
        W_q, W_k, _ = layouts.split_qkv(W, n_heads=n_heads, n_kv_heads=n_kv_heads)
        q = _split_heads(F.linear(X, W_q), n_heads)
        return q @ _repeated(F.linear(X, W_k), n_kv_heads, n_heads // n_kv_heads).mT
    return through_W_QK, q_dot_k


def _circuit_output(n_heads: int, n_kv_heads: int):
    def through_W_OV(A, X, W, W_O):
        """Σ_μ A_μ X W_OV,μ: the output from the OV circuit (any weights A)."""
        W_OV = circuits.ov_circuit(W, W_O, n_heads=n_heads, n_kv_heads=n_kv_heads)
        return torch.einsum("nmts,nsi,mij->ntj", A, X, W_OV)

    def values_then_heads(A, X, W, W_O):
        _, _, W_v = layouts.split_qkv(W, n_heads=n_heads, n_kv_heads=n_kv_heads)
        v = _repeated(F.linear(X, W_v), n_kv_heads, n_heads // n_kv_heads)
        return _concat_then_linear(A @ v, W_O)
    return through_W_OV, values_then_heads


def _rope_forms(style: str):
    def rotation_equation(T, t):
        R = rotary.rotations(t, d_head=T.shape[-1], base=10000.0, dtype=T.dtype)
        return rotary.rotate(T, R, style)

    def published(T, t):
        """Llama's ``T cos + rotate_half(T) sin`` or GPT-J's every-two form."""
        a = T.shape[-1]
        angle = t[..., None] * 10000.0 ** (-torch.arange(0, a, 2, dtype=T.dtype) / a)
        if style == "half":
            angle, turned = torch.cat([angle, angle], -1), torch.cat(
                [-T[..., a // 2:], T[..., : a // 2]], -1)
        else:
            angle = angle.repeat_interleave(2, -1)
            turned = torch.stack([-T[..., 1::2], T[..., 0::2]], -1).flatten(-2)
        return T * angle.cos()[:, None] + turned * angle.sin()[:, None]
    return rotation_equation, published


def _rope_scores(shift: int):
    def scores_at(Q, K):
        """RoPE scores with query and key positions 0, 1, … shifted by ``shift``."""
        n, _, L, a = Q.shape
        R = rotary.rotations(torch.arange(L).expand(n, L) + shift, d_head=a, base=10000.0,
                             dtype=Q.dtype)
        return functional.attention_scores(rotary.rotate(Q, R, "half"),
                                           rotary.rotate(K, R, "half"))
    return scores_at


def _decode_forms(n_heads: int, n_kv_heads: int):
    def prefill_then_steps(X, W, W_O):
        """Two tokens of prefill (the one token there is when τ = 1), then one token a
        call, through a KVCache (RoPE on)."""
        cache, options = KVCache(), {"n_heads": n_heads, "n_kv_heads": n_kv_heads,
                                     "causal": True, "rope": "half"}
        L = X.shape[1]
        cuts = [0, *range(min(2, L), L + 1)]
        return torch.cat([functional.multi_head_attention(X[:, a:b], W, W_O, cache=cache,
                                                          **options)
                          for a, b in itertools.pairwise(cuts)], dim=1)

    def one_forward(X, W, W_O):
        return functional.multi_head_attention(X, W, W_O, n_heads=n_heads,
                                               n_kv_heads=n_kv_heads, causal=True, rope="half")
    return prefill_then_steps, one_forward


def _linear_keys_first(phi_Q, phi_K, V):
    """φ_Q (φ_Kᵀ V): the keys' (a c) summary first, with plain matmuls."""
    return phi_Q @ (phi_K.mT @ V)


def _linear_prefix_sums(phi_Q, phi_K, V):
    """The causal numerator by prefix sums, (L4)–(L6)."""
    H, _ = linear.prefix_sums(phi_K, V, phi_Q.shape[2])
    return linear.causal_numerator(phi_Q, H)


def _linear_masked_weights(phi_Q, phi_K, V):
    """The causal numerator the quadratic way: (φ_Q φ_Kᵀ, zero where σ > τ) V."""
    return (phi_Q @ phi_K.mT).tril() @ V


def _linear_strict_prefix(phi_Q, phi_K, V):
    """Wrong: each query's own key left out (σ < τ)."""
    return (phi_Q @ phi_K.mT).tril(-1) @ V


def _linear_forms(causal: bool):
    def linear_order(Q, K, V):
        return linear.linear_attention(Q, K, V, causal=causal)

    def quadratic_order(Q, K, V):
        return linear.quadratic_form(Q, K, V, causal=causal)
    return linear_order, quadratic_order


_PHIS = {"phi_Q": "n μ τ a", "phi_K": "n μ σ a", "V": "n μ σ c"}
_QKV_C = {"Q": "n μ τ a", "K": "n μ σ a", "V": "n μ σ c"}
_LAYER_GQA = {"X": "n τ i", "W": "(g C a) i", "W_O": "(g r) a i"}


def variation_steps(s: dict[str, int]) -> list[Step]:
    """The variations' true steps at ``s``: GQA, circuits, RoPE, the cache, linear."""
    q = _gqa_sizes(s)
    μ, g = q["μ"], q["g"]
    even = {**s, "σ": s["τ"], "a": 2 * max(1, s["a"] // 2)}  # RoPE turns pairs
    lin = with_value_width(s)
    circuit = {k: v for k, v in q.items() if k not in "Bj"}  # fewer sizes: a wider exact span
    prefix = {k: v for k, v in {**lin, "σ": s["τ"]}.items() if k in "nμτσac"}
    return [
        Step("(1q)+(1kv) = (1) when j = i", functional.PROJECT, cross.split_projection(s["μ"]),
             s, exact=True),
        Step("GQA (g C a) layout = repeat-interleave reference", *_gqa_layers(μ, g), q,
             exact=False, inputs=_LAYER_GQA),
        Step("W_QK circuit = Q·K scores", *_circuit_scores(μ, g), circuit, exact=True,
             inputs={"X": "n τ i", "W": "(g C a) i"}),
        Step("W_OV circuit = A·V·W_O output", *_circuit_output(μ, g), circuit, exact=True,
             inputs={"A": "n μ τ σ", "X": "n σ i", "W": "(g C a) i", "W_O": "μ a i"},
             draws=8),
        Step("RoPE (R1) rotation = Llama's rotate_half", *_rope_forms("half"), even,
             exact=False, inputs={"T": "n μ τ a", "t": "n τ"}),
        Step("RoPE (R2) rotation = GPT-J's rotate_every_two", *_rope_forms("interleaved"),
             even, exact=False, inputs={"T": "n μ τ a", "t": "n τ"}),
        Step("RoPE scores depend on t − s only (positions + 1000)", _rope_scores(1000),
             _rope_scores(0), even, exact=False, inputs={"Q": "n μ τ a", "K": "n μ σ a"}),
        Step("KV cache: prefill + token steps = one causal forward",
             *_decode_forms(μ, g), {**q, "a": even["a"]}, exact=False, inputs=_LAYER_GQA),
        Step("linear attention: (L1) as one equation = φ_Q (φ_Kᵀ V)", linear.NUMERATOR,
             _linear_keys_first, lin, exact=True),
        Step("causal linear attention: prefix sums (L4)–(L6) = masked weights",
             _linear_prefix_sums, _linear_masked_weights, prefix, exact=True, inputs=_PHIS,
             draws=8),
        Step("linear attention = its quadratic form (no softmax)", *_linear_forms(False), lin,
             exact=False, inputs=_QKV_C),
        Step("causal linear attention = its causal quadratic form", *_linear_forms(True), lin,
             exact=False, inputs=_QKV_C),
    ]


def variation_mutations(s: dict[str, int]) -> list[Step]:
    """Plausible wrong steps of the variations."""
    t = _gqa_sizes({**s, "μ": 6}, g=2)  # the two orders coincide when g = 1 or r = 1
    return [
        Step("(1kv) with K and V swapped in W_KV", functional.PROJECT,
             cross.split_projection(s["μ"], swapped=True), s, exact=True),
        Step("tiled GQA heads (r g) read as grouped (g r)", *_tiled(t["μ"], t["g"]), t,
             exact=False, inputs=_LAYER_GQA),
        Step("causal linear attention with a strict prefix σ < τ", _linear_prefix_sums,
             _linear_strict_prefix, {**with_value_width(s), "σ": s["τ"]}, exact=True,
             inputs=_PHIS),
    ]


# -- the attention patterns: the terms of equation (3), einattn.pattern_steps's forms --------

def pattern_steps(s: dict[str, int]) -> list[Step]:
    """The patterns' true steps, each at :func:`einattn.pattern_steps.pattern_sizes` (one
    query fewer than keys at self-attention sizes), the documents' with no more queries
    than keys; w is half the keys."""
    p, packed = _pattern.pattern_sizes(s), _pattern.packed_sizes(s)
    w, qkv = _pattern.window_width(p["σ"]), _pattern.QKV
    return [
        Step("sliding window, causal = its dense mask τ' − w < σ ≤ τ'",
             *_pattern.window_forms(w, causal=True), p, exact=False, inputs=qkv),
        Step("sliding window = its dense mask |τ' − σ| < w",
             *_pattern.window_forms(w, causal=False), p, exact=False, inputs=qkv),
        Step("softcap c·tanh(S/c) after the 1/√a scale, before B and M",
             *_pattern.softcap_forms(_pattern.SOFTCAP, w), p, exact=False, inputs=qkv),
        Step("sinks = softmax over σ and one more logit s_μ (its value zero)",
             *_pattern.sink_forms(), p, exact=False, inputs=_pattern.SINKS),
        Step("ALiBi −m_μ|τ' − σ| = BLOOM's +m_μ·σ under causal (a per-row shift)",
             *_pattern.alibi_forms(), p, exact=False, inputs=qkv),
        Step("documents = a block-diagonal mask", *_pattern.document_forms(causal=False),
             packed, exact=False, inputs=_pattern.DOCUMENTS),
        Step("packed documents, causal = each document alone, concatenated",
             *_pattern.document_forms(causal=True), packed, exact=False,
             inputs=_pattern.DOCUMENTS),
    ]


def pattern_mutations(s: dict[str, int]) -> list[Step]:
    """Plausible wrong steps of the patterns, at the sizes of their true steps."""
    p, packed = _pattern.pattern_sizes(s), _pattern.packed_sizes(s)
    w, qkv = _pattern.window_width(p["σ"]), _pattern.QKV
    causal_window, window = (_pattern.window_forms(w, causal)[0] for causal in (True, False))
    wider, top_left = _pattern.wrong_windows(w)
    capped = _pattern.softcap_forms(_pattern.SOFTCAP, w)[0]
    capped_last, unscaled = _pattern.wrong_softcaps(_pattern.SOFTCAP, w)
    alibi, (flipped, reversed_) = _pattern.alibi_forms()[0], _pattern.wrong_alibis()
    return [
        Step("window off by one: τ' − w ≤ σ, w + 1 keys", causal_window, wider, p, exact=False,
             inputs=qkv),
        Step("window aligned top-left: τ for τ'", window, top_left, p, exact=False, inputs=qkv),
        Step("softcap after B and M", capped, capped_last, p, exact=False, inputs=qkv),
        Step("softcap before the 1/√a scale", capped, unscaled, p, exact=False, inputs=qkv),
        Step("sink counted in the first key's numerator", _pattern.sink_forms()[0],
             _pattern.sink_in_a_numerator, p, exact=False, inputs=_pattern.SINKS),
        Step("ALiBi with its sign flipped", alibi, flipped, p, exact=False, inputs=qkv),
        Step("ALiBi slopes in reverse head order", alibi, reversed_, p, exact=False,
             inputs=qkv),
        Step("packed documents without their ids", _pattern.one_at_a_time,
             _pattern.packed_without_ids, packed, exact=False, inputs=_pattern.DOCUMENTS),
    ]


# -- the registry ---------------------------------------------------------------------------

def steps(sizes: dict[str, int] | None = None) -> list[Step]:
    """Every true step of docs/derivation.md at ``sizes`` (default: the worked example),
    the variations' and the attention patterns' last."""
    s = default_sizes() if sizes is None else sizes
    self_sizes = {**s, "σ": s["τ"]}
    μ = s["μ"]
    layer, reshape = _layers(μ, causal=True)
    return [
        Step("fused projection = three separate projections", functional.PROJECT,
             _projections(μ), s, exact=True),
        Step("scores as one four-operand contraction X W_Q W_K X = Q·K",
             "S[n μ τ σ] = X[n τ i] W_Q[μ a i] W_K[μ a j] X[n σ j]", _q_dot_k,
             self_sizes, exact=True),
        Step("index fusion (a i) = a·p + i", "Y[n (a i)] = T[n a i]", _fuse_by_formula,
             s, exact=True),
        Step("W_O[μ a i] contraction = concatenate heads + linear", functional.HEADS,
             _concat_then_linear, s, exact=True),
        Step("(μ B a) and (B μ a) related by a rearrangement", functional.PROJECT,
             _bma_projection(μ), s, exact=True),
        Step("(3) softmax_σ(S + M) as its Equation = torch.softmax with the mask applied",
             *_pattern.softmax_forms(), s, exact=False, inputs=_pattern.MASKED),
        Step("additive causal M = boolean causal mask", *_pattern.causal_softmaxes(), s,
             exact=False, inputs={"S": "n μ τ σ"}),
        Step("whole layer = reshape form", layer, reshape, self_sizes, exact=False,
             inputs={"X": "n τ i", "W": "(μ B a) i", "W_O": "μ a i"}),
        *variation_steps(s),
        *pattern_steps(s),
        *_numerical(_ring.steps(s)),
        *_gradient.steps(s),
        *_field.steps(s),
        *_models.steps(s),
    ]


def _scores_without_scale(Q, K):
    return Q @ K.transpose(-2, -1)


def _scores_scaled(Q, K):
    return Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])


def _transposed_W_O(Z, W_O):
    μ, a, i = W_O.shape
    return functional.combine_heads(Z, W_O.reshape(μ, i, a).transpose(1, 2))


def mutations(sizes: dict[str, int] | None = None) -> list[Step]:
    """Plausible wrong steps; verification must reject every one."""
    s = default_sizes() if sizes is None else sizes
    self_sizes = {**s, "σ": s["τ"]}
    return [
        Step("swapped indices τ ↔ σ in the scores", functional.SCORES,
             "S[n μ τ σ] = Q[n μ σ a] K[n μ τ a] / √a", self_sizes, exact=True),
        Step("missing 1/√a scale", _scores_without_scale, _scores_scaled, self_sizes,
             exact=False, inputs={"Q": "n μ τ a", "K": "n μ σ a"}),
        Step("wrong group order (B μ a) read as (μ B a)", functional.PROJECT,
             "P[n τ μ B a] = X[n τ i] W[(B μ a) i]", s, exact=True),
        Step("transposed W_O", functional.HEADS, _transposed_W_O, s, exact=True),
        Step("off-by-one causal mask", _pattern.causal_softmaxes()[1], _pattern.off_by_one,
             self_sizes, exact=False, inputs={"S": "n μ τ σ"}),
        Step("(3)'s softmax along τ, not σ", _pattern.softmax_along_tau,
             _pattern.softmax_forms()[1], s, exact=False, inputs=_pattern.MASKED),
        Step("tiling (a μ) instead of interleaving (μ a)", "Y[n (μ a)] = T[n μ a]",
             "Y[n (a μ)] = T[n μ a]", s, exact=True),
        *variation_mutations(s),
        *pattern_mutations(s),
        *_numerical(_ring.mutations(s)),
        *_gradient.mutations(s),
        *_field.mutations(s),
        *_models.mutations(s),
    ]


def _numerical(rows) -> list[Step]:
    """Steps checked in float64 from ``(name, lhs, rhs, sizes, inputs)`` rows."""
    return [Step(name, lhs, rhs, sizes, exact=False, inputs=inputs)
            for name, lhs, rhs, sizes, inputs in rows]
