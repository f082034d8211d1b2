"""Heads × sequence on gloo processes on the CPU: per-rank memory.

For each mesh ``H×S`` (H ranks of heads by S ranks of the sequence) and each sequence length
L, H·S processes each run one causal forward+backward of a ``MultiHeadAttention``
(``impl="chunked"``) sharded by :func:`einattn.parallel.shard` (heads over ``heads``, the
sequence over ``seq``, whichever has more than one rank) on their L/S tokens, and report the
growth of their peak resident set during it (the method of ``einattn bench``'s memory
column) and the causal tiles their ring computes. ``1x1`` is the unsharded layer in one
process. The processes run with ``MALLOC_MMAP_THRESHOLD_=65536``, so that glibc returns
every freed buffer of 64 KiB or more at once and the resident set follows the live tensors
rather than the allocator's caching. The expectation: a rank's peak falls with L/S (its
tokens) and with H (its heads' Q, K, V, Z and their gradients), and the zigzag layout gives
every rank the same tiles. A script, not a test: it prints, it asserts nothing
(tests/test_ring.py and tests/test_shard.py check the results equal one process's). All
ranks share this machine's cores, so times are not reported.

    python benchmarks/ring.py [--meshes 1x1 2x1 1x2 2x2] [--lengths 8192] [--layout zigzag]
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


def tiles(rank: int, S: int, layout: str, L: int) -> int:
    """The causal tiles of ``block`` sequence rank k's ring computes over a sequence of L."""
    c = L // ring.n_chunks(S, layout)
    causal = patterns.build(n=1, n_heads=1, L_q=L, L_k=L, dtype=torch.float32, device="cpu",
                            causal=True)
    return sum(len(p.tiles(block)) for k in range(S)
               for _, _, p in ring.pairs(ring.chunks(rank, S, layout),
                                         ring.chunks(k, S, layout), c, causal))


def sharded(H: int, S: int, layout: str) -> tuple[MultiHeadAttention, int]:
    """The layer sharded over an ``H×S`` mesh (unsharded for 1×1), and this rank's place
    on the sequence."""
    torch.manual_seed(0)
    layer = MultiHeadAttention(d_model, heads, n_kv_heads=kv_heads, causal=True, impl="chunked",
                               block_size=block, rope="half")
    if H * S == 1:
        return layer, 0
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (H, S), mesh_dim_names=("heads", "seq"))
    par.shard(layer, mesh, heads="heads" if H > 1 else None, sequence="seq" if S > 1 else None,
              layout=layout)
    return layer, mesh.get_local_rank("seq")


def worker(rank: int, H: int, S: int, port: int, L: int, layout: str, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=H * S,
                            init_method=f"tcp://127.0.0.1:{port}",
                            timeout=datetime.timedelta(seconds=1200))
    layer, k = sharded(H, S, layout)
    x = torch.randn(n, L // S, d_model, requires_grad=True)
    layer(x[:, :256]).sum().backward()  # warm-up at a short length

    def step():
        layer(x).sum().backward()

    growth = peak_growth(step)["growth_bytes"]
    out.put((rank, growth, tiles(k, S, layout, L)))
    dist.barrier()
    dist.destroy_process_group()


def run(H: int, S: int, L: int, layout: str, port: int) -> list[tuple]:
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(worker, args=(H, S, port, L, layout, queue), nprocs=H * S,
                       start_method="spawn")
    return sorted(queue.get() for _ in range(H * S))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--meshes", nargs="+", default=["1x1", "2x1", "1x2", "2x2"],
                        help="H×S: ranks of heads by ranks of the sequence")
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192])
    parser.add_argument("--layout", choices=ring.LAYOUTS, default="zigzag")
    args = parser.parse_args(argv)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # read by each spawned rank
    print(f"n={n}, d_model={d_model}, {heads} heads, {kv_heads} key/value heads, causal, "
          f"RoPE, impl='chunked', block_size={block}, layout={args.layout!r}, float32")
    print(f"{'H×S':>5} {'L':>6} {'L/S':>6} {'heads':>5}  per-rank peak growth (MiB)"
          f"       per-rank tiles")
    for mesh in args.meshes:
        H, S = (int(k) for k in mesh.split("x"))
        for L in args.lengths:
            results = run(H, S, L, args.layout, 29500 + os.getpid() % 1000 + H * S)
            mib = " ".join(f"{g / 2**20:6.1f}" for _, g, _ in results)
            print(f"{mesh:>5} {L:>6} {L // S:>6} {heads // H:>5}  {mib:<32} "
                  f"{[t for *_, t in results]}")


if __name__ == "__main__":
    main()
