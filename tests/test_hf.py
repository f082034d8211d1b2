"""einattn.hf.layer: the einattn layer of a Hugging Face attention module computes what the
module computes, and whatever einattn cannot compute yet is refused by name.

Tiny modules with random float64 weights, built from configs (no hub), against their own
eager forward with an explicit causal mask and, with RoPE, cos/sin from the model's own
rotary embedding class. Hugging Face computes cos/sin in float32 (and Llama's softmax too)
whatever the model's dtype, so those cases agree to 1e-5; GPT-2 has neither and agrees to
1e-12. Each case also names a wrong twin of the layer (scaling dropped, bias dropped, the
default scale, full rotary, the other RoPE style, ...) that must miss by more than 1e-3.
"""

from __future__ import annotations

import copy
import importlib
import math
import subprocess
import sys

import pytest
import torch

from einattn import EinattnError, hf
from tests.conftest import TOL, assert_close_scaled, randn

transformers = pytest.importorskip("transformers")

F64 = torch.float64
N, L, D, L0 = 5, 40, 30, 16  # n, τ (past L₀), i, the configs' max_position_embeddings
HEADS = {"num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 12}  # μ, g (r=3), a
GPT2_SIZES = {"n_embd": 28, "n_head": 4, "n_positions": 64}  # a = 7

ARCHS = {  # name -> (class prefix, package under transformers.models)
    "gpt2": ("GPT2", "gpt2"), "llama": ("Llama", "llama"), "mistral": ("Mistral", "mistral"),
    "qwen2": ("Qwen2", "qwen2"), "gemma": ("Gemma", "gemma"), "gemma2": ("Gemma2", "gemma2"),
    "stablelm": ("StableLm", "stablelm"), "glm": ("Glm", "glm"), "qwen3": ("Qwen3", "qwen3"),
    "gpt_oss": ("GptOss", "gpt_oss"), "phi": ("Phi", "phi"),
}
SCALINGS = {  # Hugging Face rope_parameters beyond rope_theta, L₀ = 16
    "linear": {"rope_type": "linear", "factor": 2.5},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": L0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": L0,
             "beta_fast": 8.0, "beta_slow": 1.0},
    # factor None: HF takes max_position_embeddings / original (64 / 16); truncate None: off,
    # which moves the ramp's upper end from pair 2 to pair 1.51 (beta_slow = 0.25)
    "yarn-derived-factor": {"rope_type": "yarn", "factor": None, "truncate": None,
                            "original_max_position_embeddings": L0, "beta_fast": 4.0,
                            "beta_slow": 0.25},
}


def _attention(arch: str, layer_idx: int = 0, **options):
    """Hugging Face's attention module of ``arch`` (float64, eval mode, random weights) for
    a config with these options, and its rotary embedding (None for GPT-2)."""
    prefix, package = ARCHS[arch]
    sizes = GPT2_SIZES if arch == "gpt2" else {"hidden_size": D, "max_position_embeddings": L0,
                                               **HEADS}
    config = getattr(transformers, f"{prefix}Config")(
        attn_implementation="eager", **{**sizes, **options})
    modeling = importlib.import_module(f"transformers.models.{package}.modeling_{package}")
    attention = getattr(modeling, f"{prefix}Attention")(config, layer_idx=layer_idx)
    with torch.no_grad():  # N(0, 0.2²): scores of order one (GPT-2's N(0, 0.02²) are flat)
        for k, p in enumerate(attention.parameters()):
            p.copy_(0.2 * randn(*p.shape, seed=6100 + k))
    rotary_embedding = getattr(modeling, f"{prefix}RotaryEmbedding", None)
    return (attention.double().eval(),
            None if rotary_embedding is None else rotary_embedding(config))


def _hf_forward(attention, rotary_embedding, x: torch.Tensor) -> torch.Tensor:
    """The module's own output on ``x`` at positions 0 … L−1 under a causal 4-D mask, with
    the layer's sliding window where it has one (written here: the model builds it)."""
    future = torch.full((x.shape[1], x.shape[1]), -math.inf, dtype=F64).triu(1)[None, None]
    window = getattr(attention, "sliding_window", None)
    if window is None and attention.config.model_type == "mistral":
        window = attention.config.sliding_window
    if window is not None:  # τ sees σ iff τ − w < σ ≤ τ
        future = future.masked_fill(torch.ones_like(future, dtype=torch.bool)
                                    .tril(-window), -math.inf)
    if rotary_embedding is None:
        return attention(x, attention_mask=future)[0]
    positions = torch.arange(x.shape[1]).expand(x.shape[0], -1)
    return attention(x, position_embeddings=rotary_embedding(x, positions),
                     attention_mask=future)[0]


def _rope(kind: str) -> dict:
    """Config options for this scaling; L₀ is "dynamic"'s max_position_embeddings, the
    others' original_max_position_embeddings (HF wants it below max_position_embeddings)."""
    longer = {} if kind in ("linear", "dynamic") else {"max_position_embeddings": 4 * L0}
    return {"rope_parameters": {**SCALINGS[kind], "rope_theta": 10000.0}, **longer}


# (id, arch, layer_idx, config options, the wrong twin: layer attributes that must matter)
CASES = [
    ("gpt2", "gpt2", 0, {}, {"causal": False}),
    ("gpt2-unscaled", "gpt2", 0, {"scale_attn_weights": False}, {"scale": None}),
    ("gpt2-inverse-layer-idx", "gpt2", 2, {"scale_attn_by_inverse_layer_idx": True},
     {"scale": None}),
    ("llama-gqa", "llama", 0, {}, {"rope": None}),
    *[(f"llama-{kind}", "llama", 0, _rope(kind), {"rope_scaling": None}) for kind in SCALINGS],
    ("llama-bias-and-theta", "llama", 0,
     {"attention_bias": True, "rope_parameters": {"rope_type": "default", "rope_theta": 500.0}},
     {"rope_base": 10000.0}),
    ("mistral", "mistral", 0, {"sliding_window": None}, {"rope": None}),
    ("qwen2-bias", "qwen2", 0, {}, {"b": None}),
    # a window on layer 1 only: layer 0 attends to everything
    ("qwen2-window-on-later-layers", "qwen2", 0,
     {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1,
      "num_hidden_layers": 2}, {"b": None}),
    ("gemma", "gemma", 0, {}, {"rope": None}),
    # the attention patterns of equation (3), each with a twin that leaves it out
    ("mistral-window", "mistral", 0, {"sliding_window": 8}, {"window": None}),
    ("qwen2-window-layer", "qwen2", 1,
     {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1,
      "num_hidden_layers": 2}, {"window": None}),
    ("gemma2-softcap-and-window", "gemma2", 0,
     {"attn_logit_softcapping": 2.0, "sliding_window": 8, "num_hidden_layers": 2},
     {"softcap": None}),
    ("gemma2-window-off-on-a-global-layer", "gemma2", 1,
     {"attn_logit_softcapping": 2.0, "sliding_window": 8, "num_hidden_layers": 2},
     {"window": 8}),
    ("gpt-oss-sinks-and-window", "gpt_oss", 0,
     {"sliding_window": 8, "num_hidden_layers": 2, "attention_bias": True},
     {"sinks": None}),
    ("gemma2-query-pre-attn-scalar", "gemma2", 1,
     {"query_pre_attn_scalar": 10, "attn_logit_softcapping": None, "num_hidden_layers": 2},
     {"scale": None}),
    ("stablelm-partial-rotary", "stablelm", 0,
     {"num_attention_heads": 3, "num_key_value_heads": 1, "use_qkv_bias": True,
      "partial_rotary_factor": 0.4}, {"rotary_dim": None}),
    ("glm-partial-interleaved", "glm", 0,
     {"attention_bias": True, "partial_rotary_factor": 0.5}, {"rope": "half"}),
]


@pytest.mark.parametrize("arch, layer_idx, options, twin", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_layer_equals_the_module(arch, layer_idx, options, twin):
    attention, rotary_embedding = _attention(arch, layer_idx, **options)
    x = randn(N, L, attention.config.hidden_size, seed=62)
    want = _hf_forward(attention, rotary_embedding, x)
    layer = hf.layer(attention)
    assert_close_scaled(layer(x), want, TOL[F64] if arch == "gpt2" else 1e-5)
    wrong = copy.deepcopy(layer)
    for name, value in twin.items():
        setattr(wrong, name, value)
    assert (wrong(x) - want).abs().max() > 1e-3


def test_whole_llama_models_layers_convert_in_place():
    """Inside a whole LlamaForCausalLM (GQA, llama3 scaling), with the mask and positions the
    model builds itself: each layer's converted attention maps the hidden states that
    reached it to what it returned (and not to what the other layer returned)."""
    config = transformers.LlamaConfig(
        vocab_size=11, hidden_size=D, intermediate_size=14, num_hidden_layers=2,
        attn_implementation="eager", **HEADS, **_rope("llama3"))
    torch.manual_seed(63)
    model = transformers.LlamaForCausalLM(config).double().eval()
    with torch.no_grad():  # N(0, 0.2²), as in _attention
        for k, p in enumerate(model.model.layers.parameters()):
            p.copy_(0.2 * randn(*p.shape, seed=6300 + k))
    seen = {}

    def keep(module, args, kwargs, output):
        seen[module.layer_idx] = (kwargs["hidden_states"], output[0])

    for block in model.model.layers:
        block.self_attn.register_forward_hook(keep, with_kwargs=True)
    model(torch.randint(11, (N, L), generator=torch.Generator().manual_seed(64)))
    layers = [hf.layer(block.self_attn) for block in model.model.layers]
    for k, (hidden, out) in seen.items():
        assert_close_scaled(layers[k](hidden), out, 1e-5)
        assert out.abs().max() > 0.1  # of order one, so that 1e-5 is tight
        assert (layers[1 - k](hidden) - out).abs().max() > 1e-3


def test_the_layer_holds_copies_in_the_modules_dtype_and_mode():
    attention, _ = _attention("qwen2", attention_dropout=0.25)
    layer = hf.layer(attention)
    assert (layer.W.dtype, layer.W.device, layer.training) == (F64, attention.q_proj.weight.device,
                                                               False)
    assert layer.dropout == 0.25 and hf.layer(attention.train()).training
    before = layer.W.detach().clone()
    with torch.no_grad():
        attention.q_proj.weight.add_(1.0)
    assert torch.equal(layer.W, before) and layer.W.grad_fn is None


def test_importing_einattn_leaves_transformers_unimported():
    code = ("import sys, einattn, einattn.hf; "
            "assert 'transformers' not in sys.modules, 'transformers was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


class _OwnLlamaAttention(importlib.import_module(
        "transformers.models.llama.modeling_llama").LlamaAttention):
    """A subclass may compute something else: it is refused, not converted."""


REFUSALS = [  # (id, module builder, what the message must say)
    ("no-config", lambda: torch.nn.Linear(4, 4), r"not a Hugging Face .*: Linear"),
    ("unknown-class", lambda: _attention("phi")[0], r"knows GPT2Attention.*PhiAttention"),
    ("subclass", lambda: _OwnLlamaAttention(_attention("llama")[0].config, 0),
     r"knows .*_OwnLlamaAttention \(model_type 'llama'\) from \S*test_hf"),
    ("stablelm-qk-layernorm", lambda: _attention(
        "stablelm", num_attention_heads=3, num_key_value_heads=1, qk_layernorm=True)[0],
     r"StableLmAttention .*\(q_layernorm\)"),
    ("llama-longrope", lambda: _attention("llama", rope_parameters={
        "rope_type": "longrope", "short_factor": [1.0] * 6, "long_factor": [2.0] * 6,
        "original_max_position_embeddings": L0, "rope_theta": 10000.0})[0],
     r"LlamaAttention \(model_type 'llama'\) has rope_parameters with rope_type 'longrope'"),
    ("llama-key-einattn-does-not-read", lambda: _attention("llama", rope_parameters={
        "rope_type": "linear", "factor": 2.0, "mscale": 1.0, "rope_theta": 10000.0})[0],
     r"LlamaAttention \(model_type 'llama'\): rope_scaling of rope_type 'linear' needs "
     r"\['factor'\], got \['factor', 'mscale'\]"),
    ("gpt2-cross-attention", lambda: transformers.models.gpt2.modeling_gpt2.GPT2Attention(
        transformers.GPT2Config(**GPT2_SIZES), is_cross_attention=True),
     r"GPT2Attention \(model_type 'gpt2'\) .*is_cross_attention=True"),
    ("gpt2-training-resid-dropout", lambda: _attention("gpt2")[0].train(),
     r"GPT2Attention .*training mode with resid_pdrop=0.1.*module.eval\(\)"),
]


@pytest.mark.parametrize("build, message", [r[1:] for r in REFUSALS],
                         ids=[r[0] for r in REFUSALS])
def test_what_einattn_cannot_compute_is_refused(build, message):
    with pytest.raises(EinattnError, match=message):
        hf.layer(build())
