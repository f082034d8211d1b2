"""Whether ``torch.autocast`` is on for a device, and the dtype it computes in there."""

from __future__ import annotations

import torch


def dtype(device: torch.device) -> torch.dtype | None:
    """Autocast's dtype on ``device`` where it is enabled, else None (also on devices that
    autocast does not know, such as ``meta``, where asking would raise)."""
    kind = device.type
    if not torch.amp.is_autocast_available(kind) or not torch.is_autocast_enabled(kind):
        return None
    return torch.get_autocast_dtype(kind)
