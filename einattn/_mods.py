"""Pieces a user writes: :class:`MaskMod` (FlexAttention's ``mask_mod``), :class:`ScoreMod`
(its ``score_mod``), functions of the indices, and :class:`Mask`, an index predicate in the
equation language, such as ``"σ ≤ τ ∧ τ − σ < w"``. Each is bound like every piece.

``b``, ``h``, ``q_idx`` and ``kv_idx`` are the sample ``n``, the head ``μ``, and the positions
of query and key: a query among fewer queries than keys (a KV cache) sits at ``τ + L_k −
L_q``, as ``causal`` aligns it, so that one function is right for a prefill, cached decoding
and the ring. A MaskMod is judged per tile by evaluating it once over each tile grid (a block
of rows at a time, never ``L_q × L_k`` at once), kept per function and sizes: the function
itself is the key, so a new closure is never taken for an old one, even at a recycled id.
A Mask is judged by interval arithmetic over each tile's ranges of indices
(:mod:`einattn._intervals`), exactly and without evaluating it per element.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import _intervals, _predicate
from ._piece import Frame, MaskPiece, ScorePiece
from .errors import EinattnError

_ROWS = 1 << 22  # booleans evaluated at once while judging a MaskMod (4 MiB)


def _named(fn) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


@dataclass(frozen=True)
class _Function:
    """A piece that is a user's function, ``FORM`` in FlexAttention's words."""

    fn: Callable

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise EinattnError(f"{type(self).__name__} takes a function {self.FORM}, as "
                               f"FlexAttention's, got {type(self.fn).__name__}")

    def latex(self) -> str:
        return self.LATEX_FORM.replace("NAME", _named(self.fn))


@dataclass(frozen=True)
class MaskMod(_Function, MaskPiece):
    """A piece of the mask ``M`` from FlexAttention's ``mask_mod``:
    ``fn(b, h, q_idx, kv_idx) -> bool tensor``, True = may attend (a user's existing mask_mod
    ports unchanged), in torch operations on index tensors that broadcast. Its tile
    judgement is kept per function and sizes: what it captures must not change in place."""

    FORM = "mask_mod(b, h, q_idx, kv_idx) -> bool tensor"
    LATEX_FORM = (r"M_{n\mu\tau\sigma} = \begin{cases} 0 & \operatorname{NAME}(n, \mu, "
                  r"\tau', \sigma) \\ -\infty & \text{otherwise} \end{cases}")

    def allowed(self, n, mu, tau, sigma):
        ok = self.fn(n, mu, tau, sigma)
        if not isinstance(ok, torch.Tensor) or ok.dtype != torch.bool:
            got = ok.dtype if isinstance(ok, torch.Tensor) else type(ok).__name__
            raise EinattnError(f"MaskMod({_named(self.fn)}) must return a bool tensor (True = "
                               f"may attend), got {got}")
        return ok

    def judge(self, frame: Frame, size: int):
        if torch.compiler.is_compiling() or type(frame.q0) is not int:
            return super().judge(frame, size)
        some, every, _, _ = _evaluated(self, frame, size)
        q0, k0 = frame.q0, frame.k0
        return lambda t0, t1, s0, s1: (some[(t0 - q0) // size][(s0 - k0) // size],
                                       every[(t0 - q0) // size][(s0 - k0) // size])

    def keys(self, frame: Frame, t0: int, t1: int):
        """The keys the queries ``t0..t1`` see, read from the function's values."""
        if torch.compiler.is_compiling() or type(frame.q0) is not int:
            return None
        _, _, lo, hi = _evaluated(self, frame, max(frame.L_q, frame.L_k, 1))
        rows = slice(t0 - frame.q0, t1 - frame.q0 + 1)
        return min(lo[rows], default=frame.L_k) + frame.k0, max(hi[rows], default=-1) + frame.k0


@functools.lru_cache(maxsize=32)
def _evaluated(mod: MaskMod, frame: Frame, size: int) -> tuple[list, list, list, list]:
    """Over tiles of ``size``: whether some key is seen and whether every one is (for every
    ``n`` and ``μ``), and each query row's first and last key seen (``L_k`` and −1: none)."""
    n, n_heads, L_q, L_k, q0, k0, device = frame
    with torch.inference_mode(False), torch.no_grad():
        b, h = (torch.arange(n, device=device).view(-1, 1, 1, 1),
                torch.arange(n_heads, device=device).view(1, -1, 1, 1))
        kv = torch.arange(L_k, device=device).view(1, 1, 1, -1) + k0
        probe = mod.allowed(b, h, torch.full((1, 1, 1, 1), q0, device=device), kv[..., :1])
        rows = max(size, _ROWS // max(1, L_k * probe.shape[0] * probe.shape[1]) // size * size)
        parts = [_judged_rows(mod, b, h, kv, q0, t, min(t + rows, L_q), size)
                 for t in range(0, L_q, rows)]
    return tuple(list(itertools.chain.from_iterable(p[i] for p in parts)) for i in range(4))


def _judged_rows(mod: MaskMod, b, h, kv, q0: int, t0: int, t1: int, size: int):
    """:func:`_evaluated` for the query rows ``t0 … t1 − 1`` (a whole number of blocks)."""
    tau = torch.arange(t0, t1, device=kv.device).view(1, 1, -1, 1) + q0
    ok = _broadcast(mod, mod.allowed(b, h, tau, kv), (b.shape[0], h.shape[1], t1 - t0,
                                                       kv.shape[3]))
    some, every = ok.any(1).any(0), ok.all(1).all(0)  # [τ σ] over every n and μ
    seen = some.any(-1)
    first = torch.where(seen, some.int().argmax(-1), kv.shape[3])
    last = torch.where(seen, kv.shape[3] - 1 - some.flip(-1).int().argmax(-1), -1)
    pad = (0, -kv.shape[3] % size, 0, -(t1 - t0) % size)
    tiles = [torch.nn.functional.pad(m, pad, value=v).unflatten(1, (-1, size))
             .unflatten(0, (-1, size)).transpose(1, 2).flatten(2) for m, v in
             ((some, False), (every, True))]
    return (tiles[0].any(-1).tolist(), tiles[1].all(-1).tolist(), first.tolist(),
            last.tolist())


def _broadcast(mod: MaskMod, ok: torch.Tensor, shape: tuple) -> torch.Tensor:
    """``ok`` as ``(n or 1, μ or 1, τ, σ)``: the axes the function reads, the others of 1."""
    ok = ok.reshape((1,) * (4 - ok.ndim) + tuple(ok.shape))
    if ok.ndim != 4 or any(got not in (1, want) for got, want in zip(ok.shape, shape,
                                                                   strict=True)):
        raise EinattnError(f"MaskMod({_named(mod.fn)}) must return a bool tensor that "
                           f"broadcasts to (n, μ, τ, σ) = {shape}, got {tuple(ok.shape)}")
    return ok.expand(ok.shape[0], ok.shape[1], shape[2], shape[3])


@dataclass(frozen=True)
class ScoreMod(_Function, ScorePiece):
    """A term of the scores from FlexAttention's ``score_mod``:
    ``fn(score, b, h, q_idx, kv_idx) -> score``, applied to the scaled scores before the mask
    (a relative-position bias, a cap). Differentiable: gradients reach Q, K and the tensors
    ``fn`` captures with ``requires_grad`` (its closure's, its defaults', the globals it
    names), on the chunked path through its recomputing backward too."""

    FORM = "score_mod(score, b, h, q_idx, kv_idx) -> score"
    LATEX_FORM = r"\operatorname{NAME}\left(S_{n\mu\tau\sigma}, n, \mu, \tau', \sigma\right)"

    def score(self, S, n, mu, tau, sigma):
        out = self.fn(S, n, mu, tau, sigma)
        if not isinstance(out, torch.Tensor) or out.shape != S.shape:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise EinattnError(f"ScoreMod({_named(self.fn)}) must return a score of the shape "
                               f"it was given, {tuple(S.shape)}, got {got}")
        return out

    @property
    def tensors(self) -> tuple:
        """The tensors ``fn`` captures that want a gradient."""
        return tuple(t for t in _captured(self.fn) if t.requires_grad)

    def grads(self, S, dS, n, mu, tau, sigma) -> tuple:
        """``(∂L/∂S, ∂L/∂tensors)`` from ``∂L/∂score``, by autograd through ``fn``."""
        tensors = self.tensors
        with torch.enable_grad():
            S_in = S.detach().requires_grad_()
            out = self.score(S_in, n, mu, tau, sigma)
            grads = torch.autograd.grad(out, (S_in, *tensors), dS, allow_unused=True)
        return grads[0], tuple(torch.zeros_like(t) if g is None else g
                               for t, g in zip(tensors, grads[1:], strict=True))


def _captured(fn, depth: int = 0) -> list:
    """The tensors a function reads besides its arguments: its closure, its defaults, the
    globals it names, a ``functools.partial``'s arguments; functions among them, searched
    the same way (two levels deep)."""
    if depth > 2:
        return []
    if isinstance(fn, functools.partial):
        found = [*fn.args, *fn.keywords.values(), fn.func]
    else:
        code = getattr(fn, "__code__", None)
        cells = [c.cell_contents for c in getattr(fn, "__closure__", None) or ()
                 if c.cell_contents is not fn]
        named = [] if code is None else [fn.__globals__[k] for k in code.co_names
                                         if k in getattr(fn, "__globals__", {})]
        found = [*cells, *(getattr(fn, "__defaults__", None) or ()), *named,
                 *(getattr(fn, "__kwdefaults__", None) or {}).values()]
    out = []
    for item in found:
        if isinstance(item, torch.Tensor):
            out += [] if any(item is t for t in out) else [item]
        elif (callable(item) and hasattr(item, "__code__")) \
                or isinstance(item, functools.partial):
            out += [t for t in _captured(item, depth + 1) if not any(t is u for u in out)]
    return out


@dataclass(frozen=True, init=False)
class Mask(MaskPiece):
    """A piece of the mask ``M`` written as an index predicate (:mod:`einattn._predicate`):
    ``Mask("σ ≤ τ ∧ τ − σ < w", w=256)``, with ``n``, ``μ``, ``τ``, ``σ`` positions and
    named integer parameters. It renders as LaTeX (:meth:`latex`), runs on index tensors (the
    dense form, a tile's, FlexAttention's mask_mod) and judges a tile by interval arithmetic
    over the tile's ranges, exactly, with no evaluation per element."""

    text: str
    params: tuple

    def __init__(self, text: str, **params: int) -> None:
        if not isinstance(text, str):
            raise EinattnError(f"Mask takes the predicate as a string, such as 'σ ≤ τ', got "
                               f"{type(text).__name__}")
        for name, value in params.items():
            if isinstance(value, bool) or not isinstance(value, int):
                raise EinattnError(f"Mask parameter {name} must be an int (positions are "
                                   f"integers), got {value!r}")
        object.__setattr__(self, "text", text)
        object.__setattr__(self, "params", tuple(sorted(params.items())))
        object.__setattr__(self, "tree", _predicate.parse(text, params))

    def latex(self) -> str:
        return (rf"M_{{n\mu\tau\sigma}} = \begin{{cases}} 0 & {_predicate.latex(self.tree)} \\ "
                rf"-\infty & \text{{otherwise}} \end{{cases}}")

    def allowed(self, n, mu, tau, sigma):
        ok = _predicate.run(self.tree, {"n": n, "μ": mu, "τ": tau, "σ": sigma})
        return torch.tensor(ok) if isinstance(ok, bool) else ok

    def judge(self, frame: Frame, size: int):
        ranges = {"n": (0, frame.n - 1), "μ": (0, frame.n_heads - 1)}
        return lambda t0, t1, s0, s1: _intervals.judge(
            self.tree, {**ranges, "τ": (t0, t1), "σ": (s0, s1)})

    def keys(self, frame: Frame, t0: int, t1: int) -> tuple[int, int]:
        return _intervals.keys(self.tree, {"n": (0, frame.n - 1), "μ": (0, frame.n_heads - 1),
                                           "τ": (t0, t1),
                                           "σ": (frame.k0, frame.k0 + frame.L_k - 1)})
