"""The decoding section: a causal layer fed a prompt of ``context`` tokens (the prefill, not
timed), then one token at a time under ``no_grad``; the time per token, and the memory its
K, V cache holds:

    sdpa, einsum, chunked  einattn, MultiHeadAttention(causal=True, impl=...) with a KVCache,
                           whose storage grows in place (doubling)
    hand_cat               hand-written: nanoGPT's one Linear to 3·d_model, SDPA, out Linear,
                           its K, V cache grown by torch.cat on every token
    hand_prealloc          the same with K, V written into a cache preallocated for the run

Every form has the weights of one seeded einattn layer. A sample's steps append tokens; when
``SLACK`` have been added the cache is cropped back to the prompt (a view, no copy), so that
every step attends over ``context`` to ``context + SLACK`` keys.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

from ..cache import KVCache
from ..module import MultiHeadAttention
from .forms import with_impl
from .timing import Row, relative_deviation, time_interleaved

if TYPE_CHECKING:
    from .settings import DecodingSize, Settings

DECODING_FORMS = ("sdpa", "einsum", "chunked", "hand_cat", "hand_prealloc")
DECODING_NAMES = {"sdpa": "einattn sdpa", "einsum": "einattn einsum",
                  "chunked": "einattn chunked", "hand_cat": "Linear+SDPA, torch.cat cache",
                  "hand_prealloc": "Linear+SDPA, preallocated cache"}
DECODING_MODE = "per token, no_grad"
SLACK = 16  # tokens a sample may append before the cache is cropped back to the prompt


class _Einattn:
    """An einattn layer decoding into its :class:`~einattn.KVCache`."""

    def __init__(self, layer: MultiHeadAttention, x: torch.Tensor, context: int) -> None:
        self.layer, self.x, self.context, self.cache = layer, x, context, KVCache()
        with torch.no_grad():
            layer(x[:, :context], cache=self.cache)

    def __call__(self) -> torch.Tensor:
        t = len(self.cache)
        with torch.no_grad():
            y = self.layer(self.x[:, t:t + 1], cache=self.cache)
        if t + 1 >= self.context + SLACK:
            self.cache.crop(self.context)
        return y

    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.cache._storage)


class _Hand:
    """nanoGPT's attention decoding by hand: ``qkv = x W_qkvᵀ`` split into heads, the new
    ``k``, ``v`` appended by ``torch.cat`` or written into preallocated ``K``, ``V``, SDPA
    over the cache, ``y = z W_oᵀ``."""

    def __init__(self, W_qkv, W_o, heads: int, x: torch.Tensor, context: int,
                 preallocate: bool) -> None:
        self.W_qkv, self.W_o, self.heads, self.x = W_qkv, W_o, heads, x
        self.context, self.length = context, context
        with torch.no_grad():
            _, k, v = self._qkv(x[:, :context])
        if preallocate:
            self.K, self.V = (t.new_empty(*t.shape[:2], context + SLACK, t.shape[3])
                              for t in (k, v))
            self.K[:, :, :context], self.V[:, :, :context] = k, v
        self.preallocated, self.k, self.v = preallocate, k, v

    def _qkv(self, x: torch.Tensor):
        n, L, d_model = x.shape
        return (t.view(n, L, self.heads, d_model // self.heads).transpose(1, 2)
                for t in F.linear(x, self.W_qkv).split(d_model, dim=2))

    def __call__(self) -> torch.Tensor:
        t = self.length
        with torch.no_grad():
            q, k, v = self._qkv(self.x[:, t:t + 1])
            if self.preallocated:
                self.K[:, :, t:t + 1], self.V[:, :, t:t + 1] = k, v
                K, V = self.K[:, :, :t + 1], self.V[:, :, :t + 1]
            else:
                K = self.k = torch.cat([self.k, k], dim=2)
                V = self.v = torch.cat([self.v, v], dim=2)
            z = F.scaled_dot_product_attention(q, K, V)
            y = F.linear(z.transpose(1, 2).reshape(q.shape[0], 1, -1), self.W_o)
        self.length = t + 1
        if self.length >= self.context + SLACK:
            self.length = self.context
            self.k, self.v = self.k[:, :, :self.context], self.v[:, :, :self.context]
        return y

    def cache_bytes(self) -> int:
        kept = (self.K, self.V) if self.preallocated else (self.k, self.v)
        return sum(t.numel() * t.element_size() for t in kept)


def decoding_forms(size: DecodingSize, x: torch.Tensor, *, seed: int = 0,
                   names: tuple[str, ...] = DECODING_FORMS) -> dict[str, Callable]:
    """The forms named, each after its prefill of ``size.context`` tokens of ``x``: a call is
    one decoding step, returning that token's ``Y[n τ i]``."""
    torch.manual_seed(seed)
    layer = MultiHeadAttention(size.d_model, size.heads, causal=True, dtype=x.dtype).eval()
    p = layer.projections()
    W_qkv = torch.cat([p.W_q, p.W_k, p.W_v]).detach()
    forms = {"hand_cat": lambda: _Hand(W_qkv, p.W_o.detach(), size.heads, x, size.context,
                                       False),
             "hand_prealloc": lambda: _Hand(W_qkv, p.W_o.detach(), size.heads, x,
                                            size.context, True)}
    return {name: forms[name]() if name in forms
            else _Einattn(with_impl(layer, name), x, size.context) for name in names}


@dataclass
class DecodingRow(Row):
    """One context: every form's time per token, its first step's distance from the
    hand-written cat form's, and the bytes its K, V cache holds."""

    size: DecodingSize
    cache_bytes: dict[str, int] = field(default_factory=dict)
    BASES: ClassVar[dict[str, str]] = {"vs_hand_cat": "hand_cat",
                                       "vs_hand_prealloc": "hand_prealloc",
                                       "vs_einattn_sdpa": "sdpa"}

    def as_json(self) -> dict:
        found = super().as_json()
        for name, path in found["paths"].items():
            path["cache_bytes"] = self.cache_bytes[name]
        return found


def time_decoding(size: DecodingSize, settings: Settings,
                  names: tuple[str, ...] = DECODING_FORMS) -> DecodingRow:
    """The forms prefilled, each first step checked against the cat form's, then their
    steps timed in interleaved rounds."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(size.n, size.context + SLACK, size.d_model, generator=g)
    forms = decoding_forms(size, x, names=names)
    first = {name: form() for name, form in forms.items()}
    deviation = {name: relative_deviation(y, first["hand_cat"]) for name, y in first.items()}
    timings = time_interleaved(forms, settings)
    return DecodingRow(size, DECODING_MODE, timings, deviation,
                       {name: form.cache_bytes() for name, form in forms.items()})


@dataclass
class DecodingSection:
    """What the decoding section measured (``ran`` False: the section was not run)."""

    rows: list[DecodingRow] = field(default_factory=list)
    ran: bool = False

    def as_json(self, settings: Settings) -> dict:
        if not self.ran:
            return {"skipped": "--section " + " ".join(settings.sections)}
        return {"paths": DECODING_NAMES, "slack": SLACK,
                "timings": [r.as_json() for r in self.rows]}


def run_decoding(settings: Settings, say: Callable[[str], None]) -> DecodingSection:
    """The decoding section at each of ``settings.decoding_sizes``."""
    section = DecodingSection(ran=True)
    for size in settings.decoding_sizes:
        say(f"decoding at {size.label}")
        section.rows.append(time_decoding(size, settings))
    return section


def decoding_lines(section: DecodingSection, table, paint, duration, times, percent, rate) \
        -> list[str]:
    """The section as text: per context, each form's time per token, spread, ratios, cache
    memory, bandwidth and its fraction of peak, and max |ΔY| (``duration``, ``times``,
    ``percent``, ``rate`` format the cells)."""
    out = ["", "decoding: a prefill of `context` tokens, then one token at a time under no_grad "
               f"(the cache cropped back every {SLACK} tokens); time per token, ratios of "
               "medians, the bytes of the K, V cache, the cache read per token and its "
               "fraction of the peak bandwidth"]
    for row in section.rows:
        cells = [[DECODING_NAMES[name], duration(t.median), percent(t.spread),
                  times(row.ratio(name, "hand_cat")), times(row.ratio(name, "hand_prealloc")),
                  times(row.ratio(name, "sdpa")), f"{row.cache_bytes[name] / 2**20:,.1f} MiB",
                  *rate(row, name),
                  f"{row.deviation[name]:.0e}" if row.deviation[name] else "0"]
                 for name, t in row.timings.items()]
        out += ["", f"{row.size.label}  n={row.size.n} i={row.size.d_model} "
                    f"μ={row.size.heads} τ=1 σ≈{row.size.context}",
                *table(["form", "per token", "spread", "× torch.cat", "× preallocated",
                        "× einattn sdpa", "cache", "GB/s read", "of bandwidth", "max |ΔY|"],
                       cells, paint, right=(1, 2, 3, 4, 5, 6, 7, 8, 9))]
    return out
