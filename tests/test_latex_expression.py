r"""Equation.from_latex on the expression language (einattn._latex_expression): a paper's
softmax, exponentials, sums, quotients, maxima and scalars read into the equation they write,
"Attention Is All You Need" and the online-softmax update equal to their bracket-syntax
Equations, latex() read back, and every refusal under its place in the LaTeX."""

from __future__ import annotations

import pytest

from einattn import EinattnError, Equation, chunked, functional
from einattn._latex_expression import read_expression, written_as_expression
from einattn.verify import check_equivalent

READS = {
    "softmax, operatorname": (r"A_{n \mu \tau \sigma} = \operatorname{softmax}_{\sigma}\left("
                              r"S_{n \mu \tau \sigma} + M_{n \mu \tau \sigma}\right)",
                              "A[n μ τ σ] = softmax_σ(S[n μ τ σ] + M[n μ τ σ])"),
    "softmax, mathrm": (r"A_{\tau\sigma} = \mathrm{softmax}_{\sigma}(S_{\tau\sigma})",
                        "A[τ σ] = softmax_σ(S[τ σ])"),
    "logsumexp, text": (r"L_{\tau} = \text{logsumexp}_\sigma\left(S_{\tau\sigma}\right)",
                        "L[τ] = logsumexp_σ(S[τ σ])"),
    "exp, log, tanh": (r"Y_{\tau} = \exp(X_{\tau}) - \log\left(W_{\tau}\right) + \tanh{U_{\tau}}",
                       "Y[τ] = exp(X[τ]) − log(W[τ]) + tanh(U[τ])"),
    "sigmoid, operatorname": (r"(Z_{g})_{\tau a} = Z_{\tau a} \operatorname{sigmoid}\left("
                              r"G_{\tau a}\right)", "Z_g[τ a] = Z[τ a] · sigmoid(G[τ a])"),
    "e to the power": (r"P_{\tau\sigma} = e^{S_{\tau\sigma} - m_{\tau}}",
                       "P[τ σ] = exp(S[τ σ] − m[τ])"),
    "max along an axis, unparenthesised": (r"m_{\tau} = \max_{\sigma} S_{\tau\sigma}",
                                           "m[τ] = max_σ(S[τ σ])"),
    "max of two": (r"m'_{\tau} = \max\left(m_{\tau}, \max_{\sigma} S_{\tau\sigma}\right)",
                   "mʹ[τ] = max(m[τ], max_σ(S[τ σ]))"),
    "sum over the rest of its product": (r"l_{\tau} = \sum_{\sigma} e^{S_{\tau\sigma}} "
                                         r"V_{\sigma a} W_{a}",
                                         "l[τ] = sum_σ(exp(S[τ σ]) V[σ a] W[a])"),
    "a fraction of sums": (r"Z_{\tau a} = \frac{\sum_{\sigma} e^{S_{\tau\sigma}} V_{\sigma a}}"
                           r"{\sum_{\sigma} e^{S_{\tau\sigma}}}",
                           "Z[τ a] = sum_σ(exp(S[τ σ]) V[σ a]) / sum_σ(exp(S[τ σ]))"),
    "a denominator that is a sum": (r"Y_{\tau} = \frac{X_{\tau}}{U_{\tau} + W_{\tau}}",
                                    "Y[τ] = X[τ] / (U[τ] + W[τ])"),
    "a root and a divisor below": (r"S_{\tau\sigma} = \frac{Q_{\tau a} K_{\sigma a}}{c \sqrt{d_a}}",
                                   "S[τ σ] = Q[τ a] K[σ a] / c / √a"),
    "scalars, numbers, cdot": (r"C_{\tau\sigma} = c \cdot \tanh\left(\frac{S_{\tau\sigma}}{c}"
                               r"\right) + 0.5 \times S_{\tau\sigma}",
                               "C[τ σ] = c · tanh(S[τ σ] / c) + 0.5 S[τ σ]"),
    "a fraction in a denominator": (r"Y_{\tau} = \frac{X_{\tau}}{\frac{W_{\tau}}{V_{\tau}}}",
                                    "Y[τ] = X[τ] / (W[τ] / V[τ])"),
    "a fraction beside a factor below": (r"Y_{\tau} = \frac{X_{\tau}}{\frac{1}{2} W_{\tau}}",
                                         "Y[τ] = X[τ] / (1 / 2) / W[τ]"),
    "divided by a fraction": (r"Y_{\tau} = X_{\tau} / \frac{W_{\tau}}{V_{\tau}}",
                              "Y[τ] = X[τ] / (W[τ] / V[τ])"),
    "a leading minus, braces": (r"Y_{\tau} = -{X_{\tau} + W_{\tau}}", "Y[τ] = −(X[τ] + W[τ])"),
    "ell and a named tensor in parentheses": (
        r"\ell_{\tau} = \left(W_{O}\right)_{\tau} + 1", "ℓ[τ] = W_O[τ] + 1"),
    "a delta": (r"X_{\tau \tau'} = Y_{\tau} \delta_{\tau \tau'} + 0", "X[τ τʹ] = Y[τ] δ[τ τʹ] + 0"),
}


@pytest.mark.parametrize("tex, text", READS.values(), ids=READS.keys())
def test_reading_rules(tex, text):
    assert written_as_expression(tex)
    assert Equation.from_latex(tex).text == text


def test_a_fraction_divided_by_reads_back_as_the_same_number():
    """A review's false PASS: ``\\frac{X}{\\frac{W}{V}}`` was read as X / W / V, so the wrong
    step X / (W V) passed and the right one X V / W failed."""
    written = Equation("Y[τ] = X[τ] / (W[τ] / V[τ])")
    assert Equation.from_latex(written.latex()).text == written.text
    read = Equation.from_latex(r"Y_{\tau} = \frac{X_{\tau}}{\frac{W_{\tau}}{V_{\tau}}}")
    sizes = {"τ": 3}
    assert check_equivalent(read, "Y[τ] = X[τ] V[τ] / W[τ]", sizes).equal
    assert not check_equivalent(read, "Y[τ] = X[τ] / W[τ] / V[τ]", sizes).equal


def test_attention_is_all_you_need_in_index_form_is_equations_2_to_4():
    """softmax(Q Kᵀ / √d_k) V, with its indices: (2), (3) without a mask, and (4)."""
    tex = (r"Z_{\tau a} = \operatorname{softmax}_{\sigma}\left(\frac{Q_{\tau b} K_{\sigma b}}"
           r"{\sqrt{d_k}}\right) V_{\sigma a}")
    read = Equation.from_latex(tex, size_names={"d_k": "b"})
    bracket = Equation("Z[τ a] = softmax_σ(Q[τ b] K[σ b] / √b) V[σ a]")
    assert read.text == bracket.text
    sizes = {"τ": 3, "σ": 5, "a": 4, "b": 6}
    assert check_equivalent(read, bracket, sizes).equal
    stages = functional.SCORES.text.replace("n μ ", "").replace("a]", "b]").replace("√a", "√b")
    assert stages == "S[τ σ] = Q[τ b] K[σ b] / √b"


ONLINE = {  # einattn.chunked's running equations, as a paper writes them
    "RUNNING_MAX": (r"m^{\text{new}}_{n \mu \tau} = \max\left(m_{n \mu \tau}, \max_{\sigma} "
                    r"S_{n \mu \tau \sigma}\right)", chunked.RUNNING_MAX),
    "WEIGHTS": (r"P_{n \mu \tau \sigma} = e^{S_{n \mu \tau \sigma} - m^{\text{new}}_{n \mu \tau}}",
                chunked.WEIGHTS),
    "RESCALE": (r"c_{n \mu \tau} = \exp\left(m_{n \mu \tau} - m^{\text{new}}_{n \mu \tau}\right)",
                chunked.RESCALE),
    "RUNNING_SUM": (r"l^{\text{new}}_{n \mu \tau} = c_{n \mu \tau} \cdot l_{n \mu \tau} + "
                    r"\sum_{\sigma}\left(P_{n \mu \tau \sigma}\right)", chunked.RUNNING_SUM),
    "RUNNING_VALUES": (r"O^{\text{new}}_{n (g r) \tau a} = c_{n (g r) \tau} \cdot "
                       r"O_{n (g r) \tau a} + P_{n (g r) \tau \sigma} (V_{b})_{n g \sigma a}",
                       chunked.RUNNING_VALUES),
}


@pytest.mark.parametrize("tex, equation", ONLINE.values(), ids=ONLINE.keys())
def test_the_online_softmax_update_in_latex_is_chunkeds_equation(tex, equation):
    read = Equation.from_latex(tex)
    assert read.text.replace(" · ", " ") == equation.text.replace(" · ", " ")
    sizes = {"n": 2, "μ": 6, "g": 3, "r": 2, "τ": 4, "σ": 5, "a": 3}
    assert check_equivalent(read, equation, sizes, exact=True).equal


ROUND_TRIPS = [
    functional.SOFTMAX.text, chunked.RUNNING_MAX.text, chunked.WEIGHTS.text,
    chunked.RESCALE.text, chunked.RUNNING_SUM.text, chunked.RUNNING_VALUES.text,
    "C[τ σ] = c · tanh(S[τ σ] / c)", "L[τ] = logsumexp_σ(S[τ σ])",
    "Y[τ] = −(X[τ] − W[τ]) / (U[τ] + 2)", "Z[τ a] = softmax_σ(Q[τ b] K[σ b] / √b) V[σ a]",
    "lse[n μ τ] = log(exp(lse_1[n μ τ]) + exp(lse_2[n μ τ]))",
]


@pytest.mark.parametrize("text", ROUND_TRIPS)
def test_latex_reads_back_as_the_same_equation(text):
    equation = Equation(text)
    back = Equation.from_latex(equation.latex())
    assert back.latex() == equation.latex()
    assert back.text.replace(" · ", " ") == equation.text.replace(" · ", " ")


ERRORS = {
    "no equals sign": (r"\exp(S_{\tau}) + 1", "no '=': this is an expression", [0]),
    "two sides": (r"Y_{\tau} + X_{\tau} = \exp(S_{\tau})", "expected '=' after the output",
                  ["+"]),
    "left over": (r"Y_{\tau} = \exp(S_{\tau}) )", r"cannot read '\)' here", [26]),
    "a missing factor": (r"Y_{\tau} = \exp(S_{\tau}) + ", "expected a factor", [28]),
    "a square root alone": (r"Y_{\tau} = \sqrt{X_{\tau}} + 1", "a square root divides",
                            [r"\sqrt"]),
    "a softmax without its axis": (r"A_{\tau\sigma} = \mathrm{softmax}(S_{\tau\sigma}) + 0",
                                   r"softmax needs the index it runs along: write "
                                   r"\\operatorname\{softmax\}_\{\\sigma\}", [r"\mathrm"]),
    "a sum along two": (r"Y_{\tau} = \sum_{\sigma a} X_{\tau \sigma a} + 1",
                        "sum runs along one index", [r"\sum"]),
    "a root of no index": (r"Y_{\tau} = \frac{X_{\tau} + 1}{\sqrt{d_k}}",
                           r"the size d_k is no index's", ["d_k"]),
    # the equation's own checks, their carets moved back into the LaTeX
    "an index that survives": (r"Y_{\tau} = \exp(S_{\tau\sigma})",
                               "index 'σ' of S is on neither the left nor a function's axis",
                               [r"\sigma"]),
    "a softmax along no index of it": (r"A_{\tau} = \mathrm{softmax}_{\sigma}(S_{\tau}) + 1",
                                       "softmax_σ runs along 'σ', which is no index",
                                       [r"\sigma}("]),
}


@pytest.mark.parametrize("tex, message, places", ERRORS.values(), ids=ERRORS.keys())
def test_a_refusal_points_at_its_place_in_the_latex(tex, message, places):
    with pytest.raises(EinattnError, match=message) as caught:
        Equation.from_latex(tex)
    lines = str(caught.value).split("\n")
    assert lines[-2] == "  " + tex
    cols = [p if isinstance(p, int) else tex.index(p) for p in places]
    assert [k for k, c in enumerate(lines[-1][2:]) if c == "^"] == cols


def test_a_product_with_a_mistake_keeps_the_product_readers_message():
    with pytest.raises(EinattnError, match="a number cannot be an index"):
        Equation.from_latex(r"S_{\tau} = Q_{\tau 1}")
    assert not written_as_expression(r"S_{\tau} = Q_{\tau 1}")


def test_read_expression_alone_returns_the_text():
    assert read_expression(r"Y_{\tau} = X_{\tau} + W_{\tau}") == "Y[τ] = X[τ] + W[τ]"
