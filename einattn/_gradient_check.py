"""A backward step as two sides of :func:`einattn.verify.check_equivalent`: autograd's
vector–Jacobian product of a forward, and the gradient claimed for it.

Where the forward and the gradient are written (equations or chains), the sides are
written too: :class:`Autograd`, which runs ``torch.autograd`` in float64 and, in the finite
field, differentiates the forward itself (:func:`einattn._field_eval.vjp`), and a
:class:`~einattn.chain.Chain` of the forward and the gradient (which may read the forward's
output). Where either is a Python function, they are functions.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from . import _sides
from ._expression import Call, walk
from ._field_eval import vjp
from ._field_tensor import FieldTensor, Missing
from .chain import Chain
from .errors import EinattnError, at
from .notation import Equation

Side = Any  # an Equation, a Chain, an equation string, or a function of tensors

class GradientSides(NamedTuple):
    """:func:`check_gradient`'s question as two sides for :func:`check_equivalent`: ``true``
    is autograd's vector–Jacobian product of the forward, ``claimed`` the gradient given.
    Both take the forward's inputs and the cotangent ``d<Out>`` by keyword; ``inputs`` gives
    each of those tensors' index strings."""

    true: Callable[..., torch.Tensor]
    claimed: Callable[..., torch.Tensor]
    inputs: dict[str, str]




def gradient_sides(forward: Side, gradient: Side, *, wrt: str,
                   sizes: dict[str, int] | None = None, shapes: dict[str, str] | None = None,
                   output: str | None = None) -> GradientSides:
    """The two sides :func:`check_gradient` compares; a registered step holds them.

    ``forward`` computes ``Out`` from its inputs: an equation (``Out`` is its left side), or
    a callable whose keyword parameters are its inputs and whose output ``output=`` names
    (default ``out``); ``shapes`` gives a callable's inputs and output as index strings. An
    equation ``gradient`` produces ``d<wrt>[wrt's indices]``; a callable one returns that
    tensor. Either takes, by name, any of the forward's inputs, ``Out`` and ``d<Out>``.
    """
    forward, gradient = (Equation(s) if isinstance(s, str) else s for s in (forward, gradient))
    sizes = dict(sizes or {})
    terms, out = _forward_terms(forward, dict(shapes or {}), output)
    if wrt not in terms:
        raise EinattnError(f"wrt={wrt!r} is not an input of the forward "
                           f"{_sides.text(forward)}; its inputs are {', '.join(terms)}")
    names, cotangent = list(terms), f"d{out.name}"
    takes = _gradient_takes(gradient, terms[wrt], [*names, out.name, cotangent])
    inputs = {name: _bracketed(t) for name, t in [*terms.items(), (cotangent, out)]}
    if _sides.written(forward) and _sides.written(gradient):
        return GradientSides(Autograd(forward, wrt),
                             Chain(*_sides.equations(forward), *_sides.equations(gradient)),
                             inputs)
    parameters = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY) for n in inputs]
    true = _autograd_side(_runner(forward, sizes), _sides.text(forward), wrt, names, cotangent)
    claimed = _claimed_side(gradient, forward, wrt, names, out.name, takes, sizes)
    for side, text in [(true, f"autograd's d{wrt} of {_sides.text(forward)}"),
                       (claimed, _sides.text(gradient))]:
        side.__qualname__, side.__signature__ = text, inspect.Signature(parameters)
        side.output_indices = None if terms[wrt].grouped else terms[wrt].indices
    true.degree, claimed.degree = _sides.degree(forward), _sides.degree(gradient)
    true.sums_in_float64 = True  # exact below 2^53 only
    true.not_multilinear, claimed.not_multilinear = (_sides.not_multilinear(forward),
                                                     _sides.not_multilinear(gradient))
    return GradientSides(true, claimed, inputs)


def _term(name: str, text: str):
    """``name[text]`` parsed: its axes, groups and indices."""
    return Equation(f"_[] = {name}[{text}]").terms[0]


def _bracketed(term) -> str:
    """The index string inside a term's brackets: ``"n (g r) τ a"``."""
    return term.text()[len(term.name) + 1:-1]


def _keywords(function: Callable) -> list[inspect.Parameter] | None:
    """The parameters a callable takes by keyword, or None where it takes ``**kwargs``."""
    parameters = inspect.signature(function).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return None
    return [p for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _forward_terms(forward, shapes: dict[str, str], output: str | None):
    """The forward's inputs as terms, by name, and its output term."""
    if _sides.written(forward):
        if output not in (None, forward.output):
            raise EinattnError(f"output={output!r}, but the forward {forward.text} names its "
                               f"output {forward.output}")
        terms: dict = {}
        for term in forward.terms:
            terms.setdefault(term.name, term)
        return terms, forward.lhs
    out = "out" if output is None else output
    keywords = _keywords(forward)
    names = ([p.name for p in keywords if p.default is p.empty] if keywords is not None
             else [n for n in shapes if n != out])
    for name in [*names, out]:
        if name not in shapes:
            role = "the output" if name == out else "an input"
            raise EinattnError(f"shapes gives no index string for {name!r}, {role} of the "
                               f"forward {_sides.text(forward)}; pass "
                               f"shapes={{{name!r}: 'τ σ', ...}}")
    return {name: _term(name, shapes[name]) for name in names}, _term(out, shapes[out])


def _gradient_takes(gradient, wrt, available: list[str]) -> list[str]:
    """The tensors the gradient takes, once it is known to produce ``d<wrt>`` from them."""
    if _sides.written(gradient):
        lhs = gradient.lhs
        if lhs.name != f"d{wrt.name}" or not _in_place(lhs, wrt):
            raise at(f"the gradient must produce d{wrt.text()}, the gradient of "
                     f"{wrt.name}, but produces {lhs.text()}", gradient.text, lhs.position)
        takes = list(gradient.operands)
    else:
        keywords = _keywords(gradient)
        if keywords is None:
            return available
        takes = [p.name for p in keywords if p.default is p.empty or p.name in available]
    for name in takes:
        if name not in available:
            raise EinattnError(f"the gradient {_sides.text(gradient)} takes {name!r}, which "
                               f"is none of the forward's inputs, its output and its "
                               f"cotangent: "
                               f"{', '.join(available)}")
    return takes


def _in_place(lhs, wrt) -> bool:
    """Whether ``lhs`` has ``wrt``'s axes: the same groups and indices, but where ``wrt``
    repeats an index (``X[τ τ]``), which the gradient names anew (``dX[τ τʹ]``)."""
    if [(len(a.indices), a.grouped) for a in lhs.axes] != \
            [(len(a.indices), a.grouped) for a in wrt.axes]:
        return False
    return all(mine == theirs or theirs in wrt.indices[:k]
               for k, (mine, theirs) in enumerate(zip(lhs.indices, wrt.indices, strict=True)))


def _runner(side, sizes: dict[str, int]) -> Callable[[dict], torch.Tensor]:
    """A side as a function of a dict of tensors (an equation also gets its sizes)."""
    return lambda tensors: _sides.evaluated(side, tensors, sizes)


def _exact_values(t: torch.Tensor, what: str) -> torch.Tensor:
    """A float64 result at integer inputs as int64, once it is known to be integral."""
    if not torch.equal(t, t.round()):
        raise EinattnError(f"exact=True but {what} is not an integer at integer inputs: the "
                           f"forward is not multilinear; use float mode")
    return t.to(torch.int64)


def _autograd_side(run: Callable, forward: str, wrt: str, names: list[str],
                   cotangent: str) -> Callable:
    """``torch.autograd``'s ``d<wrt>`` of the forward ``run`` (shown as ``forward``) in
    float64, for the cotangent ``tensors[cotangent]``; as int64 where the draws are
    integers (and the gradient is one, as a multilinear forward's is)."""

    def true_gradient(**tensors: torch.Tensor) -> torch.Tensor:
        exact = not tensors[cotangent].is_floating_point()
        arguments = {n: tensors[n].detach().to(torch.float64).requires_grad_(n == wrt)
                     for n in names}
        with torch.enable_grad():
            out = run(arguments)
            d_out = tensors[cotangent]
            if out.shape != d_out.shape:
                raise EinattnError(f"the forward {forward} returned shape "
                                   f"{tuple(out.shape)}, but its cotangent {cotangent} has "
                                   f"shape {tuple(d_out.shape)} from shapes")
            grad = (torch.autograd.grad(out, arguments[wrt], d_out.to(out.dtype),
                                        allow_unused=True)[0] if out.requires_grad else None)
        grad = torch.zeros_like(arguments[wrt]) if grad is None else grad.detach()
        return _exact_values(grad, f"autograd's d{wrt}") if exact else grad
    return true_gradient


def _claimed_side(gradient, forward, wrt: str, names: list[str], out: str, takes: list[str],
                  sizes) -> Callable:
    run, run_forward = _runner(gradient, sizes), _runner(forward, sizes)

    def claimed_gradient(**tensors: torch.Tensor) -> torch.Tensor:
        exact = not tensors[f"d{out}"].is_floating_point()
        given = {n: tensors[n] for n in takes if n in tensors}
        if out in takes:  # the forward's output, computed from the same inputs
            with torch.no_grad():
                value = run_forward({n: tensors[n].to(torch.float64) for n in names})
            given[out] = _exact_values(value, f"the forward's output {out}") if exact else value
        result = run(given)
        if result.shape != tensors[wrt].shape:
            raise EinattnError(f"the gradient {_sides.text(gradient)} returned shape "
                               f"{tuple(result.shape)}, but d{wrt} has {wrt}'s shape "
                               f"{tuple(tensors[wrt].shape)}")
        return result
    return claimed_gradient



class Autograd:
    """Autograd's ``d<wrt>`` of a written forward (an equation or a chain), as a side: a
    function of the forward's inputs, scalars and the cotangent ``d<Out>``. In float64 it is
    ``torch.autograd.grad``; in the finite field the forward's rules are run back from its
    output there, in reverse mode (:func:`einattn._field_eval.vjp`)."""

    sums_in_float64 = True  # integer draws stay exact below 2^53 only

    def __init__(self, forward, wrt: str):
        self.forward, self.wrt = forward, wrt
        out = forward.lhs
        self.cotangent = f"d{out.name}"
        terms = {t.name: t for t in reversed(forward.terms)}
        if wrt not in terms:
            raise EinattnError(f"wrt={wrt!r} is not an input of the forward {forward.text}; "
                               f"its inputs are {', '.join(forward.operands)}")
        self.terms = (*forward.terms, _term(self.cotangent, _bracketed(out)))
        self.operands = (*forward.operands, self.cotangent)
        self.scalars = tuple(getattr(forward, "scalars", ()))
        self.lhs = _term(f"d{wrt}", _bracketed(terms[wrt]))
        self.indices = forward.indices
        self.text = f"autograd's d{wrt} of {forward.text}"
        self.is_contraction, self.scale = forward.is_contraction, forward.scale
        self.degree = _sides.degree(forward)
        self.equations = _sides.equations(forward)

    def __call__(self, **arguments) -> torch.Tensor:
        names = (*self.forward.operands, *self.scalars)
        sizes = {k: v for k, v in arguments.items() if k in self.indices and k not in names}
        forward = self.forward
        side = _autograd_side(lambda tensors: forward(**tensors, **sizes), forward.text,
                              self.wrt, list(names), self.cotangent)
        return side(**{k: v for k, v in arguments.items() if k not in sizes})

    def field_value(self, env: dict, sizes: dict[str, int]) -> FieldTensor:
        """Autograd's gradient in the field; none where the forward takes a maximum, whose
        derivative is a comparison."""
        if any(isinstance(n, Call) and n.function == "max" for e in self.equations
               for n in _nodes(e)):
            why = "the forward takes a maximum, whose derivative is a comparison"
            x = env[self.wrt]
            return FieldTensor(x.field, x.shape, Missing(why), Missing(why))
        return vjp(self.forward, self.wrt, self.cotangent, env, sizes)


def _nodes(equation) -> list:
    """Every node of an equation's right side (none for a contraction: it has no function)."""
    tree = getattr(equation, "_tree", None)
    return [] if tree is None else walk(tree.right)
