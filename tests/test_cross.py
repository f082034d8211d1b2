"""Cross-attention from a context of another width (``d_context``): queries from X[n τ i],
keys and values from C[n σ j] through W_Q[(μ a) i] and W_KV[(g B a) j]. Parity in float64,
forward and every gradient, with nn.MultiheadAttention(kdim = vdim = j), and with an
x-transformers-style and a diffusers-style cross-attention written here from their
published definitions; at all-distinct sizes i ≠ j ≠ μ·a, with key padding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from einattn import EinattnError, KVCache, MultiHeadAttention, cross
from tests.conftest import TOL, assert_close_scaled, randn, whole

F64 = torch.float64
N, L_Q, L_K, D_X, D_C, MU, A = 2, 5, 7, 20, 13, 3, 4  # i = 20, j = 13, μ·a = 12
IMPLS = ["einsum", "sdpa", "chunked"]


def _inputs(seed: int = 1, d_x: int = D_X):
    x = randn(N, L_Q, d_x, seed=seed, requires_grad=True)
    c = randn(N, L_K, D_C, seed=seed + 1, requires_grad=True)
    pad = torch.zeros(N, L_K, dtype=torch.bool)
    pad[1, :3] = True
    return x, c, pad


def _grads(y: torch.Tensor, tensors) -> list[torch.Tensor]:
    return list(torch.autograd.grad(y, tensors, randn(*y.shape, seed=9)))


@pytest.mark.parametrize("impl", IMPLS)
def test_equals_torch_multihead_attention_with_kdim_and_vdim(impl):
    torch.manual_seed(0)  # nn.MultiheadAttention needs μ·a = i: here i = 21 = 3·7, j = 13
    mha = nn.MultiheadAttention(21, MU, kdim=D_C, vdim=D_C, bias=True, batch_first=True,
                                dtype=F64)
    with torch.no_grad():
        for p in mha.parameters():
            p.copy_(randn(*p.shape, seed=p.numel()) * 0.3)
    layer = MultiHeadAttention.from_torch(mha, impl=impl)
    assert layer.d_context == D_C and layer.W is None and tuple(layer.W_KV.shape) == (42, D_C)
    x, c, pad = _inputs(d_x=21)
    Y = layer(x, c, key_padding_mask=pad)
    Y_ref = mha(x, c, c, key_padding_mask=pad, need_weights=False)[0]
    assert_close_scaled(Y, Y_ref, TOL[F64])
    ours = [x, c, layer.W_Q, layer.W_KV, layer.W_O, layer.b_Q, layer.b_KV, layer.b_O]
    theirs = [x, c, mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight,
              mha.out_proj.weight, mha.in_proj_bias, mha.out_proj.bias]
    dx, dc, dW_Q, dW_KV, dW_O, db_Q, db_KV, db_O = _grads(Y, ours)
    ex, ec, eW_q, eW_k, eW_v, eW_o, eb_in, eb_o = _grads(Y_ref, theirs)
    dK, dV = dW_KV.unflatten(0, (MU, 2, -1)).unbind(1)  # W_KV[(g B a) j], g = μ here
    db_K, db_V = db_KV.unflatten(0, (MU, 2, -1)).unbind(1)
    pairs = [(dx, ex), (dc, ec), (dW_Q, eW_q), (dK.flatten(0, 1), eW_k),
             (dV.flatten(0, 1), eW_v), (dW_O.flatten(0, 1).T, eW_o),
             (torch.cat([db_Q, db_K.flatten(), db_V.flatten()]), eb_in), (db_O, eb_o)]
    for g, g_ref in pairs:  # every gradient: the inputs' and every parameter's
        assert_close_scaled(g, g_ref, TOL[F64])
    back = layer.to_torch()
    assert back.kdim == back.vdim == D_C
    assert_close_scaled(back(x, c, c, key_padding_mask=pad)[0], Y_ref, TOL[F64])


def _xtransformers(x, context, to_q, to_k, to_v, to_out, heads, kv_heads):
    """x-transformers' Attention(dim_context=j) as published: q from x, k and v from the
    context, split into heads ('b n (h d) -> b h n d'), kv heads repeated for GQA, softmax
    of q·k / √d, merged heads, to_out."""
    b = x.shape[0]
    q = to_q(x).view(b, x.shape[1], heads, -1).transpose(1, 2)
    k, v = (f(context).view(b, context.shape[1], kv_heads, -1).transpose(1, 2)
            for f in (to_k, to_v))
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    A = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
    return to_out((A @ v).transpose(1, 2).reshape(b, x.shape[1], -1))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kv_heads", [MU, 1], ids=["heads", "GQA"])
def test_equals_an_x_transformers_cross_attention(impl, kv_heads):
    torch.manual_seed(1)
    to_q, to_out = nn.Linear(D_X, MU * A, bias=False, dtype=F64), nn.Linear(MU * A, D_X, dtype=F64)
    to_k, to_v = (nn.Linear(D_C, kv_heads * A, bias=False, dtype=F64) for _ in range(2))
    layer = MultiHeadAttention.from_projections(
        to_q.weight.detach(), to_k.weight.detach(), to_v.weight.detach(),
        to_out.weight.detach(), b_o=to_out.bias.detach(), n_heads=MU, impl=impl)
    assert layer.n_kv_heads == kv_heads and layer.d_context == D_C
    x, c, _ = _inputs(seed=3)
    Y = layer(x, c)
    Y_ref = _xtransformers(x, c, to_q, to_k, to_v, to_out, MU, kv_heads)
    assert_close_scaled(Y, Y_ref, TOL[F64])
    *grads, dW_KV = _grads(Y, [x, c, layer.W_KV])
    *grads_ref, dW_k = _grads(Y_ref, [x, c, to_k.weight])
    assert_close_scaled(dW_KV[:A], dW_k[:A], TOL[F64])  # group 0's key rows
    for g, g_ref in zip(grads, grads_ref, strict=True):
        assert_close_scaled(g, g_ref, TOL[F64])


def test_equals_a_diffusers_style_cross_attention():
    """diffusers' Attention(query_dim=i, cross_attention_dim=j) as published: to_q, to_k,
    to_v without bias, to_out[0] with one, scores scaled by d_head^-1/2, the text states
    as the context."""
    torch.manual_seed(2)
    to_q, to_k, to_v = (nn.Linear(d, MU * A, bias=False, dtype=F64) for d in (D_X, D_C, D_C))
    to_out = nn.Linear(MU * A, D_X, dtype=F64)
    layer = MultiHeadAttention.from_projections(
        *(m.weight.detach() for m in (to_q, to_k, to_v, to_out)), b_o=to_out.bias.detach(),
        n_heads=MU)
    x, c, _ = _inputs(seed=5)
    q, k, v = (t.view(N, -1, MU, A).transpose(1, 2) for t in (to_q(x), to_k(c), to_v(c)))
    A_ = (q @ k.transpose(-1, -2) * A ** -0.5).softmax(-1)
    Y_ref = to_out((A_ @ v).transpose(1, 2).reshape(N, L_Q, MU * A))
    Y = layer(x, c)
    assert_close_scaled(Y, Y_ref, TOL[F64])
    dx, dc, dW_Q, dW_KV, dW_O, db_O = _grads(Y, [x, c, layer.W_Q, layer.W_KV, layer.W_O,
                                                 layer.b_O])
    ex, ec, eq, ek, ev, eo, eb = _grads(Y_ref, [x, c, to_q.weight, to_k.weight, to_v.weight,
                                                to_out.weight, to_out.bias])
    dK, dV = dW_KV.unflatten(0, (MU, 2, -1)).unbind(1)
    for g, g_ref in [(dx, ex), (dc, ec), (dW_Q, eq), (dK.flatten(0, 1), ek),
                     (dV.flatten(0, 1), ev), (dW_O.flatten(0, 1).T, eo), (db_O, eb)]:
        assert_close_scaled(g, g_ref, TOL[F64])


@pytest.mark.parametrize("impl", IMPLS)
def test_everything_composes(impl):
    """GQA, biases, a mask and key padding, the patterns, weights and intermediates: the
    d_context layer equals the same computation through cross.project and the functional
    attention written out."""
    torch.manual_seed(3)
    layer = MultiHeadAttention(D_X, 6, d_head=A, n_kv_heads=2, d_context=D_C, bias=True,
                               window=4, softcap=5.0, sinks=True, impl=impl, dtype=F64)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(randn(*p.shape, seed=p.numel() + 1) * 0.3)
    x, c, pad = _inputs(seed=7)
    mask = randn(L_Q, L_K, seed=8) > -1
    Y, stages = layer(x, c, key_padding_mask=pad, mask=mask, return_intermediates=True)
    Q, K, V = cross.project(x, layer.W_Q, c, layer.W_KV, n_heads=6, n_kv_heads=2,
                            b_Q=layer.b_Q, b_KV=layer.b_KV)
    assert all(torch.equal(stages[k], t) for k, t in zip("QKV", (Q, K, V), strict=True))
    assert_close_scaled(layer(x, c, key_padding_mask=pad, mask=mask), Y, TOL[F64])
    compiled = torch.compile(layer, fullgraph=whole(impl), backend="aot_eager")
    assert_close_scaled(compiled(x, c, key_padding_mask=pad, mask=mask), Y, TOL[F64])
    torch._dynamo.reset()


def test_a_context_of_the_models_width_may_be_left_out():
    layer = MultiHeadAttention(D_X, MU, d_head=A, d_context=D_X, dtype=F64)
    x = randn(N, L_Q, D_X, seed=10)
    assert_close_scaled(layer(x), layer(x, x), TOL[F64])


def test_rope_and_the_cache_stay_self_attention_only():
    x, c, _ = _inputs()
    with pytest.raises(EinattnError, match=r"rope needs self-attention"):
        MultiHeadAttention(D_X, MU, d_head=A, d_context=D_C, rope="half", dtype=F64)(x, c)
    with pytest.raises(EinattnError, match=r"a KVCache holds self-attention's keys"):
        MultiHeadAttention(D_X, MU, d_head=A, d_context=D_C, dtype=F64)(x, c, cache=KVCache())


def test_projections_round_trip_and_name_the_widths():
    layer = MultiHeadAttention(D_X, MU, d_head=A, d_context=D_C, bias=True, dtype=F64)
    p = layer.projections()
    assert tuple(p.W_q.shape) == (MU * A, D_X) and tuple(p.W_k.shape) == (MU * A, D_C)
    again = MultiHeadAttention.from_projections(*p[:4], n_heads=MU, b_q=p.b_q, b_k=p.b_k,
                                                b_v=p.b_v, b_o=p.b_o)
    for name, t in layer.named_parameters():
        assert torch.equal(getattr(again, name), t), name
    assert "d_context=13" in repr(layer)


def test_flex_runs_the_d_context_layer_forward():
    layer = MultiHeadAttention(D_X, MU, d_head=A, d_context=D_C, window=3, dtype=F64)
    x, c, pad = _inputs(seed=11)
    with torch.no_grad():
        assert_close_scaled(layer(x, c, key_padding_mask=pad, impl="flex"),
                            layer(x, c, key_padding_mask=pad), TOL[F64])


ERRORS = {
    "context width": (lambda: cross.project(torch.ones(2, 5, D_X), torch.ones(12, D_X),
                                            torch.ones(2, 7, 11), torch.ones(24, D_C),
                                            n_heads=MU),
                      r"index 'j' has size 11 in the context C\[n σ j\] \(2, 7, 11\) but 13 in "
                      r"the weight W_KV\[\(g B a\) j\] \(24, 13\)"),
    "no context": (lambda: cross.project(torch.ones(2, 5, D_X), torch.ones(12, D_X), None,
                                         torch.ones(24, D_C), n_heads=MU),
                   r"W_KV\[\(g B a\) j\] projects the keys and values from a context C\[n σ j\]: "
                   r"pass context="),
    "context 2-D": (lambda: cross.project(torch.ones(2, 5, D_X), torch.ones(12, D_X),
                                          torch.ones(7, D_C), torch.ones(24, D_C), n_heads=MU),
                    r"context must be 3-D C\[n σ j\] and W_KV 2-D W_KV\[\(g B a\) j\]"),
    "b_KV": (lambda: cross.project(torch.ones(2, 5, D_X), torch.ones(12, D_X),
                                   torch.ones(2, 7, D_C), torch.ones(24, D_C), n_heads=MU,
                                   b_KV=torch.ones(12)),
             r"b_KV has shape \(12,\) but b_KV\[\(g B a\)\] needs \(24,\)"),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_bad_cross_inputs_name_the_index_and_tensors(name):
    call, match = ERRORS[name]
    with pytest.raises(EinattnError, match=match):
        call()
