"""The benchmark: einattn's three paths against three PyTorch forms of the same layer.

    einattn bench [--quick] [--json] [--no-compile] [--no-memory] [--sizes N,L,D,H ...]

Six forms of one bias-free self-attention layer, all on the same weights:

    einsum       einattn, impl="einsum": equations (1)–(5) as written
    sdpa         einattn, impl="sdpa": (2)–(4) by F.scaled_dot_product_attention
    chunked      einattn, impl="chunked": exact attention over tiles, O(L) memory
    textbook     the lean reshape form: three F.linear, view/transpose, matmul, /√a,
                 softmax, matmul, transpose/reshape, F.linear; no mask handling
    torch_mha    nn.MultiheadAttention(batch_first=True), need_weights=False
    linear_sdpa  hand-fused: one nn.Linear to 3·d_model, split, SDPA, out nn.Linear

Timing: in one process, the forms of one size and mode take turns (interleaved rounds, the
order rotated each round) after warm-up calls, so that drift in the machine's speed hits
them alike; each form's median and spread (IQR, min–max) are reported, and ratios of
medians against ``textbook`` and ``linear_sdpa``, measured in the same rounds. "forward"
runs under ``torch.no_grad()``; "forward+backward" runs ``Y.backward(dY)`` with X
requiring grad and every gradient reset to None before each call.

Compile: ``torch.compile`` of textbook, einsum and sdpa, timed interleaved with their
eager forms. Memory: the peak resident-set growth of one forward+backward, each form in a
fresh subprocess. Targets (a ratio of medians, or of peak memory, that a form should stay
under) are printed with PASS, FAIL or SKIP; ``einattn bench --check`` exits with status 1
when one fails.
"""

from __future__ import annotations

import copy
import gc
import importlib
import json
import math
import os
import platform
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .errors import EinattnError
from .module import MultiHeadAttention

# -- what runs ------------------------------------------------------------------------------

PATHS = ("einsum", "sdpa", "chunked", "textbook", "torch_mha", "linear_sdpa")
EINATTN = ("einsum", "sdpa", "chunked")
NAMES = {"einsum": "einattn einsum", "sdpa": "einattn sdpa", "chunked": "einattn chunked",
         "textbook": "textbook (reshape)", "torch_mha": "nn.MultiheadAttention",
         "linear_sdpa": "Linear+SDPA (fused)"}
COMPILED = ("textbook", "einsum", "sdpa")
MODES = ("forward", "forward+backward")
VERDICTS = ("PASS", "FAIL", "SKIP")


@dataclass(frozen=True)
class Size:
    """One benchmark size: ``n`` samples, ``L`` positions (τ = σ), ``d_model``, ``heads``."""

    n: int
    L: int
    d_model: int
    heads: int
    causal: bool = False

    @property
    def d_head(self) -> int:
        return self.d_model // self.heads

    @property
    def label(self) -> str:
        text = f"({self.n}, {self.L}, {self.d_model}, {self.heads})"
        return f"{text} causal" if self.causal else text

    def as_json(self) -> dict:
        return {"n": self.n, "L": self.L, "d_model": self.d_model, "heads": self.heads,
                "d_head": self.d_head, "causal": self.causal}


def parse_size(text: str) -> Size:
    """``"8,128,512,8"`` (n, L, d_model, heads), or with ``",causal"`` after them."""
    parts = [p.strip() for p in text.split(",")]
    causal = parts[-1] == "causal"
    numbers = parts[:-1] if causal else parts
    if len(numbers) != 4 or not all(p.isdigit() and int(p) > 0 for p in numbers):
        raise ValueError(f"{text!r} is not n,L,d_model,heads (four positive integers, "
                         f"optionally followed by ,causal)")
    size = Size(*map(int, numbers), causal=causal)
    if size.d_model % size.heads:
        raise ValueError(f"{text!r}: d_model={size.d_model} is not divisible by "
                         f"heads={size.heads} (index a would not be whole)")
    return size


# The sizes the targets name, then one causal row (informational: targets read non-causal
# rows).
SIZES = (Size(8, 128, 512, 8), Size(2, 1024, 512, 8), Size(1, 4096, 256, 4),
         Size(2, 5, 16, 4), Size(2, 1024, 512, 8, causal=True))
COMPILE_SIZES = (Size(8, 128, 512, 8), Size(2, 1024, 512, 8))  # the mid sizes
QUICK_SIZES = (Size(2, 5, 16, 4), Size(2, 64, 64, 4))
MEMORY = (1, 256, 4)  # n, d_model, heads of the memory runs
MEMORY_LENGTHS = (4096, 8192)
QUICK_MEMORY_LENGTHS = (1024,)


@dataclass(frozen=True)
class Settings:
    """How much to run. ``sample_s``: each timing sample repeats calls until it lasts at
    least this long, so that the clock's resolution never dominates a tiny size."""

    sizes: tuple[Size, ...] = SIZES
    rounds: int = 11
    warmup: int = 2
    sample_s: float = 0.02
    compile_sizes: tuple[Size, ...] = COMPILE_SIZES  # () = no compile runs
    memory_lengths: tuple[int, ...] = MEMORY_LENGTHS  # () = no memory runs
    quick: bool = False
    threads: int | None = None  # torch intra-op threads; None: leave torch's setting
    clock: str = "wall"  # a key of CLOCKS
    why_no_compile: str = ""
    why_no_memory: str = ""

    @classmethod
    def build(cls, *, quick: bool = False, compile: bool = True, memory: bool = True,
              sizes: tuple[Size, ...] | None = None, rounds: int | None = None,
              threads: int | None = None, clock: str | None = None) -> Settings:
        """The full run, or with ``quick`` the tiny one (two small sizes, 3 rounds, one
        memory length of 1024, no compile). ``sizes`` replaces the sizes, and then compile
        runs at every one of them; ``rounds`` replaces the number of rounds."""
        s = (cls(sizes=QUICK_SIZES, rounds=3, warmup=1, sample_s=0.002, compile_sizes=(),
                 memory_lengths=QUICK_MEMORY_LENGTHS, quick=True,
                 why_no_compile="--quick runs no compile")
             if quick else cls())
        if sizes:
            s = replace(s, sizes=tuple(sizes),
                        compile_sizes=() if quick else tuple(x for x in sizes))
        if rounds is not None:
            s = replace(s, rounds=rounds)
        if threads is not None:
            s = replace(s, threads=threads)
        if clock is not None:
            if clock not in CLOCKS:
                raise EinattnError(f"clock must be one of {', '.join(map(repr, CLOCKS))}, got "
                                   f"{clock!r}")
            s = replace(s, clock=clock)
        if not compile:
            s = replace(s, compile_sizes=(), why_no_compile="--no-compile")
        if not memory:
            s = replace(s, memory_lengths=(), why_no_memory="--no-memory")
        return s


# -- the six forms, on the same weights -----------------------------------------------------

class Textbook(nn.Module):
    """The lean textbook form, timed as the baseline (einattn.reference carries mask handling
    that would slow it and flatter einattn)."""

    def __init__(self, W_q, W_k, W_v, W_o, *, heads: int, causal: bool):
        super().__init__()
        self.W_q, self.W_k, self.W_v, self.W_o = (nn.Parameter(w.clone())
                                                  for w in (W_q, W_k, W_v, W_o))
        self.heads, self.causal = heads, causal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, L, d_model = x.shape
        d_head = d_model // self.heads
        q = F.linear(x, self.W_q).view(n, L, self.heads, d_head).transpose(1, 2)
        k = F.linear(x, self.W_k).view(n, L, self.heads, d_head).transpose(1, 2)
        v = F.linear(x, self.W_v).view(n, L, self.heads, d_head).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(d_head)
        if self.causal:
            future = torch.ones(L, L, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        z = torch.softmax(scores, dim=-1) @ v
        return F.linear(z.transpose(1, 2).reshape(n, L, d_model), self.W_o)


class LinearSDPA(nn.Module):
    """Hand-fused, as nanoGPT writes it: one Linear to 3·d_model, split, SDPA, out Linear."""

    def __init__(self, W_qkv, W_o, *, heads: int, causal: bool):
        super().__init__()
        d_model = W_o.shape[0]
        kw = {"bias": False, "dtype": W_o.dtype, "device": W_o.device}
        self.qkv = nn.Linear(d_model, 3 * d_model, **kw)
        self.out = nn.Linear(d_model, d_model, **kw)
        with torch.no_grad():
            self.qkv.weight.copy_(W_qkv)
            self.out.weight.copy_(W_o)
        self.heads, self.causal = heads, causal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, L, d_model = x.shape
        q, k, v = (t.view(n, L, self.heads, d_model // self.heads).transpose(1, 2)
                   for t in self.qkv(x).split(d_model, dim=2))
        z = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.out(z.transpose(1, 2).reshape(n, L, d_model))


class TorchMHA(nn.Module):
    """``nn.MultiheadAttention`` called as a self-attention layer, weights not returned."""

    def __init__(self, mha: nn.MultiheadAttention, *, causal: bool):
        super().__init__()
        self.mha, self.causal = mha, causal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.causal:
            return self.mha(x, x, x, need_weights=False)[0]
        L = x.shape[1]
        future = torch.ones(L, L, dtype=torch.bool, device=x.device).triu(1)  # True = blocked
        return self.mha(x, x, x, need_weights=False, attn_mask=future, is_causal=True)[0]


def with_impl(layer: MultiHeadAttention, impl: str) -> MultiHeadAttention:
    """The layer itself with another default ``impl``: a shallow copy sharing its parameters,
    so that einattn is timed as users call it, with no wrapper module around it."""
    form = copy.copy(layer)
    form.impl = impl
    return form


def _without_causal(layer: MultiHeadAttention) -> MultiHeadAttention:
    """A shallow copy with ``causal=False``, which ``to_torch`` converts (TorchMHA passes the
    causal mask on each call instead)."""
    form = copy.copy(layer)
    form.causal = False
    return form


def build(size: Size, *, seed: int = 0, dtype: torch.dtype = torch.float32,
          paths: tuple[str, ...] = PATHS) -> dict[str, nn.Module]:
    """The forms of one layer, from one seeded einattn layer's weights (all eval, bias-free)."""
    torch.manual_seed(seed)
    layer = MultiHeadAttention(size.d_model, size.heads, causal=size.causal, dtype=dtype)
    p = layer.projections()
    forms: dict[str, Callable[[], nn.Module]] = {
        "einsum": lambda: with_impl(layer, "einsum"),
        "sdpa": lambda: with_impl(layer, "sdpa"),
        "chunked": lambda: with_impl(layer, "chunked"),
        "textbook": lambda: Textbook(p.W_q, p.W_k, p.W_v, p.W_o, heads=size.heads,
                                     causal=size.causal),
        "torch_mha": lambda: TorchMHA(_without_causal(layer).to_torch(), causal=size.causal),
        "linear_sdpa": lambda: LinearSDPA(torch.cat([p.W_q, p.W_k, p.W_v]), p.W_o,
                                          heads=size.heads, causal=size.causal),
    }
    return {name: forms[name]().eval() for name in paths}


def unavailable() -> dict[str, str]:
    """Forms that cannot run here, with the reason: today only ``chunked``, until
    einattn.chunked lands."""
    try:
        importlib.import_module("einattn.chunked")
    except ImportError as error:
        return {"chunked": f"einattn.chunked is not available ({error}); skipped"}
    return {}


def inputs(size: Size, *, seed: int = 1, dtype: torch.dtype = torch.float32):
    """``X[n τ i]`` (requiring grad) and the output gradient ``dY``."""
    g = torch.Generator().manual_seed(seed)
    shape = (size.n, size.L, size.d_model)
    x = torch.randn(*shape, generator=g, dtype=dtype).requires_grad_()
    return x, torch.randn(*shape, generator=g, dtype=dtype)


def step(form: Callable, mode: str, x: torch.Tensor, dy: torch.Tensor,
         params: list[torch.Tensor]) -> Callable[[], None]:
    """One call of ``form`` in ``mode``, as a function of no arguments."""
    if mode == "forward":
        def forward() -> None:
            with torch.no_grad():
                form(x)
        return forward

    def forward_backward() -> None:
        for t in params:
            t.grad = None
        x.grad = None
        form(x).backward(dy)
    return forward_backward


# -- timing ---------------------------------------------------------------------------------

def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class Timing:
    """Seconds per call, one sample per round."""

    samples: tuple[float, ...]
    calls_per_sample: int

    @property
    def median(self) -> float:
        return _quantile(list(self.samples), 0.5)

    @property
    def iqr(self) -> tuple[float, float]:
        return _quantile(list(self.samples), 0.25), _quantile(list(self.samples), 0.75)

    @property
    def spread(self) -> float:
        """The IQR relative to the median."""
        q1, q3 = self.iqr
        return (q3 - q1) / self.median

    def as_json(self) -> dict:
        q1, q3 = self.iqr
        return {"median_s": self.median, "q1_s": q1, "q3_s": q3, "min_s": min(self.samples),
                "max_s": max(self.samples), "rounds": len(self.samples),
                "calls_per_sample": self.calls_per_sample}


# "cpu": the process's CPU time, which leaves out the time a shared machine runs someone
# else; it is the work of the forms' threads, not their latency, so use it with --threads 1.
# Compile times (the first compiled call) are wall-clock either way.
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
RESOLUTION = {name: time.get_clock_info(clock.__name__).resolution
              for name, clock in CLOCKS.items()}
CLOCK_NAMES = {"wall": "wall-clock time", "cpu": "process CPU time"}


def _clock(fn: Callable[[], None], number: int, clock: str = "wall") -> float:
    now = CLOCKS[clock]
    start = now()
    for _ in range(number):
        fn()
    return now() - start


def time_interleaved(steps: dict[str, Callable[[], None]], settings: Settings) \
        -> dict[str, Timing]:
    """Warm each step up, size its samples, then time them in rotating interleaved rounds.

    A sample's number of calls comes from the fastest of three timed calls, so that one
    call stalled by a neighbour on the machine cannot shrink every sample to one call."""
    number = {}
    for name, fn in steps.items():
        for _ in range(settings.warmup):
            fn()
        once = min(_clock(fn, 1, settings.clock) for _ in range(3 if settings.sample_s else 1))
        once = max(once, RESOLUTION[settings.clock], 1e-9)  # a coarse clock may read 0
        number[name] = max(1, math.ceil(settings.sample_s / once))
    samples: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(settings.rounds):
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                samples[name].append(_clock(steps[name], number[name], settings.clock)
                                     / number[name])
    finally:
        if was_enabled:
            gc.enable()
    return {name: Timing(tuple(samples[name]), number[name]) for name in steps}


@dataclass
class Row:
    """One size and mode: every form's timing, and how far its output is from textbook's."""

    size: Size
    mode: str
    timings: dict[str, Timing]
    deviation: dict[str, float] = field(default_factory=dict)

    def ratio(self, path: str, base: str) -> float | None:
        if path not in self.timings or base not in self.timings:
            return None
        return self.timings[path].median / self.timings[base].median

    def as_json(self) -> dict:
        return {"size": self.size.as_json(), "mode": self.mode,
                "paths": {name: {**t.as_json(), "vs_textbook": self.ratio(name, "textbook"),
                                 "vs_linear_sdpa": self.ratio(name, "linear_sdpa"),
                                 "max_deviation": self.deviation.get(name)}
                          for name, t in self.timings.items()}}


def _deviation(y: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |y − ref|`` relative to ``max(1, max |ref|)``."""
    return ((y - ref).abs().max() / ref.abs().max().clamp(min=1.0)).item()


def time_size(size: Size, settings: Settings, skip: dict[str, str]) -> list[Row]:
    """Both modes at one size: each form checked against textbook once, then timed."""
    names = tuple(p for p in PATHS if p not in skip)
    forms = build(size, paths=names)
    x, dy = inputs(size)
    with torch.no_grad():
        outputs = {name: form(x) for name, form in forms.items()}
    deviation = {name: _deviation(y, outputs["textbook"]) for name, y in outputs.items()}
    del outputs
    rows = []
    for mode in MODES:
        steps = {name: step(form, mode, x, dy, list(form.parameters()))
                 for name, form in forms.items()}
        rows.append(Row(size, mode, time_interleaved(steps, settings), deviation))
    return rows


# -- compile --------------------------------------------------------------------------------

@dataclass
class CompileRow:
    """Eager and compiled forms of one size and mode, timed in the same rounds."""

    size: Size
    mode: str
    eager: dict[str, Timing]
    compiled: dict[str, Timing]
    compile_s: dict[str, float]

    def ratio(self, path: str) -> float:
        """Compiled ``path`` against compiled textbook."""
        return self.compiled[path].median / self.compiled["textbook"].median

    def speedup(self, path: str) -> float:
        return self.eager[path].median / self.compiled[path].median

    def as_json(self) -> dict:
        return {"size": self.size.as_json(), "mode": self.mode,
                "paths": {name: {"eager": self.eager[name].as_json(),
                                 "compiled": self.compiled[name].as_json(),
                                 "compile_s": self.compile_s[name],
                                 "speedup": self.speedup(name),
                                 "vs_compiled_textbook": self.ratio(name)}
                          for name in self.compiled}}


def compile_size(size: Size, settings: Settings) -> list[CompileRow]:
    """``torch.compile`` (static shapes) of textbook, einsum and sdpa at one size."""
    torch._dynamo.reset()  # a fresh cache per size: no recompile limit, no dynamic shapes
    forms = build(size, paths=COMPILED)
    x, dy = inputs(size)
    rows = []
    for mode in MODES:
        steps, compile_s = {}, {}
        for name, form in forms.items():
            params = list(form.parameters())
            steps[name] = step(form, mode, x, dy, params)
            compiled = step(torch.compile(form, dynamic=False), mode, x, dy, params)
            compile_s[name] = _clock(compiled, 1)  # the first call compiles
            steps[f"{name} compiled"] = compiled
        timings = time_interleaved(steps, settings)
        rows.append(CompileRow(size, mode, {k: timings[k] for k in forms},
                               {k: timings[f"{k} compiled"] for k in forms}, compile_s))
    return rows


# -- memory ---------------------------------------------------------------------------------

MEMORY_METHOD = ("peak resident set growth of one forward+backward, in a fresh process per "
                 "form: after setup and a warm-up step at L=16, the kernel's peak-RSS mark is "
                 "reset (/proc/self/clear_refs, 5) and the growth is VmHWM after the step "
                 "minus VmRSS before it; where that reset is not allowed, ru_maxrss after "
                 "the step minus ru_maxrss before it")


def _status_kib(field_name: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1])
    raise KeyError(field_name)


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def memory_worker(argv: list[str]) -> None:
    """In a fresh process: ``path n L d_model heads threads``; prints one JSON line."""
    name, *numbers = argv
    n, L, d_model, heads, threads = map(int, numbers)
    torch.set_num_threads(threads)
    size = Size(n, L, d_model, heads)
    form = build(size, paths=(name,))[name]
    params = list(form.parameters())
    warm = replace(size, L=16)
    step(form, "forward+backward", *inputs(warm), params)()  # load kernels, small peak
    run = step(form, "forward+backward", *inputs(size), params)
    gc.collect()
    if _reset_peak():
        before = _status_kib("VmRSS")
        run()
        peak, method = _status_kib("VmHWM"), "VmHWM"
    else:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        run()
        peak, method = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "ru_maxrss"
    print(json.dumps({"growth_bytes": (peak - before) * 1024, "baseline_bytes": before * 1024,
                      "method": method}))


@dataclass
class MemoryRow:
    L: int
    growth: dict[str, int]  # bytes
    errors: dict[str, str]

    def ratio(self, path: str, base: str) -> float | None:
        if path not in self.growth or not self.growth.get(base):
            return None
        return self.growth[path] / self.growth[base]

    def as_json(self) -> dict:
        n, d_model, heads = MEMORY
        return {"size": Size(n, self.L, d_model, heads).as_json(),
                "paths": {name: {"peak_growth_bytes": b,
                                 "vs_textbook": self.ratio(name, "textbook"),
                                 "vs_linear_sdpa": self.ratio(name, "linear_sdpa")}
                          for name, b in self.growth.items()},
                "errors": self.errors}


def measure_memory(L: int, skip: dict[str, str]) -> MemoryRow:
    n, d_model, heads = MEMORY
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    growth, errors = {}, {}
    for name in (p for p in PATHS if p not in skip):
        argv = [name, n, L, d_model, heads, torch.get_num_threads()]
        code = "import sys; from einattn.bench import memory_worker; memory_worker(sys.argv[1:])"
        done = subprocess.run([sys.executable, "-c", code, *map(str, argv)],
                              capture_output=True, text=True, env=env, timeout=900)
        if done.returncode:
            tail = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
            errors[name] = tail
            continue
        growth[name] = json.loads(done.stdout.strip().splitlines()[-1])["growth_bytes"]
    return MemoryRow(L, growth, errors)


# -- targets --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Target:
    """One target at one place: the measured ratio against its limit."""

    target: str
    where: str
    value: float | None
    limit: float
    spread: float | None = None  # the larger relative IQR of the two medians compared
    note: str = ""

    @property
    def verdict(self) -> str:
        if self.value is None:
            return "SKIP"
        return "PASS" if self.value <= self.limit else "FAIL"

    def as_json(self) -> dict:
        return {"target": self.target, "where": self.where, "value": self.value,
                "limit": self.limit, "spread": self.spread, "verdict": self.verdict,
                "note": self.note}


def _spread(*timings: Timing | None) -> float | None:
    return None if None in timings else max(t.spread for t in timings)


def targets(report: Report) -> list[Target]:
    """The targets, read from the rows run (a target with no row is SKIP)."""
    found: list[Target] = []
    plain = [r for r in report.rows if not r.size.causal]
    training = [r for r in plain if r.mode == "forward+backward"]

    def against(path: str, base: str, limit: float, rows: list[Row], label: str,
                empty: str) -> None:
        for r in rows:
            note = report.skipped.get(path, "") if path not in r.timings else ""
            found.append(Target(label, f"{r.size.label} {r.mode}", r.ratio(path, base), limit,
                                _spread(r.timings.get(path), r.timings.get(base)), note))
        if not rows:
            found.append(Target(label, empty, None, limit, note="no such size was run"))

    against("einsum", "textbook", 1.0, [r for r in training if r.size == SIZES[0]],
            "einsum ≤ 1.0× textbook", f"{SIZES[0].label} forward+backward")
    against("einsum", "textbook", 0.85, [r for r in training if r.size.L >= 1024],
            "einsum ≤ 0.85× textbook", "L ≥ 1024 forward+backward")
    against("einsum", "textbook", 1.3, [r for r in training if r.size == SIZES[3]],
            "einsum ≤ 1.3× textbook", f"{SIZES[3].label} forward+backward")
    label = "compiled einsum ≤ 1.05× compiled textbook"
    for c in report.compiled:
        found.append(Target(label, f"{c.size.label} {c.mode}", c.ratio("einsum"), 1.05,
                            _spread(c.compiled["einsum"], c.compiled["textbook"])))
    if not report.compiled:
        found.append(Target(label, "mid sizes", None, 1.05, note=report.settings.why_no_compile))
    against("sdpa", "linear_sdpa", 1.0, plain, "sdpa ≤ 1.0× Linear+SDPA", "every size")
    against("sdpa", "torch_mha", 1.0, plain, "sdpa ≤ 1.0× nn.MultiheadAttention", "every size")
    label, where = "chunked peak memory ≤ 2× Linear+SDPA's", "L=8192 forward+backward"
    row = next((m for m in report.memory if m.L == 8192), None)
    if row is None:
        note = report.settings.why_no_memory or "L=8192 was not run"
        found.append(Target(label, where, None, 2.0, note=note))
    else:
        note = report.skipped.get("chunked", row.errors.get("chunked", ""))
        found.append(Target(label, where, row.ratio("chunked", "linear_sdpa"), 2.0, note=note))
    against("chunked", "textbook", 1.3, [r for r in training if r.size.L >= 1024],
            "chunked ≤ 1.3× textbook", "L ≥ 1024 forward+backward")
    return found


# -- the run --------------------------------------------------------------------------------

@dataclass
class Report:
    settings: Settings
    rows: list[Row] = field(default_factory=list)
    compiled: list[CompileRow] = field(default_factory=list)
    memory: list[MemoryRow] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    threads: int = field(default_factory=torch.get_num_threads)
    seconds: float = 0.0

    def machine(self) -> dict:
        return {"torch": torch.__version__, "einattn": _checkout(),
                "python": platform.python_version(),
                "platform": platform.platform(), "processor": platform.processor(),
                "cpu_count": os.cpu_count(), "threads": self.threads,
                "device": "cpu", "dtype": "float32"}

    def as_json(self) -> dict:
        s = self.settings
        return {
            "machine": self.machine(),
            "settings": {"quick": s.quick, "rounds": s.rounds, "warmup": s.warmup,
                         "clock": s.clock,
                         "sample_s": s.sample_s, "sizes": [x.as_json() for x in s.sizes],
                         "compile_sizes": [x.as_json() for x in s.compile_sizes],
                         "memory_lengths": list(s.memory_lengths)},
            "paths": {name: NAMES[name] for name in PATHS},
            "skipped": self.skipped,
            "timings": [r.as_json() for r in self.rows],
            "compile": ({"rows": [c.as_json() for c in self.compiled]} if self.compiled
                        else {"skipped": s.why_no_compile or "no compile sizes"}),
            "memory": ({"method": MEMORY_METHOD, "rows": [m.as_json() for m in self.memory]}
                       if self.memory else {"skipped": s.why_no_memory or "no lengths"}),
            "targets": [t.as_json() for t in targets(self)],
            "seconds": self.seconds,
        }


def _checkout() -> str:
    """The einattn that ran: the version, and the commit when run from a git checkout
    (with ``+dirty`` when files differ from it)."""
    from . import __version__

    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--",
                                "einattn"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = dirty = ""
    if not commit:
        return __version__
    return f"{__version__} ({commit}{'+dirty' if dirty else ''})"


def run(settings: Settings, progress: Callable[[str], None] | None = None) -> Report:
    """Everything ``settings`` asks for, in this process (memory in subprocesses)."""
    say = progress or (lambda text: None)
    start = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(settings.threads or threads)
    report = Report(settings, skipped=unavailable())
    try:
        for size in settings.sizes:
            say(f"timing {size.label}")
            report.rows += time_size(size, settings, report.skipped)
        for size in settings.compile_sizes:
            say(f"compiling {size.label}")
            report.compiled += compile_size(size, settings)
        for L in settings.memory_lengths:
            say(f"memory at L={L}")
            report.memory.append(measure_memory(L, report.skipped))
    finally:
        torch.set_num_threads(threads)
    report.seconds = time.perf_counter() - start
    return report


# -- the text -------------------------------------------------------------------------------

def _duration(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale or unit == "µs":
            value = seconds / scale
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
    raise AssertionError  # unreachable


def _times(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}×"


def _percent(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.0f}%"


def _count(k: int | None, noun: str) -> str:
    return f"{k} {noun}{'' if k == 1 else 's'}"


def _deviation_text(x: float) -> str:
    return "0" if x == 0 else f"{x:.0e}"


def _mib(b: int | None) -> str:
    return "—" if b is None else f"{b / 2**20:,.0f} MiB"


def lines(report: Report, table, paint) -> list[str]:
    """The report as text; ``table`` and ``paint`` are einattn.cli's (aligned columns,
    verdicts in colour on a terminal)."""
    s, m = report.settings, report.machine()
    out = [f"einattn bench{' --quick' if s.quick else ''}: einattn {m['einattn']}, "
           f"torch {m['torch']}, CPU "
           f"({_count(m['cpu_count'], 'core')}, {_count(m['threads'], 'thread')}), float32, "
           f"bias-free, the same weights in every form",
           f"median of {_count(s.rounds, 'interleaved round')} after "
           f"{_count(s.warmup, 'warm-up call')}, {CLOCK_NAMES[s.clock]}; "
           f"spread = IQR / median; forward under no_grad, forward+backward with dX and "
           f"every weight's gradient"]
    out += [f"skipped: {NAMES[name]}: {why}" for name, why in report.skipped.items()]
    for size in s.sizes:
        rows = [r for r in report.rows if r.size == size]
        out += ["", f"{size.label}  n={size.n} τ=σ={size.L} i={size.d_model} "
                    f"μ={size.heads} a={size.d_head}" + (", causal" if size.causal else "")]
        cells = []
        for r in rows:
            for name, t in r.timings.items():
                cells.append([r.mode, NAMES[name], _duration(t.median), _percent(t.spread),
                              _times(r.ratio(name, "textbook")),
                              _times(r.ratio(name, "linear_sdpa")),
                              _deviation_text(r.deviation[name])])
        out += table(["mode", "form", "median", "spread", "× textbook", "× Linear+SDPA",
                      "max |ΔY|"], cells, paint, right=(2, 3, 4, 5, 6))
    out += ["", "torch.compile (dynamic=False), eager and compiled timed in the same rounds"]
    if report.compiled:
        cells = [[c.size.label, c.mode, NAMES[name], _duration(c.eager[name].median),
                  _duration(c.compiled[name].median), _times(c.speedup(name)),
                  _times(c.ratio(name)), f"{c.compile_s[name]:.0f} s"]
                 for c in report.compiled for name in c.compiled]
        out += table(["size", "mode", "form", "eager", "compiled", "speed-up",
                      "× compiled textbook", "first call"], cells, paint,
                     right=(3, 4, 5, 6, 7))
    else:
        out.append(f"  skipped: {s.why_no_compile}")
    n, d_model, heads = MEMORY
    out += ["", f"peak memory, forward+backward, n={n} d_model={d_model} heads={heads}"]
    if report.memory:
        out.append(f"method: {MEMORY_METHOD}")
        cells = []
        for row in report.memory:
            for name in (p for p in PATHS if p not in report.skipped):
                if name in row.growth:
                    cells.append([str(row.L), NAMES[name], _mib(row.growth[name]),
                                  _times(row.ratio(name, "textbook")),
                                  _times(row.ratio(name, "linear_sdpa"))])
                else:
                    cells.append([str(row.L), NAMES[name], "failed", "—", "—"])
        out += table(["L", "form", "peak growth", "× textbook", "× Linear+SDPA"], cells,
                     paint, right=(2, 3, 4))
        for row in report.memory:
            out += [f"  failed at L={row.L}: {NAMES[k]}: {e}" for k, e in row.errors.items()]
    else:
        out.append(f"  skipped: {s.why_no_memory}")
    found = targets(report)
    out += ["", "targets: ratios of medians (of peak memory for chunked) against their "
                "limits; einattn bench --check exits 1 on a FAIL"]
    out += table(["verdict", "target", "where", "measured", "spread", "note"],
                 [[t.verdict, t.target, t.where, "—" if t.value is None else f"{t.value:.3f}×",
                   _percent(t.spread), t.note]
                  for t in found], paint, right=(3, 4))
    counts = {v: sum(t.verdict == v for t in found) for v in VERDICTS}
    out += [f"{len(found)} checks: " + ", ".join(f"{c} {v}" for v, c in counts.items() if c),
            f"ran in {report.seconds:.0f} s"]
    return out
