"""Attention temperature (Llama 4's NoPE layers): the queries scaled by a factor that grows
with the logarithm of the position, so that attention stays sharp over long contexts::

    (T1) F[n τ]       = ⌊(t[n τ] + 1) / f⌋                          f: floor_scale
    (T2) β[n τ]       = 1 + α · log(1 + F[n τ])                       α: attn_scale
    (T3) Q_t[n μ τ a] = β[n τ] Q[n μ τ a]

``t`` is the token's index in the sequence, counted from its first position, cached tokens
included, as Llama 4 counts it (its ``cache_position``): ``0 … L−1`` without a cache,
``len(cache) …`` with one, whatever ``positions=`` gives RoPE. Under left padding the pads
count, as they do in Llama 4's own layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import EinattnError
from .notation import Equation

FACTOR = Equation("β[n τ] = 1 + α · log(1 + F[n τ])")  # (T2)
SCALED = Equation("Q_t[n μ τ a] = β[n τ] Q[n μ τ a]")  # (T3)


@dataclass(frozen=True)
class Temperature:
    """Llama 4's ``floor_scale`` (f) and ``attn_scale`` (α)."""

    floor_scale: float
    attn_scale: float

    def __post_init__(self) -> None:
        for name in ("floor_scale", "attn_scale"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0 < value < float("inf"):
                raise EinattnError(f"Temperature's {name} must be a finite positive number, "
                                   f"got {value!r}")


def factor(t: torch.Tensor, temperature: Temperature, dtype: torch.dtype) -> torch.Tensor:
    """(T1), (T2): ``β[n τ] = 1 + α · log(1 + F[n τ])`` at the indices ``t[n τ]``, with
    ``F[n τ] = ⌊(t[n τ] + 1) / f⌋``."""
    F = torch.floor((t.to(dtype) + 1) / temperature.floor_scale)
    return FACTOR(F=F, α=temperature.attn_scale)


def indices(cache, n: int, L: int, device) -> torch.Tensor:
    """``t[n τ]``: the call's tokens' indices in the sequence, after the cached ones."""
    positions, offset = (None, 0) if cache is None else cache.placed(None, L, device)
    if positions is None:
        positions = torch.arange(offset, offset + L, device=device)
    return positions.expand(n, L)


def scaled(Q: torch.Tensor, t: torch.Tensor, temperature: Temperature) -> torch.Tensor:
    """(T3): ``Q_t[n μ τ a] = β[n τ] Q[n μ τ a]``."""
    return SCALED(β=factor(t, temperature, Q.dtype), Q=Q)
