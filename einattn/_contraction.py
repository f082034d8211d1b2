"""The engine of an index equation that is one product: parsed, checked, planned, run
(:class:`einattn.notation.Equation` is this class with the expression language beside it;
its docstring shows one at work). An expression's inner contractions are these too:

    >>> import torch
    >>> Contraction("Y[τ j] = X[τ i] W[i j]")(X=torch.ones(2, 3), W=torch.ones(3, 4)).shape
    torch.Size([2, 4])

Summation is Einstein's: an index absent from the left is summed. opt_einsum plans the
order of a contraction of three or more operands, torch runs each step, and the plan is
cached per shape signature so a call in a training loop costs about one ``torch.einsum``.
Index sizes are resolved by name (:mod:`einattn._sizes`), a Kronecker delta ``δ`` made from
them (:mod:`einattn._delta`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from itertools import repeat
from typing import Any

import opt_einsum
import torch

from . import _autocast, _delta
from ._lowering import assign_letters, contraction
from ._sizes import Sizes
from ._syntax import Parsed, Term, parse
from .errors import EinattnError, at
from .latex import render

_MAX_PLANS = 256


@dataclass(frozen=True)
class Explanation:
    """How an equation runs at given sizes: the letter-mapped einsum and opt_einsum's plan."""

    equation: str
    einsum: str
    sizes: dict[str, int]
    path: list[tuple[int, ...]]
    flops: int
    largest_intermediate: int
    info: Any = field(repr=False)

    def __str__(self) -> str:
        sizes = ", ".join(f"{k}={v}" for k, v in self.sizes.items())
        return "\n".join(
            [
                f"equation: {self.equation}",
                f"einsum:   {self.einsum}",
                f"sizes:    {sizes}",
                f"path:     {self.path}",
                f"FLOPs:    {self.flops:,}",
                f"largest intermediate: {self.largest_intermediate:,} elements",
                str(self.info),
            ]
        )


@dataclass(frozen=True)
class _Plan:
    """Everything a call needs once the sizes of one signature are known and checked."""

    operand_slots: tuple[int, ...]  # occurrence -> position in the unique-name list
    reshapes: tuple[tuple[int, tuple[int, ...]], ...]  # (occurrence, groups opened), for steps
    scale_slot: int  # occurrence to multiply by the scale, or -1
    scale: float
    whole: Callable[..., torch.Tensor]  # one step (one or two operands, groups as given)
    steps: tuple[tuple[tuple[int, ...], Callable], ...]  # (operands popped, step), for more
    out_shape: tuple[int, ...] | None
    direct: bool  # nothing to do but ``whole`` over the tensors as given
    call: Callable[..., torch.Tensor] = field(init=False, repr=False, compare=False)  # what runs

    def __post_init__(self) -> None:  # the call with the fewest Python frames that will do
        call = self._run
        if self.direct:
            call = self.whole
        elif (self.scale_slot >= 0 and self.operand_slots == (0, 1) and not self.steps
              and self.out_shape is None):  # the scale is its only extra
            call = _scaled(self.whole, self.scale_slot, self.scale)
        object.__setattr__(self, "call", call)

    def _run(self, *tensors: torch.Tensor) -> torch.Tensor:
        ops = [tensors[k] for k in self.operand_slots]
        if self.scale_slot >= 0:
            ops[self.scale_slot] = ops[self.scale_slot] * self.scale
        if self.steps:
            for k, shape in self.reshapes:
                ops[k] = ops[k].reshape(*shape)
            for popped, step in self.steps:
                ops.append(step(*[ops.pop(k) for k in popped]))
            out = ops[0]
        else:
            out = self.whole(*ops)
        return out if self.out_shape is None else out.reshape(*self.out_shape)


class Contraction(Sizes):
    """An index equation ``Out[...] = A[...] B[...] ... [/ √index]``.

    Call it with the operands as keyword tensors, and with keyword integers for sizes of
    grouped indices that cannot be inferred: ``eq(X=x, W=w, μ=4, B=3)``.
    """

    is_contraction = True  # one product of terms; an Expression is more

    def __init__(self, text: str):
        if not isinstance(text, str):
            raise EinattnError(f"an Equation is written as a string such as "
                               f"\"S[n μ τ σ] = Q[n μ τ a] K[n μ σ a] / √a\", got "
                               f"{type(text).__name__}")
        self.text = text
        parsed = parse(text)
        self._parsed: Parsed = replace(parsed, operands=_delta.numbered(parsed.operands, text))
        self._letters = assign_letters(self._parsed, text)
        self._subscripts = self._letter_subscripts()  # the einsum string, e.g. "nmta,nmsa->nmts"
        self._plans: dict[tuple, _Plan] = {}
        self._named(self._parsed.operands)

    def _named(self, terms: tuple[Term, ...]) -> None:
        """``operands``, the tensors a call takes, and ``_inputs``, those and the deltas."""
        self._inputs: tuple[str, ...] = tuple(dict.fromkeys(t.name for t in terms))
        self.operands = tuple(n for n in self._inputs if not _delta.is_delta(n))
        self._deltas = len(self.operands) < len(self._inputs)

    @property
    def output(self) -> str:
        return self._parsed.output.name

    @property
    def lhs(self) -> Term:
        """The output term, with its indices and groups."""
        return self._parsed.output

    @property
    def terms(self) -> tuple[Term, ...]:
        """The operand terms in order; a tensor used twice appears twice (a delta, which
        the equation makes itself, not)."""
        return tuple(t for t in self._parsed.operands if not _delta.is_delta(t.name))

    @property
    def scale(self) -> str | None:
        """The index whose size's square root divides the product, if any."""
        return self._parsed.scale

    @property
    def indices(self) -> tuple[str, ...]:
        """Every index of the equation, in order of first appearance."""
        return tuple(self._letters)

    @property
    def summed(self) -> tuple[str, ...]:
        """The indices summed over: those absent from the left-hand side."""
        free = set(self._parsed.output.indices)
        return tuple(i for i in self._letters if i not in free)

    def __repr__(self) -> str:
        return f"Equation({self.text!r})"  # as the user writes it

    def __str__(self) -> str:
        return self.text

    def __reduce__(self) -> tuple:  # pickled as its text: the plans are rebuilt, not stored
        return type(self), (self.text,)

    def latex(self) -> str:
        """The equation in LaTeX, in the derivation's style; ``from_latex`` reads it."""
        return render(self._parsed)

    def __call__(self, **arguments: Any) -> torch.Tensor:
        if self._deltas:
            arguments = self._with_deltas(arguments)
        if torch.compiler.is_compiling():
            return self._traced(arguments)
        try:
            plan = self._plans.get(signature(arguments))
        except TypeError:  # an unhashable argument: planning says what is wrong with it
            plan = None
        if plan is None:  # planned outside the except clause: no chained backend traceback
            plan = self._plan(arguments)
        try:  # map over C callables: no Python frame per operand
            return plan.call(*map(arguments.__getitem__, self._inputs))
        except (RuntimeError, TypeError) as error:
            failure = error
        self._plan(arguments)  # raises an EinattnError if the arguments are at fault
        self._check_dtypes(arguments, failed=True)  # or if a dtype is
        raise failure

    def planned(self, **arguments: Any) -> Callable[..., torch.Tensor]:
        """What a call with arguments of these shapes runs, planned (and its sizes checked)
        once: it takes the operands positionally, in :attr:`operands` order, and runs the
        same torch operations as the call, without looking its plan up again (a decoding
        step's plan keeps it: :mod:`einattn._decode`). Equations with deltas are planned by
        their calls only."""
        if self._deltas:
            raise EinattnError(f"{self.text}: an equation with deltas is planned per call")
        plan = self._plans.get(signature(arguments))
        return (self._plan(arguments) if plan is None else plan).call

    def _traced(self, arguments: dict[str, Any]) -> torch.Tensor:
        """The call as ``torch.compile`` traces it: no plan cache and no planner (Python that
        dynamo cannot follow), one ``torch.einsum`` that Inductor lowers itself. Sizes are
        checked when the same call runs eagerly."""
        sizes = {k: v for k, v in arguments.items() if isinstance(v, int)}
        for term in self._parsed.operands:  # sizes that single axes show, for the groups
            t = arguments[term.name]
            axes = [(i,) for i in term.indices] if t.ndim == len(term.indices) else \
                [axis.indices for axis in term.axes]
            for indices, n in zip(axes, t.shape, strict=True):
                if len(indices) == 1:
                    sizes[indices[0]] = n
        ops = []
        for term in self._parsed.operands:
            t = arguments[term.name]
            ops.append(t if t.ndim == len(term.indices) else opened(t, term, sizes))
        if self._parsed.scale is not None:
            k = next(k for k, t in enumerate(self._parsed.operands)
                     if self._parsed.scale in t.indices)
            size = ops[k].shape[self._parsed.operands[k].indices.index(self._parsed.scale)]
            ops[k] = ops[k] / math.sqrt(size)
        out = torch.einsum(self._subscripts, *ops)
        start = 0
        for axis in self._parsed.output.axes:
            out = out.flatten(start, start + len(axis.indices) - 1)
            start += 1
        return out

    def sizes(self, **arguments: Any) -> dict[str, int]:
        """The size of every index, from tensors (or shapes) and keyword sizes, checked."""
        shapes, given = self._split_arguments(arguments, allow_shapes=True)
        return self._resolve(shapes, given)

    def explain(self, **arguments: Any) -> Explanation:
        """The letter-mapped einsum, contraction path, FLOPs and largest intermediate.

        Arguments are tensors, shapes (tuples) or index sizes, as for a call.
        """
        shapes, given = self._split_arguments(arguments, allow_shapes=True)
        sizes = self._resolve(shapes, given)
        subscripts = self._subscripts
        atomic = [tuple(sizes[i] for i in t.indices) for t in self._parsed.operands]
        path, info = opt_einsum.contract_path(subscripts, *atomic, shapes=True)
        return Explanation(self.text, subscripts, sizes, list(path), int(info.opt_cost),
                           int(info.largest_intermediate), info)

    # -- planning: everything below runs once per shape signature ------------------------

    def _plan(self, arguments: dict[str, Any]) -> _Plan:
        shapes, given = self._split_arguments(arguments, allow_shapes=False)
        self._check_dtypes(arguments)
        sizes = self._resolve(shapes, given)
        terms = self._parsed.operands
        atomic = [tuple(sizes[i] for i in t.indices) for t in terms]
        scale_slot, scale = -1, 1.0
        if self._parsed.scale is not None:
            scale_slot = min(range(len(terms)), key=lambda k: math.prod(atomic[k]))
            if sizes[self._parsed.scale] == 0:
                raise at(f"scale index {self._parsed.scale!r} has size 0: cannot divide by √0",
                         self.text, self._parsed.scale_position)
            scale = 1.0 / math.sqrt(sizes[self._parsed.scale])
        out = self._parsed.output
        out_shape = tuple(math.prod(sizes[i] for i in axis.indices) for axis in out.axes)
        slots = tuple(self._inputs.index(t.name) for t in terms)
        arriving = [shapes[t.name] for t in terms]  # groups of indices may still be one axis
        steps = self._steps(atomic, sizes) if len(terms) > 2 else ()
        plan = _Plan(
            operand_slots=slots,
            reshapes=tuple((k, atomic[k]) for k, t in enumerate(terms)
                           if steps and len(arriving[k]) != len(t.indices)),
            scale_slot=scale_slot,
            scale=scale,
            whole=contraction(self._subscripts, atomic, arriving),
            steps=steps,
            out_shape=out_shape if out.grouped else None,
            direct=(slots == tuple(range(len(slots))) and scale_slot < 0 and not steps
                    and not out.grouped),
        )
        if len(self._plans) >= _MAX_PLANS:
            self._plans.clear()
        self._plans[signature(arguments)] = plan
        return plan

    def _steps(self, atomic: list[tuple[int, ...]], sizes: dict[str, int]):
        """opt_einsum's pairwise order, each pair lowered (see ``_lowering``)."""
        _, info = opt_einsum.contract_path(self._subscripts, *atomic, shapes=True)
        by_letter = {self._letters[i]: n for i, n in sizes.items()}
        steps = []
        for popped, _, subscripts, *_ in info.contraction_list:
            terms = subscripts.split("->")[0].split(",")
            shapes = [tuple(by_letter[c] for c in term) for term in terms]
            steps.append((tuple(popped), contraction(subscripts, shapes)))
        return tuple(steps)

    def _letter_subscripts(self) -> str:
        def letters(term: Term) -> str:
            return "".join(self._letters[i] for i in term.indices)

        inputs = ",".join(letters(t) for t in self._parsed.operands)
        return f"{inputs}->{letters(self._parsed.output)}"

    def _split_arguments(self, arguments: dict[str, Any], *, allow_shapes: bool):
        """Separate tensors (as shapes) from keyword sizes; reject missing and unknown names."""
        missing = [n for n in self.operands if n not in arguments]
        if missing:
            raise at(f"missing tensor {', '.join(missing)}: this equation takes "
                     f"{', '.join(self.operands)}", self.text,
                     *(t.position for t in self._parsed.operands if t.name in missing))
        shapes: dict[str, tuple[int, ...]] = {}
        given: dict[str, int] = {}
        for name, value in arguments.items():
            if name in self._inputs:
                shapes[name] = _shape_of(name, value, allow_shapes)
            elif name in self._letters:
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise EinattnError(f"size of index {name!r} must be a non-negative int, "
                                       f"got {value!r}")
                given[name] = value
            else:
                raise at(f"{name!r} is neither a tensor nor an index of this equation "
                         f"(tensors: {', '.join(self.operands)})", self.text)
        return shapes, given

    def _check_dtypes(self, arguments: dict[str, Any], failed: bool = False) -> None:
        """The operands' dtypes and devices agree; once the backend ``failed``, each dtype is
        one this equation runs on (not bool; no integers with a scale or off the CPU)."""
        first = arguments[self.operands[0]]
        for name in self.operands:
            t = arguments[name]
            if failed and not (t.is_floating_point() or t.is_complex()):
                takes = (f" (its scale / √{self._parsed.scale} is not an integer)"
                         if self._parsed.scale else ", or integers where torch multiplies them")
                raise at(f"{name} is {t.dtype} on {t.device.type}, which this equation does not "
                         f"run on: it takes floating-point or complex tensors{takes}; convert "
                         f"with .to()", self.text)
            if t.dtype != first.dtype and _autocast.dtype(t.device) is None:
                # (under autocast the backend casts the operands: Z is bfloat16, W_O is not)
                raise at(f"{name} is {t.dtype} but {self.operands[0]} is {first.dtype}", self.text)
            if t.device != first.device:
                raise at(f"{name} is on {t.device} but {self.operands[0]} is on {first.device}",
                         self.text)

    def _with_deltas(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """``arguments`` and the equation's deltas, made from the sizes they give."""
        tensors = {k: v for k, v in arguments.items() if k in self.operands}
        sizes = self.sizes(**{k: v for k, v in arguments.items() if not _delta.is_delta(k)})
        like = next((t for t in tensors.values() if isinstance(t, torch.Tensor)), None)
        return {**arguments, **_delta.tensors(self._parsed.operands, sizes, like)}



def signature(arguments: dict[str, Any]) -> tuple:
    """What a plan is cached by: the argument names in call order, then each tensor's shape
    and each keyword size, then each tensor's device, in one flat tuple (its length says how
    many names lead). The devices are part of it because a plan is only made after they
    were checked to agree (a meta tensor beside a CPU one would run, wrongly). Built on
    every call, so kept to passes over the arguments in C (``getattr(v, "shape", v)``
    mapped, no Python frame per argument); a call with its keywords reordered plans once
    more. Anything else with a ``shape`` (a NumPy array) may find a tensor's plan, whose
    backend call then fails and the call re-plans, which names the operand."""
    values = arguments.values()
    return (*arguments, *map(getattr, values, _SHAPE, values),
            *map(getattr, values, _DEVICE, values))


_SHAPE = repeat("shape")  # getattr's second argument, as many times as map asks
_DEVICE = repeat("device")


def _scaled(whole: Callable[..., torch.Tensor], slot: int,
            scale: float) -> Callable[..., torch.Tensor]:
    """``whole`` over two operands, the one at ``slot`` (0 or 1) multiplied by ``scale``
    first: equation (2)'s ``/ √a`` folded into its smaller operand, in one Python frame."""
    if slot == 0:
        return lambda A, B: whole(A * scale, B)
    return lambda A, B: whole(A, B * scale)


def opened(t: torch.Tensor, term: Term, sizes: dict[str, int]) -> torch.Tensor:
    """``t`` with each grouped axis of ``term`` opened into its indices, ``(μ B a) i`` as
    ``μ B a i`` (an unflatten: the order stays), one unknown size per group inferred."""
    for k in reversed(range(len(term.axes))):  # from the last, so earlier axes keep their place
        if term.axes[k].grouped:
            t = torch.unflatten(t, k, [sizes.get(i, -1) for i in term.axes[k].indices])
    return t


def _shape_of(name: str, value: Any, allow_shapes: bool) -> tuple[int, ...]:
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    if allow_shapes and isinstance(value, (tuple, list, torch.Size)):
        if all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value):
            return tuple(value)
        raise EinattnError(f"shape of {name} must be non-negative ints, got {tuple(value)!r}")
    expected = "a torch.Tensor or a shape" if allow_shapes else "a torch.Tensor"
    raise EinattnError(f"{name} must be {expected}, got {type(value).__name__}")
