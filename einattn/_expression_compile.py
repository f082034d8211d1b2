"""The meaning of an equation of the expression language, compiled into closures.

Every node of the tree (:mod:`einattn._expression`) carries indices, known from the text
alone: a term its own; a sum, an elementwise function or ``max(x, y)`` the union of its
arguments' (broadcast by index name, never by position); ``softmax_σ`` its argument's;
``logsumexp_σ``, ``max_σ`` and ``sum_σ`` their argument's but σ. A product sums, as
Einstein's convention says, the indices of its factors that nothing outside it has (not
the left side, not an enclosing function's axis, not an index another factor of an
enclosing product carries, one that factor's own reduction binds excepted): such a
product is a contraction, an inner equation that the algebra runs; a product that sums
nothing is an entrywise one. A term outside a product must have only indices that
something outside it has: nothing is summed silently, and nothing survives that the left
side does not name.

What the closures compute with is an :class:`Algebra`: torch tensors
(:mod:`einattn._expression_run`), or a finite field (:mod:`einattn._field_eval`), so that
both read one tree by the same rules.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._expression import Call, Node, Number, Product, Scalar, Sum, Tensor, children, walk
from ._lowering import same
from .errors import at

Run = Callable[[dict, dict], Any]  # (arguments, sizes) -> the node's value


@dataclass(frozen=True)
class Algebra:
    """What compiled closures compute with: each entry makes the function of one node."""

    elementwise: Callable[[Call, bool, str], Callable]  # (node, whether a tensor reaches
    # it, its text) -> f(x) or f(x, y)
    along: Callable[[Call, str], Callable]  # (node, its argument's text) -> f(x), axis last
    contraction: Callable[[str, tuple[str, ...]], tuple[Callable, Any]]  # (text, groups) ->
    # (f(given, sizes), the inner equation where there is one, for explain)
    number: Callable[[Number], Any]  # a number's value
    root: Callable[[Any, int], Any]  # (value, n) -> value / √n
    opened: Callable[[Any, Any, dict], Any]  # (value, term, sizes) -> its groups opened


@dataclass(frozen=True)
class Compiled:
    """A node made runnable: its value's axes are ``indices``, in that order."""

    indices: tuple[str, ...]
    run: Run


@dataclass(frozen=True)
class Stage:
    """One operation that runs, for :meth:`Expression.explain`."""

    kind: str  # "contraction", "entrywise", "softmax" or "reduction"
    text: str  # the part of the equation it computes
    indices: tuple[str, ...]  # its result's
    equation: Any = None  # a contraction's own equation, where the algebra has one


def _free(node: Node) -> set[str]:
    """The indices ``node`` may carry to its neighbours in a product, from the text alone:
    its terms' indices less those its reductions bind (``sum_a(z[a])`` carries none)."""
    if isinstance(node, Tensor):
        return set(node.term.indices)
    if isinstance(node, Call) and node.axis is not None and node.function != "softmax":
        return _free(node.arguments[0]) - {node.axis}
    return set().union(*map(_free, children(node)))


class Compiler:
    """Compiles a tree into closures of ``algebra``, checking what the text alone decides."""

    def __init__(self, text: str, algebra: Algebra):
        self.text = text
        self.algebra = algebra
        self.stages: list[Stage] = []
        self.names = 0  # placeholders of the inner equations: _0, _1, …

    def equation(self, output, right: Node) -> Run:
        """The right side as one closure whose value has the left side's axes."""
        compiled = self.node(right, frozenset(output.indices))
        for index, pos in zip(output.indices, output.positions, strict=True):
            if index not in compiled.indices:
                where = ("is on no tensor" if all(index not in t.term.indices for t in
                                                  walk(right) if isinstance(t, Tensor))
                         else "is reduced away on the right")
                raise at(f"output index {index!r} {where}", self.text, pos)
        for index in compiled.indices:
            if index not in output.indices:
                raise at(f"index {index!r} survives on the right but is not on the left: "
                         f"reduce it (sum_{index}, max_{index}, …) or put it on the left",
                         self.text, *(p for t in walk(right) if isinstance(t, Tensor)
                                      for i, p in zip(t.term.indices, t.term.positions,
                                                      strict=True) if i == index))
        run = _then(compiled.run, _aligned(compiled.indices, output.indices))
        if not output.grouped:
            return run
        shape = [axis.indices for axis in output.axes]
        return lambda arguments, sizes: run(arguments, sizes).reshape(
            *[math.prod([sizes[i] for i in axis]) for axis in shape])

    def node(self, node: Node, visible: frozenset, in_product: bool = False) -> Compiled:
        """Any node, seeing the indices in ``visible`` as held outside it."""
        if isinstance(node, Tensor):
            return self.tensor(node, visible, in_product)
        if isinstance(node, Scalar):
            name = node.name
            return Compiled((), lambda arguments, sizes: arguments[name])
        if isinstance(node, Number):
            value = self.algebra.number(node)
            return Compiled((), lambda arguments, sizes: value)
        if isinstance(node, Sum):
            return self.sum(node, visible)
        if isinstance(node, Product):
            return self.product(node, visible)
        return self.call(node, visible)

    def tensor(self, node: Tensor, visible: frozenset, in_product: bool) -> Compiled:
        """A term: outside a product, each of its indices held outside, none repeated."""
        term = node.term
        if not in_product:
            repeated = [p for i, p in zip(term.indices, term.positions, strict=True)
                        if term.indices.count(i) > 1]
            if repeated:
                raise at(f"{term.name} repeats an index: a diagonal is a contraction's, "
                         f"write it as a product", self.text, *repeated)
            for index, pos in zip(term.indices, term.positions, strict=True):
                if index not in visible:
                    raise at(f"index {index!r} of {term.name} is on neither the left nor a "
                             f"function's axis: only a product sums (Einstein's convention), "
                             f"elsewhere write sum_{index}(…)", self.text, pos)
        name, opened = term.name, self.algebra.opened
        if not term.grouped:
            return Compiled(term.indices, lambda arguments, sizes: arguments[name])
        return Compiled(term.indices, lambda arguments, sizes: opened(
            arguments[name], term, sizes))

    def sum(self, node: Sum, visible: frozenset) -> Compiled:
        """Terms added and subtracted, broadcast by index name."""
        parts = [self.node(t, visible) for t in node.terms]
        indices = _union(p.indices for p in parts)
        runs = [_then(p.run, _aligned(p.indices, indices)) for p in parts]
        return self.stage("entrywise", node, indices, _sum_run(runs, node.signs))

    def product(self, node: Product, visible: frozenset) -> Compiled:
        """Factors over divisors: a contraction where it sums an index (Einstein's
        convention), else entrywise, times its scalars, over its divisors and root."""
        held = [_free(f) for f in node.factors]  # a factor sees what the others carry
        factors = [(f, self.node(f, visible.union(*held[:k], *held[k + 1:]), in_product=True))
                   for k, f in enumerate(node.factors)]
        tensors = [(f, c) for f, c in factors if not isinstance(f, (Scalar, Number))]
        numbers = [c for f, c in factors if isinstance(f, (Scalar, Number))]
        summed = {i for _, c in tensors for i in c.indices} - visible
        contracted = summed or any(len(set(c.indices)) < len(c.indices) for _, c in tensors)
        top = [self.contraction(node, tensors, visible)] if contracted else \
            [c for _, c in tensors]
        divisors = [self.node(d, visible) for d in node.divisors]
        if contracted and not numbers and not divisors:
            return top[0]
        indices = _union([*(c.indices for c in top), *(d.indices for d in divisors)])
        runs = [[_then(c.run, _aligned(c.indices, indices)) for c in group]
                for group in ([*numbers, *top], divisors)]
        root = None if contracted else node.root  # a contraction divides by it itself
        return self.stage("entrywise", node, indices,
                          _product_run(*runs, root, self.algebra.root))

    def contraction(self, node: Product, tensors: list, visible: frozenset) -> Compiled:
        """The factors that carry indices as one inner equation, with the product's root."""
        kept = tuple(i for i in _union(c.indices for _, c in tensors) if i in visible)
        parts, feeds, grouped = [], [], set()
        for factor, compiled in tensors:
            if isinstance(factor, Tensor):
                parts.append(factor.term.text())
                feeds.append((factor.term.name, None))
                grouped |= {i for a in factor.term.axes if a.grouped for i in a.indices}
            else:
                name = f"_{self.names}"
                self.names += 1
                parts.append(f"{name}[{' '.join(compiled.indices)}]")
                feeds.append((name, compiled.run))
        root = f" / √{node.root}" if node.root else ""
        inner, equation = self.algebra.contraction(
            f"_out[{' '.join(kept)}] = {' '.join(parts)}{root}", tuple(sorted(grouped)))

        def run(arguments, sizes):
            return inner({name: arguments[name] if f is None else f(arguments, sizes)
                          for name, f in feeds}, sizes)
        self.stages.append(Stage("contraction", self.text[node.start:node.end], kept, equation))
        return Compiled(kept, run)

    def call(self, node: Call, visible: frozenset) -> Compiled:
        """A function: elementwise (of tensors or numbers), or along its axis."""
        if node.axis is None:
            parts = [self.node(a, visible) for a in node.arguments]
            indices = _union(p.indices for p in parts)
            runs = [_then(p.run, _aligned(p.indices, indices)) for p in parts]
            reached = all(any(isinstance(n, Tensor) for n in walk(a)) for a in node.arguments)
            f = self.algebra.elementwise(node, reached, self.text[node.start:node.end])
            first, *second = runs  # max(x, y) has two; no generator (dynamo)
            run = (lambda arguments, sizes: f(first(arguments, sizes))) if not second else \
                lambda arguments, sizes: f(first(arguments, sizes), second[0](arguments, sizes))
            return self.stage("entrywise", node, indices, run)
        (argument,) = node.arguments
        self.check_axis(node, argument, _union(n.term.indices for n in walk(argument)
                                               if isinstance(n, Tensor)))
        part = self.node(argument, visible | {node.axis})
        self.check_axis(node, argument, part.indices)
        last = (*(i for i in part.indices if i != node.axis), node.axis)
        f = self.algebra.along(node, self.text[argument.start:argument.end])
        inner = _then(part.run, _aligned(part.indices, last))
        kind = "softmax" if node.function == "softmax" else "reduction"
        indices = last if node.function == "softmax" else last[:-1]
        return self.stage(kind, node, indices, lambda arguments, sizes: f(
            inner(arguments, sizes)))

    def check_axis(self, node: Call, argument: Node, indices: tuple[str, ...]) -> None:
        """That a function's axis is an index of its argument."""
        if node.axis not in indices:
            has = ", ".join(indices) or "none"
            raise at(f"{node.function}_{node.axis} runs along {node.axis!r}, which is no index "
                     f"of its argument {self.text[argument.start:argument.end]} (its indices: "
                     f"{has})", self.text, node.axis_position)

    def stage(self, kind: str, node: Node, indices: tuple[str, ...], run: Run) -> Compiled:
        """``run`` as the node's value, recorded for :meth:`Expression.explain`."""
        self.stages.append(Stage(kind, self.text[node.start:node.end], indices))
        return Compiled(indices, run)


def _sum_run(runs: list[Run], signs: tuple[int, ...]) -> Run:
    """A sum's closure: its terms added or subtracted in the order written."""
    if len(runs) == 2 and signs[0] > 0:  # the common case, in one frame
        f, g = runs
        if signs[1] > 0:
            return lambda arguments, sizes: f(arguments, sizes) + g(arguments, sizes)
        return lambda arguments, sizes: f(arguments, sizes) - g(arguments, sizes)

    def run(arguments, sizes):
        total = None
        for sign, part in zip(signs, runs, strict=True):
            value = part(arguments, sizes)
            total = (-value if sign < 0 else value) if total is None else \
                total - value if sign < 0 else total + value
        return total
    return run


def _product_run(tops: list[Run], bottoms: list[Run], root: str | None,
                 divide_by_root: Callable) -> Run:
    """A product's closure: its factors multiplied, then divided by its divisors and the
    root of an index's size (``divide_by_root(value, size)``), in the order written."""
    if root is None and len(tops) == 2 and not bottoms:  # c · X, X Y: in one frame
        f, g = tops
        return lambda arguments, sizes: f(arguments, sizes) * g(arguments, sizes)
    if root is None and len(tops) == 1 and len(bottoms) == 1:  # X / c
        f, g = tops[0], bottoms[0]
        return lambda arguments, sizes: f(arguments, sizes) / g(arguments, sizes)

    def run(arguments, sizes):
        value = tops[0](arguments, sizes)
        for f in tops[1:]:
            value = value * f(arguments, sizes)
        for f in bottoms:
            value = value / f(arguments, sizes)
        return value if root is None else divide_by_root(value, sizes[root])
    return run


def _then(run: Run, step: Callable) -> Run:
    """``step`` applied to what ``run`` gives; ``run`` itself where the step changes nothing."""
    return run if step is same else lambda arguments, sizes: step(run(arguments, sizes))


def _union(groups) -> tuple[str, ...]:
    """The indices of ``groups`` in order of first appearance."""
    return tuple(dict.fromkeys(i for group in groups for i in group))


def _aligned(have: tuple[str, ...], want: tuple[str, ...]) -> Callable:
    """A view of a value with axes ``have`` (a subset of ``want``) that broadcasts against
    axes ``want`` by index name: permuted into ``want``'s order, with a new axis of size one
    for each index it lacks (those before its first axis left to broadcasting)."""
    order = tuple(sorted(range(len(have)), key=lambda k: want.index(have[k])))
    index = tuple(slice(None) if i in have else None for i in want)
    while index and index[0] is None:
        index = index[1:]
    permute = order != tuple(range(len(order)))
    insert = None in index
    if permute and insert:
        return lambda t: t.permute(*order)[index]
    if permute:
        return lambda t: t.permute(*order)
    return (lambda t: t[index]) if insert else same
