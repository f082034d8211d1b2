"""``KVCache``: the keys and values of the tokens seen so far, for decoding one step at a time.

A call ``layer(x_new, causal=True, cache=cache)`` projects only the new tokens, appends
their keys ``K[n g σ a]`` and values ``V[n g σ a]`` (g = the key/value heads, rotated
already when the layer uses RoPE) to the cache, and attends over every cached key. The
queries are the last ``L_q`` of ``L_k`` positions, so the causal mask is aligned
bottom-right, as :func:`einattn.masks.causal_mask` aligns it.
"""

from __future__ import annotations

import torch

from ._checks import check_max_length
from .errors import EinattnError
from .patterns import Documents

# New storage holds a quarter more positions than it must (at least HEADROOM more): each
# position is copied about 4 times as the cache grows, where doubling holds up to twice the
# keys and values of the sequence and reads them strided across twice the memory. Measured
# per token at context 4096 (d_model 512, 8 heads, one thread, 2026-11-25): doubling 1.76 ms
# with 32 MiB of storage, a quarter 1.37 ms with 20 MiB (a tight preallocated cache's hand
# loop: 1.29–1.47 ms, 16 MiB).
HEADROOM = 16


class KVCache:
    """Keys, values and key padding of the tokens seen so far, grown by each call.

    Keys and values are written in place into storage that grows geometrically (by a
    quarter, at least ``HEADROOM`` positions), or is made once for ``max_length``
    positions: each call writes only its new positions, and ``K``, ``V`` are views of the
    filled part, so a view a caller keeps does not change when later tokens arrive (until
    :meth:`crop` or :meth:`reset` frees its positions). (Where the new keys carry a
    gradient, each call's tensors stay their own, as autograd needs, and are concatenated
    instead.)

    >>> cache = KVCache()
    >>> K, V, pad = cache.append(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4))
    >>> len(cache), tuple(K.shape), pad
    (3, (1, 2, 3, 4), None)
    """

    def __init__(self, max_length: int | None = None) -> None:
        self.max_length = check_max_length(max_length)
        self.K: torch.Tensor | None = None
        self.V: torch.Tensor | None = None
        self.padding: torch.Tensor | None = None  # (n, σ), True = padding, or None
        self.document_ids: torch.Tensor | None = None  # d[n σ], packed documents, or None
        self._storage: tuple[torch.Tensor, torch.Tensor] | None = None  # [n g capacity a]

    def __len__(self) -> int:
        """The number of cached positions σ."""
        return 0 if self.K is None else self.K.shape[2]

    def __repr__(self) -> str:
        shape = None if self.K is None else tuple(self.K.shape)
        limit = "" if self.max_length is None else f", max_length={self.max_length}"
        return f"KVCache(length={len(self)}{limit}, K[n g σ a]={shape})"

    def undo_on_error(self) -> _Undo:
        """Put the cache back as it was if the block raises: a call that fails adds nothing."""
        return _Undo(self)

    def placed(self, positions, L: int, device) -> tuple[torch.Tensor | None, int]:
        """RoPE's positions of a call's tokens: as given, else after the cached ones."""
        return positions, len(self)

    def reset(self) -> None:
        """Forget every cached token (a new sequence). A ``max_length`` cache keeps its
        storage for the next sequence, which then writes over the views of this one."""
        self.K = self.V = self.padding = self.document_ids = None
        if self.max_length is None:
            self._storage = None

    def crop(self, length: int) -> None:
        """Keep the first ``length`` cached positions (drop the rest: rejected speculative
        tokens, a rewound benchmark); the storage stays, and the next append writes over
        the positions dropped, so views of them a caller kept may change."""
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= len(self):
            raise EinattnError(f"crop keeps 0 to {len(self)} cached positions σ, got {length!r}")
        if length == 0:
            self.reset()
            return
        self.K, self.V = self.K[:, :, :length], self.V[:, :, :length]
        self.padding = None if self.padding is None else self.padding[:, :length]
        self.document_ids = None if self.document_ids is None \
            else self.document_ids[:, :length]

    def append(self, K: torch.Tensor, V: torch.Tensor,
               key_padding_mask: torch.Tensor | None = None,
               document_ids: torch.Tensor | None = None):
        """Append this call's ``K[n g σ a]``, ``V[n g σ a]`` and its key padding ``(n, σ)``
        (True = padding); return everything cached: ``(K, V, padding over all σ)``. The
        documents of packed sequences, ``d[n σ]``, are kept as :attr:`document_ids`: a
        cache that has them needs them on every call."""
        check_new(K, V, key_padding_mask)
        held = self.K
        if held is not None and not _fit(held, self.V, K, V):
            self._refuse_unlike(K, V)
        self.check_call(K.shape[2], document_ids=document_ids)
        before = 0 if held is None else held.shape[2]
        if document_ids is not None:
            self._append_ids(document_ids, K)
        self.K, self.V = self._stored(K, V, before)
        if self.padding is not None or key_padding_mask is not None:
            n, L = K.shape[0], K.shape[2]
            old = _no_padding(n, before, K) if self.padding is None else self.padding
            new = _no_padding(n, L, K) if key_padding_mask is None else key_padding_mask
            self.padding = torch.cat([old, new], dim=1)
        return self.K, self.V, self.padding

    def _stored(self, K: torch.Tensor, V: torch.Tensor, before: int):
        """Every cached position's keys and values with this call's written after the
        ``before`` cached ones: views of the storage, grown where it is full."""
        L = before + K.shape[2]
        if torch.is_grad_enabled() and (K.requires_grad or V.requires_grad):
            self._storage = None  # autograd saved the earlier steps' tensors: none is written
            return (K, V) if self.K is None else (torch.cat([self.K, K], dim=2),
                                                  torch.cat([self.V, V], dim=2))
        store = self._storage  # with keys cached, they lie in it and K, V fit them (_check)
        if store is None or store[0].shape[2] < L or (not before and not _fit(*store, K, V)):
            capacity = self.max_length or L + max(L // 4, HEADROOM)
            store = tuple(t.new_empty(*t.shape[:2], capacity, t.shape[3]) for t in (K, V))
            if before:  # the cached part, copied once into the larger storage
                store[0][:, :, :before].copy_(self.K)
                store[1][:, :, :before].copy_(self.V)
            self._storage = store
        # narrow, not [:, :, before:L]: one call where indexing makes three (the per-token cost)
        store[0].narrow(2, before, L - before).copy_(K)
        store[1].narrow(2, before, L - before).copy_(V)
        return store[0].narrow(2, 0, L), store[1].narrow(2, 0, L)

    def check_call(self, L: int, *, mask=None, positions=None, document_ids=None) -> None:
        """Refuse, before anything is written, a call of ``L`` tokens this cache cannot
        take: more positions than ``max_length`` holds, or ``document_ids`` on some calls
        only. (A mask and positions it takes as they are, and every piece of a pattern.)"""
        if self.max_length is not None and len(self) + L > self.max_length:
            raise EinattnError(f"the cache holds at most max_length={self.max_length} positions, "
                               f"but {len(self)} cached and {L} new make {len(self) + L}")
        if (document_ids is None) != (self.document_ids is None) and len(self):
            raise EinattnError("document_ids must be given on every call with this cache or on "
                               "none: the cache holds one document id d[n σ] per cached key")

    def seen_by(self, L: int) -> tuple[tuple, None]:
        """What the ``L`` queries of a call attend with, once appended: the pieces the cache
        adds to the pattern (the documents of every cached key) and their first position
        (None: the last ``L`` of the cached ones, as ``causal`` aligns them)."""
        if self.document_ids is None:
            return (), None
        return (Documents(self.document_ids),), None

    def _append_ids(self, ids: torch.Tensor, K: torch.Tensor) -> None:
        n, L = K.shape[0], K.shape[2]
        if not isinstance(ids, torch.Tensor) or ids.shape != (n, L):
            shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise EinattnError(f"with a cache, document_ids marks this call's new keys: shape "
                               f"(n, σ) = ({n}, {L}), got {shape}")
        self.document_ids = ids if self.document_ids is None \
            else torch.cat([self.document_ids, ids], dim=1)

    def _refuse_unlike(self, K: torch.Tensor, V: torch.Tensor) -> None:
        """Say which size, dtype or device of the new keys and values is not the cache's."""
        for index, axis, name, new, old in (("n", 0, "keys", K, self.K),
                                            ("g", 1, "keys", K, self.K),
                                            ("a", 3, "keys", K, self.K),
                                            ("b", 3, "values", V, self.V)):
            if new.shape[axis] != old.shape[axis]:
                held = "K[n g σ a]" if name == "keys" else "V[n g σ b]"
                raise EinattnError(
                    f"index {index!r} has size {new.shape[axis]} in the new {name} but "
                    f"{old.shape[axis]} in the cache's {held}; call cache.reset() to "
                    f"start another sequence")
        raise EinattnError(f"new keys are {K.dtype} on {K.device} but the cache holds "
                           f"{self.K.dtype} on {self.K.device}")


class _Undo:
    """:meth:`KVCache.undo_on_error`'s block: a class, not a generator's context manager,
    whose enter and exit are twice the Python calls (a decoding step's cost)."""

    __slots__ = ("cache", "saved")

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.saved = cache.K, cache.V, cache.padding, cache.document_ids, cache._storage

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, traceback) -> bool:
        if kind is not None:
            c = self.cache
            c.K, c.V, c.padding, c.document_ids, c._storage = self.saved
        return False  # what was raised goes on


def check_new(K: torch.Tensor, V: torch.Tensor, key_padding_mask: torch.Tensor | None) -> None:
    """A call's new keys ``[n g σ a]`` and values ``[n g σ b]``, alike but for their width,
    and its key padding ``(n, σ)``."""
    if not (isinstance(K, torch.Tensor) and isinstance(V, torch.Tensor)
            and K.ndim == 4 and V.ndim == 4):  # one test where all is well (a decoding step)
        for name, t in (("K", K), ("V", V)):
            if not isinstance(t, torch.Tensor) or t.ndim != 4:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise EinattnError(f"the new {name}[n g σ a] must be a 4-D tensor, got {shape}")
    if V.shape[:3] != K.shape[:3] or V.dtype != K.dtype or V.device != K.device:
        raise EinattnError(f"every new key K[n g σ a] needs its value V[n g σ b]: K is "
                           f"{tuple(K.shape)} {K.dtype} on {K.device} but V is "
                           f"{tuple(V.shape)} {V.dtype} on {V.device}")
    n, L = K.shape[0], K.shape[2]
    if key_padding_mask is not None and (key_padding_mask.dtype != torch.bool
                                         or key_padding_mask.shape != (n, L)):
        raise EinattnError(
            f"with a cache, key_padding_mask marks this call's new keys: a bool (n, σ) = "
            f"({n}, {L}) tensor, True = padding, got {key_padding_mask.dtype} "
            f"{tuple(key_padding_mask.shape)}")


def _fit(K_old: torch.Tensor, V_old: torch.Tensor, K: torch.Tensor, V: torch.Tensor) -> bool:
    """Whether keys and values kept from before (cached, or their storage) are like the new
    ``K`` and ``V``: batch, heads, widths, dtype, device (a cache reset for a sequence of
    another batch makes new storage). Each pair is alike but for its width (``check_new``;
    the cache takes none other), so the values' width is all V adds."""
    return (K_old.shape[:2] == K.shape[:2] and K_old.shape[3] == K.shape[3]
            and V_old.shape[3] == V.shape[3] and K_old.dtype == K.dtype
            and K_old.device == K.device)


def _no_padding(n: int, L: int, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros(n, L, dtype=torch.bool, device=like.device)
