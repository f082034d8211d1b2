"""Shared helpers for the test suite: seeded tensors, weights in both layouts, tolerances."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# The suite runs thousands of operations on tiny tensors, where intra-op threads cost more
# than they save (and, on a busy machine, far more): one thread keeps it fast and steady.
torch.set_num_threads(1)

# Equality proofs: float64 at ≤1e-12 relative to scale (STYLE §5); float32 at 1e-5.
TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float64,
          requires_grad: bool = False) -> torch.Tensor:
    """A reproducible standard-normal tensor that does not touch the global RNG."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
    return t.requires_grad_(requires_grad)


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
