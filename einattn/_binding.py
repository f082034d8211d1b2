"""The pieces of equation (3) bound to one call's sizes and positions: the one place where
that happens, for every call, every impl, the KV cache, the static cache and the ring.

:func:`bind` checks each piece against the call (:meth:`bound`: the documents' ids, ALiBi's
slopes, the sinks), keeps the mask pieces that mask something there (one query aligned
bottom-right under ``Causal()`` sees every key: no piece), orders the terms of the scores
as equation (3) applies them (functions of S such as the cap, then the terms ``B`` added)
and gives the :class:`Pattern` the impls read. The pieces' own faces are in
:mod:`einattn._piece`; a pattern asks them, never their classes.
"""

from __future__ import annotations

import functools
import itertools

import torch

from ._piece import Frame, Grid, grid
from .errors import EinattnError


def bind(pieces, *, n: int, n_heads: int, L_q: int, L_k: int, dtype: torch.dtype,
         device: torch.device, q0=None, k0: int = 0) -> Pattern:
    """The pattern of one call of ``L_q`` queries × ``L_k`` keys: its queries at positions
    ``q0 …`` (default ``L_k − L_q``, the last ones; a 0-d tensor for a static cache's count),
    its keys at ``k0 …``, the pieces checked against it."""
    frame = Frame(n, n_heads, L_q, L_k, L_k - L_q if q0 is None else q0, k0, device)
    return _assembled([piece.bound(frame, dtype) for piece in pieces], frame, dtype)


def _assembled(pieces, frame: Frame, dtype: torch.dtype) -> Pattern:
    """The pattern of ``pieces`` already bound (checked) for ``frame``, or for a whole of
    which ``frame`` is a part: its mask pieces that mask something there, its score terms
    in the order (3) applies them, its sink."""
    if not pieces:
        return Pattern((), (), None, frame, dtype)
    masks, scores, sinks = [], [], None
    for piece in pieces:
        if piece.KIND == "mask":
            masks += [p for p in piece.conjuncts() if not _sees_every_key(p, frame)]
        elif piece.KIND == "score":
            scores.append(piece)
        elif sinks is None:
            sinks = piece.s
        else:
            raise EinattnError("a pattern has one sink logit s[μ] per head: got two (sinks= "
                               "and a Sinks piece, or two Sinks pieces)")
    scores.sort(key=lambda piece: piece.STAGE)  # (3): cap(S), then + B; stable otherwise
    return Pattern(tuple(masks), tuple(scores), sinks, frame, dtype)


def _sees_every_key(piece, frame: Frame) -> bool:
    """Whether a mask piece masks nothing in this call (judged on the call as one tile)."""
    if not piece.static or type(frame.q0) is not int or not frame.L_q or not frame.L_k:
        return False
    q0, k0 = frame.q0, frame.k0
    judge = piece.judge(frame, max(frame.L_q, frame.L_k))
    return judge(q0, q0 + frame.L_q - 1, k0, k0 + frame.L_k - 1)[1]


class Pattern:
    """The pieces of one call's equation (3), bound: the mask pieces (and-ed), the terms
    of the scores in the order they apply, the sink logits ``s[μ]`` (or None), and the
    ``frame`` they are bound to (for scores of ``dtype``). Methods that take ``at`` read it
    as the local indices of :func:`einattn._piece.grid` (a tile's, or FlexAttention's
    scalars) and hand the pieces positions."""

    __slots__ = ("_k0", "_q0", "dtype", "frame", "masks", "scores", "sinks")

    def __init__(self, masks: tuple, scores: tuple, sinks, frame: Frame,
                 dtype: torch.dtype) -> None:
        self.masks, self.scores, self.sinks, self.frame = masks, scores, sinks, frame
        self.dtype = dtype
        self._q0 = None if type(frame.q0) is int and frame.q0 == 0 else frame.q0
        self._k0 = frame.k0 or None

    def with_sinks(self, sinks) -> Pattern:
        return Pattern(self.masks, self.scores, sinks, self.frame, self.dtype)

    def at(self, q0: int, L_q: int, k0: int, L_k: int) -> Pattern:
        """The same pieces at ``L_q`` queries from position ``q0`` and ``L_k`` keys from
        ``k0`` (a pair of the ring's chunks, within this pattern's call), without the sink:
        not checked again, since they were checked against the whole (the documents' ids
        ``d[n σ]`` are the whole sequence's)."""
        f = self.frame
        return _assembled(self.pieces, Frame(f.n, f.n_heads, L_q, L_k, q0, k0, f.device),
                          self.dtype)

    @property
    def pieces(self) -> tuple:
        """The mask pieces and the terms of the scores, to bind again elsewhere."""
        return self.masks + self.scores

    @property
    def only_masks(self) -> bool:
        """Whether the pattern only masks: no score term, no sink."""
        return len(self.scores) == 0 and self.sinks is None  # len: dynamo traces it

    @property
    def additive(self) -> bool:
        """Whether every score term is a bias added to S (no cap) and there is no sink:
        then the pattern is a mask and a bias, which SDPA takes as its float mask."""
        # len(): dynamo traces it (not `not`); `or` spares a call with no score term a generator
        return self.sinks is None and (len(self.scores) == 0
                                       or all(piece.additive for piece in self.scores))

    @property
    def causal_only(self) -> bool:
        """Whether the pattern is the causal rule alone, as many queries as keys at the
        same positions: SDPA's ``is_causal``."""
        f = self.frame
        return (self.only_masks and len(self.masks) == 1 and self.masks[0].is_causal
                and f.L_q == f.L_k and type(f.q0) is int and f.q0 == f.k0)

    def no_dead_row(self, M) -> bool:
        """Whether no query row can be fully masked: no mask ``M``, every mask piece lets a
        query see its own position, which is among the keys, and no score term masks."""
        f = self.frame
        return (M is None and bool(self.masks) and all(p.diagonal for p in self.masks)
                and type(f.q0) is int and f.k0 <= f.q0 and f.q0 + f.L_q <= f.k0 + f.L_k
                and not self.scores_mask)

    @property
    def scores_mask(self) -> bool:
        """Whether a score term may set scores to −∞ itself (a ScoreMod: FlexAttention's way
        to mask), so that a row of logits may be all −∞ with no mask saying so."""
        return not all(piece.finite for piece in self.scores)

    def refusal(self, impl: str) -> str | None:
        """Why ``impl`` cannot run one of the score terms as it is, or None."""
        return next((why for why in (p.tile_refusal(impl, self.frame, self.dtype)
                                     for p in self.scores) if why), None)

    @property
    def key(self):
        """What this call's tiles and BlockMask may be kept and found again under (the
        pieces and the frame), or None where they read data (documents) or a sink."""
        if self.sinks is not None or type(self.frame.q0) is not int \
                or not all(p.static for p in self.masks):
            return None
        return self.masks, self.frame

    def grid(self) -> Grid | None:
        """The local index grid the pieces read, or None where there is no piece."""
        if len(self.masks) + len(self.scores) == 0:  # len: dynamo traces it
            return None
        f = self.frame
        return grid(f.n, f.n_heads, f.L_q, f.L_k, f.device)

    def positions(self, at) -> tuple:
        """``(n, μ, τ', σ')``: the local indices ``at`` as positions."""
        n, mu, tau, sigma = at
        if self._q0 is not None:
            tau = tau + self._q0
        if self._k0 is not None:
            sigma = sigma + self._k0
        return n, mu, tau, sigma

    def allowed(self, at, which=True) -> torch.Tensor | None:
        """The mask pieces and-ed at ``at``: True = may attend (None: no piece); ``which``,
        a tile's set of the pieces that do not allow all of it, evaluates those alone."""
        masks = self.masks if which is True else [self.masks[i] for i in sorted(which)]
        if not masks:
            return None
        n, mu, tau, sigma = self.positions(at)
        ok = masks[0].allowed(n, mu, tau, sigma)
        for piece in masks[1:]:
            ok = ok & piece.allowed(n, mu, tau, sigma)
        return ok

    def bias(self, at) -> torch.Tensor | None:
        """``B`` at ``at``: the additive terms summed (None: no term)."""
        B, where = None, self.positions(at)
        for piece in self.scores:
            B = piece.bias(*where) if B is None else B + piece.bias(*where)
        return B

    def scored(self, S: torch.Tensor, at) -> torch.Tensor:
        """``cap(S) + B`` at ``at`` (S itself without score terms)."""
        where = self.positions(at)
        for piece in self.scores:
            S = piece.score(S, *where)
        return S

    @property
    def tensors(self) -> tuple:
        """What the score terms read that wants a gradient (a ScoreMod's captured tensors),
        in the order :meth:`score_grad` gives their gradients."""
        return tuple(t for piece in self.scores for t in piece.tensors)

    def score_grad(self, S: torch.Tensor, dS: torch.Tensor, at) -> tuple:
        """``(∂L/∂S, ∂L/∂tensors)`` from ``∂L/∂(cap(S) + B)``, the chain rule through the
        terms backwards."""
        where, inputs, grads = self.positions(at), [], ()
        for piece in self.scores:
            inputs.append(S)
            S = piece.score(S, *where)
        for piece, S_in in zip(reversed(self.scores), reversed(inputs), strict=True):
            dS, piece_grads = piece.grads(S_in, dS, *where)
            grads = tuple(piece_grads) + grads
        return dS, grads

    def tiles(self, size: int, cut: bool = False, which: bool = False) -> list:
        """``(τ0, τ1, σ0, σ1, partial)`` (local, ends excluded) for each tile of ``size``
        that the mask pieces leave some key of; ``partial``: not every one. Rows are judged
        only within the pieces' reach (a window's: O(L·w) tiles, not O(L²)); with ``cut``,
        tiles are also cut where a piece says (where documents change: no tile then mixes
        two, and the diagonal's are all that is partial), and a partial tile of
        :data:`REFINED` or more a side is judged again in quarters (a causal diagonal's empty
        quarter is left out: the chunked path's); with ``which``, ``partial`` is the
        set of the pieces that do not allow all of the tile (empty: full). The tiles of a
        pattern of positions alone are kept per pattern, sizes and ``size``."""
        f = self.frame
        if type(f.q0) is not int:  # a static cache's count: known on the device only
            return [(t0, min(t0 + size, f.L_q), s0, min(s0 + size, f.L_k), bool(self.masks))
                    for t0 in range(0, f.L_q, size) for s0 in range(0, f.L_k, size)]
        if self.key is None or torch.compiler.is_compiling():
            cuts = sorted({c for p in self.masks for c in p.cuts(f)}) if cut else None
            return _tiles(self.masks, f, size, cuts, which)
        return _kept_tiles(self.masks, f, size, cut, which)

    def reach(self) -> tuple[int, int, bool]:
        """The keys ``[σ0, σ1)`` (local) that some query may see, and whether the mask
        pieces must be evaluated there (False: every query sees every one of them)."""
        f = self.frame
        if type(f.q0) is not int:
            return 0, f.L_k, bool(self.masks)
        last = f.q0 + f.L_q - 1
        s0, s1 = _local(_reach_of(self.masks, f, f.q0, last), f)
        partial = False
        for piece in self.masks:
            some, every = (False, False) if s1 <= s0 else \
                piece.judge(f, max(f.L_q, f.L_k))(f.q0, last, s0 + f.k0, s1 - 1 + f.k0)
            if not some:
                return s0, s0, False
            partial = partial or not every
        return s0, max(s0, s1), partial

    def band(self) -> int | None:
        """How many keys the last query may see at most, from the pieces' reach (None: no
        bound): a sliding window's ``w``."""
        f = self.frame
        if type(f.q0) is not int or not self.masks:
            return None
        last = f.q0 + f.L_q - 1
        lo, hi = _reach_of(self.masks, f, last, last)
        return None if lo is None or hi is None or hi < lo else hi - lo + 1

    def sees_any(self) -> bool:
        """Whether some query may see some key (the call judged as one tile)."""
        f = self.frame
        if not self.masks or type(f.q0) is not int:
            return True
        size = max(f.L_q, f.L_k, 1)
        return all(p.judge(f, size)(f.q0, f.q0 + f.L_q - 1, f.k0, f.k0 + f.L_k - 1)[0]
                   for p in self.masks)


def _reach_of(masks: tuple, frame: Frame, t0: int, t1: int) -> tuple:
    """The key positions ``(lo, hi)`` the queries ``t0..t1`` may see at most (a side None:
    no bound)."""
    lo = hi = None
    for piece in masks:
        keys = piece.keys(frame, t0, t1)
        if keys is not None:
            if keys[0] is not None:
                lo = keys[0] if lo is None else max(lo, keys[0])
            if keys[1] is not None:
                hi = keys[1] if hi is None else min(hi, keys[1])
    return lo, hi


def _local(reach: tuple, frame: Frame) -> tuple:
    """Key positions ``(lo, hi)`` (ends included, None unbounded) as the local keys
    ``[σ0, σ1)`` among the call's."""
    lo, hi = reach
    s0 = 0 if lo is None else max(0, lo - frame.k0)
    s1 = frame.L_k if hi is None else min(frame.L_k, hi - frame.k0 + 1)
    return s0, s1


def _edges(size: int, length: int, start: int, cuts) -> list:
    """Where tiles of ``size`` begin along ``length`` positions from ``start``, and the cuts
    (positions) within them: local, the end last."""
    edges = set(range(0, length, size)) | {c - start for c in cuts if 0 < c - start < length}
    return [*sorted(edges), length]


REFINED = 256  # a partial tile this large (or larger) a side is judged again in quarters


def _tiles(masks: tuple, frame: Frame, size: int, cuts=None, which: bool = False) -> list:
    """:meth:`Pattern.tiles`; ``cuts`` None: no cut, else the cuts and quarters."""
    judges = [piece.judge(frame, size) for piece in masks]
    rows = _edges(size, frame.L_q, frame.q0, cuts or ())
    cols = _edges(size, frame.L_k, frame.k0, cuts or ())
    tiles = []
    for t0, t1 in itertools.pairwise(rows):
        lo, hi = _local(_reach_of(masks, frame, t0 + frame.q0, t1 - 1 + frame.q0), frame)
        start = sum(c <= lo for c in cols) - 1 if cuts else lo // size  # within reach
        for s0, s1 in itertools.pairwise(cols[start:]):
            if s0 >= hi:
                break
            tile = _judged(masks, judges, frame, (t0, t1, s0, s1))
            if tile is not None and cuts is not None and tile[4] \
                    and min(t1 - t0, s1 - s0) >= REFINED:  # a causal diagonal: 3 quarters
                tiles += _quartered(masks, judges, frame, (t0, t1, s0, s1))
            elif tile is not None:
                tiles.append(tile)
    return tiles if which else [(*t[:4], bool(t[4])) for t in tiles]


def _judged(masks: tuple, judges: list, frame: Frame, tile: tuple):
    """``(τ0', τ1, σ0, σ1, partial pieces)`` of one tile (local, ends excluded; ``τ0'``
    its first row that sees a key), or None where no key of it is seen."""
    t0, t1, s0, s1 = tile
    q0, k0 = frame.q0, frame.k0
    answers = [judge(t0 + q0, t1 - 1 + q0, s0 + k0, s1 - 1 + k0) for judge in judges]
    first = _first_row(masks, t0, s0 + k0, q0)
    if not all(some for some, _ in answers) or first >= t1:
        return None
    return first, t1, s0, s1, frozenset(i for i, (_, every) in enumerate(answers) if not every)


def _quartered(masks: tuple, judges: list, frame: Frame, tile: tuple) -> list:
    """The quarters of a tile that some key of is seen in, each judged."""
    t0, t1, s0, s1 = tile
    tm, sm = (t0 + t1) // 2, (s0 + s1) // 2
    quarters = [(a, b, c, d) for a, b in ((t0, tm), (tm, t1)) for c, d in ((s0, sm), (sm, s1))]
    return [t for t in (_judged(masks, judges, frame, q) for q in quarters) if t is not None]


@functools.lru_cache(maxsize=64)
def _kept_tiles(masks: tuple, frame: Frame, size: int, cut: bool, which: bool) -> list:
    return _tiles(masks, frame, size, () if cut else None, which)


def _first_row(masks: tuple, t0: int, s0: int, q0: int) -> int:
    """The tile's first row: the first query that sees one of its keys (a causal tile's),
    at least ``t0``."""
    first = t0
    for piece in masks:
        row = piece.first_row(s0)
        if row is not None:
            first = max(first, row - q0)
    return first
