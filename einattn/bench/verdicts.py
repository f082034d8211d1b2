"""Targets and their verdicts: a ratio of medians (or of peak memory) that a form should stay
under, read from the rows a run produced and marked PASS, FAIL or SKIP (SKIP: no such row)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from .patterns import FORWARD_MEMORY_LIMIT, why_no_memory
from .settings import DECODING_SIZES, PATTERN_MEMORY_LENGTHS, PATTERN_SIZES, SIZES

if TYPE_CHECKING:
    from .compiled import CompileRow
    from .decoding import DecodingSection
    from .memory import MemoryRow
    from .patterns import PatternSection
    from .settings import Settings
    from .timing import Row, Timing


class Report(Protocol):
    """What the targets read of a run (:class:`einattn.bench.report.Report` has it)."""

    settings: Settings
    rows: list[Row]
    compiled: list[CompileRow]
    memory: list[MemoryRow]
    skipped: dict[str, str]
    patterns: PatternSection
    decoding: DecodingSection

VERDICTS = ("PASS", "FAIL", "SKIP")
_TRAINING = "forward+backward"
_LONG = f"L ≥ 1024 {_TRAINING}"


@dataclass(frozen=True)
class Target:
    """One target at one place: the measured ratio against its limit."""

    target: str
    where: str
    value: float | None
    limit: float
    spread: float | None = None  # the larger relative IQR of the two medians compared
    note: str = ""

    @property
    def verdict(self) -> str:
        """PASS when ``value ≤ limit``, FAIL when over it, SKIP when nothing was measured."""
        if self.value is None:
            return "SKIP"
        return "PASS" if self.value <= self.limit else "FAIL"

    def as_json(self) -> dict:
        return {"target": self.target, "where": self.where, "value": self.value,
                "limit": self.limit, "spread": self.spread, "verdict": self.verdict,
                "note": self.note}


def _spread(*timings: Timing | None) -> float | None:
    return None if None in timings else max(t.spread for t in timings)


def _against(report: Report, label: str, path: str, base: str, limit: float, rows: list[Row],
             empty: str, skipped: dict[str, str] | None = None) -> list[Target]:
    """``path``'s median over ``base``'s at each of ``rows``, against ``limit``; one SKIP at
    ``empty`` when there is no such row. A form not timed is noted with why, from
    ``skipped`` (default: the layer's)."""
    skipped = report.skipped if skipped is None else skipped
    found = []
    for r in rows:
        absent = [name for name in (path, base) if name not in r.timings]
        note = skipped.get(absent[0], "") if absent else ""
        found.append(Target(label, f"{r.size.label} {r.mode}", r.ratio(path, base), limit,
                            _spread(r.timings.get(path), r.timings.get(base)), note))
    return found or [Target(label, empty, None, limit, note="no such size was run")]


def _compiled(report: Report) -> list[Target]:
    """Compiled einsum's median over compiled textbook's at each compile row."""
    label = "compiled einsum ≤ 1.05× compiled textbook"
    found = [Target(label, f"{c.size.label} {c.mode}", c.ratio("einsum"), 1.05,
                    _spread(c.compiled["einsum"], c.compiled["textbook"]))
             for c in report.compiled]
    return found or [Target(label, "mid sizes", None, 1.05,
                            note=report.settings.why_no_compile)]


def _memory(report: Report) -> Target:
    """Chunked's peak growth over Linear+SDPA's at L=8192."""
    label, where = "chunked peak memory ≤ 2× Linear+SDPA's", f"L=8192 {_TRAINING}"
    row = next((m for m in report.memory if m.L == 8192), None)
    if row is None:
        note = report.settings.why_no_memory or "L=8192 was not run"
        return Target(label, where, None, 2.0, note=note)
    note = report.skipped.get("chunked", row.errors.get("chunked", ""))
    return Target(label, where, row.ratio("chunked", "linear_sdpa"), 2.0, note=note)


def _window_memory(report: Report) -> Target:
    """Chunked's peak growth with the window over without it, at the longest length."""
    L = max(PATTERN_MEMORY_LENGTHS)
    label, where = "window: chunked peak memory ≤ 1.0× without", f"L={L} {_TRAINING}"
    row = next((m for m in report.patterns.memory if m.L == L), None)
    if row is None:
        note = why_no_memory(report.settings) or f"L={L} was not run"
        return Target(label, where, None, 1.0, note=note)
    skipped = report.patterns.skipped
    note = (skipped.get("chunked") or row.errors.get("chunked")
            or row.errors.get("chunked_causal", ""))
    return Target(label, where, row.ratio("chunked", "chunked_causal"), 1.0, note=note)


def _patterns(report: Report) -> list[Target]:
    """The window's targets at issue 19's size: chunked against the dense SDPA and the
    hand-written compiled FlexAttention, impl="flex" against the latter, and memory."""
    size = PATTERN_SIZES[0]
    rows = [r for r in report.patterns.rows if r.size == size]
    forward = [r for r in rows if r.mode == "forward"]
    skipped = report.patterns.skipped
    return [
        *_against(report, "window: chunked ≤ 0.3× SDPA (dense mask)", "chunked", "sdpa_dense",
                  0.3, rows, f"{size.label} both modes", skipped),
        *_against(report, "window: chunked ≤ 1.0× compiled flex", "chunked", "flex_compiled",
                  1.0, forward, f"{size.label} forward", skipped),
        *_against(report, 'window: impl="flex" ≤ 1.1× compiled flex', "flex", "flex_compiled",
                  1.1, forward, f"{size.label} forward", skipped),
        _window_memory(report),
        *_own(report, rows, size),
        *_ahead(report, rows, size),
    ]


_AHEAD_FORMS = ("chunked_documents", "flex_documents", "chunked_causal", "sdpa_causal")


def _ahead(report: Report, rows: list[Row], size) -> list[Target]:
    """Issue 38's targets: the window under a fifth of the dense SDPA, packed documents ahead
    of their compiled FlexAttention, training at most 2.5× the forward, dense causal within
    1.25× SDPA's flash kernel."""
    if not any(name in r.timings for r in rows for name in _AHEAD_FORMS):
        return []
    forward = [r for r in rows if r.mode == "forward"]
    training = [r for r in rows if r.mode == _TRAINING]
    at, skipped = f"{size.label} forward", report.patterns.skipped
    return [
        *_against(report, "window: chunked ≤ 0.2× SDPA (dense mask)", "chunked", "sdpa_dense",
                  0.2, forward, at, skipped),
        *_against(report, "documents: chunked ≤ 1.0× compiled flex", "chunked_documents",
                  "flex_documents", 1.0, forward, at, skipped),
        *(_training_cost(f"{what}: chunked {_TRAINING} ≤ 2.5× forward", name, forward,
                         training, skipped)
          for name, what in (("chunked", "window"), ("chunked_documents", "documents"))),
        *_against(report, "causal: chunked ≤ 1.25× SDPA is_causal", "chunked_causal",
                  "sdpa_causal", 1.25, training + report.patterns.causal,
                  f"{size.label} {_TRAINING}", skipped),
    ]


def _training_cost(label: str, name: str, forward: list[Row], training: list[Row],
                   skipped: dict[str, str]) -> Target:
    """``name``'s forward+backward median over its forward median at one size."""
    pairs = [(t.timings[name], f.timings[name]) for f in forward for t in training
             if t.size == f.size and name in f.timings and name in t.timings]
    if not pairs:
        return Target(label, "forward and forward+backward", None, 2.5,
                      note=skipped.get(name, "not run in both modes"))
    both, alone = pairs[0]
    return Target(label, forward[0].size.label, both.median / alone.median, 2.5,
                  _spread(both, alone))


def _own(report: Report, rows: list[Row], size) -> list[Target]:
    """Issue 35's targets, where its forms ran: the window written as a MaskMod and as a
    Mask string against the dense SDPA and the built-in window, packed documents against the
    dense SDPA, and the Mask string's forward memory at the longest length."""
    own = ("chunked_maskmod", "chunked_mask", "chunked_documents")
    if not any(name in r.timings for r in rows for name in own) \
            and not report.patterns.forward_memory:
        return []
    both, skipped = f"{size.label} both modes", report.patterns.skipped
    found = []
    for name, how in (("chunked_maskmod", "a MaskMod"), ("chunked_mask", "a Mask string")):
        found += _against(report, f"window as {how}: chunked ≤ 0.35× SDPA (dense mask)", name,
                          "sdpa_dense", 0.35, rows, both, skipped)
        found += _against(report, f"window as {how}: ≤ 1.2× the built-in window", name,
                          "chunked", 1.2, rows, both, skipped)
    found += _against(report, "documents: chunked ≤ 0.3× SDPA (dense mask)",
                      "chunked_documents", "sdpa_documents", 0.3, rows, both, skipped)
    return [*found, _mask_memory(report)]


def _mask_memory(report: Report) -> Target:
    """The Mask string's forward peak growth at the longest length, against 32 MiB."""
    L = max(PATTERN_MEMORY_LENGTHS)
    label = f"Mask string: chunked forward peak growth ≤ {FORWARD_MEMORY_LIMIT >> 20} MiB"
    where = f"L={L} forward (× {FORWARD_MEMORY_LIMIT >> 20} MiB)"
    row = next((m for m in report.patterns.forward_memory if m.L == L), None)
    if row is None or "chunked_mask" not in row.growth:
        note = why_no_memory(report.settings) or (row.errors.get("chunked_mask", "")
                                                  if row else f"L={L} was not run")
        return Target(label, where, None, 1.0, note=note)
    return Target(label, where, row.growth["chunked_mask"] / FORWARD_MEMORY_LIMIT, 1.0)


def _layer(report: Report) -> list[Target]:
    """The layer's targets, read from the non-causal rows run (causal rows are
    informational)."""
    plain = [r for r in report.rows if not r.size.causal]
    training = [r for r in plain if r.mode == _TRAINING]
    long = [r for r in training if r.size.L >= 1024]
    mid, tiny = SIZES[0], SIZES[3]
    tiny_rows, at_tiny = [r for r in training if r.size == tiny], f"{tiny.label} {_TRAINING}"
    return [
        *_against(report, "einsum ≤ 1.0× textbook", "einsum", "textbook", 1.0,
                  [r for r in training if r.size == mid], f"{mid.label} {_TRAINING}"),
        *_against(report, "einsum ≤ 0.85× textbook", "einsum", "textbook", 0.85, long, _LONG),
        *_against(report, "einsum ≤ 1.2× textbook", "einsum", "textbook", 1.2, tiny_rows,
                  at_tiny),
        *_against(report, "sdpa ≤ 1.2× textbook", "sdpa", "textbook", 1.2, tiny_rows, at_tiny),
        *_compiled(report),
        *_against(report, "sdpa ≤ 1.0× Linear+SDPA", "sdpa", "linear_sdpa", 1.0, plain,
                  "every size"),
        *_against(report, "sdpa ≤ 1.0× nn.MultiheadAttention", "sdpa", "torch_mha", 1.0, plain,
                  "every size"),
        _memory(report),
        *_against(report, "chunked ≤ 1.3× textbook", "chunked", "textbook", 1.3, long, _LONG),
    ]


def _decoding(report: Report) -> list[Target]:
    """Issue 24's targets at the longest context: a step of einattn against the hand-written
    loops, with a ``torch.cat`` cache and with a preallocated one, and chunked against
    einattn's sdpa; and issue 38's, sdpa against the preallocated loop at every context."""
    size = DECODING_SIZES[-1]
    rows = [r for r in report.decoding.rows if r.size == size]
    where = f"{size.label} per token"
    every = [r for c in DECODING_SIZES for r in report.decoding.rows if r.size == c]
    return [
        *_against(report, "decoding: sdpa ≤ 0.6× the torch.cat loop", "sdpa", "hand_cat",
                  0.6, rows, where, {}),
        *_against(report, "decoding: sdpa ≤ 1.1× the preallocated loop", "sdpa",
                  "hand_prealloc", 1.1, every, "every context per token", {}),
        *_against(report, "decoding: einsum ≤ 0.7× the torch.cat loop", "einsum", "hand_cat",
                  0.7, rows, where, {}),
        *_against(report, "decoding: chunked ≤ 1.3× einattn sdpa", "chunked", "sdpa", 1.3,
                  rows, where, {}),
    ]


_SECTIONS = {"layer": _layer, "patterns": _patterns, "decoding": _decoding}


def targets(report: Report) -> list[Target]:
    """The targets of the sections run: the layer's read from its non-causal rows (causal
    rows are informational), the patterns' from issue 19's size, decoding's at the contexts
    of :data:`DECODING_SIZES`."""
    return [t for name, section in _SECTIONS.items() if name in report.settings.sections
            for t in section(report)]
