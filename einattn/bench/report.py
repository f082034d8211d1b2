"""The report: what one run measured (:func:`run` makes it), as JSON and as text."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .compiled import CompileRow, compile_size
from .decoding import DecodingSection, decoding_lines, run_decoding
from .forms import NAMES, PATHS, unavailable
from .memory import MEMORY_METHOD, PATTERN_MEMORY_METHOD, MemoryRow, measure_memory
from .patterns import (
    FLEX_FORMS,
    FORWARD_ONLY,
    PATTERN_MEMORY_FORMS,
    PATTERN_NAMES,
    PatternSection,
    run_patterns,
    why_no_memory,
)
from .roof import Roof, measure_roof
from .settings import CLOCK_NAMES, MEMORY, PatternSize, Settings, Size
from .timing import Row, time_size
from .verdicts import VERDICTS, targets
from .work import FLOP_METHOD, rate_cells, rates


@dataclass
class Report:
    """Every row a run timed, compiled and measured, with the forms it skipped and why; the
    patterns section's in ``patterns``; the machine's roof the rows are rated against."""

    settings: Settings
    rows: list[Row] = field(default_factory=list)
    compiled: list[CompileRow] = field(default_factory=list)
    memory: list[MemoryRow] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    patterns: PatternSection = field(default_factory=PatternSection)
    decoding: DecodingSection = field(default_factory=DecodingSection)
    threads: int = field(default_factory=torch.get_num_threads)
    seconds: float = 0.0
    roof: Roof | None = None

    def machine(self) -> dict:
        return {"torch": torch.__version__, "einattn": _checkout(),
                "python": platform.python_version(),
                "platform": platform.platform(), "processor": platform.processor(),
                "cpu_count": os.cpu_count(), "threads": self.threads,
                "device": "cpu", "dtype": "float32"}

    def as_json(self) -> dict:
        s = self.settings
        return {
            "machine": self.machine(),
            "settings": {"quick": s.quick, "rounds": s.rounds, "warmup": s.warmup,
                         "clock": s.clock,
                         "sample_s": s.sample_s, "sizes": [x.as_json() for x in s.sizes],
                         "compile_sizes": [x.as_json() for x in s.compile_sizes],
                         "memory_lengths": list(s.memory_lengths),
                         "sections": list(s.sections),
                         "pattern_sizes": [x.as_json() for x in s.pattern_sizes],
                         "pattern_memory_lengths": list(s.pattern_memory_lengths),
                         "decoding_sizes": [x.as_json() for x in s.decoding_sizes]},
            "paths": {name: NAMES[name] for name in PATHS},
            "skipped": self.skipped,
            "timings": [r.as_json() for r in self.rows],
            "compile": ({"rows": [c.as_json() for c in self.compiled]} if self.compiled
                        else {"skipped": s.why_no_compile or "no compile sizes"}),
            "memory": ({"method": MEMORY_METHOD, "rows": [m.as_json() for m in self.memory]}
                       if self.memory else {"skipped": s.why_no_memory or "no lengths"}),
            "patterns": self.patterns.as_json(s),
            "decoding": self.decoding.as_json(s),
            "peak": self._peak_json(),
            "targets": [t.as_json() for t in targets(self)],
            "seconds": self.seconds,
        }


    def _peak_json(self) -> dict:
        """The roof measured, the thread count the rows are rated at and how they are."""
        if self.roof is None:
            return {"skipped": "no roof was measured"}
        return {**self.roof.as_json(), "threads": self.threads, "work": FLOP_METHOD}

    def rate(self, roof: Roof) -> None:
        """Rate every row of the layer, patterns and decoding sections against ``roof`` at
        this run's thread count (each row's ``peak``)."""
        self.roof = roof
        for row in (*self.rows, *self.patterns.rows, *self.patterns.causal,
                    *self.decoding.rows):
            row.peak = rates(row, roof, self.threads)


def _checkout() -> str:
    """The einattn that ran: the version, and the commit when run from a git checkout
    (with ``+dirty`` when files differ from it)."""
    from .. import __version__

    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--",
                                "einattn"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = dirty = ""
    if not commit:
        return __version__
    return f"{__version__} ({commit}{'+dirty' if dirty else ''})"


def run(settings: Settings, progress: Callable[[str], None] | None = None) -> Report:
    """Everything ``settings`` asks for, in this process (memory in subprocesses)."""
    say = progress or (lambda text: None)
    start = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(settings.threads or threads)
    report = Report(settings, skipped=unavailable())
    try:
        say("measuring the roof: a float32 matmul and a read of memory")
        roof = measure_roof((1, report.threads, threads), quick=settings.quick,
                            clock=settings.clock, all_threads=threads)
        for size in settings.sizes:
            say(f"timing {size.label}")
            report.rows += time_size(size, settings, report.skipped)
        for size in settings.compile_sizes:
            say(f"compiling {size.label}")
            report.compiled += compile_size(size, settings)
        for L in settings.memory_lengths:
            say(f"memory at L={L}")
            report.memory.append(measure_memory(L, report.skipped))
        if "patterns" in settings.sections:
            report.patterns = run_patterns(settings, say)
        if "decoding" in settings.sections:
            report.decoding = run_decoding(settings, say)
        report.rate(roof)
    finally:
        torch.set_num_threads(threads)
    report.seconds = time.perf_counter() - start
    return report


# -- the text -------------------------------------------------------------------------------

def _duration(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale or unit == "µs":
            value = seconds / scale
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
    raise AssertionError  # unreachable


def _times(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}×"


def _percent(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.0f}%"


def _count(k: int | None, noun: str) -> str:
    return f"{k} {noun}{'' if k == 1 else 's'}"


def _deviation_text(x: float) -> str:
    return "0" if x == 0 else f"{x:.0e}"


def _mib(b: int | None) -> str:
    return "—" if b is None else f"{b / 2**20:,.0f} MiB"


def _header(report: Report) -> list[str]:
    """What ran where and how it was timed, then the forms skipped."""
    s, m = report.settings, report.machine()
    layer = "layer" in s.sections
    return [f"einattn bench{' --quick' if s.quick else ''}: einattn {m['einattn']}, "
            f"torch {m['torch']}, CPU "
            f"({_count(m['cpu_count'], 'core')}, {_count(m['threads'], 'thread')}), float32"
            + (", bias-free, the same weights in every form" if layer else ""),
            f"median of {_count(s.rounds, 'interleaved round')} after "
            f"{_count(s.warmup, 'warm-up call')}, {CLOCK_NAMES[s.clock]}; "
            f"spread = IQR / median; forward under no_grad, forward+backward with "
            + ("dX and every weight's gradient" if layer else "dQ, dK and dV"),
            *(f"skipped: {NAMES[name]}: {why}" for name, why in report.skipped.items())]


def _roof_lines(report: Report) -> list[str]:
    """The roof the rows are rated against, or why there is none."""
    roof = report.roof
    if roof is None:
        return ["peak: no roof was measured"]
    def each(figures: dict[int, float], unit: str) -> str:
        return ", ".join(f"{x:.3g} {unit} on {_count(t, 'thread')}" for t, x in figures.items())
    return [f"peak: matmul {each(roof.gflops, 'GFLOP/s')}; bandwidth "
            f"{each(roof.bandwidth, 'GB/s')}; rows rated at {_count(report.threads, 'thread')}, "
            f"by FLOP (layer, patterns) or by bytes read (decoding)",
            f"  how: {roof.method}"]


def _timing_table(report: Report, size: Size, table, paint) -> list[str]:
    """One size: every form in both modes, its median, spread, ratios and max |ΔY|."""
    title = (f"{size.label}  n={size.n} τ=σ={size.L} i={size.d_model} "
             f"μ={size.heads} a={size.d_head}" + (", causal" if size.causal else ""))
    cells = [[r.mode, NAMES[name], _duration(t.median), _percent(t.spread),
              _times(r.ratio(name, "textbook")), _times(r.ratio(name, "linear_sdpa")),
              *rate_cells(r, name), _deviation_text(r.deviation[name])]
             for r in report.rows if r.size == size for name, t in r.timings.items()]
    return ["", title, *table(["mode", "form", "median", "spread", "× textbook",
                               "× Linear+SDPA", "GFLOP/s", "of peak", "max |ΔY|"], cells,
                              paint, right=(2, 3, 4, 5, 6, 7, 8))]


def _compile_table(report: Report, table, paint) -> list[str]:
    """Eager against compiled, and compiled against compiled textbook, or why none ran."""
    out = ["", "torch.compile (dynamic=False), eager and compiled timed in the same rounds"]
    if not report.compiled:
        return [*out, f"  skipped: {report.settings.why_no_compile}"]
    cells = [[c.size.label, c.mode, NAMES[name], _duration(c.eager[name].median),
              _duration(c.compiled[name].median), _times(c.speedup(name)),
              _times(c.ratio(name)), f"{c.compile_s[name]:.0f} s"]
             for c in report.compiled for name in c.compiled]
    return [*out, *table(["size", "mode", "form", "eager", "compiled", "speed-up",
                          "× compiled textbook", "first call"], cells, paint,
                         right=(3, 4, 5, 6, 7))]


def _memory_cells(report: Report, row: MemoryRow) -> list[list[str]]:
    """One length: each form run, its peak growth and ratios, or "failed"."""
    return [[str(row.L), NAMES[name], _mib(row.growth[name]),
             _times(row.ratio(name, "textbook")), _times(row.ratio(name, "linear_sdpa"))]
            if name in row.growth else [str(row.L), NAMES[name], "failed", "—", "—"]
            for name in PATHS if name not in report.skipped]


def _memory_table(report: Report, table, paint) -> list[str]:
    """Peak growth per form and length, with the method and each failure, or why none ran."""
    n, d_model, heads = MEMORY
    out = ["", f"peak memory, forward+backward, n={n} d_model={d_model} heads={heads}"]
    if not report.memory:
        return [*out, f"  skipped: {report.settings.why_no_memory}"]
    cells = [cell for row in report.memory for cell in _memory_cells(report, row)]
    return [*out, f"method: {MEMORY_METHOD}",
            *table(["L", "form", "peak growth", "× textbook", "× Linear+SDPA"], cells, paint,
                   right=(2, 3, 4)),
            *(f"  failed at L={row.L}: {NAMES[k]}: {e}"
              for row in report.memory for k, e in row.errors.items())]


def _pattern_table(report: Report, size: PatternSize, table, paint) -> list[str]:
    """One pattern size: every form in each mode it runs, its median, spread, ratios, max
    |ΔZ|, then what the forms cost before their timed calls."""
    title = (f"{size.label}  n={size.n} μ={size.heads} τ=σ={size.L} a={size.d_head}, "
             f"window of {size.window} keys")
    section = report.patterns
    cells = [[r.mode, PATTERN_NAMES[name], _duration(t.median), _percent(t.spread),
              _times(r.ratio(name, "sdpa_dense")), _times(r.ratio(name, "flex_compiled")),
              *rate_cells(r, name), _deviation_text(r.deviation[name])]
             for r in section.rows if r.size == size for name, t in r.timings.items()]
    setup = next((x.seconds for x in section.setup if x.size == size), {})
    return ["", title, *table(["mode", "form", "median", "spread", "× SDPA dense",
                               "× compiled flex", "GFLOP/s", "of peak", "max |ΔZ|"], cells,
                              paint, right=(2, 3, 4, 5, 6, 7, 8)),
            "  before the timed calls: " + "; ".join(f"{what} {_duration(seconds)}"
                                                     for what, seconds in setup.items())]


def _pattern_memory_table(report: Report, table, paint) -> list[str]:
    """Peak growth of the window's memory forms per length, or why none ran."""
    size = report.settings.pattern_sizes[0] if report.settings.pattern_sizes else None
    where = "" if size is None else (f", n={size.n} μ={size.heads} a={size.d_head} "
                                     f"window {size.window}")
    out = ["", f"peak memory of the window, forward+backward{where}"]
    memory = report.patterns.memory
    if not memory:
        return [*out, f"  skipped: {why_no_memory(report.settings)}"]
    cells = [[str(row.L), PATTERN_NAMES[name], _mib(row.growth[name]),
              _times(row.ratio(name, "chunked_causal")), _times(row.ratio(name, "sdpa_dense"))]
             if name in row.growth else [str(row.L), PATTERN_NAMES[name], "failed", "—", "—"]
             for row in memory for name in PATTERN_MEMORY_FORMS
             if name not in report.patterns.skipped]
    forward = [f"  forward alone at L={row.L}: {PATTERN_NAMES[name]} {_mib(growth)}"
               for row in report.patterns.forward_memory for name, growth in row.growth.items()]
    return [*out, f"method: {PATTERN_MEMORY_METHOD}",
            *table(["L", "form", "peak growth", "× no window", "× SDPA dense"], cells, paint,
                   right=(2, 3, 4)), *forward,
            *(f"  failed at L={row.L}: {PATTERN_NAMES[k]}: {e}"
              for row in (*memory, *report.patterns.forward_memory)
              for k, e in row.errors.items())]


def _patterns_text(report: Report, table, paint) -> list[str]:
    """The patterns section: what it times, each size, the forms skipped, memory."""
    skipped = report.patterns.skipped
    flex_timed = any(name not in skipped for name in FLEX_FORMS)
    return ["", "attention patterns: a causal sliding window (built in, as a MaskMod, as a "
                "Mask string) and 8 packed documents, Z[n μ τ a] from Q, K, V "
                "(forward+backward with dQ, dK, dV); ratios of medians against SDPA with the "
                "dense mask and the hand-written compiled flex_attention",
            *(line for size in report.settings.pattern_sizes
              for line in _pattern_table(report, size, table, paint)),
            *([f"  forward+backward: no flex forms ({FORWARD_ONLY})"] if flex_timed else []),
            *(f"  skipped: {PATTERN_NAMES[name]}: {why}" for name, why in skipped.items()),
            *_causal_table(report, table, paint),
            *_pattern_memory_table(report, table, paint)]


def _causal_table(report: Report, table, paint) -> list[str]:
    """Dense causal forward+backward at the memory lengths, with each form's peak growth
    there (from the memory rows) beside."""
    section = report.patterns
    if not section.causal:
        return []
    peaks = {(m.L, name): growth for m in section.memory for name, growth in m.growth.items()}
    cells = [[str(r.size.L), PATTERN_NAMES[name], _duration(t.median), _percent(t.spread),
              _times(r.ratio(name, "sdpa_causal")), *rate_cells(r, name),
              _deviation_text(r.deviation[name]) if name in r.deviation else "—",
              _mib(peaks.get((r.size.L, name)))]
             for r in section.causal for name, t in r.timings.items()]
    return ["", "dense causal attention, forward+backward, at the memory lengths: chunked "
                "against SDPA's flash kernel (is_causal); max |ΔZ| against SDPA's Z",
            *table(["L", "form", "median", "spread", "× SDPA is_causal", "GFLOP/s", "of peak",
                    "max |ΔZ|", "peak growth"], cells, paint, right=(2, 3, 4, 5, 6, 7, 8))]


def _targets_table(report: Report, table, paint) -> list[str]:
    """Every target with its verdict, then the count of each verdict."""
    found = targets(report)
    cells = [[t.verdict, t.target, t.where, "—" if t.value is None else f"{t.value:.3f}×",
              _percent(t.spread), t.note] for t in found]
    counts = {v: sum(t.verdict == v for t in found) for v in VERDICTS}
    return ["", "targets: ratios of medians (of peak memory for chunked) against their "
                "limits; einattn bench --check exits 1 on a FAIL",
            *table(["verdict", "target", "where", "measured", "spread", "note"], cells, paint,
                   right=(3, 4)),
            f"{len(found)} checks: " + ", ".join(f"{c} {v}" for v, c in counts.items() if c)]


def lines(report: Report, table, paint) -> list[str]:
    """The report as text; ``table`` and ``paint`` are einattn.cli's (aligned columns,
    verdicts in colour on a terminal)."""
    sections = report.settings.sections
    layer = [*(line for size in report.settings.sizes
               for line in _timing_table(report, size, table, paint)),
             *_compile_table(report, table, paint),
             *_memory_table(report, table, paint)] if "layer" in sections else []
    patterns = _patterns_text(report, table, paint) if "patterns" in sections else []
    decoding = decoding_lines(report.decoding, table, paint, _duration, _times, _percent,
                              rate_cells) if "decoding" in sections else []
    return [*_header(report), *_roof_lines(report), *layer, *patterns, *decoding,
            *_targets_table(report, table, paint),
            f"ran in {report.seconds:.0f} s"]
