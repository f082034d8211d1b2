"""einattn._softmax: the softmax of equation (3) written over its own scratch scores gives
torch's softmax bit for bit, forward and backward, in the scores' and the gradient's own
storage; the einsum path takes it where nobody sees S or A, and keeps the out-of-place
softmax where somebody could (weights returned, a second derivative, torch.func)."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from conftest import randn
from torch.utils._python_dispatch import TorchDispatchMode

from einattn import MultiHeadAttention, _softmax

F64, F32 = torch.float64, torch.float32


@pytest.fixture(autouse=True)
def every_size_is_worth_it(monkeypatch):
    """The tests' scores are tiny: let them take the in-place path all the same."""
    monkeypatch.setattr(_softmax, "WORTH", 0)


class _Probe(torch.autograd.Function):
    """Identity whose backward records the storage of the gradient it is given."""

    seen: ClassVar[list[int]] = []

    @staticmethod
    def forward(ctx, S):
        return S.clone()

    @staticmethod
    def backward(ctx, dS):
        _Probe.seen.append(dS.data_ptr())
        return dS


@pytest.mark.parametrize("dtype", [F64, F32])
def test_over_scratch_is_torch_softmax_bit_for_bit_in_place(dtype):
    S0 = randn(2, 3, 5, 7, seed=1, dtype=dtype, requires_grad=True)
    dA = randn(2, 3, 5, 7, seed=2, dtype=dtype)
    expected = torch.softmax(S0, dim=-1)
    (dS_expected,) = torch.autograd.grad(expected, S0, dA)

    _Probe.seen.clear()
    S = _Probe.apply(S0)
    storage = S.data_ptr()
    A = _softmax.over_scratch(S)
    assert A.data_ptr() == storage  # written over the scores
    assert torch.equal(A, expected)
    grads = []
    A.register_hook(lambda g: grads.append(g.data_ptr()))
    (dS,) = torch.autograd.grad(A, S0, dA.clone())
    assert torch.equal(dS, dS_expected)
    assert _Probe.seen == grads  # the scores' gradient was written over dA


def test_over_scratch_without_a_gradient_writes_over_the_scores():
    S = randn(4, 6, 9, seed=3)
    expected = torch.softmax(S, dim=-1)
    with torch.no_grad():
        A = _softmax.over_scratch(S)
    assert A.data_ptr() == S.data_ptr() and torch.equal(A, expected)


def test_second_derivatives_keep_the_incoming_gradient():
    """create_graph: the backward is out of place and differentiable, checked twice over."""
    S0 = randn(2, 4, 5, seed=4, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda S: _softmax.over_scratch(S * 1.0), (S0,))


@pytest.mark.parametrize("S, why", [
    (randn(3, 8, seed=5).t(), "non-contiguous"),
    (torch.empty(3, 4, device="meta"), "not on the CPU"),
])
def test_not_spendable(S, why):
    assert not _softmax.spendable(S), why


@pytest.mark.cpu_only("the scores are spent in place on the CPU path only")
def test_spendable_scores():
    assert _softmax.spendable(randn(3, 4, seed=6))


@pytest.mark.cpu_only("the scores are spent in place on the CPU path only")
def test_small_scores_are_not_worth_spending(monkeypatch):
    """Below WORTH bytes the Function's Python costs more than the buffer it saves."""
    monkeypatch.setattr(_softmax, "WORTH", 8 * 12)
    assert _softmax.spendable(randn(3, 4, seed=6))
    assert not _softmax.spendable(randn(11, seed=6))
    monkeypatch.undo()
    layer = MultiHeadAttention(12, 3, d_head=5, dtype=F64)
    with _Ops() as seen:
        layer(randn(2, 7, 12, seed=8))
    assert "_softmax.default" in seen.ops and "_softmax.out" not in seen.ops


class _Ops(TorchDispatchMode):
    """Names of the aten ops that run, and the output storage of each bmm."""

    def __init__(self):
        super().__init__()
        self.ops, self.products = [], set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append(str(func.overloadpacket.__name__) + "." + func._overloadname)
        if func.overloadpacket is torch.ops.aten.bmm:
            self.products.add(out.untyped_storage().data_ptr())
        if func.overloadpacket is torch.ops.aten._softmax and "out" in (kwargs or {}):
            self.softmax_out = kwargs["out"].untyped_storage().data_ptr()
        return out


@pytest.mark.cpu_only("the scores are spent in place on the CPU path only")
@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("kwargs", [{}, {"causal": True}])
def test_the_einsum_layer_writes_the_softmax_over_its_scores(grad, kwargs):
    """Not a timing: the einsum path on CPU runs softmax as ``_softmax.out`` into the storage
    of the scores' bmm, so one L_q × L_k buffer fewer is allocated each way."""
    layer = MultiHeadAttention(12, 3, d_head=5, dtype=F64)
    x = randn(2, 7, 12, seed=7, requires_grad=grad)
    with torch.set_grad_enabled(grad), _Ops() as seen:
        layer(x, **kwargs)
    assert "_softmax.default" not in seen.ops
    assert "_softmax.out" in seen.ops and seen.softmax_out in seen.products


@pytest.mark.parametrize("kwargs", [{"need_weights": True}, {"return_intermediates": True}])
def test_seen_scores_or_weights_keep_the_fresh_softmax(kwargs):
    layer = MultiHeadAttention(12, 3, d_head=5, dtype=F64)
    with _Ops() as seen:
        layer(randn(2, 7, 12, seed=8), **kwargs)
    assert "_softmax.default" in seen.ops and "_softmax.out" not in seen.ops


MASKS = {
    "none": {},
    "causal": {"causal": True},
    "bool": {"mask": randn(6, 6, seed=9) > -0.3},
    "float": {"mask": randn(6, 6, seed=10).masked_fill(randn(6, 6, seed=11) < -0.5,
                                                          float("-inf"))},
    "padding, a dead row": {"key_padding_mask": torch.tensor([[False] * 6, [True] * 6])},
}


@pytest.mark.parametrize("n_kv_heads", [None, 2])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("dtype", [F64, F32])
def test_in_place_path_equals_the_out_of_place_one(mask, n_kv_heads, dtype):
    """``return_intermediates`` runs the same stages with the fresh softmax: the output and
    every gradient agree bit for bit."""
    layer = MultiHeadAttention(12, 4, d_head=5, n_kv_heads=n_kv_heads, dtype=dtype)
    x = randn(2, 6, 12, seed=12, dtype=dtype, requires_grad=True)
    dY = randn(2, 6, 12, seed=13, dtype=dtype)
    kwargs = {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v
              for k, v in MASKS[mask].items()}
    results = []
    for seen in (False, True):
        Y = layer(x, return_intermediates=True, **kwargs)[0] if seen else layer(x, **kwargs)
        results.append((Y, *torch.autograd.grad(Y, (x, *layer.parameters()), dY)))
    for fresh, spent in zip(*results, strict=True):
        assert torch.equal(fresh, spent)


def test_the_layer_twice_differentiable():
    layer = MultiHeadAttention(6, 2, d_head=4, dtype=F64)
    x = randn(2, 5, 6, seed=14, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda x: layer(x, causal=True), (x,))


def test_torch_func_transforms_keep_the_fresh_softmax():
    layer = MultiHeadAttention(6, 2, d_head=4, dtype=F64)
    x = randn(3, 5, 6, seed=15)
    grad = torch.func.grad(lambda x: layer(x).square().sum())(x)
    x_ = x.clone().requires_grad_()
    (expected,) = torch.autograd.grad(layer(x_).square().sum(), x_)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.func.vmap(layer)(x[:, None])[:, 0], layer(x),
                               rtol=1e-12, atol=1e-12)
