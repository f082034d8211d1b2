"""The benchmark: einattn's three paths against three PyTorch forms of the same layer, and a
causal sliding window against SDPA with a dense mask and compiled FlexAttention.

    einattn bench [--quick] [--json] [--no-compile] [--no-memory] [--sizes N,L,D,H ...]
                  [--section layer|patterns|decoding ...] [--pattern-sizes N,H,L,A,W ...]

One module per job: :mod:`~einattn.bench.forms` (the six forms, on the same weights),
:mod:`~einattn.bench.patterns` (the patterns section: its forms, timing and rows),
:mod:`~einattn.bench.decoding` (the decoding section: a prefill, then one token at a time),
:mod:`~einattn.bench.timing` (interleaved rounds, medians and spreads),
:mod:`~einattn.bench.compiled` (``torch.compile``), :mod:`~einattn.bench.memory` (peak
resident-set growth, one subprocess per form), :mod:`~einattn.bench.roof` (the machine's
matmul GFLOP/s and memory bandwidth), :mod:`~einattn.bench.work` (each row's FLOP or bytes
read, and its fraction of that peak), :mod:`~einattn.bench.verdicts` (targets
marked PASS, FAIL or SKIP), :mod:`~einattn.bench.report` (the run, its JSON and its text)
and :mod:`~einattn.bench.settings` (sizes and settings). docs/performance.md says how each
is measured and why.
"""

from .compiled import COMPILED, CompileRow, compile_size
from .decoding import (
    DECODING_FORMS,
    DECODING_NAMES,
    DecodingRow,
    DecodingSection,
    decoding_forms,
    run_decoding,
    time_decoding,
)
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
from .memory import MEMORY_METHOD, PATTERN_MEMORY_METHOD, MemoryRow, measure_memory, memory_worker
from .patterns import (
    DOCUMENT_FORMS,
    FLEX_FORMS,
    PATTERN_FORMS,
    PATTERN_MEMORY_FORMS,
    PATTERN_NAMES,
    PatternRow,
    PatternSection,
    Setup,
    measure_pattern_memory,
    pattern_forms,
    pattern_inputs,
    pattern_memory_worker,
    pattern_skipped,
    pattern_step,
    run_patterns,
    time_long_causal,
    time_patterns,
    window_mask,
)
from .report import Report, lines, run
from .roof import ROOF_METHOD, Roof, measure_roof
from .settings import (
    CLOCK_NAMES,
    COMPILE_SIZES,
    DECODING_SIZES,
    MEMORY,
    MEMORY_LENGTHS,
    PATTERN_MEMORY_LENGTHS,
    PATTERN_SIZES,
    QUICK_DECODING_SIZES,
    QUICK_MEMORY_LENGTHS,
    QUICK_PATTERN_MEMORY_LENGTHS,
    QUICK_PATTERN_SIZES,
    QUICK_SIZES,
    SECTIONS,
    SIZES,
    DecodingSize,
    PatternSize,
    Settings,
    Size,
    parse_pattern_size,
    parse_size,
)
from .timing import CLOCKS, RESOLUTION, Row, Timing, time_interleaved, time_size
from .verdicts import VERDICTS, Target, targets
from .work import (
    FLOP_METHOD,
    PATTERN_OF,
    attention_flops,
    cache_read_bytes,
    layer_flops,
    pattern_flops,
    pattern_pairs,
    rates,
)

__all__ = [
    "CLOCKS", "CLOCK_NAMES", "COMPILED", "COMPILE_SIZES", "DECODING_FORMS", "DECODING_NAMES",
    "DECODING_SIZES", "DOCUMENT_FORMS", "EINATTN", "FLEX_FORMS", "FLOP_METHOD", "MEMORY",
    "MEMORY_LENGTHS", "MEMORY_METHOD", "MODES", "NAMES", "PATHS", "PATTERN_FORMS",
    "PATTERN_MEMORY_FORMS", "PATTERN_MEMORY_LENGTHS", "PATTERN_MEMORY_METHOD", "PATTERN_NAMES",
    "PATTERN_OF", "PATTERN_SIZES", "QUICK_DECODING_SIZES", "QUICK_MEMORY_LENGTHS",
    "QUICK_PATTERN_MEMORY_LENGTHS", "QUICK_PATTERN_SIZES", "QUICK_SIZES", "RESOLUTION",
    "ROOF_METHOD", "SECTIONS", "SIZES", "VERDICTS", "CompileRow", "DecodingRow",
    "DecodingSection", "DecodingSize", "LinearSDPA", "MemoryRow", "PatternRow",
    "PatternSection", "PatternSize", "Report", "Roof", "Row", "Settings", "Setup", "Size",
    "Target", "Textbook", "Timing", "TorchMHA", "attention_flops", "build", "cache_read_bytes",
    "compile_size", "decoding_forms", "inputs", "layer_flops", "lines", "measure_memory",
    "measure_pattern_memory", "measure_roof", "memory_worker", "parse_pattern_size",
    "parse_size", "pattern_flops", "pattern_forms", "pattern_inputs", "pattern_memory_worker",
    "pattern_pairs", "pattern_skipped", "pattern_step", "rates", "run", "run_decoding",
    "run_patterns", "step", "targets", "time_decoding", "time_interleaved", "time_long_causal",
    "time_patterns",
    "time_size", "unavailable", "window_mask", "with_impl",
]
