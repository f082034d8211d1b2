"""``nn.MultiheadAttention`` on the other side: the layer made from one, one made from the
layer, and the state dict of one recognised where a layer's is expected.

PyTorch keeps the fused projection as ``in_proj_weight[(B μ a) i]`` (all queries, then all
keys, then all values; or ``q_proj_weight``, ``k_proj_weight``, ``v_proj_weight`` when the
context has its own width) and the output as ``out_proj.weight[i (μ a)]``; einattn keeps
``W[(μ B a) i]`` and ``W_O[μ a i]``. The conversions go through the ``nn.Linear`` layout of
:meth:`MultiHeadAttention.projections`, and ``batch_first`` travels both ways, and so do
``kdim ≠ vdim`` (einattn's ``d_context=(j, k)``), ``add_bias_kv`` (``bias_kv``: its
``bias_k``, ``bias_v`` of shape ``(1, 1, E)`` are the layer's ``bias_k[(μ a)]``,
``bias_v[(μ a)]``) and ``add_zero_attn`` (``zero_attn``).

PyTorch's one ambiguity: with ``is_causal=True``, ``need_weights=False`` and no
``key_padding_mask`` it drops its ``attn_mask`` and calls SDPA with ``is_causal=True`` over
the ``L_k + 1`` (or + 2) keys, whose top-left causal mask hides the added slots from every
query; on its other paths they are seen by every query. einattn's slots are seen by every
query, always (docs/models.md).
"""

from __future__ import annotations

import torch
from torch import nn

from .errors import EinattnError

# The keys of nn.MultiheadAttention's state dict, none of which a MultiHeadAttention has.
TORCH_KEYS = ("in_proj_weight", "in_proj_bias", "q_proj_weight", "k_proj_weight",
              "v_proj_weight", "out_proj.weight", "out_proj.bias", "bias_k", "bias_v")


def from_torch(cls, mha: nn.MultiheadAttention, layer_options: dict):
    """A ``cls`` layer equivalent to ``mha``: its weights, dropout, ``batch_first``, context
    widths and slots."""
    if mha._qkv_same_embed_dim:
        W_q, W_k, W_v = mha.in_proj_weight.detach().chunk(3)
    else:
        W_q, W_k, W_v = (w.detach() for w in (mha.q_proj_weight, mha.k_proj_weight,
                                               mha.v_proj_weight))
    b = mha.in_proj_bias
    b_q, b_k, b_v = (None,) * 3 if b is None else b.detach().chunk(3)
    b_o = None if mha.out_proj.bias is None else mha.out_proj.bias.detach()
    options = {"dropout": mha.dropout, "batch_first": mha.batch_first,
               "bias_kv": mha.bias_k is not None, "zero_attn": mha.add_zero_attn,
               **layer_options}
    layer = cls.from_projections(W_q, W_k, W_v, mha.out_proj.weight.detach(),
                                 n_heads=mha.num_heads, b_q=b_q, b_k=b_k, b_v=b_v, b_o=b_o,
                                 **options)
    if layer.bias_kv and mha.bias_k is not None:
        with torch.no_grad():
            layer.bias_k.copy_(mha.bias_k.reshape(-1))
            layer.bias_v.copy_(mha.bias_v.reshape(-1))
    return layer


def to_torch(layer) -> nn.MultiheadAttention:
    """An ``nn.MultiheadAttention`` equivalent to ``layer``, after refusing what it cannot
    express."""
    _check_expressible(layer)
    kdim, vdim = layer.d_context if isinstance(layer.d_context, tuple) else \
        (layer.d_context, layer.d_context)
    mha = nn.MultiheadAttention(layer.d_model, layer.n_heads, dropout=layer.dropout,
                                bias=layer.b_O is not None, add_bias_kv=layer.bias_kv,
                                add_zero_attn=layer.zero_attn, batch_first=layer.batch_first,
                                kdim=kdim, vdim=vdim, device=layer.W_O.device,
                                dtype=layer.W_O.dtype)
    p = layer.projections()
    with torch.no_grad():
        if layer.bias_kv:
            mha.bias_k.copy_(layer.bias_k.view(1, 1, -1))
            mha.bias_v.copy_(layer.bias_v.view(1, 1, -1))
        if mha._qkv_same_embed_dim:
            mha.in_proj_weight.copy_(torch.cat([p.W_q, p.W_k, p.W_v]))
        else:  # kdim = vdim ≠ embed_dim: three separate weights
            for name, w in (("q", p.W_q), ("k", p.W_k), ("v", p.W_v)):
                getattr(mha, f"{name}_proj_weight").copy_(w)
        mha.out_proj.weight.copy_(p.W_o)
        if p.b_o is not None:
            mha.in_proj_bias.copy_(torch.cat([p.b_q, p.b_k, p.b_v]))
            mha.out_proj.bias.copy_(p.b_o)
    return mha.train(layer.training)


def _check_expressible(layer) -> None:
    """Refuse, naming the option, a layer that ``nn.MultiheadAttention`` cannot express."""
    if layer.n_kv_heads != layer.n_heads:
        raise EinattnError(f"nn.MultiheadAttention has no grouped-query attention, but this "
                           f"layer has n_kv_heads={layer.n_kv_heads} < n_heads={layer.n_heads}")
    if layer.rope is not None:
        raise EinattnError(f"nn.MultiheadAttention has no rotary embeddings, but this layer "
                           f"has rope={layer.rope!r}")
    if layer.scale is not None:
        raise EinattnError(f"nn.MultiheadAttention always scales the scores by 1/√a, but "
                           f"this layer has scale={layer.scale}")
    patterned = [f"{k}={v!r}" for k, v in (("window", layer.window),
                                           ("softcap", layer.softcap), ("alibi", layer.alibi),
                                           ("sinks", layer.sinks is not None),
                                           ("pattern", layer.pattern)) if v]
    if patterned:
        raise EinattnError(f"nn.MultiheadAttention has no attention patterns, but this "
                           f"layer has {', '.join(patterned)}")
    if layer.causal:
        raise EinattnError("nn.MultiheadAttention keeps no causal flag, but this layer has "
                           "causal=True: convert a causal=False layer and pass "
                           "attn_mask=~einattn.masks.causal_mask(L) (or is_causal=True "
                           "with that mask) on each call")
    models = [f"{k}={getattr(layer, k)!r}" for k in ("qk_norm", "differential", "temperature")
              if getattr(layer, k) is not None] + (["gate=True"] if layer.gate else [])
    if models:
        raise EinattnError(f"nn.MultiheadAttention has none of today's models' options, but "
                           f"this layer has {', '.join(models)}")
    if layer.d_value != layer.d_head:
        raise EinattnError(f"nn.MultiheadAttention's values are as wide as its queries, but "
                           f"this layer has d_value={layer.d_value} ≠ d_head={layer.d_head}")
    if layer.n_heads * layer.d_head != layer.d_model:
        raise EinattnError(f"nn.MultiheadAttention needs n_heads·d_head = d_model, but "
                           f"{layer.n_heads}·{layer.d_head} != {layer.d_model}")


def refuse_torch_state(state_dict, prefix: str, own: list[str]) -> None:
    """Refuse ``nn.MultiheadAttention``'s state dict where a layer's (keys ``own``, under
    ``prefix``) is loaded: its keys would be unexpected and the layer's missing, or, with
    ``strict=False``, nothing would load at all."""
    theirs = [key for key in TORCH_KEYS if prefix + key in state_dict]
    if theirs and not any(prefix + key in state_dict for key in own):
        raise EinattnError(
            f"this is nn.MultiheadAttention's state dict ({', '.join(prefix + k for k in theirs)})"
            f", not einattn's ({', '.join(prefix + k for k in own)}): load it into the "
            f"nn.MultiheadAttention it came from and convert that module with "
            f"MultiHeadAttention.from_torch(mha), which reorders W[(μ B a) i] from "
            f"in_proj_weight[(B μ a) i]")
