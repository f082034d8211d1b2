"""The arguments: what a subcommand is (:class:`Command`), the options it takes, the sizes
they set, and the memory check that refuses sizes before anything is allocated."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .. import derivation
from .output import Output, Paint

Options = Callable[[argparse.ArgumentParser], None]


@dataclass(frozen=True)
class Command:
    """A subcommand: the function that runs it, its help, the option groups it takes
    (``--json`` and ``--help`` come with every subcommand)."""

    run: Callable[[argparse.Namespace, Paint], Output]
    help: str
    options: tuple[Options, ...] = ()


class UsageError(Exception):
    """Bad command-line arguments: printed as one line, exit status 2."""


# -- what a run would hold ------------------------------------------------------------------

MEMORY_LIMIT = 2**30  # bytes: the largest tensor trace, verify and bench may allocate
# The largest tensors of one attention layer, by their indices: the input (as large as Q, Z
# and Y), the fused weight, the projections Q, K, V of the keys' side (σ = τ without a
# context; with one, K and V from C and only Q from X), the scores. W and P with B = 3 bound
# the grouped (g C a), C = r + 2 ≤ 3r; C, K, V, W_O and the rest are no larger.
TRACE_TENSORS = ("X[n τ i]", "W[(μ B a) i]", "P[n σ μ B a]", "S[n μ τ σ]")
VERIFY_TENSORS = TRACE_TENSORS + derivation.TENSORS
# What each of them is, for a refusal: the user asked for a run at some sizes, not for the
# tensor that would not fit (the linear-attention steps' H[n μ τ a c], say).
HELD = {"X[n τ i]": "the input", "W[(μ B a) i]": "the fused weight of (1)",
        "P[n σ μ B a]": "the projections Q, K, V of (1)", "S[n μ τ σ]": "the scores of (2)",
        "S[n μ τ τ]": "the scores of the self-attention steps",
        "W_QK[μ i j]": "the W_QK circuit's weight", "Y_μ[n μ τ i]": "the per-head terms of (5a)",
        "H[n μ τ a c]": "the linear-attention steps' prefix sums, with c = a + 3",
        "H[n μ σ a c]": "the linear-attention steps' sums over keys, with c = a + 3"}


def largest_tensor(sizes: dict[str, int], tensors: Sequence[str]) -> tuple[str, int]:
    """The largest of ``tensors`` (written ``"S[n μ τ σ]"``) at ``sizes``, and its number of
    elements."""
    def elements(tensor: str) -> int:
        indices = tensor[tensor.index("[") + 1:-1].replace("(", " ").replace(")", " ")
        return math.prod(sizes[index] for index in indices.split())

    largest = max(tensors, key=elements)
    return largest, elements(largest)


def gib(n_bytes: int) -> str:
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
        raise UsageError(f"{who} would hold {tensor} ({HELD[tensor]}) of {elements:,} "
                         f"{str(dtype).removeprefix('torch.')} elements ({gib(need)}), over "
                         f"the limit of {gib(MEMORY_LIMIT)} for one tensor: choose smaller sizes")


# -- the options ----------------------------------------------------------------------------

def positive(text: str) -> int:
    """An option's value as a positive integer, or the reason it is not one."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


# The size options' defaults (the derivation's worked example) and the sizes they set. Their
# argparse default is SUPPRESS, so that a size given before the subcommand, or with none
# (the main job), is not overwritten by the subcommand's default; fill_sizes fills these in.
SIZE_DEFAULTS = {"batch": 2, "seq": 5, "seq_k": None, "d_model": 16, "heads": 4,
                 "kv_heads": None}


def size_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sizes", "The defaults are the derivation's worked "
                                      "example. Sizes whose largest tensor would need more "
                                      f"than {gib(MEMORY_LIMIT)} are refused.")

    def add(flag: str, metavar: str, help: str) -> None:
        default = SIZE_DEFAULTS[flag.removeprefix("--").replace("-", "_")]
        group.add_argument(flag, type=positive, default=argparse.SUPPRESS, metavar=metavar,
                           help=help if default is None else f"{help} (default {default})")

    add("--batch", "N", "index n")
    add("--seq", "L", "index τ, query positions")
    add("--seq-k", "L_K", "index σ, key positions: makes it cross-attention on a context of "
        "this length (default: self-attention, σ = τ)")
    add("--d-model", "D", "index i")
    add("--heads", "H", "index μ; d_head (index a) is d_model / heads")
    add("--kv-heads", "G", "index g, key/value heads: grouped-query attention with heads / G "
        "query heads per group (default: heads)")


def fill_sizes(args: argparse.Namespace, name: str, takes_sizes: bool) -> None:
    """Put the size defaults into ``args``; refuse sizes given to a subcommand without them
    (``einattn --seq 3 latex``)."""
    given = [f"--{key.replace('_', '-')}" for key in SIZE_DEFAULTS if key in vars(args)]
    if given and not takes_sizes:
        raise UsageError(f"{name} takes no size options ({', '.join(given)}): they belong to "
                         f"trace, verify and einattn with no subcommand")
    if given and getattr(args, "file", None) is not None:
        raise UsageError(f"verify FILE takes no size options ({', '.join(given)}): each "
                         f"derivation block gives its own on a 'sizes:' line")
    for key, default in SIZE_DEFAULTS.items():
        vars(args).setdefault(key, default)


def causal_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--causal", action="store_true",
                        help="mask keys after each query (bottom-right aligned)")


def exact_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--exact", action="store_true",
                        help="only the steps an exact mode checks (finite field or integers); "
                        "skip those only float64 can")


def derive_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--derive", action="store_true",
                        help="show the gradients Equation.grad derives for equations (1)-(5), "
                        "each checked against autograd exactly (in the finite field)")


def file_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", nargs="?", metavar="FILE.md",
                        help="check the derivation blocks of this markdown file (fenced "
                        "blocks whose info string is derivation or derivation-latex) "
                        "instead of the registered steps")


# -- the sizes they set ---------------------------------------------------------------------

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
    asked = " ".join(f"--{key.replace('_', '-')} {vars(args)[key]}" for key in SIZE_DEFAULTS
                     if vars(args)[key] is not None)
    check_memory(f"{who} at {asked}", derivation.with_value_width(sizes), tensors,
                 torch.float64)
    return sizes
