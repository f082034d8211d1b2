"""A refused call leaves any cache exactly as it was: every kind of refusal the layer and
``functional.multi_head_attention`` can make with a cache, on a fresh and on a used
``KVCache`` (growing, of a ``max_length``, holding documents) and ``StaticKVCache``. Its
length, contents, padding, documents and storage are the same objects with the same
values afterwards, and decoding on from there equals the causal forward over the whole
sequence (float64). A ``StaticKVCache`` whose first call was refused used to keep that
call's keys, and every later step attended to them at shifted positions."""

from __future__ import annotations

import pytest
import torch

from einattn import EinattnError, KVCache, MultiHeadAttention, StaticKVCache, functional
from tests.conftest import TOL, assert_close_scaled, randn

F64 = torch.float64
N, L, D, H, G, A = 2, 9, 12, 6, 2, 4  # all distinct: batch, length, width, heads, groups, a
USED = 3  # a used cache holds a prompt of 3 tokens

CACHES = {
    "KVCache": lambda: KVCache(),
    "KVCache(max_length)": lambda: KVCache(max_length=L),
    "KVCache with documents": lambda: KVCache(),
    "StaticKVCache": lambda: StaticKVCache(max_length=L),
}


def _layer() -> MultiHeadAttention:
    torch.manual_seed(3)
    return MultiHeadAttention(D, H, d_head=A, n_kv_heads=G, rope="half", causal=True,
                              dropout=0.25, block_size=2, dtype=F64).eval()


X = randn(N, L + 1, D, seed=31)  # one token more than any cache holds
PADDING = torch.zeros(N, L + 1, dtype=torch.bool)
PADDING[1, 1] = PADDING[0, 4] = True
DOCUMENTS = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 2, 2, 2, 2]])


def _call(layer, cache, kind: str, start: int, stop: int, **options):
    """The layer on tokens ``start … stop − 1`` with their padding (and documents),
    ``options`` replacing any of those or adding others (``dtype``: the tokens' dtype);
    ``functional=True`` calls :func:`einattn.functional.multi_head_attention` on the
    layer's weights instead."""
    call = {"cache": cache, "key_padding_mask": PADDING[:, start:stop]}
    if kind == "KVCache with documents":
        call["document_ids"] = DOCUMENTS[:, start:stop]
    call.update(options)
    x = X[:, start:stop].to(call.pop("dtype", F64))
    if call.pop("functional", False):
        W_O = call.pop("W_O", layer.W_O)
        return functional.multi_head_attention(x, layer.W, W_O, n_heads=H, n_kv_heads=G,
                                               rope="half", causal=True, **call)
    return layer(x, **call)


def _new(layer, cache, kind, **options):
    """Two new tokens after those cached."""
    return _call(layer, cache, kind, len(cache), len(cache) + 2, **options)


def _learned_slopes(layer, cache, kind):
    """ALiBi slopes that need a gradient (grad mode on: the keys are then concatenated, the
    cache's storage let go) on the chunked path, which holds them constant."""
    with torch.enable_grad():
        return _new(layer, cache, kind, functional=True, impl="chunked",
                    alibi=torch.ones(H, dtype=F64, requires_grad=True))


REFUSALS = {  # name: (the refused call, what the refusal says, by cache kind where it differs)
    "mask shape": (lambda *a: _new(*a, mask=torch.ones(3, 3, dtype=torch.bool)), r"mask"),
    "mask dtype": (lambda *a: _new(*a, mask=torch.ones(2, USED + 2, dtype=torch.long)),
                   r"mask"),
    "window": (lambda *a: _new(*a, functional=True, window=0), r"window|needs KVCache"),
    "sinks shape": (lambda *a: _new(*a, functional=True, sinks=torch.zeros(H + 1)),
                    r"sinks|needs KVCache"),
    "learned slopes on chunked": (lambda *a: _learned_slopes(*a), r"learned slopes|needs KVCache"),
    "dropout on flex": (lambda layer, *a: _new(layer.train(), *a, impl="flex"),
                        r"impl='flex' has no dropout"),
    "padding shape": (lambda *a: _new(*a, key_padding_mask=torch.zeros(N, 5, dtype=torch.bool)),
                      r"key_padding_mask marks this call's new keys"),
    "padding dtype": (lambda *a: _new(*a, key_padding_mask=torch.zeros(N, 2)),
                      r"a bool \(n, σ\) = \(2, 2\) tensor"),
    "document dtype": (lambda *a: _new(*a, document_ids=torch.zeros(N, 2)),
                       r"document_ids"),
    "positions": (lambda *a: _new(*a, positions=torch.arange(5)), r"positions"),
    "b_O shape": (lambda *a: _new(*a, functional=True, b_O=torch.zeros(D + 1, dtype=F64)),
                  r"b_O has shape \(13,\) but b_O\[i\] needs \(12,\)"),
    "W_O heads": (lambda layer, *a: _new(layer, *a, functional=True, W_O=layer.W_O[:-1]),
                  r"index 'μ' has size"),
    "x dtype": (lambda *a: _new(*a, dtype=torch.float32), r"x is torch.float32 but the "
                                                           r"layer's W is torch.float64"),
    "W_O dtype": (lambda layer, *a: _new(layer, *a, functional=True, W_O=layer.W_O.float()),
                  r"float32"),
    "impl": (lambda *a: _new(*a, impl="fast"), r"impl must be one of"),
    "context": (lambda *a: _new(*a, functional=True, context=X[:, :4]),
                r"a KVCache holds self-attention's keys and values"),
    "length": (lambda layer, c, kind: _call(layer, c, kind, len(c), L + 1),
               r"max_length=9"),
}
UNLIMITED = {"KVCache", "KVCache with documents"}  # no max_length: a long call is taken


def _state(cache) -> dict:
    """Every tensor the cache holds, by name: the object and a copy of its values."""
    names = ("K", "V", "padding", "document_ids", "filled")
    held = {name: getattr(cache, name, None) for name in names}
    if isinstance(cache, KVCache) and cache._storage is not None:
        held |= {"storage K": cache._storage[0], "storage V": cache._storage[1]}
    return {name: (t, None if t is None else t.clone()) for name, t in held.items()}


def _assert_same(cache, before: dict, length: int) -> None:
    assert len(cache) == length
    after = _state(cache)
    assert after.keys() == before.keys()
    for name, (t, _) in after.items():
        was, values = before[name]
        assert t is was, name  # the same object (a view handed out stays valid)
        if t is not None and not name.startswith("storage"):  # past len: scratch, documented
            assert torch.equal(t, values), name
    if isinstance(cache, KVCache) and cache.K is not None:  # the storage behind K, V
        assert torch.equal(cache._storage[0][:, :, :length], before["storage K"][1][:, :, :length])


def _whole(layer, kind: str) -> torch.Tensor:
    documents = DOCUMENTS[:, :L] if kind == "KVCache with documents" else None
    return layer(X[:, :L], key_padding_mask=PADDING[:, :L], document_ids=documents)


@pytest.mark.parametrize("refusal", list(REFUSALS))
@pytest.mark.parametrize("kind", list(CACHES))
@pytest.mark.parametrize("used", [False, True], ids=["fresh", "used"])
def test_a_refused_call_leaves_the_cache_as_it_was_and_decoding_goes_on(refusal, kind, used):
    if refusal == "length" and kind in UNLIMITED:
        pytest.skip("a cache without max_length takes any length")
    layer, cache = _layer(), CACHES[kind]()
    call, message = REFUSALS[refusal]
    with torch.no_grad():
        if used:
            _call(layer, cache, kind, 0, USED)
        before = _state(cache)
        with pytest.raises(EinattnError, match=message):
            call(layer, cache, kind)
        _assert_same(cache, before, USED if used else 0)
        layer.eval()
        start = USED if used else 0
        prompt = [_call(layer, cache, kind, 0, USED)] if not used else []
        steps = [_call(layer, cache, kind, t, t + 1) for t in range(USED, L)]
        whole = _whole(layer, kind)
    assert_close_scaled(torch.cat(prompt + steps, dim=1), whole[:, start:], TOL[F64])


@pytest.mark.parametrize("used", [False, True], ids=["fresh", "used"])
def test_a_refused_static_call_leaves_no_trace_in_its_storage(used):
    """What a refused call wrote in place is emptied again: zeros and padding at every
    position not filled, as a fresh storage and reset() leave them."""
    layer, cache = _layer(), StaticKVCache(max_length=L)
    with torch.no_grad():
        _call(layer, cache, "StaticKVCache", 0, USED)
        if not used:
            cache.reset()
        with pytest.raises(EinattnError, match=r"impl='flex' has no dropout"):
            _new(layer.train(), cache, "StaticKVCache", impl="flex")
    f = len(cache)
    assert f == (USED if used else 0)
    assert not cache.K[:, :, f:].any() and not cache.V[:, :, f:].any()
    assert cache.padding[:, f:].all()
