"""Pieces a user writes: :class:`MaskMod` (FlexAttention's ``mask_mod``), :class:`ScoreMod`
(its ``score_mod``), functions of the indices, and :class:`Mask`, an index predicate in the
equation language, such as ``"σ ≤ τ ∧ τ − σ < w"``. Each is bound like every piece.

``b``, ``h``, ``q_idx`` and ``kv_idx`` are the sample ``n``, the head ``μ``, and the positions
of query and key: a query among fewer queries than keys (a KV cache) sits at ``τ + L_k −
L_q``, as ``causal`` aligns it, so that one function is right for a prefill, cached decoding
and the ring. A MaskMod is judged per tile by evaluating it once over each tile grid (a block
of rows at a time, never ``L_q × L_k`` at once), kept per MaskMod, sizes and what its
function reads (:mod:`einattn._reads`): a new MaskMod, even of the same function, is judged
afresh, and so is one whose function reads a global since rebound or a tensor since changed
in place. A Mask is judged by interval arithmetic over each tile's ranges of indices
(:mod:`einattn._intervals`), exactly and without evaluating it per element.
"""

from __future__ import annotations

import copy
import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from . import _intervals, _predicate, _reads, _softmax
from ._piece import Frame, MaskPiece, ScorePiece
from .errors import EinattnError

_ROWS = 1 << 19  # booleans evaluated at once while judging a MaskMod (512 KiB)


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


_SERIALS = itertools.count()  # each MaskMod its own number: a judgement is kept per MaskMod


@dataclass(frozen=True)
class MaskMod(_Function, MaskPiece):
    """A piece of the mask ``M`` from FlexAttention's ``mask_mod``:
    ``fn(b, h, q_idx, kv_idx) -> bool tensor``, True = may attend (a user's existing mask_mod
    ports unchanged), in torch operations on index tensors that broadcast. Its tile
    judgement is kept per MaskMod, sizes and what ``fn`` reads (:func:`einattn._reads.key`:
    a global rebound, a tensor it reads changed in place, and it is judged again)."""

    FORM = "mask_mod(b, h, q_idx, kv_idx) -> bool tensor"
    LATEX_FORM = (r"M_{n\mu\tau\sigma} = \begin{cases} 0 & \operatorname{NAME}(n, \mu, "
                  r"\tau', \sigma) \\ -\infty & \text{otherwise} \end{cases}")
    serial: int = field(default_factory=lambda: next(_SERIALS), init=False, repr=False)
    reads: tuple = field(default=(), init=False, repr=False)  # bound: _reads.key(fn)

    def allowed(self, n, mu, tau, sigma):
        ok = self.fn(n, mu, tau, sigma)
        if not isinstance(ok, torch.Tensor) or ok.dtype != torch.bool:
            got = ok.dtype if isinstance(ok, torch.Tensor) else type(ok).__name__
            raise EinattnError(f"MaskMod({_named(self.fn)}) must return a bool tensor (True = "
                               f"may attend), got {got}")
        return ok

    def bound(self, frame: Frame, dtype: torch.dtype) -> MaskMod:
        """This MaskMod with what its function reads now, which its kept judgements are
        kept under (under ``torch.compile``, which keeps none, itself)."""
        if torch.compiler.is_compiling():
            return self
        same = copy.copy(self)
        object.__setattr__(same, "reads", _reads.key(self.fn))
        return same

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
    ``n`` and ``μ``), and each query row's first and last key seen (``L_k`` and −1: none).
    The function is evaluated a block of rows at a time, about :data:`_ROWS` booleans, into
    results made before the first block (a small tensor kept between blocks made the heap
    grow by a block's worth each time: 300 MiB at L = 8192), so that nothing of
    ``L_q × L_k`` is made, whatever ``size``."""
    n, n_heads, L_q, L_k, q0, k0, device = frame
    with torch.inference_mode(False), torch.no_grad():
        b, h = (torch.arange(n, device=device).view(-1, 1, 1, 1),
                torch.arange(n_heads, device=device).view(1, -1, 1, 1))
        kv = torch.arange(L_k, device=device).view(1, 1, 1, -1) + k0
        probe = mod.allowed(b, h, torch.full((1, 1, 1, 1), q0, device=device), kv[..., :1])
        rows = max(1, _ROWS // max(1, L_k * probe.shape[0] * probe.shape[1]))
        T_q, T_k = -(-L_q // size), -(-L_k // size)
        # per row and block of keys: some seen, every one seen; per row: first, last seen
        out = (torch.zeros(T_q * size, T_k, dtype=torch.bool, device=device),
               torch.ones(T_q * size, T_k, dtype=torch.bool, device=device),
               torch.empty(L_q, dtype=torch.long, device=device),
               torch.empty(L_q, dtype=torch.long, device=device))
        for t in range(0, L_q, rows):
            _judge_rows(mod, b, h, kv, q0, (t, min(t + rows, L_q)), size, out)
        some, every, first, last = out
        return (some.unflatten(0, (-1, size)).any(1).tolist(),
                every.unflatten(0, (-1, size)).all(1).tolist(), first.tolist(), last.tolist())


def _judge_rows(mod: MaskMod, b, h, kv, q0: int, rows: tuple, size: int, out: tuple) -> None:
    """:func:`_evaluated` for the query rows ``t0 … t1 − 1``, written into ``out``."""
    t0, t1 = rows
    tau = torch.arange(t0, t1, device=kv.device).view(1, 1, -1, 1) + q0
    L_k = kv.shape[3]
    ok = _broadcast(mod, mod.allowed(b, h, tau, kv), (b.shape[0], h.shape[1], t1 - t0, L_k))
    some, every = ok.any(1).any(0), ok.all(1).all(0)  # [τ σ] over every n and μ
    pad = (0, -L_k % size)
    out[0][t0:t1] = torch.nn.functional.pad(some, pad, value=False).unflatten(1, (-1, size)) \
        .any(-1)
    out[1][t0:t1] = torch.nn.functional.pad(every, pad, value=True).unflatten(1, (-1, size)) \
        .all(-1)
    seen = some.any(-1)
    out[2][t0:t1] = torch.where(seen, some.int().argmax(-1), L_k)
    out[3][t0:t1] = torch.where(seen, L_k - 1 - some.flip(-1).int().argmax(-1), -1)


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
    (a relative-position bias, a cap; ``−∞`` masks, as in FlexAttention). Differentiable:
    gradients reach Q, K and the tensors ``fn`` reads with ``requires_grad``
    (:mod:`einattn._reads`: its closure's, its defaults', the globals it names, a bound
    method's module's parameters), on the chunked path through its recomputing backward
    too. A function that writes into its score is given a copy of it."""

    FORM = "score_mod(score, b, h, q_idx, kv_idx) -> score"
    LATEX_FORM = r"\operatorname{NAME}\left(S_{n\mu\tau\sigma}, n, \mu, \tau', \sigma\right)"
    finite = False  # it may give −∞: a row of −∞ is guarded as a fully masked one
    probed: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def score(self, S, n, mu, tau, sigma):
        spends = self._spends(S.dtype, S.device)
        if spends and S.requires_grad and torch.is_grad_enabled():
            self._check_differentiable(S.dtype, S.device)
        out = self.fn(S.clone() if spends else S, n, mu, tau, sigma)
        if not isinstance(out, torch.Tensor) or out.shape != S.shape:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise EinattnError(f"ScoreMod({_named(self.fn)}) must return a score of the shape "
                               f"it was given, {tuple(S.shape)}, got {got}")
        if out.dtype != S.dtype:
            raise EinattnError(f"ScoreMod({_named(self.fn)}) must return a score of the dtype "
                               f"it was given, {S.dtype}, got {out.dtype} (a tensor it reads "
                               f"of another dtype promotes it: cast that tensor, or the "
                               f"result with .to(score.dtype))")
        return out

    @property
    def tensors(self) -> tuple:
        """The tensors ``fn`` reads that want a gradient."""
        return tuple(t for t in _reads.tensors(self.fn) if t.requires_grad)

    def grads(self, S, dS, n, mu, tau, sigma) -> tuple:
        """``(∂L/∂S, ∂L/∂tensors)`` from ``∂L/∂score``, by autograd through ``fn``."""
        tensors = self.tensors
        with torch.enable_grad():
            S_in = S.detach().requires_grad_()
            out = self.score(S_in, n, mu, tau, sigma)
            grads = torch.autograd.grad(out, (S_in, *tensors), dS, allow_unused=True)
        return grads[0], tuple(torch.zeros_like(t) if g is None else g
                               for t, g in zip(tensors, grads[1:], strict=True))

    def tile_refusal(self, impl: str, frame: Frame, dtype: torch.dtype) -> str | None:
        """Under grad mode, on the chunked path (whose backward differentiates ``fn`` itself):
        a write into the score that autograd cannot differentiate, or a tensor ``fn``
        reads, wanting a gradient, where :mod:`einattn._reads` does not find it."""
        if impl != "chunked" or not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return None
        dtype = torch.promote_types(dtype, torch.float32)  # the tiles' scores
        if self._spends(dtype, frame.device) and not self._differentiable(dtype, frame.device):
            return self._in_place_refusal()
        hidden = self._hidden(dtype, frame.device)
        if hidden is None:
            return None
        return (f"ScoreMod({_named(self.fn)}) reads a tensor of shape {tuple(hidden.shape)} "
                f"that requires grad where einattn does not find it, so impl='chunked', whose "
                f"backward differentiates the function itself, would leave it without its "
                f"gradient: use impl='einsum' or 'sdpa', or let the function reach it through "
                f"its closure, its defaults, a global it names or the module of a bound "
                f"method (a parameter, a buffer or a tensor attribute)")

    def _hidden(self, dtype: torch.dtype, device) -> torch.Tensor | None:
        """A tensor wanting a gradient in the graph of ``fn``'s result that its search does
        not find (:func:`einattn._reads.unseen`), asked again when what ``fn`` reaches is
        another (not when a tensor's values change: an optimizer's step)."""
        reads = _reads.key(self.fn, versions=False)
        if self.probed.get("reads") != reads:
            out = self._probe(dtype, device, False)[0]
            self.probed["reads"] = reads
            self.probed["hidden"] = _reads.unseen(out, self.tensors) \
                if isinstance(out, torch.Tensor) else None
        hidden = self.probed["hidden"]
        return hidden if hidden is not None and hidden.requires_grad else None

    def _spends(self, dtype: torch.dtype, device) -> bool:
        """Whether ``fn`` writes into the score it is given (asked once, of a probe;
        not under ``torch.compile`` or the ``torch.func`` transforms, which trace it)."""
        if torch.compiler.is_compiling() or _softmax.transformed():
            return False
        if "spends" not in self.probed:
            with torch.no_grad():
                self.probed["spends"] = self._probe(dtype, device, False)[1]
        return self.probed["spends"]

    def _probe(self, dtype: torch.dtype, device, grad: bool) -> tuple:
        """``fn`` called on a score of one element, at index 0 everywhere (``grad``: a score
        that requires grad): ``(its result, whether it wrote into the score, the score)``."""
        at = torch.zeros((1, 1, 1, 1), dtype=torch.long, device=device)
        with torch.inference_mode(False):
            score = torch.zeros((1, 1, 1, 1), dtype=dtype, device=device, requires_grad=grad)
            given = score.clone()
            version = given._version
            return self.fn(given, at, at, at, at), given._version != version, score

    def _differentiable(self, dtype: torch.dtype, device) -> bool:
        """Whether autograd can differentiate ``fn``'s writes into its score (asked once)."""
        if "differentiable" not in self.probed:
            with torch.enable_grad():
                out, _, score = self._probe(dtype, device, True)
                try:
                    if isinstance(out, torch.Tensor) and out.requires_grad:
                        torch.autograd.grad(out.sum(), score, allow_unused=True)
                    self.probed["differentiable"] = True
                except RuntimeError:
                    self.probed["differentiable"] = False
        return self.probed["differentiable"]

    def _check_differentiable(self, dtype: torch.dtype, device) -> None:
        if not self._differentiable(dtype, device):
            raise EinattnError(self._in_place_refusal())

    def _in_place_refusal(self) -> str:
        return (f"ScoreMod({_named(self.fn)}) writes into its score in a way autograd cannot "
                f"differentiate (an in-place operation overwrote a value another one saved, "
                f"such as tanh_ then mul_): return a new tensor (score = 2 * torch.tanh(score "
                f"/ 2)), or call it under torch.no_grad()")


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
            if name in _predicate.INDICES or name in _predicate.WORDS:
                raise EinattnError(f"Mask parameter {name} is named as an index or a word of "
                                   f"the predicate ({', '.join(_predicate.INDICES)}, "
                                   f"{', '.join(_predicate.WORDS)}), where {name} would be "
                                   f"read as that: give the parameter another name")
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
