"""Binding the pieces of equation (3) to a call (einattn._binding): the keyword shorthands
and the same pieces passed as ``pattern=`` give the same bits on every impl, on the functions
and on the layer (its own pieces and a call's joined); pieces are free of shapes and read
positions, so one piece is right for a call, a cache and the ring's pairs of chunks."""

from __future__ import annotations

import pytest
import torch
from conftest import TOL, assert_close_scaled, randn

from einattn import EinattnError, KVCache, MultiHeadAttention, patterns
from einattn import functional as F

F64 = torch.float64
N, MU, G, A = 2, 6, 3, 5
IMPLS = ["einsum", "sdpa", "chunked"]


def qkv(L_q: int, L_k: int, seed: int = 0):
    return (randn(N, MU, L_q, A, seed=seed, requires_grad=True),
            randn(N, G, L_k, A, seed=seed + 1, requires_grad=True),
            randn(N, G, L_k, A, seed=seed + 2, requires_grad=True))


IDS = torch.tensor([[0] * 4 + [1] * 5 + [2] * 4, [0] * 9 + [1] * 4])
SINKS = randn(MU, seed=7)
SLOPES = randn(MU, seed=8).abs()
CASES = {  # keyword options -> the same pieces as pattern=
    "causal": (dict(causal=True), lambda: patterns.Causal()),
    "window": (dict(window=3), lambda: patterns.Window(3)),
    "causal window": (dict(causal=True, window=3),
                      lambda: patterns.Causal() & patterns.Window(3)),
    "documents softcap alibi sinks": (
        dict(causal=True, document_ids=IDS, softcap=1.5, alibi=True, sinks=SINKS),
        lambda: [patterns.Sinks(SINKS), patterns.ALiBi(), patterns.Softcap(1.5),
                 patterns.Documents(IDS), patterns.Causal()]),
    "slopes window": (dict(window=4, alibi=SLOPES),
                      lambda: [patterns.ALiBi(SLOPES), patterns.Window(4)]),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", list(CASES))
def test_keywords_and_pieces_give_the_same_bits(case, impl):
    """Forward and every gradient, bit for bit: the keywords build these pieces (score
    terms in the order of (3) whatever order they are given in)."""
    keywords, pieces = CASES[case]
    Q, K, V = qkv(13, 13)
    by_keyword = F.attention(Q, K, V, impl=impl, block_size=4, **keywords)
    by_piece = F.attention(Q, K, V, impl=impl, block_size=4, pattern=pieces())
    assert torch.equal(by_keyword, by_piece)
    dZ = randn(*by_piece.shape, seed=9)
    for a, b in zip(torch.autograd.grad(by_keyword, (Q, K, V), dZ),
                    torch.autograd.grad(by_piece, (Q, K, V), dZ), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("impl", IMPLS)
def test_keywords_and_pieces_join(impl):
    """``causal=`` and a window given as a piece are the causal window."""
    Q, K, V = qkv(11, 11)
    assert torch.equal(F.attention(Q, K, V, impl=impl, causal=True, pattern=patterns.Window(3)),
                       F.attention(Q, K, V, impl=impl, causal=True, window=3))


def test_a_window_alone_is_two_sided_and_with_causal_one_sided():
    """``Window(w)``: |τ' − σ| < w; ``Causal() & Window(w)``: τ' − w < σ ≤ τ'."""
    def seen(pattern):
        bound = patterns.build(n=1, n_heads=1, L_q=6, L_k=6, dtype=F64, device="cpu",
                               pattern=pattern)
        return bound.allowed(patterns.grid(1, 1, 6, 6, "cpu"))[0, 0]
    tau, sigma = torch.arange(6)[:, None], torch.arange(6)
    assert torch.equal(seen(patterns.Window(2)), (tau - sigma).abs() < 2)
    assert torch.equal(seen(patterns.Causal() & patterns.Window(2)),
                       (sigma <= tau) & (tau - sigma < 2))


def test_pieces_read_positions_bound_by_the_call():
    """3 queries over 5 keys sit at positions 2, 3, 4: the causal piece, bound once, is
    the bottom-right mask; the ring's pair binds the same piece at other positions."""
    whole = patterns.build(n=1, n_heads=1, L_q=3, L_k=5, dtype=F64, device="cpu",
                           pattern=patterns.Causal())
    at = patterns.grid(1, 1, 3, 5, "cpu")
    assert whole.frame.q0 == 2 and torch.equal(whole.allowed(at)[0, 0],
                                               torch.ones(3, 5, dtype=torch.bool).tril(2))
    pair = whole.at(8, 3, 4, 5)  # queries 8..10 over keys 4..8: every key seen, no piece
    assert pair.masks == () and pair.sees_any()
    later = whole.at(0, 3, 4, 5)  # queries 0..2 over keys 4..8: none seen
    assert not later.sees_any()


def test_one_causal_query_over_its_keys_binds_no_piece():
    """A decoding step: one query aligned bottom-right sees every key."""
    bound = patterns.build(n=1, n_heads=1, L_q=1, L_k=9, dtype=F64, device="cpu", causal=True)
    assert bound.masks == ()


def random_layer(**options) -> MultiHeadAttention:
    torch.manual_seed(0)
    layer = MultiHeadAttention(12, MU, d_head=A, n_kv_heads=G, bias=True, dtype=F64, **options)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()
    return layer


@pytest.mark.parametrize("impl", IMPLS)
def test_the_layer_takes_pieces_of_its_own_and_per_call(impl):
    """The layer's ``pattern=`` equals its keywords; a call's pieces join the layer's."""
    by_keyword = random_layer(causal=True, window=3, softcap=2.0, impl=impl, block_size=4)
    by_piece = random_layer(pattern=[patterns.Causal() & patterns.Window(3),
                                     patterns.Softcap(2.0)], impl=impl, block_size=4)
    x = randn(N, 13, 12, seed=3)
    assert torch.equal(by_keyword(x), by_piece(x))
    assert torch.equal(by_keyword(x, document_ids=IDS),
                       by_piece(x, pattern=patterns.Documents(IDS)))
    assert "pattern=(AllOf(parts=(Causal(), Window(w=3))), Softcap(c=2.0))" in repr(by_piece)


def test_a_cache_binds_the_same_pieces_at_its_positions():
    """Prefill then one-token steps with a window given as a piece equal one forward."""
    layer = random_layer(pattern=patterns.Causal() & patterns.Window(3), impl="chunked",
                         block_size=4)
    x = randn(N, 9, 12, seed=4)
    cache = KVCache()
    steps = [layer(x[:, :5], cache=cache)] + [layer(x[:, t:t + 1], cache=cache)
                                              for t in range(5, 9)]
    assert_close_scaled(torch.cat(steps, dim=1), layer(x), TOL[F64])


def test_pattern_takes_pieces_only():
    Q, K, V = qkv(4, 4)
    with pytest.raises(EinattnError, match=r"pattern takes pieces of einattn.patterns "
                                           r"\(Causal\(\), Window\(w\).*got function"):
        F.attention(Q, K, V, pattern=lambda b, h, q, kv: q >= kv)
