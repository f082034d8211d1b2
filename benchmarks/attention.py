"""The attention benchmark: ``einattn bench`` as a script (the logic is einattn.bench).

einattn's einsum, sdpa and chunked paths against the lean textbook reshape form,
``nn.MultiheadAttention`` and a hand-fused Linear + ``F.scaled_dot_product_attention``, on
the same weights: interleaved medians and spread, forward and forward+backward, ratios,
eager against ``torch.compile``, and peak memory in a subprocess per form; then a causal
sliding window by einattn's chunked, einsum and flex paths against SDPA with a dense mask and
a hand-written compiled FlexAttention. It prints the issues' targets as PASS, FAIL or SKIP
and asserts nothing. See docs/performance.md.

    python benchmarks/attention.py [--quick] [--json] [--no-compile] [--no-memory]
                                   [--sizes N,L,D,H ...] [--section layer|patterns ...]
                                   [--pattern-sizes N,H,L,A,W ...] [--repeats R]
                                   [--threads T] [--clock wall|cpu]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout as is

from einattn.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", *sys.argv[1:]]))
