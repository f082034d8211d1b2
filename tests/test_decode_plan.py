"""The layer's plan for cached calls (:mod:`einattn._decode`): a decoding run under no_grad
goes by the plan and gives the composition's numbers bit for bit, for every grouping, RoPE,
padding, pattern and impl it covers; what it does not cover runs the composition; every
refusal of a cached call still fires through it, and leaves the cache as it was."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from einattn import EinattnError, KVCache, MultiHeadAttention, _decode, equations
from tests.conftest import left_padded, randn

N, D, H, A = 2, 30, 6, 4  # n, d_model, n_heads, d_head: all distinct
PROMPT, STEPS = 7, 9
CONFIGS = {
    "causal": {},
    "grouped, rope half, bias": {"n_kv_heads": 2, "rope": "half", "bias": True},
    "grouped, rope interleaved, scale": {"n_kv_heads": 3, "rope": "interleaved",
                                         "scale": 0.3},
    "window": {"window": 3, "n_kv_heads": 2},
    "one key head, not causal": {"n_kv_heads": 1, "causal": False},
}


def _layer(impl: str, **options) -> MultiHeadAttention:
    torch.manual_seed(3)
    options = {"causal": True, **options}
    layer = MultiHeadAttention(D, H, d_head=A, impl=impl, **options).eval()
    with torch.no_grad():  # nonzero biases, so that a bias dropped would show
        for p in layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return layer


def _run(layer, x, padding) -> list[torch.Tensor]:
    """A prompt (its keys padded where ``padding``) then one token at a time, under no_grad:
    every call's Y, then the cache's K and V."""
    cache = KVCache()
    with torch.no_grad():
        ys = [layer(x[:, :PROMPT], cache=cache,
                    key_padding_mask=left_padded(N, PROMPT, 2) if padding else None)]
        ys += [layer(x[:, t:t + 1], cache=cache) for t in range(PROMPT, x.shape[1])]
    return [*ys, cache.K, cache.V]


def _plans(layer) -> list:
    """The plans the layer made (None for the keys no plan covers)."""
    return [made[1] for made in layer.__dict__.get("_decode_plans", {}).values()]


@pytest.mark.parametrize("impl", ["einsum", "sdpa", "chunked"])
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("padding", [False, True], ids=["unpadded", "padded"])
def test_a_planned_decoding_run_equals_the_composition_bit_for_bit(impl, config, padding,
                                                                   monkeypatch):
    x = randn(N, PROMPT + STEPS, D, seed=5, dtype=torch.float32)
    layer = _layer(impl, **config)
    planned = _run(layer, x, padding)
    plans = [plan for plan in _plans(layer) if plan is not None]
    assert len(plans) == 2  # the prompt's and the step's
    direct = impl == "sdpa" and "window" not in config
    assert [plan.direct for plan in plans] == [False, direct]
    monkeypatch.setattr(_decode, "step", lambda *args: None)  # every call composed
    composed = _run(layer, x, padding)
    assert all(torch.equal(p, c) for p, c in zip(planned, composed, strict=True))


def test_a_new_spec_makes_a_new_plan():
    layer, x = _layer("sdpa", n_kv_heads=2), randn(N, PROMPT + STEPS, D, seed=6,
                                                    dtype=torch.float32)
    first = _run(layer, x, False)
    layer.impl = "einsum"
    assert {plan.spec.impl for plan in _plans(layer)} == {"sdpa"}
    again = _run(layer, x, False)
    assert {plan.spec.impl for plan in _plans(layer)} == {"einsum"}
    assert all(torch.allclose(f, a, atol=1e-6) for f, a in zip(first, again, strict=True))


@pytest.mark.parametrize("options, call", [
    ({"dropout": 0.1}, "train"), ({"alibi": True}, None), ({"sinks": True}, None),
    ({"qk_norm": None, "gate": True}, None), ({"d_value": 7}, None),
])
def test_what_no_plan_covers_runs_the_composition(options, call):
    layer = _layer("sdpa", **options)
    if call == "train":
        layer.train()
    _run(layer, randn(N, PROMPT + 2, D, seed=7, dtype=torch.float32), False)
    assert all(plan is None for plan in _plans(layer))


def test_grad_mode_and_parametrized_weights_run_the_composition():
    layer = _layer("sdpa")
    layer(torch.ones(N, 1, D), cache=KVCache())  # grad mode: the cache concatenates
    assert not _plans(layer)
    nn.utils.parametrize.register_parametrization(layer, "W", nn.Identity())
    _run(layer, randn(N, PROMPT + 2, D, seed=8, dtype=torch.float32), False)
    assert not _plans(layer)


def _stepped(layer, cache=None, **call) -> KVCache:
    """``cache`` (a new one by default) after a prompt and one planned step."""
    cache = KVCache() if cache is None else cache
    with torch.no_grad():
        layer(torch.ones(N, 3, D), cache=cache, **call)
        layer(torch.ones(N, 1, D), cache=cache)
    assert any(plan is not None for plan in _plans(layer))
    return cache


def _bad_b(layer):
    layer.b = nn.Parameter(torch.ones(4))


def _bad_b_O(layer):
    layer.b_O = nn.Parameter(torch.ones(4))


def _bad_W(layer):
    layer.W = nn.Parameter(torch.ones(3 * H * A + 1, D))


REFUSALS = {
    "x width": (None, lambda layer, c: layer(torch.ones(N, 1, D + 1), cache=c),
                r"x has shape \(2, 1, 31\) but the layer expects \(n, L, d_model=30\)"),
    "x dtype": (None, lambda layer, c: layer(torch.ones(N, 1, D, dtype=torch.float64),
                                             cache=c),
                r"x is torch.float64 but the layer's W is torch.float32"),
    "batch": (None, lambda layer, c: layer(torch.ones(3, 1, D), cache=c),
              r"index 'n' has size 3 in the new keys but 2 in the cache's K\[n g σ a\]"),
    "padding": (None, lambda layer, c: layer(torch.ones(N, 1, D), cache=c,
                                             key_padding_mask=torch.zeros(N, 2).bool()),
                r"key_padding_mask marks this call's new keys: a bool \(n, σ\) = \(2, 1\)"),
    "W rows": (_bad_W, lambda layer, c: layer(torch.ones(N, 1, D), cache=c),
               r"W has 73 rows; W\[\(μ B a\) i\] needs μ·B·a rows"),
    "b": (_bad_b, lambda layer, c: layer(torch.ones(N, 1, D), cache=c),
          r"b has shape \(4,\) but b\[\(μ B a\)\] needs \(72,\)"),
    "b_O": (_bad_b_O, lambda layer, c: layer(torch.ones(N, 1, D), cache=c),
            r"b_O has shape \(4,\) but b_O\[i\] needs \(30,\)"),
    "other heads": (None, lambda layer, c: _layer("sdpa", n_kv_heads=2)(
        torch.ones(N, 1, D), cache=c), r"index 'g' has size 2 in the new keys but 6"),
}


@pytest.mark.parametrize("spoil, call, message", REFUSALS.values(), ids=REFUSALS.keys())
def test_refusals_fire_through_the_plan_and_leave_the_cache(spoil, call, message):
    layer = _layer("sdpa", bias=True)
    cache = _stepped(layer)
    K, V = cache.K, cache.V
    if spoil is not None:
        spoil(layer)
    with torch.no_grad(), pytest.raises(EinattnError, match=message):
        call(layer, cache)
    assert len(cache) == 4 and cache.K is K and cache.V is V


def test_a_full_cache_and_missing_document_ids_are_refused_through_the_plan():
    layer = _layer("sdpa")
    cache = _stepped(layer, KVCache(max_length=4))
    with torch.no_grad(), pytest.raises(EinattnError, match=r"at most max_length=4 positions"):
        layer(torch.ones(N, 1, D), cache=cache)
    cache = KVCache()
    with torch.no_grad():
        layer(torch.ones(N, 3, D), cache=cache, document_ids=torch.zeros(N, 3).long())
        with pytest.raises(EinattnError, match=r"document_ids must be given on every call"):
            layer(torch.ones(N, 1, D), cache=cache)
    assert len(cache) == 3


def test_a_planned_layer_copies_and_pickles_without_its_plans():
    layer = _layer("sdpa")
    _stepped(layer)
    for other in (copy.deepcopy(layer), _pickled(layer)):
        assert not _plans(other)
        x = torch.randn(N, 4, D)
        assert torch.equal(other(x), layer(x))


def _pickled(layer):
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def test_planned_runs_what_the_equation_runs():
    x, W = randn(N, 3, D, seed=1), randn(3 * H * A, D, seed=2)
    run = equations.PROJECT.planned(X=x, W=W, μ=H, B=3)
    assert torch.equal(run(x, W), equations.PROJECT(X=x, W=W, μ=H, B=3))
