"""Checks of the options that the functional form and the layer both take: each says what
the option means and what it got."""

from __future__ import annotations

import math

from .errors import EinattnError

IMPLS = ("einsum", "sdpa", "chunked", "flex")


def check_impl(impl: str) -> str:
    """``impl`` itself, once it is known to name one of :data:`IMPLS`."""
    if impl not in IMPLS:
        raise EinattnError(f"impl must be one of {', '.join(map(repr, IMPLS))}, got {impl!r}")
    return impl


def check_scale(scale) -> float:
    """``scale`` itself, once it is known to be a finite positive number."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) \
            or not 0 < scale < math.inf:
        raise EinattnError(f"scale (s in S = s · Q K, 1/√a by default) must be a finite "
                           f"positive number, got {scale!r}")
    return scale


def check_positive_int(name: str, value) -> int:
    """``value`` itself, once it is known to be an int ≥ 1 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise EinattnError(f"{name} must be a positive int, got {value!r}")
    return value
