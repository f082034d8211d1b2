"""Sequence parallelism (ring attention) on R gloo processes on the CPU: per-rank memory.

For each number of ranks R and each sequence length L, R processes each run one causal
forward+backward of a sequence-parallel ``MultiHeadAttention`` (``impl="chunked"``) on their
L/R tokens, and report the growth of their peak resident set during it (the method of
``einattn bench``'s memory column) and the causal tiles their ring computes. R = 1 is the
whole sequence in one process. The processes run with ``MALLOC_MMAP_THRESHOLD_=65536``, so
that glibc returns every freed buffer of 64 KiB or more at once and the resident set follows
the live tensors rather than the allocator's caching. The expectation: a rank's peak grows
as L/R, and the zigzag layout gives every rank the same tiles where the contiguous one
gives rank k about k + 1 times rank 0's. A script, not a test: it prints, it asserts
nothing (tests/test_ring.py checks the results equal one process's). All ranks share this
machine's cores, so times are not reported.

    python benchmarks/ring.py [--ranks 1 2 4] [--lengths 4096 8192] [--layout zigzag]
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout as is

from einattn import MultiHeadAttention, patterns, ring
from einattn import parallel as par
from einattn.bench.memory import peak_growth

n, d_model, heads, kv_heads, block = 1, 1024, 16, 4, 256


def tiles(rank: int, R: int, layout: str, L: int) -> int:
    """The causal tiles of ``block`` rank k's ring computes over a sequence of L."""
    c = L // ring.n_chunks(R, layout)
    causal = patterns.build(n=1, n_heads=1, L_q=L, L_k=L, dtype=torch.float32, device="cpu",
                            causal=True)
    return sum(len(p.tiles(block)) for k in range(R)
               for _, _, p in ring.pairs(ring.chunks(rank, R, layout),
                                         ring.chunks(k, R, layout), c, causal))


def worker(rank: int, R: int, port: int, L: int, layout: str, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=R, init_method=f"tcp://127.0.0.1:{port}",
                            timeout=datetime.timedelta(seconds=600))
    from torch.distributed.device_mesh import init_device_mesh
    torch.manual_seed(0)
    layer = MultiHeadAttention(d_model, heads, n_kv_heads=kv_heads, causal=True, impl="chunked",
                               block_size=block, rope="half")
    layer = par.shard_sequence(layer, init_device_mesh("cpu", (R,)), layout=layout)
    x = torch.randn(n, L // R, d_model, requires_grad=True)
    layer(x[:, :256]).sum().backward()  # warm-up at a short length

    def step():
        layer(x).sum().backward()

    growth = peak_growth(step)["growth_bytes"]
    out.put((rank, growth, tiles(rank, R, layout, L)))
    dist.destroy_process_group()


def run(R: int, L: int, layout: str, port: int) -> list[tuple]:
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(worker, args=(R, port, L, layout, queue), nprocs=R, start_method="spawn")
    return sorted(queue.get() for _ in range(R))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--layout", choices=ring.LAYOUTS, default="zigzag")
    args = parser.parse_args(argv)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # read by each spawned rank
    print(f"n={n}, d_model={d_model}, {heads} heads, {kv_heads} key/value heads, causal, "
          f"RoPE, impl='chunked', block_size={block}, layout={args.layout!r}, float32")
    print(f"{'R':>3} {'L':>6} {'L/R':>6}  per-rank peak growth (MiB)       per-rank tiles")
    for R in args.ranks:
        for L in args.lengths:
            results = run(R, L, args.layout, 29500 + os.getpid() % 1000 + R)
            mib = " ".join(f"{g / 2**20:6.1f}" for _, g, _ in results)
            print(f"{R:>3} {L:>6} {L // R:>6}  {mib:<32} {[t for *_, t in results]}")


if __name__ == "__main__":
    main()
