"""The command line: ``einattn`` and ``python -m einattn``.

    einattn [sizes]          the main job: ``einattn trace --causal``, then ``einattn verify``
    einattn trace [sizes]    each stage's equation, einsum, shapes, FLOPs, largest intermediate
    einattn verify [sizes]   every derivation step checked, and the scores' contraction order
    einattn latex            equations (1)–(5), (5a), (1g), (2g), (4g) as LaTeX
    einattn bench            the benchmark: timings, compile, peak memory, targets

Every subcommand takes ``--json``. Sizes whose largest tensor would need more than
:data:`MEMORY_LIMIT` bytes are refused before anything is allocated. A subcommand is one
function registered with :func:`command`; it returns an :class:`Output` (a JSON document,
the lines people read, an exit status), and :func:`main` parses, dispatches and prints.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn

import torch

from . import derivation, functional, verify
from .errors import EinattnError
from .notation import Equation, Explanation

SEED = 0
# The equations of einattn.functional by constant, with their numbers in docs/derivation.md.
# (5a) is (5) before the sum over μ: in the LaTeX, not in the trace.
EQUATIONS = {"PROJECT": "1", "SCORES": "2", "SOFTMAX": "3", "VALUES": "4", "HEADS": "5",
             "HEAD_TERMS": "5a", "PROJECT_GQA": "1g", "SCORES_GQA": "2g", "VALUES_GQA": "4g"}
SOFTMAX_LATEX = (r"A_{n \mu \tau \sigma} = \operatorname{softmax}_{\sigma}"
                 r"\left(S_{n \mu \tau \sigma} + M_{n \mu \tau \sigma}\right)")


class UsageError(Exception):
    """Bad command-line arguments: printed as one line, exit status 2."""


# -- output ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Output:
    """What a subcommand produced: a JSON document, the lines people read, an exit status."""

    document: dict
    lines: list[str]
    status: int = 0

    def __add__(self, other: Output) -> Output:
        return Output({**self.document, **other.document}, [*self.lines, "", *other.lines],
                      max(self.status, other.status))


_STYLES = {"bold": "1", "PASS": "32", "FAIL": "31", "SKIP": "33"}  # ANSI SGR codes
_VERDICTS = ("PASS", "FAIL", "SKIP")


@dataclass(frozen=True)
class Paint:
    """ANSI colour, or nothing: on only when stdout is a terminal and NO_COLOR is unset."""

    on: bool

    @classmethod
    def for_stdout(cls) -> Paint:
        return cls(sys.stdout.isatty() and not os.environ.get("NO_COLOR"))

    def __call__(self, text: str, style: str) -> str:
        return f"\033[{_STYLES[style]}m{text}\033[0m" if self.on else text

    def verdict(self, cell: str) -> str:
        """A cell reading PASS, FAIL or SKIP in its colour; any other cell as it is."""
        word = cell.strip()
        return cell.replace(word, self(word, word)) if word in _VERDICTS else cell


def table(header: Sequence[str], rows: Sequence[Sequence[str]], paint: Paint,
          right: Sequence[int] = ()) -> list[str]:
    """Columns padded to their widest cell, two spaces apart; ``right`` columns right-aligned."""
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        padded = [cell.rjust(w) if k in right else cell.ljust(w)
                  for k, (cell, w) in enumerate(zip(cells, widths, strict=True))]
        padded[-1] = padded[-1].rstrip()  # no trailing blanks, painted or not
        return "  ".join(paint.verdict(cell) for cell in padded).rstrip()

    return [paint(line(header), "bold"), *(line(row) for row in rows)]


def _sizes_text(sizes: dict[str, int]) -> str:
    """The sizes the options set (j is i's twin, B is always 3)."""
    return " ".join(f"{index}={sizes[index]}" for index in ("n", "τ", "σ", "i", "μ", "a"))


def _shapes_text(shapes: dict[str, tuple[int, ...]]) -> str:
    """``Q, K (2, 4, 5, 4)  V (2, 4, 7, 4)``: neighbours of equal shape share it."""
    groups: list[tuple[list[str], tuple[int, ...]]] = []
    for name, shape in shapes.items():
        if groups and groups[-1][1] == shape:
            groups[-1][0].append(name)
        else:
            groups.append(([name], shape))
    return "  ".join(f"{', '.join(names)} {shape}" for names, shape in groups)


def _letters_text(letters: dict[str, str]) -> str:
    return " ".join(f"{index}={letter}" for index, letter in letters.items())


def _number(x: float | None) -> str:
    if x is None:
        return "—"
    return "0" if x == 0 else f"{x:.1e}"


def _finite(x: float | None) -> float | None:
    """JSON has no inf or NaN: a deviation that is not finite becomes null."""
    return x if x is None or math.isfinite(x) else None


# -- what a run would hold ------------------------------------------------------------------

MEMORY_LIMIT = 2**30  # bytes: the largest tensor trace, verify and bench may allocate
# The largest tensors of one attention layer, by their indices: the input (as large as Q, Z
# and Y), the fused weight, the projections Q, K, V of the keys' side (σ = τ without a
# context; with one, K and V from C and only Q from X), the scores. W and P with B = 3 bound
# the grouped (g C a), C = r + 2 ≤ 3r; C, K, V, W_O and the rest are no larger.
TRACE_TENSORS = ("X[n τ i]", "W[(μ B a) i]", "P[n σ μ B a]", "S[n μ τ σ]")
VERIFY_TENSORS = TRACE_TENSORS + derivation.TENSORS


def largest_tensor(sizes: dict[str, int], tensors: Sequence[str]) -> tuple[str, int]:
    """The largest of ``tensors`` (written ``"S[n μ τ σ]"``) at ``sizes``, and its number of
    elements."""
    def elements(tensor: str) -> int:
        indices = tensor[tensor.index("[") + 1:-1].replace("(", " ").replace(")", " ")
        return math.prod(sizes[index] for index in indices.split())

    largest = max(tensors, key=elements)
    return largest, elements(largest)


def _gib(n_bytes: int) -> str:
    """Bytes in GiB to one decimal, in integers: no float overflows, however large."""
    tenths = (10 * n_bytes + 2**29) >> 30
    return f"{tenths // 10:,}.{tenths % 10} GiB"


def check_memory(who: str, sizes: dict[str, int], tensors: Sequence[str],
                 dtype: torch.dtype) -> None:
    """Refuse, before anything is allocated, sizes whose largest tensor would need more than
    :data:`MEMORY_LIMIT` bytes."""
    tensor, elements = largest_tensor(sizes, tensors)
    need = elements * dtype.itemsize
    if need > MEMORY_LIMIT:
        raise UsageError(f"{who} would hold {tensor} of {elements:,} "
                         f"{str(dtype).removeprefix('torch.')} elements ({_gib(need)}), over "
                         f"the limit of {_gib(MEMORY_LIMIT)} for one tensor: choose smaller sizes")


# -- trace: the stages, run on seeded float64 input ------------------------------------------

def letter_mapping(equation: Equation, einsum: str) -> dict[str, str]:
    """Index -> the ``torch.einsum`` letter it runs as, read off the einsum term by term."""
    inputs, output = einsum.split("->")
    mapping: dict[str, str] = {}
    for term, letters in zip((equation.lhs, *equation.terms), (output, *inputs.split(",")),
                             strict=True):
        mapping.update(zip(term.indices, letters, strict=True))
    return mapping


def _renamed(mapping: dict[str, str]) -> dict[str, str]:
    """The letters that differ from their index (Greek, mostly): the mapping to show."""
    return {index: letter for index, letter in mapping.items() if index != letter}


@dataclass(frozen=True)
class Stage:
    """One stage as traced: its equation, the shapes it read and wrote, and how it ran."""

    number: str
    name: str
    equation: Equation | str  # a str where the stage is no contraction (the softmax)
    inputs: dict[str, tuple[int, ...]]
    outputs: dict[str, tuple[int, ...]]
    plans: tuple[Explanation, ...] = ()  # one per contraction the stage runs

    @property
    def einsum(self) -> str | None:
        return self.plans[0].einsum if self.plans else None

    @property
    def letters(self) -> dict[str, str]:
        return _renamed(letter_mapping(self.equation, self.einsum)) if self.plans else {}

    @property
    def flops(self) -> int | None:
        return sum(p.flops for p in self.plans) if self.plans else None

    @property
    def largest_intermediate(self) -> int | None:
        return max(p.largest_intermediate for p in self.plans) if self.plans else None

    @property
    def label(self) -> str:
        return f"({self.number}) {self.name}"

    def as_json(self) -> dict:
        return {"number": self.number, "name": self.name, "equation": str(self.equation),
                "einsum": self.einsum, "letters": self.letters,
                "inputs": {k: list(v) for k, v in self.inputs.items()},
                "outputs": {k: list(v) for k, v in self.outputs.items()},
                "flops": self.flops, "largest_intermediate": self.largest_intermediate}


def _shapes(**tensors: torch.Tensor | None) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in tensors.items() if t is not None}


def trace(sizes: dict[str, int], *, cross: bool, causal: bool, seed: int = SEED) -> list[Stage]:
    """Run equations (1)–(5) of :mod:`einattn.functional` one at a time on seeded float64
    input, and explain each contraction at the shapes it ran on; with ``sizes["g"]`` below
    the head count, grouped-query attention's (1g), (2g) and (4g)."""
    n, L_q, L_k, d_model, n_heads, d_head = (sizes[k] for k in ("n", "τ", "σ", "i", "μ", "a"))
    groups = sizes.get("g", n_heads)
    r = n_heads // groups
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64) / math.sqrt(
            shape[-1])

    X = draw(n, L_q, d_model)
    C = draw(n, L_k, d_model) if cross else None  # the context C[n σ i]
    W, W_O = draw(groups * (r + 2) * d_head, d_model), draw(n_heads, d_head, d_model)
    Q, K, V = functional.project_qkv(X, W, n_heads=n_heads, n_kv_heads=groups, context=C)
    M = functional.attention_mask(n=n, n_heads=n_heads, L_q=L_q, L_k=L_k, dtype=X.dtype,
                                  device=X.device, causal=causal)
    S = functional.attention_scores(Q, K)
    A = functional.masked_softmax(S, M)
    Z = functional.weighted_values(A, V)
    Y = functional.combine_heads(Z, W_O)
    # Self-attention projects Q, K and V (B = 3, or C = r + 2 slots per group) from X;
    # cross-attention Q (r slots) from X and K, V (2) from C: the same equation, run twice.
    projected = [(X, r + 2)] if C is None else [(X, r), (C, 2)]
    runs = [{"X": tuple(x.shape), "W": (groups, B, d_head, d_model)} for x, B in projected]
    gqa = "_GQA" if r > 1 else ""
    return [
        _stage("PROJECT" + gqa, _shapes(X=X, C=C, W=W), _shapes(Q=Q, K=K, V=V), runs),
        _stage("SCORES" + gqa, _shapes(Q=Q, K=K), _shapes(S=S)),
        _stage("SOFTMAX", _shapes(S=S, M=M), _shapes(A=A)),
        _stage("VALUES" + gqa, _shapes(A=A, V=V), _shapes(Z=Z)),
        _stage("HEADS", _shapes(Z=Z, W_O=W_O), _shapes(Y=Y)),
    ]


def _stage(name: str, inputs: dict[str, tuple[int, ...]], outputs: dict[str, tuple[int, ...]],
           runs: list[dict] | None = None) -> Stage:
    """``runs``: the operand shapes of each contraction the stage runs (default: one, on
    ``inputs``); the softmax runs none."""
    equation = getattr(functional, name)
    if not isinstance(equation, Equation):  # the softmax: no contraction to explain
        runs = []
    elif runs is None:
        runs = [inputs]
    plans = tuple(equation.explain(**shapes) for shapes in runs)
    return Stage(EQUATIONS[name], name, equation, inputs, outputs, plans)


def stage_lines(stages: list[Stage], paint: Paint) -> list[str]:
    equations = table(["stage", "equation", "einsum", "letters"],
                      [[s.label, str(s.equation), s.einsum or "— (not a contraction)",
                        _letters_text(s.letters)] for s in stages], paint)
    costs = table(["stage", "in", "out", "FLOPs", "largest intermediate (elements)"],
                  [[s.label, _shapes_text(s.inputs), _shapes_text(s.outputs),
                    _count(s.flops), _count(s.largest_intermediate)] for s in stages],
                  paint, right=(3, 4))
    return [*equations, "", *costs]


def _count(x: int | None) -> str:
    return "—" if x is None else f"{x:,}"


def trace_output(sizes: dict[str, int], *, cross: bool, causal: bool, paint: Paint) -> Output:
    stages = trace(sizes, cross=cross, causal=causal)
    kind = ("cross-attention" if cross else "self-attention") + (", causal" if causal else "")
    head = f"trace: {_sizes_text(sizes)}, {kind}, seeded float64 input (seed {SEED})"
    document = {"sizes": sizes, "causal": causal, "cross_attention": cross, "seed": SEED,
                "stages": [s.as_json() for s in stages]}
    return Output(document, [head, "", *stage_lines(stages, paint)])


# -- verify: the derivation's steps --------------------------------------------------------

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


def check_step(step: derivation.Step, *, exact_only: bool = False) -> StepResult:
    """Check ``step`` in its registered mode; with ``exact_only``, skip a float-only step."""
    mode = "exact" if step.exact else "float"
    if exact_only and not step.exact:
        return StepResult(step.name, mode, where="skipped: not multilinear, float mode only")
    try:
        r = verify.check_equivalent(step.lhs, step.rhs, step.sizes, exact=step.exact,
                                    inputs=step.inputs, draws=step.draws)
    except AssertionError as mismatch:  # the two sides have different shapes
        return StepResult(step.name, mode, math.inf, 0.0, False, where=str(mismatch))
    return StepResult(step.name, r.mode, r.max_deviation, r.tolerance, r.equal,
                      r.false_acceptance, r.where)


def step_lines(results: list[StepResult], paint: Paint) -> list[str]:
    rows = [[r.verdict, r.mode, _number(r.max_deviation), _number(r.tolerance),
             "—" if r.false_acceptance is None else f"≤ {r.false_acceptance:.1e}", r.name]
            for r in results]
    header = ["verdict", "mode", "max |lhs − rhs|", "tolerance", "false acceptance", "step"]
    count = {v: sum(r.verdict == v for r in results) for v in _VERDICTS}
    summary = f"{len(results)} steps: " + ", ".join(
        paint(f"{k} {verdict}", verdict) for verdict, k in count.items() if k)
    return [*table(header, rows, paint, right=(2, 3)), summary]


@dataclass(frozen=True)
class Contraction:
    """The order opt_einsum picks for a contraction of three or more operands."""

    step: str
    equation: str
    einsum: str
    letters: dict[str, str]
    path: list[tuple[int, ...]]
    order: list[tuple[str, str]]  # (the pairwise step in index names, its einsum)
    flops: int
    naive_flops: int
    largest_intermediate: int

    def as_json(self) -> dict:
        return {"step": self.step, "equation": self.equation, "einsum": self.einsum,
                "letters": self.letters, "path": [list(p) for p in self.path],
                "order": [{"contraction": c, "einsum": e} for c, e in self.order],
                "flops": self.flops, "naive_flops": self.naive_flops,
                "largest_intermediate": self.largest_intermediate}


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
    return Contraction(step_name, equation.text, plan.einsum, _renamed(mapping), plan.path,
                       order, plan.flops, int(plan.info.naive_cost), plan.largest_intermediate)


def contractions(steps: list[derivation.Step]) -> list[Contraction]:
    """Every side of a step that is an equation of three or more operands."""
    found = []
    for step in steps:
        for side in (step.lhs, step.rhs):
            equation = Equation(side) if isinstance(side, str) else side
            if isinstance(equation, Equation) and len(equation.terms) > 2:
                found.append(contraction(step.name, equation, step.sizes))
    return found


def contraction_lines(c: Contraction, paint: Paint) -> list[str]:
    rows = [[str(k), text, einsum] for k, (text, einsum) in enumerate(c.order, 1)]
    return [f"contraction order of '{c.step}':",
            f"  {c.equation}",
            f"  einsum {c.einsum}   ({_letters_text(c.letters)}), opt_einsum path {c.path}",
            *("  " + line for line in table(["#", "pairwise contraction", "einsum"], rows, paint)),
            f"  {c.flops:,} FLOPs in this order, {c.naive_flops:,} naive "
            f"({c.naive_flops / c.flops:.0f}× fewer); largest intermediate "
            f"{c.largest_intermediate:,} elements"]


def verify_output(sizes: dict[str, int], *, exact_only: bool, paint: Paint) -> Output:
    steps = derivation.steps(sizes)
    results = [check_step(step, exact_only=exact_only) for step in steps]
    orders = contractions(steps)
    failed = any(r.verdict == "FAIL" for r in results)
    mode = ("exact mode only (integer inputs; float-only steps skipped)" if exact_only else
            "exact steps with integer inputs, the others in float64")
    head = f"derivation steps at {_sizes_text(sizes)}: {mode}"
    lines = [head, "", *step_lines(results, paint)]
    for c in orders:
        lines += ["", *contraction_lines(c, paint)]
    document = {"sizes": sizes, "exact_only": exact_only,
                "steps": [r.as_json() for r in results],
                "contractions": [c.as_json() for c in orders], "passed": not failed}
    return Output(document, lines, 1 if failed else 0)


# -- latex -----------------------------------------------------------------------------------

def latex_equations() -> list[dict]:
    """Equations (1)–(5), (5a) and grouped-query (1g), (2g), (4g): number, name, equation
    string and LaTeX."""
    found = []
    for name, number in EQUATIONS.items():
        equation = getattr(functional, name)
        rendered = equation.latex() if isinstance(equation, Equation) else SOFTMAX_LATEX
        found.append({"number": number, "name": name, "equation": str(equation),
                      "latex": rendered})
    return found


# -- the subcommands -------------------------------------------------------------------------

Options = Callable[[argparse.ArgumentParser], None]


@dataclass(frozen=True)
class Command:
    run: Callable[[argparse.Namespace, Paint], Output]
    help: str
    options: tuple[Options, ...] = ()


COMMANDS: dict[str, Command] = {}


def command(name: str, help: str, *options: Options):
    """Register ``run(args, paint) -> Output`` as the subcommand ``name``, with the option
    groups it takes (``--json`` and ``--help`` come with every subcommand)."""
    def register(run: Callable[[argparse.Namespace, Paint], Output]):
        COMMANDS[name] = Command(run, help, options)
        return run
    return register


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _at_most(maximum: int, what: str) -> Callable[[str], int]:
    """A positive integer no larger than ``maximum``, which is ``what``."""
    def parse(text: str) -> int:
        value = _positive(text)
        if value > maximum:
            raise argparse.ArgumentTypeError(f"{value:,} is over {maximum:,}, {what}")
        return value
    return parse


# The size options' defaults (the derivation's worked example) and the sizes they set. Their
# argparse default is SUPPRESS, so that a size given before the subcommand, or with none
# (the main job), is not overwritten by the subcommand's default; main() fills these in.
SIZE_DEFAULTS = {"batch": 2, "seq": 5, "seq_k": None, "d_model": 16, "heads": 4,
                 "kv_heads": None}


def size_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sizes", "The defaults are the derivation's worked "
                                      "example. Sizes whose largest tensor would need more "
                                      f"than {_gib(MEMORY_LIMIT)} are refused.")

    def add(flag: str, metavar: str, help: str) -> None:
        default = SIZE_DEFAULTS[flag.removeprefix("--").replace("-", "_")]
        group.add_argument(flag, type=_positive, default=argparse.SUPPRESS, metavar=metavar,
                           help=help if default is None else f"{help} (default {default})")

    add("--batch", "N", "index n")
    add("--seq", "L", "index τ, query positions")
    add("--seq-k", "L_K", "index σ, key positions: makes it cross-attention on a context of "
        "this length (default: self-attention, σ = τ)")
    add("--d-model", "D", "index i")
    add("--heads", "H", "index μ; d_head (index a) is d_model / heads")
    add("--kv-heads", "G", "index g, key/value heads: grouped-query attention with heads / G "
        "query heads per group (default: heads)")


def _fill_sizes(args: argparse.Namespace, name: str, takes_sizes: bool) -> None:
    """Put the size defaults into ``args``; refuse sizes given to a subcommand without them
    (``einattn --seq 3 latex``)."""
    given = [f"--{key.replace('_', '-')}" for key in SIZE_DEFAULTS if key in vars(args)]
    if given and not takes_sizes:
        raise UsageError(f"{name} takes no size options ({', '.join(given)}): they belong to "
                         f"trace, verify and einattn with no subcommand")
    for key, default in SIZE_DEFAULTS.items():
        vars(args).setdefault(key, default)


def causal_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--causal", action="store_true",
                        help="mask keys after each query (bottom-right aligned)")


def exact_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--exact", action="store_true",
                        help="only the multilinear steps, in exact (integer) mode; skip the rest")


def sizes_of(args: argparse.Namespace) -> dict[str, int]:
    """The index sizes the size options ask for, checked (but not their memory)."""
    if args.d_model % args.heads:
        raise UsageError(f"--d-model {args.d_model} is not divisible by --heads {args.heads}: "
                         f"each head gets d_head = d_model / heads channels (index a)")
    if args.kv_heads is not None and args.heads % args.kv_heads:
        raise UsageError(f"--heads {args.heads} is not a multiple of --kv-heads "
                         f"{args.kv_heads}: query head μ = (g r) needs r = heads / G whole")
    sizes = derivation.default_sizes(args.batch, args.seq, args.d_model, args.heads, args.seq_k)
    return sizes if args.kv_heads is None else {**sizes, "g": args.kv_heads}


def checked_sizes(args: argparse.Namespace, who: str, tensors: Sequence[str]) -> dict[str, int]:
    """The sizes, refused where one of ``tensors`` (in float64) would not fit (``c`` given for
    the linear-attention steps')."""
    sizes = sizes_of(args)
    check_memory(who, derivation.with_value_width(sizes), tensors, torch.float64)
    return sizes


@command("trace", "the stage table: each stage's equation, einsum, shapes, FLOPs and "
         "largest intermediate (in elements)", size_options, causal_option)
def trace_command(args: argparse.Namespace, paint: Paint) -> Output:
    return trace_output(checked_sizes(args, "trace", TRACE_TENSORS),
                        cross=args.seq_k is not None, causal=args.causal, paint=paint)


@command("verify", "check every derivation step (exit 1 if one fails) and show the "
         "scores' contraction order", size_options, exact_option)
def verify_command(args: argparse.Namespace, paint: Paint) -> Output:
    return verify_output(checked_sizes(args, "verify", VERIFY_TENSORS), exact_only=args.exact,
                         paint=paint)


@command("latex", "the derivation's equations (1)–(5), (5a) and (1g), (2g), (4g) as LaTeX")
def latex_command(args: argparse.Namespace, paint: Paint) -> Output:
    equations = latex_equations()
    lines = [f"$$\n{e['latex']} \\tag{{{e['number']}}}\n$$" for e in equations]
    return Output({"equations": equations}, "\n\n".join(lines).splitlines())


MAX_ROUNDS = 1000  # --repeats: a round of the full run takes seconds, 1,000 an hour or more


def bench_options(parser: argparse.ArgumentParser) -> None:
    def size(text: str):
        from . import bench

        try:
            found = bench.parse_size(text)
            check_memory(f"bench at {found.label}", derivation.default_sizes(
                found.n, found.L, found.d_model, found.heads), TRACE_TENSORS, torch.float32)
        except (ValueError, UsageError) as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        return found

    add = parser.add_argument
    add("--quick", action="store_true", help="tiny sizes, 3 rounds, one small memory run, no "
        "compile: under a minute")
    add("--no-compile", action="store_true", help="skip the torch.compile comparison")
    add("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    add("--sizes", nargs="+", type=size, metavar="N,L,D,H", help="the sizes to time, each "
        "n,L,d_model,heads (append ,causal for a causal row); compile then runs at every one "
        "(default: 8,128,512,8 2,1024,512,8 1,4096,256,4 2,5,16,4 and 2,1024,512,8,causal; "
        "compile at the first two); sizes whose largest tensor would need more than "
        f"{_gib(MEMORY_LIMIT)} are refused")
    add("--repeats", type=_at_most(MAX_ROUNDS, "the most rounds bench runs"), metavar="R",
        help=f"interleaved timing rounds, 1 to {MAX_ROUNDS:,} (default 11, or 3 with --quick)")
    cores = os.cpu_count() or 1
    add("--threads", type=_at_most(cores, "the CPU cores this machine has"), metavar="T",
        help=f"torch intra-op threads, 1 to {cores} (default: torch's, one per core)")
    add("--clock", choices=("wall", "cpu"), default="wall", help="time samples by the wall "
        "clock (default) or by the process's CPU time, which leaves out the time a shared "
        "machine spends on other work (use it with --threads 1)")
    add("--check", action="store_true", help="exit with status 1 when a target fails "
        "(default: report the targets and exit 0)")


@command("bench", "time einattn's einsum, sdpa and chunked paths against the textbook form, "
         "nn.MultiheadAttention and Linear+SDPA; compile and peak memory too; targets with "
         "PASS, FAIL or SKIP (--check: exit 1 if one fails)", bench_options)
def bench_command(args: argparse.Namespace, paint: Paint) -> Output:
    from . import bench  # imported on use: only this subcommand needs it

    settings = bench.Settings.build(quick=args.quick, compile=not args.no_compile,
                                    memory=not args.no_memory, sizes=args.sizes,
                                    rounds=args.repeats, threads=args.threads,
                                    clock=args.clock)
    report = bench.run(settings, lambda text: print(f"einattn bench: {text}", file=sys.stderr,
                                                    flush=True))  # progress, off stdout
    failed = any(t.verdict == "FAIL" for t in bench.targets(report))
    return Output(report.as_json(), bench.lines(report, table, paint),
                  1 if args.check and failed else 0)


def main_job(args: argparse.Namespace, paint: Paint) -> Output:
    """No subcommand: ``einattn trace --causal``, then ``einattn verify``, at the sizes given
    (default: the derivation's worked example)."""
    sizes = checked_sizes(args, "the main job", VERIFY_TENSORS)
    head = Output({}, ["einattn: multi-head attention, one index equation per stage"])
    return (head + trace_output(sizes, cross=args.seq_k is not None, causal=True, paint=paint)
            + verify_output(sizes, exact_only=False, paint=paint))


# -- parsing and dispatch --------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line from main(), not usage + message
        raise UsageError(message)


def _json_option(parser: argparse.ArgumentParser) -> None:
    # SUPPRESS: a subcommand's default must not overwrite `einattn --json <subcommand>`.
    parser.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="print one JSON document instead of tables")


def parser() -> argparse.ArgumentParser:
    top = _Parser(prog="einattn", description="Multi-head attention as index-notation math. "
                  "With no subcommand: the main job, `trace --causal` then `verify`, at the "
                  "sizes given here.")
    _json_option(top)
    size_options(top)
    sub = top.add_subparsers(dest="command", title="subcommands (each has --help)")
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        _json_option(p)
        for add in cmd.options:
            add(p)
    return top


def _one_line(error: Exception) -> str:
    """An error as one line: its first line, and the equation it shows if any."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    shown = [line for line in lines[1:] if set(line) != {"^"}]
    return " — ".join(lines[:1] + shown[:1])


def main(argv: list[str] | None = None) -> int:
    """Run the command line. Exit status: 0 done, 1 a step (or, with ``bench --check``, a
    target) failed, 2 bad arguments (one line on stderr), 141 (as for SIGPIPE) when stdout
    was closed early."""
    try:
        args = parser().parse_args(argv)
        chosen = COMMANDS.get(args.command)
        _fill_sizes(args, args.command or "einattn",
                    chosen is None or size_options in chosen.options)
        output = (chosen.run if chosen else main_job)(args, Paint.for_stdout())
    except SystemExit as done:  # --help printed its text
        return done.code if isinstance(done.code, int) else 0
    except (UsageError, EinattnError) as error:
        print(f"einattn: error: {_one_line(error)}", file=sys.stderr)
        return 2
    as_json = getattr(args, "json", False)
    text = json.dumps(output.document, indent=2, ensure_ascii=False) if as_json else None
    return output.status if _write(text or "\n".join(output.lines)) else 141


def _write(text: str) -> bool:
    """Print ``text``; False if the reader went away (``einattn | head``), quietly."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return False
    return True
