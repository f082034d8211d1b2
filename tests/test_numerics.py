"""The numerics contract where it is hardest to keep: gradients in float16, bfloat16 and
under autocast against float64, second derivatives, ``torch.func`` transforms, forward-mode
AD, devices checked after a cached call, and NaN behind a mask.

Each comparison is against the reshape-based textbook form (``einattn.reference``) in
float64 with the same weights. The tolerances per dtype are those of docs/masks.md's
numerics table: the relative error ``‖g − g₆₄‖ / ‖g₆₄‖`` of every gradient.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import TOL, assert_close_scaled, here, randn

from einattn import EinattnError, Equation, MultiHeadAttention, reference

F64 = torch.float64
IMPLS = ("einsum", "sdpa", "chunked")
N, L, D, H = 2, 11, 30, 5  # d_head = 6: all sizes distinct
BF16 = torch.bfloat16
# Relative error ‖g − g₆₄‖ / ‖g₆₄‖ of the output and of x's gradient, where g₆₄ is computed
# in float64 from the same rounded inputs and weights (docs/masks.md, "Numerics").
GRAD_TOL = {torch.float16: 1e-3, BF16: 1e-2, "autocast": 1e-2}
# (scale of x, causal): ×100 makes attention nearly one-hot, where the chunked path's
# gradients were 1.6 (float16) and 8.6 (bfloat16) off and 2.5e12 under autocast with a bias.
CASES = [(1, False), (1, True), (100, True)]
# Near ties (×10, ×100 without causal) rounding Q and K alone moves bfloat16 gradients by
# 0.1–0.6 in every implementation, SDPA's included: there each impl is held to SDPA's error.
HARD = [(10, False), (100, False), (100, True)]


def layer_pair(impl: str, dtype, *, bias: bool = False, rounded=None, **options):
    """A layer in ``dtype`` with random weights (biases too) and a float64 copy of it whose
    weights are those same numbers (rounded to ``rounded`` first, if given)."""
    torch.manual_seed(0)
    low = MultiHeadAttention(D, H, dtype=dtype, bias=bias, impl=impl, block_size=4, **options)
    if bias:
        with torch.no_grad():
            low.b.normal_()
            low.b_O.normal_()
    exact = MultiHeadAttention(D, H, dtype=F64, bias=bias, impl=impl, block_size=4, **options)
    exact.load_state_dict({k: v.to(rounded or dtype).double()
                           for k, v in low.state_dict().items()})
    return exact, low


def reference_grads(layer, x, **call):
    """The output and x's gradient of ``Σ Y²/2``, by the textbook form in float64."""
    p = layer.projections()
    x = x.detach().double().requires_grad_()
    names = ("b_q", "b_k", "b_v", "b_o")
    Y = reference.multi_head_attention(x, *p[:4], n_heads=H, **call,
                                       **dict(zip(names, p[4:], strict=True)))
    (Y.square().sum() / 2).backward()
    return Y.detach(), x.grad


def low_precision_errors(impl, dtype, scale, causal, *, bias=False):
    """The relative errors of Y and of x's gradient in ``dtype`` ("autocast": float32 weights
    under bfloat16 autocast on the default device) against float64 on the same rounded numbers."""
    rounded = BF16 if dtype == "autocast" else dtype
    exact, low = layer_pair(impl, torch.float32 if dtype == "autocast" else dtype, bias=bias,
                            rounded=rounded, causal=causal)
    x = randn(N, L, D, seed=1) * scale
    Y64, g64 = reference_grads(exact, x.to(rounded), causal=causal)
    x_low = x.to(torch.float32 if dtype == "autocast" else dtype).requires_grad_()
    with torch.autocast(torch.get_default_device().type, dtype=BF16,
                        enabled=dtype == "autocast"):
        Y = low(x_low)
    (Y.float().square().sum() / 2).backward()
    assert Y.dtype == rounded  # bfloat16 under autocast, with or without a bias
    return relative(Y.detach(), Y64), relative(x_low.grad, g64)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("scale, causal", CASES)
@pytest.mark.parametrize("dtype", [torch.float16, BF16, "autocast"], ids=str)
@pytest.mark.parametrize("impl", IMPLS)
def test_low_precision_outputs_and_gradients_are_within_tolerance(impl, dtype, scale, causal):
    errors = low_precision_errors(impl, dtype, scale, causal)
    assert max(errors) < GRAD_TOL[dtype], errors


@pytest.mark.parametrize("impl", IMPLS)
def test_bfloat16_autocast_with_a_bias(impl):
    """A float32 bias used to promote Q, K, V and Y to float32 under autocast; the chunked
    path then scored bfloat16 forward and float32 backward (x's gradient 2.5e12 at ×100,
    a near tie where SDPA's own error is 0.9: see the next test)."""
    errors = low_precision_errors(impl, "autocast", 1, True, bias=True)
    assert max(errors) < GRAD_TOL["autocast"], errors


@pytest.mark.parametrize("scale, causal", HARD)
@pytest.mark.parametrize("dtype", [torch.float16, BF16, "autocast"], ids=str)
@pytest.mark.parametrize("impl", ["einsum", "chunked"])
@pytest.mark.parametrize("bias", [False, True])
def test_near_ties_no_implementation_is_worse_than_sdpa(impl, dtype, scale, causal, bias):
    errors = low_precision_errors(impl, dtype, scale, causal, bias=bias)
    sdpa = low_precision_errors("sdpa", dtype, scale, causal, bias=bias)
    # NaN where SDPA's is NaN too: on CUDA x's float16 gradient at ×100 with a bias overflows
    # in the projection's GEMMs (float16 reductions), whichever impl attends
    assert all(e <= 1.5 * s + GRAD_TOL[dtype] or math.isnan(s)
               for e, s in zip(errors, sdpa, strict=True)), (errors, sdpa)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("impl", IMPLS)
def test_a_large_float_mask_is_added_in_the_softmax_precision(impl, dtype):
    """A row masked by −1e4 everywhere keeps its softmax: the einsum path added S + M in the
    low dtype and lost it (0.27 off in both)."""
    exact, low = layer_pair(impl, dtype)
    x = randn(N, L, D, seed=3)
    M = torch.zeros(L, L, dtype=F64)
    M[3] = -1e4
    expected = exact(x, mask=M)
    assert relative(low(x.to(dtype), mask=M.to(dtype)).detach(), expected.detach()) < \
        GRAD_TOL[dtype]


@pytest.mark.parametrize("impl", IMPLS)
def test_float16_scores_past_65504_do_not_overflow(impl):
    """x × 1000: the scores exceed float16's range; float32 scores (as SDPA's) keep it
    finite, where einsum and chunked returned inf and NaN. Attention is then nearly one-hot,
    so the error is the projection's (in float16 GEMMs, on CUDA with float16 reductions):
    within 1e-2 on the CPU, and no impl worse than SDPA on any device."""
    def error(impl):
        exact, low = layer_pair(impl, torch.float16)
        x = randn(N, L, D, seed=4) * 1000
        Y = low(x.half())
        assert torch.isfinite(Y).all()
        return relative(Y.detach(), exact(x).detach())

    assert error(impl) < max(1e-2, 1.5 * error("sdpa"))


# -- second derivatives and the torch.func transforms -----------------------------------------


def small_layer(impl: str) -> tuple[MultiHeadAttention, torch.Tensor]:
    torch.manual_seed(5)
    layer = MultiHeadAttention(6, 2, dtype=F64, impl=impl, block_size=2, causal=True)
    return layer, randn(1, 3, 6, seed=6)


def textbook(layer: MultiHeadAttention):
    p = layer.projections()
    return lambda x: reference.multi_head_attention(x, *p[:4], n_heads=2, causal=True)


@pytest.mark.parametrize("impl", ["einsum", "chunked"])
def test_hessians_equal_the_textbook_forms(impl):
    """The chunked path's Hessian was silently zero: its backward read the saved lse, which
    has no graph. Now create_graph runs a backward that autograd can differentiate."""
    layer, x = small_layer(impl)
    H = torch.autograd.functional.hessian(lambda x: layer(x).square().sum(), x)
    expected = torch.autograd.functional.hessian(
        lambda x: textbook(layer)(x).square().sum(), x)
    assert expected.abs().max() > 0.1
    assert_close_scaled(H, expected, TOL[F64])


def test_sdpa_second_derivatives_are_refused_by_name_not_zero():
    """PyTorch's fused SDPA kernels have no double backward: the Hessian raises an
    EinattnError naming the impls that have one (it was torch's 'derivative for
    aten::_scaled_dot_product_flash_attention_for_cpu_backward is not implemented'),
    while a first derivative is unchanged."""
    layer, x = small_layer("sdpa")
    with pytest.raises(EinattnError, match=r"impl='sdpa' has no second derivative .* "
                                           r"impl='einsum' or impl='chunked'"):
        torch.autograd.functional.hessian(lambda x: layer(x).square().sum(), x)
    x = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(layer(x).square().sum(), x)
    x_ref = x.detach().clone().requires_grad_()
    (g_ref,) = torch.autograd.grad(textbook(layer)(x_ref).square().sum(), x_ref)
    assert_close_scaled(g, g_ref, TOL[F64])


@pytest.mark.parametrize("impl", IMPLS)
def test_torch_func_grad_vmap_and_jvp_run_on_every_impl(impl):
    """vmap(grad) and jvp equal the textbook form's: chunked's Function had no
    setup_context, SDPA's CPU kernel no forward-mode rule."""
    layer, _ = small_layer(impl)
    xs, v = randn(4, 3, 6, seed=7), randn(1, 3, 6, seed=8)
    ref = textbook(layer)

    def total(f):
        return lambda x: f(x[None]).square().sum()

    grads = torch.func.vmap(torch.func.grad(total(layer)))(xs)
    assert_close_scaled(grads, torch.func.vmap(torch.func.grad(total(ref)))(xs), TOL[F64])
    _, tangent = torch.func.jvp(layer, (xs[:1],), (v,))
    _, expected = torch.func.jvp(ref, (xs[:1],), (v,))
    assert_close_scaled(tangent, expected, TOL[F64])


def test_forward_mode_ad_does_not_depend_on_the_size_of_the_scores():
    """Above 1 MiB of scores the einsum path writes its softmax in place, through a Function
    without a jvp: forward-mode AD raised there and only there."""
    fwad = torch.autograd.forward_ad
    torch.manual_seed(9)
    layer = MultiHeadAttention(12, 2, dtype=F64)
    for L_ in (5, 400):  # 2·2·400² float64 scores = 5 MiB
        x, v = randn(2, L_, 12, seed=10), randn(2, L_, 12, seed=11)
        with fwad.dual_level():
            tangent = fwad.unpack_dual(layer(fwad.make_dual(x, v))).tangent
        eps = 1e-6
        numeric = (layer(x + eps * v) - layer(x - eps * v)) / (2 * eps)
        assert_close_scaled(tangent.detach(), numeric.detach(), 1e-7)


# -- devices, checked on every call -------------------------------------------------------------


def test_the_device_of_every_operand_is_checked_after_a_cached_call():
    scores = Equation("S[n μ τ σ] = Q[n μ τ a] K[n μ σ a] / √a")
    Q, K = torch.ones(2, 3, 4, 5), torch.ones(2, 3, 6, 5)
    scores(Q=Q, K=K)  # planned and cached for these shapes
    with pytest.raises(Exception, match=f"K is on meta but Q is on {here()}"):
        scores(Q=Q, K=K.to("meta"))


@pytest.mark.parametrize("impl", IMPLS)
def test_a_meta_input_or_mask_after_a_cached_call_is_refused(impl):
    layer = MultiHeadAttention(D, H, impl=impl)
    x, mask = torch.ones(N, L, D), torch.ones(L, L, dtype=torch.bool)
    layer(x, mask=mask)
    with pytest.raises(Exception, match=f"x is on meta but the layer's W is on {here()}"):
        layer(x.to("meta"))
    with pytest.raises(Exception, match=f"mask is on meta but the scores are on {here()}"):
        layer(x, mask=mask.to("meta"))


# -- NaN behind a mask ---------------------------------------------------------------------------

NAN_AT = 7  # the token whose input is NaN, in sample 0


def masked_nan_cases():
    pad = torch.zeros(N, L, dtype=torch.bool)
    pad[0, NAN_AT] = True
    column = torch.ones(L, L, dtype=torch.bool)
    column[:, NAN_AT] = False
    additive = torch.zeros(L, L, dtype=F64).masked_fill(~column, -math.inf)
    rows_before = torch.arange(L) < NAN_AT  # the queries of the causal past
    every = torch.arange(L) != NAN_AT  # the NaN token's own query is NaN: it propagates
    return {"padding": ({"key_padding_mask": pad}, every),
            "bool mask": ({"mask": column}, every),
            "float mask": ({"mask": additive}, every),
            "causal future": ({"causal": True}, rows_before)}


@pytest.mark.cpu_only("a NaN behind a mask is kept from other queries on the CPU "
                      "only (the check would sync a GPU)")
@pytest.mark.parametrize("case", list(masked_nan_cases()))
@pytest.mark.parametrize("impl", IMPLS)
def test_a_nan_behind_the_mask_reaches_no_query_that_cannot_see_it(impl, case):
    """Token 7 of sample 0 is NaN. Every query that may not attend to it gets the output it
    gets when token 7 holds any finite value (0 · NaN in equation (4) used to spread it);
    a query that may attend to it is NaN; sample 1 is untouched."""
    call, clean_rows = masked_nan_cases()[case]
    torch.manual_seed(12)
    layer = MultiHeadAttention(D, H, dtype=F64, impl=impl, block_size=4)
    x = randn(N, L, D, seed=13)
    poisoned, finite = x.clone(), x.clone()
    poisoned[0, NAN_AT] = math.nan
    finite[0, NAN_AT] = 1e3
    Y, expected = layer(poisoned, **call), layer(finite, **call)
    assert_close_scaled(Y[0, clean_rows], expected[0, clean_rows], TOL[F64])
    assert torch.isnan(Y[0, ~clean_rows]).all()
    assert_close_scaled(Y[1], expected[1], TOL[F64])


@pytest.mark.cpu_only("a NaN behind a mask is kept from other queries on the CPU "
                      "only (the check would sync a GPU)")
@pytest.mark.parametrize("impl", IMPLS)
def test_a_nan_in_a_padded_context_token_stays_out_of_cross_attention(impl):
    torch.manual_seed(14)
    layer = MultiHeadAttention(D, H, dtype=F64, impl=impl, block_size=4)
    x, context = randn(N, 5, D, seed=15), randn(N, L, D, seed=16)
    pad = torch.zeros(N, L, dtype=torch.bool)
    pad[:, -2:] = True
    poisoned = context.clone()
    poisoned[:, -2:] = math.inf
    assert_close_scaled(layer(x, poisoned, key_padding_mask=pad),
                        layer(x, context, key_padding_mask=pad), TOL[F64])


@pytest.mark.cpu_only("a NaN behind a mask is kept from other queries on the CPU "
                      "only (the check would sync a GPU)")
@pytest.mark.parametrize("impl", IMPLS)
def test_nan_in_an_admissible_input_still_propagates(impl):
    torch.manual_seed(17)
    layer = MultiHeadAttention(D, H, dtype=F64, impl=impl)
    x = randn(N, L, D, seed=18)
    x[1, 2] = math.nan
    Y = layer(x, causal=True)
    assert torch.isnan(Y[1, 2:]).all() and torch.isfinite(Y[1, :2]).all()
    assert torch.isfinite(Y[0]).all()
