"""The command line (einattn.cli): the main job, trace, verify, latex, bench, --json, the
colour rule, one-line errors with exit status 2, and docs/cli.md showing real output."""

from __future__ import annotations

import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import without_rounding
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from einattn import EinattnError, Equation, cli, derivation, functional, reference
from einattn.derivation import Step

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
STAGES = ["PROJECT", "SCORES", "SOFTMAX", "VALUES", "HEADS"]
ANSI = "\033["
SMALL = ["--batch", "2", "--seq", "3", "--d-model", "6", "--heads", "2"]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *argv: str) -> tuple[int, dict]:
    code, out, _ = run(capsys, *argv, "--json")
    return code, json.loads(out)


# -- the main job ----------------------------------------------------------------------------

def test_main_job_traces_every_stage_then_passes_every_step(capsys):
    code, out, err = run(capsys)
    assert code == 0 and err == ""
    for name in STAGES:
        assert f"({cli.EQUATIONS[name]}) {name}" in out
        assert str(getattr(functional, name)) in out
    assert "nbca,nbda->nbcd" in out and "μ=b τ=c σ=d" in out  # the scores' einsum, mapped
    assert "S (2, 4, 5, 5)" in out and "Y (2, 5, 16)" in out and "M (5, 5)" in out
    assert "X (2, 5, 16)  W (48, 16)" in out and "self-attention, causal" in out
    for step in derivation.steps():
        assert re.search(rf"^PASS .* {re.escape(step.name)}$", out, flags=re.M), step.name
    k = len(derivation.steps())
    assert "FAIL" not in out and f"{k} steps: {k} PASS" in out
    assert "contraction order of 'scores as one four-operand contraction" in out


def test_main_job_shows_each_stage_cost_from_explain(capsys):
    _, doc = run_json(capsys)
    sizes = doc["sizes"]
    scores = doc["stages"][1]
    # A two-operand contraction summing a: 2 FLOPs per term of n μ τ σ a.
    assert scores["flops"] == 2 * math.prod(sizes[i] for i in ("n", "μ", "τ", "σ", "a"))
    assert scores["largest_intermediate"] == math.prod(scores["outputs"]["S"])
    softmax = doc["stages"][2]
    assert softmax["einsum"] is None and softmax["flops"] is None


def letter_mapped(equation: str, mapping: dict[str, str]) -> str:
    """The einsum an equation should become under ``mapping``, worked out independently."""
    terms = ["".join(mapping.get(i, i) for i in re.sub(r"[()]", " ", t).split())
             for t in re.findall(r"\[([^\]]*)\]", equation)]
    return f"{','.join(terms[1:])}->{terms[0]}"


def test_every_einsum_is_its_equation_with_the_letters_shown(capsys):
    _, doc = run_json(capsys, "trace", "--seq-k", "7")
    contractions = [s for s in doc["stages"] if s["einsum"]]
    assert len(contractions) == 4  # every stage but the softmax
    for stage in contractions:
        assert all(not c.isascii() for c in stage["letters"])  # only the renamed are shown
        assert letter_mapped(stage["equation"], stage["letters"]) == stage["einsum"]


# -- failing steps, bad arguments, library errors -------------------------------------------

@pytest.mark.parametrize("k", range(len(derivation.mutations())),
                         ids=[m.name for m in derivation.mutations()])
def test_a_wrong_step_fails_with_exit_status_1(capsys, monkeypatch, k):
    """Each mutation, run after a true step, fails by name and makes the run exit 1 (every
    true step passing together: test_main_job_traces_every_stage_then_passes_every_step)."""
    true_step = derivation.steps()[k % len(derivation.steps())]
    wrong = derivation.mutations()[k]
    monkeypatch.setattr(derivation, "steps", lambda sizes=None: [true_step, wrong])
    code, out, _ = run(capsys, "verify")
    assert code == 1
    assert re.search(rf"^FAIL .* {re.escape(wrong.name)}$", out, flags=re.M)
    assert re.search(rf"^PASS .* {re.escape(true_step.name)}$", out, flags=re.M)
    assert "2 steps: 1 PASS, 1 FAIL" in out


def test_main_job_fails_when_the_layer_disagrees_with_the_reference(capsys, monkeypatch):
    honest = reference.multi_head_attention
    monkeypatch.setattr(reference, "multi_head_attention",
                        lambda *args, **kwargs: honest(*args, **kwargs) * (1 + 1e-9))
    code, doc = run_json(capsys)
    assert code == 1 and doc["passed"] is False
    failed = [s["name"] for s in doc["steps"] if not s["equal"]]
    assert failed == ["whole layer = reshape form"]


def test_sides_of_different_shapes_fail_the_step_instead_of_crashing(capsys, monkeypatch):
    step = Step("a transposed output", "Y[τ j] = X[τ i] W[i j]", "Y[j τ] = X[τ i] W[i j]",
                {"τ": 3, "i": 4, "j": 5}, exact=True)
    monkeypatch.setattr(derivation, "steps", lambda sizes=None: [step])
    code, doc = run_json(capsys, "verify")
    assert code == 1
    assert doc["steps"][0]["verdict"] == "FAIL" and "different shapes" in doc["steps"][0]["where"]


BAD_ARGUMENTS = {
    "d_model not divisible": (["trace", "--d-model", "18"], "not divisible by --heads 4"),
    "unknown option": (["--no-such-option"], "unrecognized arguments: --no-such-option"),
    "zero length": (["trace", "--seq", "0"], "--seq: must be a positive integer, got 0"),
    "negative heads": (["verify", "--heads", "-2"], "--heads: must be a positive integer"),
    "not a number": (["trace", "--batch", "two"], "'two' is not an integer"),
    "unknown subcommand": (["train"], "invalid choice: 'train'"),
    "option of another subcommand": (["latex", "--seq", "3"], "unrecognized arguments"),
    "kv heads not dividing": (["trace", "--kv-heads", "3"],
                              "--heads 4 is not a multiple of --kv-heads 3"),
    "sizes before latex": (["--seq", "3", "latex"], "latex takes no size options (--seq)"),
    "sizes before bench": (["--heads", "2", "--batch", "1", "bench"],
                           "bench takes no size options (--batch, --heads)"),
}


def assert_usage_error(code: int, out: str, err: str, message: str) -> None:
    assert code == 2 and out == ""
    assert err.startswith("einattn: error: ") and err.count("\n") == 1
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("argv, message", BAD_ARGUMENTS.values(), ids=BAD_ARGUMENTS)
def test_bad_arguments_exit_2_with_one_line(capsys, argv, message):
    assert_usage_error(*run(capsys, *argv), message)


# -- every size option at its edges ----------------------------------------------------------

TOO_BIG = "over the limit of 1.0 GiB for one tensor: choose smaller sizes"
HUGE = str(10**9)
BENCH = ["bench", "--quick", "--no-compile", "--no-memory", "--sizes", "2,5,16,4",
         "--repeats", "1"]
CORES = str(os.cpu_count())
# option: {edge: (value, None for a result, else a fragment of the one-line error)}.
# "= X" is a value equal to X's (default) size.
SIZE_EDGES = {
    "--batch": {"1": ("1", None), "= --seq": ("5", None), "10**9": (HUGE, TOO_BIG)},
    "--seq": {"1": ("1", None), "= --batch": ("2", None), "10**9": (HUGE, TOO_BIG)},
    "--seq-k": {"1": ("1", None), "= --seq": ("5", None), "10**9": (HUGE, TOO_BIG)},
    "--d-model": {"1": ("1", "--d-model 1 is not divisible by --heads 4"),
                  "= --heads": ("4", None), "10**9": (HUGE, TOO_BIG)},
    "--heads": {"1": ("1", None), "= --d-model": ("16", None),
                "10**9": (HUGE, f"--d-model 16 is not divisible by --heads {HUGE}")},
    "--kv-heads": {"1": ("1", None), "= --heads": ("4", None),
                   "10**9": (HUGE, f"--heads 4 is not a multiple of --kv-heads {HUGE}")},
}
BENCH_EDGES = {
    "--sizes": {"1": ("1,1,1,1", None), "= each other": ("3,3,6,6", None),
                "n 10**9": (f"{HUGE},5,16,4", f"bench at ({HUGE}, 5, 16, 4) would hold"),
                "L 10**9": (f"2,{HUGE},16,4", TOO_BIG),
                "d_model 10**9": (f"2,5,{HUGE},4", TOO_BIG),
                "heads 10**9": (f"2,5,16,{HUGE}", f"d_model=16 is not divisible by heads={HUGE}"),
                "0": ("2,0,16,4", "four positive integers"),
                "negative": ("2,5,16,-4", "four positive integers")},
    "--repeats": {"1": ("1", None), "10**9": (HUGE, "1,000,000,000 is over 1,000")},
    "--threads": {"1": ("1", None), "= cores": (CORES, None),
                  "10**9": (HUGE, f"is over {int(CORES):,}, the CPU cores this machine has")},
}
for edges in (*SIZE_EDGES.values(), BENCH_EDGES["--repeats"], BENCH_EDGES["--threads"]):
    edges |= {"0": ("0", "must be a positive integer, got 0"),
              "negative": ("-1", "must be a positive integer, got -1")}
SUBCOMMANDS = {"main job": ([], SIZE_EDGES), "trace": (["trace"], SIZE_EDGES),
               "verify": (["verify"], SIZE_EDGES), "bench": (BENCH, BENCH_EDGES)}
EDGE_CASES = [pytest.param(argv, option, value, expected, id=f"{name} {option} {edge}")
              for name, (argv, table) in SUBCOMMANDS.items()
              for option, edges in table.items()
              for edge, (value, expected) in edges.items()]
# Where each option's value shows in the JSON document.
SHOWN_AT = {
    "--batch": lambda doc: doc["sizes"]["n"], "--seq": lambda doc: doc["sizes"]["τ"],
    "--seq-k": lambda doc: doc["sizes"]["σ"], "--d-model": lambda doc: doc["sizes"]["i"],
    "--heads": lambda doc: doc["sizes"]["μ"], "--kv-heads": lambda doc: doc["sizes"]["g"],
    "--sizes": lambda doc: ",".join(str(doc["settings"]["sizes"][0][k])
                                    for k in ("n", "L", "d_model", "heads")),
    "--repeats": lambda doc: doc["settings"]["rounds"],
    "--threads": lambda doc: doc["machine"]["threads"],
}


class Largest(TorchDispatchMode):
    """The most elements any operation's result held in memory (a view: its whole storage)
    while the mode was on, counted in 8-byte elements."""

    def __init__(self):
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        made = func(*args, **(kwargs or {}))
        self.elements = max([self.elements, *(t.untyped_storage().nbytes() // 8
                                              for t in tree_flatten(made)[0]
                                              if isinstance(t, torch.Tensor))])
        return made


@pytest.mark.parametrize("argv, option, value, expected",
                         [case for case in EDGE_CASES if case.values[3] is None])
def test_a_size_at_its_edge_gives_a_result(capsys, argv, option, value, expected):
    code, doc = run_json(capsys, *argv, option, value)
    assert code == 0 and doc.get("passed", True)  # verify and the main job: every step
    assert str(SHOWN_AT[option](doc)) == value


@pytest.mark.parametrize("argv, option, value, expected",
                         [case for case in EDGE_CASES if case.values[3] is not None])
def test_a_size_past_its_edge_is_one_usage_error_before_any_tensor(capsys, argv, option, value,
                                                                   expected):
    with Largest() as made:
        code, out, err = run(capsys, *argv, option, value)
    assert_usage_error(code, out, err, expected)
    assert made.elements == 0  # refused from the sizes alone


def test_the_memory_error_states_the_estimate_and_the_limit(capsys):
    code, out, err = run(capsys, "verify", "--seq", "10000")
    assert_usage_error(code, out, err, "verify at --batch 2 --seq 10000 --d-model 16 --heads 4 "
                       "would hold S[n μ τ σ] (the scores of (2)) of 800,000,000 float64 "
                       "elements (6.0 GiB), over the limit of 1.0 GiB for one tensor")
    sizes = derivation.with_value_width(derivation.default_sizes(L=10_000))
    assert cli.largest_tensor(sizes, cli.VERIFY_TENSORS) == ("S[n μ τ σ]", 2 * 4 * 10_000**2)


def test_the_memory_error_names_the_run_asked_for_and_what_the_tensor_is(capsys):
    """Issue 34: wide heads made the main job refuse with the linear-attention steps' H[n μ τ
    a c] alone, a tensor the user never asked for; the refusal names the run and its sizes."""
    code, out, err = run(capsys, "--d-model", "8192", "--heads", "1", "--seq", "64",
                         "--kv-heads", "1")
    assert_usage_error(code, out, err, "einattn: error: the main job at --batch 2 --seq 64 "
                       "--d-model 8192 --heads 1 --kv-heads 1 would hold H[n μ τ a c] (the "
                       "linear-attention steps' prefix sums, with c = a + 3) of 8,593,080,320 "
                       "float64 elements (64.0 GiB)")
    assert set(cli.options.HELD) == set(cli.VERIFY_TENSORS) >= set(cli.TRACE_TENSORS)


# Sizes at which each tensor of the estimate is the largest in turn (in the comment; H[n μ τ
# a c] with one key and wide heads).
ESTIMATED = {
    "trace long": "trace --seq 40 --d-model 24 --heads 6 --kv-heads 2 --causal",  # S[n μ τ σ]
    "trace one head": "trace --batch 5 --seq 9 --d-model 12 --heads 1",  # P[n σ μ B a]
    "trace one key": "trace --batch 5 --seq 9 --seq-k 1 --d-model 12 --heads 1",  # X[n τ i]
    "trace wide": "trace --batch 1 --seq 2 --d-model 64 --heads 2",  # W[(μ B a) i]
    "verify long keys": "verify --seq 3 --seq-k 30 --d-model 8",  # H[n μ σ a c]
    "verify one key": "verify --seq 40 --seq-k 1",  # S[n μ τ τ]
    "verify one key, wide heads": "verify --batch 8 --seq 2 --seq-k 1 --d-model 48 --heads 2",
    "verify 32 heads of 2": "verify --batch 1 --seq 2 --d-model 64 --heads 32",  # W_QK[μ i j]
    "verify 8 heads of 2": "verify --batch 4 --seq 8 --heads 8",  # Y_μ[n μ τ i]
}


@pytest.mark.parametrize("argv", [argv.split() for argv in ESTIMATED.values()], ids=ESTIMATED)
def test_the_memory_estimate_bounds_every_tensor_made(capsys, argv):
    """The estimate that refuses sizes is the most memory one tensor of the run takes, or a
    little more."""
    with Largest() as made:
        code, doc = run_json(capsys, *argv)
    tensors = cli.TRACE_TENSORS if argv[0] == "trace" else cli.VERIFY_TENSORS
    _, estimate = cli.largest_tensor(derivation.with_value_width(doc["sizes"]), tensors)
    assert code == 0 and made.elements <= estimate <= 2 * made.elements


@pytest.mark.parametrize("argv, head", [
    (["--seq", "1"], "trace: n=2 τ=1 σ=1 i=16 μ=4 a=4, self-attention, causal"),
    (["--seq", "3", "--seq-k", "4"], "trace: n=2 τ=3 σ=4 i=16 μ=4 a=4, cross-attention, causal"),
    (["--seq", "3", "trace"], "trace: n=2 τ=3 σ=3 i=16 μ=4 a=4, self-attention,"),
    (["--seq", "3", "trace", "--seq", "4"], "trace: n=2 τ=4 σ=4 i=16 μ=4 a=4, self-attention,"),
    (["--batch", "3", "verify", "--seq", "2"], "derivation steps at n=3 τ=2 σ=2 i=16 μ=4 a=4"),
], ids=["main job", "main job, cross", "before trace", "before and after trace",
        "before and after verify"])
def test_sizes_before_the_subcommand_or_without_one(capsys, argv, head):
    code, out, _ = run(capsys, *argv)
    assert code == 0 and head in out


def test_kv_heads_equal_to_heads_is_accepted(capsys):
    assert run(capsys, "trace", *SMALL, "--kv-heads", "2")[0] == 0


@pytest.mark.parametrize("cross", [[], ["--seq-k", "7"]], ids=["self", "cross"])
def test_kv_heads_trace_the_grouped_equations(capsys, cross):
    """--heads 6 --kv-heads 2: W[(g C a) i] with g = 2, C = 5, a = 4; K and V have 2 heads."""
    _, doc = run_json(capsys, "trace", "--heads", "6", "--d-model", "24", "--kv-heads", "2",
                      *cross)
    names = [stage["name"] for stage in doc["stages"]]
    assert names == ["PROJECT_GQA", "SCORES_GQA", "SOFTMAX", "VALUES_GQA", "HEADS"]
    project = doc["stages"][0]
    assert project["inputs"]["W"] == [40, 24] and project["outputs"]["K"][1] == 2
    assert project["outputs"]["Q"][1] == 6
    code, out, _ = run(capsys, "verify", "--heads", "6", "--d-model", "24", "--kv-heads", "3")
    assert code == 0 and "GQA (g C a) layout" in out


@pytest.mark.parametrize("step", [
    Step("scores with a size missing", functional.SCORES, functional.SCORES, {"n": 2},
         exact=True),
    Step("an output index on no operand", "Y[τ j] = X[τ i]", "Y[τ j] = X[τ i]",
         {"τ": 3, "i": 4, "j": 5}, exact=True),
], ids=["one-line message", "message with equation and caret"])
def test_a_library_error_is_one_line(capsys, monkeypatch, step):
    monkeypatch.setattr(derivation, "steps", lambda sizes=None: [step])
    code, out, err = run(capsys, "verify")
    with pytest.raises(EinattnError) as raised:
        cli.check_step(step)
    message, *shown = str(raised.value).splitlines()
    expected = message + (f" — {shown[0].strip()}" if shown else "")  # the caret line dropped
    assert code == 2 and out == ""
    assert err == f"einattn: error: {expected}\n"


# -- trace -----------------------------------------------------------------------------------

def test_trace_at_distinct_sizes_gives_every_shape(capsys):
    n, L, L_k, d_model, heads = 3, 4, 7, 24, 2  # a = 12
    code, doc = run_json(capsys, "trace", "--batch", str(n), "--seq", str(L), "--seq-k",
                         str(L_k), "--d-model", str(d_model), "--heads", str(heads))
    assert code == 0 and doc["cross_attention"] and not doc["causal"]
    a = d_model // heads
    shapes = {name: tuple(shape) for s in doc["stages"]
              for name, shape in (*s["inputs"].items(), *s["outputs"].items())}
    assert shapes == {"X": (n, L, d_model), "C": (n, L_k, d_model), "W": (3 * d_model, d_model),
                      "Q": (n, heads, L, a), "K": (n, heads, L_k, a), "V": (n, heads, L_k, a),
                      "S": (n, heads, L, L_k), "A": (n, heads, L, L_k),
                      "Z": (n, heads, L, a), "W_O": (heads, a, d_model), "Y": (n, L, d_model)}


def test_trace_seq_k_shows_cross_attention(capsys):
    code, out, _ = run(capsys, "trace", "--seq-k", "7")
    assert code == 0 and "cross-attention" in out
    assert "X (2, 5, 16)  C (2, 7, 16)  W (48, 16)" in out
    assert "Q (2, 4, 5, 4)  K, V (2, 4, 7, 4)" in out and "S (2, 4, 5, 7)" in out
    assert "M (" not in out  # no mask without --causal


def test_cross_attention_projection_counts_both_runs(capsys):
    _, self_doc = run_json(capsys, "trace")
    _, cross = run_json(capsys, "trace", "--seq-k", "5")
    assert cross["stages"][0]["flops"] == self_doc["stages"][0]["flops"]  # B=1 + B=2 = B=3
    _, longer = run_json(capsys, "trace", "--seq-k", "10")
    assert longer["stages"][0]["flops"] == self_doc["stages"][0]["flops"] * (1 + 2 * 2) // 3


def test_trace_causal_adds_the_mask(capsys):
    _, doc = run_json(capsys, "trace", "--causal", "--seq-k", "7")
    assert doc["stages"][2]["inputs"] == {"S": [2, 4, 5, 7], "M": [5, 7]}


# -- verify ----------------------------------------------------------------------------------

STEP_KEYS = {"name", "mode", "max_deviation", "tolerance", "equal", "false_acceptance"}


def test_verify_json_has_every_step_with_the_documented_keys(capsys):
    code, doc = run_json(capsys, "verify", *SMALL)
    assert code == 0 and doc["passed"] is True
    assert [s["name"] for s in doc["steps"]] == [s.name for s in derivation.steps()]
    for step in doc["steps"]:
        assert STEP_KEYS <= step.keys() and step["equal"] is True
        if step["mode"] in ("exact", "field"):
            assert step["max_deviation"] == 0 and 0 < step["false_acceptance"] < 1e-6
        else:
            assert step["max_deviation"] <= step["tolerance"] <= 1e-10
            assert step["false_acceptance"] is None


def test_verify_exact_skips_the_float_steps(capsys):
    code, out, _ = run(capsys, "verify", "--exact", *SMALL)
    assert code == 0
    for step in derivation.steps():
        verdict = "PASS +(exact|field)" if step.exact else "SKIP +float"
        assert re.search(rf"^{verdict} .* {re.escape(step.name)}$", out, flags=re.M), step.name
    exact = sum(s.exact for s in derivation.steps())
    assert f"{exact} PASS, {len(derivation.steps()) - exact} SKIP" in out


def test_verify_shows_the_contraction_order_opt_einsum_picks(capsys):
    _, doc = run_json(capsys, "verify")
    scores, linear = doc["contractions"]  # (2) as four operands; linear attention's (L1)
    assert linear["step"].startswith("linear attention: (L1)")
    equation = Equation(scores["equation"])
    assert len(equation.terms) == 4 and scores["step"].startswith("scores as one four-operand")
    sizes = derivation.default_sizes()
    plan = equation.explain(**{t.name: tuple(sizes[i] for i in t.indices)
                               for t in equation.terms})
    assert (scores["einsum"], scores["flops"]) == (plan.einsum, plan.flops)
    assert scores["flops"] < scores["naive_flops"] and len(scores["order"]) == 3
    assert scores["order"][-1]["contraction"].startswith("S[n μ τ σ] = ")
    # The pairwise einsums, run in the path's order, compute the whole contraction.
    g = torch.Generator().manual_seed(0)
    operands = [torch.randn(t, generator=g, dtype=torch.float64)
                for t in (tuple(sizes[i] for i in term.indices) for term in equation.terms)]
    whole = torch.einsum(plan.einsum, *operands)
    for positions, step in zip(scores["path"], scores["order"], strict=True):
        taken = [operands.pop(p) for p in sorted(positions, reverse=True)]
        operands.append(torch.einsum(step["einsum"], *taken))
    torch.testing.assert_close(operands[0], whole, rtol=1e-12, atol=1e-12)


# -- latex and bench -------------------------------------------------------------------------

def test_latex_prints_every_equation_numbered_as_in_the_derivation(capsys):
    code, out, _ = run(capsys, "latex")
    assert code == 0
    derivation_md = (ROOT / "docs" / "derivation.md").read_text(encoding="utf-8")
    blocks = out.strip().split("\n\n")
    assert len(blocks) == 9  # (1)–(5), (5a), and grouped-query (1g), (2g), (4g)
    for block, (name, number) in zip(blocks, cli.EQUATIONS.items(), strict=True):
        equation = getattr(functional, name)
        latex = equation.latex() if isinstance(equation, Equation) else cli.SOFTMAX_LATEX
        assert block == f"$$\n{latex} \\tag{{{number}}}\n$$"
        assert block in derivation_md  # the same display as the docs


def test_latex_json(capsys):
    code, doc = run_json(capsys, "latex")
    assert code == 0
    assert [e["number"] for e in doc["equations"]] == ["1", "2", "3", "4", "5", "5a", "1g", "2g",
                                                       "4g"]
    assert doc["equations"][1]["latex"] == functional.SCORES.latex()


def test_a_subcommand_is_one_registered_function(capsys, monkeypatch):
    # where command() and main() look the registry up: einattn.cli.commands
    monkeypatch.setattr(cli.commands, "COMMANDS", dict(cli.COMMANDS))

    @cli.command("hello", "say hello", cli.size_options)
    def hello(args, paint):
        return cli.Output({"heads": args.heads}, [f"hello, {args.heads} heads"])

    assert run(capsys, "hello", "--heads", "3") == (0, "hello, 3 heads\n", "")
    assert run_json(capsys, "hello")[1] == {"heads": 4}


# -- --json, --help, colour ------------------------------------------------------------------

@pytest.mark.parametrize("argv, keys", [
    ([], {"sizes", "stages", "steps", "contractions", "passed"}),
    (["trace"], {"sizes", "causal", "cross_attention", "seed", "stages"}),
    (["verify", *SMALL], {"sizes", "exact_only", "steps", "contractions", "passed"}),
    (["latex"], {"equations"}),
], ids=["main job", "trace", "verify", "latex"])
def test_every_subcommand_has_json(capsys, argv, keys):
    code, out, _ = run(capsys, *argv, "--json")
    doc = json.loads(out)
    assert code == 0 and keys <= doc.keys()
    for stage in doc.get("stages", []):
        assert {"equation", "einsum", "inputs", "outputs", "flops",
                "largest_intermediate"} <= stage.keys()


def test_json_before_the_subcommand_works_too(capsys):
    assert "equations" in json.loads(run(capsys, "--json", "latex")[1])


@pytest.mark.parametrize("argv", [[], ["trace"], ["verify"], ["latex"], ["bench"]],
                         ids=["main job", "trace", "verify", "latex", "bench"])
def test_help_everywhere(capsys, argv):
    code, out, _ = run(capsys, *argv, "--help")
    assert code == 0 and out.startswith("usage: einattn") and "--json" in out
    if argv in (["trace"], ["verify"]):
        assert "--seq-k" in out and "--kv-heads" in out


def test_no_colour_when_not_a_terminal(capsys, monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    _, out, _ = run(capsys, "verify", *SMALL)
    assert ANSI not in out and "PASS" in out


def test_colour_on_a_terminal_unless_no_color(capsys, monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    _, coloured, _ = run(capsys, "verify", *SMALL)
    assert "\033[32mPASS" in coloured
    assert ANSI not in run(capsys, "verify", *SMALL, "--json")[1]  # JSON: never coloured
    monkeypatch.setenv("NO_COLOR", "1")
    _, plain, _ = run(capsys, "verify", *SMALL)
    assert ANSI not in plain
    assert re.sub(r"\033\[\d+m", "", coloured) == plain  # colour never moves a column


def test_table_aligns_columns_and_right_aligns_numbers():
    lines = cli.table(["name", "count", "verdict"], [["a", "1", "PASS"], ["bbb", "1,000", "FAIL"]],
                      cli.Paint(False), right=(1,))
    assert lines == ["name  count  verdict",
                     "a         1  PASS",
                     "bbb   1,000  FAIL"]
    painted = cli.table(["x"], [["FAIL"]], cli.Paint(True))
    assert painted == ["\033[1mx\033[0m", "\033[31mFAIL\033[0m"]


# -- as a program ----------------------------------------------------------------------------

def test_python_m_einattn_runs_the_main_job():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "einattn"], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    k = len(derivation.steps())
    assert "(2) SCORES" in done.stdout and f"{k} steps: {k} PASS" in done.stdout
    assert ANSI not in done.stdout  # a pipe is no terminal


def test_console_script_if_installed():
    script = shutil.which("einattn")
    if script is None:
        pytest.skip("the einattn console script is not installed on PATH")
    done = subprocess.run([script, "trace", "--d-model", "18"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("einattn: error: ")
    assert "Traceback" not in done.stderr


def test_a_closed_pipe_ends_quietly(capsys, monkeypatch):
    """``einattn | head``: the reader left, so no traceback, and the status of SIGPIPE."""
    read_end, write_end = os.pipe()

    class Closed(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def fileno(self):
            return write_end

    monkeypatch.setattr(sys, "stdout", Closed())
    try:
        assert cli.main(["latex"]) == 141
    finally:
        os.close(read_end)
        os.close(write_end)
    assert capsys.readouterr().err == ""


# -- docs/cli.md shows real output -----------------------------------------------------------

SHOWN = re.compile(r"^```text\n\$ einattn(.*?)\n(.*?)^```$", re.M | re.S)


def shown_outputs() -> list[tuple[list[str], str]]:
    return [(argv.split(), output) for argv, output in SHOWN.findall(DOC)]


def test_docs_show_every_subcommand():
    shown = {argv[0] if argv and not argv[0].startswith("-") else "" for argv, _ in
             shown_outputs()}
    assert shown == {"", *cli.COMMANDS} - {"bench"}  # bench prints timings: performance.md


@pytest.mark.parametrize("argv, shown", shown_outputs(),
                         ids=[" ".join(["einattn", *argv]) for argv, _ in shown_outputs()])
def test_docs_output_is_what_the_command_prints(capsys, monkeypatch, argv, shown):
    monkeypatch.delenv("NO_COLOR", raising=False)
    code, out, err = run(capsys, *argv)
    printed = out if code != 2 else err
    assert without_rounding(printed) == without_rounding(shown)


def test_docs_output_compares_on_a_machine_that_rounds_differently(capsys, other_rounding):
    """The README's test command on another CPU (issue 34): there a float step's deviation
    prints 0 where this one prints 1.9e-16, and the other way round."""
    code, printed, _ = run(capsys)
    (shown,) = [text for argv, text in shown_outputs() if argv == []]
    assert code == 0 and printed != shown  # the rounding noise did change
    assert without_rounding(printed) == without_rounding(shown)


def test_docs_output_differs_when_the_docs_say_something_else(capsys):
    """Only a float step's deviation is let go: an edit of anything else in docs/cli.md's
    main job (a verdict, an exact deviation, a tolerance, a bound, a step, a shape, a FLOP
    count, the prose of a line) fails the comparison."""
    _, printed, _ = run(capsys)
    (shown,) = [text for argv, text in shown_outputs() if argv == []]
    edits = [("PASS     float", "FAIL     float"), ("PASS     exact", "FAIL     exact"),
             ("exact                0", "exact                1"), ("4.5e-11", "4.6e-11"),
             ("≤ 1.8e-09", "≤ 1.9e-09"), ("whole layer = reshape form", "whole layer"),
             ("Y (2, 5, 16)", "Y (2, 5, 17)"), ("15,360", "15,361"), ("56 PASS", "55 PASS"),
             ("seeded float64 input", "seeded input")]
    for old, new in edits:
        assert old in shown, old
        edited = shown.replace(old, new, 1)
        assert without_rounding(printed) != without_rounding(edited), (old, new)
    noise = re.sub(r"^(PASS     float)(\s+\S+)", lambda m: m.group(1) + "9.9e-17".rjust(
        len(m.group(2))), shown, count=1, flags=re.M)  # another rounding: still the docs
    assert noise != shown and without_rounding(printed) == without_rounding(noise)


def test_docs_option_table_lists_every_option(capsys):
    documented = set(re.findall(r"^\| `(--[\w-]+)", DOC, flags=re.M))
    helps = [run(capsys, name, "--help")[1] for name in cli.COMMANDS]
    actual = {option for text in helps for option in re.findall(r"--[\w-]+", text)}
    assert documented == actual - {"--help"}


# -- einattn verify --derive: the gradients of (1)-(5), each proved in the finite field --------

def test_verify_derive_lists_each_gradient_of_1_to_5_proved_in_the_field(capsys):
    code, doc = run_json(capsys, "verify", "--derive", *SMALL)
    assert code == 0 and doc["passed"] is True
    assert [(g["equation"], g["wrt"]) for g in doc["gradients"]] == [
        ("(1)", "X"), ("(1)", "W"), ("(2)", "Q"), ("(2)", "K"), ("(3)", "S"), ("(3)", "M"),
        ("(4)", "A"), ("(4)", "V"), ("(5)", "Z"), ("(5)", "W_O")]
    for g in doc["gradients"]:
        assert (g["mode"], g["verdict"], g["equal"]) == ("field", "PASS", True)
        assert g["false_acceptance"] < 1e-12 and Equation(g["gradient"]).latex() == g["latex"]


def test_verify_derive_takes_no_file(capsys, tmp_path):
    path = tmp_path / "d.md"
    path.write_text("```derivation\nY[τ] = X[τ i] v[i]\n= v[i] X[τ i]\n```\n", encoding="utf-8")
    code, out, err = run(capsys, "verify", "--derive", str(path))
    assert_usage_error(code, out, err, "einattn: error: --derive derives the gradients of "
                       "equations (1)-(5); it takes no FILE.md")
