"""Shared helpers for the test suite: seeded tensors, weights in both layouts, tolerances, and
the device the suite runs on.

The device: ``pytest --device cuda`` (or ``EINATTN_TEST_DEVICE=cuda pytest``; the option wins)
runs every device-independent test with ``cuda`` as torch's default device, so that the
tensors, layers and Hugging Face models a test makes are made there (tests that name the
CPU, as a test of device checks does, keep it). The modules in
:data:`CPU_ONLY`, and doctests (whose printed tensors would name the device), are about the
CPU or need what only the CPU machine has: they are skipped on another device, with the
reason. The default is ``cpu``, where the switch changes nothing.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._device import DeviceContext, _device_constructors

from einattn import chunked

# The suite runs thousands of operations on tiny tensors, where intra-op threads cost more
# than they save (and, on a busy machine, far more): one thread keeps it fast and steady.
torch.set_num_threads(1)

# Equality proofs: float64 at ≤1e-12 relative to scale (STYLE §5); float32 at 1e-5.
TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


# Test modules that stay on the CPU under --device, and why.
CPU_ONLY = {
    "test_bench": "the benchmark times and measures memory on the CPU",
    "test_bench_peak": "the benchmark measures the CPU's matmul rate and memory bandwidth",
    "test_browser": "opens the built site in Chromium",
    "test_cli": "runs the command line in subprocesses on the CPU",
    "test_derivation_files": "runs `einattn verify` in subprocesses and compares its output",
    "test_docs": "compares docs/ with the code and runs its examples as written",
    "test_examples": "runs examples/tiny_lm.py as a user would",
    "test_parallel": "gloo processes on the CPU",
    "test_readme": "runs the README's commands as written",
    "test_ring": "gloo processes on the CPU",
    "test_seeds": "ports NumPy code, whose arrays live on the CPU",
    "test_shard": "gloo processes on the CPU",
    "test_site": "builds the documentation site",
}


def pytest_addoption(parser) -> None:
    """``--device``; a test marked ``@pytest.mark.cpu_only("why")`` runs on the CPU only."""
    parser.addoption("--device", default=os.environ.get("EINATTN_TEST_DEVICE"),
                     help="torch's default device while each device-independent test runs "
                          "(default: $EINATTN_TEST_DEVICE; unset, tests make their tensors "
                          "where torch does, on the CPU)")


def pytest_collection_modifyitems(config, items) -> None:
    device = config.getoption("--device")
    if device is None or torch.device(device).type == "cpu":
        return
    for item in items:
        marker = item.get_closest_marker("cpu_only")
        why = CPU_ONLY.get(item.path.stem) or (marker.args[0] if marker else None) or (
            "a doctest prints CPU tensors" if isinstance(item, pytest.DoctestItem) else None)
        if why is not None:
            item.add_marker(pytest.mark.skip(reason=f"CPU only under --device {device}: {why}"))


def pytest_configure(config) -> None:
    """The suite's device, where one is given, becomes torch's default device for the whole
    session, collection included (module-level tensors and parameters are made there too):
    a mode that places every factory call; given ``cpu`` too, so that the switch itself is
    exercised on a machine without a GPU."""
    device = config.getoption("--device")
    if device is not None:
        _Device(device).__enter__()


class _Device(DeviceContext):
    """torch's default-device mode (``with torch.device(...)``), except that a factory call
    given a CPU generator draws on the CPU and moves its result: tests seed CPU generators,
    and their numbers stay the same on every device."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _device_constructors() and kwargs.get("device") is None:
            generator = kwargs.get("generator")
            if generator is not None and generator.device.type == "cpu":
                grad = kwargs.pop("requires_grad", False)
                drawn = func(*args, **kwargs, device="cpu")
                return drawn.to(self.device).requires_grad_(grad)
            kwargs["device"] = self.device
        return func(*args, **kwargs)


def on_cpu_only(names, why: dict[str, str]) -> list:
    """``names`` as parameters, those in ``why`` marked ``cpu_only`` with their reason."""
    return [pytest.param(name, marks=pytest.mark.cpu_only(why[name])) if name in why else name
            for name in names]


FLEX_CPU = "FlexAttention's CPU kernels alone have no backward"


def whole(impl: str) -> bool:
    """Whether a layer with gradients compiles to one graph (``fullgraph=True``): chunked's
    Function breaks it before torch 2.13 (:data:`einattn.chunked.TRACEABLE`)."""
    return impl != "chunked" or chunked.TRACEABLE


def here() -> str:
    """The default device as error messages name it: ``cpu``, ``cuda:0``."""
    return str(torch.empty(0).device)


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float64,
          requires_grad: bool = False) -> torch.Tensor:
    """A reproducible standard-normal tensor that does not touch the global RNG, drawn on the
    CPU (the same numbers on every device) and moved to the default device."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=g, dtype=torch.float64, device="cpu")
    return t.to(dtype=dtype, device=torch.get_default_device()).requires_grad_(requires_grad)


def refilled(module: torch.nn.Module, seed: int, scale: float) -> torch.nn.Module:
    """``module`` with its k-th parameter redrawn as ``randn(seed=seed + k) · scale``."""
    with torch.no_grad():
        for k, p in enumerate(module.parameters()):
            p.copy_(randn(*p.shape, seed=seed + k) * scale)
    return module


def left_padded(n: int, length: int, pads: int) -> torch.Tensor:
    """Key padding ``(n, length)``, True = padding: sample 1 starts with ``pads`` pads."""
    kpm = torch.zeros(n, length, dtype=torch.bool)
    kpm[1, :pads] = True
    return kpm


def projections(d_model: int, n_heads: int, d_head: int, *, bias: bool, seed: int,
                dtype: torch.dtype = torch.float64, requires_grad: bool = False) -> dict:
    """Reshape-layout weights ``W_q, W_k, W_v: ((μ a), i)``, ``W_o: (i, (μ a))`` and,
    with ``bias``, ``b_q, b_k, b_v: ((μ a),)``, ``b_o: (i,)``; scaled as nn.Linear's."""
    rows = n_heads * d_head
    shapes = {"W_q": (rows, d_model), "W_k": (rows, d_model), "W_v": (rows, d_model),
              "W_o": (d_model, rows)}
    if bias:
        shapes |= {"b_q": (rows,), "b_k": (rows,), "b_v": (rows,), "b_o": (d_model,)}
    out = {}
    for k, (name, shape) in enumerate(shapes.items()):
        scale = shape[-1] ** -0.5 if len(shape) == 2 else 0.5
        w = randn(*shape, seed=seed * 100 + k, dtype=dtype) * scale
        out[name] = w.detach().requires_grad_(requires_grad)
    return out


def assert_close_scaled(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    """``max |actual − expected| ≤ tol · max(1, max |expected|)``, NaN where and only where
    expected has NaN, and equal shapes."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(actual), nan), "NaN pattern differs"
    a, e = actual[~nan], expected[~nan]
    if e.numel() == 0:
        return
    scale = max(1.0, e.abs().max().item())
    err = (a - e).abs().max().item()
    assert err <= tol * scale, f"max error {err:.3g} > {tol:g} · scale {scale:.3g}"


# A float step's max |lhs − rhs| is rounding noise: 1.9e-16 on one CPU, 0 on another (issue 34).
# Its cell, the one after "float" in a verdict row, is the only figure of `einattn` and
# `einattn verify FILE.md` that depends on the machine; everything else they print is
# deterministic: sizes, shapes, FLOPs, verdicts, exact deviations (integer arithmetic), the
# false-acceptance bounds (from sizes alone) and the tolerances (1e-12 · max |output|, printed
# to two digits: a last-bit difference changes them only at a rounding boundary).
FLOAT_DEVIATION = re.compile(r"^((?:PASS|FAIL)\s+float)(\s+\S+)", re.M)


def without_rounding(text: str) -> str:
    """``text`` with each float step's deviation cell replaced by ``#`` (column widths kept),
    so that printed output compares with the docs on any machine, and nothing else is hidden."""
    return FLOAT_DEVIATION.sub(lambda m: m.group(1) + "#".rjust(len(m.group(2))), text)


@pytest.fixture
def other_rounding(monkeypatch):
    """einattn.verify as on a CPU that rounds differently: each float comparison's deviation
    becomes another value of rounding noise (0 where it was not, 2.2e-16 where it was 0)."""
    from einattn import verify
    compare = verify._compare

    def rounded_elsewhere(left, right, exact, sides):
        deviation, tolerance, where = compare(left, right, exact, sides)
        if not exact and deviation <= tolerance:
            deviation = 0.0 if deviation else 2.2e-16
        return deviation, tolerance, where
    monkeypatch.setattr(verify, "_compare", rounded_elsewhere)


@pytest.fixture(scope="session")
def site(tmp_path_factory) -> Path:
    """The documentation site, built once per session by ``mkdocs build --strict``."""
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner about its future
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                            str(out)], cwd=Path(__file__).resolve().parents[1], env=env,
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    return out
