"""Linear attention: the softmax of equation (3) replaced by a feature map φ of queries and
keys, so that keys and values can be summed before any query reads them (numbered as in
docs/linear.md; ``phi_Q = φ(Q)`` and ``phi_K = φ(K)`` elementwise, ``c`` is the value
channel).

    (L1) N[n μ τ c] = phi_Q[n μ τ a] phi_K[n μ σ a] V[n μ σ c]     one three-operand equation
    (L2) D[n μ τ]   = phi_Q[n μ τ a] phi_K[n μ σ a]
    (L3) Z[n μ τ c] = N[n μ τ c] / D[n μ τ]

opt_einsum runs (L1) in the cheaper of its two orders: ``phi_K V`` first, the (a c) summary
of every key, in O(L·a·c), instead of the L_q × L_k weights ``phi_Q phi_K`` in
O(L²·(a + c)); :func:`orders` gives the FLOPs of both. Causal attention keeps prefix sums
over the keys instead of one total (bottom-right aligned, as everywhere in einattn):

    (L4) U[n μ σ a c] = phi_K[n μ σ a] V[n μ σ c]
    (L5) H[n μ τ a c] = Σ_{σ ≤ τ + L_k − L_q} U[n μ σ a c]
         h[n μ τ a]   = Σ_{σ ≤ τ + L_k − L_q} phi_K[n μ σ a]
    (L6) N[n μ τ c] = phi_Q[n μ τ a] H[n μ τ a c]
    (L7) D[n μ τ]   = phi_Q[n μ τ a] h[n μ τ a]

Grouped keys and values (``n_kv_heads`` groups g of r query heads, ``μ = (g r)``) run
(L1g), (L2g), (L6g), (L7g): the same equations with ``n (g r) τ`` for the queries and
``n g`` for the keys; (L4) holds no query, so it runs as written over g heads. This is a
different attention from softmax attention, not an ``impl`` of it: the two agree on no
inputs in general. :func:`quadratic_form` computes the
same linear attention with its L_q × L_k weights formed, the reference it is tested against.

    >>> Q, K, V = torch.randn(2, 3, 7, 5), torch.randn(2, 3, 7, 5), torch.randn(2, 3, 7, 4)
    >>> linear_attention(Q, K, V, causal=True).shape
    torch.Size([2, 3, 7, 4])
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import functional, masks
from .errors import EinattnError
from .notation import Equation, Explanation

NUMERATOR = Equation("N[n μ τ c] = phi_Q[n μ τ a] phi_K[n μ σ a] V[n μ σ c]")
NORMALISER = Equation("D[n μ τ] = phi_Q[n μ τ a] phi_K[n μ σ a]")
NORMALISE = "Z[n μ τ c] = N[n μ τ c] / D[n μ τ]"
OUTER = Equation("U[n μ σ a c] = phi_K[n μ σ a] V[n μ σ c]")
PREFIX_SUMS = ("H[n μ τ a c] = Σ_{σ ≤ τ + L_k − L_q} U[n μ σ a c],  "
               "h[n μ τ a] = Σ_{σ ≤ τ + L_k − L_q} phi_K[n μ σ a]")
CAUSAL_NUMERATOR = Equation("N[n μ τ c] = phi_Q[n μ τ a] H[n μ τ a c]")
CAUSAL_NORMALISER = Equation("D[n μ τ] = phi_Q[n μ τ a] h[n μ τ a]")

NUMERATOR_GQA = Equation("N[n (g r) τ c] = phi_Q[n (g r) τ a] phi_K[n g σ a] V[n g σ c]")
NORMALISER_GQA = Equation("D[n (g r) τ] = phi_Q[n (g r) τ a] phi_K[n g σ a]")
CAUSAL_NUMERATOR_GQA = Equation("N[n (g r) τ c] = phi_Q[n (g r) τ a] H[n g τ a c]")
CAUSAL_NORMALISER_GQA = Equation("D[n (g r) τ] = phi_Q[n (g r) τ a] h[n g τ a]")

# The two orders of (L1), each as two pairwise equations: weights first, quadratic in L ...
KERNEL = Equation("A[n μ τ σ] = phi_Q[n μ τ a] phi_K[n μ σ a]")
KERNEL_VALUES = Equation("N[n μ τ c] = A[n μ τ σ] V[n μ σ c]")
# ... or the keys' summary first, linear in L.
SUMMARY = Equation("KV[n μ a c] = phi_K[n μ σ a] V[n μ σ c]")
READOUT = Equation("N[n μ τ c] = phi_Q[n μ τ a] KV[n μ a c]")

FeatureMap = Callable[[torch.Tensor], torch.Tensor]


def elu_plus_one(x: torch.Tensor) -> torch.Tensor:
    """The default feature map, ``φ(x) = elu(x) + 1``: ``x + 1`` for ``x > 0``, ``exp(x)``
    otherwise, so every feature is positive (until ``exp`` underflows, below about −745 in
    float64 and −103 in float32).

    Computed as ``exp(x)`` rather than ``(exp(x) − 1) + 1``, which rounds to exactly 0 from
    ``x ≈ −37`` in float64 (``≈ −17`` in float32). NaN propagates.

    >>> elu_plus_one(torch.tensor([-1.0, 0.0, 2.0]))
    tensor([0.3679, 1.0000, 3.0000])
    """
    return torch.where(x > 0, x + 1, torch.exp(x.clamp(max=0)))


def numerator(phi_Q: torch.Tensor, phi_K: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """Equation (L1): ``N[n μ τ c] = phi_Q[n μ τ a] phi_K[n μ σ a] V[n μ σ c]``; with fewer
    key/value heads than query heads, (L1g): ``N[n (g r) τ c] = phi_Q[n (g r) τ a]
    phi_K[n g σ a] V[n g σ c]``. One contraction of three operands, in the order
    opt_einsum finds cheaper (see :func:`orders`).

    >>> numerator(torch.ones(1, 1, 2, 3), torch.ones(1, 1, 4, 3), torch.ones(1, 1, 4, 5))
    tensor([[[[12., 12., 12., 12., 12.],
              [12., 12., 12., 12., 12.]]]])
    """
    equation = NUMERATOR if _same_heads(phi_Q, phi_K) else NUMERATOR_GQA
    return equation(phi_Q=phi_Q, phi_K=phi_K, V=V)


def normaliser(phi_Q: torch.Tensor, phi_K: torch.Tensor) -> torch.Tensor:
    """Equation (L2): ``D[n μ τ] = phi_Q[n μ τ a] phi_K[n μ σ a]``, the sum of query τ's
    unnormalised weights over the keys; with grouped keys, (L2g): ``D[n (g r) τ] =
    phi_Q[n (g r) τ a] phi_K[n g σ a]``. torch sums ``phi_K`` over σ before the product
    over a, so this is O(L·a) whatever ``explain()`` counts for a two-operand contraction.

    >>> normaliser(torch.ones(1, 1, 2, 3), torch.ones(1, 1, 4, 3))
    tensor([[[12., 12.]]])
    """
    equation = NORMALISER if _same_heads(phi_Q, phi_K) else NORMALISER_GQA
    return equation(phi_Q=phi_Q, phi_K=phi_K)


def normalise(N: torch.Tensor, D: torch.Tensor, sees_keys: torch.Tensor | None = None
              ) -> torch.Tensor:
    """Equation (L3): ``Z[n μ τ c] = N[n μ τ c] / D[n μ τ]``.

    ``sees_keys[τ]`` (bool) is False for a query with no admissible key, whose row is an
    empty sum: it gets exact zeros and zero gradients, not 0/0. No ε is added to ``D``: a
    positive feature map makes ``D > 0`` for every query that sees a key, an ε would move
    every output away from the quadratic form, and a feature map that can vanish (relu)
    then shows its ``D = 0`` as inf or NaN rather than as a silent zero.

    >>> normalise(torch.tensor([[2.0, 4.0], [0.0, 0.0]]), torch.tensor([2.0, 0.0]),
    ...           torch.tensor([True, False]))
    tensor([[1., 2.],
            [0., 0.]])
    """
    if sees_keys is None:
        return N / D[..., None]
    blind = ~sees_keys
    Z = N / D.masked_fill(blind, 1.0)[..., None]
    return Z.masked_fill(blind[..., None], 0.0)


def prefix_sums(phi_K: torch.Tensor, V: torch.Tensor, L_q: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Equations (L4) and (L5): for each query τ, the sums over the keys it may see,
    ``σ ≤ τ + L_k − L_q`` (bottom-right, as :func:`einattn.masks.causal_mask`).

    ``H[n μ τ a c]`` sums the outer products ``U[n μ σ a c] = phi_K[n μ σ a] V[n μ σ c]``
    and ``h[n μ τ a]`` sums ``phi_K``, both by ``torch.cumsum`` over σ, read at each query's
    last visible key (zeros for a query that sees none). With grouped keys the head axis is
    g: (L4) involves no query, so it is the same equation over g heads.

    >>> H, h = prefix_sums(torch.ones(1, 1, 3, 2), torch.ones(1, 1, 3, 1), L_q=2)
    >>> h[0, 0, :, 0]
    tensor([2., 3.])
    """
    U = OUTER(phi_K=phi_K, V=V)
    return _at_queries(U.cumsum(dim=2), L_q), _at_queries(phi_K.cumsum(dim=2), L_q)


def causal_numerator(phi_Q: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    """Equation (L6): ``N[n μ τ c] = phi_Q[n μ τ a] H[n μ τ a c]``; with grouped keys,
    (L6g): ``N[n (g r) τ c] = phi_Q[n (g r) τ a] H[n g τ a c]``.

    >>> causal_numerator(torch.ones(1, 1, 2, 3), torch.ones(1, 1, 2, 3, 4)).shape
    torch.Size([1, 1, 2, 4])
    """
    equation = CAUSAL_NUMERATOR if _same_heads(phi_Q, H) else CAUSAL_NUMERATOR_GQA
    return equation(phi_Q=phi_Q, H=H)


def causal_normaliser(phi_Q: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Equation (L7): ``D[n μ τ] = phi_Q[n μ τ a] h[n μ τ a]``; with grouped keys, (L7g):
    ``D[n (g r) τ] = phi_Q[n (g r) τ a] h[n g τ a]``.

    >>> causal_normaliser(torch.ones(1, 1, 2, 3), torch.ones(1, 1, 2, 3))
    tensor([[[3., 3.]]])
    """
    equation = CAUSAL_NORMALISER if _same_heads(phi_Q, h) else CAUSAL_NORMALISER_GQA
    return equation(phi_Q=phi_Q, h=h)


def linear_attention(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, *,
                     feature_map: FeatureMap = elu_plus_one, causal: bool = False
                     ) -> torch.Tensor:
    """``Z[n μ τ c]`` of linear attention: (L1)–(L3), or (L4)–(L7) and (L3) with ``causal``.

    ``Q[n μ τ a]``, ``K[n g σ a]``, ``V[n g σ c]``, where g = μ or divides μ (grouped
    keys and values, query head μ = (g r) reading group g = μ // r). ``feature_map`` is
    applied to Q and K elementwise or along their last axis (it may change the size of
    ``a``, the same way for both); nothing is divided by √a, and a map that wants a scale
    includes it. A query with no visible key (``L_k = 0``, or causal with ``L_q > L_k``)
    gets exact zeros.

    >>> Q, K, V = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 5)
    >>> Z = linear_attention(Q, K, V)
    >>> torch.allclose(Z, quadratic_form(Q, K, V))
    True
    """
    _check_qkv(Q, K, V)
    phi_Q, phi_K = _features(feature_map, Q, "Q"), _features(feature_map, K, "K")
    L_q, L_k = Q.shape[2], K.shape[2]
    sees_keys = _sees_keys(L_q, L_k, causal, Q.device)
    if causal:
        H, h = prefix_sums(phi_K, V, L_q)
        N, D = causal_numerator(phi_Q, H), causal_normaliser(phi_Q, h)
    else:
        N, D = numerator(phi_Q, phi_K, V), normaliser(phi_Q, phi_K)
    return normalise(N, D, sees_keys)


def quadratic_form(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, *,
                   feature_map: FeatureMap = elu_plus_one, causal: bool = False
                   ) -> torch.Tensor:
    """The same ``Z[n μ τ c]`` as :func:`linear_attention`, computed the long way with plain
    matmuls: the L_q × L_k weights ``φ(Q) φ(K)ᵀ`` (zeroed where ``σ > τ + L_k − L_q`` when
    causal), divided by their row sums, times V. O(L²); the reference for tests.

    >>> Q, K, V = torch.ones(1, 1, 2, 3), torch.ones(1, 1, 2, 3), torch.arange(2.0).view(1, 1, 2, 1)
    >>> quadratic_form(Q, K, V, causal=True)[0, 0, :, 0]
    tensor([0.0000, 0.5000])
    """
    _check_qkv(Q, K, V)
    r = Q.shape[1] // K.shape[1]
    K, V = K.repeat_interleave(r, dim=1), V.repeat_interleave(r, dim=1)
    weights = _features(feature_map, Q, "Q") @ _features(feature_map, K, "K").transpose(-2, -1)
    L_q, L_k = weights.shape[-2:]
    allowed = torch.ones(L_q, L_k, dtype=torch.bool, device=Q.device)
    if causal:
        allowed = masks.causal_mask(L_q, L_k, device=Q.device)
        weights = weights.masked_fill(~allowed, 0.0)
    row_sums = weights.sum(dim=-1, keepdim=True)
    blind = ~allowed.any(dim=-1, keepdim=True)  # a query with no key: exact zeros
    Z = (weights @ V) / row_sums.masked_fill(blind, 1.0)
    return Z.masked_fill(blind, 0.0)


def multi_head_linear_attention(x: torch.Tensor, W: torch.Tensor, W_O: torch.Tensor, *,
                                n_heads: int, n_kv_heads: int | None = None,
                                context: torch.Tensor | None = None, causal: bool = False,
                                feature_map: FeatureMap = elu_plus_one,
                                b: torch.Tensor | None = None, b_O: torch.Tensor | None = None
                                ) -> torch.Tensor:
    """``Y[n τ i]`` from ``X[n τ i]`` with linear attention between equations (1) and (5):
    the same fused ``W[(μ B a) i]`` (or ``W[(g C a) i]``), ``W_O[μ a i]`` and biases as
    :class:`einattn.MultiHeadAttention`, through
    :func:`einattn.functional.project_qkv` and :func:`einattn.functional.combine_heads`.
    The value channel c is then ``a``. A different attention on the same parameters, not an
    ``impl`` of the layer's softmax attention.

    >>> Y = multi_head_linear_attention(torch.randn(2, 5, 16), torch.randn(48, 16),
    ...                                 torch.randn(4, 4, 16), n_heads=4, causal=True)
    >>> Y.shape
    torch.Size([2, 5, 16])
    """
    Q, K, V = functional.project_qkv(x, W, n_heads=n_heads, n_kv_heads=n_kv_heads, b=b,
                                     context=context)
    Z = linear_attention(Q, K, V, feature_map=feature_map, causal=causal)
    return functional.combine_heads(Z, W_O, b_O)


@dataclass(frozen=True)
class Orders:
    """The FLOPs of the two orders of (L1) at given sizes, and the one opt_einsum picks."""

    sizes: dict[str, int]
    quadratic: int  # (phi_Q phi_K) V: KERNEL then KERNEL_VALUES, 2·n·μ·τ·σ·(a + c)
    linear: int  # phi_Q (phi_K V): SUMMARY then READOUT, 2·n·μ·σ·a·c + 2·n·μ·τ·a·c
    chosen: str  # "linear" or "quadratic": the order NUMERATOR runs in
    explanation: Explanation  # NUMERATOR.explain() at these sizes

    def __str__(self) -> str:
        sizes = ", ".join(f"{k}={v}" for k, v in self.sizes.items())
        mark = {order: " <- opt_einsum" if order == self.chosen else ""
                for order in ("quadratic", "linear")}
        return "\n".join([
            f"{NUMERATOR.text}   at {sizes}",
            f"  (phi_Q phi_K) V   {self.quadratic:>15,} FLOPs   quadratic in L"
            f"{mark['quadratic']}",
            f"  phi_Q (phi_K V)   {self.linear:>15,} FLOPs   linear in L{mark['linear']}",
            f"  path {self.explanation.path}, largest intermediate "
            f"{self.explanation.largest_intermediate:,} elements",
        ])


def orders(**sizes: int) -> Orders:
    """The FLOPs of both orders of (L1), each from ``Equation.explain()`` of its two
    pairwise equations, and the order opt_einsum picks for the one three-operand equation.

    ``sizes`` gives n, μ, τ, σ, a and c by index name.

    >>> o = orders(n=1, μ=1, τ=1000, σ=1000, a=8, c=8)
    >>> o.chosen, o.linear, o.quadratic
    ('linear', 256000, 32000000)
    """
    missing = [i for i in NUMERATOR.indices if i not in sizes]
    unknown = [k for k in sizes if k not in NUMERATOR.indices]
    if missing or unknown:
        what = (f"no size for index {missing[0]!r}" if missing
                else f"{unknown[0]!r} is not an index of (L1)")
        raise EinattnError(f"orders() needs the size of every index of {NUMERATOR.text}: "
                           f"{what}; pass {', '.join(f'{i}=...' for i in NUMERATOR.indices)}")
    sizes = {i: sizes[i] for i in ("n", "μ", "τ", "σ", "a", "c")}
    explanation = _explain(NUMERATOR, sizes)
    quadratic = _explain(KERNEL, sizes).flops + _explain(KERNEL_VALUES, sizes).flops
    linear = _explain(SUMMARY, sizes).flops + _explain(READOUT, sizes).flops
    keys_first = explanation.path[0] == (1, 2)  # phi_K with V: the keys' summary
    return Orders(sizes, quadratic, linear, "linear" if keys_first else "quadratic",
                  explanation)


def _explain(equation: Equation, sizes: dict[str, int]) -> Explanation:
    return equation.explain(**{t.name: tuple(sizes[i] for i in t.indices)
                               for t in equation.terms})


def _same_heads(queries: torch.Tensor, keys: torch.Tensor) -> bool:
    return queries.shape[1:2] == keys.shape[1:2]


def _at_queries(sums: torch.Tensor, L_q: int) -> torch.Tensor:
    """Prefix sums over σ (axis 2) read at σ = τ + L_k − L_q for each query τ; zeros for
    the queries before the first key."""
    shift = sums.shape[2] - L_q
    if shift >= 0:
        return sums[:, :, shift:]
    zeros = sums.new_zeros(*sums.shape[:2], -shift, *sums.shape[3:])
    return torch.cat([zeros, sums], dim=2)


def _sees_keys(L_q: int, L_k: int, causal: bool, device) -> torch.Tensor | None:
    """Bool ``(τ,)``: whether query τ may see a key, ``σ ≤ τ + L_k − L_q`` when causal;
    None when every query does."""
    first = L_q if L_k == 0 else L_q - L_k if causal else 0  # queries τ < first see none
    if first <= 0:
        return None
    return torch.arange(L_q, device=device) >= first


def _features(feature_map: FeatureMap, t: torch.Tensor, name: str) -> torch.Tensor:
    phi = feature_map(t)
    if not isinstance(phi, torch.Tensor) or phi.shape[:-1] != t.shape[:-1]:
        got = tuple(phi.shape) if isinstance(phi, torch.Tensor) else type(phi).__name__
        raise EinattnError(f"feature_map turned {name} {tuple(t.shape)} into {got}: φ must "
                           f"keep the axes n, heads and positions of {name} and map only "
                           f"its last axis a")
    if phi.dtype != t.dtype:
        raise EinattnError(f"feature_map turned {name} ({t.dtype}) into {phi.dtype}: φ must "
                           f"keep the dtype")
    return phi


_LAYOUT = {"Q": "Q[n μ τ a]", "K": "K[n g σ a]", "V": "V[n g σ c]"}


def _check_qkv(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor) -> None:
    """Q[n μ τ a], K[n g σ a], V[n g σ c] with g dividing μ, checked by index name."""
    tensors = {"Q": Q, "K": K, "V": V}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.ndim != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise EinattnError(f"{name} must be a 4-D tensor {_LAYOUT[name]}, got {shape}")
        if not t.is_floating_point():
            raise EinattnError(f"{name} must be floating point, got {t.dtype}")
    for name, t in (("K", K), ("V", V)):
        if t.dtype != Q.dtype or t.device != Q.device:
            raise EinattnError(f"{name} is {t.dtype} on {t.device} but Q is {Q.dtype} on "
                               f"{Q.device}")
    pairs = [("n", 0, "K", "Q"), ("n", 0, "V", "Q"), ("a", 3, "K", "Q"), ("σ", 2, "V", "K")]
    for index, axis, name, other in pairs:
        if tensors[name].shape[axis] != tensors[other].shape[axis]:
            raise EinattnError(f"index {index!r} has size {tensors[name].shape[axis]} in "
                               f"{name} but {tensors[other].shape[axis]} in {other}")
    if V.shape[1] != K.shape[1]:
        raise EinattnError(f"V has {V.shape[1]} heads but K has {K.shape[1]}: keys and "
                           f"values come in the same heads g")
    if K.shape[1] == 0 or Q.shape[1] % K.shape[1]:
        raise EinattnError(f"Q has {Q.shape[1]} heads, not a multiple of the {K.shape[1]} "
                           f"heads of K and V: query head μ = (g r) needs a whole number r "
                           f"of query heads per key/value group g")
