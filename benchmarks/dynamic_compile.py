"""``torch.compile(dynamic=True)`` over varying sequence lengths, with Inductor.

A variable-length batch or a server sees a new length on most calls. This compiles each
form once with ``fullgraph=True, dynamic=True`` (einattn's einsum and sdpa paths, and the
hand-fused Linear + ``F.scaled_dot_product_attention`` of einattn.bench for comparison),
then runs it forward+backward at each of several lengths, and reports: the compile time of
the first call, how many graphs were compiled in all (1 = every length from one graph),
and at each length the median time of a compiled step against the same form eager. A
script, not a test: it prints, it asserts nothing (tests/test_impls.py checks the graph
counts and the outputs with a cheap backend).

    python benchmarks/dynamic_compile.py [--lengths 96 160 224 288] [--rounds 7] [--threads T]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout as is

from einattn import MultiHeadAttention
from einattn.bench import LinearSDPA

n, d_model, heads = 4, 256, 8


def forms() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    layer = MultiHeadAttention(d_model, heads, causal=True)
    W_q, W_k, W_v, W_o = layer.projections()[:4]
    return {"einsum": layer, "sdpa": MultiHeadAttention.from_fused(
                layer.W.detach(), layer.W_O.detach(), causal=True, impl="sdpa"),
            "Linear+SDPA": LinearSDPA(torch.cat([W_q, W_k, W_v]), W_o, heads=heads,
                                      causal=True)}


def step_time(f, x: torch.Tensor, rounds: int) -> float:
    """Median seconds of one forward+backward."""
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        f(x).sum().backward()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def counted_backend():
    """Inductor, counting the graphs it is handed."""
    count = [0]

    def backend(gm, example_inputs):
        count[0] += 1
        from torch._inductor.compile_fx import compile_fx
        return compile_fx(gm, example_inputs)
    return backend, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[96, 160, 224, 288])
    parser.add_argument("--rounds", type=int, default=7, help="timed steps per length")
    parser.add_argument("--threads", type=int, help="torch intra-op threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); n={n}, "
          f"d_model={d_model}, heads={heads}, causal; forward+backward, medians of "
          f"{args.rounds}")
    for name, form in forms().items():
        torch._dynamo.reset()
        backend, graphs = counted_backend()
        compiled = torch.compile(form, fullgraph=True, dynamic=True, backend=backend)
        x = torch.randn(n, args.lengths[0], d_model, requires_grad=True)
        start = time.perf_counter()
        compiled(x).sum().backward()
        first = time.perf_counter() - start
        cells = []
        for L in args.lengths:
            x = torch.randn(n, L, d_model, requires_grad=True)
            compiled(x).sum().backward()  # a new length: a recompile would happen here
            ratio = step_time(compiled, x, args.rounds) / step_time(form, x, args.rounds)
            cells.append(f"L={L} {ratio:.3f}x")
        print(f"{name:12} first call {first:6.1f} s, graphs {graphs[0]}; compiled/eager: "
              + ", ".join(cells))


if __name__ == "__main__":
    main()
