"""What a benchmark run covers: its sections, their sizes (a layer's ``n``, ``L``, ``d_model``,
heads; an attention pattern's ``n``, ``μ``, ``L``, ``a`` and window) and its settings."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import EinattnError


@dataclass(frozen=True)
class Size:
    """One benchmark size: ``n`` samples, ``L`` positions (τ = σ), ``d_model``, ``heads``."""

    n: int
    L: int
    d_model: int
    heads: int
    causal: bool = False

    @property
    def d_head(self) -> int:
        return self.d_model // self.heads

    @property
    def label(self) -> str:
        text = f"({self.n}, {self.L}, {self.d_model}, {self.heads})"
        return f"{text} causal" if self.causal else text

    def as_json(self) -> dict:
        return {"n": self.n, "L": self.L, "d_model": self.d_model, "heads": self.heads,
                "d_head": self.d_head, "causal": self.causal}


def parse_size(text: str) -> Size:
    """``"8,128,512,8"`` (n, L, d_model, heads), or with ``",causal"`` after them."""
    parts = [p.strip() for p in text.split(",")]
    causal = parts[-1] == "causal"
    numbers = parts[:-1] if causal else parts
    if len(numbers) != 4 or not all(p.isdigit() and int(p) > 0 for p in numbers):
        raise ValueError(f"{text!r} is not n,L,d_model,heads (four positive integers, "
                         f"optionally followed by ,causal)")
    size = Size(*map(int, numbers), causal=causal)
    if size.d_model % size.heads:
        raise ValueError(f"{text!r}: d_model={size.d_model} is not divisible by "
                         f"heads={size.heads} (index a would not be whole)")
    return size


@dataclass(frozen=True)
class PatternSize:
    """One size of the patterns section: ``Q[n μ τ a]``, ``K``, ``V`` with ``L`` positions
    (τ = σ), under a causal sliding window of ``window`` keys."""

    n: int
    heads: int
    L: int
    d_head: int
    window: int

    @property
    def label(self) -> str:
        return f"({self.n}, {self.heads}, {self.L}, {self.d_head}) w={self.window}"

    def as_json(self) -> dict:
        return {"n": self.n, "heads": self.heads, "L": self.L, "d_head": self.d_head,
                "window": self.window}


def parse_pattern_size(text: str) -> PatternSize:
    """``"1,4,4096,64,256"``: n, heads (μ), L (τ = σ), d_head (a), window."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 5 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"{text!r} is not n,heads,L,d_head,window (five positive integers)")
    return PatternSize(*map(int, parts))


@dataclass(frozen=True)
class DecodingSize:
    """One decoding size: ``n`` samples, ``d_model``, ``heads``, and the ``context`` of
    cached tokens each step attends over."""

    n: int
    d_model: int
    heads: int
    context: int

    @property
    def label(self) -> str:
        return f"({self.n}, {self.d_model}, {self.heads}) context {self.context}"

    def as_json(self) -> dict:
        return {"n": self.n, "d_model": self.d_model, "heads": self.heads,
                "d_head": self.d_model // self.heads, "context": self.context}


# The sizes the targets name, then one causal row (informational: targets read non-causal
# rows).
SIZES = (Size(8, 128, 512, 8), Size(2, 1024, 512, 8), Size(1, 4096, 256, 4),
         Size(2, 5, 16, 4), Size(2, 1024, 512, 8, causal=True))
COMPILE_SIZES = (Size(8, 128, 512, 8), Size(2, 1024, 512, 8))  # the mid sizes
QUICK_SIZES = (Size(2, 5, 16, 4), Size(2, 64, 64, 4))
MEMORY = (1, 256, 4)  # n, d_model, heads of the memory runs
MEMORY_LENGTHS = (4096, 8192)
QUICK_MEMORY_LENGTHS = (1024,)
# The sections a run may cover: one attention layer six ways, attention patterns, decoding.
SECTIONS = ("layer", "patterns", "decoding")
PATTERN_SIZES = (PatternSize(1, 4, 4096, 64, 256),)  # the size issue 19's targets name
QUICK_PATTERN_SIZES = (PatternSize(1, 2, 64, 8, 16),)
PATTERN_MEMORY_LENGTHS = (8192,)  # at the first pattern size's n, μ, a and window
QUICK_PATTERN_MEMORY_LENGTHS = (1024,)
DECODING_SIZES = (DecodingSize(1, 512, 8, 512), DecodingSize(1, 512, 8, 4096))  # issue 24's
QUICK_DECODING_SIZES = (DecodingSize(1, 32, 4, 24),)
# The clocks a timing sample may read (einattn.bench.timing.CLOCKS), as the report names them.
CLOCK_NAMES = {"wall": "wall-clock time", "cpu": "process CPU time"}


@dataclass(frozen=True)
class Settings:
    """How much to run. ``sample_s``: each timing sample repeats calls until it lasts at
    least this long."""

    sizes: tuple[Size, ...] = SIZES
    rounds: int = 11
    warmup: int = 2
    sample_s: float = 0.02
    compile_sizes: tuple[Size, ...] = COMPILE_SIZES  # () = no compile runs
    memory_lengths: tuple[int, ...] = MEMORY_LENGTHS  # () = no memory runs
    quick: bool = False
    threads: int | None = None  # torch intra-op threads; None: leave torch's setting
    clock: str = "wall"  # a key of CLOCK_NAMES
    why_no_compile: str = ""
    why_no_memory: str = ""
    sections: tuple[str, ...] = SECTIONS
    pattern_sizes: tuple[PatternSize, ...] = PATTERN_SIZES
    pattern_memory_lengths: tuple[int, ...] = PATTERN_MEMORY_LENGTHS  # () = no memory runs
    why_no_flex: str = ""  # why the compiled FlexAttention forms do not run ("" = they do)
    decoding_sizes: tuple[DecodingSize, ...] = DECODING_SIZES

    @classmethod
    def build(cls, *, quick: bool = False, compile: bool = True, memory: bool = True,
              sizes: tuple[Size, ...] | None = None, rounds: int | None = None,
              threads: int | None = None, clock: str | None = None,
              sections: tuple[str, ...] | None = None,
              pattern_sizes: tuple[PatternSize, ...] | None = None) -> Settings:
        """The full run, or with ``quick`` the tiny one (small sizes, 3 rounds, memory at
        L=1024, no compile). ``sizes`` replaces the layer's sizes, and then compile runs at
        every one of them; ``pattern_sizes`` the patterns section's; ``rounds`` the number
        of rounds; ``sections`` the sections run (default: all of :data:`SECTIONS`)."""
        s = cls._quick() if quick else cls()
        if sizes:
            s = replace(s, sizes=tuple(sizes),
                        compile_sizes=() if quick else tuple(x for x in sizes))
        if pattern_sizes:
            s = replace(s, pattern_sizes=tuple(pattern_sizes))
        s = replace(s, rounds=s.rounds if rounds is None else rounds,
                    threads=s.threads if threads is None else threads,
                    clock=_checked_clock(s.clock if clock is None else clock))
        if not compile:
            s = replace(s, compile_sizes=(), why_no_compile="--no-compile",
                        why_no_flex="--no-compile")
        if not memory:
            s = replace(s, memory_lengths=(), pattern_memory_lengths=(),
                        why_no_memory="--no-memory")
        return s._only(sections)

    @classmethod
    def _quick(cls) -> Settings:
        return cls(sizes=QUICK_SIZES, rounds=3, warmup=1, sample_s=0.002, compile_sizes=(),
                   memory_lengths=QUICK_MEMORY_LENGTHS, quick=True,
                   why_no_compile="--quick runs no compile", pattern_sizes=QUICK_PATTERN_SIZES,
                   pattern_memory_lengths=QUICK_PATTERN_MEMORY_LENGTHS,
                   why_no_flex="--quick runs no compile", decoding_sizes=QUICK_DECODING_SIZES)

    def _only(self, sections: tuple[str, ...] | None) -> Settings:
        """These settings for ``sections`` alone: the layer's sizes and lengths emptied when
        the layer is not among them, the patterns' and decoding's when they are not."""
        if not sections:
            return self
        unknown = [name for name in sections if name not in SECTIONS]
        if unknown:
            raise EinattnError(f"section must be one of {', '.join(map(repr, SECTIONS))}, got "
                               f"{unknown[0]!r}")
        s = replace(self, sections=tuple(x for x in SECTIONS if x in sections))
        if "layer" not in s.sections:
            why = "--section " + " ".join(s.sections)
            s = replace(s, sizes=(), compile_sizes=(), memory_lengths=(),
                        why_no_compile=s.why_no_compile or why,
                        why_no_memory=s.why_no_memory or why)
        if "patterns" not in s.sections:
            s = replace(s, pattern_sizes=(), pattern_memory_lengths=())
        if "decoding" not in s.sections:
            s = replace(s, decoding_sizes=())
        return s


def _checked_clock(clock: str) -> str:
    if clock not in CLOCK_NAMES:
        raise EinattnError(f"clock must be one of {', '.join(map(repr, CLOCK_NAMES))}, "
                           f"got {clock!r}")
    return clock
