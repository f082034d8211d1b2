"""The operands of one call of the tile loops (:mod:`einattn.impls.tiles`): Q, K, V as the
tiles read them, the key or value blocks of a tile per query head, and the memory each tile's
products are written into, reused over the tiles of the call."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch


class Operands(NamedTuple):
    """Q, K, V of one call as the tile loop reads them, in ``acc``: ``q[(n μ) τ a]``,
    ``k[(n g) σ a]``, ``v[(n g) σ a]`` (views of Q, K, V where they are contiguous and in
    ``acc``), with ``r`` query heads per key head; ``scale = 1/√a`` enters the products that
    read ``q`` (a GEMM's ``alpha``, free) where ``Q / √a`` once cost a pass and a tensor."""

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
        q = Q.to(acc).reshape(n * heads, L_q, a)
        k, v = (T.to(acc).contiguous().flatten(0, 1) for T in (K, V))
        return cls(q, k, v, n, heads, heads // K.shape[1], scale, {})

    def product(self, slot: str, x: torch.Tensor, y: torch.Tensor,
                alpha: float = 1.0) -> torch.Tensor:
        """``alpha · x y`` (batched) into the memory ``slot`` of this call, reused by every tile
        (a new tensor under ``torch.compile``): a tile's few MiB, allocated anew, come back
        from the system page by page (one thread, tiles of 4 × 256 × 1024 scores: 100
        GFLOP/s into new memory, 138 into the same)."""
        shape = (x.shape[0], x.shape[1], y.shape[2])
        if torch.compiler.is_compiling():
            out = x.new_empty(shape)
        else:
            memory = self.buffers.get(slot)
            if memory is None or memory.numel() < math.prod(shape):
                memory = self.buffers[slot] = x.new_empty(math.prod(shape))
            out = memory[:math.prod(shape)].view(shape)
        return out.baddbmm_(x, y, beta=0, alpha=alpha)  # beta = 0: out's old numbers unread

    def summing(self) -> torch.Tensor:
        """``v⁺[(n g) σ e] = [v | 1]``: the values with a column of ones, so that ``dZ⁺ v⁺ᵀ``
        with ``dZ⁺ = [dZ | −D]`` is ``dZ Vᵀ − D`` (PROB_GRADS with the ``D`` of ``dS = P ∘
        (dP − D)`` in one product); made once per call. (The forward's ``P v⁺ = [P V | Σ_σ
        P]`` would save its sum's pass too, but a product 65 wide costs what the pass does.)"""
        ones = self.buffers.get("v+")
        if ones is None:
            ones = self.buffers["v+"] = torch.cat(
                [self.v, self.v.new_ones((*self.v.shape[:2], 1))], dim=-1)
        return ones

    def per_head(self, T: torch.Tensor, s0: int, s1: int) -> torch.Tensor:
        """Keys or values ``[(n g) σ ·]`` of ``[σ0, σ1)`` as ``[(n μ) σ ·]``: a view where
        ``r = 1``, else each group's block copied for its ``r`` heads (a tile's, at most
        ``1 / (2 · τ-block)`` of its products: the whole ``K`` is never repeated)."""
        block = T[:, s0:s1]
        if self.r == 1:
            return block
        g = block.shape[0] // self.n
        return block.unflatten(0, (self.n, g, 1)).expand(-1, -1, self.r, -1, -1).flatten(0, 2)

    def add_grouped(self, target: torch.Tensor, x, y, alpha: float = 1.0) -> None:
        """``target[(n g) · ·] += alpha Σ_r x y``: a tile's key or value gradient summed over
        the ``r`` query heads of each group (one product into ``target`` where r = 1)."""
        if self.r == 1:
            target.baddbmm_(x, y, alpha=alpha)
            return
        target.add_(torch.bmm(x, y).unflatten(0, (self.n, -1, self.r)).sum(2).flatten(0, 1),
                    alpha=alpha)
