"""Value heads of their own width (issue 36, item 1): ``d_value`` (b ≠ a), so ``V[n g σ b]``,
``Z[n μ τ b]``, ``W_O[μ b i]`` and the fused ``W[(g e) i]``, ``e = (r a | a | b)``.

Against the reshape form (einattn.reference, which splits each projection into heads of its
own width), on every impl, through both caches, torch.compile, the converters and
cross-attention; float64 at 1e-12. Sizes all distinct: n=2, L=9, i=30, μ=6, g=2 (r=3),
a=4, b=7.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from einattn import EinattnError, KVCache, MultiHeadAttention, StaticKVCache, reference
from einattn import functional as F
from tests.conftest import TOL, assert_close_scaled, left_padded, randn, refilled, whole

F64 = torch.float64
N, L, D, H, G, A, B = 2, 9, 30, 6, 2, 4, 7


def make(seed: int = 0, **options) -> MultiHeadAttention:
    return refilled(MultiHeadAttention(D, H, d_head=A, d_value=B, dtype=F64, **options),
                    seed * 10, 0.4)


def test_the_layout_and_the_shapes():
    layer = make(n_kv_heads=G, bias=True)
    e = (H // G + 1) * A + B
    assert layer.W.shape == (G * e, D) and layer.b.shape == (G * e,)
    assert layer.W_O.shape == (H, B, D)
    _, st = layer(randn(N, L, D, seed=1), return_intermediates=True)
    assert st["Q"].shape == (N, H, L, A) and st["K"].shape == (N, G, L, A)
    assert st["V"].shape == (N, G, L, B) and st["Z"].shape == (N, H, L, B)
    assert "d_value=7" in repr(layer)


@pytest.mark.parametrize("bias", [False, True])
def test_equals_the_reshape_form_forward_and_gradients(bias):
    """Without grouping, the textbook form with V split into heads of b channels."""
    layer = make(bias=bias, causal=True)
    x = randn(N, L, D, seed=2, requires_grad=True)
    p = layer.projections()
    weights = [t.detach().clone().requires_grad_(True) for t in p[:4]]
    biases = [None if t is None else t.detach().clone().requires_grad_(True) for t in p[4:]]
    want = reference.multi_head_attention(x, *weights, n_heads=H, causal=True,
                                          b_q=biases[0], b_k=biases[1], b_v=biases[2],
                                          b_o=biases[3])
    got = layer(x)
    assert_close_scaled(got, want, TOL[F64])
    g = randn(N, L, D, seed=3)
    (gx_want,) = torch.autograd.grad((want * g).sum(), x)
    (gx_got,) = torch.autograd.grad((got * g).sum(), x)
    assert_close_scaled(gx_got, gx_want, TOL[F64])


def test_grouped_values_equal_repeated_heads():
    """With g = 2 groups of r = 3, each value head V[n g σ b] serves its group's queries."""
    layer = make(n_kv_heads=G, causal=True, bias=True)
    x = randn(N, L, D, seed=4)
    p = layer.projections()
    W_k = p.W_k.view(G, A, D).repeat_interleave(H // G, 0).reshape(H * A, D)
    W_v = p.W_v.view(G, B, D).repeat_interleave(H // G, 0).reshape(H * B, D)
    b_k = p.b_k.view(G, A).repeat_interleave(H // G, 0).flatten()
    b_v = p.b_v.view(G, B).repeat_interleave(H // G, 0).flatten()
    want = reference.multi_head_attention(x, p.W_q, W_k, W_v, p.W_o, n_heads=H, causal=True,
                                          b_q=p.b_q, b_k=b_k, b_v=b_v, b_o=p.b_o)
    assert_close_scaled(layer(x), want, TOL[F64])


@pytest.mark.parametrize("impl", ["sdpa", "chunked", "flex"])
def test_every_impl_equals_einsum(impl):
    layer = make(n_kv_heads=G, causal=True, window=5, rope="half", block_size=4)
    x = randn(N, L, D, seed=5)
    with torch.no_grad():  # flex on the CPU runs without gradients
        assert_close_scaled(layer(x, key_padding_mask=left_padded(N, L, 3), impl=impl),
                            layer(x, key_padding_mask=left_padded(N, L, 3)), TOL[F64])


@pytest.mark.parametrize("cache", [KVCache, lambda: StaticKVCache(L + 2)],
                         ids=["KVCache", "StaticKVCache"])
def test_cached_decoding_equals_the_full_forward(cache):
    layer = make(n_kv_heads=G, causal=True, rope="interleaved")
    x, kpm = randn(N, L, D, seed=6), left_padded(N, L, 3)
    c, outs = cache(), []
    with torch.no_grad():
        for a, b in itertools.pairwise([0, 4, *range(5, L + 1)]):
            outs.append(layer(x[:, a:b], key_padding_mask=kpm[:, a:b], cache=c))
        want = layer(x, key_padding_mask=kpm)
    assert c.V.shape[-1] == B and c.K.shape[-1] == A
    assert_close_scaled(torch.cat(outs, 1)[~kpm], want[~kpm], TOL[F64])


@pytest.mark.parametrize("impl", ["einsum", "sdpa", "chunked"])
def test_torch_compile_equals_eager(impl):
    torch._dynamo.reset()
    layer = make(n_kv_heads=G, causal=True, impl=impl, block_size=4)
    compiled = torch.compile(layer, fullgraph=whole(impl), backend="aot_eager")
    x = randn(N, L, D, seed=7, requires_grad=True)
    Y, Y_eager = compiled(x), layer(x)
    assert_close_scaled(Y, Y_eager, TOL[F64])
    wrt = [x, *layer.parameters()]
    for got, want in zip(torch.autograd.grad(Y.sum(), wrt), torch.autograd.grad(
            Y_eager.sum(), wrt), strict=True):
        assert_close_scaled(got, want, TOL[F64])
    torch._dynamo.reset()


def test_from_projections_infers_d_value_and_projections_give_them_back():
    layer = make(n_kv_heads=G, bias=True)
    p = layer.projections()
    assert p.W_v.shape == (G * B, D) and p.W_o.shape == (D, H * B)
    again = MultiHeadAttention.from_projections(*p[:4], n_heads=H, b_q=p.b_q, b_k=p.b_k,
                                                b_v=p.b_v, b_o=p.b_o)
    assert (again.d_head, again.d_value, again.n_kv_heads) == (A, B, G)
    for name, t in layer.state_dict().items():
        assert torch.equal(again.state_dict()[name], t)


def test_from_fused_reads_b_from_W_O_and_a_from_d_head():
    layer = make(n_kv_heads=G, bias=True)
    again = MultiHeadAttention.from_fused(layer.W.detach(), layer.W_O.detach(),
                                          layer.b.detach(), layer.b_O.detach(), n_kv_heads=G,
                                          d_head=A)
    x = randn(N, L, D, seed=8)
    assert torch.equal(again(x), layer(x))
    with pytest.raises(EinattnError, match=r"W has shape \(50, 30\) but W\[\(g e\) i\] needs "
                                           r"\(46, 30\) with μ=6, b=7, i=30 from W_O, a=4, g=2"):
        MultiHeadAttention.from_fused(torch.ones(50, D), layer.W_O.detach(), n_kv_heads=G,
                                      d_head=A)


def test_cross_attention_from_a_context_of_its_own_width():
    """d_context: W_KV[(g e) j], e = (a | b); the fused weight with a context of x's width."""
    x, C = randn(N, 5, D, seed=9), randn(N, L, 11, seed=10)
    layer = make(n_kv_heads=G, d_context=11, bias=True)
    assert layer.W_KV.shape == (G * (A + B), 11)
    p = layer.projections()
    W_k, W_v, b_k, b_v = (t.view(G, -1, *t.shape[1:]).repeat_interleave(H // G, 0).flatten(0, 1)
                          for t in (p.W_k, p.W_v, p.b_k, p.b_v))
    want = reference.multi_head_attention(x, p.W_q, W_k, W_v, p.W_o, n_heads=H, context=C,
                                          b_q=p.b_q, b_k=b_k, b_v=b_v, b_o=p.b_o)
    assert_close_scaled(layer(x, C), want, TOL[F64])
    fused = make(n_kv_heads=G)
    same = MultiHeadAttention.from_projections(*fused.projections()[:4], n_heads=H)
    C = randn(N, L, D, seed=11)
    assert_close_scaled(fused(x, C), same(x, C), TOL[F64])


def test_the_functional_form_takes_d_value():
    layer = make(causal=True)
    x = randn(N, L, D, seed=12)
    Y = F.multi_head_attention(x, layer.W, layer.W_O, n_heads=H, d_value=B, causal=True)
    assert_close_scaled(Y, layer(x), TOL[F64])
    with pytest.raises(EinattnError, match=r"W has 90 rows; W\[\(μ B a\) i\] needs μ·B·a rows "
                                           r"with μ=6, B=3, so a multiple of 18; with values of "
                                           r"their own width b = d_value = 6"):
        F.multi_head_attention(x, layer.W, layer.W_O, n_heads=H, d_value=6)


def test_a_bias_of_the_wrong_length_and_values_of_another_width_in_a_cache_are_refused():
    layer = make(n_kv_heads=G, bias=True)
    x = randn(N, L, D, seed=13)
    with pytest.raises(EinattnError, match=r"b has shape \(45,\) but b\[\(g e\)\] needs \(46,\), "
                                           r"the rows of W"):
        F.multi_head_attention(x, layer.W, layer.W_O, b=layer.b[:-1], n_heads=H,
                               n_kv_heads=G, d_value=B)
    cache = KVCache()
    cache.append(torch.ones(N, G, 2, A), torch.ones(N, G, 2, B))
    with pytest.raises(EinattnError, match=r"index 'b' has size 5 in the new values but 7 in "
                                           r"the cache's V\[n g σ b\]"):
        cache.append(torch.ones(N, G, 1, A), torch.ones(N, G, 1, 5))
