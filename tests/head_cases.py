"""The cases of a head-parallel layer, for tests/test_parallel.py: a float64 layer with
random parameters, the tensors of a call by name (masks of every shape, padding, RoPE
positions, a context), and the check that errors are within 1e-12 relative to scale.
"""

from __future__ import annotations

import torch
from conftest import TOL, randn

from einattn import MultiHeadAttention

F64 = torch.float64
# All sizes distinct where they meet (n, τ, σ, i, μ, a); a even, for RoPE; g = the 2 ranks.
N, L_Q, L_K, D, MU, A, G = 4, 7, 9, 11, 6, 10, 2
BLOCK = 4  # chunked: several key blocks, the last one partial


def within(errors: dict[str, float]) -> dict[str, float]:
    bad = {k: e for k, e in errors.items() if not e <= TOL[F64]}
    assert not bad, f"errors above {TOL[F64]:g}: {bad}"
    return errors


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, torch.distributed.tensor.DTensor) else t


def make_layer(*, n_kv_heads=None, impl="einsum", rope=None, bias=True, seed=0,
               **patterns) -> MultiHeadAttention:
    """A float64 layer with every parameter (biases, sinks too) random, the same on every
    rank."""
    layer = MultiHeadAttention(D, MU, d_head=A, n_kv_heads=n_kv_heads, bias=bias,
                               dtype=F64, impl=impl, block_size=BLOCK, rope=rope, **patterns)
    with torch.no_grad():
        for k, p in enumerate(layer.parameters()):
            p.copy_(randn(*p.shape, seed=seed * 10 + k) * p.shape[-1] ** -0.5)
    return layer


def inputs(options: str, *, seed: int = 1) -> dict:
    """The call's tensors for a case: x (and context) requiring grad, masks, and the
    cotangent T with which the loss is ⟨Y, T⟩."""
    L_k = L_K if "context" in options else L_Q
    call = {"x": randn(N, L_Q, D, seed=seed, requires_grad=True)}
    if "context" in options:
        call["context"] = randn(N, L_K, D, seed=seed + 1, requires_grad=True)
    if "bool nμτσ" in options:
        call["mask"] = randn(N, MU, L_Q, L_k, seed=seed + 2) > -0.6
        call["mask"][0, 4, 2] = False  # a fully masked row in a head of rank 1
    if "float nμτσ" in options:
        m = randn(N, MU, L_Q, L_k, seed=seed + 3)
        call["mask"] = m.masked_fill(randn(N, MU, L_Q, L_k, seed=seed + 4) < -0.8, -torch.inf)
        call["mask"].requires_grad_()
    if "float τσ" in options:  # one mask for every head: its gradient sums over all of them
        m = randn(L_Q, L_k, seed=seed + 6)
        call["mask"] = m.masked_fill(m < -1.0, -torch.inf).requires_grad_()
    if "bool n1τσ" in options:
        call["mask"] = randn(N, 1, L_Q, L_k, seed=seed + 5) > -0.6
    if "padding" in options:
        padding = torch.zeros(N, L_k, dtype=torch.bool)
        padding[0, L_k // 2:] = True
        call["key_padding_mask"] = padding
    if "causal" in options:
        call["causal"] = True
    if "positions" in options:  # RoPE positions t[n τ]: each sample from its own offset
        call["positions"] = torch.tensor([3, 0, 11, 5])[:, None] + torch.arange(L_Q)
    return call


def run(layer, call: dict, **extra):
    return layer(call["x"], call.get("context"),
                 **{k: v for k, v in call.items() if k not in ("x", "context")}, **extra)


def rope_in(options: str) -> str | None:
    return next((style for style in ("half", "interleaved") if style in options), None)
