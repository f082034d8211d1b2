"""Attention patterns: the terms of equation (3) besides the scores and the user's mask.

    A[n μ τ σ] = softmax_σ( cap(S[n μ τ σ]) + B[μ τ σ] + M[n μ τ σ] )     (3)

with, optionally, a sink logit ``s_μ`` in the softmax's denominator. ``τ' = τ + L_k − L_q``
is query τ's position among the keys (bottom-right alignment, as ``causal`` has it).

Each pattern is one piece below, and each piece has its four faces together:

* ``LATEX``: its case formula, as docs/derivation.md shows it;
* one function of the indices, ``allowed(n, μ, τ, σ)`` for a piece of the mask ``M`` or
  ``score(S, n, μ, τ, σ)`` for a term of the scores, written in torch operations only, so
  that the same function gives the dense form (on broadcast ``arange`` grids), one tile's
  form (on the tile's grids) and FlexAttention's ``mask_mod`` / ``score_mod`` (on the
  scalars FlexAttention maps it over);
* ``judge(size)``: for a tile of queries × keys, from its first and last indices (and, for
  documents, each block's least and greatest id), whether some key may be seen and
  whether every one is, so that the chunked path skips the empty tiles and the mask work
  on the full ones.

A new pattern (a prefix-LM mask, relative-position buckets) is one more class with these
faces, and one line in :func:`build` that adds it from its option.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .errors import EinattnError
from .masks import alibi_slopes
from .notation import Equation


class Grid(NamedTuple):
    """The indices ``n, μ, τ, σ`` as integer tensors shaped to broadcast to
    ``(n, μ, τ, σ)``; :meth:`tile` takes one tile's rows and columns."""

    n: torch.Tensor
    mu: torch.Tensor
    tau: torch.Tensor
    sigma: torch.Tensor

    def tile(self, tau: slice, sigma: slice) -> Grid:
        return Grid(self.n, self.mu, self.tau[:, :, tau], self.sigma[:, :, :, sigma])


# -- pieces of the mask M: a predicate over (n, μ, τ, σ) --------------------------------------


@dataclass(frozen=True)
class Causal:
    """Query τ sees the keys up to its own position: ``σ ≤ τ'``."""

    shift: int  # L_k − L_q
    LATEX = r"M^{\text{causal}}_{\tau\sigma} = \begin{cases} 0 & \sigma \le \tau' \\ -\infty & \text{otherwise} \end{cases}"  # noqa: E501

    def allowed(self, n, mu, tau, sigma):
        return sigma <= tau + self.shift

    def judge(self, size: int):
        return self.block

    def block(self, t0: int, t1: int, s0: int, s1: int) -> tuple[bool, bool]:
        """For the tile of queries ``t0..t1`` × keys ``s0..s1`` (last ones included):
        whether some key may be seen, and whether every one is."""
        return s0 <= t1 + self.shift, s1 <= t0 + self.shift

    def keys(self, t0: int, t1: int) -> tuple[int, int]:
        """The keys that the queries ``t0..t1`` may see lie in this range (ends included)."""
        return 0, t1 + self.shift

    def first_row(self, sigma0: int) -> int:
        """The first query that sees key ``σ0``: a tile's rows above it see none of its keys."""
        return sigma0 - self.shift


@dataclass(frozen=True)
class Window:
    """A sliding window of ``w`` keys: with ``causal``, ``τ' − w < σ`` (the causal piece
    bounds it above: w keys, τ' itself included); without, ``|τ' − σ| < w``."""

    w: int
    shift: int
    causal: bool
    LATEX = r"M^{\text{window}}_{\tau\sigma} = \begin{cases} 0 & \tau' - \sigma < w \text{ with causal, } |\tau' - \sigma| < w \text{ without} \\ -\infty & \text{otherwise} \end{cases}"  # noqa: E501

    def allowed(self, n, mu, tau, sigma):
        d = tau + self.shift - sigma  # how far key σ lies behind query τ'
        return d < self.w if self.causal else d.abs() < self.w

    def judge(self, size: int):
        return self.block

    def keys(self, t0: int, t1: int) -> tuple[int, int]:
        return t0 + self.shift - self.w + 1, t1 + self.shift + (0 if self.causal else self.w - 1)

    def block(self, t0: int, t1: int, s0: int, s1: int) -> tuple[bool, bool]:
        near, far = t0 + self.shift - s1, t1 + self.shift - s0  # the least and greatest d
        if self.causal:
            return near < self.w, far < self.w
        return near < self.w and far > -self.w, far < self.w and near > -self.w


@dataclass(frozen=True, eq=False)
class Documents:
    """Packed sequences: τ sees σ only within its own document, ``d[n τ'] = d[n σ]``."""

    ids: torch.Tensor  # d[n σ], one id per key; the queries' are the last L_q
    shift: int
    LATEX = r"M^{\text{doc}}_{n\tau\sigma} = \begin{cases} 0 & d_{n\tau'} = d_{n\sigma} \\ -\infty & \text{otherwise} \end{cases}"  # noqa: E501

    def allowed(self, n, mu, tau, sigma):
        return self.ids[n, tau + self.shift] == self.ids[n, sigma]

    def judge(self, size: int):
        """Per tile: empty where no two ids of its rows and columns can be equal (their
        ranges lie apart, for every n); full where all of them are one id. Under
        ``torch.compile``, which cannot read the ids' values, every tile is partial."""
        if torch.compiler.is_compiling():
            return _partial
        q_lo, q_hi = _block_range(self.ids[:, self.shift:], size)  # (n, T_q)
        k_lo, k_hi = _block_range(self.ids, size)  # (n, T_k)
        q_lo, q_hi, k_lo, k_hi = q_lo[:, :, None], q_hi[:, :, None], k_lo[:, None], k_hi[:, None]
        some = ((q_lo <= k_hi) & (k_lo <= q_hi)).any(0).tolist()
        every = ((q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo)).all(0).tolist()
        return lambda t0, t1, s0, s1: (some[t0 // size][s0 // size],
                                       every[t0 // size][s0 // size])


def _partial(t0: int, t1: int, s0: int, s1: int) -> tuple[bool, bool]:
    return True, False


def _block_range(ids: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The least and the greatest id in each block of ``size`` positions, ``(n, blocks)``."""
    n, L = ids.shape
    short = -L % size
    if short:  # the last block's own last id fills it up
        ids = torch.cat([ids, ids[:, -1:].expand(n, short)], dim=1)
    blocks = ids.view(n, -1, size)
    return blocks.amin(-1), blocks.amax(-1)


# -- terms of the scores: cap(S) and B -----------------------------------------------------------


@dataclass(frozen=True)
class Softcap:
    """Logit softcapping (Gemma 2): ``cap(S) = c · tanh(S / c)``, on the scaled scores."""

    c: float
    CAP = Equation("C[n μ τ σ] = c · tanh(S[n μ τ σ] / c)")  # C = cap(S)
    LATEX = CAP.latex()
    ADDITIVE = False  # a function of S, not a term added to it

    def score(self, S, n, mu, tau, sigma):
        if S.ndim == 4:  # the dense form and a tile's: S[n μ τ σ]
            return self.CAP(S=S, c=self.c)
        return self.c * torch.tanh(S / self.c)  # FlexAttention's scalars: CAP's arithmetic

    def grad(self, S, dS):
        """``∂L/∂S`` from ``∂L/∂cap(S)``: ``dS · (1 − tanh²(S / c))``."""
        return dS * (1 - torch.tanh(S / self.c) ** 2)


@dataclass(frozen=True, eq=False)
class ALiBi:
    """Attention with linear biases (BLOOM, MPT): ``B[μ τ σ] = −m_μ · |τ' − σ|``."""

    slopes: torch.Tensor  # m[μ]
    shift: int
    LATEX = r"B_{\mu\tau\sigma} = -m_\mu \left|\tau' - \sigma\right|"
    ADDITIVE = True  # S + B: SDPA takes B as its float mask

    def score(self, S, n, mu, tau, sigma):
        return S + self.bias(n, mu, tau, sigma)

    def bias(self, n, mu, tau, sigma):
        return -self.slopes[mu] * (tau + self.shift - sigma).abs()

    def grad(self, S, dS):
        return dS


# -- the sink: one more logit in the softmax's denominator ---------------------------------------

# The definition; it runs as einattn._softmax.with_sink, which never overflows (tests check
# the two agree): S is the logits cap(S) + B + M, s[μ] the sink.
SINK = Equation("A[n μ τ σ] = exp(S[n μ τ σ]) / (exp(s[μ]) + sum_σ(exp(S[n μ τ σ])))")
SINK_LATEX = SINK.latex()


@dataclass(frozen=True, eq=False)
class Pattern:
    """The pieces of one call's equation (3): mask pieces, score terms in the order they
    apply (the cap, then B), and the sink logits ``s[μ]`` (or None)."""

    masks: tuple = ()
    scores: tuple = ()
    sinks: torch.Tensor | None = None

    @property
    def only_masks(self) -> bool:
        """Whether the pattern only masks: no score term, no sink."""
        return len(self.scores) == 0 and self.sinks is None

    @property
    def learned_slopes(self) -> bool:
        """Whether ALiBi's slopes are a tensor that wants a gradient (learned slopes)."""
        return torch.is_grad_enabled() and any(
            isinstance(piece, ALiBi) and piece.slopes.requires_grad for piece in self.scores)

    @property
    def additive(self) -> bool:
        """Whether every score term is a bias added to S (no cap) and there is no sink:
        then the pattern is a mask and a bias, which SDPA takes as its float mask."""
        return self.sinks is None and all(piece.ADDITIVE for piece in self.scores)

    def bias(self, at: Grid) -> torch.Tensor | None:
        """``B`` at the indices ``at``: the additive terms summed (None: no term)."""
        B = None
        for piece in self.scores:
            B = piece.bias(*at) if B is None else B + piece.bias(*at)
        return B

    @property
    def causal_only(self) -> bool:
        return self.only_masks and len(self.masks) == 1 and isinstance(self.masks[0], Causal)

    def allowed(self, at: Grid) -> torch.Tensor | None:
        """The mask pieces and-ed at the indices ``at``: True = may attend (None: no piece)."""
        ok = None
        for piece in self.masks:
            here = piece.allowed(*at)
            ok = here if ok is None else ok & here
        return ok

    def scored(self, S: torch.Tensor, at: Grid) -> torch.Tensor:
        """``cap(S) + B`` at the indices ``at`` (S itself without score terms)."""
        for piece in self.scores:
            S = piece.score(S, *at)
        return S

    def score_grad(self, S: torch.Tensor, dS: torch.Tensor, at: Grid) -> torch.Tensor:
        """``∂L/∂S`` from ``∂L/∂(cap(S) + B)``, the chain rule through the terms backwards."""
        inputs = []
        for piece in self.scores:
            inputs.append(S)
            S = piece.score(S, *at)
        for piece, S_in in zip(reversed(self.scores), reversed(inputs), strict=True):
            dS = piece.grad(S_in, dS)
        return dS

    def tiles(self, L_q: int, L_k: int, size: int):
        """``(τ0, τ1, σ0, σ1, partial)`` for each tile of queries ``[τ0, τ1)`` × keys
        ``[σ0, σ1)`` that the mask pieces leave some key of; ``partial``: not every one.
        A window's rows are judged only within its reach: O(L·w) tiles, not O(L²)."""
        judges = [piece.judge(size) for piece in self.masks]
        causal = next((piece for piece in self.masks if isinstance(piece, Causal)), None)
        ranges = [piece.keys for piece in self.masks if hasattr(piece, "keys")]
        tiles = []
        for t0 in range(0, L_q, size):
            t1 = min(t0 + size, L_q)
            lo, hi = 0, L_k - 1  # only the key blocks within every piece's reach are judged
            for keys in ranges:
                piece_lo, piece_hi = keys(t0, t1 - 1)
                lo, hi = max(lo, piece_lo), min(hi, piece_hi)
            for s0 in range(lo // size * size, hi + 1, size):
                s1 = min(s0 + size, L_k)
                some, every = True, True
                for judge in judges:
                    piece_some, piece_every = judge(t0, t1 - 1, s0, s1 - 1)
                    some, every = some and piece_some, every and piece_every
                if some:  # a causal tile starts at its first row that sees one of its keys
                    first = t0 if causal is None else max(t0, causal.first_row(s0))
                    tiles.append((first, t1, s0, s1, not every))
        return tiles


def grid(n: int, n_heads: int, L_q: int, L_k: int, device) -> Grid:
    """Every index of ``S[n μ τ σ]``, each on its own axis (made once per sizes and device
    outside ``torch.compile``: four ``arange`` cost 15 µs, a small part of a short call)."""
    if torch.compiler.is_compiling():
        return _grid(n, n_heads, L_q, L_k, device)
    return _cached_grid(n, n_heads, L_q, L_k, torch.device(device or "cpu"))


def _grid(n: int, n_heads: int, L_q: int, L_k: int, device) -> Grid:
    def along(size: int, axis: int) -> torch.Tensor:
        shape = [1, 1, 1, 1]
        shape[axis] = size
        return torch.arange(size, device=device).view(shape)
    return Grid(along(n, 0), along(n_heads, 1), along(L_q, 2), along(L_k, 3))


@functools.lru_cache(maxsize=64)
def _cached_grid(n: int, n_heads: int, L_q: int, L_k: int, device) -> Grid:
    with torch.inference_mode(False):  # ordinary tensors, whatever mode made them first
        return _grid(n, n_heads, L_q, L_k, device)


def build(*, n: int, n_heads: int, L_q: int, L_k: int, dtype: torch.dtype, device,
          causal: bool = False, window=None, softcap=None, alibi=False, sinks=None,
          document_ids=None) -> Pattern:
    """The pattern of one call, its options checked (each error names its option)."""
    shift, device = L_k - L_q, torch.device(device)
    masks = []
    if causal and L_q > 1:  # one query aligned bottom-right sees every key
        masks.append(Causal(shift))
    if window is not None:
        masks.append(Window(check_window(window), shift, bool(causal)))
    if document_ids is not None:
        masks.append(Documents(_checked_ids(document_ids, n, L_q, L_k, device), shift))
    scores = []
    if softcap is not None:
        scores.append(Softcap(check_softcap(softcap)))
    if alibi is not None and alibi is not False:  # slopes in at least float32, as S is
        slopes = _checked_slopes(alibi, n_heads, torch.promote_types(dtype, torch.float32),
                                 device)
        scores.append(ALiBi(slopes, shift))
    if sinks is not None:
        sinks = _checked_sinks(sinks, n_heads, device)
    return Pattern(tuple(masks), tuple(scores), sinks)


def check_window(window) -> int:
    """``window`` itself, once it is known to be an int ≥ 1."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise EinattnError(f"window (the number of keys σ a query τ sees, itself included) "
                           f"must be an int ≥ 1, got {window!r}")
    return window


def check_softcap(softcap) -> float:
    """``softcap`` itself, once it is known to be a finite number > 0."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) \
            or not 0 < softcap < math.inf:
        raise EinattnError(f"softcap (c in cap(S) = c · tanh(S / c)) must be a finite number "
                           f"> 0, got {softcap!r}")
    return float(softcap)


def _checked_ids(ids, n: int, L_q: int, L_k: int, device) -> torch.Tensor:
    if L_q > L_k:
        raise EinattnError(f"document_ids needs the queries among the keys (L_q ≤ L_k, the "
                           f"queries being the last L_q): got L_q={L_q} queries and "
                           f"L_k={L_k} keys")
    if not isinstance(ids, torch.Tensor) or ids.shape != (n, L_k):
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise EinattnError(f"document_ids has shape {shape} but must be (n, σ) = ({n}, {L_k}): "
                           f"one document id d[n σ] per key (the queries' are the last "
                           f"L_q={L_q})")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise EinattnError(f"document_ids must hold integers (one id per document), got "
                           f"{ids.dtype}")
    if ids.device != device:
        raise EinattnError(f"document_ids is on {ids.device} but the scores are on {device}")
    return ids


def _checked_slopes(alibi, n_heads: int, dtype: torch.dtype, device) -> torch.Tensor:
    """``m[μ]``: BLOOM's slopes for ``alibi=True``, or the given tensor checked."""
    if alibi is True:
        return alibi_slopes(n_heads, dtype=dtype, device=device)
    what = "True (BLOOM's slopes) or a float tensor of slopes m[μ]"
    return _per_head(alibi, "alibi", what, n_heads, device).to(dtype)


def _checked_sinks(sinks, n_heads: int, device) -> torch.Tensor:
    return _per_head(sinks, "sinks", "a float tensor of sink logits s[μ]", n_heads, device)


def _per_head(t, name: str, what: str, n_heads: int, device) -> torch.Tensor:
    """``t`` itself, once it is a float tensor of one value per head on ``device``."""
    if not isinstance(t, torch.Tensor) or t.shape != (n_heads,) or not t.is_floating_point():
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else repr(t)
        raise EinattnError(f"{name} must be {what} of shape (n_heads,) = ({n_heads},), "
                           f"got {got}")
    if t.device != device:
        raise EinattnError(f"{name} is on {t.device} but the scores are on {device}")
    return t
