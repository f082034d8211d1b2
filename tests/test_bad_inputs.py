"""Bad input to ``einattn.MultiHeadAttention``: every one raises ``EinattnError`` (a
``ValueError``) at the layer's boundary, with a message that names the argument or index and
the sizes involved (STYLE §4).

One table, one parametrized test; then a test that every ``raise`` in einattn/module.py is
reached by some row of the table, so a new raise site without a test fails here.

The layer used throughout: d_model=30, n_heads=5 (d_head=6), float64; x (2, 5, 30),
context (2, 7, 30).
"""

from __future__ import annotations

import ast
import re
import traceback
from pathlib import Path

import pytest
import torch
from conftest import FLEX_CPU, here, on_cpu_only

import einattn
from einattn import EinattnError, MultiHeadAttention

F64 = torch.float64
N, L_Q, L_K, D, H = 2, 5, 7, 30, 5


def _layer(**options) -> MultiHeadAttention:
    return MultiHeadAttention(D, H, dtype=F64, **options)


def _scaled(rope_type: str, **keys):
    """A layer with rope="half" and this rope_scaling, made when the case runs."""
    return lambda: _layer(rope="half", rope_scaling={"rope_type": rope_type, **keys})


def _x(*shape: int, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.ones(*shape or (N, L_Q, D), dtype=dtype)


def _c(*shape: int, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.ones(*shape or (N, L_K, D), dtype=dtype)


def _cross(**kwargs):
    """A cross-attention call (L_q=5, L_k=7) with extra keyword arguments."""
    return lambda: _layer()(_x(), _c(), **kwargs)


def _projections(**override):
    """Valid reshape-layout weights for d_model=30, n_heads=5, d_head=6, with overrides."""
    w = {"W_q": torch.ones(30, D), "W_k": torch.ones(30, D), "W_v": torch.ones(30, D),
         "W_o": torch.ones(D, 30)}
    w |= override
    n_heads = w.pop("n_heads", H)
    weights = [w.pop(k) for k in ("W_q", "W_k", "W_v", "W_o")]
    return lambda: MultiHeadAttention.from_projections(*weights, n_heads=n_heads, **w)


def _mask(*shape: int, dtype=torch.bool) -> torch.Tensor:
    return torch.ones(*shape, dtype=dtype)


def _ids(*shape: int, dtype=torch.long) -> torch.Tensor:
    """Document ids d[n σ] (all one document) of this shape and dtype."""
    return torch.zeros(*shape, dtype=dtype)


def _cached_then(**kwargs):
    """A call with a cache that holds document ids, then a second call with kwargs."""
    def call():
        layer, cache = _layer(causal=True), einattn.KVCache()
        layer(_x(), cache=cache, document_ids=_ids(N, L_Q))
        layer(_x(N, 1, D), cache=cache, **kwargs)
    return call


def _to_torch_with_d_head_7():
    return _layer(d_head=7).to_torch()


BAD = {
    # -- constructor: sizes ------------------------------------------------------------------
    "d_model-not-divisible": (lambda: MultiHeadAttention(30, 4),
                              r"d_model=30 is not divisible by n_heads=4: index 'a' would have "
                              r"size 30/4; pass d_head explicitly"),
    "d_model-zero": (lambda: MultiHeadAttention(0, 5), r"d_model must be a positive int, got 0"),
    "d_model-negative": (lambda: MultiHeadAttention(-30, 5),
                         r"d_model must be a positive int, got -30"),
    "d_model-bool": (lambda: MultiHeadAttention(True, 1),
                     r"d_model must be a positive int, got True"),
    "d_model-float": (lambda: MultiHeadAttention(30.0, 5),
                      r"d_model must be a positive int, got 30\.0"),
    "n_heads-zero": (lambda: MultiHeadAttention(30, 0), r"n_heads must be a positive int, got 0"),
    "n_heads-negative": (lambda: MultiHeadAttention(30, -5),
                         r"n_heads must be a positive int, got -5"),
    "n_heads-bool": (lambda: MultiHeadAttention(30, True),
                     r"n_heads must be a positive int, got True"),
    "n_heads-str": (lambda: MultiHeadAttention(30, "5"),
                    r"n_heads must be a positive int, got '5'"),
    "d_head-zero": (lambda: MultiHeadAttention(30, 5, d_head=0),
                    r"d_head must be a positive int, got 0"),
    "d_head-negative": (lambda: MultiHeadAttention(30, 5, d_head=-6),
                        r"d_head must be a positive int, got -6"),
    "d_head-bool": (lambda: MultiHeadAttention(30, 5, d_head=True),
                    r"d_head must be a positive int, got True"),
    "d_head-float": (lambda: MultiHeadAttention(30, 5, d_head=6.0),
                     r"d_head must be a positive int, got 6\.0"),
    # -- constructor: options ----------------------------------------------------------------
    "dropout-negative": (lambda: MultiHeadAttention(30, 5, dropout=-0.1),
                         r"dropout .* must be a number in \[0, 1\), got -0\.1"),
    "dropout-one": (lambda: MultiHeadAttention(30, 5, dropout=1.0),
                    r"dropout .* must be a number in \[0, 1\), got 1\.0"),
    "dropout-nan": (lambda: MultiHeadAttention(30, 5, dropout=float("nan")),
                    r"dropout .* must be a number in \[0, 1\), got nan"),
    "init-unknown": (lambda: MultiHeadAttention(30, 5, init="xavier"),
                     r"init must be 'torch' or 'gpt2', got 'xavier'"),
    "reset_parameters-unknown": (lambda: _layer().reset_parameters("kaiming"),
                                 r"init must be 'torch' or 'gpt2', got 'kaiming'"),
    # -- forward: x and context --------------------------------------------------------------
    "x-feature-size": (lambda: _layer()(_x(N, L_Q, 29)),
                       r"x has shape \(2, 5, 29\) but the layer expects \(n, L, d_model=30\) "
                       r"\(index 'i' has size 30 in W\)"),
    "x-2d": (lambda: _layer()(_x(L_Q, D)), r"x has shape \(5, 30\) but the layer expects \(n, L, "
                                           r"d_model=30\)"),
    "x-4d": (lambda: _layer()(_x(1, N, L_Q, D)),
             r"x has shape \(1, 2, 5, 30\) but the layer expects \(n, L, d_model=30\)"),
    "x-sequence-first": (lambda: _layer(batch_first=False)(_x(L_Q, N, 29)),
                         r"x has shape \(5, 2, 29\) but the layer expects \(L, n, d_model=30\)"),
    "x-list": (lambda: _layer()([[[0.0] * D]]), r"x must be a torch\.Tensor, got list"),
    "x-dtype": (lambda: _layer()(_x(dtype=torch.float32)),
                r"x is torch\.float32 but the layer's W is torch\.float64; convert one with "
                r"\.to\(\)"),
    "context-batch": (lambda: _layer()(_x(), _c(3, L_K, D)),
                      r"index 'n' has size 3 in context but 2 in x"),
    "context-feature-size": (lambda: _layer()(_x(), _c(N, L_K, 31)),
                             r"context has shape \(2, 7, 31\) but the layer expects "
                             r"\(n, L, d_model=30\)"),
    "context-2d": (lambda: _layer()(_x(), _c(L_K, D)),
                   r"context has shape \(7, 30\) but the layer expects"),
    "context-not-tensor": (lambda: _layer()(_x(), 3.0),
                           r"context must be a torch\.Tensor, got float"),
    "context-dtype": (lambda: _layer()(_x(), _c(dtype=torch.float32)),
                      r"context is torch\.float32 but the layer's W is torch\.float64"),
    # -- forward: mask -------------------------------------------------------------------------
    "mask-2d-σ": (_cross(mask=_mask(L_Q, 6)),
                  r"mask has shape \(5, 6\): index 'σ' has size 6 in mask but 7 in the scores "
                  r"S\[n μ τ σ\] \(2, 5, 5, 7\)"),
    "mask-2d-τ": (_cross(mask=_mask(4, L_K)),
                  r"mask has shape \(4, 7\): index 'τ' has size 4 in mask but 5 in the scores"),
    "mask-2d-self-attention-σ": (lambda: _layer()(_x(), mask=_mask(L_Q, L_K)),
                                 r"index 'σ' has size 7 in mask but 5 in the scores"),
    "mask-3d-n": (_cross(mask=_mask(3, L_Q, L_K)),
                  r"mask has shape \(3, 5, 7\): index 'n' has size 3 in mask but 2 in the scores"),
    "mask-3d-τ": (_cross(mask=_mask(N, 6, L_K)),
                  r"mask has shape \(2, 6, 7\): index 'τ' has size 6 in mask but 5"),
    "mask-3d-heads-first": (_cross(mask=_mask(H, L_Q, L_K)),  # (μ, τ, σ) is not a 3-D layout
                            r"index 'n' has size 5 in mask but 2 in the scores"),
    "mask-4d-μ": (_cross(mask=_mask(N, 4, L_Q, L_K)),
                  r"mask has shape \(2, 4, 5, 7\): index 'μ' has size 4 in mask but 5"),
    "mask-4d-σ": (_cross(mask=_mask(N, H, L_Q, 8)),
                  r"index 'σ' has size 8 in mask but 7 in the scores"),
    "mask-4d-torch-layout": (_cross(mask=_mask(N * H, L_Q, L_K)),  # torch's (n·μ, τ, σ)
                             r"index 'n' has size 10 in mask but 2"),
    "mask-1d": (_cross(mask=_mask(L_K)),
                r"mask has 1 axes \(7,\); expected \(τ, σ\), \(n, τ, σ\) or \(n, μ, τ, σ\)"),
    "mask-5d": (_cross(mask=_mask(1, N, H, L_Q, L_K)), r"mask has 5 axes \(1, 2, 5, 5, 7\)"),
    "mask-int": (_cross(mask=_mask(L_Q, L_K, dtype=torch.int64)),
                 r"mask must be bool \(True = may attend\) or float \(added to the scores\), got "
                 r"torch\.int64; for a mask where 0 = blocked pass `mask != 0`"),
    "mask-uint8": (_cross(mask=_mask(L_Q, L_K, dtype=torch.uint8)),
                   r"got torch\.uint8; .*`mask != 0`"),
    "mask-float-other-dtype": (_cross(mask=_mask(L_Q, L_K, dtype=torch.float32)),
                               r"mask is torch\.float32 but the scores are torch\.float64"),
    "mask-list": (_cross(mask=[[True] * L_K] * L_Q), r"mask must be a torch\.Tensor, got list"),
    # -- forward: key_padding_mask -----------------------------------------------------------
    "key_padding_mask-L_q-not-L_k": (_cross(key_padding_mask=_mask(N, L_Q)),
                                     r"key_padding_mask has shape \(2, 5\) but must be "
                                     r"\(n, σ\) = \(2, 7\)"),
    "key_padding_mask-batch": (_cross(key_padding_mask=_mask(1, L_K)),
                               r"key_padding_mask has shape \(1, 7\) but must be \(n, σ\) = "
                               r"\(2, 7\)"),
    "key_padding_mask-3d": (_cross(key_padding_mask=_mask(N, 1, L_K)),
                            r"key_padding_mask has shape \(2, 1, 7\) but must be \(n, σ\)"),
    "key_padding_mask-int": (_cross(key_padding_mask=_mask(N, L_K, dtype=torch.int32)),
                             r"key_padding_mask must be bool with True = padding .* got "
                             r"torch\.int32; .* key_padding_mask=\(attention_mask == 0\)"),
    "key_padding_mask-float": (
        _cross(key_padding_mask=_mask(N, L_K, dtype=torch.float64)),
        r"key_padding_mask must be bool with True = padding .* got torch\.float64; .*mask="),
    "key_padding_mask-list": (_cross(key_padding_mask=[[False] * L_K] * N),
                              r"key_padding_mask has shape list but must be \(n, σ\) = \(2, 7\)"),
    # -- conversions -------------------------------------------------------------------------
    "d_context-not-int": (lambda: _layer(d_context=2.5),
                          r"d_context must be a positive int, got 2.5"),
    "d_context-no-context": (lambda: _layer(d_context=7)(_x()),
                             r"this layer reads its keys and values from a context C\[n σ j\] "
                             r"of width j = d_context = 7 through W_KV\[\(g B a\) j\]: pass "
                             r"context="),
    "d_context-wrong-width": (lambda: _layer(d_context=7)(_x(), torch.ones(2, 3, 8, dtype=F64)),
                              r"context has shape \(2, 3, 8\) but the layer expects "
                              r"\(n, L, d_context=7\) \(index 'j' has size 7 in W_KV\)"),
    "to_torch-d_head": (_to_torch_with_d_head_7,
                        r"nn\.MultiheadAttention needs n_heads·d_head = d_model, but 5·7 != 30"),
    "from_projections-rows": (_projections(W_q=torch.ones(29, D), n_heads=5),
                              r"W_q has 29 rows, not divisible by n_heads=5"),
    "from_projections-n_heads-zero": (_projections(n_heads=0),
                                      r"n_heads must be a positive int, got 0"),
    "from_projections-n_heads-float": (_projections(n_heads=2.5),
                                       r"n_heads must be a positive int, got 2\.5"),
    "from_projections-W_q-1d": (_projections(W_q=torch.ones(30)),
                                r"W_q must be a 2-D weight W_q\[\(μ a\) i\], got \(30,\)"),
    "from_projections-W_k": (_projections(W_k=torch.ones(30, 31), W_v=torch.ones(31, 30)),
                             r"W_v has shape \(31, 30\) but W_v\[\(g b\) j\] needs \(30, 30\)"
                             r".*from W_k, j = 31"),
    "from_projections-W_o-transposed": (
        _projections(W_q=torch.ones(35, D), W_k=torch.ones(35, D), W_v=torch.ones(35, D),
                     W_o=torch.ones(35, D)),
        r"W_o has shape \(35, 30\) but W_o\[i \(μ b\)\] needs \(30, 35\): from W_q, i = "
        r"d_model = 30 and \(μ a\) = 35"),
    "from_projections-W_o-broadcastable": (_projections(W_o=torch.ones(1, 30)),
                                           r"W_o has shape \(1, 30\) but W_o\[i \(μ b\)\] needs "
                                           r"\(30, 30\)"),
    "from_projections-b_q": (_projections(b_q=torch.ones(25)),
                             r"b_q has shape \(25,\) but b_q\[\(μ a\)\] needs \(30,\)"),
    "from_projections-b_o-broadcastable": (_projections(b_o=torch.ones(1)),
                                           r"b_o has shape \(1,\) but b_o\[i\] needs \(30,\)"),
    "from_projections-dtype-option": (_projections(dtype=torch.float16),
                                      r"from_projections takes dtype from the weights"),
    "from_projections-d_head-and-bias-options": (
        _projections(d_head=3, bias=True),
        r"from_projections takes bias, d_head from the weights"),
    "to_torch-grouped": (lambda: MultiHeadAttention(30, 6, n_kv_heads=2).to_torch(),
                         r"nn.MultiheadAttention has no grouped-query attention, but this layer "
                         r"has n_kv_heads=2 < n_heads=6"),
    "n_kv_heads-not-dividing": (lambda: MultiHeadAttention(30, 6, n_kv_heads=4),
                                r"n_heads=6 is not a multiple of n_kv_heads=4"),
    "impl-unknown": (lambda: MultiHeadAttention(30, 5, impl="flash"),
                     r"impl must be one of 'einsum', 'sdpa', 'chunked', 'flex', 'auto', "
                     r"got 'flash'"),
    "impl-unknown-per-call": (lambda: MultiHeadAttention(30, 5)(torch.ones(1, 2, 30), impl="x"),
                              r"impl must be one of 'einsum', 'sdpa', 'chunked', 'flex', "
                              r"'auto', got 'x'"),
    "dropout-not-a-number": (lambda: MultiHeadAttention(30, 5, dropout="0.1"),
                             r"dropout .* must be a number in \[0, 1\), got '0\.1'"),
    "from_fused-W_O-2-D": (lambda: MultiHeadAttention.from_fused(torch.ones(90, 30),
                                                                  torch.ones(30, 30)),
                           r"W_O has shape \(30, 30\) but W_O\[μ a i\] is 3-D"),
    "from_fused-W-rows": (lambda: MultiHeadAttention.from_fused(torch.ones(80, 30),
                                                                torch.ones(5, 6, 30)),
                          r"W has shape \(80, 30\) but W\[\(μ B a\) i\] needs \(90, 30\) with μ=5, "
                          r"a=6, i=30 from W_O, B=3"),
    "from_fused-grouped-W": (lambda: MultiHeadAttention.from_fused(
                                 torch.ones(90, 30), torch.ones(6, 5, 30), n_kv_heads=2),
                             r"W has shape \(90, 30\) but W\[\(g C a\) i\] needs \(50, 30\) "
                             r"with μ=6, a=5, i=30 from W_O, g=2, C=r\+2=5"),
    "from_fused-b_O": (lambda: MultiHeadAttention.from_fused(
                           torch.ones(90, 30), torch.ones(5, 6, 30), torch.ones(90),
                           torch.ones(29)),
                       r"b_O has shape \(29,\) but b_O\[i\] needs \(30,\)"),
    "from_fused-b-not-a-tensor": (lambda: MultiHeadAttention.from_fused(
                                      torch.ones(90, 30), torch.ones(5, 6, 30), b=[0.0] * 90),
                                  r"b must be a torch.Tensor, got list"),
    "from_fused-n_heads-option": (lambda: MultiHeadAttention.from_fused(
                                      torch.ones(90, 30), torch.ones(5, 6, 30), n_heads=5),
                                  r"from_fused takes n_heads from the weights"),
    "from_fused-dtype-option": (lambda: MultiHeadAttention.from_fused(
                                    torch.ones(90, 30), torch.ones(5, 6, 30), dtype=F64),
                                r"from_fused takes dtype from the weights"),
    "to_torch-rope": (lambda: MultiHeadAttention(30, 5, rope="half").to_torch(),
                      r"nn.MultiheadAttention has no rotary embeddings, but this layer has "
                      r"rope='half'"),
    "rope-unknown": (lambda: MultiHeadAttention(30, 5, rope="llama"),
                     r"rope must be None, 'half' or 'interleaved', got 'llama'"),
    "rope-odd-d_head": (lambda: MultiHeadAttention(30, 6, rope="half"),
                        r"rope turns pairs of channels, but index 'a' has odd size 5"),
    "positions-without-rope": (lambda: _layer()(_x(), positions=torch.arange(L_Q)),
                               r"positions=, rope_scaling= and rotary_dim= only matter with rope="),
    "rope-with-context": (lambda: _layer(rope="half")(_x(), _c()),
                          r"rope needs self-attention: with a context, the keys' positions"),
    "to_torch-causal": (lambda: MultiHeadAttention(30, 5, causal=True).to_torch(),
                        r"nn.MultiheadAttention keeps no causal flag, but this layer has "
                        r"causal=True"),
    # -- the options of today's models (docs/models.md) -------------------------------------
    "d_value-zero": (lambda: _layer(d_value=0), r"d_value must be a positive int, got 0"),
    "d_context-pair-zero": (lambda: _layer(d_context=(7, 0)),
                            r"d_context must be a positive int, got 0"),
    "zero_attn-and-sinks": (lambda: _layer(sinks=True, zero_attn=True),
                            r"zero_attn is a sink of logit 0 for every head, and sinks=True "
                            r"learns one"),
    "qk_norm-not-a-QKNorm": (lambda: _layer(qk_norm="rms"),
                             r"qk_norm must be None or an einattn.qk_norm.QKNorm, got str"),
    "differential-odd-heads": (lambda: _layer(differential=einattn.differential.Differential(0.2)),
                               r"n_heads=5 and n_kv_heads=5 must both be even"),
    "value_context-one-context": (lambda: _layer()(_x(), _x(N, L_K, D), _x(N, L_K, D)),
                                  r"value_context is for a layer with d_context=\(j, k\)"),
    "d_context-pair-one-context": (
        lambda: _layer(d_context=(7, 9))(_x(), _c(N, L_K, 7)),
        r"reads its keys from C_K\[n σ j\] \(j = 7\) through W_K\[\(g a\) j\] and its "
        r"values from C_V\[n σ j\] \(j = 9\) .*: pass context= and value_context="),
    "d_context-pair-value-width": (
        lambda: _layer(d_context=(7, 9))(_x(), _c(N, L_K, 7), _c(N, L_K, 7)),
        r"value_context has shape \(2, 7, 7\) but the layer expects \(n, L, "
        r"d_context\[1\]=9\) \(index 'j' has size 9 in W_V\)"),
    "block_size-0": (lambda: _layer(block_size=0),
                     r"block_size \(the number of queries τ and of keys σ per tile\) must be a "
                     r"positive int, got 0"),
    "block_size-float": (lambda: _layer(block_size=2.5), r"block_size .* got 2\.5"),
    **{f"rope_base-{base}": (lambda base=base: _layer(rope="half", rope_base=base),
                             rf"rope_base must be a finite positive number .* got {base}")
       for base in (0, -2.0, float("nan"), float("inf"))},
    "rope_base-functional": (lambda: einattn.functional.multi_head_attention(
                                 _x(), torch.ones(90, D, dtype=F64), torch.ones(5, 6, D,
                                 dtype=F64), n_heads=H, rope="half", rope_base=-1.0),
                             r"rope_base must be a finite positive number .* got -1\.0"),
    "to_torch-patterns": (lambda: MultiHeadAttention(30, 5, window=4, alibi=True).to_torch(),
                          r"nn.MultiheadAttention has no attention patterns, but this layer "
                          r"has window=4, alibi=True"),
    **{f"layer-{name}-not-bool": (lambda name=name: _layer(**{name: 1}),
                                  rf"{name} must be True or False, got 1")
       for name in ("alibi", "sinks", "batch_first")},
    "to_torch-scale": (lambda: MultiHeadAttention(30, 5, scale=0.1).to_torch(),
                       r"nn.MultiheadAttention always scales the scores by 1/√a, but this layer "
                       r"has scale=0.1"),
    **{f"scale-{v}": (lambda v=v: _layer(scale=v), rf"scale \(s in S = s · Q K, 1/√a by "
                                                    rf"default\) must be a finite positive "
                                                    rf"number, got {v}")
       for v in (0, -1.0, float("inf"), True)},
    **{f"rotary_dim-{v}": (lambda v=v: _layer(rope="half", rotary_dim=v),
                           rf"rotary_dim \(a_r, the channels of each head that turn\) must be "
                           rf"an even int from 2 to d_head = 6, got {v}")
       for v in (0, 3, 8, 2.0)},
    "rope_scaling-not-dict": (lambda: _layer(rope="half", rope_scaling="linear"),
                              r"rope_scaling must be a dict such as .* got str"),
    "rope_scaling-type": (_scaled("longrope"),
                          r"rope_scaling's rope_type must be one of 'default', 'linear', "
                          r"'dynamic', 'llama3', 'yarn', got 'longrope'"),
    "rope_scaling-missing": (_scaled("llama3", factor=8.0),
                             r"rope_scaling of rope_type 'llama3' needs \['factor', "
                             r"'high_freq_factor', 'low_freq_factor', "
                             r"'original_max_position_embeddings'\], got \['factor'\]"),
    "rope_scaling-unknown-key": (_scaled("linear", factor=2.0, beta_fast=3),
                                 r"rope_scaling of rope_type 'linear' needs \['factor'\], got "
                                 r"\['beta_fast', 'factor'\]"),
    "rope_scaling-factor": (_scaled("linear", factor=-2.0),
                            r"rope_scaling's factor must be a finite positive number, got -2.0"),
    "rope_scaling-llama3-ramp": (_scaled("llama3", factor=8.0, low_freq_factor=4,
                                         high_freq_factor=1,
                                         original_max_position_embeddings=64),
                                 r"rope_scaling 'llama3' ramps between low_freq_factor and a "
                                 r"larger high_freq_factor, got 4 and 1"),
    "rope_scaling-theta": (_scaled("linear", factor=2.0, rope_theta=500000.0),
                           r"rope_scaling has rope_theta=500000.0 but rope_base=10000.0; pass "
                           r"rope_base=500000.0"),
    "rope_scaling-partial": (_scaled("default", partial_rotary_factor=0.5),
                             r"rope_scaling has partial_rotary_factor=0.5, 3 of d_head = 6 "
                             r"channels, but rotary_dim=6; pass rotary_dim=3"),
    "rope_scaling-dynamic-2": (lambda: _layer(rope="half", rotary_dim=2, rope_scaling={
                                   "rope_type": "dynamic", "factor": 2.0,
                                   "max_position_embeddings": 16}),
                               r"rope_scaling 'dynamic' raises the base to a_r/\(a_r − 2\): it "
                               r"needs rotary_dim \(a_r\) of at least 4, got 2"),
    "mask-plus-inf": (_cross(mask=torch.zeros(L_Q, L_K, dtype=F64).index_fill(
                          1, torch.tensor([3]), float("inf"))),
                      r"mask holds \+inf, which would make every weight of its row NaN"),
    "mask-meta": (_cross(mask=torch.ones(L_Q, L_K, dtype=torch.bool, device="meta")),
                  rf"mask is on meta but the scores are on {here()}"),
    "key_padding_mask-meta": (_cross(key_padding_mask=torch.zeros(N, L_K, dtype=torch.bool,
                                                                  device="meta")),
                              rf"key_padding_mask is on meta but the scores are on {here()}"),
    "x-meta": (lambda: _layer()(_x().to("meta")),
               rf"x is on meta but the layer's W is on {here()}"),
    # -- attention patterns (einattn/patterns.py; the functional ones in test_patterns.py) ------
    **{f"window-{v}": (lambda v=v: _layer(window=v),
                       rf"window \(the number of keys σ a query τ sees, itself included\) must "
                       rf"be an int ≥ 1, got {v}")
       for v in (0, 2.5, -1, True)},
    **{f"softcap-{v}": (lambda v=v: _layer(softcap=v),
                        rf"softcap \(c in cap\(S\) = c · tanh\(S / c\)\) must be a finite number "
                        rf"> 0, got {v}")
       for v in (0, -1.0, float("inf"), True)},
    "document_ids-shape": (lambda: _layer()(_x(), document_ids=_ids(N, L_K)),
                           r"document_ids has shape \(2, 7\) but must be \(n, σ\) = \(2, 5\): one "
                           r"document id d\[n σ\] per key \(the queries' are the last L_q=5\)"),
    "document_ids-cross-attention-shape": (_cross(document_ids=_ids(N, L_Q)),
                                           r"document_ids has shape \(2, 5\) but must be "
                                           r"\(n, σ\) = \(2, 7\)"),
    "document_ids-float": (lambda: _layer()(_x(), document_ids=_ids(N, L_Q, dtype=F64)),
                           r"document_ids must hold integers \(one id per document\), got "
                           r"torch\.float64"),
    "document_ids-bool": (lambda: _layer()(_x(), document_ids=_ids(N, L_Q, dtype=torch.bool)),
                          r"document_ids must hold integers .*got torch\.bool"),
    "document_ids-cache-shape": (lambda: _layer()(_x(), cache=einattn.KVCache(),
                                                  document_ids=_ids(N, 3)),
                                 r"with a cache, document_ids marks this call's new keys: shape "
                                 r"\(n, σ\) = \(2, 5\), got \(2, 3\)"),
    "document_ids-cache-not-every-call": (_cached_then(document_ids=None),
                                          r"document_ids must be given on every call with this "
                                          r"cache or on none"),
    "flex-requires-grad": (lambda: _layer(impl="flex", window=3)(_x()),
                           r"impl='flex' has no backward on the CPU .*train with "
                           r"impl='chunked'.* or call under torch\.no_grad\(\)"),
    "flex-dropout": (lambda: _layer(impl="flex", dropout=0.1)(_x()),
                     r"impl='flex' has no dropout \(got dropout=0\.1\)"),
}


@pytest.mark.parametrize("name", on_cpu_only(BAD, {"flex-requires-grad": FLEX_CPU}))
def test_bad_input_raises_einattn_error(name):
    call, match = BAD[name]
    with pytest.raises(EinattnError, match=match) as info:
        call()
    assert isinstance(info.value, ValueError)


def test_the_error_is_exported_and_a_value_error():
    assert einattn.EinattnError is EinattnError and issubclass(EinattnError, ValueError)


def _raise_lines(path: Path) -> set[int]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {node.lineno for node in ast.walk(tree) if isinstance(node, ast.Raise)}


def reached_lines(rows, source: Path) -> set[int]:
    """The lines of ``source`` from which the ``(call, match)`` rows' errors were raised."""
    reached = set()
    for call, _ in rows:
        try:
            call()
        except EinattnError as e:
            frames = traceback.extract_tb(e.__traceback__)
            reached |= {f.lineno for f in frames if Path(f.filename).resolve() == source}
    return reached


def test_every_raise_site_in_module_py_is_reached_by_the_table():
    """Run every row and record the line that raised: each ``raise`` in einattn/module.py
    must be among them (STYLE §4: every raise site has a ``pytest.raises`` test)."""
    module_py = Path(einattn.module.__file__).resolve()
    missing = sorted(_raise_lines(module_py) - reached_lines(BAD.values(), module_py))
    assert not missing, f"raise sites in module.py with no bad-input test: lines {missing}"


def test_messages_name_what_is_wrong_rather_than_the_backend():
    """The einsum backend never gets to complain: no message leaks torch's or opt_einsum's
    wording (``einsum()``, ``operand``, ``size of tensor``)."""
    for name, (call, _) in BAD.items():
        if name == "flex-requires-grad" and torch.get_default_device().type != "cpu":
            continue  # FLEX_CPU
        with pytest.raises(EinattnError) as info:
            call()
        assert not re.search(r"einsum\(|operand|size of tensor", str(info.value)), name


# -- what reached the backend: dtypes, dropout, block sizes (issue 34, item 6) ---------------
# Each of these used to raise torch's own error (a RuntimeError from requires_grad, torch's
# ValueError for dropout=1.5, a matmul's dtype error, addmm's NotImplementedError, range()'s
# ValueError) or, for integer Q, K, V on the chunked path, to answer in integers.

def _qkv(dtype=F64):
    return torch.ones(N, H, L_Q, 6, dtype=dtype), *(torch.ones(N, H, L_K, 6, dtype=dtype),) * 2


def _functional_layer(dtype=F64, **options):
    """functional.multi_head_attention on x (2, 5, 30) and W, W_O of d_model 30, 5 heads."""
    F = einattn.functional
    return lambda: F.multi_head_attention(_x(dtype=dtype), torch.ones(90, D, dtype=dtype),
                                          torch.ones(H, 6, D, dtype=dtype), n_heads=H, **options)


def _attention(dtype=F64, **options):
    return lambda: einattn.functional.attention(*_qkv(dtype), **options)


def _equation(text: str, dtype: torch.dtype):
    return lambda: einattn.Equation(text)(Q=torch.ones(2, 3, dtype=dtype),
                                          K=torch.ones(4, 3, dtype=dtype))


DROPOUT = r"dropout \(the probability that a weight A\[n μ τ σ\] is zeroed\) must be a number in "
FLOATS = r"attention runs on floating-point tensors \(float16, bfloat16, float32, float64\)"
SCALED = "S[τ σ] = Q[τ a] K[σ a] / √a"
NOT_THE_BACKEND = {
    **{f"layer-dtype-{name}": (lambda dt=dt: MultiHeadAttention(D, H, dtype=dt),
                               rf"dtype \(the layer's weights'\) must be a floating-point "
                               rf"torch.dtype \(torch.float32, torch.bfloat16, ...\), got {got}")
       for name, dt, got in (("long", torch.long, r"torch\.int64"),
                             ("bool", torch.bool, r"torch\.bool"),
                             ("complex", torch.complex64, r"torch\.complex64"),
                             ("str", "float32", r"'float32'"))},
    "layer-device-unknown": (lambda: MultiHeadAttention(D, H, device="gpu"),
                             r"device must be a torch.device, its name or its index \('cpu', "
                             r"'cuda:0', 0, ...\), got 'gpu'"),
    "layer-device-list": (lambda: MultiHeadAttention(D, H, device=[0]),
                          r"device must be .*got \[0\]"),
    "layer-device-absent": (lambda: MultiHeadAttention(D, H, device="cuda:99"),  # a CPU build's
                            r"device 'cuda:99' is not available here \("),  # AssertionError
    "from_fused-long": (lambda: MultiHeadAttention.from_fused(torch.ones(90, D, dtype=torch.long),
                                                              torch.ones(H, 6, D,
                                                                         dtype=torch.long)),
                        r"dtype \(the layer's weights'\) must be a floating-point"),
    **{f"{where}-dropout-{p!r}-{impl}": (call(dropout=p, impl=impl),
                                         DROPOUT + rf"\[0, 1\), got {re.escape(repr(p))}")
       for where, call in (("functional", _functional_layer), ("attention", _attention))
       for impl in ("einsum", "sdpa")
       for p in (1.5, -0.1, float("nan"), 1.0, None, True, "0.1")},
    **{f"attention-{dt}-{impl}": (_attention(dt, impl=impl), rf"^Q is {dt}: " + FLOATS)
       for dt in (torch.long, torch.bool) for impl in ("einsum", "sdpa", "chunked", "flex")},
    **{f"functional-{dt}-{impl}": (_functional_layer(dt, impl=impl), rf"^x is {dt}: " + FLOATS)
       for dt in (torch.long, torch.bool) for impl in ("einsum", "sdpa", "chunked", "flex")},
    "chunked.attention-long": (lambda: einattn.chunked.attention(*_qkv(torch.long)),
                               r"^Q is torch.int64: " + FLOATS),
    "masked_softmax-long": (lambda: einattn.functional.masked_softmax(torch.ones(2, 3).long()),
                            r"^S is torch.int64: " + FLOATS),
    "attention-block_size-0": (_attention(impl="chunked", block_size=0),
                               r"block_size \(the number of queries τ and of keys σ per tile\) "
                               r"must be a positive int, got 0"),
    "functional-block_size-float": (_functional_layer(impl="chunked", block_size=2.0),
                                    r"block_size .* must be a positive int, got 2\.0"),
    "equation-scaled-long": (_equation(SCALED, torch.long),
                             r"^Q is torch.int64 on cpu, which this equation does not run on: it "
                             r"takes floating-point or complex tensors \(its scale / √a is not "
                             r"an integer\); convert with .to\(\)\n  S\[τ σ\]"),
    "equation-scaled-bool": (_equation(SCALED, torch.bool),
                             r"^Q is torch.bool on cpu, .*\(its scale / √a is not an integer\)"),
    "equation-bool": (_equation("S[τ σ] = Q[τ a] K[σ a]", torch.bool),
                      r"^Q is torch.bool on cpu, which this equation does not run on: it takes "
                      r"floating-point or complex tensors, or integers where torch multiplies "
                      r"them; convert with .to\(\)"),
}


@pytest.mark.parametrize("name", list(NOT_THE_BACKEND))
def test_what_reached_the_backend_is_refused_by_name(name):
    call, match = NOT_THE_BACKEND[name]
    with pytest.raises(EinattnError, match=match) as info:
        call()
    assert info.value.__cause__ is None


@pytest.mark.parametrize("dtype", [torch.long, torch.int32, torch.uint8])
def test_an_equation_without_a_scale_still_runs_on_integers(dtype):
    """Exact integer checks (einattn.verify's) keep working: no scale, on the CPU."""
    Q, K = torch.arange(6, dtype=dtype).reshape(2, 3), torch.arange(12, dtype=dtype).reshape(4, 3)
    S = einattn.Equation("S[τ σ] = Q[τ a] K[σ a]")(Q=Q, K=K)
    assert S.dtype == dtype and torch.equal(S, Q @ K.T)
