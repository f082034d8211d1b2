"""Cross-attention from a context of another width: equation (1) split in two.

    (1q)  Q[n τ μ a]   = X[n τ i] W_Q[(μ a) i]
    (1kv) P[n σ g B a] = C[n σ j] W_KV[(g B a) j]        B over K, V

Values of their own width b (``d_value``) make (1kv) ``P[n σ g e] = C[n σ j] W_KV[(g e) j]``,
each group's rows ``e = (a | b)``; keys and values from two contexts of their own widths
(``nn.MultiheadAttention``'s ``kdim ≠ vdim``) make it two equations, each with its own
context and its own ``j``:

    (1k)  K[n σ g a] = C_K[n σ j] W_K[(g a) j]
    (1v)  V[n σ g b] = C_V[n σ j] W_V[(g b) j]

The queries are projected from ``X[n τ i]`` (width ``i``, the model's) and the keys and
values from the context ``C[n σ j]`` (width ``j``, its own), each through its own weight.
With ``j = i`` the two are equation (1)'s fused ``W[(μ B a) i]`` cut by B into its query
rows and its key/value rows (a registered derivation step proves it), so a layer without
a context of its own keeps the one fused weight.
"""

from __future__ import annotations

import torch

from . import _autocast, layouts
from .errors import EinattnError
from .notation import Equation

PROJECT_Q = Equation("Q[n τ μ a] = X[n τ i] W_Q[(μ a) i]")
PROJECT_KV = Equation("P[n σ g B a] = C[n σ j] W_KV[(g B a) j]")
PROJECT_KV_WIDE = Equation("P[n σ g e] = C[n σ j] W_KV[(g e) j]")
PROJECT_K = Equation("K[n σ g a] = C_K[n σ j] W_K[(g a) j]")
PROJECT_V = Equation("V[n σ g b] = C_V[n σ j] W_V[(g b) j]")


def project(x: torch.Tensor, W_Q: torch.Tensor, context, W_KV, *, n_heads: int,
            n_kv_heads: int | None = None, b_Q: torch.Tensor | None = None, b_KV=None,
            d_value: int | None = None) -> tuple[torch.Tensor, ...]:
    """Equations (1q) and (1kv): ``Q[n μ τ a]`` from ``x``, ``K[n g σ a]`` and
    ``V[n g σ b]`` from ``context`` (with their biases ``b_Q[(μ a)]``, ``b_KV[(g B a)]``);
    values ``d_value`` wide by (1kv)'s ``W_KV[(g e) j]``; ``W_KV = (W_K, W_V)`` with
    ``context = (C_K, C_V)`` (and ``b_KV = (b_K, b_V)``) by (1k) and (1v),
    ``K[n σ g a] = C_K[n σ j] W_K[(g a) j]`` and ``V[n σ g b] = C_V[n σ j] W_V[(g b) j]``.

    >>> Q, K, V = project(torch.randn(2, 5, 16), torch.randn(16, 16), torch.randn(2, 7, 10),
    ...                   torch.randn(32, 10), n_heads=4)
    >>> tuple(Q.shape), tuple(K.shape)
    ((2, 4, 5, 4), (2, 4, 7, 4))
    """
    g, _ = layouts.groups(n_heads, n_kv_heads)
    Q = PROJECT_Q(X=x, W_Q=W_Q, μ=n_heads)
    if b_Q is not None:
        Q = Q + _bias(b_Q, "b_Q", "(μ a)", (n_heads, Q.shape[-1]))
    if isinstance(W_KV, tuple):
        K, V = _two_contexts(context, W_KV, b_KV, g)
    else:
        _check(context, W_KV)
        a = Q.shape[-1]
        wide = d_value is not None and d_value != a
        P = PROJECT_KV_WIDE(C=context, W_KV=W_KV, g=g) if wide else \
            PROJECT_KV(C=context, W_KV=W_KV, g=g, B=2)
        if b_KV is not None:
            P = P + _bias(b_KV, "b_KV", "(g e)" if wide else "(g B a)", (g, *P.shape[3:]))
        K, V = P.split([a, d_value], -1) if wide else P.unbind(3)
    return Q.transpose(1, 2), K.transpose(1, 2), V.transpose(1, 2)


def _two_contexts(contexts, W_KV: tuple, b_KV, g: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(1k) and (1v): keys from ``C_K`` by ``W_K[(g a) j]``, values from ``C_V`` by
    ``W_V[(g b) j]``, each context of its own width."""
    if not isinstance(contexts, tuple) or len(contexts) != 2:
        raise EinattnError("W_K[(g a) j] and W_V[(g b) j] project the keys and the values "
                           "from two contexts C_K[n σ j] and C_V[n σ j]: pass both (context "
                           "and value_context)")
    (C_K, C_V), (W_K, W_V) = contexts, W_KV
    _check(C_K, W_K, "C_K", "W_K[(g a) j]")
    _check(C_V, W_V, "C_V", "W_V[(g b) j]")
    if C_K.shape[:2] != C_V.shape[:2]:
        raise EinattnError(f"every key needs its value: C_K[n σ j] {tuple(C_K.shape)} and "
                           f"C_V[n σ j] {tuple(C_V.shape)} differ in n or σ")
    K, V = PROJECT_K(C_K=C_K, W_K=W_K, g=g), PROJECT_V(C_V=C_V, W_V=W_V, g=g)
    if b_KV is not None:
        K = K + _bias(b_KV[0], "b_K", "(g a)", (g, K.shape[-1]))
        V = V + _bias(b_KV[1], "b_V", "(g b)", (g, V.shape[-1]))
    return K, V


def check_same_width(x: torch.Tensor, context: torch.Tensor) -> None:
    """A context projected by the fused ``W[(μ B a) i]``: ``C[n σ i]``, with x's ``n`` and
    ``i``."""
    if context.ndim != 3 or x.ndim != 3:
        raise EinattnError(f"x {tuple(x.shape)} and context {tuple(context.shape)} must be "
                           f"3-D X[n τ i] and C[n σ i]")
    for index, axis in (("n", 0), ("i", 2)):
        if context.shape[axis] != x.shape[axis]:
            raise EinattnError(f"index {index!r} has size {context.shape[axis]} in context "
                               f"but {x.shape[axis]} in x")


def _check(context, W_KV, name: str = "C", weight: str = "W_KV[(g B a) j]") -> None:
    if context is None:
        raise EinattnError(f"{weight} projects the keys and values from a context "
                           f"{name}[n σ j]: pass context=")
    if not isinstance(context, torch.Tensor) or context.ndim != 3 \
            or not isinstance(W_KV, torch.Tensor) or W_KV.ndim != 2:
        raise EinattnError(f"context must be 3-D {name}[n σ j] and {weight.split('[')[0]} "
                           f"2-D {weight}")
    if context.shape[2] != W_KV.shape[1]:
        raise EinattnError(f"index 'j' has size {context.shape[2]} in the context "
                           f"{name}[n σ j] {tuple(context.shape)} but {W_KV.shape[1]} in the "
                           f"weight {weight} {tuple(W_KV.shape)}")


def _bias(b: torch.Tensor, name: str, layout: str, shape: tuple[int, ...]) -> torch.Tensor:
    n = 1
    for size in shape:
        n *= size
    if not isinstance(b, torch.Tensor) or tuple(b.shape) != (n,):
        got = tuple(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__
        raise EinattnError(f"{name} has shape {got} but {name}[{layout}] needs ({n},)")
    low = _autocast.dtype(b.device)  # added in autocast's dtype, as nn.Linear's bias is
    return (b if low is None else b.to(low)).view(shape)


def split_projection(n_heads: int, *, swapped: bool = False):
    """(1q) and (1kv) with ``W_Q`` and ``W_KV`` cut from one fused ``W[(μ B a) i]``
    (``j = i``), stacked as ``P[n τ μ B a]``: the form that proves them equation (1).
    ``swapped`` exchanges K and V in ``W_KV``, a mutation that must be caught."""
    def two_projections(X: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
        W4 = torch.unflatten(W, 0, (n_heads, 3, -1))  # W[μ B a i]
        W_KV = W4[:, [2, 1]] if swapped else W4[:, 1:]  # W_KV[μ B a i], B over K, V
        Q, K, V = project(X, W4[:, 0].flatten(0, 1), X, W_KV.flatten(0, 2), n_heads=n_heads)
        return torch.stack([Q, K, V], dim=2).permute(0, 3, 1, 2, 4)
    return two_projections
