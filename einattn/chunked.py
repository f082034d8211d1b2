"""``einattn.chunked``: exact attention over tiles of queries × keys with O(L) memory, as
before its move to :mod:`einattn.impls.chunked` (the entry: :func:`attention`,
:func:`attend`) and :mod:`einattn.impls.tiles` (the tile kernels and their equations)."""

from ._checks import check_block_size
from .impls.chunked import TRACEABLE, attend, attention
from .impls.tiles import (
    KEY_GRADS,
    PROB_GRADS,
    QUERY_GRADS,
    RESCALE,
    RUNNING_MAX,
    RUNNING_SUM,
    RUNNING_VALUES,
    SPAN,
    SPLIT_QUERIES,
    VALUE_GRADS,
    WEIGHTS,
    accumulator,
    backward,
    for_backward,
    forward,
    sink_grad,
)

__all__ = ["KEY_GRADS", "PROB_GRADS", "QUERY_GRADS", "RESCALE", "RUNNING_MAX", "RUNNING_SUM",
           "RUNNING_VALUES", "SPAN", "SPLIT_QUERIES", "TRACEABLE", "VALUE_GRADS", "WEIGHTS",
           "accumulator", "attend", "attention", "backward", "check_block_size",
           "for_backward", "forward", "sink_grad"]
