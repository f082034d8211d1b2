"""``einattn.flex``: ``impl="flex"``, FlexAttention from einattn's pattern, as before its
move to :mod:`einattn.impls.flex`."""

from .impls.flex import BLOCK, GPU_MIN_HEAD, RECOMPILE_LIMIT, attention

__all__ = ["BLOCK", "GPU_MIN_HEAD", "RECOMPILE_LIMIT", "attention"]
