"""einattn.verify.check_gradient: a right gradient passes (exactly, for a contraction) and a
wrong one that type-checks fails with where it differs; forward and gradient as strings,
Equations or functions; the backward's registered steps (einattn.gradient_steps); every
raise site."""

from __future__ import annotations

import re

import pytest
import torch

from einattn import (
    EinattnError,
    Equation,
    _gradient_check,
    chunked,
    functional,
    gradient_steps,
    verify,
)
from einattn.derivation import default_sizes
from einattn.verify import check_equivalent, check_gradient

SCORES = "S[τ σ] = Q[τ a] K[σ a]"
DQ = "dQ[τ a] = dS[τ σ] K[σ a]"
DK = "dK[σ a] = dS[τ σ] Q[τ a]"
SQUARE = {"τ": 4, "σ": 4, "a": 3}  # τ and σ of one size: a swap between them type-checks
DISTINCT = {"τ": 4, "σ": 5, "a": 3}
ROWS = {"S": "τ σ", "A": "τ σ"}


def softmax(S):
    return S.softmax(dim=-1)


def softmax_backward(A, dA):
    """A ∘ (dA − Σ_σ A ∘ dA)."""
    return A * (dA - (A * dA).sum(dim=-1, keepdim=True))


# -- the must-show: a contraction exactly, the softmax in float64 -------------------------

@pytest.mark.parametrize("wrt, gradient", [("Q", DQ), ("K", DK)])
def test_the_right_gradient_of_a_contraction_passes_exactly(wrt, gradient):
    report = check_gradient(SCORES, gradient, wrt=wrt, sizes=SQUARE, exact=True)
    assert report.equal and report.mode == "field" and report.max_deviation == 0
    assert report.false_acceptance < 1e-12
    assert report.lhs == f"autograd's d{wrt} of {SCORES}"
    assert report.rhs == f"{SCORES}; {gradient}"  # the forward, then the gradient


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "float"])
@pytest.mark.parametrize("wrong", [
    "dQ[τ a] = dS[σ τ] K[σ a]",  # dS read transposed
    "dQ[τ a] = dS[τ σ] K[τ a]",  # K read at the query position
], ids=["dS transposed", "K at τ"])
def test_a_wrong_gradient_that_type_checks_fails_with_where(exact, wrong):
    report = check_gradient(SCORES, wrong, wrt="Q", sizes=SQUARE, exact=exact)
    assert not report.equal and report.max_deviation > report.tolerance
    assert report.where.startswith("[τ=") and ", a=" in report.where
    assert str(report).startswith("NOT equal") and wrong in str(report)


def test_the_softmax_backward_passes_and_A_times_dA_fails():
    sizes = {"τ": 3, "σ": 5}
    right = check_gradient(softmax, softmax_backward, wrt="S", output="A", shapes=ROWS,
                           sizes=sizes)
    assert right.equal and right.mode == "float" and right.max_deviation <= 1e-15
    wrong = check_gradient(softmax, lambda A, dA: A * dA, wrt="S", output="A", shapes=ROWS,
                           sizes=sizes)
    assert not wrong.equal and wrong.max_deviation > 0.1
    assert wrong.where.startswith("[τ=") and ", σ=" in wrong.where


# -- forms of the two sides ------------------------------------------------------------------

def scores_function(Q, K):
    return Q @ K.T


def dQ_function(dS, K):
    return dS @ K


FORWARDS = {"string": SCORES, "Equation": Equation(SCORES), "function": scores_function}
GRADIENTS = {"string": DQ, "Equation": Equation(DQ), "function": dQ_function}
SHAPES = {"Q": "τ a", "K": "σ a", "S": "τ σ"}


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "float"])
@pytest.mark.parametrize("gradient", GRADIENTS.values(), ids=GRADIENTS)
@pytest.mark.parametrize("forward", FORWARDS.values(), ids=FORWARDS)
def test_every_form_of_forward_and_gradient(forward, gradient, exact):
    options = {"shapes": SHAPES, "output": "S"} if callable(forward) and not isinstance(
        forward, Equation) else {}
    report = check_gradient(forward, gradient, wrt="Q", sizes=DISTINCT, exact=exact, **options)
    assert report.equal, str(report)
    wrong = check_gradient(forward, lambda dS, K: 2 * dS @ K, wrt="Q", sizes=DISTINCT,
                           exact=exact, **options)
    assert not wrong.equal


def test_a_function_forward_output_is_called_out_by_default():
    seen = {}

    def gradient(out, dout, K):
        seen["out"] = out
        return dout @ K

    shapes = {"Q": "τ a", "K": "σ a", "out": "τ σ"}
    assert check_gradient(scores_function, gradient, wrt="Q", shapes=shapes,
                          sizes=DISTINCT).equal
    assert seen["out"].shape == (4, 5)


def test_a_gradient_may_take_the_forward_output_and_every_tensor_by_kwargs():
    def takes_all(**tensors):
        assert set(tensors) == {"S", "A", "dA"}
        return softmax_backward(tensors["A"], tensors["dA"])

    assert check_gradient(softmax, takes_all, wrt="S", output="A", shapes=ROWS,
                          sizes={"τ": 3, "σ": 5}).equal


def test_a_forward_parameter_with_a_default_is_no_input():
    def rows(S, dim=-1):
        return S.softmax(dim=dim)

    assert check_gradient(rows, softmax_backward, wrt="S", output="A", shapes=ROWS,
                          sizes={"τ": 3, "σ": 5}).equal


def test_an_equation_gradient_may_read_the_forward_output():
    """d/dW of Y = X W is Xᵀ dY; a gradient that names Y gets the forward's output."""
    forward = "Y[τ j] = X[τ i] W[i j]"
    sizes = {"τ": 3, "i": 4, "j": 5}
    assert check_gradient(forward, "dW[i j] = X[τ i] dY[τ j]", wrt="W", sizes=sizes,
                          exact=True).equal
    assert not check_gradient(forward, "dW[i j] = X[τ i] Y[τ j]", wrt="W", sizes=sizes,
                              exact=True).equal


FOUR = "S[n μ τ σ] = X[n τ i] W_Q[μ a i] W_K[μ a j] X[n σ j]"
FOUR_SIZES = {"n": 2, "μ": 3, "τ": 4, "σ": 4, "a": 5, "i": 7, "j": 7}  # X twice: τ = σ
D_W_Q = "dW_Q[μ a i] = dS[n μ τ σ] X[n τ i] W_K[μ a j] X[n σ j]"


def test_exact_mode_keeps_autograds_float64_sums_exact(monkeypatch):
    """Degree 4 at small sizes: integers drawn up to the int64 bound (2^62) make products
    that float64 rounds. The draws are kept below 2^52, so the right gradient passes
    exactly; with that limit lifted to 2^62, the same right gradient fails on rounding."""
    small = {"n": 1, "μ": 2, "τ": 2, "σ": 2, "a": 3, "i": 2, "j": 2}
    d_W_Q = Equation(D_W_Q)

    def claimed(dS, X, W_K):  # a function: the integer mode (the field reads equations)
        return d_W_Q(dS=dS, X=X, W_K=W_K)

    report = check_gradient(FOUR, claimed, wrt="W_Q", sizes=small, exact=True, draws=4)
    assert report.equal and report.mode == "exact" and report.false_acceptance < 1e-8
    monkeypatch.setattr(verify, "_FLOAT64_EXACT", 2.0**62)
    lifted = check_gradient(FOUR, claimed, wrt="W_Q", sizes=small, exact=True, draws=4)
    assert not lifted.equal and 0 < lifted.max_deviation < 1e3


def test_a_tensor_used_twice_gets_both_terms_of_its_gradient():
    """X appears twice in the four-operand scores: dX has a term from each place."""
    def dX(dS, W_Q, W_K, X):
        Q = torch.einsum("nti,mai->nmta", X, W_Q)
        K = torch.einsum("nsj,maj->nmsa", X, W_K)
        return (torch.einsum("nmts,nmsa,mai->nti", dS, K, W_Q)
                + torch.einsum("nmts,nmta,maj->nsj", dS, Q, W_K))

    assert check_gradient(FOUR, dX, wrt="X", sizes=FOUR_SIZES, exact=True).equal
    one_term = "dX[n τ i] = dS[n μ τ σ] W_Q[μ a i] W_K[μ a j] X[n σ j]"
    assert not check_gradient(FOUR, one_term, wrt="X", sizes=FOUR_SIZES, exact=True).equal


def test_a_forward_that_ignores_wrt_has_gradient_zero():
    def ignores_K(Q, K):
        return Q.sum(dim=-1, keepdim=True).expand(-1, K.shape[0]) * 1.0

    shapes = {"Q": "τ a", "K": "σ a", "out": "τ σ"}
    zero = check_gradient(ignores_K, lambda K: torch.zeros_like(K), wrt="K", shapes=shapes,
                          sizes=DISTINCT)
    assert zero.equal
    assert not check_gradient(ignores_K, lambda K: K, wrt="K", shapes=shapes,
                              sizes=DISTINCT).equal


def test_the_seed_fixes_the_draws():
    def run(seed):
        return check_gradient(SCORES, "dQ[τ a] = dS[σ τ] K[σ a]", wrt="Q", sizes=SQUARE,
                              seed=seed).max_deviation
    assert run(0) == run(0) != run(1)


# -- the backward's registered steps ------------------------------------------------------------

Z = gradient_steps.gradient_sizes(default_sizes())


@pytest.mark.parametrize("tile, full, rename", [
    (gradient_steps.TILE_SCORES, functional.SCORES_GQA, {"Q_t": "Q", "K_b": "K"}),
    (gradient_steps.TILE_VALUES, functional.VALUES_GQA, {"P": "A", "V_b": "V"}),
], ids=["scores (2g)", "values (4g)"])
def test_the_tile_forwards_are_the_layers_equations(tile, full, rename):
    def renamed(**tensors):
        return full(**{rename[k]: v for k, v in tensors.items()}, g=Z["g"])

    inputs = {t.name: _gradient_check._bracketed(t) for t in tile.terms}
    assert check_equivalent(tile, renamed, Z, inputs=inputs).equal


@pytest.mark.parametrize("wrt, gradient", [
    ("V_b", chunked.VALUE_GRADS), ("P", chunked.PROB_GRADS),
    ("Q_t", chunked.QUERY_GRADS), ("K_b", chunked.KEY_GRADS),
], ids=["VALUE_GRADS", "PROB_GRADS", "QUERY_GRADS", "KEY_GRADS"])
@pytest.mark.parametrize("exact", [True, False], ids=["field", "float"])
def test_chunked_backward_equations_are_gradients(wrt, gradient, exact):
    forward = gradient_steps.TILE_SCORES if wrt in ("Q_t", "K_b") else gradient_steps.TILE_VALUES
    report = check_gradient(forward, gradient, wrt=wrt, sizes=Z, exact=exact)
    assert report.equal and report.mode == ("field" if exact else "float"), str(report)


@pytest.mark.parametrize("exact", [True, False], ids=["field", "float"])
def test_chunked_score_gradient_is_the_gradient_through_the_softmax(exact):
    report = check_gradient(gradient_steps.ATTENTION_ROWS, gradient_steps.chunked_score_grads(),
                            wrt="S", sizes=Z, exact=exact)
    assert report.equal and report.max_deviation <= 1e-14, str(report)
    assert report.mode == ("field" if exact else "float")


@pytest.mark.parametrize("label, sizes", [
    ("seed", default_sizes()), ("one query", default_sizes(n=1, L=1, d_model=6, n_heads=3)),
    ("wide", default_sizes(n=64, L=512, d_model=1024, n_heads=16, L_k=4096)),
])
def test_gradient_sizes_are_distinct_and_small(label, sizes):
    z = gradient_steps.gradient_sizes(sizes)
    assert set(z) == {"n", "g", "r", "τ", "σ", "a"} and len(set(z.values())) == 6
    assert z["a"] >= 2 and (z["g"], z["r"]) == (3, 2) and max(z.values()) <= 8
    if label == "one query":
        assert z["σ"] == 1  # the one key there is, kept


# -- errors ------------------------------------------------------------------------------------

def test_wrt_must_be_an_input_of_the_forward():
    with pytest.raises(EinattnError, match=r"wrt='V' is not an input of the forward "
                                           r"S\[τ σ\] = Q\[τ a\] K\[σ a\]; its inputs are Q, K"):
        check_gradient(SCORES, DQ, wrt="V", sizes=DISTINCT)
    with pytest.raises(EinattnError, match=r"wrt='S' is not an input of the forward "
                                           r"scores_function; its inputs are Q, K"):
        check_gradient(scores_function, DQ, wrt="S", shapes=SHAPES, output="S", sizes=DISTINCT)


@pytest.mark.parametrize("gradient, produced", [
    ("dQ[a τ] = dS[τ σ] K[σ a]", r"dQ\[a τ\]"),
    ("dK[τ a] = dS[τ σ] K[σ a]", r"dK\[τ a\]"),
], ids=["indices transposed", "named for another tensor"])
def test_an_equation_gradient_must_produce_d_wrt(gradient, produced):
    with pytest.raises(EinattnError, match=rf"must produce dQ\[τ a\], the gradient of Q, but "
                                           rf"produces {produced}\n  {re.escape(gradient)}\n  \^"):
        check_gradient(SCORES, gradient, wrt="Q", sizes=DISTINCT)


def test_a_function_gradient_must_return_d_wrt_shape():
    with pytest.raises(EinattnError, match=r"returned shape \(5, 3\), but dQ has Q's shape "
                                           r"\(4, 3\)"):
        check_gradient(SCORES, lambda dS, K: dS.T @ dS @ K, wrt="Q", sizes=DISTINCT)


@pytest.mark.parametrize("gradient", ["dQ[τ a] = dS[τ σ] V[σ a]", lambda dS, V: dS @ V],
                         ids=["equation", "function"])
def test_a_gradient_takes_only_the_forwards_tensors(gradient):
    with pytest.raises(EinattnError, match=r"takes 'V', which is none of the forward's "
                                           r"inputs, its output and its cotangent: Q, K, S, dS"):
        check_gradient(SCORES, gradient, wrt="Q", sizes=DISTINCT)


@pytest.mark.parametrize("shapes, missing, role", [
    (None, "Q", "an input"), ({"Q": "τ a", "K": "σ a"}, "S", "the output"),
], ids=["no shapes", "no output"])
def test_a_function_forward_needs_shapes(shapes, missing, role):
    with pytest.raises(EinattnError, match=rf"shapes gives no index string for '{missing}', "
                                           rf"{role} of the forward scores_function; pass "
                                           rf"shapes={{'{missing}': "):
        check_gradient(scores_function, DQ, wrt="Q", shapes=shapes, output="S", sizes=DISTINCT)


def test_the_output_shape_must_match_what_the_forward_returns():
    shapes = {**SHAPES, "S": "σ τ"}
    with pytest.raises(EinattnError, match=r"scores_function returned shape \(4, 5\), but its "
                                           r"cotangent dS has shape \(5, 4\) from shapes"):
        check_gradient(scores_function, DQ, wrt="Q", shapes=shapes, output="S", sizes=DISTINCT)


def test_output_must_agree_with_an_equation_forward():
    with pytest.raises(EinattnError, match=r"output='A', but the forward S\[τ σ\] = .* names "
                                           r"its output S"):
        check_gradient(SCORES, DQ, wrt="Q", output="A", sizes=DISTINCT)


def test_a_scaled_step_is_exact_in_the_field_and_float64_beside_a_function():
    scaled = check_gradient(f"{SCORES} / √a", f"{DQ} / √a", wrt="Q", sizes=DISTINCT,
                            exact=True)
    assert scaled.equal and scaled.mode == "field"
    assert not check_gradient(SCORES, f"{DQ} / √a", wrt="Q", sizes=DISTINCT, exact=True).equal
    dQ = Equation(f"{DQ} / √a")
    beside = check_gradient(f"{SCORES} / √a", lambda dS, K: dQ(dS=dS, K=K), wrt="Q",
                            sizes=DISTINCT, exact=True)
    assert beside.equal and beside.mode == "float"
    assert beside.note.endswith("<lambda> is Python code, which the finite field cannot "
                                f"run, and {SCORES} / √a divides by √a, which is irrational "
                                "in general")


def test_exact_mode_refuses_a_forward_that_is_not_multilinear():
    with pytest.raises(EinattnError, match=r"exact=True but autograd's dS is not an integer at "
                                           r"integer inputs: the forward is not multilinear"):
        check_gradient(softmax, softmax_backward, wrt="S", output="A", shapes=ROWS,
                       sizes={"τ": 3, "σ": 5}, exact=True)


def test_exact_mode_refuses_a_forward_output_that_is_not_an_integer():
    def offset(Q, K):
        return Q @ K.T + 0.5  # its gradient is an integer, its output is not

    with pytest.raises(EinattnError, match=r"exact=True but the forward's output S is not an "
                                           r"integer"):
        check_gradient(offset, lambda S, dS, K: dS @ K, wrt="Q", shapes=SHAPES, output="S",
                       sizes=DISTINCT, exact=True)
