"""Weight layouts and the rearrangements between them, each one einops pattern.

einattn keeps the fused projection as ``W[(μ B a) i]``: for every head μ its query, key and
value rows (B = Q, K, V) lie together, so a contiguous slice of rows holds whole heads.
With grouped-query attention it is ``W[(g C a) i]``: per key/value group g its r query
heads, then its key and its value (C = r + 2 slots), Megatron's grouped layout.
Reshape-based code keeps three ``nn.Linear`` weights ``W_q[(μ a) i]``, ``W_k``, ``W_v``,
and PyTorch's ``nn.MultiheadAttention`` stacks them as ``in_proj_weight[(B μ a) i]``.
The output weight is ``W_O[μ a i]``; as an ``nn.Linear`` weight it is ``W_o[i (μ a)]``.
Every function works on weights ``(rows, d_model)`` and on biases ``(rows,)`` alike.

Other libraries' layouts, each converted by one rearrangement per tensor (docs/layouts.md):

* Hugging Face Llama (Mistral, Qwen2): ``q_proj[(μ a) i]``, ``k_proj[(g a) i]``,
  ``v_proj[(g a) i]``, ``o_proj[i (μ a)]``: :func:`from_hf_llama`, :func:`to_hf_llama`.
* GPT-2's ``Conv1D``, stored transposed: ``c_attn[i (B μ a)]``, ``c_proj[(μ a) i]``:
  :func:`from_gpt2`, :func:`to_gpt2`.
* TransformerLens, per head: ``W_Q[μ i a]``, ``W_K[g i a]``, ``W_V[g i a]``, ``W_O[μ a i]``:
  :func:`from_transformer_lens`, :func:`to_transformer_lens`.
* Tiled grouped-query heads, ``μ = (r g)`` (x-transformers), against einattn's grouped
  ``μ = (g r)``: :func:`tiled_to_grouped` and :func:`tiled_to_grouped_o`, and back.
"""

from __future__ import annotations

import re

import torch
from einops import rearrange

from .errors import EinattnError


def _check_heads(n_heads: int) -> None:
    if isinstance(n_heads, bool) or not isinstance(n_heads, int) or n_heads < 1:
        raise EinattnError(f"n_heads (the size of index 'μ') must be a positive int, "
                           f"got {n_heads!r}")


def _check_rows(W: torch.Tensor, name: str, multiple: int, what: str) -> None:
    _check_tensor(W, name)
    if W.ndim not in (1, 2) or W.shape[0] % multiple:
        raise EinattnError(f"{name} has shape {tuple(W.shape)}; its first axis {what} must be "
                           f"a multiple of {multiple}")


def _check_tensor(t, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise EinattnError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _check_shape(t, name: str, pattern: str, shape: tuple[int, ...], sizes: str) -> None:
    """``t`` is a tensor of exactly ``shape``, the shape of ``name{pattern}`` at ``sizes``."""
    _check_tensor(t, name)
    if tuple(t.shape) != shape:
        raise EinattnError(f"{name} has shape {tuple(t.shape)} but {name}{pattern} needs "
                           f"{shape} with {sizes}")


def _check_ndim(t, name: str, pattern: str) -> None:
    """``t`` is a tensor with one axis per axis of ``pattern`` (a group is one axis)."""
    _check_tensor(t, name)
    ndim = len(re.findall(r"\([^)]*\)|\S+", pattern))
    if t.ndim != ndim:
        raise EinattnError(f"{name} has shape {tuple(t.shape)} but {name}[{pattern}] is {ndim}-D")


def groups(n_heads: int, n_kv_heads: int | None) -> tuple[int, int]:
    """``(g, r)``: the key/value groups and the query heads per group, ``μ = (g r)``."""
    _check_heads(n_heads)
    if n_kv_heads is None:
        return n_heads, 1
    if isinstance(n_kv_heads, bool) or not isinstance(n_kv_heads, int) or n_kv_heads < 1:
        raise EinattnError(f"n_kv_heads (the size of index 'g') must be a positive int, "
                           f"got {n_kv_heads!r}")
    if n_heads % n_kv_heads:
        raise EinattnError(f"n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}: "
                           f"query head μ = (g r) needs a whole number r of heads per group")
    return n_kv_heads, n_heads // n_kv_heads


def fuse_qkv(W_q: torch.Tensor, W_k: torch.Tensor, W_v: torch.Tensor, *, n_heads: int,
             n_kv_heads: int | None = None) -> torch.Tensor:
    """The fused weight from three ``nn.Linear`` weights ``W_q[(μ a) i]``, ``W_k[(g a) i]``,
    ``W_v[(g b) i]`` (or the three biases).

    The result is ``W[(g C a) i]``: per key/value group g, its r query heads, then its key,
    then its value (C runs over r + 2 slots). Without grouping (``n_kv_heads`` None or equal
    to ``n_heads``) r = 1 and this is ``W[(μ B a) i]``. Values of their own width b ≠ a
    (``W_v`` with ``(g b)`` rows) make it ``W[(g e) i]``, each group's rows
    ``e = (r a | a | b)``: the same order, the value block b wide.
    """
    g, r = groups(n_heads, n_kv_heads)
    _check_rows(W_q, "W_q", n_heads, "(μ a)")
    want = (W_q.shape[0] // r, *W_q.shape[1:])
    if W_k.shape != want:
        raise EinattnError(f"W_k has shape {tuple(W_k.shape)} but W_k[(g a) i] needs "
                           f"{want} with g={g} groups of r={r} query heads")
    _check_rows(W_v, "W_v", g, "(g b)")
    if W_v.shape[1:] != W_q.shape[1:]:
        raise EinattnError(f"W_v has shape {tuple(W_v.shape)} but W_v[(g b) i] needs "
                           f"{W_q.shape[1:]} after its rows, as W_q has")
    blocks = [rearrange(t, "(g e) ... -> g e ...", g=g) for t in (W_q, W_k, W_v)]
    return rearrange(torch.cat(blocks, dim=1), "g e ... -> (g e) ...")


def split_qkv(W: torch.Tensor, *, n_heads: int, n_kv_heads: int | None = None,
              d_value: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of :func:`fuse_qkv`: ``W_q, W_k, W_v`` from ``W[(g C a) i]`` (from
    ``W[(g e) i]`` with values ``d_value`` wide)."""
    g, r = groups(n_heads, n_kv_heads)
    if d_value is None:
        _check_rows(W, "W", g * (r + 2), "(μ B a)" if r == 1 else "(g C a)")
        a = b = W.shape[0] // (g * (r + 2))
    else:
        _check_rows(W, "W", g, "(g e)")
        b, a = d_value, (W.shape[0] // g - d_value) // (r + 1)
    W3 = rearrange(W, "(g e) ... -> g e ...", g=g)
    W_q, W_k, W_v = W3.split([r * a, a, b], dim=1)
    return tuple(rearrange(t, "g e ... -> (g e) ...") for t in (W_q, W_k, W_v))


def W_O_from_linear(W_o: torch.Tensor, *, n_heads: int) -> torch.Tensor:
    """``W_O[μ a i]`` from an output ``nn.Linear`` weight ``W_o[i (μ a)]``."""
    _check_heads(n_heads)
    if W_o.ndim != 2 or W_o.shape[1] % n_heads:
        raise EinattnError(f"W_o has shape {tuple(W_o.shape)}; W_o[i (μ a)] needs a second "
                           f"axis that is a multiple of μ={n_heads}")
    return rearrange(W_o, "i (μ a) -> μ a i", μ=n_heads)


def W_O_to_linear(W_O: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`W_O_from_linear`: ``W_o[i (μ a)]`` from ``W_O[μ a i]``."""
    if W_O.ndim != 3:
        raise EinattnError(f"W_O has shape {tuple(W_O.shape)} but W_O[μ a i] is 3-D")
    return rearrange(W_O, "μ a i -> i (μ a)")


def from_bma(W: torch.Tensor, *, n_heads: int, n_kv_heads: int | None = None) -> torch.Tensor:
    """``W[(μ B a) i]`` from the ``(B μ a)`` layout of ``nn.MultiheadAttention.in_proj_weight``
    (and of a fused linear split into all queries, then all keys, then all values).

    With ``n_kv_heads`` the queries, keys and values are blocks of ``(μ a)``, ``(g a)`` and
    ``(g a)`` rows (a fused ``qkv_proj`` such as Phi-3's), and the result is ``W[(g C a) i]``.
    """
    g, r = groups(n_heads, n_kv_heads)
    if r == 1:
        _check_rows(W, "W", 3 * n_heads, "(B μ a)")
        return rearrange(W, "(B μ a) ... -> (μ B a) ...", μ=n_heads, B=3)
    _check_rows(W, "W", g * (r + 2), "(μ a) + (g a) + (g a)")
    a = W.shape[0] // (g * (r + 2))
    W_q, W_k, W_v = W.split([n_heads * a, g * a, g * a])
    return fuse_qkv(W_q, W_k, W_v, n_heads=n_heads, n_kv_heads=g)


def to_bma(W: torch.Tensor, *, n_heads: int, n_kv_heads: int | None = None) -> torch.Tensor:
    """The inverse of :func:`from_bma`: the ``(B μ a)`` layout from ``W[(μ B a) i]`` (with
    ``n_kv_heads``, the blocks ``(μ a) + (g a) + (g a)`` from ``W[(g C a) i]``)."""
    g, r = groups(n_heads, n_kv_heads)
    if r == 1:
        _check_rows(W, "W", 3 * n_heads, "(μ B a)")
        return rearrange(W, "(μ B a) ... -> (B μ a) ...", μ=n_heads, B=3)
    return torch.cat(split_qkv(W, n_heads=n_heads, n_kv_heads=g))


# -- other libraries' layouts ------------------------------------------------------------

def fused_sizes(W_O) -> tuple[int, int, int]:
    """``(μ, a, i)`` read from ``W_O[μ a i]``, checked to be a 3-D tensor."""
    _check_ndim(W_O, "W_O", "μ a i")
    n_heads, a, i = W_O.shape
    return n_heads, a, i


def check_fused(W, b, W_O, b_O, g: int, r: int, a: int | None = None) -> None:
    """Check ``W[(g C a) i]``, ``b[(g C a)]``, ``b_O[i]`` (either bias may be None) against
    ``W_O[μ a i]``, with g groups of r query heads (``g = μ``, ``r = 1`` without grouping);
    given ``a`` other than ``W_O``'s width b, ``W[(g e) i]`` with ``e = (r a | a | b)``."""
    n_heads, b_width, i = W_O.shape
    a = b_width if a is None else a
    grouping = f", g={g}, C=r+2={r + 2}" if r > 1 else ", B=3"
    sizes = f"μ={n_heads}, a={a}, i={i} from W_O{grouping}"
    rows = g * ((r + 1) * a + b_width)
    layout = "[(μ B a) i]" if r == 1 else "[(g C a) i]"
    if a != b_width:
        sizes, layout = f"μ={n_heads}, b={b_width}, i={i} from W_O, a={a}, g={g}", "[(g e) i]"
    _check_shape(W, "W", layout, (rows, i), sizes)
    if b is not None:
        _check_shape(b, "b", layout.replace(" i]", "]"), (rows,), sizes)
    if b_O is not None:
        _check_shape(b_O, "b_O", "[i]", (i,), sizes)


def _zeros_where_missing(like: torch.Tensor, biases: dict, shapes: dict) -> dict | None:
    """None if no bias is given; otherwise every bias, the missing ones as zeros."""
    if all(v is None for v in biases.values()):
        return None
    return {k: like.new_zeros(shapes[k]) if v is None else v for k, v in biases.items()}


def from_hf_llama(q_proj: torch.Tensor, k_proj: torch.Tensor, v_proj: torch.Tensor,
                  o_proj: torch.Tensor, *, n_heads: int,
                  n_kv_heads: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W, W_O)`` from the ``.weight`` of a Hugging Face Llama attention layer's
    ``q_proj[(μ a) i]``, ``k_proj[(g a) i]``, ``v_proj[(g a) i]`` and ``o_proj[i (μ a)]``
    (Mistral and Qwen2 keep the same four).

    Hugging Face's ``repeat_kv`` gives query head μ the key/value head ``μ // r``, which is
    einattn's ``μ = (g r)``: no head moves. This converts weights only: the rotation of
    queries and keys (RoPE) that Llama applies between projection and scores belongs to the
    layer, not to its weights. Biases (Qwen2 has them on q, k and v) fuse with
    ``fuse_qkv(q_bias, k_bias, v_bias, ...)``.
    """
    g, _ = groups(n_heads, n_kv_heads)
    _check_ndim(q_proj, "q_proj", "(μ a) i")
    rows, i = q_proj.shape
    if rows % n_heads:
        raise EinattnError(f"q_proj has shape {tuple(q_proj.shape)}; its first axis (μ a) must "
                           f"be a multiple of μ={n_heads}")
    a = rows // n_heads
    sizes = f"μ={n_heads}, g={g}, a={a}, i={i} from q_proj"
    _check_shape(k_proj, "k_proj", "[(g a) i]", (g * a, i), sizes)
    _check_shape(v_proj, "v_proj", "[(g a) i]", (g * a, i), sizes)
    _check_shape(o_proj, "o_proj", "[i (μ a)]", (i, rows), sizes)
    W = fuse_qkv(q_proj, k_proj, v_proj, n_heads=n_heads, n_kv_heads=g)
    return W, rearrange(o_proj, "i (μ a) -> μ a i", μ=n_heads)


def to_hf_llama(W: torch.Tensor, W_O: torch.Tensor, *, n_kv_heads: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of :func:`from_hf_llama`: ``(q_proj, k_proj, v_proj, o_proj)`` weights
    from ``W[(g C a) i]`` and ``W_O[μ a i]`` (μ, a and i are read from ``W_O``)."""
    n_heads, _, _ = fused_sizes(W_O)
    g, r = groups(n_heads, n_kv_heads)
    check_fused(W, None, W_O, None, g, r)
    q_proj, k_proj, v_proj = split_qkv(W, n_heads=n_heads, n_kv_heads=g)
    return q_proj, k_proj, v_proj, rearrange(W_O, "μ a i -> i (μ a)")


def from_gpt2(c_attn_weight: torch.Tensor, c_attn_bias: torch.Tensor | None,
              c_proj_weight: torch.Tensor, c_proj_bias: torch.Tensor | None, *, n_heads: int
              ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """``(W, b, W_O, b_O)`` from GPT-2's ``Conv1D`` layers, which store their weights
    transposed (``x @ weight + bias``): ``c_attn.weight[i (B μ a)]``, ``c_attn.bias[(B μ a)]``,
    ``c_proj.weight[(μ a) i]``, ``c_proj.bias[i]``.

    Each is one rearrangement: ``i (B μ a) -> (μ B a) i``, ``(B μ a) -> (μ B a)``,
    ``(μ a) i -> μ a i``; ``b_O`` is ``c_proj.bias`` itself. A missing bias is zeros when the
    other is given, and both are None when neither is.

    >>> W, b, W_O, b_O = from_gpt2(torch.ones(16, 48), torch.ones(48), torch.ones(16, 16),
    ...                            torch.ones(16), n_heads=4)
    >>> tuple(W.shape), tuple(b.shape), tuple(W_O.shape), tuple(b_O.shape)
    ((48, 16), (48,), (4, 4, 16), (16,))
    """
    _check_heads(n_heads)
    _check_ndim(c_attn_weight, "c_attn_weight", "i (B μ a)")
    i, columns = c_attn_weight.shape
    if columns % (3 * n_heads):
        raise EinattnError(f"c_attn_weight has shape {tuple(c_attn_weight.shape)}; its second "
                           f"axis (B μ a) must be a multiple of B·μ = 3·{n_heads}")
    a = columns // (3 * n_heads)
    sizes = f"B=3, μ={n_heads}, a={a}, i={i} from c_attn_weight"
    _check_shape(c_proj_weight, "c_proj_weight", "[(μ a) i]", (n_heads * a, i), sizes)
    biases = {"c_attn_bias": c_attn_bias, "c_proj_bias": c_proj_bias}
    shapes = {"c_attn_bias": (columns,), "c_proj_bias": (i,)}
    patterns = {"c_attn_bias": "[(B μ a)]", "c_proj_bias": "[i]"}
    for name, t in biases.items():
        if t is not None:
            _check_shape(t, name, patterns[name], shapes[name], sizes)
    W = rearrange(c_attn_weight, "i (B μ a) -> (μ B a) i", B=3, μ=n_heads)
    W_O = rearrange(c_proj_weight, "(μ a) i -> μ a i", μ=n_heads)
    biases = _zeros_where_missing(c_attn_weight, biases, shapes)
    if biases is None:
        return W, None, W_O, None
    b = rearrange(biases["c_attn_bias"], "(B μ a) -> (μ B a)", B=3, μ=n_heads)
    return W, b, W_O, biases["c_proj_bias"]


def to_gpt2(W: torch.Tensor, b: torch.Tensor | None, W_O: torch.Tensor, b_O: torch.Tensor | None
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """The inverse of :func:`from_gpt2`: ``(c_attn_weight, c_attn_bias, c_proj_weight,
    c_proj_bias)`` from ``W[(μ B a) i]``, ``b``, ``W_O[μ a i]`` and ``b_O`` (μ, a and i are
    read from ``W_O``; GPT-2 has no grouped-query attention)."""
    n_heads, _, i = fused_sizes(W_O)
    check_fused(W, b, W_O, b_O, n_heads, 1)
    c_attn_weight = rearrange(W, "(μ B a) i -> i (B μ a)", μ=n_heads, B=3)
    c_proj_weight = rearrange(W_O, "μ a i -> (μ a) i")
    biases = _zeros_where_missing(W, {"b": b, "b_O": b_O}, {"b": (W.shape[0],), "b_O": (i,)})
    if biases is None:
        return c_attn_weight, None, c_proj_weight, None
    c_attn_bias = rearrange(biases["b"], "(μ B a) -> (B μ a)", μ=n_heads, B=3)
    return c_attn_weight, c_attn_bias, c_proj_weight, biases["b_O"]


def from_transformer_lens(W_Q: torch.Tensor, W_K: torch.Tensor, W_V: torch.Tensor,
                          W_O: torch.Tensor, b_Q: torch.Tensor | None = None,
                          b_K: torch.Tensor | None = None, b_V: torch.Tensor | None = None,
                          b_O: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor,
                                     torch.Tensor | None]:
    """``(W, b, W_O, b_O)`` from TransformerLens's per-head weights ``W_Q[μ i a]``,
    ``W_K[g i a]``, ``W_V[g i a]``, ``W_O[μ a i]`` and biases ``b_Q[μ a]``, ``b_K[g a]``,
    ``b_V[g a]``, ``b_O[i]``.

    The number of heads μ is read from ``W_Q``, of key/value groups g from ``W_K`` (with
    grouped-query attention TransformerLens keeps them as ``_W_K``, ``_W_V``, ``_b_K``,
    ``_b_V`` and repeat-interleaves them, its query head μ reading group ``μ // r``, as
    einattn's ``μ = (g r)``). ``W_O[μ a i]`` is einattn's layout already. A missing bias is
    zeros when another is given; ``b`` and ``b_O`` are None when none is.
    """
    _check_ndim(W_Q, "W_Q", "μ i a")
    _check_ndim(W_K, "W_K", "g i a")
    n_heads, i, a = W_Q.shape
    g = W_K.shape[0]
    if g == 0 or n_heads % g:
        raise EinattnError(f"W_K has g={g} key/value heads, which does not divide the μ={n_heads} "
                           f"query heads of W_Q: query head μ = (g r) needs a whole number r "
                           f"of heads per group")
    sizes = f"μ={n_heads}, i={i}, a={a} from W_Q, g={g} from W_K"
    shapes = {"W_K": (g, i, a), "W_V": (g, i, a), "W_O": (n_heads, a, i),
              "b_Q": (n_heads, a), "b_K": (g, a), "b_V": (g, a), "b_O": (i,)}
    given = {"W_K": W_K, "W_V": W_V, "W_O": W_O, "b_Q": b_Q, "b_K": b_K, "b_V": b_V, "b_O": b_O}
    for name, t in given.items():
        if t is not None or name[0] == "W":
            _check_shape(t, name, f"[{_TL_PATTERNS[name]}]", shapes[name], sizes)
    heads = {"n_heads": n_heads, "n_kv_heads": g}
    W = fuse_qkv(rearrange(W_Q, "μ i a -> (μ a) i"), rearrange(W_K, "g i a -> (g a) i"),
                 rearrange(W_V, "g i a -> (g a) i"), **heads)
    biases = _zeros_where_missing(W_Q, {k: given[k] for k in ("b_Q", "b_K", "b_V", "b_O")},
                                  shapes)
    if biases is None:
        return W, None, W_O, None
    b = fuse_qkv(rearrange(biases["b_Q"], "μ a -> (μ a)"), rearrange(biases["b_K"], "g a -> (g a)"),
                 rearrange(biases["b_V"], "g a -> (g a)"), **heads)
    return W, b, W_O, biases["b_O"]


_TL_PATTERNS = {"W_Q": "μ i a", "W_K": "g i a", "W_V": "g i a", "W_O": "μ a i", "b_Q": "μ a",
                "b_K": "g a", "b_V": "g a", "b_O": "i"}


def to_transformer_lens(W: torch.Tensor, W_O: torch.Tensor, b: torch.Tensor | None = None,
                        b_O: torch.Tensor | None = None, *,
                        n_kv_heads: int | None = None) -> dict[str, torch.Tensor | None]:
    """The inverse of :func:`from_transformer_lens`: a dict of ``W_Q[μ i a]``, ``W_K[g i a]``,
    ``W_V[g i a]``, ``W_O[μ a i]``, ``b_Q[μ a]``, ``b_K[g a]``, ``b_V[g a]``, ``b_O[i]``
    (biases None without ``b`` and ``b_O``) from ``W[(g C a) i]`` and ``W_O[μ a i]``;
    ``from_transformer_lens(**to_transformer_lens(W, W_O, ...))`` gives them back."""
    n_heads, _, i = fused_sizes(W_O)
    g, r = groups(n_heads, n_kv_heads)
    check_fused(W, b, W_O, b_O, g, r)
    heads = {"n_heads": n_heads, "n_kv_heads": g}
    W_q, W_k, W_v = split_qkv(W, **heads)
    out = {"W_Q": rearrange(W_q, "(μ a) i -> μ i a", μ=n_heads),
           "W_K": rearrange(W_k, "(g a) i -> g i a", g=g),
           "W_V": rearrange(W_v, "(g a) i -> g i a", g=g), "W_O": W_O,
           "b_Q": None, "b_K": None, "b_V": None, "b_O": None}
    biases = _zeros_where_missing(W, {"b": b, "b_O": b_O}, {"b": (W.shape[0],), "b_O": (i,)})
    if biases is not None:
        b_q, b_k, b_v = split_qkv(biases["b"], **heads)
        out |= {"b_Q": rearrange(b_q, "(μ a) -> μ a", μ=n_heads),
                "b_K": rearrange(b_k, "(g a) -> g a", g=g),
                "b_V": rearrange(b_v, "(g a) -> g a", g=g), "b_O": biases["b_O"]}
    return out


def tiled_to_grouped(W_q: torch.Tensor, *, n_heads: int, n_kv_heads: int) -> torch.Tensor:
    """Query rows from the tiled head order to einattn's grouped one:
    ``W_q[((r g) a) i] -> W_q[((g r) a) i]`` (or the bias ``b_q``).

    Tiled (x-transformers): query head μ reads key/value head ``μ % g``, so ``μ = (r g)``.
    Grouped (einattn, ``F.scaled_dot_product_attention(enable_gqa=True)``, Hugging Face):
    it reads ``μ // r``, so ``μ = (g r)``. Keys and values do not move; the output weight
    must move with the queries: see :func:`tiled_to_grouped_o`.

    >>> W_q = torch.arange(6.0)[:, None]      # 6 heads of one channel, row = tiled head
    >>> tiled_to_grouped(W_q, n_heads=6, n_kv_heads=2).flatten().tolist()
    [0.0, 2.0, 4.0, 1.0, 3.0, 5.0]

    Group 0 now holds the tiled heads 0, 2, 4, the ones that read key/value head ``μ % 2 = 0``.
    """
    g, r = groups(n_heads, n_kv_heads)
    _check_rows(W_q, "W_q", n_heads, "((r g) a)")
    return rearrange(W_q, "(r g a) ... -> (g r a) ...", g=g, r=r)


def grouped_to_tiled(W_q: torch.Tensor, *, n_heads: int, n_kv_heads: int) -> torch.Tensor:
    """The inverse of :func:`tiled_to_grouped`: ``W_q[((g r) a) i] -> W_q[((r g) a) i]``."""
    g, r = groups(n_heads, n_kv_heads)
    _check_rows(W_q, "W_q", n_heads, "((g r) a)")
    return rearrange(W_q, "(g r a) ... -> (r g a) ...", g=g, r=r)


def tiled_to_grouped_o(W_o: torch.Tensor, *, n_heads: int, n_kv_heads: int) -> torch.Tensor:
    """The output ``nn.Linear`` weight's columns in the same new head order as
    :func:`tiled_to_grouped`: ``W_o[i ((r g) a)] -> W_o[i ((g r) a)]``."""
    g, r = groups(n_heads, n_kv_heads)
    _check_columns(W_o, n_heads, "((r g) a)")
    return rearrange(W_o, "i (r g a) -> i (g r a)", g=g, r=r)


def grouped_to_tiled_o(W_o: torch.Tensor, *, n_heads: int, n_kv_heads: int) -> torch.Tensor:
    """The inverse of :func:`tiled_to_grouped_o`: ``W_o[i ((g r) a)] -> W_o[i ((r g) a)]``."""
    g, r = groups(n_heads, n_kv_heads)
    _check_columns(W_o, n_heads, "((g r) a)")
    return rearrange(W_o, "i (g r a) -> i (r g a)", g=g, r=r)


def _check_columns(W_o, n_heads: int, what: str) -> None:
    _check_tensor(W_o, "W_o")
    if W_o.ndim != 2 or W_o.shape[1] % n_heads:
        raise EinattnError(f"W_o has shape {tuple(W_o.shape)}; W_o[i {what}] needs a second "
                           f"axis that is a multiple of μ={n_heads}")
