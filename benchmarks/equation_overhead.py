"""What a cached ``Equation`` call costs over the bare ``torch.einsum`` it runs.

At attention's smallest sizes the backend's work is tiny, so this is where the engine's
own per-call overhead (argument lookup, cache key, plan dispatch) shows most. Each pair
is timed with ``timeit``, interleaved (einattn, einsum, einattn, einsum, ...) so that
drift in the machine's speed hits both alike, and the minimum over many short repeats is
reported (on a shared machine, short repeats are what find its quiet moments). The target
is a ratio of at most 1.3. A script, not a test: it prints, it asserts nothing.

    python benchmarks/equation_overhead.py [--number 200] [--repeat 200] [--threads 1]
"""

from __future__ import annotations

import argparse
import math
import timeit

import torch

from einattn import Equation

# n samples, L positions, d_model channels, heads; d_head = d_model / heads.
n, L, d_model, heads = 2, 5, 16, 4
d_head = d_model // heads


def cases():
    """(name, einattn call, bare einsum call), each pair computing the same tensor."""
    x = torch.randn(n, L, d_model)
    w = torch.randn(heads * 3 * d_head, d_model)  # W[(μ B a) i], as nn.Linear stores it
    q, k = torch.randn(n, heads, L, d_head), torch.randn(n, heads, L, d_head)
    z, w_o = torch.randn(n, heads, L, d_head), torch.randn(heads, d_head, d_model)
    root = math.sqrt(d_head)

    scores = Equation("S[n μ τ σ] = Q[n μ τ a] K[n μ σ a]")
    scaled = Equation("S[n μ τ σ] = Q[n μ τ a] K[n μ σ a] / √a")
    project = Equation("P[n τ μ B a] = X[n τ i] W[(μ B a) i]")
    heads_ = Equation("Y[n τ i] = Z[n μ τ a] W_O[μ a i]")
    return [
        ("scores S = Q K",
         lambda: scores(Q=q, K=k),
         lambda: torch.einsum("nhqd,nhkd->nhqk", q, k)),
        ("scores S = Q K / √a",
         lambda: scaled(Q=q, K=k),
         lambda: torch.einsum("nhqd,nhkd->nhqk", q, k) / root),
        ("projection P = X W[(μ B a) i]",
         lambda: project(X=x, W=w, μ=heads, B=3),
         lambda: torch.einsum("nti,hbdi->nthbd", x, w.view(heads, 3, d_head, d_model))),
        ("heads Y = Z W_O",
         lambda: heads_(Z=z, W_O=w_o),
         lambda: torch.einsum("nhtd,hdi->nti", z, w_o)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=200, help="calls per timing")
    parser.add_argument("--repeat", type=int, default=200, help="interleaved timings per call")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); sizes: n={n}, "
          f"L={L}, d_model={d_model}, heads={heads}, d_head={d_head}")
    print(f"min of {args.repeat} interleaved repeats of {args.number} calls\n")
    print(f"{'equation':34} {'einattn µs':>11} {'einsum µs':>10} {'overhead µs':>12} {'ratio':>6}")
    ratios = []
    for name, ours, bare in cases():
        torch.testing.assert_close(ours(), bare())  # the same tensor, and plans are warm
        best_ours = best_bare = math.inf
        for _ in range(args.repeat):
            best_ours = min(best_ours, timeit.timeit(ours, number=args.number))
            best_bare = min(best_bare, timeit.timeit(bare, number=args.number))
        ratio = best_ours / best_bare
        ratios.append(ratio)
        us = 1e6 / args.number
        print(f"{name:34} {best_ours * us:11.2f} {best_bare * us:10.2f} "
              f"{(best_ours - best_bare) * us:12.2f} {ratio:6.2f}")
    print(f"\nworst ratio {max(ratios):.2f} (target ≤ 1.30)")


if __name__ == "__main__":
    main()
