"""The two forms of each attention-pattern step, and the wrong forms of the mutations;
:func:`einattn.derivation.pattern_steps` registers them. The patterns are the terms of
equation (3) (:mod:`einattn.patterns`):

    A[n μ τ σ] = softmax_σ( cap(S[n μ τ σ]) + B[μ τ σ] + M[n μ τ σ] )     (3)

with, optionally, a sink logit ``s_μ`` in the denominator; ``τ' = τ + L_k − L_q``. One form
is :func:`einattn.functional.attention` with a pattern option; the other writes the term
out from its formula on ``arange`` grids, never through :mod:`einattn.patterns`, so that a
slip in a piece's predicate, its alignment or the order of the terms shows as a deviation.
The forms take ``Q[n μ τ a]``, ``K[n μ σ a]`` and ``V[n μ σ a]`` (:data:`QKV`), and the
sink logits ``s[μ]`` or the document breaks ``breaks[n σ]`` where their step needs them.
"""

from __future__ import annotations

import math

import torch

from . import functional
from .masks import additive_causal_mask, alibi_slopes, causal_mask
from .notation import Equation

QKV = {"Q": "n μ τ a", "K": "n μ σ a", "V": "n μ σ a"}
SINKS = {**QKV, "s": "μ"}
DOCUMENTS = {**QKV, "breaks": "n σ"}
SOFTCAP = 2.0  # c: about twice the scores' spread (they are N(0, 1)), so that tanh bends


def pattern_sizes(s: dict[str, int]) -> dict[str, int]:
    """The patterns' sizes: ``s`` where σ ≠ τ; at self-attention sizes one query fewer (one
    key more, for a single query), so that τ' ≠ τ and a pattern aligned top-left shows."""
    if s["σ"] != s["τ"]:
        return s
    return {**s, "σ": 2} if s["τ"] == 1 else {**s, "τ": s["τ"] - 1}


def packed_sizes(s: dict[str, int]) -> dict[str, int]:
    """The documents' sizes: :func:`pattern_sizes` with no more queries than keys (the
    queries' document ids are the keys' last L_q)."""
    p = pattern_sizes(s)
    return {**p, "τ": min(p["τ"], p["σ"])}


def window_width(L_k: int) -> int:
    """``w`` for ``L_k`` keys: half of them, at least 2, so that the window cuts."""
    return max(2, L_k // 2)


def _positions(Q: torch.Tensor, K: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """τ' as a column (query τ's position among the keys) and σ as a row."""
    L_q, L_k = Q.shape[2], K.shape[2]
    tau = torch.arange(L_q, device=Q.device)[:, None] + (L_k - L_q)
    return tau, torch.arange(L_k, device=Q.device)


def _scores(Q: torch.Tensor, K: torch.Tensor) -> torch.Tensor:
    """``S = Q Kᵀ / √a`` as a matrix product."""
    return Q @ K.mT / math.sqrt(Q.shape[-1])


def _softmax_values(logits: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """``softmax_σ(logits) V`` (``−∞`` where blocked); a query that sees no key gets zeros."""
    dead = logits.isneginf().all(dim=-1, keepdim=True)
    return torch.where(dead, 0.0, torch.softmax(logits, dim=-1)) @ V


# -- equation (3) itself: its Equation against torch.softmax, the mask applied by hand -------

MASKED = {"S": "n μ τ σ", "M": "n μ τ σ"}


def _masked(M: torch.Tensor) -> torch.Tensor:
    """A mask from a draw ``M``: −∞ where the draw is below −0.5 (about a third of the
    keys) and along the whole first query row, which no key is left to; 0 elsewhere."""
    blocked = M < -0.5
    blocked[..., 0, :] = True
    return torch.zeros_like(M).masked_fill(blocked, -math.inf)


def softmax_forms():
    """Equation (3) as :data:`einattn.functional.SOFTMAX` runs it, and ``torch.softmax``
    with the mask applied by hand: blocked scores ``−∞``, a row with nothing left zeros."""
    def equation_3(S, M):
        return functional.SOFTMAX(S=S, M=_masked(M))

    def torch_softmax(S, M):
        allowed = _masked(M) == 0
        A = torch.softmax(S.masked_fill(~allowed, -math.inf), dim=-1)
        return torch.where(allowed.any(dim=-1, keepdim=True), A, 0.0)
    return equation_3, torch_softmax


def softmax_along_tau(S, M):
    """Wrong: ``softmax_τ(S + M)``, the named axis τ where σ is meant."""
    return Equation("A[n μ τ σ] = softmax_τ(S[n μ τ σ] + M[n μ τ σ])")(S=S, M=_masked(M))


def causal_softmaxes():
    """(3) with the causal mask as 0/−∞ floats, and as booleans."""
    def additive(S):
        L_q, L_k = S.shape[-2:]
        return functional.masked_softmax(S, additive_causal_mask(L_q, L_k, dtype=S.dtype))

    def boolean(S):
        L_q, L_k = S.shape[-2:]
        return functional.masked_softmax(S, causal_mask(L_q, L_k))
    return additive, boolean


def off_by_one(S):
    """Wrong: a causal mask that lets each query see one key ahead."""
    L_q, L_k = S.shape[-2:]
    allowed = torch.ones(L_q, L_k, dtype=torch.bool).tril(diagonal=1)
    return functional.masked_softmax(S, allowed)


# -- the sliding window ------------------------------------------------------------------------

def window_forms(w: int, causal: bool):
    """``window=w`` (with or without causal), and the same attention with its mask dense."""
    def einattn_window(Q, K, V):
        return functional.attention(Q, K, V, causal=causal, window=w)

    def dense_window(Q, K, V):
        """The mask written out: ``τ' − w < σ ≤ τ'`` with causal, ``|τ' − σ| < w`` without."""
        t, s = _positions(Q, K)
        allowed = (t - w < s) & (s <= t) if causal else (t - s).abs() < w
        return functional.attention(Q, K, V, mask=allowed)
    return einattn_window, dense_window


def wrong_windows(w: int):
    """Wrong windows: one key too wide (causal), and aligned top-left (without causal)."""
    def one_key_more(Q, K, V):
        """Wrong: ``τ' − w ≤ σ ≤ τ'``, w + 1 keys."""
        t, s = _positions(Q, K)
        return functional.attention(Q, K, V, mask=(t - w <= s) & (s <= t))

    def top_left(Q, K, V):
        """Wrong: ``|τ − σ| < w``, the query's index τ where its position τ' is meant."""
        t, s = torch.arange(Q.shape[2])[:, None], torch.arange(K.shape[2])
        return functional.attention(Q, K, V, mask=(t - s).abs() < w)
    return one_key_more, top_left


# -- softcap, with ALiBi's B and a window's M after it -----------------------------------------

def _bias_and_window(Q: torch.Tensor, K: torch.Tensor, w: int):
    """``B[μ τ σ] = −m_μ |τ' − σ|`` and the window's ``M[τ σ]``: 0 where ``|τ' − σ| < w``,
    ``−∞`` elsewhere."""
    t, s = _positions(Q, K)
    B = -alibi_slopes(Q.shape[1], dtype=Q.dtype)[:, None, None] * (t - s).abs()
    M = torch.zeros(B.shape[1:], dtype=Q.dtype).masked_fill((t - s).abs() >= w, -math.inf)
    return B, M


def softcap_forms(c: float, w: int):
    """``softcap=c`` with ALiBi and a window (no causal: B's ``|τ' − σ|`` on both sides of
    τ'), and equation (3) written out with ``cap`` first."""
    def einattn_softcap(Q, K, V):
        return functional.attention(Q, K, V, softcap=c, alibi=True, window=w)

    def capped_then_terms(Q, K, V):
        """``softmax_σ(c · tanh((Q Kᵀ / √a) / c) + B + M) V``."""
        B, M = _bias_and_window(Q, K, w)
        return _softmax_values(c * torch.tanh(_scores(Q, K) / c) + B + M, V)
    return einattn_softcap, capped_then_terms


def wrong_softcaps(c: float, w: int):
    """Softcap in the wrong place: after B and M, and before the 1/√a scale."""
    def capped_last(Q, K, V):
        """Wrong: ``c · tanh((S + B + M) / c)``, capping the bias and the mask too."""
        B, M = _bias_and_window(Q, K, w)
        return _softmax_values(c * torch.tanh((_scores(Q, K) + B + M) / c), V)

    def capped_unscaled(Q, K, V):
        """Wrong: ``c · tanh(Q Kᵀ / c) / √a + B + M``, capping before the 1/√a scale."""
        B, M = _bias_and_window(Q, K, w)
        capped = c * torch.tanh(Q @ K.mT / c) / math.sqrt(Q.shape[-1])
        return _softmax_values(capped + B + M, V)
    return capped_last, capped_unscaled


# -- sinks -------------------------------------------------------------------------------------

def _with_a_sink_key(Q, K, V, s, value):
    """Causal attention over the keys and one more, whose logit is ``s_μ`` for every query
    and whose value is ``value[n μ 1 a]``."""
    t, k = _positions(Q, K)
    S = _scores(Q, K).masked_fill(k > t, -math.inf)
    A = torch.softmax(torch.cat([S, s[:, None, None].expand(*S.shape[:-1], 1)], dim=-1), dim=-1)
    return A @ torch.cat([V, value], dim=2)


def sink_forms():
    """``sinks=s`` (causal), and the sink as one more key."""
    def einattn_sinks(Q, K, V, s):
        return functional.attention(Q, K, V, causal=True, sinks=s)

    def sink_as_a_key(Q, K, V, s):
        """The softmax over σ and one more logit ``s_μ``, whose value is zero."""
        return _with_a_sink_key(Q, K, V, s, V.new_zeros(*V.shape[:2], 1, V.shape[3]))
    return einattn_sinks, sink_as_a_key


def sink_in_a_numerator(Q, K, V, s):
    """Wrong: the sink's weight kept, in the numerator of the first key (value ``V[σ=0]``)."""
    return _with_a_sink_key(Q, K, V, s, V[:, :, :1])


# -- ALiBi -------------------------------------------------------------------------------------

def bloom_slopes(h: int, dtype: torch.dtype) -> torch.Tensor:
    """BLOOM's slopes as its ``build_alibi_tensor`` draws them: ``base^1 … base^p`` for the
    largest power of two ``p ≤ h``, ``base = 2^(−8/p)``; then the odd powers of
    ``2^(−4/p)`` for the other ``h − p`` heads."""
    p = 2 ** math.floor(math.log2(h))
    powers = [2 ** (-8 / p * k) for k in range(1, p + 1)]
    return torch.tensor(powers + [2 ** (-4 / p * k) for k in range(1, 2 * (h - p), 2)],
                        dtype=dtype)


def bloom(slopes):
    """Causal attention with BLOOM's bias ``+m_μ · σ``, the same on every row, for the
    slopes ``slopes(h, dtype)``."""
    def bloom_bias(Q, K, V):
        m = slopes(Q.shape[1], Q.dtype)
        bias = m[:, None, None] * torch.arange(K.shape[2], dtype=Q.dtype)  # [μ 1 σ]
        return functional.attention(Q, K, V, mask=bias[None], causal=True)
    return bloom_bias


def alibi_forms():
    """``alibi=True`` (causal), and BLOOM's bias with BLOOM's slopes."""
    def einattn_alibi(Q, K, V):
        return functional.attention(Q, K, V, causal=True, alibi=True)
    return einattn_alibi, bloom(bloom_slopes)


def wrong_alibis():
    """Wrong: BLOOM's bias with the sign flipped, and with the slopes in reverse head order."""
    return (bloom(lambda h, dtype: -bloom_slopes(h, dtype)),
            bloom(lambda h, dtype: bloom_slopes(h, dtype).flip(0)))


# -- documents ---------------------------------------------------------------------------------

def document_ids(breaks: torch.Tensor) -> torch.Tensor:
    """``d[n σ]``, the number of breaks up to key σ: a new document starts at each key where
    ``breaks[n σ] > 0.5`` (about one in three, for normal draws)."""
    return (breaks > 0.5).cumsum(-1)


def _lengths(ids: torch.Tensor) -> list[int]:
    """The lengths of one sample's documents, in order."""
    return torch.unique_consecutive(ids, return_counts=True)[1].tolist()


def document_forms(causal: bool):
    """``document_ids``, and the documents as a block-diagonal mask (without causal) or
    run one at a time (causal)."""
    def einattn_documents(Q, K, V, breaks):
        return functional.attention(Q, K, V, causal=causal, document_ids=document_ids(breaks))
    return einattn_documents, one_at_a_time if causal else block_diagonal


def block_diagonal(Q, K, V, breaks):
    """The mask ``block_diag(1_{ℓ_1}, 1_{ℓ_2}, …)`` over the keys, one all-True block per
    document of length ℓ, its last L_q rows for the queries."""
    blocks = [torch.block_diag(*[torch.ones(k, k) for k in _lengths(ids)])
              for ids in document_ids(breaks)]
    mask = torch.stack(blocks)[:, K.shape[2] - Q.shape[2]:] > 0
    return functional.attention(Q, K, V, mask=mask)


def one_at_a_time(Q, K, V, breaks):
    """Each document of each sample alone, causal within it, the outputs concatenated."""
    shift, rows = K.shape[2] - Q.shape[2], []
    for n, ids in enumerate(document_ids(breaks)):
        parts, lo = [], 0
        for length in _lengths(ids):
            hi, first = lo + length, max(lo, shift)  # first: its first query, among the keys
            if first < hi:
                keys = slice(lo, hi)
                parts.append(functional.attention(
                    Q[n:n + 1, :, first - shift:hi - shift], K[n:n + 1, :, keys],
                    V[n:n + 1, :, keys], causal=True))
            lo = hi
        rows.append(torch.cat(parts, dim=2))
    return torch.cat(rows)


def packed_without_ids(Q, K, V):
    """Wrong: the packed sequence under causal alone, each query seeing earlier documents."""
    return functional.attention(Q, K, V, causal=True)
