"""Timing: the forms of one size and mode take turns in interleaved rounds, the order rotated
each round, after warm-up calls; each form's samples give its median and spread."""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from .forms import MODES, PATHS, build, inputs, step

if TYPE_CHECKING:
    from .settings import Settings, Size

# The clocks a sample may read, by the names of einattn.bench.settings.CLOCK_NAMES. Compile
# times (the first compiled call) are wall-clock either way.
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
RESOLUTION = {name: time.get_clock_info(clock.__name__).resolution
              for name, clock in CLOCKS.items()}


def _quantile(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs``, interpolated linearly between the two nearest ranks."""
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class Timing:
    """Seconds per call, one sample per round."""

    samples: tuple[float, ...]
    calls_per_sample: int

    @property
    def median(self) -> float:
        return _quantile(list(self.samples), 0.5)

    @property
    def iqr(self) -> tuple[float, float]:
        return _quantile(list(self.samples), 0.25), _quantile(list(self.samples), 0.75)

    @property
    def spread(self) -> float:
        """The IQR relative to the median: ``(q3 − q1) / median``."""
        q1, q3 = self.iqr
        return (q3 - q1) / self.median

    def as_json(self) -> dict:
        q1, q3 = self.iqr
        return {"median_s": self.median, "q1_s": q1, "q3_s": q3, "min_s": min(self.samples),
                "max_s": max(self.samples), "rounds": len(self.samples),
                "calls_per_sample": self.calls_per_sample}


def seconds(fn: Callable[[], None], number: int, clock: str = "wall") -> float:
    """Seconds that ``number`` calls of ``fn`` take by ``CLOCKS[clock]``."""
    now = CLOCKS[clock]
    start = now()
    for _ in range(number):
        fn()
    return now() - start


def _calls_per_sample(fn: Callable[[], None], settings: Settings) -> int:
    """Warm ``fn`` up, then the calls that make a sample last ``settings.sample_s``, from
    the fastest of three timed calls."""
    for _ in range(settings.warmup):
        fn()
    # the fastest of three: one call stalled by a neighbour cannot shrink every sample
    once = min(seconds(fn, 1, settings.clock) for _ in range(3 if settings.sample_s else 1))
    once = max(once, RESOLUTION[settings.clock], 1e-9)  # a coarse clock may read 0
    return max(1, math.ceil(settings.sample_s / once))


def time_interleaved(steps: dict[str, Callable[[], None]], settings: Settings) \
        -> dict[str, Timing]:
    """Warm each step up, size its samples, then time them in rotating interleaved rounds
    (with the garbage collector off)."""
    number = {name: _calls_per_sample(fn, settings) for name, fn in steps.items()}
    samples: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(settings.rounds):
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                samples[name].append(seconds(steps[name], number[name], settings.clock)
                                     / number[name])
    finally:
        if was_enabled:
            gc.enable()
    return {name: Timing(tuple(samples[name]), number[name]) for name in steps}


@dataclass
class Row:
    """One size and mode: every form's timing, and how far its output is from textbook's."""

    size: Size
    mode: str
    timings: dict[str, Timing]
    deviation: dict[str, float] = field(default_factory=dict)
    # each form's work, rate and fraction of the machine's peak (einattn.bench.work.rates),
    # set once the run has measured its roof
    peak: dict[str, dict] = field(default_factory=dict, init=False)
    BASES: ClassVar[dict[str, str]] = {"vs_textbook": "textbook",
                                       "vs_linear_sdpa": "linear_sdpa"}  # JSON key: form

    def ratio(self, path: str, base: str) -> float | None:
        """Median against median: ``path``'s over ``base``'s (None if one was not timed)."""
        if path not in self.timings or base not in self.timings:
            return None
        return self.timings[path].median / self.timings[base].median

    def as_json(self) -> dict:
        return {"size": self.size.as_json(), "mode": self.mode,
                "paths": {name: {**t.as_json(),
                                 **{key: self.ratio(name, base)
                                    for key, base in self.BASES.items()},
                                 "max_deviation": self.deviation.get(name),
                                 **self.peak.get(name, {})}
                          for name, t in self.timings.items()}}


def relative_deviation(y: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |y − ref|`` relative to ``max(1, max |ref|)``."""
    return ((y - ref).abs().max() / ref.abs().max().clamp(min=1.0)).item()


def time_size(size: Size, settings: Settings, skip: dict[str, str]) -> list[Row]:
    """Both modes at one size: each form checked against textbook once, then timed."""
    names = tuple(p for p in PATHS if p not in skip)
    forms = build(size, paths=names)
    x, dy = inputs(size)
    with torch.no_grad():
        outputs = {name: form(x) for name, form in forms.items()}
    deviation = {name: relative_deviation(y, outputs["textbook"]) for name, y in outputs.items()}
    del outputs
    rows = []
    for mode in MODES:
        steps = {name: step(form, mode, x, dy, list(form.parameters()))
                 for name, form in forms.items()}
        rows.append(Row(size, mode, time_interleaved(steps, settings), deviation))
    return rows
