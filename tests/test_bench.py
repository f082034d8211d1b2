"""The benchmark (einattn.bench, ``einattn bench``): the forms it times compute the same layer
(and, in the patterns section, the same sliding window), its report has every form with
positive finite medians and ratios, its targets read the rows they name, its sections run as
chosen, its memory method sees a tensor it knows is there. No timing assertions: speed lives
in the benchmark's own output (STYLE §6)."""

from __future__ import annotations

import contextlib
import io
import json
import math
import time

import pytest
import torch
from conftest import TOL, assert_close_scaled

from einattn import EinattnError, bench, cli, reference
from einattn.cli import output

TINY = "2,5,16,4"
QUICK = ["bench", "--quick", "--no-compile", "--no-memory", "--sizes", TINY, "--repeats", "2"]


def einattn(*argv: str) -> tuple[int, str, str]:
    with contextlib.redirect_stdout(io.StringIO()) as out, \
            contextlib.redirect_stderr(io.StringIO()) as err:
        status = cli.main(list(argv))
    return status, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def quick() -> dict:
    status, out, _ = einattn(*QUICK, "--json")
    assert status == 0
    return json.loads(out)


def positive(x) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


# -- the quick run's JSON --------------------------------------------------------------------

def test_quick_json_times_every_form_in_both_modes(quick):
    assert set(quick) == {"machine", "settings", "paths", "skipped", "timings", "compile",
                          "memory", "patterns", "decoding", "peak", "targets", "seconds"}
    assert set(quick["paths"]) == set(bench.PATHS)
    assert set(quick["skipped"]) <= {"chunked"}  # only the form still being written
    assert all(quick["skipped"].values())  # a skip says why
    rows = quick["timings"]
    assert [r["mode"] for r in rows] == list(bench.MODES)
    expected = set(bench.PATHS) - set(quick["skipped"])
    for row in rows:
        assert row["size"] == {"n": 2, "L": 5, "d_model": 16, "heads": 4, "d_head": 4,
                               "causal": False}
        assert set(row["paths"]) == expected
        for name, t in row["paths"].items():
            assert t["rounds"] == 2 and t["calls_per_sample"] >= 1, name
            assert all(positive(t[k]) for k in ("median_s", "q1_s", "q3_s", "min_s", "max_s"))
            assert t["min_s"] <= t["q1_s"] <= t["median_s"] <= t["q3_s"] <= t["max_s"]
            assert positive(t["vs_textbook"]) and positive(t["vs_linear_sdpa"]), name
            assert t["max_deviation"] < 1e-5, name  # float32: the same weights, the same Y


def test_quick_json_ratios_are_ratios_of_medians(quick):
    for row in quick["timings"]:
        paths = row["paths"]
        assert paths["textbook"]["vs_textbook"] == 1.0
        assert paths["linear_sdpa"]["vs_linear_sdpa"] == 1.0
        for t in paths.values():
            assert t["vs_textbook"] == pytest.approx(
                t["median_s"] / paths["textbook"]["median_s"], rel=1e-12)
            assert t["vs_linear_sdpa"] == pytest.approx(
                t["median_s"] / paths["linear_sdpa"]["median_s"], rel=1e-12)


def test_quick_json_says_what_it_skipped(quick):
    assert quick["compile"] == {"skipped": "--no-compile"}
    assert quick["memory"] == {"skipped": "--no-memory"}
    assert quick["settings"]["quick"] is True and quick["settings"]["rounds"] == 2
    assert quick["machine"]["torch"] == torch.__version__


def test_quick_json_targets(quick):
    found = {(t["target"], t["where"]): t for t in quick["targets"]}
    assert all(t["verdict"] in bench.VERDICTS for t in quick["targets"])
    tiny = found["einsum ≤ 1.2× textbook", "(2, 5, 16, 4) forward+backward"]
    assert positive(tiny["value"]) and tiny["verdict"] in ("PASS", "FAIL")
    assert tiny["value"] == quick["timings"][1]["paths"]["einsum"]["vs_textbook"]
    assert found["einsum ≤ 1.0× textbook", "(8, 128, 512, 8) forward+backward"]["verdict"] \
        == "SKIP"  # a size this run did not time
    compiled = found["compiled einsum ≤ 1.05× compiled textbook", "mid sizes"]
    assert compiled["verdict"] == "SKIP" and compiled["note"] == "--no-compile"


def test_quick_json_rates_every_row_against_the_peak(quick):
    """The roof, at the suite's one thread, named with "peak", "GFLOP/s" and "bandwidth";
    every form of the layer and patterns rows its FLOP, GFLOP/s and fraction of peak,
    every decoding form its bytes read, GB/s and fraction of the peak bandwidth."""
    peak = quick["peak"]
    threads = quick["machine"]["threads"]
    assert peak["threads"] == threads and str(threads) in peak["peak_matmul_GFLOP/s"]
    for figures in (peak["peak_matmul_GFLOP/s"], peak["peak_bandwidth_GB/s"]):
        assert "1" in figures and all(positive(x) for x in figures.values())
    flop = ("FLOP", "GFLOP/s", "fraction_of_peak_GFLOP/s")
    read = ("cache_read_bytes", "bandwidth_GB/s", "fraction_of_peak_bandwidth")
    for rows, keys, roof in ((quick["timings"], flop, peak["peak_matmul_GFLOP/s"]),
                             (quick["patterns"]["timings"], flop, peak["peak_matmul_GFLOP/s"]),
                             (quick["decoding"]["timings"], read, peak["peak_bandwidth_GB/s"])):
        for row in rows:
            for name, t in row["paths"].items():
                work, rate, fraction = (t[k] for k in keys)
                assert rate == pytest.approx(work / t["median_s"] / 1e9, rel=1e-12), name
                assert fraction == pytest.approx(rate / roof[str(threads)], rel=1e-12), name


def test_quick_text_names_every_form_and_every_target(quick):
    status, out, err = einattn(*QUICK)
    assert status == 0 and "einattn bench: timing (2, 5, 16, 4)" in err  # progress: stderr
    skipped = bench.unavailable()
    for name in bench.PATHS:
        assert (bench.NAMES[name] in out) == (name not in skipped), name
    assert "(2, 5, 16, 4)  n=2 τ=σ=5 i=16 μ=4 a=4" in out
    assert "skipped: --no-compile" in out and "skipped: --no-memory" in out
    assert "\npeak: matmul " in out and "GFLOP/s" in out and "of peak" in out
    verdicts = [line.split()[0] for line in out.split("\ntargets: ")[1]
                .splitlines()[2:] if line.split() and line.split()[0] in bench.VERDICTS]
    # which targets are checked depends on the sizes and modes run, not on the timings
    assert verdicts and len(verdicts) == len(quick["targets"])


# -- the forms: one layer, six ways ----------------------------------------------------------

@pytest.mark.parametrize("size", [bench.Size(3, 7, 30, 5), bench.Size(2, 11, 12, 3, causal=True)],
                         ids=lambda s: s.label)
def test_every_form_is_the_same_layer(size):
    """In float64, every form's Y and dX equal the independent reshape reference's, on the
    weights of one einattn layer: the ratios compare like with like."""
    forms = bench.build(size, dtype=torch.float64,
                        paths=tuple(p for p in bench.PATHS if p not in bench.unavailable()))
    x, dy = bench.inputs(size, dtype=torch.float64)
    W_q, W_k, W_v, W_o, *_ = forms["einsum"].projections()
    x_ref = x.detach().clone().requires_grad_()
    y_ref = reference.multi_head_attention(x_ref, W_q, W_k, W_v, W_o, n_heads=size.heads,
                                           causal=size.causal)
    y_ref.backward(dy)
    for form in forms.values():
        bench.step(form, "forward+backward", x, dy, list(form.parameters()))()  # sets x.grad
        with torch.no_grad():
            assert_close_scaled(form(x), y_ref.detach(), TOL[torch.float64])
        assert_close_scaled(x.grad, x_ref.grad, TOL[torch.float64])


def test_forms_share_weights_but_not_gradients():
    forms = bench.build(bench.Size(1, 3, 8, 2))
    assert forms["einsum"].W is forms["sdpa"].W is forms["chunked"].W  # one layer's weights
    assert [forms[p].impl for p in ("einsum", "sdpa", "chunked")] == ["einsum", "sdpa", "chunked"]
    others = [p for name in ("textbook", "torch_mha", "linear_sdpa")
              for p in forms[name].parameters()]
    assert not {id(p) for p in forms["einsum"].parameters()} & {id(p) for p in others}


# -- sizes, settings, statistics, targets ----------------------------------------------------

@pytest.mark.parametrize("text, size", [
    ("8,128,512,8", bench.Size(8, 128, 512, 8)),
    (" 2, 1024 ,512,8,causal", bench.Size(2, 1024, 512, 8, causal=True)),
])
def test_parse_size(text, size):
    assert bench.parse_size(text) == size


@pytest.mark.parametrize("text, message", [
    ("8,128,512", "four positive integers"),
    ("8,128,512,8,9", "four positive integers"),
    ("8,0,512,8", "four positive integers"),
    ("8,x,512,8", "four positive integers"),
    ("2,5,18,4", "d_model=18 is not divisible by heads=4"),
])
def test_bad_sizes_are_one_line_usage_errors(text, message):
    with pytest.raises(ValueError, match=message):
        bench.parse_size(text)
    status, out, err = einattn("bench", "--sizes", text)
    assert status == 2 and out == "" and err.count("\n") == 1 and message in err


def test_settings():
    full = bench.Settings.build()
    assert full.sizes == bench.SIZES and full.compile_sizes == bench.COMPILE_SIZES
    assert full.memory_lengths == (4096, 8192) and not full.quick
    quick = bench.Settings.build(quick=True)
    assert quick.compile_sizes == () and quick.why_no_compile and quick.rounds == 3
    assert quick.memory_lengths == (1024,)
    mine = bench.Settings.build(sizes=(bench.Size(1, 8, 8, 2),), rounds=4, memory=False)
    assert mine.compile_sizes == mine.sizes and mine.rounds == 4
    assert mine.memory_lengths == () and mine.why_no_memory == "--no-memory"


def test_samples_read_the_chosen_clock(monkeypatch):
    """``--clock cpu`` reads the process's CPU time (which leaves out the time the machine
    spends elsewhere), the default the wall clock; checked with stand-in clocks."""
    assert bench.CLOCKS == {"wall": time.perf_counter, "cpu": time.process_time}
    assert set(bench.CLOCKS) == set(bench.CLOCK_NAMES)  # every clock has its name in the text
    ticks = {"wall": iter([10.0, 13.0]), "cpu": iter([1.0, 1.5])}
    monkeypatch.setattr(bench.timing, "CLOCKS", {k: (lambda k=k: next(ticks[k])) for k in ticks})
    assert bench.timing.seconds(lambda: None, 1, "cpu") == 0.5
    assert bench.timing.seconds(lambda: None, 1) == 3.0
    assert bench.Settings.build().clock == "wall"
    assert bench.Settings.build(quick=True, clock="cpu").clock == "cpu"
    with pytest.raises(EinattnError, match="clock must be one of 'wall', 'cpu', got 'CPU'"):
        bench.Settings.build(clock="CPU")


def test_the_clock_is_reported():
    status, out, _ = einattn(*QUICK, "--clock", "cpu", "--repeats", "1", "--json")
    assert status == 0 and json.loads(out)["settings"]["clock"] == "cpu"
    status, out, _ = einattn(*QUICK, "--clock", "cpu", "--repeats", "1")
    assert status == 0 and "process CPU time" in out.splitlines()[1]
    status, _, err = einattn(*QUICK, "--clock", "sundial")
    assert status == 2 and "invalid choice: 'sundial'" in err


def test_timing_statistics():
    t = bench.Timing((5.0, 1.0, 4.0, 2.0, 3.0), calls_per_sample=1)
    assert t.median == 3.0 and t.iqr == (2.0, 4.0) and t.spread == pytest.approx(2 / 3)
    assert bench.Timing((2.0, 1.0), 1).median == 1.5
    assert bench.Timing((7.0,), 1).iqr == (7.0, 7.0)


def fake_row(size: bench.Size, mode: str, **medians: float) -> bench.Row:
    return bench.Row(size, mode, {name: bench.Timing((m,), 1) for name, m in medians.items()},
                     deviation=dict.fromkeys(medians, 0.0))


def verdicts(report: bench.Report) -> dict[tuple[str, str], str]:
    return {(t.target, t.where): t.verdict for t in bench.targets(report)}


def test_targets_read_the_rows_they_name():
    mid, long, tiny = bench.SIZES[0], bench.SIZES[1], bench.SIZES[3]
    fb = "forward+backward"
    report = bench.Report(bench.Settings.build(memory=False), skipped={"chunked": "absent"})
    report.rows = [
        fake_row(mid, fb, einsum=0.99, textbook=1.0, sdpa=1.0, linear_sdpa=1.0, torch_mha=0.9),
        fake_row(long, fb, einsum=0.86, textbook=1.0, sdpa=1.0, linear_sdpa=1.0, torch_mha=2),
        fake_row(tiny, fb, einsum=1.31, textbook=1.0, sdpa=1.0, linear_sdpa=1.0, torch_mha=2),
        fake_row(bench.Size(2, 1024, 512, 8, causal=True), fb, einsum=9.0, textbook=1.0,
                 sdpa=9.0, linear_sdpa=1.0, torch_mha=1.0),  # causal: informational only
    ]
    found = verdicts(report)
    assert found["einsum ≤ 1.0× textbook", f"{mid.label} {fb}"] == "PASS"
    assert found["einsum ≤ 0.85× textbook", f"{long.label} {fb}"] == "FAIL"
    assert found["einsum ≤ 1.2× textbook", f"{tiny.label} {fb}"] == "FAIL"
    assert found["sdpa ≤ 1.2× textbook", f"{tiny.label} {fb}"] == "PASS"
    assert found["sdpa ≤ 1.0× Linear+SDPA", f"{mid.label} {fb}"] == "PASS"  # equal passes
    assert found["sdpa ≤ 1.0× nn.MultiheadAttention", f"{mid.label} {fb}"] == "FAIL"
    assert found["chunked ≤ 1.3× textbook", f"{long.label} {fb}"] == "SKIP"
    assert found["chunked peak memory ≤ 2× Linear+SDPA's", "L=8192 forward+backward"] == "SKIP"
    assert not any("causal" in where for _, where in found)
    assert [t.note for t in bench.targets(report) if t.target.startswith("chunked ≤")] \
        == ["absent"]


def test_memory_and_compile_targets():
    report = bench.Report(bench.Settings.build())
    report.memory = [bench.MemoryRow(8192, {"chunked": 300, "linear_sdpa": 100}, {})]
    t = bench.Timing
    report.compiled = [bench.CompileRow(
        bench.SIZES[0], "forward", eager={}, compile_s={},
        compiled={"textbook": t((1.0,), 1), "einsum": t((1.04,), 1), "sdpa": t((1.0,), 1)})]
    found = verdicts(report)
    assert found["chunked peak memory ≤ 2× Linear+SDPA's", "L=8192 forward+backward"] == "FAIL"
    assert found["compiled einsum ≤ 1.05× compiled textbook", f"{bench.SIZES[0].label} forward"] \
        == "PASS"


@pytest.mark.parametrize("einsum, argv, status", [
    (1.21, ["--check"], 1),
    (1.21, [], 0),  # without --check, bench only reports
    (1.19, ["--check"], 0),
], ids=["missed, --check", "missed", "met, --check"])
def test_check_exits_1_when_a_target_is_missed(monkeypatch, einsum, argv, status):
    """A stand-in run at (2, 5, 16, 4), where einsum's target is ≤ 1.2× textbook; every
    other target there passes (sdpa equal to both baselines) or is skipped."""
    tiny = bench.SIZES[3]
    report = bench.Report(bench.Settings.build(sizes=(tiny,), compile=False, memory=False))
    report.rows = [fake_row(tiny, mode, einsum=einsum, textbook=1.0, sdpa=1.0, linear_sdpa=1.0,
                            torch_mha=1.0) for mode in bench.MODES]
    monkeypatch.setattr(bench, "run", lambda settings, progress=None: report)
    code, out, _ = einattn("bench", *argv)
    assert code == status
    missed = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert len(missed) == (einsum > 1.2) and "--check exits 1 on a FAIL" in out


# -- memory ----------------------------------------------------------------------------------

def test_memory_growth_sees_the_scores():
    """One subprocess: textbook's forward+backward at L=512 holds the scores, 4 heads × 512²
    float32 = 4 MiB, so the measured growth is at least that."""
    skip = {name: "not this test" for name in bench.PATHS if name != "textbook"}
    row = bench.measure_memory(512, skip)
    assert row.errors == {} and set(row.growth) == {"textbook"}
    assert row.growth["textbook"] >= 4 * 512 * 512 * 4


# -- the patterns section: a causal sliding window -------------------------------------------

def test_quick_json_times_the_window_in_both_modes(quick):
    """The quick run's patterns section at its tiny size: every form but the compiled flex
    ones (--no-compile) in both modes, ratios of medians, each Z that of its pattern."""
    section = quick["patterns"]
    assert set(section) == {"paths", "skipped", "timings", "setup", "memory", "causal"}
    assert section["causal"] == []  # timed at the memory lengths, none with --no-memory
    assert set(section["skipped"]) >= set(bench.FLEX_FORMS)
    assert section["skipped"]["flex"] == "--no-compile"
    assert section["memory"] == {"skipped": "--no-memory"}
    expected = set(bench.PATTERN_FORMS + bench.DOCUMENT_FORMS) - set(section["skipped"])
    assert "sdpa_dense" in expected and "einsum" in expected
    rows = section["timings"]
    assert [r["mode"] for r in rows] == list(bench.MODES)
    for row in rows:
        assert row["size"] == bench.QUICK_PATTERN_SIZES[0].as_json()
        assert set(row["paths"]) == expected
        base = row["paths"]["sdpa_dense"]["median_s"]
        for name, t in row["paths"].items():
            assert positive(t["median_s"]) and t["vs_flex_compiled"] is None, name
            assert t["vs_sdpa_dense"] == pytest.approx(t["median_s"] / base, rel=1e-12)
            assert t["max_deviation"] < 1e-5, name
    assert [s["size"] for s in section["setup"]] == [rows[0]["size"]]
    assert positive(section["setup"][0]["seconds"]["dense mask"])


def test_quick_text_has_the_window_and_its_targets(quick):
    status, out, err = einattn(*QUICK)
    assert status == 0 and "einattn bench: timing the window (1, 2, 64, 8) w=16" in err
    assert "(1, 2, 64, 8) w=16  n=1 μ=2 τ=σ=64 a=8, window of 16 keys" in out
    assert "skipped: compiled flex (hand-written): --no-compile" in out
    found = {(t["target"], t["where"]): t for t in quick["targets"]}
    issue = bench.PATTERN_SIZES[0].label
    assert found["window: chunked ≤ 0.3× SDPA (dense mask)", f"{issue} both modes"]["note"] \
        == "no such size was run"
    assert found["window: chunked peak memory ≤ 1.0× without", "L=8192 forward+backward"] \
        == {"target": "window: chunked peak memory ≤ 1.0× without",
            "where": "L=8192 forward+backward", "value": None, "limit": 1.0, "spread": None,
            "verdict": "SKIP", "note": "--no-memory"}


@pytest.mark.parametrize("section, ran, not_ran", [
    ("patterns", "attention patterns: a causal sliding window", "textbook (reshape)"),
    ("layer", "textbook (reshape)", "attention patterns"),
])
def test_section_chooses_what_runs(section, ran, not_ran):
    argv = [*QUICK, "--repeats", "1", "--section", section]
    status, out, _ = einattn(*argv, "--json")
    doc = json.loads(out)
    assert status == 0 and doc["settings"]["sections"] == [section]
    if section == "patterns":
        assert doc["timings"] == [] and doc["compile"] == {"skipped": "--no-compile"}
        assert all(t["target"] in PATTERN_TARGETS for t in doc["targets"])
    else:
        assert doc["patterns"] == {"skipped": "--section layer"}
        assert doc["decoding"] == {"skipped": "--section layer"}
        assert not any(t["target"] in PATTERN_TARGETS for t in doc["targets"])
    status, out, _ = einattn(*argv)
    assert status == 0 and ran in out and not_ran not in out


PATTERN_TARGETS = {"window: chunked ≤ 0.3× SDPA (dense mask)",
                   "window: chunked ≤ 1.0× compiled flex",
                   'window: impl="flex" ≤ 1.1× compiled flex',
                   "window: chunked peak memory ≤ 1.0× without"}


def test_sections_and_pattern_sizes_in_settings():
    assert bench.SECTIONS == cli.bench.SECTIONS  # the command line names them unimported
    full = bench.Settings.build()
    assert full.sections == bench.SECTIONS and full.pattern_sizes == bench.PATTERN_SIZES
    assert full.pattern_memory_lengths == (8192,) and full.why_no_flex == ""
    assert bench.Settings.build(quick=True).why_no_flex == "--quick runs no compile"
    mine = bench.Settings.build(sections=("patterns",), compile=False, memory=False,
                                pattern_sizes=(bench.PatternSize(1, 2, 3, 4, 5),))
    assert mine.sizes == mine.compile_sizes == mine.memory_lengths == ()
    assert mine.why_no_compile == "--no-compile" and mine.why_no_memory == "--no-memory"
    assert mine.why_no_flex == "--no-compile" and mine.pattern_memory_lengths == ()
    assert mine.pattern_sizes == (bench.PatternSize(1, 2, 3, 4, 5),)
    patterns = bench.Settings.build(sections=("patterns",))
    assert patterns.why_no_compile == patterns.why_no_memory == "--section patterns"
    assert patterns.pattern_memory_lengths == (8192,) and patterns.why_no_flex == ""
    layer = bench.Settings.build(sections=("layer",))
    assert layer.sizes == bench.SIZES and layer.pattern_sizes == layer.pattern_memory_lengths == ()
    with pytest.raises(EinattnError, match="section must be one of 'layer', 'patterns', "
                                           "'decoding', got 'x'"):
        bench.Settings.build(sections=("x",))


# -- the decoding section: a prefill, then one token at a time --------------------------------

def test_quick_json_times_every_decoding_form(quick):
    """The quick run's decoding section: every form per token, ratios of medians against
    both hand-written loops and einattn sdpa, each first step's Y that of the cat form, and
    the bytes each cache holds (the cat form's exactly its keys and values, the
    preallocated one's every slot, einattn's storage at least as much as the cat form's)."""
    section = quick["decoding"]
    assert set(section) == {"paths", "slack", "timings"}
    (row,) = section["timings"]
    size = bench.QUICK_DECODING_SIZES[0]
    assert row["size"] == size.as_json() and row["mode"] == "per token, no_grad"
    assert set(row["paths"]) == set(bench.DECODING_FORMS)
    paths = row["paths"]
    for name, t in paths.items():
        for key, base in (("vs_hand_cat", "hand_cat"), ("vs_hand_prealloc", "hand_prealloc"),
                          ("vs_einattn_sdpa", "sdpa")):
            assert t[key] == pytest.approx(t["median_s"] / paths[base]["median_s"], rel=1e-12)
        assert positive(t["median_s"]) and t["max_deviation"] < 1e-5, name
    per_position = 2 * size.n * size.d_model * 4  # K and V, float32
    cat = paths["hand_cat"]["cache_bytes"]
    assert cat % per_position == 0 and size.context < cat // per_position \
        <= size.context + section["slack"]
    assert paths["hand_prealloc"]["cache_bytes"] == (size.context + section["slack"]) \
        * per_position
    assert all(paths[name]["cache_bytes"] >= cat for name in bench.EINATTN)


def test_quick_text_has_the_decoding_section(quick):
    status, out, err = einattn(*QUICK, "--section", "decoding")
    assert status == 0 and "einattn bench: decoding at (1, 32, 4) context 24" in err
    assert "(1, 32, 4) context 24  n=1 i=32 μ=4 τ=1 σ≈24" in out
    assert all(name in out for name in bench.DECODING_NAMES.values())
    assert "textbook (reshape)" not in out and "attention patterns" not in out


def test_every_decoding_form_decodes_the_same_tokens():
    """In float64, 40 steps of every form (each cache cropped back to the prompt every
    SLACK tokens) give the same Y, token by token: the ratios compare like with like."""
    size = bench.DecodingSize(2, 30, 5, 13)
    x = reference_inputs(size)
    forms = bench.decoding_forms(size, x)
    steps = {name: torch.cat([form() for _ in range(40)], 1) for name, form in forms.items()}
    for Y in steps.values():
        assert_close_scaled(Y, steps["hand_cat"], TOL[torch.float64])
    assert steps["hand_cat"].shape == (2, 40, 30)
    assert len(forms["sdpa"].cache) == 13 + 40 % bench.decoding.SLACK


def reference_inputs(size) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    return torch.randn(size.n, size.context + bench.decoding.SLACK, size.d_model, generator=g,
                       dtype=torch.float64)


@pytest.mark.parametrize("text, message", [
    ("1,4,4096,64", "five positive integers"),
    ("1,4,4096,64,0", "five positive integers"),
    ("1,4,x,64,256", "five positive integers"),
    ("1,4,20000,64,256", "bench at (1, 4, 20000, 64) w=256 would hold S[n μ τ σ]"),
])
def test_bad_pattern_sizes_are_one_line_usage_errors(text, message):
    if "would hold" not in message:
        with pytest.raises(ValueError, match=message):
            bench.parse_pattern_size(text)
    status, out, err = einattn("bench", "--pattern-sizes", text)
    assert status == 2 and out == "" and err.count("\n") == 1 and message in err


def test_an_unknown_section_is_a_usage_error():
    status, out, err = einattn("bench", "--section", "window")
    assert status == 2 and out == "" and "invalid choice: 'window'" in err


def test_window_mask():
    """τ sees τ − w < σ ≤ τ: at w = 2, itself and the key before it."""
    assert bench.window_mask(4, 2).int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0],
                                                      [0, 1, 1, 0], [0, 0, 1, 1]]
    assert bench.window_mask(3, 5).equal(torch.ones(3, 3, dtype=torch.bool).tril())


def window_reference(Q, K, V, allowed):
    """softmax(Q Kᵀ / √a, over the allowed keys) V, by hand."""
    S = Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])
    return torch.softmax(S.masked_fill(~allowed, float("-inf")), dim=-1) @ V


@pytest.mark.parametrize("size", [bench.PatternSize(2, 3, 37, 5, 7),
                                  bench.PatternSize(1, 2, 19, 6, 25)], ids=lambda s: s.label)
def test_every_eager_window_form_is_the_same_attention(size):
    """In float64, every form but the compiled flex ones gives the hand-written reference's Z
    and dQ, dK, dV for its pattern (the window's; the causal one without it)."""
    names = tuple(p for p in bench.PATTERN_FORMS if p not in bench.FLEX_FORMS)
    forms, setup = bench.pattern_forms(size, names)
    assert set(forms) == set(names) and set(setup) == {"dense mask"}
    Q, K, V, dZ = bench.pattern_inputs(size, dtype=torch.float64)
    for name, form in forms.items():
        allowed = bench.window_mask(size.L, size.L if name in ("chunked_causal", "sdpa_causal")
                                    else size.window)
        leaves = [t.clone().requires_grad_() for t in (Q, K, V)]
        window_reference(*leaves, allowed).backward(dZ)
        assert_close_scaled(form(Q, K, V), window_reference(Q, K, V, allowed), TOL[torch.float64])
        mine = [t.clone().requires_grad_() for t in (Q, K, V)]
        form(*mine).backward(dZ)
        for got, want in zip(mine, leaves, strict=True):
            assert_close_scaled(got.grad, want.grad, TOL[torch.float64])



def test_the_document_forms_are_block_diagonal_attention():
    """The packed documents (issue 38: block-diagonal, not causal): SDPA with the dense mask
    and the chunked form give the softmax over each query's own document, every key of it."""
    from einattn.bench.patterns import document_ids
    size = bench.PatternSize(1, 2, 29, 5, 7)
    forms, _ = bench.pattern_forms(size, ("sdpa_documents", "chunked_documents"))
    Q, K, V, _ = bench.pattern_inputs(size, dtype=torch.float64)
    d = document_ids(size.L)[0]
    allowed = d[:, None] == d[None, :]
    assert not allowed.tril().equal(allowed)  # a query sees keys after it
    for form in forms.values():
        assert_close_scaled(form(Q, K, V), window_reference(Q, K, V, allowed), TOL[torch.float64])


def test_the_hand_written_flex_is_the_window():
    """The one compiled case: the hand-written FlexAttention call (float32, forward) gives
    the window's Z, and its BlockMask's cost is reported apart from the call."""
    if bench.pattern_skipped(bench.Settings.build()).get("flex_compiled"):
        pytest.skip("no FlexAttention or torch.compile here")
    size = bench.PatternSize(1, 2, 256, 16, 64)
    forms, setup = bench.pattern_forms(size, ("flex_compiled",))
    assert set(setup) == {"dense mask", "create_block_mask first call", "create_block_mask"}
    Q, K, V, _ = bench.pattern_inputs(size)
    with torch.no_grad():
        Z = forms["flex_compiled"](Q, K, V)
    assert_close_scaled(Z, window_reference(Q, K, V, bench.window_mask(size.L, size.window)),
                        TOL[torch.float32])



def test_the_hand_written_flex_of_documents_is_block_diagonal():
    """The documents' compiled FlexAttention call (float32, forward), compiled for its own
    mask_mod, gives the block-diagonal Z; its BlockMask's cost is reported apart."""
    if bench.pattern_skipped(bench.Settings.build()).get("flex_documents"):
        pytest.skip("no FlexAttention or torch.compile here")
    from einattn.bench.patterns import document_ids
    size = bench.PatternSize(1, 2, 256, 16, 64)
    forms, setup = bench.pattern_forms(size, ("flex_documents",))
    assert "create_block_mask (documents)" in setup
    Q, K, V, _ = bench.pattern_inputs(size)
    d = document_ids(size.L)[0]
    with torch.no_grad():
        Z = forms["flex_documents"](Q, K, V)
    assert_close_scaled(Z, window_reference(Q, K, V, d[:, None] == d[None, :]),
                        TOL[torch.float32])


def test_pattern_targets_read_the_rows_they_name():
    """At issue 19's size only: chunked against the dense SDPA in both modes, against the
    hand-written compiled flex forward, impl="flex" against it, and the window's memory."""
    size, t = bench.PATTERN_SIZES[0], bench.Timing
    report = bench.Report(bench.Settings.build(sections=("patterns",)))
    report.patterns.rows = [
        bench.PatternRow(size, "forward", {"sdpa_dense": t((1.0,), 1), "chunked": t((0.3,), 1),
                                           "flex_compiled": t((0.31,), 1),
                                           "flex": t((0.35,), 1)}),
        bench.PatternRow(size, "forward+backward", {"sdpa_dense": t((1.0,), 1),
                                                    "chunked": t((0.31,), 1)}),
        bench.PatternRow(bench.PatternSize(1, 4, 1024, 64, 256), "forward",
                         {"sdpa_dense": t((1.0,), 1), "chunked": t((0.9,), 1)}),  # not named
    ]
    report.patterns.memory = [bench.MemoryRow(8192, {"chunked": 90, "chunked_causal": 100}, {})]
    assert verdicts(report) == {
        ("window: chunked ≤ 0.3× SDPA (dense mask)", f"{size.label} forward"): "PASS",
        ("window: chunked ≤ 0.3× SDPA (dense mask)", f"{size.label} forward+backward"): "FAIL",
        ("window: chunked ≤ 1.0× compiled flex", f"{size.label} forward"): "PASS",
        ('window: impl="flex" ≤ 1.1× compiled flex', f"{size.label} forward"): "FAIL",
        ("window: chunked peak memory ≤ 1.0× without", "L=8192 forward+backward"): "PASS",
    }
    report.patterns.memory[0].growth["chunked"] = 101
    assert verdicts(report)["window: chunked peak memory ≤ 1.0× without",
                            "L=8192 forward+backward"] == "FAIL"


def test_issue_38s_targets_read_their_rows():
    """Documents against their compiled flex, training against the forward (the same form,
    both modes), dense causal against SDPA's is_causal, the window under 0.2× dense SDPA."""
    size, t = bench.PATTERN_SIZES[0], bench.Timing
    report = bench.Report(bench.Settings.build(sections=("patterns",)))
    report.patterns.rows = [
        bench.PatternRow(size, "forward", {"sdpa_dense": t((1.0,), 1), "chunked": t((0.19,), 1),
                                           "chunked_documents": t((0.4,), 1),
                                           "flex_documents": t((0.5,), 1)}),
        bench.PatternRow(size, "forward+backward", {
            "chunked": t((0.6,), 1), "chunked_documents": t((1.2,), 1),
            "chunked_causal": t((1.3,), 1), "sdpa_causal": t((1.0,), 1)}),
    ]
    found = verdicts(report)
    assert found["window: chunked ≤ 0.2× SDPA (dense mask)", f"{size.label} forward"] == "PASS"
    assert found["documents: chunked ≤ 1.0× compiled flex", f"{size.label} forward"] == "PASS"
    assert found["window: chunked forward+backward ≤ 2.5× forward", size.label] == "FAIL"  # 3.2
    assert found["documents: chunked forward+backward ≤ 2.5× forward", size.label] == "FAIL"
    assert found["causal: chunked ≤ 1.25× SDPA is_causal",
                 f"{size.label} forward+backward"] == "FAIL"  # 1.3
    value = {(x.target, x.where): x.value for x in bench.targets(report)}
    assert value["window: chunked forward+backward ≤ 2.5× forward", size.label] == 0.6 / 0.19
    long = bench.PatternSize(1, 4, 8192, 64, 256)
    report.patterns.causal = [bench.PatternRow(long, "forward+backward", {
        "chunked_causal": t((1.2,), 1), "sdpa_causal": t((1.0,), 1)})]
    found = verdicts(report)
    assert found["causal: chunked ≤ 1.25× SDPA is_causal",
                 f"{long.label} forward+backward"] == "PASS"  # 1.2
    assert found["causal: chunked ≤ 1.25× SDPA is_causal",
                 f"{size.label} forward+backward"] == "FAIL"  # still read at 4096


def test_long_causal_times_chunked_against_sdpa_and_reports_its_peak():
    """Dense causal at a memory length: chunked and SDPA's flash kernel forward+backward, the
    ratio of their medians, chunked's Z within float32 rounding of SDPA's; the text shows the
    row with the peak growth the memory run measured at that length."""
    size = bench.PatternSize(1, 2, 96, 8, 16)
    settings = bench.Settings.build(quick=True, sections=("patterns",))
    row = bench.time_long_causal(size, settings, {})
    assert set(row.timings) == {"chunked_causal", "sdpa_causal"}
    assert row.mode == "forward+backward" and positive(row.ratio("chunked_causal", "sdpa_causal"))
    assert row.deviation["sdpa_causal"] == 0 and row.deviation["chunked_causal"] < 1e-5
    report = bench.Report(settings)
    report.patterns.ran, report.patterns.causal = True, [row]
    report.patterns.memory = [bench.MemoryRow(96, {"chunked_causal": 5 * 2 ** 20}, {})]
    text = "\n".join(bench.lines(report, output.table, output.Paint(False)))
    line = next(x for x in text.splitlines()
                if x.split()[:1] == ["96"] and "einattn chunked, no window" in x and "×" in x)
    assert line.endswith("5 MiB")
    alone = bench.time_long_causal(size, settings, {"sdpa_causal": "no SDPA here"})
    assert set(alone.timings) == {"chunked_causal"} and alone.deviation == {}  # nothing compared
    report.patterns.causal = [alone]
    line = next(x for x in "\n".join(bench.lines(report, output.table, output.Paint(False)))
                .splitlines() if x.split()[:1] == ["96"] and "einattn chunked, no window" in x)
    assert line.split()[-3:] == ["—", "5", "MiB"]  # no |ΔZ| without SDPA; the peak as measured


def test_a_form_left_out_is_noted_at_its_targets():
    size, t = bench.PATTERN_SIZES[0], bench.Timing
    report = bench.Report(bench.Settings.build(sections=("patterns",), compile=False))
    report.patterns.skipped = dict.fromkeys(bench.FLEX_FORMS, "--no-compile")
    report.patterns.rows = [bench.PatternRow(size, "forward", {"sdpa_dense": t((1.0,), 1),
                                                               "chunked": t((0.2,), 1)})]
    found = {t.target: t for t in bench.targets(report)}
    assert found["window: chunked ≤ 0.3× SDPA (dense mask)"].verdict == "PASS"
    for target in ("window: chunked ≤ 1.0× compiled flex",
                   'window: impl="flex" ≤ 1.1× compiled flex'):
        assert (found[target].verdict, found[target].note) == ("SKIP", "--no-compile")


def test_pattern_memory_sees_the_gradients(monkeypatch):
    """One subprocess: chunked's forward+backward with the window at L=2048, 4 heads of 64
    channels, makes dQ, dK and dV, 2 MiB each, so the measured growth is at least that.
    glibc returns every freed buffer of 64 KiB or more at once (MALLOC_MMAP_THRESHOLD_), so
    that the resident set follows the live tensors, not what the allocator kept."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # the subprocess reads it
    row = bench.measure_pattern_memory(bench.PatternSize(1, 4, 64, 64, 128), 2048, ("chunked",))
    assert row.errors == {} and set(row.growth) == {"chunked"}
    assert row.growth["chunked"] >= 3 * 4 * 2048 * 64 * 4


def test_decoding_targets_read_the_contexts_they_name():
    """Issue 24's targets at context 4096 only: sdpa and einsum against the torch.cat loop,
    chunked against einattn's sdpa; issue 38's, sdpa ≤ 1.1× the preallocated loop, at
    contexts 512 and 4096; a row at another context is not read."""
    long, short, t = bench.DECODING_SIZES[-1], bench.DECODING_SIZES[0], bench.Timing
    report = bench.Report(bench.Settings.build(sections=("decoding",)))

    def row(size, **medians):
        return bench.DecodingRow(size, "per token", {k: t((m,), 1) for k, m in medians.items()},
                                 dict.fromkeys(medians, 0.0), dict.fromkeys(medians, 0))

    report.decoding.rows = [row(long, sdpa=1.0, einsum=1.5, chunked=1.31, hand_cat=2.0,
                                hand_prealloc=0.86),
                            row(short, sdpa=1.09, einsum=9.0, chunked=9.0, hand_cat=1.0,
                                hand_prealloc=1.0),
                            row(bench.DecodingSize(1, 512, 8, 1024), sdpa=9.0, einsum=9.0,
                                chunked=9.0, hand_cat=1.0, hand_prealloc=1.0)]
    where = f"{long.label} per token"
    assert verdicts(report) == {
        ("decoding: sdpa ≤ 0.6× the torch.cat loop", where): "PASS",
        ("decoding: sdpa ≤ 1.1× the preallocated loop", f"{short.label} per token"): "PASS",
        ("decoding: sdpa ≤ 1.1× the preallocated loop", where): "FAIL",
        ("decoding: einsum ≤ 0.7× the torch.cat loop", where): "FAIL",
        ("decoding: chunked ≤ 1.3× einattn sdpa", where): "FAIL",
    }
