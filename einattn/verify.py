"""Check that two forms of a derivation step compute the same tensor.

Each side is an :class:`~einattn.Equation`, an equation string, or a Python callable that
takes tensors as keyword arguments named as in the equation(s). Inputs are drawn at
random per tensor name (a tensor used twice gets one value) with shapes from ``sizes``.

* Float mode: float64 normal draws, several of them; the sides must agree to a tolerance
  scaled to the outputs' magnitudes.
  An equation of the expression language (``softmax_σ``, ``exp``, a sum of terms) is
  compared so, its named scalars drawn as 0-d tensors.
* Exact mode (``exact=True``), for multilinear steps (pure contractions): integer draws and
  integer arithmetic, so equality is exact. Two different multilinear polynomials of
  degree ``d`` agree at a random point of ``S^k`` with probability at most ``d/|S|``
  (Schwartz–Zippel), so ``draws`` independent draws accept a false step with probability
  at most ``(d/|S|)^draws``; the report states that bound.

    >>> check_equivalent("Y[τ j] = X[τ i] W[i j]", "Y[τ j] = W[i j] X[τ i]",
    ...                  {"τ": 3, "i": 4, "j": 5}, exact=True).equal
    True

:func:`check_gradient` asks the same of a backward step: whether a gradient equation (or
callable) equals autograd's vector–Jacobian product of its forward, for a random cotangent.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .errors import EinattnError, at
from .notation import Equation

Side = Equation | str | Callable[..., torch.Tensor]

_FLOAT_RTOL = 1e-12  # STYLE §5: float64 equality proofs at ≤1e-12 relative to scale
_EXACT_RANGE = 2**16


@dataclass(frozen=True)
class Report:
    """The outcome of one comparison."""

    equal: bool
    mode: str  # "exact" or "float"
    draws: int
    max_deviation: float
    tolerance: float
    where: str  # the position of the largest deviation, by index name
    lhs: str
    rhs: str
    false_acceptance: float | None = None  # exact mode: the Schwartz–Zippel bound

    def __str__(self) -> str:
        verdict = "equal" if self.equal else "NOT equal"
        bound = ("" if self.false_acceptance is None
                 else f", false acceptance ≤ {self.false_acceptance:.1e}")
        return "\n".join([
            f"{verdict} ({self.mode}, {self.draws} draws{bound})",
            f"  lhs: {self.lhs}",
            f"  rhs: {self.rhs}",
            f"  max |lhs − rhs| = {self.max_deviation:.3e} at {self.where} "
            f"(tolerance {self.tolerance:.1e})",
        ])


def assert_equivalent(lhs: Side, rhs: Side, sizes: dict[str, int] | None = None, *,
                      exact: bool = False, seed: int = 0, draws: int = 3,
                      inputs: dict[str, str] | None = None) -> Report:
    """Raise ``AssertionError`` (showing both forms, the largest deviation and where)
    unless ``lhs`` and ``rhs`` agree; return the :class:`Report` otherwise."""
    report = check_equivalent(lhs, rhs, sizes, exact=exact, seed=seed, draws=draws, inputs=inputs)
    if not report.equal:
        raise AssertionError(str(report))
    return report


def check_equivalent(lhs: Side, rhs: Side, sizes: dict[str, int] | None = None, *,
                     exact: bool = False, seed: int = 0, draws: int = 3,
                     inputs: dict[str, str] | None = None) -> Report:
    """The non-raising form of :func:`assert_equivalent`: a :class:`Report`.

    ``inputs`` maps tensor names to their index strings (``{"S": "n μ τ σ"}``); it is needed
    only when neither side is an equation.
    """
    if isinstance(draws, bool) or not isinstance(draws, int) or draws < 1:
        raise EinattnError(f"draws must be a positive int, got {draws!r}")
    sides = [Equation(s) if isinstance(s, str) else s for s in (lhs, rhs)]
    sizes = dict(sizes or {})
    signature = _signature(sides, inputs)
    if exact:
        _check_exact(sides)
    degree = max([d for d in map(_degree, sides) if d] or [2 * len(signature)])
    limit = min(getattr(s, "exact_limit", 2.0**62) for s in sides)
    span = _exact_span(sizes, degree, limit) if exact else 0
    generator = torch.Generator().manual_seed(seed)
    device = torch.device("cpu") if exact else torch.get_default_device()  # integer products
    worst = None  # have no CUDA kernel: the exact mode runs on the CPU
    for _ in range(draws):
        tensors = {name: _draw(shape_of(sizes), span, generator).to(device)
                   for name, shape_of in signature.items()}
        left, right = (_evaluate(s, tensors, sizes, device) for s in sides)
        result = _compare(left, right, exact, sides)
        if worst is None or result[0] - result[1] > worst[0] - worst[1]:
            worst = result
    deviation, tolerance, where = worst
    bound = (degree / (2 * span + 1)) ** draws if exact else None
    return Report(deviation <= tolerance, "exact" if exact else "float", draws, deviation,
                  tolerance, where, _text(sides[0]), _text(sides[1]), bound)


def _signature(sides: list, inputs: dict[str, str] | None) -> dict[str, Callable]:
    """Tensor name -> function of ``sizes`` giving its shape (groups flattened)."""
    signature: dict[str, Callable] = {}
    for side in sides:
        if isinstance(side, Equation):
            for term in side.terms:
                signature.setdefault(term.name, _shape_maker(term.name, term.axes))
            for name in getattr(side, "scalars", ()):  # an expression's c: a 0-d draw
                signature.setdefault(name, _shape_maker(name, ()))
    for name, text in (inputs or {}).items():
        term = Equation(f"_[] = {name}[{text}]").terms[0]
        signature[name] = _shape_maker(name, term.axes)
    if not signature:
        raise EinattnError("neither side is an equation: say which tensors the callables take, "
                           "e.g. inputs={'S': 'n μ τ σ'}")
    return signature


def _shape_maker(name: str, axes) -> Callable[[dict[str, int]], tuple[int, ...]]:
    def shape(sizes: dict[str, int]) -> tuple[int, ...]:
        missing = [i for axis in axes for i in axis.indices if i not in sizes]
        if missing:
            raise EinattnError(f"sizes gives no size for index {missing[0]!r} of {name}; "
                               f"pass sizes={{{missing[0]!r}: ...}}")
        return tuple(math.prod(sizes[i] for i in axis.indices) for axis in axes)
    return shape


def _check_exact(sides: list) -> None:
    for side in sides:
        if isinstance(side, Equation) and not side.is_contraction:
            raise EinattnError(f"exact=True needs a multilinear step, but {side.text!r} is "
                               f"no contraction (it applies functions); use float mode")
        if isinstance(side, Equation) and side.scale is not None:
            raise EinattnError(f"exact=True needs a multilinear step, but {side.text!r} divides "
                               f"by √{side.scale}, which is irrational in general; "
                               f"use float mode")


def _degree(side) -> int | None:
    """A side's degree as a polynomial of its tensors, where it says: an equation's number
    of operands, or a callable's ``degree`` attribute."""
    return len(side.terms) if isinstance(side, Equation) else getattr(side, "degree", None)


def _exact_span(sizes: dict[str, int], degree: int, limit: float = 2.0**62) -> int:
    """The largest R such that sums of products of ``degree`` integers in [-R, R] over all
    index combinations stay below ``limit`` (2^62; 2^52 where a side computes in float64),
    capped at 2^16."""
    terms = max(1, math.prod(sizes.values()))
    return max(1, min(_EXACT_RANGE, int((limit / terms) ** (1.0 / degree))))


def _draw(shape: tuple[int, ...], span: int, generator: torch.Generator) -> torch.Tensor:
    """Inputs drawn on the CPU, whatever torch's default device: a CPU generator draws the
    same numbers everywhere."""
    if span:
        return torch.randint(-span, span + 1, shape, generator=generator, dtype=torch.int64,
                             device="cpu")
    return torch.randn(shape, generator=generator, dtype=torch.float64, device="cpu")


def _evaluate(side, tensors: dict[str, torch.Tensor], sizes: dict[str, int],
              device: torch.device) -> torch.Tensor:
    """A side on the drawn tensors, with their device as the default: tensors a side makes
    itself join them."""
    with torch.device(device):
        return _evaluated(side, tensors, sizes)


def _evaluated(side, tensors: dict[str, torch.Tensor], sizes: dict[str, int]) -> torch.Tensor:
    if isinstance(side, Equation):
        known = {k: v for k, v in sizes.items() if k in side.indices}
        names = (*side.operands, *getattr(side, "scalars", ()))
        return side(**{n: tensors[n] for n in names}, **known)
    parameters = inspect.signature(side).parameters
    takes_all = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    return side(**{k: v for k, v in tensors.items() if takes_all or k in parameters})


def _compare(left: torch.Tensor, right: torch.Tensor, exact: bool, sides: list):
    if left.shape != right.shape:
        raise AssertionError(f"the sides have different shapes: {tuple(left.shape)} from "
                             f"{_text(sides[0])} but {tuple(right.shape)} from {_text(sides[1])}")
    if left.numel() == 0:
        return 0.0, 0.0, "(empty)"
    if exact and (left.is_floating_point() or right.is_floating_point()):
        raise EinattnError("exact=True but a side returned floating-point values: it is not a "
                           "pure contraction")
    # Equal values agree, equal infinities included; NaN or an unmatched ±inf is a failure.
    diff = torch.where(left == right, 0, (left - right).abs()).double()
    diff = torch.nan_to_num(diff, nan=math.inf, posinf=math.inf)
    flat = int(diff.argmax())
    deviation = float(diff.reshape(-1)[flat])
    scale = max([1.0] + [float(m.max()) for m in (t.abs()[t.isfinite()] for t in (left, right))
                         if m.numel()])
    tolerance = 0.0 if exact else _FLOAT_RTOL * scale
    return deviation, tolerance, _where(flat, left.shape, sides)


def _where(flat: int, shape: torch.Size, sides: list) -> str:
    position = []  # row-major, by hand: torch.unravel_index needs torch 2.2
    for n in reversed(shape):
        flat, p = divmod(flat, n)
        position.insert(0, p)
    names = next((n for n in map(_output_indices, sides) if n is not None), None)
    if names is None or len(names) != len(shape):
        return "[" + ", ".join(str(int(p)) for p in position) + "]"
    return "[" + ", ".join(f"{n}={int(p)}" for n, p in zip(names, position, strict=True)) + "]"


def _output_indices(side) -> tuple[str, ...] | None:
    """The indices that name a side's output axes, where it has them (no groups)."""
    if isinstance(side, Equation):
        return None if side.lhs.grouped else side.lhs.indices
    return getattr(side, "output_indices", None)


def _text(side) -> str:
    if isinstance(side, Equation):
        return side.text
    return getattr(side, "__qualname__", repr(side))


# -- gradients: a backward equation checked against autograd --------------------------------

_FLOAT64_EXACT = 2.0**52  # integers below 2^53 are exact in float64; one bit to spare


class GradientSides(NamedTuple):
    """:func:`check_gradient`'s question as two sides for :func:`check_equivalent`: ``true``
    is autograd's vector–Jacobian product of the forward, ``claimed`` the gradient given.
    Both take the forward's inputs and the cotangent ``d<Out>`` by keyword; ``inputs`` gives
    each of those tensors' index strings."""

    true: Callable[..., torch.Tensor]
    claimed: Callable[..., torch.Tensor]
    inputs: dict[str, str]


def check_gradient(forward: Side, gradient: Side, *, wrt: str,
                   sizes: dict[str, int] | None = None, shapes: dict[str, str] | None = None,
                   output: str | None = None, exact: bool = False, seed: int = 0,
                   draws: int = 3) -> Report:
    """Whether ``gradient`` is the gradient of ``forward`` with respect to its input ``wrt``:
    ``d<wrt> = Σ d<Out> ∂Out/∂<wrt>`` for a random cotangent ``d<Out>``, the true one by
    ``torch.autograd`` in float64 (:func:`gradient_sides`), compared as
    :func:`check_equivalent` compares. Exact mode (multilinear steps) draws integers small
    enough that autograd's float64 sums are exact.

    >>> check_gradient("S[τ σ] = Q[τ a] K[σ a]", "dQ[τ a] = dS[τ σ] K[σ a]", wrt="Q",
    ...                sizes={"τ": 3, "σ": 4, "a": 5}, exact=True).equal
    True
    >>> def softmax(S):
    ...     return S.softmax(-1)
    >>> check_gradient(softmax, lambda A, dA: A * (dA - (A * dA).sum(-1, keepdim=True)),
    ...                wrt="S", output="A", shapes={"S": "τ σ", "A": "τ σ"},
    ...                sizes={"τ": 3, "σ": 4}).equal
    True
    """
    sides = gradient_sides(forward, gradient, wrt=wrt, sizes=sizes, shapes=shapes,
                           output=output)
    return check_equivalent(sides.true, sides.claimed, sizes, exact=exact, seed=seed,
                            draws=draws, inputs=sides.inputs)


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
        raise EinattnError(f"wrt={wrt!r} is not an input of the forward {_text(forward)}; its "
                           f"inputs are {', '.join(terms)}")
    names, cotangent = list(terms), f"d{out.name}"
    takes = _gradient_takes(gradient, terms[wrt], [*names, out.name, cotangent])
    inputs = {name: _bracketed(t) for name, t in [*terms.items(), (cotangent, out)]}
    parameters = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY) for n in inputs]
    true = _autograd_side(forward, wrt, names, cotangent, sizes)
    claimed = _claimed_side(gradient, forward, wrt, names, out.name, takes, sizes)
    for side, text in [(true, f"autograd's d{wrt} of {_text(forward)}"),
                       (claimed, _text(gradient))]:
        side.__qualname__, side.__signature__ = text, inspect.Signature(parameters)
        side.output_indices = None if terms[wrt].grouped else terms[wrt].indices
    true.degree, claimed.degree = _degree(forward), _degree(gradient)
    true.exact_limit = _FLOAT64_EXACT  # autograd sums in float64: exact below 2^53
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
    if isinstance(forward, Equation):
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
                               f"forward {_text(forward)}; pass shapes={{{name!r}: 'τ σ', ...}}")
    return {name: _term(name, shapes[name]) for name in names}, _term(out, shapes[out])


def _gradient_takes(gradient, wrt, available: list[str]) -> list[str]:
    """The tensors the gradient takes, once it is known to produce ``d<wrt>`` from them."""
    if isinstance(gradient, Equation):
        lhs = gradient.lhs
        shown = [(a.indices, a.grouped) for a in lhs.axes]
        if lhs.name != f"d{wrt.name}" or shown != [(a.indices, a.grouped) for a in wrt.axes]:
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
            raise EinattnError(f"the gradient {_text(gradient)} takes {name!r}, which is none of "
                               f"the forward's inputs, its output and its cotangent: "
                               f"{', '.join(available)}")
    return takes


def _runner(side, sizes: dict[str, int]) -> Callable[[dict], torch.Tensor]:
    """A side as a function of a dict of tensors (an equation also gets its sizes)."""
    if isinstance(side, Equation):
        known = {k: v for k, v in sizes.items() if k in side.indices}
        return lambda tensors: side(**{n: tensors[n] for n in side.operands}, **known)
    return lambda tensors: side(**tensors)


def _exact_values(t: torch.Tensor, what: str) -> torch.Tensor:
    """A float64 result at integer inputs as int64, once it is known to be integral."""
    if not torch.equal(t, t.round()):
        raise EinattnError(f"exact=True but {what} is not an integer at integer inputs: the "
                           f"forward is not multilinear; use float mode")
    return t.to(torch.int64)


def _autograd_side(forward, wrt: str, names: list[str], cotangent: str, sizes) -> Callable:
    run = _runner(forward, sizes)

    def true_gradient(**tensors: torch.Tensor) -> torch.Tensor:
        exact = not tensors[cotangent].is_floating_point()
        if exact:
            _check_exact([forward])
        arguments = {n: tensors[n].detach().to(torch.float64).requires_grad_(n == wrt)
                     for n in names}
        with torch.enable_grad():
            out = run(arguments)
            d_out = tensors[cotangent]
            if out.shape != d_out.shape:
                raise EinattnError(f"the forward {_text(forward)} returned shape "
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
        if exact:
            _check_exact([gradient])
        given = {n: tensors[n] for n in takes if n in tensors}
        if out in takes:  # the forward's output, computed from the same inputs
            with torch.no_grad():
                value = run_forward({n: tensors[n].to(torch.float64) for n in names})
            given[out] = _exact_values(value, f"the forward's output {out}") if exact else value
        result = run(given)
        if result.shape != tensors[wrt].shape:
            raise EinattnError(f"the gradient {_text(gradient)} returned shape "
                               f"{tuple(result.shape)}, but d{wrt} has {wrt}'s shape "
                               f"{tuple(tensors[wrt].shape)}")
        return result
    return claimed_gradient
