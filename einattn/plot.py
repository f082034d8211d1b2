"""Pictures of attention weights ``A[μ τ σ]``: one heatmap per head, tokens on the axes.

matplotlib is an optional dependency (from a checkout, ``pip install '.[plot]'``), imported only
when a figure is drawn. The figure is built on matplotlib's Agg canvas, without pyplot, so
drawing one neither needs a display nor changes the backend a notebook or script has chosen.

>>> import torch
>>> from einattn import MultiHeadAttention, plot
>>> layer = MultiHeadAttention(16, 4, causal=True)
>>> _, A = layer(torch.randn(1, 5, 16), need_weights=True)   # A[n μ τ σ]
>>> fig = plot.attention(A[0], tokens=list("hello"))          # A[μ τ σ] of sample 0
>>> len([ax for ax in fig.axes if ax.images])                 # one panel per head
4
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .errors import EinattnError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["attention"]

MAX_COLUMNS = 4
MAX_WIDTH_INCHES = 14.0


def attention(A, tokens: Sequence[str] | None = None, *,
              key_tokens: Sequence[str] | None = None, title: str | None = None) -> Figure:
    """A figure of the attention weights ``A[μ τ σ]``: one panel per head ``μ``, queries
    ``τ`` down the rows, keys ``σ`` along the columns, and one colour bar.

    ``A`` is one sample's weights, ``A[0]`` of the ``A[n μ τ σ]`` that
    ``MultiHeadAttention(..., need_weights=True)`` returns (any tensor-like works: it is
    detached and copied to the CPU). ``tokens`` labels the query positions and, unless
    ``key_tokens`` is given (cross-attention), the key positions as well. The colour scale
    is [0, 1], shared by every head, unless ``A`` has values outside it (scores, say), in
    which case it is their range. Save the figure with ``fig.savefig("attention.png")``.
    """
    weights = _weights(A)
    n_heads, L_q, L_k = weights.shape
    _check_tokens("τ", L_q, "tokens", tokens)
    if key_tokens is None:
        _check_tokens("σ", L_k, "tokens", tokens)
        key_tokens = tokens
    else:
        _check_tokens("σ", L_k, "key_tokens", key_tokens)

    Figure, FigureCanvasAgg = _matplotlib()
    side = min(max(2.6, 0.15 * max(L_q, L_k)), MAX_WIDTH_INCHES - 1)  # inches per panel
    columns = max(1, min(n_heads, MAX_COLUMNS, int((MAX_WIDTH_INCHES - 1) // side)))
    rows = math.ceil(n_heads / columns)
    fig = Figure(figsize=(side * columns + 1.0, side * rows + 0.6), layout="constrained")
    FigureCanvasAgg(fig)
    low, high = float(weights.min()), float(weights.max())
    scale = (0.0, 1.0) if 0.0 <= low and high <= 1.0 else (low, high)
    axes = fig.subplots(rows, columns, squeeze=False)
    for mu, ax in enumerate(axes.flat):
        if mu >= n_heads:
            ax.set_axis_off()
            continue
        image = ax.imshow(weights[mu].numpy(), cmap="viridis", vmin=scale[0], vmax=scale[1],
                          interpolation="nearest")
        ax.set_title(f"head μ = {mu}", fontsize=10)
        _label(ax.set_yticks, ax.set_yticklabels, tokens, L_q)
        _label(ax.set_xticks, ax.set_xticklabels, key_tokens, L_k, vertical=True)
        if mu % columns == 0:
            ax.set_ylabel("query τ")
        if mu + columns >= n_heads:  # no panel below this one
            ax.set_xlabel("key σ")
    fig.colorbar(image, ax=axes, shrink=0.8, label="A[μ τ σ]")
    if title is not None:
        fig.suptitle(title)
    return fig


def _weights(A) -> torch.Tensor:
    try:
        weights = torch.as_tensor(A).detach()
    except (TypeError, ValueError, RuntimeError) as error:
        raise EinattnError(f"A must be a tensor A[μ τ σ], got {type(A).__name__}") from error
    if weights.ndim != 3:
        hint = {2: "; for a single head pass A[None]",
                4: "; for A[n μ τ σ] pick one sample, A[0]"}.get(weights.ndim, "")
        raise EinattnError(f"A must have three axes A[μ τ σ] (head, query, key), got shape "
                           f"{tuple(weights.shape)}{hint}")
    return weights.to("cpu", torch.float32)


def _check_tokens(index: str, size: int, name: str, tokens: Sequence[str] | None) -> None:
    if tokens is not None and len(tokens) != size:
        cross = "; for cross-attention pass key_tokens" if name == "tokens" and index == "σ" else ""
        raise EinattnError(f"index '{index}' has size {size} in A[μ τ σ] but {name} has "
                           f"{len(tokens)} entries{cross}")


def _label(set_ticks, set_labels, tokens: Sequence[str] | None, size: int, *,
           vertical: bool = False) -> None:
    """One label per position; key labels longer than two characters are turned upright."""
    if tokens is None:
        return
    labels = [str(t) for t in tokens]
    set_ticks(range(size))
    turn = vertical and max(map(len, labels), default=0) > 2
    set_labels(labels, rotation=90 if turn else 0, fontsize=8)


def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError("einattn.plot needs matplotlib, an optional dependency: from "
                          "einattn's checkout, pip install '.[plot]'") from error
    return Figure, FigureCanvasAgg
