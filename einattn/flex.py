"""FlexAttention for equations (2)–(4): placeholder."""

from __future__ import annotations

from .errors import EinattnError


def attention(Q, K, V, mask, pattern):
    raise EinattnError("impl='flex' is not available yet")
