"""The reading half of :mod:`einattn.latex` below the grammar: the tokens of one LaTeX
equation, a cursor over them whose errors put a caret under their place in the LaTeX, and
the readers of single tokens (letters, upright words, primes) the grammar is built from."""

from __future__ import annotations

import re
from collections import Counter
from typing import NamedTuple

from ._syntax import _GREEK
from .errors import EinattnError, at

TOKEN = re.compile(r"\s*(?:(?P<cmd>\\(?:[A-Za-z]+|[\s\S]))|(?P<char>\S))")
SPACES = {"\\ ", "\\,", "\\;", "\\:", "\\!", r"\quad", r"\qquad"}
IGNORED = {"&", r"\nonumber", r"\notag", r"\displaystyle"}
LETTERS = {command: letter for letter, command in _GREEK.items()}  # \tau -> τ
WORDS = {r"\text", r"\mathrm", r"\operatorname"}


PRIME = "ʹ"  # U+02B9 MODIFIER LETTER PRIME: a letter, so τʹ is an identifier
NOT_PRODUCTS = {"softmax": "a softmax", r"\exp": "an exponential", "+": "a sum of terms",
                 "-": "a difference", r"\in": "a declaration ∈ ℝ^{…}", r"\leftarrow": "an update"}
FORM = r"from_latex reads one product, Out_{…} = A_{…} B_{…} / \sqrt{d}"


class Token(NamedTuple):
    kind: str  # "cmd" (a backslash and what follows), "char", or "end"
    value: str
    col: int  # where it is in the LaTeX


class Reader:
    """The tokens of one LaTeX equation and a cursor; errors point into the LaTeX."""

    def __init__(self, tex: str, tokens: list[Token] | None = None, end: int = -1,
                 labels: frozenset[str] = frozenset(), scripted: Counter | None = None):
        self.shown = re.sub(r"\s", " ", tex)  # on one line, one column per character
        self.tokens = tokenize(self.shown) if tokens is None else tokens
        self.end = len(self.shown) if end < 0 else end  # the column of the end (or a "}")
        self.labels = frozenset(label.replace("'", PRIME) for label in labels)  # superscripts
        # the user names as labels of a tensor's name; how often each token stands in a sub-
        # or superscript of the whole equation (a letter in two is an index, not a label)
        self.scripted = _scripted(self.tokens) if scripted is None else scripted
        self.k = 0

    def error(self, message: str, *cols: int) -> EinattnError:
        return at(message, self.shown, *cols)

    def peek(self, ahead: int = 0) -> Token:
        k = self.k + ahead
        return self.tokens[k] if k < len(self.tokens) else Token("end", "", self.end)

    def take(self) -> Token:
        self.k += 1
        return self.peek(-1)

    def expect(self, value: str, where: str) -> Token:
        token = self.take()
        if token.value != value:
            found = "the end" if token.kind == "end" else repr(token.value)
            raise self.error(f"expected {value!r} {where} but found {found}", token.col)
        return token

    def braced(self, where: str) -> Reader:
        """A reader of what is inside the ``{…}`` that comes next (braces are balanced)."""
        self.expect("{", where)
        start, depth = self.k, 1
        while depth:
            depth += {"{": 1, "}": -1}.get(self.take().value, 0)
        closing = self.tokens[self.k - 1]
        return Reader(self.shown, self.tokens[start:self.k - 1], closing.col, self.labels,
                      self.scripted)


def _scripted(tokens: list[Token]) -> Counter:
    """How often each token's value stands in a sub- or superscript (``_x``, ``^{…}``)."""
    seen: Counter = Counter()
    k = 0
    while k < len(tokens) - 1:
        k += 1
        if tokens[k - 1].value not in ("_", "^"):
            continue
        if tokens[k].value != "{":
            seen[tokens[k].value] += 1
            continue
        depth = 1
        while depth and k + 1 < len(tokens):
            k += 1
            depth += {"{": 1, "}": -1}.get(tokens[k].value, 0)
            seen[tokens[k].value] += depth > 0
    return seen


def tokenize(shown: str) -> list[Token]:
    tokens = [Token(m.lastgroup, m.group(m.lastgroup), m.start(m.lastgroup))
              for m in TOKEN.finditer(shown)]
    tokens = [t for t in tokens if t.value not in IGNORED]
    tokens = tokens[:-1] if tokens and tokens[-1].value == "\\\\" else tokens  # an aligned \\
    opened = []
    for t in tokens:
        if t.value == "}" and not opened:
            raise at("unbalanced braces: this '}' closes nothing", shown, t.col)
        opened += [t.col] if t.value == "{" else []
        opened = opened[:-1] if t.value == "}" else opened
    if opened:
        raise at("unbalanced braces: this '{' is never closed", shown, opened[-1])
    return tokens


def word(r: Reader, command: Token) -> str:
    inner = r.braced(f"after {command.value}").tokens
    for t in inner:
        if not t.value.isalnum():
            raise r.error(f"{command.value}{{…}} names with letters and digits", t.col)
    if not inner:
        raise r.error(f"empty {command.value}{{}}", command.col)
    return "".join(t.value for t in inner)


def letter(r: Reader, token: Token, what: str) -> str:
    if token.value in LETTERS:
        return LETTERS[token.value]
    if token.kind == "char" and token.value.isalpha():
        return token.value
    if token.value.isdigit():
        raise r.error(f"a number cannot be {what} (a fixed slice such as W_{{\\mu 0 i a}} is "
                      "not a contraction): indices are letters", token.col)
    raise unreadable(r, token, what)


def unreadable(r: Reader, token: Token, what: str = "") -> EinattnError:
    where = f" where {what} belongs" if what else ""
    message = (f"{NOT_PRODUCTS[token.value]} is not a contraction" if token.value in NOT_PRODUCTS
               else f"the equation ends{where}" if token.kind == "end"
               else f"unknown command {token.value}{where}" if token.kind == "cmd"
               else f"cannot read {token.value!r}{where}")
    return r.error(f"{message}: {FORM}", token.col)


def skip_arguments(r: Reader) -> None:
    opening, depth, token = r.peek(), 0, r.peek()
    while depth or token.value != ")":
        token = r.take()
        depth += {"(": 1, ")": -1}.get(token.value, 0)
        if token.kind == "end":
            raise r.error("this '(' of an argument list is never closed", opening.col)


def primes(r: Reader) -> str:
    start = r.k
    while r.peek().value == "'":
        r.take()
    return PRIME * (r.k - start)
