"""einattn: multi-head attention written as its index-notation math."""

from . import chunked, flex, functional, patterns  # noqa: F401 (loaded by `import einattn`)
from .cache import KVCache
from .errors import EinattnError
from .latent import LatentAttention
from .module import MultiHeadAttention
from .notation import Equation
from .static_cache import StaticKVCache

__all__ = ["EinattnError", "Equation", "KVCache", "LatentAttention", "MultiHeadAttention",
           "StaticKVCache"]
__version__ = "0.1.0"
