"""The Kronecker delta, built into the notation: ``δ[i j …]`` is 1 where its indices are all
equal and 0 elsewhere, ``δ[i]`` is 1 (it carries ``i``: a broadcast along it). An equation
makes its deltas itself from the sizes of their indices, read from its other tensors or
given as keywords (``σ=5`` for an index that only a delta carries), so that
``dX[τ τʹ] = dY[τ] δ[τ τʹ]``, the gradient of a diagonal, runs given ``dY`` alone.

Inside an equation each delta is an operand of its own, named ``δ:k`` for its place ``k``
among the terms (two deltas are two tensors, of their own shapes).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ._expression import Call, Product, Sum, Tensor
from ._syntax import Term
from .errors import at

NAME = "δ"


def is_delta(name: str) -> bool:
    return name == NAME or name.startswith(NAME + ":")


def numbered(terms: tuple[Term, ...], text: str) -> tuple[Term, ...]:
    """``terms`` with each delta named after its place, ``δ:k`` (one index per axis)."""
    found = []
    for k, term in enumerate(terms):
        if term.name == NAME:
            if term.grouped:
                raise at("δ takes single indices, no group", text, term.position)
            term = replace(term, name=f"{NAME}:{k}")
        found.append(term)
    return tuple(found)


def tensor(sizes: list[int], like: torch.Tensor | None) -> torch.Tensor:
    """``δ`` of axes of ``sizes``, in the dtype and on the device of ``like``."""
    options = {} if like is None else {"dtype": like.dtype, "device": like.device}
    equal = torch.ones(sizes, dtype=torch.bool, device=options.get("device"))
    for k in range(1, len(sizes)):
        shape = [1] * len(sizes)
        first, other = shape.copy(), shape.copy()
        first[0], other[k] = sizes[0], sizes[k]
        device = options.get("device")
        equal = equal & (torch.arange(sizes[0], device=device).reshape(first)
                         == torch.arange(sizes[k], device=device).reshape(other))
    return equal.to(options.get("dtype", torch.float64))


def squared(terms, sizes: dict[str, int]) -> dict[str, int]:
    """``sizes`` and the size of each index that only a delta carries where another index
    of that delta has one: a delta is square (``δ[τ τʹ]`` of a diagonal, τʹ as τ)."""
    sizes = dict(sizes)
    for term in (t for t in terms if is_delta(t.name)):
        known = [sizes[i] for i in term.indices if i in sizes]
        sizes |= {i: known[0] for i in term.indices if known and i not in sizes}
    return sizes


def tensors(terms: tuple[Term, ...], sizes: dict[str, int],
            like: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Each delta among ``terms``, by its inner name."""
    sizes = squared(terms, sizes)
    return {t.name: tensor([sizes[i] for i in t.indices], like)
            for t in terms if is_delta(t.name)}


def numbered_tree(node, text: str, count: list[int] | None = None):
    """An expression tree (:mod:`einattn._expression`) with its deltas numbered as
    :func:`numbered` numbers a product's: by their place among the tree's terms, in the
    order :func:`einattn._expression.walk` meets them."""
    count = [0] if count is None else count
    if isinstance(node, Tensor):
        k, count[0] = count[0], count[0] + 1
        if node.term.name != NAME:
            return node
        (term,) = numbered((node.term,), text)
        return replace(node, term=replace(term, name=f"{NAME}:{k}"))
    if isinstance(node, Call):
        return replace(node, arguments=tuple(numbered_tree(a, text, count)
                                             for a in node.arguments))
    if isinstance(node, Sum):
        return replace(node, terms=tuple(numbered_tree(t, text, count) for t in node.terms))
    if isinstance(node, Product):
        factors = tuple(numbered_tree(f, text, count) for f in node.factors)
        return replace(node, factors=factors,
                       divisors=tuple(numbered_tree(d, text, count) for d in node.divisors))
    return node
