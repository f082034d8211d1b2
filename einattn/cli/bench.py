"""``einattn bench``: the options of :mod:`einattn.bench`, which is imported only when the
subcommand runs (or checks a ``--sizes`` value): the rest of the command line never needs it."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import torch

from .. import derivation
from .options import MEMORY_LIMIT, TRACE_TENSORS, Command, UsageError, check_memory, gib, positive
from .output import Output, Paint, table

MAX_ROUNDS = 1000  # --repeats: a round of the full run takes seconds, 1,000 an hour or more
SECTIONS = ("layer", "patterns", "decoding")  # einattn.bench.SECTIONS, not imported here
PATTERN_TENSORS = ("Q[n μ τ a]", "S[n μ τ σ]")  # the dense mask and einsum's scores: L² a head


def _at_most(maximum: int, what: str) -> Callable[[str], int]:
    """A positive integer no larger than ``maximum``, which is ``what``."""
    def parse(text: str) -> int:
        value = positive(text)
        if value > maximum:
            raise argparse.ArgumentTypeError(f"{value:,} is over {maximum:,}, {what}")
        return value
    return parse


def _size(text: str):
    """A ``--sizes`` value, refused where one layer's largest float32 tensor would not fit."""
    from .. import bench

    try:
        found = bench.parse_size(text)
        check_memory(f"bench at {found.label}", derivation.default_sizes(
            found.n, found.L, found.d_model, found.heads), TRACE_TENSORS, torch.float32)
    except (ValueError, UsageError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return found


def _pattern_size(text: str):
    """A ``--pattern-sizes`` value, refused where its scores ``S[n μ τ σ]`` (the einsum
    form's, as large as the dense SDPA's) would not fit in float32."""
    from .. import bench

    try:
        found = bench.parse_pattern_size(text)
        check_memory(f"bench at {found.label}", {"n": found.n, "μ": found.heads, "τ": found.L,
                                                 "σ": found.L, "a": found.d_head},
                     PATTERN_TENSORS, torch.float32)
    except (ValueError, UsageError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return found


def bench_options(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--quick", action="store_true", help="tiny sizes, 3 rounds, one small memory run, no "
        "compile: under a minute")
    add("--no-compile", action="store_true", help="skip the torch.compile comparison")
    add("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    add("--sizes", nargs="+", type=_size, metavar="N,L,D,H", help="the sizes to time, each "
        "n,L,d_model,heads (append ,causal for a causal row); compile then runs at every one "
        "(default: 8,128,512,8 2,1024,512,8 1,4096,256,4 2,5,16,4 and 2,1024,512,8,causal; "
        "compile at the first two); sizes whose largest tensor would need more than "
        f"{gib(MEMORY_LIMIT)} are refused")
    add("--section", nargs="+", choices=SECTIONS, metavar="S", help="the sections to run: "
        "layer (one attention layer six ways), patterns (a causal sliding window, built in, as "
        "a MaskMod and as a Mask string, and packed documents: chunked against SDPA with a "
        "dense mask and compiled FlexAttention; dense causal at the memory length, chunked "
        "against SDPA's flash kernel) and decoding (a prefill, "
        "then the time per token at contexts 512 and 4096 against hand-written Linear+SDPA "
        "with a torch.cat and a preallocated cache) (default: all three)")
    add("--pattern-sizes", nargs="+", type=_pattern_size, metavar="N,H,L,A,W", help="the "
        "patterns section's sizes, each n,heads,L,d_head,window (default 1,4,4096,64,256; "
        "1,2,64,8,16 with --quick); its memory runs at the first one's n, heads, d_head and "
        f"window; sizes whose scores S[n μ τ σ] would need more than {gib(MEMORY_LIMIT)} are "
        "refused")
    add("--repeats", type=_at_most(MAX_ROUNDS, "the most rounds bench runs"), metavar="R",
        help=f"interleaved timing rounds, 1 to {MAX_ROUNDS:,} (default 11, or 3 with --quick)")
    cores = os.cpu_count() or 1
    add("--threads", type=_at_most(cores, "the CPU cores this machine has"), metavar="T",
        help=f"torch intra-op threads, 1 to {cores} (default: torch's, one per core)")
    add("--clock", choices=("wall", "cpu"), default="wall", help="time samples by the wall "
        "clock (default) or by the process's CPU time, which leaves out the time a shared "
        "machine spends on other work (use it with --threads 1)")
    add("--check", action="store_true", help="exit with status 1 when a target fails "
        "(default: report the targets and exit 0)")


def bench_command(args: argparse.Namespace, paint: Paint) -> Output:
    from .. import bench  # imported on use: only this subcommand needs it

    settings = bench.Settings.build(quick=args.quick, compile=not args.no_compile,
                                    memory=not args.no_memory, sizes=args.sizes,
                                    rounds=args.repeats, threads=args.threads,
                                    clock=args.clock, sections=args.section,
                                    pattern_sizes=args.pattern_sizes)
    report = bench.run(settings, lambda text: print(f"einattn bench: {text}", file=sys.stderr,
                                                    flush=True))  # progress, off stdout
    failed = any(t.verdict == "FAIL" for t in bench.targets(report))
    return Output(report.as_json(), bench.lines(report, table, paint),
                  1 if args.check and failed else 0)


COMMAND = Command(bench_command, "time einattn's einsum, sdpa and chunked paths against the "
                  "textbook form, nn.MultiheadAttention and Linear+SDPA, a sliding window "
                  "against SDPA and FlexAttention, and decoding token by token; compile and "
                  "peak memory too; each row's fraction of the machine's peak GFLOP/s or "
                  "bandwidth; targets with PASS, FAIL or SKIP (--check: exit 1 if one fails)",
                  (bench_options,))
