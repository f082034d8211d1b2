"""The finite-field exact mode (einattn._field, _field_tensor, _field_tape, _field_eval,
_field_check): its arithmetic, what it proves through exp, softmax, logsumexp, max and
division, what it refuses (saying why, the step then in float64), its bound, and the
issue's must-show: wrong steps float64 accepts and the field rejects; every registered
exact step accepted with no false rejection over many seeds (EINATTN_SEEDS, 1000 in the
report, 10 by default)."""

from __future__ import annotations

import math
import os
from fractions import Fraction

import pytest
import torch

from einattn import EinattnError, Equation, derivation, field_steps
from einattn._field import PRIMES, Field, field_for
from einattn._field_check import mask_draw
from einattn.chain import Chain
from einattn.verify import check_equivalent, check_gradient

P = Field(PRIMES[0])
ROWS = {"τ": 3, "σ": 5, "a": 4}
SOFTMAX = "A[τ σ] = softmax_σ(S[τ σ])"


def is_prime(n: int) -> bool:
    return n > 1 and all(n % k for k in range(2, math.isqrt(n) + 1))


# -- the arithmetic ----------------------------------------------------------------------------

def test_every_prime_is_a_safe_prime_below_2_to_the_31():
    for p in PRIMES:
        assert p < 2**31 and is_prime(p) and is_prime((p - 1) // 2)


def test_g_generates_the_squares_and_exp_is_a_homomorphism():
    assert pow(4, P.q, P.p) == 1 and pow(4, 2, P.p) != 1  # order q, a prime
    x, y = torch.randint(0, P.q, (50,)), torch.randint(0, P.q, (50,))
    assert torch.equal(P.exp(x + y), P.mul(P.exp(x), P.exp(y)))
    assert torch.equal(P.exp(torch.tensor([1, 2, P.q])), torch.tensor([4, 16, 1]))


def test_inverses_roots_and_fractions():
    a = torch.randint(1, P.p, (100,))
    assert torch.equal(P.mul(a, P.inverse(a)), torch.ones(100, dtype=torch.int64))
    assert int(P.inverse(torch.tensor(0))) == 0  # 1/0 reads 0: counted in the bound
    assert P.sqrt(16) == 4 or P.sqrt(16) == P.p - 4
    root = field_for({5, 7})
    assert all(root.sqrt(n) ** 2 % root.p == n for n in (5, 7))
    assert P.value(Fraction(1, 2)) * 2 % P.p == 1 and P.exponent(Fraction(1, 3)) * 3 % P.q == 1


def test_a_contraction_in_the_field_is_the_integers_reduced():
    A = torch.randint(0, P.p, (3, 40))
    B = torch.randint(0, P.p, (40, 5))
    exact = [[sum(int(A[i, k]) * int(B[k, j]) for k in range(40)) % P.p for j in range(5)]
             for i in range(3)]
    assert P.contract("ik,kj->ij", A, B).tolist() == exact


def test_too_many_products_in_one_entry_is_an_error():
    with pytest.raises(EinattnError, match=r"sums 40,000 products in one entry, over its "
                                           r"limit of 32,768: choose smaller sizes"):
        P.contract("ik,k->i", torch.ones(2, 40_000, dtype=torch.int64),
                   torch.ones(40_000, dtype=torch.int64))


def test_no_field_with_every_root_is_an_error(monkeypatch):
    from einattn import _field
    monkeypatch.setattr(_field, "PRIMES", (2147483579,))
    square_free = next(n for n in range(2, 100) if Field(2147483579).sqrt(n) is None)
    with pytest.raises(EinattnError, match=rf"no field of einattn's has a square root of every "
                                           rf"size \[{square_free}\]"):
        _field.field_for({square_free})


# -- what the field proves ----------------------------------------------------------------------

IDENTITIES = {
    "softmax = exp / sum exp": (SOFTMAX, "A[τ σ] = exp(S[τ σ]) / sum_σ(exp(S[τ σ]))"),
    "max subtracted (a free value)": (
        SOFTMAX, "A[τ σ] = exp(S[τ σ] − max_σ(S[τ σ])) / sum_σ(exp(S[τ σ] − max_σ(S[τ σ])))"),
    "logsumexp = max + log sum exp(S − max)": (
        "L[τ] = logsumexp_σ(S[τ σ])",
        "L[τ] = max_σ(S[τ σ]) + log(sum_σ(exp(S[τ σ] − max_σ(S[τ σ]))))"),
    "exp(a + b) = exp(a) exp(b)": ("E[τ σ] = exp(S[τ σ] + T[τ σ])",
                                   "E[τ σ] = exp(S[τ σ]) · exp(T[τ σ])"),
    "a scale inside the softmax (√4 = 2)": (
        "Z[τ a] = softmax_σ(S[τ σ] / √a) V[σ a]",
        "Z[τ a] = exp(S[τ σ] / √a) V[σ a] / sum_σ(exp(S[τ σ] / √a))"),
    "the scores, divided by √a": ("S[τ σ] = Q[τ a] K[σ a] / √a", "S[τ σ] = K[σ a] Q[τ a] / √a"),
}


@pytest.mark.parametrize("lhs, rhs", IDENTITIES.values(), ids=IDENTITIES.keys())
def test_the_identities_of_attention_hold_exactly_in_the_field(lhs, rhs):
    report = check_equivalent(lhs, rhs, ROWS, exact=True)
    assert report.equal and report.mode == "field" and report.max_deviation == 0, str(report)
    assert report.false_acceptance < 1e-15 and report.prime in PRIMES


def test_a_wrong_softmax_is_caught_in_every_entry_it_changes():
    report = check_equivalent(SOFTMAX, "A[τ σ] = exp(S[τ σ]) / sum_τ(exp(S[τ σ]))", ROWS,
                              exact=True)
    assert not report.equal and report.max_deviation == 15 and report.where == "[τ=0, σ=0]"
    assert str(report).splitlines()[-1] == "  15 entries differ, the first at [τ=0, σ=0]"


def test_the_report_states_the_prime_the_draws_and_the_bound():
    """Y = X W: each entry a sum of products of degree 2; the bound is (2/q)^draws."""
    for draws in (1, 3, 5):
        report = check_equivalent("Y[τ j] = X[τ i] W[i j]", "Y[τ j] = W[i j] X[τ i]",
                                  {"τ": 3, "i": 4, "j": 5}, exact=True, draws=draws)
        assert report.false_acceptance == pytest.approx((2 / P.q) ** draws, rel=1e-12)
        assert str(report).splitlines()[0] == (
            f"equal: exact (finite field, p = {P.p}, {draws} draws; false-pass probability "
            f"≤ {report.false_acceptance:.1e})")


def test_max_is_a_free_value_one_per_text():
    """The same max_σ(S) in two places is one value; a maximum the step needs to be the
    largest (here: max of S + 1 against max of S, plus 1) is two free values, and the
    field refuses what only the order of the reals makes true."""
    assert check_equivalent("M[τ] = max_σ(S[τ σ])", "M[τ] = max_σ(S[τ σ])", ROWS,
                            exact=True).equal
    shifted = check_equivalent("M[τ] = max_σ(S[τ σ] + 1)", "M[τ] = max_σ(S[τ σ]) + 1", ROWS,
                               exact=True)
    assert shifted.mode == "field" and not shifted.equal
    assert check_equivalent("M[τ] = max_σ(S[τ σ] + 1)", "M[τ] = max_σ(S[τ σ]) + 1", ROWS).equal


REFUSED = {
    "tanh": ("C[τ σ] = c · tanh(S[τ σ] / c)", "tanh has no finite-field form"),
    "a log outside exp": ("Y[τ] = log(sum_σ(exp(S[τ σ]))) · W[τ]",
                          "log outside exp: a logarithm has no value in a finite field"),
    "a product inside exp": ("A[τ σ] = softmax_σ(Q[τ a] K[σ a])",
                             "inside exp, a contraction of drawn values (no bound holds)"),
    "a drawn value inside and outside exp": ("Y[τ σ] = S[τ σ] · exp(S[τ σ])",
                                             "S is read both as a value and inside exp"),
    "a root of a non-square inside exp": ("A[τ σ] = softmax_σ(S[τ σ] / √σ)",
                                          "inside exp, a division by √5, which is irrational"),
}


@pytest.mark.parametrize("equation, why", REFUSED.values(), ids=REFUSED.keys())
def test_what_the_field_cannot_do_runs_in_float64_saying_why(equation, why):
    report = check_equivalent(equation, equation, ROWS, exact=True)
    assert report.equal and report.mode == "float" and why in report.note
    assert report.note.startswith("float64: ") and str(report).endswith(report.note)


NO_IDENTITY = {  # a review: each was equal in the field, and none holds for real numbers
    "x / 0 = 0": ("B[τ] = x[τ] / (y[τ] − y[τ])", "B[τ] = 0 · x[τ]"),
    "x / 0 = z / 0": ("B[τ] = x[τ] / (y[τ] − y[τ])", "B[τ] = z[τ] / (y[τ] − y[τ])"),
    "signs inside paired logs": ("l[τ] = log(a[τ]) + log(b[τ])",
                                 "l[τ] = log(−a[τ]) + log(−b[τ])"),
    "the log of a negative sum": ("l[τ] = logsumexp_σ(S[τ σ]) + log(b[τ])",
                                  "l[τ] = log(−sum_σ(exp(S[τ σ]))) + log(−b[τ])"),
    "a constant ≡ 1 mod p": ("B[τ σ] = S[τ σ]", "B[τ σ] = 2147483580 · S[τ σ]"),
    "a shift by q inside exp": ("A[τ σ] = softmax_σ(S[τ σ])",
                                "A[τ σ] = exp(S[τ σ] + 1073741789) / sum_σ(exp(S[τ σ]))"),
}


@pytest.mark.parametrize("lhs, rhs", NO_IDENTITY.values(), ids=NO_IDENTITY.keys())
def test_what_the_field_takes_but_the_reals_do_not_is_rejected(lhs, rhs):
    report = check_equivalent(lhs, rhs, ROWS, exact=True)
    assert not report.equal, report
    assert ("over the reals" in report.note or "divides by zero" in report.note), report


def test_a_true_identity_of_logs_still_passes_in_the_field():
    report = check_equivalent("l[τ] = log(a[τ]) + log(b[τ])", "l[τ] = log(a[τ] b[τ])", ROWS,
                              exact=True)
    assert report.equal and report.mode == "field", report


def test_a_mask_draws_zeros_and_minus_infinities_with_a_key_in_every_row():
    kept = mask_draw((4, 6, 3), torch.Generator().manual_seed(0))
    assert set(kept.unique().tolist()) == {0, 1} and bool((kept.sum(-1) > 0).all())
    masked = "A[τ σ] = softmax_σ(S[τ σ] + M[τ σ])"
    multiplier = "A[τ σ] = exp(S[τ σ]) · exp(M[τ σ]) / sum_σ(exp(S[τ σ]) · exp(M[τ σ]))"
    for exact in (True, False):
        assert check_equivalent(masked, multiplier, ROWS, exact=exact, masks=("M",)).equal


def test_masks_name_tensors_of_the_step():
    with pytest.raises(EinattnError, match=r"masks names 'B', which is no tensor of the step "
                                           r"\(its tensors: S\)"):
        check_equivalent(SOFTMAX, SOFTMAX, ROWS, exact=True, masks=("B",))


def test_a_mask_has_no_integer_form():
    report = check_equivalent("A[τ σ] = S[τ σ] M[τ σ]", lambda S, M: S * M, ROWS, exact=True,
                              masks=("M",))
    assert report.mode == "float"
    assert report.note.endswith("<lambda> is Python code, which the finite field cannot run, "
                                "and an additive mask (−∞) is no integer")


# -- gradients: autograd in the field ------------------------------------------------------------

def test_the_softmax_backward_is_exact_in_the_field_and_a_wrong_one_is_caught():
    right = "dS[τ σ] = A[τ σ] · (dA[τ σ] − sum_σ(A[τ σ] · dA[τ σ]))"
    report = check_gradient(SOFTMAX, right, wrt="S", sizes=ROWS, exact=True)
    assert report.equal and report.mode == "field" and report.false_acceptance < 1e-15
    wrong = check_gradient(SOFTMAX, "dS[τ σ] = A[τ σ] · dA[τ σ]", wrt="S", sizes=ROWS,
                           exact=True)
    assert not wrong.equal and wrong.mode == "field"


def test_autograd_of_a_maximum_is_refused_in_the_field():
    report = check_gradient("M[τ] = max_σ(S[τ σ])", "dS[τ σ] = dM[τ] · δ[σ]", wrt="S",
                            sizes=ROWS, exact=True)
    assert report.mode == "float" and "whose derivative is a comparison" in report.note


def test_autograd_needs_an_input_of_the_forward():
    from einattn.verify import Autograd
    with pytest.raises(EinattnError, match=r"wrt='K' is not an input of the forward "
                                           r"A\[τ σ\] = softmax_σ\(S\[τ σ\]\); its inputs are S"):
        Autograd(Equation(SOFTMAX), "K")


# -- chains -------------------------------------------------------------------------------------

def test_a_chain_runs_its_equations_in_order_in_float64_and_in_the_field():
    chain = Chain("m[τ] = max_σ(S[τ σ])", "P[τ σ] = exp(S[τ σ] − m[τ])",
                  "A[τ σ] = P[τ σ] / sum_σ(P[τ σ])")
    assert (chain.operands, chain.output, chain.indices) == (("S",), "A", ("τ", "σ"))
    assert str(chain) == "; ".join(e.text for e in chain.equations)
    for exact in (True, False):
        assert check_equivalent(chain, SOFTMAX, ROWS, exact=exact).equal


CHAIN_ERRORS = {
    "empty": ((), "a Chain holds one equation at least"),
    "defined twice": (("P[τ] = Q[τ a] v[a]", "P[τ] = Q[τ a] w[a]"), "P is defined twice"),
    "read before defined": (("Y[τ] = P[τ] v[τ]", "P[τ] = Q[τ a] w[a]"), "P is defined twice, "
                            "or read before it is defined"),
}


@pytest.mark.parametrize("equations, message", CHAIN_ERRORS.values(), ids=CHAIN_ERRORS.keys())
def test_a_chain_that_is_no_chain_is_an_error(equations, message):
    with pytest.raises(EinattnError, match=message):
        Chain(*equations)


def test_a_chain_called_without_a_tensor_names_it():
    with pytest.raises(EinattnError, match=r"missing tensor v: the chain .* takes Q, v"):
        Chain("P[τ] = Q[τ a] v[a]", "Y[τ] = P[τ] P[τ]")(Q=torch.ones(2, 3))


# -- the must-show: what float64 passes and the field does not; no false rejection ---------------

@pytest.mark.parametrize("step", field_steps.subtle_mutations(derivation.default_sizes()),
                         ids=lambda step: step.name)
def test_a_wrong_step_float64_accepts_is_rejected_by_the_field(step):
    float64 = check_equivalent(step.lhs, step.rhs, step.sizes)
    field = check_equivalent(step.lhs, step.rhs, step.sizes, exact=True)
    assert float64.equal and 0 < float64.max_deviation <= float64.tolerance
    assert not field.equal and field.mode == "field" and field.false_acceptance < 1e-15


SEEDS = int(os.environ.get("EINATTN_SEEDS", "10"))  # 1000 for the report: ~11 minutes


def exact_steps():
    return [step for step in derivation.steps() if step.exact]


@pytest.mark.parametrize("name", [step.name for step in exact_steps()])
def test_no_false_rejection_of_a_registered_exact_step_over_many_seeds(name):
    """Each correct exact step passes at every seed: a false rejection is impossible in
    exact arithmetic, and this shows none happens (EINATTN_SEEDS=1000 runs 1000 seeds)."""
    (step,) = [s for s in exact_steps() if s.name == name]
    for seed in range(SEEDS):
        report = check_equivalent(step.lhs, step.rhs, step.sizes, exact=True, seed=seed,
                                  inputs=step.inputs or None, draws=step.draws,
                                  masks=step.masks)
        assert report.equal, f"seed {seed}: {report}"
