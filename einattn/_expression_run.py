"""How an equation of the expression language runs on torch tensors.

:mod:`einattn._expression_compile` gives each node of the tree its meaning (which indices it
carries, what it sums); this module gives it torch's arithmetic and the checks of a call.
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
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from . import _delta, _expression, _softmax
from ._contraction import Contraction, opened, signature
from ._expression import Call, Scalar, Tensor, walk
from ._expression_compile import Algebra, Compiler, Stage
from ._expression_latex import render
from ._lowering import assign_letters
from ._syntax import Parsed
from .errors import at

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


def _sigmoid(x: float) -> float:
    """``1 / (1 + e^(−x))`` of a number, without overflow for large ``−x``."""
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def _numbers_too(on_tensor: Callable, on_number: Callable) -> Callable:
    """A function of one tensor that takes a number (a Python float, float64) as well."""
    return lambda x: on_tensor(x) if isinstance(x, torch.Tensor) else on_number(x)


# name: (where a tensor reaches it, where maybe only numbers do)
_ELEMENTWISE = {"exp": (torch.exp, _numbers_too(torch.exp, _exp)),
                "log": (torch.log, _numbers_too(torch.log, _log)),
                "tanh": (torch.tanh, _numbers_too(torch.tanh, math.tanh)),
                "sigmoid": (torch.sigmoid, _numbers_too(torch.sigmoid, _sigmoid)),
                "max": (torch.maximum, _maximum)}


def _contraction(text: str, groups: tuple[str, ...]) -> tuple[Callable, Contraction]:
    """An inner contraction as a closure over its given tensors and the sizes."""
    equation = Contraction(text)
    return (lambda given, sizes: equation(**given, **{i: sizes[i] for i in groups})), equation


def _opened(value: torch.Tensor, term, sizes: dict[str, int]) -> torch.Tensor:
    """A grouped term's tensor with its groups opened, unless it arrived opened."""
    return opened(value, term, sizes) if value.ndim == len(term.axes) else value


TORCH = Algebra(
    elementwise=lambda node, reached, text: _ELEMENTWISE[node.function][0 if reached else 1],
    along=lambda node, text: _ALONG[node.function],
    contraction=_contraction,
    number=lambda node: node.value,
    root=lambda value, n: value / math.sqrt(n),
    opened=_opened,
)


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


class ExpressionRun:
    """What :class:`einattn.notation.Expression` adds to a contraction's engine: an
    equation whose right side is more than one product: named-axis functions, elementwise
    functions, sums, differences, quotients and named scalars, as
    :mod:`einattn._expression` reads them. Called like any equation, with each named
    scalar as a number or a 0-d tensor: ``eq(S=S, c=2.0)``."""

    is_contraction = False  # more than one product: no integer-exact mode

    def __init__(self, text: str):
        self.text = text
        tree = _expression.parse(text)
        tree = replace(tree, right=_delta.numbered_tree(tree.right, text))
        self._tree = tree
        terms = tuple(n.term for n in walk(tree.right) if isinstance(n, Tensor))
        self._parsed = Parsed(tree.output, terms, None, -1)  # what the size checks read
        self._letters = assign_letters(self._parsed, text)
        self._named(terms)
        self.scalars = tuple(dict.fromkeys(n.name for n in walk(tree.right)
                                           if isinstance(n, Scalar)))
        _expression.check_names(tree, self.operands, self.scalars, text)
        self._logits = {n.term.name: (f"{c.function}_{c.axis}", n.term.position)
                        for c in walk(tree.right) if isinstance(c, Call) and c.function in _LOGITS
                        for n in walk(c) if isinstance(n, Tensor)}  # floating point only
        compiler = Compiler(text, TORCH)
        self._run = compiler.equation(tree.output, tree.right)
        self._stages = tuple(compiler.stages)
        self._checked: dict[tuple, dict[str, int]] = {}

    def latex(self) -> str:
        return render(self._tree)

    def __call__(self, **arguments: Any) -> torch.Tensor:
        if self._deltas:
            arguments = self._with_deltas(arguments)
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

