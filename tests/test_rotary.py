"""Rotary position embeddings: (R1)/(R2) against Llama's and GPT-J's published definitions,
relative-position invariance, the angles' precision, and every impl and grouping.

The references below are written from the published descriptions (Llama's ``rotate_half``
with ``inv_freq = base^(−2p/a)`` and the angle table repeated over the two halves; GPT-J's
``rotate_every_two`` with the angles repeated per neighbour pair), with plain tensor code:
no einattn equation takes part in them.
"""

from __future__ import annotations

import math

import pytest
import torch

from einattn import EinattnError, MultiHeadAttention, layouts, rotary
from tests.conftest import TOL, assert_close_scaled, randn, whole

F64 = torch.float64
N, L, D, H, A = 2, 7, 24, 6, 6  # d_head 6: three pairs per head


def _inv_freq(d_head: int, base: float) -> torch.Tensor:
    return 1.0 / base ** (torch.arange(0, d_head, 2, dtype=F64) / d_head)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _rotate_every_two(x):
    return torch.stack([-x[..., 1::2], x[..., 0::2]], dim=-1).flatten(-2)


def _rope_reference(t: torch.Tensor, positions: torch.Tensor, style: str, base: float,
                    rotary_dim: int | None = None):
    """``t`` (n, heads, L, d) turned as Llama ("half") or GPT-J ("interleaved") do it; with
    ``rotary_dim``, as GPT-NeoX does: its first ``rotary_dim`` channels only."""
    if rotary_dim is not None:
        turned = _rope_reference(t[..., :rotary_dim], positions, style, base)
        return torch.cat([turned, t[..., rotary_dim:]], dim=-1)
    freqs = positions.to(F64)[..., None] * _inv_freq(t.shape[-1], base)  # (n, L, d/2)
    if style == "half":
        angles, turn = torch.cat([freqs, freqs], dim=-1), _rotate_half
    else:
        angles, turn = freqs.repeat_interleave(2, dim=-1), _rotate_every_two
    cos, sin = angles.cos()[:, None].to(t.dtype), angles.sin()[:, None].to(t.dtype)
    return t * cos + turn(t) * sin


def _llama_attention(x, w, *, n_heads, n_kv_heads, positions, style, base, causal=True,
                     rotary_dim=None, scale=None):
    """Separate q/k/v/o projections, rotary on q and k, keys and values repeated per group,
    scores times ``scale`` (1/√d by default)."""
    n, L_, _ = x.shape
    d = w["W_q"].shape[0] // n_heads
    q = (x @ w["W_q"].T).view(n, L_, n_heads, d).transpose(1, 2)
    k = (x @ w["W_k"].T).view(n, L_, n_kv_heads, d).transpose(1, 2)
    v = (x @ w["W_v"].T).view(n, L_, n_kv_heads, d).transpose(1, 2)
    q, k = (_rope_reference(t, positions, style, base, rotary_dim) for t in (q, k))
    k, v = (t.repeat_interleave(n_heads // n_kv_heads, dim=1) for t in (k, v))
    scores = q @ k.transpose(2, 3) * (1 / math.sqrt(d) if scale is None else scale)
    if causal:
        future = torch.ones(L_, L_, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    z = torch.softmax(scores, dim=-1) @ v
    return z.transpose(1, 2).reshape(n, L_, n_heads * d) @ w["W_o"].T


def _weights(n_kv_heads: int, seed: int) -> dict:
    rows, kv = H * A, n_kv_heads * A
    shapes = {"W_q": (rows, D), "W_k": (kv, D), "W_v": (kv, D), "W_o": (D, rows)}
    return {k: randn(*s, seed=seed + j) / math.sqrt(s[1]) for j, (k, s) in
            enumerate(shapes.items())}


CASES = [(style, g, impl) for style in ("half", "interleaved") for g in (6, 2, 1)
         for impl in ("einsum", "sdpa", "chunked")]


@pytest.mark.parametrize("style, g, impl", CASES)
def test_layer_equals_the_published_definition(style, g, impl):
    w = _weights(g, seed=10 * g)
    x = randn(N, L, D, seed=3)
    positions = torch.stack([torch.arange(L), torch.arange(L) + 40])  # two offsets, one batch
    layer = MultiHeadAttention.from_projections(*w.values(), n_heads=H, n_kv_heads=g,
                                                rope=style, rope_base=500.0, causal=True)
    want = _llama_attention(x, w, n_heads=H, n_kv_heads=g, positions=positions, style=style,
                            base=500.0)
    assert_close_scaled(layer(x, positions=positions, impl=impl), want, TOL[F64])


@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_gradients_equal_the_published_definition(style):
    w = {k: v.requires_grad_() for k, v in _weights(2, seed=5).items()}
    x = randn(N, L, D, seed=4)
    layer = MultiHeadAttention.from_projections(*(v.detach() for v in w.values()), n_heads=H,
                                                n_kv_heads=2, rope=style, causal=True)
    dy = randn(N, L, D, seed=6)
    (layer(x) * dy).sum().backward()
    positions = torch.arange(L).expand(N, L)
    (_llama_attention(x, w, n_heads=H, n_kv_heads=2, positions=positions, style=style,
                      base=10000.0) * dy).sum().backward()
    # the layer's gradient lives on its fused W: split it as the weights were fused
    dW_q, dW_k, dW_v = layouts.split_qkv(layer.W.grad, n_heads=H, n_kv_heads=2)
    for got, name in ((dW_q, "W_q"), (dW_k, "W_k"), (dW_v, "W_v"),
                      (layouts.W_O_to_linear(layer.W_O.grad), "W_o")):
        assert_close_scaled(got, w[name].grad, TOL[F64])


@pytest.mark.parametrize("style", ["half", "interleaved"])
@pytest.mark.parametrize("impl", ["einsum", "sdpa", "chunked"])
def test_scores_depend_on_relative_position_only(style, impl):
    layer = MultiHeadAttention(D, H, n_kv_heads=3, rope=style, causal=True, dtype=F64)
    x = randn(N, L, D, seed=8)
    near = layer(x, positions=torch.arange(L), impl=impl)
    far = layer(x, positions=torch.arange(L) + 1000, impl=impl)
    assert_close_scaled(far, near, TOL[F64])
    S_near = layer(x, positions=torch.arange(L), return_intermediates=True)[1]["S"]
    S_far = layer(x, positions=torch.arange(L) + 1000, return_intermediates=True)[1]["S"]
    assert_close_scaled(S_far, S_near, 1e-11)  # scores are unscaled by the output's norm


def test_rope_changes_the_output_and_the_two_styles_differ():
    """The tests above could not pass with RoPE switched off or the styles swapped."""
    torch.manual_seed(0)
    plain = MultiHeadAttention(D, H, causal=True, dtype=F64)
    x = randn(N, L, D, seed=9)
    outputs = {}
    for style in (None, "half", "interleaved"):
        layer = MultiHeadAttention(D, H, causal=True, rope=style, dtype=F64)
        layer.load_state_dict(plain.state_dict())
        outputs[style] = layer(x)
    assert (outputs["half"] - outputs[None]).abs().max() > 1e-3
    assert (outputs["half"] - outputs["interleaved"]).abs().max() > 1e-3


def test_position_zero_is_the_identity_and_rotation_keeps_norms():
    T = randn(N, H, L, A, seed=11)
    at_zero = rotary.rotations(torch.zeros(N, L, dtype=torch.int64), d_head=A, base=1e4,
                               dtype=F64)
    assert torch.equal(rotary.rotate(T, at_zero, "half"), T)
    R = rotary.rotations(torch.arange(L).expand(N, L) * 37, d_head=A, base=1e4, dtype=F64)
    for style in ("half", "interleaved"):
        turned = rotary.rotate(T, R, style)
        assert_close_scaled(turned.norm(dim=-1), T.norm(dim=-1), TOL[F64])


def test_rotate_equals_the_references_to_the_last_bit():
    T = randn(N, H, L, A, seed=12)
    t = torch.arange(L).expand(N, L) + 5
    R = rotary.rotations(t, d_head=A, base=10000.0, dtype=F64)
    for style in ("half", "interleaved"):
        assert_close_scaled(rotary.rotate(T, R, style), _rope_reference(T, t, style, 1e4), 1e-15)


def test_angles_are_computed_in_float32_for_a_bfloat16_model():
    """bfloat16 holds 8 bits of mantissa: position 1001 would round to 1000 and the angle
    t·θ would be off by radians. The angles are formed in float32, then cos/sin are cast."""
    t = torch.arange(4000, 4096).expand(1, 96)
    got = rotary.rotations(t, d_head=8, base=1e4, dtype=torch.bfloat16)
    exact = rotary.rotations(t, d_head=8, base=1e4, dtype=F64)
    assert got.dtype == torch.bfloat16
    assert (got.double() - exact).abs().max() <= 2 ** -8  # one bfloat16 rounding of |x| ≤ 1
    naive = t.to(torch.bfloat16)[..., None] * _inv_freq(8, 1e4).to(torch.bfloat16)
    assert (naive.double().cos() - exact[..., 0, 0]).abs().max() > 0.5  # what is avoided


def test_float32_model_with_rope_agrees_with_float64():
    torch.manual_seed(1)
    layer = MultiHeadAttention(D, H, rope="half", causal=True, dtype=F64)
    x = randn(N, L, D, seed=13)
    positions = torch.arange(L) + 3000
    want = layer(x, positions=positions)
    got = layer.float()(x.float(), positions=positions)
    assert (got.double() - want).abs().max() <= 1e-5 * max(1.0, want.abs().max().item())


ERRORS = {
    "style": (lambda: MultiHeadAttention(D, H, rope="neox"),
              r"rope must be None, 'half' or 'interleaved', got 'neox'"),
    "odd d_head": (lambda: MultiHeadAttention(D, H, d_head=5, rope="half"),
                   r"rope turns pairs of channels, but index 'a' has odd size 5 \(d_head\)"),
    "float positions": (lambda: MultiHeadAttention(D, H, rope="half")(
                            torch.ones(N, L, D), positions=torch.arange(L) * 1.0),
                        r"positions must be an integer tensor t\[τ\] or t\[n τ\], got "
                        r"torch.float32"),
    "list positions": (lambda: MultiHeadAttention(D, H, rope="half")(
                           torch.ones(N, L, D), positions=list(range(L))),
                       r"positions must be an integer tensor .* got list"),
    "positions shape": (lambda: MultiHeadAttention(D, H, rope="half")(
                            torch.ones(N, L, D), positions=torch.arange(L + 1)),
                        r"positions has shape \(8,\) but t\[τ\] or t\[n τ\] needs \(7,\), "
                        r"\(1, 7\) or \(2, 7\) \(n=2, τ=7\)"),
    "positions without rope": (lambda: MultiHeadAttention(D, H)(
                                   torch.ones(N, L, D), positions=torch.arange(L)),
                               r"positions=, rope_scaling= and rotary_dim= only matter with "
                               r"rope='half' or 'interleaved'"),
    "rope with context": (lambda: MultiHeadAttention(D, H, rope="half")(
                              torch.ones(N, L, D), torch.ones(N, 3, D)),
                          r"rope needs self-attention"),
    "to_torch": (lambda: MultiHeadAttention(D, H, rope="half").to_torch(),
                 r"nn.MultiheadAttention has no rotary embeddings, but this layer has "
                 r"rope='half'"),
}


@pytest.mark.parametrize("call, message", ERRORS.values(), ids=ERRORS.keys())
def test_bad_rope_input_raises(call, message):
    with pytest.raises(EinattnError, match=message):
        call()


@pytest.mark.parametrize("impl", ["einsum", "sdpa", "chunked"])
def test_compiled_with_rope_and_groups_equals_eager(impl):
    """``torch.compile(fullgraph=True)`` traces the rotation (aot_eager: no Inductor build)."""
    torch._dynamo.reset()
    layer = MultiHeadAttention(D, H, n_kv_heads=2, rope="interleaved", causal=True,
                               impl=impl, dtype=F64)
    x = randn(N, L, D, seed=14)
    compiled = torch.compile(layer, fullgraph=whole(impl), backend="aot_eager")
    positions = torch.arange(L) + 7
    assert_close_scaled(compiled(x, positions=positions), layer(x, positions=positions),
                        TOL[F64])


def test_positions_broadcast_over_the_batch():
    layer = MultiHeadAttention(D, H, rope="half", causal=True, dtype=F64)
    x = randn(N, L, D, seed=15)
    t = torch.arange(L) + 11
    assert torch.equal(layer(x, positions=t[None]), layer(x, positions=t))
    assert torch.equal(layer(x, positions=t[None]), layer(x, positions=t.expand(N, L)))


# -- partial rotary, the softmax scale, and the frequency scalings --------------------------


@pytest.mark.parametrize("style", ["half", "interleaved"])
@pytest.mark.parametrize("impl", ["einsum", "sdpa", "chunked"])
def test_rotary_dim_turns_the_first_channels_only(style, impl):
    """GPT-NeoX/Phi partial rotary, a_r = 4 of a = 6: the reference turns t[..., :4] by
    base^(−2p/4) and passes the rest; the layer equals it, and differs from full rotary."""
    w = _weights(2, seed=21)
    x, positions = randn(N, L, D, seed=22), (torch.arange(L) + 3).expand(N, L)
    layer = MultiHeadAttention.from_projections(*w.values(), n_heads=H, n_kv_heads=2,
                                                rope=style, rotary_dim=4, causal=True)
    want = _llama_attention(x, w, n_heads=H, n_kv_heads=2, positions=positions, style=style,
                            base=10000.0, rotary_dim=4)
    assert_close_scaled(layer(x, positions=positions, impl=impl), want, TOL[F64])
    full = _llama_attention(x, w, n_heads=H, n_kv_heads=2, positions=positions, style=style,
                            base=10000.0)
    assert (want - full).abs().max() > 1e-3


@pytest.mark.parametrize("impl", ["einsum", "sdpa", "chunked"])
def test_scale_equals_the_written_out_softmax(impl):
    """S = s · Q K with s = 0.37 (Gemma-style: not 1/√a); the stages show Q itself and
    S = s · Q K."""
    w = _weights(3, seed=31)
    x, positions = randn(N, L, D, seed=32), torch.arange(L).expand(N, L)
    layer = MultiHeadAttention.from_projections(*w.values(), n_heads=H, n_kv_heads=3,
                                                rope="half", scale=0.37, causal=True)
    want = _llama_attention(x, w, n_heads=H, n_kv_heads=3, positions=positions, style="half",
                            base=10000.0, scale=0.37)
    assert_close_scaled(layer(x, impl=impl), want, TOL[F64])
    _, stages = layer(x, return_intermediates=True)
    K = stages["K"].repeat_interleave(2, dim=1)
    assert_close_scaled(stages["S"], 0.37 * stages["Q"] @ K.transpose(2, 3), TOL[F64])
    assert (layer(x, impl=impl) - MultiHeadAttention.from_projections(
        *w.values(), n_heads=H, n_kv_heads=3, rope="half", causal=True)(x)).abs().max() > 1e-3


def test_the_cache_decodes_with_scaling_partial_rotary_and_scale():
    """Prefill then one token at a time equals one causal forward, with every option on
    (dynamic scaling reads the largest position, which grows past L₀ while decoding)."""
    from einattn import KVCache

    torch.manual_seed(41)
    layer = MultiHeadAttention(D, H, n_kv_heads=2, rope="half", rotary_dim=4, scale=0.3,
                               causal=True, dtype=F64, rope_scaling={
                                   "rope_type": "linear", "factor": 2.0})
    x = randn(N, L, D, seed=42)
    cache = KVCache()
    steps = [layer(x[:, :3], cache=cache)] + [layer(x[:, t:t + 1], cache=cache)
                                             for t in range(3, L)]
    assert_close_scaled(torch.cat(steps, dim=1), layer(x), TOL[F64])


HF_SCALINGS = {  # Hugging Face rope_parameters, L₀ = 16 (positions run to 39)
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 2.5},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
             "beta_fast": 8.0, "beta_slow": 1.0},
}
HF_L0, HF_D_HEAD = 16, 16  # a = 16: wavelengths 2π … ≈ 2π·10000^(7/8), across L₀'s ramps


def _hf_llama(kind: str, n_kv_heads: int):
    """A Hugging Face LlamaAttention with random float64 weights and its rotary embedding,
    from a config with these rope_parameters, and einattn's rope_scaling for them."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama

    params = {**HF_SCALINGS[kind], "rope_theta": 10000.0}
    config = transformers.LlamaConfig(
        hidden_size=D, num_attention_heads=2, num_key_value_heads=n_kv_heads,
        head_dim=HF_D_HEAD, max_position_embeddings=HF_L0, rope_parameters=params,
        attn_implementation="eager")
    torch.manual_seed(51)
    attention = modeling_llama.LlamaAttention(config, layer_idx=0).double()
    ours = dict(params, max_position_embeddings=HF_L0) if kind == "dynamic" else params
    return attention, modeling_llama.LlamaRotaryEmbedding(config), ours


@pytest.mark.parametrize("kind", list(HF_SCALINGS))
@pytest.mark.parametrize("impl", ["einsum", "sdpa", "chunked"])
def test_rope_scaling_equals_hf_llama_attention(kind, impl):
    """The same weights and rope_parameters through HF's LlamaAttention (eager, float64
    weights) and einattn's layer, 40 positions (past L₀ = 16). HF computes its frequencies
    and cos/sin in float32 whatever the model's dtype, so the two agree to float32's
    precision (1e-5), not float64's; a wrong scaling is off by more than 1e-2."""
    attention, rotary_embedding, scaling = _hf_llama(kind, n_kv_heads=1)
    q, k, v, o = (getattr(attention, f"{p}_proj").weight.detach() for p in "qkvo")
    W, W_O = layouts.from_hf_llama(q, k, v, o, n_heads=2, n_kv_heads=1)
    layer = MultiHeadAttention.from_fused(W, W_O, n_kv_heads=1, rope="half", causal=True,
                                          rope_scaling=scaling, impl=impl)
    x = randn(2, 40, D, seed=52)
    positions = torch.arange(40).expand(2, 40)
    future = torch.full((40, 40), -math.inf, dtype=F64).triu(1)
    want, _ = attention(x, rotary_embedding(x, positions), attention_mask=future[None, None])
    assert_close_scaled(layer(x), want, 1e-5)
    if kind != "default":
        plain = MultiHeadAttention.from_fused(W, W_O, n_kv_heads=1, rope="half", causal=True)
        assert (plain(x) - want).abs().max() > 1e-2


@pytest.mark.parametrize("kind", list(HF_SCALINGS))
def test_frequencies_equal_hf_rope_init_functions(kind):
    """ω[p] and the attention factor against HF's own ROPE_INIT_FUNCTIONS (float32)."""
    pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    attention, rotary_embedding, scaling = _hf_llama(kind, n_kv_heads=2)
    positions = torch.arange(40)[None]
    init = ROPE_INIT_FUNCTIONS.get(kind, rotary_embedding.compute_default_rope_parameters)
    hf = init(attention.config, **({"seq_len": 40} if kind == "dynamic" else {}))
    omega, m = rotary.frequencies(positions, d_rot=HF_D_HEAD, base=10000.0,
                                  scaling=rotary.check_scaling(scaling, base=10000.0,
                                                               d_head=HF_D_HEAD,
                                                               d_rot=HF_D_HEAD), dtype=F64)
    assert_close_scaled(omega, hf[0].double(), 1e-6)
    assert math.isclose(m, hf[1], rel_tol=1e-12)
