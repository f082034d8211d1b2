"""The judgement of an index predicate (:mod:`einattn._predicate`) over a box of indices, by
interval arithmetic: whether some point of the box satisfies it and whether every one does,
with no evaluation per element.

Each index ranges over an interval (a tile's queries ``τ0..τ1`` and keys ``σ0..σ1``, every
``n`` and ``μ``); ``+``, ``−`` and floor division by a positive ``k`` are monotone in each
operand, so a comparison whose sides use each index once takes its least and greatest
values at corners of the box, and every integer between them (each index steps by one, and
``⌊x / k⌋`` steps by at most one): its judgement is exact. ``∧``, ``∨`` and ``¬`` of exact
judgements are exact where the parts cannot hide a point from one another (all but one
part of a ``∧`` true throughout, all but one of a ``∨`` false throughout); elsewhere the box
is cut in halves and each judged again, down to single points if need be, within a budget
beyond which the answer stays on the safe side (some key may be seen, not every one).
"""

from __future__ import annotations

from typing import NamedTuple

from ._predicate import Cmp, Floor, Index, Neg, Not, Num, Param

BUDGET = 256  # boxes judged at most for one tile


class Verdict(NamedTuple):
    """``some``: possibly satisfied somewhere (never False wrongly); ``every``: surely
    satisfied everywhere (never True wrongly); each ``_exact`` where it is also the truth."""

    some: bool
    every: bool
    some_exact: bool
    every_exact: bool


def judge(tree, box: dict, budget: list | None = None) -> tuple[bool, bool]:
    """``(some, every)`` of ``tree`` over ``box`` (index name → ``(lo, hi)``, ends
    included): exact, or, past the budget, ``some`` True and ``every`` False."""
    budget = [BUDGET] if budget is None else budget
    budget[0] -= 1
    v = verdict(tree, box)
    need_some = v.some and not v.some_exact
    need_every = not v.every and not v.every_exact
    if not (need_some or need_every) or budget[0] <= 0:
        return v.some, v.every
    halves = _halves(box)
    if halves is None:  # one point: exact by construction
        return v.some, v.every
    some, every = (False if need_some else v.some), (True if need_every else v.every)
    for half in halves:
        s, e = judge(tree, half, budget)
        some, every = (some or s) if need_some else some, (every and e) if need_every else every
    return some, every


def _halves(box: dict):
    """The box cut in two along its widest index, or None where it is one point."""
    name = max(box, key=lambda k: box[k][1] - box[k][0])
    lo, hi = box[name]
    if hi <= lo:
        return None
    mid = (lo + hi) // 2
    return {**box, name: (lo, mid)}, {**box, name: (mid + 1, hi)}


def verdict(x, box: dict) -> Verdict:
    """One pass over the tree with the box's intervals."""
    if isinstance(x, Cmp):
        a, b = interval(x.a, box), interval(x.b, box)
        lo, hi = a[0] - b[1], a[1] - b[0]  # of a − b
        some, every = _signs(x.op, lo, hi)
        return Verdict(some, every, x.exact or not some, x.exact or every)
    if isinstance(x, Not):
        v = verdict(x.x, box)
        return Verdict(not v.every, not v.some, v.every_exact, v.some_exact)
    parts = [verdict(p, box) for p in x.parts]
    return _all(parts) if x.op == "∧" else _any(parts)


def _all(parts: list) -> Verdict:
    some, every = all(p.some for p in parts), all(p.every for p in parts)
    open_ = [p for p in parts if not p.every]  # parts that do not hold throughout
    some_exact = not some or (len(open_) <= 1 and all(p.some_exact for p in open_))
    every_exact = every or any(not p.every and p.every_exact for p in parts)
    return Verdict(some, every, some_exact, every_exact)


def _any(parts: list) -> Verdict:
    some, every = any(p.some for p in parts), any(p.every for p in parts)
    live = [p for p in parts if p.some]  # parts that may hold somewhere
    some_exact = not some or any(p.some and p.some_exact for p in parts)
    every_exact = every or (len(live) <= 1 and all(p.every_exact for p in live))
    return Verdict(some, every, some_exact, every_exact)


def _signs(op: str, lo: int, hi: int) -> tuple[bool, bool]:
    """``(possibly, surely)`` for ``d op 0`` with ``d`` in ``[lo, hi]``."""
    if op == "<":
        return lo < 0, hi < 0
    if op == "≤":
        return lo <= 0, hi <= 0
    if op == ">":
        return hi > 0, lo > 0
    if op == "≥":
        return hi >= 0, lo >= 0
    if op == "=":
        return lo <= 0 <= hi, lo == hi == 0
    return not lo == hi == 0, not lo <= 0 <= hi  # ≠


def interval(x, box: dict) -> tuple[int, int]:
    """The least and the greatest value of an expression over the box."""
    if isinstance(x, (Num, Param)):
        return x.value, x.value
    if isinstance(x, Index):
        return box[x.name]
    if isinstance(x, Neg):
        lo, hi = interval(x.x, box)
        return -hi, -lo
    if isinstance(x, Floor):
        lo, hi = interval(x.x, box)
        return lo // x.k.value, hi // x.k.value
    (a_lo, a_hi), (b_lo, b_hi) = interval(x.a, box), interval(x.b, box)
    return (a_lo + b_lo, a_hi + b_hi) if x.op == "+" else (a_lo - b_hi, a_hi - b_lo)


def keys(tree, box: dict) -> tuple[int, int]:
    """The least and the greatest ``σ`` of ``box`` that some point with it satisfies the
    tree at (``(σ_hi + 1, σ_hi)``, an empty range, where none does): two binary searches,
    each step one judgement."""
    s_lo, s_hi = box["σ"]
    if not judge(tree, box)[0]:
        return s_hi + 1, s_hi
    lo, hi = s_lo, s_hi  # the least σ: the first prefix of the keys that some point sees
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if judge(tree, {**box, "σ": (s_lo, mid)})[0] else (mid + 1, hi)
    first, lo, hi = lo, s_lo, s_hi
    while lo < hi:  # the greatest σ: the last suffix
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if judge(tree, {**box, "σ": (mid, s_hi)})[0] else (lo, mid - 1)
    return first, lo

