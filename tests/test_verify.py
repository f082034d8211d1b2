"""einattn.verify: true equalities pass in every mode, wrong ones fail with a message that
shows both forms, the largest deviation and where; the integer mode's draws and its
Schwartz–Zippel bound (for Python functions: two equations go to the finite field, which
tests/test_field.py covers); every raise site."""

from __future__ import annotations

import math

import pytest
import torch

from einattn import EinattnError, Equation
from einattn.errors import SidesDiffer
from einattn.verify import Report, assert_equivalent, check_equivalent

MATMUL = "Y[τ j] = X[τ i] W[i j]"
MATMUL_SIZES = {"τ": 3, "i": 4, "j": 5}
SCORES = "S[n μ τ σ] = Q[n μ τ a] K[n μ σ a]"
SCORES_SIZES = {"n": 2, "μ": 3, "τ": 4, "σ": 5, "a": 6}


def exact_range(sizes: dict[str, int], degree: int) -> int:
    """R as docs/verifying.md states it: the largest R ≤ 2^16 with Π sizes · R^d ≤ 2^62."""
    return max(1, min(2**16, int((2.0**62 / math.prod(sizes.values())) ** (1 / degree))))


def function(text: str):
    """The equation ``text`` as a Python function of its tensors: a side only the integer
    mode can check exactly (the finite field reads equations only)."""
    equation = Equation(text)

    def run(**tensors):
        return equation(**{n: tensors[n] for n in equation.operands})
    run.__qualname__ = f"function of {text}"
    return run


def recorder(name: str, seen: list, value=None):
    """A callable ``X -> X`` (or -> ``value(X)``) that keeps every tensor it is given."""
    def side(**tensors):
        seen.append(tensors[name])
        return tensors[name] if value is None else value(tensors[name])
    return side


# -- true equalities ------------------------------------------------------------------------

@pytest.mark.parametrize("exact", [True, False], ids=["exact", "float"])
def test_string_vs_string(exact):
    report = assert_equivalent(MATMUL, "Y[τ j] = W[i j] X[τ i]", MATMUL_SIZES, exact=exact)
    assert report.equal and report.mode == ("field" if exact else "float")


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "float"])
def test_equation_vs_callable(exact):
    def matmul(X, W):
        return X @ W

    assert assert_equivalent(Equation(MATMUL), matmul, MATMUL_SIZES, exact=exact).equal


def test_scaled_equation_vs_callable_in_float_mode():
    def textbook(Q, K):
        return Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])

    report = assert_equivalent(f"{SCORES} / √a", textbook, SCORES_SIZES)
    assert report.max_deviation <= report.tolerance


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "float"])
def test_callable_vs_callable_with_inputs(exact):
    def head_by_head(Z, W_O):
        return sum(Z[:, m] @ W_O[m] for m in range(W_O.shape[0]))

    def fused(Z, W_O):
        return torch.einsum("nmta,mai->nti", Z, W_O)

    report = assert_equivalent(head_by_head, fused, {"n": 2, "μ": 3, "τ": 5, "a": 4, "i": 7},
                               exact=exact, inputs={"Z": "n μ τ a", "W_O": "μ a i"})
    assert report.equal and report.lhs.endswith("head_by_head") and report.rhs.endswith("fused")


def test_grouped_indices_take_their_size_from_sizes():
    def reshape(T):
        return T.reshape(T.shape[0], -1)

    sizes = {"n": 2, "μ": 3, "a": 4}
    assert assert_equivalent("Y[n (μ a)] = T[n μ a]", reshape, sizes, exact=True).equal


def test_a_callable_with_var_keywords_gets_every_tensor():
    assert assert_equivalent(MATMUL, lambda **t: t["X"] @ t["W"], MATMUL_SIZES, exact=True).equal


# -- wrong steps fail -------------------------------------------------------------------------

@pytest.mark.parametrize("exact", [True, False], ids=["exact", "float"])
def test_one_missing_term_in_one_element_is_caught_and_located(exact):
    def one_term_missing(Q, K):
        S = torch.einsum("nmta,nmsa->nmts", Q, K)
        S[0, 2, 2, 4] -= Q[0, 2, 2, 0] * K[0, 2, 4, 0]  # forgot a = 0 in one sum
        return S

    report = check_equivalent(SCORES, one_term_missing, SCORES_SIZES, exact=exact)
    assert not report.equal
    assert report.where == "[n=0, μ=2, τ=2, σ=4]"
    assert report.max_deviation > report.tolerance
    with pytest.raises(AssertionError, match=r"max \|lhs − rhs\| = .* at \[n=0, μ=2, τ=2, σ=4\]"):
        assert_equivalent(SCORES, one_term_missing, SCORES_SIZES, exact=exact)


def test_failure_message_shows_both_forms_the_deviation_and_where():
    swapped = "S[n μ τ σ] = Q[n μ σ a] K[n μ τ a]"
    sizes = {**SCORES_SIZES, "σ": 4}
    with pytest.raises(AssertionError) as caught:
        assert_equivalent(SCORES, function(swapped), sizes, exact=True)
    lines = str(caught.value).splitlines()
    assert lines[0].startswith("NOT equal (exact, 3 draws, false acceptance ≤ ")
    assert lines[1] == f"  lhs: {SCORES}"
    assert lines[2] == f"  rhs: function of {swapped}"
    assert lines[3].startswith("  max |lhs − rhs| = ")
    report = check_equivalent(SCORES, function(swapped), sizes, exact=True)
    assert f"= {report.max_deviation:.3e} at {report.where} (tolerance 0.0e+00)" in lines[3]
    assert report.where.startswith("[n=") and ", μ=" in report.where and ", σ=" in report.where


def test_the_largest_deviation_over_all_draws_is_reported():
    seen: list[torch.Tensor] = []
    report = check_equivalent(recorder("S", seen), lambda S: 1.5 * S, {"τ": 3, "σ": 4},
                              inputs={"S": "τ σ"}, draws=4)
    worst = max(seen, key=lambda S: S.abs().max())
    assert len(seen) == 4 and not report.equal
    assert report.max_deviation == pytest.approx(0.5 * float(worst.abs().max()), rel=1e-15)
    flat = int(worst.abs().argmax())
    assert report.where == f"[{flat // 4}, {flat % 4}]"  # positions only: no equation


def test_positions_of_a_grouped_output_are_given_by_axis():
    report = check_equivalent("Y[n (μ a)] = T[n μ a]", "Y[n (a μ)] = T[n μ a]",
                              {"n": 1, "μ": 3, "a": 4}, exact=True)
    assert not report.equal and report.where.startswith("[0, ")


def test_float_tolerance_is_relative_to_the_magnitude_of_the_outputs():
    sizes, inputs = {"τ": 3, "σ": 4}, {"S": "τ σ"}
    big = check_equivalent(lambda S: 0 * S + 1e6, lambda S: 0 * S + 1e6 + 1e-7, sizes,
                           inputs=inputs)
    assert big.equal and big.tolerance == pytest.approx(1e-6)  # 1e-12 · 1e6
    small = check_equivalent(lambda S: S, lambda S: S + 1e-7, sizes, inputs=inputs)
    assert not small.equal and small.tolerance <= 1e-12 * 10
    tiny = check_equivalent(lambda S: 1e-9 * S, lambda S: 1e-9 * S, sizes, inputs=inputs)
    assert tiny.tolerance == 1e-12  # the scale is never below 1


def test_float_tolerance_is_at_most_1e_12_relative():
    seen: list[torch.Tensor] = []
    report = check_equivalent(recorder("S", seen, lambda S: 100 * S), lambda S: 100 * S,
                              {"τ": 3, "σ": 4}, inputs={"S": "τ σ"})
    largest = 100 * max(float(S.abs().max()) for S in seen)
    assert report.equal and 0 < report.tolerance <= 1e-12 * largest


def test_a_nan_producing_side_fails():
    report = check_equivalent(lambda S: S, lambda S: S.sqrt(), {"τ": 3, "σ": 4},
                              inputs={"S": "τ σ"})  # NaN where S < 0
    assert not report.equal and report.max_deviation == math.inf


def test_nan_on_both_sides_still_fails():
    def nan_at_corner(S):
        return S.index_put((torch.tensor(0), torch.tensor(0)), torch.tensor(math.nan).double())

    report = check_equivalent(nan_at_corner, nan_at_corner, {"τ": 3, "σ": 4}, inputs={"S": "τ σ"})
    assert not report.equal and report.where == "[0, 0]"


def test_an_infinity_on_one_side_only_fails():
    def minus_inf_at_corner(S):
        return S.index_put((torch.tensor(1), torch.tensor(2)), torch.tensor(-math.inf).double())

    report = check_equivalent(lambda S: S, minus_inf_at_corner, {"τ": 3, "σ": 4},
                              inputs={"S": "τ σ"})
    assert not report.equal and report.where == "[1, 2]"
    assert report.max_deviation == math.inf and math.isfinite(report.tolerance)


def test_equal_infinities_agree():
    allowed = torch.ones(3, 4, dtype=torch.bool).tril()

    def additive(S):
        return S + torch.zeros(3, 4, dtype=S.dtype).masked_fill(~allowed, -math.inf)

    def filled(S):
        return S.masked_fill(~allowed, -math.inf)

    report = assert_equivalent(additive, filled, {"τ": 3, "σ": 4}, inputs={"S": "τ σ"})
    assert report.max_deviation == 0.0 and math.isfinite(report.tolerance)


# -- one value per tensor name, determinism --------------------------------------------------

def test_a_tensor_used_twice_gets_one_value():
    def outer_of_X_with_itself(X):
        return torch.einsum("ti,sj->tisj", X, X)

    sizes = {"τ": 4, "σ": 4, "i": 3, "j": 3}
    assert assert_equivalent("P[τ i σ j] = X[τ i] X[σ j]", outer_of_X_with_itself, sizes,
                             exact=True).equal
    gram = assert_equivalent("G[τ σ] = X[τ i] X[σ i]", lambda X: X @ X.T, sizes, exact=True)
    assert gram.false_acceptance == pytest.approx((2 / (2 * 2**16 + 1)) ** 3)  # d = 2: X, X
    # Two different names are two independent draws: the same callable then fails.
    assert not check_equivalent("P[τ i σ j] = X[τ i] Y[σ j]", outer_of_X_with_itself, sizes,
                                exact=True).equal


def test_same_seed_same_draws_and_report():
    first: list[torch.Tensor] = []
    second: list[torch.Tensor] = []
    sizes, inputs = {"τ": 3, "σ": 4}, {"S": "τ σ"}
    one = check_equivalent(recorder("S", first), lambda S: 2 * S, sizes, inputs=inputs, seed=7)
    two = check_equivalent(recorder("S", second), lambda S: 2 * S, sizes, inputs=inputs, seed=7)
    assert one == two and all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    other = check_equivalent(lambda S: S, lambda S: 2 * S, sizes, inputs=inputs, seed=8)
    assert other.max_deviation != one.max_deviation
    assert not torch.equal(first[0], first[1])  # each draw is a fresh one


def test_draws_are_independent_per_tensor():
    seen: list[torch.Tensor] = []

    def both(X, W):
        seen.extend([X, W])
        return X @ W

    check_equivalent(MATMUL, both, {"τ": 4, "i": 4, "j": 4})
    assert not torch.equal(seen[0], seen[1])


# -- exact mode --------------------------------------------------------------------------------

def test_exact_draws_are_int64_within_the_stated_range():
    seen: list[torch.Tensor] = []
    report = check_equivalent(MATMUL, recorder("X", seen, lambda X: X @ torch.ones(
        4, 5, dtype=X.dtype)), MATMUL_SIZES, exact=True)
    R = exact_range(MATMUL_SIZES, 2)
    assert R == 2**16 and not report.equal  # X @ 1 is not X @ W
    for X in seen:
        assert X.dtype == torch.int64 and int(X.abs().max()) <= R
    assert int(torch.stack(seen).abs().max()) > R // 2  # the whole range is used


def test_float_draws_are_float64():
    seen: list[torch.Tensor] = []
    check_equivalent(recorder("S", seen), lambda S: S, {"τ": 2}, inputs={"S": "τ"})
    assert all(S.dtype == torch.float64 for S in seen)


@pytest.mark.parametrize("draws", [1, 3, 5])
def test_exact_bound_is_d_over_2R_plus_1_to_the_draws(draws):
    four = "S[n μ τ σ] = X[n τ i] W_Q[μ a i] W_K[μ a j] X[n σ j]"  # d = 4: X counts twice
    sizes = {"n": 2, "τ": 5, "σ": 5, "i": 16, "j": 16, "μ": 4, "a": 4}
    R = exact_range(sizes, 4)
    assert R == 2178 and math.prod(sizes.values()) * R**4 <= 2**62
    report = check_equivalent(four, function(four), sizes, exact=True, draws=draws)
    assert report.draws == draws
    assert report.false_acceptance == pytest.approx((4 / (2 * R + 1)) ** draws, rel=1e-12)
    two = check_equivalent(MATMUL, function(MATMUL), MATMUL_SIZES, exact=True, draws=draws)
    assert two.false_acceptance == pytest.approx((2 / (2 * 2**16 + 1)) ** draws, rel=1e-12)


def test_exact_report_fields_and_text():
    swapped = "Y[τ j] = W[i j] X[τ i]"
    report = assert_equivalent(MATMUL, function(swapped), MATMUL_SIZES, exact=True)
    assert isinstance(report, Report)
    assert (report.equal, report.mode, report.draws) == (True, "exact", 3)
    assert (report.max_deviation, report.tolerance, report.note) == (0.0, 0.0, "")
    assert (report.lhs, report.rhs) == (MATMUL, f"function of {swapped}")
    assert report.where == "[τ=0, j=0]"
    assert str(report).splitlines() == [
        f"equal (exact, 3 draws, false acceptance ≤ {report.false_acceptance:.1e})",
        f"  lhs: {MATMUL}",
        f"  rhs: function of {swapped}",
        "  max |lhs − rhs| = 0.000e+00 at [τ=0, j=0] (tolerance 0.0e+00)",
    ]


def test_float_report_fields_and_text():
    report = check_equivalent(MATMUL, lambda X, W: X @ W, MATMUL_SIZES, draws=2)
    assert (report.equal, report.mode, report.draws) == (True, "float", 2)
    assert report.false_acceptance is None and report.rhs.endswith("<lambda>")
    text = str(report)
    assert text.startswith("equal (float, 2 draws)\n") and "false acceptance" not in text
    assert f"(tolerance {report.tolerance:.1e})" in text


def test_exact_mode_uses_large_integers_without_overflow():
    three = "Z[n τ c] = F[n τ a] G[n σ a] V[n σ c]"
    sizes = {"n": 2, "τ": 10, "σ": 10, "a": 10, "c": 10}
    R = exact_range(sizes, 3)
    assert R < 2**16 and math.prod(sizes.values()) * R**3 <= 2**62  # not capped: the bound
    seen: list[torch.Tensor] = []

    def keys_first(F, G, V):
        seen.append(F @ (G.transpose(-2, -1) @ V))
        return seen[-1]

    assert assert_equivalent(three, keys_first, sizes, exact=True).equal
    assert max(int(Z.abs().max()) for Z in seen) > 2**40  # far beyond float32, exact


# -- every raise site ----------------------------------------------------------------------------

def test_assert_equivalent_raises_assertion_error_with_the_report():
    with pytest.raises(AssertionError, match=r"^NOT equal \(float, 3 draws\)\n  lhs: "):
        assert_equivalent(MATMUL, lambda X, W: 2 * (X @ W), MATMUL_SIZES)


def test_no_equation_and_no_inputs():
    with pytest.raises(EinattnError, match=r"neither side is an equation.*inputs="):
        check_equivalent(lambda S: S, lambda S: S, {"τ": 2})


def test_missing_size_names_the_index_and_the_tensor():
    with pytest.raises(EinattnError, match=r"no size for index 'j' of W; pass sizes=\{'j': "):
        check_equivalent(MATMUL, MATMUL, {"τ": 3, "i": 4})


def test_missing_size_of_an_input_named_by_inputs():
    with pytest.raises(EinattnError, match=r"no size for index 'σ' of S"):
        check_equivalent(lambda S: S, lambda S: S, {"τ": 2}, inputs={"S": "τ σ"})


def test_exact_mode_beside_a_function_falls_back_to_float64_for_a_scale_saying_why():
    report = check_equivalent(f"{SCORES} / √a", function(f"{SCORES} / √a"), SCORES_SIZES,
                              exact=True)
    assert report.equal and report.mode == "float"
    assert report.note == (f"float64: function of {SCORES} / √a is Python code, which the "
                           f"finite field cannot run, and {SCORES} / √a divides by √a, which is "
                           f"irrational in general")
    assert str(report).endswith(f"\n  {report.note}")


def test_exact_mode_rejects_a_side_that_returns_floats():
    with pytest.raises(EinattnError, match=r"exact=True but a side returned floating-point"):
        check_equivalent(MATMUL, lambda X, W: (X @ W) / 1, MATMUL_SIZES, exact=True)


def test_sides_of_different_shapes_name_both_shapes():
    with pytest.raises(AssertionError, match=r"different shapes: \(3, 5\) from Y\[τ j\] = "
                                             r"X\[τ i\] W\[i j\] but \(5, 3\) from .*<lambda>$"):
        assert_equivalent(MATMUL, lambda X, W: (X @ W).T, MATMUL_SIZES)


@pytest.mark.parametrize("exact", [False, True])
def test_check_equivalent_refuses_sides_of_different_shapes_as_an_einattn_error(exact):
    """A review: the non-raising form raised a bare AssertionError (as assert_equivalent)."""
    with pytest.raises(SidesDiffer, match=r"different shapes: \(3, 4\) from .* but \(4, 3\)"):
        check_equivalent("Y[τ σ] = Q[τ a] K[σ a]", "Y[σ τ] = Q[τ a] K[σ a]",
                         {"τ": 3, "σ": 4, "a": 2}, exact=exact)


@pytest.mark.parametrize("draws", [0, -1, 2.0, True])
def test_draws_must_be_a_positive_int(draws):
    with pytest.raises(EinattnError, match=r"draws must be a positive int, got "):
        check_equivalent(MATMUL, MATMUL, MATMUL_SIZES, draws=draws)
