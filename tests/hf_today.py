"""The attention modules of today's models in Hugging Face, tiny, float64, random weights, for
tests/test_hf_today.py: their configs, the float32 islands patched, their masks.

Hugging Face computes in float32 whatever the model's dtype: cos/sin (every rotary class),
the RMS norms (``x.float()``), Llama 4's complex RoPE (``xq.float()``) and its temperature
(``positions.float()``, ``log1p``), DiffLlama's λ (``sum(..., dtype=float32)``). ``patched``
hands a module float64 angles from :mod:`einattn.rotary` and runs those in float64 (λ by
``lambda_q1 = lambda_q2 = 0``, which makes it exact), so that parity is tested at 1e-12;
the unpatched module is compared too, at :data:`UNPATCHED`.
"""

from __future__ import annotations

import contextlib
import importlib
import types
from dataclasses import dataclass, field

import torch

from einattn import rotary
from tests.conftest import randn

transformers = importlib.import_module("transformers")

F64 = torch.float64
N, L = 3, 11  # n, τ; every config's d_model (30, or 48), μ = 6 (12), g = 2 (4), a = 8 (6, 16)
UNPATCHED = 1e-6  # measured: 4e-8 … 1.4e-7 (DiffLlama's λ in float32)
SMALL = {"vocab_size": 50, "intermediate_size": 24, "max_position_embeddings": 64,
         "attn_implementation": "sdpa"}
HEADS = {"hidden_size": 30, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 8}
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def qwen3_config(**extra):
    return transformers.Qwen3Config(num_hidden_layers=2, rms_norm_eps=1e-5,
                                    rope_parameters=DEFAULT_ROPE, use_sliding_window=True,
                                    sliding_window=4, max_window_layers=1, **HEADS, **SMALL,
                                    **extra)


def gemma3_config(**extra):
    return transformers.Gemma3TextConfig(
        num_hidden_layers=2, query_pre_attn_scalar=13, sliding_window=4,
        attn_logit_softcapping=3.0, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 1000.0}},
        **HEADS, **SMALL, **extra)


def olmo2_config(**extra):
    return transformers.Olmo2Config(hidden_size=48, num_hidden_layers=1, num_attention_heads=6,
                                    num_key_value_heads=2, eos_token_id=None,
                                    rope_parameters=DEFAULT_ROPE, **SMALL, **extra)


def qwen3_next_config(**extra):
    return transformers.Qwen3NextConfig(
        num_hidden_layers=4, **{**HEADS, "head_dim": 16}, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
        shared_expert_intermediate_size=8, experts_implementation="eager",
        rope_parameters={**DEFAULT_ROPE, "partial_rotary_factor": 0.25}, **SMALL, **extra)


def diffllama_config(**extra):
    return transformers.DiffLlamaConfig(
        num_hidden_layers=3, **{**HEADS, "num_attention_heads": 12, "num_key_value_heads": 4,
                                "head_dim": 6}, rms_norm_eps=1e-5, rope_parameters=DEFAULT_ROPE,
        **SMALL, **extra)


def llama4_config(**extra):
    return transformers.Llama4TextConfig(
        intermediate_size_mlp=24, num_hidden_layers=2, no_rope_layers=[1, 0],
        attention_chunk_size=4, use_qk_norm=True, attn_temperature_tuning=True, floor_scale=3,
        attn_scale=0.25, num_local_experts=2, rms_norm_eps=1e-5, rope_parameters=DEFAULT_ROPE,
        experts_implementation="eager", **HEADS, **SMALL, **extra)


@dataclass(frozen=True)
class Case:
    """One module: its config, package and class prefix, layer index, how its RoPE is handed
    in (``"cos_sin"``, ``"complex"`` or None), whether its norms' gain is ``1 + γ``, and the
    mask the model gives it (``window``, ``chunk``)."""

    config: object
    package: str
    prefix: str
    layer: int
    rope: str | None = "cos_sin"
    plus_one: bool = False
    window: int | None = None
    chunk: int | None = None
    extra: dict = field(default_factory=dict)

    @property
    def modeling(self):
        return importlib.import_module(f"transformers.models.{self.package}."
                                       f"modeling_{self.package}")


CASES = {
    "qwen3 full": Case(qwen3_config, "qwen3", "Qwen3", 0),
    "qwen3 sliding": Case(qwen3_config, "qwen3", "Qwen3", 1, window=4),
    "gemma3 sliding": Case(gemma3_config, "gemma3", "Gemma3", 0, plus_one=True, window=4),
    "gemma3 full": Case(gemma3_config, "gemma3", "Gemma3", 1, plus_one=True),
    "olmo2": Case(olmo2_config, "olmo2", "Olmo2", 0),
    "qwen3_next": Case(qwen3_next_config, "qwen3_next", "Qwen3Next", 3, plus_one=True),
    "diffllama": Case(diffllama_config, "diffllama", "DiffLlama", 2),
    "llama4 chunked": Case(llama4_config, "llama4", "Llama4Text", 0, rope="complex", chunk=4),
    "llama4 nope": Case(llama4_config, "llama4", "Llama4Text", 1, rope=None),
}


def module(case: Case, seed: int = 0):
    """The float64 module in eval mode, every parameter random: norm gains around 1 (around 0
    under ``1 + γ``), so that a dropped gain shows."""
    config = case.config()
    m = getattr(case.modeling, f"{case.prefix}Attention")(config, case.layer).to(F64).eval()
    with torch.no_grad():
        for k, (name, p) in enumerate(m.named_parameters()):
            gain = "norm" in name and not case.plus_one
            p.copy_(randn(*p.shape, seed=seed * 100 + k) * 0.3 + gain)
    return m


def left_padded(n: int = N, length: int = L) -> torch.Tensor:
    """Key padding (n, L), True = padding: row 1 starts with 4 pads (a whole chunk of 4)."""
    kpm = torch.zeros(n, length, dtype=torch.bool)
    kpm[1, :4] = True
    return kpm


def allowed(case: Case, kpm: torch.Tensor, length: int, offset: int = 0) -> torch.Tensor:
    """The module's bool mask [n 1 τ σ], True = may attend: causal, its window or chunk (of
    the cache index), and not padding."""
    tau = torch.arange(offset, offset + length)[:, None]
    sigma = torch.arange(offset + length)[None, :]
    ok = sigma <= tau
    if case.window is not None:
        ok &= sigma > tau - case.window
    if case.chunk is not None:
        ok &= sigma // case.chunk == tau // case.chunk
    return ok[None, None] & ~kpm[:, None, None, :offset + length]


def positions(case: Case, m, layer, x, offset: int = 0, shipped: bool = False):
    """The position_embeddings the module takes for positions ``offset …``: its own rotary
    class's (``shipped``), else float64 angles from einattn.rotary, laid out as that class
    lays them (cos/sin of ``cat(θ, θ)``, or ``polar(1, θ)``), times its attention factor."""
    if case.rope is None:
        return None
    n, length = x.shape[:2]
    t = torch.arange(offset, offset + length).expand(n, length)
    if shipped:
        rotary_class = getattr(case.modeling, f"{case.prefix}RotaryEmbedding")(m.config)
        args = (m.layer_type,) if case.package == "gemma3" else ()
        return rotary_class(x, t, *args)
    omega, factor = rotary.frequencies(t, d_rot=layer.rotary_dim or layer.d_head,
                                       base=layer.rope_base, scaling=layer.rope_scaling,
                                       dtype=F64)
    theta = t[..., None].to(F64) * omega
    if case.rope == "complex":
        return torch.polar(torch.ones_like(theta), theta) * factor
    both = torch.cat([theta, theta], -1)
    return both.cos() * factor, both.sin() * factor


def _rms(x, weight, eps: float, plus_one: bool):
    out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return out if weight is None else out * ((1.0 + weight) if plus_one else weight)


def _complex_rope_float64(xq, xk, freqs_cis):
    """Llama 4's apply_rotary_emb without its ``.float()``: pairs (2p, 2p+1) as complex."""
    def turned(T):
        pairs = torch.view_as_complex(T.reshape(*T.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(pairs * freqs_cis[:, :, None, :]).flatten(3)
    return turned(xq), turned(xk)


@contextlib.contextmanager
def patched(case: Case, m, monkeypatch):
    """Inside it, the module's float32 islands run in float64: its norms, Llama 4's complex
    RoPE and its temperature's log1p, DiffLlama's λ (made exact: λ_q1 = λ_q2 = 0)."""
    for name in ("q_norm", "k_norm", "qk_norm"):
        norm = getattr(m, name, None)
        if norm is not None:
            eps = getattr(norm, "variance_epsilon", None) or norm.eps
            weight = getattr(norm, "weight", None)
            monkeypatch.setattr(norm, "forward", types.MethodType(
                lambda self, x, w=weight, e=eps: _rms(x, w, e, case.plus_one), norm))
    if case.package == "llama4":
        monkeypatch.setattr(case.modeling, "apply_rotary_emb", _complex_rope_float64)
        log1p = torch.log1p
        monkeypatch.setattr(torch, "log1p", lambda t: log1p(t.to(F64)))
    if case.package == "diffllama":
        with torch.no_grad():
            m.lambda_q1.zero_()
            m.lambda_q2.zero_()
    yield m
