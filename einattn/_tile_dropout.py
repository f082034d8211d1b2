"""Attention dropout on the chunked path, as FlashAttention has it: a mask drawn per tile
from a seed, drawn again identically by the recomputing backward.

Dropout acts on the weights after the softmax, as ``F.dropout(A)`` on the einsum path::

    Z[n μ τ a] = (A[n μ τ σ] ∘ R[n μ τ σ]) V[n μ σ a],   R = ξ / (1 − p),  ξ ~ Bernoulli(1 − p)

so the tiles' running sum ``l`` and the log-sum-exp ``lse`` (the softmax's denominator) use
the weights ``P`` before dropout, and only the running values ``O`` take ``P ∘ R``. The
backward, with ``D[n μ τ] = Σ_a dZ Z`` of the dropped ``Z`` (still ``Σ_σ A dA``)::

    dV_b = (P ∘ R)ᵀ dZ_t,    dP = (dZ_t V_bᵀ) ∘ R,    dS = P ∘ (dP − D)

``R`` of a tile comes from a generator seeded by the call's seed and the tile's corner
``(τ0, σ0)``: the same tile draws the same ``R`` in the forward and the backward, in any
order of tiles, and no ``L_q × L_k`` mask is ever stored. The call's seed is drawn from
torch's default generator, so ``torch.manual_seed`` fixes every mask, and a checkpointed
layer (which restores that generator to recompute its forward) draws the same masks again.
"""

from __future__ import annotations

import dataclasses

import torch

_MASK64 = 2 ** 64 - 1


@dataclasses.dataclass(frozen=True)
class TileDropout:
    """Dropout of probability ``p`` whose masks all follow from ``seed``."""

    p: float
    seed: int

    @classmethod
    def drawn(cls, p: float) -> TileDropout | None:
        """A dropout with a fresh seed from torch's default generator; None for ``p = 0``."""
        if not p:
            return None
        return cls(float(p), int(torch.randint(0, 2 ** 62, ()).item()))

    def weights(self, tile, shape, device, dtype) -> torch.Tensor:
        """``R[n μ τ σ]`` of the tile ``(τ0, τ1, σ0, σ1, …)``, of ``shape``: ``0`` where a
        weight is dropped, ``1 / (1 − p)`` where it is kept."""
        generator = torch.Generator(device=device).manual_seed(
            _tile_seed(self.seed, tile[0], tile[2]))
        kept = torch.rand(shape, generator=generator, device=device) < 1.0 - self.p
        return kept.to(dtype).mul_(1.0 / (1.0 - self.p) if self.p < 1.0 else 0.0)

    def dense(self, tiles, shape, device, dtype) -> torch.Tensor:
        """``R[n μ τ σ]`` whole, from the same draws as ``tiles`` (zero outside them: keys
        the pattern hides, whose weights are zero): what a second derivative reads."""
        R = torch.zeros(shape, dtype=dtype, device=device)
        for tile in tiles:
            t0, t1, s0, s1 = tile[:4]
            R[:, :, t0:t1, s0:s1] = self.weights(tile, (*shape[:2], t1 - t0, s1 - s0),
                                                 device, dtype)
        return R


def _tile_seed(seed: int, t0: int, s0: int) -> int:
    """SplitMix64's finaliser of the call's seed stepped by the tile's corner: corners give
    unrelated seeds, in every bit (torch's CPU generator reads the low 32)."""
    x = (seed + 0x9E3779B97F4A7C15 * ((t0 << 32) + s0 + 1)) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)
