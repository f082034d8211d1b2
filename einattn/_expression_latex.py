r"""LaTeX of the expression language, in the derivation's style.

    A[n μ τ σ] = softmax_σ(S[n μ τ σ] + M[n μ τ σ])
    A_{n \mu \tau \sigma} = \operatorname{softmax}_{\sigma}\left(S_{n \mu \tau \sigma}
                            + M_{n \mu \tau \sigma}\right)

``softmax_σ`` and ``logsumexp_σ`` are operators with the axis beneath
(``\operatorname{logsumexp}_{\sigma}``), ``max_σ`` and ``sum_σ`` are ``\max_{\sigma}`` and
``\sum_{\sigma}``, ``exp``, ``log``, ``tanh`` and ``max(x, y)`` their commands; a quotient is
a ``\frac``, with ``/ √a`` as ``\sqrt{d_{a}}`` beneath, as a contraction writes it.
"""

from __future__ import annotations

from ._expression import Call, Node, Number, Parsed, Product, Scalar, Sum, Tensor
from .latex import rendered_term, symbol

_OPERATORS = {"softmax": r"\operatorname{softmax}", "logsumexp": r"\operatorname{logsumexp}",
              "max": r"\max", "sum": r"\sum"}
_COMMANDS = {"exp": r"\exp", "log": r"\log", "tanh": r"\tanh", "max": r"\max",
             "sigmoid": r"\operatorname{sigmoid}"}


def render(parsed: Parsed) -> str:
    """The equation as LaTeX."""
    return f"{rendered_term(parsed.output)} = {_latex(parsed.right)}"


def _latex(node: Node) -> str:
    if isinstance(node, Tensor):
        return rendered_term(node.term)
    if isinstance(node, Scalar):
        return symbol(node.name)
    if isinstance(node, Number):
        return node.written
    if isinstance(node, Sum):
        return _sum(node)
    if isinstance(node, Product):
        return _product(node)
    return _call(node)


def _sum(node: Sum) -> str:
    parts = []
    for k, (term, sign) in enumerate(zip(node.terms, node.signs, strict=True)):
        operator = ("-" if sign < 0 else "") if k == 0 else (" - " if sign < 0 else " + ")
        inner = _latex(term)
        if isinstance(term, Sum) and (sign < 0 or (k > 0 and term.signs[0] < 0)):
            inner = rf"\left({inner}\right)"  # S - (S - M), -(S + M), S + (-M + X)
        parts.append(operator + inner)
    return "".join(parts)


def _product(node: Product) -> str:
    alone = len(node.divisors) == 1 and node.root is None  # a \frac's whole denominator
    below = [_latex(node.divisors[0])] if alone else _factors(node.divisors)
    if node.root is not None:
        below.append(rf"\sqrt{{d_{{{symbol(node.root)}}}}}")
    if not below:
        return " ".join(_factors(node.factors))
    top = _latex(node.factors[0]) if len(node.factors) == 1 else " ".join(_factors(node.factors))
    return rf"\frac{{{top}}}{{{' '.join(below)}}}"


def _factors(nodes: tuple[Node, ...]) -> list[str]:
    r"""Factors of a product side by side: a sum within it keeps its parentheses, and a
    number after another factor a ``\cdot`` (``2 \cdot 3 S``, not ``2 3 S``)."""
    shown = []
    for k, node in enumerate(nodes):
        inner = _latex(node)
        inner = rf"\left({inner}\right)" if isinstance(node, Sum) else inner
        shown.append(rf"\cdot {inner}" if k and isinstance(node, Number) else inner)
    return shown


def _call(node: Call) -> str:
    arguments = ", ".join(_latex(a) for a in node.arguments)
    if node.axis is None:
        return rf"{_COMMANDS[node.function]}\left({arguments}\right)"
    return rf"{_OPERATORS[node.function]}_{{{symbol(node.axis)}}}\left({arguments}\right)"
