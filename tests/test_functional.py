"""einattn.functional: each stage against an independent formula, the composition against the
reshape-based reference (values and gradients), gradchecks, numerics and errors."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as torch_F
from conftest import TOL, assert_close_scaled, projections, randn

from einattn import EinattnError, layouts, masks, reference
from einattn import functional as F

F64, F32 = torch.float64, torch.float32

# All-distinct sizes (so a swapped index cannot hide), non-powers of two, μ·a ≠ d_model,
# and the seed's own trace.
SIZES = {
    "distinct": dict(n=2, L_q=5, L_k=7, d_model=24, n_heads=3, d_head=8),
    "odd": dict(n=3, L_q=4, L_k=6, d_model=13, n_heads=2, d_head=5),
    "seed": dict(n=2, L_q=5, L_k=5, d_model=16, n_heads=4, d_head=4),
}
CASES = [("distinct", "self"), ("distinct", "cross"), ("odd", "self"), ("odd", "cross"),
         ("seed", "self")]
MASKS = [None, "bool τσ", "bool nτσ", "bool nμτσ", "float τσ", "float n1τσ", "float nμτσ"]


def make_mask(kind, *, n, n_heads, L_q, L_k, dtype, seed=7):
    """A mask of the named kind; every kind that has an n axis fully masks row 1 of sample 0."""
    if kind is None:
        return None
    shape = {"τσ": (L_q, L_k), "nτσ": (n, L_q, L_k), "n1τσ": (n, 1, L_q, L_k),
             "nμτσ": (n, n_heads, L_q, L_k)}[kind.split()[1]]
    allowed = randn(*shape, seed=seed) > -0.5  # about 70 % allowed
    if len(shape) > 2:
        allowed[0, ..., 1, :] = False
    if kind.startswith("bool"):
        return allowed
    values = randn(*shape, seed=seed + 1, dtype=dtype)
    return values.masked_fill(~allowed, float("-inf"))


def sizes_of(case, attention):
    s = dict(SIZES[case])
    if attention == "self":
        s["L_k"] = s["L_q"]
    return s


def both(case, attention, mask_kind, causal, bias, dtype, requires_grad=False):
    """einattn's and the reference's outputs on the same inputs, and the leaf tensors."""
    s = sizes_of(case, attention)
    n, L_q, L_k, d, mu, a = (s[k] for k in ("n", "L_q", "L_k", "d_model", "n_heads", "d_head"))
    x = randn(n, L_q, d, seed=1, dtype=dtype, requires_grad=requires_grad)
    ctx = None if attention == "self" else randn(n, L_k, d, seed=2, dtype=dtype,
                                                  requires_grad=requires_grad)
    p = projections(d, mu, a, bias=bias, seed=3, dtype=dtype, requires_grad=requires_grad)
    mask = make_mask(mask_kind, n=n, n_heads=mu, L_q=L_q, L_k=L_k, dtype=dtype)
    W = layouts.fuse_qkv(p["W_q"], p["W_k"], p["W_v"], n_heads=mu)
    W_O = layouts.W_O_from_linear(p["W_o"], n_heads=mu)
    b = layouts.fuse_qkv(p["b_q"], p["b_k"], p["b_v"], n_heads=mu) if bias else None
    y = F.multi_head_attention(x, W, W_O, n_heads=mu, context=ctx, mask=mask, causal=causal,
                               b=b, b_O=p.get("b_o"))
    y_ref = reference.multi_head_attention(
        x, p["W_q"], p["W_k"], p["W_v"], p["W_o"], n_heads=mu, context=ctx, mask=mask,
        causal=causal, b_q=p.get("b_q"), b_k=p.get("b_k"), b_v=p.get("b_v"), b_o=p.get("b_o"))
    leaves = {"x": x, **({} if ctx is None else {"context": ctx}), **p}
    return y, y_ref, leaves


parity = pytest.mark.parametrize("case, attention", CASES)
options = [pytest.mark.parametrize("mask_kind", MASKS),
           pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"]),
           pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])]


def _apply(marks):
    def decorate(f):
        for m in reversed(marks):
            f = m(f)
        return f
    return decorate


# -- the composition equals the reshape-based reference ---------------------------------


@parity
@_apply(options)
@pytest.mark.parametrize("dtype", [F64, F32], ids=["f64", "f32"])
def test_matches_reference(case, attention, mask_kind, causal, bias, dtype):
    y, y_ref, _ = both(case, attention, mask_kind, causal, bias, dtype)
    assert torch.isfinite(y).all()
    assert_close_scaled(y, y_ref, TOL[dtype])


@parity
@_apply(options)
def test_gradients_match_reference(case, attention, mask_kind, causal, bias):
    y, y_ref, leaves = both(case, attention, mask_kind, causal, bias, F64, requires_grad=True)
    g = randn(*y.shape, seed=11)
    grads = torch.autograd.grad(y, list(leaves.values()), g)
    grads_ref = torch.autograd.grad(y_ref, list(leaves.values()), g)
    for name, got, want in zip(leaves, grads, grads_ref, strict=True):
        assert torch.isfinite(got).all(), name
        assert got.abs().sum() > 0, name  # every leaf reaches the output
        assert_close_scaled(got, want, TOL[F64])


def test_seed_shape_trace():
    """The seed's trace: n=2, L=5, d_model=16, 4 heads of 4 channels."""
    x, W, W_O = randn(2, 5, 16, seed=1), randn(48, 16, seed=2), randn(4, 4, 16, seed=3)
    Q, K, V = F.project_qkv(x, W, n_heads=4)
    S = F.attention_scores(Q, K)
    A = F.masked_softmax(S, masks.causal_mask(5))
    Z = F.weighted_values(A, V)
    Y = F.combine_heads(Z, W_O)
    assert Q.shape == K.shape == V.shape == (2, 4, 5, 4)
    assert S.shape == A.shape == (2, 4, 5, 5)
    assert Z.shape == (2, 4, 5, 4)
    assert Y.shape == (2, 5, 16)
    Y2, stages = F.multi_head_attention(x, W, W_O, n_heads=4, causal=True,
                                        return_intermediates=True)
    assert_close_scaled(Y2, Y, TOL[F64])
    for name, t in {"Q": Q, "K": K, "V": V, "S": S, "A": A, "Z": Z, "Y": Y}.items():
        assert_close_scaled(stages[name], t, TOL[F64])
    assert stages["Y_μ"].shape == (2, 4, 5, 16)
    _, A2 = F.multi_head_attention(x, W, W_O, n_heads=4, causal=True, need_weights=True)
    assert_close_scaled(A2, A, TOL[F64])


# -- each stage against an independent formula (all-distinct sizes) ---------------------

N, LQ, LK, D, MU, A_ = 2, 3, 4, 7, 2, 5  # a = 5 so a ≠ every other size


@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_project_qkv_per_head(cross, bias):
    x = randn(N, LQ, D, seed=1)
    ctx = randn(N, LK, D, seed=2) if cross else None
    p = projections(D, MU, A_, bias=bias, seed=3)
    W = layouts.fuse_qkv(p["W_q"], p["W_k"], p["W_v"], n_heads=MU)
    b = layouts.fuse_qkv(p["b_q"], p["b_k"], p["b_v"], n_heads=MU) if bias else None
    Q, K, V = F.project_qkv(x, W, n_heads=MU, b=b, context=ctx)
    src = x if ctx is None else ctx
    for mu in range(MU):
        rows = slice(mu * A_, (mu + 1) * A_)
        for got, inp, B in ((Q, x, "q"), (K, src, "k"), (V, src, "v")):
            bias_B = p[f"b_{B}"][rows] if bias else None
            want = torch_F.linear(inp, p[f"W_{B}"][rows], bias_B)
            assert_close_scaled(got[:, mu], want, TOL[F64])


def test_q_k_v_without_grouping_are_views_of_one_projection():
    """Equation (1) writes P[n τ μ B a] in the matmul's order: Q, K, V are views of that one
    product (no copy, no permute there and back), and backward joins their gradients in it."""
    x = randn(N, LQ, D, seed=4, requires_grad=True)
    W = randn(3 * MU * A_, D, seed=5)
    Q, K, V = F.project_qkv(x, W, n_heads=MU)
    assert len({t.untyped_storage().data_ptr() for t in (Q, K, V)}) == 1
    chain, node = [], Q.grad_fn  # from Q back to the matmul
    while "Mm" not in node.name():
        chain.append(node.name())
        node = node.next_functions[0][0]
    assert chain == ["TransposeBackward0", "UnbindBackward0", "ViewBackward0",
                     "UnsafeViewBackward0"]


@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_q_k_v_split_alike_with_and_without_a_gradient(cross):
    """Where P needs no gradient, (1)'s split is a permute and one unbind (two calls, not
    four); it must give the very views that the split backward needs gives: the same values
    and strides, all in P's storage."""
    x, ctx = randn(N, LQ, D, seed=6), randn(N, LK, D, seed=7) if cross else None
    W = randn(3 * MU * A_, D, seed=8)
    plain = F.project_qkv(x, W, n_heads=MU, context=ctx)
    tracked = F.project_qkv(x, W.clone().requires_grad_(), n_heads=MU, context=ctx)
    for a, b in zip(plain, tracked, strict=True):
        assert not a.requires_grad and b.requires_grad
        assert a.stride() == b.stride() and torch.equal(a, b.detach())
    assert len({t.untyped_storage().data_ptr() for t in plain}) == (2 if cross else 1)


def test_attention_scores_is_scaled_dot_product():
    Q, K = randn(N, MU, LQ, A_, seed=1), randn(N, MU, LK, A_, seed=2)
    S = F.attention_scores(Q, K)
    assert S.shape == (N, MU, LQ, LK)
    assert_close_scaled(S, Q @ K.transpose(-1, -2) / math.sqrt(A_), TOL[F64])


def test_weighted_values_and_combine_heads():
    A = torch.softmax(randn(N, MU, LQ, LK, seed=1), -1)
    V, W_O, b_O = randn(N, MU, LK, A_, seed=2), randn(MU, A_, D, seed=3), randn(D, seed=4)
    Z = F.weighted_values(A, V)
    assert_close_scaled(Z, A @ V, TOL[F64])
    concat = Z.transpose(1, 2).reshape(N, LQ, MU * A_)  # "concatenate the heads"
    W_o = W_O.reshape(MU * A_, D).T  # the output nn.Linear weight
    assert_close_scaled(F.combine_heads(Z, W_O, b_O), torch_F.linear(concat, W_o, b_O), TOL[F64])
    terms = F.head_contributions(Z, W_O)
    assert terms.shape == (N, MU, LQ, D)
    for mu in range(MU):
        assert_close_scaled(terms[:, mu], Z[:, mu] @ W_O[mu], TOL[F64])
    assert_close_scaled(terms.sum(1), F.combine_heads(Z, W_O), TOL[F64])


# -- gradcheck of every stage in float64 --------------------------------------------------


def _req(*ts):
    return tuple(t.detach().requires_grad_(True) for t in ts)


def test_gradcheck_project_qkv_self():
    x, W, b = _req(randn(N, LQ, D, seed=1), randn(3 * MU * A_, D, seed=2),
                   randn(3 * MU * A_, seed=3))
    assert torch.autograd.gradcheck(lambda x, W, b: F.project_qkv(x, W, n_heads=MU, b=b), (x, W, b))


def test_gradcheck_project_qkv_cross():
    x, c, W, b = _req(randn(N, LQ, D, seed=1), randn(N, LK, D, seed=2),
                      randn(3 * MU * A_, D, seed=3), randn(3 * MU * A_, seed=4))
    assert torch.autograd.gradcheck(
        lambda x, c, W, b: F.project_qkv(x, W, n_heads=MU, b=b, context=c), (x, c, W, b))


def test_gradcheck_attention_scores():
    Q, K = _req(randn(N, MU, LQ, A_, seed=1), randn(N, MU, LK, A_, seed=2))
    assert torch.autograd.gradcheck(F.attention_scores, (Q, K))


def _dead_row_bool():
    m = randn(N, MU, LQ, LK, seed=5) > -0.5
    m[..., 0] = True  # every row but the dead one has an admissible key
    m[1, 0, 2, :] = False  # a fully masked row
    return m


@pytest.mark.parametrize("kind", ["none", "bool", "float"])
def test_gradcheck_masked_softmax(kind):
    (S,) = _req(randn(N, MU, LQ, LK, seed=1))
    if kind == "none":
        assert torch.autograd.gradcheck(F.masked_softmax, (S,))
        return
    m = _dead_row_bool()
    if kind == "bool":
        assert torch.autograd.gradcheck(F.masked_softmax, (S, m))
        return
    (M,) = _req(randn(N, MU, LQ, LK, seed=2).masked_fill(~m, float("-inf")))
    assert torch.autograd.gradcheck(F.masked_softmax, (S, M))


def test_gradcheck_weighted_values():
    A, V = _req(torch.softmax(randn(N, MU, LQ, LK, seed=1), -1), randn(N, MU, LK, A_, seed=2))
    assert torch.autograd.gradcheck(F.weighted_values, (A, V))


def test_gradcheck_combine_heads_and_head_contributions():
    Z, W_O, b_O = _req(randn(N, MU, LQ, A_, seed=1), randn(MU, A_, D, seed=2), randn(D, seed=3))
    assert torch.autograd.gradcheck(F.combine_heads, (Z, W_O, b_O))
    assert torch.autograd.gradcheck(F.head_contributions, (Z, W_O))


@pytest.mark.parametrize("mask", ["bool", "float"])
def test_gradcheck_multi_head_attention(mask):
    x, c, W, W_O, b, b_O = _req(
        randn(N, LQ, D, seed=1), randn(N, LK, D, seed=2), randn(3 * MU * A_, D, seed=3) / 3,
        randn(MU, A_, D, seed=4), randn(3 * MU * A_, seed=5), randn(D, seed=6))
    m = _dead_row_bool()
    if mask == "float":
        m = randn(N, MU, LQ, LK, seed=7).masked_fill(~m, float("-inf"))

    def f(x, c, W, W_O, b, b_O):
        return F.multi_head_attention(x, W, W_O, n_heads=MU, context=c, mask=m, causal=True,
                                      b=b, b_O=b_O)

    assert torch.autograd.gradcheck(f, (x, c, W, W_O, b, b_O))


# -- causal alignment -----------------------------------------------------------------------


def test_causal_cross_equals_the_tail_of_full_self_attention():
    """Bottom-right alignment is what a key/value cache needs: the last L_q queries of a
    causal self-attention over L_k tokens equal those queries attending to all L_k tokens."""
    n, L_k, L_q, d, mu = 2, 7, 3, 10, 2
    seq = randn(n, L_k, d, seed=1)
    W, W_O, b, b_O = (randn(3 * d, d, seed=2) / 3, randn(mu, d // mu, d, seed=3),
                      randn(3 * d, seed=4), randn(d, seed=5))
    full = F.multi_head_attention(seq, W, W_O, n_heads=mu, causal=True, b=b, b_O=b_O)
    tail = F.multi_head_attention(seq[:, -L_q:], W, W_O, n_heads=mu, context=seq, causal=True,
                                  b=b, b_O=b_O)
    assert_close_scaled(tail, full[:, -L_q:], TOL[F64])


def test_causal_with_more_queries_than_keys_gives_zero_rows():
    n, L_q, L_k, d, mu = 2, 6, 4, 9, 3
    x, c = randn(n, L_q, d, seed=1), randn(n, L_k, d, seed=2)
    W, W_O, b_O = randn(3 * 3 * mu, d, seed=3), randn(mu, 3, d, seed=4), randn(d, seed=5)
    Y, A = F.multi_head_attention(x, W, W_O, n_heads=mu, context=c, causal=True, b_O=b_O,
                                  need_weights=True)
    dead = L_q - L_k  # queries 0 and 1 sit before the first key
    assert torch.equal(A[:, :, :dead], torch.zeros_like(A[:, :, :dead]))
    assert torch.equal(Y[:, :dead], b_O.expand(n, dead, d))
    assert (A[:, :, dead:].sum(-1) - 1).abs().max() < 1e-12
    assert (A[:, :, dead, 1:] == 0).all() and (A[:, :, dead, 0] == 1).all()
    assert (A[:, :, -1] > 0).all()  # the last query sees every key


# -- fully masked rows, NaN, polarity --------------------------------------------------------


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_fully_masked_row_is_exact_zeros_with_zero_gradient(kind):
    (S,) = _req(randn(N, MU, LQ, LK, seed=1) * 30)
    m = _dead_row_bool()
    M = m if kind == "bool" else torch.zeros(()).double().masked_fill(~m, float("-inf"))
    A = F.masked_softmax(S, M)
    assert torch.equal(A[1, 0, 2], torch.zeros(LK, dtype=F64))
    live = torch.ones(N, MU, LQ, dtype=torch.bool)
    live[1, 0, 2] = False
    assert (A.sum(-1)[live] - 1).abs().max() < 1e-12
    (gS,) = torch.autograd.grad(A, S, randn(*A.shape, seed=2))
    assert torch.isfinite(gS).all()
    assert torch.equal(gS[1, 0, 2], torch.zeros(LK, dtype=F64))
    assert torch.equal(gS[~m], torch.zeros_like(gS[~m]))  # masked keys get no gradient


def test_fully_masked_rows_in_multi_head_attention_have_finite_gradients():
    x, c, W, W_O, b, b_O = _req(
        randn(N, LQ, D, seed=1), randn(N, LK, D, seed=2), randn(3 * MU * A_, D, seed=3),
        randn(MU, A_, D, seed=4), randn(3 * MU * A_, seed=5), randn(D, seed=6))
    m = torch.ones(N, LQ, LK, dtype=torch.bool)
    m[0, 1] = False  # query 1 of sample 0 may attend to nothing
    M = torch.zeros(N, 1, LQ, LK, dtype=F64).masked_fill(~m[:, None], float("-inf"))
    M.requires_grad_(True)
    for mask in (m, M):
        Y, A = F.multi_head_attention(x, W, W_O, n_heads=MU, context=c, mask=mask, b=b,
                                      b_O=b_O, need_weights=True)
        assert torch.equal(A[0, :, 1], torch.zeros(MU, LK, dtype=F64))
        assert torch.equal(Y[0, 1], b_O)
        leaves = (x, c, W, W_O, b, b_O) + ((M,) if mask is M else ())
        grads = torch.autograd.grad(Y, leaves, randn(*Y.shape, seed=7))
        for g in grads:
            assert torch.isfinite(g).all()
        # in cross-attention x[0, 1] feeds only the dead query: its gradient is exactly zero
        assert torch.equal(grads[0][0, 1], torch.zeros(D, dtype=F64))
        if mask is M:
            assert torch.equal(grads[-1][0, 0, 1], torch.zeros(LK, dtype=F64))


def test_nan_in_an_admissible_score_propagates():
    S = randn(N, MU, LQ, LK, seed=1)
    m = _dead_row_bool()
    m[0, 1, 2, 3] = True
    clean = F.masked_softmax(S, m)
    S[0, 1, 2, 3] = float("nan")
    for mask in (None, m, torch.zeros((), dtype=F64).masked_fill(~m, float("-inf"))):
        A = F.masked_softmax(S, mask)
        assert torch.isnan(A[0, 1, 2]).all()
        others = torch.ones(N, MU, LQ, dtype=torch.bool)
        others[0, 1, 2] = False
        assert torch.isfinite(A[others]).all()
    assert torch.equal(A[others], clean[others])


def test_nan_in_a_masked_out_score_does_not_poison_the_row():
    S = randn(N, MU, LQ, LK, seed=1)
    m = _dead_row_bool()
    m[0, 1, 2, 3], m[0, 1, 2, 0] = False, True
    clean = F.masked_softmax(S, m)
    S[0, 1, 2, 3] = float("nan")
    A = F.masked_softmax(S, m)
    assert torch.isfinite(A).all()
    assert torch.equal(A, clean)
    assert A[0, 1, 2, 3] == 0


@pytest.mark.cpu_only("a NaN behind a mask is kept from other queries on the CPU "
                      "only (the check would sync a GPU)")
def test_nan_in_the_input_reaches_the_queries_that_may_see_it_only():
    """Token 2 is NaN: queries 2-4 may attend to it and are NaN; queries 0 and 1 may not
    (their causal future) and equal the reference's output on the same clean prefix, where
    0 · NaN in equation (4) would have spread it to the whole sample."""
    x = randn(2, 5, 12, seed=1)
    x[0, 2, 3] = float("nan")
    W, W_O = randn(36, 12, seed=2), randn(3, 4, 12, seed=3)
    W_q, W_k, W_v = layouts.split_qkv(W, n_heads=3)
    Y_ref = reference.multi_head_attention(x[:, :2], W_q, W_k, W_v, layouts.W_O_to_linear(W_O),
                                           n_heads=3, causal=True)
    for impl in ("einsum", "sdpa", "chunked"):
        Y = F.multi_head_attention(x, W, W_O, n_heads=3, causal=True, impl=impl, block_size=2)
        assert torch.isnan(Y[0, 2:]).all(), impl
        assert torch.isfinite(Y[1]).all(), impl  # another sample is untouched
        torch.testing.assert_close(Y[:, :2], Y_ref, rtol=1e-12, atol=1e-12)


def _softmax_over(S, allowed):
    """An independent masked softmax: exponentials of the allowed scores, normalised."""
    e = torch.where(allowed, torch.exp(S - S.max(-1, keepdim=True).values), torch.zeros_like(S))
    total = e.sum(-1, keepdim=True)
    return torch.where(total > 0, e / torch.where(total > 0, total, 1.0), 0.0)


def test_mask_polarity_both_ways():
    S = randn(N, MU, LQ, LK, seed=1)
    m = _dead_row_bool()
    A, A_flipped = F.masked_softmax(S, m), F.masked_softmax(S, ~m)
    assert_close_scaled(A, _softmax_over(S, m), TOL[F64])
    assert_close_scaled(A_flipped, _softmax_over(S, ~m), TOL[F64])
    assert (A[~m] == 0).all() and (A[m] > 0).all()  # True = may attend
    live = (~m).any(-1)
    assert (A_flipped[m] == 0).all() and (A_flipped[~m & live[..., None]] > 0).all()
    M = torch.zeros((), dtype=F64).masked_fill(~m, float("-inf"))
    assert torch.equal(F.masked_softmax(S, M), A)  # float 0/-inf mask = bool mask


@pytest.mark.parametrize("dtype", [F64, F32], ids=["f64", "f32"])
def test_masking_holds_at_any_score_scale(dtype):
    """Masked keys get exactly zero weight even when admissible scores are hugely negative,
    which a finite sentinel such as -1e9 would not give."""
    S = randn(N, MU, LQ, LK, seed=1, dtype=dtype) - torch.finfo(dtype).max / 2
    m = _dead_row_bool()
    A = F.masked_softmax(S, m)
    assert (A[~m] == 0).all()
    assert torch.isfinite(A).all() and (A[m] > 0).any()
    assert_close_scaled(A, _softmax_over(S, m), TOL[dtype])


def test_mask_polarity_matches_scaled_dot_product_attention():
    Q, K = randn(N, MU, LQ, A_, seed=1), randn(N, MU, LK, A_, seed=2)
    m = _dead_row_bool()
    m[1, 0, 2, 1] = True  # no dead row here: SDPA would give NaN
    eye = torch.eye(LK, dtype=F64).expand(N, MU, LK, LK)
    A_sdpa = torch_F.scaled_dot_product_attention(Q, K, eye, attn_mask=m)
    assert_close_scaled(F.masked_softmax(F.attention_scores(Q, K), m), A_sdpa, TOL[F64])


def test_float_mask_is_added_to_the_scores():
    S = randn(N, MU, LQ, LK, seed=1)
    m = _dead_row_bool()
    M = randn(LQ, LK, seed=2).expand(N, MU, LQ, LK).masked_fill(~m, float("-inf"))
    A = F.masked_softmax(S, M)
    live = m.any(-1)
    assert_close_scaled(A[live], torch.softmax(S + M, -1)[live], TOL[F64])
    assert torch.equal(A[~live], torch.zeros_like(A[~live]))


def test_mask_changes_multi_head_attention_as_its_polarity_says():
    x, W, W_O = randn(2, 5, 12, seed=1), randn(36, 12, seed=2), randn(3, 4, 12, seed=3)
    m = randn(5, 5, seed=4) > 0
    m[:, 0] = True
    everything = torch.ones(5, 5, dtype=torch.bool)
    plain = F.multi_head_attention(x, W, W_O, n_heads=3)
    assert torch.equal(F.multi_head_attention(x, W, W_O, n_heads=3, mask=everything), plain)
    with_m = F.multi_head_attention(x, W, W_O, n_heads=3, mask=m)
    assert not torch.allclose(with_m, plain)
    M = torch.zeros(5, 5, dtype=F64).masked_fill(~m, float("-inf"))
    assert_close_scaled(F.multi_head_attention(x, W, W_O, n_heads=3, mask=M), with_m, TOL[F64])
    causal = F.multi_head_attention(x, W, W_O, n_heads=3, causal=True)
    as_mask = F.multi_head_attention(x, W, W_O, n_heads=3, mask=masks.causal_mask(5))
    assert torch.equal(causal, as_mask)


def test_key_padding_mask_is_an_inverted_key_mask():
    x, c = randn(2, 4, 12, seed=1), randn(2, 6, 12, seed=2)
    W, W_O = randn(36, 12, seed=3), randn(3, 4, 12, seed=4)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[0, 4:], pad[1, 5:] = True, True  # True = padding
    Y = F.multi_head_attention(x, W, W_O, n_heads=3, context=c, key_padding_mask=pad)
    Y_mask = F.multi_head_attention(x, W, W_O, n_heads=3, context=c, mask=~pad[:, None, :]
                                    .expand(2, 4, 6))
    assert torch.equal(Y, Y_mask)
    Y_cut = F.multi_head_attention(x[:1], W, W_O, n_heads=3, context=c[:1, :4])
    assert_close_scaled(Y[:1], Y_cut, TOL[F64])


# -- errors: every raise site, and bad inputs that reach the Equation engine ---------------

x0, W0, W_O0 = torch.ones(2, 5, 16), torch.ones(48, 16), torch.ones(4, 4, 16)


def mha(**changes):
    args = {"x": x0, "W": W0, "W_O": W_O0, "n_heads": 4} | changes
    x, W, W_O = args.pop("x"), args.pop("W"), args.pop("W_O")
    return F.multi_head_attention(x, W, W_O, **args)


ERRORS = {
    "W 3-D": (dict(W=torch.ones(4, 12, 16)),
              r"W must be 2-D W\[\(μ B a\) i\], got \(4, 12, 16\)"),
    "W not a tensor": (dict(W=[[1.0]]), r"W must be 2-D W\[\(μ B a\) i\], got list"),
    "W rows": (dict(W=torch.ones(47, 16)),
               r"W has 47 rows; W\[\(μ B a\) i\] needs μ·B·a rows with μ=4, B=3, "
               r"so a multiple of 12"),
    "n_heads 0": (dict(n_heads=0),
                  r"n_heads \(the size of index 'μ'\) must be a positive int, got 0"),
    "n_heads float": (dict(n_heads=4.0),
                      r"n_heads \(the size of index 'μ'\) must be a positive int, got 4\.0"),
    "n_heads bool": (dict(n_heads=True), r"must be a positive int, got True"),
    "b size": (dict(b=torch.ones(47)), r"b has shape \(47,\) but b\[\(μ B a\)\] needs \(48,\) "
               r"with μ=4, B=3, a=4"),
    "b 2-D": (dict(b=torch.ones(48, 1)), r"b has shape \(48, 1\) but b\[\(μ B a\)\] needs \(48,\)"),
    "b not a tensor": (dict(b=[0.0] * 48), r"b must be a torch.Tensor, got list"),
    "context 2-D": (dict(context=torch.ones(5, 16)),
                    r"x \(2, 5, 16\) and context \(5, 16\) must be 3-D X\[n τ i\] and C\[n σ i\]"),
    "context n": (dict(context=torch.ones(3, 7, 16)),
                  r"index 'n' has size 3 in context but 2 in x"),
    "context i": (dict(context=torch.ones(2, 7, 15)),
                  r"index 'i' has size 15 in context but 16 in x"),
    "x d_model": (dict(x=torch.ones(2, 5, 15)), r"index 'i' has size 16 in W but 15 in X"),
    "x 2-D": (dict(x=torch.ones(5, 16)), r"X has 2 axes \(5, 16\)"),
    "x dtype": (dict(x=x0.double()), r"W is torch.float32 but X is torch.float64"),
    "W_O a": (dict(W_O=torch.ones(4, 3, 16)), r"index 'a' has size 3 in W_O but 4 in Z"),
    "W_O μ": (dict(W_O=torch.ones(2, 4, 16)), r"index 'μ' has size 2 in W_O but 4 in Z"),
    "impl": (dict(impl="fast"),
             r"impl must be one of 'einsum', 'sdpa', 'chunked', 'flex', 'auto', got 'fast'"),
    "W_O i": (dict(W_O=torch.ones(4, 4, 9)),
              r"index 'i' has size 9 in W_O but 16 in x"),
    "b_O size": (dict(b_O=torch.ones(7)),
                 r"b_O has shape \(7,\) but b_O\[i\] needs \(16,\), the size of index 'i' in W_O"),
    "b_O scalar-like": (dict(b_O=torch.ones(1)),
                        r"b_O has shape \(1,\) but b_O\[i\] needs \(16,\)"),
    "mask σ": (dict(mask=torch.ones(5, 4, dtype=torch.bool)),
               r"mask has shape \(5, 4\): index 'σ' has size 4 in mask but 5 in the scores"),
    "mask n": (dict(mask=torch.ones(3, 5, 5, dtype=torch.bool)),
               r"index 'n' has size 3 in mask but 2 in the scores"),
    "mask dtype": (dict(mask=torch.zeros(5, 5, dtype=torch.float64)),
                   r"mask is torch.float64 but the scores are torch.float32"),
    "mask int": (dict(mask=torch.ones(5, 5, dtype=torch.int64)),
                 r"mask must be bool \(True = may attend\) or float.*got torch.int64"),
    "key_padding_mask": (dict(key_padding_mask=torch.zeros(2, 4, dtype=torch.bool)),
                         r"key_padding_mask has shape \(2, 4\) but must be \(n, σ\) = \(2, 5\)"),
}


@pytest.mark.parametrize("changes, message", ERRORS.values(), ids=ERRORS.keys())
def test_multi_head_attention_errors(changes, message):
    with pytest.raises(EinattnError, match=message):
        mha(**changes)


STAGE_ERRORS = {
    "scores a": (lambda: F.attention_scores(torch.ones(2, 4, 5, 4), torch.ones(2, 4, 7, 8)),
                 r"index 'a' has size 8 in K but 4 in Q"),
    "scores μ": (lambda: F.attention_scores(torch.ones(2, 4, 5, 4), torch.ones(2, 3, 7, 4)),
                 r"group \(g r\) of Q has length 4, not divisible by g=3\n"),
    "values σ": (lambda: F.weighted_values(torch.ones(2, 4, 5, 7), torch.ones(2, 4, 6, 3)),
                 r"index 'σ' has size 6 in V but 7 in A"),
    "heads 3-D Z": (lambda: F.combine_heads(torch.ones(4, 5, 3), torch.ones(4, 3, 16)),
                    r"Z has 3 axes \(4, 5, 3\)"),
    "head terms a": (lambda: F.head_contributions(torch.ones(2, 4, 5, 3), torch.ones(4, 2, 16)),
                     r"index 'a' has size 2 in W_O but 3 in Z"),
    "open_fused": (lambda: F.open_fused(torch.ones(50, 16), 4),
                   r"W has 50 rows.*a multiple of 12"),
}


@pytest.mark.parametrize("call, message", STAGE_ERRORS.values(), ids=STAGE_ERRORS.keys())
def test_stage_errors(call, message):
    with pytest.raises(EinattnError, match=message):
        call()


def test_errors_are_value_errors_and_show_the_equation():
    with pytest.raises(ValueError) as info:
        mha(W_O=torch.ones(4, 3, 16))
    assert re.search(r"Y\[n τ i\] = Z\[n μ τ a\] W_O\[μ a i\]", str(info.value))


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_the_promise_of_no_fully_masked_row_changes_nothing_where_it_holds(kind):
    """``every_row_sees_a_key=True`` skips the guard of fully masked rows: the same A, bit
    for bit, where every row sees a key (a causal mask with L_q ≤ L_k)."""
    S = randn(2, 3, 4, 6, seed=21)
    m = masks.causal_mask(4, 6)
    M = m if kind == "bool" else torch.zeros(4, 6, dtype=F64).masked_fill(~m, float("-inf"))
    assert torch.equal(F.masked_softmax(S, M, every_row_sees_a_key=True), F.masked_softmax(S, M))


def test_causal_rows_that_see_no_key_keep_their_guard():
    """L_q > L_k with causal: the first queries see no key; the einsum path must not take
    the unguarded softmax there (it would give NaN rows)."""
    x, W, W_O = randn(2, 6, 16, seed=1), randn(48, 16, seed=2), randn(4, 4, 16, seed=3)
    context = randn(2, 3, 16, seed=4)
    Y, A = F.multi_head_attention(x, W, W_O, n_heads=4, context=context, causal=True,
                                  need_weights=True)
    assert not torch.isnan(Y).any() and torch.equal(A[:, :, :3], torch.zeros_like(A[:, :, :3]))
