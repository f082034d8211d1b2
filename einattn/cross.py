"""Cross-attention from a context of another width: equation (1) split in two.

    (1q)  Q[n τ μ a]   = X[n τ i] W_Q[(μ a) i]
    (1kv) P[n σ g B a] = C[n σ j] W_KV[(g B a) j]        B over K, V

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


def project(x: torch.Tensor, W_Q: torch.Tensor, context: torch.Tensor, W_KV: torch.Tensor, *,
            n_heads: int, n_kv_heads: int | None = None, b_Q: torch.Tensor | None = None,
            b_KV: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Equations (1q) and (1kv): ``Q[n μ τ a]`` from ``x``, ``K[n g σ a]`` and
    ``V[n g σ a]`` from ``context`` (with their biases ``b_Q[(μ a)]``, ``b_KV[(g B a)]``).

    >>> Q, K, V = project(torch.randn(2, 5, 16), torch.randn(16, 16), torch.randn(2, 7, 10),
    ...                   torch.randn(32, 10), n_heads=4)
    >>> tuple(Q.shape), tuple(K.shape)
    ((2, 4, 5, 4), (2, 4, 7, 4))
    """
    g, _ = layouts.groups(n_heads, n_kv_heads)
    _check(context, W_KV)
    Q = PROJECT_Q(X=x, W_Q=W_Q, μ=n_heads)
    P = PROJECT_KV(C=context, W_KV=W_KV, g=g, B=2)
    if b_Q is not None:
        Q = Q + _bias(b_Q, "b_Q", "(μ a)", (n_heads, Q.shape[-1]))
    if b_KV is not None:
        P = P + _bias(b_KV, "b_KV", "(g B a)", (g, 2, P.shape[-1]))
    K, V = P.unbind(3)
    return Q.transpose(1, 2), K.transpose(1, 2), V.transpose(1, 2)


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


def _check(context, W_KV) -> None:
    if context is None:
        raise EinattnError("W_KV[(g B a) j] projects the keys and values from a context "
                           "C[n σ j]: pass context=")
    if not isinstance(context, torch.Tensor) or context.ndim != 3 \
            or not isinstance(W_KV, torch.Tensor) or W_KV.ndim != 2:
        raise EinattnError("context must be 3-D C[n σ j] and W_KV 2-D W_KV[(g B a) j]")
    if context.shape[2] != W_KV.shape[1]:
        raise EinattnError(f"index 'j' has size {context.shape[2]} in the context C[n σ j] "
                           f"{tuple(context.shape)} but {W_KV.shape[1]} in the weight "
                           f"W_KV[(g B a) j] {tuple(W_KV.shape)}")


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
