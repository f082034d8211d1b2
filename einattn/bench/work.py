"""The work an attention row does, and each form's rate as a fraction of the machine's roof
(:mod:`~einattn.bench.roof`):

    layer, patterns  FlashAttention's FLOP count of ``Z[n μ τ a]`` from ``Q``, ``K``, ``V``:
                     ``4·n·μ·a`` per ``(τ, σ)`` pair the pattern keeps (``2·a`` for
                     ``S = Q Kᵀ``, ``2·a`` for ``A V``): ``4·n·μ·L_q·L_k·a`` dense, about
                     half under causal (``L(L+1)/2`` pairs), the kept pairs under a window
                     or documents; ×3.5 forward+backward (the backward 2.5× the forward).
                     The layer adds its projections (1) and (5), ``8·n·L·i²`` forward, ×3
                     forward+backward (dX and dW)
    decoding         the bytes of the K, V cache one step reads, ``2·n·μ·σ·a·4`` (float32)
                     over the mean number σ of keys a step attends

A form's rate is that work over its median; its fraction of peak, the rate over the roof at
the run's thread count (GFLOP/s for the first two, bandwidth for decoding).
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING

from .decoding import SLACK, DecodingRow
from .patterns import PatternRow, document_ids, documents_mask, window_mask

if TYPE_CHECKING:
    from .roof import Roof
    from .settings import DecodingSize, PatternSize, Size
    from .timing import Row

FLOP_METHOD = ("FlashAttention's count: 4·n·μ·a FLOP per (τ, σ) pair the pattern keeps "
               "(L_q·L_k dense, L(L+1)/2 causal, the kept pairs of a window or of documents), "
               "×3.5 forward+backward; the layer adds 8·n·L·i² for its projections (×3 "
               "forward+backward); decoding: the bytes of K and V read per token")
ATTENTION_TIMES = {"forward": 1.0, "forward+backward": 3.5}  # backward = 2.5 × forward
LINEAR_TIMES = {"forward": 1.0, "forward+backward": 3.0}  # dX and dW: 2 × forward each
# The pattern each form of the patterns section computes (a form not named is not rated).
PATTERN_OF = {**dict.fromkeys(("sdpa_dense", "chunked", "chunked_maskmod", "chunked_mask",
                               "einsum", "flex_compiled", "flex"), "window"),
              **dict.fromkeys(("chunked_causal", "sdpa_causal"), "causal"),
              **dict.fromkeys(("sdpa_documents", "chunked_documents", "flex_documents"),
                              "documents")}


def attention_flops(n: int, heads: int, pairs: int, d_head: int, mode: str) -> float:
    """FlashAttention's FLOP count: ``4·n·μ·a`` per kept ``(τ, σ)`` pair, ×3.5 with the
    backward."""
    return 4 * n * heads * pairs * d_head * ATTENTION_TIMES[mode]


def causal_pairs(L: int) -> int:
    """The ``(τ, σ)`` pairs with ``σ ≤ τ`` of ``L`` positions: ``L(L+1)/2``."""
    return L * (L + 1) // 2


def layer_flops(size: Size, mode: str) -> float:
    """One layer call: the attention's FLOP (dense or causal) and the projections'
    ``2·n·L·i·3i + 2·n·L·i·i``."""
    pairs = causal_pairs(size.L) if size.causal else size.L * size.L
    projections = 8 * size.n * size.L * size.d_model**2 * LINEAR_TIMES[mode]
    return attention_flops(size.n, size.heads, pairs, size.d_head, mode) + projections


@cache
def pattern_pairs(size: PatternSize, pattern: str) -> int:
    """The pairs ``pattern`` keeps at ``size``: "window", "causal" or "documents", counted on
    the patterns section's own dense masks."""
    if pattern == "causal":
        return causal_pairs(size.L)
    mask = window_mask(size.L, size.window) if pattern == "window" \
        else documents_mask(document_ids(size.L))
    return int(mask.sum())


def pattern_flops(size: PatternSize, name: str, mode: str) -> float | None:
    """The FLOP of form ``name`` of the patterns section (None: a form not in
    :data:`PATTERN_OF`)."""
    pattern = PATTERN_OF.get(name)
    if pattern is None:
        return None
    return attention_flops(size.n, size.heads, pattern_pairs(size, pattern), size.d_head, mode)


def cache_read_bytes(size: DecodingSize) -> float:
    """The float32 bytes of ``K[n μ σ a]`` and ``V`` one decoding step reads, over the mean
    keys a step attends: ``context + 1`` to ``context + SLACK``, then cropped back."""
    keys = size.context + (SLACK + 1) / 2
    return 2 * size.n * keys * size.d_model * 4


_KEYS = {False: ("FLOP", "GFLOP/s", "fraction_of_peak_GFLOP/s"),
         True: ("cache_read_bytes", "bandwidth_GB/s", "fraction_of_peak_bandwidth")}


def row_work(row: Row, name: str) -> float | None:
    """Form ``name``'s work in ``row``: bytes read for a decoding row, FLOP otherwise (None:
    a pattern form not in :data:`PATTERN_OF`)."""
    if isinstance(row, DecodingRow):
        return cache_read_bytes(row.size)
    if isinstance(row, PatternRow):
        return pattern_flops(row.size, name, row.mode)
    return layer_flops(row.size, row.mode)


def rates(row: Row, roof: Roof, threads: int) -> dict[str, dict]:
    """Each form of ``row``: its work, its rate and that rate's fraction of the roof at
    ``threads`` threads, under the JSON keys of :data:`_KEYS`."""
    memory = isinstance(row, DecodingRow)
    peak = (roof.bandwidth if memory else roof.gflops)[threads]
    found = {}
    for name, timing in row.timings.items():
        work = row_work(row, name)
        if work is not None:
            rate = work / timing.median / 1e9
            found[name] = dict(zip(_KEYS[memory], (work, rate, rate / peak), strict=True))
    return found


def rate_cells(row: Row, name: str) -> list[str]:
    """The table's two cells for one form: its rate (GFLOP/s or GB/s) and its fraction of
    peak, or dashes where it was not rated."""
    figures = list(row.peak.get(name, {}).values())
    if not figures:
        return ["—", "—"]
    _, rate, fraction = figures
    percent = 100 * fraction
    return [f"{rate:.3g}", f"{percent:.0f}%" if percent >= 10 else f"{percent:.2g}%"]
