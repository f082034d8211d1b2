"""The benchmark: einattn's three paths against three PyTorch forms of the same layer.

    einattn bench [--quick] [--json] [--no-compile] [--no-memory] [--sizes N,L,D,H ...]

One module per job: :mod:`~einattn.bench.forms` (the six forms, on the same weights),
:mod:`~einattn.bench.timing` (interleaved rounds, medians and spreads),
:mod:`~einattn.bench.compiled` (``torch.compile``), :mod:`~einattn.bench.memory` (peak
resident-set growth, one subprocess per form), :mod:`~einattn.bench.verdicts` (targets
marked PASS, FAIL or SKIP), :mod:`~einattn.bench.report` (the run, its JSON and its text)
and :mod:`~einattn.bench.settings` (sizes and settings). docs/performance.md says how each
is measured and why.
"""

from .compiled import COMPILED, CompileRow, compile_size
from .forms import (
    EINATTN,
    MODES,
    NAMES,
    PATHS,
    LinearSDPA,
    Textbook,
    TorchMHA,
    build,
    inputs,
    step,
    unavailable,
    with_impl,
)
from .memory import MEMORY_METHOD, MemoryRow, measure_memory, memory_worker
from .report import Report, lines, run
from .settings import (
    CLOCK_NAMES,
    COMPILE_SIZES,
    MEMORY,
    MEMORY_LENGTHS,
    QUICK_MEMORY_LENGTHS,
    QUICK_SIZES,
    SIZES,
    Settings,
    Size,
    parse_size,
)
from .timing import CLOCKS, RESOLUTION, Row, Timing, time_interleaved, time_size
from .verdicts import VERDICTS, Target, targets

__all__ = [
    "CLOCKS", "CLOCK_NAMES", "COMPILED", "COMPILE_SIZES", "EINATTN", "MEMORY", "MEMORY_LENGTHS",
    "MEMORY_METHOD", "MODES", "NAMES", "PATHS", "QUICK_MEMORY_LENGTHS", "QUICK_SIZES",
    "RESOLUTION", "SIZES", "VERDICTS", "CompileRow", "LinearSDPA", "MemoryRow", "Report", "Row",
    "Settings", "Size", "Target", "Textbook", "Timing", "TorchMHA", "build", "compile_size",
    "inputs", "lines", "measure_memory", "memory_worker", "parse_size", "run", "step",
    "targets", "time_interleaved", "time_size", "unavailable", "with_impl",
]
