"""What the chunked backward (:mod:`einattn.impls.tiles`) accumulates over the tiles of one
call: the gradients of Q, K, V (a float mask's, the score terms' tensors'), in the layout
their products write fastest, and handed back in the layout of Q, K, V."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tile_operands import Operands

WIDE_ROWS = 256  # tiles of at least this many queries keep dK, dV transposed (Grads)


@dataclass
class Grads:
    """``dQ[(n μ) τ a]``, ``dK``, ``dV`` ``[(n g) σ a]`` (``[(n g) a σ]`` where
    ``transposed``), a float mask's ``dM``, the score terms' ``dT``.

    Transposed, a tile's ``dV += Pᵀ dZ`` is ``dVᵀ += dZᵀ P``, a product writing rows of the
    tile's keys where the other wrote a column of ``a`` per key: one thread, tiles of 4 × 256
    × 1024 scores, 114 → 132 GFLOP/s, 4 × 256 × 512: 117 → 133; at 4 × 128 × 384 (a
    window's) both 119, where laying them out again at the end costs more than it saves."""

    dQ: torch.Tensor | None
    dK: torch.Tensor | None
    dV: torch.Tensor | None
    dM: torch.Tensor | None
    dT: list
    transposed: bool

    @classmethod
    def zeros(cls, op: Operands, mask, tensors, transposed: bool) -> Grads:
        """Zeros for each gradient (``dM`` where ``mask`` is given), contiguous."""
        dQ, dK, dV, dM = (None if x is None else torch.zeros_like(
            x, memory_format=torch.contiguous_format) for x in (op.q, *(
                y.transpose(1, 2) if transposed else y for y in (op.k, op.v)), mask))
        return cls(dQ, dK, dV, dM, [torch.zeros_like(t) for t in tensors], transposed)

    def add_keys(self, op: Operands, total: torch.Tensor, s0: int, s1: int, X, Y,
                 alpha: float = 1.0) -> None:
        """``total[σ0:σ1] += alpha Σ_r Xᵀ Y`` for ``total`` = dK or dV, ``X`` the tile's
        ``[(n μ) τ σ]``, ``Y`` its rows ``[(n μ) τ ·]`` (``Yᵀ X`` where transposed)."""
        if self.transposed:
            op.add_grouped(total[:, :, s0:s1], Y.transpose(1, 2), X, alpha)
        else:
            op.add_grouped(total[:, s0:s1], X.transpose(1, 2), Y, alpha)

    def shaped(self, Q, K, V) -> tuple[torch.Tensor, ...]:
        """``dQ, dK, dV`` in the shapes and dtypes of ``Q, K, V``, contiguous, each let go of
        here once laid out (a transposed one is copied: one copy alive at a time, 8 MiB at
        L = 8192 rather than 16)."""
        out = []
        for name, T in (("dQ", Q), ("dK", K), ("dV", V)):
            d = getattr(self, name)
            setattr(self, name, None)
            d = d.transpose(1, 2) if self.transposed and name != "dQ" else d
            out.append(d.reshape(T.shape).to(T.dtype, memory_format=torch.contiguous_format)
                       .contiguous())
            del d  # the accumulator, free before the next copy
        return tuple(out)
