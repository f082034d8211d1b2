"""The einattn layer of a Hugging Face attention module of the Llama family (``q_proj``,
``k_proj``, ``v_proj``, ``o_proj``), for :func:`einattn.hf.layer`: the weights, RoPE, scale
and patterns every such module has (:func:`llama_family`), and, by class, what today's
models compute around them (:data:`CONVERTERS`):

* ``Qwen3Attention``: qk-norm per head with a gain γ, before RoPE (a sliding window where
  the layer has one);
* ``Gemma3Attention``: qk-norm per head with a gain ``1 + γ``, the RoPE of its layer type,
  ``query_pre_attn_scalar``'s scale, sliding and full layers (its ``attn_logit_softcapping``
  is kept by the module and never applied: einattn applies none either);
* ``Olmo2Attention``: qk-norm over every head's channels together;
* ``Qwen3NextAttention``: the output gate, its rows taken out of ``q_proj[(μ B a) i]``,
  qk-norm with ``1 + γ``, partial RoPE;
* ``DiffLlamaAttention``: differential attention, its four λ and its λ_init;
* ``Llama4TextAttention``: a chunked layer (``ChunkedLocal``, RoPE, the weightless RMS
  norm after RoPE) or a NoPE layer (causal, the temperature).

``transformers`` is never imported: a module is known by its exact class's name.
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import nn

from . import gate, layouts, rotary
from .differential import LAMBDAS, Differential
from .errors import EinattnError
from .module import MultiHeadAttention
from .patterns import ChunkedLocal
from .qk_norm import QKNorm
from .temperature import Temperature


def llama_family(module: nn.Module, config, who: str, style: str, *, W_q=None, b_q=None,
                 params: dict | None = None, **options) -> MultiHeadAttention:
    """The layer holding copies of the module's projections (``W_q``, ``b_q``: its query
    rows, where ``q_proj`` holds more), its RoPE (``style``; ``params``: the
    ``rope_parameters`` of its layer, the config's by default), scale, causal flag, dropout,
    window and sinks, with ``options`` of the layer besides."""
    a = module.head_dim
    q, k, v, o = (getattr(module, f"{p}_proj") for p in "qkvo")
    W_q = q.weight.detach() if W_q is None else W_q
    heads = {"n_heads": W_q.shape[0] // a, "n_kv_heads": k.weight.shape[0] // a}
    W = layouts.fuse_qkv(W_q, k.weight.detach(), v.weight.detach(), **heads)
    biased = any(p.bias is not None for p in (q, k, v, o))
    rope = {} if style is None else rope_options(
        config.rope_parameters if params is None else params, config, style, a, who)
    try:  # the layer checks the options: its message, with the model's name
        layer = MultiHeadAttention(
            o.weight.shape[0], heads["n_heads"], d_head=a, n_kv_heads=heads["n_kv_heads"],
            bias=biased, causal=bool(module.is_causal), dropout=module.attention_dropout,
            scale=scale_of(module, a), device=W.device, dtype=W.dtype,
            **rope, **patterns_of(module, config), **options)
    except EinattnError as e:
        raise EinattnError(f"{who}: {e}") from None
    with torch.no_grad():
        layer.W.copy_(W)
        layer.W_O.copy_(rearrange(o.weight.detach(), "i (μ c) -> μ c i", μ=layer.W_O.shape[0]))
        if biased:
            b_q = q.bias if b_q is None else b_q
            b = [t.detach() if t is not None else p.weight.new_zeros(n)
                 for t, p, n in ((b_q, q, W_q.shape[0]), (k.bias, k, k.weight.shape[0]),
                                 (v.bias, v, v.weight.shape[0]))]
            layer.b.copy_(layouts.fuse_qkv(*b, **heads))
            layer.b_O.copy_(layer.b_O if o.bias is None else o.bias.detach())
        if layer.sinks is not None:
            layer.sinks.copy_(module.sinks)
    return layer.train(module.training)


def patterns_of(module: nn.Module, config) -> dict:
    """The terms of equation (3) this module computes: its window, its softcap, its sinks
    (Gemma 3 keeps ``attn_logit_softcapping`` and never applies it: no softcap)."""
    softcap = getattr(module, "attn_logit_softcapping", None)
    softcap = getattr(config, "attn_logit_softcapping", None) if softcap is None else softcap
    if type(module).__name__ == "Gemma3Attention":
        softcap = None
    return {"window": sliding_window(module, config), "softcap": softcap,
            "sinks": getattr(module, "sinks", None) is not None}


def sliding_window(module: nn.Module, config) -> int | None:
    """The window this layer attends within, as the model decides it: the module's own
    ``sliding_window`` where it keeps one (Qwen2, Gemma 2: set for the layers that
    ``config.layer_types`` calls "sliding_attention"), else the config's for every layer
    (Mistral)."""
    if hasattr(module, "sliding_window"):
        return module.sliding_window
    layer_types, index = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
    if layer_types is not None and index is not None:
        return config.sliding_window if layer_types[index] == "sliding_attention" else None
    return getattr(config, "sliding_window", None)


def rope_options(params: dict, config, style: str, d_head: int, who: str) -> dict:
    """``rope``, ``rope_base``, ``rope_scaling`` and ``rotary_dim`` from a config's
    ``rope_parameters``; "default" is no scaling, "dynamic" also takes the config's
    ``max_position_embeddings`` (its L₀)."""
    kind = params.get("rope_type", "default")
    if kind not in rotary.SCALING_KEYS:
        raise EinattnError(f"{who} has rope_parameters with rope_type {kind!r}; einattn's "
                           f"rope_scaling has {', '.join(map(repr, rotary.SCALING_KEYS))}")
    # A key HF reads with .get() may be None, which it treats as absent (truncate: as False)
    scaling = {key: value for key, value in params.items()
               if key not in ("rope_theta", "partial_rotary_factor")
               and (value is not None or key == "truncate")}
    if kind == "yarn" and "factor" not in scaling:  # HF: the ratio of the two lengths
        scaling["factor"] = (config.max_position_embeddings
                             / scaling["original_max_position_embeddings"])
    if kind == "dynamic":
        scaling["max_position_embeddings"] = config.max_position_embeddings
    fraction = params.get("partial_rotary_factor")
    rotary_dim = None if fraction is None else int(d_head * fraction)
    return {"rope": style, "rope_base": params["rope_theta"],
            "rope_scaling": None if kind == "default" else scaling,
            "rotary_dim": None if rotary_dim == d_head else rotary_dim}


def scale_of(module: nn.Module, d_head: int) -> float | None:
    """``module.scaling`` where it is not the default ``1/√a`` (None: the default)."""
    return None if module.scaling == d_head ** -0.5 else float(module.scaling)


def detached(t):
    return None if t is None else t.detach()


# -- today's models ---------------------------------------------------------------------------

def _eps(norm: nn.Module) -> float:
    return norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps


def _with_gains(layer: MultiHeadAttention, module: nn.Module) -> MultiHeadAttention:
    """The layer with the module's qk-norm weights as its gains ``gamma_Q``, ``gamma_K``."""
    with torch.no_grad():
        for mine, theirs in (("gamma_Q", "q_norm"), ("gamma_K", "k_norm")):
            gain = getattr(layer, mine)
            gain.copy_(getattr(module, theirs).weight.detach().view(gain.shape))
    return layer


def qwen3(module: nn.Module, config, who: str) -> MultiHeadAttention:
    norm = QKNorm("head", "gamma", _eps(module.q_norm))
    return _with_gains(llama_family(module, config, who, "half", qk_norm=norm), module)


def olmo2(module: nn.Module, config, who: str) -> MultiHeadAttention:
    norm = QKNorm("heads", "gamma", _eps(module.q_norm))
    return _with_gains(llama_family(module, config, who, "half", qk_norm=norm), module)


def gemma3(module: nn.Module, config, who: str) -> MultiHeadAttention:
    if not module.is_causal:
        raise EinattnError(f"{who} attends both ways (use_bidirectional_attention, whose "
                           f"window is centred): einattn.hf.layer converts its causal layers")
    norm = QKNorm("head", "1+gamma", _eps(module.q_norm))
    params = config.rope_parameters[module.layer_type]
    return _with_gains(llama_family(module, config, who, "half", params=params, qk_norm=norm),
                       module)


def qwen3_next(module: nn.Module, config, who: str) -> MultiHeadAttention:
    n_heads = module.q_proj.weight.shape[0] // (2 * module.head_dim)
    W_q, W_G = gate.from_interleaved(module.q_proj.weight.detach(), n_heads)
    b_q, b_G = (None, None) if module.q_proj.bias is None else \
        gate.from_interleaved(module.q_proj.bias.detach(), n_heads)
    norm = QKNorm("head", "1+gamma", _eps(module.q_norm))
    layer = llama_family(module, config, who, "half", W_q=W_q, b_q=b_q, qk_norm=norm,
                         gate=True)
    with torch.no_grad():
        layer.W_G.copy_(W_G)
        if b_G is not None:
            layer.b_G.copy_(b_G)
    return _with_gains(layer, module)


def diffllama(module: nn.Module, config, who: str) -> MultiHeadAttention:
    eps = module.groupnorm.eps
    eps = torch.finfo(module.q_proj.weight.dtype).eps if eps is None else eps
    layer = llama_family(module, config, who, "half",
                         differential=Differential(module.lambda_init, eps))
    with torch.no_grad():
        for name in LAMBDAS:
            getattr(layer, name).copy_(getattr(module, name).detach())
    return layer


def llama4(module: nn.Module, config, who: str) -> MultiHeadAttention:
    """A chunked layer (RoPE, ``ChunkedLocal`` where ``layer_types`` says so, the weightless
    norm after RoPE) or a NoPE layer (causal, the temperature where it is tuned)."""
    options = {}
    if module.use_rope:
        chunked = config.layer_types[module.layer_idx] == "chunked_attention"
        options["pattern"] = ChunkedLocal(config.attention_chunk_size) if chunked else None
        if getattr(module, "qk_norm", None) is not None:
            options["qk_norm"] = QKNorm("head", None, module.qk_norm.eps, after_rope=True)
    elif module.attn_temperature_tuning:
        options["temperature"] = Temperature(module.floor_scale, module.attn_scale)
    return llama_family(module, config, who, "interleaved" if module.use_rope else None,
                        **options)


CONVERTERS = {"Qwen3Attention": qwen3, "Olmo2Attention": olmo2, "Gemma3Attention": gemma3,
              "Qwen3NextAttention": qwen3_next, "DiffLlamaAttention": diffllama,
              "Llama4TextAttention": llama4}
