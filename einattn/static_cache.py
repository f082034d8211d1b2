"""``StaticKVCache``: a key/value cache of one fixed shape, for a compiled decoding step.

:class:`~einattn.KVCache` hands attention the filled part of its storage, whose length
grows by one every step, so a compiled step sees a new shape each time (``torch.compile``
makes the length symbolic after its second call). Here every call sees the same shapes:
the storage holds ``max_length`` positions from the first call, the number filled so far
is a tensor ``f`` (no Python number changes from step to step), a call writes its ``L``
keys and values at positions ``f … f + L − 1`` (``index_copy_``), and attention runs over
all ``max_length`` positions, those not filled yet being padding, the queries at positions
``f … f + L − 1`` (:meth:`StaticKVCache.seen_by`): every piece of a pattern defined by
positions reads them as it reads any position (the causal piece ``σ ≤ τ'``, a window, ALiBi,
a ``Mask`` string, a ``MaskMod`` or ``ScoreMod``, ...), each tile then judged partial, as ``f``
is known on the device alone, and RoPE turns the queries and keys there. The work per step is
that of ``max_length`` keys, whatever the number filled: the price of one shape.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from .cache import check_new
from .errors import EinattnError


class StaticKVCache:
    """Keys, values and key padding of up to ``max_length`` tokens, in storage of that size
    made at the first call. Every position not filled holds zeros in ``K`` and ``V`` (nothing
    that could turn NaN behind its mask) and is padding, after :meth:`reset` and after a
    refused call too: a call that raises leaves the cache exactly as it was.

    >>> cache = StaticKVCache(max_length=8)
    >>> K, V, pad = cache.append(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4))
    >>> len(cache), tuple(K.shape), pad.tolist()
    (3, (1, 2, 8, 4), [[False, False, False, True, True, True, True, True]])
    """

    def __init__(self, max_length: int) -> None:
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
            raise EinattnError(f"max_length (the positions σ a StaticKVCache holds) must be a "
                               f"positive int, got {max_length!r}")
        self.max_length = max_length
        self.K: torch.Tensor | None = None  # [n g max_length a], every position
        self.V: torch.Tensor | None = None
        self.padding: torch.Tensor | None = None  # (n, max_length), True = padding or empty
        self.filled: torch.Tensor | None = None  # f: how many positions are filled, 0-d

    def __len__(self) -> int:
        """The number of filled positions (reads the tensor ``filled``: not for compiled
        code)."""
        return 0 if self.filled is None else int(self.filled)

    def __repr__(self) -> str:
        return f"StaticKVCache(length={len(self)}, max_length={self.max_length})"

    def reset(self) -> None:
        """Start a new sequence in the same storage."""
        if self.filled is not None:
            self.filled.zero_()
            self._empty_unfilled()

    @contextmanager
    def undo_on_error(self) -> Iterator[None]:
        """Put the cache back as it was if the block raises: a first call's storage is
        dropped; a later call's count ``f`` is restored and what it wrote at ``f`` and after
        is emptied again, as every position not filled is."""
        saved = None if self.filled is None else self.filled.clone()
        try:
            yield
        except BaseException:
            if saved is None:
                self.K = self.V = self.padding = self.filled = None
            else:
                self.filled.copy_(saved)
                self._empty_unfilled()
            raise

    def _empty_unfilled(self) -> None:
        """Zeros in ``K`` and ``V``, and padding, at every position ``σ ≥ f``."""
        unfilled = torch.arange(self.max_length, device=self.K.device) >= self.filled
        self.K.masked_fill_(unfilled[:, None], 0)
        self.V.masked_fill_(unfilled[:, None], 0)
        self.padding.masked_fill_(unfilled, True)

    def check_call(self, L: int, *, mask=None, positions=None, document_ids=None) -> None:
        """Refuse, before anything is written, a call of ``L`` tokens this cache cannot
        take: ``document_ids``, ``positions``, a ``mask``, or more positions than
        ``max_length`` holds (the count filled is read where it can be: not inside a
        compiled region). Every piece of a pattern is taken (the pieces read its positions)."""
        if document_ids is not None:
            raise EinattnError("a StaticKVCache keeps no document_ids; use KVCache")
        if positions is not None:
            raise EinattnError("a StaticKVCache places the tokens at the positions it has "
                               "filled; drop positions=")
        if mask is not None:
            raise EinattnError("a StaticKVCache takes key_padding_mask and the pieces of a "
                               "pattern (read at the positions it has filled); a mask needs "
                               "KVCache")
        if L > self.max_length:
            raise EinattnError(f"a call of {L} positions does not fit a StaticKVCache of "
                               f"max_length={self.max_length}")
        if torch.compiler.is_compiling():
            return
        f = len(self)
        if f > self.max_length:
            raise EinattnError(f"a compiled call went past max_length={self.max_length} ({f} "
                               f"positions counted): its values were written as NaN at the "
                               f"last position, so its outputs and every later call's are NaN; "
                               f"call cache.reset()")
        if f + L > self.max_length:
            raise EinattnError(f"the cache holds at most max_length={self.max_length} "
                               f"positions, but {f} filled and {L} new make {f + L}")

    def placed(self, positions, L: int, device) -> tuple[torch.Tensor, int]:
        """RoPE's positions of a call's ``L`` tokens, ``f … f + L − 1``, and offset 0 (a
        call that gives ``positions`` is refused by :meth:`check_call`)."""
        start = torch.zeros((), dtype=torch.long, device=device) if self.filled is None \
            else self.filled
        return start + torch.arange(L, device=device), 0

    def append(self, K: torch.Tensor, V: torch.Tensor,
               key_padding_mask: torch.Tensor | None = None, document_ids=None):
        """Write this call's ``K[n g σ a]``, ``V[n g σ a]`` and key padding at positions
        ``f … f + L − 1``; return the whole storage ``(K, V, padding)``, the positions not
        filled marked as padding. Everything is checked before the first write."""
        check_new(K, V, key_padding_mask)
        n, L = K.shape[0], K.shape[2]
        self.check_call(L, document_ids=document_ids)
        if self.K is None:
            self._make(K, V.shape[3])
        elif self.K.shape[:2] != K.shape[:2] or self.K.shape[3] != K.shape[3] \
                or self.V.shape[3] != V.shape[3] or self.K.dtype != K.dtype \
                or self.K.device != K.device:
            raise EinattnError(f"the new keys are {tuple(K.shape)} {K.dtype} on {K.device} but "
                               f"the cache holds K[n g σ a] of {tuple(self.K.shape)} "
                               f"{self.K.dtype} on {self.K.device}: make another StaticKVCache")
        where = self.filled + torch.arange(L, device=K.device)
        if torch.compiler.is_compiling():  # f is on the device, unchecked: see _past_the_end
            where, V = _past_the_end(where, V, self.max_length)
        self.K.index_copy_(2, where, K)
        self.V.index_copy_(2, where, V)
        new = torch.zeros(n, L, dtype=torch.bool, device=K.device) if key_padding_mask is None \
            else key_padding_mask
        self.padding.index_copy_(1, where, new)
        self.filled.add_(L)
        return self.K, self.V, self.padding

    def _make(self, K: torch.Tensor, b: int) -> None:
        n, g, _, a = K.shape
        self.K = K.new_zeros(n, g, self.max_length, a)
        self.V = K.new_zeros(n, g, self.max_length, b)  # values b wide (d_value)
        self.padding = torch.ones(n, self.max_length, dtype=torch.bool, device=K.device)
        self.filled = torch.zeros((), dtype=torch.long, device=K.device)

    def seen_by(self, L: int) -> tuple[tuple, torch.Tensor]:
        """What the ``L`` queries of a call attend with, once appended: no piece of its own
        (the positions not filled are padding), and their first position ``f − L``, with
        ``f`` counted after them: a tensor, which the pieces read as they read any index."""
        return (), self.filled - L


def _past_the_end(where: torch.Tensor, V: torch.Tensor, max_length: int):
    """Where a compiled call writes, and its values: a call past ``max_length`` (which a
    compiled step cannot refuse without reading ``f`` back from the device) writes at the
    last position, not out of bounds (an IndexError, on CUDA a device-side assert), and its
    values as NaN, so that its outputs, and every later call's, are NaN rather than numbers;
    :meth:`StaticKVCache.check_call` refuses the next eager call."""
    past = where[-1] >= max_length
    return where.clamp(max=max_length - 1), V.masked_fill(past, float("nan"))
