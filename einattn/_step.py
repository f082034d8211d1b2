"""``Step``: one registered step of the derivation, as :mod:`einattn.derivation` and the
modules of its parts (:mod:`einattn.pattern_steps`, :mod:`einattn.ring_steps`,
:mod:`einattn.gradient_steps`, :mod:`einattn.field_steps`) register it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Step:
    """``lhs`` equals ``rhs`` at ``sizes``: exactly where ``exact`` (in the finite field where
    both sides are written, else with integers for a multilinear step), else in float64."""

    name: str
    lhs: Any
    rhs: Any
    sizes: dict[str, int]
    exact: bool
    inputs: dict[str, str] = field(default_factory=dict)
    draws: int = 3  # more where the degree is high, to keep the exact bound below 1e-8
    masks: tuple[str, ...] = ()  # tensors drawn as additive masks (0 or −∞)
