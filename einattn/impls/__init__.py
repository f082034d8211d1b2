"""The impls of equations (2)–(4): the same ``Z[n μ τ a]`` from the same Q, K, V and the
same pattern of equation (3) (:mod:`einattn.patterns`, bound to the call), one module each,
each with one entry point of one signature, ``run(Q, K, V, M, pattern, spec, seen)``:

* :mod:`~einattn.impls.einsum`: the equations as written (:mod:`einattn.equations`);
* :mod:`~einattn.impls.sdpa`: ``F.scaled_dot_product_attention``, the pattern's mask folded
  into its mask;
* :mod:`~einattn.impls.chunked`: exact attention over tiles of queries × keys with O(L)
  memory (:mod:`einattn.impls.tiles`), skipping the tiles the pattern leaves empty;
* :mod:`~einattn.impls.flex`: FlexAttention with the pattern's mods and a BlockMask from the
  same tiles;
* :mod:`~einattn.impls.auto`: no impl of its own: ``impl="auto"`` picks one of the four
  above per call, by a table of measured rules, and runs it.

Each takes grouped-query keys and values as they are, ``K[n g σ a]`` with ``μ = (g r)``,
never repeated per head, and einattn's masks with einattn's meaning: True = may attend,
float = added, causal aligned bottom-right. Each says what it cannot run (the pattern's
pieces say why) rather than running something else. :func:`run` routes a call (asking the
pattern, never its pieces' classes); :func:`nonfinite` and :func:`masked_nonfinite_dropped`
keep a NaN or ±∞ behind a mask out of the outputs of the queries that may not see it, on
every impl (on the CPU, eagerly).
"""

from __future__ import annotations

import math

import torch

from .. import _softmax
from . import auto, chunked, einsum, flex, sdpa

RUNS = {"einsum": einsum.run, "sdpa": sdpa.run, "chunked": chunked.run, "flex": flex.run}


def run(Q, K, V, M, pattern, spec, seen: bool) -> dict[str, torch.Tensor]:
    """Equations (2)–(4) by the spec's impl, with the mask ``M`` and the bound ``pattern``:
    every stage where they are ``seen`` (on the einsum path, which alone has S and A), Z
    alone elsewhere. ``impl="auto"`` runs the impl :func:`einattn.impls.auto.choose` picks."""
    name = spec.impl
    if name == "auto":
        name = auto.noted(auto.choose(Q, K, V, M, pattern, spec, seen), Q, K)
    impl = RUNS["einsum" if seen else routed(name, pattern)]
    stages = impl(Q, K, V, M, pattern, spec, seen)
    if (M is not None or pattern.masks) and nonfinite(stages["Z"]):
        def again(K, V):
            return impl(Q, K, V, M, pattern, spec, seen)
        stages = masked_nonfinite_dropped(again, Q, K, V, M, pattern, stages)
    return stages


def choice(Q, K, V, M, pattern, spec, seen: bool) -> auto.Choice:
    """The impl :func:`run` runs this call on, and why (nothing is run)."""
    if spec.impl == "auto":
        return auto.choose(Q, K, V, M, pattern, spec, seen)
    name = "einsum" if seen else routed(spec.impl, pattern)
    why = "the weights A exist on the einsum path alone" if seen and spec.impl != "einsum" \
        else "as asked" if name == spec.impl else "SDPA cannot take a cap or a sink"
    return auto.Choice(name, f"impl={spec.impl!r}: {why}")


def routed(impl: str, pattern) -> str:
    """Where ``impl`` runs this pattern: SDPA takes masks and biases (ALiBi) as its mask; a
    softcap or a sink runs the einsum path's equations. Under ``torch.compile`` the einsum
    path runs as SDPA, which Inductor fuses, where SDPA can take the pattern."""
    if impl == "sdpa" and not pattern.additive:
        return "einsum"
    if impl == "einsum" and pattern.additive and torch.compiler.is_compiling():
        return "sdpa"
    return impl


def nonfinite(Z: torch.Tensor) -> bool:
    """Whether ``Z`` holds NaN or ±∞, checked where that costs no device sync and can
    branch: on the CPU, eagerly, outside the ``torch.func`` transforms."""
    if Z.device.type != "cpu" or torch.compiler.is_compiling() or _softmax.transformed():
        return False
    return not math.isfinite(Z.sum().item())


def masked_nonfinite_dropped(run, Q, K, V, M, pattern, stages: dict) -> dict:
    """The stages again with every key whose K or V is not finite set to zero, then NaN in
    the rows that may attend to one of those keys: a NaN or ±∞ behind the mask of a query
    (padding, the causal future, a bool mask) reaches no output of that query, where
    ``0 · NaN`` in equation (4) would have spread it."""
    bad = ~(torch.isfinite(K).all(-1) & torch.isfinite(V).all(-1))  # bad[n g σ]
    if not bad.any():
        return stages  # Q or an admissible input was not finite: it propagates
    stages = run(*(T.masked_fill(bad[..., None], 0.0) for T in (K, V)))
    n, n_heads, L_q, L_k = Q.shape[0], Q.shape[1], Q.shape[2], K.shape[2]
    allowed = torch.ones(L_q, L_k, dtype=torch.bool, device=Q.device)
    if pattern.masks:
        allowed = allowed & pattern.allowed(pattern.grid())
    if M is not None:
        allowed = allowed & (M if M.dtype == torch.bool else M != float("-inf"))
    bad = bad.repeat_interleave(n_heads // K.shape[1], dim=1)[:, :, None, :]  # [n μ 1 σ]
    poisoned = (allowed & bad).any(-1, keepdim=True).expand(n, n_heads, L_q, 1)
    return {k: v.masked_fill(poisoned, float("nan")) if k in ("A", "Z") else v
            for k, v in stages.items()}
