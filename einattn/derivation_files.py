"""Derivation files: the ``derivation`` blocks of a markdown file, read and checked.

A block is a chain of equal forms, as a derivation is written on paper::

    ```derivation
    sizes: n=2 τ=5 i=6 μ=4 B=3 a=2
    P[n τ μ B a] = X[n τ i] W[(μ B a) i]
    = X[n τ i] W[μ B a i]
    ```

Its first line may be ``sizes: index=size ...``; then one equation ``Out[...] = rhs``;
then each line that starts with ``=`` is another right-hand side of ``Out``, which must
equal the first. A ``derivation-latex`` block is the same in LaTeX, each line read by
:meth:`einattn.Equation.from_latex` as written (the ``&`` and closing ``\\\\`` of an align
environment included; its ``\\begin`` and ``\\end`` lines are skipped); its ``sizes:``
line may name an index as a command (``\\tau'=5``) and tie a size name to an index
(``d_k=a``: ``\\sqrt{d_k}`` is the square root of the size of ``a``). Without a ``sizes:``
line every index gets a size of its own, 2, 3, 4, ... in order of first appearance, so
that no swap of two indices can hide behind equal sizes. An index that only a later line
writes takes its size from the first line's shapes where a tensor of the first line fixes
it: ``= Q[τ b] K[σ b]`` after ``Q[τ a] K[σ a]`` renames the summed index, and ``b`` has
the size of ``a``.

Each step is :func:`einattn.verify.check_equivalent` of ``Out = first`` against
``Out = this``: the tensors are drawn once by name, so ``W[(μ B a) i]`` and
``W[μ B a i]`` are one tensor, grouped and opened; in the strongest mode the step allows:
exactly, in a finite field, for contractions, ``/ √index``, ``exp``, ``softmax_σ``,
``logsumexp_σ``, ``sum_σ``, ``max_σ`` (a free value) and quotients; float64 for ``tanh`` or a
``log`` outside ``exp`` (:func:`einattn.verify.check_equivalent`). A line with a tensor the
first line does not have fails without a comparison (that tensor would be drawn on its
own), saying so.

    >>> text = "```derivation\\nY[τ j] = X[τ i] W[i j]\\n= W[i j] X[τ i]\\n```\\n"
    >>> [c.verdict for block in read_blocks(text) for c in check_block(block)]
    ['PASS']
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from ._syntax import _GREEK
from .errors import EinattnError, SidesDiffer
from .notation import Equation
from .verify import Report, check_equivalent

KINDS = ("derivation", "derivation-latex")
MAX_ELEMENTS = 2**27  # the largest tensor a block may draw: 1 GiB of float64
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)[^`]*$")
_LATEX_NOISE = re.compile(r"\\(?:notag|label\{[^}]*\})")  # from_latex skips & \nonumber \\
_LATEX_SKIP = re.compile(r"^(?:\$\$|\\\[|\\\]|\\(?:begin|end)\{[^}]*\})$")
_LETTER = {command: letter for letter, command in _GREEK.items()}  # \tau -> τ, for sizes:


@dataclass(frozen=True)
class Line:
    """One line of the file: its number (from 1) and its text, stripped."""

    number: int
    text: str


@dataclass(frozen=True)
class Step:
    """A line of a block and the equation it means: ``Out[...] = this right-hand side``."""

    line: Line
    equation: Equation


@dataclass(frozen=True)
class Block:
    """One derivation block: its first equation, the steps that must equal it, the sizes."""

    source: str  # the file, as named in messages
    kind: str  # "derivation" or "derivation-latex"
    first: Step
    steps: tuple[Step, ...]
    sizes: dict[str, int]
    sizes_given: bool  # False: the default sizes, all distinct
    inferred: tuple[str, ...] = ()  # indices of later lines sized by the first line's shapes


@dataclass(frozen=True)
class Refused:
    """A block that cannot be checked as written: where it opens, and the error saying why
    (naming the file and the line)."""

    source: str
    kind: str
    opened: int  # the line of its opening fence
    error: EinattnError


@dataclass(frozen=True)
class Checked:
    """One step checked: its report, or why it fails or was skipped before comparing."""

    block: Block
    step: Step
    mode: str  # "field" or "float" ("—" where it failed before a comparison)
    report: Report | None = None
    reason: str = ""  # why the step failed (or was skipped) without a report

    @property
    def equal(self) -> bool | None:
        if self.report is not None:
            return self.report.equal
        return None if self.reason.startswith("skipped") else False

    @property
    def verdict(self) -> str:
        return "SKIP" if self.equal is None else "PASS" if self.equal else "FAIL"


# -- reading --------------------------------------------------------------------------------

def read_file(path: str | Path) -> list[Block]:
    """The derivation blocks of the markdown file at ``path`` (``OSError`` if it cannot be
    read, ``EinattnError`` naming the line if a block is wrong or there is none)."""
    return _accepted(read_file_each(path))


def read_file_each(path: str | Path) -> list[Block | Refused]:
    """Each derivation block of the file at ``path``, or why it is refused (``OSError`` if
    the file cannot be read, ``EinattnError`` if it has no derivation block)."""
    text = Path(path).read_text(encoding="utf-8")
    found = read_each(text, str(path))
    if not found:
        raise EinattnError(f"{path}: no derivation blocks (fenced blocks whose info string "
                           f"is {' or '.join(KINDS)})")
    return found


def read_blocks(text: str, source: str = "<text>") -> list[Block]:
    """Every ``derivation`` and ``derivation-latex`` block of markdown ``text``, parsed;
    the first that is wrong raises its ``EinattnError``."""
    return _accepted(read_each(text, source))


def read_each(text: str, source: str = "<text>") -> list[Block | Refused]:
    """Every derivation block of markdown ``text``, parsed, or refused with its error."""
    found: list[Block | Refused] = []
    for kind, opened, lines in fenced(text, source):
        if kind in KINDS:
            try:
                found.append(_block(kind, opened, lines, source))
            except EinattnError as error:
                found.append(Refused(source, kind, opened, error))
    return found


def _accepted(found: list[Block | Refused]) -> list[Block]:
    for block in found:
        if isinstance(block, Refused):
            raise block.error
    return found  # type: ignore[return-value]  # no Refused left


def fenced(text: str, source: str = "<text>") -> list[tuple[str, int, list[Line]]]:
    """Each fenced block of ``text``: (its info string's first word, the line of its
    opening fence, its lines). A block inside another (longer) fence is not one."""
    found, fence, kind, opened, body = [], "", "", 0, []
    for number, raw in enumerate(text.splitlines(), 1):
        m = _FENCE.match(raw)
        if not fence and m:
            fence, kind, opened, body = m.group(1), m.group(2), number, []
        elif fence and m and not m.group(2) and m.group(1)[0] == fence[0] \
                and len(m.group(1)) >= len(fence) and raw.strip() == m.group(1):
            found.append((kind, opened, body))
            fence = ""
        elif fence:
            body.append(Line(number, raw.strip()))
    if fence and kind in KINDS:
        raise EinattnError(f"{source}:{opened}: the {kind} block opened here is not closed")
    return found


def _block(kind: str, opened: int, lines: list[Line], source: str) -> Block:
    comment = "%" if kind == "derivation-latex" else "#"
    lines = [line for line in lines if line.text and not line.text.startswith(comment)]
    given, names = None, {}
    if lines and lines[0].text.startswith("sizes:"):
        given, names = _sizes_line(lines[0], source, kind)
        lines = lines[1:]
    if kind == "derivation-latex":
        lines = [line for line in lines if not _LATEX_SKIP.match(line.text)]
    if len(lines) < 2:
        raise EinattnError(f"{source}:{opened}: a {kind} block holds an equation "
                           f"'Out[...] = rhs' and at least one more right-hand side on a "
                           f"line that starts with '='; this one has "
                           f"{'no equation' if not lines else 'nothing to compare'}")
    first = Step(lines[0], _equation(kind, lines[0], source, names))
    lhs = lines[0].text.split("=", 1)[0].replace("&", "")
    steps = tuple(_step(kind, lhs, line, first, source, names) for line in lines[1:])
    sizes, inferred = _sizes(first, steps, given, source)
    return Block(source, kind, first, steps, sizes, given is not None, inferred)


def _step(kind: str, lhs: str, line: Line, first: Step, source: str,
          names: dict[str, str]) -> Step:
    if not line.text.lstrip("&").lstrip().startswith("="):
        raise EinattnError(f"{source}:{line.number}: expected another right-hand side of "
                           f"{first.equation.output}, a line that starts with '=', but found "
                           f"{line.text!r} (one chain per block: start a new block for "
                           f"another equation)")
    text = f"{lhs.rstrip()} {line.text}"
    return Step(line, _equation(kind, Line(line.number, text), source, names))


def _equation(kind: str, line: Line, source: str, names: dict[str, str]) -> Equation:
    """The equation of one line, text or LaTeX; its errors name the file and line."""
    try:
        if kind == "derivation":
            return Equation(line.text)
        from_latex = getattr(Equation, "from_latex", None)
        if from_latex is None:
            raise EinattnError("a derivation-latex block needs Equation.from_latex, which "
                               "this version of einattn does not have")
        return from_latex(_LATEX_NOISE.sub("", line.text), names)
    except EinattnError as error:
        raise EinattnError(f"{source}:{line.number}: {error}") from None


def _sizes_line(line: Line, source: str, kind: str) -> tuple[dict[str, int], dict[str, str]]:
    """``sizes: τ=5 a=4``: each index's size; in LaTeX, ``\\tau'=5`` is ``τʹ=5`` and
    ``d_k=a`` says that ``\\sqrt{d_k}`` is the square root of the size of ``a``."""
    sizes, names = {}, {}
    for item in line.text.removeprefix("sizes:").replace(",", " ").split():
        index, _, size = (_index_name(part) for part in item.partition("="))
        if kind == "derivation-latex" and size.isidentifier():
            names[index] = size
        elif index and size.isdigit() and int(size) > 0:
            sizes[index] = int(size)
        else:
            tie = " or, in LaTeX, a size name tied to an index (d_k=a)" \
                if kind == "derivation-latex" else ""
            raise EinattnError(f"{source}:{line.number}: sizes: {item!r} is not index=size "
                               f"with a positive integer size (sizes: τ=5 a=4){tie}")
    return sizes, names


def _index_name(text: str) -> str:
    """An index as the sizes line writes it, as an equation names it: ``\\tau'`` is ``τʹ``."""
    base = text.rstrip("'ʹ")
    return _LETTER.get(base, base) + "ʹ" * (len(text) - len(base))


# -- sizes ----------------------------------------------------------------------------------

def _sizes(first: Step, steps: tuple[Step, ...], given: dict[str, int] | None,
           source: str) -> tuple[dict[str, int], tuple[str, ...]]:
    """The size of every index of the block, and those of later lines read from the first
    line's shapes: the ``sizes:`` line must name every index of the first line, and every
    other that no tensor of the first line fixes; without it, 2, 3, 4, ... in order of
    first appearance."""
    indices = list(dict.fromkeys(i for s in (first, *steps) for i in s.equation.indices))
    firsts = [i for i in indices if i in first.equation.indices]
    if given is None:
        sizes = {index: k for k, index in enumerate(firsts, 2)}
    else:
        for index in (i for i in firsts if i not in given):
            raise _no_size(source, first.line.number, index, given)
        sizes = {index: size for index, size in given.items() if index in indices}
    inferred = _from_shapes(first, steps, sizes)
    sizes |= inferred
    for k, index in enumerate([i for i in indices if i not in sizes], len(sizes) + 2):
        if given is not None:
            line = next(s for s in steps if index in s.equation.indices).line.number
            raise _no_size(source, line, index, given, ", and no tensor of the first line "
                                                       "fixes it")
        sizes[index] = k
    _within_limit((first, *steps), sizes, source)
    _same_shapes(first, (), sizes, source, given is None)
    return sizes, tuple(inferred)


def _no_size(source: str, line: int, index: str, given: dict[str, int],
             why: str = "") -> EinattnError:
    return EinattnError(f"{source}:{line}: the sizes: line gives no size for index {index!r} "
                        f"(it gives {', '.join(given) or 'none'}){why}")


def _from_shapes(first: Step, steps: tuple[Step, ...], sizes: dict[str, int]) -> dict[str, int]:
    """The size of each index of a later line that ``sizes`` lacks, where a tensor of the
    first line fixes it: in ``Q[τ b]`` after ``Q[τ a]``, ``b`` is the size of ``a``."""
    shapes = {t.name: [sizes[i] for i in t.indices] for t in first.equation.terms}
    found: dict[str, int] = {}
    for step in steps:
        for term in step.equation.terms:
            shape = shapes.get(term.name)
            if shape is not None and len(shape) == len(term.indices):
                for index, n in zip(term.indices, shape, strict=True):
                    if index not in sizes:
                        found.setdefault(index, n)
    return found


def _within_limit(steps: tuple[Step, ...], sizes: dict[str, int], source: str) -> None:
    for step in steps:
        equation = step.equation
        for term in (equation.lhs, *equation.terms):
            elements = math.prod(sizes[i] for i in term.indices)
            if elements > MAX_ELEMENTS:
                raise EinattnError(f"{source}:{step.line.number}: {term.text()} would have "
                                   f"{elements:,} elements, over the limit of "
                                   f"{MAX_ELEMENTS:,}: choose smaller sizes")


def _same_shapes(first: Step, others: tuple[Step, ...], sizes: dict[str, int], source: str,
                 default: bool) -> str:
    """Why a tensor of ``others`` does not have the shape it has in ``first`` (with its
    groups opened), or ""; an error if ``first`` alone disagrees with itself."""
    shapes: dict[str, tuple[str, tuple[int, ...]]] = {}
    for step in (first, *others):
        for term in step.equation.terms:
            shape = tuple(sizes[i] for i in term.indices)
            seen, earlier = shapes.setdefault(term.name, (term.text(), shape))
            if earlier == shape:
                continue
            why = f"{term.text()} is {shape} but {seen} is {earlier}"
            if step is not first:
                return why
            hint = (" (the default sizes are all distinct: give a sizes: line)"
                    if default else "")
            raise EinattnError(f"{source}:{step.line.number}: {why}{hint}")
    return ""


# -- checking -------------------------------------------------------------------------------

def check_block(block: Block, *, exact_only: bool = False, seed: int = 0) -> list[Checked]:
    """Each step of ``block`` against its first equation, in the strongest mode it allows
    (the finite field, else float64); with ``exact_only``, a step only float64 can check
    (``tanh``, ``log`` outside ``exp``) is skipped."""
    return [_check_step(block, step, exact_only, seed) for step in block.steps]


def _check_step(block: Block, step: Step, exact_only: bool, seed: int) -> Checked:
    lhs, rhs = block.first.equation, step.equation
    new = _not_in_first(block.first.equation, rhs)
    if new:
        return Checked(block, step, "—", reason=new)
    shapes = _same_shapes(block.first, (step,), block.sizes, block.source, False)
    if shapes:
        return Checked(block, step, "—", reason=shapes)
    try:
        report = check_equivalent(lhs, rhs, block.sizes, exact=True, seed=seed,
                                  inputs=_opened_inputs(lhs, rhs))
    except SidesDiffer as mismatch:  # the sides have different shapes
        return Checked(block, step, "—", reason=str(mismatch))
    if exact_only and report.mode == "float":
        return Checked(block, step, "float", reason=f"skipped: {report.note}")
    return Checked(block, step, report.mode, report)


def _not_in_first(first: Equation, rhs: Equation) -> str:
    """Why ``rhs`` cannot be checked against ``first``: a tensor (or scalar) that ``first``
    does not have, which would be drawn on its own; or ""."""
    names = {t.name for t in first.terms} | set(getattr(first, "scalars", ()))
    for term in rhs.terms:
        if term.name not in names:
            return (f"{term.text()} does not appear in the first line ({first.text}): it "
                    f"would be drawn on its own, so the line cannot equal the first; write "
                    f"it with the first line's tensors, or start a block for it")
    extra = [c for c in getattr(rhs, "scalars", ()) if c not in names]
    return (f"the scalar {extra[0]} does not appear in the first line ({first.text}): it "
            f"would be drawn on its own, so the line cannot equal the first") if extra else ""


def _opened_inputs(*equations: Equation) -> dict[str, str]:
    """Each tensor that a side writes with a group, as its first occurrence with the groups
    opened: drawn so, ``W[(μ B a) i]`` and ``W[μ B a i]`` read the same numbers."""
    first: dict[str, tuple[str, ...]] = {}
    grouped = set()
    for equation in equations:
        for term in equation.terms:
            first.setdefault(term.name, term.indices)
            if term.grouped:
                grouped.add(term.name)
    return {name: " ".join(first[name]) for name in grouped}


def check_file(path: str | Path, *, exact_only: bool = False) -> list[Checked]:
    """Every step of every derivation block of the markdown file at ``path``."""
    return [c for block in read_file(path) for c in check_block(block, exact_only=exact_only)]
