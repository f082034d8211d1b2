r"""LaTeX index notation, read into einattn's equation language and rendered back.

:meth:`Equation.from_latex <einattn.notation.Equation.from_latex>` reads one equation as a
derivation writes it; :meth:`Equation.latex <einattn.notation.Equation.latex>` writes one
back. Seed 003's scores, and the equation they are read as::

    \tilde{A}_{\tau \tau'} = \frac{Q_{\tau a} K_{\tau'}^{\ \ \ a}}{\sqrt{d_k}}
    A_tilde[τ τʹ] = Q[τ a] K[τʹ a] / √a               (size_names={"d_k": "a"})

* Subscripts and superscripts are both index slots; each ``\ `` (``\,``, ``\;``) holds a
  place, place k above and place k below are one slot (one index at most), empty places are
  dropped: ``V^{\ \tau'}_{\mu \ \ a}`` is ``V[μ τʹ a]``, ``X_{\tau}^{\ \ i}`` is ``X[τ i]``.
* In a slot each letter is an index (``_{ia}`` is ``i a``), ``\tau`` is ``τ``, ``\tau'``
  is ``τʹ`` (U+02B9, a letter: a new index, never ``τ``), ``\mathrm{pos}`` is ``pos``,
  and ``(\mu B a)`` is a fused axis, as in einattn.
* Tensors: ``X``, ``\Xi``; a name with a subscript in parentheses, ``\left(W_Q\right)``
  or ``(W_{O})``, is ``W_Q``, ``W_O``; ``\text{Attention}(Q,K,V)`` is ``Attention`` (its
  arguments only label it; ``\mathrm``, ``\operatorname`` alike); ``\tilde{A}``,
  ``\hat{A}``, ``\bar{A}`` are ``A_tilde``, ``A_hat``, ``A_bar``.
* A label above is part of the name, as papers write names: ``W^{O}_{\mu a i}`` is
  ``W_O[μ a i]``, ``W^{(O)}`` is ``W_O``, ``h^{(l)}`` is ``h_l``, ``E^{\text{pos}}`` is
  ``E_pos``. A superscript is a label when it is capitals (``O``, ``QK``), one upright
  word, one symbol in parentheses (a letter, a number or a word), or one that ``labels``
  names (``labels={"q"}`` reads ``W^{q}`` as ``W_q``); any other holds indices, as
  ``V^{\ \tau'}`` does. ``T``, ``\top`` and ``\intercal`` above are transposes, refused.
* The right side is a product (``\cdot`` and spacing allowed) with one scale at most,
  ``\frac{…}{\sqrt{s}}``, ``\frac{1}{\sqrt{s}}`` or ``/ \sqrt{s}``: divide by the square
  root of an index's size. ``size_names`` ties ``s`` to an index (seed 003 indexes the head
  width ``a`` but calls its size ``d_k``: ``{"d_k": "a"}``); failing that, ``d_x`` or
  ``d_{x}`` is the size of index ``x`` (as ``Equation.latex()`` writes it), ``x`` alone too.
* Summation is Einstein's: an index absent from the left is summed; one on the left is free
  even when repeated on the right. ``\sum_{j}`` may say so, if ``j`` is summed.
* Alignment ``&``, ``\nonumber``, ``\notag`` and a closing ``\\`` are ignored.

An equation that is more than one product (a softmax, a sum of terms, a quotient, a
function) is read by :mod:`einattn._latex_expression`, with these rules for its tensors.
Anything else (a second ``=``, a number as an index, an unknown command, an unbalanced
brace) is an :class:`~einattn.errors.EinattnError` with a caret under its place in the LaTeX.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import zip_longest
from typing import NamedTuple

from . import _delta
from ._latex_reader import (
    FORM,
    LETTERS,
    NOT_PRODUCTS,
    PRIME,
    SPACES,
    WORDS,
    Reader,
    letter,
    primes,
    skip_arguments,
    unreadable,
    word,
)
from ._syntax import Parsed, Term, latex_symbol, parse
from .errors import EinattnError, at

_ACCENTS = {r"\tilde": "tilde", r"\hat": "hat", r"\bar": "bar"}  # \tilde{A} -> A_tilde
_ACCENT_COMMANDS = {suffix: command for command, suffix in _ACCENTS.items()}


class _Index(NamedTuple):
    name: str  # as einattn writes it: τʹ for \tau'
    col: int


class _Axis(NamedTuple):
    indices: tuple[_Index, ...]
    grouped: bool


class _Term(NamedTuple):
    name: str
    col: int
    axes: tuple[_Axis, ...]

    def indices(self) -> list[_Index]:
        return [i for axis in self.axes for i in axis.indices]


@dataclass
class _Product:
    terms: list[_Term] = field(default_factory=list)
    scale: Reader | None = None  # over the tokens inside \sqrt{…}
    sums: list[_Index] = field(default_factory=list)


def read(tex: str, size_names: Mapping[str, str] | None = None,
         labels: Iterable[str] = ()) -> str:
    r"""The einattn equation that LaTeX ``tex`` writes, by the rules of this module.

    >>> read(r"S_{\tau \tau'} = \frac{Q_{\tau a} K_{\tau'}^{\ \ a}}{\sqrt{d_a}}")
    'S[τ τʹ] = Q[τ a] K[τʹ a] / √a'
    >>> read(r"Y_{\tau i} = Z_{\mu \tau a} W^{O}_{\mu a i}")
    'Y[τ i] = Z[μ τ a] W_O[μ a i]'
    """
    if not isinstance(tex, str):
        raise EinattnError(f"from_latex reads a string of LaTeX, got {type(tex).__name__}")
    if isinstance(labels, str) or not all(isinstance(x, str) for x in labels):
        raise EinattnError(f"labels is a collection of superscripts, such as {{'l'}}, got "
                           f"{labels!r}")
    r = Reader(tex, labels=frozenset(labels))
    out, product = _equation(r)
    indices = {i.name for t in (out, *product.terms) for i in t.indices()}
    scale = scale_index(r, product.scale, indices, size_names or {})
    _check_sums(r, out, product)
    text, cols = _written(out, product.terms, scale)
    try:
        parse(text)
    except EinattnError as error:  # the same complaint, its carets moved into the LaTeX
        raise relocated(error, text, cols, r.shown) from None
    return text


def _equation(r: Reader) -> tuple[_Term, _Product]:
    if not any(t.value == "=" for t in r.tokens):
        raise r.error(f"no '=': this is an expression; {FORM}", r.peek().col)
    out = read_term(r)
    if r.peek().value != "=":
        second = read_term(r)  # or an error saying why it is not a tensor either
        raise r.error(f"the left side must be one tensor, the output: {FORM}", second.col)
    token = r.take()
    product = _Product()
    _factors(r, product)
    if not product.terms:
        raise r.error(f"no tensor on the right: {FORM}", token.col)
    return out, product


def _factors(r: Reader, product: _Product) -> None:
    """Tensors, spacing, ``\\sum_{…}`` and the scale, up to the end of ``r``."""
    while True:
        token = r.peek()
        if token.kind == "end":
            return
        if token.value in SPACES or token.value == r"\cdot":
            r.take()
        elif token.value == "=":
            raise r.error(f"a second '=': {FORM}; give each step of a chain on its own",
                          token.col)
        elif token.value == "\\\\":
            raise r.error(f"a line break: {FORM}; give each line on its own", token.col)
        elif token.value == r"\sum":
            r.take()
            r.expect("_", r"after \sum")
            product.sums += [i for place in read_places(r) if place for i in place.indices]
        elif token.value == r"\frac":
            _fraction(r, product)
        elif token.value == "/":
            r.take()
            _root(r, product, token.col)
        else:
            product.terms.append(read_term(r))


def _fraction(r: Reader, product: _Product) -> None:
    start = r.take().col
    numerator = r.braced(r"after \frac")
    if [t.value for t in numerator.tokens] != ["1"]:  # \frac{1}{\sqrt{d}}: tensors follow
        _factors(numerator, product)
    denominator = r.braced(r"after the numerator of \frac")
    _root(denominator, product, start)
    if denominator.peek().kind != "end":
        raise r.error(r"the denominator of \frac is \sqrt{size} alone", denominator.peek().col)


def _root(r: Reader, product: _Product, col: int) -> None:
    token = r.take()
    if token.value != r"\sqrt":
        raise r.error(r"a scale divides by \sqrt{size}, the square root of a size", token.col)
    if product.scale is not None:
        raise r.error("a second scale: an Equation divides by one square root", col)
    product.scale = r.braced(r"after \sqrt")


def read_term(r: Reader) -> _Term:
    token = r.peek()
    if token.value == "(" or (token.value == r"\left" and r.peek(1).value == "("):
        r.take()
        if token.value == r"\left":
            r.take()
        name, col = _name(r, subscripted=True)
        if token.value == r"\left":
            r.expect(r"\right", f"closing the parentheses around {name}")
        r.expect(")", f"closing the parentheses around {name}")
    else:
        name, col = _name(r, subscripted=False)
        if token.value in WORDS and r.peek().value in ("(", r"\left"):
            skip_arguments(r)  # \text{Attention}(Q,K,V): a label
    places: dict[str, list[_Axis | None]] = {}
    while r.peek().value in ("_", "^"):
        mark = r.take()
        if mark.value in places:
            raise r.error(f"a second {'sub' if mark.value == '_' else 'super'}script on "
                          f"{name}", mark.col)
        label = _label(r, name) if mark.value == "^" else None
        if label is None:
            places[mark.value] = read_places(r)
        else:  # W^{O}: part of the name, W_O (before an accent's suffix: A_O_tilde)
            head, _, accent = name.rpartition("_")
            name = f"{head}_{label}_{accent}" if accent in _ACCENT_COMMANDS else f"{name}_{label}"
            places["^"] = []
    return _Term(name, col, _merged(r, name, places.get("_", []), places.get("^", [])))


def _label(r: Reader, name: str) -> str | None:
    """The label a superscript adds to a tensor's name, read; or None, and nothing read, for
    a superscript of indices (the rules are in the module docstring)."""
    start = r.k
    inner = r.braced("").tokens if r.peek().value == "{" else [r.take()]
    if len(inner) == 1 and inner[0].value in WORDS and r.peek().value == "{":
        inner += r.braced("").tokens  # ^\text{pos}, unbraced
    values = [LETTERS.get(t.value, t.value) for t in inner if t.value not in ("{", "}")]
    text = "".join(values).replace("'", PRIME)
    if text in r.labels:
        return text
    if values and values[0] != "(" and values[0] not in WORDS and any(
            r.scripted[t.value] > 1 for t in inner if t.value.isalpha()):
        r.k = start  # a letter that stands in another script too is an index, not a label:
        return None  # Y^{M} = Λ^{M}_{\ N} X^{N}, A_{τ T} B^{T}
    if values in (["T"], [r"\top"], [r"\intercal"]):
        named = (f"; if T is part of the name {name}_T, write {name}^{{(T)}} or pass "
                 "labels={'T'}") if text == "T" else ""
        raise r.error(f"{name}^{text} is a transpose, which index notation writes by the order "
                      f"of the indices ((A^T)_{{ij}} is A_{{ji}}){named}", inner[0].col)
    label = _label_of(values)
    if label is None:
        r.k = start
    return label


def _label_of(values: list[str]) -> str | None:
    """Capitals (``O``, ``QK``), an upright word, or one symbol in parentheses: a letter, a
    number or an upright word (``(O)``, ``(l)``, ``(12)``); each token's value given."""
    if values[:1] == ["("] and values[-1:] == [")"]:
        inner = values[1:-1]
        one = (len(inner) >= 1 and inner[0].isalnum() and all(v == "'" for v in inner[1:])) \
            or all(map(str.isdigit, inner))
        return "".join(inner).replace("'", PRIME) if one and inner else _upright(inner)
    text = "".join(values)
    if text.isascii() and text.isalnum() and text[0].isupper() and text.isupper():
        return text
    return _upright(values)


def _upright(values: list[str]) -> str | None:
    if len(values) > 1 and values[0] in WORDS and all(v.isalnum() for v in values[1:]):
        return "".join(values[1:])
    return None


def _name(r: Reader, *, subscripted: bool) -> tuple[str, int]:
    r"""A tensor's name; inside parentheses (``subscripted``) it may have a subscript,
    ``W_{O}`` or ``W_{\mathrm{QK}}``."""
    token = r.take()
    if token.value in WORDS:
        name = word(r, token)
        if name in NOT_PRODUCTS:
            raise unreadable(r, token._replace(value=name))
    elif token.value in _ACCENTS:
        r.expect("{", f"after {token.value}")
        name = f"{_name(r, subscripted=True)[0]}_{_ACCENTS[token.value]}"
        r.expect("}", f"closing {token.value}")
    else:
        name = letter(r, token, "a tensor")
    if subscripted and r.peek().value == "_":
        r.take()
        inner = r.braced("").tokens if r.peek().value == "{" else [r.take()]
        name += "_" + "".join(t.value if t.value.isalnum() else letter(r, t, "a name")
                              for t in inner if t.value not in (*WORDS, "{", "}"))
    return name + primes(r), token.col


def read_places(r: Reader) -> list[_Axis | None]:
    """One sub- or superscript: an axis per index or group, None per ``\\ `` spacer."""
    if r.peek().value != "{":
        return [_Axis((_index(r),), False)]
    inner = r.braced("")
    places: list[_Axis | None] = []
    while inner.peek().kind != "end":
        if inner.peek().value in SPACES:
            inner.take()
            places.append(None)
        elif inner.peek().value == "(":
            opening = inner.take()
            group = []
            while inner.peek().value != ")" and inner.peek().kind != "end":
                group.append(_index(inner))
            inner.expect(")", "closing the group")
            if not group:
                raise r.error("an empty group", opening.col)
            places.append(_Axis(tuple(group), True))
        else:
            places.append(_Axis((_index(inner),), False))
    return places


def _index(r: Reader) -> _Index:
    token = r.take()
    name = word(r, token) if token.value in WORDS else letter(r, token, "an index")
    return _Index(name + primes(r), token.col)


def _merged(r: Reader, name: str, below: list, above: list) -> tuple[_Axis, ...]:
    """The slots of ``name``: place k below and place k above are one slot."""
    axes = []
    for k, (low, high) in enumerate(zip_longest(below, above)):
        if low and high:
            raise r.error(f"{name} has an index below and one above in place {k + 1}: if "
                          "both are indices, hold the place of one with '\\ ', as in "
                          "X_{\\tau}^{\\ i}" + _label_advice(name, above),
                          low.indices[0].col, high.indices[0].col)
        if low or high:
            axes.append(low or high)
    return tuple(axes)


def _label_advice(name: str, above: list[_Axis | None]) -> str:
    """How to say that a superscript of one index is a label of ``name`` instead."""
    if len(above) != 1 or above[0] is None or len(above[0].indices) != 1:
        return ""
    label = above[0].indices[0].name
    return (f"; if {label} is part of the name {name}_{label}, write {name}^{{({symbol(label)})}}"
            f" or pass labels={{{label!r}}}")


def scale_index(r: Reader, scale: Reader | None, indices: set[str],
                 size_names: Mapping[str, str]) -> _Index | None:
    """The index whose size ``\\sqrt{…}`` names (rules in the module docstring)."""
    if scale is None:
        return None
    plain = [t for t in scale.tokens if t.value not in ("{", "}", *WORDS)]
    key, col = "".join(t.value for t in plain), scale.peek().col  # d_{\text{k}} is d_k
    named = {re.sub(r"\\(?:text|mathrm|operatorname)|[\s{}]", "", k): v
             for k, v in size_names.items()}
    if key in named and named[key] not in indices:
        raise r.error(f"size_names ties {key} to {named[key]!r}, which is no index of this "
                      f"equation ({', '.join(sorted(indices))})", col)
    if [t.value for t in plain[:2]] == ["d", "_"] and len(plain) > 2:
        plain = plain[2:]  # d_x, d_{x}: the size of x
    name = "".join(LETTERS.get(t.value, t.value) for t in plain)
    name = named.get(key, name.replace("'", PRIME))
    if name not in indices:
        raise r.error(f"the size {key or '(empty)'} is no index's: write d_x for the size of "
                      f"index x, or pass size_names={{{key!r}: index}}", col)
    return _Index(name, col)


def _check_sums(r: Reader, out: _Term, product: _Product) -> None:
    summed = {i.name for t in product.terms for i in t.indices()} - {i.name for i in out.indices()}
    for index in (i for i in product.sums if i.name not in summed):
        raise r.error(f"\\sum_{{{index.name}}} but {index.name} is not summed: it is on the "
                      "left, or on no tensor", index.col)


def _written(out: _Term, terms: list[_Term], scale: _Index | None) -> tuple[str, list[int]]:
    """The einattn equation, and for each of its characters a column in the LaTeX."""
    text: list[str] = []
    cols: list[int] = []

    def put(piece: str, col: int) -> None:
        text.append(piece)
        cols.extend([col] * len(piece))

    for k, term in enumerate((out, *terms)):
        put(f"{' = ' if k == 1 else ' ' * (k > 1)}{term.name}[", term.col)
        for n, axis in enumerate(term.axes):
            put(" " * (n > 0) + "(" * axis.grouped, axis.indices[0].col)
            for m, index in enumerate(axis.indices):
                put(" " * (m > 0) + index.name, index.col)
            put(")" * axis.grouped, axis.indices[-1].col)
        put("]", term.col)
    if scale is not None:
        put(f" / √{scale.name}", scale.col)
    return "".join(text), cols


def relocated(error: EinattnError, text: str, cols: list[int], shown: str) -> EinattnError:
    """``error``, raised about ``text``, with its carets under the LaTeX they came from."""
    lines = str(error).split("\n")
    if "  " + text not in lines:
        return error
    k = lines.index("  " + text)
    carets = lines[k + 1][2:] if k + 1 < len(lines) else ""
    return at("\n".join(lines[:k]), shown, *(cols[p] for p, c in enumerate(carets) if c == "^"))


# -- rendering ----------------------------------------------------------------------------


def symbol(name: str) -> str:
    """An index or tensor name as LaTeX: ``τʹ`` as ``\\tau'``, ``A_tilde`` as
    ``\\tilde{A}``, others as :func:`einattn._syntax.latex_symbol` writes them."""
    name = _delta.NAME if _delta.is_delta(name) else name  # an equation's δ:k is δ
    base = name.rstrip(PRIME)
    primes = "'" * (len(name) - len(base))
    head, _, accent = base.rpartition("_")
    if head and accent in _ACCENT_COMMANDS:
        return f"{_ACCENT_COMMANDS[accent]}{{{symbol(head)}}}{primes}"
    return latex_symbol(base) + primes


def rendered_term(term: Term) -> str:
    parts = []
    for axis in term.axes:
        body = " ".join(symbol(i) for i in axis.indices)
        parts.append(f"({body})" if axis.grouped else body)
    name = symbol(term.name)
    if "_" in name:  # (W_{O})_{\mu a i}: the name's subscript is not an index slot
        name = f"({name})"
    return f"{name}_{{{' '.join(parts)}}}"


def render(p: Parsed) -> str:
    """The equation as LaTeX in the derivation's style, which :func:`read` reads back."""
    right = " ".join(rendered_term(t) for t in p.operands)
    if p.scale is not None:
        right = rf"\frac{{{right}}}{{\sqrt{{d_{{{symbol(p.scale)}}}}}}}"
    return f"{rendered_term(p.output)} = {right}"
