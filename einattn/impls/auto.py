"""``impl="auto"``: the impl that runs a call fastest, of those that give its exact answer,
chosen per call from what the call is: its pattern (does SDPA take all of it? does a mask
leave tiles empty? is there a cap or a sink?), its sizes, dtype and device, and whether
autograd records it. The call then runs on that impl, with the same arguments: its output is
that impl's, bit for bit.

The rules are one table, :data:`RULES`, read top to bottom, the first that holds deciding;
each names a test of the call (:data:`TESTS`) and the impl it picks, and says why. They come
from ``benchmarks/auto.py`` on this project's CPU (one thread, 2026-11-26; the table in
docs/performance.md); retune them there when an impl gets faster. :func:`choose` gives the
choice and its reason (``einattn.functional.explain`` asks it without running), logs it to
the ``einattn.auto`` logger at DEBUG, and :func:`recording` collects the choices made
inside it (a layer's, a whole Hugging Face model's).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import NamedTuple

import torch

LOG = logging.getLogger("einattn.auto")

# The sizes below are in scores per head (L_q · L_k); the ratios beside them are medians of
# benchmarks/auto.py (one thread, process CPU time, 2026-11-26, a shared machine), at L = 96–2048
# between the grid's 5, 512 and 4096.
#
# At most this many scores per head (L_q · L_k), a call is small: its cost is the impl's
# per-call Python, least on SDPA's one kernel (or the einsum path's few, where SDPA cannot
# take the pattern).
SMALL = 64 * 64
# From this many, the chunked path's skipped tiles pay for its Python (a causal window of
# 256 at L = 448: 0.81× SDPA's masked kernel forward, 0.95× trained; 8 packed documents:
# 0.89×, 0.82×; at L = 384 SDPA leads the documents, 0.85× chunked, and ties the window).
TILED = 400 * 400
# Where SDPA cannot take the pattern (a sink or a cap), the chunked tiles lead the equations
# (einsum) from this many scores, by (a sink?, gradients?); measured under the causal rule.
TERMS_TILED = {
    # a sink, forward: einsum leads at 80 (chunked 1.03×); chunked 0.92× at 96, 0.77× at 128
    (True, False): 88 * 88,
    # a sink, trained: einsum 0.94× chunked at 128; ties at 160; chunked 0.89× at 192
    (True, True): 160 * 160,
    # a cap, forward: einsum 0.94× chunked at 192; ties at 224; chunked 0.98× at 256, 0.70× at 352
    (False, False): 240 * 240,
    # a cap, trained: einsum 0.82× chunked at 288, 0.97–1.01× at 320–352; chunked 0.94× at 384,
    # 0.80× at 512
    (False, True): 368 * 368,
}
# (Retuned 2026-11-26 after the chunked backward's fewer passes; benchmarks/auto.py with
# --sample-s 0.1, 9–11 rounds.)


class Choice(NamedTuple):
    """The impl ``impl="auto"`` runs a call on, and why (the rule that decided)."""

    impl: str
    reason: str


class Call:
    """What the rules read of one call, each fact worked out when a rule first asks for it
    (at small sizes the call costs little more than its Python: the first rules ask least)."""

    __slots__ = ("K", "M", "Q", "V", "pattern", "scores", "seen", "spec")

    def __init__(self, Q, K, V, M, pattern, spec, seen: bool) -> None:
        self.Q, self.K, self.V, self.M, self.pattern, self.spec = Q, K, V, M, pattern, spec
        self.seen = seen  # the weights A are asked for
        self.scores = Q.shape[2] * K.shape[2]  # L_q · L_k, the scores per head

    @property
    def grad(self) -> bool:
        """Whether autograd records the call."""
        return torch.is_grad_enabled() and any(
            t is not None and t.requires_grad
            for t in (self.Q, self.K, self.V, self.M, self.pattern.sinks))

    @property
    def sdpa_takes(self) -> bool:
        """Whether SDPA's mask (and ``is_causal``) hold the whole pattern: no cap, no sink."""
        return self.pattern.additive

    @property
    def causal_only(self) -> bool:
        """The causal rule alone over as many queries as keys, no mask: SDPA's is_causal."""
        return self.M is None and self.pattern.causal_only

    @property
    def skips(self) -> bool:
        """Whether a mask piece other than the causal rule alone leaves tiles empty."""
        return bool(self.pattern.masks) and not self.pattern.causal_only

    @property
    def band(self) -> bool:
        """Whether each query sees a band of keys (a sliding window)."""
        return self.pattern.band() is not None

    @property
    def sink(self) -> bool:
        """Whether a sink logit joins each row's softmax."""
        return self.pattern.sinks is not None

    @property
    def flex_runs(self) -> bool:
        """Whether FlexAttention runs the call here: compiled (not float64), forward only
        on the CPU, no dropout, every score term a mod of its own."""
        return (not self.spec.dropout and self.Q.dtype != torch.float64
                and not (self.Q.device.type == "cpu" and self.grad)
                and self.pattern.refusal("flex") is None)


def _flex_ahead(c: Call) -> bool:
    """Off the CPU, a forward FlexAttention runs a window or a cap from TILED scores: its one
    compiled kernel, where the chunked path loops over tiles (not measured: no GPU here; with
    gradients neither). On the CPU the chunked tiles lead it (L = 512, 4096 forward: a window
    0.60×, a cap 0.67–0.81×, a sink 0.54–0.58×, packed documents 0.27–0.37×), and at L = 5
    SDPA or the equations do, so it is never picked there."""
    if c.Q.device.type == "cpu" or c.sink or c.grad or c.scores < TILED or not c.flex_runs:
        return False
    return c.band or not c.sdpa_takes


TESTS = {
    "weights": lambda c: c.seen,
    "small, SDPA takes it": lambda c: c.scores <= SMALL and c.pattern.additive,  # sdpa_takes
    "small": lambda c: c.scores <= SMALL,
    "causal or no piece": lambda c: c.sdpa_takes and not c.skips,
    "forward off the CPU, FlexAttention": _flex_ahead,
    "a mask SDPA takes, from TILED": lambda c: c.scores >= TILED and c.sdpa_takes,  # skips
    "SDPA takes it": lambda c: c.sdpa_takes,
    "a sink or a cap, from TERMS_TILED": lambda c: c.scores >= TERMS_TILED[c.sink, c.grad],
    "anything else": None,  # what no rule above took
}

# (test, impl, why): the first whose test holds picks
RULES = (
    ("weights", "einsum", "the weights A exist on the einsum path alone"),
    ("small, SDPA takes it", "sdpa", "a small call: SDPA's one kernel has the least Python"),
    ("small", "einsum", "a small call SDPA cannot take: the equations' few kernels"),
    ("causal or no piece", "sdpa",
     "SDPA's flash kernel takes the whole pattern (is_causal, or a mask of the call's own)"),
    ("forward off the CPU, FlexAttention", "flex",
     "compiled FlexAttention skips the empty tiles and runs a cap in its kernel"),
    ("a mask SDPA takes, from TILED", "chunked",
     "a mask leaves tiles empty: the chunked path skips them"),
    ("SDPA takes it", "sdpa", "SDPA takes the whole pattern as its mask, below TILED"),
    ("a sink or a cap, from TERMS_TILED", "chunked",
     "a sink or a cap SDPA cannot take: one more term of the chunked tiles' online softmax"),
    ("anything else", "einsum",
     "a sink or a cap SDPA cannot take, below TERMS_TILED: the equations' few kernels"),
)
_CHOICES = tuple((TESTS[test], Choice(impl, f"{test}: {why}")) for test, impl, why in RULES)
_TESTED, _OTHERWISE = _CHOICES[:-1], _CHOICES[-1][1]  # the last rule: anything else


def choose(Q, K, V, M, pattern, spec, seen: bool) -> Choice:
    """The impl ``impl="auto"`` runs this call on (``Q``, ``K``, ``V``, the mask ``M``, the
    bound ``pattern`` and ``spec`` as :func:`einattn.impls.run` has them), and why: the
    first of :data:`RULES` whose test holds."""
    call = Call(Q, K, V, M, pattern, spec, seen)
    for test, choice in _TESTED:  # a loop, not next(...): no generator per call
        if test(call):
            return choice
    return _OTHERWISE


def noted(choice: Choice, Q, K) -> str:
    """The impl of ``choice``, made for a call with ``Q`` and ``K``, once it is logged (at
    DEBUG, to ``einattn.auto``) and added to the open :func:`recording`'s."""
    if LOG.isEnabledFor(logging.DEBUG):
        LOG.debug("impl='auto' runs %s (%s): Q %s, K %s, %s on %s, %s", choice.impl,
                  choice.reason, tuple(Q.shape), tuple(K.shape), Q.dtype, Q.device.type,
                  "grad mode" if torch.is_grad_enabled() else "no_grad")
    for log in _recording.logs:
        log.append(choice)
    return choice.impl


class _Recording(threading.local):
    def __init__(self) -> None:
        self.logs: list[list[Choice]] = []  # the open recordings' lists, this thread's


_recording = _Recording()


@contextlib.contextmanager
def recording() -> Iterator[list[Choice]]:
    """Inside it, every choice ``impl="auto"`` makes is appended to the list it gives (a
    layer's, every layer's of a model): ``with recording() as choices: layer(x)``."""
    log: list[Choice] = []
    _recording.logs = [*_recording.logs, log]
    try:
        yield log
    finally:
        _recording.logs = [kept for kept in _recording.logs if kept is not log]
