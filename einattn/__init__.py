"""einattn: multi-head attention written as its index-notation math."""

from .cache import KVCache
from .errors import EinattnError
from .module import MultiHeadAttention
from .notation import Equation

__all__ = ["EinattnError", "Equation", "KVCache", "MultiHeadAttention"]
__version__ = "0.1.0"
