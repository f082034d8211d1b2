"""How one pairwise contraction runs: lowered to ``torch.matmul`` where it can be.

An equation is the specification; running it is the engine's business. A contraction of
two operands ``A`` and ``B`` sorts its indices into four kinds: *batch* (in A, B and the
output), *contracted* (in A and B only), *left* (A and the output) and *right* (B and the
output). Then ``C = A[batch left con] @ B[batch con right]``, one matmul, between
permutations chosen once per shape; where B already lies as ``B[right con]`` with no batch
(an ``nn.Linear`` weight such as ``W[(μ B a) i]``) it is ``F.linear(A, B)``. The
contracted indices follow the memory order of the larger operand so that a weight such as
``W_O[μ a i]`` is read as a view, never copied (``torch.einsum`` orders them alphabetically
and copies a weight whose order disagrees).
Whatever cannot be lowered (a repeated index on one operand, an index summed within one
operand) runs through ``torch.einsum``.
"""

from __future__ import annotations

import math
import string
from collections.abc import Callable
from functools import partial
from operator import methodcaller

import torch
import torch.nn.functional as F

from .errors import at

_LETTERS = string.ascii_lowercase + string.ascii_uppercase
Pair = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def contraction(subscripts: str, shapes: list[tuple[int, ...]],
                given: list[tuple[int, ...]] | None = None) -> Callable[..., torch.Tensor]:
    """A function computing ``torch.einsum(subscripts, *operands)`` for operands of
    ``shapes`` (one axis per letter), lowered to matmul for two operands that allow it.

    ``given``: the shapes the operands arrive in, where a group of letters may still be one
    axis (``W[(μ B a) i]`` as a 2-D weight). A lowered pair opens a group only where it
    must permute across it, so a weight that already lies as the matmul reads it is used
    as it is."""
    given = shapes if given is None else given
    inputs, out = subscripts.split("->")
    terms = inputs.split(",")
    if len(terms) == 2:
        lowered = _pair(terms[0], terms[1], out, shapes, given)
        if lowered is not None:
            return lowered
    if given == shapes:
        return partial(torch.einsum, subscripts)
    return lambda *ops: torch.einsum(subscripts, *(t.reshape(shape)
                                                   for t, shape in zip(ops, shapes, strict=True)))


def _pair(a: str, b: str, out: str, shapes, given) -> Pair | None:
    (shape_a, shape_b), (given_a, given_b) = shapes, given
    if len(set(a)) < len(a) or len(set(b)) < len(b):
        return None
    if any(c not in b and c not in out for c in a) or any(c not in a and c not in out for c in b):
        return None
    size = {**dict(zip(a, shape_a, strict=True)), **dict(zip(b, shape_b, strict=True))}
    batch = [c for c in out if c in a and c in b]
    larger = b if math.prod(shape_b) > math.prod(shape_a) else a
    con = [c for c in larger if c in a and c in b and c not in out]
    left = [c for c in a if c not in b]
    right = [c for c in b if c not in a]
    dims = [size[c] for c in batch]
    middle = batch + left + right
    if not batch:  # A keeps its left axes: matmul and F.linear take any leading axes
        A_shape = (*(size[c] for c in left), _prod(con, size))
        plan_a = _arrange(a, left + con, A_shape, shape_a, given_a)
        plan_c = _unarrange(middle, out, tuple(size[c] for c in middle),
                            (*A_shape[:-1], _prod(right, size)))
        if list(b) == right + con:  # B is an nn.Linear weight B[right con]
            plan_b = _arrange(b, right + con, (_prod(right, size), _prod(con, size)), shape_b,
                              given_b)
            return _around(F.linear, plan_a, plan_b, plan_c)
        plan_b = _arrange(b, con + right, (_prod(con, size), _prod(right, size)), shape_b,
                          given_b)
        return _around(torch.matmul, plan_a, plan_b, plan_c)
    plan_c = _unarrange(middle, out, tuple(size[c] for c in middle),
                        (*dims, _prod(left, size), _prod(right, size)))
    plan_a = _arrange(a, batch + left + con, (*dims, _prod(left, size), _prod(con, size)),
                      shape_a, given_a)
    plan_b = _arrange(b, batch + con + right, (*dims, _prod(con, size), _prod(right, size)),
                      shape_b, given_b)
    return _around(torch.matmul, plan_a, plan_b, plan_c)


def _around(op: Pair, plan_a: Callable, plan_b: Callable, plan_c: Callable) -> Pair:
    """``plan_c(op(plan_a(A), plan_b(B)))``, leaving out the plans that change nothing (the
    per-call cost at small sizes is the number of Python calls)."""
    if plan_a is same:
        inner = op if plan_b is same else (lambda A, B: op(A, plan_b(B)))
    else:
        inner = (lambda A, B: op(plan_a(A), B)) if plan_b is same else \
            (lambda A, B: op(plan_a(A), plan_b(B)))
    return inner if plan_c is same else (lambda A, B: plan_c(inner(A, B)))


def _prod(indices: list[str], size: dict[str, int]) -> int:
    return math.prod(size[c] for c in indices)


def _arrange(have: str, want: list[str], shape: tuple[int, ...], atomic: tuple[int, ...],
             current: tuple[int, ...]) -> Callable:
    """Permute axes from ``have`` to ``want`` order, then reshape to ``shape``. The operand
    arrives in shape ``current``; its groups are opened (to ``atomic``, one axis per index)
    only for a permutation, and no call at all is made where it already is as wanted.

    Here and in ``_unarrange`` sizes go to torch unpacked: its argument parser takes
    ``reshape(2, 5, 16)`` about 0.5 µs faster than ``reshape((2, 5, 16))``, a tenth of a
    small contraction. A single step is an ``operator.methodcaller``, which runs without a
    Python frame of its own."""
    order = tuple(have.index(c) for c in want)
    if order == tuple(range(len(order))):  # ``shape`` is never empty: it holds the matmul's axes
        return same if tuple(current) == shape else methodcaller("reshape", *shape)
    opened = tuple(current) != tuple(atomic)
    if tuple(atomic[k] for k in order) == shape:  # the permutation alone gives the shape
        return (lambda t: t.reshape(*atomic).permute(*order)) if opened else \
            methodcaller("permute", *order)
    if opened:
        return lambda t: t.reshape(*atomic).permute(*order).reshape(*shape)
    return lambda t: t.permute(*order).reshape(*shape)


def _unarrange(have: list[str], want: str, shape: tuple[int, ...],
               current: tuple[int, ...]) -> Callable:
    """Reshape a matmul result (of shape ``current``) to one axis per index of ``have``,
    then permute to ``want``; no call at all for a step that would change nothing."""
    order = tuple(have.index(c) for c in want)
    if order != tuple(range(len(order))):
        if current == shape:
            return methodcaller("permute", *order)
        return lambda t: t.reshape(*shape).permute(*order)
    if current == shape:
        return same
    return methodcaller("reshape", *shape) if shape else methodcaller("reshape", ())  # a scalar


def same(t: torch.Tensor) -> torch.Tensor:
    """The identity: the step that changes nothing (recognised by ``is``, and left out)."""
    return t


def assign_letters(parsed, text: str) -> dict[str, str]:
    """Index name -> einsum letter: one-letter ASCII names keep their letter, others
    (Greek, multi-letter) take the first free one. torch.einsum takes only ASCII."""
    terms = (parsed.output, *parsed.operands)
    names = list(dict.fromkeys(i for t in terms for i in t.indices))
    taken = {n for n in names if len(n) == 1 and n in _LETTERS}
    free = iter(c for c in _LETTERS if c not in taken)
    mapping = {}
    for n in names:
        if n in taken:
            mapping[n] = n
        else:
            letter = next(free, None)
            if letter is None:
                raise at(f"too many indices: einsum has {len(_LETTERS)} letters", text)
            mapping[n] = letter
    return mapping

