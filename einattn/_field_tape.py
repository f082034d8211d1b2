"""Reverse mode in the finite field: autograd's vector–Jacobian product of an evaluation of
:class:`~einattn._field_tensor.FieldTensor` s, exactly.

Each operation on a tensor that depends on the one differentiated keeps its ``parents``,
each with the rule that takes its cotangent to the parent's (``g · b`` for a factor ``a`` of
``a·b``, ``−g / a²`` for ``1/a``, ``g · exp(x)`` for ``exp(x)``, ``g / x`` for ``log(x)``, ``g``
broadcast back for a sum, the other factors contracted for a contraction). :func:`backward`
runs them from the output down, as ``torch.autograd`` does, in ``Z_p``: the same derivative
rules, applied to residues, so that the gradient is the image of the true one. A rule that
needs a value the field has not (a logarithm's) gives :class:`Missing`, and so does the
gradient.
"""

from __future__ import annotations

import torch

from ._field import Field, Missing


def link(*pairs) -> tuple:
    """The ``(parent, rule)`` pairs whose parent depends on what is differentiated."""
    return tuple((parent, rule) for parent, rule in pairs if parent.tracked)


def unbroadcast(F: Field, g: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A cotangent ``g`` of a broadcast result summed back to an operand of ``shape``."""
    extra = g.ndim - len(shape)
    if extra:
        g = g.sum(tuple(range(extra)))
    dims = tuple(k for k, n in enumerate(shape) if n == 1 and g.shape[k] != 1)
    if dims:
        g = g.sum(dims, keepdim=True)
    return g % F.p


def times(F: Field, factor, shape: tuple[int, ...], sign: int = 1):
    """The rule ``g ↦ ±g · factor`` (summed back to ``shape``), or one that gives
    ``factor`` where it is :class:`~einattn._field.Missing`."""
    if not isinstance(factor, torch.Tensor):
        return lambda g: factor
    return lambda g: unbroadcast(F, sign * g * factor % F.p, shape)


def backward(out, seed: torch.Tensor, leaf):
    """``Σ seed · ∂out/∂leaf``: each rule from ``out`` down, cotangents added where paths
    meet; a :class:`~einattn._field_tensor.Missing` where a rule has no value to use."""
    F = out.field
    order, seen = [], set()
    stack = [(out, False)]
    while stack:  # depth first, each tensor after every one it feeds
        node, done = stack.pop()
        if done:
            order.append(node)
        elif id(node) not in seen:
            seen.add(id(node))
            stack += [(node, True), *((p, False) for p, _ in node.parents)]
    grads = {id(out): torch.broadcast_to(seed, out.shape) % F.p}
    for node in reversed(order):
        g = grads.pop(id(node), None) if node is not leaf else None
        for parent, rule in () if g is None else node.parents:
            part = rule(g)
            if not isinstance(part, torch.Tensor):
                return part
            grads[id(parent)] = (grads.get(id(parent), 0) + part) % F.p
    found = grads.get(id(leaf))
    return torch.zeros(leaf.shape, dtype=torch.int64) if found is None else \
        torch.broadcast_to(found, leaf.shape)


def contraction_rule(F: Field, subscripts: str, factors: list, k: int):
    """The rule of factor ``k`` of ``einsum(subscripts, *factors)``: the cotangent contracted
    with the other factors down to factor ``k``'s letters, broadcast along a letter only it
    has, and put on the diagonal where it repeats a letter (``δ``)."""
    inputs, out = subscripts.split("->")
    terms = inputs.split(",")
    mine = terms[k]
    others = [(t, f.value()) for j, (t, f) in enumerate(zip(terms, factors, strict=True))
              if j != k]
    missing = next((v for _, v in others if isinstance(v, Missing)), None)
    if missing is not None:
        return lambda g: missing
    first = {c: mine.index(c) for c in mine}
    reached = "".join(c for p, c in enumerate(mine) if first[c] == p
                      and (c in out or any(c in t for t, _ in others)))
    shape = factors[k].shape

    def rule(g: torch.Tensor) -> torch.Tensor:
        part = F.contract(",".join([out, *(t for t, _ in others)]) + f"->{reached}", g,
                          *(v for _, v in others))
        part = part.reshape([n if c in reached and first[c] == p else 1
                             for p, (c, n) in enumerate(zip(mine, shape, strict=True))])
        part = part.expand(shape)
        for p, c in enumerate(mine):
            if first[c] != p:  # a repeated letter: only its diagonal
                part = part * _equal(shape, first[c], p)
        return part % F.p
    return rule


def _equal(shape, a: int, b: int) -> torch.Tensor:
    """1 where the indices at axes ``a`` and ``b`` are equal, broadcast to ``shape``."""
    first, second = [1] * len(shape), [1] * len(shape)
    first[a], second[b] = shape[a], shape[b]
    return (torch.arange(shape[a]).reshape(first) == torch.arange(shape[b]).reshape(second)).long()
