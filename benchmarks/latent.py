"""Multi-head latent attention: what each form caches per token, and one decode step of the
absorbed form against the expanded one at a long context.

The cache per token and per layer is c + ρ numbers absorbed (the latent and the shared
rotary key) against μ·(a + ρ) + μ·b expanded (every head's keys and values); the decode
step is one new token attending over ``--context`` cached ones, on the same parameters,
after the same prefill. Each round times both forms back to back (the order alternating),
so that drift in a shared machine's speed hits both alike; the minimum over rounds is
reported for each, and their ratio. A script, not a test: it prints, it asserts nothing.

    python benchmarks/latent.py [--sizes v2-lite|v3] [--context 4096] [--rounds 30]
                                [--number 5] [--threads 1] [--impl einsum]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from einattn import LatentAttention
from einattn.latent_cache import LatentCache

# Attention sizes of the released models: i, μ, l (None: no query latent), c, a, ρ, b.
SIZES = {
    "v2-lite": {"d_model": 2048, "n_heads": 16, "d_query_latent": None, "d_latent": 512,
                "d_head": 128, "d_rope": 64, "d_value": 128},
    "v3": {"d_model": 7168, "n_heads": 128, "d_query_latent": 1536, "d_latent": 512,
           "d_head": 128, "d_rope": 64, "d_value": 128},
}
FORMS = ("expanded", "absorbed")


def per_token(sizes: dict) -> dict[str, int]:
    """Numbers cached per token per layer, by form (what LatentCache.numbers_per_token says
    once filled)."""
    μ, c, a, ρ, b = (sizes[k] for k in ("n_heads", "d_latent", "d_head", "d_rope", "d_value"))
    return {"expanded": μ * (a + ρ) + μ * b, "absorbed": c + ρ}


def prefilled(layer, form: str, context: int, chunk: int = 512) -> LatentCache:
    """A cache holding ``context`` tokens of one sequence, filled ``chunk`` at a time (SDPA:
    the einsum path would make a context × chunk score matrix per head)."""
    cache = LatentCache()
    torch.manual_seed(1)
    for start in range(0, context, chunk):
        x = torch.randn(1, min(chunk, context - start), layer.d_model)
        layer(x, cache=cache, form=form, impl="sdpa", causal=True)
    return cache


def step_time(layer, cache: LatentCache, form: str, x: torch.Tensor, number: int,
              impl: str) -> float:
    """Seconds per decode step: one token over the cache, then the cache cropped back."""
    context = len(cache)
    start = time.perf_counter()
    for _ in range(number):
        layer(x, cache=cache, form=form, impl=impl)
        cache.crop(context)
    return (time.perf_counter() - start) / number


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", choices=sorted(SIZES), default="v2-lite")
    parser.add_argument("--context", type=int, default=4096, help="cached tokens")
    parser.add_argument("--rounds", type=int, default=30, help="interleaved timings per form")
    parser.add_argument("--number", type=int, default=5, help="decode steps per timing")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--impl", default="einsum", help="the decode step's impl")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = SIZES[args.sizes]
    torch.manual_seed(0)
    layer = LatentAttention(**sizes).eval()
    numbers = per_token(sizes)
    print(f"DeepSeek-{args.sizes} attention sizes {sizes}, float32, batch 1, "
          f"{args.threads} thread(s), impl={args.impl!r}, context {args.context}")
    with torch.no_grad():
        caches = {form: prefilled(layer, form, args.context) for form in FORMS}
        for form, cache in caches.items():
            assert cache.numbers_per_token() == numbers[form]
        x = torch.randn(1, 1, layer.d_model)
        times = {form: [] for form in FORMS}
        for r in range(args.rounds):
            for form in FORMS if r % 2 == 0 else FORMS[::-1]:
                times[form].append(step_time(layer, caches[form], form, x, args.number,
                                             args.impl))
    report(numbers, times)


def report(numbers: dict[str, int], times: dict[str, list[float]]) -> None:
    print(f"{'form':<10}{'numbers/token':>15}{'bytes/token f32':>17}{'bf16':>8}"
          f"{'step min':>12}{'step median':>14}")
    for form in FORMS:
        print(f"{form:<10}{numbers[form]:>15}{4 * numbers[form]:>17}{2 * numbers[form]:>8}"
              f"{1e3 * min(times[form]):>10.3f}ms{1e3 * statistics.median(times[form]):>12.3f}ms")
    ratios = [e / a for e, a in zip(times["expanded"], times["absorbed"], strict=True)]
    fastest = min(times["expanded"]) / min(times["absorbed"])
    print(f"cache: expanded / absorbed = {numbers['expanded'] / numbers['absorbed']:.1f}x; "
          f"decode step: expanded / absorbed = {fastest:.2f}x (minima), "
          f"{statistics.median(ratios):.2f}x (median of per-round ratios)")


if __name__ == "__main__":
    main()
