"""``einattn trace``: equations (1)–(5) run one stage at a time on seeded float64 input, each
with the einsum it runs as, the shapes it read and wrote, its FLOPs and largest intermediate."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import torch

from .. import functional, masks
from ..notation import Equation, Explanation
from .options import TRACE_TENSORS, Command, causal_option, checked_sizes, size_options
from .output import Output, Paint, letters_text, sizes_text, table

SEED = 0
# The equations of einattn.functional by constant, with their numbers in docs/derivation.md.
# (5a) is (5) before the sum over μ: in the LaTeX, not in the trace.
EQUATIONS = {"PROJECT": "1", "SCORES": "2", "SOFTMAX": "3", "VALUES": "4", "HEADS": "5",
             "HEAD_TERMS": "5a", "PROJECT_GQA": "1g", "SCORES_GQA": "2g", "VALUES_GQA": "4g"}


def letter_mapping(equation: Equation, einsum: str) -> dict[str, str]:
    """Index -> the ``torch.einsum`` letter it runs as, read off the einsum term by term."""
    inputs, output = einsum.split("->")
    mapping: dict[str, str] = {}
    for term, letters in zip((equation.lhs, *equation.terms), (output, *inputs.split(",")),
                             strict=True):
        mapping.update(zip(term.indices, letters, strict=True))
    return mapping


def renamed(mapping: dict[str, str]) -> dict[str, str]:
    """The letters that differ from their index (Greek, mostly): the mapping to show."""
    return {index: letter for index, letter in mapping.items() if index != letter}


@dataclass(frozen=True)
class Stage:
    """One stage as traced: its equation, the shapes it read and wrote, and how it ran."""

    number: str
    name: str
    equation: Equation
    inputs: dict[str, tuple[int, ...]]
    outputs: dict[str, tuple[int, ...]]
    plans: tuple[Explanation, ...] = ()  # one per contraction the stage runs

    @property
    def einsum(self) -> str | None:
        return self.plans[0].einsum if self.plans else None

    @property
    def letters(self) -> dict[str, str]:
        return renamed(letter_mapping(self.equation, self.einsum)) if self.plans else {}

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
    M = masks.attention_mask(n=n, n_heads=n_heads, L_q=L_q, L_k=L_k, dtype=X.dtype,
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
    if not equation.is_contraction:  # the softmax: no contraction to explain
        runs = []
    elif runs is None:
        runs = [inputs]
    plans = tuple(equation.explain(**shapes) for shapes in runs)
    return Stage(EQUATIONS[name], name, equation, inputs, outputs, plans)


# -- the text -------------------------------------------------------------------------------

def _shapes_text(shapes: dict[str, tuple[int, ...]]) -> str:
    """``Q, K (2, 4, 5, 4)  V (2, 4, 7, 4)``: neighbours of equal shape share it."""
    groups: list[tuple[list[str], tuple[int, ...]]] = []
    for name, shape in shapes.items():
        if groups and groups[-1][1] == shape:
            groups[-1][0].append(name)
        else:
            groups.append(([name], shape))
    return "  ".join(f"{', '.join(names)} {shape}" for names, shape in groups)


def _count(x: int | None) -> str:
    return "—" if x is None else f"{x:,}"


def stage_lines(stages: list[Stage], paint: Paint) -> list[str]:
    equations = table(["stage", "equation", "einsum", "letters"],
                      [[s.label, str(s.equation), s.einsum or "— (not a contraction)",
                        letters_text(s.letters)] for s in stages], paint)
    costs = table(["stage", "in", "out", "FLOPs", "largest intermediate (elements)"],
                  [[s.label, _shapes_text(s.inputs), _shapes_text(s.outputs),
                    _count(s.flops), _count(s.largest_intermediate)] for s in stages],
                  paint, right=(3, 4))
    return [*equations, "", *costs]


def trace_output(sizes: dict[str, int], *, cross: bool, causal: bool, paint: Paint) -> Output:
    stages = trace(sizes, cross=cross, causal=causal)
    kind = ("cross-attention" if cross else "self-attention") + (", causal" if causal else "")
    head = f"trace: {sizes_text(sizes)}, {kind}, seeded float64 input (seed {SEED})"
    document = {"sizes": sizes, "causal": causal, "cross_attention": cross, "seed": SEED,
                "stages": [s.as_json() for s in stages]}
    return Output(document, [head, "", *stage_lines(stages, paint)])


def trace_command(args: argparse.Namespace, paint: Paint) -> Output:
    return trace_output(checked_sizes(args, "trace", TRACE_TENSORS),
                        cross=args.seq_k is not None, causal=args.causal, paint=paint)


COMMAND = Command(trace_command, "the stage table: each stage's equation, einsum, shapes, "
                  "FLOPs and largest intermediate (in elements)", (size_options, causal_option))
