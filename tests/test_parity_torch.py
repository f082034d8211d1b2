"""``einattn.MultiHeadAttention`` against PyTorch's own attention and the reshape-based form.

Three independent references:

* ``torch.nn.MultiheadAttention``: forward, attention weights and the gradients of the
  inputs and of every parameter, einattn's grads mapped to torch's layout
  (``W[(μ B a) i] -> in_proj_weight[(B μ a) i]``, ``W_O[μ a i] -> out_proj.weight[i (μ a)]``);
  a named table of cases, then a seeded random table of 240 cases;
* ``F.scaled_dot_product_attention`` on the layer's own ``Q, K, V`` for ``Z[n μ τ a]``;
* ``einattn.reference.multi_head_attention`` (view/transpose/matmul) via ``layer.projections()``.

Polarity differs and is converted here, in one place: einattn's boolean ``mask`` is True where
attention is *allowed*, torch's ``attn_mask`` True where it is *not*; the key padding mask is
True = padding in both. einattn's causal mask is aligned bottom-right, so for ``L_q != L_k``
torch gets an explicit bottom-right mask built here (not by einattn).

Tolerances, relative to ``max(1, max |expected|)``: float64 1e-12, float32 1e-5.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F
from conftest import randn
from torch import nn

from einattn import MultiHeadAttention, layouts, reference

TOL = {torch.float64: 1e-12, torch.float32: 1e-5}
F64, F32 = torch.float64, torch.float32


# -- helpers ------------------------------------------------------------------------------




def _assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str = "") -> None:
    """``max |actual − expected| ≤ tol · max(1, max |expected|)``, same shape and dtype."""
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (what, actual.dtype, expected.dtype)
    assert torch.isfinite(expected).all(), f"{what}: the reference is not finite"
    if expected.numel() == 0:
        return
    scale = max(1.0, expected.abs().max().item())
    err = (actual - expected).abs().max().item()
    assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol:g} · scale {scale:.3g}"


def _pair(d_model: int, n_heads: int, *, bias: bool, batch_first: bool, dtype: torch.dtype,
          seed: int) -> tuple[nn.MultiheadAttention, MultiHeadAttention]:
    """A torch layer with random weights *and* random biases (torch zeroes its biases, which
    would hide a bias bug), and the einattn layer made from it."""
    mha = nn.MultiheadAttention(d_model, n_heads, bias=bias, batch_first=batch_first, dtype=dtype)
    with torch.no_grad():
        for k, p in enumerate(mha.parameters()):
            scale = p.shape[-1] ** -0.5 if p.ndim == 2 else 0.5
            p.copy_(randn(*p.shape, seed=1000 * seed + k, dtype=dtype) * scale)
    layer = MultiHeadAttention.from_torch(mha)
    return mha, layer


def _bottom_right(L_q: int, L_k: int) -> torch.Tensor:
    """Allowed ``(τ, σ)``: key σ at most at the query's absolute position τ + L_k − L_q."""
    return torch.ones(L_q, L_k, dtype=torch.bool).tril(diagonal=L_k - L_q)


def _as_float(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, float("-inf"))


def _torch_attn_mask(mask: torch.Tensor, n_heads: int, n: int, L_q: int, L_k: int) -> torch.Tensor:
    """einattn's mask (2-D as it is, else broadcast to (n, μ, τ, σ)) as torch's attn_mask:
    (τ, σ) or (n·μ, τ, σ), batch-major as torch folds it; bool polarity inverted."""
    if mask.ndim == 2:
        out = mask
    else:
        full = mask if mask.ndim == 4 else mask[:, None]
        out = full.expand(n, n_heads, L_q, L_k).reshape(n * n_heads, L_q, L_k)
    return ~out if out.dtype == torch.bool else out


def _torch_call(mha: nn.MultiheadAttention, x: torch.Tensor, context: torch.Tensor | None, **kw):
    """Call torch batch-first or sequence-first as the layer expects; return batch-first Y."""
    kv = x if context is None else context
    if mha.batch_first:
        Y, A = mha(x, kv, kv, **kw)
        return Y, A
    Y, A = mha(x.transpose(0, 1), kv.transpose(0, 1), kv.transpose(0, 1), **kw)
    return Y.transpose(0, 1), A


def _einattn_call(layer: MultiHeadAttention, x: torch.Tensor, context: torch.Tensor | None,
                  **kw):
    """Call the layer in its own layout, as torch is called: sequence-first where
    ``from_torch`` kept ``batch_first=False``; return batch-first Y (and what comes with it)."""
    if layer.batch_first:
        return layer(x, context, **kw)
    out = layer(x.transpose(0, 1), None if context is None else context.transpose(0, 1), **kw)
    Y = out[0] if isinstance(out, tuple) else out
    assert Y.shape[:2] == (x.shape[1], x.shape[0])  # (L, n, d_model), as torch gives it
    return (Y.transpose(0, 1), *out[1:]) if isinstance(out, tuple) else Y.transpose(0, 1)


def _einattn_grads_in_torch_layout(layer: MultiHeadAttention) -> dict[str, torch.Tensor]:
    n_heads = layer.n_heads
    out = {"in_proj_weight": layouts.to_bma(layer.W.grad, n_heads=n_heads),
           "out_proj.weight": layouts.W_O_to_linear(layer.W_O.grad)}
    if layer.b is not None:
        out["in_proj_bias"] = layouts.to_bma(layer.b.grad, n_heads=n_heads)
        out["out_proj.bias"] = layer.b_O.grad
    return out


def _assert_param_grads_match(layer, mha, tol):
    theirs = dict(mha.named_parameters())
    ours = _einattn_grads_in_torch_layout(layer)
    assert set(ours) == set(theirs)
    for name, g in ours.items():
        _assert_close(g, theirs[name].grad, tol, f"grad {name}")


# -- the named table -------------------------------------------------------------------------

# Every case: n=2, d_model=24, n_heads=3 (d_head=8), L_q=5; "L_k" set = cross-attention.
# Masks keep key σ=0 for every query and never pad it, so no row is fully masked here
# (fully masked rows are the random table's and test_module's business).
CASES = {
    "self": {},
    "cross": {"L_k": 7},
    "weights-per-head": {"need_weights": True, "average": False},
    "weights-averaged": {"need_weights": True, "average": True},
    "cross-weights-per-head": {"L_k": 7, "need_weights": True, "average": False},
    "key-padding": {"L_k": 7, "kpm": True},
    "key-padding-weights": {"kpm": True, "need_weights": True, "average": False},
    "bool-mask-2d": {"mask": ("bool", 2)},
    "bool-mask-3d": {"L_k": 7, "mask": ("bool", 3)},
    "bool-mask-4d": {"mask": ("bool", 4), "need_weights": True, "average": False},
    "float-mask-2d": {"L_k": 7, "mask": ("float", 2)},
    "float-mask-3d": {"mask": ("float", 3), "need_weights": True, "average": True},
    "float-mask-4d": {"L_k": 7, "mask": ("float", 4), "kpm": True},
    "causal-is_causal-hint": {"causal": "hint"},
    "causal-is_causal-hint-weights": {"causal": "hint", "need_weights": True, "average": False},
    "causal-float-mask": {"causal": "float"},
    "causal-cross-bottom-right": {"L_k": 7, "causal": "float", "need_weights": True,
                                  "average": False},
    "causal-bool-mask-kpm": {"L_k": 7, "causal": "float", "mask": ("bool", 3), "kpm": True,
                             "need_weights": True, "average": False},
    "seed-trace-2-5-16-4": {"sizes": (2, 5, 16, 4), "causal": "hint"},
    "seed-trace-weights": {"sizes": (2, 5, 16, 4), "need_weights": True, "average": True},
}


def _case_masks(case: dict, n: int, n_heads: int, L_q: int, L_k: int, dtype, seed: int):
    """einattn's mask, torch's attn_mask, einattn's and torch's key padding masks, and
    torch's is_causal hint, for a named case."""
    mask = torch_mask = None
    allowed_causal = _bottom_right(L_q, L_k) if case.get("causal") else None
    if "mask" in case:
        kind, rank = case["mask"]
        shape = {2: (L_q, L_k), 3: (n, L_q, L_k), 4: (n, n_heads, L_q, L_k)}[rank]
        allowed = randn(*shape, seed=seed + 7) > -0.3
        allowed[..., 0] = True
        mask = allowed if kind == "bool" else (randn(*shape, seed=seed + 8, dtype=dtype)
                                               .masked_fill(~allowed, float("-inf")))
        torch_mask = _torch_attn_mask(mask, n_heads, n, L_q, L_k)
    kpm = None
    if case.get("kpm"):
        kpm = randn(n, L_k, seed=seed + 9) > 0.4
        kpm[:, 0] = False
    is_causal = False
    if allowed_causal is not None:
        causal_float = _as_float(allowed_causal, dtype)
        if torch_mask is None:
            torch_mask = causal_float
            is_causal = case["causal"] == "hint"
        else:
            user = _as_float(~torch_mask, dtype) if torch_mask.dtype == torch.bool else torch_mask
            torch_mask = user + causal_float
    if kpm is not None and torch_mask is not None and torch_mask.dtype != torch.bool:
        torch_kpm = _as_float(~kpm, dtype)  # torch wants both masks of one type
    else:
        torch_kpm = kpm
    return mask, torch_mask, kpm, torch_kpm, is_causal


@pytest.mark.parametrize("dtype", [F64, F32], ids=["f64", "f32"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_nn_multihead_attention(name, bias, batch_first, dtype):
    case = CASES[name]
    n, L_q, d_model, n_heads = case.get("sizes", (2, 5, 24, 3))
    L_k = case.get("L_k", L_q)
    seed = sorted(CASES).index(name)
    mha, layer = _pair(d_model, n_heads, bias=bias, batch_first=batch_first, dtype=dtype,
                       seed=seed)
    x = randn(n, L_q, d_model, seed=seed + 1, dtype=dtype)
    c = randn(n, L_k, d_model, seed=seed + 2, dtype=dtype) if "L_k" in case else None
    mask, torch_mask, kpm, torch_kpm, is_causal = _case_masks(case, n, n_heads, L_q, L_k,
                                                              dtype, seed)
    need_weights, average = case.get("need_weights", False), case.get("average", True)

    inputs = [x] if c is None else [x, c]
    ours_in = [t.clone().requires_grad_() for t in inputs]
    theirs_in = [t.clone().requires_grad_() for t in inputs]
    out = _einattn_call(layer, ours_in[0], ours_in[1] if c is not None else None, mask=mask,
                        key_padding_mask=kpm, causal=bool(case.get("causal")),
                        need_weights=need_weights)
    Y, A = out if need_weights else (out, None)
    Y_t, A_t = _torch_call(mha, theirs_in[0], theirs_in[1] if c is not None else None,
                           attn_mask=torch_mask, key_padding_mask=torch_kpm,
                           need_weights=need_weights, average_attn_weights=average,
                           is_causal=is_causal)
    tol = TOL[dtype]
    _assert_close(Y, Y_t, tol, "Y")
    G = randn(*Y.shape, seed=seed + 3, dtype=dtype)
    loss, loss_t = (Y * G).sum(), (Y_t * G).sum()
    if need_weights:
        assert A.shape == (n, n_heads, L_q, L_k)
        A_cmp = A.mean(dim=1) if average else A
        _assert_close(A_cmp, A_t, tol, "A")
        G_A = randn(*A_t.shape, seed=seed + 4, dtype=dtype)
        loss, loss_t = loss + (A_cmp * G_A).sum(), loss_t + (A_t * G_A).sum()
    else:
        assert A_t is None
    loss.backward()
    loss_t.backward()
    for k, (a, b) in enumerate(zip(ours_in, theirs_in, strict=True)):
        _assert_close(a.grad, b.grad, tol, ["grad x", "grad context"][k])
    _assert_param_grads_match(layer, mha, tol)


def test_the_named_table_covers_what_it_claims():
    """Every kind of case the table is meant to hold is in it (a table can rot silently)."""
    kinds = {(c["mask"] if "mask" in c else None) for c in CASES.values()}
    assert {(k, r) for k in ("bool", "float") for r in (2, 3, 4)} <= kinds
    assert any(c.get("kpm") for c in CASES.values())
    assert {c.get("causal") for c in CASES.values()} >= {"hint", "float"}
    assert any(c.get("need_weights") and not c.get("average", True) for c in CASES.values())
    assert any(c.get("need_weights") and c.get("average", True) for c in CASES.values())
    assert any(c.get("sizes") == (2, 5, 16, 4) for c in CASES.values())


# -- the random table ------------------------------------------------------------------------


def _random_case(seed: int) -> dict:
    r = random.Random(seed)
    n_heads = r.choice([1, 2, 3, 5])
    d_head = r.choice([1, 2, 3, 5, 7])
    L_q = r.choice([1, 1, 2, 3, 4, 5, 6, 7])
    cross = r.random() < 0.5
    return {
        "n": r.choice([1, 2, 3]), "L_q": L_q, "L_k": r.choice([1, 2, 3, 5, 6, 8]) if cross else L_q,
        "cross": cross, "n_heads": n_heads, "d_model": n_heads * d_head,
        "bias": r.random() < 0.5, "batch_first": r.random() < 0.5,
        "causal": r.random() < 0.35, "hint": r.random() < 0.5,
        "mask": r.choice([None, "bool", "float"]), "rank": r.choice([2, 3, 4]),
        "broadcast": [r.random() < 0.3 for _ in range(2)],
        "kpm": r.choice([None, None, "bool", "float"]),
        "need_weights": r.random() < 0.5, "average": r.random() < 0.5,
        "p_blocked": r.choice([0.1, 0.4, 0.8]),
    }


def _random_inputs(case: dict, seed: int):
    """The inputs, einattn's masks, torch's masks, and the allowed (n, μ, τ, σ) pattern."""
    n, L_q, L_k, h = case["n"], case["L_q"], case["L_k"], case["n_heads"]
    x = randn(n, L_q, case["d_model"], seed=seed * 10 + 1)
    c = randn(n, L_k, case["d_model"], seed=seed * 10 + 2) if case["cross"] else None
    allowed = torch.ones(n, h, L_q, L_k, dtype=torch.bool)
    g = torch.Generator().manual_seed(seed)

    mask = None
    if case["mask"]:
        shape = {2: [L_q, L_k], 3: [n, L_q, L_k], 4: [n, h, L_q, L_k]}[case["rank"]]
        if case["rank"] > 2:  # a size-1 axis that broadcasts (n, or μ)
            for axis, one in zip(range(case["rank"] - 2), case["broadcast"], strict=False):
                shape[axis] = 1 if one else shape[axis]
        ok = torch.rand(*shape, generator=g) >= case["p_blocked"]
        mask = ok if case["mask"] == "bool" else (
            torch.randn(*shape, generator=g, dtype=F64).masked_fill(~ok, float("-inf")))
        full = ok if case["rank"] == 4 else ok[:, None] if case["rank"] == 3 else ok
        allowed &= full
    kpm = None
    if case["kpm"]:
        pad = torch.rand(n, L_k, generator=g) < case["p_blocked"] / 2
        kpm = pad if case["kpm"] == "bool" else (
            torch.randn(n, L_k, generator=g, dtype=F64).masked_fill(pad, float("-inf")))
        allowed &= ~pad[:, None, None, :]
    if case["causal"]:
        allowed &= _bottom_right(L_q, L_k)

    # torch: the user's mask (polarity inverted, expanded), then causal merged in as floats
    torch_mask = None if mask is None else _torch_attn_mask(mask, h, n, L_q, L_k)
    is_causal = False
    if case["causal"]:
        causal_float = _as_float(_bottom_right(L_q, L_k), F64)
        if torch_mask is None:
            torch_mask = causal_float
            is_causal = case["hint"] and L_q == L_k  # torch's hint is top-left aligned
        else:
            user = _as_float(~torch_mask, F64) if torch_mask.dtype == torch.bool else torch_mask
            torch_mask = user + causal_float
    torch_kpm = kpm
    if kpm is not None and torch_mask is not None and (kpm.dtype == torch.bool) != (
            torch_mask.dtype == torch.bool):
        # torch wants both masks of one type: make both float
        torch_kpm = _as_float(~kpm, F64) if kpm.dtype == torch.bool else kpm
        if torch_mask.dtype == torch.bool:
            torch_mask = _as_float(~torch_mask, F64)
    if kpm is not None and kpm.dtype != torch.bool:  # einattn takes an additive padding bias
        mask, kpm = _with_padding_bias(mask, kpm), None  # as part of mask=, not as padding
    return x, c, mask, kpm, torch_mask, torch_kpm, is_causal, allowed


def _with_padding_bias(mask: torch.Tensor | None, bias: torch.Tensor) -> torch.Tensor:
    """One float mask ``(n, 1, τ, σ)`` or ``(n, μ, τ, σ)``: ``mask`` (bool made additive)
    plus a float padding bias ``(n, σ)`` added to every query's scores."""
    bias = bias[:, None, None, :]
    if mask is None:
        return bias
    if mask.dtype == torch.bool:
        mask = _as_float(mask, F64)
    return bias + (mask[:, None] if mask.ndim == 3 else mask)


@pytest.mark.parametrize("seed", range(240))
def test_random_table_matches_nn_multihead_attention(seed):
    """Random shapes (L = 1, odd sizes, L_q ≠ L_k), masks of each kind, rank and broadcast,
    key padding of both kinds, bias, causal, weights: float64, 1e-12 relative to scale.

    Where every key of a query is blocked, torch's weights are NaN (or, on its SDPA path,
    zeros); einattn's are exact zeros. Those rows are compared to zeros, the rest to torch;
    gradients wherever torch's output is finite throughout."""
    case = _random_case(seed)
    mha, layer = _pair(case["d_model"], case["n_heads"], bias=case["bias"],
                       batch_first=case["batch_first"], dtype=F64, seed=seed)
    x, c, mask, kpm, torch_mask, torch_kpm, is_causal, allowed = _random_inputs(case, seed)
    dead = ~allowed.any(dim=-1)  # (n, μ, τ)
    need_weights, average = case["need_weights"], case["average"]

    inputs = [x] if c is None else [x, c]
    ours_in = [t.clone().requires_grad_() for t in inputs]
    theirs_in = [t.clone().requires_grad_() for t in inputs]
    Y, stages = _einattn_call(layer, ours_in[0], ours_in[1] if c is not None else None,
                              mask=mask, key_padding_mask=kpm, causal=case["causal"],
                              return_intermediates=True)
    A = stages["A"]
    Y_t, A_t = _torch_call(mha, theirs_in[0], theirs_in[1] if c is not None else None,
                           attn_mask=torch_mask, key_padding_mask=torch_kpm,
                           need_weights=need_weights, average_attn_weights=average,
                           is_causal=is_causal)
    tol = TOL[F64]

    assert torch.isfinite(Y).all() and torch.isfinite(A).all()
    assert torch.equal(A[dead], torch.zeros_like(A[dead]))
    rows = torch.isfinite(Y_t).all(dim=-1)  # (n, τ): rows torch could compute
    assert rows[~dead.any(dim=1)].all(), "torch is not finite on a row with no dead head"
    _assert_close(Y[rows], Y_t[rows], tol, "Y")
    if need_weights:
        live = ~dead if not average else ~dead.any(dim=1)
        A_cmp = A if not average else A.mean(dim=1)
        _assert_close(A_cmp[live], A_t[live], tol, "A")

    if rows.all():  # no dead row, or torch's SDPA path, which also gives zeros there
        G = randn(*Y.shape, seed=seed * 10 + 3)
        (Y * G).sum().backward()
        (Y_t * G).sum().backward()
        for k, (a, b) in enumerate(zip(ours_in, theirs_in, strict=True)):
            _assert_close(a.grad, b.grad, tol, ["grad x", "grad context"][k])
        _assert_param_grads_match(layer, mha, tol)


def test_random_table_covers_its_space():
    """The 240 seeds really reach every corner the table claims (else it could pass vacuously)."""
    cases = [_random_case(s) for s in range(240)]
    seen = {(c["mask"], c["rank"]) for c in cases}
    assert {(k, r) for k in ("bool", "float") for r in (2, 3, 4)} <= seen
    assert {c["kpm"] for c in cases} == {None, "bool", "float"}
    for key in ("cross", "bias", "batch_first", "causal", "need_weights", "average"):
        assert {c[key] for c in cases} == {False, True}, key
    assert any(c["L_q"] == 1 for c in cases) and any(c["L_k"] == 1 for c in cases)
    assert any(c["cross"] and c["causal"] and c["L_q"] > c["L_k"] for c in cases)
    assert any(c["n_heads"] == 5 and c["d_model"] % 2 for c in cases)
    n_dead = sum(bool((~_random_inputs(c, s)[-1].any(-1)).any()) for s, c in enumerate(cases))
    assert 20 <= n_dead <= 200, n_dead  # both fully masked rows and fully live cases occur


# -- F.scaled_dot_product_attention on the layer's own Q, K, V --------------------------------


SDPA_CASES = ["none", "bool-2d", "bool-4d", "float-3d", "causal-self", "causal-cross"]


@pytest.mark.parametrize("dtype", [F64, F32], ids=["f64", "f32"])
@pytest.mark.parametrize("kind", SDPA_CASES)
def test_Z_matches_scaled_dot_product_attention(kind, dtype):
    """``Z[n μ τ a]`` from ``return_intermediates`` equals SDPA on the same Q, K, V (same
    polarity: True = may attend), and ``Y`` equals ``Z`` pushed through ``W_O``."""
    n, n_heads, d_head, L_q, L_k = 2, 3, 5, 4, 7 if kind == "causal-cross" else 4
    d_model = 17  # d_head·n_heads = 15 ≠ d_model: einattn needs no tie between them
    layer = MultiHeadAttention(d_model, n_heads, d_head=d_head, bias=True, dtype=dtype)
    with torch.no_grad():
        for k, p in enumerate(layer.parameters()):
            p.copy_(randn(*p.shape, seed=50 + k, dtype=dtype) * 0.4)
    x = randn(n, L_q, d_model, seed=61, dtype=dtype)
    c = randn(n, L_k, d_model, seed=62, dtype=dtype) if L_k != L_q else None
    mask, sdpa_mask, causal, sdpa_causal = None, None, False, False
    if kind == "bool-2d":
        mask = randn(L_q, L_k, seed=63) > -0.5
        mask[:, 1] = True
        sdpa_mask = mask
    elif kind == "bool-4d":
        mask = randn(n, n_heads, L_q, L_k, seed=64) > -0.5
        mask[..., 2] = True
        sdpa_mask = mask
    elif kind == "float-3d":
        mask = randn(n, L_q, L_k, seed=65, dtype=dtype)
        mask[0, 1, 2:] = float("-inf")
        sdpa_mask = mask[:, None]  # SDPA broadcasts from the right: (n, 1, τ, σ)
    elif kind == "causal-self":
        causal, sdpa_causal = True, True  # square: top-left = bottom-right
    elif kind == "causal-cross":
        causal, sdpa_mask = True, _bottom_right(L_q, L_k)
    Y, st = layer(x, c, mask=mask, causal=causal, return_intermediates=True)
    assert st["Q"].shape == (n, n_heads, L_q, d_head)
    Z_sdpa = F.scaled_dot_product_attention(st["Q"], st["K"], st["V"], attn_mask=sdpa_mask,
                                            is_causal=sdpa_causal)
    tol = TOL[dtype]
    _assert_close(st["Z"], Z_sdpa, tol, "Z")
    Y_sdpa = torch.einsum("nhta,hai->nti", Z_sdpa, layer.W_O) + layer.b_O
    _assert_close(Y, Y_sdpa, tol, "Y")


# -- the reshape-based reference, through layer.projections() --------------------------------


REF_CASES = {
    "self": {},
    "cross-causal-bias": {"L_k": 7, "causal": True, "bias": True},
    "cross-causal-L_q>L_k": {"L_q": 6, "L_k": 4, "causal": True},  # first 2 rows fully masked
    "bool-3d-dead-row": {"mask": "bool", "bias": True},
    "float-4d": {"mask": "float", "L_k": 7},
    "d_head≠d_model/n_heads": {"d_head": 7, "bias": True, "causal": True},
    "seed-trace-2-5-16-4": {"sizes": (2, 5, 16, 4), "causal": True},
}


@pytest.mark.parametrize("name", list(REF_CASES))
def test_matches_reshape_reference(name):
    """Y, A and every gradient equal ``reference.multi_head_attention`` fed
    ``layer.projections()``, fully masked rows included (both give zeros there)."""
    case = REF_CASES[name]
    n, L_q, d_model, n_heads = case.get("sizes", (2, case.get("L_q", 5), 24, 3))
    L_k = case.get("L_k", L_q)
    layer = MultiHeadAttention(d_model, n_heads, d_head=case.get("d_head"),
                               bias=case.get("bias", False), dtype=F64)
    with torch.no_grad():
        for k, p in enumerate(layer.parameters()):
            p.copy_(randn(*p.shape, seed=300 + k) * 0.3)
    x = randn(n, L_q, d_model, seed=311)
    c = randn(n, L_k, d_model, seed=312) if "L_k" in case else None
    mask = None
    if case.get("mask") == "bool":
        mask = randn(n, L_q, L_k, seed=313) > 0
        mask[1, 2] = False  # one fully masked row
    elif case.get("mask") == "float":
        mask = randn(n, n_heads, L_q, L_k, seed=314)
        mask[0, 1, 3, :] = float("-inf")
    causal = case.get("causal", False)

    inputs = [x] if c is None else [x, c]
    ours_in = [t.clone().requires_grad_() for t in inputs]
    ref_in = [t.clone().requires_grad_() for t in inputs]
    Y, A = layer(*ours_in, mask=mask, causal=causal, need_weights=True)
    p = layer.projections()
    ref_p = [None if t is None else t.clone().requires_grad_() for t in p]
    Y_r, A_r = reference.multi_head_attention(
        ref_in[0], *ref_p[:4], n_heads=n_heads, context=ref_in[1] if c is not None else None,
        mask=mask, causal=causal, b_q=ref_p[4], b_k=ref_p[5], b_v=ref_p[6], b_o=ref_p[7],
        return_weights=True)
    tol = TOL[F64]
    _assert_close(Y, Y_r, tol, "Y")
    _assert_close(A, A_r, tol, "A")
    G, G_A = randn(*Y.shape, seed=315), randn(*A.shape, seed=316)
    ((Y * G).sum() + (A * G_A).sum()).backward()
    ((Y_r * G).sum() + (A_r * G_A).sum()).backward()
    for k, (a, b) in enumerate(zip(ours_in, ref_in, strict=True)):
        _assert_close(a.grad, b.grad, tol, ["grad x", "grad context"][k])
    W_q, W_k, W_v, W_o = (t.grad for t in ref_p[:4])
    _assert_close(layer.W.grad, layouts.fuse_qkv(W_q, W_k, W_v, n_heads=n_heads), tol, "grad W")
    _assert_close(layer.W_O.grad, layouts.W_O_from_linear(W_o, n_heads=n_heads), tol, "grad W_O")
    if layer.b is not None:
        b_q, b_k, b_v, b_o = (t.grad for t in ref_p[4:])
        _assert_close(layer.b.grad, layouts.fuse_qkv(b_q, b_k, b_v, n_heads=n_heads), tol,
                      "grad b")
        _assert_close(layer.b_O.grad, b_o, tol, "grad b_O")
    if causal and L_q > L_k:
        assert torch.equal(A[:, :, : L_q - L_k], torch.zeros_like(A[:, :, : L_q - L_k]))


def test_scale_is_one_over_sqrt_d_head():
    """The scores use 1/√a with a = d_head, not 1/√d_model (they differ here: 7 vs 24)."""
    layer = MultiHeadAttention(24, 3, d_head=7, dtype=F64)
    x = randn(1, 4, 24, seed=5)
    _, st = layer(x, return_intermediates=True)
    S = torch.einsum("nhta,nhsa->nhts", st["Q"], st["K"]) / math.sqrt(7)
    _assert_close(st["S"], S, TOL[F64], "S")
