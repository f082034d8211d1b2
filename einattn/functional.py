"""The stages of multi-head attention, one equation each (numbered as in docs/derivation.md).

    (1) P[n τ μ B a] = X[n τ i] W[(μ B a) i]          Q[n μ τ a] = P[n τ μ Q a], K, V alike
    (2) S[n μ τ σ]   = Q[n μ τ a] K[n μ σ a] / √a
    (3) A[n μ τ σ]   = softmax_σ(S[n μ τ σ] + M[n μ τ σ])
    (4) Z[n μ τ a]   = A[n μ τ σ] V[n μ σ a]
    (5) Y[n τ i]     = Z[n μ τ a] W_O[μ a i]

Grouped-query attention (``n_kv_heads`` groups g of r query heads, ``μ = (g r)``) runs
(1g), (2g) and (4g) in place of (1), (2) and (4); (3) and (5) are unchanged:

    (1g) P[n τ g C a] = X[n τ i] W[(g C a) i]          Q: slots C < r, K: C = r, V: C = r+1
    (2g) S[n (g r) τ σ] = Q[n (g r) τ a] K[n g σ a] / √a
    (4g) Z[n (g r) τ a] = A[n (g r) τ σ] V[n g σ a]

Each stage is a function of :mod:`einattn.equations`, which runs its equation, re-exported
here; :func:`attention` and :func:`multi_head_attention` are the functional forms of the
layer, equations (2)–(4) and (1)–(5) with every option as a keyword, composed by
:mod:`einattn.composition` from one :class:`~einattn.spec.Spec` made per call.
"""

from __future__ import annotations

import torch

from . import composition
from ._checks import IMPLS, refuse_is_causal
from .cache import KVCache
from .equations import (
    HEAD_TERMS,
    HEADS,
    PROJECT,
    PROJECT_GQA,
    SCORES,
    SCORES_GQA,
    SOFTMAX,
    VALUES,
    VALUES_GQA,
    attention_scores,
    check_qkv,
    combine_heads,
    head_contributions,
    masked_softmax,
    open_fused,
    project_qkv,
    weighted_values,
)
from .impls.auto import Choice
from .spec import Spec

__all__ = ["HEADS", "HEAD_TERMS", "IMPLS", "PROJECT", "PROJECT_GQA", "SCORES", "SCORES_GQA",
           "SOFTMAX", "VALUES", "VALUES_GQA", "attention", "attention_scores", "check_qkv",
           "combine_heads", "explain", "head_contributions", "masked_softmax",
           "multi_head_attention", "open_fused", "project_qkv", "weighted_values"]


def attention(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, *,
              mask: torch.Tensor | None = None, key_padding_mask: torch.Tensor | None = None,
              causal: bool = False, window: int | None = None, softcap: float | None = None,
              alibi=False, sinks: torch.Tensor | None = None,
              document_ids: torch.Tensor | None = None, pattern=None, dropout: float = 0.0,
              impl: str = "einsum", block_size: int = 256, scale: float | None = None,
              need_weights: bool = False, is_causal=None):
    """Equations (2)–(4) with every term of (3): ``Z[n μ τ a]`` from ``Q[n μ τ a]``,
    ``K[n g σ a]`` and ``V[n g σ a]`` (``g`` dividing ``μ``: grouped-query attention)::

        A[n μ τ σ] = softmax_σ( cap(S[n μ τ σ]) + B[μ τ σ] + M[n μ τ σ] )   (+ a sink s[μ])

    ``mask``, ``key_padding_mask`` and ``causal`` as in :func:`multi_head_attention`.
    The patterns (:mod:`einattn.patterns`; τ' = τ + L_k − L_q): ``window=w`` lets τ see
    the w keys ``τ' − w < σ ≤ τ'`` with ``causal`` (``|τ' − σ| < w`` without);
    ``document_ids`` (integers ``(n, σ)``, the queries' ids the last ``L_q``) keeps each
    query within its document; ``alibi=True`` adds ``B = −m_μ |τ' − σ|`` with BLOOM's
    slopes (:func:`einattn.masks.alibi_slopes`; a tensor ``m[μ]`` gives others);
    ``softcap=c`` caps the scaled scores, ``c · tanh(S / c)``; ``sinks`` (``s[μ]``) adds a
    logit to each row's softmax denominator, so rows sum to less than one. ``impl``:
    "einsum", "sdpa", "chunked" or "flex" (docs/masks.md: which runs what), or "auto", the
    fastest of them for this call (:func:`explain` says which, and why).
    ``need_weights=True`` returns ``(Z, A)`` (the einsum path's). ``is_causal`` (PyTorch's
    name) is refused: einattn's is ``causal``.

    >>> Q, K, V = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    >>> attention(Q, K, V, causal=True, window=3, softcap=30.0).shape
    torch.Size([1, 4, 6, 8])
    """
    refuse_is_causal(is_causal)
    spec, pieces = _prepared(Q, K, V, locals())
    stages = composition.attention(Q, K, V, spec, mask, key_padding_mask, pieces, need_weights)
    return (stages["Z"], stages["A"]) if need_weights else stages["Z"]


def explain(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, *,
            mask: torch.Tensor | None = None, key_padding_mask: torch.Tensor | None = None,
            causal: bool = False, window: int | None = None, softcap: float | None = None,
            alibi=False, sinks: torch.Tensor | None = None,
            document_ids: torch.Tensor | None = None, pattern=None, dropout: float = 0.0,
            impl: str = "auto", block_size: int = 256, scale: float | None = None,
            need_weights: bool = False) -> Choice:
    """Which impl :func:`attention` runs with these arguments on, and why, as a
    ``Choice(impl, reason)``; nothing is run. With ``impl="auto"`` (the default here) the
    rule of :data:`einattn.impls.auto.RULES` that decides; whether gradients are needed is
    read as a call would read it (grad mode, and which inputs require grad).

    >>> Q = K = V = torch.randn(1, 4, 512, 16)
    >>> explain(Q, K, V, causal=True).impl
    'sdpa'
    """
    spec, pieces = _prepared(Q, K, V, locals())
    return composition.choice(Q, K, V, spec, mask, key_padding_mask, pieces, need_weights)


def _prepared(Q, K, V, a: dict) -> tuple:
    """The spec and the pieces of one call of :func:`attention` (or :func:`explain`), from
    its keywords ``a``, checked."""
    spec = Spec(a["impl"], a["block_size"], a["dropout"], a["scale"], window=a["window"],
                softcap=a["softcap"], pattern=a["pattern"])
    check_qkv(Q, K, V)
    pieces = composition.call_pieces(spec, composition.Call(causal=a["causal"]), a["alibi"],
                                     a["sinks"], a["document_ids"])
    return spec, pieces


def multi_head_attention(x: torch.Tensor, W: torch.Tensor, W_O: torch.Tensor, *, n_heads: int,
                         n_kv_heads: int | None = None, context: torch.Tensor | None = None,
                         mask: torch.Tensor | None = None,
                         key_padding_mask: torch.Tensor | None = None, causal: bool = False,
                         b: torch.Tensor | None = None, b_O: torch.Tensor | None = None,
                         dropout: float = 0.0, need_weights: bool = False,
                         return_intermediates: bool = False, impl: str = "einsum",
                         block_size: int = 256, rope: str | None = None,
                         rope_base: float = 10000.0, rope_scaling: dict | None = None,
                         rotary_dim: int | None = None, positions: torch.Tensor | None = None,
                         cache: KVCache | None = None, scale: float | None = None,
                         window: int | None = None, softcap: float | None = None, alibi=False,
                         sinks: torch.Tensor | None = None,
                         document_ids: torch.Tensor | None = None, pattern=None,
                         W_KV: torch.Tensor | None = None, b_KV: torch.Tensor | None = None,
                         d_value: int | None = None, is_causal=None):
    """Equations (1)–(5) composed: ``Y[n τ i]`` from ``X[n τ i]``.

    ``dropout`` is applied to ``A`` (pass 0 outside training). ``need_weights=True``
    returns ``(Y, A)``; ``return_intermediates=True`` returns ``(Y, stages)``, a dict of
    every intermediate by its equation name: Q, K, V, S, A, Z, Y_μ and Y.
    ``n_kv_heads`` (dividing ``n_heads``) makes it grouped-query attention over
    ``W[(g C a) i]``: query head μ = (g r) reads key/value group g = μ // r.

    ``rope`` ("half" or "interleaved") turns Q and K by rotary position embeddings
    (:mod:`einattn.rotary`, base ``rope_base``, frequencies scaled by ``rope_scaling``, the
    first ``rotary_dim`` channels of each head) at ``positions`` (``(L,)`` or ``(n, L)``
    integers; default: 0, 1, … after the tokens already in ``cache``). ``scale`` is the
    softmax scale ``s`` of equation (2), ``S = s · Q K``: ``1/√a`` by default. With a
    :class:`~einattn.cache.KVCache`, this call's keys and values are appended to it and the
    queries attend over everything cached (causal aligned bottom-right);
    ``key_padding_mask`` and ``document_ids`` then mark this call's new keys only. A
    :class:`~einattn.static_cache.StaticKVCache` is the same with one shape for every call.
    ``window``, ``softcap``, ``alibi``, ``sinks`` and ``document_ids`` are the attention
    patterns of equation (3), as in :func:`attention`, and so is ``pattern``. With ``W_KV``
    (and ``b_KV``) the context has a width of its own: ``W`` is then ``W_Q[(μ a) i]`` and
    equation (1) splits into (1q) and (1kv) (:mod:`einattn.cross`). ``is_causal`` (PyTorch's
    name) is refused: einattn's is ``causal``. ``d_value`` (b) makes the values of each
    head b wide, not a: ``W[(g e) i]`` with each group's rows ``e = (r a | a | b)``, equation
    (1b), and ``W_O[μ b i]``.

    ``impl`` chooses how equations (2)–(4) run, on the same parameters: ``"einsum"`` (the
    equations as written; under ``torch.compile`` routed to SDPA, which Inductor fuses),
    ``"sdpa"`` (``F.scaled_dot_product_attention``), ``"chunked"`` (exact attention over
    tiles of ``block_size`` queries × keys, O(L) memory, see :mod:`einattn.chunked`) or
    ``"flex"`` (FlexAttention, compiled). Weights ``A`` exist only on the einsum path, so
    asking for them runs it.

    >>> Y = multi_head_attention(torch.randn(2, 5, 16), torch.randn(48, 16),
    ...                          torch.randn(4, 4, 16), n_heads=4, causal=True)
    >>> Y.shape
    torch.Size([2, 5, 16])
    """
    spec = Spec(impl, block_size, dropout, scale, causal, window, softcap, pattern, rope,
                rope_base, rope_scaling, rotary_dim)
    refuse_is_causal(is_causal)
    w = {"W": W, "W_O": W_O, "b": b, "b_O": b_O, "W_KV": W_KV, "b_KV": b_KV, "sinks": sinks,
         "alibi": alibi, "n_heads": n_heads, "n_kv_heads": n_kv_heads, "d_value": d_value}
    return composition.multi_head(x, w, spec, composition.Call(
        context, mask, key_padding_mask, causal, None, positions, cache, document_ids,
        need_weights, return_intermediates))
