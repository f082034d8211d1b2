"""The machine's roof: the float32 matmul rate (GFLOP/s) and the memory bandwidth (GB/s) that
the attention rows of a run are reported against, on one thread and on all.

    GFLOP/s    ``C = A B`` of square float32 matrices, 512 a side, by ``torch.mm(..., out=C)``:
               ``2·N³`` floating-point operations a call
    bandwidth  ``x.sum()`` over 8 MiB slices of a float32 vector of 256 MiB (64 MiB with
               ``--quick``), larger than the caches, read in turn: a slice's bytes a call,
               read as a decoding step reads its cache

Each figure is the best of :data:`ROUNDS` short calls after one untimed call, timed by the
run's clock (``--clock``, as the rows are), at each thread count asked for (torch's
intra-op threads, set for the measurement and put back after): the rate this process
reaches, not a vendor's peak. Calls of a millisecond or two fit in one time slice of a
shared machine, so their best is the machine's, not its neighbours'.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .timing import CLOCKS

ROUNDS = 64
SIDE = 512  # the matmul's N: at its peak already on one thread, a call of about 1.5 ms
SLICE = 8 * 2**20  # bytes summed a call
READ_BYTES = {False: 256 * 2**20, True: 64 * 2**20}  # the vector read, by quick
ROOF_METHOD = (f"matmul: torch.mm of two float32 N × N matrices (N = {SIDE}), 2·N³ FLOP a "
               f"call; bandwidth: x.sum() over {SLICE >> 20} MiB slices of a float32 vector "
               "of {mib} MiB read in turn, a slice's bytes a call; each the best of "
               f"{ROUNDS} calls after a warm-up, by the {{clock}} clock, at each thread count")


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


def _best(calls, clock: str) -> float:
    """The shortest of the timed ``calls`` (functions of no arguments) by ``CLOCKS[clock]``,
    after one untimed call of the first."""
    now = CLOCKS[clock]
    calls[0]()
    best = float("inf")
    for call in calls:
        start = now()
        call()
        best = min(best, now() - start)
    return best


def matmul_gflops(clock: str = "wall") -> float:
    """GFLOP/s of ``torch.mm`` of two float32 ``SIDE × SIDE`` matrices at torch's current
    thread count: ``2·SIDE³`` over the best call's seconds."""
    a, b = torch.randn(SIDE, SIDE), torch.randn(SIDE, SIDE)
    c = torch.empty(SIDE, SIDE)
    return 2 * SIDE**3 / _best([lambda: torch.mm(a, b, out=c)] * ROUNDS, clock) / 1e9


def read_bandwidth(nbytes: int, clock: str = "wall") -> float:
    """GB/s of ``x.sum()`` over :data:`SLICE` bytes, the slices of ``nbytes`` of float32 read
    in turn (each gone from the caches when read again), at torch's current thread count."""
    slices = torch.ones(nbytes // 4).split(SLICE // 4)
    calls = [slices[r % len(slices)].sum for r in range(ROUNDS)]
    return SLICE / _best(calls, clock) / 1e9


def measure_roof(thread_counts: tuple[int, ...], *, quick: bool = False, clock: str = "wall",
                 all_threads: int | None = None) -> Roof:
    """The roof at each of ``thread_counts`` by ``clock`` (torch's thread count put back
    after)."""
    nbytes = READ_BYTES[quick]
    was = torch.get_num_threads()
    gflops, bandwidth = {}, {}
    try:
        for t in sorted(set(thread_counts)):
            torch.set_num_threads(t)
            gflops[t], bandwidth[t] = matmul_gflops(clock), read_bandwidth(nbytes, clock)
    finally:
        torch.set_num_threads(was)
    return Roof(all_threads or was, gflops, bandwidth,
                ROOF_METHOD.format(mib=nbytes >> 20, clock=clock))
