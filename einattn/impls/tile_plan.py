"""The plan of the chunked path: which tiles of queries × keys it visits, in what shape, and
the mask each partial tile needs, made once per pattern and size where that can be kept.

A pattern's pieces judge each tile from its bounds (:meth:`einattn._binding.Pattern.tiles`):
empty (never visited), full (no mask work) or partial. Neighbours in a row of tiles run as one
product (:func:`tiles`, up to the area of :data:`SPAN` tiles), and a partial tile's mask is
added to its scores as a bias of 0 and −∞ (:class:`Tile`). Why, measured on one CPU thread
(4 heads, tiles of 4 × 128 × 384 scores):

* evaluating the pieces on a tile's index grid costs about six passes over the tile (the
  window's ``abs``, ``lt``, ``le``, ``and``, the negation, the fill): 5 of a window's 48 ms
  forward at L = 4096. A pattern of positions alone (:attr:`Pattern.key`) gives the same masks
  at every call of the same sizes, and a band's partial tiles repeat (the same mask at every
  diagonal offset), so the plan keeps each distinct mask once (:data:`KEPT_BYTES` at most);
* adding a float bias of the tile's broadcast shape costs 19 µs where ``masked_fill_`` of the
  same bool mask costs 245 µs (its kernel reads the broadcast mask element by element);
* the masks of pieces that read data (documents' ids) are evaluated per tile, as before: where
  documents cut the tiles, no tile mixes two documents, so only the pieces of positions that
  share a tile with them (causal) are partial, and their masks are kept per tile geometry.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from .._binding import Pattern

SPAN = 4  # the widest tile, in key blocks: neighbours in a row of tiles run as one
KEPT_BYTES = 16 * 2 ** 20  # the distinct masks one plan keeps, at most (then: per tile)
_KEPT_TILES = 4096  # masks kept per tile geometry for patterns that read data, at most


class Tile(NamedTuple):
    """One tile ``[τ0, τ1) × [σ0, σ1)`` (local), ``which``: the pieces that do not allow all
    of it (empty: full; True: every piece), and their mask as a bias ``M[n μ τ σ]`` of 0 and
    −∞ to add to its scores and as ``keep``, 1 and 0 to multiply its weights by, or None
    where it is full or evaluated per call; the masks cover the tile's keys from its column
    ``c0`` on (every query sees the keys before it: a causal row's span is partial only in
    its last block, whose mask then costs a quarter of the span's)."""

    t0: int
    t1: int
    s0: int
    s1: int
    which: object
    bias: torch.Tensor | None = None
    keep: torch.Tensor | None = None
    c0: int = 0


def _spans(tiles, block_size: int) -> list:
    """The pattern's tiles with neighbours merged, up to the area of ``SPAN`` tiles (a row of
    ``SPAN`` key blocks; for one decoding query, ``SPAN · block_size`` blocks): fewer, wider
    products (a window's band of keys in one), the same keys visited. Neighbours
    merge where they start at the same query (a causal tile starts at its first row that
    sees one of its keys), so no query meets a key it does not see in the same tile."""
    merged, area = [], SPAN * block_size * block_size  # a few queries: a longer row of keys
    for t0, t1, s0, s1, partial in tiles:
        if merged:
            m0, m1, n0, n1, m_partial = merged[-1]
            if (m0, m1, n1) == (t0, t1, s0) and (t1 - t0) * (s1 - n0) <= area:
                merged[-1] = (t0, t1, n0, s1, m_partial | partial)
                continue
        merged.append((t0, t1, s0, s1, partial))
    return merged


def tiles(pattern, block_size: int) -> list:
    """The tiles ``(τ0, τ1, σ0, σ1, partial)`` the forward and the backward visit."""
    return _spans(pattern.tiles(block_size, cut=True, which=True), block_size)


def plan(pattern, block_size: int, dtype: torch.dtype) -> list[Tile]:
    """:func:`tiles` with each partial tile's mask as a bias of ``dtype`` where it can be
    kept: the whole plan per pattern and size for a pattern of positions alone, else each
    mask of the pieces of positions per tile geometry (none under ``torch.compile``)."""
    if torch.compiler.is_compiling():
        return [Tile(*tile) for tile in tiles(pattern, block_size)]
    key = pattern.key
    if key is not None:
        return _kept_plan(*key, block_size, dtype)
    at = pattern.grid()
    return [Tile(*tile, *_kept_masks(pattern, at, tile, dtype))
            for tile in tiles(pattern, block_size)]


@functools.lru_cache(maxsize=32)
def _kept_plan(masks: tuple, frame, block_size: int, dtype: torch.dtype) -> list[Tile]:
    """The plan of a pattern of positions alone, each distinct mask made once."""
    pattern = Pattern(masks, (), None, frame, dtype)
    at, distinct, kept, planned = pattern.grid(), {}, 0, []
    for tile in tiles(pattern, block_size):
        if not tile[4] or kept > KEPT_BYTES:
            planned.append(Tile(*tile))
            continue
        c0, allowed = _trimmed(_allowed(pattern, at, tile))
        key = (c0, allowed.shape, allowed.numpy(force=True).tobytes())
        if key not in distinct:
            distinct[key] = (*_masks(allowed, dtype), c0)
            kept += 2 * allowed.numel() * torch.finfo(dtype).bits // 8
        planned.append(Tile(*tile, *distinct[key]))
    return planned


_BY_GEOMETRY: dict = {}


def _kept_masks(pattern, at, tile, dtype: torch.dtype) -> tuple:
    """A partial tile's ``(bias, keep, c0)``, kept per tile geometry where every piece that
    does not allow all of it depends on positions alone (None, None, 0: evaluated per call)."""
    which = tile[4]
    if not which or which is True or type(pattern.frame.q0) is not int:
        return None, None, 0
    pieces = tuple(pattern.masks[i] for i in sorted(which))
    if not all(piece.static for piece in pieces):
        return None, None, 0
    key = (pieces, pattern.frame, tile[:4], dtype)
    masks = _BY_GEOMETRY.get(key)
    if masks is None:
        if len(_BY_GEOMETRY) >= _KEPT_TILES:
            _BY_GEOMETRY.clear()
        c0, allowed = _trimmed(_allowed(pattern, at, tile))
        masks = _BY_GEOMETRY[key] = (*_masks(allowed, dtype), c0)
    return masks


def _allowed(pattern, at, tile) -> torch.Tensor:
    """The pieces ``which`` of one tile, True = may attend (the broadcast shape they give)."""
    t0, t1, s0, s1, which = tile
    with torch.inference_mode(False), torch.no_grad():
        return pattern.allowed(at.tile(slice(t0, t1), slice(s0, s1)), which)


def _trimmed(allowed: torch.Tensor) -> tuple[int, torch.Tensor]:
    """``(c0, allowed[..., c0:])``: ``c0`` the leading key columns every query may see (0
    where ``allowed`` broadcasts over the keys)."""
    if allowed.shape[-1] == 1:
        return 0, allowed
    hidden = (~allowed).flatten(0, -2).any(0) if allowed.dim() > 1 else ~allowed
    c0 = int(hidden.int().argmax()) if bool(hidden.any()) else 0
    return c0, allowed[..., c0:]


def _masks(allowed: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``allowed`` as a bias (0 where a key may be seen, −∞ where not) and as ``keep`` (1, 0)."""
    with torch.inference_mode(False):
        keep = allowed.to(dtype)
        return torch.zeros_like(keep).masked_fill_(~allowed, -float("inf")), keep
