"""``einattn.MultiHeadAttention``: the layer's own contract.

Fully masked rows, dropout, state_dict, dtype/device moves, float16/bfloat16 accuracy,
empty sizes, initialisation statistics, the conversions (projections, torch), d_head free
of d_model/n_heads, intermediates, the per-call causal override, mask polarity and rank,
NaN propagation and ``gradcheck``. Parity with PyTorch is tests/test_parity_torch.py; bad
arguments are tests/test_bad_inputs.py.

Sizes are all distinct and mostly not powers of two: n=2, L_q=5, L_k=7, d_model=30,
n_heads=5 (d_head=6), unless a test says otherwise.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import randn
from torch import nn

from einattn import EinattnError, KVCache, MultiHeadAttention, reference
from einattn import functional as F

F64 = torch.float64
N, L_Q, L_K, D, H = 2, 5, 7, 30, 5




def _layer(d_model: int = D, n_heads: int = H, *, seed: int = 0, bias: bool = True,
           dtype: torch.dtype = F64, **options) -> MultiHeadAttention:
    """A layer with seeded weights and non-zero biases (zero biases would hide bias bugs)."""
    layer = MultiHeadAttention(d_model, n_heads, bias=bias, dtype=dtype, **options)
    with torch.no_grad():
        for k, p in enumerate(layer.parameters()):
            p.copy_(randn(*p.shape, seed=100 * seed + k, dtype=dtype) * 0.3)
    return layer


def _close(actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-12) -> bool:
    """Equal shapes and ``max |actual − expected| ≤ tol · max(1, max |expected|)``."""
    if actual.shape != expected.shape:
        return False
    if expected.numel() == 0:
        return True
    scale = max(1.0, expected.abs().max().item())
    return (actual - expected).abs().max().item() <= tol * scale


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected).abs().max() / expected.abs().max()).item()


# -- fully masked rows -----------------------------------------------------------------------


def _dead_row_cases():
    """(name, mask kwargs, dead (n, τ) query rows, L_k): every way to block all keys."""
    bool_mask = torch.ones(N, L_Q, L_K, dtype=torch.bool)
    bool_mask[1, 3] = False
    float_mask = randn(L_Q, L_K, seed=7)
    float_mask[2] = float("-inf")
    kpm = torch.zeros(N, L_K, dtype=torch.bool)
    kpm[0] = True  # every key of sample 0 is padding
    return [
        ("bool-mask", {"mask": bool_mask}, [(1, 3)], L_K),
        ("float-mask", {"mask": float_mask}, [(0, 2), (1, 2)], L_K),
        ("key-padding", {"key_padding_mask": kpm}, [(0, t) for t in range(L_Q)], L_K),
        # bottom-right causal with L_q = 5 > L_k = 3: queries 0 and 1 precede every key
        ("causal-L_q>L_k", {"causal": True}, [(n, t) for n in range(N) for t in (0, 1)], 3),
    ]


@pytest.mark.parametrize("name,kwargs,dead,L_k", _dead_row_cases(),
                         ids=[c[0] for c in _dead_row_cases()])
def test_fully_masked_rows_are_exact_zeros_with_finite_gradients(name, kwargs, dead, L_k):
    """A query with no admissible key: A and Z exactly 0, Y exactly b_O, every gradient
    finite, and the live rows unchanged by the dead ones (STYLE §5)."""
    layer = _layer()
    x = randn(N, L_Q, D, seed=1).requires_grad_()
    c = randn(N, L_k, D, seed=2).requires_grad_()
    Y, st = layer(x, c, return_intermediates=True, **kwargs)
    dead_rows = torch.zeros(N, L_Q, dtype=torch.bool)
    for n, t in dead:
        dead_rows[n, t] = True
    assert torch.equal(st["A"].permute(0, 2, 1, 3)[dead_rows],
                       torch.zeros(len(dead), H, L_k, dtype=F64))
    assert torch.equal(st["Z"].permute(0, 2, 1, 3)[dead_rows],
                       torch.zeros(len(dead), H, layer.d_head, dtype=F64))
    assert torch.equal(Y[dead_rows], layer.b_O.detach().expand(len(dead), D))
    live_sums = st["A"].sum(-1).permute(0, 2, 1)[~dead_rows]
    assert _close(live_sums, torch.ones_like(live_sums))

    (Y * randn(*Y.shape, seed=3)).sum().backward()
    for name_, t in [("x", x), ("context", c), *layer.named_parameters()]:
        assert t.grad is not None and torch.isfinite(t.grad).all(), name_
        assert t.grad.abs().sum() > 0, name_  # finite *and* alive: the live rows still learn


def test_torch_gives_nan_where_einattn_gives_zeros():
    """The documented difference, tested: ``nn.MultiheadAttention`` returns NaN weights and
    outputs for a fully masked query (its explicit-softmax path, need_weights=True), and NaN
    gradients for every parameter; einattn returns zeros and finite gradients."""
    layer = _layer()
    mha = layer.to_torch()
    x = randn(N, L_Q, D, seed=4)
    allowed = torch.ones(L_Q, L_Q, dtype=torch.bool)
    allowed[2] = False
    Y_t, A_t = mha(x, x, x, attn_mask=~allowed, need_weights=True, average_attn_weights=False)
    assert torch.isnan(A_t[:, :, 2]).all() and torch.isnan(Y_t[:, 2]).all()
    assert torch.isfinite(Y_t[:, [0, 1, 3, 4]]).all()
    Y_t.nan_to_num().sum().backward()  # even with the NaN output masked off
    assert torch.isnan(mha.in_proj_weight.grad).any()
    assert torch.isnan(mha.out_proj.weight.grad).any()

    Y, A = layer(x, mask=allowed, need_weights=True)
    assert torch.equal(A[:, :, 2], torch.zeros(N, H, L_Q, dtype=F64))
    assert torch.equal(Y[:, 2], layer.b_O.detach().expand(N, D))
    assert _close(Y[:, [0, 1, 3, 4]], Y_t[:, [0, 1, 3, 4]])
    Y.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters())


def test_nan_in_an_admissible_input_propagates():
    """Zeroing dead rows must not swallow a NaN that a live query really sees (STYLE §5)."""
    layer = _layer()
    x = randn(N, L_Q, D, seed=5)
    x[1, 3, 4] = float("nan")
    Y = layer(x, causal=True)
    assert torch.isnan(Y[1, 3:]).all()  # queries 3, 4 of sample 1 attend to key 3
    assert torch.isfinite(Y[0]).all()  # samples do not mix
    # (the earlier queries of sample 1 are NaN too, through 0·NaN in A·V, as in torch)
    M = torch.zeros(L_Q, L_Q, dtype=F64)
    M[2, 1] = float("nan")  # an admissible entry of a float mask
    Y = layer(randn(N, L_Q, D, seed=5), mask=M)
    assert torch.isnan(Y[:, 2]).all() and torch.isfinite(Y[:, [0, 1, 3, 4]]).all()


# -- dropout ---------------------------------------------------------------------------------


def test_dropout_is_off_in_eval_and_equals_a_dropout_free_layer():
    p = 0.37
    layer, plain = _layer(dropout=p), _layer(dropout=0.0)
    layer.eval()
    x = randn(N, L_Q, D, seed=6)
    Y1, A1 = layer(x, need_weights=True)
    Y2, A2 = layer(x, need_weights=True)
    assert torch.equal(Y1, Y2) and torch.equal(A1, A2)
    assert torch.equal(Y1, plain(x))
    assert _close(A1.sum(-1), torch.ones(N, H, L_Q, dtype=F64))


def test_dropout_in_training_drops_and_rescales_A():
    """In training, A as returned is the eval A with entries zeroed and the rest scaled by
    1/(1−p), and Y is computed from exactly that A."""
    p = 0.37
    layer = _layer(dropout=p)
    x = randn(N, L_Q, D, seed=6)
    layer.eval()
    Y_eval, A_eval = layer(x, need_weights=True)
    layer.train()
    torch.manual_seed(11)
    Y_train, st = layer(x, return_intermediates=True)
    A = st["A"]
    kept = A != 0
    assert 0 < (~kept).sum() < A.numel()  # some dropped, some kept
    assert _close(A[kept], A_eval[kept] / (1 - p))
    assert not _close(Y_train, Y_eval, 1e-3)
    Z = torch.einsum("nhts,nhsa->nhta", A, st["V"])
    assert _close(st["Z"], Z)
    torch.manual_seed(11)
    assert torch.equal(layer(x), Y_train)  # the same draw gives the same output


def test_dropout_weights_returned_by_need_weights_are_the_dropped_ones():
    layer = _layer(dropout=0.5)
    x = randn(N, L_Q, D, seed=8)
    torch.manual_seed(3)
    _, A = layer(x, need_weights=True)
    assert (A == 0).any() and ((A == 0) | (A > 0)).all()
    assert (A.sum(-1) > 1.0 + 1e-9).any()  # rescaled rows no longer sum to 1


# -- state, dtype, device --------------------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False])
def test_state_dict_round_trip(bias):
    layer = _layer(bias=bias, seed=1)
    sd = layer.state_dict()
    assert list(sd) == (["W", "W_O", "b", "b_O"] if bias else ["W", "W_O"])
    assert sd["W"].shape == (H * 3 * layer.d_head, D) and sd["W_O"].shape == (H, layer.d_head, D)
    fresh = MultiHeadAttention(D, H, bias=bias, dtype=F64)
    fresh.load_state_dict(sd)
    x = randn(N, L_Q, D, seed=9)
    assert torch.equal(fresh(x), layer(x))
    with pytest.raises(RuntimeError):  # a bias-free layer refuses biased weights and back
        MultiHeadAttention(D, H, bias=not bias, dtype=F64).load_state_dict(sd)


class _Doubled(nn.Module):
    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return 2 * t


@pytest.mark.parametrize("name", ["W", "W_O", "b", "b_O"])
def test_a_parametrized_weight_is_used_as_parametrized(name):
    """With ``torch.nn.utils.parametrize`` a weight leaves ``_parameters``; forward must read
    the parametrized value (here 2·weight), not skip the weight or read the stored one."""
    from torch.nn.utils import parametrize
    layer, doubled = _layer(seed=2), _layer(seed=2)
    with torch.no_grad():
        getattr(doubled, name).mul_(2)
    parametrize.register_parametrization(layer, name, _Doubled())
    x, context = randn(N, L_Q, D, seed=11), randn(N, L_K, D, seed=12)
    for impl in ("einsum", "sdpa", "chunked"):
        assert _close(layer(x, context, impl=impl), doubled(x, context, impl=impl))


def test_functional_call_runs_the_layer_on_the_weights_it_is_given():
    """``torch.func.functional_call`` swaps the tensors in ``_parameters`` for one call."""
    layer, other = _layer(seed=3), _layer(seed=4)
    x = randn(N, L_Q, D, seed=13)
    weights = {k: v.detach().clone().requires_grad_() for k, v in other.named_parameters()}
    Y = torch.func.functional_call(layer, weights, (x,))
    assert torch.equal(Y, other(x)) and not torch.equal(Y, layer(x))
    Y.sum().backward()
    assert all(w.grad is not None for w in weights.values())
    assert all(p.grad is None for p in layer.parameters())


def test_to_dtype_moves_every_parameter_and_keeps_the_function():
    layer = _layer(dtype=torch.float32)
    x = randn(N, L_Q, D, seed=10)
    Y32 = layer(x.float())
    layer.to(F64)
    assert {p.dtype for p in layer.parameters()} == {F64}
    Y64 = layer(x)
    assert Y64.dtype == F64 and _close(Y64, Y32.double(), 1e-5)


def test_to_device():
    """Moved to another device (``meta`` here, CUDA when present) every parameter goes, and
    the forward pass runs there with the right shapes."""
    layer = _layer()
    devices = [torch.device("meta")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    for device in devices:
        moved = _layer().to(device)
        assert {p.device.type for p in moved.parameters()} == {device.type}
        x = torch.randn(N, L_Q, D, dtype=F64, device=device)
        c = torch.randn(N, L_K, D, dtype=F64, device=device)
        Y, A = moved(x, c, causal=True, need_weights=True)
        assert Y.device.type == device.type
        assert Y.shape == (N, L_Q, D) and A.shape == (N, H, L_Q, L_K)
        if device.type == "cuda":
            x = randn(N, L_Q, D, seed=12)
            assert _close(moved(x.to(device)).cpu(), layer(x).cpu(), 1e-10)
    constructed = MultiHeadAttention(D, H, bias=True, device="meta")
    assert {p.device.type for p in constructed.parameters()} == {"meta"}


# Measured over 40 seeds (d_model=30, n_heads=5, L_q=11, L_k=13, causal, bias), error
# relative to max |float64 value|: float16 forward ≤ 8.7e-4, grads ≤ 1.9e-3; bfloat16
# forward ≤ 7.3e-3, grads ≤ 1.6e-2. The bounds below leave ~2.5× headroom.
LOW_PRECISION = {torch.float16: (2e-3, 5e-3), torch.bfloat16: (2e-2, 4e-2)}


@pytest.mark.parametrize("dtype", list(LOW_PRECISION), ids=["float16", "bfloat16"])
@pytest.mark.parametrize("seed", range(3))
def test_half_precision_on_cpu_against_float64(dtype, seed):
    fwd_tol, grad_tol = LOW_PRECISION[dtype]
    ref = _layer(seed=seed)
    low = MultiHeadAttention(D, H, bias=True, dtype=dtype)
    low.load_state_dict(ref.state_dict())  # load_state_dict converts to the layer's dtype
    assert {p.dtype for p in low.parameters()} == {dtype}
    x, c = randn(3, 11, D, seed=seed + 20), randn(3, 13, D, seed=seed + 21)
    G = randn(3, 11, D, seed=seed + 22)
    x64 = x.clone().requires_grad_()
    Y = ref(x64, c, causal=True)
    (Y * G).sum().backward()
    x_low = x.to(dtype).requires_grad_()
    Y_low = low(x_low, c.to(dtype), causal=True)
    (Y_low * G.to(dtype)).sum().backward()
    assert Y_low.dtype == dtype and x_low.grad.dtype == dtype
    assert _rel_err(Y_low, Y) <= fwd_tol
    assert _rel_err(x_low.grad, x64.grad) <= grad_tol
    for (name, p), p_low in zip(ref.named_parameters(), low.parameters(), strict=True):
        assert _rel_err(p_low.grad, p.grad) <= grad_tol, name


# -- empty sizes -----------------------------------------------------------------------------


def test_empty_batch():
    layer = _layer()
    x = torch.zeros(0, L_Q, D, dtype=F64, requires_grad=True)
    Y, A = layer(x, randn(0, L_K, D, seed=0), need_weights=True, causal=True)
    assert Y.shape == (0, L_Q, D) and A.shape == (0, H, L_Q, L_K)
    Y.sum().backward()
    assert x.grad.shape == x.shape


def test_empty_query_length():
    layer = _layer()
    Y, A = layer(torch.zeros(N, 0, D, dtype=F64), need_weights=True)
    assert Y.shape == (N, 0, D) and A.shape == (N, H, 0, 0)
    Y, A = layer(torch.zeros(N, 0, D, dtype=F64), randn(N, L_K, D, seed=1), need_weights=True,
                 causal=True)
    assert Y.shape == (N, 0, D) and A.shape == (N, H, 0, L_K)


@pytest.mark.parametrize("causal", [False, True])
def test_empty_context_gives_b_O(causal):
    """No key at all: every query is fully masked, so Y = b_O exactly, gradients finite."""
    layer = _layer()
    x = randn(N, L_Q, D, seed=2).requires_grad_()
    Y, A = layer(x, torch.zeros(N, 0, D, dtype=F64), need_weights=True, causal=causal)
    assert A.shape == (N, H, L_Q, 0)
    assert torch.equal(Y, layer.b_O.detach().expand(N, L_Q, D))
    Y.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))
    assert torch.equal(layer.b_O.grad, torch.full((D,), float(N * L_Q), dtype=F64))


# -- initialisation --------------------------------------------------------------------------

# Large enough that the sample statistics are tight: W has 3·μ·a·d_model = 3·7·11·60 entries.
INIT_SIZES = [(60, 5, None), (60, 7, 11)]


@pytest.mark.parametrize("d_model,n_heads,d_head", INIT_SIZES)
def test_init_torch_matches_nn_multihead_attention_bounds(d_model, n_heads, d_head):
    """W: xavier-uniform over (3·μ·a, d_model), bound √(6/(d_model + 3·μ·a)); W_O: uniform
    with bound 1/√(μ·a) (nn.Linear's, fan-in μ·a); biases 0. Uniform on ±bound has
    std bound/√3, and its extremes come near the bound."""
    torch.manual_seed(0)
    layer = MultiHeadAttention(d_model, n_heads, d_head=d_head, bias=True, dtype=F64)
    a = layer.d_head
    for W, bound in ((layer.W, math.sqrt(6 / (d_model + 3 * n_heads * a))),
                     (layer.W_O, 1 / math.sqrt(n_heads * a))):
        W = W.detach()
        assert W.abs().max() <= bound
        assert W.abs().max() >= 0.99 * bound
        assert abs(W.std().item() / (bound / math.sqrt(3)) - 1) < 0.05
        assert abs(W.mean().item()) < 0.05 * bound
    assert not layer.b.any() and not layer.b_O.any()


def test_init_torch_has_the_scale_of_nn_multihead_attention():
    """Same bounds as PyTorch's own layer, compared to the thing itself rather than to a
    formula: max |W| and std agree within sampling error."""
    torch.manual_seed(1)
    ours = MultiHeadAttention(60, 5)
    theirs = nn.MultiheadAttention(60, 5)
    for a, b in ((ours.W, theirs.in_proj_weight), (ours.W_O, theirs.out_proj.weight)):
        assert abs(a.detach().abs().max() / b.detach().abs().max() - 1) < 0.02
        assert abs(a.detach().std() / b.detach().std() - 1) < 0.05


def test_init_gpt2():
    torch.manual_seed(2)
    layer = MultiHeadAttention(60, 5, bias=True, init="gpt2", dtype=F64)
    for W in (layer.W, layer.W_O):
        assert abs(W.std().item() - 0.02) < 0.001
        assert abs(W.mean().item()) < 0.001
    assert not layer.b.any() and not layer.b_O.any()
    # reset_parameters switches scheme in place
    layer.reset_parameters("torch")
    assert abs(layer.W_O.std().item() - 1 / math.sqrt(60) / math.sqrt(3)) < 0.005


# -- conversions -----------------------------------------------------------------------------


@pytest.mark.parametrize("d_head", [None, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_projections_round_trip(bias, d_head):
    layer = _layer(d_head=d_head, bias=bias, seed=3)
    p = layer.projections()
    a = layer.d_head
    assert p.W_q.shape == p.W_k.shape == p.W_v.shape == (H * a, D)
    assert p.W_o.shape == (D, H * a)
    assert (p.b_q is None) == (not bias)
    back = MultiHeadAttention.from_projections(*p[:4], n_heads=H, b_q=p.b_q, b_k=p.b_k,
                                               b_v=p.b_v, b_o=p.b_o)
    assert back.d_head == a and back.W.dtype == F64
    for (name, mine), theirs in zip(layer.named_parameters(), back.parameters(), strict=True):
        assert torch.equal(mine, theirs), name
    q2 = back.projections()
    for u, v in zip(p, q2, strict=True):
        assert (u is None and v is None) or torch.equal(u, v)


def test_projections_are_the_reshape_layout():
    """Head μ's query rows of W[(μ B a) i] are rows μ·a … μ·a + a − 1 of W_q: check one
    entry by hand, so a swap of μ and a, or of B and μ, cannot hide."""
    layer = _layer(seed=4)
    p = layer.projections()
    a = layer.d_head
    W4 = layer.W.detach().reshape(H, 3, a, D)
    mu, k, i = 3, 2, 17
    assert p.W_q[mu * a + k, i] == W4[mu, 0, k, i]
    assert p.W_k[mu * a + k, i] == W4[mu, 1, k, i]
    assert p.W_v[mu * a + k, i] == W4[mu, 2, k, i]
    assert p.W_o[i, mu * a + k] == layer.W_O[mu, k, i]
    assert p.b_k[mu * a + k] == layer.b.reshape(H, 3, a)[mu, 1, k]


def test_from_projections_defaults_missing_biases_to_zero_and_passes_options():
    p = _layer(seed=5).projections()
    b_k = randn(H * 6, seed=6)
    layer = MultiHeadAttention.from_projections(*p[:4], n_heads=H, b_k=b_k, causal=True,
                                                dropout=0.25)
    assert layer.causal and layer.dropout == 0.25
    q = layer.projections()
    assert torch.equal(q.b_k, b_k)
    assert not q.b_q.any() and not q.b_v.any() and not q.b_o.any()


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("bias", [False, True])
def test_from_torch_to_torch_round_trip(bias, batch_first):
    torch.manual_seed(5)
    mha = nn.MultiheadAttention(D, H, bias=bias, batch_first=batch_first, dropout=0.125,
                                dtype=F64)
    if bias:
        with torch.no_grad():
            mha.in_proj_bias.normal_()
            mha.out_proj.bias.normal_()
    layer = MultiHeadAttention.from_torch(mha)
    assert (layer.b is None) == (not bias) and layer.dropout == 0.125
    assert layer.W.dtype == F64
    assert layer.batch_first is batch_first  # called as the module was, (L, n, d) or not
    back = layer.to_torch()
    assert back.batch_first is batch_first and back.dropout == 0.125 and back.num_heads == H
    for (name, p), q in zip(mha.named_parameters(), back.parameters(), strict=True):
        assert torch.equal(p, q), name
    mha.eval(), layer.eval(), back.eval()
    x = randn(N, L_Q, D, seed=13)
    with torch.no_grad():
        xt = x if batch_first else x.transpose(0, 1)
        Y_t = mha(xt, xt, xt, need_weights=False)[0]
        assert _close(layer(xt), Y_t)
        assert _close(back(xt, xt, xt, need_weights=False)[0], Y_t)


def test_from_torch_layer_options_override():
    mha = nn.MultiheadAttention(D, H, dropout=0.2)
    layer = MultiHeadAttention.from_torch(mha, dropout=0.0, causal=True)
    assert layer.dropout == 0.0 and layer.causal


def test_d_head_independent_of_d_model():
    """n_heads·d_head = 5·7 = 35 ≠ d_model = 30 works and matches the reshape reference."""
    layer = _layer(d_head=7, seed=6)
    assert layer.W.shape == (H * 3 * 7, D) and layer.W_O.shape == (H, 7, D)
    x, c = randn(N, L_Q, D, seed=14), randn(N, L_K, D, seed=15)
    Y, st = layer(x, c, causal=True, return_intermediates=True)
    assert st["Q"].shape == (N, H, L_Q, 7) and st["V"].shape == (N, H, L_K, 7)
    p = layer.projections()
    Y_r = reference.multi_head_attention(x, *p[:4], n_heads=H, context=c, causal=True,
                                         b_q=p.b_q, b_k=p.b_k, b_v=p.b_v, b_o=p.b_o)
    assert _close(Y, Y_r)
    with pytest.raises(EinattnError, match=r"n_heads·d_head = d_model, but 5·7 != 30"):
        layer.to_torch()  # PyTorch's layer cannot hold it


# -- intermediates, weights, causal ----------------------------------------------------------


def test_return_intermediates_shapes_and_identities():
    layer = _layer(d_head=4, seed=7)  # a = 4 ≠ d_model / n_heads
    x, c = randn(N, L_Q, D, seed=16), randn(N, L_K, D, seed=17)
    Y, st = layer(x, c, return_intermediates=True)
    a = 4
    shapes = {"Q": (N, H, L_Q, a), "K": (N, H, L_K, a), "V": (N, H, L_K, a),
              "S": (N, H, L_Q, L_K), "A": (N, H, L_Q, L_K), "Z": (N, H, L_Q, a),
              "Y_μ": (N, H, L_Q, D), "Y": (N, L_Q, D)}
    assert {k: tuple(v.shape) for k, v in st.items()} == shapes
    assert st["Y"] is Y or torch.equal(st["Y"], Y)
    assert _close(st["Y_μ"].sum(dim=1) + layer.b_O, Y)
    assert _close(st["A"].sum(-1), torch.ones(N, H, L_Q, dtype=F64))
    assert _close(st["A"], torch.softmax(st["S"], dim=-1))
    assert _close(st["S"], st["Q"] @ st["K"].transpose(-1, -2) / math.sqrt(a))
    assert _close(st["Z"], st["A"] @ st["V"])
    # Q from x, K and V from the context, each head its own rows of W
    W4, b4 = layer.W.detach().reshape(H, 3, a, D), layer.b.detach().reshape(H, 3, a)
    assert _close(st["Q"][:, 2], x @ W4[2, 0].T + b4[2, 0])
    assert _close(st["V"][:, 4], c @ W4[4, 2].T + b4[4, 2])
    # the same A with need_weights, and Y alone otherwise
    Y2, A2 = layer(x, c, need_weights=True)
    assert torch.equal(Y2, Y) and torch.equal(A2, st["A"])
    assert torch.equal(layer(x, c), Y)


def test_causal_constructor_default_and_per_call_override():
    causal_layer, plain_layer = _layer(seed=8, causal=True), _layer(seed=8)
    x = randn(N, L_Q, D, seed=18)
    Y_causal, A_causal = causal_layer(x, need_weights=True)
    Y_plain = plain_layer(x)
    assert not _close(Y_causal, Y_plain, 1e-3)
    future = ~torch.ones(L_Q, L_Q, dtype=torch.bool).tril()
    assert not A_causal[..., future].any() and A_causal[..., ~future].all()
    assert torch.equal(causal_layer(x, causal=False), Y_plain)
    assert torch.equal(plain_layer(x, causal=True), Y_causal)
    assert torch.equal(causal_layer(x, causal=None), Y_causal)


@pytest.mark.parametrize("L_q,L_k", [(3, 7), (7, 3), (1, 6)])
def test_causal_is_bottom_right_for_cross_attention(L_q, L_k):
    """Query τ sits at absolute position τ + L_k − L_q: the last query sees every key."""
    layer = _layer(seed=9)
    _, A = layer(randn(N, L_q, D, seed=19), randn(N, L_k, D, seed=20), causal=True,
                 need_weights=True)
    tau, sigma = torch.arange(L_q)[:, None], torch.arange(L_k)[None, :]
    allowed = sigma <= tau + (L_k - L_q)
    assert not A[..., ~allowed].any()
    live = allowed.any(-1)
    assert A[:, :, live][..., allowed[live]].all()
    assert (A[:, :, -1] > 0).all()


def test_extra_repr():
    layer = MultiHeadAttention(30, 5, d_head=7, bias=True, dropout=0.25, causal=True)
    assert layer.extra_repr() == ("d_model=30, n_heads=5, d_head=7, bias=True, dropout=0.25, "
                                  "causal=True, impl='einsum'")
    assert repr(MultiHeadAttention(30, 5, impl="sdpa")) == (
        "MultiHeadAttention(d_model=30, n_heads=5, d_head=6, bias=False, dropout=0.0, "
        "causal=False, impl='sdpa')")


# -- masks: polarity and rank ----------------------------------------------------------------


def test_bool_mask_true_means_may_attend():
    layer = _layer(seed=10)
    x, c = randn(N, L_Q, D, seed=21), randn(N, L_K, D, seed=22)
    only_key_4 = torch.zeros(L_Q, L_K, dtype=torch.bool)
    only_key_4[:, 4] = True
    _, A = layer(x, c, mask=only_key_4, need_weights=True)
    assert torch.equal(A[..., 4], torch.ones(N, H, L_Q, dtype=F64))
    _, A = layer(x, c, mask=~only_key_4, need_weights=True)
    assert not A[..., 4].any() and A[..., [0, 1, 2, 3, 5, 6]].all()


def test_key_padding_mask_true_means_padding():
    layer = _layer(seed=11)
    x, c = randn(N, L_Q, D, seed=23), randn(N, L_K, D, seed=24)
    kpm = torch.zeros(N, L_K, dtype=torch.bool)
    kpm[0, 5:] = True
    kpm[1, 0] = True
    _, A = layer(x, c, key_padding_mask=kpm, need_weights=True)
    assert not A[0, ..., 5:].any() and not A[1, ..., 0].any()
    assert A[0, ..., :5].all() and A[1, ..., 1:].all()
    # padding keys do not influence the output at all
    c2 = c.clone()
    c2[0, 5:] = 1e3
    assert _close(layer(x, c2, key_padding_mask=kpm), layer(x, c, key_padding_mask=kpm))


def test_float_mask_is_added_to_the_scores():
    layer = _layer(seed=12)
    x = randn(N, L_Q, D, seed=25)
    M = randn(N, H, L_Q, L_Q, seed=26)
    _, st = layer(x, mask=M, return_intermediates=True)
    assert _close(st["A"], torch.softmax(st["S"] + M, dim=-1))


def test_mask_ranks_and_broadcasting_agree():
    """The same pattern as (τ, σ), (n, τ, σ), (n, μ, τ, σ) and with size-1 axes."""
    layer = _layer(seed=13)
    x, c = randn(N, L_Q, D, seed=27), randn(N, L_K, D, seed=28)
    m2 = randn(L_Q, L_K, seed=29) > -0.4
    m2[:, 0] = True
    expected = layer(x, c, mask=m2)
    for m in (m2[None].expand(N, -1, -1), m2[None], m2[None, None],
              m2[None, None].expand(N, H, -1, -1), m2[None, None].expand(1, H, -1, -1)):
        assert torch.equal(layer(x, c, mask=m), expected), tuple(m.shape)
    f2 = torch.zeros(L_Q, L_K, dtype=F64).masked_fill(~m2, float("-inf"))
    assert _close(layer(x, c, mask=f2), expected)
    # a per-sample and a per-head mask really are per sample and per head
    m4 = torch.ones(N, H, L_Q, L_K, dtype=torch.bool)
    m4[1, 3] = m2
    _, A = layer(x, c, mask=m4, need_weights=True)
    _, A_full = layer(x, c, need_weights=True)
    _, A_m2 = layer(x, c, mask=m2, need_weights=True)
    assert torch.equal(A[1, 3], A_m2[1, 3])
    assert torch.equal(A[0], A_full[0]) and torch.equal(A[1, :3], A_full[1, :3])


def test_all_masks_combine():
    """mask, key_padding_mask and causal together block the union of what each blocks."""
    layer = _layer(seed=14)
    x, c = randn(N, L_Q, D, seed=30), randn(N, L_K, D, seed=31)
    m = randn(N, L_Q, L_K, seed=32) > -0.5
    kpm = randn(N, L_K, seed=33) > 0.6
    _, A = layer(x, c, mask=m, key_padding_mask=kpm, causal=True, need_weights=True)
    causal = torch.ones(L_Q, L_K, dtype=torch.bool).tril(L_K - L_Q)
    allowed = (m & ~kpm[:, None, :] & causal)[:, None].expand(N, H, L_Q, L_K)
    assert not A[~allowed].any()
    live = allowed.any(-1, keepdim=True).expand_as(allowed)
    assert A[allowed & live].all()


# -- gradcheck -------------------------------------------------------------------------------


def test_gradcheck_every_input_and_parameter():
    """Analytic gradients of the whole layer (cross-attention, mask with a fully masked row,
    causal, bias) against finite differences, float64."""
    d_model, n_heads, d_head = 6, 2, 5
    layer = _layer(d_model, n_heads, d_head=d_head, seed=15)
    W, W_O, b, b_O = (p.detach().clone().requires_grad_() for p in layer.parameters())
    x = randn(2, 3, d_model, seed=34).requires_grad_()
    c = randn(2, 4, d_model, seed=35).requires_grad_()
    mask = torch.ones(2, 3, 4, dtype=torch.bool)
    mask[0, 2] = False

    def f(x, c, W, W_O, b, b_O):
        return torch.func.functional_call(layer, {"W": W, "W_O": W_O, "b": b, "b_O": b_O},
                                          (x, c), {"mask": mask, "causal": True})

    assert torch.autograd.gradcheck(f, (x, c, W, W_O, b, b_O))


@pytest.mark.parametrize("n_kv_heads, bias", [(None, True), (2, False), (1, True)])
def test_from_fused_holds_copies_of_the_fused_weights(n_kv_heads, bias):
    torch.manual_seed(3)
    layer = MultiHeadAttention(24, 6, d_head=5, n_kv_heads=n_kv_heads, bias=bias, causal=True,
                               dtype=torch.float64)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()
    copy = MultiHeadAttention.from_fused(layer.W, layer.W_O, layer.b, layer.b_O,
                                         n_kv_heads=n_kv_heads, causal=True)
    assert (copy.n_heads, copy.d_head, copy.n_kv_heads) == (6, 5, layer.n_kv_heads)
    x = torch.randn(2, 7, 24, dtype=torch.float64)
    assert torch.equal(copy(x), layer(x))
    assert copy.W.data_ptr() != layer.W.data_ptr()  # a copy, not a view of the other's


def test_from_fused_with_one_bias_makes_the_other_zero():
    torch.manual_seed(4)
    W, W_O = torch.randn(90, 30, dtype=torch.float64), torch.randn(5, 6, 30, dtype=torch.float64)
    b_O = torch.randn(30, dtype=torch.float64)
    layer = MultiHeadAttention.from_fused(W, W_O, b_O=b_O)
    assert torch.equal(layer.b, torch.zeros(90, dtype=torch.float64))
    x = torch.randn(2, 4, 30, dtype=torch.float64)
    assert torch.equal(layer(x), MultiHeadAttention.from_fused(W, W_O)(x) + b_O)


@pytest.mark.parametrize("impl", ["einsum", "sdpa", "chunked"])
@pytest.mark.parametrize("n_kv_heads", [None, 2])
@pytest.mark.parametrize("masking", ["none", "causal", "bool", "float"])
def test_the_layer_runs_under_autocast(impl, n_kv_heads, masking):
    """``torch.autocast`` (bfloat16, on the default device): float32 parameters, bfloat16
    stages, float32 gradients; the output agrees with float32 to bfloat16's precision."""
    layer = MultiHeadAttention(24, 4, d_head=5, n_kv_heads=n_kv_heads, impl=impl,
                               dtype=torch.float32)
    x = randn(3, 7, 24, seed=40, dtype=torch.float32, requires_grad=True)
    allowed = randn(7, 7, seed=41) > -0.8
    allowed[:, 0] = True  # no fully masked row: bfloat16 is compared, not the guard
    kwargs = {"none": {}, "causal": {"causal": True}, "bool": {"mask": allowed},
              "float": {"mask": torch.zeros(7, 7).masked_fill(~allowed, float("-inf"))}}[masking]
    with torch.autocast(torch.get_default_device().type, dtype=torch.bfloat16):
        Y = layer(x, **kwargs)
    assert Y.dtype == torch.bfloat16
    Y.float().square().sum().backward()
    assert layer.W.grad.dtype == torch.float32 and torch.isfinite(layer.W.grad).all()
    expected = layer(x, **kwargs)
    scale = expected.abs().max().item()
    assert (Y.float() - expected).abs().max().item() <= 3e-2 * max(1.0, scale)


# -- what a PyTorch user brings: batch_first, torch's state dict, is_causal (issue 34, item 7) --


def _pair_by_layout(**options) -> tuple[MultiHeadAttention, MultiHeadAttention]:
    """The same weights, batch-first and sequence-first."""
    first = _layer(seed=21, **options)
    second = MultiHeadAttention(D, H, bias=True, dtype=F64, batch_first=False, **options)
    second.load_state_dict(first.state_dict())
    return first, second


def _t(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(0, 1)


@pytest.mark.parametrize("call", ["self", "context", "padding-mask-weights", "causal-stages"])
def test_batch_first_false_takes_and_gives_sequence_first(call):
    """x (L_q, n, d_model), context (L_k, n, d_model), Y (L_q, n, d_model): the batch-first
    layer's numbers; masks, key padding, weights and intermediates keep their indices."""
    bf, sf = _pair_by_layout()
    x, c = randn(N, L_Q, D, seed=22), randn(N, L_K, D, seed=23)
    kw = {"self": {}, "context": {}, "causal-stages": {"causal": True,
                                                       "return_intermediates": True},
          "padding-mask-weights": {"key_padding_mask": randn(N, L_K, seed=24) > 0.5,
                                   "mask": randn(N, L_Q, L_K, seed=25) > -0.5,
                                   "need_weights": True}}[call]
    context = None if call in ("self", "causal-stages") else c
    ours = sf(_t(x), None if context is None else _t(context), **kw)
    want = bf(x, context, **kw)
    if not isinstance(want, tuple):
        ours, want = (ours,), (want,)
    assert ours[0].shape == (L_Q, N, D) and _close(_t(ours[0]), want[0])
    if len(want) > 1:
        rest = want[1] if isinstance(want[1], dict) else {"A": want[1]}
        got = ours[1] if isinstance(ours[1], dict) else {"A": ours[1]}
        assert all(_close(got[k], rest[k]) for k in rest if k != "Y")


def test_batch_first_false_decodes_with_a_cache_and_converts_both_ways():
    bf, sf = _pair_by_layout(causal=True, rope="half")
    x = randn(N, L_K, D, seed=26)
    cache = KVCache()
    with torch.no_grad():
        steps = [sf(_t(x[:, :3]), cache=cache)] + [sf(_t(x[:, t:t + 1]), cache=cache)
                                                   for t in range(3, L_K)]
        assert _close(_t(torch.cat(steps, 0)), bf(x))
    plain = _pair_by_layout()[1]
    mha = plain.to_torch()
    assert mha.batch_first is False and MultiHeadAttention.from_torch(mha).batch_first is False
    with torch.no_grad():
        assert _close(mha(_t(x), _t(x), _t(x), need_weights=False)[0], plain(_t(x)))
    assert "batch_first=False" in repr(plain) and "batch_first" not in repr(bf)


def test_a_layer_pickled_before_batch_first_runs_batch_first():
    layer = _layer(seed=27)
    vars(layer).pop("batch_first")  # as torch.load gives back a layer saved before the option
    x = randn(N, L_Q, D, seed=28)
    assert layer.batch_first and _close(layer(x), _layer(seed=27)(x))


def _torch_state(**options) -> dict:
    return nn.MultiheadAttention(D, H, dtype=F64, **options).state_dict()


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("options, keys", [
    ({}, "in_proj_weight, in_proj_bias, out_proj.weight, out_proj.bias"),
    ({"bias": False}, "in_proj_weight, out_proj.weight"),
    ({"kdim": 7, "vdim": 7}, "in_proj_bias, q_proj_weight, k_proj_weight, v_proj_weight, "
                             "out_proj.weight, out_proj.bias"),
], ids=["fused", "no-bias", "kdim"])
def test_load_state_dict_of_nn_multihead_attention_points_to_from_torch(options, keys, strict):
    """torch's keys gave only torch's missing/unexpected-key error, or with strict=False
    loaded nothing and said nothing."""
    layer = _layer(seed=29)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    with pytest.raises(EinattnError, match=rf"this is nn.MultiheadAttention's state dict "
                                           rf"\({keys}\), not einattn's \(W, W_O, b, b_O\): "
                                           rf"load it into the nn.MultiheadAttention it came "
                                           rf"from and convert that module with "
                                           rf"MultiHeadAttention.from_torch\(mha\)"):
        layer.load_state_dict(_torch_state(**options), strict=strict)
    assert all(torch.equal(v, before[k]) for k, v in layer.state_dict().items())


def test_a_torch_state_dict_inside_a_model_is_named_by_its_prefix():
    model = nn.ModuleDict({"attn": _layer(seed=30)})
    torch_state = {f"attn.{k}": v for k, v in _torch_state().items()}
    with pytest.raises(EinattnError, match=r"\(attn.in_proj_weight, .*\), not einattn's "
                                           r"\(attn.W, attn.W_O, attn.b, attn.b_O\)"):
        model.load_state_dict(torch_state)


def test_einattn_state_dicts_load_strict_and_not():
    source, target = _layer(seed=31), _layer(seed=32)
    target.load_state_dict(source.state_dict())
    assert all(torch.equal(a, b)
               for a, b in zip(target.parameters(), source.parameters(), strict=True))
    partial = {k: v for k, v in _layer(seed=33).state_dict().items() if k != "b_O"}
    result = target.load_state_dict({**partial, "extra": torch.ones(1)}, strict=False)
    assert result.missing_keys == ["b_O"] and result.unexpected_keys == ["extra"]
    assert torch.equal(target.W, _layer(seed=33).W) and torch.equal(target.b_O, source.b_O)
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"b_O\""):
        target.load_state_dict(partial)


IS_CAUSAL = r"is_causal is PyTorch's name; einattn's is causal \(got is_causal=True\): pass " \
            r"causal=True \(causal=True aligns the causal mask bottom-right where L_q ≠ L_k\)"


@pytest.mark.parametrize("call", [
    lambda: _layer()(randn(N, L_Q, D, seed=34), is_causal=True),
    lambda: F.attention(*(randn(N, H, L_Q, 6, seed=35),) * 3, is_causal=True),
    lambda: F.multi_head_attention(randn(N, L_Q, D, seed=36), torch.ones(90, D, dtype=F64),
                                   torch.ones(H, 6, D, dtype=F64), n_heads=H, is_causal=True),
], ids=["layer", "attention", "multi_head_attention"])
def test_is_causal_is_refused_with_einattns_name(call):
    """It was a TypeError (an unexpected keyword) that named neither einattn's word nor how
    einattn aligns it."""
    with pytest.raises(EinattnError, match=IS_CAUSAL):
        call()
