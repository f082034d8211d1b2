"""What an equation of the expression language means, and how it runs.

Every node of the tree (:mod:`einattn._expression`) carries indices, known from the text
alone: a term its own; a sum, an elementwise function or ``max(x, y)`` the union of its
arguments' (broadcast by index name, never by position); ``softmax_σ`` its argument's;
``logsumexp_σ``, ``max_σ`` and ``sum_σ`` their argument's but σ. A product sums, as
Einstein's convention says, the indices of its factors that nothing outside it has (not
the left side, not an enclosing function's axis, not another factor of an enclosing
product): such a product is a contraction, an inner
:class:`~einattn.notation.Equation` that opt_einsum plans and :mod:`einattn._lowering`
runs; a product that sums nothing is an entrywise one. A term outside a product must
have only indices that something outside it has: nothing is summed silently.

The masking contract of equation (3): in ``softmax_σ(… + M[…])``, a sum whose last term is
a tensor, a row where every ``M`` is −∞ gives exact zeros with zero gradients
(:func:`einattn._softmax.masked`, as :func:`~einattn.functional.masked_softmax` runs it);
any other ``softmax_σ`` gives zeros for a row whose every logit is −∞. Everything is
compiled into closures when the equation is made; a call checks the sizes by index name
(once per shape signature, as a contraction's plan is cached) and runs the closures.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import methodcaller
from typing import Any

import torch

from . import _softmax
from ._expression import Call, Node, Number, Product, Scalar, Sum, Tensor, parse, walk
from ._expression_latex import render
from ._lowering import assign_letters
from ._syntax import Parsed
from .errors import EinattnError, at
from .notation import Equation, _opened, _signature

Run = Callable[[dict, dict], Any]  # (arguments, sizes) -> the node's value
_ALONG = {"softmax": _softmax.guarded, "logsumexp": _softmax.logsumexp,
          "max": methodcaller("amax", -1), "sum": methodcaller("sum", -1)}
_ELEMENTWISE = {"exp": torch.exp, "log": torch.log, "tanh": torch.tanh}


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
    equation: Equation | None = None  # a contraction's own equation


@dataclass(frozen=True)
class ExpressionExplanation:
    """How an equation of the expression language runs at given sizes: its operations in
    the order they run, each contraction with opt_einsum's plan."""

    equation: str
    sizes: dict[str, int]
    stages: tuple[Stage, ...]
    plans: tuple[Any, ...] = field(repr=False)  # a contraction's Explanation, or None

    def __str__(self) -> str:
        lines = [f"equation: {self.equation}",
                 "sizes:    " + ", ".join(f"{k}={v}" for k, v in self.sizes.items()), "runs:"]
        for k, (stage, plan) in enumerate(zip(self.stages, self.plans, strict=True)):
            lines.append(f"  {k + 1}. {stage.kind:12} {stage.text} -> [{' '.join(stage.indices)}]")
            if plan is not None:
                lines.append(f"     einsum {plan.einsum}, path {plan.path}, {plan.flops:,} FLOPs")
        return "\n".join(lines)


class Expression(Equation):
    """An :class:`~einattn.notation.Equation` whose right side is more than one product
    (``Equation`` makes one of these for such a text): named-axis functions, elementwise
    functions, sums, differences, quotients and named scalars, as
    :mod:`einattn._expression` reads them. Called like any equation, with each named
    scalar as a number or a 0-d tensor: ``eq(S=S, c=2.0)``."""

    is_contraction = False  # einattn verify compares it in float64, never exactly

    def __init__(self, text: str):
        self.text = text
        tree = parse(text)
        self._tree = tree
        terms = tuple(n.term for n in walk(tree.right) if isinstance(n, Tensor))
        self._parsed = Parsed(tree.output, terms, None, -1)  # what the size checks read
        self._letters = assign_letters(self._parsed, text)
        self.operands = tuple(dict.fromkeys(t.name for t in terms))
        self.scalars = tuple(dict.fromkeys(n.name for n in walk(tree.right)
                                           if isinstance(n, Scalar)))
        _check_names(tree, self.operands, self.scalars, text)
        compiler = _Compiler(text)
        self._run = compiler.equation(tree.output, tree.right)
        self._stages = tuple(compiler.stages)
        self._checked: dict[tuple, dict[str, int]] = {}

    def latex(self) -> str:
        return render(self._tree)

    def __call__(self, **arguments: Any) -> torch.Tensor:
        tensors = self._without_scalars(arguments)
        if torch.compiler.is_compiling():  # no cache (dynamo follows the sizes, not the key)
            return self._run(arguments, self._resolve(*self._split_arguments(
                tensors, allow_shapes=False)))
        try:
            sizes = self._checked.get(_signature(tensors))
        except TypeError:  # an unhashable argument: the check says what is wrong with it
            sizes = None
        if sizes is None:
            sizes = self._check(tensors)
        return self._run(arguments, sizes)

    def _check(self, tensors: dict[str, Any]) -> dict[str, int]:
        shapes, given = self._split_arguments(tensors, allow_shapes=False)
        self._check_dtypes(tensors)
        sizes = self._resolve(shapes, given)
        if len(self._checked) >= 256:
            self._checked.clear()
        self._checked[_signature(tensors)] = sizes
        return sizes

    def sizes(self, **arguments: Any) -> dict[str, int]:
        return super().sizes(**{k: v for k, v in arguments.items() if k not in self.scalars})

    def explain(self, **arguments: Any) -> ExpressionExplanation:
        """The operations in the order they run, at the sizes of ``arguments`` (tensors,
        shapes or index sizes, and the scalars or not): which are contractions (each with
        opt_einsum's plan), which entrywise, which softmaxes and reductions."""
        sizes = self.sizes(**arguments)
        plans = tuple(None if s.equation is None else s.equation.explain(
            **{t.name: tuple(sizes[i] for i in t.indices) for t in s.equation.terms})
            for s in self._stages)
        return ExpressionExplanation(self.text, sizes, self._stages, plans)

    def _without_scalars(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """The arguments less the scalars, each checked to be a number or a 0-d tensor."""
        if not self.scalars:
            return arguments
        missing = [s for s in self.scalars if s not in arguments]
        if missing:
            raise at(f"missing scalar {', '.join(missing)}: give it as a number, "
                     f"{missing[0]}=2.0", self.text, *(n.start for n in walk(self._tree.right)
                                                       if isinstance(n, Scalar)
                                                       and n.name in missing))
        for name in self.scalars:
            value = arguments[name]
            if isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor)) \
                    or (isinstance(value, torch.Tensor) and value.ndim):
                raise EinattnError(f"scalar {name} must be a number or a 0-d tensor, got "
                                   f"{_described(value)}")
        return {k: v for k, v in arguments.items() if k not in self.scalars}


def _described(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return repr(value) if isinstance(value, bool) else type(value).__name__


def _check_names(tree, operands: tuple[str, ...], scalars: tuple[str, ...], text: str) -> None:
    output = tree.output
    seen: dict[str, int] = {}
    for index, pos in zip(output.indices, output.positions, strict=True):
        if index in seen:
            raise at(f"index {index!r} appears twice on the left", text, seen[index], pos)
        seen[index] = pos
    if not operands:
        raise at("the right side has no tensor: an equation computes from tensors", text,
                 tree.right.start)
    if output.name in (*operands, *scalars):
        raise at(f"{output.name} is both the output and an operand", text, output.position)
    indices = {i for n in walk(tree.right) if isinstance(n, Tensor) for i in n.term.indices}
    for node in walk(tree.right):
        if isinstance(node, Scalar) and (node.name in operands or node.name in indices):
            what = "a tensor" if node.name in operands else "an index"
            raise at(f"{node.name} is both a scalar and {what}", text, node.start)


class _Compiler:
    """Compiles a tree into closures, checking what the text alone decides."""

    def __init__(self, text: str):
        self.text = text
        self.stages: list[Stage] = []
        self.names = 0  # placeholders of the inner equations: _0, _1, …

    def equation(self, output, right: Node) -> Run:
        compiled = self.node(right, frozenset(output.indices))
        for index, pos in zip(output.indices, output.positions, strict=True):
            if index not in compiled.indices:
                where = ("is on no tensor" if all(index not in t.term.indices for t in
                                                  walk(right) if isinstance(t, Tensor))
                         else "is reduced away on the right")
                raise at(f"output index {index!r} {where}", self.text, pos)
        order = _aligned(compiled.indices, output.indices)
        run, shape = compiled.run, [axis.indices for axis in output.axes]
        if not output.grouped:
            return lambda arguments, sizes: order(torch.as_tensor(run(arguments, sizes)))
        return lambda arguments, sizes: order(torch.as_tensor(run(arguments, sizes))).reshape(
            *(math.prod(sizes[i] for i in axis) for axis in shape))

    def node(self, node: Node, visible: frozenset, in_product: bool = False) -> Compiled:
        if isinstance(node, Tensor):
            return self.tensor(node, visible, in_product)
        if isinstance(node, Scalar):
            name = node.name
            return Compiled((), lambda arguments, sizes: arguments[name])
        if isinstance(node, Number):
            value = node.value
            return Compiled((), lambda arguments, sizes: value)
        if isinstance(node, Sum):
            return self.sum(node, visible)
        if isinstance(node, Product):
            return self.product(node, visible)
        return self.call(node, visible)

    def tensor(self, node: Tensor, visible: frozenset, in_product: bool) -> Compiled:
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
        if not term.grouped:
            return Compiled(term.indices, lambda arguments, sizes: arguments[term.name])
        axes = len(term.axes)
        return Compiled(term.indices, lambda arguments, sizes: _opened(
            arguments[term.name], term, sizes) if arguments[term.name].ndim == axes
            else arguments[term.name])

    def sum(self, node: Sum, visible: frozenset) -> Compiled:
        parts = [self.node(t, visible) for t in node.terms]
        indices = _union(p.indices for p in parts)
        runs = [(sign, p.run, _aligned(p.indices, indices))
                for sign, p in zip(node.signs, parts, strict=True)]

        def run(arguments, sizes):
            total = None
            for sign, part, align in runs:
                value = align(part(arguments, sizes))
                total = (-value if sign < 0 else value) if total is None else \
                    total - value if sign < 0 else total + value
            return total
        return self.stage("entrywise", node, indices, run)

    def product(self, node: Product, visible: frozenset) -> Compiled:
        held = [{i for n in walk(f) if isinstance(n, Tensor) for i in n.term.indices}
                for f in node.factors]  # a factor sees the indices the others hold
        factors = [(f, self.node(f, visible.union(*held[:k], *held[k + 1:]), in_product=True))
                   for k, f in enumerate(node.factors)]
        tensors = [(f, c) for f, c in factors if not isinstance(f, (Scalar, Number))]
        numbers = [c.run for f, c in factors if isinstance(f, (Scalar, Number))]
        summed = {i for _, c in tensors for i in c.indices} - visible
        if summed or any(len(set(c.indices)) < len(c.indices) for _, c in tensors):
            compiled = self.contraction(node, tensors, visible)
            entrywise: list = []
        else:
            compiled = None
            entrywise = [c for _, c in tensors]
        divisors = [self.node(d, visible) for d in node.divisors]
        indices = _union([compiled.indices] if compiled else [c.indices for c in entrywise])
        indices = _union([indices, *(d.indices for d in divisors)])
        root = None if compiled is not None else node.root
        run = _product_run(compiled, entrywise, numbers, divisors, root, indices)
        if compiled is not None and not numbers and not divisors:
            return compiled
        return self.stage("entrywise", node, indices, run)

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
        equation = Equation(f"_out[{' '.join(kept)}] = {' '.join(parts)}{root}")
        group_sizes = tuple(sorted(grouped))

        def run(arguments, sizes):
            given = {name: arguments[name] if f is None else f(arguments, sizes)
                     for name, f in feeds}
            return equation(**given, **{i: sizes[i] for i in group_sizes})
        self.stages.append(Stage("contraction", self.text[node.start:node.end], kept, equation))
        return Compiled(kept, run)

    def call(self, node: Call, visible: frozenset) -> Compiled:
        if node.axis is None:
            parts = [self.node(a, visible) for a in node.arguments]
            indices = _union(p.indices for p in parts)
            runs = [(p.run, _aligned(p.indices, indices)) for p in parts]
            f = _ELEMENTWISE.get(node.function, torch.maximum)
            return self.stage("entrywise", node, indices, lambda arguments, sizes: f(
                *(torch.as_tensor(align(r(arguments, sizes))) for r, align in runs)))
        (argument,) = node.arguments
        self.check_axis(node, argument, _union(n.term.indices for n in walk(argument)
                                               if isinstance(n, Tensor)))
        if node.function == "softmax" and _masked_form(argument):
            return self.masked_softmax(node, argument, visible | {node.axis})
        part = self.node(argument, visible | {node.axis})
        self.check_axis(node, argument, part.indices)
        last = (*(i for i in part.indices if i != node.axis), node.axis)
        align, f, run = _aligned(part.indices, last), _ALONG[node.function], part.run
        kind = "softmax" if node.function == "softmax" else "reduction"
        indices = last if node.function == "softmax" else last[:-1]
        return self.stage(kind, node, indices, lambda arguments, sizes: f(
            align(run(arguments, sizes))))

    def masked_softmax(self, node: Call, argument: Sum, visible: frozenset) -> Compiled:
        """``softmax_σ(X + M)``: :func:`einattn._softmax.masked`, the library's contract."""
        rest = argument.terms[0] if len(argument.terms) == 2 and argument.signs[0] > 0 else \
            Sum(argument.start, argument.terms[-1].start, argument.terms[:-1], argument.signs[:-1])
        x, mask = self.node(rest, visible), self.node(argument.terms[-1], visible)
        self.check_axis(node, argument, _union([x.indices, mask.indices]))
        last = (*(i for i in _union([x.indices, mask.indices]) if i != node.axis), node.axis)
        (run_x, align_x), (run_m, align_m) = ((x.run, _aligned(x.indices, last)),
                                              (mask.run, _aligned(mask.indices, last)))
        return self.stage("softmax", node, last, lambda arguments, sizes: _softmax.masked(
            align_x(run_x(arguments, sizes)), align_m(run_m(arguments, sizes))))

    def check_axis(self, node: Call, argument: Node, indices: tuple[str, ...]) -> None:
        if node.axis not in indices:
            has = ", ".join(indices) or "none"
            raise at(f"{node.function}_{node.axis} runs along {node.axis!r}, which is no index "
                     f"of its argument {self.text[argument.start:argument.end]} (its indices: "
                     f"{has})", self.text, node.axis_position)

    def stage(self, kind: str, node: Node, indices: tuple[str, ...], run: Run) -> Compiled:
        self.stages.append(Stage(kind, self.text[node.start:node.end], indices))
        return Compiled(indices, run)


def _masked_form(argument: Node) -> bool:
    """Whether a softmax's argument is ``… + M[…]``: a sum whose last term is a tensor."""
    return isinstance(argument, Sum) and isinstance(argument.terms[-1], Tensor) \
        and argument.signs[-1] > 0


def _product_run(contracted: Compiled | None, entrywise: list[Compiled], numbers: list[Run],
                 divisors: list[Compiled], root: str | None, indices: tuple[str, ...]) -> Run:
    """A product's closure: the contraction (or the entrywise product of its factors), times
    its scalars, over its divisors and the root, in the order written."""
    factors = [(c.run, _aligned(c.indices, indices)) for c in
               ([contracted] if contracted is not None else entrywise)]
    below = [(d.run, _aligned(d.indices, indices)) for d in divisors]

    def run(arguments, sizes):
        value = None
        for f in numbers:
            value = f(arguments, sizes) if value is None else value * f(arguments, sizes)
        for f, align in factors:
            t = align(f(arguments, sizes))
            value = t if value is None else value * t
        for f, align in below:
            value = value / align(f(arguments, sizes))
        return value if root is None else value / math.sqrt(sizes[root])
    return run


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
        return methodcaller("permute", *order)
    return (lambda t: t[index]) if insert else _same


def _same(t):
    return t
