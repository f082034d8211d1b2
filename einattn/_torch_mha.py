"""``nn.MultiheadAttention`` on the other side: the layer made from one, one made from the
layer, and the state dict of one recognised where a layer's is expected.

PyTorch keeps the fused projection as ``in_proj_weight[(B μ a) i]`` (all queries, then all
keys, then all values; or ``q_proj_weight``, ``k_proj_weight``, ``v_proj_weight`` when the
context has its own width) and the output as ``out_proj.weight[i (μ a)]``; einattn keeps
``W[(μ B a) i]`` and ``W_O[μ a i]``. The conversions go through the ``nn.Linear`` layout of
:meth:`MultiHeadAttention.projections`, and ``batch_first`` travels both ways.
"""

from __future__ import annotations

import torch
from torch import nn

from .errors import EinattnError

# The keys of nn.MultiheadAttention's state dict, none of which a MultiHeadAttention has.
TORCH_KEYS = ("in_proj_weight", "in_proj_bias", "q_proj_weight", "k_proj_weight",
              "v_proj_weight", "out_proj.weight", "out_proj.bias", "bias_k", "bias_v")


def from_torch(cls, mha: nn.MultiheadAttention, layer_options: dict):
    """A ``cls`` layer equivalent to ``mha``: its weights, dropout and ``batch_first``."""
    if mha.kdim != mha.vdim:
        raise EinattnError(f"from_torch needs kdim = vdim (one context C[n σ j] gives the "
                           f"keys and the values), got kdim={mha.kdim}, vdim={mha.vdim}")
    if mha.bias_k is not None or mha.add_zero_attn:
        raise EinattnError("from_torch needs no add_bias_kv or add_zero_attn: einattn's "
                           "keys and values are the context's alone")
    if mha._qkv_same_embed_dim:
        W_q, W_k, W_v = mha.in_proj_weight.detach().chunk(3)
    else:
        W_q, W_k, W_v = (w.detach() for w in (mha.q_proj_weight, mha.k_proj_weight,
                                               mha.v_proj_weight))
    b = mha.in_proj_bias
    b_q, b_k, b_v = (None,) * 3 if b is None else b.detach().chunk(3)
    b_o = None if mha.out_proj.bias is None else mha.out_proj.bias.detach()
    options = {"dropout": mha.dropout, "batch_first": mha.batch_first, **layer_options}
    return cls.from_projections(W_q, W_k, W_v, mha.out_proj.weight.detach(),
                                n_heads=mha.num_heads, b_q=b_q, b_k=b_k, b_v=b_v, b_o=b_o,
                                **options)


def to_torch(layer) -> nn.MultiheadAttention:
    """An ``nn.MultiheadAttention`` equivalent to ``layer``, after refusing what it cannot
    express."""
    _check_expressible(layer)
    mha = nn.MultiheadAttention(layer.d_model, layer.n_heads, dropout=layer.dropout,
                                bias=layer.b_O is not None, batch_first=layer.batch_first,
                                kdim=layer.d_context, vdim=layer.d_context,
                                device=layer.W_O.device, dtype=layer.W_O.dtype)
    p = layer.projections()
    with torch.no_grad():
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
