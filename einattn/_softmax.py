"""The softmax of equation (3) written into the storage of its own scores.

On a CPU a fresh buffer of ``L_q × L_k`` scores costs more than its arithmetic: glibc maps
a block that large (always beyond 32 MiB) from the kernel afresh, and it page-faults on
first touch (at (2, 1024, 512, 8), 64 MiB of scores, the einsum path's forward+backward
was 13 % faster with two such buffers fewer, and made half the minor faults).

Where S is scratch, the einsum path's own scores that nothing else reads or returns,
:func:`over_scratch` writes ``A`` into S's storage, and in backward the scores' gradient
into the incoming ``dA`` (the fresh product of equation (4)'s backward, or of dropout's,
read by nobody else). The kernels are torch's own softmax and its backward, so the numbers
are the same bit for bit. Elsewhere (scores under :data:`WORTH` bytes; CUDA, whose
caching allocator makes a buffer cheap; a non-contiguous S; tensor subclasses such as
DTensor; ``torch.func`` transforms; a second derivative) the caller keeps the ordinary
out-of-place softmax.
"""

from __future__ import annotations

import torch

_aten = torch.ops.aten


# Below this many bytes of scores a fresh buffer is cheap (glibc serves it from the heap
# it keeps), and the autograd.Function's Python, ~50 µs forward+backward, is not.
WORTH = 1 << 20


def spendable(S: torch.Tensor) -> bool:
    """Whether writing over S saves enough to pay and is safe: a plain contiguous CPU tensor
    of at least :data:`WORTH` bytes, outside the ``torch.func`` transforms (their wrappers
    have no rule for ``out=``) and forward-mode AD (the Function has no jvp)."""
    return (S.numel() * S.element_size() >= WORTH and type(S) is torch.Tensor
            and S.device.type == "cpu" and S.is_contiguous() and not transformed())


def transformed() -> bool:
    """Whether a ``torch.func`` transform (vmap, grad, jvp, …) or forward-mode AD is active:
    there an ``autograd.Function`` without vmap and jvp rules, or a fused kernel without
    them, cannot run, and the caller takes a composite path. (One question to functorch,
    0.04 µs, where asking each tensor whether it is wrapped cost ~2 µs a call.)"""
    if torch.compiler.is_compiling():  # dynamo functionalizes what it traces itself
        return False
    return torch.autograd.forward_ad._current_level >= 0 \
        or torch._C._functorch.maybe_current_level() is not None


def over_scratch(S: torch.Tensor) -> torch.Tensor:
    """``softmax_σ(S)`` over the last axis, written into the storage of a :func:`spendable`
    S that is scratch: the caller neither reads it again nor hands it out."""
    if S.requires_grad and torch.is_grad_enabled():
        return _SoftmaxInPlace.apply(S)
    return _aten._softmax.out(S, -1, False, out=S)


class _SoftmaxInPlace(torch.autograd.Function):
    """``A = softmax_σ(S)`` in S's storage; backward ``dS = A ⊙ (dA − Σ_σ dA ⊙ A)`` in dA's."""

    @staticmethod
    def forward(ctx, S: torch.Tensor) -> torch.Tensor:
        ctx.mark_dirty(S)
        A = _aten._softmax.out(S, -1, False, out=S)
        ctx.save_for_backward(A)
        return A

    @staticmethod
    def backward(ctx, dA: torch.Tensor) -> torch.Tensor:
        (A,) = ctx.saved_tensors
        if torch.is_grad_enabled() or not dA.is_contiguous():  # create_graph: keep dA intact
            return torch._softmax_backward_data(dA, A, -1, A.dtype)
        return _aten._softmax_backward_data.out(dA, A, -1, A.dtype, grad_input=dA)


# -- equation (3)'s masking contract: a row with nothing to attend to gives zeros -------------

def masked(S: torch.Tensor, mask: torch.Tensor | None, every_row_sees_a_key: bool = False,
           *, scratch: bool = False, logits_mask: bool = False) -> torch.Tensor:
    """``softmax_σ(S + M)`` over the last axis, ``mask`` boolean (True = may attend, a
    masked score never read) or float (added). A row whose every key is masked gives exact
    zeros and zero gradients: its scores are set to 0 before the softmax and its weights to
    0 after, never a finite sentinel. ``every_row_sees_a_key``: the caller's promise that
    no row is fully masked, which skips those two passes; ``logits_mask``: S itself may be
    −∞ (a score term that masks, FlexAttention's way), and a row of S all −∞ is a fully
    masked row too. With ``scratch`` S may be spent: where :func:`spendable` finds that
    saves a buffer, the mask is applied to S in place and the softmax written over it."""
    scratch = scratch and spendable(S)
    softmax = over_scratch if scratch else _fresh
    if mask is None and not logits_mask:
        return softmax(S)
    admissible = None
    if mask is not None and mask.dtype == torch.bool:
        admissible = mask
        S = (S.masked_fill_ if scratch else S.masked_fill)(~mask, float("-inf"))
    elif mask is not None:
        admissible = mask != float("-inf")
        S = S.add_(mask) if scratch else S + mask
    if every_row_sees_a_key:
        return softmax(S)
    dead = None if admissible is None else ~admissible.any(dim=-1, keepdim=True)
    if logits_mask:  # −∞ all along a row of S itself
        empty = (maximum(S) == float("-inf"))[..., None]
        dead = empty if dead is None else dead | empty
    A = softmax((S.masked_fill_ if scratch else S.masked_fill)(dead, 0.0))
    return A.masked_fill(dead, 0.0)


def _fresh(S: torch.Tensor) -> torch.Tensor:
    return torch.softmax(S, dim=-1)


def guarded(logits: torch.Tensor) -> torch.Tensor:
    """``softmax_σ(logits)`` over the last axis, a row whose every logit is −∞ exact zeros
    with zero gradients (NaN, being no −∞, still propagates); over an empty axis, empty."""
    dead = (maximum(logits) == float("-inf"))[..., None]
    return torch.softmax(logits.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)


def logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """``log Σ_σ exp(logits)`` over the last axis: ``torch.logsumexp``, whose gradient on a
    row of −∞ (the empty sum, −∞ itself) is zeros rather than NaN; over an empty axis −∞."""
    dead = (maximum(logits) == float("-inf"))[..., None]
    lse = torch.logsumexp(logits.masked_fill(dead, 0.0), dim=-1)
    return lse.masked_fill(dead.squeeze(-1), float("-inf"))


def maximum(t: torch.Tensor) -> torch.Tensor:
    """``max_σ t`` over the last axis; over an empty axis the identity of max, as 0 is the
    empty sum's: −∞ (an integer dtype's least value, False for bool). The result stays on
    t's graph, so that a backward through it runs (t's gradient being empty)."""
    if t.shape[-1] == 0:
        least = (float("-inf") if t.is_floating_point() else False if t.dtype == torch.bool
                 else torch.iinfo(t.dtype).min)
        t = torch.cat([t, t.new_full((*t.shape[:-1], 1), least)], dim=-1)
    return t.amax(dim=-1)


def with_sink(S: torch.Tensor, mask: torch.Tensor | None, sinks: torch.Tensor) -> torch.Tensor:
    """Equation (3) with a sink: the softmax over σ and one more logit ``s_μ`` (S being
    ``S[n μ τ σ]``), whose weight is dropped. A row with nothing to attend to, its sink
    included (``s_μ = −∞``), gives zeros, as a fully masked row does."""
    if mask is not None:
        S = S.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else S + mask
    s = sinks.to(S.dtype)[:, None, None].expand(*S.shape[:-1], 1)
    return guarded(torch.cat([S, s], dim=-1))[..., :-1]
