"""Compile: ``torch.compile`` (static shapes) of textbook, einsum and sdpa, timed in the same
interleaved rounds as their eager forms."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .forms import MODES, build, inputs, step
from .timing import Timing, seconds, time_interleaved

if TYPE_CHECKING:
    from .settings import Settings, Size

COMPILED = ("textbook", "einsum", "sdpa")


@dataclass
class CompileRow:
    """Eager and compiled forms of one size and mode, timed in the same rounds."""

    size: Size
    mode: str
    eager: dict[str, Timing]
    compiled: dict[str, Timing]
    compile_s: dict[str, float]

    def ratio(self, path: str) -> float:
        """Compiled ``path`` against compiled textbook."""
        return self.compiled[path].median / self.compiled["textbook"].median

    def speedup(self, path: str) -> float:
        """Eager ``path`` against compiled ``path``."""
        return self.eager[path].median / self.compiled[path].median

    def as_json(self) -> dict:
        return {"size": self.size.as_json(), "mode": self.mode,
                "paths": {name: {"eager": self.eager[name].as_json(),
                                 "compiled": self.compiled[name].as_json(),
                                 "compile_s": self.compile_s[name],
                                 "speedup": self.speedup(name),
                                 "vs_compiled_textbook": self.ratio(name)}
                          for name in self.compiled}}


def compile_size(size: Size, settings: Settings) -> list[CompileRow]:
    """``torch.compile(dynamic=False)`` of textbook, einsum and sdpa at one size, from a fresh
    Dynamo cache; the first compiled call's time is ``compile_s``."""
    torch._dynamo.reset()  # a fresh cache per size: no recompile limit, no dynamic shapes
    forms = build(size, paths=COMPILED)
    x, dy = inputs(size)
    rows = []
    for mode in MODES:
        steps, compile_s = {}, {}
        for name, form in forms.items():
            params = list(form.parameters())
            steps[name] = step(form, mode, x, dy, params)
            compiled = step(torch.compile(form, dynamic=False), mode, x, dy, params)
            compile_s[name] = seconds(compiled, 1)  # the first call compiles
            steps[f"{name} compiled"] = compiled
        timings = time_interleaved(steps, settings)
        rows.append(CompileRow(size, mode, {k: timings[k] for k in forms},
                               {k: timings[f"{k} compiled"] for k in forms}, compile_s))
    return rows
