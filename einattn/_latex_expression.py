r"""LaTeX of the expression language, read: what :meth:`einattn.Equation.from_latex` reads
where an equation is more than one product (a softmax, a sum of terms, a quotient, a
function); :mod:`einattn.latex` reads the tensors and products, this module the rest.

* ``\operatorname{softmax}_{\sigma}(…)``, ``\mathrm{softmax}``, ``\text{softmax}``, and
  ``logsumexp`` alike; ``\max_{\sigma}``, ``\sum_{\sigma}`` (over what follows it in its
  product), ``\exp``, ``\log``, ``\tanh``, ``\max(x, y)``; ``e^{x}`` is ``exp(x)`` where the
  superscript is more than indices;
* ``\frac{…}{…}`` a quotient (``\sqrt{d_a}`` in its denominator the root of a size, as in a
  product), ``/``, ``+``, ``-``, ``\cdot``, ``\times`` and spacing, numbers, parentheses
  (``\left( … \right)``, braces), and named scalars: a name with no index slot (``c``).

    >>> read_expression(r"A_{\tau \sigma} = \operatorname{softmax}_{\sigma}\left("
    ...                 r"\frac{S_{\tau \sigma}}{c}\right)")
    'A[τ σ] = softmax_σ(S[τ σ] / c)'
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping

from . import latex
from ._latex_reader import LETTERS, SPACES, WORDS, Reader, tokenize, word
from .errors import EinattnError

_FUNCTIONS = {r"\exp": "exp", r"\log": "log", r"\tanh": "tanh"}
_NAMED = ("softmax", "logsumexp")
_NAMED_ELEMENTWISE = ("sigmoid",)  # \operatorname{sigmoid}(x), entry by entry
_SIGNS = {"+", "-", r"\exp", r"\log", r"\tanh", r"\max"}


def written_as_expression(tex: str) -> bool:
    """Whether ``tex`` uses what only the expression language has: a sign, a function, a
    number outside a slot, ``e^{…}``, or a ``\\frac`` whose denominator is no lone root."""
    if not isinstance(tex, str):
        return False
    try:
        tokens = tokenize(re.sub(r"\s", " ", tex))
    except EinattnError:
        return False
    values = [t.value for t in tokens]
    if any(f"{{{name}}}" in "".join(values) for name in _NAMED + _NAMED_ELEMENTWISE):
        return True
    slots = []  # for each open brace, whether it holds index slots (after _ or ^)
    for k, value in enumerate(values):
        slots = [*slots, values[k - 1:k] in (["_"], ["^"])] if value == "{" else \
            slots[:-1] if value == "}" else slots
        if value in _SIGNS or (value == "e" and values[k + 1:k + 2] == ["^"]) or (
                value.isdigit() and not any(slots) and values[k - 1:k] != ["_"]):
            return True
        if value == r"\frac" and _denominator(values, k + 1)[:1] != [r"\sqrt"]:
            return True
    return False


def names_a_function(tex: str) -> bool:
    """Whether ``tex`` calls an upright elementwise function (``\\operatorname{sigmoid}``),
    which the product reader would take for a tensor's name."""
    return isinstance(tex, str) and any(rf"{{{name}}}" in re.sub(r"\s", "", tex)
                                        for name in _NAMED_ELEMENTWISE)


def _denominator(values: list[str], k: int) -> list[str]:
    """The tokens of the second braced group from ``k`` on (a fraction's denominator)."""
    depth, groups, found = 0, 0, []
    for value in values[k:]:
        if groups == 1 and (depth or value != "{"):
            found.append(value)
        depth += {"{": 1, "}": -1}.get(value, 0)
        groups += depth == 0 and value == "}"
        if groups == 2:
            break
    return [v for v in found if v not in ("{", "}")][:1]


class _Out:
    """The einattn equation being written: pieces, each with its column in the LaTeX."""

    def __init__(self):
        self.pieces: list[list] = []  # [text, column]; a root's index is filled in at the end
        self.roots: list[tuple[int, Reader, Reader]] = []  # (piece, reader, inside \sqrt{…})

    def put(self, piece: str, col: int) -> None:
        self.pieces.append([piece, col])

    @property
    def cols(self) -> list[int]:
        return [col for piece, col in self.pieces for _ in piece]

    def term(self, term) -> None:
        self.put(f"{term.name}[", term.col)
        for n, axis in enumerate(term.axes):
            self.put(" " * (n > 0) + "(" * axis.grouped, axis.indices[0].col)
            for m, index in enumerate(axis.indices):
                self.put(" " * (m > 0) + index.name, index.col)
            self.put(")" * axis.grouped, axis.indices[-1].col)
        self.put("]", term.col)

    @property
    def text(self) -> str:
        return "".join(piece for piece, _ in self.pieces)

    def rooted(self, size_names: Mapping[str, str]) -> None:
        r"""Each ``\sqrt{…}`` read as the root of an index's size, the equation's indices known."""
        indices = {i for i in re.findall(r"[^\W\d][\wʹ]*",
                                         " ".join(re.findall(r"\[([^\]]*)\]", self.text)))}
        for k, r, inside in self.roots:
            index = latex.scale_index(r, inside, indices, size_names)
            self.pieces[k] = [f" / √{index.name}", index.col]


def read_expression(tex: str, size_names: Mapping[str, str] | None = None,
                    labels: Iterable[str] = (), build: Callable | None = None) -> str:
    """The einattn equation that LaTeX ``tex`` writes; ``build`` (``Equation``) checks it,
    its errors' carets moved back into the LaTeX."""
    r = Reader(tex, labels=frozenset(labels))
    if not any(t.value == "=" for t in r.tokens):
        raise r.error("no '=': this is an expression, not an equation Out_{…} = …",
                      r.peek().col)
    w = _Out()
    reader = _Reader(w, dict(size_names or {}))
    w.term(latex.read_term(r))
    token = r.take()
    if token.value != "=":
        raise r.error("expected '=' after the output tensor", token.col)
    w.put(" = ", token.col)
    reader.sum(r)
    if r.peek().kind != "end":
        raise r.error(f"cannot read {r.peek().value!r} here", r.peek().col)
    w.rooted(reader.size_names)
    if build is not None:
        try:
            build(w.text)
        except EinattnError as error:
            raise latex.relocated(error, w.text, w.cols, r.shown) from None
    return w.text


class _Reader:
    """The grammar: a sum of products of factors, each writing its einattn text."""

    def __init__(self, w: _Out, size_names: dict[str, str]):
        self.w, self.size_names = w, size_names

    def sum(self, r: Reader) -> None:
        first = True
        while True:
            token = r.peek()
            if token.value in ("+", "-"):
                r.take()
                self.w.put(("−" if token.value == "-" else "") if first else
                           (" − " if token.value == "-" else " + "), token.col)
            elif not first:
                return
            self.product(r)
            first = False
            if r.peek().value not in ("+", "-"):
                return

    def product(self, r: Reader) -> None:
        """Factors, a tensor beside what comes before it (``Q[τ b] K[σ b]``), else ``·``."""
        first = True
        while True:
            token = r.peek()
            if token.kind == "end" or token.value in ("+", "-", ")", r"\right", ",", "="):
                if first:
                    raise r.error("expected a factor: a tensor, a number, a function or "
                                  "(…)", token.col)
                return
            if token.value in SPACES or token.value in (r"\cdot", r"\times"):
                r.take()
            elif token.value == "/":
                r.take()
                self.divisor(r, token.col)
            else:
                k = len(self.w.pieces)
                if not first:
                    self.w.put(" · ", token.col)
                if self.factor(r) == "term" and not first:
                    self.w.pieces[k][0] = " "
                first = False

    def divisor(self, r: Reader, col: int) -> None:
        if r.peek().value == r"\sqrt":
            self.root(r, r.take())
        else:
            self.over(r, col)

    def over(self, r: Reader, col: int) -> None:
        """`` / factor``; a fraction divided by is one factor, in parentheses (``a / (b / c)``,
        never ``a / b / c``)."""
        nested = r.peek().value == r"\frac"
        self.w.put(" / (" if nested else " / ", col)
        self.factor(r)
        self.w.put(")" if nested else "", col)

    def root(self, r: Reader, token) -> None:
        """``\\sqrt{d_a}``: the root of index ``a``'s size, as a product divides by it (which
        index, once the equation's indices are known)."""
        self.w.roots.append((len(self.w.pieces), r, r.braced(r"after \sqrt")))
        self.w.put(" / √", token.col)

    def factor(self, r: Reader) -> str | None:
        """One factor; ``"term"`` where it is a tensor."""
        token = r.peek()
        if token.value == r"\frac":
            return self.fraction(r)
        if token.value in ("(", "{", r"\left") and not self.named(r):
            return self.group(r)
        if token.value in _FUNCTIONS:
            r.take()
            return self.call(r, _FUNCTIONS[token.value], None, token.col)
        if self.operator(r) in _NAMED_ELEMENTWISE:
            name = self.operator(r)
            word(r, r.take())
            return self.call(r, name, None, token.col)
        if token.value in (r"\max", r"\sum") or self.operator(r) is not None:
            return self.axis_function(r)
        if token.kind == "char" and (token.value.isdigit() or token.value == "."):
            return self.number(r)
        if token.value == "e" and r.peek(1).value == "^" and self.exponent_follows(r):
            r.take()
            r.take()
            return self.call(r, "exp", None, token.col)
        if token.value == r"\sqrt":
            raise r.error(r"a square root divides: write / \sqrt{d_x} or \frac{…}{\sqrt{d_x}}",
                          token.col)
        term = latex.read_term(r)
        if not term.axes:
            return self.w.put(term.name, term.col)  # a name with no index slot: a scalar
        self.w.term(term)
        return "term"

    def fraction(self, r: Reader) -> None:
        """``\\frac{a}{b}``: ``a / b``, a root of ``b`` the root of a size."""
        start = r.take().col
        top = r.braced(r"after \frac")
        bottom = r.braced(r"after the numerator of \frac")
        self.parenthesised(top, start, sum_only=True)
        if _has_sum(bottom):
            self.w.put(" / (", start)
            self.sum(bottom)
            self.w.put(")", start)
            return
        while bottom.peek().kind != "end":
            token = bottom.peek()
            if token.value in SPACES or token.value in (r"\cdot", r"\times"):
                bottom.take()
            elif token.value == r"\sqrt":
                self.root(bottom, bottom.take())
            else:
                self.over(bottom, token.col)

    def parenthesised(self, r: Reader, col: int, sum_only: bool) -> None:
        """What ``r`` holds, in parentheses where it is a sum (or always)."""
        wrap = _has_sum(r) or not sum_only
        self.w.put("(" if wrap else "", col)
        self.sum(r)
        self.w.put(")" if wrap else "", col)

    def group(self, r: Reader) -> None:
        """``( … )``, ``\\left( … \\right)`` or ``{ … }``."""
        token = r.peek()
        if token.value == "{":
            return self.parenthesised(r.braced(""), token.col, sum_only=False)
        r.take()
        if token.value == r"\left":
            r.expect("(", r"after \left")
        self.w.put("(", token.col)
        self.sum(r)
        if token.value == r"\left":
            r.expect(r"\right", "closing the parentheses")
        closing = r.expect(")", "closing the parentheses")
        self.w.put(")", closing.col)

    def call(self, r: Reader, name: str, axis, col: int) -> None:
        """``name(argument)`` (or ``name_axis``) written at ``col``: the argument
        parenthesised, braced, or one factor; ``max(x, y)`` two."""
        self.w.put(name, col)
        if axis is not None:
            self.w.put(f"_{axis.name}", axis.col)
        token = r.peek()
        if token.value in ("(", r"\left"):
            r.take()
            if token.value == r"\left":
                r.expect("(", r"after \left")
            self.w.put("(", token.col)
            self.sum(r)
            while r.peek().value == ",":
                self.w.put(", ", r.take().col)
                self.sum(r)
            if token.value == r"\left":
                r.expect(r"\right", "closing the argument")
            self.w.put(")", r.expect(")", "closing the argument").col)
        elif token.value == "{":
            self.parenthesised(r.braced(""), token.col, sum_only=False)
        else:
            self.w.put("(", token.col)
            self.factor(r)
            self.w.put(")", token.col)

    def axis_function(self, r: Reader) -> None:
        """``\\max_{σ}``, ``\\sum_{σ}`` (over the rest of its product), a named operator
        (``\\operatorname{softmax}_{σ}``), or ``\\max(x, y)``."""
        token = r.peek()
        name = "sum" if token.value == r"\sum" else "max" if token.value == r"\max" \
            else self.operator(r)
        r.take()
        if token.value in WORDS:
            word(r, token)
        if r.peek().value != "_":
            if name != "max":
                command = token.value if name == "sum" else rf"\operatorname{{{name}}}"
                raise r.error(f"{name} needs the index it runs along: write "
                              f"{command}_{{\\sigma}}(…)", token.col)
            return self.call(r, "max", None, token.col)
        r.take()
        places = [p for p in latex.read_places(r) if p]
        if len(places) != 1 or len(places[0].indices) != 1:
            raise r.error(f"{name} runs along one index", token.col)
        (axis,) = places[0].indices
        if name != "sum" or r.peek().value in ("(", r"\left"):  # sum_σ(…) of its group
            return self.call(r, name, axis, token.col)
        self.w.put(f"sum_{axis.name}(", token.col)
        self.product(r)
        self.w.put(")", token.col)

    def operator(self, r: Reader) -> str | None:
        """``softmax`` or ``logsumexp`` where an upright word names one, else None."""
        token = r.peek()
        if token.value not in WORDS or r.peek(1).value != "{":
            return None
        k = r.k + 2
        text = ""
        while k < len(r.tokens) and r.tokens[k].value != "}":
            text += r.tokens[k].value
            k += 1
        return text if text in _NAMED + _NAMED_ELEMENTWISE else None

    def number(self, r: Reader) -> None:
        start, digits = r.peek().col, ""
        while r.peek().kind == "char" and (r.peek().value.isdigit() or r.peek().value == "."):
            digits += r.take().value
        self.w.put(digits, start)

    def named(self, r: Reader) -> bool:
        """Whether a tensor's name in parentheses comes next, ``(W_{O})_{μ a i}`` or
        ``\\left(W_Q\\right)``: a subscripted name, then its index slots."""
        k = r.k + (2 if r.peek().value == r"\left" else 1)
        if r.tokens[r.k:k][-1:] and r.tokens[k - 1].value != "(":
            return False
        inside = []
        while k < len(r.tokens) and r.tokens[k].value not in (")", r"\right"):
            inside.append(r.tokens[k].value)
            k += 1
        k += 2 if k < len(r.tokens) and r.tokens[k].value == r"\right" else 1
        after = r.tokens[k].value if k < len(r.tokens) else ""
        return "_" in inside and after in ("_", "^") and not any(
            v in ("+", "-", r"\frac", "(") or v in _FUNCTIONS for v in inside)

    def exponent_follows(self, r: Reader) -> bool:
        """``e^{…}`` is an exponential where the superscript holds more than indices."""
        k, depth, inner = r.k + 2, 0, []
        while k < len(r.tokens):
            value = r.tokens[k].value
            depth += {"{": 1, "}": -1}.get(value, 0)
            inner.append(value)
            k += 1
            if depth == 0:
                break
        return any(v in ("_", "+", "-", r"\max", "^") or v in _FUNCTIONS or v in WORDS
                   for v in inner) or not all(v in ("{", "}") or v in LETTERS or
                                              v.isalpha() for v in inner)


def _has_sum(r: Reader) -> bool:
    """Whether ``r`` holds a ``+`` or ``-`` outside braces and parentheses."""
    depth = 0
    for token in r.tokens[r.k:]:
        depth += {"{": 1, "}": -1, "(": 1, ")": -1}.get(token.value, 0)
        if depth == 0 and token.value in ("+", "-"):
            return True
    return False
