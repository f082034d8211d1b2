"""What a benchmark run covers: its sizes (``n``, ``L``, ``d_model``, heads) and its settings."""

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


# The sizes the targets name, then one causal row (informational: targets read non-causal
# rows).
SIZES = (Size(8, 128, 512, 8), Size(2, 1024, 512, 8), Size(1, 4096, 256, 4),
         Size(2, 5, 16, 4), Size(2, 1024, 512, 8, causal=True))
COMPILE_SIZES = (Size(8, 128, 512, 8), Size(2, 1024, 512, 8))  # the mid sizes
QUICK_SIZES = (Size(2, 5, 16, 4), Size(2, 64, 64, 4))
MEMORY = (1, 256, 4)  # n, d_model, heads of the memory runs
MEMORY_LENGTHS = (4096, 8192)
QUICK_MEMORY_LENGTHS = (1024,)
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

    @classmethod
    def build(cls, *, quick: bool = False, compile: bool = True, memory: bool = True,
              sizes: tuple[Size, ...] | None = None, rounds: int | None = None,
              threads: int | None = None, clock: str | None = None) -> Settings:
        """The full run, or with ``quick`` the tiny one (two small sizes, 3 rounds, one
        memory length of 1024, no compile). ``sizes`` replaces the sizes, and then compile
        runs at every one of them; ``rounds`` replaces the number of rounds."""
        s = (cls(sizes=QUICK_SIZES, rounds=3, warmup=1, sample_s=0.002, compile_sizes=(),
                 memory_lengths=QUICK_MEMORY_LENGTHS, quick=True,
                 why_no_compile="--quick runs no compile")
             if quick else cls())
        if sizes:
            s = replace(s, sizes=tuple(sizes),
                        compile_sizes=() if quick else tuple(x for x in sizes))
        if rounds is not None:
            s = replace(s, rounds=rounds)
        if threads is not None:
            s = replace(s, threads=threads)
        if clock is not None:
            if clock not in CLOCK_NAMES:
                raise EinattnError(f"clock must be one of {', '.join(map(repr, CLOCK_NAMES))}, "
                                   f"got {clock!r}")
            s = replace(s, clock=clock)
        if not compile:
            s = replace(s, compile_sizes=(), why_no_compile="--no-compile")
        if not memory:
            s = replace(s, memory_lengths=(), why_no_memory="--no-memory")
        return s
