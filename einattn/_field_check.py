"""The finite-field mode of :func:`einattn.verify.check_equivalent`: both sides evaluated
over ``Z_p`` (:mod:`einattn._field_eval`) at independent random points, compared entry by
entry, and the chance that a false step passed bounded.

The bound is Schwartz–Zippel's: a nonzero polynomial of degree ``D`` vanishes at a random
point of ``S^k`` with probability at most ``D/|S|``. Here every drawn value is uniform in
``Z_p``, and every drawn exponent ``x`` (and each free maximum) is uniform in ``Z_q``, so that
``g^x`` is uniform in the ``q`` squares: ``|S| ≥ q``. Each entry of ``lhs − rhs`` is a
rational function of those; ``D`` bounds the degree of its numerator and of every
polynomial inverted on the way (a divisor that vanishes at the draw leaves the field), from
:class:`~einattn._field_tensor.Degree`. A draw passes a false step with probability at most
``D/q``, and ``draws`` independent draws at most ``(D/q)^draws``. The argument needs the
difference to stay nonzero when its coefficients are read modulo ``p``: a coefficient
divisible by ``p`` (about 2·10⁹) would vanish, which no step written with small integers or
decimals has.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _sides
from ._expression import Product, walk
from ._field import field_for
from ._field_eval import CURRENT, Draw, evaluate
from ._field_tensor import FieldTensor, Missing, Values, mask


@dataclass(frozen=True)
class FieldResult:
    """One comparison in the field: whether every entry agreed on every draw; on the draw
    where most disagreed, how many did and the first of them; the prime, the bound."""

    equal: bool
    differing: int
    flat: int  # the first differing entry (row-major), or 0
    shape: tuple[int, ...]
    prime: int
    bound: float


def roots(sides: list, sizes: dict[str, int]) -> set[int]:
    """The sizes whose square roots the sides divide by (one ``sizes`` lacks is reported
    where its tensor is drawn)."""
    found = set()
    for side in sides:
        for equation in _sides.equations(side):
            tree = getattr(equation, "_tree", None)
            nodes = [] if tree is None else walk(tree.right)
            named = [equation.scale, *(n.root for n in nodes if isinstance(n, Product))]
            found |= {sizes[i] for i in named if i is not None and i in sizes}
    return found


def compare(sides: list, sizes: dict[str, int], signature: dict, masks, seed: int,
            draws: int) -> FieldResult | str:
    """The sides compared in the field over ``draws`` draws, or why they cannot be (a form
    that does not exist, a name read both as a value and as an exponent)."""
    F = field_for(roots(sides, sizes))
    generator = torch.Generator().manual_seed(seed)
    bound, worst = 1.0, None
    for _ in range(draws):
        left, right = _evaluated(sides, Draw(F, generator), signature, masks, sizes)
        chosen = _chosen(left, right)
        if isinstance(chosen, str):
            return chosen
        a, b, degree = chosen
        bound *= min(1.0, degree / F.q)
        _sides.same_shapes(a, b, sides)
        differ = (a != b).reshape(-1)
        count = int(differ.sum())
        if worst is None or count > worst[0]:
            worst = (count, int(differ.int().argmax()) if count else 0, tuple(a.shape))
    count, flat, shape = worst
    return FieldResult(count == 0, count, flat, shape, F.p, bound)


def _evaluated(sides: list, draw: Draw, signature: dict, masks, sizes: dict[str, int]):
    """Both sides on one draw: each tensor drawn once, by name (a mask as 0/1 multipliers),
    on the CPU whatever torch's default device (integer products)."""
    token = CURRENT.set(draw)
    try:
        with torch.device("cpu"):
            env = {name: _mask(draw, name, shape_of(sizes)) if name in masks
                   else draw.tensor(name, shape_of(sizes))
                   for name, shape_of in signature.items()}
            return [evaluate(side, env, sizes) for side in sides]
    finally:
        CURRENT.reset(token)


def _mask(draw: Draw, name: str, shape: tuple[int, ...]) -> FieldTensor:
    return mask(draw.field, name, mask_draw(shape, draw.generator))


def mask_draw(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """0/1 at random, each entry kept with probability 1/2 and at least one kept in each
    row along the last axis (so that no softmax row is left empty)."""
    kept = torch.randint(0, 2, shape, generator=generator, dtype=torch.int64)
    if shape and shape[-1]:
        one = torch.randint(0, shape[-1], (*shape[:-1], 1), generator=generator)
        kept.scatter_(-1, one, 1)
    return kept


def _chosen(left: FieldTensor, right: FieldTensor):
    """The forms to compare, and the degree of their difference: the values where both
    sides have them, else the exponents' ``exp`` (``exp`` is one to one on the reals); or
    why neither will do."""
    why = []
    for a, b in ((left.values, right.values), (left.exp().values, right.exp().values)):
        missing = next((r for r in (a, b) if isinstance(r, Missing)), None)
        if missing is not None:
            why.append(missing.why)
            continue
        both = _conflict(a, b)
        if both:
            why.append(f"{both} is read both as a value and inside exp (its value and its "
                       f"exponent are drawn apart)")
            continue
        return a.t, b.t, a.degree.plus(b.degree).total()
    return why[0]


def _conflict(a: Values, b: Values) -> str:
    names = (a.uses[0] | b.uses[0]) & (a.uses[1] | b.uses[1])
    return ", ".join(sorted(names))
