r"""``Equation.from_latex`` (einattn.latex): LaTeX index notation read, computed and rendered.

Seed 003 (shared/seeds/003_7d2d3814221a90d2.txt) writes multi-head attention in LaTeX index
notation. Every contraction it writes is quoted below exactly as the seed writes it, read,
and computed against a ``torch.einsum`` written by hand, in float64 with all-distinct sizes
where the math allows (one tensor used twice, ``X_{\tau}^{i} … X_{\tau'}^{j}``, forces two
sizes to agree). The seed calls the head width ``d_k`` but indexes it ``a``, so its scale
needs ``size_names={"d_k": "a"}``.
"""

from __future__ import annotations

import ast
import inspect
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from einattn import EinattnError, Equation, _latex_reader
from einattn import functional as F
from einattn import latex as latex_module
from einattn.latex import read

ROOT = Path(__file__).resolve().parent.parent
SEED_NAME = "003_7d2d3814221a90d2.txt"
SEEDS = [p / SEED_NAME for p in (ROOT / "shared" / "seeds", ROOT.parent / "shared" / "seeds")]
SEED_SIZE_NAMES = {"d_k": "a"}

# One size per index, all distinct: τ, τ′, model channels i, head channels a (d_k), value
# channels (d_v), heads μ, projections B; b and j of the seed's first example.
T, T2, DM, DK, DV, H, B3, NB, NJ = 7, 9, 11, 5, 4, 3, 3, 6, 8

es = torch.einsum


@dataclass(frozen=True)
class SeedCase:
    id: str
    quote: str  # exactly as the seed writes it
    read_as: str  # the einattn equation it is read as
    shapes: dict[str, tuple[int, ...]]
    reference: Callable[..., torch.Tensor]  # by hand, ASCII einsum letters
    left: str = ""  # an output for a quote that has none (the seed writes it elsewhere)
    sizes: dict[str, int] = field(default_factory=dict)


SEED_CASES = [
    # (1): "A_{aj} B_b^{\ \ j} = \sum_{j} A_{aj} B_{bj}", two sides without an output
    SeedCase("example, raised j", r"A_{aj} B_b^{\ \ j}", "C[a b] = A[a j] B[b j]",
             {"A": (DK, NJ), "B": (NB, NJ)}, lambda A, B: es("aj,bj->ab", A, B), "C_{ab} = "),
    SeedCase("example, explicit sum", r"\sum_{j} A_{aj} B_{bj}", "C[a b] = A[a j] B[b j]",
             {"A": (DK, NJ), "B": (NB, NJ)}, lambda A, B: es("aj,bj->ab", A, B), "C_{ab} = "),
    # the scores, the first line of an align (with its & and \\) and the second after its left
    SeedCase("scores from X",
             r"\tilde{A}_{\tau \tau'} &=\frac {X_{\tau}^{\ \ i} \left( W_Q \right)_{ia} "
             r"\left( W_K \right)_{j}^{\ \ a} X_{\tau'}^{\ \ \ j}}{\sqrt{d_k}} \\",
             "A_tilde[τ τʹ] = X[τ i] W_Q[i a] W_K[j a] X[τʹ j] / √a",
             {"X": (T, DM), "W_Q": (DM, DK), "W_K": (DM, DK)},
             lambda X, W_Q, W_K: es("ti,ia,ja,sj->ts", X, W_Q, W_K, X) / math.sqrt(DK)),
    SeedCase("scores from Q K", r"&=\frac {Q_{\tau a} K_{\tau'}^{\ \ \ a}}{\sqrt{d_k}}",
             "A_tilde[τ τʹ] = Q[τ a] K[τʹ a] / √a", {"Q": (T, DK), "K": (T2, DK)},
             lambda Q, K: es("ta,sa->ts", Q, K) / math.sqrt(DK), r"\tilde{A}_{\tau \tau'} "),
    SeedCase("query", r"Q_{\tau a} = X_{\tau}^{\ \ i} \left(W_Q \right)_{ia}",
             "Q[τ a] = X[τ i] W_Q[i a]", {"X": (T, DM), "W_Q": (DM, DK)},
             lambda X, W_Q: es("ti,ia->ta", X, W_Q)),
    SeedCase("key", r"K_{\tau'}^{\ \ \ a} = \left( W_K \right)_{j}^{\ \ a} X_{\tau'}^{\ \ \ j}",
             "K[τʹ a] = W_K[j a] X[τʹ j]", {"W_K": (DM, DK), "X": (T2, DM)},
             lambda W_K, X: es("ja,sj->sa", W_K, X)),
    SeedCase("value", r"V_{\tau a} = \left(W_V\right)^{i}_{\ a} X_{\tau i}",
             "V[τ a] = W_V[i a] X[τ i]", {"W_V": (DM, DV), "X": (T, DM)},
             lambda W_V, X: es("ia,ti->ta", W_V, X)),
    SeedCase("one head",
             r"\text{Attention}(Q,K,V)_{\tau a} = A_{\tau \tau'} V^{\tau'}_{\ \ \ a}",
             "Attention[τ a] = A[τ τʹ] V[τʹ a]", {"A": (T, T2), "V": (T2, DV)},
             lambda A, V: es("ts,sa->ta", A, V)),
    SeedCase("heads: μ repeated and free",
             r"\text{Attention}(Q,K,V)_{\mu \tau a} = A_{\mu \tau \tau'} V^{\ \tau'}_{\mu \ \ a}",
             "Attention[μ τ a] = A[μ τ τʹ] V[μ τʹ a]", {"A": (H, T, T2), "V": (H, T2, DV)},
             lambda A, V: es("mts,msa->mta", A, V)),
    SeedCase("multi-head", r"\text{MultiHead}(Q, K, V)_{\tau i} =\left(W_O \right)^{\mu a}_"
             r"{\ \ \ \ i} \  \text{Attention}(Q,K,V)_{\mu \tau a}",
             "MultiHead[τ i] = W_O[μ a i] Attention[μ τ a]",
             {"W_O": (H, DV, DM), "Attention": (H, T, DV)},
             lambda W_O, Attention: es("mai,mta->ti", W_O, Attention)),
    SeedCase("fused projection", r"W_{(\mu Ba)i} X_\tau^{\ \ i}",
             "P[τ μ B a] = W[(μ B a) i] X[τ i]", {"W": (H * B3 * DK, DM), "X": (T, DM)},
             lambda W, X: es("mbai,ti->tmba", W.view(H, B3, DK, DM), X),
             r"P_{\tau \mu B a} = ", {"μ": H, "B": B3}),
    # the seed's commented-out draft writes the projections with other letters
    SeedCase("draft query", r"Q_{ai} &= X_{aj} \left(W_{Q} \right)_{i}^{\ \ j}",
             "Q[a i] = X[a j] W_Q[i j]", {"X": (T, DM), "W_Q": (DK, DM)},
             lambda X, W_Q: es("tj,ij->ti", X, W_Q)),
    SeedCase("draft key", r"K_{ai} = X_{aj} \left(W_{K} \right)_{i}^{\ \ j}",
             "K[a i] = X[a j] W_K[i j]", {"X": (T, DM), "W_K": (DK, DM)},
             lambda X, W_K: es("tj,ij->ti", X, W_K)),
    SeedCase("draft value", r"V_{ai} = X_{a}^{\ j} \left(W_{V}\right)_{ij}",
             "V[a i] = X[a j] W_V[i j]", {"X": (T, DM), "W_V": (DV, DM)},
             lambda X, W_V: es("tj,ij->ti", X, W_V)),
    SeedCase("draft multi-head", r"\text{MultiHead}(\Q, \K, \V)_{ai} =\left(W_O \right)^{\mu j}"
             r"_{\ \ \ \ i} \  \text{Attention}(Q,K,V)_{\mu aj}",
             "MultiHead[a i] = W_O[μ j i] Attention[μ a j]",
             {"W_O": (H, DV, DM), "Attention": (H, T, DV)},
             lambda W_O, Attention: es("mji,maj->ai", W_O, Attention)),
]


def seed_text() -> str:
    found = [p for p in SEEDS if p.exists()]
    if not found:
        pytest.skip(f"seed 003 is not beside this checkout ({SEED_NAME})")
    return found[0].read_text(encoding="utf-8")


@pytest.mark.parametrize("case", SEED_CASES, ids=lambda c: c.id)
def test_every_seed_contraction_is_quoted_verbatim(case):
    assert case.quote in seed_text()


@pytest.mark.parametrize("case", SEED_CASES, ids=lambda c: c.id)
def test_every_seed_contraction_computes_the_einsum_it_means(case):
    eq = Equation.from_latex(case.left + case.quote, size_names=SEED_SIZE_NAMES)
    assert eq.text == case.read_as
    gen = torch.Generator().manual_seed(3)
    tensors = {k: torch.randn(*s, dtype=torch.float64, generator=gen)
               for k, s in case.shapes.items()}
    out, expected = eq(**tensors, **case.sizes), case.reference(**tensors)
    assert out.dtype == torch.float64 and out.shape == expected.shape
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12 * expected.abs().max())


def test_the_seeds_mu_is_free_and_its_tau_prime_is_not_tau():
    heads = Equation.from_latex(SEED_CASES[8].quote)
    assert heads.summed == ("τʹ",) and heads.indices == ("μ", "τ", "a", "τʹ")
    scores = Equation.from_latex(r"\tilde{A}_{\tau \tau'} " + SEED_CASES[3].quote,
                                 size_names=SEED_SIZE_NAMES)
    assert scores.sizes(Q=(T, DK), K=(T2, DK)) == {"τ": T, "τʹ": T2, "a": DK}


def test_a_size_mismatch_in_a_latex_equation_is_an_error():
    eq = Equation.from_latex(r"\tilde{A}_{\tau \tau'} " + SEED_CASES[3].quote,
                             size_names=SEED_SIZE_NAMES)
    Q, K = torch.zeros(T, DK, dtype=torch.float64), torch.zeros(T2, DK + 1, dtype=torch.float64)
    with pytest.raises(EinattnError, match="index 'a' has size 6 in K but 5 in Q") as caught:
        eq(Q=Q, K=K)
    _, shown, carets = str(caught.value).split("\n")
    assert shown == "  A_tilde[τ τʹ] = Q[τ a] K[τʹ a] / √a"  # the equation it was read as
    assert carets == "  " + " " * eq.text.index("a]") + "^" + " " * 7 + "^"  # Q's a, K's a
    with pytest.raises(EinattnError, match="index 'a' has size 6 in K but 5 in Q"):
        eq.sizes(Q=(T, DK), K=(T2, DK + 1))


# -- what the seed writes that no equation reads is refused, saying why ---------------------

NOT_CONTRACTIONS = {
    "softmax": (r"A_{\tau \tau'} = \text{softmax} ( \tilde{A}_{\tau} ) _{\tau'} = \frac{\exp "
                r"\left(\tilde{A}_{\tau \tau'} \right)}{\sum_{\tau'} \exp(\tilde{A}_{\tau \tau'})}",
                "softmax needs the index it runs along", r"\text{softmax}"),
    "mask update": (r"\tilde{A}_{\mu \tau \tau'} \leftarrow \tilde{A}_{\mu \tau \tau'} + "
                    r"\tilde{M}_{\mu \tau \tau'}", "no '=': this is an expression", r"\tilde"),
    "fixed slices": (r"W_{\mu 0ia} =  \left(W_{Q} \right)_{\mu ia}", "a number cannot be an "
                     "index", "0"),
    "embedding": (r"X_{\tau i} = \Xi \left( I  \right )_{\tau i} \in \mathbb{R}^{N \times "
                  r"d_{m}}", r"a declaration ∈ ℝ\^\{…\} is not a contraction", r"\in"),
    "two sides": (r"A_{aj} B_b^{\ \ j} = \sum_{j} A_{aj} B_{bj}",
                  "the left side must be one tensor, the output", "B_b"),
    "an align of two lines": (r"\tilde{A}_{\tau \tau'} &=\frac {Q_{\tau a} K_{\tau'}^{\ \ \ a}}"
                              "{\\sqrt{d_k}} \\\\\n   &=\\frac {X_{\\tau}^{\\ \\ i}}{\\sqrt{d_k}}",
                              "a line break", "\\\\\n"),
    "a chain": (r"\tilde{A}_{\tau \tau'} = Q_{\tau a} K_{\tau' a} = K_{\tau' a} Q_{\tau a}",
                "a second '='", "= K"),
}


@pytest.mark.parametrize("tex, message, place", NOT_CONTRACTIONS.values(),
                         ids=NOT_CONTRACTIONS.keys())
def test_what_is_not_one_contraction_is_refused_at_its_place(tex, message, place):
    assert_error_at(tex, message, tex.index(place))


def assert_error_at(tex: str, message: str, *cols: int, **size_names: str) -> None:
    """``from_latex(tex)`` raises ``message`` with carets under ``cols`` of the LaTeX."""
    with pytest.raises(EinattnError, match=message) as caught:
        Equation.from_latex(tex, size_names=size_names or None)
    lines = str(caught.value).split("\n")
    assert lines[-2] == "  " + tex.replace("\n", " ")
    assert [k for k, c in enumerate(lines[-1][2:]) if c == "^"] == list(cols)


# -- the reading rules --------------------------------------------------------------------

READS = {
    "spacers interleave": (r"Y_{\mu \tau a} = V^{\ \tau'}_{\mu \ \ a} A_{\tau \tau'}",
                           "Y[μ τ a] = V[μ τʹ a] A[τ τʹ]"),
    "raised after lowered": (r"Y_{\tau} = X_{\tau}^{\ \ i} v_i", "Y[τ] = X[τ i] v[i]"),
    "unicode Greek, (W_O)": (r"Y_{τ i} = Z_{μ τ a} (W_O)_{μ a i}",
                             "Y[τ i] = Z[μ τ a] W_O[μ a i]"),
    "primes are new indices": (r"S_{\tau \tau' \tau''} = X_{\tau i} X_{\tau' i} X_{\tau'' i}",
                               "S[τ τʹ τʹʹ] = X[τ i] X[τʹ i] X[τʹʹ i]"),
    "accents and words": (r"\hat{Y}_{\tau} = \bar{x}_{\tau} \mathrm{Gain}_{\tau}",
                          "Y_hat[τ] = x_bar[τ] Gain[τ]"),
    "fused group, no spaces": (r"P_{\tau \mu B a} = X_{\tau i} W_{(\mu Ba)i}",
                               "P[τ μ B a] = X[τ i] W[(μ B a) i]"),
    "fused output": (r"S_{(g r) \tau} = Q_{(g r) \tau a} K_{g a}",
                     "S[(g r) τ] = Q[(g r) τ a] K[g a]"),
    "slash scale": (r"S_{\tau\sigma} = Q_{\tau a} K_{\sigma a} / \sqrt{d_a}",
                    "S[τ σ] = Q[τ a] K[σ a] / √a"),
    "one over root, cdot": (r"S_{\tau\sigma} = \frac{1}{\sqrt{d_{\sigma}}} Q_{\tau a} \cdot "
                            r"K_{\sigma a}", "S[τ σ] = Q[τ a] K[σ a] / √σ"),
    "root of the index": (r"S_{\tau\sigma} = \frac{Q_{\tau a} K_{\sigma a}}{\sqrt{a}}",
                          "S[τ σ] = Q[τ a] K[σ a] / √a"),
    "multi-letter index": (r"Y_{\mathrm{pos}} = X_{\mathrm{pos}\, i} v_{i}",
                           "Y[pos] = X[pos i] v[i]"),
    "no indices": (r"s_{} = u_{i} v^{i}", "s[] = u[i] v[i]"),
    "unbraced slots": (r"S_{a b} = T_a^{\ b}", "S[a b] = T[a b]"),
    # once refused as no contraction, now the expression language (tests/test_latex_expression.py)
    "an exponential": (r"S_{\tau} = \exp Q_{\tau}", "S[τ] = exp(Q[τ])"),
    "a sum of terms": (r"S_{\tau} = Q_{\tau} + K_{\tau}", "S[τ] = Q[τ] + K[τ]"),
    "a quotient by a number": (r"S_{\tau} = \frac{Q_{\tau a}}{2}", "S[τ] = Q[τ a] / 2"),
}


@pytest.mark.parametrize("tex, text", READS.values(), ids=READS.keys())
def test_reading_rules(tex, text):
    assert Equation.from_latex(tex).text == text


def test_a_size_name_ties_to_the_index_size_names_gives():
    tex = r"S_{\tau\sigma} = \frac{Q_{\tau a} K_{\sigma a}}{\sqrt{d_{\text{head}}}}"
    assert read(tex, {"d_{head}": "a"}) == "S[τ σ] = Q[τ a] K[σ a] / √a"
    assert read(tex, {r"d_\text{head}": "a"}) == "S[τ σ] = Q[τ a] K[σ a] / √a"
    # size_names wins over the d_x rule: seed 003's d_k where k is an index of its own
    tex = r"S_{k \sigma} = \frac{Q_{k a} K_{\sigma a}}{\sqrt{d_k}}"
    assert read(tex) == "S[k σ] = Q[k a] K[σ a] / √k"
    assert read(tex, {"d_k": "a"}) == "S[k σ] = Q[k a] K[σ a] / √a"


def test_scaled_and_unscaled_differ_by_the_root_of_the_size():
    """The scale is there in the numbers, not only in the text."""
    Q, K = torch.randn(T, DK, dtype=torch.float64), torch.randn(T2, DK, dtype=torch.float64)
    plain = Equation.from_latex(r"S_{\tau\sigma} = Q_{\tau a} K_{\sigma a}")(Q=Q, K=K)
    scaled = Equation.from_latex(r"S_{\tau\sigma} = Q_{\tau a} K_{\sigma a} / \sqrt{a}")(Q=Q, K=K)
    torch.testing.assert_close(scaled * math.sqrt(DK), plain, rtol=1e-12, atol=1e-12)


# -- what cannot be read is an error under its place --------------------------------------

ERRORS = {
    "unclosed brace": (r"S_{\tau = Q_{\tau a}", "unbalanced braces: this '{' is never closed",
                       [r"{\tau"]),
    "stray brace": (r"S_{\tau} = Q_{\tau a}}", "unbalanced braces: this '}' closes nothing",
                    [21]),
    "unknown command, generic": (r"S_{\tau} = \foo{Q}_{\tau}", r"unknown command \\foo where "
                                 "a tensor belongs", [r"\foo"]),
    "number as an index": (r"S_{\tau} = Q_{\tau 1}", "a number cannot be an index", ["1"]),
    "place taken twice": (r"S_{\tau i} = X_{\tau i}^{\ j} W_{ij}", r"X has an index below "
                          "and one above in place 2", ["i}^", "j}"]),
    "stacked without braces": (r"S_{a b} = T_a^b", r"T has an index below and one above "
                               "in place 1", ["a^", 14]),
    "double subscript": (r"S_{\tau} = Q_{\tau}_{a}", "a second subscript on Q", ["_{a"]),
    "no right side": (r"S_{\tau} = ", "no tensor on the right", ["="]),
    "two scales": (r"S_{\tau} = \frac{Q_{\tau a}}{\sqrt{a}} / \sqrt{a}",
                   "a second scale", ["/ "]),
    "size of no index": (r"S_{\tau} = \frac{Q_{\tau a}}{\sqrt{d_k}}", r"the size d_k is no "
                         r"index's: .* size_names=\{'d_k': index\}", ["d_k"]),
    "explicit sum of a free index": (r"S_{\tau} = \sum_{\tau} Q_{\tau a}", r"\\sum_\{τ\} but "
                                     "τ is not summed", [r"\tau} Q"]),
    "unclosed argument list": (r"Y_{\tau} = \text{F}(Q, K_{\tau}", "never closed", ["(Q"]),
    # the einattn equation's own checks, their carets moved back into the LaTeX
    "index twice on the left": (r"S_{\tau \tau} = Q_{\tau a} K_{\tau a}",
                                "index 'τ' appears twice on the left", [r"\tau \t", r"\tau}"]),
    "output index on no operand": (r"S_{\tau \sigma} = Q_{\tau a} K_{\tau a}",
                                   "output index 'σ' appears on no operand", [r"\sigma"]),
    "output also an operand": (r"S_{\tau} = S_{\tau a} v_{a}", "S is both the output and an "
                               "operand", ["S_"]),
}


@pytest.mark.parametrize("tex, message, places", ERRORS.values(), ids=ERRORS.keys())
def test_an_unreadable_equation_is_an_error_under_its_place(tex, message, places):
    """``places``: the text each caret starts, or its column."""
    assert_error_at(tex, message, *(p if isinstance(p, int) else tex.index(p) for p in places))


def test_size_names_to_no_index_is_an_error():
    tex = r"S_{\tau} = \frac{Q_{\tau a}}{\sqrt{d_k}}"
    assert_error_at(tex, r"size_names ties d_k to 'b', which is no index of this equation "
                    r"\(a, τ\)", tex.index("d_k"), d_k="b")


def test_not_a_string_is_an_error():
    with pytest.raises(EinattnError, match="from_latex reads a string of LaTeX, got bytes"):
        Equation.from_latex(b"S_{a} = Q_{a}")


# -- eq.latex() and from_latex are each other's inverse -----------------------------------

OWN = ["PROJECT", "SCORES", "VALUES", "HEADS", "HEAD_TERMS", "PROJECT_GQA", "SCORES_GQA",
       "VALUES_GQA"]


@pytest.mark.parametrize("name", OWN)
def test_einattns_own_equations_round_trip(name):
    eq = getattr(F, name)
    again = Equation.from_latex(eq.latex())
    assert again.text == eq.text
    assert again.latex() == eq.latex()


@pytest.mark.parametrize("text, tex", [
    ("A_tilde[τ τʹ] = Q[τ a] K[τʹ a] / √τʹ",
     r"\tilde{A}_{\tau \tau'} = \frac{Q_{\tau a} K_{\tau' a}}{\sqrt{d_{\tau'}}}"),
    ("Y[pos i] = X_hat[pos j] W[j i]", r"Y_{\mathrm{pos} i} = \hat{X}_{\mathrm{pos} j} W_{j i}"),
    ("dQ[τ a] = dS[τ σ] K[σ a]", r"\mathrm{dQ}_{\tau a} = \mathrm{dS}_{\tau \sigma} K_{\sigma a}"),
], ids=["prime and tilde", "word index and hat", "multi-letter tensors"])
def test_primes_accents_and_words_render_and_read_back(text, tex):
    assert Equation(text).latex() == tex
    assert Equation.from_latex(tex).text == text


# -- a label above a name is part of the name (issue 34) ----------------------------------

LABELS = {
    "W^O": (r"Y_{\tau i} = Z_{\mu \tau a} W^O_{\mu a i}", "Y[τ i] = Z[μ τ a] W_O[μ a i]"),
    "W^{O} after the slots": (r"Y_{\tau i} = Z_{\mu \tau a} W_{\mu a i}^{O}",
                              "Y[τ i] = Z[μ τ a] W_O[μ a i]"),
    "W^{Q}_{i}": (r"Q_{\tau} = X_{\tau i} W^{Q}_{i}", "Q[τ] = X[τ i] W_Q[i]"),
    "W^{(O)}": (r"Y_{\tau i} = Z_{\mu \tau a} W^{(O)}_{\mu a i}", "Y[τ i] = Z[μ τ a] W_O[μ a i]"),
    "h^{(l)}": (r"y_{\tau} = h^{(l)}_{\tau i} v_{i}", "y[τ] = h_l[τ i] v[i]"),
    "h^{(12)}, a number": (r"y_{\tau} = h^{(12)}_{\tau}", "y[τ] = h_12[τ]"),
    "W^{(\\mu)}, a Greek label": (r"y_{\tau} = W^{(\mu)}_{\tau}", "y[τ] = W_μ[τ]"),
    "E^{\\text{pos}}": (r"Y_{\tau i} = E^{\text{pos}}_{\tau i}", "Y[τ i] = E_pos[τ i]"),
    "E^\\mathrm{pos}, unbraced": (r"Y_{\tau i} = E^\mathrm{pos}_{\tau i}", "Y[τ i] = E_pos[τ i]"),
    "W^{QK}": (r"S_{\tau \sigma} = X_{\tau i} W^{QK}_{i j} X_{\sigma j}",
               "S[τ σ] = X[τ i] W_QK[i j] X[σ j]"),
    "an accent and a label": (r"y_{i} = \tilde{W}^{O}_{a i} z_{a}", "y[i] = W_O_tilde[a i] z[a]"),
    "the output labelled": (r"h^{(l)}_{\tau i} = X_{\tau j} W_{j i}", "h_l[τ i] = X[τ j] W[j i]"),
    # superscripts that hold indices stay indices: Einstein's raised ones, groups, spacers
    "a raised index": (r"B_{\nu \mu} = A^{\mu}_{\ \nu}", "B[ν μ] = A[μ ν]"),
    "raised lower-case": (r"s_{} = u_{i} v^{i}", "s[] = u[i] v[i]"),
    "a raised group": (r"Y_{i} = W^{(\mu a)}_{\ i} z_{(\mu a)}", "Y[i] = W[(μ a) i] z[(μ a)]"),
    "a raised capital held in place": (r"Y_{i} = W^{\ B}_{i} b_{B}", "Y[i] = W[i B] b[B]"),
    # a capital that stands in another script too is an index (a review found these read
    # as labels, and `einattn verify` then passed a wrong step)
    "raised capitals, Einstein's": (r"Y^{M} = \Lambda^{M}_{\ N} X^{N}", "Y[M] = Λ[M N] X[N]"),
    "c^{B} summed with P's B": (r"Z_{\tau} = P_{\tau B} c^{B}", "Z[τ] = P[τ B] c[B]"),
    "B^{I} summed with A's I": (r"Y = A_{I} B^{I}", "Y[] = A[I] B[I]"),
    "x^{N} summed with A's N": (r"y_{\tau} = A_{\tau N} x^{N}", "y[τ] = A[τ N] x[N]"),
    "T summed, not a transpose": (r"S_{\tau} = A_{\tau T} B^{T}", "S[τ] = A[τ T] B[T]"),
    "a primed label": (r"S_{\tau} = Q_{\tau}^{(\sigma')} K_{\tau}", "S[τ] = Q_σʹ[τ] K[τ]"),
}


@pytest.mark.parametrize("tex, text", LABELS.values(), ids=LABELS.keys())
def test_a_label_above_is_part_of_the_name_and_round_trips(tex, text):
    eq = Equation.from_latex(tex)
    assert eq.text == text
    assert Equation.from_latex(eq.latex()).text == text  # (W_{O})_{\mu a i}, read back


def test_W_O_read_from_a_superscript_computes_with_the_output_weight():
    eq = Equation.from_latex(r"Y_{\tau i} = Z_{\mu \tau a} W^{O}_{\mu a i}")
    assert eq.latex() == r"Y_{\tau i} = Z_{\mu \tau a} (W_{O})_{\mu a i}"  # as (5) writes W_O
    Z, W_O = torch.randn(H, T, DK, dtype=torch.float64), torch.randn(H, DK, DM, dtype=torch.float64)
    torch.testing.assert_close(eq(Z=Z, W_O=W_O), es("mta,mai->ti", Z, W_O), rtol=1e-12, atol=1e-12)


def test_labels_names_a_lower_case_superscript_and_must_be_a_collection():
    tex = r"Y_{\tau i} = h^{l}_{\tau j} W_{j i}"
    assert Equation.from_latex(tex, labels={"l"}).text == "Y[τ i] = h_l[τ j] W[j i]"
    primed = r"S_{\tau} = Q_{\tau}^{\sigma'} K_{\tau}"  # the advice for a primed label holds
    assert Equation.from_latex(primed, labels={"σ'"}).text == "S[τ] = Q_σʹ[τ] K[τ]"
    assert Equation.from_latex(tex, labels=["l"]).text == "Y[τ i] = h_l[τ j] W[j i]"
    for wrong in ("l", [1]):
        with pytest.raises(EinattnError, match=r"^labels is a collection of superscripts, "
                                               r"such as \{'l'\}, got "):
            Equation.from_latex(tex, labels=wrong)


@pytest.mark.parametrize("above", ["T", r"\top", r"{\intercal}"])
def test_a_transpose_above_is_refused(above):
    tex = rf"S_{{\tau \sigma}} = Q_{{\tau a}} K^{above}_{{\sigma a}}"
    assert_error_at(tex, rf"^K\^{re.escape(above.strip('{}'))} is a transpose, which index "
                    r"notation writes by the order of the indices", tex.index(above.strip("{")))


# Every advice an error of latex.py gives, followed literally: (the input refused, the
# part of its message that advises, [(the input with the advice followed, its keywords, the
# equation it must read as: the one written)]).
ADVICE = {
    "hold the place (indices)": (
        r"S_{\tau i j} = X_{\tau i}^{j}", "if both are indices, hold the place of one",
        [(r"S_{\tau i j} = X_{\tau i}^{\ \ j}", {}, "S[τ i j] = X[τ i j]")]),
    "hold the place or name the label": (
        r"Y_{i} = W^{q}_{\mu a i} Z_{\mu a}", r"if q is part of the name W_q, write W\^\{\(q\)\} "
        r"or pass labels=\{'q'\}",
        [(r"Y_{i} = W^{q}_{\ \mu a i} Z_{\mu a}", {}, "Y[i] = W[q μ a i] Z[μ a]"),  # q an index
         (r"Y_{i} = W^{(q)}_{\mu a i} Z_{\mu a}", {}, "Y[i] = W_q[μ a i] Z[μ a]"),  # q a label
         (r"Y_{i} = W^{q}_{\mu a i} Z_{\mu a}", {"labels": {"q"}}, "Y[i] = W_q[μ a i] Z[μ a]")]),
    "the issue's W^{O}: no longer refused, and its old advice reads the same": (
        None, None,
        [(r"Y_{i} = W^{O}_{\mu a i} Z_{\mu a}", {}, "Y[i] = W_O[μ a i] Z[μ a]"),
         (r"Y_{i} = W^{O}_{\ \mu a i} Z_{\mu a}", {}, "Y[i] = W_O[μ a i] Z[μ a]")]),
    "a transpose or a label T": (
        r"S_{i j} = K^T_{i j}", r"if T is part of the name K_T, write K\^\{\(T\)\} or pass "
        r"labels=\{'T'\}",
        [(r"S_{i j} = K^{(T)}_{i j}", {}, "S[i j] = K_T[i j]"),
         (r"S_{i j} = K^T_{i j}", {"labels": {"T"}}, "S[i j] = K_T[i j]")]),
    "the size of no index": (
        r"S_{\tau} = \frac{Q_{\tau a}}{\sqrt{d_k}}", r"write d_x for the size of index x, or "
        r"pass size_names=\{'d_k': index\}",
        [(r"S_{\tau} = \frac{Q_{\tau a}}{\sqrt{d_a}}", {}, "S[τ] = Q[τ a] / √a"),
         (r"S_{\tau} = \frac{Q_{\tau a}}{\sqrt{d_k}}", {"size_names": {"d_k": "a"}},
          "S[τ] = Q[τ a] / √a")]),
    "a chain": (
        r"A_{\tau \sigma} = Q_{\tau a} K_{\sigma a} = K_{\sigma a} Q_{\tau a}",
        "give each step of a chain on its own",
        [(r"A_{\tau \sigma} = Q_{\tau a} K_{\sigma a}", {}, "A[τ σ] = Q[τ a] K[σ a]"),
         (r"A_{\tau \sigma} = K_{\sigma a} Q_{\tau a}", {}, "A[τ σ] = K[σ a] Q[τ a]")]),
    "two lines": (
        "A_{\\tau \\sigma} &= Q_{\\tau a} K_{\\sigma a} \\\\\n &= K_{\\sigma a} Q_{\\tau a}",
        "give each line on its own",
        [(r"A_{\tau \sigma} &= Q_{\tau a} K_{\sigma a} \\", {}, "A[τ σ] = Q[τ a] K[σ a]"),
         (r"A_{\tau \sigma} &= K_{\sigma a} Q_{\tau a}", {}, "A[τ σ] = K[σ a] Q[τ a]")]),
}


@pytest.mark.parametrize("refused, advice, followed", ADVICE.values(), ids=ADVICE.keys())
def test_an_advice_followed_reads_the_equation_written(refused, advice, followed):
    if refused is not None:
        with pytest.raises(EinattnError, match=advice):
            Equation.from_latex(refused)
    for tex, keywords, text in followed:
        assert Equation.from_latex(tex, **keywords).text == text


def test_every_advice_in_the_latex_reader_is_followed_by_a_test():
    """Each string of einattn.latex and einattn._latex_reader that tells the user what to
    write, pass, hold or give is part of a message a case of ADVICE raises."""
    messages = []
    for refused, _, _ in (case for case in ADVICE.values() if case[0] is not None):
        with pytest.raises(EinattnError) as caught:
            Equation.from_latex(refused)
        messages.append(str(caught.value))
    advising = [s for s in strings_of(latex_module, _latex_reader)
                if re.search(r"\b(write|pass|hold|give)\b", s)]
    assert len(advising) >= 6
    for piece in advising:
        assert any(piece in m for m in messages), piece


def strings_of(*modules) -> list[str]:
    """The string constants of ``modules``, docstrings left out."""
    found = []
    for module in modules:
        tree = ast.parse(inspect.getsource(module))
        docs = {id(node.body[0].value) for node in ast.walk(tree)
                if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef))
                and node.body and isinstance(node.body[0], ast.Expr)}
        found += [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
                  and isinstance(node.value, str) and id(node) not in docs]
    return found
