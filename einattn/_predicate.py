"""Index predicates such as ``σ ≤ τ ∧ τ − σ < w``: read, rendered as LaTeX, run on index
tensors. The grammar, in words: comparisons (``<``, ``≤``/``<=``, ``=``/``==``, ``≠``/``!=``,
``≥``/``>=``, ``>``, chained as ``0 ≤ τ − σ < w``) of integer expressions, joined by
``∧``/``and``, ``∨``/``or`` and ``¬``/``not`` and parenthesised; an expression is made of
the indices ``n``, ``μ``, ``τ``, ``σ`` (positions, as every piece reads them), integer
literals, named integer parameters, ``+``, ``−`` (also unary) and floor division by a
positive integer, ``⌊x / k⌋`` or ``x // k``. An error shows the text with a caret under the
place it is about, as every Equation error does.
"""

from __future__ import annotations

import re
from collections import namedtuple

import torch

from .errors import at

INDICES = {"n": "n", "μ": r"\mu", "τ": r"\tau", "σ": r"\sigma"}
WORDS = ("and", "or", "not")  # ∧, ∨, ¬ spelled out
_SYMBOLS = {"<=": "≤", ">=": "≥", "==": "=", "!=": "≠", "-": "−", "and": "∧", "or": "∨",
            "not": "¬"}
COMPARISONS = {"<": "<", "≤": r"\le", "=": "=", "≠": r"\ne", "≥": r"\ge", ">": ">"}
_TOKEN = re.compile(r"\s*(?:(?P<number>\d+(?:\.\d*)?)|(?P<name>[^\W\d]\w*)"
                    r"|(?P<symbol><=|>=|==|!=|//|[<>=≤≥≠+\-−()⌊⌋/∧∨¬])|(?P<bad>\S))")


# The tree: integers, indices, parameters (name, value); −x, a ± b, ⌊x / k⌋; comparisons
# (exact: no index twice, so its interval judgement is exact), ∧ / ∨ of parts, ¬x.
Num = namedtuple("Num", "value")
Index = namedtuple("Index", "name")
Param = namedtuple("Param", "name value")
Neg = namedtuple("Neg", "x")
Bin = namedtuple("Bin", "op a b")
Floor = namedtuple("Floor", "x k")
Cmp = namedtuple("Cmp", "op a b exact")
Join = namedtuple("Join", "op parts")
Not = namedtuple("Not", "x")


def parse(text: str, params: dict) -> object:
    """The predicate ``text`` as a tree, its names resolved (``params``: name → int)."""
    reader = _Reader(text, params)
    tree = reader.predicate()
    if reader.peek()[0] != "end":
        raise reader.error("expected ∧, ∨ or the end of the mask here")
    return tree


class _Reader:
    """A recursive-descent reader over the tokens of one text."""

    def __init__(self, text: str, params: dict) -> None:
        self.text, self.params, self.i = text, params, 0
        self.tokens = []
        for m in _TOKEN.finditer(text):
            kind = m.lastgroup
            word = m.group(kind)
            if kind == "bad":
                raise at(f"unexpected {word!r} in the mask", text, m.start(kind))
            if kind == "name" and word in WORDS:
                kind = "symbol"
            self.tokens.append((kind, _SYMBOLS.get(word, word), m.start(kind)))
        self.tokens.append(("end", "", len(text.rstrip())))

    def peek(self) -> tuple:
        return self.tokens[self.i]

    def take(self) -> tuple:
        token = self.tokens[self.i]
        self.i += 1
        return token

    def error(self, message: str, token: tuple | None = None):
        return at(message, self.text, (token or self.peek())[2])

    def expect(self, word: str) -> None:
        if self.peek()[1] != word or self.peek()[0] != "symbol":
            raise self.error(f"expected {word} here")
        self.take()

    def predicate(self) -> object:
        return self._joined("∨", self.conjunction)

    def conjunction(self) -> object:
        return self._joined("∧", self.negation)

    def _joined(self, op: str, part) -> object:
        parts = [part()]
        while self.peek()[1] == op:
            self.take()
            parts.append(part())
        return parts[0] if len(parts) == 1 else Join(op, tuple(parts))

    def negation(self) -> object:
        if self.peek()[1] == "¬":
            self.take()
            return Not(self.negation())
        if self.peek()[1] == "(":  # a parenthesised predicate, unless a comparison follows
            start = self.i
            try:
                self.take()
                inner = self.predicate()
                self.expect(")")
                if self.peek()[1] not in COMPARISONS:
                    return inner
            except ValueError:
                pass
            self.i = start  # an expression in parentheses, then
        return self.comparison()

    def comparison(self) -> object:
        left = self.expression()
        if self.peek()[1] not in COMPARISONS:
            raise self.error("expected a comparison (<, ≤, =, ≠, ≥, >) here")
        cmps = []
        while self.peek()[1] in COMPARISONS:
            op = self.take()[1]
            right = self.expression()
            cmps.append(Cmp(op, left, right, _exact(left, right)))
            left = right
        return cmps[0] if len(cmps) == 1 else Join("∧", tuple(cmps))

    def expression(self) -> object:
        x = self.term()
        while self.peek()[1] in ("+", "−"):
            x = Bin(self.take()[1], x, self.term())
        return x

    def term(self) -> object:
        x = self.unary()
        while self.peek()[1] == "//":
            self.take()
            x = Floor(x, self.divisor())
        return x

    def unary(self) -> object:
        if self.peek()[1] == "−":
            self.take()
            return Neg(self.unary())
        return self.primary()

    def primary(self) -> object:
        kind, word, _ = token = self.take()
        if kind == "number":
            return Num(self._integer(token))
        if kind == "name":
            return self._name(token)
        if word == "(":
            x = self.expression()
            self.expect(")")
            return x
        if word == "⌊":
            x = self.expression()
            self.expect("/")
            k = self.divisor()
            self.expect("⌋")
            return Floor(x, k)
        raise self.error("expected an index (n, μ, τ, σ), an integer, a parameter or ( here",
                         token)

    def divisor(self) -> object:
        token = self.take()
        k = Num(self._integer(token)) if token[0] == "number" else \
            self._name(token) if token[0] == "name" else None
        if not isinstance(k, (Num, Param)) or k.value < 1:
            raise self.error("a floor division divides by a positive integer or a parameter "
                             "that is one", token)
        return k

    def _integer(self, token: tuple) -> int:
        if "." in token[1]:
            raise self.error(f"a mask's numbers are integers (positions), got {token[1]}",
                             token)
        return int(token[1])

    def _name(self, token: tuple) -> object:
        name = token[1]
        if name in INDICES:
            return Index(name)
        if name in self.params:
            return Param(name, self.params[name])
        given = ", ".join(self.params) or "none given"
        raise self.error(f"unknown name {name!r} in the mask: the indices are n, μ, τ, σ "
                         f"(positions), the parameters {given}", token)


def _exact(a, b) -> bool:
    """Whether no index occurs twice in ``a`` and ``b`` together."""
    names = []

    def visit(x) -> None:
        if isinstance(x, Index):
            names.append(x.name)
        for child in (getattr(x, f, None) for f in ("x", "a", "b")):
            if child is not None:
                visit(child)
    visit(a)
    visit(b)
    return len(names) == len(set(names))


def run(x, env: dict):
    """The tree on the index tensors ``env`` (name → tensor): a bool tensor (or a Python
    bool, where no index occurs), a number or an integer tensor below."""
    if isinstance(x, (Num, Param)):
        return x.value
    if isinstance(x, Index):
        return env[x.name]
    if isinstance(x, Neg):
        return -run(x.x, env)
    if isinstance(x, Bin):
        a, b = run(x.a, env), run(x.b, env)
        return a + b if x.op == "+" else a - b
    if isinstance(x, Floor):
        return run(x.x, env) // x.k.value
    if isinstance(x, Cmp):
        return _compare(x.op, run(x.a, env), run(x.b, env))
    if isinstance(x, Not):
        return ~_bool(run(x.x, env))
    parts = [run(p, env) for p in x.parts]
    out = parts[0]
    for p in parts[1:]:
        out = (out & p) if x.op == "∧" else (out | p)
    return out


def _bool(v):
    return torch.tensor(v) if isinstance(v, bool) else v


def _compare(op: str, a, b):
    return {"<": lambda: a < b, "≤": lambda: a <= b, "=": lambda: a == b,
            "≠": lambda: a != b, "≥": lambda: a >= b, ">": lambda: a > b}[op]()


def latex(x, outer: str = "") -> str:
    """The tree as LaTeX: ``\\le``, ``\\wedge``, ``\\lfloor \\frac{x}{k} \\rfloor``, …"""
    if isinstance(x, Num):
        return str(x.value)
    if isinstance(x, Index):
        return INDICES[x.name]
    if isinstance(x, Param):
        return x.name if len(x.name) == 1 else rf"\mathit{{{x.name}}}"
    if isinstance(x, Neg):
        return f"-{latex(x.x, 'neg')}"
    if isinstance(x, Bin):
        text = f"{latex(x.a, '+')} {'+' if x.op == '+' else '-'} {latex(x.b, x.op)}"
        return rf"\left({text}\right)" if outer in ("−", "neg") else text
    if isinstance(x, Floor):
        return rf"\left\lfloor \frac{{{latex(x.x)}}}{{{latex(x.k)}}} \right\rfloor"
    if isinstance(x, Cmp):
        text = f"{latex(x.a)} {COMPARISONS[x.op]} {latex(x.b)}"
        return rf"\left({text}\right)" if outer == "¬" else text
    if isinstance(x, Not):
        return rf"\neg {latex(x.x, '¬')}"
    join = r" \wedge " if x.op == "∧" else r" \vee "
    text = join.join(latex(p, x.op) for p in x.parts)
    return rf"\left({text}\right)" if outer in ("∧", "¬") or (outer == "∨" and x.op == "∨") \
        else text
