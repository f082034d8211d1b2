"""Attention patterns: the pieces of equation (3) besides the scores and the user's mask.

    A[n μ τ σ] = softmax_σ( cap(S[n μ τ σ]) + B[μ τ σ] + M[n μ τ σ] )     (3)

with, optionally, a sink logit ``s_μ`` in the softmax's denominator. A piece is free of
shapes and reads positions: ``τ'``, query τ's position among the keys (``τ + L_k − L_q``
by default, bottom-right, as ``causal`` has it), and ``σ``, a key's.

Each pattern is one piece below, with its faces together (the protocol:
:mod:`einattn._piece`):

* ``LATEX``: its case formula, as docs/derivation.md shows it;
* one function of the indices, ``allowed(n, μ, τ, σ)`` for a piece of the mask ``M`` or
  ``score(S, n, μ, τ, σ)`` for a term of the scores, in torch operations only, so that it
  is the dense form (on broadcast ``arange`` grids), one tile's form (on the tile's grids)
  and FlexAttention's ``mask_mod`` / ``score_mod`` (on the scalars it maps it over);
* ``judge(frame, size)``: for a tile of queries × keys, from its first and last positions
  (and, for documents, each block's least and greatest id), whether some key may be seen
  and whether every one is, so that the chunked path skips the empty tiles and the mask
  work on the full ones, and FlexAttention's BlockMask needs no ``L_q × L_k`` evaluation;
* ``keys(frame, τ0, τ1)``, its reach: the keys a block of queries may see at most.

Mask pieces compose with ``&``, ``|`` and ``~``; ``pattern=`` (on
:func:`einattn.functional.attention`, ``multi_head_attention`` and the layer) takes one
piece or a sequence of them, and the keyword shorthands (``causal=``, ``window=``, ...)
build the same pieces in :func:`pieces_of`. A pattern of one's own is a
:class:`MaskMod` (FlexAttention's ``mask_mod``), a :class:`ScoreMod` (its ``score_mod``)
or a :class:`Mask` (an index predicate such as ``"σ ≤ τ ∧ τ − σ < w"``); a new named piece
is one more class here with the faces above.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._binding import Pattern, bind
from ._checks import (
    check_document_ids,
    check_per_head,
    check_prefix,
    check_softcap,
    check_window,
)
from ._mods import Mask, MaskMod, ScoreMod
from ._piece import Frame, Grid, MaskPiece, ScorePiece, grid
from .errors import EinattnError
from .notation import Equation

__all__ = ["SINK", "SINK_LATEX", "ALiBi", "Causal", "ChunkedLocal", "Documents", "Grid",
           "Mask", "MaskMod", "MaskPiece", "Pattern", "PrefixLM", "ScoreMod", "ScorePiece",
           "Sinks", "Softcap", "Window", "ZeroSink", "alibi_slopes", "bind", "build",
           "check_softcap", "check_window", "grid", "pieces_of"]

# -- pieces of the mask M: a predicate over (n, μ, τ, σ) --------------------------------------


@dataclass(frozen=True)
class Causal(MaskPiece):
    """Query τ sees the keys up to its own position: ``σ ≤ τ'``."""

    LATEX = r"M^{\text{causal}}_{\tau\sigma} = \begin{cases} 0 & \sigma \le \tau' \\ -\infty & \text{otherwise} \end{cases}"  # noqa: E501
    diagonal = True
    is_causal = True

    def allowed(self, n, mu, tau, sigma):
        return sigma <= tau

    def judge(self, frame: Frame, size: int):
        return self.tile

    @staticmethod
    def tile(t0: int, t1: int, s0: int, s1: int) -> tuple[bool, bool]:
        """For the tile of query positions ``t0..t1`` × keys ``s0..s1`` (last ones
        included): whether some key may be seen, and whether every one is."""
        return s0 <= t1, s1 <= t0

    def keys(self, frame: Frame, t0: int, t1: int) -> tuple:
        return None, t1

    def first_row(self, s0: int) -> int:
        return s0


@dataclass(frozen=True)
class Window(MaskPiece):
    """A band of keys around each query: ``|τ' − σ| < w`` (``2w − 1`` keys); with
    :class:`Causal` (``Causal() & Window(w)``, or ``causal=True, window=w``) the ``w``
    keys ``τ' − w < σ ≤ τ'``, itself included."""

    w: int
    LATEX = r"M^{\text{window}}_{\tau\sigma} = \begin{cases} 0 & |\tau' - \sigma| < w \\ -\infty & \text{otherwise} \end{cases}"  # noqa: E501
    diagonal = True

    def __post_init__(self) -> None:
        check_window(self.w)

    def allowed(self, n, mu, tau, sigma):
        return (tau - sigma).abs() < self.w

    def judge(self, frame: Frame, size: int):
        return self.tile

    def tile(self, t0: int, t1: int, s0: int, s1: int) -> tuple[bool, bool]:
        near, far = t0 - s1, t1 - s0  # the least and greatest τ' − σ of the tile
        return near < self.w and far > -self.w, far < self.w and near > -self.w

    def keys(self, frame: Frame, t0: int, t1: int) -> tuple:
        return t0 - self.w + 1, t1 + self.w - 1


@dataclass(frozen=True, eq=False)
class Documents(MaskPiece):
    """Packed sequences: τ sees σ only within its own document, ``d[n τ'] = d[n σ]``."""

    ids: torch.Tensor  # d[n σ], one id per key position; the queries' are theirs
    LATEX = r"M^{\text{doc}}_{n\tau\sigma} = \begin{cases} 0 & d_{n\tau'} = d_{n\sigma} \\ -\infty & \text{otherwise} \end{cases}"  # noqa: E501
    diagonal = True
    static = False  # its judgement reads the ids

    def allowed(self, n, mu, tau, sigma):
        return self.ids[n, tau] == self.ids[n, sigma]

    def bound(self, frame: Frame, dtype: torch.dtype) -> Documents:
        return Documents(check_document_ids(self.ids, frame.n, frame.L_q, frame.L_k,
                                            frame.device))

    def judge(self, frame: Frame, size: int):
        """Per tile: empty where no two ids of its rows and columns can be equal (their
        ranges lie apart, for every n); full where all of them are one id; a tile within
        one run of ids on each side (cut where documents change) by its two ids. Under
        ``torch.compile``, which cannot read the ids' values, every tile is partial."""
        if torch.compiler.is_compiling() or type(frame.q0) is not int:
            return super().judge(frame, size)
        q0, k0 = frame.q0, frame.k0
        q_lo, q_hi = _block_range(self.ids[:, q0:q0 + frame.L_q], size)  # (n, T_q)
        k_lo, k_hi = _block_range(self.ids[:, k0:k0 + frame.L_k], size)  # (n, T_k)
        q_lo, q_hi, k_lo, k_hi = q_lo[:, :, None], q_hi[:, :, None], k_lo[:, None], k_hi[:, None]
        some = ((q_lo <= k_hi) & (k_lo <= q_hi)).any(0).tolist()
        every = ((q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo)).all(0).tolist()
        run, ids = self._runs(), self.ids.T.tolist()  # run[σ], ids[σ][n]

        def tile(t0: int, t1: int, s0: int, s1: int) -> tuple[bool, bool]:
            if run[t0] == run[t1] and run[s0] == run[s1]:
                same = [a == b for a, b in zip(ids[t0], ids[s0], strict=True)]
                return any(same), all(same)
            return some[(t0 - q0) // size][(s0 - k0) // size], \
                every[(t0 - q0) // size][(s0 - k0) // size]
        return tile

    def _runs(self) -> list:
        """For each position, which run of unchanged ids (over every n) it is in."""
        change = (self.ids[:, 1:] != self.ids[:, :-1]).any(0)
        return torch.cat([change.new_zeros(1), change]).cumsum(0).tolist()

    def cuts(self, frame: Frame) -> tuple:
        """Where the ids change, where few do (at most 8, or one position in 16: packed
        documents, not interleaved ids, whose tiles would be slivers)."""
        if torch.compiler.is_compiling() or type(frame.q0) is not int:
            return ()
        change = (self.ids[:, 1:] != self.ids[:, :-1]).any(0).nonzero().flatten() + 1
        return tuple(change.tolist()) if len(change) <= max(8, self.ids.shape[1] // 16) else ()


@dataclass(frozen=True, eq=False)
class PrefixLM(MaskPiece):
    """A prefix LM (T5's, UniLM's, PaliGemma's): the keys before the prefix, ``σ < p``, are
    seen by every query, both ways; the rest causally, ``σ ≤ τ'``. ``prefix``: an int, or
    one length per sample, integers ``(n,)``."""

    prefix: int | torch.Tensor  # p, or p[n]
    LATEX = r"M^{\text{prefix}}_{n\tau\sigma} = \begin{cases} 0 & \sigma < p_n \vee \sigma \le \tau' \\ -\infty & \text{otherwise} \end{cases}"  # noqa: E501
    diagonal = True

    @property
    def static(self) -> bool:
        return isinstance(self.prefix, int)

    def allowed(self, n, mu, tau, sigma):
        p = self.prefix if self.static else self.prefix[n]
        return (sigma < p) | (sigma <= tau)

    def bound(self, frame: Frame, dtype: torch.dtype) -> PrefixLM:
        return PrefixLM(check_prefix(self.prefix, frame.n, frame.device))

    def judge(self, frame: Frame, size: int):
        if not self.static and (torch.compiler.is_compiling() or type(frame.q0) is not int):
            return super().judge(frame, size)
        lo, hi = self._range()
        return lambda t0, t1, s0, s1: (s0 < hi or s0 <= t1, s1 < lo or s1 <= t0)

    def keys(self, frame: Frame, t0: int, t1: int):
        return None, max(t1, self._range()[1] - 1)

    def _range(self) -> tuple[int, int]:
        """The least and the greatest prefix over the samples."""
        if self.static:
            return self.prefix, self.prefix
        return int(self.prefix.min()), int(self.prefix.max())


@dataclass(frozen=True)
class ChunkedLocal(MaskPiece):
    """Chunked local attention (Llama 4's local layers): the sequence is cut into chunks of
    ``c`` positions, and a query sees the keys of its own chunk up to itself,
    ``⌊τ'/c⌋ = ⌊σ/c⌋ ∧ σ ≤ τ'``."""

    c: int
    LATEX = r"M^{\text{chunk}}_{\tau\sigma} = \begin{cases} 0 & \lfloor \tau' / c \rfloor = \lfloor \sigma / c \rfloor \wedge \sigma \le \tau' \\ -\infty & \text{otherwise} \end{cases}"  # noqa: E501
    diagonal = True

    def __post_init__(self) -> None:
        if isinstance(self.c, bool) or not isinstance(self.c, int) or self.c < 1:
            raise EinattnError(f"ChunkedLocal's c (positions per chunk) must be an int ≥ 1, "
                               f"got {self.c!r}")

    def allowed(self, n, mu, tau, sigma):
        return (tau // self.c == sigma // self.c) & (sigma <= tau)

    def judge(self, frame: Frame, size: int):
        return self.tile

    def tile(self, t0: int, t1: int, s0: int, s1: int) -> tuple[bool, bool]:
        """Some key is seen where a chunk k holds queries and keys of the tile with one key
        at or before one query: a chunk after the first key's, or the first key's with
        ``σ0 ≤ τ1``; every key where one chunk holds the whole tile, its keys first."""
        c = self.c
        first, last = max(t0, s0) // c, min(t1, s1) // c  # the chunks both sides reach
        some = first <= last and (s0 <= t1 or last > s0 // c)
        return some, t0 // c == t1 // c == s0 // c == s1 // c and s1 <= t0

    def keys(self, frame: Frame, t0: int, t1: int) -> tuple:
        return t0 // self.c * self.c, t1

    def first_row(self, s0: int) -> int:
        return s0


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
class Softcap(ScorePiece):
    """Logit softcapping (Gemma 2): ``cap(S) = c · tanh(S / c)``, on the scaled scores."""

    c: float
    CAP = Equation("C[n μ τ σ] = c · tanh(S[n μ τ σ] / c)")  # C = cap(S)
    LATEX = CAP.latex()
    STAGE = 0  # a function of S, not a term added to it

    def __post_init__(self) -> None:
        object.__setattr__(self, "c", check_softcap(self.c))

    def score(self, S, n, mu, tau, sigma):
        if S.ndim == 4:  # the dense form and a tile's: S[n μ τ σ]
            return self.CAP(S=S, c=self.c)
        return self.c * torch.tanh(S / self.c)  # FlexAttention's scalars: CAP's arithmetic

    def grad(self, S, dS, n, mu, tau, sigma):
        """``∂L/∂S`` from ``∂L/∂cap(S)``: ``dS · (1 − tanh²(S / c))``."""
        return dS * (1 - torch.tanh(S / self.c) ** 2)


@dataclass(frozen=True, eq=False)
class ALiBi(ScorePiece):
    """Attention with linear biases (BLOOM, MPT): ``B[μ τ σ] = −m_μ · |τ' − σ|``, with
    the slopes ``m[μ]`` given or BLOOM's for the call's heads (:func:`alibi_slopes`)."""

    slopes: torch.Tensor | None = None  # m[μ]
    LATEX = r"B_{\mu\tau\sigma} = -m_\mu \left|\tau' - \sigma\right|"
    STAGE = 1
    additive = True  # S + B: SDPA takes B as its float mask

    def score(self, S, n, mu, tau, sigma):
        return S + self.bias(n, mu, tau, sigma)

    def bias(self, n, mu, tau, sigma):
        return -self.slopes[mu] * (tau - sigma).abs()

    def grad(self, S, dS, n, mu, tau, sigma):
        return dS

    def bound(self, frame: Frame, dtype: torch.dtype) -> ALiBi:
        """The slopes in at least float32, as the scores are."""
        dtype = torch.promote_types(dtype, torch.float32)
        if self.slopes is None:
            return ALiBi(alibi_slopes(frame.n_heads, dtype=dtype, device=frame.device))
        what = "True (BLOOM's slopes) or a float tensor of slopes m[μ]"
        return ALiBi(check_per_head(self.slopes, "alibi", what, frame.n_heads, frame.device)
                     .to(dtype))

    def tile_refusal(self, impl: str, frame: Frame, dtype: torch.dtype) -> str | None:
        if not (torch.is_grad_enabled() and self.slopes.requires_grad):
            return None
        return (f"impl={impl!r} takes ALiBi's slopes as constants, but this alibi tensor "
                f"requires grad (learned slopes): use impl='einsum' or 'sdpa', whose slopes "
                f"get their gradient")


def alibi_slopes(n_heads: int, *, dtype=torch.float32, device=None) -> torch.Tensor:
    """ALiBi's slopes ``m[μ]``, as BLOOM and MPT draw them: for ``h`` a power of two the
    geometric sequence ``m_μ = 2^(−8 (μ + 1) / h)``; otherwise those of the largest power of
    two ``h' < h``, then every other slope of ``2 h'`` heads (the odd ones) for the rest.

    >>> alibi_slopes(4)
    tensor([0.2500, 0.0625, 0.0156, 0.0039])
    """
    if isinstance(n_heads, bool) or not isinstance(n_heads, int) or n_heads < 1:
        raise EinattnError(f"n_heads must be a positive int, got {n_heads!r}")

    def geometric(h: int) -> torch.Tensor:
        return 2.0 ** (-8.0 * torch.arange(1, h + 1, dtype=torch.float64) / h)
    h = 1 << (n_heads.bit_length() - 1)
    slopes = torch.cat([geometric(h), geometric(2 * h)[0::2][:n_heads - h]])
    return slopes.to(dtype=dtype, device=device)


# -- the sink: one more logit in the softmax's denominator ---------------------------------------

# The definition; it runs as einattn._softmax.with_sink, which never overflows (tests check
# the two agree): S is the logits cap(S) + B + M, s[μ] the sink.
SINK = Equation("A[n μ τ σ] = exp(S[n μ τ σ]) / (exp(s[μ]) + sum_σ(exp(S[n μ τ σ])))")
SINK_LATEX = SINK.latex()


@dataclass(frozen=True, eq=False)
class Sinks:
    """A sink logit ``s[μ]`` per head (gpt-oss): one more term in each row's denominator,
    :data:`SINK`, so that rows sum to less than one."""

    s: torch.Tensor
    KIND = "sink"

    def latex(self) -> str:
        return SINK_LATEX

    def bound(self, frame: Frame, dtype: torch.dtype) -> Sinks:
        return Sinks(check_per_head(self.s, "sinks", "a float tensor of sink logits s[μ]",
                                    frame.n_heads, frame.device))


@dataclass(frozen=True)
class ZeroSink:
    """A key and a value of zeros for every query (``nn.MultiheadAttention``'s
    ``add_zero_attn``): its score ``Q · 0`` is 0 whatever the query, so it is a sink of logit
    ``s_μ = 0`` in every head, learned by nothing."""

    KIND = "sink"

    def latex(self) -> str:
        return SINK_LATEX + r", \quad s_{\mu} = 0"

    def bound(self, frame: Frame, dtype: torch.dtype) -> Sinks:
        return Sinks(torch.zeros(frame.n_heads, dtype=dtype, device=frame.device))


# -- the keyword shorthands, and what pattern= takes ---------------------------------------------


def pieces_of(pattern=None, *, causal: bool = False, window=None, softcap=None, alibi=False,
              sinks=None, document_ids=None) -> tuple:
    """The pieces of one call: those the keyword shorthands name (each meaning what its
    keyword does), then ``pattern`` (one piece or a sequence of them)."""
    pieces = []
    if causal:
        pieces.append(Causal())
    if window is not None:
        pieces.append(Window(window))
    if document_ids is not None:
        pieces.append(Documents(document_ids))
    if softcap is not None:
        pieces.append(Softcap(softcap))
    if alibi is not None and alibi is not False:
        pieces.append(ALiBi(None if alibi is True else alibi))
    if sinks is not None:
        pieces.append(Sinks(sinks))
    if pattern is not None:
        pieces += _given(pattern)
    return tuple(pieces)


def _given(pattern) -> list:
    """``pattern=`` as a list of pieces, each checked to be one."""
    given = list(pattern) if isinstance(pattern, (list, tuple)) else [pattern]
    for piece in given:
        if getattr(piece, "KIND", None) not in ("mask", "score", "sink"):
            raise EinattnError(f"pattern takes pieces of einattn.patterns (Causal(), "
                               f"Window(w), MaskMod(fn), ScoreMod(fn), Mask('σ ≤ τ'), ...) "
                               f"or a sequence of them, got {type(piece).__name__}")
    return given


def build(*, n: int, n_heads: int, L_q: int, L_k: int, dtype: torch.dtype, device,
          pattern=None, **keywords) -> Pattern:
    """The pattern of one call from the keyword shorthands and ``pattern``, bound to its
    sizes (each error names its option)."""
    return bind(pieces_of(pattern, **keywords), n=n, n_heads=n_heads, L_q=L_q, L_k=L_k,
                dtype=dtype, device=torch.device(device))
