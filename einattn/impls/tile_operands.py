"""The operands of one call of the tile loops (:mod:`einattn.impls.tiles`): Q, K, V as the
tiles read them, the key or value blocks of a tile per query head, and the memory each tile's
products are written into, reused over the tiles of the call."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch


class Operands(NamedTuple):
    """Q, K, V of one call as the tile loop reads them, in ``acc``: ``q[(n μ) τ a] = Q / √a``
    (the scale applied once), ``k[(n g) σ a]``, ``v[(n g) σ a]``, each contiguous, with
    ``r`` query heads per key head."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    n: int
    heads: int
    r: int
    scale: float
    buffers: dict

    @classmethod
    def of(cls, Q, K, V, acc: torch.dtype) -> Operands:
        n, heads, L_q, a = Q.shape
        scale = 1.0 / math.sqrt(a)
        q = torch.mul(Q.to(acc), scale).reshape(n * heads, L_q, a)
        k, v = (T.to(acc).contiguous().flatten(0, 1) for T in (K, V))
        return cls(q, k, v, n, heads, heads // K.shape[1], scale, {})

    def product(self, slot: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``torch.bmm(x, y)`` into the memory ``slot`` of this call, reused by every tile
        (a new tensor under ``torch.compile``): a tile's few MiB, allocated anew, come back
        from the system page by page (one thread, tiles of 4 × 256 × 1024 scores: 100
        GFLOP/s into new memory, 138 into the same)."""
        if torch.compiler.is_compiling():
            return torch.bmm(x, y)
        size = x.shape[0] * x.shape[1] * y.shape[2]
        memory = self.buffers.get(slot)
        if memory is None or memory.numel() < size:
            memory = self.buffers[slot] = x.new_empty(size)
        return torch.bmm(x, y, out=memory[:size].view(x.shape[0], x.shape[1], y.shape[2]))

    def per_head(self, T: torch.Tensor, s0: int, s1: int) -> torch.Tensor:
        """Keys or values ``[(n g) σ ·]`` of ``[σ0, σ1)`` as ``[(n μ) σ ·]``: a view where
        ``r = 1``, else each group's block copied for its ``r`` heads (a tile's, at most
        ``1 / (2 · τ-block)`` of its products: the whole ``K`` is never repeated)."""
        block = T[:, s0:s1]
        if self.r == 1:
            return block
        g = block.shape[0] // self.n
        return block.unflatten(0, (self.n, g, 1)).expand(-1, -1, self.r, -1, -1).flatten(0, 2)

    def add_grouped(self, total: torch.Tensor, s0: int, s1: int, x, y) -> None:
        """``total[(n g) σ ·][σ0:σ1] += Σ_r x y``: a key or value gradient of the tile, summed
        over the ``r`` query heads of each group (one product into ``total`` where r = 1)."""
        if self.r == 1:
            total[:, s0:s1].baddbmm_(x, y)
            return
        part = torch.bmm(x, y).unflatten(0, (self.n, -1, self.r)).sum(2).flatten(0, 1)
        total[:, s0:s1] += part
