"""``einattn`` with no subcommand, the main job: ``einattn trace --causal``, then
``einattn verify``, at the sizes given (default: the derivation's worked example)."""

from __future__ import annotations

import argparse

from .options import VERIFY_TENSORS, checked_sizes
from .output import Output, Paint
from .trace import trace_output
from .verify import verify_output

DESCRIPTION = ("Multi-head attention as index-notation math. With no subcommand: the main "
               "job, `trace --causal` then `verify`, at the sizes given here.")


def main_job(args: argparse.Namespace, paint: Paint) -> Output:
    """The causal trace, then every derivation step, at one set of sizes checked once."""
    sizes = checked_sizes(args, "the main job", VERIFY_TENSORS)
    head = Output({}, ["einattn: multi-head attention, one index equation per stage"])
    return (head + trace_output(sizes, cross=args.seq_k is not None, causal=True, paint=paint)
            + verify_output(sizes, exact_only=False, paint=paint))
