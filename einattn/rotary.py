"""Rotary position embeddings (RoPE): each pair of a head's channels turned by an angle
that grows with the position.

A head channel ``a`` is split into pairs ``p`` (``a/2`` of them) of two components ``h``.
The pair p of a token at position t turns by the angle ``t·θ_p`` with ``θ_p =
base^(−2p/a)``, one 2×2 rotation ``R[n τ p h k]`` per position and pair:

    (R0)  θ[n τ p] = t[n τ] ω[p],  ω[p] = base^(−2p/a)
    (R1)  T_rot[n μ τ (h p)] = R[n τ p h k] T[n μ τ (k p)]        "half" (GPT-NeoX, Llama)
    (R2)  T_rot[n μ τ (p h)] = R[n τ p h k] T[n μ τ (p k)]        "interleaved" (RoFormer, GPT-J)

with ``R[n τ p ·  ·] = [[cos θ, −sin θ], [sin θ, cos θ]]``; ``T`` is the queries Q or the
keys K. The two styles differ only in which channels form a pair: the two halves of ``a``
(``a = (h p)``) or neighbours (``a = (p h)``). Because rotations compose, the score of
query position t and key position s depends on ``t − s`` only.

Two options change which channels turn and how fast (docs/derivation.md, "Rotary
embeddings"). ``rotary_dim`` (partial rotary, GPT-NeoX and Phi): only the first
``a_r = rotary_dim`` channels of each head turn, with ``a_r`` in place of ``a`` in (R0), and
the rest pass as they are. ``rope_scaling`` (a dict in Hugging Face's ``rope_parameters``
form) stretches the frequencies ``ω[p] = base^(−2p/a_r)`` for contexts longer than
training's, ``L₀``:

    linear   ω[p] / factor
    dynamic  base^(−2p/a_r) with base · (factor · L/L₀ − (factor − 1))^(a_r/(a_r − 2)),
             L = max(L₀, the largest position of the call + 1) (NTK-aware)
    llama3   ω[p] where its wavelength 2π/ω[p] < L₀/high_freq_factor, ω[p]/factor where it
             is > L₀/low_freq_factor, and between them (1 − s)·ω[p]/factor + s·ω[p] with
             s = (L₀/wavelength − low_freq_factor)/(high_freq_factor − low_freq_factor)
    yarn     (1 − e[p])·ω[p]/factor + e[p]·ω[p], e[p] = 1 − clamp((p − lo)/(hi − lo), 0, 1),
             lo and hi the pairs that turn beta_fast and beta_slow times in L₀; and R
             multiplied by the attention factor m = 0.1·ln(factor) + 1 (or as given)
"""

from __future__ import annotations

import math

import torch

from .errors import EinattnError
from .notation import Equation

ANGLES = Equation("θ[n τ p] = t[n τ] ω[p]")  # (R0), ω[p] = base^(−2p/a) unless scaled
ROTATE_HALF = Equation("T_rot[n μ τ (h p)] = R[n τ p h k] T[n μ τ (k p)]")
ROTATE_INTERLEAVED = Equation("T_rot[n μ τ (p h)] = R[n τ p h k] T[n μ τ (p k)]")
STYLES = {"half": ROTATE_HALF, "interleaved": ROTATE_INTERLEAVED}


def check_options(style, base, scaling, rotary_dim, d_head: int) -> tuple:
    """``(style, base, scaling, a_r)`` for heads of ``d_head`` channels, each checked."""
    style, base = check_style(style, d_head), check_base(base)
    d_rot = check_rotary_dim(rotary_dim, d_head)
    return style, base, check_scaling(scaling, base=base, d_head=d_head, d_rot=d_rot), d_rot


def check_style(rope: str | None, d_head: int) -> str | None:
    """``rope`` itself, once it is known to be a style that fits heads of ``d_head``."""
    if rope is not None and rope not in STYLES:
        raise EinattnError(f"rope must be None, 'half' or 'interleaved', got {rope!r}")
    if rope is not None and d_head % 2:
        raise EinattnError(f"rope turns pairs of channels, but index 'a' has odd size "
                           f"{d_head} (d_head)")
    return rope


def _positive(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) \
        and 0 < value < math.inf


def check_base(base) -> float:
    """``base`` itself, once it is known to be a finite positive number (θ_p = base^(−2p/a))."""
    if not _positive(base):
        raise EinattnError(f"rope_base must be a finite positive number (the base of "
                           f"θ_p = base^(−2p/a)), got {base!r}")
    return base


def check_rotary_dim(rotary_dim, d_head: int) -> int:
    """The number of channels that turn, ``a_r``: ``d_head`` by default, else an even int
    from 2 to ``d_head`` (partial rotary: the first ``a_r`` channels of each head)."""
    if rotary_dim is None:
        return d_head
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) or rotary_dim < 2 \
            or rotary_dim % 2 or rotary_dim > d_head:
        raise EinattnError(f"rotary_dim (a_r, the channels of each head that turn) must be an "
                           f"even int from 2 to d_head = {d_head}, got {rotary_dim!r}")
    return rotary_dim


# The keys of Hugging Face's rope_parameters that each rope_type reads, required and optional.
# "dynamic" reads L₀ from the model config's max_position_embeddings: here it is in the dict.
SCALING_KEYS = {
    "default": (set(), set()),
    "linear": ({"factor"}, set()),
    "dynamic": ({"factor", "max_position_embeddings"}, set()),
    "llama3": ({"factor", "original_max_position_embeddings", "low_freq_factor",
                "high_freq_factor"}, set()),
    "yarn": ({"factor", "original_max_position_embeddings"},
             {"attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
              "truncate"}),
}


def check_scaling(scaling, *, base: float, d_head: int, d_rot: int) -> dict | None:
    """``rope_scaling`` as a dict with its ``rope_type`` and every key that type needs.
    A ``rope_theta`` or ``partial_rotary_factor`` in it (as in a Hugging Face config's
    ``rope_parameters``) must agree with ``rope_base`` and ``rotary_dim``."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise EinattnError(f"rope_scaling must be a dict such as {{'rope_type': 'linear', "
                           f"'factor': 2.0}}, got {type(scaling).__name__}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in SCALING_KEYS:
        raise EinattnError(f"rope_scaling's rope_type must be one of "
                           f"{', '.join(map(repr, SCALING_KEYS))}, got {kind!r}")
    required, optional = SCALING_KEYS[kind]
    given = set(scaling) - {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
    if required - given or given - required - optional:
        raise EinattnError(f"rope_scaling of rope_type {kind!r} needs {sorted(required)}"
                           + (f" and may have {sorted(optional)}" if optional else "")
                           + f", got {sorted(given)}")
    for key in sorted(given - {"truncate"}):
        if not _positive(scaling[key]):
            raise EinattnError(f"rope_scaling's {key} must be a finite positive number, got "
                               f"{scaling[key]!r}")
    if kind == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise EinattnError(f"rope_scaling 'llama3' ramps between low_freq_factor and a larger "
                           f"high_freq_factor, got {scaling['low_freq_factor']} and "
                           f"{scaling['high_freq_factor']}")
    _check_agrees(scaling, base=base, d_head=d_head, d_rot=d_rot)
    if kind == "dynamic" and d_rot == 2:
        raise EinattnError("rope_scaling 'dynamic' raises the base to a_r/(a_r − 2): it needs "
                           "rotary_dim (a_r) of at least 4, got 2")
    return {**scaling, "rope_type": kind}


def _check_agrees(scaling: dict, *, base: float, d_head: int, d_rot: int) -> None:
    theta = scaling.get("rope_theta", base)
    if theta != base:
        raise EinattnError(f"rope_scaling has rope_theta={theta} but rope_base={base}; pass "
                           f"rope_base={theta}")
    fraction = scaling.get("partial_rotary_factor")
    if fraction is not None and int(d_head * fraction) != d_rot:
        raise EinattnError(f"rope_scaling has partial_rotary_factor={fraction}, "
                           f"{int(d_head * fraction)} of d_head = {d_head} channels, but "
                           f"rotary_dim={d_rot}; pass rotary_dim={int(d_head * fraction)}")


def positions_for(positions: torch.Tensor | None, *, n: int, L: int, offset: int,
                  device: torch.device) -> torch.Tensor:
    """Positions ``t[n τ]`` as int64: ``positions`` given as ``(L,)``, ``(1, L)`` or
    ``(n, L)`` integers, or by default ``offset, …, offset + L − 1`` (offset: the tokens
    already cached)."""
    if positions is None:
        return torch.arange(offset, offset + L, device=device).expand(n, L)
    if not isinstance(positions, torch.Tensor) or positions.dtype.is_floating_point \
            or positions.dtype.is_complex or positions.dtype == torch.bool:
        what = positions.dtype if isinstance(positions, torch.Tensor) else \
            type(positions).__name__
        raise EinattnError(f"positions must be an integer tensor t[τ] or t[n τ], got {what}")
    if positions.shape not in ((L,), (1, L), (n, L)):
        raise EinattnError(f"positions has shape {tuple(positions.shape)} but t[τ] or t[n τ] "
                           f"needs ({L},), (1, {L}) or ({n}, {L}) (n={n}, τ={L})")
    return positions.to(device=device, dtype=torch.int64).expand(n, L)


def rotations(t: torch.Tensor, *, d_head: int, base: float, dtype: torch.dtype,
              scaling: dict | None = None) -> torch.Tensor:
    """``R[n τ p h k]`` from positions ``t[n τ]`` by (R0), ``θ[n τ p] = t[n τ] ω[p]``, for
    ``d_head`` turning channels (``a_r``), with the frequencies ``ω`` of ``scaling``: angles
    in float64 for a float64 model, float32 otherwise (bfloat16 cannot tell position 256
    from 257), then cast."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    omega, m = frequencies(t, d_rot=d_head, base=base, scaling=scaling, dtype=work)
    theta = ANGLES(t=t.to(work), ω=omega)
    cos, sin = theta.cos() * m, theta.sin() * m
    R = torch.stack([torch.stack([cos, -sin], -1), torch.stack([sin, cos], -1)], -2)
    return R.to(dtype)


def frequencies(t: torch.Tensor, *, d_rot: int, base: float, scaling: dict | None,
                dtype: torch.dtype) -> tuple[torch.Tensor, float]:
    """``ω[p]`` of (R0) under ``scaling`` (module docstring), and the factor ``m`` that
    multiplies R (1 but for yarn). Only "dynamic" reads the positions ``t``: their largest."""
    kind = "default" if scaling is None else scaling["rope_type"]
    p = torch.arange(0, d_rot, 2, device=t.device, dtype=dtype)
    if kind == "dynamic":
        return _ntk_base(t, d_rot, base, scaling, dtype) ** (-p / d_rot), 1.0
    omega = base ** (-p / d_rot)
    if kind == "linear":
        return omega / scaling["factor"], 1.0
    if kind == "llama3":
        return _llama3(omega, scaling), 1.0
    if kind == "yarn":
        return _yarn(omega, d_rot, base, scaling)
    return omega, 1.0


def _ntk_base(t, d_rot: int, base: float, scaling: dict, dtype) -> torch.Tensor:
    """dynamic: ``base · (factor · L/L₀ − (factor − 1))^(a_r/(a_r − 2))``, L the longest."""
    factor, L0 = scaling["factor"], scaling["max_position_embeddings"]
    L = torch.clamp(t.max().to(dtype) + 1, min=L0) if t.numel() else torch.tensor(
        float(L0), dtype=dtype, device=t.device)
    return base * (factor * L / L0 - (factor - 1)) ** (d_rot / (d_rot - 2))


def _llama3(omega: torch.Tensor, scaling: dict) -> torch.Tensor:
    """llama3: long wavelengths slowed by ``factor``, short ones kept, a ramp between."""
    factor, L0 = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelength = 2 * math.pi / omega
    s = ((L0 / wavelength - low) / (high - low)).clamp(0, 1)
    return (1 - s) * omega / factor + s * omega


def _yarn(omega: torch.Tensor, d_rot: int, base: float, scaling: dict):
    """yarn: pairs that turn fewer than ``beta_slow`` times in L₀ interpolated, more than
    ``beta_fast`` times kept, a ramp between; R multiplied by the attention factor."""
    factor, L0 = scaling["factor"], scaling["original_max_position_embeddings"]

    def pair_turning(turns: float) -> float:  # the pair p that turns `turns` times in L₀
        return d_rot * math.log(L0 / (turns * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = pair_turning(scaling.get("beta_fast") or 32), pair_turning(
        scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, d_rot - 1)
    hi = hi + 0.001 if lo == hi else hi  # a ramp of zero width would divide by zero
    pair = torch.arange(d_rot // 2, device=omega.device, dtype=omega.dtype)
    e = 1 - ((pair - lo) / (hi - lo)).clamp(0, 1)  # e[p]: 1 = keep ω[p], 0 = ω[p]/factor
    return (1 - e) * omega / factor + e * omega, _yarn_attention_factor(scaling)


def _yarn_attention_factor(scaling: dict) -> float:
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    factor, mscale, mscale_all = (scaling["factor"], scaling.get("mscale"),
                                  scaling.get("mscale_all_dim"))

    def grown(weight: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0

    return grown(mscale) / grown(mscale_all) if mscale and mscale_all else grown(1.0)


def rotate(T: torch.Tensor, R: torch.Tensor, style: str) -> torch.Tensor:
    """Every head of ``T[n μ τ a]`` turned by ``R[n τ p h k]``: ``style="half"`` runs (R1),
    ``T_rot[n μ τ (h p)] = R[n τ p h k] T[n μ τ (k p)]``; ``"interleaved"`` runs (R2),
    ``T_rot[n μ τ (p h)] = R[n τ p h k] T[n μ τ (p k)]``.

    >>> T = torch.tensor([[[[1.0, 0.0]]]])  # one pair (h = 0, 1) at position t = 1
    >>> R = rotations(torch.tensor([[1]]), d_head=2, base=10000.0, dtype=torch.float32)
    >>> torch.allclose(rotate(T, R, "half"), torch.tensor([[[[0.5403, 0.8415]]]]), atol=1e-4)
    True
    """
    d_rot = 2 * R.shape[2]
    if d_rot == T.shape[-1]:
        return STYLES[style](R=R, T=T)
    turned = STYLES[style](R=R, T=T[..., :d_rot])  # partial rotary: the rest pass as they are
    return torch.cat([turned, T[..., d_rot:]], dim=-1)


def turned(Q, K, options: tuple, positions, *, offset: int, cross: bool):
    """Q and K turned by (R1)/(R2) where ``options`` (rope, base, scaling, rotary_dim) set a
    style, the keys at the queries' positions (self-attention only), which follow
    ``offset`` tokens already cached unless ``positions`` are given."""
    rope, base, scaling, d_rot = options
    if rope is None:
        if positions is not None or scaling is not None or d_rot is not None:
            raise EinattnError("positions=, rope_scaling= and rotary_dim= only matter with "
                               "rope='half' or 'interleaved'; this attention has rope=None")
        return Q, K
    style, base, scaling, d_rot = check_options(rope, base, scaling, d_rot, Q.shape[-1])
    if cross:
        raise EinattnError("rope needs self-attention: with a context, the keys' positions "
                           "are not the queries'; drop rope or the context")
    n, _, L, _ = Q.shape
    t = positions_for(positions, n=n, L=L, offset=offset, device=Q.device)
    R = rotations(t, d_head=d_rot, base=base, dtype=Q.dtype, scaling=scaling)
    return rotate(Q, R, style), rotate(K, R, style)
