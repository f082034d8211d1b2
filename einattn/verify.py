"""Check that two forms of a derivation step compute the same tensor.

Each side is an :class:`~einattn.Equation`, an equation string, a
:class:`~einattn.chain.Chain` of equations, or a Python callable that takes tensors as
keyword arguments named as in the equation(s). Inputs are drawn at random per tensor name
(a tensor used twice gets one value) with shapes from ``sizes``.

* Float mode: float64 normal draws, several of them; the sides must agree to a tolerance
  scaled to the outputs' magnitudes. Named scalars are drawn as 0-d tensors.
* Exact mode (``exact=True``) picks the strongest mode the step allows:

  - the finite field (``mode == "field"``) where both sides are written (equations,
    chains, autograd of one): ``+ − · /``, contractions, ``/ √a``, ``exp``, ``softmax_σ``,
    ``logsumexp_σ``, ``sum_σ``, ``log`` inside ``exp``, ``max`` as a free value
    (:mod:`einattn._field_check` states the bound, :mod:`einattn._field_tensor` the rules);
  - integers (``mode == "exact"``) where a side is a Python function of a multilinear
    step: integer draws and integer arithmetic. Two different multilinear polynomials of
    degree ``d`` agree at a random point of ``S^k`` with probability at most ``d/|S|``
    (Schwartz–Zippel), so ``draws`` independent draws accept a false step with probability
    at most ``(d/|S|)^draws``;
  - float64 otherwise (``tanh``, ``log`` outside ``exp``, Python code that is not
    multilinear), the report's ``note`` saying why.

    >>> check_equivalent("Y[τ j] = X[τ i] W[i j]", "Y[τ j] = W[i j] X[τ i]",
    ...                  {"τ": 3, "i": 4, "j": 5}, exact=True).equal
    True

:func:`check_gradient` asks the same of a backward step: whether a gradient equation (or
callable) equals autograd's vector–Jacobian product of its forward, for a random cotangent.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import _field_check, _sides
from ._field_check import FieldResult, mask_draw
from ._gradient_check import Autograd, GradientSides, gradient_sides
from .chain import Chain
from .errors import EinattnError
from .notation import Equation

Side = Equation | Chain | str | Callable[..., torch.Tensor]
__all__ = ["Autograd", "Chain", "GradientSides", "Report", "assert_equivalent",
           "check_equivalent", "check_gradient", "gradient_sides"]

_FLOAT_RTOL = 1e-12  # STYLE §5: float64 equality proofs at ≤1e-12 relative to scale
_EXACT_RANGE = 2**16
_FLOAT64_EXACT = 2.0**52  # integers below 2^53 are exact in float64; one bit to spare


@dataclass(frozen=True)
class Report:
    """The outcome of one comparison. In the finite field (``mode == "field"``)
    ``max_deviation`` counts the entries that differ (on the worst draw), ``where`` is the
    first of them, ``prime`` the field's; ``note`` says why a check asked to be exact ran
    in float64."""

    equal: bool
    mode: str  # "field", "exact" (integers) or "float"
    draws: int
    max_deviation: float
    tolerance: float
    where: str  # the position of the largest deviation, by index name
    lhs: str
    rhs: str
    false_acceptance: float | None = None  # exact modes: the Schwartz–Zippel bound
    prime: int | None = None  # the field's p
    note: str = ""

    def __str__(self) -> str:
        verdict = "equal" if self.equal else "NOT equal"
        sides = [f"  lhs: {self.lhs}", f"  rhs: {self.rhs}"]
        if self.mode == "field":
            found = ("every entry equal on every draw" if self.equal else
                     f"{self.max_deviation:.0f} entries differ, the first at {self.where}")
            return "\n".join([f"{verdict}: exact (finite field, p = {self.prime}, "
                              f"{self.draws} draws; false-pass probability ≤ "
                              f"{self.false_acceptance:.1e})", *sides, f"  {found}"])
        bound = ("" if self.false_acceptance is None
                 else f", false acceptance ≤ {self.false_acceptance:.1e}")
        return "\n".join([
            f"{verdict} ({self.mode}, {self.draws} draws{bound})", *sides,
            f"  max |lhs − rhs| = {self.max_deviation:.3e} at {self.where} "
            f"(tolerance {self.tolerance:.1e})", *([f"  {self.note}"] if self.note else [])])


def assert_equivalent(lhs: Side, rhs: Side, sizes: dict[str, int] | None = None, *,
                      exact: bool = False, seed: int = 0, draws: int = 3,
                      inputs: dict[str, str] | None = None, masks=()) -> Report:
    """Raise ``AssertionError`` (showing both forms, the largest deviation and where)
    unless ``lhs`` and ``rhs`` agree; return the :class:`Report` otherwise."""
    report = check_equivalent(lhs, rhs, sizes, exact=exact, seed=seed, draws=draws,
                              inputs=inputs, masks=masks)
    if not report.equal:
        raise AssertionError(str(report))
    return report


def check_equivalent(lhs: Side, rhs: Side, sizes: dict[str, int] | None = None, *,
                     exact: bool = False, seed: int = 0, draws: int = 3,
                     inputs: dict[str, str] | None = None, masks=()) -> Report:
    """The non-raising form of :func:`assert_equivalent`: a :class:`Report`.

    ``inputs`` maps tensor names to their index strings (``{"S": "n μ τ σ"}``); it is needed
    only when neither side is an equation. ``masks`` names tensors drawn as additive masks,
    0 or −∞ at random with at least one 0 in each row along the last index (in the field,
    ``exp`` of one is a 0/1 multiplier).
    """
    if isinstance(draws, bool) or not isinstance(draws, int) or draws < 1:
        raise EinattnError(f"draws must be a positive int, got {draws!r}")
    sides = [Equation(s) if isinstance(s, str) else s for s in (lhs, rhs)]
    sizes = dict(sizes or {})
    signature = _signature(sides, inputs)
    masks = _masks(masks, signature)
    note = ""
    if exact and all(map(_sides.written, sides)):
        result = _field_check.compare(sides, sizes, signature, masks, seed, draws)
        if isinstance(result, FieldResult):
            return _field_report(result, sides, draws)
        note = f"float64: {result}"
    if exact:
        why = next(filter(None, map(_sides.not_multilinear, sides)), "") or \
            ("an additive mask (−∞) is no integer" if masks else "")
        code = next((s for s in reversed(sides) if not _sides.written(s)), None)
        if why and not note and code is not None:  # why not the field either
            why = f"{_sides.text(code)} is Python code, which the finite field cannot run, " \
                  f"and {why}"
        exact, note = not (why or note), note or (f"float64: {why}" if why else "")
    return _drawn_report(sides, sizes, signature, masks, exact, seed, draws, note)


def _drawn_report(sides, sizes, signature, masks, exact: bool, seed: int, draws: int,
                  note: str) -> Report:
    """The float64 or integer comparison of :func:`check_equivalent`."""
    degree = max([d for d in map(_sides.degree, sides) if d] or [2 * len(signature)])
    limit = _FLOAT64_EXACT if any(getattr(s, "sums_in_float64", False) for s in sides) \
        else 2.0**62
    span = _exact_span(sizes, degree, limit) if exact else 0
    generator = torch.Generator().manual_seed(seed)
    device = torch.device("cpu") if exact else torch.get_default_device()  # integer products
    worst = None  # have no CUDA kernel: the exact mode runs on the CPU
    for _ in range(draws):
        tensors = {name: _draw(shape_of(sizes), span, generator, name in masks).to(device)
                   for name, shape_of in signature.items()}
        left, right = (_evaluate(s, tensors, sizes, device) for s in sides)
        result = _compare(left, right, exact, sides)
        if worst is None or result[0] - result[1] > worst[0] - worst[1]:
            worst = result
    deviation, tolerance, where = worst
    bound = (degree / (2 * span + 1)) ** draws if exact else None
    return Report(deviation <= tolerance, "exact" if exact else "float", draws, deviation,
                  tolerance, where, _sides.text(sides[0]), _sides.text(sides[1]), bound,
                  note=note)


def _field_report(result: FieldResult, sides: list, draws: int) -> Report:
    where = _where(result.flat, result.shape, sides) if math.prod(result.shape) else "(empty)"
    return Report(result.equal, "field", draws, float(result.differing), 0.0, where,
                  _sides.text(sides[0]), _sides.text(sides[1]), result.bound, result.prime)


def _masks(masks, signature: dict) -> frozenset:
    names = frozenset([masks] if isinstance(masks, str) else masks)
    for name in sorted(names - set(signature)):
        raise EinattnError(f"masks names {name!r}, which is no tensor of the step (its "
                           f"tensors: {', '.join(signature)})")
    return names


def _signature(sides: list, inputs: dict[str, str] | None) -> dict[str, Callable]:
    """Tensor name -> function of ``sizes`` giving its shape (groups flattened)."""
    signature: dict[str, Callable] = {}
    for side in sides:
        if _sides.written(side):
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


def _exact_span(sizes: dict[str, int], degree: int, limit: float = 2.0**62) -> int:
    """The largest R such that sums of products of ``degree`` integers in [-R, R] over all
    index combinations stay below ``limit`` (2^62; 2^52 where a side computes in float64),
    capped at 2^16."""
    terms = max(1, math.prod(sizes.values()))
    return max(1, min(_EXACT_RANGE, int((limit / terms) ** (1.0 / degree))))


def _draw(shape: tuple[int, ...], span: int, generator: torch.Generator,
          is_mask: bool = False) -> torch.Tensor:
    """Inputs drawn on the CPU, whatever torch's default device: a CPU generator draws the
    same numbers everywhere. A mask is 0 or −∞ (:func:`einattn._field_check.mask_draw`)."""
    if is_mask:
        return torch.where(mask_draw(shape, generator) == 1, 0.0, -math.inf).double()
    if span:
        return torch.randint(-span, span + 1, shape, generator=generator, dtype=torch.int64,
                             device="cpu")
    return torch.randn(shape, generator=generator, dtype=torch.float64, device="cpu")


def _evaluate(side, tensors: dict[str, torch.Tensor], sizes: dict[str, int],
              device: torch.device) -> torch.Tensor:
    """A side on the drawn tensors, with their device as the default: tensors a side makes
    itself join them."""
    with torch.device(device):
        return _sides.evaluated(side, tensors, sizes)


def _compare(left: torch.Tensor, right: torch.Tensor, exact: bool, sides: list):
    if left.shape != right.shape:
        raise AssertionError(f"the sides have different shapes: {tuple(left.shape)} from "
                             f"{_sides.text(sides[0])} but {tuple(right.shape)} from "
                             f"{_sides.text(sides[1])}")
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
    names = next((n for n in map(_sides.output_indices, sides) if n is not None), None)
    if names is None or len(names) != len(shape):
        return "[" + ", ".join(str(int(p)) for p in position) + "]"
    return "[" + ", ".join(f"{n}={int(p)}" for n, p in zip(names, position, strict=True)) + "]"


# -- gradients: a backward equation checked against autograd --------------------------------

def check_gradient(forward: Side, gradient: Side, *, wrt: str,
                   sizes: dict[str, int] | None = None, shapes: dict[str, str] | None = None,
                   output: str | None = None, exact: bool = False, seed: int = 0,
                   draws: int = 3) -> Report:
    """Whether ``gradient`` is the gradient of ``forward`` with respect to its input ``wrt``:
    ``d<wrt> = Σ d<Out> ∂Out/∂<wrt>`` for a random cotangent ``d<Out>``, the true one by
    ``torch.autograd`` in float64 (:func:`gradient_sides`), compared as
    :func:`check_equivalent` compares. With ``exact=True``, a written forward and gradient
    are compared in the finite field, where the forward is differentiated exactly; Python
    functions of a multilinear step, with integer draws small enough that autograd's
    float64 sums are exact. ``gradient="auto"`` checks :meth:`einattn.Equation.grad`'s.

    >>> check_gradient("S[τ σ] = Q[τ a] K[σ a]", "dQ[τ a] = dS[τ σ] K[σ a]", wrt="Q",
    ...                sizes={"τ": 3, "σ": 4, "a": 5}, exact=True).mode
    'field'
    >>> def softmax(S):
    ...     return S.softmax(-1)
    >>> check_gradient(softmax, lambda A, dA: A * (dA - (A * dA).sum(-1, keepdim=True)),
    ...                wrt="S", output="A", shapes={"S": "τ σ", "A": "τ σ"},
    ...                sizes={"τ": 3, "σ": 4}).equal
    True
    """
    if isinstance(gradient, str) and gradient == "auto":
        if not isinstance(forward, (str, Equation)):
            raise EinattnError(f"gradient='auto' derives the gradient of an equation, but the "
                               f"forward is {_sides.text(forward)}")
        gradient = (Equation(forward) if isinstance(forward, str) else forward).grad(wrt)
    sides = gradient_sides(forward, gradient, wrt=wrt, sizes=sizes, shapes=shapes,
                           output=output)
    return check_equivalent(sides.true, sides.claimed, sizes, exact=exact, seed=seed,
                            draws=draws, inputs=sides.inputs)
