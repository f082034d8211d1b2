"""The patterns section: attention under a causal sliding window of ``w`` keys (query τ sees
``τ − w < σ ≤ τ``), ``Z[n μ τ a]`` from ``Q[n μ τ a]``, ``K[n μ σ a]``, ``V[n μ σ a]``:

    sdpa_dense      F.scaled_dot_product_attention with the dense bool mask ``[τ σ]``
    chunked         einattn, impl="chunked", causal=True, window=w: empty tiles skipped
    chunked_causal  the same without the window: the work and memory the window saves
    sdpa_causal     F.scaled_dot_product_attention with ``is_causal=True``, the same as
                    chunked_causal: PyTorch's own flash kernel
    einsum          einattn, impl="einsum" with the window: equations (2)–(4) as written
    flex_compiled   hand-written: ``torch.compile(flex_attention)`` with the mask_mod
                    ``(kv <= q) & (kv > q - w)`` and a ``create_block_mask`` made once
    flex            einattn, impl="flex": FlexAttention, its BlockMask made on each call
                    from the chunked path's judgement of each tile
    chunked_maskmod the window written as a MaskMod, FlexAttention's mask_mod above
    chunked_mask    the window written as a Mask string, ``"σ ≤ τ ∧ τ − σ < w"``

and 8 packed documents of random lengths (``d[n τ] = d[n σ]``, block-diagonal, not causal):

    sdpa_documents     F.scaled_dot_product_attention with the dense bool mask ``[τ σ]``
    chunked_documents  einattn, impl="chunked", document_ids=d
    flex_documents     hand-written: ``torch.compile(flex_attention)`` with the mask_mod
                       ``d[q] == d[kv]`` and a ``create_block_mask`` made once

and, at each memory length (L = 8192), dense causal attention forward+backward alone: chunked
against SDPA's flash kernel (``chunked_causal``, ``sdpa_causal``; :func:`time_long_causal`).

The dense masks and the hand-written BlockMask are made once, outside the timed calls, as a
user caches them; what making them costs is reported apart (:class:`Setup`), with each
compiled form's first call. FlexAttention's CPU kernels are forward only: the flex forms
have no forward+backward row on a CPU.
"""

from __future__ import annotations

import importlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

from ..functional import attention
from ..patterns import Mask, MaskMod
from .forms import MODES, unavailable
from .memory import PATTERN_MEMORY_METHOD, MemoryRow, measured, peak_growth
from .settings import PatternSize
from .timing import Row, relative_deviation, time_interleaved

if TYPE_CHECKING:
    from .settings import Settings

PATTERN_FORMS = ("sdpa_dense", "chunked", "chunked_maskmod", "chunked_mask", "chunked_causal",
                 "sdpa_causal", "einsum", "flex_compiled", "flex")  # the window's
PATTERN_NAMES = {"sdpa_dense": "SDPA, dense mask", "chunked": "einattn chunked",
                 "chunked_maskmod": "einattn chunked, MaskMod",
                 "chunked_mask": "einattn chunked, Mask string",
                 "chunked_causal": "einattn chunked, no window",
                 "sdpa_causal": "SDPA, is_causal (no window)",
                 "einsum": "einattn einsum", "flex_compiled": "compiled flex (hand-written)",
                 "flex": 'einattn impl="flex"', "sdpa_documents": "SDPA, dense documents",
                 "chunked_documents": "einattn chunked, documents",
                 "flex_documents": "compiled flex, documents (hand-written)"}
DOCUMENT_FORMS = ("sdpa_documents", "chunked_documents", "flex_documents")
N_DOCUMENTS = 8
# Forward only, at the memory lengths: no L × L tensor (64 MiB of bool at L = 8192) is made.
FORWARD_MEMORY_FORMS = ("chunked_mask",)
FORWARD_MEMORY_LIMIT = 32 * 2 ** 20
FLEX_FORMS = ("flex_compiled", "flex", "flex_documents")
FORWARD_ONLY = "FlexAttention's CPU kernels are forward only"
# The forms whose peak memory is measured: the window's, the same without it (chunked and
# SDPA's flash kernel), the dense one.
PATTERN_MEMORY_FORMS = ("chunked", "chunked_causal", "sdpa_causal", "sdpa_dense", "chunked_mask")

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# Dense causal attention, chunked and SDPA's flash kernel: the window's forms without it, and
# issue 38's forms at the memory lengths (:func:`time_long_causal`).
CAUSAL_FORMS: dict[str, Attend] = {
    "chunked_causal": partial(attention, causal=True, impl="chunked"),
    "sdpa_causal": partial(F.scaled_dot_product_attention, is_causal=True)}


def window_mask(L: int, window: int) -> torch.Tensor:
    """The dense causal-window mask ``[τ σ]``, True = may attend: ``τ − w < σ ≤ τ``."""
    tau, sigma = torch.arange(L)[:, None], torch.arange(L)[None, :]
    return (sigma <= tau) & (sigma > tau - window)


def window_mod(w: int):
    """The causal window as FlexAttention's mask_mod, ``(kv <= q) & (q − kv < w)``."""
    def mask_mod(b, h, q, kv):
        return (kv <= q) & (q - kv < w)
    return mask_mod


def document_ids(L: int, *, seed: int = 3) -> torch.Tensor:
    """``d[n σ]`` of :data:`N_DOCUMENTS` documents of random lengths packed in ``L``."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randperm(L - 1, generator=g)[:N_DOCUMENTS - 1] + 1
    return torch.zeros(L, dtype=torch.long).index_fill_(0, starts, 1).cumsum(0)[None]


def documents_mask(ids: torch.Tensor) -> torch.Tensor:
    """The dense block-diagonal documents mask ``[τ σ]``, True = may attend: ``d[τ] = d[σ]``."""
    d = ids[0]
    return d[:, None] == d[None, :]


def pattern_inputs(size: PatternSize, *, seed: int = 1, dtype: torch.dtype = torch.float32):
    """``Q``, ``K``, ``V`` ``[n μ τ a]`` and the output gradient ``dZ``."""
    g = torch.Generator().manual_seed(seed)
    shape = (size.n, size.heads, size.L, size.d_head)
    return tuple(torch.randn(*shape, generator=g, dtype=dtype) for _ in range(4))


def _seconds(fn: Callable[[], object]) -> tuple[object, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def _hand_flex(size: PatternSize, setup: dict[str, float], mask_mod=None,
               what: str = "") -> Attend:
    """The hand-written FlexAttention call with ``mask_mod`` (the window's where None), its
    BlockMask made once (twice, to time the second, which no longer pays for the first's
    tracing), compiled for this mask alone (``dynamic=False``: one compiled function reused
    for a second mask fails in Inductor's C++ code generation, torch 2.13)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    w = size.window

    def window(b, h, q, kv):
        return (kv <= q) & (kv > q - w)

    def make():
        return create_block_mask(mask_mod or window, None, None, size.L, size.L, device="cpu")

    _, setup[f"create_block_mask{what} first call"] = _seconds(make)
    block_mask, setup[f"create_block_mask{what}"] = _seconds(make)
    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda Q, K, V: compiled(Q, K, V, block_mask=block_mask)


def pattern_forms(size: PatternSize, names: tuple[str, ...] = PATTERN_FORMS) \
        -> tuple[dict[str, Attend], dict[str, float]]:
    """The forms named, as functions of ``(Q, K, V)``, and what setting them up cost in
    seconds (the dense mask, the hand-written BlockMask)."""
    w, setup = size.window, {}
    dense, setup["dense mask"] = _seconds(lambda: window_mask(size.L, w))
    forms = {"sdpa_dense": partial(F.scaled_dot_product_attention, attn_mask=dense),
             "chunked": partial(attention, causal=True, window=w, impl="chunked"),
             "chunked_maskmod": partial(attention, pattern=MaskMod(window_mod(w)),
                                        impl="chunked"),
             "chunked_mask": partial(attention, pattern=Mask("σ ≤ τ ∧ τ − σ < w", w=w),
                                     impl="chunked"),
             **CAUSAL_FORMS,
             "einsum": partial(attention, causal=True, window=w, impl="einsum"),
             "flex": partial(attention, causal=True, window=w, impl="flex")}
    if "flex_compiled" in names:
        forms["flex_compiled"] = _hand_flex(size, setup)
    if set(DOCUMENT_FORMS) & set(names):
        ids = document_ids(size.L)
        documents, setup["dense documents mask"] = _seconds(lambda: documents_mask(ids))
        forms["sdpa_documents"] = partial(F.scaled_dot_product_attention, attn_mask=documents)
        forms["chunked_documents"] = partial(attention, impl="chunked",
                                             document_ids=ids.expand(size.n, size.L))
        if "flex_documents" in names:
            d = ids[0]
            forms["flex_documents"] = _hand_flex(size, setup, lambda b, h, q, kv: d[q] == d[kv],
                                                 " (documents)")
    return {name: forms[name] for name in names}, setup


def pattern_skipped(settings: Settings) -> dict[str, str]:
    """The forms this run leaves out, with the reason: the flex forms without compiling or
    without FlexAttention, the chunked ones without einattn.chunked."""
    skipped = {}
    chunked = unavailable().get("chunked")
    if chunked:
        skipped |= dict.fromkeys(("chunked", "chunked_maskmod", "chunked_mask",
                                  "chunked_causal", "chunked_documents"), chunked)
    why = settings.why_no_flex
    if not why:
        try:
            importlib.import_module("torch.nn.attention.flex_attention")
        except ImportError:
            why = f"torch {torch.__version__} has no FlexAttention"
        else:
            why = "" if torch._dynamo.is_dynamo_supported() else "no torch.compile here"
    return skipped | (dict.fromkeys(FLEX_FORMS, why) if why else {})


def pattern_step(form: Attend, mode: str, qkv: tuple[torch.Tensor, ...], dZ: torch.Tensor) \
        -> Callable[[], None]:
    """One call of ``form`` in ``mode``: "forward" under ``torch.no_grad()`` on inputs that
    need no gradient; "forward+backward" on copies that do, their gradients reset to None,
    then ``Z.backward(dZ)``."""
    if mode == "forward":
        def forward() -> None:
            with torch.no_grad():
                form(*qkv)
        return forward

    leaves = tuple(t.detach().clone().requires_grad_() for t in qkv)

    def forward_backward() -> None:
        for t in leaves:
            t.grad = None
        form(*leaves).backward(dZ)
    return forward_backward


@dataclass
class PatternRow(Row):
    """One pattern size and mode: every form's timing, and how far its ``Z`` is from the
    dense SDPA's."""

    size: PatternSize
    BASES: ClassVar[dict[str, str]] = {"vs_sdpa_dense": "sdpa_dense",
                                       "vs_flex_compiled": "flex_compiled",
                                       "vs_sdpa_causal": "sdpa_causal",
                                       "vs_flex_documents": "flex_documents"}


@dataclass
class Setup:
    """What one size's forms cost before their timed calls, in seconds: the dense mask, the
    hand-written BlockMask, each compiled form's first call."""

    size: PatternSize
    seconds: dict[str, float]

    def as_json(self) -> dict:
        return {"size": self.size.as_json(), "seconds": self.seconds}


def _deviations(outputs: dict[str, torch.Tensor], Q, K, V, size: PatternSize) \
        -> dict[str, float]:
    """Each form's ``max |ΔZ|`` from SDPA's with the dense mask of its pattern: the window's,
    the causal one for the form without the window, the documents' for theirs (relative to
    ``max(1, max |Z|)``)."""
    def sdpa(mask):
        return F.scaled_dot_product_attention(Q, K, V, attn_mask=mask)
    causal = torch.ones(size.L, size.L, dtype=torch.bool).tril()
    refs = {"chunked_causal": lambda: sdpa(causal), "sdpa_causal": lambda: sdpa(causal),
            "sdpa_documents": lambda: sdpa(documents_mask(document_ids(size.L))),
            "windowed": lambda: sdpa(window_mask(size.L, size.window))}
    refs["chunked_documents"] = refs["flex_documents"] = refs["sdpa_documents"]
    return {name: relative_deviation(Z, refs.get(name, refs["windowed"])())
            for name, Z in outputs.items()}


def time_patterns(size: PatternSize, settings: Settings, skip: dict[str, str]) \
        -> tuple[list[PatternRow], Setup]:
    """Both modes at one size: each form's first call (which compiles the flex forms) timed
    and checked against the dense SDPA's ``Z``, then the forms timed in interleaved rounds;
    the flex forms forward only on a CPU."""
    forms, setup = pattern_forms(size, tuple(p for p in PATTERN_FORMS + DOCUMENT_FORMS
                                             if p not in skip))
    Q, K, V, dZ = pattern_inputs(size)
    outputs = {}
    with torch.no_grad():
        for name, form in forms.items():
            outputs[name], first = _seconds(lambda form=form: form(Q, K, V))
            if name in FLEX_FORMS:
                setup[f"{PATTERN_NAMES[name]} first call"] = first
        deviation = _deviations(outputs, Q, K, V, size)
    del outputs
    rows = []
    for mode in MODES:
        steps = {name: pattern_step(form, mode, (Q, K, V), dZ) for name, form in forms.items()
                 if mode == "forward" or name not in FLEX_FORMS}
        rows.append(PatternRow(size, mode, time_interleaved(steps, settings), deviation))
    return rows, Setup(size, setup)


def time_long_causal(size: PatternSize, settings: Settings, skip: dict[str, str]) \
        -> PatternRow:
    """Dense causal attention forward+backward at ``size`` (a memory length): chunked against
    SDPA's flash kernel in interleaved rounds, chunked's ``Z`` against SDPA's."""
    forms = {name: form for name, form in CAUSAL_FORMS.items() if name not in skip}
    Q, K, V, dZ = pattern_inputs(size)
    with torch.no_grad():
        outputs = {name: form(Q, K, V) for name, form in forms.items()}
    reference = outputs.get("sdpa_causal")
    deviation = {} if reference is None else {  # nothing to compare against without SDPA
        name: relative_deviation(Z, reference) for name, Z in outputs.items()}
    del outputs
    steps = {name: pattern_step(form, "forward+backward", (Q, K, V), dZ)
             for name, form in forms.items()}
    return PatternRow(size, "forward+backward", time_interleaved(steps, settings), deviation)


@dataclass
class PatternSection:
    """What the patterns section measured: its rows, setup costs and peak memory, and the
    forms it left out and why (``ran`` False: the section was not run)."""

    rows: list[PatternRow] = field(default_factory=list)
    setup: list[Setup] = field(default_factory=list)
    memory: list[MemoryRow] = field(default_factory=list)
    forward_memory: list[MemoryRow] = field(default_factory=list)  # FORWARD_MEMORY_FORMS
    causal: list[PatternRow] = field(default_factory=list)  # at the memory lengths
    skipped: dict[str, str] = field(default_factory=dict)
    ran: bool = False

    def as_json(self, settings: Settings) -> dict:
        if not self.ran:
            return {"skipped": "--section " + " ".join(settings.sections)}
        why = why_no_memory(settings)
        return {"paths": {name: PATTERN_NAMES[name] for name in PATTERN_FORMS + DOCUMENT_FORMS},
                "skipped": self.skipped, "timings": [r.as_json() for r in self.rows],
                "causal": [r.as_json() for r in self.causal],
                "setup": [s.as_json() for s in self.setup],
                "memory": ({"method": PATTERN_MEMORY_METHOD,
                            "rows": [_memory_json(m, settings) for m in self.memory],
                            "forward": [_memory_json(m, settings) for m in self.forward_memory]}
                           if self.memory else {"skipped": why})}


def why_no_memory(settings: Settings) -> str:
    """Why the patterns section measures no memory ("" where it does)."""
    if settings.pattern_memory_lengths:
        return ""
    return settings.why_no_memory or "no lengths"


def _memory_json(row: MemoryRow, settings: Settings) -> dict:
    size = settings.pattern_sizes[0]
    return {"size": {**size.as_json(), "L": row.L}, "errors": row.errors,
            "paths": {name: {"peak_growth_bytes": b,
                             "vs_chunked_causal": row.ratio(name, "chunked_causal"),
                             "vs_sdpa_dense": row.ratio(name, "sdpa_dense")}
                      for name, b in row.growth.items()}}


def run_patterns(settings: Settings, say: Callable[[str], None]) -> PatternSection:
    """The patterns section as ``settings`` asks (memory in subprocesses)."""
    section = PatternSection(skipped=pattern_skipped(settings), ran=True)
    for size in settings.pattern_sizes:
        say(f"timing the window {size.label}")
        rows, setup = time_patterns(size, settings, section.skipped)
        section.rows += rows
        section.setup.append(setup)
    for L in settings.pattern_memory_lengths:
        say(f"timing dense causal at L={L}")
        section.causal.append(time_long_causal(replace(settings.pattern_sizes[0], L=L),
                                               settings, section.skipped))
        say(f"memory of the window at L={L}")
        names = tuple(p for p in PATTERN_MEMORY_FORMS if p not in section.skipped)
        section.memory.append(measure_pattern_memory(settings.pattern_sizes[0], L, names))
        names = tuple(p for p in FORWARD_MEMORY_FORMS if p not in section.skipped)
        section.forward_memory.append(measure_pattern_memory(settings.pattern_sizes[0], L,
                                                             names, "forward"))
    return section


def pattern_memory_worker(argv: list[str]) -> None:
    """In a fresh process: ``form mode n heads L d_head window threads`` of the patterns
    section; prints one JSON line."""
    name, mode, *numbers = argv
    n, heads, L, d_head, window, threads = map(int, numbers)
    torch.set_num_threads(threads)
    size = PatternSize(n, heads, L, d_head, window)

    def ready(at: PatternSize):  # one step at ``at``, its setup (a dense mask) done
        Q, K, V, dZ = pattern_inputs(at)
        return pattern_step(pattern_forms(at, (name,))[0][name], mode, (Q, K, V), dZ)

    ready(replace(size, L=min(L, 512)))()  # load the kernels, with a small peak
    print(json.dumps(peak_growth(ready(size))))


def measure_pattern_memory(size: PatternSize, L: int, names: tuple[str, ...],
                           mode: str = "forward+backward") -> MemoryRow:
    """The patterns section's forms ``names`` at ``size`` but length ``L`` in ``mode``, one
    subprocess each (:func:`pattern_memory_worker`), at this process's thread count."""
    return measured(L, [(name, [name, mode, size.n, size.heads, L, size.d_head, size.window,
                                torch.get_num_threads()]) for name in names],
                    "patterns", "pattern_memory_worker")
