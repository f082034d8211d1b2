"""The one exception family of einattn.

Every check of user input raises :class:`EinattnError` (a ``ValueError``), so callers can
catch einattn's complaints without catching the backend's. Messages name the index, the
tensor and both sizes; where an equation is involved they show it with a caret under the
place that is wrong.
"""

from __future__ import annotations


class EinattnError(ValueError):
    """Bad input to einattn: a size, shape, dtype, mask or equation that does not fit."""


class SidesDiffer(EinattnError):
    """The two sides of a derivation step give tensors of different shapes."""


def at(message: str, text: str, *positions: int) -> EinattnError:
    """An error whose message shows ``text`` with carets under ``positions``.

    >>> print(at("index 'a' differs", "S[τ σ] = Q[τ a] K[σ a]", 13))
    index 'a' differs
      S[τ σ] = Q[τ a] K[σ a]
                   ^
    """
    marks = [" "] * (max(positions, default=-1) + 1)
    for p in positions:
        marks[p] = "^"
    caret = "".join(marks).rstrip()
    lines = [message, "  " + text]
    if caret:
        lines.append("  " + caret)
    return EinattnError("\n".join(lines))
