"""Grouped-query and multi-query attention: einattn.MultiHeadAttention with n_kv_heads = g
against two independent references on the same weights, over every path and option.

References, both written on hand-projected q, k, v (F.linear, view, transpose):

* sdpa: ``F.scaled_dot_product_attention(..., enable_gqa=True)`` on k, v with g heads;
* repeat: k and v repeat-interleaved to the n_heads query heads (query head μ reads
  group μ // r), then matmul, softmax, matmul.

Forward outputs and the gradients of every parameter and input agree in float64 to 1e-12
relative to scale on every path (measured worst over all sixteen option combinations:
below 5e-15 on each of einsum, sdpa and chunked; the chunked path, over key blocks of 3,
needs no looser tolerance at these sizes).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close_scaled, randn

from einattn import EinattnError, MultiHeadAttention

N, L, L_K, D, H, A = 2, 5, 7, 24, 6, 5  # batch, query length, context length, d_model, heads, a
KV_HEADS = {"MQA g=1": 1, "g=2": 2, "g=3": 3, "g=n_heads": H}
TOL = 1e-12


def weights(g: int, bias: bool, seed: int) -> dict[str, torch.Tensor]:
    """Reshape-layout weights: W_q ((μ a), i), W_k and W_v ((g a), i), W_o (i, (μ a))."""
    shapes = {"W_q": (H * A, D), "W_k": (g * A, D), "W_v": (g * A, D), "W_o": (D, H * A)}
    if bias:
        shapes |= {"b_q": (H * A,), "b_k": (g * A,), "b_v": (g * A,), "b_o": (D,)}
    return {name: (randn(*shape, seed=seed + k) / math.sqrt(shape[-1] if len(shape) == 2 else 4))
            .requires_grad_(True) for k, (name, shape) in enumerate(shapes.items())}


def allowed(causal: bool, key_padding_mask: torch.Tensor | None, L_q: int, L_k: int):
    """True where query τ may attend to key σ: (n, 1, τ, σ)."""
    ok = torch.ones(N, 1, L_q, L_k, dtype=torch.bool)
    if causal:  # aligned bottom-right: the last query sees every key
        ok = ok & torch.ones(L_q, L_k, dtype=torch.bool).tril(diagonal=L_k - L_q)
    if key_padding_mask is not None:
        ok = ok & ~key_padding_mask[:, None, None, :]
    return ok


def project(p: dict, x: torch.Tensor, context: torch.Tensor, g: int):
    """q (n, μ, τ, a) from x; k, v (n, g, σ, a) from the context."""
    def heads(t, count):
        return t.view(t.shape[0], t.shape[1], count, A).transpose(1, 2)
    q = heads(F.linear(x, p["W_q"], p.get("b_q")), H)
    k = heads(F.linear(context, p["W_k"], p.get("b_k")), g)
    v = heads(F.linear(context, p["W_v"], p.get("b_v")), g)
    return q, k, v


def merge(z: torch.Tensor, p: dict) -> torch.Tensor:
    n, _, L_q, _ = z.shape
    return F.linear(z.transpose(1, 2).reshape(n, L_q, H * A), p["W_o"], p.get("b_o"))


def sdpa_reference(p, x, context, g, ok):
    q, k, v = project(p, x, context, g)
    return merge(F.scaled_dot_product_attention(q, k, v, attn_mask=ok, enable_gqa=True), p)


def repeat_reference(p, x, context, g, ok):
    q, k, v = project(p, x, context, g)
    k, v = (t.repeat_interleave(H // g, dim=1) for t in (k, v))
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(A)
    return merge(torch.softmax(scores.masked_fill(~ok, float("-inf")), dim=-1) @ v, p)


REFERENCES = {"sdpa enable_gqa": sdpa_reference, "repeat_interleave": repeat_reference}


def layer_gradients(layer: MultiHeadAttention, g: int) -> dict[str, torch.Tensor]:
    """The layer's parameter gradients in reshape layout, split by plain reshapes:
    W is (g, C = r + 2, a, i) with the r query heads of a group before its key and value."""
    r = H // g
    Wg = layer.W.grad.view(g, r + 2, A, D)
    grads = {"W_q": Wg[:, :r].reshape(H * A, D), "W_k": Wg[:, r].reshape(g * A, D),
             "W_v": Wg[:, r + 1].reshape(g * A, D), "W_o": layer.W_O.grad.reshape(H * A, D).T}
    if layer.b is not None:
        bg = layer.b.grad.view(g, r + 2, A)
        grads |= {"b_q": bg[:, :r].reshape(H * A), "b_k": bg[:, r].reshape(g * A),
                  "b_v": bg[:, r + 1].reshape(g * A), "b_o": layer.b_O.grad}
    return grads


# (cross, causal, key padding, bias): each option on and off for every path and every g,
# in six rows rather than all sixteen (all sixteen pass too; they cost seconds).
SCENARIOS = {
    "self": (False, False, False, False),
    "self causal bias": (False, True, False, True),
    "self causal key_padding": (False, True, True, False),
    "cross bias": (True, False, False, True),
    "cross causal": (True, True, False, False),
    "cross causal key_padding bias": (True, True, True, True),
}


@pytest.mark.parametrize("g", KV_HEADS.values(), ids=KV_HEADS.keys())
@pytest.mark.parametrize("impl", ["einsum", "sdpa", "chunked"])
@pytest.mark.parametrize("cross, causal, padding, bias", SCENARIOS.values(), ids=SCENARIOS.keys())
def test_grouped_attention_matches_references(g, impl, cross, causal, padding, bias):
    p = weights(g, bias, seed=10 * g + bias)
    layer = MultiHeadAttention.from_projections(
        *(p[k].detach() for k in ("W_q", "W_k", "W_v", "W_o")), n_heads=H, n_kv_heads=g,
        impl=impl, block_size=3,  # chunked: several key blocks, the last one partial
        **{k: p[k].detach() for k in ("b_q", "b_k", "b_v", "b_o") if k in p})
    assert layer.n_kv_heads == g
    x = randn(N, L, D, seed=1, requires_grad=True)
    c = randn(N, L_K, D, seed=2, requires_grad=True) if cross else None
    context = x if c is None else c
    kpm = None
    if padding:  # sample 1 pads its last two keys; no query row is left with no key
        kpm = torch.zeros(N, context.shape[1], dtype=torch.bool)
        kpm[1, -2:] = True
    cotangent = randn(N, L, D, seed=3)

    Y = layer(x, c, key_padding_mask=kpm, causal=causal)
    (Y * cotangent).sum().backward()
    got = {"x": x.grad, **({"context": c.grad} if cross else {}), **layer_gradients(layer, g)}

    ok = allowed(causal, kpm, L, context.shape[1])
    for reference in REFERENCES.values():
        for t in (x, c, *p.values()):
            if t is not None:
                t.grad = None
        Y_ref = reference(p, x, context, g, ok)
        (Y_ref * cotangent).sum().backward()
        want = {"x": x.grad, **({"context": c.grad} if cross else {}),
                **{k: v.grad for k, v in p.items()}}
        assert_close_scaled(Y, Y_ref.detach(), TOL)
        assert got.keys() == want.keys()
        for name in want:
            assert_close_scaled(got[name], want[name], TOL)


def test_the_references_tell_grouped_from_tiled_heads():
    """The parity table could not pass with the kv heads assigned μ % g instead of μ // r."""
    g = 2
    p = weights(g, False, seed=7)
    x = randn(N, L, D, seed=1)
    ok = allowed(False, None, L, L)
    q, k, v = project(p, x, x, g)
    tiled = merge(torch.softmax(q @ k.repeat(1, H // g, 1, 1).transpose(-2, -1) / math.sqrt(A),
                                dim=-1) @ v.repeat(1, H // g, 1, 1), p)
    layer = MultiHeadAttention.from_projections(
        *(p[k].detach() for k in ("W_q", "W_k", "W_v", "W_o")), n_heads=H, n_kv_heads=g)
    assert (layer(x) - tiled).abs().max() > 1e-3
    assert_close_scaled(repeat_reference(p, x, x, g, ok), sdpa_reference(p, x, x, g, ok), TOL)


@pytest.mark.parametrize("g", KV_HEADS.values(), ids=KV_HEADS.keys())
def test_projections_have_g_key_value_heads_and_round_trip(g):
    p = {k: v.detach() for k, v in weights(g, True, seed=3).items()}
    layer = MultiHeadAttention.from_projections(
        p["W_q"], p["W_k"], p["W_v"], p["W_o"], n_heads=H, n_kv_heads=g,
        b_q=p["b_q"], b_k=p["b_k"], b_v=p["b_v"], b_o=p["b_o"])
    assert layer.W.shape == (g * (H // g + 2) * A, D)
    back = layer.projections()
    assert back.W_q.shape == (H * A, D)
    assert back.W_k.shape == back.W_v.shape == (g * A, D)
    assert back.b_k.shape == back.b_v.shape == (g * A,)
    for name, t in p.items():
        assert torch.equal(getattr(back, name), t), name


def test_n_kv_heads_is_inferred_from_W_k():
    p = {k: v.detach() for k, v in weights(3, False, seed=4).items()}
    layer = MultiHeadAttention.from_projections(p["W_q"], p["W_k"], p["W_v"], p["W_o"],
                                                n_heads=H)
    assert layer.n_kv_heads == 3


def test_multi_query_attention_shares_one_key_among_all_heads():
    """With g = 1 every head's scores use the same keys: changing one head's query rows
    changes that head's scores only."""
    p = {k: v.detach() for k, v in weights(1, False, seed=5).items()}
    layer = MultiHeadAttention.from_projections(p["W_q"], p["W_k"], p["W_v"], p["W_o"],
                                                n_heads=H, n_kv_heads=1)
    x = randn(N, L, D, seed=1)
    _, before = layer(x, return_intermediates=True)
    assert before["K"].shape == (N, 1, L, A)
    with torch.no_grad():
        layer.W[2 * A:3 * A] += 1.0  # query rows of head 2 (slots: 6 query heads, K, V)
    _, after = layer(x, return_intermediates=True)
    changed = (after["S"] - before["S"]).abs().amax(dim=(0, 2, 3)) > 0
    assert changed.tolist() == [h == 2 for h in range(H)]


W_q, W_kv, W_o = torch.ones(H * A, D), torch.ones(4 * A, D), torch.ones(D, H * A)
ERRORS = {
    "layer n_kv_heads does not divide": (
        lambda: MultiHeadAttention(D, H, d_head=A, n_kv_heads=4),
        r"n_heads=6 is not a multiple of n_kv_heads=4: query head μ = \(g r\)"),
    "from_projections n_kv_heads does not divide": (
        lambda: MultiHeadAttention.from_projections(W_q, W_kv, W_kv, W_o, n_heads=H,
                                                    n_kv_heads=4),
        r"n_heads=6 is not a multiple of n_kv_heads=4"),
    "from_projections inferred from W_k does not divide": (
        lambda: MultiHeadAttention.from_projections(W_q, W_kv, W_kv, W_o, n_heads=H),
        r"n_heads=6 is not a multiple of n_kv_heads=4"),
    "from_projections W_v rows for g": (
        lambda: MultiHeadAttention.from_projections(W_q, W_kv[:2 * A], W_kv[:3 * A], W_o,
                                                    n_heads=H, n_kv_heads=2),
        r"W_v has shape \(15, 24\) but W_v\[\(g b\) j\] needs \(10, 24\)"),
    "n_kv_heads zero": (lambda: MultiHeadAttention(D, H, d_head=A, n_kv_heads=0),
                        r"n_kv_heads \(the size of index 'g'\) must be a positive int, got 0"),
}


@pytest.mark.parametrize("call, message", ERRORS.values(), ids=ERRORS.keys())
def test_errors(call, message):
    with pytest.raises(EinattnError, match=message):
        call()
