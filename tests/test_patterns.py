"""Attention patterns (einattn.patterns), the terms of equation (3) besides the scores:

    A[n μ τ σ] = softmax_σ( cap(S[n μ τ σ]) + B[μ τ σ] + M[n μ τ σ] )     (+ a sink s_μ)

with τ' = τ + L_k − L_q. Every option on every impl equals a dense reference written here
from the definitions (values; gradients of Q, K, V, the sinks and a float mask); the layer
equals the same reference from its weights (every parameter's gradient, a KV cache, RoPE,
the weights it returns); the chunked path visits the tiles the pattern leaves some key of
and no more; BLOOM, Gemma 2, gpt-oss and FlexAttention's own mods agree; bad options raise.
"""

from __future__ import annotations

import importlib
import math
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import FLEX_CPU, TOL, assert_close_scaled, here, on_cpu_only, randn
from test_bad_inputs import BAD, _raise_lines, reached_lines
from test_chunked import largest_outputs

from einattn import EinattnError, KVCache, MultiHeadAttention, masks, patterns
from einattn import functional as F
from einattn.impls import tiles as tile_kernels

F64, F32 = torch.float64, torch.float32
N, MU, G, A, A_V = 3, 6, 2, 5, 4  # all distinct; μ = (g r) with r = 3 query heads a group
LENGTHS = {"cross": (7, 11), "self": (9, 9), "more-queries": (11, 7)}  # (L_q, L_k)
IMPLS = ["einsum", "sdpa", "chunked"]  # flex is forward only on the CPU: tested apart
INF = float("inf")


# -- the reference: equation (3) written out densely, from the definitions ---------------------


def bloom_slopes(h: int) -> torch.Tensor:
    """ALiBi's slopes as the paper and BLOOM draw them: 2^(−8k/p) for k = 1..p, p the largest
    power of two ≤ h, then the odd k of 2p heads for the rest."""
    p = 2 ** math.floor(math.log2(h))
    first = [2 ** (-8 * k / p) for k in range(1, p + 1)]
    rest = [2 ** (-8 * k / (2 * p)) for k in range(1, 2 * (h - p), 2)]
    return torch.tensor(first + rest, dtype=F64)


def positions(L_q: int, L_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """τ' (query τ's position among the keys) as a column and σ as a row."""
    return torch.arange(L_q)[:, None] + (L_k - L_q), torch.arange(L_k)[None, :]


def allowed_keys(n, L_q, L_k, *, causal=False, window=None, document_ids=None,
                 key_padding_mask=None, mask=None) -> torch.Tensor:
    """may[n μ τ σ] (μ of size 1 unless a bool mask has heads): which keys τ may see."""
    tau, sigma = positions(L_q, L_k)
    may = torch.ones(n, 1, L_q, L_k, dtype=torch.bool)
    if causal:
        may = may & (sigma <= tau)
    if window is not None:
        behind = tau - sigma
        may = may & (behind < window if causal else behind.abs() < window)
    if document_ids is not None:
        queries = document_ids[:, L_k - L_q:]
        may = may & (queries[:, None, :, None] == document_ids[:, None, None, :])
    if key_padding_mask is not None:
        may = may & ~key_padding_mask[:, None, None, :]
    if mask is not None and mask.dtype == torch.bool:
        may = may & mask
    return may


def reference(Q, K, V, *, causal=False, window=None, document_ids=None, key_padding_mask=None,
              mask=None, softcap=None, alibi=None, sinks=None, scale=None):
    """(Z, A, S): K and V repeated per query head, every term of (3) on explicit index grids,
    the softmax over σ with a sink column appended, a row with nothing to see all zeros."""
    n, mu, L_q, a = Q.shape
    L_k, r = K.shape[2], mu // K.shape[1]
    K, V = K.repeat_interleave(r, dim=1), V.repeat_interleave(r, dim=1)
    S = torch.einsum("nhqa,nhka->nhqk", Q, K) * (a ** -0.5 if scale is None else scale)
    logits = S if softcap is None else softcap * torch.tanh(S / softcap)
    if alibi is not None:
        slopes = bloom_slopes(mu) if alibi is True else alibi
        tau, sigma = positions(L_q, L_k)
        logits = logits - slopes[:, None, None] * (tau - sigma).abs()
    if mask is not None and mask.dtype != torch.bool:
        logits = logits + mask
    may = allowed_keys(n, L_q, L_k, causal=causal, window=window, document_ids=document_ids,
                       key_padding_mask=key_padding_mask, mask=mask)
    logits = logits.masked_fill(~may, -INF)
    if sinks is not None:
        logits = torch.cat([logits, sinks[:, None, None].expand(n, mu, L_q, 1)], dim=-1)
    top = logits.amax(-1, keepdim=True).detach()
    e = torch.exp(logits - torch.where(top > -INF, top, 0.0))
    total = e.sum(-1, keepdim=True)
    A = e / torch.where(total > 0, total, 1.0)
    A = A[..., :L_k]  # the sink's weight dropped
    return torch.einsum("nhqk,nhka->nhqa", A, V), A, S


# -- inputs ------------------------------------------------------------------------------------


def qkv(L_q, L_k, *, g=G, n=N, seed=0, dtype=F64, requires_grad=True):
    Q = randn(n, MU, L_q, A, seed=seed, dtype=dtype)
    K = randn(n, g, L_k, A, seed=seed + 1, dtype=dtype)
    V = randn(n, g, L_k, A_V, seed=seed + 2, dtype=dtype)
    return tuple(t.requires_grad_(requires_grad) for t in (Q, K, V))


def documents(L: int, *, kind: str = "sorted", n: int = N, seed: int = 3) -> torch.Tensor:
    """d[n σ]: three documents a sample, packed (sorted) or interleaved (unsorted)."""
    ids = torch.randint(0, 3, (n, L), generator=torch.Generator().manual_seed(seed))
    return ids.sort(dim=1).values if kind == "sorted" else ids


def padding(L_k: int) -> torch.Tensor:
    pad = torch.zeros(N, L_k, dtype=torch.bool)
    pad[1, -3:] = pad[2, 0] = True
    return pad


def user_mask(kind: str, L_q: int, L_k: int) -> torch.Tensor:
    if kind == "bool":
        return randn(N, MU, L_q, L_k, seed=8) > -0.8
    blocked = randn(N, 1, L_q, L_k, seed=9) < -1.2
    return randn(N, 1, L_q, L_k, seed=10).masked_fill(blocked, -INF).requires_grad_()


MAKERS = {  # a case's symbolic values, made for its lengths
    "document_ids": lambda kind, L_q, L_k: documents(L_k, kind=kind),
    "alibi": lambda kind, L_q, L_k: True if kind is True else randn(MU, seed=4).abs(),
    "sinks": lambda kind, L_q, L_k: randn(MU, seed=5, requires_grad=True),
    "key_padding_mask": lambda kind, L_q, L_k: padding(L_k),
    "mask": lambda kind, L_q, L_k: user_mask(kind, L_q, L_k),
}

CASES = {
    "window": dict(window=3),
    "window-causal": dict(causal=True, window=3),
    "window-1-causal": dict(causal=True, window=1),
    "window-wider-than-the-keys": dict(causal=True, window=40),
    "documents": dict(document_ids="sorted"),
    "documents-causal": dict(causal=True, document_ids="sorted"),
    "documents-unsorted-window": dict(window=4, document_ids="unsorted"),
    "documents-window-causal": dict(causal=True, window=3, document_ids="sorted"),
    "softcap": dict(softcap=1.5),
    "softcap-scale-causal": dict(causal=True, softcap=1.5, scale=0.7),
    "alibi": dict(alibi=True),
    "alibi-causal": dict(causal=True, alibi=True),
    "alibi-slopes-window": dict(window=4, alibi="slopes"),
    "sinks": dict(sinks=True),
    "sinks-window-causal": dict(causal=True, window=2, sinks=True),
    "padding-window": dict(window=2, key_padding_mask=True),
    "float-mask-softcap-alibi-sinks": dict(mask="float", softcap=2.5, alibi=True, sinks=True),
    "bool-mask-documents-causal": dict(mask="bool", causal=True, document_ids="unsorted"),
    "everything": dict(causal=True, window=4, document_ids="sorted", softcap=2.0, alibi=True,
                       sinks=True, key_padding_mask=True, mask="float"),
}


def options(case: str, L_q: int, L_k: int) -> dict:
    """The case's options with their tensors made (sinks and a float mask require grad)."""
    return {k: MAKERS[k](v, L_q, L_k) if k in MAKERS else v for k, v in CASES[case].items()}


def leaves(Q, K, V, opts: dict) -> list[torch.Tensor]:
    return [Q, K, V, *(v for v in opts.values()
                       if isinstance(v, torch.Tensor) and v.requires_grad)]


def flex(Q, K, V, **opts) -> torch.Tensor:
    """impl="flex" where the CPU build runs it: forward only, float64's eager reference."""
    with torch.no_grad():
        return F.attention(Q, K, V, impl="flex", **opts)


def compare(impl, Q, K, V, opts, *, block_size=3) -> torch.Tensor:
    """Z by ``impl`` against the reference, then the gradients of every leaf."""
    if impl == "flex":
        Z = flex(Q, K, V, **opts)
        assert_close_scaled(Z, reference(Q, K, V, **opts)[0].detach(), TOL[F64])
        return Z
    Z = F.attention(Q, K, V, impl=impl, block_size=block_size, **opts)
    Z_ref = reference(Q, K, V, **opts)[0]
    assert_close_scaled(Z, Z_ref, TOL[F64])
    dZ = randn(*Z.shape, seed=11)
    wrt = leaves(Q, K, V, opts)
    for got, want in zip(torch.autograd.grad(Z, wrt, dZ, retain_graph=True),
                         torch.autograd.grad(Z_ref, wrt, dZ), strict=True):
        assert_close_scaled(got, want, TOL[F64])
    return Z


# -- every option on every impl -----------------------------------------------------------------

# The queries' ids are the last L_q of the keys': documents need L_q ≤ L_k.
GRID = [(case, lengths) for case in CASES for lengths in LENGTHS
        if not ("document_ids" in CASES[case] and lengths == "more-queries")]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case, lengths", GRID, ids=lambda v: str(v))
def test_each_impl_equals_the_reference(case, lengths, impl):
    L_q, L_k = LENGTHS[lengths]
    compare(impl, *qkv(L_q, L_k), options(case, L_q, L_k))


FLEX_GRID = [(case, "cross") for case in CASES] + [("window-causal", "more-queries"),
                                                    ("sinks-window-causal", "self")]


@pytest.mark.parametrize("case, lengths", FLEX_GRID, ids=lambda v: str(v))
def test_flex_equals_the_reference(case, lengths):
    L_q, L_k = LENGTHS[lengths]
    compare("flex", *qkv(L_q, L_k), options(case, L_q, L_k))


@pytest.mark.parametrize("impl", [*IMPLS, "flex"])
@pytest.mark.parametrize("g", [1, 3, 6], ids=lambda g: f"g={g}")
def test_every_head_grouping(g, impl):
    """Multi-query (g = 1), groups of two (g = 3) and one key head a query head (g = μ)."""
    compare(impl, *qkv(7, 11, g=g), options("everything", 7, 11))


@pytest.mark.parametrize("block_size", [1, 4, 5, 64])
@pytest.mark.parametrize("case", ["window-causal", "documents-unsorted-window", "everything"])
def test_chunked_for_every_block_size(case, block_size):
    compare("chunked", *qkv(7, 11), options(case, 7, 11), block_size=block_size)


def test_patterns_change_the_result():
    """Each option moves Z away from plain causal attention: none is silently dropped."""
    Q, K, V = qkv(7, 11, requires_grad=False)
    plain = F.attention(Q, K, V, causal=True)
    for case in ("window-causal", "documents-causal", "softcap-scale-causal", "alibi-causal",
                 "sinks-window-causal"):
        Z = F.attention(Q, K, V, **options(case, 7, 11))
        assert (Z - plain).abs().max() > 1e-3, case


def test_a_window_wider_than_the_keys_is_no_window():
    Q, K, V = qkv(7, 11, requires_grad=False)
    for causal in (False, True):
        assert_close_scaled(F.attention(Q, K, V, causal=causal, window=11),
                            F.attention(Q, K, V, causal=causal), TOL[F64])


def test_gradcheck_chunked_with_every_term():
    Q, K, V = (randn(1, 2, L, 3, seed=s, requires_grad=True) for s, L in enumerate((4, 5, 5)))
    s = randn(2, seed=3, requires_grad=True)
    ids = torch.tensor([[0, 0, 1, 1, 1]])

    def f(Q, K, V, s):
        return F.attention(Q, K, V, impl="chunked", block_size=2, causal=True, window=2,
                           softcap=1.5, alibi=True, sinks=s, document_ids=ids)

    assert torch.autograd.gradcheck(f, (Q, K, V, s))


# -- fully masked rows: exact zeros, finite gradients, with and without a sink ----------------


def dead_case(name: str) -> tuple[int, int, dict]:
    if name == "more-queries-window-padding":  # τ' < 0 sees nothing; so does τ' = 3 in n = 0
        pad = torch.zeros(N, 6, dtype=torch.bool)
        pad[0, 2:4] = True
        return 9, 6, dict(causal=True, window=2, key_padding_mask=pad)
    ids = documents(11)
    ids[0] = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2])
    pad = torch.zeros(N, 11, dtype=torch.bool)
    pad[0, 3:7] = True  # document 1 of sample 0 is all padding: its queries see nothing
    return 7, 11, dict(document_ids=ids, key_padding_mask=pad, softcap=2.0)


@pytest.mark.parametrize("impl", [*IMPLS, "flex"])
@pytest.mark.parametrize("sinks", [False, True], ids=["no-sink", "sink"])
@pytest.mark.parametrize("name", ["more-queries-window-padding", "padded-document"])
def test_fully_masked_rows_are_zeros(name, sinks, impl):
    L_q, L_k, opts = dead_case(name)
    if sinks:
        opts["sinks"] = randn(MU, seed=5, requires_grad=True)
    Q, K, V = qkv(L_q, L_k)
    Z = compare(impl, Q, K, V, opts)
    pieces = {k: opts[k] for k in ("causal", "window", "document_ids", "key_padding_mask")
              if k in opts}
    dead = ~allowed_keys(N, L_q, L_k, **pieces).any(-1).expand(N, MU, L_q)
    assert dead.any() and (~dead).any()
    assert torch.equal(Z[dead], torch.zeros_like(Z[dead])) and (Z[~dead] != 0).any(-1).all()
    if impl != "flex":
        grads = torch.autograd.grad(Z, leaves(Q, K, V, opts), torch.ones_like(Z))
        assert all(torch.isfinite(g).all() for g in grads)
        assert torch.equal(grads[0][dead], torch.zeros_like(grads[0][dead]))


@pytest.mark.parametrize("impl", [*IMPLS, "flex"])
def test_a_sink_switched_off_on_a_fully_masked_row_is_zeros(impl):
    """s_μ = −∞ turns head μ's sink off: a row with no key then has nothing at all to
    attend to, and gives zeros with finite gradients, as any fully masked row does."""
    Q, K, V = qkv(5, 5, requires_grad=impl != "flex")
    s = torch.tensor([-math.inf, *randn(MU - 1, seed=5).tolist()], dtype=F64)
    pad = torch.zeros(N, 5, dtype=torch.bool)
    pad[0] = True  # sample 0: every key is padding
    with torch.set_grad_enabled(impl != "flex"):
        Z = F.attention(Q, K, V, key_padding_mask=pad, causal=True, sinks=s, impl=impl)
        Z_ref = F.attention(Q, K, V, key_padding_mask=pad[1:2].expand(N, 5), causal=True,
                            sinks=s, impl="einsum")
    assert torch.equal(Z[0], torch.zeros_like(Z[0]))
    assert_close_scaled(Z[1], Z_ref[1], TOL[F64])
    if impl != "flex":
        assert all(torch.isfinite(g).all() for g in torch.autograd.grad(Z.sum(), (Q, K, V)))


def test_flex_without_keys_is_zeros():
    Q, K, V = qkv(4, 0, requires_grad=False)
    with torch.no_grad():
        assert torch.equal(F.attention(Q, K, V, causal=True, impl="flex"),
                           torch.zeros(N, MU, 4, V.shape[3], dtype=F64))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_alibi_in_half_precision_keeps_its_distances(dtype):
    """ALiBi's bias is made in float32, as the half-precision scores are: in bfloat16 the
    distance 1499 would round to 1496 before its slope multiplied it."""
    here = torch.get_default_device()
    pattern = patterns.build(n=1, n_heads=MU, L_q=1, L_k=1500, dtype=dtype, device=here,
                             alibi=True)
    B = pattern.bias(patterns.grid(1, MU, 1, 1500, here))
    assert B.dtype == torch.float32
    exact = -masks.alibi_slopes(MU, dtype=F64)[:, None, None] * torch.arange(1499, -1, -1)
    assert torch.equal(B[0].double(), exact.float().double())


def test_weights_with_a_sink_sum_to_less_than_one():
    """What each row misses is the sink's weight, exp(s_μ) / (exp(s_μ) + Σ_σ exp(S'_σ))."""
    Q, K, V = qkv(7, 11, requires_grad=False)
    s = randn(MU, seed=5)
    _, A_ = F.attention(Q, K, V, causal=True, window=3, sinks=s, need_weights=True)
    _, A_ref, S = reference(Q, K, V, causal=True, window=3, sinks=s)
    assert_close_scaled(A_, A_ref, TOL[F64])
    may = allowed_keys(N, 7, 11, causal=True, window=3)
    lse = torch.logsumexp(S.masked_fill(~may, -INF), dim=-1)  # log Σ_σ exp(S'_σ)
    assert (A_.sum(-1) < 1).all()
    assert_close_scaled(1 - A_.sum(-1), torch.sigmoid(s[:, None] - lse), TOL[F64])


@pytest.mark.cpu_only("a NaN behind a mask is kept from other queries on the CPU "
                      "only (the check would sync a GPU)")
@pytest.mark.parametrize("impl", [*IMPLS, "flex"])
@pytest.mark.parametrize("case", ["window-causal", "documents", "sinks-window-causal"])
def test_nan_behind_the_pattern_reaches_only_the_queries_that_see_it(case, impl):
    """A NaN value of key 5 makes NaN the rows of the heads that may see it (every channel,
    as with a mask), and nothing where the window or the documents hide it."""
    Q, K, V = qkv(7, 11, requires_grad=False)
    V[1, 0, 5, 2] = float("nan")  # key 5 of group 0: query heads 0, 1, 2
    opts = options(case, 7, 11)
    with torch.no_grad():
        Z = F.attention(Q, K, V, impl=impl, block_size=3, **opts)
    pieces = {k: v for k, v in opts.items() if k in ("causal", "window", "document_ids")}
    sees = allowed_keys(N, 7, 11, **pieces)[1, 0, :, 5]
    assert sees.any() and not sees.all()
    assert torch.isnan(Z[1, :3, :, 2]).equal(sees.expand(3, 7))
    assert torch.isnan(Z).sum() == 3 * sees.sum() * A_V  # the rows that see it, nothing else


# -- the layer: the same reference from its weights ------------------------------------------


D_MODEL, L = 14, 9


def random_layer(d_head=A, seed=0, **layer_options) -> MultiHeadAttention:
    """A float64 layer (n_kv_heads=2, biases) with every parameter, sinks too, random."""
    layer = MultiHeadAttention(D_MODEL, MU, d_head=d_head, n_kv_heads=G, bias=True, dtype=F64,
                               **layer_options)
    with torch.no_grad():
        for k, p in enumerate(layer.parameters()):
            p.copy_(randn(*p.shape, seed=100 * seed + k) * 0.3)
    return layer


def rope_half(T: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """RoPE as GPT-NeoX and Llama turn the two halves of a head at positions 0, 1, …"""
    a = T.shape[-1]
    theta = torch.arange(T.shape[2], dtype=F64)[:, None] \
        * base ** (-2 * torch.arange(a // 2, dtype=F64) / a)
    x1, x2, cos, sin = T[..., :a // 2], T[..., a // 2:], theta.cos(), theta.sin()
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def layer_reference(layer, x, *, document_ids=None):
    """(Y, A, S): W[(g C a) i] split by hand (C < r the queries, C = r the keys, r+1 the
    values), equations (1) and (5) as einsums, (2)–(4) by the reference."""
    g, r, a = layer.n_kv_heads, layer.n_heads // layer.n_kv_heads, layer.d_head
    W, b = layer.W.view(g, r + 2, a, D_MODEL), layer.b.view(g, r + 2, a)

    def project(W_, b_):
        return torch.einsum("nti,hai->nhta", x, W_) + b_[None, :, None, :]

    Q = project(W[:, :r].reshape(g * r, a, D_MODEL), b[:, :r].reshape(g * r, a))
    K, V = project(W[:, r], b[:, r]), project(W[:, r + 1], b[:, r + 1])
    if layer.rope == "half":
        Q, K = rope_half(Q), rope_half(K)
    Z, A_, S = reference(Q, K, V, causal=layer.causal, window=layer.window,
                         softcap=layer.softcap, alibi=True if layer.alibi else None,
                         sinks=layer.sinks, scale=layer.scale, document_ids=document_ids)
    return torch.einsum("nhta,hai->nti", Z, layer.W_O) + layer.b_O, A_, S


LAYER_CASES = {
    "window-causal": dict(causal=True, window=3),
    "window-sinks": dict(window=2, sinks=True),
    "softcap-alibi-sinks-causal": dict(causal=True, softcap=1.5, alibi=True, sinks=True),
    "everything-scaled": dict(causal=True, window=4, softcap=2.0, alibi=True, sinks=True,
                              scale=0.4),
}


def compare_layer(layer, x, *, impl, document_ids=None):
    Y = layer(x, impl=impl, document_ids=document_ids)
    Y_ref = layer_reference(layer, x, document_ids=document_ids)[0]
    assert_close_scaled(Y, Y_ref, TOL[F64])
    wrt = [x, *layer.parameters()]
    dY = randn(*Y.shape, seed=12)
    for got, want in zip(torch.autograd.grad(Y, wrt, dY),
                         torch.autograd.grad(Y_ref, wrt, dY), strict=True):
        assert_close_scaled(got, want, TOL[F64])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_layer_equals_the_reference_from_its_weights(case, impl):
    layer = random_layer(block_size=4, **LAYER_CASES[case])
    assert (layer.sinks is not None) == ("sinks" in LAYER_CASES[case])
    compare_layer(layer, randn(N, L, D_MODEL, seed=1, requires_grad=True), impl=impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_layer_with_document_ids(impl):
    layer = random_layer(block_size=4, causal=True, window=4, sinks=True, alibi=True)
    x = randn(N, L, D_MODEL, seed=1, requires_grad=True)
    compare_layer(layer, x, impl=impl, document_ids=documents(L))


@pytest.mark.parametrize("impl", IMPLS)
def test_layer_with_rope_and_a_window(impl):
    layer = random_layer(d_head=4, causal=True, window=3, rope="half", block_size=4)
    compare_layer(layer, randn(N, L, D_MODEL, seed=1, requires_grad=True), impl=impl)


def test_layer_on_flex_without_grad():
    layer = random_layer(**LAYER_CASES["everything-scaled"])
    x, ids = randn(N, L, D_MODEL, seed=1), documents(L)
    with torch.no_grad():
        Y = layer(x, impl="flex", document_ids=ids)
    assert_close_scaled(Y, layer_reference(layer, x, document_ids=ids)[0].detach(), TOL[F64])


def test_the_sinks_parameter_starts_at_zero_and_learns():
    torch.manual_seed(0)
    layer = MultiHeadAttention(D_MODEL, MU, d_head=A, sinks=True, causal=True, dtype=F64)
    assert isinstance(layer.sinks, torch.nn.Parameter) and layer.sinks.shape == (MU,)
    assert torch.equal(layer.sinks, torch.zeros(MU, dtype=F64))
    assert "sinks" in dict(layer.named_parameters())
    assert MultiHeadAttention(D_MODEL, MU, d_head=A).sinks is None
    layer(randn(N, L, D_MODEL, seed=1)).sum().backward()
    assert layer.sinks.grad is not None and (layer.sinks.grad != 0).all()


@pytest.mark.parametrize("impl", ["einsum", "chunked"])
def test_layer_weights_and_intermediates_with_patterns(impl):
    layer = random_layer(impl=impl, **LAYER_CASES["everything-scaled"])
    x = randn(N, L, D_MODEL, seed=1)
    Y_ref, A_ref, S_ref = layer_reference(layer, x)
    Y, A_ = layer(x, need_weights=True)
    assert_close_scaled(Y, Y_ref, TOL[F64])
    assert_close_scaled(A_, A_ref, TOL[F64])
    assert (A_.sum(-1) < 1).all()  # the sink takes the rest
    Y, stages = layer(x, return_intermediates=True)
    assert_close_scaled(stages["A"], A_ref, TOL[F64])
    assert_close_scaled(stages["S"], S_ref, TOL[F64])  # S is s·Q K, before the cap
    assert_close_scaled(stages["Y"], Y_ref, TOL[F64])


# -- a KV cache: prefill, then steps of one and of several tokens -----------------------------

CACHE_CASES = {
    "window": (dict(window=3), False),
    "documents": (dict(), True),
    "everything": (dict(window=3, softcap=2.0, alibi=True, sinks=True), True),
    "rope-window": (dict(window=3, rope="half"), False),
}
STEPS = [(0, 4), (4, 5), (5, 7), (7, 8), (8, 9), (9, 10)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", list(CACHE_CASES))
def test_cache_decodes_as_one_causal_forward(case, impl):
    layer_options, with_ids = CACHE_CASES[case]
    d_head = 4 if "rope" in layer_options else A
    layer = random_layer(d_head=d_head, causal=True, impl=impl, block_size=3, **layer_options)
    x = randn(N, 10, D_MODEL, seed=1)
    ids = documents(10) if with_ids else None
    Y_ref = layer_reference(layer, x, document_ids=ids)[0]
    cache = KVCache()
    Y = torch.cat([layer(x[:, t0:t1], cache=cache,
                         document_ids=None if ids is None else ids[:, t0:t1])
                   for t0, t1 in STEPS], dim=1)
    assert_close_scaled(Y, Y_ref.detach(), TOL[F64])
    if with_ids:
        assert torch.equal(cache.document_ids, ids)


# -- the chunked path's tiles --------------------------------------------------------------------


TILE_CASES = {
    "causal": dict(causal=True),
    "window-causal": dict(causal=True, window=5),
    "window": dict(window=4),
    "documents-sorted": dict(document_ids="sorted"),
    "documents-unsorted": dict(document_ids="unsorted"),
    "documents-window-causal": dict(causal=True, window=6, document_ids="sorted"),
}
TILE_LENGTHS = [(13, 13), (10, 17), (17, 10)]


def tile_grid():
    for case, opts in TILE_CASES.items():
        for L_q, L_k in TILE_LENGTHS:
            if not ("document_ids" in opts and L_q > L_k):
                yield case, L_q, L_k


@pytest.mark.parametrize("size", [3, 4])
@pytest.mark.parametrize("case, L_q, L_k", list(tile_grid()), ids=str)
def test_tiles_against_a_dense_evaluation(case, L_q, L_k, size):
    """Each tile the pattern names is one the dense mask has some key in; each it leaves out
    has none (packed ids: exactly; interleaved ids may cost a visit to an empty tile); a tile
    is partial exactly where some key of it is masked; rows before its first are empty."""
    opts = dict(TILE_CASES[case])
    if "document_ids" in opts:
        opts["document_ids"] = documents(L_k, kind=opts["document_ids"], seed=L_q)
    may = allowed_keys(N, L_q, L_k, **opts)[:, 0]  # may[n τ σ]
    tiles = patterns.build(n=N, n_heads=MU, L_q=L_q, L_k=L_k, dtype=F64,
                           device=torch.get_default_device(), **opts).tiles(size)
    named = {(t0 // size, s0 // size) for t0, _, s0, _, _ in tiles}
    assert len(named) == len(tiles)  # no tile twice
    for t0, t1, s0, s1, partial in tiles:
        block_start = t0 - t0 % size
        assert t1 == min(block_start + size, L_q) and s1 == min(s0 + size, L_k)
        assert not may[:, block_start:t0, s0:s1].any()
        assert partial == (not may[:, block_start:t1, s0:s1].all())
    for bt in range(-(-L_q // size)):
        for bs in range(-(-L_k // size)):
            some = bool(may[:, bt * size:(bt + 1) * size, bs * size:(bs + 1) * size].any())
            if case == "documents-unsorted":
                assert (bt, bs) in named or not some
            else:
                assert ((bt, bs) in named) == some, (bt, bs)


@pytest.mark.parametrize("L_q, L_k", [(13, 13), (10, 17)])
def test_packed_documents_cut_the_tiles(L_q, L_k):
    """The chunked path's tiles of packed documents, cut where the documents change (of any
    sample): none holds two documents, a tile called full is, and they cover every key each
    query sees, once."""
    ids = documents(L_k)
    pattern = patterns.build(n=N, n_heads=MU, L_q=L_q, L_k=L_k, dtype=F64,
                             device=torch.get_default_device(), causal=True, document_ids=ids)
    may = allowed_keys(N, L_q, L_k, causal=True, document_ids=ids)[:, 0]
    covered = torch.zeros(L_q, L_k, dtype=torch.long)
    for t0, t1, s0, s1, partial in pattern.tiles(4, cut=True):
        queries, keys = ids[:, L_k - L_q + t0:L_k - L_q + t1], ids[:, s0:s1]
        assert (queries == queries[:, :1]).all() and (keys == keys[:, :1]).all()
        assert partial or may[:, t0:t1, s0:s1].all()
        covered[t0:t1, s0:s1] += 1
    assert (covered > 0)[may.any(0)].all() and covered.max() == 1


def scores_computed(monkeypatch, L_q, L_k, size, **opts) -> int:
    """How many scores (τ, σ) of one head chunked attention computes in its forward (its
    backward recomputes the same tiles), over every tile it visits."""
    tiles = []
    real = tile_kernels._scores

    def counted(op, *tile):
        tiles.append(tile)
        return real(op, *tile)

    monkeypatch.setattr(tile_kernels, "_scores", counted)
    Q, K, V = qkv(L_q, L_k)
    F.attention(Q, K, V, impl="chunked", block_size=size, **opts).sum().backward()
    monkeypatch.setattr(tile_kernels, "_scores", real)
    area = [(t1 - t0) * (s1 - s0) for t0, t1, s0, s1 in tiles]
    assert sum(area[:len(area) // 2]) == sum(area[len(area) // 2:])  # forward = backward
    return sum(area) // 2


def test_a_causal_window_visits_O_L_w_tiles(monkeypatch):
    """With a window of w keys a block of b queries reads at most 2b + w − 2 keys (its band,
    rounded out to whole key blocks), so the work grows as L·w; causal alone grows as L²/2."""
    size, w = 4, 6
    for L in (41, 83):
        windowed = scores_computed(monkeypatch, L, L, size, causal=True, window=w)
        causal = scores_computed(monkeypatch, L, L, size, causal=True)
        assert L * w - w * w // 2 <= windowed <= L * (2 * size + w - 2)  # at least the band
        assert causal >= L * L // 2
    assert 3 * windowed < causal  # at L = 83


def test_a_causal_window_makes_nothing_of_L_q_by_L_k():
    """Forward and backward with every term make nothing of L_q × L_k per head, nothing
    larger than an O(L·a) tensor such as dQ; the einsum path, by contrast, does."""
    L_q, L_k, size = 41, 53, 4

    def run(impl):
        Q, K, V = qkv(L_q, L_k)
        opts = dict(causal=True, window=5, softcap=2.0, alibi=True, document_ids=documents(L_k),
                    sinks=randn(MU, seed=5, requires_grad=True))
        return largest_outputs(lambda: F.attention(Q, K, V, impl=impl, block_size=size,
                                                   **opts).sum().backward())

    made = run("chunked")
    assert not any(shape[-2:] == (L_q, L_k) for shape in made)
    assert max(torch.Size(s).numel() for s in made) <= N * MU * L_k * A
    assert any(shape[-2:] == (L_q, L_k) for shape in run("einsum"))


# -- parity with real peers ---------------------------------------------------------------------


@pytest.mark.parametrize("h", [1, 3, 5, 6, 8, 12, 20])
def test_alibi_slopes_equal_bloom(h):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    assert_close_scaled(masks.alibi_slopes(h, dtype=F64), bloom_slopes(h), TOL[F64])
    bias = build_alibi_tensor(torch.ones(1, 9), h, F32)  # (h, 1, σ): m_μ · σ, in float32
    ours = masks.alibi_slopes(h)[:, None, None] * torch.arange(9, dtype=F32)
    assert_close_scaled(bias, ours, TOL[F32])


@pytest.mark.parametrize("impl", IMPLS)
def test_bloom_attention_equals_causal_alibi(impl):
    """BLOOM adds +m_μ·σ, which differs from −m_μ·|τ − σ| by m_μ·τ, the same for every key of
    a row under causal: the softmax cannot tell them apart. BLOOM's softmax is float32."""
    from transformers import BloomConfig
    from transformers.models.bloom.modeling_bloom import BloomAttention, build_alibi_tensor

    config = BloomConfig(hidden_size=30, n_head=6, attention_dropout=0.0, hidden_dropout=0.0)
    bloom = BloomAttention(config, layer_idx=0).to(F64).eval()
    ours = MultiHeadAttention(30, 6, bias=True, causal=True, alibi=True, impl=impl, dtype=F64)
    with torch.no_grad():
        for k, p in enumerate(bloom.parameters()):
            p.copy_(randn(*p.shape, seed=20 + k) * 0.3)
        ours.W.copy_(bloom.query_key_value.weight)  # BLOOM fuses (μ B a) i, as einattn does
        ours.b.copy_(bloom.query_key_value.bias)
        ours.W_O.copy_(bloom.dense.weight.view(30, 6, 5).permute(1, 2, 0))
        ours.b_O.copy_(bloom.dense.bias)
    x = randn(2, L, 30, seed=1)
    future = torch.ones(L, L, dtype=torch.bool).triu(1)
    M = torch.zeros(2, 1, L, L, dtype=F64).masked_fill(future, -INF)
    alibi = build_alibi_tensor(torch.ones(2, L), 6, F64)
    with torch.no_grad():
        Y_bloom, _ = bloom(x, torch.zeros_like(x), alibi, M)
        assert_close_scaled(ours(x), Y_bloom, TOL[F32])


@pytest.mark.parametrize("impl", [*IMPLS, "flex"])
def test_gemma2_capped_sliding_attention(impl):
    """Gemma 2's eager attention (softcap after the scale, then its sliding-window causal
    mask from transformers' own mask functions) equals softcap + window + causal. Its
    softmax is float32."""
    from transformers import masking_utils
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    Q, K, V = qkv(L, L, requires_grad=False)
    M = masking_utils.eager_mask(batch_size=N, q_length=L, kv_length=L, dtype=F64,
                                 mask_function=masking_utils.sliding_window_causal_mask_function(4)
                                 ).to(Q.device)  # made on the CPU
    module = SimpleNamespace(num_key_value_groups=MU // G, training=False, head_dim=A)
    Z_gemma, _ = eager_attention_forward(module, Q, K, V, M, scaling=0.3, softcap=2.0)
    opts = dict(causal=True, window=4, softcap=2.0, scale=0.3)
    Z = flex(Q, K, V, **opts) if impl == "flex" else F.attention(Q, K, V, impl=impl, **opts)
    assert_close_scaled(Z, Z_gemma.transpose(1, 2), TOL[F32])


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("impl", IMPLS)
def test_gpt_oss_sinks(impl, window):
    """gpt-oss's eager attention with its sinks (and sliding window), in float64: values and
    the gradients of Q, K, V and the sinks."""
    from transformers import masking_utils
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    Q, K, V = qkv(L, L)
    s = randn(MU, seed=5, requires_grad=True)
    mask_function = masking_utils.causal_mask_function if window is None \
        else masking_utils.sliding_window_causal_mask_function(window)
    M = masking_utils.eager_mask(batch_size=N, q_length=L, kv_length=L, dtype=F64,
                                 mask_function=mask_function).to(Q.device)  # made on the CPU
    module = SimpleNamespace(sinks=s, num_key_value_groups=MU // G, training=False)
    Z_oss = eager_attention_forward(module, Q, K, V, M, scaling=A ** -0.5)[0].transpose(1, 2)
    Z = F.attention(Q, K, V, impl=impl, block_size=4, causal=True, window=window, sinks=s)
    assert_close_scaled(Z, Z_oss, TOL[F64])
    dZ = randn(*Z.shape, seed=11)
    for got, want in zip(torch.autograd.grad(Z, (Q, K, V, s), dZ),
                         torch.autograd.grad(Z_oss, (Q, K, V, s), dZ), strict=True):
        assert_close_scaled(got, want, TOL[F64])


def hand_written_mods(name: str, L_q: int, L_k: int, ids: torch.Tensor):
    """FlexAttention's mask_mod or score_mod written here, and einattn's options for it."""
    shift, m = L_k - L_q, bloom_slopes(MU)
    mods = {
        "window": (lambda b, h, q, kv: (kv <= q + shift) & (q + shift - kv < 3), None,
                   dict(causal=True, window=3)),
        "documents": (lambda b, h, q, kv: ids[b, q + shift] == ids[b, kv], None,
                      dict(document_ids=ids)),
        "softcap": (None, lambda S, b, h, q, kv: 1.5 * torch.tanh(S / 1.5), dict(softcap=1.5)),
        "alibi": (None, lambda S, b, h, q, kv: S - m[h] * (q + shift - kv).abs(),
                  dict(alibi=True)),
    }
    return mods[name]


@pytest.mark.parametrize("name", ["window", "documents", "softcap", "alibi"])
def test_flex_attention_with_hand_written_mods(name):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    L_q, L_k = 7, 11
    Q, K, V = qkv(L_q, L_k, requires_grad=False)
    ids = documents(L_k)
    mask_mod, score_mod, opts = hand_written_mods(name, L_q, L_k, ids)
    block_mask = None if mask_mod is None else \
        create_block_mask(mask_mod, N, None, L_q, L_k, device=Q.device)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
        Z_flex = flex_attention(Q, K, V, score_mod=score_mod, block_mask=block_mask,
                                enable_gqa=True)
    assert_close_scaled(reference(Q, K, V, **opts)[0], Z_flex, TOL[F64])  # the reference too
    for impl in IMPLS:
        assert_close_scaled(F.attention(Q, K, V, impl=impl, block_size=3, **opts), Z_flex,
                            TOL[F64])
    assert_close_scaled(flex(Q, K, V, **opts), Z_flex, TOL[F64])


def test_flex_compiled_in_float32():
    """Float32 runs FlexAttention compiled (seconds a shape and pattern): one case with
    every term, its mask_mod and score_mod both compiled."""
    case = "everything"
    L_q, L_k = 23, 37
    Q, K, V = qkv(L_q, L_k, requires_grad=False)
    opts = {k: v.detach() if isinstance(v, torch.Tensor) else v
            for k, v in options(case, L_q, L_k).items()}
    low = {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
           for k, v in opts.items()}
    Z = flex(Q.float(), K.float(), V.float(), **low)
    assert Z.dtype == F32
    assert_close_scaled(Z.double(), reference(Q, K, V, **opts)[0], TOL[F32])


# -- documents need their queries; a slopes tensor's gradient -------------------------------------


@pytest.mark.parametrize("impl", [*IMPLS, "flex"])
def test_document_ids_need_the_queries_among_the_keys(impl):
    """With L_q > L_k the first queries have no id (τ' < 0): refused, where an index −1
    would have read the last key's id."""
    Q, K, V = qkv(11, 7, requires_grad=False)
    with pytest.raises(EinattnError, match=r"document_ids needs the queries among the keys "
                                           r"\(L_q ≤ L_k, the queries being the last L_q\): "
                                           r"got L_q=11 queries and L_k=7 keys"):
        F.attention(Q, K, V, impl=impl, document_ids=documents(7))


@pytest.mark.parametrize("impl", ["chunked", "flex"])
def test_learned_alibi_slopes_get_their_gradient_or_an_error(impl):
    """einsum and sdpa differentiate a slopes tensor that requires grad (and agree); chunked
    and flex take the slopes as constants, so they refuse it rather than drop its gradient."""
    Q, K, V = qkv(7, 11)
    m = randn(MU, seed=4).abs().requires_grad_()
    grads = [torch.autograd.grad(F.attention(Q, K, V, impl=name, alibi=m).sum(), m)[0]
             for name in ("einsum", "sdpa")]
    assert_close_scaled(grads[1], grads[0], TOL[F64])
    with pytest.raises(EinattnError, match=rf"impl='{impl}' takes ALiBi's slopes as "
                                           rf"constants, but this alibi tensor requires grad"):
        F.attention(Q, K, V, impl=impl, alibi=m)
    with torch.no_grad():  # without a gradient the slopes are constants everywhere
        assert_close_scaled(F.attention(Q, K, V, impl="chunked", alibi=m),
                            F.attention(Q, K, V, impl="einsum", alibi=m), TOL[F64])


# -- errors ----------------------------------------------------------------------------------------


def _call(**opts):
    """functional.attention on (7, 11), GQA, with these options."""
    Q, K, V = qkv(7, 11, requires_grad=False)
    return lambda: F.attention(Q, K, V, **opts)


ERRORS = {
    **{f"window-{v}": (_call(window=v), rf"window \(the number of keys σ a query τ sees, itself "
                                        rf"included\) must be an int ≥ 1, got {v}")
       for v in (0, 2.5, -1, True)},
    **{f"softcap-{v}": (_call(softcap=v), rf"softcap \(c in cap\(S\) = c · tanh\(S / c\)\) must "
                                          rf"be a finite number > 0, got {v}")
       for v in (0, -1.0, INF, True)},
    "document_ids-shape": (_call(document_ids=torch.zeros(N, 7, dtype=torch.long)),
                           r"document_ids has shape \(3, 7\) but must be \(n, σ\) = \(3, 11\): "
                           r"one document id d\[n σ\] per key \(the queries' are the last "
                           r"L_q=7\)"),
    "document_ids-more-queries": (lambda: F.attention(*qkv(11, 7, requires_grad=False),
                                                      document_ids=documents(7)),
                                  r"document_ids needs the queries among the keys"),
    "document_ids-list": (_call(document_ids=[[0] * 11] * N),
                          r"document_ids has shape list but must be \(n, σ\) = \(3, 11\)"),
    "document_ids-float": (_call(document_ids=torch.zeros(N, 11)),
                           r"document_ids must hold integers .*got torch.float32"),
    "document_ids-bool": (_call(document_ids=torch.zeros(N, 11, dtype=torch.bool)),
                          r"document_ids must hold integers .*got torch.bool"),
    "document_ids-meta": (_call(document_ids=torch.zeros(N, 11, dtype=torch.long,
                                                         device="meta")),
                          rf"document_ids is on meta but the scores are on {here()}"),
    "alibi-shape": (_call(alibi=torch.ones(G, dtype=F64)),
                    r"alibi must be True \(BLOOM's slopes\) or a float tensor of slopes m\[μ\] "
                    r"of shape \(n_heads,\) = \(6,\), got torch.float64 \(2,\)"),
    "alibi-int": (_call(alibi=torch.ones(MU, dtype=torch.long)),
                  r"alibi must be True .* = \(6,\), got torch.int64 \(6,\)"),
    "alibi-number": (_call(alibi=0.5), r"alibi must be True .*, got 0.5"),
    "alibi-meta": (_call(alibi=torch.ones(MU, device="meta")),
                   rf"alibi is on meta but the scores are on {here()}"),
    "sinks-shape": (_call(sinks=torch.zeros(1, MU, dtype=F64)),
                    r"sinks must be a float tensor of sink logits s\[μ\] of shape \(n_heads,\) "
                    r"= \(6,\), got torch.float64 \(1, 6\)"),
    "sinks-int": (_call(sinks=torch.zeros(MU, dtype=torch.long)),
                  r"sinks must be a float tensor .* = \(6,\), got torch.int64 \(6,\)"),
    "sinks-bool": (_call(sinks=True), r"sinks must be a float tensor .*, got True"),
    "sinks-meta": (_call(sinks=torch.zeros(MU, device="meta")),
                   rf"sinks is on meta but the scores are on {here()}"),
    "flex-requires-grad": (lambda: F.attention(*qkv(7, 11), impl="flex", window=3),
                           r"impl='flex' has no backward on the CPU .*impl='chunked'"),
    "flex-sinks-require-grad": (lambda: F.attention(
        *qkv(7, 11, requires_grad=False), impl="flex", sinks=randn(MU, seed=5,
                                                                   requires_grad=True)),
        r"impl='flex' has no backward on the CPU"),
    "alibi-slopes-heads": (lambda: masks.alibi_slopes(0), r"n_heads must be a positive int, "
                                                          r"got 0"),
    "pattern-not-a-piece": (_call(pattern=[patterns.Causal(), "window"]),
                            r"pattern takes pieces of einattn.patterns \(Causal\(\), Window\(w\), "
                            r".*or a sequence of them, got str"),
    "and-not-a-mask": (lambda: patterns.Causal() & patterns.Softcap(2.0),
                       r"& composes pieces of the mask M \(Causal\(\), Window\(w\), .*got Softcap"),
    "two-sinks": (_call(sinks=torch.zeros(MU, dtype=F64),
                        pattern=patterns.Sinks(torch.ones(MU, dtype=F64))),
                  r"a pattern has one sink logit s\[μ\] per head: got two"),
    **{f"prefix-{name}": (_call(pattern=patterns.PrefixLM(p)),
                          rf"PrefixLM's prefix \(the keys σ < p every query sees\) must be an "
                          rf"int ≥ 0 or integers p\[n\] of shape \(n,\) = \(3,\), got {got}")
       for name, p, got in (("negative", -1, "-1"), ("bool", True, "True"),
                            ("float", torch.ones(N), r"torch.float32 \(3,\)"),
                            ("shape", torch.ones(N + 1, dtype=torch.long),
                             r"torch.int64 \(4,\)"))},
    "prefix-meta": (_call(pattern=patterns.PrefixLM(torch.ones(N, dtype=torch.long,
                                                               device="meta"))),
                    rf"PrefixLM's prefix is on meta but the scores are on {here()}"),
    **{f"chunk-{c}": (lambda c=c: patterns.ChunkedLocal(c),
                      rf"ChunkedLocal's c \(positions per chunk\) must be an int ≥ 1, got {c}")
       for c in (0, 2.5, True)},
    "flex-dropout": (_call(impl="flex", causal=True, dropout=0.1),
                     r"impl='flex' has no dropout \(got dropout=0.1\); use impl='chunked' "
                     r"\(the same tiles, with dropout\), 'einsum' or 'sdpa'"),
}


@pytest.mark.parametrize("name", on_cpu_only(ERRORS, {"flex-requires-grad": FLEX_CPU,
                                                     "flex-sinks-require-grad": FLEX_CPU}))
def test_bad_options_raise(name):
    call, match = ERRORS[name]
    with pytest.raises(EinattnError, match=match):
        call()


def test_flex_failures_are_put_in_einattns_words(monkeypatch):
    from einattn.impls import flex as flex_module

    def broken(flex, Q):
        def run(*args, **kwargs):
            raise RuntimeError("no kernel for this\nsecond line")
        return run

    monkeypatch.setattr(flex_module, "_compiled", broken)
    with pytest.raises(EinattnError, match=r"impl='flex': FlexAttention could not run here "
                                           r"\(RuntimeError: no kernel for this\); "
                                           r"impl='chunked' runs the same pattern"):
        _call(impl="flex", window=3)()


def test_flex_without_flex_attention_or_dynamo(monkeypatch):
    monkeypatch.setattr(torch._dynamo, "is_dynamo_supported", lambda: False)
    with pytest.raises(EinattnError, match=r"torch.compile is not supported on this Python; "
                                           r"use impl='chunked'"):
        _call(impl="flex")()
    monkeypatch.delattr(torch.nn.attention, "flex_attention")
    monkeypatch.setitem(sys.modules, "torch.nn.attention.flex_attention", None)
    with pytest.raises(EinattnError, match=r"impl='flex' needs torch.nn.attention.flex_attention"
                                           r", which torch .* lacks; impl='chunked'"):
        _call(impl="flex")()


@pytest.mark.parametrize("module", ["patterns", "_piece", "_binding"])
def test_every_raise_site_in_patterns_py_is_reached(module):
    """Every ``raise`` in einattn/patterns.py (and the pieces' protocol and binding) is
    reached by a row here or in tests/test_bad_inputs.py (STYLE §4)."""
    source = Path(importlib.import_module(f"einattn.{module}").__file__).resolve()
    reached = reached_lines([*ERRORS.values(), *BAD.values()], source)
    missing = sorted(_raise_lines(source) - reached)
    assert not missing, f"raise sites in {module}.py with no test: lines {missing}"



# -- named pieces without a keyword: pattern=PrefixLM(p), ... ------------------------------------

PREFIXES = torch.tensor([0, 5, 6])  # p[n]: none, and two prefixes cut by tiles of 3 and 4
PIECE_CASES = {  # name -> (the piece, its mask from the definition on τ' and σ, (n, τ, σ))
    "prefix": (lambda: patterns.PrefixLM(4), lambda n, t, s: (s < 4) | (s <= t)),
    "prefix per sample": (lambda: patterns.PrefixLM(PREFIXES),
                          lambda n, t, s: (s < PREFIXES[n]) | (s <= t)),
    "prefix past the keys": (lambda: patterns.PrefixLM(12), lambda n, t, s: s < 12),
    "chunked local": (lambda: patterns.ChunkedLocal(4),
                      lambda n, t, s: (t // 4 == s // 4) & (s <= t)),
    "chunked local of 5": (lambda: patterns.ChunkedLocal(5),
                           lambda n, t, s: (t // 5 == s // 5) & (s <= t)),
}
PREFILLED = [(0, 6), (6, 7), (7, 9), (9, 10)]  # a prefix must be whole before decoding


def piece_mask(case: str, L_q: int, L_k: int) -> torch.Tensor:
    """The case's dense mask ``(n, 1, τ, σ)``, True = may attend."""
    tau, sigma = positions(L_q, L_k)
    may = PIECE_CASES[case][1](torch.arange(N).view(-1, 1, 1), tau, sigma)
    return torch.broadcast_to(may, (N, L_q, L_k))[:, None]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("lengths", list(LENGTHS))
@pytest.mark.parametrize("case", list(PIECE_CASES))
def test_named_pieces_equal_their_definitions(case, lengths, impl):
    """Forward and the gradients of Q, K, V, at tiles of 3 (cutting the prefix mid-tile)."""
    L_q, L_k = LENGTHS[lengths]
    Q, K, V = qkv(L_q, L_k)
    Z = F.attention(Q, K, V, pattern=PIECE_CASES[case][0](), impl=impl, block_size=3)
    Z_ref = reference(Q, K, V, mask=piece_mask(case, L_q, L_k))[0]
    assert_close_scaled(Z, Z_ref, TOL[F64])
    dZ = randn(*Z.shape, seed=11)
    for got, want in zip(torch.autograd.grad(Z, (Q, K, V), dZ),
                         torch.autograd.grad(Z_ref, (Q, K, V), dZ), strict=True):
        assert_close_scaled(got, want, TOL[F64])


@pytest.mark.parametrize("case", list(PIECE_CASES))
def test_named_pieces_on_flex(case):
    Q, K, V = qkv(9, 9, requires_grad=False)
    Z = flex(Q, K, V, pattern=PIECE_CASES[case][0]())
    assert_close_scaled(Z, reference(Q, K, V, mask=piece_mask(case, 9, 9))[0], TOL[F64])


@pytest.mark.parametrize("size", [3, 4])
@pytest.mark.parametrize("lengths", list(LENGTHS))
@pytest.mark.parametrize("case", list(PIECE_CASES))
def test_named_pieces_judge_their_tiles_exactly(case, lengths, size):
    """The tiles named are those with some key seen, partial where some is not."""
    L_q, L_k = LENGTHS[lengths]
    may = piece_mask(case, L_q, L_k)[:, 0]
    tiles = patterns.build(n=N, n_heads=MU, L_q=L_q, L_k=L_k, dtype=F64,
                           device=torch.get_default_device(),
                           pattern=PIECE_CASES[case][0]()).tiles(size)
    named = {(t0 // size, s0 // size): partial for t0, _, s0, _, partial in tiles}
    for bt in range(-(-L_q // size)):
        for bs in range(-(-L_k // size)):
            block = may[:, bt * size:(bt + 1) * size, bs * size:(bs + 1) * size]
            assert ((bt, bs) in named) == bool(block.any()), (bt, bs)
            assert named.get((bt, bs), False) == (bool(block.any()) and not block.all())


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", [c for c in PIECE_CASES if c != "prefix past the keys"])
def test_named_pieces_decode_as_one_forward(case, impl):
    """A layer with the piece: prefill, then steps of one and of several tokens."""
    layer = random_layer(impl=impl, block_size=3, pattern=PIECE_CASES[case][0]())
    x = randn(N, 10, D_MODEL, seed=1)
    cache = KVCache()
    with torch.no_grad():
        Y = torch.cat([layer(x[:, t0:t1], cache=cache) for t0, t1 in PREFILLED], dim=1)
        assert_close_scaled(Y, layer(x), TOL[F64])


# -- the pieces written as equations: the softcap's CAP, the sink's SINK ----------------------


def test_softcap_runs_its_equation_and_flex_scalars_do_its_arithmetic():
    """The dense form and a tile's run ``Softcap.CAP``; FlexAttention's scalar form does the
    same two operations, bit for bit; its LaTeX is CAP's."""
    cap = patterns.Softcap(2.5)
    S = randn(N, MU, 7, 11, seed=3) * 4
    at = patterns.grid(N, MU, 7, 11, S.device)
    dense = cap.score(S, *at)
    assert torch.equal(dense, patterns.Softcap.CAP(S=S, c=2.5))
    assert torch.equal(dense, 2.5 * torch.tanh(S / 2.5))
    scalars = torch.stack([cap.score(s, *at) for s in S.flatten()[:20]])
    assert torch.equal(scalars, dense.flatten()[:20])
    assert patterns.Softcap.LATEX == patterns.Softcap.CAP.latex()
    assert r"\tanh\left(\frac{S_{n \mu \tau \sigma}}{c}\right)" in patterns.Softcap.LATEX


@pytest.mark.parametrize("masked", [False, True], ids=["open", "a fully masked row"])
def test_the_sink_equation_is_the_sink_softmax(masked):
    """``SINK``, the definition, equals the stable form every impl's einsum path runs."""
    from einattn import _softmax
    S, s = randn(N, MU, 7, 11, seed=4), randn(MU, seed=5)
    M = torch.zeros(7, 11, dtype=F64)
    if masked:
        M[2] = -INF
    A = _softmax.with_sink(S, M, s)
    torch.testing.assert_close(patterns.SINK(S=S + M, s=s), A, rtol=1e-12, atol=1e-12)
    assert patterns.SINK_LATEX == patterns.SINK.latex()
    if masked:
        assert torch.equal(A[:, :, 2], torch.zeros(N, MU, 11, dtype=F64))
