"""A tensor of a finite-field evaluation: the values of one node of an equation, in ``Z_p``
and as an exponent, what it was computed from (for a gradient, in reverse mode) and what
bounds the chance of a false pass.

A real number ``x`` is held twice, as each of its uses needs it:

* as a value, a residue of ``Z_p`` (what ``+ − · /``, ``sum_σ`` and contractions compute);
* as an exponent ``e + log f``: ``e`` in ``Z_q`` and a value ``f`` (1 unless a ``log`` or a
  mask put one there), what ``exp`` reads: ``exp(e + log f) = g^e · f``. Exponents add and
  are multiplied by constants; ``log`` of a value is ``0 + log f``, ``logsumexp_σ`` is the
  log of ``sum_σ(exp(…))``, and a mask is ``0 + log 1`` or ``0 + log 0`` (``−∞``).

A drawn tensor is random in both (independently): a result is sound only if each drawn
name is read as a value or as an exponent, never both (``uses`` records which), for a
value and its exponent are no two forms of one real number. Where a form does not exist
(``tanh``; ``log`` outside ``exp``; a product of two drawn values inside ``exp``) it is
:class:`Missing` and says why; the check then runs in float64.

``max`` is a free value: each ``max_σ(x)`` (by the text of ``x``) is drawn as a name of its
own. The identities of attention hold for every value of the maximum they subtract (it
cancels), so a step that holds for every drawn one holds for the true one; a step that
needs the maximum to be the largest value fails here and belongs to float64.

``Degree`` bounds each entry as a rational function of the draws (and of ``g^x`` for each
drawn exponent ``x``): the Schwartz–Zippel bound of a false pass is read from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from fractions import Fraction

import torch

from . import _field_tape as tape
from ._field import Field, Missing

Uses = tuple[frozenset, frozenset]  # the names read as values, and as exponents
_NONE: Uses = (frozenset(), frozenset())


def joined(*uses: Uses) -> Uses:
    return (frozenset().union(*(u[0] for u in uses)), frozenset().union(*(u[1] for u in uses)))


@dataclass(frozen=True)
class Degree:
    """Bounds on one entry ``N/D``: ``deg N ≤ num``, ``deg D ≤ den``; ``inverted``: the sum of
    the degrees of the polynomials inverted on the way (one of them may vanish: ``1/0``
    is 0 here); ``scale``: the lcm of the denominators of the exponents' coefficients (the
    degrees count powers of ``g^(x/scale)``)."""

    num: Fraction = Fraction(0)
    den: Fraction = Fraction(0)
    inverted: Fraction = Fraction(0)
    scale: int = 1

    def plus(self, o: Degree) -> Degree:
        return Degree(max(self.num + o.den, o.num + self.den), self.den + o.den,
                      self.inverted + o.inverted, math.lcm(self.scale, o.scale))

    def times(self, o: Degree) -> Degree:
        return Degree(self.num + o.num, self.den + o.den, self.inverted + o.inverted,
                      math.lcm(self.scale, o.scale))

    def over(self, o: Degree) -> Degree:
        return Degree(self.num + o.den, self.den + o.num, self.inverted + o.inverted + o.num,
                      math.lcm(self.scale, o.scale))

    def summed(self, n: int) -> Degree:
        """A sum of ``n`` entries such as this one."""
        return Degree(self.num + (n - 1) * self.den, n * self.den, n * self.inverted, self.scale)

    def power(self, c: Fraction) -> Degree:
        """This entry to the power ``c`` (an integer where the entry is not constant)."""
        num, den = (self.num, self.den) if c >= 0 else (self.den, self.num)
        inverted = self.inverted + (self.num if c < 0 else 0)
        return Degree(abs(c) * num, abs(c) * den, inverted, self.scale)

    def total(self) -> int:
        """The degree of the numerator of this entry and every inverted polynomial, in powers
        of ``g^(x/scale)`` (a drawn value counts ``scale`` too: an upper bound)."""
        return math.ceil(self.scale * (self.num + self.inverted))


@dataclass(frozen=True)
class Values:
    t: torch.Tensor  # residues of Z_p
    degree: Degree
    uses: Uses


@dataclass(frozen=True)
class Exponents:
    """``e + log f``: ``e`` in Z_q, ``f`` in Z_p (None: 1); ``form`` the coefficients of each
    drawn name in ``e`` (positive and negative parts), ``log`` the degree of ``f``."""

    e: torch.Tensor
    f: torch.Tensor | None
    form: dict = field(default_factory=dict)  # name -> (positive, negative) coefficients
    log: Degree = Degree()
    uses: Uses = _NONE

    def degree(self) -> Degree:
        """The degree of ``g^e · f``."""
        positive = sum((p for p, _ in self.form.values()), Fraction(0))
        negative = sum((n for _, n in self.form.values()), Fraction(0))
        scale = math.lcm(self.log.scale, *(c.denominator for pair in self.form.values()
                                           for c in pair))
        return Degree(positive + self.log.num, negative + self.log.den, self.log.inverted, scale)


Rep = Values | Exponents | Missing


def _form(a: dict, b: dict, c: Fraction = Fraction(1)) -> dict:
    """The coefficients of ``a + c·b``."""
    out = dict(a)
    for name, (p, n) in b.items():
        p, n = (abs(c) * p, abs(c) * n) if c >= 0 else (abs(c) * n, abs(c) * p)
        old = out.get(name, (Fraction(0), Fraction(0)))
        out[name] = (old[0] + p, old[1] + n)
    return out


@dataclass(frozen=True, eq=False)
class FieldTensor:
    """One tensor of a finite-field evaluation: its value and its exponent (either may be
    :class:`Missing`), for a number its value as a fraction, and, where it depends on the
    tensor a gradient is taken for, how: ``parents``, each with the rule that takes this
    tensor's cotangent to the parent's (reverse mode, :func:`einattn._field_tape.backward`)."""

    field: Field
    shape: tuple[int, ...]
    values: Rep
    exponents: Rep
    constant: Fraction | None = None
    parents: tuple = ()  # (parent, rule: cotangent -> the parent's cotangent, or Missing)
    leaf: bool = False  # the tensor a gradient is taken for

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def tracked(self) -> bool:
        return self.leaf or bool(self.parents)

    def value(self):
        """The values a rule multiplies by, or why there are none."""
        return self.values.t if isinstance(self.values, Values) else self.values

    # -- arithmetic ------------------------------------------------------------------------

    def __add__(self, other: FieldTensor) -> FieldTensor:
        return self._sum(other, 1)

    def __sub__(self, other: FieldTensor) -> FieldTensor:
        return self._sum(other, -1)

    def _sum(self, other: FieldTensor, sign: int) -> FieldTensor:
        F, shape = self.field, torch.broadcast_shapes(self.shape, other.shape)
        values = _pair(self.values, other.values, lambda a, b: Values(
            (a.t + sign * b.t) % F.p, a.degree.plus(b.degree), joined(a.uses, b.uses)))
        exponents = _pair(self.exponents, other.exponents,
                          lambda a, b: _exponent_sum(F, a, b, sign))
        constant = None if None in (self.constant, other.constant) else \
            self.constant + sign * other.constant
        parents = tape.link((self, lambda g: tape.unbroadcast(F, g, self.shape)),
                            (other, lambda g: tape.unbroadcast(F, sign * g, other.shape)))
        return FieldTensor(F, shape, values, exponents, constant, parents)

    def __neg__(self) -> FieldTensor:
        return self.scaled(Fraction(-1))

    def __mul__(self, other: FieldTensor) -> FieldTensor:
        if self.constant is not None or other.constant is not None:  # a number: 0-d
            number, x = (self, other) if self.constant is not None else (other, self)
            return x.scaled(number.constant)
        F, shape = self.field, torch.broadcast_shapes(self.shape, other.shape)
        values = _pair(self.values, other.values, lambda a, b: Values(
            a.t * b.t % F.p, a.degree.times(b.degree), joined(a.uses, b.uses)))
        exponents = next((x.exponents for x in (self, other) if isinstance(x.exponents, Missing)),
                         Missing("inside exp, a product of two drawn values (no bound holds)"))
        parents = tape.link((self, tape.times(F, other.value(), self.shape)),
                            (other, tape.times(F, self.value(), other.shape)))
        return FieldTensor(F, shape, values, exponents, None, parents)

    def __truediv__(self, other: FieldTensor) -> FieldTensor:
        return self * other.reciprocal()

    def reciprocal(self) -> FieldTensor:
        F = self.field
        if self.constant is not None and self.constant != 0:
            return number(F, 1 / self.constant)
        values = _each(self.values, lambda a: Values(
            F.inverse(a.t), Degree().over(a.degree), a.uses))
        square = values if isinstance(values, Missing) else values.t * values.t % F.p
        parents = tape.link((self, tape.times(F, square, self.shape, -1)))
        exponents = self.exponents if isinstance(self.exponents, Missing) else Missing(
            "inside exp, a division by a drawn value (no bound holds)")
        return FieldTensor(F, self.shape, values, exponents, None, parents)

    def scaled(self, c: Fraction) -> FieldTensor:
        """``c · self`` for a rational ``c``."""
        F = self.field
        k = F.value(c)
        values = _each(self.values, lambda a: Values(a.t * k % F.p, a.degree, a.uses))
        exponents = _each(self.exponents, lambda a: _exponent_scaled(F, a, c))
        constant = None if self.constant is None else c * self.constant
        parents = tape.link((self, lambda g: g * k % F.p))
        return FieldTensor(F, self.shape, values, exponents, constant, parents)

    # -- functions -------------------------------------------------------------------------

    def exp(self) -> FieldTensor:
        F = self.field
        values = _each(self.exponents, lambda a: Values(
            F.exp(a.e) if a.f is None else F.exp(a.e) * a.f % F.p, a.degree(), a.uses))
        out = values.t if isinstance(values, Values) else values
        return FieldTensor(F, self.shape, values, Missing("exp inside exp"), None,
                           tape.link((self, tape.times(F, out, self.shape))))

    def log(self) -> FieldTensor:
        F = self.field
        exponents = _each(self.values, lambda a: Exponents(
            torch.zeros_like(a.t), a.t, {}, a.degree, a.uses))
        values = Missing("log outside exp: a logarithm has no value in a finite field")
        v = self.value()
        inverse = v if isinstance(v, Missing) else F.inverse(v)
        return FieldTensor(F, self.shape, values, exponents, None,
                           tape.link((self, tape.times(F, inverse, self.shape))))

    def sum_last(self) -> FieldTensor:
        """``sum`` over the last axis."""
        F, n, shape = self.field, self.shape[-1], self.shape[:-1]
        values = _each(self.values, lambda a: Values(
            a.t.sum(-1) % F.p, a.degree.summed(n), a.uses))
        exponents = _each(self.exponents, lambda a: Exponents(
            a.e.sum(-1) % F.q, None if a.f is None else _product_last(F, a.f),
            _form({}, a.form, Fraction(n)), a.log.summed(n) if a.f is not None else a.log,
            a.uses))
        parents = tape.link((self, lambda g: g[..., None].expand(self.shape)))
        return FieldTensor(F, shape, values, exponents, None, parents)

    def softmax_last(self) -> FieldTensor:
        """``softmax`` over the last axis: ``exp(x) / sum(exp(x))``."""
        weights = self.exp()
        return weights * weights.sum_last()[..., None].reciprocal()

    def logsumexp_last(self) -> FieldTensor:
        return self.exp().sum_last().log()

    # -- shapes ----------------------------------------------------------------------------

    def _shaped(self, shape, on_tensor, back) -> FieldTensor:
        """This tensor's entries laid out anew by ``on_tensor``, ``back`` undoing it."""
        values = _each(self.values, lambda a: replace(a, t=on_tensor(a.t)))
        exponents = _each(self.exponents, lambda a: replace(
            a, e=on_tensor(a.e), f=None if a.f is None else on_tensor(a.f)))
        return replace(self, shape=tuple(shape), values=values, exponents=exponents,
                       parents=tape.link((self, back)), leaf=False)

    def permute(self, *order: int) -> FieldTensor:
        shape = tuple(self.shape[k] for k in order)
        undo = sorted(range(len(order)), key=order.__getitem__)
        return self._shaped(shape, lambda t: t.permute(*order), lambda g: g.permute(*undo))

    def __getitem__(self, index: tuple) -> FieldTensor:
        """Indexing by ``None``, ``:`` and ``...`` alone (new axes of one entry)."""
        index = index if isinstance(index, tuple) else (index,)
        shape = torch.empty(self.shape, device="meta")[index].shape
        return self._shaped(tuple(shape), lambda t: t[index],
                            lambda g: g.reshape(self.shape))

    def reshape(self, *shape: int) -> FieldTensor:
        return self._shaped(shape, lambda t: t.reshape(*shape), lambda g: g.reshape(self.shape))

    def unflatten(self, dim: int, sizes: list[int]) -> FieldTensor:
        shape = torch.empty(self.shape, device="meta").unflatten(dim, sizes).shape
        return self._shaped(tuple(shape), lambda t: t.unflatten(dim, sizes),
                            lambda g: g.reshape(self.shape))


def number(F: Field, c: Fraction) -> FieldTensor:
    """A rational number, as a value and as an exponent."""
    return FieldTensor(F, (), Values(torch.tensor(F.value(c)), Degree(), _NONE),
                       Exponents(torch.tensor(F.exponent(c)), None), constant=c)


def constant(F: Field, t: torch.Tensor) -> FieldTensor:
    """A tensor of integers that no draw changes (a Kronecker delta), as a value and as
    the exponent ``0 + log t``."""
    return FieldTensor(F, tuple(t.shape), Values(t % F.p, Degree(), _NONE),
                       Exponents(torch.zeros_like(t), t % F.p))


def root(F: Field, n: int) -> FieldTensor:
    """``√n`` for a size ``n``: a number where ``n`` is a square, else a value of ``Z_p``
    with no exponent (an irrational coefficient inside exp has no bound)."""
    r = math.isqrt(n)
    if r * r == n:
        return number(F, Fraction(r))
    return FieldTensor(F, (), Values(torch.tensor(F.sqrt(n)), Degree(), _NONE), Missing(
        f"inside exp, a division by √{n}, which is irrational (no bound holds)"))


def drawn(F: Field, name: str, value: torch.Tensor, exponent: torch.Tensor) -> FieldTensor:
    """A drawn tensor: a random value of ``Z_p`` and, independently, a random exponent."""
    one = Degree(Fraction(1))
    return FieldTensor(F, tuple(value.shape), Values(value, one, (frozenset({name}), frozenset())),
                       Exponents(exponent, None, {name: (Fraction(1), Fraction(0))}, Degree(),
                                 (frozenset(), frozenset({name}))))


def mask(F: Field, name: str, kept: torch.Tensor) -> FieldTensor:
    """An additive mask: 0 where ``kept`` is 1 and ``−∞`` where it is 0, which ``exp`` turns
    into the 0/1 multiplier ``kept`` itself."""
    return FieldTensor(F, tuple(kept.shape), Missing(f"the mask {name} (0 or −∞) as a value"),
                       Exponents(torch.zeros_like(kept), kept, {}, Degree(),
                                 (frozenset(), frozenset({name}))))


# -- the rules, form by form -----------------------------------------------------------------

def _each(rep: Rep, rule) -> Rep:
    """``rule`` of a form; a missing form stays missing."""
    return rep if isinstance(rep, Missing) else rule(rep)


def _pair(a: Rep, b: Rep, rule) -> Rep:
    """``rule`` of two forms; the first missing one, if one is."""
    return a if isinstance(a, Missing) else b if isinstance(b, Missing) else rule(a, b)





def _exponent_sum(F: Field, a: Exponents, b: Exponents, sign: int) -> Exponents:
    """``a ± b``: the exponents add, the logs' values multiply (or divide)."""
    e = (a.e + sign * b.e) % F.q
    if b.f is None:
        f, log = a.f, a.log
    else:
        g = b.f if sign > 0 else F.inverse(b.f)
        g_log = b.log if sign > 0 else b.log.power(Fraction(-1))
        f, log = (g, g_log) if a.f is None else (a.f * g % F.p, a.log.times(g_log))
    return Exponents(e, f, _form(a.form, b.form, Fraction(sign)), log, joined(a.uses, b.uses))


def _exponent_scaled(F: Field, a: Exponents, c: Fraction) -> Exponents | Missing:
    """``c · (e + log f)`` = ``c e + log f^c``, for ``f^c`` only where ``c`` is an integer."""
    f, log = a.f, a.log
    if f is not None and c.denominator != 1:
        return Missing("inside exp, a fraction of a logarithm")
    if f is not None:
        f = F.power(f, int(abs(c)))
        f, log = (F.inverse(f), log.power(c)) if c < 0 else (f, log.power(c))
    return Exponents(a.e * F.exponent(c) % F.q, f, _form({}, a.form, c), log, a.uses)


def _product_last(F: Field, f: torch.Tensor) -> torch.Tensor:
    """The product over the last axis, in ``Z_p``."""
    result = torch.ones(f.shape[:-1], dtype=f.dtype)
    for k in range(f.shape[-1]):
        result = result * f[..., k] % F.p
    return result



def contracted(F: Field, subscripts: str, factors: list[FieldTensor]) -> FieldTensor:
    """``einsum(subscripts, *factors)`` in ``Z_p`` (each factor one axis per letter); a
    contraction of drawn values has no exponent."""
    inputs, out = subscripts.split("->")
    terms = inputs.split(",")
    size = {c: n for term, x in zip(terms, factors, strict=True)
            for c, n in zip(term, x.shape, strict=True)}
    summed = math.prod(n for c, n in size.items() if c not in out)
    reps = [x.values for x in factors]
    values = next((r for r in reps if isinstance(r, Missing)), None)
    if values is None:
        degree = Degree()
        for r in reps:
            degree = degree.times(r.degree)
        values = Values(F.contract(subscripts, *(r.t for r in reps)), degree.summed(summed),
                        joined(*(r.uses for r in reps)))
    parents = tape.link(*((x, tape.contraction_rule(F, subscripts, factors, k))
                          for k, x in enumerate(factors)))
    return FieldTensor(F, tuple(size[c] for c in out), values, Missing(
        "inside exp, a contraction of drawn values (no bound holds)"), None, parents)
