"""Index sizes by name: each index's size read from the tensors that carry it (an axis, or
a group ``(μ B a)`` whose length is the product of its indices' sizes) and from keyword
sizes, every disagreement an error that names the index, both tensors and both sizes,
with a caret under each place in the equation."""

from __future__ import annotations

import math

from . import _delta
from .errors import at


class Sizes:
    """What an equation (:class:`einattn._contraction.Contraction`) resolves its sizes
    with; it reads the equation's ``text``, ``_parsed`` and ``_letters``."""

    def _resolve(self, shapes: dict[str, tuple[int, ...]], given: dict[str, int]) -> dict[str, int]:
        """The size of every index, checked by name across tensors, groups and keywords."""
        sizes = dict(given)
        source = {k: ("", -1) for k in given}
        groups = []
        for term in self._parsed.operands:
            shape = shapes.get(term.name)
            if shape is None:  # a delta not made yet: its indices are sized elsewhere
                continue
            if len(shape) == len(term.indices):  # every axis its own index (groups opened)
                pairs = [((i,), (p,), n)
                         for i, p, n in zip(term.indices, term.positions, shape, strict=True)]
            elif len(shape) == len(term.axes):
                pairs = [(a.indices, a.positions, n) for a, n in zip(term.axes, shape, strict=True)]
            else:
                also = f" (or {len(term.indices)} with its groups opened)" if term.grouped else ""
                raise at(f"{term.name} has {len(shape)} axes {tuple(shape)} but "
                         f"{term.text()} has {len(term.axes)}{also}", self.text, term.position)
            for indices, positions, n in pairs:
                if len(indices) == 1:
                    self._settle(sizes, source, indices[0], n, term.name, positions[0])
                else:
                    groups.append((term, indices, positions, n))
        self._solve_groups(groups, sizes, source)
        sizes = _delta.squared(self._parsed.operands, sizes)
        for index in (i for i in self._letters if i not in sizes):
            raise at(f"index {index!r} is on δ alone: give its size as a keyword, {index}=...",
                     self.text, *(p for t in self._parsed.operands if _delta.is_delta(t.name)
                                  for i, p in zip(t.indices, t.positions, strict=True)
                                  if i == index))
        return {i: sizes[i] for i in self._letters}


    def _settle(self, sizes, source, index, n, tensor, pos) -> None:
        if index not in sizes:
            sizes[index], source[index] = n, (tensor, pos)
            return
        if sizes[index] != n:
            where, first_pos = source[index]
            where = (f"{index}={sizes[index]} was given" if first_pos < 0
                     else f"{sizes[index]} in {where}")
            raise at(f"index {index!r} has size {n} in {tensor} but {where}",
                     self.text, *(p for p in (pos, first_pos) if p >= 0))

    def _solve_groups(self, groups, sizes, source) -> None:
        pending = list(groups)
        while pending:
            progress = []
            for group in pending:
                term, indices, positions, n = group
                unknown = [i for i in indices if i not in sizes]
                if len(unknown) > 1:
                    continue
                known = math.prod([sizes[i] for i in indices if i in sizes])  # a list: dynamo
                label = f"group ({' '.join(indices)}) of {term.name}"
                product = "·".join([f"{i}={sizes[i]}" for i in indices if i in sizes])
                if not unknown and known != n:
                    raise at(f"{label} has length {n} but {product} gives {known}",
                             self.text, *positions)
                divisor = f"{product} = {known}" if "·" in product else product
                if unknown and n == known == 0:  # 0 = 0 · anything
                    raise at(f"{label} has length 0, and with {divisor} any size of "
                             f"{unknown[0]} fits: give it as a keyword, {unknown[0]}=...",
                             self.text, *positions)
                if unknown and (known == 0 or n % known):
                    raise at(f"{label} has length {n}, not divisible by {divisor}",
                             self.text, *positions)
                if unknown:
                    k = indices.index(unknown[0])
                    sizes[unknown[0]] = n // known
                    source[unknown[0]] = (term.name, positions[k])
                progress.append(group)
            if not progress:
                term, indices, positions, n = pending[0]
                unknown = [i for i in indices if i not in sizes]
                raise at(f"cannot infer the sizes of {', '.join(unknown)} in group "
                         f"({' '.join(indices)}) of {term.name} (length {n}): give all but one "
                         f"as keywords, e.g. {unknown[0]}=...", self.text, *positions)
            pending = [g for g in pending if g not in progress]
