"""The QK and OV circuits: what each head computes, read off its weights alone.

Substituting the projections (1) into the scores (2) and into the output (4)–(5) leaves
the input ``X`` on both sides of one matrix per head (Elhage et al., 2021):

    S[n μ τ σ] = X[n τ i] W_QK[μ i j] X[n σ j] / √a      (without biases)
    Y[n τ j]   = A[n μ τ σ] X[n σ i] W_OV[μ i j]          (without biases)

so that ``W_QK`` says which pairs of model directions a head matches (where it looks)
and ``W_OV`` what it moves from the key position to the query position. Both are computed
from the fused ``W[(g C a) i]``, grouped-query attention included: query head μ = (g r)
pairs its own query rows with the key and value rows of its group g. Biases are not part
of a circuit. Where ``W_Q``, ``W_K``, ``W_V`` appear below they are the query, key and
value rows of ``W`` (``nn.Linear`` orientation, ``a`` before ``i``), the transpose of
TransformerLens's ``W_Q[μ i a]``.
"""

from __future__ import annotations

import torch

from . import functional
from .errors import EinattnError
from .module import MultiHeadAttention
from .notation import Equation

QK_CIRCUIT = Equation("W_QK[(g r) i j] = W_Q[(g r) a i] W_K[g a j]")
OV_CIRCUIT = Equation("W_OV[(g r) i j] = W_V[g a i] W_O[(g r) a j]")


def qk_circuit(W: torch.Tensor, *, n_heads: int, n_kv_heads: int | None = None) -> torch.Tensor:
    """Equation (C1), ``W_QK[(g r) i j] = W_Q[(g r) a i] W_K[g a j]``: each query head's
    bilinear form on the model width, from the fused ``W[(g C a) i]``; shape
    ``(n_heads, d_model, d_model)``.

    ``S[n μ τ σ] = X[n τ i] W_QK[μ i j] X[n σ j] / √a`` for a layer without biases.

    >>> W = torch.randn(3 * 2 * 4, 5)                  # 2 heads of 4 channels, d_model 5
    >>> qk_circuit(W, n_heads=2).shape
    torch.Size([2, 5, 5])
    """
    W4 = functional.open_fused(W, n_heads, n_kv_heads)  # W[g C a i]
    r = W4.shape[1] - 2
    return QK_CIRCUIT(W_Q=W4[:, :r], W_K=W4[:, r])


def ov_circuit(W: torch.Tensor, W_O: torch.Tensor, *, n_heads: int,
               n_kv_heads: int | None = None) -> torch.Tensor:
    """Equation (C2), ``W_OV[(g r) i j] = W_V[g a i] W_O[(g r) a j]``: what each head
    writes to model channel j per unit of model channel i at the position it attends to,
    from the fused ``W[(g C a) i]`` and ``W_O[μ a j]``; shape ``(n_heads, d_model, d_model)``.

    ``Y[n τ j] = A[n μ τ σ] X[n σ i] W_OV[μ i j]`` for a layer without biases.

    >>> ov_circuit(torch.randn(24, 5), torch.randn(2, 4, 5), n_heads=2).shape
    torch.Size([2, 5, 5])
    """
    W4 = functional.open_fused(W, n_heads, n_kv_heads)  # W[g C a i]
    r = W4.shape[1] - 2
    if not isinstance(W_O, torch.Tensor) or W_O.ndim != 3:
        shape = tuple(W_O.shape) if isinstance(W_O, torch.Tensor) else type(W_O).__name__
        raise EinattnError(f"W_O must be a 3-D tensor W_O[μ a i], got {shape}")
    return OV_CIRCUIT(W_V=W4[:, r + 1], W_O=W_O, r=r)


def qk(layer: MultiHeadAttention) -> torch.Tensor:
    """The QK circuit ``W_QK[μ i j]`` of a :class:`~einattn.MultiHeadAttention` layer
    without rotary embeddings (with them, the bilinear form depends on t − s)."""
    _check_layer(layer)
    if layer.rope is not None:
        raise EinattnError(f"this layer has rope={layer.rope!r}: its scores turn Q and K by "
                           f"the positions, so no single W_QK[μ i j] gives them")
    return qk_circuit(layer.W, n_heads=layer.n_heads, n_kv_heads=layer.n_kv_heads)


def ov(layer: MultiHeadAttention) -> torch.Tensor:
    """The OV circuit ``W_OV[μ i j]`` of a :class:`~einattn.MultiHeadAttention` layer."""
    _check_layer(layer)
    return ov_circuit(layer.W, layer.W_O, n_heads=layer.n_heads, n_kv_heads=layer.n_kv_heads)


def _check_layer(layer) -> None:
    if not isinstance(layer, MultiHeadAttention):
        raise EinattnError(f"layer must be an einattn.MultiHeadAttention, got "
                           f"{type(layer).__name__}; for bare weights use qk_circuit(W, ...) "
                           f"or ov_circuit(W, W_O, ...)")
