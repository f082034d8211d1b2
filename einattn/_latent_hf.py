"""A :class:`~einattn.latent.LatentAttention` from Hugging Face's ``DeepseekV3Attention`` or
``DeepseekV2Attention`` (``transformers`` is never imported: the class is known by its name).

Where each weight comes from (``nn.Linear`` weights are ``[out, in]``):

    q_proj.weight             [(μ (a|ρ)) i]  ->  W_QA[μ a i], W_QR[μ ρ i]   (no query latent)
    q_a_proj.weight (+bias)   [l i]          ->  W_DQ[l i] (b_DQ[l])
    q_a_layernorm.weight      [l]            ->  gamma_Q[l]
    q_b_proj.weight           [(μ (a|ρ)) l]  ->  W_UQA[μ a l], W_UQR[μ ρ l]
    kv_a_proj_with_mqa.weight [(c|ρ) i]      ->  W_DKV[c i], W_KR[ρ i]  (its bias split alike)
    kv_a_layernorm.weight     [c]            ->  gamma_KV[c]
    kv_b_proj.weight          [(μ (a|b)) c]  ->  W_UK[μ a c], W_UV[μ b c]
    o_proj.weight (+bias)     [i (μ b)]      ->  W_O[μ b i] (b_O[i])
"""

from __future__ import annotations

import torch
from torch import nn

from .errors import EinattnError

# The classes known, and how each pairs the rotary channels: V2 always as neighbours (its
# complex form), V3 as its config's rope_interleave says.
CLASSES = ("DeepseekV3Attention", "DeepseekV2Attention")


def from_hf(cls, module: nn.Module, layer_options: dict):
    """The layer equal to ``module`` (LatentAttention.from_hf's body)."""
    who = type(module).__name__
    if who not in CLASSES:
        raise EinattnError(f"LatentAttention.from_hf takes {' or '.join(CLASSES)}, got {who}")
    config = module.config
    if module.num_key_value_groups > 1:
        raise EinattnError(f"{who} has num_key_value_heads={config.num_key_value_heads} below "
                           f"num_attention_heads={config.num_attention_heads}: multi-head latent "
                           f"attention has no key/value groups (its own forward fails so)")
    fixed = set(layer_options) & {"d_model", "n_heads", "d_latent", "d_head", "d_rope",
                                  "d_value", "d_query_latent", "bias", "eps", "rope",
                                  "rope_base", "rope_scaling", "device", "dtype"}
    if fixed:
        raise EinattnError(f"from_hf takes {', '.join(sorted(fixed))} from the module")
    weight = module.kv_a_proj_with_mqa.weight
    options = {"causal": bool(module.is_causal), "dropout": module.attention_dropout,
               **_sizes(module), **_rope(module, who), **layer_options}
    try:  # the layer checks the options: its message, with the module's name
        layer = cls(device=weight.device, dtype=weight.dtype, **options)
    except EinattnError as e:
        raise EinattnError(f"{who}: {e}") from None
    if options.get("scale") is None and layer.softmax_scale != module.scaling:
        layer.scale = float(module.scaling)  # a module whose scaling was set by hand
    state = {name: p.detach() for name, p in module.named_parameters()}
    with torch.no_grad():
        for name, t in weights(state, layer.n_heads, layer.d_head).items():
            getattr(layer, name).copy_(t)
    return layer.train(module.training)


def _sizes(module: nn.Module) -> dict:
    norm = module.kv_a_layernorm
    eps = norm.variance_epsilon
    if module.q_a_layernorm is not None and module.q_a_layernorm.variance_epsilon != eps:
        raise EinattnError(f"{type(module).__name__}'s q_a_layernorm has eps "
                           f"{module.q_a_layernorm.variance_epsilon} but kv_a_layernorm {eps}: "
                           f"LatentAttention has one eps")
    return {"d_model": module.hidden_size, "n_heads": module.num_heads,
            "d_latent": module.kv_lora_rank, "d_head": module.qk_nope_head_dim,
            "d_rope": module.qk_rope_head_dim, "d_value": module.v_head_dim,
            "d_query_latent": module.q_lora_rank, "eps": eps,
            "bias": module.kv_a_proj_with_mqa.bias is not None}


def _rope(module: nn.Module, who: str) -> dict:
    """``rope``, ``rope_base`` and ``rope_scaling`` from ``config.rope_parameters``."""
    config = module.config
    params = dict(config.rope_parameters)
    kind = params.get("rope_type", "default")
    interleaved = who == "DeepseekV2Attention" or config.rope_interleave
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise EinattnError(f"{who} has partial_rotary_factor={params['partial_rotary_factor']}: "
                           f"every one of MLA's d_rope channels turns")
    scaling = {k: v for k, v in params.items()
               if k not in ("rope_theta", "partial_rotary_factor")
               and (v is not None or k == "truncate")}
    if kind == "dynamic":
        scaling["max_position_embeddings"] = config.max_position_embeddings
    return {"rope": "interleaved" if interleaved else "half", "rope_base": params["rope_theta"],
            "rope_scaling": None if kind == "default" else scaling}


def weights(state: dict[str, torch.Tensor], n_heads: int, d_head: int) -> dict:
    """LatentAttention's tensors from a module's, by the table of the module docstring: a
    pure re-indexing, so it maps the module's gradients to the layer's too."""
    μ, a = n_heads, d_head
    c = state["kv_a_layernorm.weight"].shape[0]
    out = {"gamma_KV": state["kv_a_layernorm.weight"]}
    if "q_proj.weight" in state:
        out["W_QA"], out["W_QR"] = _heads(state["q_proj.weight"], μ, a)
    else:
        out |= {"W_DQ": state["q_a_proj.weight"], "gamma_Q": state["q_a_layernorm.weight"]}
        out["W_UQA"], out["W_UQR"] = _heads(state["q_b_proj.weight"], μ, a)
        if "q_a_proj.bias" in state:
            out["b_DQ"] = state["q_a_proj.bias"]
    kv = state["kv_a_proj_with_mqa.weight"]
    out["W_DKV"], out["W_KR"] = kv[:c], kv[c:]
    if "kv_a_proj_with_mqa.bias" in state:
        out["b_DKV"], out["b_KR"] = state["kv_a_proj_with_mqa.bias"][:c], \
            state["kv_a_proj_with_mqa.bias"][c:]
    out["W_UK"], out["W_UV"] = _heads(state["kv_b_proj.weight"], μ, a)
    o = state["o_proj.weight"]  # o[i (μ b)]
    out["W_O"] = o.reshape(o.shape[0], μ, -1).permute(1, 2, 0)
    if "o_proj.bias" in state:
        out["b_O"] = state["o_proj.bias"]
    return out


def _heads(W: torch.Tensor, n_heads: int, first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``(μ (f|g))`` of an nn.Linear weight as ``[μ f in]`` and ``[μ g in]``, f = first."""
    per_head = W.reshape(n_heads, -1, W.shape[-1])
    return per_head[:, :first], per_head[:, first:]
