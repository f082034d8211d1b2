"""qk-norm: queries and keys normalised by their root mean square before the scores.

Qwen3, Gemma 3 and Qwen3-Next normalise each head's channels ``a`` (``over="head"``), OLMo 2
every head's channels of a token together (``over="heads"``), all of them before RoPE;
Llama 4 after RoPE and without a gain. With ``ν`` the mean square over the channels
normalised and ``ε`` the norm's own::

    (QK1) Q̂[n μ τ a] = γ_Q[a]   · Q[n μ τ a] / √(Σ_a Q[n μ τ a]² / d_a + ε)          per head
    (QK2) Q̂[n μ τ a] = γ_Q[μ a] · Q[n μ τ a] / √(Σ_μ Σ_a Q[n μ τ a]² / (d_μ d_a) + ε)  over heads

and the keys alike, ``K̂[n g σ a]`` with their own ``γ_K[a]`` (``γ_K[g a]``). The gain is
``γ`` (``gain="gamma"``), ``1 + γ`` (``"1+gamma"``: Gemma 3, Qwen3-Next, whose γ start at
0) or none (``None``: Llama 4's, whose module is named an L2 norm and computes this RMS
norm). The norm runs in float32 for float16 and bfloat16 inputs, its result cast back before
the gain, as the models' own do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import EinattnError

OVER = ("head", "heads")
GAINS = ("gamma", "1+gamma", None)
LATEX = {  # (QK1), (QK2) as the docs show them; torch code in normalised()
    "head": r"\hat{Q}_{n \mu \tau a} = (\gamma_{Q})_{a} \, \frac{Q_{n \mu \tau a}}{\sqrt{"
            r"\frac{1}{d_a} \sum_{a'} Q_{n \mu \tau a'}^{2} + \epsilon}}",
    "heads": r"\hat{Q}_{n \mu \tau a} = (\gamma_{Q})_{\mu a} \, \frac{Q_{n \mu \tau a}}{"
             r"\sqrt{\frac{1}{d_{\mu} d_a} \sum_{\mu' a'} Q_{n \mu' \tau a'}^{2} + \epsilon}}",
}


@dataclass(frozen=True)
class QKNorm:
    """How queries and keys are normalised: ``over`` each head's channels or every head's
    together, the ``gain`` (``"gamma"``, ``"1+gamma"`` or None), the norm's ``eps``, and
    whether it comes ``after_rope`` (Llama 4) or before (the others)."""

    over: str = "head"
    gain: str | None = "gamma"
    eps: float = 1e-6
    after_rope: bool = False

    def __post_init__(self) -> None:
        if self.over not in OVER:
            raise EinattnError(f"QKNorm's over must be 'head' (each head's channels a) or "
                               f"'heads' (every head's channels (μ a) together), got "
                               f"{self.over!r}")
        if self.gain not in GAINS:
            raise EinattnError(f"QKNorm's gain must be 'gamma', '1+gamma' or None, got "
                               f"{self.gain!r}")
        eps = self.eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < 1:
            raise EinattnError(f"QKNorm's eps (ε under the root) must be a number in [0, 1), "
                               f"got {eps!r}")
        if not isinstance(self.after_rope, bool):
            raise EinattnError(f"QKNorm's after_rope must be True or False, got "
                               f"{self.after_rope!r}")


def shapes(norm: QKNorm | None, n_heads: int, n_kv_heads: int, d_head: int) -> dict:
    """The gains a layer holds: ``gamma_Q[a]`` and ``gamma_K[a]`` per head, ``gamma_Q[μ a]``
    and ``gamma_K[g a]`` over heads; none without a gain."""
    if norm is None or norm.gain is None:
        return {}
    if norm.over == "head":
        return {"gamma_Q": (d_head,), "gamma_K": (d_head,)}
    return {"gamma_Q": (n_heads, d_head), "gamma_K": (n_kv_heads, d_head)}


def initial(norm: QKNorm) -> float:
    """The gains' first value: the norm alone, γ = 1 (or 0 under ``1 + γ``)."""
    return 0.0 if norm.gain == "1+gamma" else 1.0


def normalised(T: torch.Tensor, gamma: torch.Tensor | None, norm: QKNorm) -> torch.Tensor:
    """(QK1) or (QK2) on ``T[n μ τ a]`` (queries or keys) with its gain ``gamma``."""
    work = T.float() if T.dtype in (torch.float16, torch.bfloat16) else T
    axes = (-1,) if norm.over == "head" else (1, -1)
    T_hat = (work * torch.rsqrt(work.pow(2).mean(axes, keepdim=True) + norm.eps)).to(T.dtype)
    if norm.gain is None:
        return T_hat
    if gamma is None:
        raise EinattnError("this attention normalises queries and keys with a gain γ, but "
                           "its weights hold no gamma_Q or gamma_K (a layer whose weights are "
                           "sharded or substituted must hand them on)")
    gain = gamma if norm.over == "head" else gamma[:, None, :]  # γ[μ a] over τ
    return T_hat * (1 + gain if norm.gain == "1+gamma" else gain)


def applied(Q: torch.Tensor, K: torch.Tensor, w: dict, norm: QKNorm):
    """Q̂ and K̂: each normalised with its own gain (``w["gamma_Q"]``, ``w["gamma_K"]``)."""
    return (normalised(Q, w.get("gamma_Q"), norm), normalised(K, w.get("gamma_K"), norm))
