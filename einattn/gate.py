"""The output gate (Qwen3-Next): each head's output ``Z`` scaled, channel by channel, by the
sigmoid of a gate projected from the same token, before equation (5)::

    (G1) G[n τ μ b]   = X[n τ i] W_G[(μ b) i]                 (+ b_G[(μ b)])
    (G2) Z_g[n μ τ b] = Z[n μ τ b] · sigmoid(G[n μ τ b])

``b`` is the value width of a head (``d_head`` unless the layer's ``d_value`` says
otherwise). Qwen3-Next keeps ``W_G``'s rows in its ``q_proj``, interleaved per head with the
query rows, ``q_proj[(μ B a) i]`` with B over Q, G: :func:`from_interleaved` takes them
apart, :func:`to_interleaved` puts them back.
"""

from __future__ import annotations

import torch
from einops import rearrange

from .errors import EinattnError
from .notation import Equation

GATE = Equation("G[n τ μ b] = X[n τ i] W_G[(μ b) i]")  # (G1)
GATED = Equation("Z_g[n μ τ b] = Z[n μ τ b] · sigmoid(G[n μ τ b])")  # (G2)


def gate_logits(x: torch.Tensor, W_G: torch.Tensor | None, b_G: torch.Tensor | None,
                n_heads: int) -> torch.Tensor:
    """(G1): ``G[n τ μ b] = X[n τ i] W_G[(μ b) i]`` (+ ``b_G[(μ b)]``), returned as
    ``G[n μ τ b]``."""
    if W_G is None:
        raise EinattnError("this attention gates its output, but its weights hold no W_G "
                           "(a layer whose weights are sharded or substituted must hand it "
                           "on)")
    G = GATE(X=x, W_G=W_G, μ=n_heads)
    if b_G is not None:
        G = G + b_G.view(n_heads, -1)
    return G.transpose(1, 2)


def gated(Z: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """(G2): ``Z_g[n μ τ b] = Z[n μ τ b] · sigmoid(G[n μ τ b])``.

    >>> gated(torch.ones(1, 1, 1, 2), torch.zeros(1, 1, 1, 2))
    tensor([[[[0.5000, 0.5000]]]])
    """
    return GATED(Z=Z, G=G)


def from_interleaved(W: torch.Tensor, n_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W_q[(μ a) i], W_G[(μ a) i])`` from Qwen3-Next's ``q_proj[(μ B a) i]`` (or its
    bias), per head its a query rows, then its a gate rows."""
    if W.shape[0] % (2 * n_heads):
        raise EinattnError(f"q_proj has {W.shape[0]} rows; q_proj[(μ B a) i] with B over the "
                           f"query and the gate needs a multiple of 2·μ = {2 * n_heads}")
    W_q, W_G = rearrange(W, "(μ B a) ... -> B (μ a) ...", μ=n_heads, B=2)
    return W_q, W_G


def to_interleaved(W_q: torch.Tensor, W_G: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of :func:`from_interleaved`."""
    return rearrange([W_q, W_G], "B (μ a) ... -> (μ B a) ...", μ=n_heads)
