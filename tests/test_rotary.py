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
from tests.conftest import TOL, assert_close_scaled, randn

F64 = torch.float64
N, L, D, H, A = 2, 7, 24, 6, 6  # d_head 6: three pairs per head


def _inv_freq(d_head: int, base: float) -> torch.Tensor:
    return 1.0 / base ** (torch.arange(0, d_head, 2, dtype=F64) / d_head)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _rotate_every_two(x):
    return torch.stack([-x[..., 1::2], x[..., 0::2]], dim=-1).flatten(-2)


def _rope_reference(t: torch.Tensor, positions: torch.Tensor, style: str, base: float):
    """``t`` (n, heads, L, d) turned as Llama ("half") or GPT-J ("interleaved") do it."""
    freqs = positions.to(F64)[..., None] * _inv_freq(t.shape[-1], base)  # (n, L, d/2)
    if style == "half":
        angles, turn = torch.cat([freqs, freqs], dim=-1), _rotate_half
    else:
        angles, turn = freqs.repeat_interleave(2, dim=-1), _rotate_every_two
    cos, sin = angles.cos()[:, None].to(t.dtype), angles.sin()[:, None].to(t.dtype)
    return t * cos + turn(t) * sin


def _llama_attention(x, w, *, n_heads, n_kv_heads, positions, style, base, causal=True):
    """Separate q/k/v/o projections, rotary on q and k, keys and values repeated per group."""
    n, L_, _ = x.shape
    d = w["W_q"].shape[0] // n_heads
    q = (x @ w["W_q"].T).view(n, L_, n_heads, d).transpose(1, 2)
    k = (x @ w["W_k"].T).view(n, L_, n_kv_heads, d).transpose(1, 2)
    v = (x @ w["W_v"].T).view(n, L_, n_kv_heads, d).transpose(1, 2)
    q, k = (_rope_reference(t, positions, style, base) for t in (q, k))
    k, v = (t.repeat_interleave(n_heads // n_kv_heads, dim=1) for t in (k, v))
    scores = q @ k.transpose(2, 3) / math.sqrt(d)
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
                               r"positions= only matters with rope='half' or 'interleaved'"),
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
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    positions = torch.arange(L) + 7
    assert_close_scaled(compiled(x, positions=positions), layer(x, positions=positions),
                        TOL[F64])


def test_positions_broadcast_over_the_batch():
    layer = MultiHeadAttention(D, H, rope="half", causal=True, dtype=F64)
    x = randn(N, L, D, seed=15)
    t = torch.arange(L) + 11
    assert torch.equal(layer(x, positions=t[None]), layer(x, positions=t))
    assert torch.equal(layer(x, positions=t[None]), layer(x, positions=t.expand(N, L)))
