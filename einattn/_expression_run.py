"""What an equation of the expression language means, and how it runs.

Every node of the tree (:mod:`einattn._expression`) carries indices, known from the text
alone: a term its own; a sum, an elementwise function or ``max(x, y)`` the union of its
arguments' (broadcast by index name, never by position); ``softmax_σ`` its argument's;
``logsumexp_σ``, ``max_σ`` and ``sum_σ`` their argument's but σ. A product sums, as
Einstein's convention says, the indices of its factors that nothing outside it has (not
the left side, not an enclosing function's axis, not an index another factor of an
enclosing product carries, one that factor's own reduction binds excepted): such a
product is a contraction, an inner :class:`~einattn.notation.Equation` that opt_einsum
plans and :mod:`einattn._lowering` runs; a product that sums nothing is an entrywise one.
A term outside a product must have only indices that something outside it has: nothing
is summed silently, and nothing survives that the left side does not name.

The masking contract of equation (3): ``softmax_σ`` of any logits, ``S + M`` or ``M + S``
or a longer sum, gives exact zeros with zero gradients for a row whose every logit is −∞
(:func:`einattn._softmax.guarded`; NaN, being no −∞, propagates). Numbers and Python
scalars stay Python floats (float64) until they meet a tensor, whose dtype they take, as
torch's own scalars do. Everything is compiled into closures when the equation is made; a
call checks the sizes by index name (once per shape signature, as a contraction's plan is
cached) and runs the closures.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from . import _expression, _softmax
from ._expression import Call, Node, Number, Product, Scalar, Sum, Tensor, children, walk
from ._expression_latex import render
from ._lowering import assign_letters, same
from ._syntax import Parsed
from .errors import at
from .notation import Equation, opened, signature

Run = Callable[[dict, dict], Any]  # (arguments, sizes) -> the node's value
# (plain functions, never an operator.methodcaller: dynamo cannot trace one inside an
# autograd.Function, as the chunked path runs these)
_ALONG = {"softmax": _softmax.guarded, "logsumexp": _softmax.logsumexp,
          "max": _softmax.maximum, "sum": lambda t: t.sum(-1)}
_LOGITS = ("softmax", "logsumexp", "max")  # functions of real numbers (the first two, of
# floating-point logits only)


def _exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:  # as torch.exp: inf
        return math.inf


def _log(x: float) -> float:
    return math.log(x) if x > 0 else -math.inf if x == 0 else math.nan  # as torch.log


def _maximum(x: Any, y: Any) -> Any:
    """``max(x, y)`` of tensors or numbers: a number that meets a tensor takes its dtype."""
    if isinstance(x, torch.Tensor):
        return torch.maximum(x, y if isinstance(y, torch.Tensor) else x.new_tensor(y))
    if isinstance(y, torch.Tensor):
        return torch.maximum(y.new_tensor(x), y)
    return x if x != x or x >= y else y  # NaN propagates, as torch.maximum's does


def _numbers_too(on_tensor: Callable, on_number: Callable) -> Callable:
    """A function of one tensor that takes a number (a Python float, float64) as well."""
    return lambda x: on_tensor(x) if isinstance(x, torch.Tensor) else on_number(x)


# name: (where a tensor reaches it, where maybe only numbers do)
_ELEMENTWISE = {"exp": (torch.exp, _numbers_too(torch.exp, _exp)),
                "log": (torch.log, _numbers_too(torch.log, _log)),
                "tanh": (torch.tanh, _numbers_too(torch.tanh, math.tanh)),
                "max": (torch.maximum, _maximum)}


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
        tree = _expression.parse(text)
        self._tree = tree
        terms = tuple(n.term for n in walk(tree.right) if isinstance(n, Tensor))
        self._parsed = Parsed(tree.output, terms, None, -1)  # what the size checks read
        self._letters = assign_letters(self._parsed, text)
        self.operands = tuple(dict.fromkeys(t.name for t in terms))
        self.scalars = tuple(dict.fromkeys(n.name for n in walk(tree.right)
                                           if isinstance(n, Scalar)))
        _expression.check_names(tree, self.operands, self.scalars, text)
        self._logits = {n.term.name: (f"{c.function}_{c.axis}", n.term.position)
                        for c in walk(tree.right) if isinstance(c, Call) and c.function in _LOGITS
                        for n in walk(c) if isinstance(n, Tensor)}  # floating point only
        compiler = _Compiler(text)
        self._run = compiler.equation(tree.output, tree.right)
        self._stages = tuple(compiler.stages)
        self._checked: dict[tuple, dict[str, int]] = {}

    def latex(self) -> str:
        return render(self._tree)

    def __call__(self, **arguments: Any) -> torch.Tensor:
        tensors = arguments
        if self.scalars:
            for name in self.scalars:  # a Python number passes at the cost of one lookup
                if type(arguments.get(name)) not in (float, int):
                    self._check_scalar(name, arguments)
            tensors = {k: v for k, v in arguments.items() if k not in self.scalars}
        if torch.compiler.is_compiling():  # no cache (dynamo follows the sizes, not the key)
            return self._run(arguments, self._resolve(*self._split_arguments(
                tensors, allow_shapes=False)))
        try:
            sizes = self._checked.get(signature(tensors))
        except TypeError:  # an unhashable argument: the check says what is wrong with it
            sizes = None
        if sizes is None:
            sizes = self._check(tensors)
        return self._run(arguments, sizes)

    def _check(self, tensors: dict[str, Any]) -> dict[str, int]:
        shapes, given = self._split_arguments(tensors, allow_shapes=False)
        self._check_dtypes(tensors)
        for name, (function, position) in self._logits.items():
            t = tensors[name]
            if t.is_complex() or not (t.is_floating_point() or function.startswith("max")):
                takes = "real numbers" if function.startswith("max") else "floating-point logits"
                raise at(f"{name} is {t.dtype}: {function} takes {takes}", self.text, position)
        sizes = self._resolve(shapes, given)
        if len(self._checked) >= 256:
            self._checked.clear()
        self._checked[signature(tensors)] = sizes
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

    def _check_scalar(self, name: str, arguments: dict[str, Any]) -> None:
        """That scalar ``name`` is given, as a number or a 0-d tensor."""
        value = arguments.get(name)
        if (isinstance(value, torch.Tensor) and not value.ndim) \
                or (isinstance(value, (int, float)) and not isinstance(value, bool)):
            return  # a 0-d tensor, or a subclass of float (numpy's float64)
        places = [n.start for n in walk(self._tree.right) if isinstance(n, Scalar)
                  and n.name == name]
        if name not in arguments:
            raise at(f"missing scalar {name}: give it as a number, {name}=2.0", self.text,
                     *places)
        raise at(f"scalar {name} must be a number or a 0-d tensor, got {_described(value)}",
                 self.text, *places)


def _described(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return repr(value) if isinstance(value, bool) else type(value).__name__


def _free(node: Node) -> set[str]:
    """The indices ``node`` may carry to its neighbours in a product, from the text alone:
    its terms' indices less those its reductions bind (``sum_a(z[a])`` carries none)."""
    if isinstance(node, Tensor):
        return set(node.term.indices)
    if isinstance(node, Call) and node.axis is not None and node.function != "softmax":
        return _free(node.arguments[0]) - {node.axis}
    return set().union(*map(_free, children(node)))


class _Compiler:
    """Compiles a tree into closures, checking what the text alone decides."""

    def __init__(self, text: str):
        self.text = text
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
            value = node.value
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
        name = term.name
        if not term.grouped:
            return Compiled(term.indices, lambda arguments, sizes: arguments[name])
        axes = len(term.axes)
        return Compiled(term.indices, lambda arguments, sizes: opened(
            arguments[name], term, sizes) if arguments[name].ndim == axes
            else arguments[name])

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
        return self.stage("entrywise", node, indices, _product_run(*runs, root))

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
        """A function: elementwise (of tensors or numbers), or along its axis."""
        if node.axis is None:
            parts = [self.node(a, visible) for a in node.arguments]
            indices = _union(p.indices for p in parts)
            runs = [_then(p.run, _aligned(p.indices, indices)) for p in parts]
            reached = all(any(isinstance(n, Tensor) for n in walk(a)) for a in node.arguments)
            f = _ELEMENTWISE[node.function][0 if reached else 1]  # by tensors or maybe numbers
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
        f, inner = _ALONG[node.function], _then(part.run, _aligned(part.indices, last))
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


def _product_run(tops: list[Run], bottoms: list[Run], root: str | None) -> Run:
    """A product's closure: its factors multiplied, then divided by its divisors and the
    root of an index's size, in the order written."""
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
        return value if root is None else value / math.sqrt(sizes[root])
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
