"""Rotary position embeddings (RoPE): each pair of a head's channels turned by an angle
that grows with the position.

A head channel ``a`` is split into pairs ``p`` (``a/2`` of them) of two components ``h``.
The pair p of a token at position t turns by the angle ``t·θ_p`` with ``θ_p =
base^(−2p/a)``, one 2×2 rotation ``R[n τ p h k]`` per position and pair:

    (R0)  θ[n τ p] = t[n τ] · base^(−2p/a)
    (R1)  T_rot[n μ τ (h p)] = R[n τ p h k] T[n μ τ (k p)]        "half" (GPT-NeoX, Llama)
    (R2)  T_rot[n μ τ (p h)] = R[n τ p h k] T[n μ τ (p k)]        "interleaved" (RoFormer, GPT-J)

with ``R[n τ p ·  ·] = [[cos θ, −sin θ], [sin θ, cos θ]]``; ``T`` is the queries Q or the
keys K. The two styles differ only in which channels form a pair: the two halves of ``a``
(``a = (h p)``) or neighbours (``a = (p h)``). Because rotations compose, the score of
query position t and key position s depends on ``t − s`` only.
"""

from __future__ import annotations

import math

import torch

from .errors import EinattnError
from .notation import Equation

ANGLES = "θ[n τ p] = t[n τ] · base^(−2p/a)"
ROTATE_HALF = Equation("T_rot[n μ τ (h p)] = R[n τ p h k] T[n μ τ (k p)]")
ROTATE_INTERLEAVED = Equation("T_rot[n μ τ (p h)] = R[n τ p h k] T[n μ τ (p k)]")
STYLES = {"half": ROTATE_HALF, "interleaved": ROTATE_INTERLEAVED}


def check_style(rope: str | None, d_head: int) -> str | None:
    """``rope`` itself, once it is known to be a style that fits heads of ``d_head``."""
    if rope is not None and rope not in STYLES:
        raise EinattnError(f"rope must be None, 'half' or 'interleaved', got {rope!r}")
    if rope is not None and d_head % 2:
        raise EinattnError(f"rope turns pairs of channels, but index 'a' has odd size "
                           f"{d_head} (d_head)")
    return rope


def check_base(base) -> float:
    """``base`` itself, once it is known to be a finite positive number (θ_p = base^(−2p/a))."""
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not 0 < base < math.inf:
        raise EinattnError(f"rope_base must be a finite positive number (the base of "
                           f"θ_p = base^(−2p/a)), got {base!r}")
    return base


def positions_for(positions: torch.Tensor | None, *, n: int, L: int, offset: int,
                  device: torch.device) -> torch.Tensor:
    """Positions ``t[n τ]`` as int64: ``positions`` given as ``(L,)``, ``(1, L)`` or
    ``(n, L)`` integers, or by default ``offset, …, offset + L − 1`` (offset: the tokens
    already cached)."""
    if positions is None:
        return torch.arange(offset, offset + L, device=device).expand(n, L)
    if not isinstance(positions, torch.Tensor) or positions.dtype.is_floating_point \
            or positions.dtype.is_complex or positions.dtype == torch.bool:
        what = positions.dtype if isinstance(positions, torch.Tensor) else \
            type(positions).__name__
        raise EinattnError(f"positions must be an integer tensor t[τ] or t[n τ], got {what}")
    if positions.shape not in ((L,), (1, L), (n, L)):
        raise EinattnError(f"positions has shape {tuple(positions.shape)} but t[τ] or t[n τ] "
                           f"needs ({L},), (1, {L}) or ({n}, {L}) (n={n}, τ={L})")
    return positions.to(device=device, dtype=torch.int64).expand(n, L)


def rotations(t: torch.Tensor, *, d_head: int, base: float,
              dtype: torch.dtype) -> torch.Tensor:
    """``R[n τ p h k]`` from positions ``t[n τ]`` by (R0): angles in float64 for a float64
    model, float32 otherwise (bfloat16 cannot tell position 256 from 257), then cast."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    p = torch.arange(0, d_head, 2, device=t.device, dtype=work)
    theta = t.to(work)[..., None] * base ** (-p / d_head)  # θ[n τ p]
    cos, sin = theta.cos(), theta.sin()
    R = torch.stack([torch.stack([cos, -sin], -1), torch.stack([sin, cos], -1)], -2)
    return R.to(dtype)


def rotate(T: torch.Tensor, R: torch.Tensor, style: str) -> torch.Tensor:
    """Every head of ``T[n μ τ a]`` turned by ``R[n τ p h k]``: ``style="half"`` runs (R1),
    ``T_rot[n μ τ (h p)] = R[n τ p h k] T[n μ τ (k p)]``; ``"interleaved"`` runs (R2),
    ``T_rot[n μ τ (p h)] = R[n τ p h k] T[n μ τ (p k)]``.

    >>> T = torch.tensor([[[[1.0, 0.0]]]])  # one pair (h = 0, 1) at position t = 1
    >>> R = rotations(torch.tensor([[1]]), d_head=2, base=10000.0, dtype=torch.float32)
    >>> torch.allclose(rotate(T, R, "half"), torch.tensor([[[[0.5403, 0.8415]]]]), atol=1e-4)
    True
    """
    return STYLES[style](R=R, T=T)
