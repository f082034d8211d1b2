"""LatentAttention.from_hf against DeepSeek's own Hugging Face modules, float64, random
weights, sizes all distinct (i=42, μ=3, l=11, c=13, a=5, ρ=6, b=7; n=2, L=9).

Hugging Face computes cos/sin and the two RMS norms in float32 whatever the dtype (V2 also
its complex RoPE). With those islands patched (the module is handed float64 angles from
einattn.rotary, its norms and V2's rotation run in float64) the layer equals the module to
1e-12 in both forms, forward and every gradient; unpatched, to 1e-6 (measured: 1e-7), which
also checks einattn's frequencies and YaRN factor against the module's own float32 ones.
"""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch

from einattn import EinattnError, LatentAttention, rotary
from einattn import _latent_hf as convert
from einattn.latent import FORMS, deepseek_scale
from einattn.latent_cache import LatentCache
from tests.conftest import TOL, assert_close_scaled, randn

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as ds2  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds3  # noqa: E402

F64 = torch.float64
N, L, D, H, DQ, DC, DA, DR, DV = 2, 9, 42, 3, 11, 13, 5, 6, 7
UNPATCHED = 1e-6  # the float32 islands: cos/sin and the norms (1e-7 measured)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 16, "mscale": 0.5, "mscale_all_dim": 1.0}
LINEAR = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
CONFIGS = {  # name -> (q_lora_rank, rope_parameters, rope_interleave, attention_bias)
    "query latent": (DQ, None, True, False),
    "no query latent": (None, None, True, False),
    "yarn + bias": (DQ, YARN, True, True),
    "half rope": (DQ, None, False, False),
    "linear, no query latent, half, bias": (None, LINEAR, False, True),
}


def config(version: int, q_lora_rank=DQ, rope=None, interleave=True, bias=False, **extra):
    common = dict(vocab_size=50, hidden_size=D, intermediate_size=24, moe_intermediate_size=8,
                  num_hidden_layers=1, num_attention_heads=H, q_lora_rank=q_lora_rank,
                  kv_lora_rank=DC, qk_nope_head_dim=DA, qk_rope_head_dim=DR, v_head_dim=DV,
                  n_routed_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
                  rope_parameters=rope or {"rope_type": "default", "rope_theta": 10000.0},
                  attention_bias=bias, attn_implementation="sdpa",
                  experts_implementation="eager", **extra)
    if version == 2:
        return transformers.DeepseekV2Config(**common)
    return transformers.DeepseekV3Config(**common, rope_interleave=interleave, n_group=1,
                                         topk_group=1, first_k_dense_replace=1)


def module(version: int = 3, seed: int = 0, **options):
    """A float64 DeepseekV{2,3}Attention with every parameter random (norm weights around 1)."""
    cls = ds2.DeepseekV2Attention if version == 2 else ds3.DeepseekV3Attention
    m = cls(config(version, **options), layer_idx=0).to(F64).eval()
    with torch.no_grad():
        for k, (name, p) in enumerate(m.named_parameters()):
            p.copy_(randn(*p.shape, seed=seed * 100 + k) * 0.3 + ("norm" in name))
    return m


def float64_norms(m) -> None:
    """The module's RMS norms computed in float64 (Hugging Face's run in float32)."""
    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                               + self.variance_epsilon))
    for norm in (m.q_a_layernorm, m.kv_a_layernorm):
        if norm is not None:
            norm.forward = types.MethodType(forward, norm)


def angles(layer, n: int, length: int, offset: int = 0):
    """θ[n τ p] = t ω[p] in float64 from einattn.rotary, and its attention factor m."""
    t = torch.arange(offset, offset + length).expand(n, length)
    omega, m = rotary.frequencies(t, d_rot=DR, base=layer.rope_base,
                                  scaling=layer.rope_scaling, dtype=F64)
    return t[..., None].to(F64) * omega, m


def cos_sin(layer, n: int, length: int, offset: int = 0):
    """V3's position_embeddings, laid out as its rotary class lays them: cat(θ, θ) · m."""
    theta, m = angles(layer, n, length, offset)
    both = torch.cat([theta, theta], -1)
    return both.cos() * m, both.sin() * m


def allowed(kpm: torch.Tensor | None, length: int, offset: int = 0) -> torch.Tensor:
    """The module's bool mask [n 1 τ σ], True = may attend: causal and not padding."""
    total = offset + length
    ok = torch.arange(total)[None, :] <= torch.arange(offset, total)[:, None]
    ok = ok[None, None].expand(N, 1, length, total)
    return ok if kpm is None else ok & ~kpm[:, None, None, :total]


def real_rows(Y: torch.Tensor, kpm: torch.Tensor) -> torch.Tensor:
    """The outputs at query positions that are not padding (a pad query sees only pads)."""
    return Y[~kpm]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_v3_forward_equals_the_module(name):
    q_lora_rank, rope, interleave, bias = CONFIGS[name]
    m = module(q_lora_rank=q_lora_rank, rope=rope, interleave=interleave, bias=bias)
    layer = LatentAttention.from_hf(m)
    x, kpm = randn(N, L, D, seed=1), torch.zeros(N, L, dtype=torch.bool)
    kpm[1, :3] = True  # left padding
    rope_class = ds3.DeepseekV3RotaryEmbedding(m.config)
    shipped, _ = m(x, position_embeddings=rope_class(x, torch.arange(L)[None]),
                   attention_mask=allowed(kpm, L))
    float64_norms(m)
    want, _ = m(x, position_embeddings=cos_sin(layer, N, L), attention_mask=allowed(kpm, L))
    for form in FORMS:
        Y = layer(x, key_padding_mask=kpm, form=form)
        assert_close_scaled(real_rows(Y, kpm), real_rows(want, kpm), TOL[F64])
        assert_close_scaled(real_rows(Y, kpm), real_rows(shipped, kpm), UNPATCHED)


@pytest.mark.parametrize("form", FORMS)
def test_v3_gradients_of_the_input_and_every_parameter_equal_the_module(form):
    m = module(rope=YARN, bias=True, seed=2)
    layer = LatentAttention.from_hf(m)
    float64_norms(m)
    x, g = randn(N, L, D, seed=3, requires_grad=True), randn(N, L, D, seed=4)
    names = [name for name, _ in m.named_parameters()]
    Y_hf, _ = m(x, position_embeddings=cos_sin(layer, N, L), attention_mask=allowed(None, L))
    hf = torch.autograd.grad((Y_hf * g).sum(), [x, *m.parameters()])
    ours = dict(layer.named_parameters())
    Y = layer(x, form=form)
    got = torch.autograd.grad((Y * g).sum(), [x, *ours.values()])
    assert_close_scaled(got[0], hf[0], TOL[F64])
    want = convert.weights(dict(zip(names, hf[1:], strict=True)), H, DA)  # laid out as ours
    assert set(want) == set(ours) and len(ours) == 14  # every parameter, biases included
    for name, grad in zip(ours, got[1:], strict=True):
        assert_close_scaled(grad, want[name], TOL[F64])


def rotate_float64(xq, xk, freqs_cis):
    """V2's apply_rotary_emb without its float32 cast: pairs (2p, 2p+1) as complex numbers,
    written back interleaved."""
    def turned(T):
        pairs = torch.view_as_complex(T.reshape(*T.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(pairs * freqs_cis.unsqueeze(1)).flatten(3)
    return turned(xq), turned(xk)


@pytest.mark.parametrize("rope", [None, YARN], ids=["default", "yarn"])
def test_v2_forward_equals_the_module(rope, monkeypatch):
    """V2: its complex RoPE (always interleaved) and the same weights as V3."""
    m = module(version=2, rope=rope, seed=5)
    layer = LatentAttention.from_hf(m)
    assert layer.rope == "interleaved"
    x = randn(N, L, D, seed=6)
    shipped, _ = m(x, attention_mask=allowed(None, L),
                   position_embeddings=ds2.DeepseekV2RotaryEmbedding(m.config)(
                       x, torch.arange(L)[None]))
    float64_norms(m)
    monkeypatch.setattr(ds2, "apply_rotary_emb", rotate_float64)
    theta, factor = angles(layer, N, L)
    freqs_cis = torch.polar(torch.ones_like(theta), theta) * factor
    want, _ = m(x, attention_mask=allowed(None, L), position_embeddings=freqs_cis)
    for form in FORMS:
        Y = layer(x, form=form)
        assert_close_scaled(Y, want, TOL[F64])
        assert_close_scaled(Y, shipped, UNPATCHED)


def test_the_scale_and_the_frequencies_are_the_modules():
    """DeepSeek's s (YaRN's mscale_all_dim squared) and the angles' ω and m: those of the
    module and its rotary class (which keeps ω in float32)."""
    m = module(rope=YARN)
    layer = LatentAttention.from_hf(m)
    assert layer.scale is None  # from_hf left it to deepseek_scale: the module's own
    assert abs(layer.softmax_scale - m.scaling) <= 1e-15 and m.scaling != (DA + DR) ** -0.5
    rope_class = ds3.DeepseekV3RotaryEmbedding(m.config)
    omega, factor = rotary.frequencies(torch.arange(L)[None], d_rot=DR, base=10000.0,
                                       scaling=layer.rope_scaling, dtype=F64)
    assert_close_scaled(omega, rope_class.inv_freq.to(F64), 1e-7)
    assert factor == pytest.approx(rope_class.attention_scaling, rel=1e-15) and factor != 1
    assert deepseek_scale(DA, DR, None) == (DA + DR) ** -0.5


def test_cached_decoding_equals_the_modules_cached_decoding():
    """Prefill 6 left-padded tokens, then 3 steps: the absorbed form with a LatentCache
    against the module with its DynamicCache (which also holds the latent and K_R)."""
    m = module(rope=YARN, seed=7)
    layer = LatentAttention.from_hf(m)
    float64_norms(m)
    x, kpm = randn(N, L, D, seed=8), torch.zeros(N, L, dtype=torch.bool)
    kpm[0, :2] = True
    hf_cache, cache = transformers.DynamicCache(config=m.config), LatentCache()
    for start, stop in ((0, 6), (6, 7), (7, 8), (8, 9)):
        want, _ = m(x[:, start:stop], position_embeddings=cos_sin(layer, N, stop - start, start),
                    attention_mask=allowed(kpm, stop - start, start), cache=hf_cache)
        Y = layer(x[:, start:stop], key_padding_mask=kpm[:, start:stop], cache=cache,
                  form="absorbed")
        rows = kpm[:, start:stop]
        assert_close_scaled(real_rows(Y, rows), real_rows(want, rows), TOL[F64])
    assert hf_cache.layers[0].keys.shape == (N, 1, L, DC) and len(cache) == L


def test_from_hf_keeps_the_modules_mode_and_dropout_and_passes_options():
    m = module()
    m.config.attention_dropout = 0.25
    m2 = ds3.DeepseekV3Attention(m.config, 0).to(F64).train()
    layer = LatentAttention.from_hf(m2, form="absorbed", impl="sdpa")
    assert layer.training and layer.dropout == 0.25 and layer.causal
    assert (layer.form, layer.impl) == ("absorbed", "sdpa")
    m.scaling = 0.5  # set by hand: the layer takes it
    assert LatentAttention.from_hf(m).softmax_scale == 0.5


def test_dynamic_rope_parameters_convert():
    """"dynamic" takes the config's max_position_embeddings as its L₀: at L = 70 > 64 the
    frequencies change, and the layer still equals the module (float32 angles: 1e-5)."""
    m = module(rope={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    layer = LatentAttention.from_hf(m)
    assert layer.rope_scaling["max_position_embeddings"] == 64
    length = 70
    x = randn(1, length, D, seed=9)
    rope_class = ds3.DeepseekV3RotaryEmbedding(m.config)
    shipped, _ = m(x, position_embeddings=rope_class(x, torch.arange(length)[None]),
                   attention_mask=allowed(None, length)[:1])
    assert_close_scaled(layer(x, causal=True), shipped, 1e-5)


def test_refusals_name_what_is_wrong():
    with pytest.raises(EinattnError, match="takes DeepseekV3Attention or DeepseekV2Attention, "
                                           "got Linear"):
        LatentAttention.from_hf(torch.nn.Linear(2, 2))
    grouped = ds3.DeepseekV3Attention(config(3, num_key_value_heads=1), 0)
    with pytest.raises(EinattnError, match="num_key_value_heads=1 below num_attention_heads=3"):
        LatentAttention.from_hf(grouped)
    m = module()
    with pytest.raises(EinattnError, match="from_hf takes d_model, dtype from the module"):
        LatentAttention.from_hf(m, d_model=5, dtype=torch.float32)
    with pytest.raises(EinattnError, match="DeepseekV3Attention: form must be one of"):
        LatentAttention.from_hf(m, form="latent")
    m.q_a_layernorm.variance_epsilon = 1e-5
    with pytest.raises(EinattnError, match="q_a_layernorm has eps 1e-05 but kv_a_layernorm "
                                           "1e-06"):
        LatentAttention.from_hf(m)
    m = module()
    m.config.rope_parameters["partial_rotary_factor"] = 0.5
    with pytest.raises(EinattnError, match=r"partial_rotary_factor=0\.5: every one of MLA"):
        LatentAttention.from_hf(m)


def test_import_einattn_does_not_import_transformers():
    code = ("import sys, einattn, einattn.latent, einattn._latent_hf; "
            "assert 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
