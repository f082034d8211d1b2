"""The backward pass's steps: each equation of :mod:`einattn.chunked`'s backward, and the
softmax's backward, is the gradient of its forward, proved by
:func:`einattn.verify.check_gradient`; :func:`einattn.derivation.steps` registers them.

Per tile of queries τ ∈ t and keys σ ∈ b, with ``μ = (g r)``, the forward is equation (2g),
then (3) and (4g) with the tile's names::

    S[n (g r) τ σ]   = Q_t[n (g r) τ a] K_b[n g σ a] / √a           (TILE_SCORES)
    P[n μ τ σ]       = softmax_σ(S[n μ τ σ])
    Z_t[n (g r) τ a] = P[n (g r) τ σ] V_b[n g σ a]                  (TILE_VALUES)

and the backward, for the cotangent ``dZ_t``, is ``chunked.VALUE_GRADS``, ``PROB_GRADS``,
``QUERY_GRADS``, ``KEY_GRADS`` and, between them, ``dS = P ∘ (dP − D)`` with
``D[n μ τ] = Σ_a dZ_t Z_t`` (:data:`ROW_TERM`), which is the softmax backward
``dS = A ∘ (dA − Σ_σ A ∘ dA)`` with the row sum taken over ``a`` instead of ``σ``.
"""

from __future__ import annotations

import torch

from . import chunked, derivation
from .notation import Equation
from .verify import gradient_sides

TILE_SCORES = Equation("S[n (g r) τ σ] = Q_t[n (g r) τ a] K_b[n g σ a] / √a")
TILE_VALUES = Equation("Z_t[n (g r) τ a] = P[n (g r) τ σ] V_b[n g σ a]")
ROW_TERM = Equation("D[n μ τ] = dZ_t[n μ τ a] Z_t[n μ τ a]")

_ROWS = {"S": "n (g r) τ σ", "A": "n (g r) τ σ"}
_TILE = {"S": "n (g r) τ σ", "V_b": "n g σ a", "Z_t": "n (g r) τ a"}


_CAP = 6  # an identity of index equations needs no large sizes; these keep its tensors small


def gradient_sizes(s: dict[str, int]) -> dict[str, int]:
    """The backward steps' sizes, all six different so that no swapped pair can hide:
    r = 2 query heads a group in g = 3 groups (so that (g r) and (r g) differ), then σ, τ,
    a (at least 2, so that √a ≠ 1) and n as ``s`` gives them up to 6, each moved to the
    nearest free size, smaller first (τ = σ − 1 at self-attention sizes)."""
    sizes = {"r": 2, "g": 3}
    for index in ("σ", "τ", "a", "n"):
        size = min(s[index], _CAP)
        low = 2 if index == "a" else min(2, size)
        free = [k for k in [*range(size, low - 1, -1), *range(size + 1, size + 7)]
                if k not in sizes.values()]
        sizes[index] = free[0]
    return sizes


def softmax_rows(S: torch.Tensor) -> torch.Tensor:
    """``A[n μ τ σ] = softmax_σ(S[n μ τ σ])``."""
    return torch.softmax(S, dim=-1)


def softmax_backward(A: torch.Tensor, dA: torch.Tensor) -> torch.Tensor:
    """``dS = A ∘ (dA − Σ_σ A ∘ dA)``."""
    return A * (dA - (A * dA).sum(dim=-1, keepdim=True))


def attention_rows(S: torch.Tensor, V_b: torch.Tensor) -> torch.Tensor:
    """``Z_t = softmax_σ(S) V_b``: one row of tiles' output from its scores."""
    return TILE_VALUES(P=softmax_rows(S), V_b=V_b)


def chunked_score_grads(S, V_b, Z_t, dZ_t) -> torch.Tensor:
    """``dS = P ∘ (dP − D)`` as einattn.chunked's backward forms it: ``P = exp(S − lse)``
    recomputed from the scores, ``dP`` by ``PROB_GRADS``, ``D = Σ_a dZ_t Z_t``."""
    P = (S - S.logsumexp(dim=-1, keepdim=True)).exp()
    dP = chunked.PROB_GRADS(dZ_t=dZ_t, V_b=V_b)
    return P * (dP - ROW_TERM(dZ_t=dZ_t, Z_t=Z_t)[..., None])


# -- the wrong forms of the mutations ---------------------------------------------------------

def softmax_without_row_sum(A: torch.Tensor, dA: torch.Tensor) -> torch.Tensor:
    """Wrong: ``A ∘ dA``, as if each weight moved alone."""
    return A * dA


def softmax_summed_over_queries(A: torch.Tensor, dA: torch.Tensor) -> torch.Tensor:
    """Wrong: ``A ∘ (dA − Σ_τ A ∘ dA)``, the row sum taken down a column."""
    return A * (dA - (A * dA).sum(dim=-2, keepdim=True))


def row_term_outside(S, V_b, Z_t, dZ_t) -> torch.Tensor:
    """Wrong: ``P ∘ dP − D``, D left outside the product."""
    P = S.softmax(dim=-1)
    return P * chunked.PROB_GRADS(dZ_t=dZ_t, V_b=V_b) - ROW_TERM(dZ_t=dZ_t, Z_t=Z_t)[..., None]


# -- the steps ---------------------------------------------------------------------------------

def _step(name: str, forward, gradient, wrt: str, sizes: dict[str, int], exact: bool,
          **options) -> derivation.Step:
    """A registered step: autograd's d<wrt> of ``forward`` = ``gradient``."""
    sides = gradient_sides(forward, gradient, wrt=wrt, sizes=sizes, **options)
    return derivation.Step(name, sides.true, sides.claimed, sizes, exact, sides.inputs)


def steps(s: dict[str, int]) -> list[derivation.Step]:
    """The backward's true steps at :func:`gradient_sizes` of ``s``."""
    z = gradient_sizes(s)
    rows, tile = {"output": "A", "shapes": _ROWS}, {"output": "Z_t", "shapes": _TILE}
    return [
        _step("backward VALUE_GRADS dV_b = Pᵀ dZ_t is d/dV_b of Z_t = P V_b", TILE_VALUES,
              chunked.VALUE_GRADS, "V_b", z, exact=True),
        _step("backward PROB_GRADS dP = dZ_t V_bᵀ is d/dP of Z_t = P V_b", TILE_VALUES,
              chunked.PROB_GRADS, "P", z, exact=True),
        _step("backward QUERY_GRADS dQ_t = dS K_b / √a is d/dQ_t of (2g)", TILE_SCORES,
              chunked.QUERY_GRADS, "Q_t", z, exact=False),
        _step("backward KEY_GRADS dK_b = dSᵀ Q_t / √a is d/dK_b of (2g)", TILE_SCORES,
              chunked.KEY_GRADS, "K_b", z, exact=False),
        _step("softmax backward dS = A ∘ (dA − Σ_σ A ∘ dA)", softmax_rows, softmax_backward,
              "S", z, exact=False, **rows),
        _step("chunked dS = P ∘ (dP − D), D = Σ_a dZ Z is d/dS of softmax_σ(S) V_b",
              attention_rows, chunked_score_grads, "S", z, exact=False, **tile),
    ]


def mutations(s: dict[str, int]) -> list[derivation.Step]:
    """Plausible wrong backward steps, at the sizes of the true ones."""
    z = gradient_sizes(s)
    rows, tile = {"output": "A", "shapes": _ROWS}, {"output": "Z_t", "shapes": _TILE}
    tiled = "dV_b[n g σ a] = P[n (r g) τ σ] dZ_t[n (r g) τ a]"
    unscaled = "dQ_t[n (g r) τ a] = dS[n (g r) τ σ] K_b[n g σ a]"
    return [
        _step("dV_b summed over query heads read (r g)", TILE_VALUES, tiled, "V_b", z,
              exact=True),
        _step("dQ_t without its 1/√a", TILE_SCORES, unscaled, "Q_t", z, exact=False),
        _step("softmax backward A ∘ dA, no row sum", softmax_rows, softmax_without_row_sum,
              "S", z, exact=False, **rows),
        _step("softmax backward's sum over queries τ", softmax_rows,
              softmax_summed_over_queries, "S", z, exact=False, **rows),
        _step("dS = P ∘ dP − D, D outside the product", attention_rows, row_term_outside, "S",
              z, exact=False, **tile),
    ]
