"""``LatentCache``: what :class:`~einattn.latent.LatentAttention` reads back when it decodes.

Each form of multi-head latent attention keeps what its own attention reads, per token:

* ``"absorbed"``: the latent and the shared rotary key side by side,
  ``K[n 1 σ (c ρ)] = [C_KV[n σ c] | K_R[n σ ρ]]``, **c + ρ** numbers; its values are the
  latent itself, ``V = C_KV``, a view of the same storage, never a second copy;
* ``"expanded"``: every head's keys ``K[n μ σ (a ρ)]`` and values ``V[n μ σ b]``,
  **μ·(a + ρ) + μ·b** numbers.

The contract is :class:`~einattn.KVCache`'s: a call appends its new positions, ``len`` is the
number cached, :meth:`crop` keeps a prefix, :meth:`reset` starts a new sequence, and a call
that is refused (or raises later, inside :meth:`undo_on_error`) leaves the cache as it was.
One cache holds one form: the two hold different tensors.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ._checks import check_max_length
from .errors import EinattnError

FORMS = ("expanded", "absorbed")
# Storage grows by a quarter of the filled length, at least this many positions, as a
# KVCache's does (einattn/cache.py has the measurement behind the choice).
_HEADROOM = 16


class LatentCache:
    """The tokens seen so far, in the form one :class:`~einattn.latent.LatentAttention`
    runs: ``tensors`` are views of the filled positions of storage that grows geometrically
    (or is made once for ``max_length`` positions), so each call writes only its new ones.

    >>> cache = LatentCache()
    >>> (K,), padding = cache.append("absorbed", (torch.ones(1, 1, 3, 19),))
    >>> len(cache), tuple(K.shape), cache.numbers_per_token()
    (3, (1, 1, 3, 19), 19)
    """

    def __init__(self, max_length: int | None = None) -> None:
        self.max_length = check_max_length(max_length)
        self.form: str | None = None
        self.tensors: tuple[torch.Tensor, ...] | None = None  # each [n h σ w]
        self.padding: torch.Tensor | None = None  # (n, σ), True = padding, or None
        self._storage: tuple[torch.Tensor, ...] | None = None

    def __len__(self) -> int:
        """The number of cached positions σ."""
        return 0 if self.tensors is None else self.tensors[0].shape[2]

    def __repr__(self) -> str:
        shapes = None if self.tensors is None else [tuple(t.shape) for t in self.tensors]
        return f"LatentCache(length={len(self)}, form={self.form!r}, tensors={shapes})"

    def numbers_per_token(self) -> int:
        """How many numbers one cached position holds, for one sequence: c + ρ absorbed,
        μ·(a + ρ) + μ·b expanded (times the element size for bytes)."""
        if self.tensors is None:
            raise EinattnError("the cache is empty: it holds no form's tensors yet")
        return sum(t.shape[1] * t.shape[3] for t in self.tensors)

    @contextmanager
    def undo_on_error(self) -> Iterator[None]:
        """Put the cache back as it was if the block raises: a call that fails adds nothing."""
        saved = self.form, self.tensors, self.padding, self._storage
        try:
            yield
        except BaseException:
            self.form, self.tensors, self.padding, self._storage = saved
            raise

    def placed(self, positions, L: int, device) -> tuple[torch.Tensor | None, int]:
        """RoPE's positions of a call's tokens: as given, else after the cached ones."""
        return positions, len(self)

    def reset(self) -> None:
        """Forget every cached token (a new sequence, of either form). A ``max_length`` cache
        keeps its storage for the next sequence of the same shapes."""
        self.form = self.tensors = self.padding = None
        if self.max_length is None:
            self._storage = None

    def crop(self, length: int) -> None:
        """Keep the first ``length`` cached positions; the next append writes over the rest."""
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= len(self):
            raise EinattnError(f"crop keeps 0 to {len(self)} cached positions σ, got {length!r}")
        if length == 0:
            self.reset()
            return
        self.tensors = tuple(t[:, :, :length] for t in self.tensors)
        self.padding = None if self.padding is None else self.padding[:, :length]

    def append(self, form: str, new: tuple[torch.Tensor, ...],
               key_padding_mask: torch.Tensor | None = None):
        """Append this call's tensors of ``form`` (each ``[n h σ w]``, the same n and σ) and
        its key padding ``(n, σ)`` (True = padding); return every cached position's
        tensors and the padding over all of them (or None)."""
        self.check_call(form, new, key_padding_mask)
        before = len(self)
        self.tensors = self._stored(new, before)
        self.form = form
        if self.padding is not None or key_padding_mask is not None:
            n, L = new[0].shape[0], new[0].shape[2]
            old = self.padding if self.padding is not None else _no_padding(n, before, new[0])
            added = _no_padding(n, L, new[0]) if key_padding_mask is None else key_padding_mask
            self.padding = torch.cat([old, added], dim=1)
        return self.tensors, self.padding

    def check_call(self, form: str, new: tuple[torch.Tensor, ...],
                   key_padding_mask: torch.Tensor | None = None) -> None:
        """Refuse, before anything is written, what this cache cannot take."""
        if form not in FORMS:
            raise EinattnError(f"form must be one of {', '.join(map(repr, FORMS))}, got {form!r}")
        if self.form is not None and form != self.form:
            raise EinattnError(f"this cache holds the {self.form} form's tensors, not the "
                               f"{form} form's; call cache.reset() to start a sequence in it")
        _check_new(new, key_padding_mask)
        L = new[0].shape[2]
        if self.max_length is not None and len(self) + L > self.max_length:
            raise EinattnError(f"the cache holds at most max_length={self.max_length} positions, "
                               f"but {len(self)} cached and {L} new make {len(self) + L}")
        if self.tensors is not None:
            _check_like(new, self.tensors)

    def _stored(self, new: tuple[torch.Tensor, ...], before: int) -> tuple[torch.Tensor, ...]:
        """Every position's tensors, this call's written after the ``before`` cached ones:
        views of the storage, grown where it is full (concatenated where autograd needs
        each call's tensors kept as they are)."""
        L = before + new[0].shape[2]
        if torch.is_grad_enabled() and any(t.requires_grad for t in new):
            self._storage = None
            return new if self.tensors is None else tuple(
                torch.cat([old, t], dim=2) for old, t in zip(self.tensors, new, strict=True))
        store = self._storage
        if store is None or store[0].shape[2] < L or not _fits(store, new):
            capacity = self.max_length or L + max(L // 4, _HEADROOM)
            store = tuple(t.new_empty(t.shape[0], t.shape[1], capacity, t.shape[3]) for t in new)
            for s, old in zip(store, self.tensors or (), strict=False):
                s[:, :, :before].copy_(old)
            self._storage = store
        for s, t in zip(store, new, strict=True):
            s[:, :, before:L].copy_(t)
        return tuple(s[:, :, :L] for s in store)


def _check_new(new, key_padding_mask) -> None:
    """A call's tensors ``[n h σ w]`` agree in n, σ, dtype and device; its padding is
    ``(n, σ)`` bool."""
    if not isinstance(new, tuple) or not new or not all(
            isinstance(t, torch.Tensor) and t.ndim == 4 for t in new):
        got = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
               for t in new] if isinstance(new, tuple) else type(new).__name__
        raise EinattnError(f"the new tensors must be a tuple of 4-D [n h σ w] tensors, got "
                           f"{got}")
    first = new[0]
    for t in new[1:]:
        if (t.shape[0], t.shape[2], t.dtype, t.device) != (
                first.shape[0], first.shape[2], first.dtype, first.device):
            raise EinattnError(f"the new tensors disagree: {tuple(first.shape)} {first.dtype} "
                               f"on {first.device} and {tuple(t.shape)} {t.dtype} on {t.device}")
    n, L = first.shape[0], first.shape[2]
    if key_padding_mask is not None and (not isinstance(key_padding_mask, torch.Tensor)
                                         or key_padding_mask.dtype != torch.bool
                                         or key_padding_mask.shape != (n, L)):
        got = (f"{key_padding_mask.dtype} {tuple(key_padding_mask.shape)}"
               if isinstance(key_padding_mask, torch.Tensor) else type(key_padding_mask).__name__)
        raise EinattnError(f"with a cache, key_padding_mask marks this call's new keys: a bool "
                           f"(n, σ) = ({n}, {L}) tensor, True = padding, got {got}")


def _check_like(new, cached) -> None:
    """The new tensors continue the cached ones: as many, the same n, h, w, dtype, device."""
    if len(new) != len(cached):
        raise EinattnError(f"the cache holds {len(cached)} tensors per token, got {len(new)}")
    for k, (t, old) in enumerate(zip(new, cached, strict=True)):
        for index, axis in (("n", 0), ("heads", 1), ("width", 3)):
            if t.shape[axis] != old.shape[axis]:
                raise EinattnError(
                    f"{index} has size {t.shape[axis]} in new tensor {k} but {old.shape[axis]} "
                    f"in the cache's {tuple(old.shape)}; call cache.reset() to start another "
                    f"sequence")
        if t.dtype != old.dtype or t.device != old.device:
            raise EinattnError(f"new tensors are {t.dtype} on {t.device} but the cache holds "
                               f"{old.dtype} on {old.device}")


def _fits(storage: tuple[torch.Tensor, ...], new: tuple[torch.Tensor, ...]) -> bool:
    """Whether storage kept from before holds tensors like ``new`` (a reset cache reused)."""
    return len(storage) == len(new) and all(
        s.shape[:2] == t.shape[:2] and s.shape[3] == t.shape[3] and s.dtype == t.dtype
        and s.device == t.device for s, t in zip(storage, new, strict=True))


def _no_padding(n: int, L: int, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros(n, L, dtype=torch.bool, device=like.device)
