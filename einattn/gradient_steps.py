"""The backward pass's steps: each equation of :mod:`einattn.chunked`'s backward, and the
softmax's backward, is the gradient of its forward, proved by
:func:`einattn.verify.check_gradient`'s sides in the finite field (the forward is
differentiated there, exactly); :func:`einattn.derivation.steps` registers them.

Per tile of queries τ ∈ t and keys σ ∈ b, with ``μ = (g r)``, the forward is equation (2g),
then (3) and (4g) with the tile's names::

    S[n (g r) τ σ]   = Q_t[n (g r) τ a] K_b[n g σ a] / √a           (TILE_SCORES)
    P[n (g r) τ σ]   = softmax_σ(S[n (g r) τ σ])                      (TILE_WEIGHTS)
    Z_t[n (g r) τ a] = P[n (g r) τ σ] V_b[n g σ a]                  (TILE_VALUES)

and the backward, for the cotangent ``dZ_t``, is ``chunked.VALUE_GRADS``, ``PROB_GRADS``,
``QUERY_GRADS``, ``KEY_GRADS`` and, between them, ``dS = P ∘ (dP − D)`` with ``P`` recomputed
as ``exp(S − lse)`` and ``D[n (g r) τ] = Σ_a dZ_t Z_t`` (:data:`ROW_TERM`), which is the softmax
backward ``dS = A ∘ (dA − Σ_σ A ∘ dA)`` with the row sum taken over ``a`` instead of ``σ``.
"""

from __future__ import annotations

from . import chunked
from ._gradient_check import gradient_sides
from ._step import Step
from .chain import Chain
from .notation import Equation

TILE_SCORES = Equation("S[n (g r) τ σ] = Q_t[n (g r) τ a] K_b[n g σ a] / √a")
TILE_WEIGHTS = Equation("P[n (g r) τ σ] = softmax_σ(S[n (g r) τ σ])")
TILE_VALUES = Equation("Z_t[n (g r) τ a] = P[n (g r) τ σ] V_b[n g σ a]")
ROW_TERM = Equation("D[n (g r) τ] = dZ_t[n (g r) τ a] Z_t[n (g r) τ a]")

SOFTMAX_ROWS = Equation("A[n (g r) τ σ] = softmax_σ(S[n (g r) τ σ])")
SOFTMAX_BACKWARD = Equation("dS[n (g r) τ σ] = A[n (g r) τ σ] · (dA[n (g r) τ σ] "
                            "− sum_σ(A[n (g r) τ σ] · dA[n (g r) τ σ]))")
ATTENTION_ROWS = Chain(SOFTMAX_ROWS, "Z_t[n (g r) τ a] = A[n (g r) τ σ] V_b[n g σ a]")


def chunked_score_grads(last: str = "dS[n (g r) τ σ] = P[n (g r) τ σ] · (dP[n (g r) τ σ] "
                                    "− D[n (g r) τ])"):
    """``dS = P ∘ (dP − D)`` as einattn.chunked's backward forms it: ``P = exp(S − lse)``
    recomputed from the scores, ``dP`` by ``PROB_GRADS``, ``D = Σ_a dZ_t Z_t``."""
    return Chain("lse[n (g r) τ] = logsumexp_σ(S[n (g r) τ σ])",
                 "P[n (g r) τ σ] = exp(S[n (g r) τ σ] − lse[n (g r) τ])",
                 chunked.PROB_GRADS, ROW_TERM, last)


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


def _step(name: str, forward, gradient, wrt: str, sizes: dict[str, int]) -> Step:
    """A registered step: autograd's d<wrt> of ``forward`` = ``gradient``, exactly."""
    sides = gradient_sides(forward, gradient, wrt=wrt, sizes=sizes)
    return Step(name, sides.true, sides.claimed, sizes, True, sides.inputs)


def steps(s: dict[str, int]) -> list[Step]:
    """The backward's true steps at :func:`gradient_sizes` of ``s``."""
    z = gradient_sizes(s)
    return [
        _step("backward VALUE_GRADS dV_b = Pᵀ dZ_t is d/dV_b of Z_t = P V_b", TILE_VALUES,
              chunked.VALUE_GRADS, "V_b", z),
        _step("backward PROB_GRADS dP = dZ_t V_bᵀ is d/dP of Z_t = P V_b", TILE_VALUES,
              chunked.PROB_GRADS, "P", z),
        _step("backward QUERY_GRADS dQ_t = dS K_b / √a is d/dQ_t of (2g)", TILE_SCORES,
              chunked.QUERY_GRADS, "Q_t", z),
        _step("backward KEY_GRADS dK_b = dSᵀ Q_t / √a is d/dK_b of (2g)", TILE_SCORES,
              chunked.KEY_GRADS, "K_b", z),
        _step("softmax backward dS = A ∘ (dA − Σ_σ A ∘ dA)", SOFTMAX_ROWS, SOFTMAX_BACKWARD,
              "S", z),
        _step("chunked dS = P ∘ (dP − D), D = Σ_a dZ Z is d/dS of softmax_σ(S) V_b",
              ATTENTION_ROWS, chunked_score_grads(), "S", z),
    ]


def mutations(s: dict[str, int]) -> list[Step]:
    """Plausible wrong backward steps, at the sizes of the true ones."""
    z = gradient_sizes(s)
    tiled = "dV_b[n g σ a] = P[n (r g) τ σ] dZ_t[n (r g) τ a]"
    unscaled = "dQ_t[n (g r) τ a] = dS[n (g r) τ σ] K_b[n g σ a]"
    return [
        _step("dV_b summed over query heads read (r g)", TILE_VALUES, tiled, "V_b", z),
        _step("dQ_t without its 1/√a", TILE_SCORES, unscaled, "Q_t", z),
        _step("softmax backward A ∘ dA, no row sum", SOFTMAX_ROWS,
              "dS[n (g r) τ σ] = A[n (g r) τ σ] · dA[n (g r) τ σ]", "S", z),
        _step("softmax backward's sum over queries τ", SOFTMAX_ROWS,
              "dS[n (g r) τ σ] = A[n (g r) τ σ] · (dA[n (g r) τ σ] "
              "− sum_τ(A[n (g r) τ σ] · dA[n (g r) τ σ]))", "S", z),
        _step("dS = P ∘ dP − D, D outside the product", ATTENTION_ROWS,
              chunked_score_grads("dS[n (g r) τ σ] = P[n (g r) τ σ] · dP[n (g r) τ σ] "
                                  "− D[n (g r) τ]"), "S", z),
    ]
