"""The machine's roof: the float32 matmul rate (GFLOP/s) and the memory bandwidth (GB/s) that
the attention rows of a run are reported against, on one thread and on all.

    GFLOP/s    ``C = A B`` of square float32 matrices (2048 a side; 1024 with ``--quick``) by
               ``torch.mm(..., out=C)``: ``2·N³`` floating-point operations a call
    bandwidth  ``x.sum()`` over a float32 vector of 256 MiB (64 MiB with ``--quick``), larger
               than the caches: ``x.nbytes`` read a call, as a decoding step reads its cache

Each figure is the best of :data:`ROUNDS` timed calls after one untimed call, at each thread
count asked for (torch's intra-op threads, set for the measurement and put back after): the
rate this process can reach, not a vendor's peak.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

ROUNDS = 5
SIDES = {False: 2048, True: 1024}  # the matmul's N, by quick
READ_BYTES = {False: 256 * 2**20, True: 64 * 2**20}  # the vector summed, by quick
ROOF_METHOD = ("matmul: torch.mm of two float32 N × N matrices (N = {side}), 2·N³ FLOP a call; "
               "bandwidth: x.sum() of a float32 vector of {mib} MiB, its bytes read a call; "
               f"each the best of {ROUNDS} calls after a warm-up, at each thread count")


@dataclass(frozen=True)
class Roof:
    """The best rates measured, by thread count: ``gflops[t]`` in GFLOP/s, ``bandwidth[t]``
    in GB/s (10⁹ bytes a second); ``threads``: "all threads", torch's count when the run
    began; ``method``: how they were measured."""

    threads: int
    gflops: dict[int, float]
    bandwidth: dict[int, float]
    method: str

    def as_json(self) -> dict:
        return {"method": self.method, "all_threads": self.threads,
                "peak_matmul_GFLOP/s": {str(t): x for t, x in self.gflops.items()},
                "peak_bandwidth_GB/s": {str(t): x for t, x in self.bandwidth.items()}}


def _best(fn, rounds: int = ROUNDS) -> float:
    """The shortest of ``rounds`` timed calls of ``fn``, after one untimed call."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def matmul_gflops(side: int) -> float:
    """GFLOP/s of ``torch.mm`` of two float32 ``side × side`` matrices at torch's current
    thread count: ``2·side³`` over the best call's seconds."""
    a, b = torch.randn(side, side), torch.randn(side, side)
    c = torch.empty(side, side)
    return 2 * side**3 / _best(lambda: torch.mm(a, b, out=c)) / 1e9


def read_bandwidth(nbytes: int) -> float:
    """GB/s of ``x.sum()`` over ``nbytes`` of float32 at torch's current thread count."""
    x = torch.ones(nbytes // 4)
    return x.nbytes / _best(x.sum) / 1e9


def measure_roof(thread_counts: tuple[int, ...], *, quick: bool = False,
                 all_threads: int | None = None) -> Roof:
    """The roof at each of ``thread_counts`` (torch's thread count put back after)."""
    side, nbytes = SIDES[quick], READ_BYTES[quick]
    was = torch.get_num_threads()
    gflops, bandwidth = {}, {}
    try:
        for t in sorted(set(thread_counts)):
            torch.set_num_threads(t)
            gflops[t], bandwidth[t] = matmul_gflops(side), read_bandwidth(nbytes)
    finally:
        torch.set_num_threads(was)
    return Roof(all_threads or was, gflops, bandwidth,
                ROOF_METHOD.format(side=side, mib=nbytes >> 20))
