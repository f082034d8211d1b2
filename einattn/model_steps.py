"""The steps of today's models' attention (docs/models.md), registered beside the
derivation's (:func:`einattn.derivation.steps`): each variant's identity, proved in the finite
field where both sides are its equations, with integers where a side is Python code of a
multilinear step, in float64 where it runs torch code, and the wrong steps that every mode
rejects (:func:`mutations`).

* MLA's absorption (:mod:`einattn.latent`): the scores and the output re-associated;
* values of their own width (1b), and keys and values from two contexts (1k), (1v);
* qk-norm: over the heads as OLMo 2 writes it; without a gain it commutes with RoPE;
* the gate's rows, interleaved per head in Qwen3-Next's ``q_proj``;
* differential attention: the weights' difference is the outputs' (D4), and HF's pairing of
  the heads by halves is einattn's value pairs;
* Llama 4's temperature scales the scores' rows;
* ``add_bias_kv``'s slot, seen by every query, is torch's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange

from . import (
    cross,
    differential,
    equations,
    functional,
    gate,
    layouts,
    qk_norm,
    rotary,
    temperature,
)
from . import latent as mla
from ._step import Step
from .chain import Chain
from .module import MultiHeadAttention
from .notation import Equation

SCORE_TERM = Equation("S_A[n μ τ σ] = Q_A[n μ τ a] K_A[n μ σ a]")
LATENT_TERM = Equation("S_A[n μ τ σ] = Q_C[n μ τ c] C_KV[n σ c]")
SOFTMAXES = ("A_1[n p τ σ] = softmax_σ(S_1[n p τ σ])", "A_2[n p τ σ] = softmax_σ(S_2[n p τ σ])")
WEIGHTS_DIFFERENCE = "Z_D[n p τ c] = (A_1[n p τ σ] − λ · A_2[n p τ σ]) V[n p σ c]"
OUTPUTS_DIFFERENCE = ("Z_1[n p τ c] = A_1[n p τ σ] V[n p σ c]",
                      "Z_2[n p τ c] = A_2[n p τ σ] V[n p σ c]",
                      "Z_D[n p τ c] = Z_1[n p τ c] − λ · Z_2[n p τ c]")
TEMPERED = (temperature.SCALED, "S[n μ τ σ] = Q_t[n μ τ a] K[n μ σ a]")
UNTEMPERED = "S_0[n μ τ σ] = Q[n μ τ a] K[n μ σ a]"
LAMBDA = 0.37  # differential attention's λ in the pairing steps


_CAP = 6  # an identity of index equations needs no large sizes; these keep its tensors small


def sizes_of(s: dict[str, int]) -> dict[str, dict[str, int]]:
    """Each family's sizes: n, τ, i, μ, a as ``s`` gives them (up to a cap), the family's own
    indices beside them, each moved up to the nearest size not taken (a even where RoPE turns
    it), so that no swapped pair can hide. Three sizes meet on purpose: ``square``'s a = c,
    where W_UK read as [μ c a] has the right shape; ``slot``'s i = μ·a, torch's heads; and
    ``tempered``'s σ = τ, where β[n σ] has β[n τ]'s shape."""
    n, τ, a = min(s["n"], 3), min(s["τ"], _CAP), min(s["a"], _CAP)
    i, μ = min(s["i"], 2 * _CAP), min(s["μ"], _CAP)
    rows = [("τ", τ), ("n", n)]
    latent = _distinct([*rows, ("σ", τ + 1), ("μ", 3), ("a", 4), ("c", 7), ("b", 8), ("i", 9)])
    wide = _distinct([*rows, ("i", i), ("g", 3), ("r", 2), ("a", a), ("b", a + 3)])
    slot = _distinct([("B", 3), ("μ", 2), ("a", 5), *rows])  # small: W holds 3 (μ a)²
    tempered = _distinct([*rows, ("μ", μ), ("a", a)])
    return {"latent": latent, "square": {**latent, "c": latent["a"]},
            "wide": {**wide, "e": (wide["r"] + 1) * wide["a"] + wide["b"]},
            "contexts": _distinct([("σ", τ + 1), ("n", n), ("g", 3), ("a", a), ("b", a + 3),
                                   ("j", i)]),
            "heads": _distinct([*rows, ("μ", μ), ("a", a)], even="a"),
            "gate": _distinct([("B", 2), *rows, ("μ", μ), ("a", a), ("i", i)]),
            "pairs": _distinct([("μ", 12), ("g", 4), *rows, ("σ", τ + 1), ("a", a)]),
            "differential": _distinct([*rows, ("σ", τ + 1), ("p", 3), ("c", 2 * a)]),
            "tempered": {**tempered, "σ": tempered["τ"]},
            "slot": {**slot, "i": slot["μ"] * slot["a"]}}


def _distinct(wanted: list[tuple[str, int]], even: str = "") -> dict[str, int]:
    """The sizes in order, each moved up to the nearest size no earlier index took (and to
    an even one for the index ``even``)."""
    sizes: dict[str, int] = {}
    for index, size in wanted:
        stride = 2 if index == even else 1
        size += size % stride
        while size in sizes.values():
            size += stride
        sizes[index] = size
    return sizes


# -- values of their own width, two contexts ----------------------------------------------------

def _wide(g: int, r: int, b: int, swapped: bool = False):
    def fused(X, W):
        """(1b) as the layer runs it: Q, K, V of ``W[(g e) i]``, laid side by side per group."""
        Q, K, V = equations.project_qkv(X, W, n_heads=g * r, n_kv_heads=g, d_value=b)
        Q = rearrange(Q, "n (g r) τ a -> n g τ (r a)", g=g)
        return torch.cat([Q, K, V], -1)

    def rows(X, W):
        """Each group's rows taken by hand: its queries, its key, its value (``swapped``:
        the value block read before the key's, a wrong layout)."""
        a = (W.shape[0] // g - b) // (r + 1)
        W3 = W.view(g, -1, W.shape[-1])
        blocks = [W3[:, :r * a], W3[:, r * a + b:], W3[:, r * a:r * a + b]] if swapped else \
            [W3[:, :r * a], W3[:, r * a:(r + 1) * a], W3[:, (r + 1) * a:]]
        return torch.cat([torch.einsum("nti,gei->ngte", X, w) for w in blocks], -1)
    return _bilinear(fused, rows)


def _contexts(g: int, wrong: bool = False):
    def einattn_two(C_K, C_V, W_K, W_V):
        """(1k), (1v) as :func:`einattn.cross.project` runs them (queries of no width)."""
        X = C_K.new_zeros(C_K.shape[0], 1, 1)
        _, K, V = cross.project(X, W_K.new_zeros(W_K.shape[0] * 2, 1), (C_K, C_V),
                                (W_K, W_V), n_heads=2 * g, n_kv_heads=g)
        return torch.cat([K, V], -1)

    def linears(C_K, C_V, W_K, W_V):
        """nn.MultiheadAttention's k_proj_weight, v_proj_weight (``wrong``: both on C_V)."""
        K = F.linear(C_V if wrong else C_K, W_K)
        heads = [torch.unflatten(t, -1, (g, -1)).transpose(1, 2) for t in (K, F.linear(C_V, W_V))]
        return torch.cat(heads, -1)
    return _bilinear(einattn_two, linears)


def _bilinear(*sides):
    """Python sides of a step that is a product of two drawn tensors: degree 2, the bound of
    the exact mode's integers (:func:`einattn.verify.check_equivalent`)."""
    for side in sides:
        side.degree = 2
    return sides


# -- qk-norm --------------------------------------------------------------------------------------

def _over_heads(T, gamma):
    return qk_norm.normalised(T, gamma, qk_norm.QKNorm("heads", "gamma", 1e-6))


def _flat(T, gamma):
    """OLMo 2: the norm of the flat projection ``[n τ (μ a)]``, before the heads are split."""
    flat = rearrange(T, "n μ τ a -> n τ (μ a)")
    normed = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + 1e-6) * gamma.flatten()
    return rearrange(normed, "n τ (μ a) -> n μ τ a", μ=T.shape[1])


def _per_head(T, gamma):
    """Wrong for OLMo 2: each head normalised alone."""
    return T * torch.rsqrt(T.pow(2).mean(-1, keepdim=True) + 1e-6) * gamma[:, None]


def _commuting(gained: bool):
    """The norm after RoPE and before it, per head (``gained``: with γ[a], which no rotation
    leaves alone)."""
    norm = qk_norm.QKNorm("head", "gamma" if gained else None, 1e-6)

    def turned(T, gamma, t):
        return rotary.rotate(T, rotary.rotations(t, d_head=T.shape[-1], base=10000.0,
                                                 dtype=T.dtype), "interleaved")

    def after(T, gamma, t):
        return qk_norm.normalised(turned(T, gamma, t), gamma, norm)

    def before(T, gamma, t):
        return turned(qk_norm.normalised(T, gamma, norm), gamma, t)
    return after, before


# -- the gate's rows, differential attention -----------------------------------------------------

def _gate_rows(n_heads: int, blocks: bool = False):
    def einattn_gate(X, q_proj):
        _, W_G = gate.from_interleaved(q_proj, n_heads)
        return gate.GATE(X=X, W_G=W_G, μ=n_heads)

    def hf_gate(X, q_proj):
        """Qwen3-Next: ``q_proj(x).view(n, L, μ, 2a).chunk(2)``'s second part (``blocks``:
        the last μ·a rows, a wrong layout)."""
        P = F.linear(X, q_proj)
        if blocks:
            return torch.unflatten(P[..., P.shape[-1] // 2:], -1, (n_heads, -1))
        return torch.unflatten(P, -1, (n_heads, 2, -1))[..., 1, :]
    return _bilinear(einattn_gate, hf_gate)


def _einattn_pairs(Q, K, V):
    """einattn: attention over the value pairs (D2)–(D3), then (D4) on the halves."""
    Z = functional.attention(Q, K, differential.value_pairs(V))
    Z_1, Z_2 = Z.chunk(2, dim=1)
    return differential.DIFFERENCE(Z_1=Z_1, Z_2=Z_2, λ=LAMBDA, q=K.shape[1] // 2)


def _hf_pairs(neighbours: bool = False):
    def hf(Q, K, V):
        """DiffLlama: the values' two halves, each repeated to every group, two attentions,
        their outputs side by side, the heads' two halves subtracted (``neighbours``: heads
        and values paired with their neighbours, a layout DiffLlama does not have)."""
        r = Q.shape[1] // K.shape[1]
        if neighbours:
            v1, v2 = V[:, 0::2], V[:, 1::2]
        else:
            v1, v2 = V.chunk(2, dim=1)
        out = torch.cat([_softmax_attention(Q, K, torch.cat([v, v], 1), r)
                         for v in (v1, v2)], -1)
        o1, o2 = (out[:, 0::2], out[:, 1::2]) if neighbours else out.chunk(2, dim=1)
        return o1 - LAMBDA * o2
    return hf


def _softmax_attention(Q, K, V, r: int):
    """softmax(Q Kᵀ / √a) V with each key/value head repeated for its r query heads."""
    K, V = K.repeat_interleave(r, 1), V.repeat_interleave(r, 1)
    return torch.softmax(Q @ K.mT / math.sqrt(Q.shape[-1]), -1) @ V


# -- add_bias_kv ----------------------------------------------------------------------------------

def _einattn_slot(X, W, W_O, k_b, v_b):
    """A causal einattn layer with ``bias_kv``: its slot seen by every query."""
    layer = MultiHeadAttention.from_fused(W, W_O, causal=True, bias_kv=True)
    with torch.no_grad():
        layer.bias_k.copy_(k_b)
        layer.bias_v.copy_(v_b)
        return layer(X)


def _torch_slot(hidden: bool = False):
    def torch_mha(X, W, W_O, k_b, v_b):
        """``F.multi_head_attention_forward`` with ``bias_k``, ``bias_v`` and the causal mask
        (``hidden``: its ``is_causal=True`` without weights, whose SDPA hides the slot)."""
        _, L, E = X.shape
        future = torch.ones(L, L, dtype=torch.bool, device=X.device).triu(1)
        x = X.transpose(0, 1)
        Y, _ = F.multi_head_attention_forward(
            x, x, x, E, W_O.shape[0], layouts.to_bma(W, n_heads=W_O.shape[0]), None,
            k_b.view(1, 1, E), v_b.view(1, 1, E), False, 0.0,
            layouts.W_O_to_linear(W_O), None, training=False, need_weights=not hidden,
            attn_mask=future, is_causal=hidden)
        return Y.transpose(0, 1)
    return torch_mha


# -- the registry ---------------------------------------------------------------------------------

_SCORES_IN = {"Q": "n μ τ a", "K": "n g σ a", "V": "n g σ a"}
_SLOT_IN = {"X": "n τ i", "W": "(μ B a) i", "W_O": "μ a i", "k_b": "(μ a)", "v_b": "(μ a)"}


def steps(s: dict[str, int]) -> list[Step]:
    """Today's models' true steps at sizes from ``s``."""
    z = sizes_of(s)
    wide = z["wide"]
    return [
        Step("MLA absorption: scores Q_A·(C_KV W_UK) = (Q_A W_UK)·C_KV", Chain(
            mla.KEYS, SCORE_TERM), Chain(mla.ABSORB_Q, LATENT_TERM), z["latent"], True),
        Step("MLA absorption: output ((A (C_KV W_UV)) W_O) = (((A C_KV) W_UV) W_O)", Chain(
            mla.VALUES, mla.WEIGHTED, mla.OUTPUT), Chain(mla.WEIGHTED_LATENT, mla.ABSORB_V,
                                                         mla.OUTPUT), z["latent"], True),
        Step("(1b) W[(g e) i], e = (r a | a | b) = each group's rows by hand",
             *_wide(wide["g"], wide["r"], wide["b"]), wide, True,
             inputs={"X": "n τ i", "W": "(g e) i"}),
        Step("(1k), (1v): keys and values from contexts of their own = two linears",
             *_contexts(z["contexts"]["g"]), z["contexts"], True,
             inputs={"C_K": "n σ j", "C_V": "n σ j", "W_K": "(g a) j", "W_V": "(g b) j"}),
        Step("qk-norm over the heads = OLMo 2's norm of the flat projection", _over_heads,
             _flat, z["heads"], False, inputs={"T": "n μ τ a", "gamma": "μ a"}),
        Step("qk-norm without a gain commutes with RoPE (Llama 4's after = before)",
             *_commuting(gained=False), z["heads"], False,
             inputs={"T": "n μ τ a", "gamma": "a", "t": "n τ"}),
        Step("gate rows (μ B a) = Qwen3-Next's view(n, L, μ, 2a).chunk(2)",
             *_gate_rows(z["gate"]["μ"]), z["gate"], True,
             inputs={"X": "n τ i", "q_proj": "(μ B a) i"}),
        Step("(D4) (A_1 − λ A_2) V = Z_1 − λ Z_2", Chain(*SOFTMAXES, WEIGHTS_DIFFERENCE),
             Chain(*SOFTMAXES, *OUTPUTS_DIFFERENCE), z["differential"], True),
        Step("differential heads (δ q r), value pairs (e q) = DiffLlama's halves",
             _einattn_pairs, _hf_pairs(), z["pairs"], False, inputs=_SCORES_IN),
        Step("(T3) β[n τ] Q, then the scores = the scores, then β[n τ] on their rows",
             Chain(*TEMPERED), Chain(UNTEMPERED, "S[n μ τ σ] = β[n τ] S_0[n μ τ σ]"),
             z["tempered"], True),
        Step("add_bias_kv: the slot, seen by every query = torch's (causal attn_mask)",
             _einattn_slot, _torch_slot(), z["slot"], False, inputs=_SLOT_IN),
    ]


def mutations(s: dict[str, int]) -> list[Step]:
    """Plausible wrong steps of today's models; every mode must reject them."""
    z = sizes_of(s)
    wide = z["wide"]
    transposed = "Q_C[n μ τ c] = Q_A[n μ τ a] W_UK[μ c a]"
    return [
        Step("MLA absorption with W_UK read as [μ c a]", Chain(mla.KEYS, SCORE_TERM),
             Chain(transposed, LATENT_TERM), z["square"], True),
        Step("(1b) with the value block read before the key's",
             *_wide(wide["g"], wide["r"], wide["b"])[:1],
             _wide(wide["g"], wide["r"], wide["b"], swapped=True)[1], wide, True,
             inputs={"X": "n τ i", "W": "(g e) i"}),
        Step("(1k) with the keys projected from the values' context",
             _contexts(z["contexts"]["g"])[0], _contexts(z["contexts"]["g"], wrong=True)[1],
             z["contexts"], True,
             inputs={"C_K": "n σ j", "C_V": "n σ j", "W_K": "(g a) j", "W_V": "(g b) j"}),
        Step("qk-norm over the heads taken per head", _over_heads, _per_head, z["heads"],
             False, inputs={"T": "n μ τ a", "gamma": "μ a"}),
        Step("qk-norm with a gain γ[a] after RoPE = before it", *_commuting(gained=True),
             z["heads"], False, inputs={"T": "n μ τ a", "gamma": "a", "t": "n τ"}),
        Step("gate rows read as the last μ·a rows (B μ a)", _gate_rows(z["gate"]["μ"])[0],
             _gate_rows(z["gate"]["μ"], blocks=True)[1], z["gate"], True,
             inputs={"X": "n τ i", "q_proj": "(μ B a) i"}),
        Step("(D4) with λ on the first softmax", Chain(*SOFTMAXES, WEIGHTS_DIFFERENCE),
             Chain(*SOFTMAXES, *OUTPUTS_DIFFERENCE[:2],
                   "Z_D[n p τ c] = λ · Z_1[n p τ c] − Z_2[n p τ c]"), z["differential"], True),
        Step("differential heads paired with their neighbours", _einattn_pairs,
             _hf_pairs(neighbours=True), z["pairs"], False, inputs=_SCORES_IN),
        Step("(T3) with β at the key's position", Chain(*TEMPERED),
             Chain(UNTEMPERED, "S[n μ τ σ] = β[n σ] S_0[n μ τ σ]"), z["tempered"], True),
        Step("add_bias_kv's slot hidden by torch's is_causal=True", _einattn_slot,
             _torch_slot(hidden=True), z["slot"], False, inputs=_SLOT_IN),
    ]
