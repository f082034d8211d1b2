"""``einattn verify``: every step of :mod:`einattn.derivation` checked by
:func:`einattn.verify.check_equivalent`, each in the mode that proved it (``field``: exactly,
in a finite field; ``exact``: with integers; ``float``: in float64), and the order
opt_einsum contracts the scores in; ``einattn verify FILE.md``: the derivation blocks of a
markdown file (:mod:`einattn.derivation_files`), a verdict per line; ``einattn verify
--derive``: the gradients of equations (1)–(5) (:mod:`einattn.cli.derive`)."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from .. import derivation, derivation_files, verify
from ..errors import SidesDiffer
from ..notation import Equation, Explanation
from .derive import derive_output
from .options import (
    VERIFY_TENSORS,
    Command,
    UsageError,
    checked_sizes,
    derive_option,
    exact_option,
    file_argument,
    size_options,
)
from .output import VERDICTS, Output, Paint, letters_text, one_line, sizes_text, table
from .trace import letter_mapping, renamed


@dataclass(frozen=True)
class StepResult:
    """One derivation step checked (or skipped: ``equal`` is None)."""

    name: str
    mode: str
    max_deviation: float | None = None
    tolerance: float | None = None
    equal: bool | None = None
    false_acceptance: float | None = None
    where: str = ""

    @property
    def verdict(self) -> str:
        return "SKIP" if self.equal is None else "PASS" if self.equal else "FAIL"

    def as_json(self) -> dict:
        return {"name": self.name, "mode": self.mode,
                "max_deviation": _finite(self.max_deviation), "tolerance": self.tolerance,
                "equal": self.equal, "false_acceptance": self.false_acceptance,
                "where": self.where, "verdict": self.verdict}


def _finite(x: float | None) -> float | None:
    """JSON has no inf or NaN: a deviation that is not finite becomes null."""
    return x if x is None or math.isfinite(x) else None


def check_step(step: derivation.Step, *, exact_only: bool = False) -> StepResult:
    """Check ``step`` in its registered mode; with ``exact_only``, skip a float-only step."""
    mode = "exact" if step.exact else "float"
    if exact_only and not step.exact:
        return StepResult(step.name, "float", where="skipped: float64 only")
    try:
        r = verify.check_equivalent(step.lhs, step.rhs, step.sizes, exact=step.exact,
                                    inputs=step.inputs, draws=step.draws, masks=step.masks)
    except SidesDiffer as mismatch:  # the two sides have different shapes
        return StepResult(step.name, mode, math.inf, 0.0, False, where=str(mismatch))
    return StepResult(step.name, r.mode, r.max_deviation, r.tolerance, r.equal,
                      r.false_acceptance, r.where)


def _number(x: float | None) -> str:
    if x is None:
        return "—"
    return "0" if x == 0 else f"{x:.1e}"


def _deviation(r: StepResult) -> str:
    """A float's largest deviation; in the field, how many entries differ (0 or ``n ≠``)."""
    if r.mode == "field" and r.max_deviation:
        return f"{r.max_deviation:.0f} ≠"
    return _number(r.max_deviation)


def step_lines(results: list[StepResult], paint: Paint) -> list[str]:
    rows = [[r.verdict, r.mode, _deviation(r), _number(r.tolerance),
             "—" if r.false_acceptance is None else f"≤ {r.false_acceptance:.1e}", r.name]
            for r in results]
    header = ["verdict", "mode", "max |lhs − rhs|", "tolerance", "false acceptance", "step"]
    count = {v: sum(r.verdict == v for r in results) for v in VERDICTS}
    summary = f"{len(results)} steps: " + ", ".join(
        paint(f"{k} {verdict}", verdict) for verdict, k in count.items() if k)
    return [*table(header, rows, paint, right=(2, 3)), summary]


_MODES = ("each step in the strongest mode it allows: field (exact, in a finite field), "
          "exact (integers), float (float64)")


# -- the contraction order ------------------------------------------------------------------

@dataclass(frozen=True)
class Contraction:
    """The order opt_einsum picks for a contraction of three or more operands: its plan
    (the einsum, path, FLOPs and largest intermediate), each pairwise step in index names."""

    step: str
    plan: Explanation
    letters: dict[str, str]  # the einsum's letters that differ from their index
    order: list[tuple[str, str]]  # (the pairwise step in index names, its einsum)

    @property
    def naive_flops(self) -> int:
        return int(self.plan.info.naive_cost)

    def as_json(self) -> dict:
        p = self.plan
        return {"step": self.step, "equation": p.equation, "einsum": p.einsum,
                "letters": self.letters, "path": [list(k) for k in p.path],
                "order": [{"contraction": c, "einsum": e} for c, e in self.order],
                "flops": p.flops, "naive_flops": self.naive_flops,
                "largest_intermediate": p.largest_intermediate}


def contraction(step_name: str, equation: Equation, sizes: dict[str, int]) -> Contraction:
    """``equation.explain(...)`` at ``sizes``, each pairwise step spelled in index names
    (intermediates T1, T2, ...)."""
    plan = equation.explain(**{t.name: tuple(sizes[i] for i in t.indices)
                               for t in equation.terms})
    mapping = letter_mapping(equation, plan.einsum)
    index_of = {letter: index for index, letter in mapping.items()}
    operands = [t.name for t in equation.terms]
    steps = plan.info.contraction_list
    order = []
    for k, (positions, _, einsum, *_) in enumerate(steps, 1):
        inputs, out = einsum.split("->")
        names = [operands.pop(p) for p in positions]  # the order the einsum lists them in
        result = equation.output if k == len(steps) else f"T{k}"
        operands.append(result)
        terms = [f"{name}[{' '.join(index_of[c] for c in ix)}]"
                 for name, ix in zip([result, *names], [out, *inputs.split(",")], strict=True)]
        order.append((f"{terms[0]} = {' '.join(terms[1:])}", einsum))
    return Contraction(step_name, plan, renamed(mapping), order)


def contractions(steps: list[derivation.Step]) -> list[Contraction]:
    """Every side of a step that is an equation of three or more operands."""
    found = []
    for step in steps:
        for side in (step.lhs, step.rhs):
            equation = Equation(side) if isinstance(side, str) else side
            if isinstance(equation, Equation) and equation.is_contraction \
                    and len(equation.terms) > 2:
                found.append(contraction(step.name, equation, step.sizes))
    return found


def contraction_lines(c: Contraction, paint: Paint) -> list[str]:
    p = c.plan
    rows = [[str(k), text, einsum] for k, (text, einsum) in enumerate(c.order, 1)]
    return [f"contraction order of '{c.step}':",
            f"  {p.equation}",
            f"  einsum {p.einsum}   ({letters_text(c.letters)}), opt_einsum path {p.path}",
            *("  " + line for line in table(["#", "pairwise contraction", "einsum"], rows, paint)),
            f"  {p.flops:,} FLOPs in this order, {c.naive_flops:,} naive "
            f"({c.naive_flops / p.flops:.0f}× fewer); largest intermediate "
            f"{p.largest_intermediate:,} elements"]


# -- the registered steps ------------------------------------------------------------------

def verify_output(sizes: dict[str, int], *, exact_only: bool, paint: Paint) -> Output:
    steps = derivation.steps(sizes)
    results = [check_step(step, exact_only=exact_only) for step in steps]
    orders = contractions(steps)
    failed = any(r.verdict == "FAIL" for r in results)
    mode = ("exact modes only (float-only steps skipped)" if exact_only else _MODES)
    head = f"derivation steps at {sizes_text(sizes)}: {mode}"
    lines = [head, "", *step_lines(results, paint)]
    for c in orders:
        lines += ["", *contraction_lines(c, paint)]
    document = {"sizes": sizes, "exact_only": exact_only,
                "steps": [r.as_json() for r in results],
                "contractions": [c.as_json() for c in orders], "passed": not failed}
    return Output(document, lines, 1 if failed else 0)


# -- a derivation file ----------------------------------------------------------------------

def file_result(c: derivation_files.Checked) -> StepResult:
    """A checked line of a derivation file as a row of the table: named by its text."""
    r = c.report
    if r is None:
        return StepResult(c.step.line.text, c.mode, equal=c.equal, where=c.reason)
    return StepResult(c.step.line.text, r.mode, r.max_deviation, r.tolerance, r.equal,
                      r.false_acceptance, r.where)


def _block_head(block: derivation_files.Block) -> list[str]:
    """The block's first line as written, its sizes (those read from the first line's
    shapes after a ';') and, for LaTeX, the equation read."""
    given = [f"{k}={v}" for k, v in block.sizes.items() if k not in block.inferred]
    which = "sizes" if block.sizes_given else "default sizes, all distinct:"
    read = [f"{k}={block.sizes[k]}" for k in block.inferred]
    shapes = f"; from the first line's shapes: {' '.join(read)}" if read else ""
    first = block.first
    head = [f"{block.source}:{first.line.number}  {first.line.text}   "
            f"({which} {' '.join(given)}{shapes})"]
    if block.kind == "derivation-latex":
        head.append(f"  read as {first.equation}")
    return head


Found = derivation_files.Block | derivation_files.Refused


def file_lines(blocks: list[Found], results: list[list[StepResult]], paint: Paint) -> list[str]:
    """One table: each block's first line, then a row per ``=`` line (a block refused: its
    error, in its place); then each failure quoted with its line and where it differs; then
    the count."""
    checked = [(block, rs) for block, rs in zip(blocks, results, strict=True)
               if isinstance(block, derivation_files.Block)]
    rows = [[r.verdict, r.mode, _deviation(r), _number(r.tolerance),
             "—" if r.false_acceptance is None else f"≤ {r.false_acceptance:.1e}",
             str(c.line.number), c.line.text]
            for block, rs in checked for c, r in zip(block.steps, rs, strict=True)]
    header = ["verdict", "mode", "max |lhs − rhs|", "tolerance", "false acceptance", "line",
              "step"]
    shown = table(header, rows, paint, right=(2, 3, 5))
    lines, k = [shown[0]], 1
    for block in blocks:
        if isinstance(block, derivation_files.Refused):
            lines.append(f"{paint('ERROR', 'FAIL')} {one_line(block.error)}")
            continue
        lines += [*_block_head(block), *shown[k:k + len(block.steps)]]
        k += len(block.steps)
    flat = [(block, c, r) for block, rs in checked for c, r in zip(block.steps, rs, strict=True)]
    for block, c, r in flat:
        if r.verdict == "FAIL":
            lines.append(f"{paint('FAIL', 'FAIL')} {block.source}:{c.line.number}: "
                         f"{c.line.text}  — {_differs(r)}")
    return [*lines, _count([r for *_, r in flat], len(blocks) - len(checked), paint)]


def _count(results: list[StepResult], refused: int, paint: Paint) -> str:
    """``3 steps: 2 PASS, 1 FAIL``, and how many blocks were refused, if any."""
    count = {v: sum(r.verdict == v for r in results) for v in VERDICTS}
    parts = ", ".join(paint(f"{k} {verdict}", verdict) for verdict, k in count.items() if k)
    text = f"{len(results)} step{'s' * (len(results) != 1)}" + (f": {parts}" if parts else "")
    if refused:
        text += f"; {paint(f'{refused} block' + 's' * (refused != 1), 'FAIL')} not checked"
    return text


def _differs(r: StepResult) -> str:
    if r.max_deviation is None:
        return r.where
    if r.mode == "field":
        return f"{r.max_deviation:.0f} entries differ in the finite field, the first at {r.where}"
    return f"max |lhs − rhs| = {r.max_deviation:.3e} at {r.where}"


def file_output(path: str, *, exact_only: bool, paint: Paint) -> Output:
    """``einattn verify FILE.md``: every block checked, a block that is wrong in itself
    reported in its place; exit with the worst status: 2 if a block is wrong (each error
    also on stderr), 1 if a line fails. A file that cannot be read is an error (exit 2)."""
    try:
        blocks = derivation_files.read_file_each(path)
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"cannot read {path}: {getattr(error, 'strerror', None) or error}"
                         ) from None
    results = [[file_result(c) for c in derivation_files.check_block(b, exact_only=exact_only)]
               if isinstance(b, derivation_files.Block) else [] for b in blocks]
    errors = tuple(one_line(b.error) for b in blocks if isinstance(b, derivation_files.Refused))
    failed = any(r.verdict == "FAIL" for rs in results for r in rs)
    mode = ("the finite field only (float-only lines skipped)" if exact_only else
            "each exactly in a finite field where it can be, else in float64")
    head = (f"{path}: {len(blocks)} derivation block{'s' * (len(blocks) != 1)}, each '=' "
            f"line against its block's first right-hand side; {mode}")
    document = {"file": str(path), "exact_only": exact_only,
                "blocks": [_block_json(b, rs) for b, rs in zip(blocks, results, strict=True)],
                "passed": not failed and not errors}
    return Output(document, [head, "", *file_lines(blocks, results, paint)],
                  2 if errors else 1 if failed else 0, errors)


def _block_json(block: Found, results: list[StepResult]) -> dict:
    """A block for ``--json``: its first line as written and as read, its sizes (and those
    read from the first line's shapes), its steps (each named by its line as written); a
    refused block: the line of its opening fence, and its error (which names its line)."""
    if isinstance(block, derivation_files.Refused):
        return {"opened": block.opened, "kind": block.kind, "error": one_line(block.error),
                "steps": []}
    return {"line": block.first.line.number, "kind": block.kind,
            "equation": block.first.line.text, "read_as": block.first.equation.text,
            "sizes": block.sizes, "sizes_given": block.sizes_given,
            "sizes_from_shapes": list(block.inferred),
            "steps": [{"line": step.line.number, "read_as": step.equation.text, **r.as_json()}
                      for step, r in zip(block.steps, results, strict=True)]}


# -- the subcommand -------------------------------------------------------------------------

def verify_command(args: argparse.Namespace, paint: Paint) -> Output:
    if args.file is not None:
        if args.derive:
            raise UsageError("--derive derives the gradients of equations (1)-(5); it takes "
                             "no FILE.md")
        return file_output(args.file, exact_only=args.exact, paint=paint)
    sizes = checked_sizes(args, "verify", VERIFY_TENSORS)
    if args.derive:
        return derive_output(sizes, paint=paint)
    return verify_output(sizes, exact_only=args.exact, paint=paint)


COMMAND = Command(verify_command, "check every derivation step (exit 1 if one fails) and "
                  "show the scores' contraction order; with FILE.md, check the derivation "
                  "blocks of that file instead; with --derive, derive the gradients of "
                  "equations (1)-(5)", (size_options, exact_option, derive_option, file_argument))
