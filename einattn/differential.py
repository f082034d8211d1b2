"""Differential attention (DiffLlama, the Differential Transformer): two softmaxes over the
same keys, the second subtracted from the first with a learned weight λ, then a norm.

The ``μ`` query heads are two halves, ``μ = (δ q r)`` with ``δ`` (which softmax) slowest,
and so are the key/value groups, ``g = (δ q)``; a differential head is ``(q r)``. Its two
softmaxes are those of query heads ``(0 q r)`` and ``(1 q r)``, each over its own keys; both
weigh the same values, the pair of value heads ``(0 q)`` and ``(1 q)`` side by side, so that
a differential head is ``c = (e b)`` = 2b wide::

    (D1) λ[]            = exp(λ_q1[a] λ_k1[a]) − exp(λ_q2[a] λ_k2[a]) + λ_init
    (D2) V_P[n (δ q) σ (e b)] = V[n (e q) σ b]                       (the same for δ = 0, 1)
    (D3) Z[n (δ q r) τ c] = A[n (δ q r) τ σ] V_P[n (δ q) σ c]       equations (2)–(4), GQA
    (D4) Z_D[n (q r) τ c] = Z_1[n (q r) τ c] − λ · Z_2[n (q r) τ c]   Z_1, Z_2: δ = 0, 1
    (D5) N[n (q r) τ c]   = (1 − λ_init) · Z_D[n (q r) τ c] / √(Σ_c Z_D² / d_c + ε)
    (5)  Y[n τ i]        = N[n μ τ c] W_O[μ c i]                      over the (q r) heads

(D4) is ``(A_1 − λ A_2) V_P``: the difference of the weights is the difference of their
outputs, so (D3) runs on any impl, which never sees λ. ``λ_init = 0.8 − 0.6 · exp(−0.3 ·
layer index)`` (:func:`lambda_init`) is fixed per layer; the four ``λ`` vectors are learned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from einops import rearrange

from .errors import EinattnError
from .notation import Equation

LAMBDA = Equation("λ[] = exp(λ_q1[a] λ_k1[a]) − exp(λ_q2[a] λ_k2[a]) + λ_init")  # (D1)
DIFFERENCE = Equation("Z_D[n (q r) τ c] = Z_1[n (q r) τ c] − λ · Z_2[n (q r) τ c]")  # (D4)
LAMBDAS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")
NORM_LATEX = (  # (D5) as the docs show it; torch code in combined()
    r"N_{n (q r) \tau c} = (1 - \lambda_{\mathrm{init}}) \, \frac{(Z_{D})_{n (q r) \tau c}}"
    r"{\sqrt{\frac{1}{d_c} \sum_{c'} (Z_{D})_{n (q r) \tau c'}^{2} + \epsilon}}")


@dataclass(frozen=True)
class Differential:
    """Differential attention's fixed numbers: ``lambda_init`` (λ_init of (D1) and (D5)) and
    the ``eps`` of (D5)'s norm."""

    lambda_init: float
    eps: float = 1e-5

    def __post_init__(self) -> None:
        for name, value in (("lambda_init", self.lambda_init), ("eps", self.eps)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or (name == "eps" and not 0 <= value < 1):
                raise EinattnError(f"Differential's {name} must be a finite number"
                                   f"{' in [0, 1)' if name == 'eps' else ''}, got {value!r}")


def lambda_init(layer_index: int) -> float:
    """``λ_init = 0.8 − 0.6 · exp(−0.3 · layer_index)``, the layer's (0-based) as DiffLlama
    and the Differential Transformer set it.

    >>> round(lambda_init(2), 6)
    0.470713
    """
    return 0.8 - 0.6 * math.exp(-0.3 * layer_index)


def check_heads(n_heads: int, n_kv_heads: int) -> None:
    """The heads and groups of a differential layer split into the two halves δ."""
    if n_heads % 2 or n_kv_heads % 2:
        raise EinattnError(f"differential attention splits the heads and the key/value groups "
                           f"into two halves δ (μ = (δ q r), g = (δ q)): n_heads={n_heads} and "
                           f"n_kv_heads={n_kv_heads} must both be even")


def shapes(differential: Differential | None, d_head: int) -> dict:
    """The four learned vectors ``λ_q1[a]``, ``λ_k1[a]``, ``λ_q2[a]``, ``λ_k2[a]``."""
    return {} if differential is None else {name: (d_head,) for name in LAMBDAS}


def value_pairs(V: torch.Tensor) -> torch.Tensor:
    """(D2): ``V_P[n (δ q) σ (e b)] = V[n (e q) σ b]``, each group's pair of value heads side
    by side, the same for both halves δ."""
    pairs = rearrange(V, "n (e q) σ b -> n q σ (e b)", e=2)
    return torch.cat([pairs, pairs], dim=1)


def weight(w: dict, differential: Differential) -> torch.Tensor:
    """(D1): ``λ[] = exp(λ_q1[a] λ_k1[a]) − exp(λ_q2[a] λ_k2[a]) + λ_init``, from the four
    vectors in ``w``."""
    given = [w.get(name) for name in LAMBDAS]
    if any(t is None for t in given):
        raise EinattnError("this attention is differential, but its weights hold no "
                           "lambda_q1, lambda_k1, lambda_q2, lambda_k2 (a layer whose weights "
                           "are sharded or substituted must hand them on)")
    q1, k1, q2, k2 = given
    return LAMBDA(λ_q1=q1, λ_k1=k1, λ_q2=q2, λ_k2=k2, λ_init=differential.lambda_init)


def combined(Z: torch.Tensor, lam: torch.Tensor, differential: Differential,
             n_kv_heads: int) -> dict:
    """(D4) and (D5): ``Z_D`` and ``N`` of the ``(q r)`` differential heads from
    ``Z[n (δ q r) τ c]`` (``n_kv_heads`` groups ``(δ q)``), its halves ``Z_1`` and ``Z_2``
    (δ = 0, 1): ``Z_D[n (q r) τ c] = Z_1[n (q r) τ c] − λ · Z_2[n (q r) τ c]``."""
    Z_1, Z_2 = Z.chunk(2, dim=1)
    Z_D = DIFFERENCE(Z_1=Z_1, Z_2=Z_2, λ=lam, q=n_kv_heads // 2)
    work = Z_D.float() if Z_D.dtype in (torch.float16, torch.bfloat16) else Z_D
    N = work * torch.rsqrt(work.pow(2).mean(-1, keepdim=True) + differential.eps)
    return {"Z_D": Z_D, "N": (1 - differential.lambda_init) * N.to(Z_D.dtype)}


def weights(A: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """The differential heads' weights as applied, ``A_D = A_1 − λ A_2`` (``(D4)`` before
    the values)."""
    A_1, A_2 = A.chunk(2, dim=1)
    return A_1 - lam * A_2
