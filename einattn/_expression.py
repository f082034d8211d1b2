"""The expression language of an ``Equation``: terms joined by functions and arithmetic.

    A[n μ τ σ] = softmax_σ(S[n μ τ σ] + M[n μ τ σ])
    L[n τ]     = logsumexp_σ(S[n τ σ])
    C[τ σ]     = c · tanh(S[τ σ] / c)

The grammar, in words: an output term, ``=``, and an expression. An expression is a sum of
products (``+``, ``−`` or ``-``; a leading minus negates); a product is factors joined by
``·``, ``*`` or juxtaposition, divided by ``/`` (and at most one ``/ √a``, the root of an
index's size, as in a contraction); a factor is a term ``X[…]``, a named scalar ``c``, a
number, a parenthesised expression, or a function: a named-axis function ``softmax_σ``,
``logsumexp_σ``, ``max_σ``, ``sum_σ`` (the axis is the index after ``_``), an elementwise
``exp``, ``log``, ``tanh``, ``sigmoid`` (``1 / (1 + exp(−x))``), or ``max(x, y)``, the
elementwise maximum of two.

This module reads the text into a tree of frozen nodes, each with its span in the text, so
that every error can point at its place; :mod:`einattn._expression_run` gives the tree its
meaning (which indices each node carries, what runs) and :mod:`einattn._expression_latex`
renders it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._syntax import EXPRESSION_TOKEN, Term, Tokens, read_term
from ._syntax import root as read_root
from .errors import at

AXIS_FUNCTIONS = ("softmax", "logsumexp", "max", "sum")  # f_σ(x): a function along σ
ELEMENTWISE = ("exp", "log", "tanh", "sigmoid")  # f(x), entry by entry
PAIRWISE = ("max",)  # f(x, y), entry by entry, broadcast by index name
_KNOWN = "softmax_σ, logsumexp_σ, max_σ, sum_σ, exp, log, tanh, sigmoid, max(x, y)"


@dataclass(frozen=True)
class Node:
    """Where a node stands in the text: ``text[start:end]`` is what it was read from."""

    start: int
    end: int


@dataclass(frozen=True)
class Tensor(Node):
    term: Term


@dataclass(frozen=True)
class Scalar(Node):
    name: str


@dataclass(frozen=True)
class Number(Node):
    value: float
    written: str


@dataclass(frozen=True)
class Call(Node):
    function: str
    axis: str | None  # the index after "_" of a named-axis function
    axis_position: int
    arguments: tuple[Node, ...]


@dataclass(frozen=True)
class Sum(Node):
    terms: tuple[Node, ...]
    signs: tuple[int, ...]  # +1 or -1 for each term


@dataclass(frozen=True)
class Product(Node):
    factors: tuple[Node, ...]
    divisors: tuple[Node, ...]
    root: str | None  # / √root: the square root of that index's size
    root_position: int


@dataclass(frozen=True)
class Parsed:
    output: Term
    right: Node


def parse(text: str) -> Parsed:
    """Read ``text`` into an output term and the tree of its right side."""
    tokens = Tokens(text, EXPRESSION_TOKEN)
    output = read_term(tokens)
    tokens.take("=")
    right = _sum(tokens)
    tokens.take("end")
    return Parsed(output, right)


def _sum(tokens: Tokens) -> Node:
    start = tokens.peek()[2]
    terms, signs = [], []
    sign = 1
    if tokens.peek()[1] in ("-", "−", "+"):
        sign = -1 if tokens.take()[1] != "+" else 1
    while True:
        terms.append(_product(tokens))
        signs.append(sign)
        if tokens.peek()[1] not in ("-", "−", "+"):
            break
        sign = -1 if tokens.take()[1] != "+" else 1
    if len(terms) == 1 and sign == 1:
        return terms[0]
    return Sum(start, _end(tokens), tuple(terms), tuple(signs))


def _product(tokens: Tokens) -> Node:
    start = tokens.peek()[2]
    factors, divisors = [_factor(tokens)], []
    root, root_position = None, -1
    while True:
        kind, value, pos = tokens.peek()
        if value in ("·", "*"):
            tokens.take()
            factors.append(_factor(tokens))
        elif value == "/" and _ahead(tokens) in ("√", "sqrt"):
            if root is not None:
                raise at("a second / √: a product divides by one square root", tokens.text, pos)
            tokens.take()
            root, root_position = read_root(tokens)
        elif value == "/":
            tokens.take()
            divisors.append(_factor(tokens))
        elif kind in ("name", "number") or value == "(":
            factors.append(_factor(tokens))  # juxtaposed: Q[τ a] K[σ a]
        else:
            break
    if len(factors) == 1 and not divisors and root is None:
        return factors[0]
    return Product(start, _end(tokens), tuple(factors), tuple(divisors), root, root_position)


def _factor(tokens: Tokens) -> Node:
    kind, value, pos = tokens.peek()
    if value == "(":
        tokens.take()
        inner = _sum(tokens)
        _close(tokens, pos)
        return inner
    if kind == "number":
        tokens.take()
        return Number(pos, pos + len(value), float(value), value)
    _, name, pos = tokens.take("name", "(")
    following = tokens.peek()[1]
    if following == "[":
        tokens.k -= 1  # a term: read it whole
        term = read_term(tokens)
        return Tensor(pos, _end(tokens), term)
    if following == "(":
        return _call(tokens, name, pos)
    return Scalar(pos, pos + len(name), name)


def _call(tokens: Tokens, name: str, pos: int) -> Call:
    function, _, axis = name.partition("_")
    axis_position = pos + len(function) + 1
    if function in AXIS_FUNCTIONS and axis:
        count = 1
    elif function in ELEMENTWISE and not axis:
        count = 1
    elif function in PAIRWISE and not axis:
        count = 2
    elif function in AXIS_FUNCTIONS and not name.endswith("_"):
        raise at(f"{function} needs the index it runs along, as {function}_σ(…) (for the "
                 f"elementwise maximum of two, max(x, y))", tokens.text, pos)
    elif function in ELEMENTWISE:
        raise at(f"{function} is elementwise: it takes no index ({function}(…), not "
                 f"{name}(…))", tokens.text, axis_position)
    else:
        raise at(f"unknown function {name!r}: known are {_KNOWN}", tokens.text, pos)
    opening = tokens.take("(")[2]
    arguments = [_sum(tokens)]
    while tokens.peek()[1] == ",":
        arguments.append((tokens.take(), _sum(tokens))[1])
    if len(arguments) != count:
        raise at(f"{name} takes {count} argument{'s' * (count > 1)}, got {len(arguments)}",
                 tokens.text, pos)
    _close(tokens, opening)
    return Call(pos, _end(tokens), function, axis or None, axis_position, tuple(arguments))


def _close(tokens: Tokens, opening: int) -> None:
    if tokens.peek()[1] != ")":
        kind, value, pos = tokens.peek()
        found = "the end" if kind == "end" else repr(value)
        raise at(f"unbalanced parentheses: this '(' is never closed (found {found})",
                 tokens.text, opening, pos)
    tokens.take()


def _ahead(tokens: Tokens) -> str:
    """The token after the next one."""
    k = tokens.k + 1
    return tokens.items[k][1] if k < len(tokens.items) else ""


def _end(tokens: Tokens) -> int:
    """Where the last token taken ends."""
    _, value, pos = tokens.items[tokens.k - 1]
    return pos + len(value)


def check_names(tree: Parsed, operands: tuple[str, ...], scalars: tuple[str, ...],
                text: str) -> None:
    """What the text alone decides about names: the left side's indices, the output's
    name, each scalar's, the root's index."""
    output = tree.output
    seen: dict[str, int] = {}
    for index, pos in zip(output.indices, output.positions, strict=True):
        if index in seen:
            raise at(f"index {index!r} appears twice on the left", text, seen[index], pos)
        seen[index] = pos
    if not operands:
        raise at("the right side has no tensor: an equation computes from tensors", text,
                 tree.right.start)
    if output.name in (*operands, *scalars):
        raise at(f"{output.name} is both the output and an operand", text, output.position)
    indices = {i for n in walk(tree.right) if isinstance(n, Tensor) for i in n.term.indices}
    for node in walk(tree.right):
        if isinstance(node, Scalar) and (node.name in operands or node.name in indices):
            what = "a tensor" if node.name in operands else "an index"
            raise at(f"{node.name} is both a scalar and {what}", text, node.start)
        if isinstance(node, Product) and node.root is not None and node.root not in indices:
            raise at(f"scale index {node.root!r} appears on no tensor", text, node.root_position)


def children(node: Node) -> tuple[Node, ...]:
    """The nodes directly below ``node``."""
    if isinstance(node, Call):
        return node.arguments
    if isinstance(node, Sum):
        return node.terms
    if isinstance(node, Product):
        return (*node.factors, *node.divisors)
    return ()


def walk(node: Node) -> list[Node]:
    """``node`` and every node below it, in the order written."""
    return [node, *(n for child in children(node) for n in walk(child))]
