"""``impl="auto"`` (einattn.impls.auto): over issue 38's grid of patterns, lengths and with
and without gradients, its output and gradients are those of the impl it picks, bit for bit;
its choice is the one ``explain`` gives and the one logged; the layer and ``einattn.hf``
take it."""

from __future__ import annotations

import logging

import pytest
import torch

from einattn import MultiHeadAttention
from einattn import functional as F
from einattn.impls import auto

F64 = torch.float64
LENGTHS = (5, 96, 1024)  # small (≤ auto.SMALL scores), mid, long (≥ auto.TILED)


def _pattern(name: str, L: int) -> dict:
    if name == "documents":
        ids = torch.zeros(1, L, dtype=torch.long)
        ids[:, L // 3:] = 1
        ids[:, 2 * L // 3:] = 2
        return {"document_ids": ids}
    return {"dense": {}, "causal": {"causal": True},
            "window": {"causal": True, "window": 48},
            "softcap": {"causal": True, "softcap": 2.0},
            "sinks": {"causal": True, "sinks": torch.tensor([0.5, -1.0], dtype=F64)}}[name]


PATTERNS = ("dense", "causal", "window", "documents", "softcap", "sinks")


def _qkv(L: int, grad: bool):
    g = torch.Generator().manual_seed(L)
    return [torch.randn(1, 2, L, 8, generator=g, dtype=F64).requires_grad_(grad)
            for _ in range(3)]


def _run(impl: str, L: int, pattern: str, grad: bool):
    """Z (and the gradients of Q, K, V from one seeded dZ) on ``impl``."""
    Q, K, V = _qkv(L, grad)
    with torch.set_grad_enabled(grad):
        Z = F.attention(Q, K, V, impl=impl, **_pattern(pattern, L))
    if not grad:
        return [Z]
    Z.backward(torch.randn(Z.shape, generator=torch.Generator().manual_seed(1), dtype=F64))
    return [Z, Q.grad, K.grad, V.grad]


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "forward+backward"])
@pytest.mark.parametrize("L", LENGTHS)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_auto_is_the_impl_it_picks_bit_for_bit(pattern, L, grad):
    with auto.recording() as choices:
        got = _run("auto", L, pattern, grad)
    assert len(choices) == 1
    Q, K, V = _qkv(L, grad)
    with torch.set_grad_enabled(grad):
        assert choices[0] == F.explain(Q, K, V, **_pattern(pattern, L))
    want = _run(choices[0].impl, L, pattern, grad)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), choices[0]


@pytest.mark.parametrize("pattern, L, grad, impl", [
    ("dense", 5, True, "sdpa"), ("softcap", 5, False, "einsum"),
    ("causal", 1024, True, "sdpa"), ("dense", 1024, False, "sdpa"),
    ("window", 384, False, "sdpa"), ("window", 448, False, "chunked"),
    ("window", 1024, False, "chunked"), ("window", 1024, True, "chunked"),
    ("documents", 384, True, "sdpa"), ("documents", 1024, True, "chunked"),
    ("softcap", 224, False, "einsum"), ("softcap", 256, False, "chunked"),
    ("softcap", 352, True, "einsum"), ("softcap", 384, True, "chunked"),
    ("sinks", 80, False, "einsum"), ("sinks", 96, False, "chunked"),
    ("sinks", 128, True, "einsum"), ("sinks", 192, True, "chunked"),
])
def test_the_rules_pick_as_measured(pattern, L, grad, impl):
    """A few cells of docs/performance.md's table, as RULES decides them."""
    Q, K, V = _qkv(L, grad)
    with torch.set_grad_enabled(grad):
        assert F.explain(Q, K, V, **_pattern(pattern, L)).impl == impl


def test_weights_asked_run_the_einsum_path():
    Q, K, V = _qkv(96, False)
    choice = F.explain(Q, K, V, causal=True, need_weights=True)
    assert choice.impl == "einsum" and "weights" in choice.reason
    Z, A = F.attention(Q, K, V, causal=True, need_weights=True, impl="auto")
    assert torch.equal(Z, F.attention(Q, K, V, causal=True, impl="einsum"))
    assert torch.equal(A, F.attention(Q, K, V, causal=True, need_weights=True)[1])


def test_explain_of_an_impl_named_says_where_it_runs():
    Q, K, V = _qkv(5, False)
    assert F.explain(Q, K, V, impl="chunked") == auto.Choice("chunked", "impl='chunked': as asked")
    assert F.explain(Q, K, V, impl="sdpa", softcap=2.0).impl == "einsum"


def test_the_choice_is_logged_at_debug(caplog):
    Q, K, V = _qkv(1024, False)
    with caplog.at_level(logging.DEBUG, logger="einattn.auto"):
        F.attention(Q, K, V, causal=True, window=48, impl="auto")
    assert "impl='auto' runs chunked" in caplog.text and "(1, 2, 1024, 8)" in caplog.text


def test_the_layer_runs_auto_as_the_impl_it_picks():
    torch.manual_seed(0)
    layer = MultiHeadAttention(16, 2, causal=True, window=40, impl="auto", dtype=F64)
    x = torch.randn(1, 1024, 16, dtype=F64)
    with auto.recording() as choices:
        Y = layer(x)
    assert [c.impl for c in choices] == ["chunked"]
    assert torch.equal(Y, layer(x, impl="chunked"))
    assert layer.impl == "auto" and "impl='auto'" in repr(layer)


def test_flex_is_picked_off_the_cpu_alone():
    """A forward window or cap from TILED scores: chunked on the CPU (measured ahead of
    compiled FlexAttention), flex off it (a meta tensor stands for a GPU's); not with
    gradients, nor in float64 (FlexAttention compiles no float64 kernel)."""
    for device, impl in (("cpu", "chunked"), ("meta", "flex")):
        Q = torch.empty(1, 2, 512, 16, device=device)
        with torch.no_grad():
            assert F.explain(Q, Q, Q, causal=True, window=64).impl == impl
            assert F.explain(Q, Q, Q, causal=True, softcap=30.0).impl == impl
            assert F.explain(Q.double(), Q.double(), Q.double(), causal=True,
                             window=64).impl == "chunked"
        assert F.explain(Q.requires_grad_(), Q, Q, causal=True, window=64).impl == "chunked"
