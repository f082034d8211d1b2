"""einattn.StaticKVCache: one shape for every decoding step, so that a compiled step is
compiled once; checked against the layer's forward over the whole sequence (causal, and
every piece defined by positions), in float64, eager and compiled, on every impl with
grouped-query attention and RoPE."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from einattn import EinattnError, MultiHeadAttention, StaticKVCache, patterns
from tests.conftest import TOL, assert_close_scaled, here, randn

F64 = torch.float64
N, L, D, H, G = 2, 9, 12, 6, 2  # a prompt of 3, then 6 one-token steps; max_length 11


def decoder(impl: str, causal: bool = True) -> MultiHeadAttention:
    torch.manual_seed(0)
    return MultiHeadAttention(D, H, d_head=4, n_kv_heads=G, rope="half", causal=causal,
                              impl=impl, dtype=F64, block_size=3).eval()


def decode(step, x, cache, padding=None):
    """A prompt of 3 tokens, then one token a call."""
    cuts = [(0, 3)] + [(t, t + 1) for t in range(3, x.shape[1])]
    with torch.no_grad():
        return torch.cat([step(x[:, a:b], cache=cache, key_padding_mask=None if padding is None
                               else padding[:, a:b]) for a, b in cuts], dim=1)


@pytest.mark.parametrize("impl", ["einsum", "sdpa", "chunked"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_decoding_equals_one_causal_forward_and_compiles_once_per_shape(impl, compiled):
    """Compiled with dynamic=False: one graph for the prompt, one for every later step."""
    layer, x = decoder(impl), randn(N, L, D, seed=1)
    counter = CompileCounter()
    step = torch.compile(layer, backend=counter, fullgraph=True, dynamic=False) \
        if compiled else layer
    cache = StaticKVCache(max_length=11)
    assert_close_scaled(decode(step, x, cache), layer(x), TOL[F64])
    assert len(cache) == L and cache.K.shape == (N, G, 11, 4)
    assert counter.frame_count == (2 if compiled else 0)


RELATIVE = randn(H, 21, seed=14)  # a relative-position bias b[μ, τ − σ + 10]
PIECES = {  # the layer's options: every piece defined by positions alone
    "window": dict(causal=True, window=3),
    "softcap": dict(causal=True, softcap=2.0),
    "alibi": dict(causal=True, alibi=True),
    "sinks": dict(causal=True, sinks=True),
    "Mask": dict(pattern=patterns.Mask("σ ≤ τ ∧ τ − σ < w", w=4)),
    "MaskMod": dict(pattern=patterns.MaskMod(lambda b, h, q, kv: (kv <= q) & ((q - kv) % 3
                                                                            != 1))),
    "ScoreMod": dict(causal=True, pattern=patterns.ScoreMod(
        lambda s, b, h, q, kv: s + RELATIVE[h, q - kv + 10])),
    "PrefixLM": dict(pattern=patterns.PrefixLM(3)),  # the prompt's 3 tokens see each other
    "ChunkedLocal": dict(pattern=patterns.ChunkedLocal(3)),
}


IMPLS = ["einsum", "sdpa", "chunked"]
# Eager: every piece on every impl. Compiled (about a second a case): each piece on one impl,
# in turn, so that every impl compiles three or four of them.
DECODED = [(False, piece, impl) for piece in PIECES for impl in IMPLS] + \
    [(True, piece, IMPLS[k % len(IMPLS)]) for k, piece in enumerate(PIECES)]


@pytest.mark.parametrize("compiled, piece, impl", DECODED,
                         ids=[f"{'compiled' if c else 'eager'}-{p}-{i}" for c, p, i in DECODED])
def test_every_piece_of_positions_decodes_as_one_forward(compiled, piece, impl):
    """The pieces read the cache's positions f + τ, f a 0-d tensor: decoding equals the
    layer's forward over the whole sequence, and compiled it is still one graph for the
    prompt and one for every later step (old code: "a StaticKVCache takes causal and
    key_padding_mask; ... needs KVCache")."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = MultiHeadAttention(D, H, d_head=4, n_kv_heads=G, rope="half", impl=impl,
                               dtype=F64, block_size=3, **PIECES[piece]).eval()
    x, counter = randn(N, L, D, seed=1), CompileCounter()
    step = torch.compile(layer, backend=counter, fullgraph=True, dynamic=False) \
        if compiled else layer
    with torch.no_grad():
        assert_close_scaled(decode(step, x, StaticKVCache(max_length=11)), layer(x), TOL[F64])
    assert counter.frame_count == (2 if compiled else 0)
    torch._dynamo.reset()


@pytest.mark.parametrize("causal", [True, False])
def test_key_padding_over_calls_and_reset(causal):
    """Padding marked call by call equals the whole sequence's key_padding_mask; after
    reset() the same storage decodes another sequence."""
    layer, x = decoder("sdpa", causal), randn(N, L, D, seed=2)
    padding = torch.zeros(N, L, dtype=torch.bool)
    padding[0, 1], padding[1, 4:6] = True, True
    cache = StaticKVCache(max_length=L)
    full = layer(x, key_padding_mask=padding)
    if causal:
        assert_close_scaled(decode(layer, x, cache, padding), full, TOL[F64])
    else:  # without causal each call sees the keys so far; its last row sees them all
        decode(layer, x[:, :-1], cache, padding[:, :-1])
        with torch.no_grad():
            last = layer(x[:, -1:], cache=cache, key_padding_mask=padding[:, -1:])
        assert_close_scaled(last, full[:, -1:], TOL[F64])
    storage = cache.K.untyped_storage().data_ptr()
    cache.reset()
    y = randn(N, L, D, seed=3)
    assert_close_scaled(decode(layer, y, cache), decoder("sdpa", causal)(y) if causal else
                        decode(layer, y, StaticKVCache(max_length=L)), TOL[F64])
    assert cache.K.untyped_storage().data_ptr() == storage


def test_a_failed_call_leaves_the_count_filled():
    layer, x = decoder("einsum"), randn(N, L, D, seed=4)
    cache = StaticKVCache(max_length=L)
    decode(layer, x[:, :5], cache)
    with pytest.raises(EinattnError, match=r"key_padding_mask marks this call's new keys: a "
                                           r"bool \(n, σ\) = \(2, 1\) tensor"):
        layer(x[:, 5:6], cache=cache, key_padding_mask=torch.zeros(N, 4, dtype=torch.bool))
    assert len(cache) == 5
    with torch.no_grad():
        rest = torch.cat([layer(x[:, t:t + 1], cache=cache) for t in range(5, L)], dim=1)
    assert_close_scaled(rest, layer(x)[:, 5:], TOL[F64])


ERRORS = {
    "max_length": (lambda: StaticKVCache(max_length=0),
                   r"max_length \(the positions σ a StaticKVCache holds\) must be a positive "
                   r"int, got 0"),
    "too long a call": (lambda: decoder("einsum")(randn(N, 5, D, seed=5),
                                                  cache=StaticKVCache(max_length=4)),
                        r"a call of 5 positions does not fit a StaticKVCache of max_length=4"),
    "full": (lambda: [decoder("einsum")(randn(N, 3, D, seed=6), cache=c)
                      for c in [StaticKVCache(max_length=5)] for _ in range(2)],
             r"the cache holds at most max_length=5 positions, but 3 filled and 3 new make 6"),
    "positions": (lambda: decoder("einsum")(randn(N, 3, D, seed=7), cache=StaticKVCache(8),
                                            positions=torch.arange(3)),
                  r"a StaticKVCache places the tokens at the positions it has filled; drop "
                  r"positions="),
    "mask": (lambda: decoder("einsum")(randn(N, 3, D, seed=8), cache=StaticKVCache(8),
                                       mask=torch.ones(3, 3, dtype=torch.bool)),
             r"a StaticKVCache takes key_padding_mask and the pieces of a pattern \(read at "
             r"the positions it has filled\); a mask needs KVCache"),
    "documents": (lambda: decoder("einsum")(randn(N, 3, D, seed=10), cache=StaticKVCache(8),
                                            document_ids=torch.zeros(N, 3, dtype=torch.long)),
                  r"a StaticKVCache keeps no document_ids; use KVCache"),
    "another batch": (lambda: [decoder("einsum")(randn(n, 2, D, seed=11), cache=c)
                               for c in [StaticKVCache(8)] for n in (N, N + 1)],
                      rf"the new keys are \(3, 2, 2, 4\) torch.float64 on {here()} but the cache "
                      r"holds K\[n g σ a\] of \(2, 2, 8, 4\).*make another StaticKVCache"),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_bad_input_raises_einattn_error(name):
    call, match = ERRORS[name]
    with pytest.raises(EinattnError, match=match):
        call()


def test_a_compiled_step_past_max_length_gives_nan_and_the_next_eager_call_says_so():
    """A compiled step cannot refuse a call past max_length without reading f back from the
    device: it used to fail in index_copy_ (an IndexError here; on CUDA a device-side
    assert, which ends the process's CUDA context). It writes at the last position now,
    its values NaN, so its outputs are NaN; the next eager call refuses; reset() clears it."""
    torch._dynamo.reset()  # a fresh count of compilations of the layer's forward
    layer, x = decoder("einsum"), randn(N, L, D, seed=12)
    step = torch.compile(layer, backend="aot_eager", fullgraph=True, dynamic=False)
    cache = StaticKVCache(max_length=4)
    with torch.no_grad():
        decode(step, x[:, :4], cache)  # full
        past = step(x[:, 4:5], cache=cache)
    assert torch.isnan(past).all() and len(cache) == 5
    with pytest.raises(EinattnError, match=r"a compiled call went past max_length=4 \(5 "
                                           r"positions counted\): its values were written as "
                                           r"NaN at the last position.*call cache.reset\(\)"):
        layer(x[:, 5:6], cache=cache)
    cache.reset()
    assert_close_scaled(decode(step, x[:, :4], cache), layer(x[:, :4]), TOL[F64])
    torch._dynamo.reset()


@pytest.mark.parametrize("fullgraph", [False, True])
def test_a_refusal_known_when_tracing_names_what_is_refused(fullgraph):
    """Under torch.compile the refusals that need no count (a call longer than max_length,
    a mask, positions, ...) raise while Dynamo traces: without fullgraph Dynamo runs the
    call eagerly and the EinattnError itself comes out; with fullgraph=True Dynamo wraps it
    (torch._dynamo.exc.Unsupported, "Observed exception") with einattn's message inside.
    Either way the cache is untouched (docs/variants.md says so)."""
    torch._dynamo.reset()  # Dynamo runs a frame that raised without fullgraph eagerly after
    step = torch.compile(decoder("einsum"), backend="aot_eager", fullgraph=fullgraph,
                         dynamic=False)
    cache = StaticKVCache(max_length=4)
    raised = torch._dynamo.exc.Unsupported if fullgraph else EinattnError
    with pytest.raises(raised, match=r"a call of 5 positions does not fit a StaticKVCache of "
                                     r"max_length=4"):
        step(randn(N, 5, D, seed=13), cache=cache)
    assert len(cache) == 0 and cache.K is None
    torch._dynamo.reset()
