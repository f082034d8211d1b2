"""einattn on a CUDA device: the layer's sdpa path in bfloat16 against a hand-fused Linear +
``F.scaled_dot_product_attention``, and a causal sliding window by einattn's flex, chunked
and sdpa paths against FlexAttention called by hand (compiled, forward and backward).

Times are CUDA-event medians over interleaved rounds; each row also gives the largest
deviation from a float32 reference on the same inputs (bfloat16 rows) or from the hand-written
form (same dtype). It asserts nothing and prints a table (and ``--json FILE``). The figures
in docs/performance.md ("On a GPU") come from it.

    python benchmarks/gpu.py [--device cuda] [--repeats 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout as is

import einattn
from einattn import functional


def timed(forms: dict, repeats: int) -> dict[str, float]:
    """Median milliseconds of each form, rounds interleaved, after two warm-up calls each
    (CUDA events on a GPU; the wall clock elsewhere, for a dry run)."""
    for form in forms.values():
        form(), form()
    times = {name: [] for name in forms}
    for _ in range(repeats):
        for name, form in forms.items():
            times[name].append(_milliseconds(form))
    return {name: statistics.median(t) for name, t in times.items()}


def _milliseconds(form) -> float:
    if not torch.cuda.is_available():
        start = time.perf_counter()
        form()
        return 1e3 * (time.perf_counter() - start)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    form()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def runnable(forms: dict, errors: dict) -> dict:
    """The forms that run forward and backward once; the others' errors go to ``errors``."""
    kept = {}
    for name, form in forms.items():
        try:
            trained(form)()
            kept[name] = form
        except Exception as error:  # reported in the form's row, the other forms still run
            errors[name] = f"{type(error).__name__}: {error}"[:300]
    return kept


def rows_of(kind: str, size: str, forms: dict, exact: torch.Tensor, repeats: int) -> list:
    """Each form's row: its forward and forward+backward medians and deviation from exact."""
    errors: dict[str, str] = {}
    forms = runnable(forms, errors)
    with torch.no_grad():
        dev = {k: (f().float() - exact).abs().max().item() for k, f in forms.items()}
        fwd = timed(forms, repeats)
    both = timed({k: trained(f) for k, f in forms.items()}, repeats)
    return [{"row": f"{kind} {k}", "sizes": size, "forward_ms": fwd[k], "fwd_bwd_ms": both[k],
             "max_dev_vs_fp32": dev[k]} for k in forms] + [
        {"row": f"{kind} {k}", "sizes": size, "error": e} for k, e in errors.items()]


def trained(forward):
    """Forward then backward of the sum, the inputs' gradients cleared."""
    def step():
        out = forward()
        out.float().sum().backward()
    return step


def layer_rows(device, n, L, d_model, heads, repeats) -> list[dict]:
    """The layer in bfloat16: einattn's sdpa against Linear + SDPA + Linear by hand."""
    torch.manual_seed(0)
    layer = einattn.MultiHeadAttention(d_model, heads, impl="sdpa", device=device,
                                       dtype=torch.bfloat16)
    x = torch.randn(n, L, d_model, device=device, dtype=torch.bfloat16, requires_grad=True)
    W, W_O = layer.W.detach(), layer.W_O.detach()  # W[(μ B a) i], W_O[μ a i]
    a = d_model // heads

    def by_hand(x, W, W_O):
        q, k, v = F.linear(x, W).unflatten(-1, (heads, 3, a)).unbind(-2)
        z = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                           is_causal=True)
        return F.linear(z.transpose(1, 2).flatten(2), W_O.flatten(0, 1).T)

    Wg, W_Og = W.clone().requires_grad_(), W_O.clone().requires_grad_()
    forms = {"einattn sdpa": lambda: layer(x, causal=True),
             "Linear+SDPA": lambda: by_hand(x, Wg, W_Og)}
    with torch.no_grad():
        exact = by_hand(x.float(), W.float(), W_O.float())
    return rows_of("layer", f"n={n} L={L} d={d_model} μ={heads} bf16 causal", forms, exact,
                   repeats)


def window_rows(device, n, heads, L, a, w, repeats) -> list[dict]:
    """A causal window of w keys on Q, K, V: einattn's impls against FlexAttention by hand."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch.manual_seed(1)
    Q, K, V = (torch.randn(n, heads, L, a, device=device, dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))

    def band(b, h, q, k):
        return (k <= q) & (q - k < w)

    block = create_block_mask(band, None, None, L, L, device=device)
    flex = torch.compile(flex_attention, dynamic=False)
    forms = {"FlexAttention by hand": lambda: flex(Q, K, V, block_mask=block)}
    for impl in ("flex", "chunked", "sdpa"):
        forms[f"einattn {impl}"] = (lambda impl=impl: functional.attention(
            Q, K, V, causal=True, window=w, impl=impl))
    with torch.no_grad():
        exact = functional.attention(Q.float(), K.float(), V.float(), causal=True, window=w,
                                     impl="sdpa")
    return rows_of("window", f"n={n} μ={heads} L={L} a={a} w={w} bf16", forms, exact, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a dry run")
    args = parser.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    print(f"{name}, torch {torch.__version__}")
    layer, window = ((2, 256, 64, 4), (1, 2, 512, 16, 64)) if args.quick else (
        (4, 4096, 2048, 16), (4, 16, 8192, 64, 256))
    rows = []
    for label, run in (("layer", lambda: layer_rows(device, *layer, args.repeats)),
                       ("window", lambda: window_rows(device, *window, args.repeats))):
        try:
            rows += run()
        except Exception as error:  # one section's failure still reports the others
            rows.append({"row": label, "error": f"{type(error).__name__}: {error}"[:500]})
    for row in rows:
        print(json.dumps(row, ensure_ascii=False))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
