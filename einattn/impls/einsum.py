"""``impl="einsum"``: equations (2)–(4) as written (:mod:`einattn.equations`), with every
term of equation (3) from the bound pattern: the one impl that has the weights ``A``, and
the dense form the chunked path falls back on for second derivatives and ``torch.func``.

Where nobody is handed S or A the softmax writes over its own scores
(:func:`einattn._softmax.over_scratch`: docs/performance.md, "How the fast paths are fast");
where every query sees its own key and there is no mask, the two passes that guard fully
masked rows are skipped.
"""

from __future__ import annotations

import torch

from .. import _softmax, masks
from ..equations import attention_scores, weighted_values


def run(Q, K, V, M, pattern, spec, seen: bool) -> dict[str, torch.Tensor]:
    """The impls' entry point: S, A and Z (S spent on A where they are not ``seen``)."""
    return stages(Q, K, V, M, pattern, spec.dropout, scratch=not seen)


def stages(Q, K, V, M, pattern, dropout: float, scratch: bool) -> dict[str, torch.Tensor]:
    """Equations (2)–(4) as written, with the terms of (3) from ``pattern``: S, A (after
    dropout, as applied) and Z. With ``scratch`` nobody sees S or A, so the softmax may
    spend S's storage (then "S" holds A). Float16 and bfloat16 scores, mask and softmax
    are float32 (as SDPA's are): a score past 65504 or a ``−1e4`` mask added in half
    precision would lose the row."""
    at = pattern.grid()
    no_dead_row = pattern.no_dead_row(M)
    M = masks.combine(M, None if at is None else pattern.allowed(at))
    half = Q.dtype in _HALF
    if half:
        with torch.autocast(Q.device.type, enabled=False):  # S itself never rounded to half
            S = attention_scores(Q.float(), K.float())
    else:
        S = attention_scores(Q, K)
    logits = pattern.scored(S, at) if pattern.scores else S  # cap(S) + B
    if pattern.sinks is not None:
        A = _softmax.with_sink(logits, M, pattern.sinks)
    else:
        A = _softmax.masked(logits, M, no_dead_row, scratch=scratch,
                            logits_mask=pattern.scores_mask)
    A = A.to(V.dtype) if half else A
    if dropout:
        A = torch.nn.functional.dropout(A, p=dropout)
    return {"S": S, "A": A, "Z": weighted_values(A, V)}


_HALF = (torch.float16, torch.bfloat16)
