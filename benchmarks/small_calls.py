"""The layer's fixed cost per call (issue 38, item 4): the tiny trace shape (n=2, L=5,
d_model=16, 4 heads) forward+backward against the textbook reshape form, and one decoding step
at context 512 (``MultiHeadAttention(512, 8, impl="sdpa")`` with a KVCache) against the
preallocated hand loop. One thread, process CPU time, interleaved rounds; prints the ratios of
medians. ``--profile`` prints cProfile's top entries for the tiny call instead.

    python benchmarks/small_calls.py [--rounds 21] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
from dataclasses import replace

import torch

from einattn.bench.decoding import decoding_forms
from einattn.bench.forms import build, inputs, step
from einattn.bench.settings import DECODING_SIZES, SIZES, Settings
from einattn.bench.timing import time_interleaved

TINY, DECODE = SIZES[3], DECODING_SIZES[0]


def _tiny_steps() -> dict:
    """The tiny shape's forward+backward: einattn's einsum and sdpa, and textbook."""
    forms = build(TINY, paths=("einsum", "sdpa", "textbook"))
    x, dy = inputs(TINY)
    return {name: step(form, "forward+backward", x, dy, list(form.parameters()))
            for name, form in forms.items()}


def _decode_steps() -> dict:
    """One decoding step at context 512: einattn sdpa and the preallocated hand loop."""
    x = torch.randn(DECODE.n, DECODE.context + 32, DECODE.d_model)
    return decoding_forms(DECODE, x, names=("sdpa", "hand_prealloc"))


def _ratios(rounds: int) -> None:
    settings = replace(Settings(), rounds=rounds, clock="cpu", sample_s=0.05)
    for label, steps, base in (("tiny (2, 5, 16, 4) forward+backward", _tiny_steps(),
                                "textbook"),
                               ("decode context 512 per token", _decode_steps(),
                                "hand_prealloc")):
        timings = time_interleaved(steps, settings)
        for name, t in timings.items():
            print(f"{label:40s} {name:14s} {t.median * 1e6:8.1f} µs  "
                  f"{t.median / timings[base].median:5.2f}× {base}  (spread {t.spread:.2f})")


def _profile() -> None:
    for label, steps, name in (("tiny einsum", _tiny_steps(), "einsum"),
                               ("decode sdpa", _decode_steps(), "sdpa")):
        fn = steps[name]
        for _ in range(50):
            fn()
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(2000):
            fn()
        profile.disable()
        print(f"== {label}: 2000 calls")
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    _profile() if args.profile else _ratios(args.rounds)


if __name__ == "__main__":
    main()
