"""The expressions :mod:`einattn._grad` builds a gradient from: the expression language with
every sum written out (``sum_x(…)``, never Einstein's implicit one), so that which index
is free where is read from the expression alone and a renaming cannot capture an index;
:func:`printed` writes one back in einattn's notation, a sum over an index that nothing
around it carries as Einstein's convention writes it (``dS[τ σ] K[σ a]``).

Free indices: a term's; a sum's, product's or elementwise function's, those of its parts;
``softmax_x``'s, its argument's; ``sum_x``, ``logsumexp_x`` and ``max_x`` bind ``x``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

PRIME = "ʹ"  # a new index beside σ is σʹ (a letter: einattn.latex reads \sigma' so)
BINDERS = ("sum", "logsumexp", "max")


@dataclass(frozen=True)
class Term:
    name: str
    axes: tuple[tuple[tuple[str, ...], bool], ...]  # (indices, grouped) per axis

    @property
    def indices(self) -> tuple[str, ...]:
        return tuple(i for indices, _ in self.axes for i in indices)


@dataclass(frozen=True)
class Num:
    text: str


@dataclass(frozen=True)
class Scalar:
    name: str


@dataclass(frozen=True)
class Fn:
    function: str
    axis: str | None
    args: tuple


@dataclass(frozen=True)
class Add:
    parts: tuple  # (sign, expression) pairs


@dataclass(frozen=True)
class Mul:
    factors: tuple
    divisors: tuple = ()
    root: str | None = None  # / √root: the root of that index's size


ONE = Num("1")


def free(e) -> frozenset:
    """The indices ``e`` carries."""
    if isinstance(e, Term):
        return frozenset(e.indices)
    if isinstance(e, Fn):
        inner = frozenset().union(*map(free, e.args))
        return inner - {e.axis} if e.function in BINDERS else inner
    if isinstance(e, Add):
        return frozenset().union(*(free(p) for _, p in e.parts))
    if isinstance(e, Mul):
        return frozenset().union(*map(free, (*e.factors, *e.divisors)))
    return frozenset()


def names(e) -> frozenset:
    """Every index name in ``e``, free or bound (and a root's)."""
    if isinstance(e, Term):
        return frozenset(e.indices)
    if isinstance(e, Fn):
        return frozenset({e.axis} - {None}).union(*map(names, e.args))
    if isinstance(e, Add):
        return frozenset().union(*(names(p) for _, p in e.parts))
    if isinstance(e, Mul):
        return frozenset({e.root} - {None}).union(*map(names, (*e.factors, *e.divisors)))
    return frozenset()


def fresh(base: str, taken) -> str:
    """``base`` with primes enough to be none of ``taken``."""
    name = base.rstrip(PRIME) + PRIME
    while name in taken:
        name += PRIME
    return name


def renamed(e, mapping: dict[str, str]):
    """``e`` with its free indices renamed by ``mapping`` (all at once), a bound index that
    a new name would be captured by renamed first; a root follows its index."""
    mapping = {k: v for k, v in mapping.items() if k != v}
    if not mapping:
        return e
    if isinstance(e, Term):
        return replace(e, axes=tuple((tuple(mapping.get(i, i) for i in ix), g)
                                     for ix, g in e.axes))
    if isinstance(e, Fn) and e.function in BINDERS:
        inner = {k: v for k, v in mapping.items() if k != e.axis}
        axis, args = e.axis, e.args
        if axis in inner.values():  # sum_x(… y …) with y -> x: x is renamed first
            axis = fresh(axis, names(e) | set(inner) | set(inner.values()))
            args = tuple(renamed(a, {e.axis: axis}) for a in args)
        return Fn(e.function, axis, tuple(renamed(a, inner) for a in args))
    if isinstance(e, Fn):
        return Fn(e.function, mapping.get(e.axis, e.axis),
                  tuple(renamed(a, mapping) for a in e.args))
    if isinstance(e, Add):
        return Add(tuple((s, renamed(p, mapping)) for s, p in e.parts))
    if isinstance(e, Mul):
        return Mul(tuple(renamed(f, mapping) for f in e.factors),
                   tuple(renamed(d, mapping) for d in e.divisors),
                   mapping.get(e.root, e.root))
    return e


# -- building, with the obvious simplifications ---------------------------------------------

def product(factors, divisors=(), root: str | None = None):
    """``Π factors / Π divisors / √root``: nested products opened, ones dropped, a minus
    sign of a factor taken in front."""
    signs = [f for f in factors if _minus(f)]
    if signs:
        rest = [f.parts[0][1] if _minus(f) else f for f in factors]
        e = product(rest, divisors, root)
        return negated(e) if len(signs) % 2 else e
    flat, below = [], list(divisors)
    for f in factors:
        if isinstance(f, Mul) and (f.root is None or root is None):
            flat += f.factors
            below += f.divisors
            root = root or f.root
        elif f != ONE:
            flat.append(f)
    if not below and root is None and len(flat) == 1:
        return flat[0]
    return Mul(tuple(flat) or (ONE,), tuple(below), root)


def _minus(e) -> bool:
    return isinstance(e, Add) and len(e.parts) == 1 and e.parts[0][0] < 0


def negated(e):
    if isinstance(e, Add) and len(e.parts) == 1:
        return e.parts[0][1] if e.parts[0][0] < 0 else Add(((-1, e.parts[0][1]),))
    return Add(((-1, e),))


def total(parts: list):
    """The sum of ``parts`` (sign, expression), a lone positive one as itself."""
    flat = []
    for sign, p in parts:
        if isinstance(p, Add):
            flat += [(sign * s, q) for s, q in p.parts]
        else:
            flat.append((sign, p))
    return flat[0][1] if len(flat) == 1 and flat[0][0] > 0 else Add(tuple(flat))


def summed(e, over):
    """``e`` summed over the indices ``over`` (each a ``sum_x``), in a stable order; the
    sum of a negation the negation of the sum."""
    if _minus(e) and over:
        return negated(summed(e.parts[0][1], over))
    for index in sorted(over):
        e = Fn("sum", index, (e,))
    return e


# -- printing ---------------------------------------------------------------------------------

def printed(e, visible: frozenset) -> str:
    """``e`` in einattn's notation, seen from a place that holds the indices ``visible``."""
    if isinstance(e, Term):
        axes = [" ".join(ix) if not g else f"({' '.join(ix)})" for ix, g in e.axes]
        return f"{e.name}[{' '.join(axes)}]"
    if isinstance(e, Num):
        return e.text
    if isinstance(e, Scalar):
        return e.name
    if isinstance(e, Add):
        return _sum_text(e, visible)
    bare = _einstein(e, visible) if isinstance(e, Fn) else None
    if isinstance(e, Mul) or (bare is not None and len(bare.factors) > 1):
        return _product_text(e if isinstance(e, Mul) else bare, visible)
    inside = visible | ({e.axis} if e.axis else set())
    arguments = ", ".join(printed(a, inside) for a in e.args)
    return f"{e.function}{'_' + e.axis if e.axis else ''}({arguments})"


def _einstein(e, visible: frozenset) -> Mul | None:
    """``sum_x(…(Π factors / Π divisors))`` as the product Einstein's convention writes bare,
    where no index it sums is visible around it nor in a divisor; else None."""
    over = []
    while isinstance(e, Fn) and e.function == "sum":
        over.append(e.axis)
        e = e.args[0]
    if not over or not isinstance(e, (Mul, Term)):
        return None
    e = e if isinstance(e, Mul) else Mul((e,))
    carried = frozenset().union(*map(free, e.factors))
    below = frozenset().union(*map(free, e.divisors))
    if any(x in visible or x in below or x not in carried for x in over) or \
            not any(isinstance(f, Term) for f in e.factors):
        return None
    return e


def _product_text(e: Mul, visible: frozenset) -> str:
    factors, divisors, root = list(e.factors), list(e.divisors), e.root
    k = 0
    while k < len(factors):  # a sum Einstein's convention writes bare joins the product
        f = factors[k]
        others = [free(g) for j, g in enumerate(factors) if j != k]
        around = visible.union(*others, *map(free, divisors))
        inner = _einstein(f, around) if isinstance(f, Fn) else None
        if inner is not None and len(factors) - 1 + len(inner.factors) > 1 and not (
                inner.root and root):  # a lone term sums nothing; one root a product
            factors[k:k + 1] = inner.factors
            divisors += inner.divisors
            root = root or inner.root
            continue
        k += 1
    shown = []
    for k, f in enumerate(factors):
        around = visible.union(*(free(g) for j, g in enumerate(factors) if j != k))
        text = printed(f, around)
        text = f"({text})" if isinstance(f, Add) else text
        joint = " " if k and isinstance(f, Term) and isinstance(factors[k - 1], Term) else \
            " · " if k else ""
        shown.append(joint + text)
    for d in divisors:
        text = printed(d, visible)
        shown.append(f" / ({text})" if isinstance(d, (Add, Mul)) else f" / {text}")
    if root is not None:
        shown.append(f" / √{root}")
    return "".join(shown)


def _sum_text(e: Add, visible: frozenset) -> str:
    shown = []
    for k, (sign, p) in enumerate(e.parts):
        text = printed(p, visible)
        text = f"({text})" if isinstance(p, Add) else text
        shown.append(("−" if sign < 0 else "") + text if not k else
                     (" − " if sign < 0 else " + ") + text)
    return "".join(shown)
