"""What :mod:`einattn.verify` reads from a side of a step, whatever it is: an
:class:`~einattn.Equation`, a :class:`~einattn.chain.Chain`, autograd's gradient of one
(:class:`einattn._gradient_check.Autograd`), or a Python function of tensors.

An equation, a chain and an autograd side are *written*: they name their tensors (``terms``,
``scalars``), their output (``lhs``) and what they compute, so that they can be run, sized
and, in the finite field, evaluated; a Python function says only what its parameters and
optional attributes (``degree``, ``output_indices``) say.
"""

from __future__ import annotations

import inspect

import torch

from .errors import SidesDiffer
from .notation import Equation


def written(side) -> bool:
    """Whether ``side`` names its tensors: an equation, a chain, an autograd side."""
    return isinstance(side, Equation) or hasattr(side, "field_value")


def text(side) -> str:
    """How a side is shown: its equations, or a function's qualified name."""
    if written(side):
        return side.text
    return getattr(side, "__qualname__", repr(side))


def degree(side) -> int | None:
    """A side's degree as a polynomial of its tensors, where it says: an equation's number
    of operands, a chain's or an autograd side's own ``degree``, a callable's attribute."""
    return len(side.terms) if isinstance(side, Equation) else getattr(side, "degree", None)


def equations(side) -> tuple:
    """The equations a written side runs: its own, a chain's, or the forward autograd
    differentiates."""
    return (side,) if isinstance(side, Equation) else side.equations


def output_indices(side) -> tuple[str, ...] | None:
    """The indices that name a side's output axes, where it has them (no groups)."""
    if written(side):
        return None if side.lhs.grouped else side.lhs.indices
    return getattr(side, "output_indices", None)


def not_multilinear(side) -> str:
    """Why integer arithmetic cannot check ``side`` exactly, or "" where it can (a callable
    is taken at its word, its ``not_multilinear`` attribute, until it returns floats)."""
    if not written(side):
        return getattr(side, "not_multilinear", "")
    if not side.is_contraction:
        return f"{side.text} applies functions (it is no contraction)"
    if side.scale is not None:
        return f"{side.text} divides by √{side.scale}, which is irrational in general"
    return ""


def evaluated(side, tensors: dict[str, torch.Tensor], sizes: dict[str, int]) -> torch.Tensor:
    """A side on the drawn tensors (an equation also gets the sizes of its indices)."""
    if written(side):
        known = {k: v for k, v in sizes.items() if k in side.indices}
        names = (*side.operands, *getattr(side, "scalars", ()))
        return side(**{n: tensors[n] for n in names}, **known)
    parameters = inspect.signature(side).parameters
    takes_all = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    return side(**{k: v for k, v in tensors.items() if takes_all or k in parameters})


def same_shapes(left, right, sides) -> None:
    """Raise :class:`~einattn.errors.SidesDiffer` unless the sides' values have one shape."""
    if left.shape != right.shape:
        raise SidesDiffer(f"the sides have different shapes: {tuple(left.shape)} from "
                          f"{text(sides[0])} but {tuple(right.shape)} from {text(sides[1])}")
