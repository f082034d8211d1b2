"""The layer's options for today's models (issue 36, items 3–6), on einattn's own: qk-norm
(per head, over the heads, after RoPE without a gain), the output gate, differential
attention, Llama 4's temperature. Each composes with the rest: grouped-query attention, a
mask and a window, every impl, both caches, torch.compile, the intermediates by their
equation names; what cannot run is refused by name. (Parity with the models' own modules:
tests/test_hf_today.py.) Sizes all distinct: n=2, L=9, i=30, μ=6, g=2, a=8, b=10.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from einattn import EinattnError, KVCache, MultiHeadAttention, StaticKVCache, composition, rotary
from einattn import differential as diff
from einattn import gate as gate_module
from einattn import temperature as temp
from einattn.functional import masked_softmax
from einattn.qk_norm import QKNorm
from einattn.spec import Spec
from tests.conftest import TOL, assert_close_scaled, left_padded, randn, refilled, whole

F64 = torch.float64
N, L, D, H, G, A, B = 2, 9, 30, 6, 2, 8, 10
OPTIONS = {  # name -> layer options
    "qk-norm per head": {"qk_norm": QKNorm("head", "gamma", 1e-5), "rope": "half"},
    "qk-norm over heads": {"qk_norm": QKNorm("heads", "1+gamma", 1e-6), "rope": "half",
                           "window": 5},
    "qk-norm after rope": {"qk_norm": QKNorm("head", None, 1e-5, after_rope=True),
                           "rope": "interleaved"},
    "gate, d_value": {"gate": True, "d_value": B, "bias": True, "rope": "half",
                      "rotary_dim": 4},
    "differential": {"differential": diff.Differential(diff.lambda_init(2)), "rope": "half"},
    "temperature": {"temperature": temp.Temperature(3, 0.25)},
    "everything": {"qk_norm": QKNorm("head", "1+gamma"), "gate": True, "rope": "half",
                   "differential": diff.Differential(0.3, 1e-6),
                   "temperature": temp.Temperature(2, 0.5), "bias": True},
}


def make(name: str, seed: int = 0, **more) -> MultiHeadAttention:
    options = {"n_kv_heads": G, "causal": True, **OPTIONS[name], **more}
    return refilled(MultiHeadAttention(D, H, d_head=A, dtype=F64, **options), seed * 100, 0.4)


@pytest.mark.parametrize("impl", ["sdpa", "chunked", "flex"])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_every_impl_equals_einsum(name, impl):
    layer = make(name, block_size=4)
    x, kpm = randn(N, L, D, seed=1), left_padded(N, L, 3)
    with torch.no_grad():  # flex on the CPU runs without gradients
        assert_close_scaled(layer(x, key_padding_mask=kpm, impl=impl)[~kpm],
                            layer(x, key_padding_mask=kpm)[~kpm], TOL[F64])


CACHES = [(name, cache) for name in OPTIONS for cache in ("KVCache", "StaticKVCache")
          if cache == "KVCache" or "window" not in OPTIONS[name]]  # static: no window


@pytest.mark.parametrize("name, cache", CACHES, ids=[f"{n}-{c}" for n, c in CACHES])
def test_cached_decoding_equals_the_full_forward(name, cache):
    """The temperature at the cache index, qk-norm before the keys are cached, the
    differential value pairs made from the cached values."""
    layer = make(name, seed=1)
    x, kpm = randn(N, L, D, seed=2), left_padded(N, L, 3)
    c, outs = KVCache() if cache == "KVCache" else StaticKVCache(L + 1), []
    with torch.no_grad():
        for a, b in itertools.pairwise([0, 4, *range(5, L + 1)]):
            outs.append(layer(x[:, a:b], key_padding_mask=kpm[:, a:b], cache=c))
        want = layer(x, key_padding_mask=kpm)
    assert_close_scaled(torch.cat(outs, 1)[~kpm], want[~kpm], TOL[F64])


@pytest.mark.parametrize("impl", ["einsum", "sdpa"])
@pytest.mark.parametrize("name", ["qk-norm over heads", "everything"])
def test_torch_compile_equals_eager(name, impl):
    torch._dynamo.reset()
    layer = make(name, impl=impl)
    compiled = torch.compile(layer, fullgraph=whole(impl), backend="aot_eager")
    x = randn(N, L, D, seed=3, requires_grad=True)
    Y, Y_eager = compiled(x), layer(x)
    assert_close_scaled(Y, Y_eager, TOL[F64])
    wrt = [x, *layer.parameters()]
    for got, want in zip(torch.autograd.grad(Y.sum(), wrt),
                         torch.autograd.grad(Y_eager.sum(), wrt), strict=True):
        assert_close_scaled(got, want, TOL[F64])
    torch._dynamo.reset()


def rms(T, axes, eps):
    """The RMS norm written out: T / √(mean of T² over ``axes`` + ε)."""
    return T / (T.pow(2).mean(axes, keepdim=True) + eps).sqrt()


@pytest.mark.parametrize("name", [name for name in OPTIONS if name.startswith("qk")])
def test_qk_norm_is_its_equation_before_or_after_rope(name):
    """Q and K of the intermediates: the projections normalised (per head with γ[a], over
    the heads with 1 + γ[μ a]), then turned; or turned, then normalised without a gain."""
    layer, x = make(name, seed=5), randn(N, L, D, seed=4)
    norm = layer.qk_norm
    _, st = layer(x, return_intermediates=True)
    _, projected = make(name, seed=5, qk_norm=None, rope=None)(x, return_intermediates=True)
    R = rotary.rotations(torch.arange(L).expand(N, L), d_head=A, base=layer.rope_base,
                         dtype=F64)
    axes = (-1,) if norm.over == "head" else (1, -1)
    for T, gamma in (("Q", getattr(layer, "gamma_Q", None)), ("K", getattr(layer, "gamma_K",
                                                                           None))):
        gain = 1.0 if gamma is None else gamma[:, None] if norm.over == "heads" else gamma
        gain = 1 + gain if norm.gain == "1+gamma" else gain
        if norm.after_rope:
            want = rms(rotary.rotate(projected[T], R, layer.rope), axes, norm.eps) * gain
        else:
            want = rotary.rotate(rms(projected[T], axes, norm.eps) * gain, R, layer.rope)
        assert_close_scaled(st[T], want, TOL[F64])


def test_the_gate_and_the_differential_heads_are_their_equations():
    layer = make("everything", seed=6)
    x = randn(N, L, D, seed=7)
    Y, st = layer(x, return_intermediates=True)
    lam = diff.weight(dict(layer.named_parameters()), layer.differential)
    q1, k1, q2, k2 = (getattr(layer, n) for n in diff.LAMBDAS)
    assert_close_scaled(lam, torch.exp(q1 @ k1) - torch.exp(q2 @ k2) + 0.3, TOL[F64])
    V_P = diff.value_pairs(st["V"])
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    Z = masked_softmax(st["S"], causal) @ V_P.repeat_interleave(H // G, 1)
    assert_close_scaled(st["Z"], Z, TOL[F64])
    Z_D = Z[:, :H // 2] - lam * Z[:, H // 2:]
    assert_close_scaled(st["Z_D"], Z_D, TOL[F64])
    N_ = 0.7 * Z_D / (Z_D.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    assert_close_scaled(st["N"], N_, TOL[F64])
    G_ = (x @ layer.W_G.T + layer.b_G).view(N, L, H // 2, -1).transpose(1, 2)
    assert st["G"].shape == (N, H // 2, L, 2 * A)  # per channel of the differential heads
    assert_close_scaled(st["G"], G_, TOL[F64])
    assert_close_scaled(st["Z_g"], N_ * torch.sigmoid(G_), TOL[F64])
    W_O = layer.W_O
    assert_close_scaled(Y, torch.einsum("nmtc,mci->nti", st["Z_g"], W_O) + layer.b_O,
                        TOL[F64])


def test_differential_weights_are_A_1_minus_lambda_A_2():
    layer = make("differential", seed=8)
    x = randn(N, L, D, seed=9)
    Y, A_D = layer(x, need_weights=True)
    _, st = layer(x, return_intermediates=True)
    lam = diff.weight(dict(layer.named_parameters()), layer.differential)
    assert A_D.shape == (N, H // 2, L, L)
    assert_close_scaled(A_D, st["A"][:, :H // 2] - lam * st["A"][:, H // 2:], TOL[F64])
    assert_close_scaled(Y, st["Y"], TOL[F64])


def test_the_temperature_counts_the_cache_index_and_scales_the_queries():
    """β[τ] = 1 + α·log(1 + ⌊(t + 1)/f⌋) at t = 0 … L−1 (after the cached tokens), the same
    for every head and sample, whatever positions= says."""
    layer = make("temperature", seed=10)
    x = randn(N, L, D, seed=11)
    plain = make("temperature", seed=10, temperature=None)
    _, st = layer(x, return_intermediates=True)
    _, raw = plain(x, return_intermediates=True)
    t = torch.arange(L, dtype=F64)
    beta = 1 + 0.25 * torch.log(1 + torch.floor((t + 1) / 3))
    assert_close_scaled(st["Q"], raw["Q"] * beta[:, None], TOL[F64])
    assert beta[0] == 1 and beta[2] == 1 + 0.25 * math.log(2)
    cache = KVCache()
    layer(x[:, :4], cache=cache)
    _, later = layer(x[:, 4:], cache=cache, return_intermediates=True)
    assert_close_scaled(later["Q"], st["Q"][:, :, 4:], TOL[F64])


BAD = [  # (what, the message)
    (lambda: QKNorm("tokens"), "QKNorm's over must be 'head'"),
    (lambda: QKNorm(gain="beta"), "QKNorm's gain must be 'gamma', '1\\+gamma' or None"),
    (lambda: QKNorm(eps=-1.0), "QKNorm's eps .ε under the root. must be a number in"),
    (lambda: QKNorm(after_rope=1), "QKNorm's after_rope must be True or False"),
    (lambda: temp.Temperature(0, 0.1), "Temperature's floor_scale must be a finite positive"),
    (lambda: diff.Differential(float("nan")), "Differential's lambda_init must be a finite"),
    (lambda: diff.Differential(0.2, eps=2.0), "Differential's eps must be a finite number in"),
    (lambda: Spec(gate=1), "gate must be True or False, got 1"),
    (lambda: Spec(temperature=3), "temperature must be None or an einattn.temperature."
                                  "Temperature, got int"),
    (lambda: gate_module.from_interleaved(torch.ones(10, 3), 3),
     r"q_proj has 10 rows; q_proj\[\(μ B a\) i\] with B over the query and the gate needs a "
     r"multiple of 2·μ = 6"),
]


@pytest.mark.parametrize("build, message", BAD)
def test_bad_options_are_refused_by_name(build, message):
    with pytest.raises(EinattnError, match=message):
        build()


@pytest.mark.parametrize("name, missing, message", [
    ("qk-norm per head", "gamma_Q", "hold no gamma_Q or gamma_K"),
    ("gate, d_value", "W_G", "its weights hold no W_G"),
    ("differential", "lambda_k2", "hold no lambda_q1, lambda_k1, lambda_q2, lambda_k2"),
])
def test_weights_that_miss_an_options_tensor_are_refused(name, missing, message):
    """A layer whose weights are substituted (a parallel layer's shards) must hand each
    option's tensors on: one that does not is refused by name, not run without them."""
    layer = make(name)
    w = layer._attention_weights()
    del w[missing]
    with pytest.raises(EinattnError, match=message):
        composition.multi_head(randn(N, L, D, seed=12), w, layer.spec,
                               composition.Call(causal=True))


def test_a_slot_is_refused_where_the_attention_is_not_the_compositions():
    layer = MultiHeadAttention(D, H, dtype=F64, bias_kv=True)
    w = layer._attention_weights()

    def ring(*args):  # a sequence-parallel layer's attention, which takes no dense mask
        return {"Z": args[0]}
    with pytest.raises(EinattnError, match=r"bias_kv: this layer's attention \(sequence-parallel"):
        composition.multi_head(randn(N, L, D, seed=13), w, layer.spec, composition.Call(), ring)
