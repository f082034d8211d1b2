"""Memory: the peak resident-set growth of one forward+backward, each form in a fresh
subprocess (``python -c "… from einattn.bench.memory import memory_worker …"``): the layer's
forms (:func:`measure_memory`), and the way the patterns section measures its own
(:func:`measured`, :func:`peak_growth`)."""

from __future__ import annotations

import gc
import json
import os
import resource
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .forms import PATHS, build, inputs, step
from .settings import MEMORY, Size

MEMORY_METHOD = ("peak resident set growth of one forward+backward, in a fresh process per "
                 "form: after setup and a warm-up step at L=16, the kernel's peak-RSS mark is "
                 "reset (/proc/self/clear_refs, 5) and the growth is VmHWM after the step "
                 "minus VmRSS before it; where that reset is not allowed, ru_maxrss after "
                 "the step minus ru_maxrss before it")
PATTERN_MEMORY_METHOD = MEMORY_METHOD.replace("at L=16", "at L=min(L, 512)")
_WORKER = "import sys; from einattn.bench.{0} import {1}; {1}(sys.argv[1:])"
_ROOT = Path(__file__).resolve().parents[2]  # the folder that holds the einattn package


def _status_kib(field_name: str) -> int:
    """A field of /proc/self/status, in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1])
    raise KeyError(field_name)


def _reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM); False where that is not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def peak_growth(run) -> dict:
    """Call ``run`` once; the growth of the peak resident set it caused, in bytes, the
    resident set before it, and the method that measured them."""
    gc.collect()
    if _reset_peak():
        before = _status_kib("VmRSS")
        run()
        peak, method = _status_kib("VmHWM"), "VmHWM"
    else:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        run()
        peak, method = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "ru_maxrss"
    return {"growth_bytes": (peak - before) * 1024, "baseline_bytes": before * 1024,
            "method": method}


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
    print(json.dumps(peak_growth(step(form, "forward+backward", *inputs(size), params))))


def _in_subprocess(module: str, worker: str, argv: list) -> tuple[int | None, str]:
    """Run ``worker`` of ``einattn.bench.<module>`` in a fresh Python with ``argv``: the peak
    growth it printed, or None and the last line of what it said when it failed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(_ROOT), os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, "-c", _WORKER.format(module, worker), *map(str, argv)],
                          capture_output=True, text=True, env=env, timeout=900)
    if done.returncode:
        return None, (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
    return json.loads(done.stdout.strip().splitlines()[-1])["growth_bytes"], ""


@dataclass
class MemoryRow:
    """One length ``L``: each form's peak growth in bytes, and the forms that failed."""

    L: int
    growth: dict[str, int]  # bytes
    errors: dict[str, str]

    def ratio(self, path: str, base: str) -> float | None:
        """Peak growth against peak growth: ``path``'s over ``base``'s (None without both)."""
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
    """Every form not in ``skip`` at length ``L``, one subprocess each (:func:`memory_worker`),
    at the n, d_model and heads of ``MEMORY`` and this process's thread count."""
    n, d_model, heads = MEMORY
    return measured(L, [(name, [name, n, L, d_model, heads, torch.get_num_threads()])
                        for name in PATHS if name not in skip], "memory", "memory_worker")


def measured(L: int, runs: list[tuple[str, list]], module: str, worker: str) -> MemoryRow:
    """The row of length ``L``: for each ``(form, argv)`` of ``runs``, ``worker`` of
    ``einattn.bench.<module>`` run in a fresh process."""
    growth, errors = {}, {}
    for name, argv in runs:
        bytes_, error = _in_subprocess(module, worker, argv)
        if error:
            errors[name] = error
        else:
            growth[name] = bytes_
    return MemoryRow(L, growth, errors)
