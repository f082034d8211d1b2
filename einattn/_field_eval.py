"""Equations evaluated over a finite field: the tree of :mod:`einattn._expression`, compiled
by the same :class:`~einattn._expression_compile.Compiler` that runs it on torch tensors, with
the arithmetic of :class:`~einattn._field_tensor.FieldTensor` (:data:`Algebra` ``_algebra``):
one reading of an equation, two ways to compute it.

* ``exp``, ``log``, ``softmax_σ``, ``logsumexp_σ``, ``sum_σ``, contractions, ``/ √a``:
  their finite-field forms (:mod:`einattn._field_tensor`);
* ``max_σ(x)`` and ``max(x, y)``: a free value, drawn once per draw for each text of the
  argument (so that the same ``max_σ(S[τ σ])`` in two places, or on both sides of a step,
  is one value);
* ``tanh``, ``sigmoid``: no form (the step runs in float64).

A side is an equation, a :class:`~einattn.chain.Chain` of them, or autograd's gradient of
one (:func:`vjp`: reverse mode in the field, :mod:`einattn._field_tape`).
"""

from __future__ import annotations

import math
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from decimal import Decimal
from fractions import Fraction
from functools import lru_cache

import torch

from . import _delta, _expression
from . import _field_tape as tape
from ._expression import Product, Tensor, walk
from ._expression_compile import Algebra, Compiler
from ._field import Field
from ._field_tensor import (
    Degree,
    FieldTensor,
    Missing,
    Values,
    constant,
    contracted,
    drawn,
    joined,
    number,
    root,
)
from ._lowering import assign_letters
from ._syntax import parse


@dataclass
class Draw:
    """One draw of a check: its field, its generator, the free values drawn so far."""

    field: Field
    generator: torch.Generator
    free: dict[str, FieldTensor] = field(default_factory=dict)

    def values(self, shape: tuple[int, ...], modulus: int) -> torch.Tensor:
        return torch.randint(0, modulus, shape, generator=self.generator, dtype=torch.int64)

    def tensor(self, name: str, shape: tuple[int, ...]) -> FieldTensor:
        """A drawn tensor: uniform in ``Z_p`` as a value, uniform in ``Z_q`` as an exponent."""
        F = self.field
        return drawn(F, name, self.values(shape, F.p), self.values(shape, F.q))


CURRENT: ContextVar[Draw] = ContextVar("einattn_field_draw")


def _free(key: str, shape: tuple[int, ...]) -> FieldTensor:
    """The free value of ``key`` in the current draw, drawn on first use."""
    draw = CURRENT.get()
    key = f"{key} {tuple(shape)}"
    if key not in draw.free:
        draw.free[key] = draw.tensor(key, tuple(shape))
    return draw.free[key]


def _nothing(why: str):
    """A function with no finite-field form."""
    def none(x: FieldTensor) -> FieldTensor:
        return FieldTensor(x.field, x.shape, Missing(why), Missing(why), None,
                           tape.link((x, lambda g: Missing(why))))
    return none


def _elementwise(node, reached: bool, text: str):
    if node.function == "max":
        return lambda x, y: _free(text, torch.broadcast_shapes(x.shape, y.shape))
    if node.function in ("tanh", "sigmoid"):
        return _nothing(f"{node.function} has no finite-field form")
    return {"exp": FieldTensor.exp, "log": FieldTensor.log}[node.function]


def _along(node, text: str):
    if node.function == "max":
        return lambda x: _free(f"max_{node.axis}({text})", x.shape[:-1])
    return {"softmax": FieldTensor.softmax_last, "logsumexp": FieldTensor.logsumexp_last,
            "sum": FieldTensor.sum_last}[node.function]


def _opened(value: FieldTensor, term, sizes: dict[str, int]) -> FieldTensor:
    """A grouped term's value with its groups opened, unless it arrived opened."""
    if value.ndim != len(term.axes):
        return value
    for k in reversed(range(len(term.axes))):
        if term.axes[k].grouped:
            value = value.unflatten(k, [sizes[i] for i in term.axes[k].indices])
    return value


def _contraction(F: Field, text: str):
    """An inner contraction ``_out[…] = A[…] B[…] … / √a`` over field tensors."""
    parsed = parse(text)
    letters = assign_letters(parsed, text)
    inputs = ",".join("".join(letters[i] for i in t.indices) for t in parsed.operands)
    subscripts = f"{inputs}->{''.join(letters[i] for i in parsed.output.indices)}"

    def run(given: dict, sizes: dict[str, int]) -> FieldTensor:
        factors = [_opened(given[t.name], t, sizes) for t in parsed.operands]
        out = contracted(F, subscripts, factors)
        return out if parsed.scale is None else out / root(F, sizes[parsed.scale])
    return run


def _algebra(F: Field) -> Algebra:
    return Algebra(elementwise=_elementwise, along=_along,
                   contraction=lambda text, groups: (_contraction(F, text), None),
                   number=lambda node: number(F, Fraction(Decimal(node.written))),
                   root=lambda value, n: value / root(F, n), opened=_opened)


@lru_cache(maxsize=256)
def compiled(text: str, p: int):
    """The equation ``text`` as one closure over field tensors of ``Z_p``, and its deltas'
    terms (which the closure reads by their inner names, ``δ:k``)."""
    tree = _expression.parse(text)
    right = _delta.numbered_tree(tree.right, text)
    if isinstance(right, Tensor) and len(set(right.term.indices)) < len(right.term.indices):
        right = Product(right.start, right.end, (right,), (), None, -1)  # a diagonal: a product
    deltas = tuple(n.term for n in walk(right) if isinstance(n, Tensor)
                   and _delta.is_delta(n.term.name))
    return Compiler(text, _algebra(Field(p))).equation(tree.output, right), deltas


def evaluate(side, env: dict[str, FieldTensor], sizes: dict[str, int]) -> FieldTensor:
    """A side over the field tensors ``env`` (by name): an equation, a chain, or autograd's
    gradient of an equation (anything with ``field_value``)."""
    if hasattr(side, "field_value"):
        return side.field_value(env, sizes)
    F = CURRENT.get().field
    run, deltas = compiled(side.text, F.p)
    made = {name: constant(F, t.to(torch.int64))
            for name, t in _delta.tensors(deltas, sizes, None).items()}
    return run({**env, **made}, sizes)


def vjp(forward, wrt: str, cotangent: str, env: dict[str, FieldTensor],
        sizes: dict[str, int]) -> FieldTensor:
    """Autograd's ``d<wrt>`` of ``forward`` for the cotangent ``env[cotangent]``, exactly:
    the forward evaluated with ``wrt`` marked, then each rule run back from its output in
    the field (:func:`einattn._field_tape.backward`)."""
    x = env[wrt]
    leaf = replace(x, parents=(), leaf=True)
    out = evaluate(forward, {**env, wrt: leaf}, sizes)
    d_out = env[cotangent]
    seed = d_out.values.t if isinstance(d_out.values, Values) else d_out.values
    gradient = seed if isinstance(seed, Missing) else tape.backward(out, seed, leaf)
    if isinstance(gradient, Missing):
        return FieldTensor(x.field, x.shape, gradient, gradient)
    return FieldTensor(x.field, x.shape, _gradient_values(gradient, out, d_out),
                       Missing("a gradient inside exp"))


def _gradient_values(t: torch.Tensor, out: FieldTensor, d_out: FieldTensor):
    """The values of ``Σ d<Out> ∂Out/∂x``: the derivative of an entry ``N/D`` of degrees
    (n, d) is of degrees at most (n + d + 1, 2d) (a drawn exponent's ``g^x`` is its own
    derivative), times the cotangent, summed over the output's entries. An output that is
    a logarithm, ``log(N/D)``, has the derivative ``(N/D)′ / (N/D)``."""
    form = out.values if isinstance(out.values, Values) else out.exp().values
    if isinstance(form, Missing):
        return form
    d = form.degree
    entry = Degree(d.num + d.den + 1, 2 * d.den, d.inverted, d.scale)
    if form is not out.values:
        entry = entry.over(d)
    summed = entry.times(d_out.values.degree).summed(max(1, math.prod(out.shape)))
    return Values(t, summed, joined(form.uses, d_out.values.uses))
