"""``impl="auto"`` against every impl it may pick, over issue 38's grid: six patterns (dense,
causal, a causal sliding window of 256, packed documents, a causal softcap, causal sinks),
L ∈ {5, 512, 4096} (n = 1, μ = 4 heads, a = 64, τ = σ), forward alone (no_grad) and
forward+backward. Each cell times einsum, sdpa, chunked, flex (forward only on the CPU) and
auto in interleaved rounds by process CPU time on one thread, checks that auto's Z is
``torch.equal`` to the Z of the impl it picked, and prints auto's time over the fastest
impl's measured in the same run (issue 38: never above 1.1×). A script, not a test: it
prints a Markdown table (docs/performance.md has one), it asserts nothing.

    python benchmarks/auto.py [--lengths 5,512,4096] [--rounds 15,15,5]
                              [--patterns dense,causal] [--impls einsum,sdpa,chunked,flex]
                              [--sample-s 0.1]

``--rounds``: one number for every length, or one per length of ``--lengths``.

A sample lasts at least ``--sample-s`` seconds of calls: with 0.02 s (one or two calls at L =
512), auto, timed right after chunked in most rounds (einsum after auto, sdpa after einsum),
measured 1.21–1.26× the einsum code it ran in the trained cap's cell at 512 (two runs; sdpa,
the same code there, 0.99–1.05× einsum), as if the first call after another impl paid for it;
with 0.1 s, 1.03–1.04× (two runs).
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from einattn import functional as F
from einattn.bench.settings import Settings
from einattn.bench.timing import time_interleaved
from einattn.errors import EinattnError

SHAPE = (1, 4, 64)  # n, μ, a
LENGTHS = (5, 512, 4096)
IMPLS = ("einsum", "sdpa", "chunked", "flex")
MODES = ("forward", "forward+backward")
WINDOW, DOCUMENTS, CAP = 256, 8, 30.0


def pattern_keywords(name: str, L: int) -> dict:
    """The keywords of :func:`einattn.functional.attention` that make pattern ``name``."""
    if name == "documents":  # DOCUMENTS packed documents of random lengths, not causal
        g = torch.Generator().manual_seed(L)
        cuts = torch.randperm(L - 1, generator=g)[:min(DOCUMENTS, L) - 1].add(1).sort().values
        ids = torch.zeros(L, dtype=torch.long)
        ids[cuts] = 1
        return {"document_ids": ids.cumsum(0)[None]}
    μ = SHAPE[1]
    return {"dense": {}, "causal": {"causal": True},
            "window": {"causal": True, "window": WINDOW},
            "softcap": {"causal": True, "softcap": CAP},
            "sinks": {"causal": True, "sinks": torch.linspace(-1.0, 1.0, μ)}}[name]


PATTERNS = ("dense", "causal", "window", "documents", "softcap", "sinks")


def _inputs(L: int, grad: bool):
    g = torch.Generator().manual_seed(0)
    n, μ, a = SHAPE
    Q, K, V = (torch.randn(n, μ, L, a, generator=g).requires_grad_(grad) for _ in range(3))
    return Q, K, V, torch.randn(n, μ, L, a, generator=g)


def _step(impl: str, QKV, dZ, keywords: dict, grad: bool):
    """One call of ``impl`` (backward of ``dZ`` too where ``grad``), as a function of none."""
    Q, K, V = QKV
    if not grad:
        def forward():
            with torch.no_grad():
                return F.attention(Q, K, V, impl=impl, **keywords)
        return forward

    def forward_backward():
        for t in QKV:
            t.grad = None
        Z = F.attention(Q, K, V, impl=impl, **keywords)
        Z.backward(dZ)
        return Z
    return forward_backward


def _runnable(steps: dict) -> tuple[dict, dict]:
    """The steps that run here (a first call each: compiles flex), and why the others do not."""
    kept, why = {}, {}
    for name, fn in steps.items():
        try:
            fn()
        except EinattnError as error:
            why[name] = str(error).split(":")[0]
        else:
            kept[name] = fn
    return kept, why


def cell(pattern: str, L: int, mode: str, settings: Settings, impls: tuple) -> dict:
    """One cell of the grid: every impl's median seconds, auto's pick and its ratio."""
    grad = mode != "forward"
    Q, K, V, dZ = _inputs(L, grad)
    keywords = pattern_keywords(pattern, L)
    with torch.set_grad_enabled(grad):
        choice = F.explain(Q, K, V, **keywords)
    steps, why = _runnable({name: _step(name, (Q, K, V), dZ, keywords, grad)
                            for name in (*impls, "auto")})
    with torch.set_grad_enabled(grad):
        equal = choice.impl in steps and torch.equal(steps["auto"](), steps[choice.impl]())
    timings = time_interleaved(steps, settings)
    medians = {name: t.median for name, t in timings.items()}
    fastest = min((name for name in medians if name != "auto"), key=medians.get)
    return {"pattern": pattern, "L": L, "mode": mode, "medians": medians, "refused": why,
            "pick": choice.impl, "why": choice.reason, "equal": equal, "fastest": fastest,
            "ratio": medians["auto"] / medians[fastest]}


def _row(c: dict, impls: tuple) -> str:
    times = " | ".join(f"{c['medians'][name] * 1e3:.3g}" if name in c["medians"] else "–"
                       for name in impls)
    return (f"| {c['pattern']} | {c['L']} | {c['mode']} | {times} | {c['pick']} | "
            f"{c['fastest']} | {c['ratio']:.2f}× | {'yes' if c['equal'] else 'NO'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    parser.add_argument("--patterns", default=",".join(PATTERNS))
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--rounds", default="15,15,5")
    parser.add_argument("--sample-s", type=float, default=0.1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    impls = tuple(args.impls.split(","))
    lengths = tuple(map(int, args.lengths.split(",")))
    rounds = tuple(map(int, args.rounds.split(",")))
    if len(rounds) not in (1, len(lengths)):
        parser.error(f"--rounds {args.rounds}: one number, or one per length of {lengths}")
    rounds = rounds * len(lengths) if len(rounds) == 1 else rounds
    settings = replace(Settings(), warmup=1, sample_s=args.sample_s, clock="cpu")
    print(f"| pattern | L | mode | {' | '.join(impls)} (ms) | auto picks | fastest | "
          f"auto / fastest | equal |")
    print("|---|---|---|" + "---|" * len(impls) + "---|---|---|---|")
    for L, n_rounds in zip(lengths, rounds, strict=True):
        for pattern in args.patterns.split(","):
            for mode in MODES:
                row = cell(pattern, L, mode, replace(settings, rounds=n_rounds), impls)
                print(_row(row, impls), flush=True)


if __name__ == "__main__":
    main()
