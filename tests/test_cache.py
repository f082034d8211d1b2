"""``KVCache``: a prefill followed by token-by-token steps, or a prefill in chunks, equals
one causal forward over the whole sequence, for every rope setting, grouping and impl."""

from __future__ import annotations

import pytest
import torch

from einattn import EinattnError, KVCache, MultiHeadAttention, masks
from tests.conftest import TOL, assert_close_scaled, here, randn

F64 = torch.float64
N, L, D, H = 2, 11, 24, 6


def _layer(rope, g, impl, **options) -> MultiHeadAttention:
    torch.manual_seed(7)
    return MultiHeadAttention(D, H, d_head=4, n_kv_heads=g, rope=rope, bias=True, impl=impl,
                              causal=True, dtype=F64, **options)


def _decode(layer, x, splits, **call):
    """Run ``x`` through ``layer`` in pieces cut at ``splits``, with one cache."""
    cache, outputs, start = KVCache(), [], 0
    for stop in [*splits, x.shape[1]]:
        outputs.append(layer(x[:, start:stop], cache=cache, **call))
        start = stop
    assert len(cache) == x.shape[1]
    return torch.cat(outputs, dim=1)


CASES = [(rope, g, impl) for rope in (None, "half", "interleaved") for g in (None, 2, 1)
         for impl in ("einsum", "sdpa", "chunked")]


@pytest.mark.parametrize("rope, g, impl", CASES)
@pytest.mark.parametrize("prefill", [1, 4])
def test_prefill_then_token_steps_equal_one_causal_forward(rope, g, impl, prefill):
    layer = _layer(rope, g, impl)
    x = randn(N, L, D, seed=prefill)
    steps = list(range(prefill, L))
    assert_close_scaled(_decode(layer, x, steps), layer(x), TOL[F64])


@pytest.mark.parametrize("rope, g, impl", CASES)
def test_chunked_prefill_equals_one_causal_forward(rope, g, impl):
    layer = _layer(rope, g, impl)
    x = randn(N, L, D, seed=2)
    assert_close_scaled(_decode(layer, x, [3, 8]), layer(x), TOL[F64])


@pytest.mark.parametrize("impl", ["einsum", "sdpa", "chunked"])
def test_a_one_token_step_sees_every_cached_key(impl, monkeypatch):
    """Causal masking aligned bottom-right hides nothing from a single query, so a decoding
    step builds no mask at all and equals the unmasked call exactly."""
    layer = _layer("half", 2, impl)
    x = randn(N, 6, D, seed=9)
    steps = []
    for causal in (True, False):
        cache = KVCache()
        layer(x[:, :5], cache=cache)
        with monkeypatch.context() as patch:
            patch.setattr(masks, "causal_mask", _no_mask_expected)
            steps.append(layer(x[:, 5:], cache=cache, causal=causal))
    assert torch.equal(*steps)


def _no_mask_expected(*args, **kwargs):
    raise AssertionError("a one-query step built a causal mask")


def test_gradients_flow_through_the_cache_as_through_one_forward():
    layer = _layer("half", 2, "einsum")
    x = randn(N, L, D, seed=3)
    dy = randn(N, L, D, seed=4)
    (_decode(layer, x, [5, 6]) * dy).sum().backward()
    pieces = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    (layer(x) * dy).sum().backward()
    for got, p in zip(pieces, layer.parameters(), strict=True):
        assert_close_scaled(got, p.grad, TOL[F64])


def test_key_padding_accumulates_in_the_cache():
    """Each call's key_padding_mask marks its new keys; the cache keeps them all."""
    layer = _layer("half", 3, "einsum")
    x = randn(N, L, D, seed=5)
    padding = torch.zeros(N, L, dtype=torch.bool)
    padding[0, 1] = padding[1, 5] = padding[1, 9] = True
    want = layer(x, key_padding_mask=padding)
    cache, got = KVCache(), []
    for start, stop in ((0, 4), (4, 6), (6, 11)):
        got.append(layer(x[:, start:stop], cache=cache,
                         key_padding_mask=padding[:, start:stop]))
    assert_close_scaled(torch.cat(got, dim=1), want, TOL[F64])
    assert torch.equal(cache.padding, padding)


def test_a_call_without_padding_after_one_with_pads_nothing():
    layer = _layer(None, None, "sdpa")
    x = randn(N, 6, D, seed=6)
    padding = torch.tensor([[False, True, False], [False, False, False]])
    cache = KVCache()
    layer(x[:, :3], cache=cache, key_padding_mask=padding)
    layer(x[:, 3:], cache=cache)
    assert torch.equal(cache.padding, torch.cat([padding, torch.zeros(N, 3, dtype=torch.bool)], 1))


def test_weights_with_a_cache_cover_every_cached_key():
    layer = _layer("interleaved", 2, "einsum")
    x = randn(N, L, D, seed=7)
    cache = KVCache()
    layer(x[:, :8], cache=cache)
    _, A = layer(x[:, 8:], cache=cache, need_weights=True)
    _, A_full = layer(x, need_weights=True)
    assert A.shape == (N, H, 3, L)
    assert_close_scaled(A, A_full[:, :, 8:], TOL[F64])


def test_positions_continue_from_the_cache_length_unless_given():
    """Left-padded prompts start at different positions; given positions are used as is."""
    layer = _layer("half", None, "einsum")
    x = randn(N, L, D, seed=8)
    positions = torch.stack([torch.arange(L), torch.arange(L) + 3])
    want = layer(x, positions=positions)
    cache = KVCache()
    got = [layer(x[:, :6], cache=cache, positions=positions[:, :6])]
    for t in range(6, L):
        got.append(layer(x[:, t:t + 1], cache=cache, positions=positions[:, t:t + 1]))
    assert_close_scaled(torch.cat(got, dim=1), want, TOL[F64])


def test_reset_starts_a_new_sequence():
    layer = _layer("half", None, "einsum")
    x = randn(N, L, D, seed=9)
    cache = KVCache()
    layer(x, cache=cache)
    cache.reset()
    assert len(cache) == 0 and cache.K is None
    assert_close_scaled(_decode(layer, x, [2]), layer(x), TOL[F64])
    assert "length=0" in repr(KVCache())


def _ones(L_new: int, dtype=F64) -> torch.Tensor:
    return torch.ones(N, L_new, D, dtype=dtype)


ERRORS = {  # each call continues a cache that holds 3 float64 tokens of batch 2
    "batch": (lambda layer, c: layer(torch.ones(3, 1, D, dtype=F64), cache=c),
              r"index 'n' has size 3 in the new keys but 2 in the cache's K\[n g σ a\]; call "
              r"cache.reset\(\)"),
    "dtype": (lambda layer, c: layer.float()(_ones(1, torch.float32), cache=c),
              rf"new keys are torch.float32 on {here()} but the cache holds torch.float64 "
              rf"on {here()}"),
    "padding shape": (lambda layer, c: layer(_ones(2), cache=c,
                                             key_padding_mask=torch.zeros(N, 5).bool()),
                      r"with a cache, key_padding_mask marks this call's new keys: a bool "
                      r"\(n, σ\) = \(2, 2\) tensor, True = padding, got torch.bool \(2, 5\)"),
    "padding float": (lambda layer, c: layer(_ones(2), cache=c,
                                             key_padding_mask=torch.zeros(N, 2)),
                      r"a bool \(n, σ\) = \(2, 2\) tensor, True = padding, got torch.float32 "
                      r"\(2, 2\)"),
}


@pytest.mark.parametrize("call, message", ERRORS.values(), ids=ERRORS.keys())
def test_bad_cache_use_raises(call, message):
    layer, cache = _layer(None, None, "einsum"), KVCache()
    layer(_ones(3), cache=cache)
    with pytest.raises(EinattnError, match=message):
        call(layer, cache)


@pytest.mark.parametrize("K, V, message", [
    (torch.ones(2, 3, 4), torch.ones(2, 3, 4), r"the new K\[n g σ a\] must be a 4-D tensor, "
                                               r"got \(2, 3, 4\)"),
    (torch.ones(2, 3, 4, 5), [[1.0]], r"the new V\[n g σ a\] must be a 4-D tensor, got list"),
    (torch.ones(2, 3, 4, 5), torch.ones(2, 3, 6, 5), r"every new key K\[n g σ a\] needs its "
                                                     r"value V\[n g σ b\]: K is \(2, 3, 4, 5\) "
                                                     rf"torch.float32 on {here()} but V is "
                                                     r"\(2, 3, 6, 5\)"),
    (torch.ones(2, 3, 4, 5), torch.ones(2, 3, 4, 5, dtype=F64), r"but V is \(2, 3, 4, 5\) "
                                                                r"torch.float64"),
])
def test_append_checks_ranks_and_lengths(K, V, message):
    """A 3-D K, or K and V of different lengths, used to be cached as they were."""
    cache = KVCache()
    with pytest.raises(EinattnError, match=message):
        cache.append(K, V)
    assert len(cache) == 0


def test_heads_must_match_the_cache():
    cache = KVCache()
    _layer(None, None, "einsum")(torch.ones(N, 3, D, dtype=F64), cache=cache)
    with pytest.raises(EinattnError, match=r"index 'g' has size 2 in the new keys but 6"):
        _layer(None, 2, "einsum")(torch.ones(N, 1, D, dtype=F64), cache=cache)


def test_a_call_that_raises_leaves_the_cache_as_it_was():
    layer = _layer("half", 2, "chunked", dropout=0.1)
    x = randn(N, L, D, seed=10)
    cache = KVCache()
    layer.eval()(x[:, :4], cache=cache)
    K, V = cache.K, cache.V
    with pytest.raises(EinattnError, match=r"mask has shape \(5, 5\)"):
        layer(x[:, 4:6], cache=cache, mask=torch.ones(5, 5, dtype=torch.bool))
    layer.impl = "flex"  # refused late, in the path, after the cache took the keys
    with pytest.raises(EinattnError, match=r"impl='flex' has no dropout"):
        layer.train()(x[:, 4:6], cache=cache)
    layer.impl = "chunked"
    assert len(cache) == 4 and cache.K is K and cache.V is V and cache.padding is None
    layer.eval()
    assert_close_scaled(torch.cat([layer(x[:, :4]), layer(x[:, 4:], cache=cache)], 1)[:, 4:],
                        layer(x)[:, 4:], TOL[F64])


def test_the_cache_refuses_a_context_and_other_objects():
    layer = _layer(None, None, "einsum")
    with pytest.raises(EinattnError, match=r"a KVCache holds self-attention's keys and values"):
        layer(_ones(3), _ones(5), cache=KVCache())
    with pytest.raises(EinattnError, match=r"cache must be an einattn.KVCache or "
                                           r"StaticKVCache, got dict"):
        layer(_ones(3), cache={})


# -- storage written in place ---------------------------------------------------------------


def _kv(L: int, seed: int):
    return randn(N, 2, L, 4, seed=seed), randn(N, 2, L, 4, seed=seed + 1)


def test_appends_write_in_place_and_leave_earlier_views_as_they_were():
    """Under no_grad each call writes only its new positions into storage that grows by a
    quarter (at least HEADROOM positions) when full: 5 + 16 positions, then 41 + 16 (past
    21), then 61 + 16 (past 57); each view handed out keeps its contents, and the cache
    equals one torch.cat of every call's keys and values."""
    cache, handed, pieces, storages = KVCache(), [], [], set()
    with torch.no_grad():
        for step, L_new in enumerate([5, 1, 1, 1, 1, 1, 3, 28, 20, 1]):
            K_new, V_new = _kv(L_new, seed=10 * step)
            pieces.append((K_new, V_new))
            K, V, _ = cache.append(K_new, V_new)
            handed.append((K, V, K.clone(), V.clone()))
            storages.add(K.untyped_storage().data_ptr())
    assert len(cache) == 62 and len(storages) == 3
    assert cache._storage[0].shape == (N, 2, 77, 4) == cache._storage[1].shape
    for K, V, K_then, V_then in handed:
        assert torch.equal(K, K_then) and torch.equal(V, V_then)
    assert torch.equal(cache.K, torch.cat([k for k, _ in pieces], 2))
    assert torch.equal(cache.V, torch.cat([v for _, v in pieces], 2))


def test_max_length_is_made_once_and_refuses_more():
    cache = KVCache(max_length=8)
    with torch.no_grad():
        cache.append(*_kv(3, seed=1))
        first = cache.K.untyped_storage().data_ptr()
        cache.append(*_kv(5, seed=2))
        assert cache.K.untyped_storage().data_ptr() == first and len(cache) == 8
        with pytest.raises(EinattnError, match=r"the cache holds at most max_length=8 "
                                               r"positions, but 8 cached and 1 new make 9"):
            cache.append(*_kv(1, seed=3))
    assert len(cache) == 8 and "max_length=8" in repr(cache)
    ids = KVCache(max_length=4)  # a refused append keeps nothing of the call, ids included
    with torch.no_grad():
        ids.append(*_kv(3, seed=4), document_ids=torch.zeros(N, 3, dtype=torch.long))
        with pytest.raises(EinattnError, match=r"but 3 cached and 3 new make 6"):
            ids.append(*_kv(3, seed=5), document_ids=torch.ones(N, 3, dtype=torch.long))
    assert len(ids) == 3 and ids.document_ids.shape == (N, 3)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(EinattnError, match=rf"max_length .* must be a positive int, "
                                               rf"got {bad!r}"):
            KVCache(max_length=bad)


def test_a_failed_call_mid_decoding_leaves_length_and_contents_as_they_were():
    layer = _layer("half", 2, "sdpa")
    x = randn(N, L, D, seed=12)
    cache = KVCache()
    with torch.no_grad():
        layer(x[:, :6], cache=cache)
        K, V = cache.K.clone(), cache.V.clone()
        with pytest.raises(EinattnError, match=r"mask has shape \(4, 4\)"):
            layer(x[:, 6:9], cache=cache, mask=torch.ones(4, 4, dtype=torch.bool))
        assert len(cache) == 6 and torch.equal(cache.K, K) and torch.equal(cache.V, V)
        rest = layer(x[:, 6:], cache=cache)
    assert_close_scaled(rest, layer(x)[:, 6:], TOL[F64])


@pytest.mark.parametrize("impl", ["einsum", "sdpa", "chunked", "flex"])
def test_two_hundred_steps_equal_one_causal_forward(impl):
    """A prefill of 3 and 200 one-token steps (GQA, RoPE) under no_grad, the storage grown
    in place, equal one causal forward over the 203 tokens (float64)."""
    layer = _layer("half", 2, impl, block_size=16)
    x = randn(1, 203, D, seed=13)
    cache = KVCache()
    with torch.no_grad():
        out = [layer(x[:, :3], cache=cache)]
        out += [layer(x[:, t:t + 1], cache=cache) for t in range(3, 203)]
        whole = layer(x, impl="einsum")
    assert_close_scaled(torch.cat(out, 1), whole, TOL[F64])


def test_keys_that_need_a_gradient_are_concatenated_not_written():
    """With a graph through the steps nothing autograd saved is written over: gradients
    through a prefill and two steps equal one causal forward's."""
    layer = _layer("half", 2, "einsum")
    x = randn(N, 6, D, seed=14, requires_grad=True)
    cache = KVCache()
    Y = torch.cat([layer(x[:, :4], cache=cache), layer(x[:, 4:5], cache=cache),
                   layer(x[:, 5:], cache=cache)], 1)
    assert cache._storage is None
    g, = torch.autograd.grad(Y.sum(), x)
    g_ref, = torch.autograd.grad(layer(x).sum(), x)
    assert_close_scaled(g, g_ref, TOL[F64])


def test_a_compiled_decode_step_with_a_preallocated_cache_equals_eager():
    """torch.compile(layer, fullgraph=True) over a prefill and 6 one-token steps into
    KVCache(max_length=16) (GQA, RoPE): equal to eager in float64, the storage made once and
    written in place, and no step compiles again after the second (torch.compile's automatic
    dynamic shapes: the first step's graph has the cached length σ as a constant, the
    second's as a symbol)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    layer = _layer("half", 2, "einsum").eval()
    x = randn(N, 11, D, seed=15)
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(layer, fullgraph=True, backend=counter)
    eager, compiled = KVCache(max_length=16), KVCache(max_length=16)
    with torch.no_grad():
        want = [layer(x[:, :5], cache=eager)] + [layer(x[:, t:t + 1], cache=eager)
                                                for t in range(5, 11)]
        got = [step(x[:, :5], cache=compiled)] + [step(x[:, t:t + 1], cache=compiled)
                                                  for t in (5, 6)]
        storage, graphs = compiled._storage[0].data_ptr(), counter.frame_count
        got += [step(x[:, t:t + 1], cache=compiled) for t in range(7, 11)]
    assert counter.frame_count == graphs == 3 and len(compiled) == 11
    assert compiled.K.data_ptr() == storage == compiled._storage[0].data_ptr()
    assert_close_scaled(torch.cat(got, 1), torch.cat(want, 1), TOL[F64])
    torch._dynamo.reset()


def test_crop_drops_the_last_positions_and_decoding_goes_on_from_there():
    """A cache cropped back to 6 positions (two rejected tokens) continues as if they had
    never been appended; cropping to 0 resets it; a length out of range is refused."""
    layer = _layer("half", 2, "sdpa")
    x, wrong = randn(N, L, D, seed=16), randn(N, 2, D, seed=17)
    cache = KVCache()
    padding = torch.zeros(N, 6, dtype=torch.bool)
    padding[1, 2] = True
    with torch.no_grad():
        layer(x[:, :6], cache=cache, key_padding_mask=padding)
        layer(wrong, cache=cache)
        cache.crop(6)
        assert len(cache) == 6 and torch.equal(cache.padding, padding)
        rest = layer(x[:, 6:], cache=cache)
        want = layer(x, key_padding_mask=torch.cat([padding, torch.zeros(N, 5).bool()], 1))
    assert_close_scaled(rest, want[:, 6:], TOL[F64])
    for bad in (-1, 12, 2.0, True):
        with pytest.raises(EinattnError, match=rf"crop keeps 0 to 11 cached positions σ, "
                                               rf"got {bad!r}"):
            cache.crop(bad)
    cache.crop(0)
    assert len(cache) == 0 and cache.K is None and cache.padding is None
