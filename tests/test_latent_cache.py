"""einattn.latent_cache.LatentCache: KVCache's contract (append, len, crop, reset, a refused
call changes nothing) for tensors of widths of their own, and every refusal by name."""

from __future__ import annotations

import pytest
import torch

from einattn import EinattnError
from einattn.latent_cache import LatentCache
from tests.conftest import randn

F64 = torch.float64


def expanded(n: int = 2, L: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """An expanded call's K[n μ σ (a ρ)] and V[n μ σ b]: μ=3, a+ρ=11, b=7."""
    return randn(n, 3, L, 11, seed=seed), randn(n, 3, L, 7, seed=seed + 1)


def test_append_returns_every_position_in_order_and_the_padding():
    cache = LatentCache()
    first, second = expanded(L=3), expanded(L=2, seed=5)
    pad = torch.tensor([[False, True], [False, False]])
    cache.append("expanded", first)
    (K, V), padding = cache.append("expanded", second, pad)
    assert len(cache) == 5 and cache.form == "expanded"
    assert torch.equal(K, torch.cat([first[0], second[0]], 2))
    assert torch.equal(V, torch.cat([first[1], second[1]], 2))
    assert torch.equal(padding, torch.cat([torch.zeros(2, 3, dtype=torch.bool), pad], 1))
    assert cache.numbers_per_token() == 3 * 11 + 3 * 7
    assert repr(cache) == ("LatentCache(length=5, form='expanded', tensors=[(2, 3, 5, 11), "
                           "(2, 3, 5, 7)])")


def test_crop_keeps_a_prefix_and_reset_forgets_the_form():
    cache = LatentCache()
    K, V = expanded(L=4)
    cache.append("expanded", (K, V), torch.zeros(2, 4, dtype=torch.bool))
    cache.crop(2)
    assert len(cache) == 2 and torch.equal(cache.tensors[0], K[:, :, :2])
    assert cache.padding.shape == (2, 2)
    cache.crop(0)
    assert len(cache) == 0 and cache.form is None and cache.padding is None
    cache.append("absorbed", (randn(2, 1, 1, 19, seed=3),))  # a new sequence, the other form
    assert cache.form == "absorbed"


def snapshot(cache: LatentCache) -> tuple:
    return (cache.form, len(cache), None if cache.tensors is None else
            [t.clone() for t in cache.tensors], cache.padding)


REFUSED = [  # (what a call passes, the message)
    (("compressed", expanded()), "form must be one of 'expanded', 'absorbed', got 'compressed'"),
    (("absorbed", (randn(2, 1, 3, 19, seed=1),)), "holds the expanded form's tensors, not the "
                                                  "absorbed form's"),
    (("expanded", [torch.ones(1)]), "must be a tuple of 4-D .n h σ w. tensors, got list"),
    (("expanded", (torch.ones(2, 3, 3),)), r"got \[\(2, 3, 3\)\]"),
    (("expanded", (randn(2, 3, 3, 11, seed=1), randn(2, 3, 4, 7, seed=2))),
     "the new tensors disagree"),
    (("expanded", expanded(), torch.zeros(2, 3)), r"key_padding_mask marks this call's new "
                                                  r"keys: a bool \(n, σ\) = \(2, 3\)"),
    (("expanded", expanded()[:1]), "the cache holds 2 tensors per token, got 1"),
    (("expanded", expanded(n=1)), "n has size 1 in new tensor 0 but 2 in the cache's"),
    (("expanded", (randn(2, 3, 1, 11, seed=1), randn(2, 3, 1, 8, seed=2))),
     "width has size 8 in new tensor 1 but 7"),
    (("expanded", tuple(t.float() for t in expanded())),
     "new tensors are torch.float32 on cpu but the cache holds torch.float64"),
    (("expanded", expanded(L=6)), "at most max_length=8 positions, but 3 cached and 6 new"),
]


@pytest.mark.parametrize("call, message", REFUSED)
def test_a_refused_append_names_what_is_wrong_and_changes_nothing(call, message):
    cache = LatentCache(max_length=8)
    cache.append("expanded", expanded(seed=10))
    before = snapshot(cache)
    with pytest.raises(EinattnError, match=message):
        cache.append(*call)
    after = snapshot(cache)
    assert after[:2] == before[:2] and after[3] is before[3]
    assert all(torch.equal(a, b) for a, b in zip(after[2], before[2], strict=True))


def test_a_block_that_raises_inside_undo_on_error_adds_nothing():
    cache = LatentCache()
    cache.append("absorbed", (randn(2, 1, 2, 19, seed=1),))
    with pytest.raises(RuntimeError), cache.undo_on_error():
        cache.append("absorbed", (randn(2, 1, 1, 19, seed=2),))
        raise RuntimeError("the attention after the append failed")
    assert len(cache) == 2


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_a_bad_max_length_is_refused(bad):
    with pytest.raises(EinattnError, match=r"max_length \(the most positions σ the cache holds\) "
                                           r"must be a positive int"):
        LatentCache(max_length=bad)


@pytest.mark.parametrize("bad", [-1, 2, 1.0, True])
def test_a_bad_crop_is_refused(bad):
    cache = LatentCache()
    cache.append("absorbed", (randn(1, 1, 1, 19, seed=1),))
    with pytest.raises(EinattnError, match="crop keeps 0 to 1 cached positions σ"):
        cache.crop(bad)
    assert len(cache) == 1


def test_an_empty_cache_has_no_numbers_per_token():
    with pytest.raises(EinattnError, match="the cache is empty"):
        LatentCache().numbers_per_token()
