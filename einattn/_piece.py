"""The protocol of the pieces of equation (3), and how mask pieces compose.

    A[n μ τ σ] = softmax_σ( cap(S[n μ τ σ]) + B[μ τ σ] + M[n μ τ σ] )     (3)

A piece is one term of (3), free of shapes: :func:`einattn._binding.bind` binds it to one
call's sizes and positions, in one place. Its indices are positions: query τ of ``L_q``
sits at ``τ' = τ + q0`` (``q0 = L_k − L_q`` by default: the last ``L_q`` positions of
the keys, as ``causal`` aligns them), key σ at ``σ + k0`` (``k0 = 0``); the KV cache, the
static cache and the ring's pairs of chunks pass their own.

A piece says what it is, ``KIND`` ("mask", "score" or "sink"), and gives its LaTeX,
``latex()``. A mask piece, a predicate over the indices (True = may attend), gives

* ``allowed(n, μ, τ, σ)``, in torch operations on integer tensors that broadcast, so that
  one function is the dense form, a tile's form and FlexAttention's ``mask_mod``;
* ``judge(frame, size)``: a function of one tile's first and last query and key positions
  ``(τ0, τ1, σ0, σ1)`` (tiles of ``size``), whether some key may be seen there and whether
  every one is, from the bounds alone (``some`` may only err towards True, ``every`` towards
  False: a tile judged partial is masked where it is visited, which is always right);
* ``keys(frame, τ0, τ1)``: the key positions ``(lo, hi)`` the queries ``τ0..τ1`` may see at
  most (either None: no bound), or None; ``first_row(σ0)``: the first query position that sees
  key σ0 or a later one, or None; ``cuts(frame)``: positions a tile had better not straddle
  (where documents change), whose tiles then lie within one run of them;
* ``diagonal`` (every query may see the key at its own position), ``is_causal`` (it is the
  causal rule, which SDPA runs as ``is_causal``) and ``static`` (its judgement depends on
  positions alone, so it may be kept per pattern and sizes).

A score piece gives ``score(S, n, μ, τ, σ)``, ``grads(S, dS, n, μ, τ, σ)`` (∂L/∂S from
∂L/∂score, and the gradients of the ``tensors`` it reads that want one, for the chunked
path's recomputing backward), ``STAGE`` (0: a function of S such as the cap; 1: a term ``B``
added to it), ``additive`` (then ``bias(n, μ, τ, σ)`` is ``B``), ``finite`` (it gives a finite
score for a finite one: else a row it sets to −∞ is guarded as a fully masked row) and
``tile_refusal(impl, frame, dtype)`` (why the chunked or flex path cannot run it, or None).
``bound(frame, dtype)`` checks a piece against one call and gives the piece that runs
there. Mask pieces compose with ``&``, ``|`` and ``~``, as FlexAttention's ``and_masks``,
``or_masks`` do.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .errors import EinattnError


class Frame(NamedTuple):
    """One call as the pieces see it: its sizes, where its queries and keys start
    (``q0``: an int, or a 0-d tensor for a static cache's count), its device."""

    n: int
    n_heads: int
    L_q: int
    L_k: int
    q0: object
    k0: int
    device: torch.device


class Grid(NamedTuple):
    """The indices ``n, μ, τ, σ`` as integer tensors shaped to broadcast to
    ``(n, μ, τ, σ)``; :meth:`tile` takes one tile's rows and columns."""

    n: torch.Tensor
    mu: torch.Tensor
    tau: torch.Tensor
    sigma: torch.Tensor

    def tile(self, tau: slice, sigma: slice) -> Grid:
        return Grid(self.n, self.mu, self.tau[:, :, tau], self.sigma[:, :, :, sigma])


def grid(n: int, n_heads: int, L_q: int, L_k: int, device) -> Grid:
    """Every index of ``S[n μ τ σ]``, each on its own axis (made once per sizes and device
    outside ``torch.compile``: four ``arange`` cost 15 µs, a small part of a short call)."""
    if torch.compiler.is_compiling():
        return _grid(n, n_heads, L_q, L_k, device)
    return _cached_grid(n, n_heads, L_q, L_k, torch.device(device or "cpu"))


def _grid(n: int, n_heads: int, L_q: int, L_k: int, device) -> Grid:
    def along(size: int, axis: int) -> torch.Tensor:
        shape = [1, 1, 1, 1]
        shape[axis] = size
        return torch.arange(size, device=device).view(shape)
    return Grid(along(n, 0), along(n_heads, 1), along(L_q, 2), along(L_k, 3))


@functools.lru_cache(maxsize=64)
def _cached_grid(n: int, n_heads: int, L_q: int, L_k: int, device) -> Grid:
    with torch.inference_mode(False):  # ordinary tensors, whatever mode made them first
        return _grid(n, n_heads, L_q, L_k, device)


def partial_tile(t0: int, t1: int, s0: int, s1: int) -> tuple[bool, bool]:
    """The judgement of a piece that cannot tell: some key may be seen, not every one."""
    return True, False


class MaskPiece:
    """What every piece of the mask ``M`` has unless it says better (module docstring)."""

    KIND = "mask"
    diagonal = False
    is_causal = False
    static = True

    def latex(self) -> str:
        return self.LATEX

    def judge(self, frame: Frame, size: int):
        return partial_tile

    def keys(self, frame: Frame, t0: int, t1: int):
        return None

    def first_row(self, s0: int):
        return None

    def cuts(self, frame: Frame) -> tuple:
        return ()

    def bound(self, frame: Frame, dtype: torch.dtype) -> MaskPiece:
        return self

    def conjuncts(self) -> tuple:
        """The pieces this one and-s: itself."""
        return (self,)

    def __and__(self, other) -> AllOf:
        return AllOf(self.conjuncts() + _mask_piece(other, "&").conjuncts())

    def __or__(self, other) -> AnyOf:
        return AnyOf((self, _mask_piece(other, "|")))

    def __invert__(self) -> Not:
        return Not(self)


def _mask_piece(other, op: str) -> MaskPiece:
    if getattr(other, "KIND", None) != "mask":
        raise EinattnError(f"{op} composes pieces of the mask M (Causal(), Window(w), "
                           f"MaskMod(fn), Mask('σ ≤ τ'), ...), got {type(other).__name__}")
    return other


class ScorePiece:
    """What every term of the scores has unless it says better (module docstring)."""

    KIND = "score"
    STAGE = 0
    additive = False
    finite = True  # a finite score stays finite (no −∞ of its own)
    tensors = ()  # what it reads that wants a gradient, beside S

    def grads(self, S, dS, n, mu, tau, sigma) -> tuple:
        """``(∂L/∂S, ∂L/∂tensors)`` from ``∂L/∂score``: its ``grad``, and no tensor."""
        return self.grad(S, dS, n, mu, tau, sigma), ()

    def latex(self) -> str:
        return self.LATEX

    def bound(self, frame: Frame, dtype: torch.dtype) -> ScorePiece:
        return self

    def tile_refusal(self, impl: str, frame: Frame, dtype: torch.dtype) -> str | None:
        """Why ``impl`` (chunked, flex) cannot run this piece, bound to ``frame`` for scores
        of ``dtype``, as it is, or None."""
        return None


@dataclass(frozen=True)
class _Joined(MaskPiece):
    """Mask pieces joined by one operation, ``JOIN`` (``&`` or ``|``), ``LATEX_JOIN`` in
    LaTeX; ``EACH`` (``all`` or ``any``) joins what the parts say of a tile and of the
    diagonal."""

    parts: tuple

    def latex(self) -> str:
        return self.LATEX_JOIN.join(rf"\left({p.latex()}\right)" for p in self.parts)

    def allowed(self, n, mu, tau, sigma):
        return functools.reduce(self.JOIN, [p.allowed(n, mu, tau, sigma) for p in self.parts])

    def judge(self, frame: Frame, size: int):
        return _joined([p.judge(frame, size) for p in self.parts], self.EACH, self.EACH)

    @property
    def diagonal(self) -> bool:
        return self.EACH(p.diagonal for p in self.parts)

    def bound(self, frame: Frame, dtype: torch.dtype) -> _Joined:
        return type(self)(tuple(p.bound(frame, dtype) for p in self.parts))

    @property
    def static(self) -> bool:
        return all(p.static for p in self.parts)


class AllOf(_Joined):
    """``M₁ ∧ M₂ ∧ …``: a key may be seen where every part allows it."""

    JOIN, LATEX_JOIN, EACH = operator.and_, r" \wedge ", all

    def keys(self, frame: Frame, t0: int, t1: int):
        return _meet([p.keys(frame, t0, t1) for p in self.parts])

    def first_row(self, s0: int):
        rows = [r for r in (p.first_row(s0) for p in self.parts) if r is not None]
        return max(rows, default=None)

    def conjuncts(self) -> tuple:
        return self.parts


class AnyOf(_Joined):
    """``M₁ ∨ M₂ ∨ …``: a key may be seen where some part allows it."""

    JOIN, LATEX_JOIN, EACH = operator.or_, r" \vee ", any

    def keys(self, frame: Frame, t0: int, t1: int):
        ranges = [p.keys(frame, t0, t1) for p in self.parts]
        if any(r is None for r in ranges):
            return None
        lows, highs = [r[0] for r in ranges], [r[1] for r in ranges]
        return (None if None in lows else min(lows)), (None if None in highs else max(highs))


@dataclass(frozen=True)
class Not(MaskPiece):
    """``¬M``: a key may be seen where the part forbids it."""

    part: MaskPiece

    def latex(self) -> str:
        return rf"\neg\left({self.part.latex()}\right)"

    def allowed(self, n, mu, tau, sigma):
        return ~self.part.allowed(n, mu, tau, sigma)

    def judge(self, frame: Frame, size: int):
        inner = self.part.judge(frame, size)

        def tile(t0: int, t1: int, s0: int, s1: int) -> tuple[bool, bool]:
            some, every = inner(t0, t1, s0, s1)
            return not every, not some
        return tile

    def bound(self, frame: Frame, dtype: torch.dtype) -> Not:
        return Not(self.part.bound(frame, dtype))

    @property
    def static(self) -> bool:
        return self.part.static


def _joined(judges: list, some_of, every_of):
    """One judgement from the parts': ``some`` and ``every`` each by ``all`` (and) or
    ``any`` (or). And-ed, ``every`` is exact and ``some`` may err towards True; or-ed, the
    reverse: both as the protocol allows."""
    def tile(t0: int, t1: int, s0: int, s1: int) -> tuple[bool, bool]:
        answers = [judge(t0, t1, s0, s1) for judge in judges]
        return some_of(a[0] for a in answers), every_of(a[1] for a in answers)
    return tile


def _meet(ranges: list):
    """The key positions within every range given (None: no range given; a side None:
    no bound there)."""
    known = [r for r in ranges if r is not None]
    if not known:
        return None
    return _bound(max, [r[0] for r in known]), _bound(min, [r[1] for r in known])


def _bound(pick, ends: list):
    """``pick`` (max or min) of the ends that bound (None: none does)."""
    ends = [end for end in ends if end is not None]
    return pick(ends) if ends else None
