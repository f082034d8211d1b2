"""The stages of multi-head attention, one equation each, numbered as in docs/derivation.md
and listed in :mod:`einattn.functional` (their public face): projection (1), scores (2), the
masked softmax (3), the weighted values (4), the heads combined (5), and their grouped-query
forms (1g), (2g), (4g), ``μ = (g r)``.

Each function below runs its equation, and nothing else: :mod:`einattn.composition` composes
them, the impls (:mod:`einattn.impls`) run (2)–(4) their ways.
"""

from __future__ import annotations

import functools

import torch

from . import _autocast, _softmax, layouts
from . import cross as _cross
from ._checks import check_floating
from .errors import EinattnError
from .notation import Equation

PROJECT = Equation("P[n τ μ B a] = X[n τ i] W[(μ B a) i]")
SCORES = Equation("S[n μ τ σ] = Q[n μ τ a] K[n μ σ a] / √a")
SOFTMAX = Equation("A[n μ τ σ] = softmax_σ(S[n μ τ σ] + M[n μ τ σ])")
VALUES = Equation("Z[n μ τ a] = A[n μ τ σ] V[n μ σ a]")
HEADS = Equation("Y[n τ i] = Z[n μ τ a] W_O[μ a i]")
HEAD_TERMS = Equation("Y_μ[n μ τ i] = Z[n μ τ a] W_O[μ a i]")
PROJECT_GQA = Equation("P[n τ g C a] = X[n τ i] W[(g C a) i]")
SCORES_GQA = Equation("S[n (g r) τ σ] = Q[n (g r) τ a] K[n g σ a] / √a")
VALUES_GQA = Equation("Z[n (g r) τ a] = A[n (g r) τ σ] V[n g σ a]")
PROJECT_WIDE = Equation("P[n τ g e] = X[n τ i] W[(g e) i]")  # (1b): e = (r a | a | b)


def open_fused(W: torch.Tensor, n_heads: int, n_kv_heads: int | None = None) -> torch.Tensor:
    """View the fused weight ``W[(g C a) i]`` as ``W[g C a i]`` after checking its rows
    (``W[(μ B a) i]`` as ``W[μ B a i]`` without grouping)."""
    return _opened(W, *_fused_groups(W, n_heads, n_kv_heads))


def head_widths(W: torch.Tensor, n_heads: int, n_kv_heads: int | None,
                d_value: int | None) -> tuple[int, int, int, int]:
    """``(g, r, a, b)`` of a fused weight whose value heads are ``d_value`` (b) wide: its rows
    ``(g e)``, each group's ``e = (r a | a | b)`` (its queries, its key, its value), checked;
    ``W[(g C a) i]`` where ``d_value`` is None or ``a``."""
    g, r = layouts.groups(n_heads, n_kv_heads)
    _check_2d(W)
    rows, C = W.shape[0], r + 2
    if d_value is None or (rows % (g * C) == 0 and rows // (g * C) == d_value):
        g, r = _fused_groups(W, n_heads, n_kv_heads)
        return g, r, rows // (g * C), rows // (g * C)
    per_group, left = divmod(rows, g)
    if left or per_group <= d_value or (per_group - d_value) % (r + 1):
        layout = "W[(μ B a) i] needs μ·B·a" if r == 1 else "W[(g C a) i] needs g·C·a"
        raise EinattnError(f"W has {rows} rows; {layout} rows with {_counts(g, r)}, so a "
                           f"multiple of {g * C}; with values of their own width "
                           f"b = d_value = {d_value}, W[(g e) i] needs g·((r+1)·a + b) rows "
                           f"(g={g}, r={r}, a ≥ 1)")
    return g, r, (per_group - d_value) // (r + 1), d_value


def _opened(W: torch.Tensor, g: int, r: int) -> torch.Tensor:
    """``W[(g C a) i]`` as ``W[g C a i]``, for rows already checked against ``(g, r)``."""
    return torch.unflatten(W, 0, (g, r + 2, -1))


def _fused_groups(W, n_heads: int, n_kv_heads: int | None) -> tuple[int, int]:
    """``(g, r)`` for a fused weight whose rows have been checked against them."""
    _check_2d(W)
    if type(n_heads) is not int or type(n_kv_heads) not in (int, type(None)) \
            or torch.compiler.is_compiling():  # refused there; dynamo warns of a cache
        return _row_groups.__wrapped__(W.shape[0], n_heads, n_kv_heads)
    return _row_groups(W.shape[0], n_heads, n_kv_heads)


@functools.lru_cache(maxsize=256)
def _row_groups(rows: int, n_heads: int, n_kv_heads: int | None) -> tuple[int, int]:
    """``(g, r)`` for a fused weight of ``rows`` rows, checked once per sizes (a refusal
    raises, and so is not kept: it is made again on every call)."""
    g, r = layouts.groups(n_heads, n_kv_heads)
    if rows % (g * (r + 2)):
        layout = "W[(μ B a) i] needs μ·B·a" if r == 1 else "W[(g C a) i] needs g·C·a"
        raise EinattnError(
            f"W has {rows} rows; {layout} rows with {_counts(g, r)}, "
            f"so a multiple of {g * (r + 2)}")
    return g, r


def _check_2d(W) -> None:
    if not isinstance(W, torch.Tensor) or W.ndim != 2:
        shape = tuple(W.shape) if isinstance(W, torch.Tensor) else type(W).__name__
        raise EinattnError(f"W must be 2-D W[(μ B a) i], got {shape}")


def _counts(g: int, r: int) -> str:
    return f"μ={g}, B=3" if r == 1 else f"g={g}, C=r+2={r + 2}"


def project_qkv(x: torch.Tensor, W: torch.Tensor, *, n_heads: int,
                n_kv_heads: int | None = None, b: torch.Tensor | None = None,
                context: torch.Tensor | None = None,
                d_value: int | None = None) -> tuple[torch.Tensor, ...]:
    """Equation (1): queries, keys and values of every head in one contraction.

    ``P[n τ μ B a] = X[n τ i] W[(μ B a) i] (+ b[(μ B a)])``; B runs over Q, K, V. With a
    ``context``, Q is projected from ``x`` and K, V from ``context`` (cross-attention).
    With ``n_kv_heads`` it is (1g), ``P[n τ g C a] = X[n τ i] W[(g C a) i]``: Q has
    ``n_heads`` heads ``μ = (g r)``, K and V have ``n_kv_heads``. With value heads of their
    own width ``d_value`` (b ≠ a) it is (1b), ``P[n τ g e] = X[n τ i] W[(g e) i]``, each
    group's rows ``e = (r a | a | b)``: ``V[n g σ b]``.

    >>> Q, K, V = project_qkv(torch.randn(2, 5, 16), torch.randn(48, 16), n_heads=4)
    >>> tuple(Q.shape), tuple(K.shape)
    ((2, 4, 5, 4), (2, 4, 5, 4))
    """
    g, r, a, d_value = head_widths(W, n_heads, n_kv_heads, d_value)
    if d_value != a:
        return _project_wide(x, W, b, context, g, (r * a, a, d_value))
    if context is None:  # W as it lies: the matmul reads W[(g C a) i] as an nn.Linear weight
        P = PROJECT(X=x, W=W, μ=g, B=3) if r == 1 else PROJECT_GQA(X=x, W=W, g=g, C=r + 2)
        return split_fused(P, b, g, r)
    b3 = None if b is None else _open_bias(b, g, r + 2, W.shape[0] // (g * (r + 2)))
    _cross.check_same_width(x, context)
    W4 = _opened(W, g, r)  # W[g C a i], to take Q's rows apart from K's, V's
    (Q,) = _slots(_project(x, W4[:, :r], None if b3 is None else b3[:, :r], r > 1), r)
    K, V = _slots(_project(context, W4[:, r:], None if b3 is None else b3[:, r:], r > 1), 1, 1)
    return Q, K, V


def split_fused(P: torch.Tensor, b: torch.Tensor | None, g: int,
                r: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Equation (1)'s ``P[n τ g C a]`` (``+ b[(g C a)]``) as ``Q[n (g r) τ a]``,
    ``K[n g σ a]`` and ``V[n g σ a]``: the slots C of each group, its r queries, its key,
    its value."""
    if b is not None:
        P = P + _open_bias(b, g, r + 2, P.shape[-1])
    return _slots(P, r, 1, 1)


def _project_wide(x, W, b, context, g: int, widths: tuple[int, int, int]):
    """Equation (1b): ``P[n τ g e] = X[n τ i] W[(g e) i] (+ b[(g e)])``, P split along e
    into the queries ``(r a)``, the key ``a`` and the value ``b`` of each group (the keys and
    values from ``context`` where one is given)."""
    if b is not None and (not isinstance(b, torch.Tensor) or b.shape != W.shape[:1]):
        got = tuple(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__
        raise EinattnError(f"b has shape {got} but b[(g e)] needs ({W.shape[0]},), the rows "
                           f"of W")
    q = widths[0]
    b2 = None if b is None else _in_autocast_dtype(b.view(g, -1))
    if context is None:
        Q, K, V = _wide(x, W, b2, g).split(widths, -1)
    else:
        _cross.check_same_width(x, context)
        W3 = torch.unflatten(W, 0, (g, -1))
        Q = _wide(x, W3[:, :q].flatten(0, 1), None if b2 is None else b2[:, :q], g)
        K, V = _wide(context, W3[:, q:].flatten(0, 1), None if b2 is None else b2[:, q:],
                     g).split(widths[1:], -1)
    Q = torch.unflatten(Q, -1, (-1, widths[1])).permute(*_HEADS_FIRST).flatten(1, 2)
    return Q, K.transpose(1, 2), V.transpose(1, 2)


def _wide(x: torch.Tensor, W: torch.Tensor, b2, g: int) -> torch.Tensor:
    P = PROJECT_WIDE(X=x, W=W, g=g)
    return P if b2 is None else P + b2


def _project(x: torch.Tensor, W4: torch.Tensor, b3: torch.Tensor | None,
             grouped: bool) -> torch.Tensor:
    """Equation (1) or (1g) over some of the slots of ``W[g C a i]`` (sizes read from it)."""
    P = (PROJECT_GQA if grouped else PROJECT)(X=x, W=W4)
    return P if b3 is None else P + b3


def _slots(P: torch.Tensor, *counts: int) -> tuple[torch.Tensor, ...]:
    """Split ``P[n τ g C a]`` along C into parts of ``counts`` slots, each as ``[n (g r) τ a]``:
    views of P, except grouped Q, whose ``(g r)`` is not contiguous in P (``flatten`` copies)."""
    if max(counts) == 1:  # why two ways: docs/performance.md, "How the fast paths are fast"
        if not P.requires_grad:
            return P.permute(*_SLOTS_FIRST).unbind(0)
        return tuple([part.transpose(1, 2) for part in P.unbind(3)])
    return tuple([part.permute(*_HEADS_FIRST).flatten(1, 2)
                  for part in P.split_with_sizes(counts, dim=3)])


def _axes(pattern: str) -> tuple[int, ...]:
    """The ``permute`` argument of an einops-style pattern such as ``"x y -> y x"``."""
    have, want = (side.split() for side in pattern.split("->"))
    return tuple(have.index(index) for index in want)


_HEADS_FIRST = _axes("n τ g r a -> n g r τ a")  # then (g r) flattened into μ
_SLOTS_FIRST = _axes("n τ g C a -> C n g τ a")  # then unbound along C


def _open_bias(b: torch.Tensor, g: int, C: int, d_head: int) -> torch.Tensor:
    """``b[(g C a)]`` as ``b[g C a]``, which broadcasts over ``P[n τ g C a]``. Under
    autocast it is added in P's dtype, as ``nn.Linear``'s bias is."""
    if not isinstance(b, torch.Tensor):
        raise EinattnError(f"b must be a torch.Tensor, got {type(b).__name__}")
    if b.shape != (g * C * d_head,):
        layout = "b[(μ B a)]" if C == 3 else "b[(g C a)]"
        raise EinattnError(f"b has shape {tuple(b.shape)} but {layout} needs "
                           f"({g * C * d_head},) with {_counts(g, C - 2)}, a={d_head}")
    return _in_autocast_dtype(b.view(g, C, d_head))


def _in_autocast_dtype(b: torch.Tensor) -> torch.Tensor:
    """A bias in the dtype it is added in: autocast's where it is on, its own elsewhere."""
    low = _autocast.dtype(b.device)
    return b if low is None else b.to(low)


def check_qkv(Q, K, V) -> None:
    """Q, K, V are ``Q[n μ τ a]``, ``K[n g σ a]``, ``V[n g σ a]`` whose sizes agree by index
    (``g`` dividing ``μ``), checked before any backend sees them."""
    for name, t, indices in (("Q", Q, "n μ τ a"), ("K", K, "n g σ a"), ("V", V, "n g σ a")):
        if not isinstance(t, torch.Tensor) or t.ndim != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise EinattnError(f"{name} must be 4-D {name}[{indices}], got {shape}")
        check_floating(name, t)
    (n, μ, _, a), (n_K, g, _, a_K) = Q.shape, K.shape  # n and a agree, g divides μ: else
    if (n != n_K or a != a_K or not g or μ % g) and not torch.compiler.is_compiling():
        SCORES_GQA.sizes(Q=Q, K=K)  # the equation's sizes say which, showing (2g)
    for index, axis in (("n", 0), ("g", 1), ("σ", 2)):
        if V.shape[axis] != K.shape[axis]:
            raise EinattnError(f"index {index!r} has size {V.shape[axis]} in V but "
                               f"{K.shape[axis]} in K: every key K[n g σ a] needs its value "
                               f"V[n g σ a]")


def attention_scores(Q: torch.Tensor, K: torch.Tensor) -> torch.Tensor:
    """Equation (2): ``S[n μ τ σ] = Q[n μ τ a] K[n μ σ a] / √a``; with fewer key heads than
    query heads, (2g): ``S[n (g r) τ σ] = Q[n (g r) τ a] K[n g σ a] / √a``.

    >>> attention_scores(torch.ones(1, 1, 2, 4), torch.ones(1, 1, 3, 4))
    tensor([[[[2., 2., 2.],
              [2., 2., 2.]]]])
    """
    if Q.shape[1:2] == K.shape[1:2]:
        return SCORES(Q=Q, K=K)
    return SCORES_GQA(Q=Q, K=K)


def masked_softmax(S: torch.Tensor, mask: torch.Tensor | None = None, *,
                   every_row_sees_a_key: bool = False,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Equation (3): ``A[n μ τ σ] = softmax_σ(S[n μ τ σ] + M[n μ τ σ])``.

    ``mask`` is boolean (True = may attend) or float (added to the scores). A query row
    with no admissible key gives exact zeros and zero gradients: its scores are set to 0
    before the softmax and its weights to 0 after, never a finite sentinel. NaN in an
    admissible score still propagates. ``every_row_sees_a_key=True`` is the caller's
    promise that no row is fully masked (a causal mask with ``L_q ≤ L_k`` and nothing
    else): the two passes over S that guard such rows are then skipped. ``sinks`` ``s[μ]``
    (S being ``S[n μ τ σ]``) adds one logit to each row's denominator,
    ``A = exp(S'_σ) / (exp(s_μ) + Σ_σ' exp(S'_σ'))``: rows sum to less than one, and a
    fully masked row is zeros. A float mask runs :data:`SOFTMAX` itself; the other forms
    run :func:`einattn._softmax.masked`, the same contract (tests/test_functional.py).

    >>> masked_softmax(torch.zeros(2, 2), torch.tensor([[True, True], [False, False]]))
    tensor([[0.5000, 0.5000],
            [0.0000, 0.0000]])
    """
    check_floating("S", S)
    if sinks is not None:
        return _softmax.with_sink(S, mask, sinks)
    if _as_written(S, mask, every_row_sees_a_key):
        return SOFTMAX(S=S, M=mask.expand(S.shape))
    return _softmax.masked(S, mask, every_row_sees_a_key)  # the same numbers, for what
    # SOFTMAX does not take: no mask, a boolean one, a promise, S not S[n μ τ σ]


def _as_written(S: torch.Tensor, mask: torch.Tensor | None, every_row_sees_a_key: bool) -> bool:
    """Whether (3) runs as written: a float mask M of S's dtype and device that broadcasts
    to ``S[n μ τ σ]`` (a view of it is then ``M[n μ τ σ]``)."""
    if mask is None or every_row_sees_a_key or S.ndim != 4 or mask.ndim > 4:
        return False
    sizes = zip(mask.shape[::-1], S.shape[::-1], strict=False)  # broadcast from the last axis
    return mask.dtype == S.dtype and mask.device == S.device and all(m in (1, s) for m, s in sizes)


def weighted_values(A: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """Equation (4): ``Z[n μ τ a] = A[n μ τ σ] V[n μ σ a]``; with fewer value heads than
    query heads, (4g): ``Z[n (g r) τ a] = A[n (g r) τ σ] V[n g σ a]``.

    >>> weighted_values(torch.full((1, 1, 1, 2), 0.5), torch.tensor([[[[1.0], [3.0]]]]))
    tensor([[[[2.]]]])
    """
    if A.shape[1:2] == V.shape[1:2]:
        return VALUES(A=A, V=V)
    return VALUES_GQA(A=A, V=V)


def combine_heads(Z: torch.Tensor, W_O: torch.Tensor,
                  b_O: torch.Tensor | None = None) -> torch.Tensor:
    """Equation (5): ``Y[n τ i] = Z[n μ τ a] W_O[μ a i] (+ b_O[i])``.

    The sum over μ replaces "concatenate the heads, then apply a linear layer".

    >>> combine_heads(torch.ones(1, 2, 1, 3), torch.ones(2, 3, 4)).shape
    torch.Size([1, 1, 4])
    """
    return output_bias(HEADS(Z=Z, W_O=W_O), b_O, W_O)


def output_bias(Y: torch.Tensor, b_O: torch.Tensor | None, W_O: torch.Tensor) -> torch.Tensor:
    """``Y[n τ i] + b_O[i]`` (``Y`` itself without a bias), ``b_O`` checked to fit the ``i``
    of ``W_O[μ a i]``; under autocast added in its dtype, as ``nn.Linear``'s bias is."""
    check_b_O(b_O, W_O)
    return Y if b_O is None else Y + _in_autocast_dtype(b_O)


def check_b_O(b_O, W_O: torch.Tensor) -> None:
    """``b_O[i]`` (or None) fits the output width of ``W_O[μ a i]``."""
    if b_O is not None and tuple(b_O.shape) != (W_O.shape[-1],):
        raise EinattnError(f"b_O has shape {tuple(b_O.shape)} but b_O[i] needs "
                           f"({W_O.shape[-1]},), the size of index 'i' in W_O")


def head_contributions(Z: torch.Tensor, W_O: torch.Tensor) -> torch.Tensor:
    """Equation (5a), each head's share of the output before the sum over μ:
    ``Y_μ[n μ τ i] = Z[n μ τ a] W_O[μ a i]``; summed over μ it gives equation (5)."""
    return HEAD_TERMS(Z=Z, W_O=W_O)
