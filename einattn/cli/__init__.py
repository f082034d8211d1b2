"""The command line: ``einattn`` and ``python -m einattn``.

    einattn [sizes]          the main job: ``einattn trace --causal``, then ``einattn verify``
    einattn trace [sizes]    each stage's equation, einsum, shapes, FLOPs, largest intermediate
    einattn verify [sizes]   every derivation step checked, and the scores' contraction order
    einattn latex            equations (1)–(5), (5a), (1g), (2g), (4g) as LaTeX
    einattn bench            the benchmark: timings, fraction of peak, compile, memory, targets

Every subcommand takes ``--json``. Sizes whose largest tensor would need more than
:data:`MEMORY_LIMIT` bytes are refused before anything is allocated. A subcommand is a
:class:`Command`: a function ``run(args, paint)`` that returns an :class:`Output` (a JSON
document, the lines people read, an exit status), its help and its option groups;
:func:`main` parses, dispatches and prints.

One module per job: :mod:`~einattn.cli.main_job`, :mod:`~einattn.cli.trace`,
:mod:`~einattn.cli.verify`, :mod:`~einattn.cli.latex` and :mod:`~einattn.cli.bench` (one
subcommand each), :mod:`~einattn.cli.options` (the options, the sizes they set, the memory
check), :mod:`~einattn.cli.output` (tables and colour) and :mod:`~einattn.cli.commands` (the
registry, :data:`COMMANDS`, and :func:`main`).
"""

from .commands import COMMANDS, command, main, parser
from .latex import SOFTMAX_LATEX
from .options import (
    MEMORY_LIMIT,
    TRACE_TENSORS,
    VERIFY_TENSORS,
    Command,
    UsageError,
    check_memory,
    largest_tensor,
    size_options,
)
from .output import Output, Paint, table
from .trace import EQUATIONS
from .verify import check_step

__all__ = [
    "COMMANDS", "EQUATIONS", "MEMORY_LIMIT", "SOFTMAX_LATEX", "TRACE_TENSORS", "VERIFY_TENSORS",
    "Command", "Output", "Paint", "UsageError", "check_memory", "check_step", "command",
    "largest_tensor", "main", "parser", "size_options", "table",
]
