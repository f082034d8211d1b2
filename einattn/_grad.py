"""``Equation.grad``: the gradient of an equation with respect to one of its tensors, derived
in index notation by reverse mode, rule by rule.

For ``Out[o] = f(…, X[x], …)`` and the cotangent ``dOut[o]`` the gradient is
``dX[x] = Σ dOut[o] ∂Out[o]/∂X[x]``, built from the right side's tree from the top down:

* a sum passes the cotangent to each term (a term that lacks an index, broadcast, gets it
  summed over that index); a product to each factor, times the other factors over the
  divisors (Einstein's convention sums what the factor lacks: ``dQ[τ a] = dS[τ σ] K[σ a]``);
  a divisor ``d`` gets ``−dOut · value / d``;
* ``exp(x)``: ``dx = dy · exp(x)``; ``log(x)``: ``dy / x``; ``tanh(x)``: ``dy · (1 − t·t)``;
  ``sigmoid(x)``: ``dy · s · (1 − s)``;
  ``softmax_σ(x)``: ``dx = s · (dy − sum_σ(s · dy))``; ``logsumexp_σ(x)``: ``dy · softmax_σ(x)``;
  ``sum_σ(x)``: ``dy``, the same for every σ; where the function is the whole right side
  its value is the output itself (``A`` for ``A = softmax_σ(S)``);
* a tensor used twice adds both terms; an index it repeats (``X[τ τ]``, a diagonal) gets a
  new name on the left and a Kronecker delta ``δ[τ τʹ]``; an index of ``X`` that the
  result does not carry (``X`` summed away alone) is broadcast by a one-index ``δ[σ]``,
  which is 1.

``max_σ`` and ``max(x, y)`` have no closed form here (their derivative is a comparison),
nor has a named scalar as ``wrt``: refused by name.
"""

from __future__ import annotations

from . import _expression
from . import _grad_terms as g
from ._expression import Call, Number, Product, Scalar, Sum, Tensor
from .errors import EinattnError


def derived(equation, wrt: str) -> str:
    """The text of ``d<wrt>[…] = …``, the gradient of ``equation`` for ``wrt``."""
    tree = _expression.parse(equation.text)
    names = {t.name for t in equation.terms}
    if wrt not in names:
        what = "a scalar" if wrt in getattr(equation, "scalars", ()) else "no tensor"
        raise EinattnError(f"grad: {wrt!r} is {what} of {equation.text} (its tensors: "
                           f"{', '.join(sorted(names))}): a gradient is taken with respect "
                           f"to a tensor")
    right = _explicit(tree.right, frozenset(tree.output.indices), equation.text)
    out = g.Term(tree.output.name, _axes(tree.output))
    cotangent = g.Term(f"d{out.name}", out.axes)
    found: list = []
    _backward(right, cotangent, out, wrt, found)
    first = next(t for t in _tensors(tree.right) if t.name == wrt)
    lhs = _left(first)
    parts = [(1, _placed(occurrence, contribution, lhs))
             for occurrence, contribution in found]
    result = g.total(parts)
    missing = [i for i in lhs.indices if i not in g.free(result)]
    result = g.product([result, *(g.Term("δ", (((i,), False),)) for i in missing)])
    return f"{g.printed(lhs, frozenset())} = {_text(result, frozenset(lhs.indices))}"


def _axes(term) -> tuple:
    return tuple((a.indices, a.grouped) for a in term.axes)


def _tensors(node) -> list:
    return [n.term for n in _expression.walk(node) if isinstance(n, Tensor)]


# -- the right side with every sum written out ---------------------------------------------

def _explicit(node, visible: frozenset, text: str):
    """The tree as :mod:`einattn._grad_terms` writes it: each sum that Einstein's convention
    leaves unsaid in a product made a ``sum_x``, as the compiler reads the product."""
    if isinstance(node, Tensor):
        return g.Term(node.term.name, _axes(node.term))
    if isinstance(node, Scalar):
        return g.Scalar(node.name)
    if isinstance(node, Number):
        return g.Num(node.written)
    if isinstance(node, Sum):
        return g.Add(tuple((s, _explicit(t, visible, text))
                           for s, t in zip(node.signs, node.terms, strict=True)))
    if isinstance(node, Call):
        inside = visible | {node.axis} if node.axis else visible
        if node.function == "max":
            raise EinattnError(f"grad: {text[node.start:node.end]} has no closed-form "
                               f"gradient here (the derivative of a maximum is a comparison)")
        return g.Fn(node.function, node.axis,
                    tuple(_explicit(a, inside, text) for a in node.arguments))
    return _explicit_product(node, visible, text)


def _explicit_product(node: Product, visible: frozenset, text: str):
    held = [_text_free(f) for f in node.factors]  # a factor sees what the others carry
    factors = [_explicit(f, visible.union(*held[:k], *held[k + 1:]), text)
               for k, f in enumerate(node.factors)]
    numbers = [f for f in factors if isinstance(f, (g.Num, g.Scalar))]
    tensors = [f for f in factors if not isinstance(f, (g.Num, g.Scalar))]
    over = frozenset().union(*map(g.free, tensors)) - visible
    top = g.summed(g.product(tensors), over) if over else g.product(tensors)
    divisors = tuple(_explicit(d, visible, text) for d in node.divisors)
    return g.product([*numbers, top], divisors, node.root)


def _text_free(node) -> frozenset:
    """What a factor of a product may carry, from its text (as the compiler's ``_free``)."""
    if isinstance(node, Tensor):
        return frozenset(node.term.indices)
    if isinstance(node, Call) and node.axis is not None and node.function != "softmax":
        return _text_free(node.arguments[0]) - {node.axis}
    return frozenset().union(*map(_text_free, _expression.children(node)))


# -- reverse mode ------------------------------------------------------------------------------

def _backward(e, adjoint, value, wrt: str, found: list) -> None:
    """Pass ``adjoint`` (the cotangent of ``e``, whose value ``value`` is) down to the
    tensors named ``wrt``, collecting ``(term, its cotangent)`` in ``found``."""
    if isinstance(e, g.Term):
        if e.name == wrt:
            found.append((e, adjoint))
    elif isinstance(e, g.Add):
        for sign, part in e.parts:
            down = adjoint if sign > 0 else g.negated(adjoint)
            _backward(part, _reduced(down, part), part, wrt, found)
    elif isinstance(e, g.Mul):
        _backward_product(e, adjoint, wrt, found)
    elif isinstance(e, g.Fn):
        _backward_function(e, adjoint, value, wrt, found)


def _reduced(adjoint, target):
    """``adjoint`` summed over the indices ``target`` does not carry."""
    return g.summed(adjoint, g.free(adjoint) - g.free(target))


def _backward_product(e: g.Mul, adjoint, wrt: str, found: list) -> None:
    for k, factor in enumerate(e.factors):
        others = [f for j, f in enumerate(e.factors) if j != k]
        down = g.product([adjoint, *others], e.divisors, e.root)
        _backward(factor, _reduced(down, factor), factor, wrt, found)
    for divisor in e.divisors:
        down = g.product([adjoint, *e.factors], (*e.divisors, divisor), e.root)
        _backward(divisor, _reduced(g.negated(down), divisor), divisor, wrt, found)


def _backward_function(e: g.Fn, adjoint, value, wrt: str, found: list) -> None:
    x = e.args[0]
    if e.function == "exp":
        down = g.product([adjoint, value])
    elif e.function == "log":
        down = g.product([adjoint], (x,))
    elif e.function == "tanh":
        down = g.product([adjoint, g.total([(1, g.ONE), (-1, g.product([value, value]))])])
    elif e.function == "sigmoid":
        down = g.product([adjoint, value, g.total([(1, g.ONE), (-1, value)])])
    elif e.function == "softmax":
        row = g.Fn("sum", e.axis, (g.product([value, adjoint]),))
        down = g.product([value, g.total([(1, adjoint), (-1, row)])])
    elif e.function == "logsumexp":
        down = g.product([adjoint, g.Fn("softmax", e.axis, (x,))])
    else:  # sum_σ: the same cotangent for every σ
        down = adjoint
    _backward(x, down, x, wrt, found)


# -- the left side, and each use of wrt brought to it -------------------------------------------

def _left(first) -> g.Term:
    """``d<wrt>`` with ``wrt``'s first use's axes, a repeated index renamed (``τ τʹ``)."""
    taken = {i for a in first.axes for i in a.indices}
    seen: list[str] = []
    axes = []
    for axis in first.axes:
        names = []
        for i in axis.indices:
            name = i if i not in seen else g.fresh(i, taken)
            taken.add(name)
            seen.append(i)
            names.append(name)
        axes.append((tuple(names), axis.grouped))
    return g.Term(f"d{first.name}", tuple(axes))


def _placed(occurrence: g.Term, contribution, lhs: g.Term):
    """One use's cotangent with its indices renamed to the left side's (a repeat tied to
    its first place by a delta), no other index caught by a new name."""
    mapping: dict[str, str] = {}
    deltas = []
    for mine, theirs in zip(occurrence.indices, lhs.indices, strict=True):
        if mine in mapping and mapping[mine] != theirs:
            deltas.append(g.Term("δ", (((mapping[mine], theirs), False),)))
        mapping.setdefault(mine, theirs)
    return g.product([g.renamed(contribution, mapping), *deltas])


def _text(e, visible: frozenset) -> str:
    """The right side; a bare product of tensors (Einstein summed) as a contraction."""
    over = []
    while isinstance(e, g.Fn) and e.function == "sum":
        over.append(e.axis)
        e = e.args[0]
    pure = isinstance(e, g.Term) or (isinstance(e, g.Mul) and not e.divisors and all(
        isinstance(f, g.Term) for f in e.factors))
    if over and pure and not set(over) & visible:
        return g.printed(e if isinstance(e, g.Mul) else g.Mul((e,)), visible)
    for x in reversed(over):
        e = g.Fn("sum", x, (e,))
    return g.printed(e, visible)
