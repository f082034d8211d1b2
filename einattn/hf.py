"""Hugging Face models through einattn: one attention module as an einattn layer
(:func:`layer`), and whole models with einattn as their attention implementation
(:func:`register`, :func:`capture`), where their architecture calls Hugging Face's attention
interface (:func:`check`).

``layer(module)`` reads one attention module of a ``transformers`` model, its weights and
its ``config``, and returns an equal :class:`~einattn.MultiHeadAttention` (DeepSeek's: a
:class:`~einattn.LatentAttention`, by :meth:`~einattn.LatentAttention.from_hf`): its forward on
the hidden states ``x[n τ i]`` equals the module's forward on them, given the causal mask
and the positions ``0 … L−1`` that the model hands it (pass ``positions=`` for others).
What the layer takes from where:

* the weights: GPT-2's ``c_attn``/``c_proj`` by :func:`einattn.layouts.from_gpt2`, the
  ``q_proj``/``k_proj``/``v_proj``/``o_proj`` of the Llama family by
  :func:`einattn.layouts.from_hf_llama` (the key/value heads ``g`` from ``k_proj``'s rows);
* RoPE: the style from the class (how its ``apply_rotary_pos_emb`` pairs channels), the base
  and the scaling from ``config.rope_parameters``, ``rotary_dim`` from its
  ``partial_rotary_factor``;
* the softmax scale from ``module.scaling`` where it is not ``1/√a`` (GPT-2's
  ``scale_attn_weights`` and ``scale_attn_by_inverse_layer_idx``, Gemma 2's
  ``query_pre_attn_scalar``);
* ``causal`` from ``module.is_causal``, the attention dropout and the train/eval mode from
  the module.

* the attention patterns of equation (3): the sliding window this layer attends within
  (``sliding_window``, per layer where ``config.layer_types`` says so), Gemma 2's logit
  soft-capping (``attn_logit_softcapping``), gpt-oss's sinks (its ``sinks`` parameter, one
  logit per head);
* what today's models compute around (1)–(5), by class (:mod:`einattn._hf_layers`): the
  qk-norm of Qwen3, Gemma 3, OLMo 2 and Qwen3-Next, Qwen3-Next's output gate, DiffLlama's
  differential attention, Llama 4's chunked and NoPE layers.

What einattn's layer cannot compute yet raises :class:`~einattn.EinattnError` naming the
option and the model: a ``rope_type`` other than linear, dynamic, llama3 or yarn,
cross-attention, DeepSeek with fewer key/value heads than heads, a bidirectional Gemma 3,
and any class not in :data:`ROPE_STYLES`, :data:`MODELS` or GPT-2's. Nothing is left out
silently.

``transformers`` is never imported by ``import einattn`` or ``import einattn.hf`` (only
:func:`register` imports it): a module is recognised by its exact class (a subclass may have
changed its forward, so it is refused).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import warnings
from collections.abc import Iterator

from torch import nn

from . import _hf_layers, composition, layouts
from ._hf_layers import detached as _detached
from ._hf_layers import llama_family
from ._hf_layers import scale_of as _scale
from ._latent_hf import CLASSES as LATENT
from .errors import EinattnError
from .latent import LatentAttention
from .module import MultiHeadAttention
from .spec import Spec

# The attention classes with q_proj, k_proj, v_proj and o_proj, and how their
# apply_rotary_pos_emb pairs channels: "half" rotates the two halves of the turning
# channels against each other (R1), "interleaved" neighbours (R2).
ROPE_STYLES = {
    "LlamaAttention": "half",
    "MistralAttention": "half",
    "Qwen2Attention": "half",
    "GemmaAttention": "half",
    "Gemma2Attention": "half",
    "StableLmAttention": "half",  # partial rotary: the first rotary_ndims channels turn
    "GlmAttention": "interleaved",  # partial rotary, neighbouring channels paired
    "GptOssAttention": "half",  # with sinks, biases and alternating sliding windows
}
GPT2 = "GPT2Attention"
# Submodules that normalise queries or keys in the classes above, as einattn's layer does not
# (StableLM's qk_layernorm: a LayerNorm per head, with its mean and bias).
_QK_NORMS = ("q_norm", "k_norm", "q_layernorm", "k_layernorm")
# Today's models (docs/models.md): the Llama family with more around (1)–(5), and DeepSeek's.
MODELS = (*_hf_layers.CONVERTERS, *LATENT)

def layer(module: nn.Module) -> MultiHeadAttention | LatentAttention:
    """An einattn layer equal to one Hugging Face attention ``module`` (GPT-2, Llama,
    Mistral, Qwen2, Gemma, Gemma 2, StableLM, GLM, gpt-oss; Qwen3, Gemma 3, OLMo 2,
    Qwen3-Next, DiffLlama, Llama 4, DeepSeek V2 and V3), on its device, in its dtype, holding
    copies of its weights.

    For ``model.model.layers[k].self_attn`` (``model.transformer.h[k].attn`` for GPT-2),
    ``layer(module)(x)`` equals ``module(x, position_embeddings=..., attention_mask=...)[0]``
    with the model's rotary embedding of positions ``0 … L−1`` and its causal mask.
    A module that is not one of these, or uses what einattn cannot compute, is refused:

    >>> layer(nn.Linear(4, 4))
    Traceback (most recent call last):
    ...
    einattn.errors.EinattnError: not a Hugging Face attention module (no config): Linear
    """
    config = getattr(module, "config", None)
    if isinstance(module, nn.Module) and not _routes(type(module)):
        raise _own_code(type(module).__name__, type(module).__module__)
    if not isinstance(module, nn.Module) or config is None:
        raise EinattnError(f"not a Hugging Face attention module (no config): "
                           f"{type(module).__name__}")
    who, kind = _describe(module), type(module).__name__
    _refuse_what_einattn_lacks(module, who)
    if not type(module).__module__.startswith("transformers.") or (
            kind != GPT2 and kind not in ROPE_STYLES and kind not in MODELS):
        known = ", ".join([GPT2, *ROPE_STYLES, *MODELS])
        raise EinattnError(f"einattn.hf.layer knows {known} (exact classes, from "
                           f"transformers); got {who} from {type(module).__module__}")
    if kind in LATENT:
        return LatentAttention.from_hf(module)
    if kind in _hf_layers.CONVERTERS:
        return _hf_layers.CONVERTERS[kind](module, config, who)
    converted = _gpt2(module, who) if kind == GPT2 else llama_family(module, config, who,
                                                                     ROPE_STYLES[kind])
    return converted.train(module.training)


def _describe(module: nn.Module) -> str:
    model_type = getattr(module.config, "model_type", None)
    return f"{type(module).__name__} (model_type {model_type!r})"


def _refuse_what_einattn_lacks(module: nn.Module, who: str) -> None:
    """Raise for what the module computes that einattn's layer has no option for."""
    for name in _QK_NORMS if type(module).__name__ not in MODELS else ():
        if getattr(module, name, None) is not None:
            raise EinattnError(f"{who} normalises queries and keys per head ({name}) before "
                               f"the scores, as einattn's qk_norm (an RMS norm) does not")
    if getattr(module, "is_cross_attention", False):
        raise EinattnError(f"{who} is a cross-attention module (is_cross_attention=True, keys "
                           f"from the encoder); einattn.hf.layer converts self-attention only")


def _gpt2(module: nn.Module, who: str) -> MultiHeadAttention:
    """GPT-2: the fused ``Conv1D`` weights, no RoPE, the scale of ``module.scaling``."""
    if module.training and module.resid_dropout.p > 0:
        raise EinattnError(f"{who} is in training mode with resid_pdrop="
                           f"{module.resid_dropout.p}, a dropout on its output that einattn's "
                           f"layer does not apply: call module.eval() first, or set "
                           f"resid_pdrop=0")
    c_attn, c_proj = module.c_attn, module.c_proj
    W, b, W_O, b_O = layouts.from_gpt2(
        c_attn.weight.detach(), _detached(c_attn.bias), c_proj.weight.detach(),
        _detached(c_proj.bias), n_heads=module.num_heads)
    return MultiHeadAttention.from_fused(
        W, W_O, b, b_O, causal=bool(module.is_causal), dropout=module.attn_dropout.p,
        scale=_scale(module, module.head_dim))


# -- whole models: einattn as a Hugging Face attention implementation -----------------------

IMPLEMENTATIONS = {"einattn": "einsum", "einattn_sdpa": "sdpa", "einattn_chunked": "chunked",
                   "einattn_flex": "flex", "einattn_auto": "auto"}


def register() -> None:
    """Register einattn with ``transformers``: after it, ``attn_implementation="einattn"``
    (the equations as written), ``"einattn_sdpa"``, ``"einattn_chunked"``, ``"einattn_flex"``
    or ``"einattn_auto"`` (each call on the fastest of them: :mod:`einattn.impls.auto`) in
    ``from_config``, ``from_pretrained`` or ``model.set_attn_implementation`` runs every
    attention layer of a model through :func:`einattn.functional.attention`. Each name's
    mask is Hugging Face's boolean ``sdpa_mask`` (True = may attend: causal, padding, a
    sliding window, packed sequences), which einattn reads with its own meaning: a query
    with no key to attend to gives zeros, never NaN. Calling it again changes nothing."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    for name, impl in IMPLEMENTATIONS.items():
        AttentionInterface.register(name, _FORWARDS[impl])
        AttentionMaskInterface.register(name, sdpa_mask)
    if _output_collector() is None:
        warnings.warn("this transformers keeps no record einattn can read of the outputs a "
                      "forward gathers: a model that is asked for output_attentions in its "
                      "call and does not hand the flag to its attention (GPT-2) gets no "
                      "attention maps from einattn_sdpa, einattn_chunked, einattn_flex or "
                      "einattn_auto; set config.output_attentions, or use 'einattn'",
                      stacklevel=2)


def _forward(impl: str, module, query, key, value, attention_mask, dropout: float = 0.0,
             scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    """One attention call of a Hugging Face model: ``query[n μ τ a]``, ``key`` and
    ``value[n g σ a]`` to ``(Z[n τ μ a], A or None)``, as its attention functions return.
    The terms of equation (3) it passes (``sliding_window``, ``softcap``, ``s_aux``: the
    sinks) become einattn's patterns; ``scaling`` is the scale ``s`` of equation (2)."""
    for name in _UNREAD:
        if kwargs.get(name) is not None:
            raise EinattnError(f"{_describe(module)} hands its attention {name}, a term einattn's "
                               f"equations do not have: load this model with another "
                               f"attn_implementation")
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    L_q = query.shape[2]
    if attention_mask is None and causal and 1 < L_q < key.shape[2]:  # an empty static
        key, value = key[:, :, :L_q], value[:, :, :L_q]  # cache's slots: HF's own rule
    window = kwargs.get("sliding_window")
    if attention_mask is not None and L_q != key.shape[2]:
        window = None  # HF's mask has it, at positions a cache may not align bottom-right
    spec = Spec(impl, dropout=dropout, scale=scaling, window=window,
                softcap=kwargs.get("softcap"))
    pieces = composition.call_pieces(
        spec, composition.Call(causal=bool(causal) and attention_mask is None), False,
        kwargs.get("s_aux"), None)
    # "einattn" returns A as HF's eager does; the others where it is asked for or captured
    seen = impl == "einsum" or _weights_asked(module, kwargs) or _capturing.stages is not None
    stages = composition.attention(query, key, value, spec, attention_mask, None, pieces, seen)
    if _capturing.stages is not None:
        _capturing.calls += 1
        _capturing.stages[getattr(module, "layer_idx", len(_capturing.stages))] = {
            "Q": query, "K": key, "V": value, **stages}
    return stages["Z"].transpose(1, 2).contiguous(), stages.get("A") if seen else None


def _weights_asked(module, kwargs: dict) -> bool:
    """Whether the model collects the weights ``A`` from this call: its ``output_attentions``
    (the call's, which the Llama family hands its attention, else the config's), or Hugging
    Face gathering "attentions" from the module's output in this forward (what GPT-2's
    ``model(..., output_attentions=True)`` asks, telling its attention nothing)."""
    config = getattr(module, "config", None)
    if kwargs.get("output_attentions", getattr(config, "output_attentions", False)):
        return True
    collector = _output_collector()
    collected = None if collector is None else collector.get()
    return collected is not None and "attentions" in collected


@functools.cache
def _output_collector():
    """Hugging Face's record of the outputs the running forward gathers (private, in
    ``transformers.utils.output_capturing``), or None in a version that keeps it elsewhere."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return None
    return _active_collector


_UNREAD = ("position_bias", "head_mask")  # what some models pass that einattn cannot apply
_FORWARDS = {impl: functools.partial(_forward, impl) for impl in IMPLEMENTATIONS.values()}


class _Capturing(threading.local):
    stages: dict | None = None
    calls: int = 0  # attention calls recorded while capturing, on this thread


_capturing = _Capturing()


def check(model: nn.Module) -> str:
    """The einattn implementation that every attention call of ``model`` runs through (one of
    :data:`IMPLEMENTATIONS`), once it is known that they do; else an
    :class:`~einattn.EinattnError` that says why einattn is not running there.

    A model computes attention through einattn only where it calls Hugging Face's attention
    interface (``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)``);
    some architectures compute it in their own code (BLOOM, Falcon, GPT-Neo, MPT), and there
    the name is ignored, or refused at load. Which do is read as Hugging Face itself reads it
    (``PreTrainedModel._can_set_attn_implementation``: whether the modeling source's attention
    classes call the interface), for the model and every model inside it. docs/huggingface.md
    lists the architectures checked both ways. A model that routes through the interface but
    hands its attention a term einattn's equations lack (T5's ``position_bias``) passes this
    check and is refused, by name, at its first attention call.
    """
    if not isinstance(model, nn.Module):
        raise EinattnError(f"einattn.hf.check takes a Hugging Face model (an nn.Module), got "
                           f"{type(model).__name__}")
    for module in model.modules():
        routes = getattr(type(module), "_can_set_attn_implementation", None)
        if routes is not None and not routes():
            raise _own_code(_describe(module), type(module).__module__)
    name = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if name not in IMPLEMENTATIONS:
        raise EinattnError(f"{type(model).__name__} is not loaded with an einattn attention "
                           f"implementation ({', '.join(IMPLEMENTATIONS)}; call "
                           f"einattn.hf.register() first), got attn_implementation={name!r}")
    return name


def _routes(cls: type) -> bool:
    """Whether the modeling module of ``cls`` (a model's or an attention module's class)
    calls Hugging Face's attention interface, as its models declare it; True where nothing
    is declared (not a module of ``transformers.models``)."""
    source = sys.modules.get(cls.__module__)
    if not cls.__module__.startswith("transformers.models.") or source is None:
        return True
    from transformers import PreTrainedModel
    models = [c for c in vars(source).values() if isinstance(c, type)
              and issubclass(c, PreTrainedModel) and c.__module__ == cls.__module__]
    return all(model._can_set_attn_implementation() for model in models)


def _own_code(who: str, where: str) -> EinattnError:
    return EinattnError(
        f"{who} computes attention in its own code, not through Hugging Face's attention "
        f"interface ({where} never calls ALL_ATTENTION_FUNCTIONS.get_interface): einattn "
        f"cannot run in this model, and attn_implementation='einattn' is ignored there or "
        f"refused when it loads (docs/huggingface.md lists the architectures checked)")


@contextlib.contextmanager
def capture(model: nn.Module) -> Iterator[dict]:
    """Inside it, every attention call of ``model`` (loaded with an einattn implementation)
    records its stages by their equation names: ``stages[layer_index]["Q" | "K" | "V" |
    "S" | "A" | "Z"]``, as ``return_intermediates`` names them (each call overwrites its
    layer's: after ``generate``, the last step's). A model einattn does not run in is refused
    on entry (:func:`check`), and one that ran inside without any attention call reaching
    einattn, on exit."""
    check(model)
    ran = []
    hook = model.register_forward_hook(lambda *_: ran.append(True))
    saved, _capturing.stages = _capturing.stages, {}
    calls = _capturing.calls
    try:
        yield _capturing.stages
    finally:
        hook.remove()
        _capturing.stages = saved
    if ran and _capturing.calls == calls:
        raise EinattnError(f"{_describe(model)} ran inside einattn.hf.capture, but none of its "
                           f"attention calls reached einattn: it computes attention in its own "
                           f"code, not through Hugging Face's attention interface")
