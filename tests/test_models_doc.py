"""docs/models.md ("Attention in today's models") shows the equations the code runs: every
display is the ``.latex()`` of its tag's Equation (or hand-written LaTeX where torch code
runs: the norm, the rotation), followed by a text block holding that Equation's string, the
tags in order. (Its Python blocks run in tests/test_docs.py.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from einattn import cross, differential, equations, gate, qk_norm, temperature
from einattn import latent as mla
from einattn.functional import SOFTMAX

DOC = Path(__file__).resolve().parent.parent / "docs" / "models.md"
TAGGED = {"MLA1": mla.QUERY_DOWN, "MLA3": mla.QUERY_UP_A, "MLA4": mla.QUERY_UP_R,
          "MLA3'": mla.QUERY_A, "MLA4'": mla.QUERY_R, "MLA5": mla.LATENT,
          "MLA6": mla.ROTARY_KEY, "MLA8": mla.KEYS, "MLA9": mla.VALUES, "MLA10": mla.SCORES,
          "MLA11": SOFTMAX, "MLA12": mla.WEIGHTED, "MLA13": mla.OUTPUT,
          "MLA-A1": mla.ABSORB_Q, "MLA-A2": mla.SCORES_ABSORBED,
          "MLA-A3": mla.WEIGHTED_LATENT, "MLA-A4": mla.ABSORB_V, "1b": equations.PROJECT_WIDE,
          "G1": gate.GATE, "G2": gate.GATED, "D1": differential.LAMBDA,
          "D4": differential.DIFFERENCE, "T2": temperature.FACTOR, "T3": temperature.SCALED,
          "1k": cross.PROJECT_K, "1v": cross.PROJECT_V}
HAND_WRITTEN = {  # tag -> LaTeX: what runs as torch code (rms_norm, einattn.rotary.rotate)
    "MLA2": r"C_{n \tau c} \leftarrow \gamma_{c} \, \frac{C_{n \tau c}}{\sqrt{\frac{1}{d_c} "
            r"\sum_{c'} C_{n \tau c'}^{2} + \epsilon}}",
    "MLA7": r"(Q_{R})_{n \mu \tau \rho} \leftarrow \operatorname{rot}_{\tau}(Q_{R})_{n \mu \tau "
            r"\rho}, \qquad (K_{R})_{n \sigma \rho} \leftarrow \operatorname{rot}_{\sigma}"
            r"(K_{R})_{n \sigma \rho}",
    "QK1": qk_norm.LATEX["head"], "QK2": qk_norm.LATEX["heads"], "D5": differential.NORM_LATEX,
}
ORDER = ["MLA1", "MLA2", "MLA3", "MLA4", "MLA3'", "MLA4'", "MLA5", "MLA6", "MLA7", "MLA8",
         "MLA9", "MLA10", "MLA11", "MLA12", "MLA13", "MLA-A1", "MLA-A2", "MLA-A3", "MLA-A4",
         "1b", "QK1", "QK2", "G1", "G2", "D1", "D4", "D5", "T2", "T3", "1k", "1v"]
DISPLAY = re.compile(r"^\$\$\n(.*?)\n\$\$$", re.M | re.S)
TAG = re.compile(r"\s*\\tag\{([^}]*)\}$")


def doc_problems(doc: str) -> list[str]:
    """Every way the displays of docs/models.md differ from the layer's equations: each is
    the .latex() of its tag's Equation (or the hand-written LaTeX), followed by a text block
    holding that Equation's string; the tags in order."""
    expected = {eq.latex(): tag for tag, eq in TAGGED.items()}
    expected |= {latex: tag for tag, latex in HAND_WRITTEN.items()}
    problems, tags = [], []
    for m in DISPLAY.finditer(doc):
        body = m.group(1).strip()
        tag = TAG.search(body)
        latex, tag = (body[: tag.start()], tag.group(1)) if tag else (body, None)
        tags.append(tag)
        if expected.get(latex) != tag:
            problems.append(f"display {latex} is tagged ({tag}), expected {expected.get(latex)}")
        elif tag in TAGGED:
            block = re.search(r"```text\n(.*?)\n```", doc[m.end():], re.S)
            if block is None or block.group(1) != TAGGED[tag].text:
                problems.append(f"({tag}) is not followed by a text block holding "
                                f"{TAGGED[tag].text}")
    if tags != ORDER:
        problems.append(f"tags {tags}, expected {ORDER}")
    return problems


def test_the_docs_show_the_equations_the_layer_runs():
    assert doc_problems(DOC.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize("old, new", [
    (r"\tag{MLA8}", r"\tag{MLA9}"),
    (r"(W_{\mathrm{UK}})_{\mu a c} \tag{MLA-A1}", r"(W_{\mathrm{UK}})_{\mu c a} \tag{MLA-A1}"),
    ("Z[n μ τ b] = Z_C[n μ τ c] W_UV[μ b c]\n```", "Z[n μ τ b] = Z_C[n μ τ c] W_UV[μ c b]\n```"),
    ("$$\nV_{n \\mu \\sigma b}", "$$\nV_{n \\mu \\sigma a}"),
    (r"\tag{G1}", r"\tag{G2}"),
    ("Q_t[n μ τ a] = β[n τ] Q[n μ τ a]\n```", "Q_t[n μ τ a] = β[n σ] Q[n μ τ a]\n```"),
    (r"\frac{1}{d_{\mu} d_a}", r"\frac{1}{d_a}"),
])
def test_an_edited_doc_is_caught(old, new):
    doc = DOC.read_text(encoding="utf-8")
    assert old in doc
    assert doc_problems(doc.replace(old, new, 1))


def test_an_edited_equation_in_the_code_is_caught(monkeypatch):
    monkeypatch.setitem(TAGGED, "MLA9", mla.Equation("V[n μ σ b] = C_KV[n σ c] W_UV[μ c b]"))
    assert doc_problems(DOC.read_text(encoding="utf-8"))
