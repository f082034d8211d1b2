"""Derivation files (einattn.derivation_files) and ``einattn verify FILE.md``: a file of
good blocks exits 0, one wrong line exits 1 and is quoted, a file that cannot be read or a
wrong block exits 2 naming the file and line; docs/derivation.md verifies itself."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import without_rounding

from einattn import EinattnError, Equation, cli
from einattn.derivation_files import check_block, fenced, read_blocks, read_file

ROOT = Path(__file__).resolve().parents[1]

GOOD = """\
# A derivation

The fused projection, its group opened:

```derivation
sizes: n=2 τ=5 i=6 μ=4 B=3 a=2
P[n τ μ B a] = X[n τ i] W[(μ B a) i]
= X[n τ i] W[μ B a i]
```

The scores, reordered, with the summed index renamed (float: it divides by √a):

```derivation
sizes: τ=4 σ=4 a=3 b=3
S[τ σ] = Q[τ a] K[σ a] / √a
= K[σ a] Q[τ a] / √a
= Q[τ b] K[σ b] / √b
```

Without a sizes line, every index gets a size of its own:

```derivation
Y[τ j] = X[τ i] W[i j]
= W[i j] X[τ i]
```
"""
# The same file with one wrong line: τ and σ (equal sizes) swapped on line 16.
SWAPPED = GOOD.replace("= K[σ a] Q[τ a] / √a", "= K[τ a] Q[σ a] / √a")


def write(tmp_path: Path, text: str, name: str = "derivation.md") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# -- einattn verify FILE.md ------------------------------------------------------------------

def test_a_file_of_good_blocks_exits_0_with_a_verdict_per_line(capsys, tmp_path):
    path = write(tmp_path, GOOD)
    code, out, err = run(capsys, "verify", str(path))
    assert code == 0 and err == ""
    for number, text in [(8, "= X[n τ i] W[μ B a i]"), (16, "= K[σ a] Q[τ a] / √a"),
                         (17, "= Q[τ b] K[σ b] / √b"), (24, "= W[i j] X[τ i]")]:
        assert re.search(rf"^PASS .* {number}  {re.escape(text)}$", out, flags=re.M), text
    assert f"{path}:7  P[n τ μ B a] = X[n τ i] W[(μ B a) i]   (sizes n=2 τ=5 i=6 μ=4 B=3 a=2)" \
        in out
    assert f"{path}:23  Y[τ j] = X[τ i] W[i j]   (default sizes, all distinct: τ=2 j=3 i=4)" \
        in out
    assert out.rstrip().endswith("4 steps: 4 PASS") and "FAIL" not in out


def test_one_swapped_line_exits_1_and_is_quoted_with_its_line_number(capsys, tmp_path):
    path = write(tmp_path, SWAPPED)
    code, out, _ = run(capsys, "verify", str(path))
    assert code == 1
    assert re.search(r"^FAIL +field .* 16  = K\[τ a\] Q\[σ a\] / √a$", out, flags=re.M)
    quoted = [line for line in out.splitlines() if line.startswith("FAIL /")]
    assert len(quoted) == 1
    assert quoted[0].startswith(f"FAIL {path}:16: = K[τ a] Q[σ a] / √a  — ")
    assert "entries differ in the finite field, the first at " in quoted[0]
    assert " at [τ=" in quoted[0]
    assert out.rstrip().endswith("4 steps: 3 PASS, 1 FAIL")


def test_a_swap_in_exact_mode_is_caught_exactly(capsys, tmp_path):
    wrong = "```derivation\nsizes: τ=3 i=4 j=4\nY[τ j] = X[τ i] W[i j]\n= X[τ j] W[i j]\n```\n"
    path = write(tmp_path, wrong.replace("X[τ j] W[i j]", "X[τ i] W[j i]"))
    code, doc = run_json(capsys, str(path))
    step = doc["blocks"][0]["steps"][0]
    assert code == 1 and doc["passed"] is False
    assert (step["mode"], step["verdict"], step["tolerance"]) == ("field", "FAIL", 0.0)
    assert step["max_deviation"] > 0 and step["line"] == 4


def run_json(capsys, path: str, *options: str) -> tuple[int, dict]:
    code, out, _ = run(capsys, "verify", path, "--json", *options)
    return code, json.loads(out)


def test_json_has_every_block_and_step(capsys, tmp_path):
    code, doc = run_json(capsys, str(write(tmp_path, GOOD)))
    assert code == 0 and doc["passed"] is True and doc["exact_only"] is False
    assert [(b["line"], b["kind"], b["sizes_given"]) for b in doc["blocks"]] == [
        (7, "derivation", True), (15, "derivation", True), (23, "derivation", False)]
    assert doc["blocks"][2]["sizes"] == {"τ": 2, "j": 3, "i": 4}
    steps = [s for b in doc["blocks"] for s in b["steps"]]
    assert [(s["line"], s["mode"], s["verdict"]) for s in steps] == [
        (8, "field", "PASS"), (16, "field", "PASS"), (17, "field", "PASS"),
        (24, "field", "PASS")]
    assert steps[0]["name"] == "= X[n τ i] W[μ B a i]" and steps[0]["false_acceptance"] < 1e-12


def test_exact_skips_the_lines_only_float64_can_check(capsys, tmp_path):
    capped = ("```derivation\nsizes: τ=3 σ=4\nC[τ σ] = c · tanh(S[τ σ] / c)\n"
              "= tanh(S[τ σ] / c) · c\n```\n")
    code, doc = run_json(capsys, str(write(tmp_path, GOOD + capped)), "--exact")
    steps = [s for b in doc["blocks"] for s in b["steps"]]
    assert code == 0 and [s["verdict"] for s in steps] == ["PASS"] * 4 + ["SKIP"]
    assert steps[-1]["where"] == "skipped: float64: tanh has no finite-field form"


def test_size_options_are_refused_with_a_file(capsys, tmp_path):
    code, out, err = run(capsys, "verify", "--seq", "3", str(write(tmp_path, GOOD)))
    assert code == 2 and out == ""
    assert "verify FILE takes no size options (--seq)" in err


def test_without_a_file_verify_checks_the_registered_steps(capsys):
    code, out, _ = run(capsys, "verify", "--batch", "1", "--seq", "2", "--d-model", "4",
                       "--heads", "2")
    assert code == 0 and out.startswith("derivation steps at n=1 τ=2")


# -- grouped and opened forms of one tensor ------------------------------------------------

@pytest.mark.parametrize("form, verdict", [("W[μ B a i]", "PASS"), ("W[(μ B) a i]", "PASS"),
                                           ("W[μ (B a) i]", "PASS"), ("W[(B μ a) i]", "FAIL"),
                                           ("W[(μ a B) i]", "FAIL")])
def test_a_grouped_tensor_and_its_opened_form_are_one_tensor(form, verdict):
    text = (f"```derivation\nsizes: τ=3 i=5 μ=2 B=3 a=2\n"
            f"P[τ μ B a] = X[τ i] W[(μ B a) i]\n= X[τ i] {form}\n```\n")
    checked = [c for block in read_blocks(text) for c in check_block(block)]
    assert [c.verdict for c in checked] == [verdict]
    assert checked[0].mode == ("field" if verdict == "PASS" else "—")  # "—": no comparison


def test_a_tensor_of_another_shape_fails_its_line_with_both_shapes():
    text = "```derivation\nY[τ j] = X[τ i] W[i j]\n= X[τ i] W[j i]\n```\n"
    (checked,) = check_block(read_blocks(text, "f.md")[0])
    assert checked.verdict == "FAIL" and checked.report is None
    assert checked.reason == "W[j i] is (3, 4) but W[i j] is (4, 3)"


# -- files that cannot be read and blocks that are wrong: exit 2 --------------------------

def test_a_file_that_cannot_be_read_exits_2(capsys, tmp_path):
    missing = tmp_path / "missing.md"
    code, out, err = run(capsys, "verify", str(missing))
    assert code == 2 and out == ""
    assert err == f"einattn: error: cannot read {missing}: No such file or directory\n"
    binary = tmp_path / "binary.md"
    binary.write_bytes(b"\xff\xfe```derivation\n")
    code, _, err = run(capsys, "verify", str(binary))
    assert code == 2 and f"cannot read {binary}: 'utf-8' codec can't decode" in err
    code, _, err = run(capsys, "verify", str(tmp_path))
    assert code == 2 and f"cannot read {tmp_path}: Is a directory" in err


BAD_BLOCKS = {
    "unparseable equation": ("Y[τ j] = X[τ i] W[i j]\n= X[τ i] W[i j\n", 4,
                             "expected name or \\( or ] but found the end"),
    "no size for an index": ("sizes: τ=2 i=3\nY[τ j] = X[τ i] W[i j]\n= W[i j] X[τ i]\n", 4,
                             r"the sizes: line gives no size for index 'j' \(it gives τ, i\)"),
    "a size that is not a positive integer": ("sizes: τ=2 i=0\nY[τ] = X[τ i]\n= X[τ i]\n", 3,
                                              "sizes: 'i=0' is not index=size"),
    "a second equation in one block": ("Y[τ j] = X[τ i] W[i j]\nZ[τ j] = W[i j] X[τ i]\n", 4,
                                       "expected another right-hand side of Y, a line that "
                                       "starts with '='"),
    "nothing to compare": ("Y[τ j] = X[τ i] W[i j]\n", 2, "this one has nothing to compare"),
    "no equation": ("sizes: τ=2\n", 2, "this one has no equation"),
    "the first equation disagrees with itself": (
        "S[τ σ] = X[τ i] X[σ i]\n= X[σ i] X[τ i]\n", 3,
        r"X\[σ i\] is \(3, 4\) but X\[τ i\] is \(2, 4\) \(the default sizes are all distinct: "
        "give a sizes: line"),
    "too large": ("sizes: τ=100000 σ=100000 a=2\nS[τ σ] = Q[τ a] K[σ a]\n= K[σ a] Q[τ a]\n", 4,
                  r"S\[τ σ\] would have 10,000,000,000 elements, over the limit"),
    "a later index no tensor of the first line fixes": (
        "sizes: τ=2 i=3\nY[τ] = X[τ i] v[i]\n= X[τ i] U[i j] w[j]\n", 5,
        r"the sizes: line gives no size for index 'j' \(it gives τ, i\), and no tensor of the "
        "first line fixes it"),
}


@pytest.mark.parametrize("body, line, message", BAD_BLOCKS.values(), ids=BAD_BLOCKS)
def test_a_wrong_block_exits_2_naming_the_file_and_line(capsys, tmp_path, body, line, message):
    path = write(tmp_path, f"Text.\n```derivation\n{body}```\n")
    with pytest.raises(EinattnError, match=rf"^{re.escape(f'{path}:{line}: ')}.*{message}"):
        read_file(path)
    code, out, err = run(capsys, "verify", str(path))
    assert code == 2 and err.startswith(f"einattn: error: {path}:{line}: ")
    assert err.count("\n") == 1 and f"\nERROR {path}:{line}: " in out
    assert out.rstrip().endswith("0 steps; 1 block not checked")


def test_a_block_left_open_or_a_file_without_blocks_exits_2(capsys, tmp_path):
    path = write(tmp_path, "# Title\n\n```derivation\nY[τ] = X[τ i]\n= X[τ i]\n")
    with pytest.raises(EinattnError, match=r":3: the derivation block opened here is not closed"):
        read_file(path)
    path = write(tmp_path, "# Title\n\n```python\nx = 1\n```\n")
    with pytest.raises(EinattnError, match=r"no derivation blocks \(fenced blocks whose info "
                                           r"string is derivation or derivation-latex\)"):
        read_file(path)
    code, _, err = run(capsys, "verify", str(path))
    assert code == 2 and "no derivation blocks" in err


def test_only_the_derivation_blocks_are_read_and_a_fence_inside_a_fence_is_not_one():
    text = ("````markdown\n```derivation\nnot an equation\n```\n````\n\n"
            "```python\nY = 1\n```\n\n~~~derivation\n# a comment\nY[τ] = X[τ i]\n\n= X[τ i]\n~~~\n")
    assert [(kind, line) for kind, line, _ in fenced(text)] == [
        ("markdown", 1), ("python", 7), ("derivation", 11)]
    (block,) = read_blocks(text)
    assert block.first.line.number == 13 and [s.line.number for s in block.steps] == [15]


# -- LaTeX blocks ---------------------------------------------------------------------------

PASTED = r"""
```derivation-latex
sizes: \tau=4 \sigma=4 a=3
\begin{align}
    S_{\tau \sigma} &= Q_{\tau a} K_{\sigma}^{\ \ a} \label{eq:scores} \\
                    &= K_{\sigma a} Q_{\tau a} \nonumber \\
                    &= Q_{\sigma a} K_{\tau a}
\end{align}
```
"""


def test_an_align_environment_pasted_whole_is_read_line_by_line(capsys, tmp_path):
    path = write(tmp_path, PASTED)
    (block,) = read_blocks(PASTED)
    assert block.first.equation.text == "S[τ σ] = Q[τ a] K[σ a]"
    assert [s.equation.text for s in block.steps] == ["S[τ σ] = K[σ a] Q[τ a]",
                                                      "S[τ σ] = Q[σ a] K[τ a]"]
    code, out, _ = run(capsys, "verify", str(path))
    assert code == 1 and "  read as S[τ σ] = Q[τ a] K[σ a]" in out
    assert re.search(r"^PASS +field .* 6  &= K_\{\\sigma a\} Q_\{\\tau a\} \\nonumber \\\\$",
                     out, flags=re.M)
    assert f"FAIL {path}:7: &= Q_{{\\sigma a}} K_{{\\tau a}}  — " in out
    assert " entries differ in the finite field" in out


# Seed 003 (shared/seeds/003_7d2d3814221a90d2.txt), verbatim: the scores and the output.
SEED_SCORES = (r"\tilde{A}_{\tau \tau'} &=\frac {X_{\tau}^{\ \ i} \left( W_Q \right)_{ia} "
               r"\left( W_K \right)_{j}^{\ \ a} X_{\tau'}^{\ \ \ j}}{\sqrt{d_k}} \\")
SEED_MULTIHEAD = (r"\text{MultiHead}(Q, K, V)_{\tau i} =\left(W_O \right)^{\mu a}_{\ \ \ \ i} \  "
                  r"\text{Attention}(Q,K,V)_{\mu \tau a}")
QUERY_THEN_KEY = r"&=\frac {X_{\tau i} (W_Q)_{ia} \, X_{\tau' j} (W_K)_{ja}}{\sqrt{d_k}}"


def latex_block(sizes: str, *lines: str) -> str:
    return "\n".join(["```derivation-latex", f"sizes: {sizes}", *lines, "```", ""])


def test_the_seed_scores_verify_and_weights_swapped_between_i_and_j_fail(capsys, tmp_path):
    sizes = r"\tau=5 \tau'=5 i=6 j=6 a=4 d_k=a"
    code, out, _ = run(capsys, "verify", str(write(tmp_path, latex_block(
        sizes, SEED_SCORES, QUERY_THEN_KEY))))
    assert code == 0 and "read as A_tilde[τ τʹ] = X[τ i] W_Q[i a] W_K[j a] X[τʹ j] / √a" in out
    swapped = QUERY_THEN_KEY.replace("(W_Q)_{ia}", "(W_Q)_{ja}").replace("(W_K)_{ja}",
                                                                          "(W_K)_{ia}")
    path = write(tmp_path, latex_block(sizes, SEED_SCORES, QUERY_THEN_KEY, swapped))
    code, out, _ = run(capsys, "verify", str(path))
    assert code == 1 and out.rstrip().endswith("2 steps: 1 PASS, 1 FAIL")
    assert f"FAIL {path}:5: {swapped}  — " in out
    assert " entries differ in the finite field" in out


def test_the_seed_output_verifies_and_a_transposed_W_O_of_equal_sizes_fails(capsys, tmp_path):
    opened = r"= \text{Attention}(Q,K,V)_{\mu \tau a} (W_O)_{\mu a i}"
    wrong = opened.replace(r"{\mu a i}", r"{a \mu i}")
    path = write(tmp_path, latex_block(r"\tau=5 i=6 \mu=4 a=4", SEED_MULTIHEAD, opened, wrong))
    code, doc = run_json(capsys, str(path))
    steps = doc["blocks"][0]["steps"]
    assert code == 1 and doc["blocks"][0]["kind"] == "derivation-latex"
    assert doc["blocks"][0]["read_as"] == "MultiHead[τ i] = W_O[μ a i] Attention[μ τ a]"
    assert [(s["verdict"], s["mode"], s["read_as"]) for s in steps] == [
        ("PASS", "field", "MultiHead[τ i] = Attention[μ τ a] W_O[μ a i]"),
        ("FAIL", "field", "MultiHead[τ i] = Attention[μ τ a] W_O[a μ i]")]
    assert steps[1]["max_deviation"] > 0  # μ and a both 4: the values, not the shapes


LATEX_ERRORS = {
    "a size name tied to no index": (r"\tau=5 \tau'=5 i=6 j=6 a=4", 3, r"d_k"),
    "not LaTeX it can read": (r"\tau=5 \tau'=5 i=6 j=6 a=4 d_k=a", 4, r"softmax"),
}


@pytest.mark.parametrize("sizes, line, message", LATEX_ERRORS.values(), ids=LATEX_ERRORS)
def test_latex_a_block_cannot_read_names_its_line(tmp_path, sizes, line, message):
    softmax = r"&= \text{softmax}(X_{\tau i})_{\tau'}"
    path = write(tmp_path, latex_block(sizes, SEED_SCORES, softmax))
    with pytest.raises(EinattnError, match=rf"^{re.escape(str(path))}:{line}: (?s:.*){message}"):
        read_file(path)


def test_a_size_name_belongs_to_latex_blocks_only():
    text = "```derivation\nsizes: τ=2 d_k=a\nY[τ] = X[τ]\n= X[τ]\n```\n"
    with pytest.raises(EinattnError, match=r"^f.md:2: sizes: 'd_k=a' is not index=size"):
        read_blocks(text, "f.md")


def test_a_latex_block_without_from_latex_is_an_error(monkeypatch):
    monkeypatch.delattr(Equation, "from_latex", raising=False)
    with pytest.raises(EinattnError, match=r"^f.md:5: a derivation-latex block needs "
                                           r"Equation.from_latex"):
        read_blocks(PASTED, "f.md")


# -- docs/verifying.md checks its own derivations, LaTeX included ---------------------------

@pytest.mark.parametrize("rounding", ["this machine's", "another machine's"])
def test_docs_verifying_verifies_and_shows_what_it_prints(capsys, monkeypatch, request,
                                                          rounding):
    if rounding != "this machine's":
        request.getfixturevalue("other_rounding")
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("NO_COLOR", raising=False)
    code, out, err = run(capsys, "verify", "docs/verifying.md")
    assert code == 0 and err == ""
    assert "derivation-latex" in (ROOT / "docs" / "verifying.md").read_text(encoding="utf-8")
    doc = (ROOT / "docs" / "verifying.md").read_text(encoding="utf-8")
    shown = re.search(r"^```sh\neinattn verify docs/verifying\.md\n```\n.*?^```text\n(.*?)^```$",
                      doc, flags=re.M | re.S)
    assert shown and without_rounding(shown.group(1)) == without_rounding(out)
    assert "read as A_tilde[τ τʹ]" in out and "7 steps: 7 PASS" in out
    assert "FAIL" not in out and " float " not in out  # every line exact, in the field


# -- the exact mode on steps a user writes: the online softmax and (3)→(4), as text and LaTeX --

def test_the_users_softmax_steps_are_proved_in_the_field_and_a_slip_fails_there():
    """docs/verifying.md's three steps through the softmax pass in the field; each with a
    plausible slip (the old sums not rescaled, the mask left out of the numerator) fails."""
    doc = (ROOT / "docs" / "verifying.md").read_text(encoding="utf-8")
    blocks = [b for b in read_blocks(doc) if "e^" in b.first.line.text or "exp" in
              b.first.line.text or "softmax" in b.first.line.text]
    assert [b.kind for b in blocks] == ["derivation", "derivation-latex", "derivation-latex"]
    for block in blocks:
        (checked,) = check_block(block)
        assert (checked.verdict, checked.mode) == ("PASS", "field"), checked.report
        assert checked.report.false_acceptance < 1e-20
    slips = [("exp(m[τ] − M[τ]) · sum_ρ(exp(R[τ ρ] − m[τ]) U[ρ a])",
              "sum_ρ(exp(R[τ ρ] − m[τ]) U[ρ a])"),  # the old sums not rescaled
             (r"\frac{\sum_{\sigma} e^{S_{\tau\sigma}} e^{M_{\tau\sigma}} V",
              r"\frac{\sum_{\sigma} e^{S_{\tau\sigma}} V")]  # the mask left out above
    for (right, slip), block in zip(slips, blocks[::2], strict=True):
        lines = [block.first.line.text, *(step.line.text for step in block.steps)]
        assert sum(right in line for line in lines) == 1, right
        sizes = " ".join(f"{k}={v}" for k, v in block.sizes.items())
        if block.kind == "derivation-latex":
            sizes = sizes.replace("τ", r"\tau").replace("σ", r"\sigma").replace("ρ", r"\rho")
        text = "\n".join(line.replace(right, slip) for line in lines)
        (wrong,) = read_blocks(f"```{block.kind}\nsizes: {sizes}\n{text}\n```\n")
        (checked,) = check_block(wrong)
        assert (checked.verdict, checked.mode) == ("FAIL", "field")


# -- docs/derivation.md checks its own steps --------------------------------------------------

def test_docs_derivation_verifies(capsys):
    code, out, err = run(capsys, "verify", str(ROOT / "docs" / "derivation.md"))
    assert code == 0 and err == "", out
    count = re.search(r"^(\d+) steps: (\d+) PASS$", out, flags=re.M)
    assert count and count.group(1) == count.group(2) and int(count.group(1)) >= 7


def test_the_console_script_verifies_docs_derivation():
    """As CI runs it: the module entry point, from the repository root."""
    done = subprocess.run([sys.executable, "-m", "einattn", "verify", "docs/derivation.md"],
                          cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "FAIL" not in done.stdout


def test_an_edited_step_of_docs_derivation_fails(capsys, tmp_path):
    doc = (ROOT / "docs" / "derivation.md").read_text(encoding="utf-8")
    old = "= X[n τ j] W_Q[μ a j] W_K[μ a i] X[n σ i] / √a"
    assert old in doc
    wrong = "= X[n τ j] W_Q[μ a i] W_K[μ a j] X[n σ i] / √a"  # i and j (equal sizes) swapped
    path = write(tmp_path, doc.replace(old, wrong))
    code, out, _ = run(capsys, "verify", str(path))
    number = doc[:doc.index(old)].count("\n") + 1
    assert code == 1 and f"FAIL {path}:{number}: {wrong}  — " in out
    assert " entries differ in the finite field" in out


# -- issue 34: sizes the shapes fix, every block reported, a tensor the first line lacks ----

RENAMED = """\
```derivation
sizes: τ=4 σ=4 a=3
S[τ σ] = Q[τ a] K[σ a]
= Q[τ b] K[σ b]
= K[σ c] Q[τ c]
```

```derivation
S[τ σ] = Q[τ a] K[σ a] / √a
= Q[τ b] K[σ b] / √b
```
"""


def test_a_renamed_summed_index_takes_its_size_from_the_first_lines_shapes(capsys, tmp_path):
    path = write(tmp_path, RENAMED)
    code, out, err = run(capsys, "verify", str(path))
    assert code == 0 and err == "" and out.rstrip().endswith("3 steps: 3 PASS")
    assert f"{path}:3  S[τ σ] = Q[τ a] K[σ a]   (sizes τ=4 σ=4 a=3; from the first line's " \
        "shapes: b=3 c=3)" in out
    assert f"{path}:9  S[τ σ] = Q[τ a] K[σ a] / √a   (default sizes, all distinct: τ=2 σ=3 a=4; " \
        "from the first line's shapes: b=4)" in out
    _, doc = run_json(capsys, str(path))
    assert [b["sizes_from_shapes"] for b in doc["blocks"]] == [["b", "c"], ["b"]]
    assert doc["blocks"][1]["sizes"] == {"τ": 2, "σ": 3, "a": 4, "b": 4}


def test_a_renamed_index_in_the_wrong_slot_still_fails():
    """b takes a's size from Q[τ b]; K[b σ] then has K[σ a]'s sizes transposed (3, 4)."""
    text = "```derivation\nS[τ σ] = Q[τ a] K[σ a]\n= Q[τ b] K[b σ]\n```\n"
    (checked,) = check_block(read_blocks(text, "f.md")[0])
    assert checked.verdict == "FAIL" and checked.reason == "K[b σ] is (4, 3) but K[σ a] is (3, 4)"


MIXED = """\
```derivation
Y[τ j] = X[τ i] W[i j]
= W[i j] X[τ i]
```

```derivation
sizes: τ=2 i=3
Y[τ] = X[τ i] v[i]
= X[τ i] U[i j] w[j]
```

```derivation
sizes: τ=3 i=4 j=4
Y[τ j] = X[τ i] W[i j]
= X[τ i] W[j i]
```
"""


def test_a_wrong_block_does_not_stop_the_others_and_the_worst_status_wins(capsys, tmp_path):
    path = write(tmp_path, MIXED)
    code, out, err = run(capsys, "verify", str(path))
    assert code == 2  # the wrong block (2) outranks the failing line (1)
    assert err == (f"einattn: error: {path}:9: the sizes: line gives no size for index 'j' (it "
                   "gives τ, i), and no tensor of the first line fixes it\n")
    assert re.search(r"^PASS .* 3  = W\[i j\] X\[τ i\]$", out, flags=re.M)
    assert f"\nERROR {path}:9: the sizes: line gives no size for index 'j'" in out
    assert f"\nFAIL {path}:15: = X[τ i] W[j i]  — " in out
    assert " entries differ in the finite field" in out
    assert out.rstrip().endswith("2 steps: 1 PASS, 1 FAIL; 1 block not checked")
    _, doc = run_json(capsys, str(path))
    assert doc["passed"] is False and [b.get("line") for b in doc["blocks"]] == [2, None, 14]
    assert doc["blocks"][1] == {"opened": 6, "kind": "derivation", "steps": [],
                                "error": err.removeprefix("einattn: error: ").rstrip("\n")}
    fixed = write(tmp_path, MIXED.replace("sizes: τ=2 i=3", "sizes: τ=2 i=3 j=5"))
    code, out, err = run(capsys, "verify", str(fixed))
    assert code == 1 and err == "" and out.rstrip().endswith("3 steps: 1 PASS, 2 FAIL")
    assert f"FAIL {path.parent / 'derivation.md'}:9: = X[τ i] U[i j] w[j]  — U[i j] does not " \
        "appear in the first line" in out  # checked now: U and w are not the first line's


@pytest.mark.parametrize("line, reason", [
    ("= Q[τ a] R[σ a]", "R[σ a] does not appear in the first line (S[τ σ] = Q[τ a] K[σ a]): it "
                        "would be drawn on its own, so the line cannot equal the first; write it "
                        "with the first line's tensors, or start a block for it"),
    ("= c · Q[τ a] K[σ a] / c", "the scalar c does not appear in the first line (S[τ σ] = "
                                "Q[τ a] K[σ a]): it would be drawn on its own, so the line "
                                "cannot equal the first"),
], ids=["a tensor", "a scalar"])
def test_a_tensor_the_first_line_lacks_fails_saying_so_without_numbers(capsys, tmp_path, line,
                                                                       reason):
    path = write(tmp_path, f"```derivation\nS[τ σ] = Q[τ a] K[σ a]\n{line}\n```\n")
    code, out, _ = run(capsys, "verify", str(path))
    assert code == 1
    assert re.search(rf"^FAIL +— +— +— +— +3  {re.escape(line)}$", out, flags=re.M)
    assert f"FAIL {path}:3: {line}  — {reason}\n" in out
    _, doc = run_json(capsys, str(path))
    step = doc["blocks"][0]["steps"][0]
    assert (step["max_deviation"], step["verdict"], step["where"]) == (None, "FAIL", reason)


def test_a_raised_capital_summed_with_a_lowered_one_is_an_index_in_every_line(capsys, tmp_path):
    """``x^{N}`` beside ``A_{τ N}`` is the summed index N, not a label x_N: a review found the
    wrong step (A's N renamed M) passing and the true one failing."""
    first, true, wrong = (r"y_{\tau} = A_{\tau N} x^{N}", r"= A_{\tau N} x_{N}",
                          r"= A_{\tau M} x^{N}")
    code, out, _ = run(capsys, "verify", str(write(tmp_path, latex_block(
        r"\tau=2 N=3", first, true))))
    assert code == 0 and "read as y[τ] = A[τ N] x[N]" in out
    code, out, _ = run(capsys, "verify", str(write(tmp_path, latex_block(
        r"\tau=2 N=3", first, wrong))))
    assert code == 1 and "1 FAIL" in out
