"""The options of attention as one frozen object, built once per layer (or once per call of
the functional forms) and read by :mod:`einattn.composition` and the impls.

A new option is one field here and the lines of the composition that use it, not a keyword
threaded through every signature.
"""

from __future__ import annotations

import dataclasses

from . import patterns
from ._checks import check_block_size, check_dropout, check_impl, check_scale
from .differential import Differential
from .errors import EinattnError
from .qk_norm import QKNorm
from .temperature import Temperature


@dataclasses.dataclass(frozen=True)
class Spec:
    """How equations (1)–(5) run, whatever the inputs.

    ``impl`` ("einsum", "sdpa", "chunked", "flex", or "auto": per call one of them) and
    ``block_size`` (its tiles) choose how (2)–(4) run; ``dropout`` is the probability applied
    to ``A`` (a layer in eval mode runs its spec with 0); ``scale`` the ``s`` of
    ``S = s · Q K`` (None: ``1/√a``); ``causal``, ``window``, ``softcap`` and ``pattern``
    the pieces of equation (3) every call applies (:attr:`pieces` holds them made);
    ``rope``, ``rope_base``, ``rope_scaling`` and ``rotary_dim`` the rotary embeddings
    (:mod:`einattn.rotary`); ``qk_norm`` the norm of queries and keys
    (:class:`einattn.qk_norm.QKNorm`), ``temperature`` Llama 4's
    (:class:`einattn.temperature.Temperature`), ``differential`` differential attention's
    numbers (:class:`einattn.differential.Differential`), ``gate`` an output gate
    (:mod:`einattn.gate`), ``bias_kv`` one more key and value for every query
    (:mod:`einattn.slots`), ``zero_attn`` a key and value of zeros for every query (a sink of
    logit 0). Each is checked when the spec is made, with the message its keyword has."""

    impl: str = "einsum"
    block_size: int = 256
    dropout: float = 0.0
    scale: float | None = None
    causal: bool = False
    window: int | None = None
    softcap: float | None = None
    pattern: tuple = ()
    rope: str | None = None
    rope_base: float = 10000.0
    rope_scaling: dict | None = None
    rotary_dim: int | None = None
    qk_norm: QKNorm | None = None
    temperature: Temperature | None = None
    differential: Differential | None = None
    gate: bool = False
    bias_kv: bool = False
    zero_attn: bool = False
    pieces: tuple = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_impl(self.impl)
        check_dropout(self.dropout)
        check_block_size(self.block_size)
        if self.scale is not None:
            check_scale(self.scale)
        for name, kind in (("qk_norm", QKNorm), ("temperature", Temperature),
                           ("differential", Differential)):
            value = getattr(self, name)
            if value is not None and not isinstance(value, kind):
                raise EinattnError(f"{name} must be None or an einattn.{name}.{kind.__name__}, "
                                   f"got {type(value).__name__}")
        for name in ("gate", "bias_kv", "zero_attn"):
            if not isinstance(getattr(self, name), bool):
                raise EinattnError(f"{name} must be True or False, got "
                                   f"{getattr(self, name)!r}")
        pattern = patterns.pieces_of(self.pattern)
        object.__setattr__(self, "pattern", pattern)  # frozen: made once, here
        object.__setattr__(self, "pieces", patterns.pieces_of(
            pattern, window=self.window, softcap=self.softcap))

    @property
    def rope_options(self) -> tuple:
        """``(rope, rope_base, rope_scaling, rotary_dim)``, as :func:`einattn.rotary.turned`
        takes them."""
        return self.rope, self.rope_base, self.rope_scaling, self.rotary_dim

    def replace(self, **changes) -> Spec:
        """This spec with ``changes``, checked."""
        return dataclasses.replace(self, **changes)
