"""The expression language of ``Equation``: named-axis functions, elementwise functions,
sums and scalars, against torch written out by hand, in float64 at ≤1e-12, with all
sizes distinct; its LaTeX, its ``explain()``, and every error with its caret."""

from __future__ import annotations

import math
import pickle
from pathlib import Path

import pytest
import torch
from test_errors import _raise_sites

import einattn
from einattn import EinattnError, Equation, equations
from einattn import functional as F

F64 = torch.float64
n, μ, τ, σ, a, c_ = 2, 3, 5, 7, 4, 6  # all distinct


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)


def dead_row_mask():
    """0 / −∞ with about a third blocked and the whole row (0, 1, 2) blocked."""
    blocked = randn(n, μ, τ, σ, seed=9) < -0.5
    blocked[0, 1, 2] = True
    return torch.zeros(n, μ, τ, σ, dtype=F64).masked_fill(blocked, -math.inf)


def masked_softmax_by_hand(S, M):
    allowed = M == 0
    A = torch.softmax(S.masked_fill(~allowed, -math.inf), dim=-1)
    return torch.where(allowed.any(-1, keepdim=True), A, 0.0)


SOFTMAX = "A[n μ τ σ] = softmax_σ(S[n μ τ σ] + M[n μ τ σ])"


# -- must show: (3), logsumexp, softcap -----------------------------------------------------

def test_softmax_of_scores_plus_mask_is_the_masked_softmax_forward_and_backward():
    S, M = randn(n, μ, τ, σ, seed=1).requires_grad_(), dead_row_mask()
    A = Equation(SOFTMAX)(S=S, M=M)
    close(A, masked_softmax_by_hand(S, M))
    assert torch.equal(A[0, 1, 2], torch.zeros(σ, dtype=F64))  # exact zeros
    dA = randn(n, μ, τ, σ, seed=2)
    (dS,) = torch.autograd.grad(A, S, dA)
    S_ref = S.detach().clone().requires_grad_()
    (dS_ref,) = torch.autograd.grad(masked_softmax_by_hand(S_ref, M), S_ref, dA)
    assert torch.isfinite(dS).all()
    assert torch.equal(dS[0, 1, 2], torch.zeros(σ, dtype=F64))
    close(dS, dS_ref)


def test_softmax_equation_passes_gradcheck_with_a_fully_masked_row():
    M = dead_row_mask()[:1, :2]
    S = randn(1, 2, τ, σ, seed=3).requires_grad_()
    eq = Equation(SOFTMAX)
    assert torch.autograd.gradcheck(lambda S: eq(S=S, M=M), (S,))


def test_the_mask_is_added_by_index_name_and_may_lack_indices():
    S, M = randn(n, μ, τ, σ, seed=1), dead_row_mask()[0, 0]  # M[τ σ]
    A = Equation("A[n μ τ σ] = softmax_σ(S[n μ τ σ] + M[τ σ])")(S=S, M=M)
    close(A, masked_softmax_by_hand(S, M.expand(n, μ, τ, σ)))
    Mt = M.T.contiguous()  # M[σ τ]: the same mask lying the other way
    close(Equation("A[n μ τ σ] = softmax_σ(S[n μ τ σ] + M[σ τ])")(S=S, M=Mt), A)


def test_logsumexp_is_torch_logsumexp():
    S = randn(n, τ, σ, seed=4)
    L = Equation("L[n τ] = logsumexp_σ(S[n τ σ])")
    assert torch.equal(L(S=S), torch.logsumexp(S, dim=-1))
    S[1, 2] = -math.inf  # an empty sum: −∞, with a zero gradient rather than NaN
    S.requires_grad_()
    out = L(S=S)
    assert out[1, 2] == -math.inf
    (g,) = torch.autograd.grad(out[0].sum() + out[1, :2].sum(), S)
    assert torch.isfinite(g).all() and torch.equal(g[1, 2], torch.zeros(σ, dtype=F64))


def test_softcap_is_c_tanh_s_over_c():
    S = randn(τ, σ, seed=5) * 4
    C = Equation("C[τ σ] = c · tanh(S[τ σ] / c)")
    close(C(S=S, c=2.0), 2.0 * torch.tanh(S / 2.0))  # bit for bit on the CPU; CUDA divides
    close(C(S=S, c=torch.tensor(3.0, dtype=F64)), 3.0 * torch.tanh(S / 3.0))  # by a number
    # as a product with its reciprocal, by a tensor truly


@pytest.mark.parametrize("text, reference", [
    ("M[n τ] = max_σ(S[n τ σ])", lambda S: S.amax(-1)),
    ("T[n τ] = sum_σ(S[n τ σ])", lambda S: S.sum(-1)),
    ("R[n σ] = sum_τ(S[n τ σ])", lambda S: S.sum(1)),
    ("E[σ n τ] = exp(S[n τ σ])", lambda S: S.exp().permute(2, 0, 1)),
    ("G[n τ σ] = log(exp(S[n τ σ]) + 1)", lambda S: torch.log(S.exp() + 1)),
    ("P[n τ σ] = softmax_τ(S[n τ σ])", lambda S: torch.softmax(S, dim=1)),
    ("D[n τ σ] = −S[n τ σ] - 2 · S[n τ σ]", lambda S: -S - 2 * S),
    ("H[n τ σ] = (S[n τ σ] + 1) / (S[n τ σ] − 0.5)", lambda S: (S + 1) / (S - 0.5)),
    ("N[n τ σ] = exp(S[n τ σ] − max_σ(S[n τ σ])) / sum_σ(exp(S[n τ σ] − max_σ(S[n τ σ])))",
     lambda S: torch.softmax(S, dim=-1)),
])
def test_functions_and_arithmetic_against_torch(text, reference):
    S = randn(n, τ, σ, seed=6)
    close(Equation(text)(S=S), reference(S))


def test_a_product_that_sums_is_a_contraction_inside_functions():
    Q, K, m, V = randn(τ, a, seed=1), randn(σ, a, seed=2), randn(τ, seed=3), randn(σ, c_, seed=4)
    eq = Equation("Z[τ c] = exp(Q[τ a] K[σ a] / √a − m[τ]) V[σ c]")
    close(eq(Q=Q, K=K, m=m, V=V), torch.exp(Q @ K.T / math.sqrt(a) - m[:, None]) @ V)
    kinds = [stage.kind for stage in eq.explain(Q=Q, K=K, m=m, V=V).stages]
    assert kinds == ["contraction", "entrywise", "entrywise", "contraction"]


def test_the_online_softmax_update_of_one_tile():
    """``m' = max(m, max_σ S)``, ``l' = exp(m − m') l + Σ_σ exp(S − m')``."""
    S, m, total = randn(n, τ, σ, seed=1), randn(n, τ, seed=2), randn(n, τ, seed=3).abs()
    new_m = Equation("mʹ[n τ] = max(m[n τ], max_σ(S[n τ σ]))")(m=m, S=S)
    assert torch.equal(new_m, torch.maximum(m, S.amax(-1)))
    new_l = Equation("lʹ[n τ] = exp(m[n τ] − mʹ[n τ]) l[n τ] + sum_σ(exp(S[n τ σ] − mʹ[n τ]))")
    close(new_l(m=m, mʹ=new_m, l=total, S=S),
          torch.exp(m - new_m) * total + torch.exp(S - new_m[..., None]).sum(-1))


def test_grouped_terms_open_and_a_grouped_output_flattens():
    X = randn(τ, μ * a, seed=1)
    eq = Equation("Y[τ (μ a)] = exp(X[τ (μ a)])")
    close(eq(X=X, μ=μ), X.exp())
    close(Equation("Y[μ τ a] = tanh(X[τ (μ a)])")(X=X, μ=μ),
          X.tanh().view(τ, μ, a).permute(1, 0, 2))


def test_masked_softmax_runs_the_equation_and_its_fast_paths_agree(monkeypatch):
    S, M = randn(n, μ, τ, σ, seed=1), dead_row_mask()
    A = F.masked_softmax(S, M)
    assert torch.equal(A, F.SOFTMAX(S=S, M=M))
    assert torch.equal(A, F.masked_softmax(S, M == 0))  # boolean: the fast path
    assert torch.equal(A, F.masked_softmax(S, M, every_row_sees_a_key=False))
    calls = []
    monkeypatch.setattr(equations, "SOFTMAX", lambda **kw: calls.append(kw) or A)
    F.masked_softmax(S, M[0, 0])  # M[τ σ] broadcast: still the equation
    assert len(calls) == 1 and calls[0]["M"].shape == S.shape


def test_cli_latex_of_3_is_rendered():
    from einattn import cli
    assert cli.SOFTMAX_LATEX == F.SOFTMAX.latex()


# -- review of issue 27: each case failed before its fix ---------------------------------------

x_, y_, z_, w_ = randn(τ, a, seed=11), randn(a, seed=12), randn(a, seed=13), randn(a, seed=14)
BOUND = [  # an index a neighbour's reduction binds is not held: the inner product still sums
    ("O[τ] = exp(x[τ a] y[a]) sum_a(z[a])", lambda: torch.exp(x_ @ y_) * z_.sum()),
    ("O[τ] = exp(x[τ a] y[a]) max_a(z[a])", lambda: torch.exp(x_ @ y_) * z_.amax()),
    ("O[τ] = sum_a(z[a]) · exp(x[τ a] y[a])", lambda: z_.sum() * torch.exp(x_ @ y_)),
    ("O[τ] = exp(x[τ a] y[a]) logsumexp_a(z[a])",
     lambda: torch.exp(x_ @ y_) * torch.logsumexp(z_, 0)),
    # a neighbour that does carry a: summed outside, as before
    ("O[τ] = exp(x[τ a] y[a]) w[a]", lambda: (torch.exp(x_ * y_) * w_).sum(-1)),
]


@pytest.mark.parametrize("text, reference", BOUND, ids=[t for t, _ in BOUND])
def test_a_reduction_of_a_neighbour_does_not_hold_its_bound_index(text, reference):
    eq = Equation(text)
    close(eq(**{k: v for k, v in dict(x=x_, y=y_, z=z_, w=w_).items() if k in eq.operands}),
          reference())


def _masking_inputs():
    """S, B finite but S's row (0, 1) all −∞; M 0/−∞ with row (1, 2) all −∞."""
    S, B = randn(2, τ, σ, seed=21), randn(2, τ, σ, seed=22)
    S[0, 1] = -math.inf
    M = torch.zeros(2, τ, σ, dtype=F64).masked_fill(randn(2, τ, σ, seed=23) < -0.5, -math.inf)
    M[1, 2] = -math.inf
    return {"S": S, "B": B, "M": M}


ORDERS = [  # softmax_σ of a sum: the −∞ may stand in any term, in any order
    ("A[n τ σ] = softmax_σ(S[n τ σ] + M[n τ σ])", lambda t: t["S"] + t["M"]),
    ("A[n τ σ] = softmax_σ(M[n τ σ] + S[n τ σ])", lambda t: t["M"] + t["S"]),
    ("A[n τ σ] = softmax_σ(S[n τ σ] + B[n τ σ])", lambda t: t["S"] + t["B"]),
    ("A[n τ σ] = softmax_σ(B[n τ σ] + M[n τ σ] + S[n τ σ])",
     lambda t: t["B"] + t["M"] + t["S"]),
    ("A[n τ σ] = softmax_σ(S[n τ σ] + B[n τ σ] + M[n τ σ])",
     lambda t: t["S"] + t["B"] + t["M"]),
    ("A[n τ σ] = softmax_σ(M[n τ σ] + S[n τ σ] + 0)", lambda t: t["M"] + t["S"]),
]


@pytest.mark.parametrize("text, logits", ORDERS, ids=[t for t, _ in ORDERS])
def test_a_row_of_minus_infinity_gives_zeros_whatever_the_order(text, logits):
    given = _masking_inputs()
    S = given["S"].clone().requires_grad_()
    used = {k: v for k, v in {**given, "S": S}.items() if f"{k}[" in text}
    A = Equation(text)(**used)
    L = logits(given)
    dead = (L == -math.inf).all(-1, keepdim=True)
    e = torch.exp(L - L.amax(-1, keepdim=True).masked_fill(dead, 0.0))
    by_hand = torch.where(dead, 0.0, e / e.sum(-1, keepdim=True))
    close(A, by_hand)
    assert dead[0, 1] and torch.equal(A[0, 1], torch.zeros(σ, dtype=F64))
    dA = randn(2, τ, σ, seed=24)
    (dS,) = torch.autograd.grad(A, S, dA)
    assert torch.isfinite(dS).all()
    close(dS, by_hand * (dA - (by_hand * dA).sum(-1, keepdim=True)))  # softmax's backward


def test_nan_in_the_logits_still_propagates():
    S, M = randn(τ, σ, seed=25), torch.zeros(τ, σ, dtype=F64)
    S[1, 3], M[2] = math.nan, -math.inf
    S[2, 0] = math.nan  # NaN in a row whose every M is −∞: NaN, not zeros
    for text in ("A[τ σ] = softmax_σ(S[τ σ] + M[τ σ])", "A[τ σ] = softmax_σ(M[τ σ] + S[τ σ])"):
        A = Equation(text)(S=S, M=M)
        assert A[1].isnan().all() and A[2].isnan().all() and not A[0].isnan().any()


v_ = randn(τ, seed=31)
NUMBERS = [  # a number or a Python scalar is computed in float64, never float32
    ("O[τ] = v[τ] · exp(1)", {}, lambda: v_ * math.e),
    ("O[τ] = v[τ] + log(c)", {"c": 3.0}, lambda: v_ + math.log(3.0)),
    ("O[τ] = v[τ] · tanh(c)", {"c": 0.3}, lambda: v_ * math.tanh(0.3)),
    ("O[τ] = v[τ] · max(c, 0.1)", {"c": 0.05}, lambda: v_ * 0.1),
    ("O[τ] = max(v[τ], 0.1)", {}, lambda: torch.clamp(v_, min=0.1)),
    ("O[τ] = max(0.1, v[τ]) + exp(c) · v[τ]", {"c": -1.3},
     lambda: torch.clamp(v_, min=0.1) + math.exp(-1.3) * v_),
    ("O[τ] = v[τ] + log(c)", {"c": 0}, lambda: v_ - math.inf),  # as torch: −∞, NaN, ∞
    ("O[τ] = v[τ] + log(c)", {"c": -1.0}, lambda: v_ + math.nan),
    ("O[τ] = v[τ] · exp(c)", {"c": 1000.0}, lambda: v_ * math.inf),
    ("O[τ] = v[τ] · max(c, 2)", {"c": math.nan}, lambda: v_ + math.nan),
]


@pytest.mark.parametrize("text, scalars, reference", NUMBERS,
                         ids=[f"{t} {s}" for t, s, _ in NUMBERS])
def test_numbers_and_python_scalars_are_float64(text, scalars, reference):
    torch.testing.assert_close(Equation(text)(v=v_, **scalars), reference(), rtol=1e-15,
                               atol=1e-15, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_number_takes_the_dtype_of_the_tensor_it_meets(dtype):
    v = v_.to(dtype)
    for text, expected in (("O[τ] = max(v[τ], 0.1)", torch.clamp(v, min=0.1)),
                           ("O[τ] = v[τ] · exp(1)", v * math.e),
                           ("O[τ] = sum_τ(v[τ]) · exp(1) + v[τ]", v.sum() * math.e + v)):
        out = Equation(text)(v=v)
        assert out.dtype == dtype and torch.equal(out, expected)


X_, U_, c_value = randn(τ, a, seed=41), randn(a, seed=42), 1.7
ROUTED = [  # valid expressions that only the expression grammar reads
    ("Y[τ] = c X[τ i] U[i]", lambda: c_value * (X_ @ U_)),
    ("Y[τ] = X[τ i] c U[i]", lambda: c_value * (X_ @ U_)),
    ("Y[τ] = (X[τ i] U[i])", lambda: X_ @ U_),
    ("Y[τ] = X[τ i] (U[i])", lambda: X_ @ U_),
    ("Y[τ] = (X[τ i]) (c U[i])", lambda: X_ @ (c_value * U_)),
    ("Y[τ] = X[τ i] U[i] + .5", lambda: X_ @ U_ + 0.5),
]


@pytest.mark.parametrize("text, reference", ROUTED, ids=[t for t, _ in ROUTED])
def test_scalars_and_parentheses_in_a_product_are_expressions(text, reference):
    eq = Equation(text)
    assert type(eq) is not Equation
    close(eq(X=X_, U=U_, **({"c": c_value} if eq.scalars else {})), reference())


@pytest.mark.parametrize("text", ["A[τ σ] = softmax_σ(S[τ σ])", "L[τ] = logsumexp_σ(S[τ σ])",
                                  "A[τ σ] = softmax_σ(2 · S[τ σ])"])
def test_softmax_of_integer_logits_is_an_error_naming_the_tensor(text):
    S = torch.ones(τ, σ, dtype=torch.long)
    with pytest.raises(EinattnError, match=r"^S is torch.int64: (softmax|logsumexp)_σ takes "
                                           r"floating-point logits") as caught:
        Equation(text)(S=S)
    assert str(caught.value).splitlines()[1] == "  " + text
    assert carets(str(caught.value)) == [text.index("S[")]


@pytest.mark.parametrize("L", [σ, 0])
def test_max_of_complex_numbers_is_an_error_naming_the_tensor(L):
    """Complex numbers have no order (torch's max said NotImplementedError, and iinfo a
    TypeError over an empty σ); integers and bools still take a max."""
    text = "Y[τ] = max_σ(S[τ σ])"
    with pytest.raises(EinattnError, match=r"^S is torch.complex128: max_σ takes real "
                                           r"numbers") as caught:
        Equation(text)(S=torch.ones(τ, L, dtype=torch.complex128))
    assert carets(str(caught.value)) == [text.index("S[")]
    assert torch.equal(Equation(text)(S=torch.arange(τ * L).view(τ, L)),
                       torch.arange(τ * L).view(τ, L).amax(-1) if L else
                       torch.full((τ,), torch.iinfo(torch.int64).min))


def test_explain_of_a_longer_sum_under_a_softmax_shows_it_whole():
    text = str(Equation("A[τ σ] = softmax_σ(S[τ σ] + B[τ σ] + M[τ σ])").explain(
        S=(τ, σ), B=(τ, σ), M=(τ, σ)))
    assert "entrywise    S[τ σ] + B[τ σ] + M[τ σ] -> [τ σ]" in text
    assert "softmax      softmax_σ(S[τ σ] + B[τ σ] + M[τ σ]) -> [τ σ]" in text
    assert "+ \n" not in text and not any(line.endswith("+ ") for line in text.splitlines())


@pytest.mark.parametrize("text", [SOFTMAX, "C[τ σ] = c · tanh(S[τ σ] / c)",
                                  "S[τ σ] = Q[τ a] K[σ a] / √a"])
def test_an_equation_pickles_as_its_text(text):
    eq = Equation(text)
    given = {"S": randn(n, μ, τ, σ, seed=1), "M": dead_row_mask()} if text == SOFTMAX else \
        {"S": randn(τ, σ, seed=1), "c": 2.0} if "c ·" in text else \
        {"Q": randn(τ, a, seed=1), "K": randn(σ, a, seed=2)}
    before = eq(**given)  # plans and closures made: none of them is pickled
    again = pickle.loads(pickle.dumps(eq))
    assert type(again) is type(eq) and again.text == text
    assert torch.equal(again(**given), before)


# -- LaTeX ------------------------------------------------------------------------------------

LATEX = [
    (SOFTMAX, r"A_{n \mu \tau \sigma} = \operatorname{softmax}_{\sigma}\left(S_{n \mu \tau \sigma}"
              r" + M_{n \mu \tau \sigma}\right)"),
    ("L[n τ] = logsumexp_σ(S[n τ σ])",
     r"L_{n \tau} = \operatorname{logsumexp}_{\sigma}\left(S_{n \tau \sigma}\right)"),
    ("C[τ σ] = c · tanh(S[τ σ] / c)",
     r"C_{\tau \sigma} = c \tanh\left(\frac{S_{\tau \sigma}}{c}\right)"),
    ("Z_g[τ a] = Z[τ a] · sigmoid(G[τ a])",
     r"(Z_{g})_{\tau a} = Z_{\tau a} \operatorname{sigmoid}\left(G_{\tau a}\right)"),
    ("m[τ] = max(x[τ], max_σ(S[τ σ]))",
     r"m_{\tau} = \max\left(x_{\tau}, \max_{\sigma}\left(S_{\tau \sigma}\right)\right)"),
    ("T[τ] = sum_σ(exp(S[τ σ] − m[τ]))",
     r"T_{\tau} = \sum_{\sigma}\left(\exp\left(S_{\tau \sigma} - m_{\tau}\right)\right)"),
    ("Z[τ b] = (A[τ σ] + B[τ σ]) V[σ b] / √b",
     r"Z_{\tau b} = \frac{\left(A_{\tau \sigma} + B_{\tau \sigma}\right) V_{\sigma b}}"
     r"{\sqrt{d_{b}}}"),
    ("Y[τ] = log(2 · x[τ])", r"Y_{\tau} = \log\left(2 x_{\tau}\right)"),
    # a sum keeps its parentheses after a minus, negated, or as a factor; numbers a \cdot
    ("A[τ σ] = S[τ σ] - (S[τ σ] - M[τ σ])",
     r"A_{\tau \sigma} = S_{\tau \sigma} - \left(S_{\tau \sigma} - M_{\tau \sigma}\right)"),
    ("A[τ σ] = -(S[τ σ] + M[τ σ])",
     r"A_{\tau \sigma} = -\left(S_{\tau \sigma} + M_{\tau \sigma}\right)"),
    ("A[τ σ] = S[τ σ] + (−M[τ σ] + S[τ σ])",
     r"A_{\tau \sigma} = S_{\tau \sigma} + \left(-M_{\tau \sigma} + S_{\tau \sigma}\right)"),
    ("A[τ σ] = (S[τ σ] + M[τ σ]) + S[τ σ]",
     r"A_{\tau \sigma} = S_{\tau \sigma} + M_{\tau \sigma} + S_{\tau \sigma}"),
    ("A[τ σ] = 2 3 S[τ σ]", r"A_{\tau \sigma} = 2 \cdot 3 S_{\tau \sigma}"),
    ("A[τ σ] = S[τ σ] · 2", r"A_{\tau \sigma} = S_{\tau \sigma} \cdot 2"),
    ("A[τ σ] = (S[τ σ] + 1) / (2 · c)",
     r"A_{\tau \sigma} = \frac{S_{\tau \sigma} + 1}{2 c}"),
]


@pytest.mark.parametrize("text, tex", LATEX, ids=[t for t, _ in LATEX])
def test_latex_renders(text, tex):
    assert Equation(text).latex() == tex


def test_explain_says_what_runs():
    text = str(Equation(SOFTMAX).explain(S=(n, μ, τ, σ), M=(n, μ, τ, σ)))
    assert "softmax      softmax_σ(S[n μ τ σ] + M[n μ τ σ]) -> [n μ τ σ]" in text
    assert "contraction" not in text
    ex = Equation("Z[τ b] = softmax_σ(Q[τ a] K[σ a] / √a) V[σ b]").explain(
        Q=(τ, a), K=(σ, a), V=(σ, c_))
    assert [s.kind for s in ex.stages] == ["contraction", "softmax", "contraction"]
    assert ex.plans[0].einsum == "ba,ca->bc" and ex.plans[1] is None
    assert "FLOPs" in str(ex)


def test_sigmoid_is_one_over_one_plus_exp_minus_x_and_its_gradient_s_times_one_minus_s():
    """Qwen3-Next's gate: sigmoid runs entry by entry (a number too, without overflow), its
    derived gradient is autograd's, and verify compares it in float64, saying why."""
    from einattn.verify import check_equivalent, check_gradient
    G, Z = randn(τ, a, seed=7) * 30, randn(τ, a, seed=8)
    gate = Equation("Z_g[τ a] = Z[τ a] · sigmoid(G[τ a])")
    close(gate(Z=Z, G=G), Z * torch.sigmoid(G))
    close(Equation("O[τ] = v[τ] · sigmoid(c)")(v=Z[:, 0], c=-800.0), Z[:, 0] * 0.0)
    report = check_gradient(gate, "auto", wrt="G", sizes={"τ": τ, "a": a}, exact=True)
    assert report.equal and report.note == "float64: sigmoid has no finite-field form"
    assert not check_equivalent(gate, "Z_g[τ a] = Z[τ a] · exp(G[τ a])", {"τ": τ, "a": a}).equal


def test_verify_compares_tanh_in_float64_and_the_softmax_in_the_field():
    from einattn.verify import check_equivalent
    report = check_equivalent("C[τ σ] = c · tanh(S[τ σ] / c)",
                              "C[τ σ] = tanh(S[τ σ] / c) · c", {"τ": τ, "σ": σ}, exact=True)
    assert report.equal and report.mode == "float"
    assert report.note == "float64: tanh has no finite-field form"
    wrong = check_equivalent("C[τ σ] = c · tanh(S[τ σ] / c)", "C[τ σ] = tanh(S[τ σ] / c)",
                             {"τ": τ, "σ": σ})
    assert not wrong.equal
    softmax = check_equivalent(SOFTMAX, SOFTMAX, {"n": n, "μ": μ, "τ": τ, "σ": σ}, exact=True)
    assert softmax.equal and softmax.mode == "field"


def test_a_pure_contraction_stays_a_plain_equation():
    for text in ("S[n μ τ σ] = Q[n μ τ a] K[n μ σ a] / √a", "Y[τ j] = X[τ i] · U[i j]",
                 "S[τ σ] = Q[τ a] K[σ a] / sqrt(a)"):
        assert type(Equation(text)) is Equation
    assert type(Equation(SOFTMAX)) is not Equation and isinstance(Equation(SOFTMAX), Equation)


# -- errors: each raise site, with its caret ----------------------------------------------------

def carets(message: str) -> list[int]:
    line = message.splitlines()[2]
    return [k - 2 for k, ch in enumerate(line) if ch == "^"]


ERRORS = [  # (message template, text, match, carets)
    ("{}_{} runs along {}, which is no index of its argument {} (its indices: {})",
     "L[n τ] = logsumexp_σ(S[n τ a])", r"logsumexp_σ runs along 'σ', which is no index of its "
     r"argument S\[n τ a\] \(its indices: n, τ, a\)", [19]),
    ("{}_{} runs along {}, which is no index of its argument {} (its indices: {})",
     "A[τ] = sum_σ(max_σ(S[τ σ]))", r"sum_σ runs along 'σ', which is no index of its "
     r"argument max_σ\(S\[τ σ\]\) \(its indices: τ\)", [11]),
    ("unknown function {}: known are {}", "A[τ] = softmx_σ(S[τ σ])",
     r"unknown function 'softmx_σ': known are softmax_σ", [7]),
    ("{} needs the index it runs along, as {}_σ(…) (for the elementwise maximum of two, "
     "max(x, y))", "A[τ σ] = softmax(S[τ σ])", r"softmax needs the index it runs along", [9]),
    ("{} is elementwise: it takes no index ({}(…), not {}(…))", "A[τ σ] = exp_σ(S[τ σ])",
     r"exp is elementwise: it takes no index", [13]),
    ("{} takes {} argument{}, got {}", "A[τ] = max(S[τ], T[τ], U[τ])",
     r"max takes 2 arguments, got 3", [7]),
    ("unbalanced parentheses: this '(' is never closed (found {})",
     "A[τ σ] = softmax_σ(S[τ σ] + M[τ σ]", r"unbalanced parentheses: this '\(' is never closed "
     r"\(found the end\)", [18, 34]),
    ("a second / √: a product divides by one square root",
     "A[τ σ] = exp(Q[τ a] K[σ a] / √a / √a)", r"a second / √", [32]),
    ("index {} of {} is on neither the left nor a function's axis: only a product sums "
     "(Einstein's convention), elsewhere write sum_{}(…)", "A[τ] = exp(S[τ σ])",
     r"index 'σ' of S is on neither the left nor a function's axis", [15]),
    ("{} repeats an index: a diagonal is a contraction's, write it as a product",
     "d[i] = exp(M[i i])", r"M repeats an index", [13, 15]),
    ("output index {} {}", "A[τ σ] = max_σ(S[τ σ])", r"output index 'σ' is reduced away", [4]),
    ("output index {} {}", "A[τ ρ] = exp(S[τ]) + 1", r"output index 'ρ' is on no tensor", [4]),
    ("index {} appears twice on the left", "A[τ τ] = exp(S[τ])",
     r"index 'τ' appears twice on the left", [2, 4]),
    ("the right side has no tensor: an equation computes from tensors", "A[] = c · 2",
     r"the right side has no tensor", [6]),
    ("{} is both the output and an operand", "S[τ] = exp(S[τ])",
     r"S is both the output and an operand", [0]),
    ("{} is both a scalar and {}", "A[τ] = c · S[τ] + S", r"S is both a scalar and a tensor",
     [18]),
    ("{} is both a scalar and {}", "A[τ] = exp(τ) · S[τ]", r"τ is both a scalar and an index",
     [11]),
    ("index {} survives on the right but is not on the left: reduce it (sum_{}, max_{}, …) or "
     "put it on the left", "O[τ] = softmax_σ(S[τ σ])", r"index 'σ' survives on the right but "
     r"is not on the left", [21]),
    ("index {} survives on the right but is not on the left: reduce it (sum_{}, max_{}, …) or "
     "put it on the left", "O[τ] = exp(softmax_σ(S[τ σ])) + 1", r"index 'σ' survives", [25]),
    ("scale index {} appears on no tensor", "A[τ σ] = exp(S[τ σ]) / √c",
     r"scale index 'c' appears on no tensor", [24]),
]


@pytest.mark.parametrize("key, text, match, where", ERRORS, ids=[e[2][:40] for e in ERRORS])
def test_an_error_points_at_its_place(key, text, match, where):
    with pytest.raises(EinattnError, match=match) as caught:
        Equation(text)
    assert str(caught.value).splitlines()[1] == "  " + text
    assert carets(str(caught.value)) == where


def test_call_errors_name_the_scalar_and_the_sizes():
    eq = Equation("C[τ σ] = c · tanh(S[τ σ] / c)")
    S = randn(τ, σ)
    with pytest.raises(EinattnError, match=r"^missing scalar c: give it as a number") as caught:
        eq(S=S)
    assert carets(str(caught.value)) == [9, 27]
    eq(S=S, c=1.0)  # a good call first: what follows is checked all the same
    for bad, shown in ((True, "True"), ("2", "str"), (torch.ones(2), r"a tensor of shape \(2,\)")):
        with pytest.raises(EinattnError, match=rf"^scalar c must be a number or a 0-d tensor, "
                                               rf"got {shown}\n") as caught:
            eq(S=S, c=bad)
        assert str(caught.value).splitlines()[1] == "  " + eq.text
        assert carets(str(caught.value)) == [9, 27]
    with pytest.raises(EinattnError, match=r"index 'σ' has size 3 in M but 7 in S"):
        Equation(SOFTMAX)(S=randn(1, 1, τ, σ), M=randn(1, 1, τ, 3))
    with pytest.raises(EinattnError, match=r"M is torch.float32 but S is torch.float64"):
        Equation(SOFTMAX)(S=randn(1, 1, τ, σ), M=torch.zeros(1, 1, τ, σ))


def test_a_product_that_fails_to_parse_keeps_its_own_message():
    with pytest.raises(EinattnError, match=r"^expected √ or sqrt but found 'a'"):
        Equation("S[τ σ] = Q[τ a] K[σ a] / a")
    with pytest.raises(EinattnError, match=r"^unexpected character '&'"):
        Equation("S[τ σ] = Q[τ a] & K[σ a]")


def test_every_raise_site_of_the_expression_language_has_a_case():
    package = Path(einattn.__file__).parent
    sites = set().union(*(_raise_sites(package / f"{name}.py") for name in (
        "_expression", "_expression_compile", "_expression_run")))
    tested = {key for key, *_ in ERRORS} | {"missing scalar {}: give it as a number, {}=2.0",
                                             "scalar {} must be a number or a 0-d tensor, got {}",
                                             "{} is {}: {} takes {}"}
    assert sites == tested


def test_an_expression_traces_under_torch_compile():
    eq = Equation("Z[τ b] = softmax_σ(Q[τ a] K[σ a] / √a + M[τ σ]) V[σ b]")
    Q, K, V = randn(τ, a, seed=1), randn(σ, a, seed=2), randn(σ, c_, seed=3)
    M = dead_row_mask()[0, 0]
    compiled = torch.compile(lambda **kw: eq(**kw), fullgraph=True, backend="aot_eager")
    close(compiled(Q=Q, K=K, V=V, M=M), eq(Q=Q, K=K, V=V, M=M))
    torch._dynamo.reset()


# -- empty axes (issue 34): each function's value on the empty set, forward and backward ----

def empty_max(S):
    return torch.full(S.shape[:-1], -math.inf, dtype=S.dtype) if S.shape[-1] == 0 else S.amax(-1)


ALONG_EMPTY = {  # text, reference over the last axis
    "softmax": ("A[τ σ] = softmax_σ(S[τ σ])", lambda S: torch.softmax(S, dim=-1)),
    "logsumexp": ("A[τ] = logsumexp_σ(S[τ σ])", lambda S: torch.logsumexp(S, dim=-1)),
    "max": ("A[τ] = max_σ(S[τ σ])", empty_max),
    "sum": ("A[τ] = sum_σ(S[τ σ])", lambda S: S.sum(-1)),
}


@pytest.mark.parametrize("shape", [(τ, 0), (0, σ), (0, 0)], ids=["σ=0", "τ=0", "both"])
@pytest.mark.parametrize("name", ALONG_EMPTY)
def test_a_function_along_an_empty_axis_gives_its_empty_value(name, shape):
    text, reference = ALONG_EMPTY[name]
    S = randn(*shape).requires_grad_()
    out = Equation(text)(S=S)
    expected = reference(S.detach())
    assert out.shape == expected.shape and out.dtype == F64
    assert torch.equal(out.detach(), expected)  # −∞ for logsumexp and max, 0 for sum
    if shape == (τ, 0):
        assert name == "softmax" or expected.eq(-math.inf if name != "sum" else 0).all()
    (grad,) = torch.autograd.grad(out, S, torch.ones_like(out))  # on the graph: backward runs
    assert grad.shape == S.shape


@pytest.mark.parametrize("text, expected", [
    ("y[τ] = max(max_σ(S[τ σ]), x[τ])", "x"),  # −∞ is max's identity
    ("y[τ] = log(exp(logsumexp_σ(S[τ σ])) + exp(x[τ]))", "x"),  # exp(−∞) = 0 adds nothing
    ("y[τ] = sum_σ(S[τ σ]) + x[τ]", "x"),
    ("y[τ] = x[τ] + sum_σ(softmax_σ(S[τ σ]) V[σ])", "x"),  # an empty softmax weighs nothing
])
def test_an_empty_reduction_is_the_identity_of_what_it_combines_by(text, expected):
    S, x, V = randn(τ, 0).requires_grad_(), randn(τ, seed=1).requires_grad_(), randn(0, seed=2)
    y = Equation(text)(S=S, x=x, V=V) if "V" in text else Equation(text)(S=S, x=x)
    close(y, x)
    gS, gx = torch.autograd.grad(y, (S, x), torch.ones_like(y))
    assert gS.shape == (τ, 0) and torch.equal(gx, torch.ones(τ, dtype=F64))


@pytest.mark.parametrize("dtype, least", [(torch.int32, -2**31), (torch.int64, -2**63),
                                          (torch.bool, False)])
def test_max_along_an_empty_axis_of_integers_is_their_least_value(dtype, least):
    out = Equation("A[τ] = max_σ(S[τ σ])")(S=torch.zeros(τ, 0, dtype=dtype))
    assert out.dtype == dtype and torch.equal(out, torch.full((τ,), least, dtype=dtype))


ATTENTION = "Z[n μ τ b] = softmax_σ(Q[n μ τ a] K[n μ σ a] / √a + M[τ σ]) V[n μ σ b]"


def attention_by_hand(Q, K, V, M):
    S = torch.einsum("nmta,nmsa->nmts", Q, K) / math.sqrt(Q.shape[-1]) + M
    return torch.einsum("nmts,nmsb->nmtb", torch.softmax(S, dim=-1), V)


@pytest.mark.parametrize("empty", ["n", "μ", "τ", "σ", "b"])
def test_attention_written_as_one_expression_runs_with_an_empty_axis(empty):
    sizes = {"n": n, "μ": μ, "τ": τ, "σ": σ, "a": a, "b": c_} | {empty: 0}
    shapes = {"Q": "n μ τ a", "K": "n μ σ a", "V": "n μ σ b", "M": "τ σ"}
    tensors = {k: randn(*(sizes[i] for i in v.split()), seed=k2).requires_grad_()
               for k2, (k, v) in enumerate(shapes.items())}
    out = Equation(ATTENTION)(**tensors)
    expected = attention_by_hand(**tensors)
    close(out, expected)  # σ = 0: zeros, the empty weighted sum
    weight = randn(*out.shape, seed=7)
    got = torch.autograd.grad(out, list(tensors.values()), weight, allow_unused=True)
    want = torch.autograd.grad(expected, list(tensors.values()), weight, allow_unused=True)
    for name, g, w in zip(tensors, got, want, strict=True):
        assert g is not None and g.shape == tensors[name].shape, name
        close(g, torch.zeros_like(g) if w is None else w)


def test_a_scale_by_the_root_of_an_empty_index_is_refused():
    Q, K = randn(τ, 0), randn(σ, 0)
    with pytest.raises(EinattnError, match=r"scale index 'a' has size 0: cannot divide by √0"):
        Equation("S[τ σ] = exp(Q[τ a] K[σ a] / √a)")(Q=Q, K=K)


@pytest.mark.parametrize("text, shapes, output", [
    ("Y[τ i] = X[τ j] W[j i]", {"X": (τ, 0), "W": (0, a)}, (τ, a)),
    ("Y[n τ i] = X[n τ j] U[j k] W[k i]", {"X": (n, τ, a), "U": (a, 0), "W": (0, c_)},
     (n, τ, c_)),
    ("Y[τ i] = X[τ j] W[j i]", {"X": (0, a), "W": (a, c_)}, (0, c_)),
], ids=["summed j=0", "summed k=0, three operands", "free τ=0"])
def test_a_contraction_over_an_empty_index_gives_zeros_and_zero_gradients(text, shapes, output):
    tensors = {k: randn(*s, seed=m).requires_grad_() for m, (k, s) in enumerate(shapes.items())}
    out = Equation(text)(**tensors)
    assert torch.equal(out, torch.zeros(output, dtype=F64))
    for name, g in zip(tensors, torch.autograd.grad(out, list(tensors.values()),
                                                    torch.ones_like(out)), strict=True):
        assert torch.equal(g, torch.zeros_like(tensors[name])), name
