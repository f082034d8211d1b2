"""einattn.layouts: every rearrangement checked element by element, round trips, errors;
the layer loaded from each library's layout computes that library's attention (float64,
1e-12), against references written in that library's own style."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_close_scaled, randn

from einattn import EinattnError, MultiHeadAttention, layouts

MU, A, D = 3, 5, 7  # heads, channels per head, d_model: all distinct


def distinct(*shape, offset=0):
    """A tensor whose every element is different, so a wrong pattern cannot pass."""
    return (torch.arange(torch.Size(shape).numel(), dtype=torch.float64) + offset).reshape(shape)


def three(*tail):
    rows = MU * A
    return tuple(distinct(rows, *tail, offset=k * 1000) for k in range(3))


@pytest.mark.parametrize("tail", [(D,), ()], ids=["weight", "bias"])
def test_fused_rows_are_per_head_q_k_v(tail):
    W_q, W_k, W_v = three(*tail)
    W = layouts.fuse_qkv(W_q, W_k, W_v, n_heads=MU)
    assert W.shape == (MU * 3 * A, *tail)
    for mu in range(MU):
        for B, W_B in enumerate((W_q, W_k, W_v)):
            # W[(μ B a) i]: row (μ·3 + B)·a + α holds W_B row μ·a + α
            fused = W[(mu * 3 + B) * A:(mu * 3 + B + 1) * A]
            assert torch.equal(fused, W_B[mu * A:(mu + 1) * A])


@pytest.mark.parametrize("tail", [(D,), ()], ids=["weight", "bias"])
def test_fuse_and_split_are_inverses(tail):
    W_q, W_k, W_v = three(*tail)
    W = layouts.fuse_qkv(W_q, W_k, W_v, n_heads=MU)
    for got, want in zip(layouts.split_qkv(W, n_heads=MU), (W_q, W_k, W_v), strict=True):
        assert torch.equal(got, want)
    W_any = distinct(MU * 3 * A, *tail)
    assert torch.equal(layouts.fuse_qkv(*layouts.split_qkv(W_any, n_heads=MU), n_heads=MU), W_any)


@pytest.mark.parametrize("g", [MU, 1], ids=["heads", "one group"])
def test_values_of_their_own_width_fuse_per_group_and_split_back(g):
    """W[(g e) i], e = (r a | a | b): each group's query rows, its key rows, then its b
    value rows (b = 4 ≠ a = 5)."""
    r, b = MU // g, 4
    W_q, W_k, W_v = distinct(MU * A, D), distinct(g * A, D) + 1000, distinct(g * b, D) + 2000
    W = layouts.fuse_qkv(W_q, W_k, W_v, n_heads=MU, n_kv_heads=g)
    e = (r + 1) * A + b
    assert W.shape == (g * e, D)
    for group in range(g):
        rows = W[group * e:(group + 1) * e]
        assert torch.equal(rows[:r * A], W_q[group * r * A:(group + 1) * r * A])
        assert torch.equal(rows[r * A:(r + 1) * A], W_k[group * A:(group + 1) * A])
        assert torch.equal(rows[(r + 1) * A:], W_v[group * b:(group + 1) * b])
    back = layouts.split_qkv(W, n_heads=MU, n_kv_heads=g, d_value=b)
    for got, want in zip(back, (W_q, W_k, W_v), strict=True):
        assert torch.equal(got, want)


def test_W_O_from_linear_indexes_as_W_O_mu_a_i():
    W_o = distinct(D, MU * A)  # nn.Linear weight (out=i, in=(μ a))
    W_O = layouts.W_O_from_linear(W_o, n_heads=MU)
    assert W_O.shape == (MU, A, D)
    for mu in range(MU):
        for alpha in range(A):
            assert torch.equal(W_O[mu, alpha], W_o[:, mu * A + alpha])


def test_W_O_round_trips():
    W_o = distinct(D, MU * A)
    assert torch.equal(layouts.W_O_to_linear(layouts.W_O_from_linear(W_o, n_heads=MU)), W_o)
    W_O = distinct(MU, A, D)
    assert torch.equal(layouts.W_O_from_linear(layouts.W_O_to_linear(W_O), n_heads=MU), W_O)


@pytest.mark.parametrize("tail", [(D,), ()], ids=["weight", "bias"])
def test_from_bma_reads_all_queries_then_keys_then_values(tail):
    W_q, W_k, W_v = three(*tail)
    stacked = torch.cat([W_q, W_k, W_v])  # nn.MultiheadAttention.in_proj_weight
    W = layouts.from_bma(stacked, n_heads=MU)
    assert torch.equal(W, layouts.fuse_qkv(W_q, W_k, W_v, n_heads=MU))
    for mu in range(MU):
        for B in range(3):
            for alpha in range(A):
                assert torch.equal(W[(mu * 3 + B) * A + alpha], stacked[(B * MU + mu) * A + alpha])
    assert torch.equal(layouts.to_bma(W, n_heads=MU), stacked)


def test_from_bma_and_to_bma_are_inverses():
    W = distinct(MU * 3 * A, D)
    assert torch.equal(layouts.from_bma(layouts.to_bma(W, n_heads=MU), n_heads=MU), W)
    assert torch.equal(layouts.to_bma(layouts.from_bma(W, n_heads=MU), n_heads=MU), W)
    assert not torch.equal(layouts.from_bma(W, n_heads=MU), W)  # it does move rows


def test_rearrangements_keep_gradients_flowing():
    W_q, W_k, W_v = (t.requires_grad_(True) for t in three(D))
    W = layouts.fuse_qkv(W_q, W_k, W_v, n_heads=MU)
    (W * distinct(*W.shape)).sum().backward()
    assert torch.equal(W_k.grad, layouts.split_qkv(distinct(*W.shape), n_heads=MU)[1])


ERRORS = {
    "fuse W_q rows": (lambda: layouts.fuse_qkv(torch.ones(14, D), torch.ones(14, D),
                                               torch.ones(14, D), n_heads=MU),
                      r"W_q has shape \(14, 7\); its first axis \(μ a\) must be a multiple of 3"),
    "fuse W_k 3-D": (lambda: layouts.fuse_qkv(torch.ones(15, D), torch.ones(15, D, 1),
                                              torch.ones(15, D), n_heads=MU),
                     r"W_k has shape \(15, 7, 1\) but W_k\[\(g a\) i\] needs \(15, 7\) "
                     r"with g=3 groups of r=1 query heads"),
    "fuse W_v rows": (lambda: layouts.fuse_qkv(torch.ones(15, D), torch.ones(15, D),
                                               torch.ones(13, D), n_heads=MU),
                      r"W_v has shape \(13, 7\); its first axis \(g b\) must be a multiple "
                      r"of 3"),
    "fuse W_v columns": (lambda: layouts.fuse_qkv(torch.ones(15, D), torch.ones(15, D),
                                                  torch.ones(12, D + 1), n_heads=MU),
                         r"W_v has shape \(12, 8\) but W_v\[\(g b\) i\] needs "
                         r"torch.Size\(\[7\]\) after its rows"),
    "fuse bias vs weight": (lambda: layouts.fuse_qkv(torch.ones(15), torch.ones(15, D),
                                                     torch.ones(15), n_heads=MU),
                            r"W_k has shape \(15, 7\) but W_k\[\(g a\) i\] needs \(15,\)"),
    "split rows": (lambda: layouts.split_qkv(torch.ones(44, D), n_heads=MU),
                   r"W has shape \(44, 7\); its first axis \(μ B a\) must be a multiple of 9"),
    "from_bma rows": (lambda: layouts.from_bma(torch.ones(44, D), n_heads=MU),
                      r"W has shape \(44, 7\); its first axis \(B μ a\) must be a multiple of 9"),
    "to_bma rows": (lambda: layouts.to_bma(torch.ones(44, D), n_heads=MU),
                    r"W has shape \(44, 7\); its first axis \(μ B a\) must be a multiple of 9"),
    "to_bma 3-D": (lambda: layouts.to_bma(torch.ones(45, D, 1), n_heads=MU),
                   r"W has shape \(45, 7, 1\)"),
    "W_O_from_linear columns": (lambda: layouts.W_O_from_linear(torch.ones(D, 14), n_heads=MU),
                                r"W_o has shape \(7, 14\); W_o\[i \(μ a\)\] needs a second axis "
                                r"that is a multiple of μ=3"),
    "W_O_from_linear 3-D": (lambda: layouts.W_O_from_linear(torch.ones(MU, A, D), n_heads=MU),
                            r"W_o has shape \(3, 5, 7\)"),
    "W_O_to_linear 2-D": (lambda: layouts.W_O_to_linear(torch.ones(D, 15)),
                          r"W_O has shape \(7, 15\) but W_O\[μ a i\] is 3-D"),
}


@pytest.mark.parametrize("call, message", ERRORS.values(), ids=ERRORS.keys())
def test_errors(call, message):
    with pytest.raises(EinattnError, match=message):
        call()


W15, W45 = torch.ones(15, D), torch.ones(45, D)
TAKE_N_HEADS = {
    "fuse_qkv": lambda h: layouts.fuse_qkv(W15, W15, W15, n_heads=h),
    "split_qkv": lambda h: layouts.split_qkv(W45, n_heads=h),
    "W_O_from_linear": lambda h: layouts.W_O_from_linear(W15.T, n_heads=h),
    "from_bma": lambda h: layouts.from_bma(W45, n_heads=h),
    "to_bma": lambda h: layouts.to_bma(W45, n_heads=h),
}


@pytest.mark.parametrize("n_heads", [0, -3, 1.5, True])
@pytest.mark.parametrize("call", TAKE_N_HEADS.values(), ids=TAKE_N_HEADS.keys())
def test_n_heads_must_be_a_positive_int(call, n_heads):
    with pytest.raises(EinattnError, match=rf"n_heads \(the size of index 'μ'\) must be a "
                                           rf"positive int, got {n_heads!r}"):
        call(n_heads)


# -- grouped-query layouts and other libraries' layouts ------------------------------------

H, G, R = 6, 2, 3  # query heads, key/value groups, query heads per group: μ = (g r)
N, L = 2, 5


def grouped_by_loops(W_q, W_k, W_v, g):
    """The fused W[(g C a) i] written out: per group, its r query heads, its key, its value."""
    r = W_q.shape[0] // A // g
    blocks = []
    for group in range(g):
        for slot in range(r):
            head = group * r + slot
            blocks.append(W_q[head * A:(head + 1) * A])
        blocks += [W_k[group * A:(group + 1) * A], W_v[group * A:(group + 1) * A]]
    return torch.cat(blocks)


def grouped_three(g, *tail):
    return (distinct(H * A, *tail), distinct(g * A, *tail, offset=1000),
            distinct(g * A, *tail, offset=2000))


def attention(q, k, v, *, causal):
    """Plain softmax attention on (n, heads, L, a), k and v already one per query head."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        future = torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def heads(t, count):  # (n, L, count·a) -> (n, count, L, a)
    return t.view(t.shape[0], t.shape[1], count, -1).transpose(1, 2)


def merged(z):  # (n, heads, L, a) -> (n, L, heads·a)
    return z.transpose(1, 2).reshape(z.shape[0], z.shape[2], -1)


def layer_from(W, b, W_O, b_O, *, n_kv_heads=None, causal=True):
    return MultiHeadAttention.from_fused(W, W_O, b, b_O, n_kv_heads=n_kv_heads, causal=causal)


@pytest.mark.parametrize("tail", [(D,), ()], ids=["weight", "bias"])
@pytest.mark.parametrize("g", [1, 2, 3, 6])
def test_fuse_qkv_grouped_is_per_group_queries_key_value(g, tail):
    W_q, W_k, W_v = grouped_three(g, *tail)
    W = layouts.fuse_qkv(W_q, W_k, W_v, n_heads=H, n_kv_heads=g)
    assert torch.equal(W, grouped_by_loops(W_q, W_k, W_v, g))
    back = layouts.split_qkv(W, n_heads=H, n_kv_heads=g)
    assert all(torch.equal(x, y) for x, y in zip(back, (W_q, W_k, W_v), strict=True))


@pytest.mark.parametrize("tail", [(D,), ()], ids=["weight", "bias"])
@pytest.mark.parametrize("g", [1, 2, 3, 6])
def test_from_bma_grouped_reads_query_key_value_blocks(g, tail):
    W_q, W_k, W_v = grouped_three(g, *tail)
    stacked = torch.cat([W_q, W_k, W_v])  # a fused qkv_proj: all queries, keys, values
    W = layouts.from_bma(stacked, n_heads=H, n_kv_heads=g)
    assert torch.equal(W, grouped_by_loops(W_q, W_k, W_v, g))
    assert torch.equal(layouts.to_bma(W, n_heads=H, n_kv_heads=g), stacked)
    if g == H:  # no grouping: the (B μ a) rearrangement
        assert torch.equal(W, layouts.from_bma(stacked, n_heads=H))


# -- Hugging Face Llama -------------------------------------------------------------------

def hf_llama_attention(x, q_proj, k_proj, v_proj, o_proj, *, n_heads, n_kv_heads):
    """LlamaAttention without RoPE: linear, view, transpose, repeat_kv (expand + reshape)."""
    q = heads(x @ q_proj.T, n_heads)
    k, v = (heads(x @ w.T, n_kv_heads) for w in (k_proj, v_proj))
    n, g, L_k, a = k.shape
    k, v = (t[:, :, None].expand(n, g, n_heads // g, L_k, a).reshape(n, n_heads, L_k, a)
            for t in (k, v))
    return merged(attention(q, k, v, causal=True)) @ o_proj.T


@pytest.mark.parametrize("g", [1, 2, 3, 6])
def test_from_hf_llama_places_every_row(g):
    q, k, v = grouped_three(g, D)
    o = distinct(D, H * A, offset=3000)
    W, W_O = layouts.from_hf_llama(q, k, v, o, n_heads=H, n_kv_heads=g)
    assert torch.equal(W, grouped_by_loops(q, k, v, g))
    for mu in range(H):
        for alpha in range(A):
            assert torch.equal(W_O[mu, alpha], o[:, mu * A + alpha])
    back = layouts.to_hf_llama(W, W_O, n_kv_heads=g)
    assert all(torch.equal(x, y) for x, y in zip(back, (q, k, v, o), strict=True))
    W_any, W_O_any = distinct(*W.shape, offset=7), distinct(H, A, D, offset=9)
    again = layouts.from_hf_llama(*layouts.to_hf_llama(W_any, W_O_any, n_kv_heads=g),
                                  n_heads=H, n_kv_heads=g)
    assert torch.equal(again[0], W_any) and torch.equal(again[1], W_O_any)


@pytest.mark.parametrize("g", [1, 2, 3, 6])
def test_layer_from_hf_llama_computes_llama_attention(g):
    q, k, v = (randn(rows, 24, seed=s) / 5 for s, rows in enumerate((H * A, g * A, g * A)))
    o = randn(24, H * A, seed=4) / 5
    x = randn(N, L, 24, seed=5)
    W, W_O = layouts.from_hf_llama(q, k, v, o, n_heads=H, n_kv_heads=g)
    layer = layer_from(W, None, W_O, None, n_kv_heads=g)
    want = hf_llama_attention(x, q, k, v, o, n_heads=H, n_kv_heads=g)
    assert_close_scaled(layer(x), want, 1e-12)


# -- GPT-2 ----------------------------------------------------------------------------------

def gpt2_attention(x, c_attn_weight, c_attn_bias, c_proj_weight, c_proj_bias, *, n_heads):
    """GPT-2's attention as written there: Conv1D = x @ weight + bias, q, k, v by thirds."""
    qkv = x @ c_attn_weight + c_attn_bias
    q, k, v = (heads(t, n_heads) for t in qkv.split(qkv.shape[-1] // 3, dim=-1))
    return merged(attention(q, k, v, causal=True)) @ c_proj_weight + c_proj_bias


def test_from_gpt2_places_every_entry():
    c_attn_w, c_attn_b = distinct(D, 3 * MU * A), distinct(3 * MU * A, offset=5000)
    c_proj_w, c_proj_b = distinct(MU * A, D, offset=7000), distinct(D, offset=9000)
    W, b, W_O, b_O = layouts.from_gpt2(c_attn_w, c_attn_b, c_proj_w, c_proj_b, n_heads=MU)
    assert W.shape == (MU * 3 * A, D) and W_O.shape == (MU, A, D)
    for mu in range(MU):
        for B in range(3):
            for alpha in range(A):
                row, column = (mu * 3 + B) * A + alpha, (B * MU + mu) * A + alpha
                assert torch.equal(W[row], c_attn_w[:, column])
                assert b[row] == c_attn_b[column]
        for alpha in range(A):
            assert torch.equal(W_O[mu, alpha], c_proj_w[mu * A + alpha])
    assert torch.equal(b_O, c_proj_b)
    back = layouts.to_gpt2(W, b, W_O, b_O)
    assert all(torch.equal(x, y)
               for x, y in zip(back, (c_attn_w, c_attn_b, c_proj_w, c_proj_b), strict=True))
    fused = (distinct(*W.shape, offset=3), distinct(*b.shape), distinct(*W_O.shape, offset=5),
             distinct(D, offset=11))
    again = layouts.from_gpt2(*layouts.to_gpt2(*fused), n_heads=MU)
    assert all(torch.equal(x, y) for x, y in zip(again, fused, strict=True))


def test_from_gpt2_biases_are_both_or_neither():
    w, p, bias = distinct(D, 3 * MU * A), distinct(MU * A, D), distinct(D)
    assert layouts.from_gpt2(w, None, p, None, n_heads=MU)[1::2] == (None, None)
    _, b, _, b_O = layouts.from_gpt2(w, None, p, bias, n_heads=MU)
    assert torch.equal(b, torch.zeros(3 * MU * A, dtype=b.dtype)) and torch.equal(b_O, bias)
    W, W_O = distinct(MU * 3 * A, D), distinct(MU, A, D)
    _, c_attn_b, _, c_proj_b = layouts.to_gpt2(W, distinct(3 * MU * A), W_O, None)
    assert torch.equal(c_proj_b, torch.zeros(D, dtype=c_proj_b.dtype))
    assert torch.equal(c_attn_b, layouts.to_bma(distinct(3 * MU * A), n_heads=MU))
    assert layouts.to_gpt2(W, None, W_O, None)[1::2] == (None, None)


def test_layer_from_gpt2_computes_gpt2_attention():
    d_model, n_heads, d_head = 24, 6, 5  # μ·a = 30 ≠ d_model: no size can stand in for another
    c_attn_w = randn(d_model, 3 * n_heads * d_head, seed=1) / 5
    c_attn_b, c_proj_b = randn(3 * n_heads * d_head, seed=2), randn(d_model, seed=3)
    c_proj_w = randn(n_heads * d_head, d_model, seed=4) / 5
    x = randn(N, L, d_model, seed=5)
    layer = layer_from(*layouts.from_gpt2(c_attn_w, c_attn_b, c_proj_w, c_proj_b,
                                          n_heads=n_heads))
    want = gpt2_attention(x, c_attn_w, c_attn_b, c_proj_w, c_proj_b, n_heads=n_heads)
    assert_close_scaled(layer(x), want, 1e-12)
    # read as (μ B a), GPT-2's columns would mix queries, keys and values across heads
    wrong = layer_from(c_attn_w.T, c_attn_b, c_proj_w.reshape(n_heads, d_head, d_model),
                       c_proj_b)
    assert (wrong(x) - want).abs().max() > 1e-3


# -- TransformerLens ------------------------------------------------------------------------

def transformer_lens_attention(x, W_Q, W_K, W_V, W_O, b_Q, b_K, b_V, b_O):
    """TransformerLens's per-head einsums; grouped K and V repeat-interleaved to the heads."""
    q = torch.einsum("nti,hia->nhta", x, W_Q) + b_Q[:, None]
    k = torch.einsum("nti,gia->ngta", x, W_K) + b_K[:, None]
    v = torch.einsum("nti,gia->ngta", x, W_V) + b_V[:, None]
    r = W_Q.shape[0] // W_K.shape[0]
    z = attention(q, k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1), causal=True)
    return torch.einsum("nhta,hai->nti", z, W_O) + b_O


def transformer_lens_weights(g, seed):
    shapes = {"W_Q": (H, 24, A), "W_K": (g, 24, A), "W_V": (g, 24, A), "W_O": (H, A, 24),
              "b_Q": (H, A), "b_K": (g, A), "b_V": (g, A), "b_O": (24,)}
    return {k: randn(*s, seed=seed + n) / 4 for n, (k, s) in enumerate(shapes.items())}


@pytest.mark.parametrize("g", [1, 2, 3, 6])
def test_from_transformer_lens_places_every_entry(g):
    tl = {"W_Q": distinct(H, D, A), "W_K": distinct(g, D, A, offset=1000),
          "W_V": distinct(g, D, A, offset=2000), "W_O": distinct(H, A, D, offset=3000),
          "b_Q": distinct(H, A, offset=4000), "b_K": distinct(g, A, offset=5000),
          "b_V": distinct(g, A, offset=6000), "b_O": distinct(D, offset=7000)}
    W, b, W_O, b_O = layouts.from_transformer_lens(**tl)
    linear = {k: tl[k].transpose(1, 2).reshape(-1, D) for k in ("W_Q", "W_K", "W_V")}
    assert torch.equal(W, grouped_by_loops(linear["W_Q"], linear["W_K"], linear["W_V"], g))
    flat = {k: tl[k].reshape(-1) for k in ("b_Q", "b_K", "b_V")}
    assert torch.equal(b, grouped_by_loops(flat["b_Q"], flat["b_K"], flat["b_V"], g))
    assert torch.equal(W_O, tl["W_O"]) and torch.equal(b_O, tl["b_O"])
    back = layouts.to_transformer_lens(W, W_O, b, b_O, n_kv_heads=g)
    assert back.keys() == tl.keys()
    assert all(torch.equal(back[k], tl[k]) for k in tl)


def test_transformer_lens_without_biases():
    tl = {"W_Q": distinct(H, D, A), "W_K": distinct(G, D, A), "W_V": distinct(G, D, A),
          "W_O": distinct(H, A, D)}
    W, b, W_O, b_O = layouts.from_transformer_lens(**tl)
    assert b is None and b_O is None
    back = layouts.to_transformer_lens(W, W_O, n_kv_heads=G)
    assert [back[k] for k in ("b_Q", "b_K", "b_V", "b_O")] == [None] * 4
    _, b, _, b_O = layouts.from_transformer_lens(**tl, b_K=distinct(G, A))
    assert torch.equal(b_O, torch.zeros(D, dtype=b_O.dtype)) and b.abs().sum() > 0


@pytest.mark.parametrize("g", [1, 2, 3, 6])
def test_layer_from_transformer_lens_computes_its_attention(g):
    tl = transformer_lens_weights(g, seed=10 * g)
    x = randn(N, L, 24, seed=5)
    layer = layer_from(*layouts.from_transformer_lens(**tl), n_kv_heads=g)
    assert_close_scaled(layer(x), transformer_lens_attention(x, **tl), 1e-12)


# -- tiled and grouped query heads -----------------------------------------------------------

def tiled_attention(x, W_q, W_k, W_v, W_o, *, n_heads, n_kv_heads):
    """x-transformers' grouping: k, v repeated as 'b g n d -> b (r g) n d' (tiled), so
    query head μ reads key/value head μ % g."""
    q = heads(x @ W_q.T, n_heads)
    k, v = (heads(x @ w.T, n_kv_heads).repeat(1, n_heads // n_kv_heads, 1, 1)
            for w in (W_k, W_v))
    return merged(attention(q, k, v, causal=True)) @ W_o.T


@pytest.mark.parametrize("tail", [(D,), ()], ids=["weight", "bias"])
@pytest.mark.parametrize("g", [2, 3])
def test_tiled_to_grouped_moves_query_head_r_g_to_g_r(g, tail):
    r = H // g
    W_q = distinct(H * A, *tail)
    W = layouts.tiled_to_grouped(W_q, n_heads=H, n_kv_heads=g)
    for group in range(g):
        for slot in range(r):
            tiled, grouped = slot * g + group, group * r + slot
            assert torch.equal(W[grouped * A:(grouped + 1) * A], W_q[tiled * A:(tiled + 1) * A])
    assert not torch.equal(W, W_q)
    assert torch.equal(layouts.grouped_to_tiled(W, n_heads=H, n_kv_heads=g), W_q)
    assert torch.equal(layouts.tiled_to_grouped(layouts.grouped_to_tiled(
        W_q, n_heads=H, n_kv_heads=g), n_heads=H, n_kv_heads=g), W_q)


@pytest.mark.parametrize("g", [2, 3])
def test_tiled_to_grouped_o_moves_the_same_heads(g):
    W_o = distinct(D, H * A)
    W = layouts.tiled_to_grouped_o(W_o, n_heads=H, n_kv_heads=g)
    # column block of each head goes where tiled_to_grouped sends its query rows
    assert torch.equal(W.T, layouts.tiled_to_grouped(W_o.T, n_heads=H, n_kv_heads=g))
    assert torch.equal(layouts.grouped_to_tiled_o(W, n_heads=H, n_kv_heads=g), W_o)


@pytest.mark.parametrize("g", [1, 2, 3, 6])
def test_tiled_weights_need_converting_for_grouped_attention(g):
    W_q, W_k, W_v = (randn(rows, 24, seed=s) / 5 for s, rows in enumerate((H * A, g * A, g * A)))
    W_o = randn(24, H * A, seed=4) / 5
    x = randn(N, L, 24, seed=5)
    want = tiled_attention(x, W_q, W_k, W_v, W_o, n_heads=H, n_kv_heads=g)
    options = {"n_heads": H, "n_kv_heads": g, "causal": True}
    as_is = MultiHeadAttention.from_projections(W_q, W_k, W_v, W_o, **options)
    heads_ = {"n_heads": H, "n_kv_heads": g}
    W_q2, W_o2 = layouts.tiled_to_grouped(W_q, **heads_), layouts.tiled_to_grouped_o(W_o, **heads_)
    converted = MultiHeadAttention.from_projections(W_q2, W_k, W_v, W_o2, **options)
    half = MultiHeadAttention.from_projections(W_q2, W_k, W_v, W_o, **options)
    assert_close_scaled(converted(x), want, 1e-12)
    if g in (1, H):  # one group, or one head per group: both orders are the same
        assert torch.equal(W_q2, W_q) and torch.equal(W_o2, W_o)
        assert_close_scaled(as_is(x), want, 1e-12)
    else:
        assert (as_is(x) - want).abs().max() > 1e-3
        assert (half(x) - want).abs().max() > 1e-3  # queries moved, output heads not


q30, kv10, o30 = torch.ones(H * A, D), torch.ones(G * A, D), torch.ones(D, H * A)
gpt_w, gpt_p = torch.ones(D, 3 * MU * A), torch.ones(MU * A, D)
tl = {"W_Q": torch.ones(H, D, A), "W_K": torch.ones(G, D, A), "W_V": torch.ones(G, D, A),
      "W_O": torch.ones(H, A, D)}
W_g, W_O6 = torch.ones(G * (R + 2) * A, D), torch.ones(H, A, D)
CONVERTER_ERRORS = {
    "from_bma grouped rows": (
        lambda: layouts.from_bma(torch.ones(49, D), n_heads=H, n_kv_heads=G),
        r"W has shape \(49, 7\); its first axis \(μ a\) \+ \(g a\) \+ \(g a\) must be a "
        r"multiple of 10"),
    "to_bma grouped rows": (lambda: layouts.to_bma(torch.ones(49, D), n_heads=H, n_kv_heads=G),
                            r"W has shape \(49, 7\); its first axis \(g C a\) must be a "
                            r"multiple of 10"),
    "not a tensor": (lambda: layouts.from_hf_llama([[1.0]], kv10, kv10, o30, n_heads=H),
                     r"q_proj must be a torch.Tensor, got list"),
    "split not a tensor": (lambda: layouts.split_qkv("W", n_heads=H),
                           r"W must be a torch.Tensor, got str"),
    "llama q_proj 1-D": (lambda: layouts.from_hf_llama(torch.ones(30), kv10, kv10, o30,
                                                       n_heads=H, n_kv_heads=G),
                         r"q_proj has shape \(30,\) but q_proj\[\(μ a\) i\] is 2-D"),
    "llama q_proj rows": (lambda: layouts.from_hf_llama(torch.ones(32, D), kv10, kv10, o30,
                                                        n_heads=H, n_kv_heads=G),
                          r"q_proj has shape \(32, 7\); its first axis \(μ a\) must be a "
                          r"multiple of μ=6"),
    "llama k_proj rows": (lambda: layouts.from_hf_llama(q30, torch.ones(15, D), kv10, o30,
                                                        n_heads=H, n_kv_heads=G),
                          r"k_proj has shape \(15, 7\) but k_proj\[\(g a\) i\] needs \(10, 7\) "
                          r"with μ=6, g=2, a=5, i=7 from q_proj"),
    "llama v_proj width": (lambda: layouts.from_hf_llama(q30, kv10, torch.ones(10, 8), o30,
                                                         n_heads=H, n_kv_heads=G),
                           r"v_proj has shape \(10, 8\) but v_proj\[\(g a\) i\] needs \(10, 7\)"),
    "llama o_proj transposed": (lambda: layouts.from_hf_llama(q30, kv10, kv10, o30.T,
                                                              n_heads=H, n_kv_heads=G),
                                r"o_proj has shape \(30, 7\) but o_proj\[i \(μ a\)\] needs "
                                r"\(7, 30\)"),
    "llama groups": (lambda: layouts.from_hf_llama(q30, kv10, kv10, o30, n_heads=H,
                                                   n_kv_heads=4),
                     r"n_heads=6 is not a multiple of n_kv_heads=4"),
    "to_llama W_O 2-D": (lambda: layouts.to_hf_llama(W_g, o30, n_kv_heads=G),
                         r"W_O has shape \(7, 30\) but W_O\[μ a i\] is 3-D"),
    "to_llama W rows": (lambda: layouts.to_hf_llama(W_g, W_O6),
                        r"W has shape \(50, 7\) but W\[\(μ B a\) i\] needs \(90, 7\) with "
                        r"μ=6, a=5, i=7 from W_O, B=3"),
    "to_llama W width": (lambda: layouts.to_hf_llama(torch.ones(50, 8), W_O6, n_kv_heads=G),
                         r"W has shape \(50, 8\) but W\[\(g C a\) i\] needs \(50, 7\) with "
                         r"μ=6, a=5, i=7 from W_O, g=2, C=r\+2=5"),
    "gpt2 weight 3-D": (lambda: layouts.from_gpt2(gpt_w[None], None, gpt_p, None, n_heads=MU),
                        r"c_attn_weight has shape \(1, 7, 45\) but "
                        r"c_attn_weight\[i \(B μ a\)\] is 2-D"),
    "gpt2 weight not transposed": (
        lambda: layouts.from_gpt2(gpt_w.T, None, gpt_p, None, n_heads=MU),
        r"c_attn_weight has shape \(45, 7\); its second axis \(B μ a\) must be a multiple "
        r"of B·μ = 3·3"),
    "gpt2 c_proj_weight": (lambda: layouts.from_gpt2(gpt_w, None, gpt_p.T, None, n_heads=MU),
                           r"c_proj_weight has shape \(7, 15\) but c_proj_weight\[\(μ a\) i\] "
                           r"needs \(15, 7\) with B=3, μ=3, a=5, i=7 from c_attn_weight"),
    "gpt2 c_attn_bias": (lambda: layouts.from_gpt2(gpt_w, torch.ones(15), gpt_p, None,
                                                   n_heads=MU),
                         r"c_attn_bias has shape \(15,\) but c_attn_bias\[\(B μ a\)\] needs "
                         r"\(45,\)"),
    "gpt2 c_proj_bias": (lambda: layouts.from_gpt2(gpt_w, None, gpt_p, torch.ones(D, 1),
                                                   n_heads=MU),
                         r"c_proj_bias has shape \(7, 1\) but c_proj_bias\[i\] needs \(7,\)"),
    "gpt2 n_heads": (lambda: layouts.from_gpt2(gpt_w, None, gpt_p, None, n_heads=0),
                     r"n_heads \(the size of index 'μ'\) must be a positive int, got 0"),
    "to_gpt2 grouped W": (lambda: layouts.to_gpt2(W_g, None, W_O6, None),
                          r"W has shape \(50, 7\) but W\[\(μ B a\) i\] needs \(90, 7\)"),
    "to_gpt2 b": (lambda: layouts.to_gpt2(torch.ones(90, D), torch.ones(50), W_O6, None),
                  r"b has shape \(50,\) but b\[\(μ B a\)\] needs \(90,\)"),
    "to_gpt2 b_O": (lambda: layouts.to_gpt2(torch.ones(90, D), None, W_O6, torch.ones(30)),
                    r"b_O has shape \(30,\) but b_O\[i\] needs \(7,\)"),
    "to_gpt2 W_O": (lambda: layouts.to_gpt2(torch.ones(90, D), None, "W_O", None),
                    r"W_O must be a torch.Tensor, got str"),
    "tl W_Q 2-D": (lambda: layouts.from_transformer_lens(**(tl | {"W_Q": q30})),
                   r"W_Q has shape \(30, 7\) but W_Q\[μ i a\] is 3-D"),
    "tl W_K 2-D": (lambda: layouts.from_transformer_lens(**(tl | {"W_K": kv10})),
                   r"W_K has shape \(10, 7\) but W_K\[g i a\] is 3-D"),
    "tl groups": (lambda: layouts.from_transformer_lens(**(tl | {"W_K": torch.ones(4, D, A)})),
                  r"W_K has g=4 key/value heads, which does not divide the μ=6 query heads "
                  r"of W_Q"),
    "tl W_V": (lambda: layouts.from_transformer_lens(**(tl | {"W_V": torch.ones(G, A, D)})),
               r"W_V has shape \(2, 5, 7\) but W_V\[g i a\] needs \(2, 7, 5\) with μ=6, i=7, "
               r"a=5 from W_Q, g=2 from W_K"),
    "tl W_O transposed": (lambda: layouts.from_transformer_lens(
        **(tl | {"W_O": torch.ones(H, D, A)})),
        r"W_O has shape \(6, 7, 5\) but W_O\[μ a i\] needs \(6, 5, 7\)"),
    "tl W_O missing": (lambda: layouts.from_transformer_lens(**(tl | {"W_O": None})),
                       r"W_O must be a torch.Tensor, got NoneType"),
    "tl b_Q": (lambda: layouts.from_transformer_lens(**tl, b_Q=torch.ones(H * A)),
               r"b_Q has shape \(30,\) but b_Q\[μ a\] needs \(6, 5\)"),
    "tl b_K": (lambda: layouts.from_transformer_lens(**tl, b_K=torch.ones(H, A)),
               r"b_K has shape \(6, 5\) but b_K\[g a\] needs \(2, 5\)"),
    "tl b_O": (lambda: layouts.from_transformer_lens(**tl, b_O=torch.ones(A)),
               r"b_O has shape \(5,\) but b_O\[i\] needs \(7,\)"),
    "to_tl groups": (lambda: layouts.to_transformer_lens(W_g, W_O6, n_kv_heads=4),
                     r"n_heads=6 is not a multiple of n_kv_heads=4"),
    "to_tl b": (lambda: layouts.to_transformer_lens(W_g, W_O6, torch.ones(90), n_kv_heads=G),
                r"b has shape \(90,\) but b\[\(g C a\)\] needs \(50,\)"),
    "tiled rows": (lambda: layouts.tiled_to_grouped(torch.ones(32, D), n_heads=H, n_kv_heads=G),
                   r"W_q has shape \(32, 7\); its first axis \(\(r g\) a\) must be a multiple "
                   r"of 6"),
    "tiled groups": (lambda: layouts.tiled_to_grouped(q30, n_heads=H, n_kv_heads=4),
                     r"n_heads=6 is not a multiple of n_kv_heads=4"),
    "grouped_to_tiled rows": (lambda: layouts.grouped_to_tiled(torch.ones(32), n_heads=H,
                                                               n_kv_heads=G),
                              r"W_q has shape \(32,\); its first axis \(\(g r\) a\) must be a "
                              r"multiple of 6"),
    "tiled_o columns": (lambda: layouts.tiled_to_grouped_o(q30, n_heads=H, n_kv_heads=G),
                        r"W_o has shape \(30, 7\); W_o\[i \(\(r g\) a\)\] needs a second axis "
                        r"that is a multiple of μ=6"),
    "grouped_to_tiled_o 1-D": (lambda: layouts.grouped_to_tiled_o(torch.ones(30), n_heads=H,
                                                                  n_kv_heads=G),
                               r"W_o has shape \(30,\); W_o\[i \(\(g r\) a\)\] needs a second "
                               r"axis"),
    "tiled_o not a tensor": (lambda: layouts.tiled_to_grouped_o(None, n_heads=H, n_kv_heads=G),
                             r"W_o must be a torch.Tensor, got NoneType"),
}


@pytest.mark.parametrize("call, message", CONVERTER_ERRORS.values(), ids=CONVERTER_ERRORS.keys())
def test_converter_errors(call, message):
    with pytest.raises(EinattnError, match=message):
        call()
