"""Equation.grad (einattn._grad, _grad_terms) and the Kronecker delta δ (einattn._delta): the
gradient of each of the derivation's equations (1)–(5), of the softmax, of a softcap, of a
diagonal, of a broadcast index, of grouped indices and of a tensor used twice, as index
equations that run given the forward's tensors, its output and the cotangent; each equal to
autograd, exactly in the finite field where it allows, in float64 where not; their LaTeX;
the refusals by name."""

from __future__ import annotations

import pytest
import torch

from einattn import EinattnError, Equation, functional
from einattn.verify import check_gradient

SIZES = {"n": 2, "τ": 3, "σ": 4, "μ": 2, "a": 4, "i": 5, "B": 3, "g": 2, "r": 3}

# (forward, wrt, the gradient it derives, the mode that proves it)
DERIVED = {
    "(1) dX": (functional.PROJECT, "X", "dX[n τ i] = dP[n τ μ B a] W[(μ B a) i]", "field"),
    "(1) dW": (functional.PROJECT, "W", "dW[(μ B a) i] = dP[n τ μ B a] X[n τ i]", "field"),
    "(2) dQ": (functional.SCORES, "Q", "dQ[n μ τ a] = dS[n μ τ σ] K[n μ σ a] / √a", "field"),
    "(2) dK": (functional.SCORES, "K", "dK[n μ σ a] = dS[n μ τ σ] Q[n μ τ a] / √a", "field"),
    "(3) dS": (functional.SOFTMAX, "S", "dS[n μ τ σ] = A[n μ τ σ] · (dA[n μ τ σ] "
               "− sum_σ(A[n μ τ σ] dA[n μ τ σ]))", "field"),
    "(3) dM": (functional.SOFTMAX, "M", "dM[n μ τ σ] = A[n μ τ σ] · (dA[n μ τ σ] "
               "− sum_σ(A[n μ τ σ] dA[n μ τ σ]))", "field"),
    "(4) dA": (functional.VALUES, "A", "dA[n μ τ σ] = dZ[n μ τ a] V[n μ σ a]", "field"),
    "(4) dV": (functional.VALUES, "V", "dV[n μ σ a] = dZ[n μ τ a] A[n μ τ σ]", "field"),
    "(5) dZ": (functional.HEADS, "Z", "dZ[n μ τ a] = dY[n τ i] W_O[μ a i]", "field"),
    "(5) dW_O": (functional.HEADS, "W_O", "dW_O[μ a i] = dY[n τ i] Z[n μ τ a]", "field"),
    "softmax": (Equation("A[τ σ] = softmax_σ(S[τ σ])"), "S",
                "dS[τ σ] = A[τ σ] · (dA[τ σ] − sum_σ(A[τ σ] dA[τ σ]))", "field"),
    "softcap c·tanh(S/c)": (Equation("C[τ σ] = c · tanh(S[τ σ] / c)"), "S",
                            "dS[τ σ] = dC[τ σ] · c · (1 − tanh(S[τ σ] / c) · tanh(S[τ σ] / c))"
                            " / c", "float"),
    "a diagonal": (Equation("Y[τ] = X[τ τ]"), "X", "dX[τ τʹ] = dY[τ] δ[τ τʹ]", "field"),
    "a broadcast index": (Equation("Y[τ σ] = X[τ] W[τ σ]"), "X", "dX[τ] = dY[τ σ] W[τ σ]",
                          "field"),
    "summed alone": (Equation("Y[τ] = sum_σ(X[τ σ])"), "X", "dX[τ σ] = dY[τ] δ[σ]", "field"),
    "grouped (g r)": (Equation("Z[n (g r) τ a] = P[n (g r) τ σ] V[n g σ a]"), "V",
                      "dV[n g σ a] = dZ[n (g r) τ a] P[n (g r) τ σ]", "field"),
    "used twice": (Equation("S[τ σ] = X[τ i] W[i j] X[σ j]"), "X",
                   "dX[τ i] = dS[τ σ] W[i j] X[σ j] + dS[τʹ τ] X[τʹ iʹ] W[iʹ i]", "field"),
    "logsumexp": (Equation("L[τ] = logsumexp_σ(S[τ σ])"), "S",
                  "dS[τ σ] = dL[τ] · softmax_σ(S[τ σ])", "field"),
    "a quotient": (Equation("Y[τ] = X[τ σ] / W[τ]"), "W", "dW[τ] = −dY[τ] X[τ σ] / W[τ] / W[τ]",
                   "field"),
}


def sizes_for(equation) -> dict[str, int]:
    """SIZES, with σ = τ where a tensor is read at both (X[τ i] and X[σ j])."""
    square = "X[σ j]" in equation.text or "X[τ τ]" in equation.text
    return {**SIZES, "σ": SIZES["τ"] if square else SIZES["σ"], "j": SIZES["i"]}


@pytest.mark.parametrize("forward, wrt, text, mode", DERIVED.values(), ids=DERIVED.keys())
def test_the_derived_gradient_is_autograds(forward, wrt, text, mode):
    gradient = forward.grad(wrt)
    assert gradient.text == text
    for exact in (True, False):
        report = check_gradient(forward, "auto", wrt=wrt, sizes=sizes_for(forward), exact=exact)
        assert report.equal, str(report)
        assert report.mode == (mode if exact else "float")
        assert report.rhs.endswith(text)


@pytest.mark.parametrize("forward, wrt, text, mode", DERIVED.values(), ids=DERIVED.keys())
def test_a_derived_gradient_doubled_is_caught(forward, wrt, text, mode):
    """The check can fail: twice the gradient is not the gradient (all are nonzero)."""
    lhs, rhs = text.split(" = ", 1)
    report = check_gradient(forward, f"{lhs} = 2 · ({rhs})", wrt=wrt, sizes=sizes_for(forward),
                            exact=True)
    assert not report.equal and report.mode == mode


def test_a_gradient_runs_on_the_forwards_tensors_its_output_and_the_cotangent_alone():
    """δ is built in: the diagonal's gradient takes dY and nothing else."""
    dY = torch.arange(1.0, 4.0)
    assert torch.equal(Equation("Y[τ] = X[τ τ]").grad("X")(dY=dY), torch.diag(dY))
    X = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    (autograd,) = torch.autograd.grad(torch.diagonal(X), X, dY.double())
    assert torch.equal(Equation("Y[τ] = X[τ τ]").grad("X")(dY=dY.double()), autograd)


def test_a_delta_alone_on_an_index_needs_its_size():
    gradient = Equation("Y[τ] = sum_σ(X[τ σ])").grad("X")
    assert gradient(dY=torch.ones(3), σ=4).shape == (3, 4)
    with pytest.raises(EinattnError, match=r"index 'σ' is on δ alone: give its size as a "
                                           r"keyword, σ=\.\.\."):
        gradient(dY=torch.ones(3))


def test_a_delta_takes_no_group():
    with pytest.raises(EinattnError, match="δ takes single indices, no group"):
        Equation("Y[(τ σ)] = X[τ σ] δ[(τ σ)]")


def test_the_gradients_latex_reads_back_as_the_gradient():
    for forward, wrt, text, _ in DERIVED.values():
        gradient = forward.grad(wrt)
        assert Equation.from_latex(gradient.latex()).text == text


REFUSED = {
    "a maximum": ("M[τ] = max_σ(S[τ σ])", "S", r"grad: max_σ\(S\[τ σ\]\) has no closed-form "
                  r"gradient here \(the derivative of a maximum is a comparison\)"),
    "a pairwise maximum": ("M[τ] = max(S[τ], T[τ])", "S", r"grad: max\(S\[τ\], T\[τ\]\) has no "
                           "closed-form gradient"),
    "a scalar": ("C[τ] = c · S[τ]", "c", r"grad: 'c' is a scalar of C\[τ\] = c · S\[τ\] \(its "
                 r"tensors: S\): a gradient is taken with respect to a tensor"),
    "no tensor of it": ("S[τ σ] = Q[τ a] K[σ a]", "V", r"grad: 'V' is no tensor of S\[τ σ\]"),
}


@pytest.mark.parametrize("forward, wrt, message", REFUSED.values(), ids=REFUSED.keys())
def test_a_gradient_with_no_closed_form_is_refused_by_name(forward, wrt, message):
    with pytest.raises(EinattnError, match=message):
        Equation(forward).grad(wrt)


def test_auto_needs_an_equation():
    with pytest.raises(EinattnError, match=r"gradient='auto' derives the gradient of an "
                                           r"equation, but the forward is .*<lambda>"):
        check_gradient(lambda S: S, "auto", wrt="S", shapes={"S": "τ", "out": "τ"},
                       sizes={"τ": 2})
