"""Checks of the options that the functional form and the layer both take: each says what
the option means and what it got."""

from __future__ import annotations

import math

import torch

from .errors import EinattnError

IMPLS = ("einsum", "sdpa", "chunked", "flex", "auto")


def check_impl(impl: str) -> str:
    """``impl`` itself, once it is known to name one of :data:`IMPLS`."""
    if impl not in IMPLS:
        raise EinattnError(f"impl must be one of {', '.join(map(repr, IMPLS))}, got {impl!r}")
    return impl


def _finite_positive(x) -> bool:
    """Whether ``x`` is a number (not a bool) with ``0 < x < ∞``."""
    return not isinstance(x, bool) and isinstance(x, (int, float)) and 0 < x < math.inf


def check_scale(scale) -> float:
    """``scale`` itself, once it is known to be a finite positive number."""
    if not _finite_positive(scale):
        raise EinattnError(f"scale (s in S = s · Q K, 1/√a by default) must be a finite "
                           f"positive number, got {scale!r}")
    return scale


def check_positive_int(name: str, value) -> int:
    """``value`` itself, once it is known to be an int ≥ 1 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise EinattnError(f"{name} must be a positive int, got {value!r}")
    return value


def check_max_length(max_length) -> int | None:
    """A cache's ``max_length`` itself, once it is known to be None or an int ≥ 1."""
    if max_length is not None and (isinstance(max_length, bool)
                                   or not isinstance(max_length, int) or max_length < 1):
        raise EinattnError(f"max_length (the most positions σ the cache holds) must be a "
                           f"positive int, got {max_length!r}")
    return max_length


def check_dropout(dropout) -> float:
    """``dropout`` itself, once it is known to be a probability in ``[0, 1)``."""
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) \
            or not 0.0 <= dropout < 1.0:
        raise EinattnError(f"dropout (the probability that a weight A[n μ τ σ] is zeroed) must "
                           f"be a number in [0, 1), got {dropout!r}")
    return dropout


def check_block_size(block_size) -> int:
    """``block_size`` itself, once it is known to be a positive int."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise EinattnError(f"block_size (the number of queries τ and of keys σ per tile) must "
                           f"be a positive int, got {block_size!r}")
    return block_size


def check_options(impl: str, dropout: float, block_size: int, is_causal=None) -> None:
    """The options of equations (2)–(4) that every call takes: impl, dropout, block size
    (and no ``is_causal``)."""
    check_impl(impl)
    check_dropout(dropout)
    check_block_size(block_size)
    refuse_is_causal(is_causal)


def refuse_is_causal(is_causal) -> None:
    """``is_causal`` is PyTorch's name (``F.scaled_dot_product_attention``,
    ``nn.MultiheadAttention``); einattn has one name for it, ``causal``."""
    if is_causal is not None:
        raise EinattnError(f"is_causal is PyTorch's name; einattn's is causal (got "
                           f"is_causal={is_causal!r}): pass causal={is_causal!r} (causal=True "
                           f"aligns the causal mask bottom-right where L_q ≠ L_k)")


def check_floating(name: str, t) -> None:
    """``t`` (where it is a tensor) holds floating-point numbers, as attention needs."""
    if isinstance(t, torch.Tensor) and not t.is_floating_point():
        raise EinattnError(f"{name} is {t.dtype}: attention runs on floating-point tensors "
                           f"(float16, bfloat16, float32, float64); convert with .to()")


def check_factory(device, dtype) -> dict:
    """The layer's ``device`` and ``dtype`` keywords, once the weights can be made with them:
    a floating-point dtype (a gradient needs one) and a device torch knows."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise EinattnError(f"dtype (the layer's weights') must be a floating-point torch.dtype "
                           f"(torch.float32, torch.bfloat16, ...), got {dtype!r}")
    try:
        if device is not None:
            torch.device(device)
    except (RuntimeError, TypeError):
        raise EinattnError(f"device must be a torch.device, its name or its index ('cpu', "
                           f"'cuda:0', 0, ...), got {device!r}") from None
    try:
        if device is not None:
            torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as error:  # a CPU build asked for CUDA asserts
        raise EinattnError(f"device {device!r} is not available here ({error})") from None
    return {"device": device, "dtype": dtype}


def check_window(window) -> int:
    """``window`` itself, once it is known to be an int ≥ 1."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise EinattnError(f"window (the number of keys σ a query τ sees, itself included) "
                           f"must be an int ≥ 1, got {window!r}")
    return window


def check_softcap(softcap) -> float:
    """``softcap`` itself, once it is known to be a finite number > 0."""
    if not _finite_positive(softcap):
        raise EinattnError(f"softcap (c in cap(S) = c · tanh(S / c)) must be a finite number "
                           f"> 0, got {softcap!r}")
    return float(softcap)


def check_document_ids(ids, n: int, L_q: int, L_k: int, device) -> torch.Tensor:
    """``document_ids`` itself, once it holds one integer id per key, ``(n, L_k)``, with the
    queries among the keys."""
    if L_q > L_k:
        raise EinattnError(f"document_ids needs the queries among the keys (L_q ≤ L_k, the "
                           f"queries being the last L_q): got L_q={L_q} queries and "
                           f"L_k={L_k} keys")
    if not isinstance(ids, torch.Tensor) or ids.shape != (n, L_k):
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise EinattnError(f"document_ids has shape {shape} but must be (n, σ) = ({n}, {L_k}): "
                           f"one document id d[n σ] per key (the queries' are the last "
                           f"L_q={L_q})")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise EinattnError(f"document_ids must hold integers (one id per document), got "
                           f"{ids.dtype}")
    if ids.device != device:
        raise EinattnError(f"document_ids is on {ids.device} but the scores are on {device}")
    return ids


def check_prefix(prefix, n: int, device):
    """``prefix`` itself, once it is an int ≥ 0 or integers ``(n,)`` on the call's device."""
    if isinstance(prefix, int) and not isinstance(prefix, bool) and prefix >= 0:
        return prefix
    if not isinstance(prefix, torch.Tensor) or prefix.shape != (n,) \
            or prefix.is_floating_point() or prefix.is_complex() or prefix.dtype == torch.bool:
        got = f"{prefix.dtype} {tuple(prefix.shape)}" if isinstance(prefix, torch.Tensor) \
            else repr(prefix)
        raise EinattnError(f"PrefixLM's prefix (the keys σ < p every query sees) must be an "
                           f"int ≥ 0 or integers p[n] of shape (n,) = ({n},), got {got}")
    if prefix.device != device:
        raise EinattnError(f"PrefixLM's prefix is on {prefix.device} but the scores are on "
                           f"{device}")
    return prefix


def check_per_head(t, name: str, what: str, n_heads: int, device) -> torch.Tensor:
    """``t`` itself, once it is a float tensor of one value per head on the call's device."""
    if not isinstance(t, torch.Tensor) or t.shape != (n_heads,) or not t.is_floating_point():
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else repr(t)
        raise EinattnError(f"{name} must be {what} of shape (n_heads,) = ({n_heads},), "
                           f"got {got}")
    if t.device != device:
        raise EinattnError(f"{name} is on {t.device} but the scores are on {device}")
    return t
