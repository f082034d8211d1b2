"""Parsing and rendering of index equations such as ``S[n μ τ σ] = Q[n μ τ a] K[n μ σ a]``.

The grammar, in words: an output term, ``=``, one or more operand terms (optionally joined
by ``·`` or ``*``), and an optional scale ``/ √a`` (divide by the square root of the size of
index ``a``). A term is a tensor name followed by its axes in brackets; an axis is an index
name or a parenthesised group of index names, ``(μ B a)``, flattened row-major (the first
index varies slowest, so ``(a i) = a·p + i`` where ``p`` is the size of ``i``).
Names are Python identifiers and may be Greek or several letters long.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .errors import at

_TOKEN = re.compile(r"\s*(?:(?P<name>[^\W\d]\w*)|(?P<sym>sqrt|[\[\]()=/√·*])|(?P<bad>\S))")


@dataclass(frozen=True)
class Axis:
    """One axis of a term: a single index, or a parenthesised group flattened row-major."""

    indices: tuple[str, ...]
    positions: tuple[int, ...]
    grouped: bool


@dataclass(frozen=True)
class Term:
    """``name[axes]``: a tensor and the indices that label its axes."""

    name: str
    axes: tuple[Axis, ...]
    position: int
    # Derived from the axes once (every plan reads them): the atomic indices with groups
    # opened, in axis order, their positions in the text, and whether any axis is a group.
    indices: tuple[str, ...] = field(init=False)
    positions: tuple[int, ...] = field(init=False)
    grouped: bool = field(init=False)

    def __post_init__(self) -> None:
        derived = {"indices": tuple(i for axis in self.axes for i in axis.indices),
                   "positions": tuple(p for axis in self.axes for p in axis.positions),
                   "grouped": any(axis.grouped for axis in self.axes)}
        for name, value in derived.items():
            object.__setattr__(self, name, value)  # frozen: set once, here

    def text(self) -> str:
        return f"{self.name}[{' '.join(_axis_text(a) for a in self.axes)}]"


@dataclass(frozen=True)
class Parsed:
    output: Term
    operands: tuple[Term, ...]
    scale: str | None
    scale_position: int


def _axis_text(axis: Axis) -> str:
    body = " ".join(axis.indices)
    return f"({body})" if axis.grouped else body


class Tokens:
    def __init__(self, text: str, pattern: re.Pattern = _TOKEN):
        self.text = text
        self.items: list[tuple[str, str, int]] = []
        for m in pattern.finditer(text):
            kind = m.lastgroup
            if kind == "bad":
                raise at(f"unexpected character {m.group(kind)!r}", text, m.start(kind))
            self.items.append((kind, m.group(kind), m.start(kind)))
        self.k = 0

    def peek(self) -> tuple[str, str, int]:
        return self.items[self.k] if self.k < len(self.items) else ("end", "", len(self.text))

    def take(self, *expected: str) -> tuple[str, str, int]:
        kind, value, pos = self.peek()
        if expected and kind not in expected and value not in expected:
            what = "the end" if kind == "end" else repr(value)
            raise at(f"expected {' or '.join(expected)} but found {what}", self.text, pos)
        self.k += 1
        return kind, value, pos


def read_term(tokens: Tokens) -> Term:
    _, name, pos = tokens.take("name")
    tokens.take("[")
    axes: list[Axis] = []
    while tokens.peek()[1] != "]":
        if tokens.peek()[1] == "(":
            tokens.take("(")
            group = []
            while tokens.peek()[1] != ")":
                group.append(tokens.take("name"))
            tokens.take(")")
            if not group:
                raise at(f"empty group in {name}", tokens.text, pos)
            axes.append(Axis(tuple(g[1] for g in group), tuple(g[2] for g in group), True))
        else:
            _, index, ipos = tokens.take("name", "(", "]")
            axes.append(Axis((index,), (ipos,), False))
    tokens.take("]")
    return Term(name, tuple(axes), pos)


def _scale(tokens: Tokens) -> tuple[str | None, int]:
    if tokens.peek()[1] != "/":
        return None, -1
    tokens.take("/")
    return root(tokens)


def root(tokens: Tokens) -> tuple[str, int]:
    """``√a`` or ``sqrt(a)``: the index whose size's square root divides, and its place."""
    symbol = tokens.take("√", "sqrt")[1]
    if symbol == "sqrt":
        tokens.take("(")
    _, index, pos = tokens.take("name")
    if symbol == "sqrt":
        tokens.take(")")
    return index, pos


# The tokens of the expression language (einattn._expression): numbers, + − - and commas too.
EXPRESSION_TOKEN = re.compile(r"\s*(?:(?P<number>(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)|"
                              r"(?P<name>[^\W\d]\w*)|(?P<sym>[\[\]()=/√·*+\-−,])|(?P<bad>\S))")


def is_expression(text: str) -> bool:
    """Whether ``text`` uses what only the expression language has (a function, a sum or
    difference, a number, a named scalar, parentheses, a division by a tensor); decided
    from its tokens, so that a product that fails to parse keeps the product grammar's
    message. A character that neither grammar reads is an error here, where it stands."""
    items = Tokens(text, EXPRESSION_TOKEN).items
    depth, before = 0, ("", "")  # bracket depth; the two tokens before
    indices = _indices(items)
    for k, (kind, value, _) in enumerate(items):
        following = items[k + 1][1] if k + 1 < len(items) else ""
        depth += {"[": 1, "]": -1}.get(value, 0)
        if value in ("+", "-", "−", ",") or (kind == "number" and depth == 0):
            return True
        if depth == 0 and value == "(" and before[1] != "sqrt":
            return True  # parentheses (a function's own are found at its name)
        if value == "/" and following not in ("√", "sqrt", *indices):
            return True  # a division by something other than a root (or a root's index)
        root = before[1] == "√" or before == ("sqrt", "(")  # the root's index
        if kind == "name" and depth == 0 and value != "sqrt" and following not in ("[", "]") \
                and not root and (following == "(" or not indices & {value, following}):
            return True  # a function, or a named scalar: a name without brackets (not
            # one beside an index, a term that lost its "[": the product grammar says so)
        before = (before[1], value)
    return False


def _indices(items: list[tuple[str, str, int]]) -> set[str]:
    """The names that stand inside brackets: the indices."""
    depth, found = 0, set()
    for kind, value, _ in items:
        depth += {"[": 1, "]": -1}.get(value, 0)
        if depth > 0 and kind == "name":
            found.add(value)
    return found


def parse(text: str) -> Parsed:
    """Parse an equation and check what can be checked without tensors."""
    tokens = Tokens(text)
    output = read_term(tokens)
    tokens.take("=")
    operands = [read_term(tokens)]
    while tokens.peek()[0] == "name" or tokens.peek()[1] in ("·", "*"):
        if tokens.peek()[1] in ("·", "*"):
            tokens.take()
        operands.append(read_term(tokens))
    scale, scale_pos = _scale(tokens)
    tokens.take("end")
    parsed = Parsed(output, tuple(operands), scale, scale_pos)
    _check(parsed, text)
    return parsed


def _check(p: Parsed, text: str) -> None:
    seen: dict[str, int] = {}
    for index, pos in zip(p.output.indices, p.output.positions, strict=True):
        if index in seen:
            raise at(f"index {index!r} appears twice on the left of {text!r}", text,
                     seen[index], pos)
        seen[index] = pos
    on_right = {i for term in p.operands for i in term.indices}
    for index, pos in zip(p.output.indices, p.output.positions, strict=True):
        if index not in on_right:
            raise at(f"output index {index!r} appears on no operand", text, pos)
    if p.scale is not None and p.scale not in on_right:
        raise at(f"scale index {p.scale!r} appears on no operand", text, p.scale_position)
    for term in p.operands:
        for axis in term.axes:
            if axis.grouped and len(set(axis.indices)) != len(axis.indices):
                raise at(f"a group of {term.name} repeats an index", text, *axis.positions)
    names = {t.name for t in p.operands}
    if p.output.name in names:
        raise at(f"{p.output.name} is both the output and an operand", text, p.output.position)


_GREEK = {
    "α": r"\alpha", "β": r"\beta", "γ": r"\gamma", "δ": r"\delta", "ε": r"\epsilon",
    "ζ": r"\zeta", "η": r"\eta", "θ": r"\theta", "ι": r"\iota", "κ": r"\kappa",
    "λ": r"\lambda", "μ": r"\mu", "ν": r"\nu", "ξ": r"\xi", "π": r"\pi", "ρ": r"\rho",
    "σ": r"\sigma", "τ": r"\tau", "υ": r"\upsilon", "φ": r"\phi", "χ": r"\chi",
    "ψ": r"\psi", "ω": r"\omega", "Γ": r"\Gamma", "Δ": r"\Delta", "Θ": r"\Theta",
    "Λ": r"\Lambda", "Ξ": r"\Xi", "Π": r"\Pi", "Σ": r"\Sigma", "Φ": r"\Phi",
    "Ψ": r"\Psi", "Ω": r"\Omega", "ℓ": r"\ell",
}
_SPELLED = {command[1:]: command for command in _GREEK.values()}  # "phi" -> \phi


def latex_symbol(name: str) -> str:
    """One index or tensor name as LaTeX: Greek letters (written as such or spelled out,
    ``phi``) as commands, ``W_O`` as ``W_{O}``, other multi-letter names upright."""
    if name in _GREEK or name in _SPELLED:
        return _GREEK.get(name) or _SPELLED[name]
    if len(name) == 1:
        return name
    head, _, tail = name.partition("_")
    if tail:
        return f"{latex_symbol(head)}_{{{latex_symbol(tail)}}}"
    return rf"\mathrm{{{name}}}"

