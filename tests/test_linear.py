"""einattn.linear: linear attention (L1)–(L7) equals its quadratic form and an explicit loop
in float64, values and gradients; the cheap order is the one that runs; bad inputs are
named; docs/linear.md shows the equations the code runs."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import TOL, assert_close_scaled, here, randn

from einattn import EinattnError, Equation, MultiHeadAttention, layouts, linear
from einattn.derivation import Step
from einattn.verify import assert_equivalent, check_equivalent

F64 = torch.float64
TOL64 = TOL[F64]
# All distinct: n, μ, τ = σ, a, c; and L_q ≠ L_k both ways for cross-attention.
N, MU, L, A, C = 2, 3, 7, 5, 4
LENGTHS = [(7, 7), (6, 9), (9, 6)]
DOC = Path(__file__).resolve().parent.parent / "docs" / "linear.md"


def qkv(L_q=L, L_k=L, *, heads=MU, kv_heads=None, a=A, c=C, seed=0, dtype=F64,
        requires_grad=False):
    g = heads if kv_heads is None else kv_heads
    return (randn(N, heads, L_q, a, seed=seed, dtype=dtype, requires_grad=requires_grad),
            randn(N, g, L_k, a, seed=seed + 1, dtype=dtype, requires_grad=requires_grad),
            randn(N, g, L_k, c, seed=seed + 2, dtype=dtype, requires_grad=requires_grad))


def loop_reference(Q, K, V, *, causal, phi=linear.elu_plus_one):
    """Z[τ] = Σ_σ w(τ, σ) V[σ] / Σ_σ w(τ, σ), w = φ(Q[τ])·φ(K[σ]) over the visible keys,
    one query and one key at a time; heads of K repeated for grouped keys."""
    n, heads, L_q, _ = Q.shape
    L_k, r = K.shape[2], heads // K.shape[1]
    Z = torch.zeros(n, heads, L_q, V.shape[-1], dtype=Q.dtype)
    for b in range(n):
        for h in range(heads):
            for t in range(L_q):
                visible = range(min(L_k, t + L_k - L_q + 1)) if causal else range(L_k)
                if len(visible) == 0:
                    continue
                w = {s: torch.dot(phi(Q[b, h, t]), phi(K[b, h // r, s])) for s in visible}
                Z[b, h, t] = sum(w[s] * V[b, h // r, s] for s in visible) / sum(w.values())
    return Z


# -- equality with the quadratic form and with the loop ------------------------------------

@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("L_q, L_k", LENGTHS, ids=lambda n: str(n))
def test_equals_quadratic_form_float64(causal, L_q, L_k):
    Q, K, V = qkv(L_q, L_k)
    assert_close_scaled(linear.linear_attention(Q, K, V, causal=causal),
                        linear.quadratic_form(Q, K, V, causal=causal), TOL64)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("L_q, L_k", [*LENGTHS, (1, 1), (3, 0), (0, 3)], ids=lambda n: str(n))
def test_quadratic_form_equals_the_loop(causal, L_q, L_k):
    Q, K, V = qkv(L_q, L_k, seed=3)
    expected = loop_reference(Q, K, V, causal=causal)
    assert_close_scaled(linear.quadratic_form(Q, K, V, causal=causal), expected, TOL64)
    assert_close_scaled(linear.linear_attention(Q, K, V, causal=causal), expected, TOL64)


def test_causal_differs_from_full_except_for_the_last_query():
    Q, K, V = qkv()
    full = linear.linear_attention(Q, K, V)
    causal = linear.linear_attention(Q, K, V, causal=True)
    assert_close_scaled(causal[:, :, -1], full[:, :, -1], TOL64)
    assert (causal[:, :, :-1] - full[:, :, :-1]).abs().amax(dim=-1).gt(1e-6).all()


def test_first_causal_query_reads_only_the_first_key():
    Q, K, V = qkv()
    Z = linear.linear_attention(Q, K, V, causal=True)
    assert_close_scaled(Z[:, :, 0], V[:, :, 0], TOL64)  # one weight, normalised to 1


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("L_q, L_k", LENGTHS[:2], ids=lambda n: str(n))
def test_grouped_keys_equal_repeated_heads(causal, L_q, L_k):
    heads, g = 12, 3  # r = 4 query heads per group
    Q, K, V = qkv(L_q, L_k, heads=heads, kv_heads=g, seed=5)
    grouped = linear.linear_attention(Q, K, V, causal=causal)
    K4, V4 = (t.repeat_interleave(heads // g, dim=1) for t in (K, V))
    assert_close_scaled(grouped, linear.linear_attention(Q, K4, V4, causal=causal), TOL64)
    assert_close_scaled(grouped, linear.quadratic_form(Q, K, V, causal=causal), TOL64)
    assert_close_scaled(grouped, loop_reference(Q, K, V, causal=causal), TOL64)


def test_grouped_query_head_reads_its_own_group():
    """μ = (g r): query head 5 with r = 2 reads group 2, not group 5 // 3 = 1."""
    Q, K, V = qkv(heads=6, kv_heads=3, seed=8)
    Z = linear.linear_attention(Q, K, V)
    alone = linear.linear_attention(Q[:, 5:6], K[:, 2:3], V[:, 2:3])
    assert_close_scaled(Z[:, 5:6], alone, TOL64)


def test_float32_against_the_float64_reference():
    Q, K, V = qkv(9, 6, dtype=torch.float32)
    Z = linear.linear_attention(Q, K, V, causal=True)
    expected = linear.quadratic_form(*(t.double() for t in (Q, K, V)), causal=True)
    assert_close_scaled(Z.double(), expected, TOL[torch.float32])


# -- gradients ------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("L_q, L_k", LENGTHS, ids=lambda n: str(n))
def test_gradients_equal_the_quadratic_forms(causal, L_q, L_k):
    grads = []
    for form in (linear.linear_attention, linear.quadratic_form):
        Q, K, V = qkv(L_q, L_k, requires_grad=True)
        dZ = randn(N, MU, L_q, C, seed=9)
        (form(Q, K, V, causal=causal) * dZ).sum().backward()
        grads.append((Q.grad, K.grad, V.grad))
    for got, expected in zip(*grads, strict=True):
        assert_close_scaled(got, expected, TOL64)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gradcheck(causal):
    Q, K, V = (randn(1, 2, L_, d, seed=s, requires_grad=True)
               for s, (L_, d) in enumerate([(3, 4), (5, 4), (5, 2)]))
    assert torch.autograd.gradcheck(
        lambda q, k, v: linear.linear_attention(q, k, v, causal=causal), (Q, K, V))


def saved_for_backward(f):
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        f()
    return saved


def test_the_cheap_order_runs_and_nothing_L_q_by_L_k_is_saved():
    L_q, L_k = 48, 80
    Q, K, V = qkv(L_q, L_k, requires_grad=True)
    saved = saved_for_backward(lambda: linear.linear_attention(Q, K, V))
    assert saved and not [s for s in saved if L_q in s and L_k in s]
    quadratic = saved_for_backward(lambda: linear.quadratic_form(Q, K, V))
    assert [s for s in quadratic if s[-2:] == (L_q, L_k)]  # the check can see an L × L


# -- feature maps, ε and NaN --------------------------------------------------------------

def positive_pair(x):
    """A custom map that doubles the feature width: [exp(x), exp(−x)] / 2."""
    return torch.cat([x.exp(), (-x).exp()], dim=-1) / 2


@pytest.mark.parametrize("phi", [F.softplus, positive_pair], ids=["softplus", "pair"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_custom_feature_map(phi, causal):
    Q, K, V = qkv(6, 9, seed=11)
    Z = linear.linear_attention(Q, K, V, feature_map=phi, causal=causal)
    assert_close_scaled(Z, linear.quadratic_form(Q, K, V, feature_map=phi, causal=causal),
                        TOL64)
    assert_close_scaled(Z, loop_reference(Q, K, V, causal=causal, phi=phi), TOL64)
    default = linear.linear_attention(Q, K, V, causal=causal)
    assert (Z - default).abs().max() > 1e-3  # the map is used


def test_elu_plus_one_is_elu_plus_one_without_cancellation():
    x = torch.linspace(-30, 30, 601, dtype=F64, requires_grad=True)
    y = linear.elu_plus_one(x)
    assert_close_scaled(y, F.elu(x) + 1, 1e-15)
    (gy,) = torch.autograd.grad(y.sum(), x)
    (ge,) = torch.autograd.grad((F.elu(x) + 1).sum(), x)
    assert_close_scaled(gy, ge, 1e-15)
    far = torch.tensor([-50.0, -700.0], dtype=F64)
    assert (F.elu(far) + 1 == 0).all()  # the naive form cancels to zero
    assert torch.equal(linear.elu_plus_one(far), far.exp()) and (far.exp() > 0).all()


def test_elu_plus_one_propagates_nan_and_has_finite_gradients_for_large_inputs():
    assert linear.elu_plus_one(torch.tensor([float("nan")])).isnan().all()
    x = torch.tensor([1000.0, -1000.0], dtype=F64, requires_grad=True)
    (grad,) = torch.autograd.grad(linear.elu_plus_one(x).sum(), x)
    assert torch.equal(grad, torch.tensor([1.0, 0.0], dtype=F64))


def test_no_epsilon_a_vanishing_normaliser_shows():
    """relu features of all-negative queries give D = 0 for a query that sees keys: NaN
    (0/0) in both forms, not a silent zero."""
    Q, K, V = qkv(seed=12)
    Q = -Q.abs()
    for form in (linear.linear_attention, linear.quadratic_form):
        assert form(Q, K, V, feature_map=F.relu).isnan().all()


def test_no_epsilon_the_normalised_weights_sum_to_one():
    """With V ≡ 1 every output is exactly the sum of the normalised weights: 1, up to
    rounding; an ε in D would leave ε/D short of it."""
    Q, K, _ = qkv()
    ones = torch.ones(N, MU, L, C, dtype=F64)
    for causal in (False, True):
        assert_close_scaled(linear.linear_attention(Q, K, ones, causal=causal), ones, TOL64)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_nan_in_a_key_reaches_exactly_the_queries_that_see_it(causal):
    Q, K, V = qkv()
    K = K.clone()
    K[:, :, 4, 0] = float("nan")
    Z = linear.linear_attention(Q, K, V, causal=causal)
    sees = torch.arange(L) >= 4 if causal else torch.ones(L, dtype=torch.bool)
    assert Z.isnan().all(dim=-1).eq(sees).all()
    assert_close_scaled(Z, linear.quadratic_form(Q, K, V, causal=causal), TOL64)


@pytest.mark.parametrize("L_q, L_k, causal, blind", [(5, 0, False, 5), (5, 0, True, 5),
                                                      (9, 6, True, 3)])
def test_queries_that_see_no_key_are_exact_zeros_with_zero_gradients(L_q, L_k, causal, blind):
    for form in (linear.linear_attention, linear.quadratic_form):
        Q, K, V = qkv(L_q, L_k, requires_grad=True)
        Z = form(Q, K, V, causal=causal)
        assert torch.equal(Z[:, :, :blind], torch.zeros_like(Z[:, :, :blind]))
        assert Z[:, :, blind:].ne(0).all()
        Z.sum().backward()
        assert Q.grad[:, :, :blind].eq(0).all() and Q.grad.isfinite().all()
        assert all(t.grad is None or t.grad.isfinite().all() for t in (K, V))


# -- orders and explain() --------------------------------------------------------------------

def test_orders_formulas_and_the_cheap_choice_at_long_lengths():
    n, mu, tau, sigma, a, c = 2, 3, 600, 700, 5, 4
    o = linear.orders(n=n, μ=mu, τ=tau, σ=sigma, a=a, c=c)
    assert o.quadratic == 2 * n * mu * tau * sigma * (a + c)
    assert o.linear == 2 * n * mu * (sigma + tau) * a * c
    assert o.chosen == "linear" and o.explanation.flops == o.linear
    assert o.explanation.path == [(1, 2), (0, 1)]
    assert o.explanation.largest_intermediate == n * mu * tau * c  # no τ × σ anywhere
    assert o.sizes == {"n": n, "μ": mu, "τ": tau, "σ": sigma, "a": a, "c": c}


def test_orders_short_sequences_take_the_weights_first():
    o = linear.orders(n=2, μ=3, τ=2, σ=3, a=64, c=48)
    assert o.chosen == "quadratic" and o.explanation.flops == o.quadratic < o.linear
    assert o.explanation.path == [(0, 1), (0, 1)]


def test_orders_prints_both_orders_and_marks_the_chosen_one():
    text = str(linear.orders(n=2, μ=3, τ=7, σ=7, a=5, c=4))
    assert "at n=2, μ=3, τ=7, σ=7, a=5, c=4" in text
    assert "(phi_Q phi_K) V             5,292 FLOPs   quadratic in L\n" in text
    assert "phi_Q (phi_K V)             3,360 FLOPs   linear in L <- opt_einsum" in text


def test_orders_needs_every_size():
    with pytest.raises(EinattnError, match="no size for index 'c'"):
        linear.orders(n=2, μ=3, τ=7, σ=7, a=5)
    with pytest.raises(EinattnError, match="'g' is not an index of"):
        linear.orders(n=2, μ=3, τ=7, σ=7, a=5, c=4, g=1)


def test_the_equation_runs_in_the_order_it_explains():
    """(L1) at L ≫ a equals the keys-first composition of SUMMARY and READOUT bit for bit."""
    Q, K, V = qkv(60, 70)
    phi_Q, phi_K = linear.elu_plus_one(Q), linear.elu_plus_one(K)
    keys_first = linear.READOUT(phi_Q=phi_Q, KV=linear.SUMMARY(phi_K=phi_K, V=V))
    N = linear.NUMERATOR(phi_Q=phi_Q, phi_K=phi_K, V=V)
    assert_close_scaled(N, keys_first, TOL64)
    weights_first = linear.KERNEL_VALUES(A=linear.KERNEL(phi_Q=phi_Q, phi_K=phi_K), V=V)
    assert_close_scaled(N, weights_first, TOL64)


# -- einattn.verify ------------------------------------------------------------------------

SIZES = {"n": N, "μ": MU, "τ": L, "σ": L, "a": A, "c": C}
INPUTS = {"Q": "n μ τ a", "K": "n μ σ a", "V": "n μ σ c"}


def keys_first(phi_Q, phi_K, V):
    return phi_Q @ (phi_K.transpose(-2, -1) @ V)


def weights_first(phi_Q, phi_K, V):
    return (phi_Q @ phi_K.transpose(-2, -1)) @ V


def causal_linear(Q, K, V):
    return linear.linear_attention(Q, K, V, causal=True)


def causal_quadratic(Q, K, V):
    return linear.quadratic_form(Q, K, V, causal=True)


def causal_numerator_by_prefix_sums(phi_Q, phi_K, V):
    H, _ = linear.prefix_sums(phi_K, V, phi_Q.shape[2])
    return linear.causal_numerator(phi_Q, H)


def causal_numerator_masked(phi_Q, phi_K, V):
    weights = phi_Q @ phi_K.transpose(-2, -1)
    return weights.tril() @ V  # L_q = L_k: σ ≤ τ


def causal_numerator_strict(phi_Q, phi_K, V):
    """Wrong: the prefix sum stops before the query's own key (σ < τ)."""
    return (phi_Q @ phi_K.transpose(-2, -1)).tril(-1) @ V


def report_steps() -> list[Step]:
    """The steps proposed for einattn.derivation (as in the report)."""
    return [
        Step("linear attention: (L1) as one equation = φ_Q (φ_Kᵀ V)", linear.NUMERATOR,
             keys_first, SIZES, exact=True),
        Step("linear attention: (L1) = (φ_Q φ_Kᵀ) V", linear.NUMERATOR, weights_first,
             SIZES, exact=True),
        Step("causal linear attention: prefix sums (L4)–(L6) = masked weights",
             causal_numerator_by_prefix_sums, causal_numerator_masked, SIZES, exact=True,
             inputs={"phi_Q": "n μ τ a", "phi_K": "n μ σ a", "V": "n μ σ c"}),
        Step("linear attention = its quadratic form (no softmax)", linear.linear_attention,
             linear.quadratic_form, SIZES, exact=False, inputs=INPUTS),
        Step("causal linear attention = its causal quadratic form", causal_linear,
             causal_quadratic, SIZES, exact=False, inputs=INPUTS),
    ]


@pytest.mark.parametrize("step", report_steps(), ids=lambda s: s.name)
def test_proposed_derivation_steps_pass(step):
    report = assert_equivalent(step.lhs, step.rhs, step.sizes, exact=step.exact,
                               inputs=step.inputs)
    assert report.mode == ("exact" if step.exact else "float")


def test_a_strict_prefix_is_caught():
    report = check_equivalent(causal_numerator_by_prefix_sums, causal_numerator_strict, SIZES,
                              exact=True,
                              inputs={"phi_Q": "n μ τ a", "phi_K": "n μ σ a", "V": "n μ σ c"})
    assert not report.equal


def test_verify_against_the_quadratic_form_with_cross_lengths():
    report = assert_equivalent(linear.linear_attention, linear.quadratic_form,
                               {**SIZES, "τ": 6, "σ": 9}, inputs=INPUTS)
    assert report.equal and report.mode == "float"


# -- the layer -----------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("n_kv_heads", [None, 1], ids=["mha", "gqa"])
def test_layer_equals_separate_projections_and_the_quadratic_form(causal, n_kv_heads):
    d_model, heads, d_head = 10, 3, 4
    layer = MultiHeadAttention(d_model, heads, d_head=d_head, n_kv_heads=n_kv_heads,
                               bias=True, dtype=F64)
    x = randn(N, 6, d_model, seed=20)
    with torch.no_grad():
        for p in (layer.b, layer.b_O):
            p.copy_(randn(*p.shape, seed=21))
        Y = linear.multi_head_linear_attention(x, layer.W, layer.W_O, n_heads=heads,
                                               n_kv_heads=n_kv_heads, causal=causal,
                                               b=layer.b, b_O=layer.b_O)
        W_q, W_k, W_v = layouts.split_qkv(layer.W, n_heads=heads, n_kv_heads=n_kv_heads)
        b_q, b_k, b_v = layouts.split_qkv(layer.b, n_heads=heads, n_kv_heads=n_kv_heads)

        def heads_of(t):  # (n, L, (μ a)) -> (n, μ, L, a)
            return t.view(N, 6, -1, d_head).transpose(1, 2)

        Q, K, V = (heads_of(x @ w.T + b) for w, b in ((W_q, b_q), (W_k, b_k), (W_v, b_v)))
        Z = linear.quadratic_form(Q, K, V, causal=causal)
        expected = Z.transpose(1, 2).reshape(N, 6, -1) @ layer.W_O.reshape(-1, d_model) \
            + layer.b_O
    assert_close_scaled(Y, expected, TOL64)
    assert (Y - layer(x)).abs().max() > 1e-3  # a different attention from the layer's


def test_layer_cross_attention():
    x, context = randn(N, 5, 8, seed=30), randn(N, 9, 8, seed=31)
    W, W_O = randn(3 * 2 * 4, 8, seed=32), randn(2, 4, 8, seed=33)
    Y = linear.multi_head_linear_attention(x, W, W_O, n_heads=2, context=context)
    W_q, W_k, W_v = layouts.split_qkv(W, n_heads=2)

    def heads_of(t):
        return t.view(N, t.shape[1], 2, 4).transpose(1, 2)

    Z = linear.quadratic_form(heads_of(x @ W_q.T), heads_of(context @ W_k.T),
                              heads_of(context @ W_v.T))
    assert_close_scaled(Y, Z.transpose(1, 2).reshape(N, 5, 8) @ W_O.reshape(8, 8), TOL64)


# -- bad inputs: every raise site ------------------------------------------------------------

def bad(Q=None, K=None, V=None):
    q, k, v = qkv()
    return (q if Q is None else Q, k if K is None else K, v if V is None else V)


BAD = [
    ("3-D Q", bad(Q=torch.zeros(N, L, A, dtype=F64)),
     r"Q must be a 4-D tensor Q\[n μ τ a\], got \(2, 7, 5\)"),
    ("list V", bad(V=[[1.0]]), r"V must be a 4-D tensor V\[n g σ c\], got list"),
    ("integer K", bad(K=torch.zeros(N, MU, L, A, dtype=torch.int64)),
     "K must be floating point, got torch.int64"),
    ("float32 V", bad(V=torch.zeros(N, MU, L, C)),
     f"V is torch.float32 on {here()} but Q is torch.float64 on {here()}"),
    ("n of K", bad(K=randn(N + 1, MU, L, A, seed=1)), "index 'n' has size 3 in K but 2 in Q"),
    ("n of V", bad(V=randn(N + 1, MU, L, C, seed=1)), "index 'n' has size 3 in V but 2 in Q"),
    ("a of K", bad(K=randn(N, MU, L, A + 1, seed=1)), "index 'a' has size 6 in K but 5 in Q"),
    ("σ of V", bad(V=randn(N, MU, L + 1, C, seed=1)), "index 'σ' has size 8 in V but 7 in K"),
    ("heads of V", bad(V=randn(N, 1, L, C, seed=1)), "V has 1 heads but K has 3"),
    ("heads of K", bad(K=randn(N, 2, L, A, seed=1), V=randn(N, 2, L, C, seed=2)),
     r"Q has 3 heads, not a multiple of the 2 heads of K and V: query head μ = \(g r\)"),
    ("no heads in K", bad(K=randn(N, 0, L, A, seed=1), V=randn(N, 0, L, C, seed=2)),
     "not a multiple of the 0 heads of K and V"),
]


@pytest.mark.parametrize("form", [linear.linear_attention, linear.quadratic_form],
                         ids=["linear", "quadratic"])
@pytest.mark.parametrize("name, args, message", BAD, ids=[b[0] for b in BAD])
def test_bad_operands_are_named(form, name, args, message):
    with pytest.raises(EinattnError, match=message):
        form(*args)


@pytest.mark.parametrize("form", [linear.linear_attention, linear.quadratic_form],
                         ids=["linear", "quadratic"])
def test_a_feature_map_must_keep_the_axes_and_the_dtype(form):
    Q, K, V = qkv()
    with pytest.raises(EinattnError, match=r"feature_map turned Q \(2, 3, 7, 5\) into "
                                           r"\(2, 3, 7\): φ must keep the axes"):
        form(Q, K, V, feature_map=lambda t: t.sum(-1))
    with pytest.raises(EinattnError, match=r"feature_map turned Q .* into float"):
        form(Q, K, V, feature_map=lambda t: 1.0)
    with pytest.raises(EinattnError, match=r"feature_map turned Q \(torch.float64\) into "
                                           r"torch.float32: φ must keep the dtype"):
        form(Q, K, V, feature_map=lambda t: t.float().exp())


def test_the_equations_name_mismatched_features():
    """Called directly, the stage functions leave the checks to the equations."""
    with pytest.raises(EinattnError, match="index 'a' has size 6 in phi_K but 5 in phi_Q"):
        linear.numerator(randn(1, 2, 3, 5, seed=0), randn(1, 2, 4, 6, seed=1),
                         randn(1, 2, 4, 7, seed=2))
    with pytest.raises(EinattnError, match=r"group \(g r\) of phi_Q has length 3, not "
                                           r"divisible by g=2"):
        linear.normaliser(randn(1, 3, 3, 5, seed=0), randn(1, 2, 4, 5, seed=1))


# -- docs ---------------------------------------------------------------------------------

TAGGED = {
    "L1": linear.NUMERATOR, "L2": linear.NORMALISER, "L4": linear.OUTER,
    "L6": linear.CAUSAL_NUMERATOR, "L7": linear.CAUSAL_NORMALISER,
    "L1g": linear.NUMERATOR_GQA, "L2g": linear.NORMALISER_GQA,
    "L6g": linear.CAUSAL_NUMERATOR_GQA, "L7g": linear.CAUSAL_NORMALISER_GQA,
}
UNTAGGED = [linear.KERNEL, linear.KERNEL_VALUES, linear.SUMMARY, linear.READOUT]
HAND_WRITTEN = {  # tag -> (the code's string, its LaTeX)
    "L3": (linear.NORMALISE, r"Z_{n \mu \tau c} = \frac{N_{n \mu \tau c}}{D_{n \mu \tau}}"),
    "L5": (linear.PREFIX_SUMS,
           r"H_{n \mu \tau a c} = \sum_{\sigma \le \tau + L_k - L_q} U_{n \mu \sigma a c}, "
           r"\qquad h_{n \mu \tau a} = \sum_{\sigma \le \tau + L_k - L_q} "
           r"(\phi_{K})_{n \mu \sigma a}"),
}
ORDER = ["L1", "L2", "L3", "L4", "L5", "L6", "L7", "L1g", "L2g", "L6g", "L7g"]
DISPLAY = re.compile(r"^\$\$\n(.*?)\n\$\$$", re.M | re.S)
TAG = re.compile(r"\s*\\tag\{([^}]*)\}$")


def displays(doc: str) -> list[tuple[str, str | None, int]]:
    found = []
    for m in DISPLAY.finditer(doc):
        body = m.group(1).strip()
        tag = TAG.search(body)
        found.append((body[: tag.start()] if tag else body, tag.group(1) if tag else None,
                      m.end()))
    return found


def doc_problems(doc: str) -> list[str]:
    expected = {eq.latex(): tag for tag, eq in TAGGED.items()}
    expected |= {latex: tag for tag, (_, latex) in HAND_WRITTEN.items()}
    expected |= {eq.latex(): None for eq in UNTAGGED}
    found = displays(doc)
    problems = [f"{latex} is not in the doc" for latex in expected
                if latex not in {f[0] for f in found}]
    for latex, tag, end in found:
        if latex not in expected:
            problems.append(f"display with no counterpart in einattn.linear: {latex}")
        elif expected[latex] != tag:
            problems.append(f"{latex} is tagged ({tag}), expected ({expected[latex]})")
        elif tag in TAGGED or tag in HAND_WRITTEN:  # the code's string follows, if ungrouped
            text = TAGGED[tag].text if tag in TAGGED else HAND_WRITTEN[tag][0]
            block = re.search(r"```text\n(.*?)\n```", doc[end:], re.S)
            if not tag.endswith("g") and (block is None or block.group(1) != text):
                problems.append(f"({tag}) is not followed by a text block holding {text}")
    if [t for _, t, _ in found if t] != ORDER:
        problems.append(f"tags {[t for _, t, _ in found if t]}, expected {ORDER}")
    return problems


def test_docs_show_the_equations_the_code_runs():
    assert doc_problems(DOC.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize("old, new", [
    (r"\tag{L1}", r"\tag{L2}"),
    (r"V_{n \mu \sigma c} \tag{L1}", r"V_{n \mu \sigma a} \tag{L1}"),
    ("N[n μ τ c] = phi_Q[n μ τ a] H[n μ τ a c]\n", "N[n μ τ c] = phi_Q[n μ τ a] H[n μ σ a c]\n"),
    (r"\mathrm{KV}_{n \mu a c} = ", r"\mathrm{KV}_{n \mu c a} = "),
])
def test_an_edited_doc_is_caught(old, new):
    doc = DOC.read_text(encoding="utf-8")
    assert old in doc
    assert doc_problems(doc.replace(old, new, 1))


def test_hand_written_latex_names_the_terms_of_the_code_strings():
    for text, latex in HAND_WRITTEN.values():
        for term in re.findall(r"\w+\[[^\]]*\]", text):
            rendered = Equation(f"{term} = {term.replace(term.split('[')[0], 'X', 1)}").latex()
            assert rendered.split(" = ")[0] in latex, (term, latex)


def test_the_printed_orders_in_the_doc_are_current():
    doc = DOC.read_text(encoding="utf-8")
    printed = re.search(r"prints\n\n```text\n(.*?)\n```", doc, re.S).group(1)
    assert printed == str(linear.orders(n=2, μ=3, τ=1024, σ=1024, a=64, c=64))


@pytest.mark.parametrize("function, equations", [
    ("numerator", ["(L1)", linear.NUMERATOR, "(L1g)", linear.NUMERATOR_GQA]),
    ("normaliser", ["(L2)", linear.NORMALISER, "(L2g)", linear.NORMALISER_GQA]),
    ("normalise", ["(L3)", linear.NORMALISE]),
    ("prefix_sums", ["(L4)", "(L5)", linear.OUTER]),
    ("causal_numerator", ["(L6)", linear.CAUSAL_NUMERATOR, "(L6g)",
                          linear.CAUSAL_NUMERATOR_GQA]),
    ("causal_normaliser", ["(L7)", linear.CAUSAL_NORMALISER, "(L7g)",
                           linear.CAUSAL_NORMALISER_GQA]),
])
def test_docstrings_quote_their_equations(function, equations):
    doc = " ".join(inspect.getdoc(getattr(linear, function)).split())
    for e in equations:
        assert (e.text if isinstance(e, Equation) else e) in doc, (function, e)
