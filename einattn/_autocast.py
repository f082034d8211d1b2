"""Whether ``torch.autocast`` is on for a device, and the dtype it computes in there."""

from __future__ import annotations

import torch


def _autocast_devices() -> frozenset[str]:
    """The device types autocast knows, asked once (Dynamo traces a set lookup, where it
    cannot trace ``torch.amp.is_autocast_available`` before torch 2.12)."""
    kinds = ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "maia", "xla", "ipu",
             torch._C._get_privateuse1_backend_name())
    return frozenset(k for k in kinds if torch.amp.is_autocast_available(k))


AUTOCAST_DEVICES = _autocast_devices()


def dtype(device: torch.device) -> torch.dtype | None:
    """Autocast's dtype on ``device`` where it is enabled, else None (also on devices that
    autocast does not know, such as ``meta``, where asking would raise)."""
    kind = device.type
    if kind not in AUTOCAST_DEVICES or not torch.is_autocast_enabled(kind):
        return None
    return torch.get_autocast_dtype(kind)
