"""einattn.chunked: online-softmax attention over tiles of queries × keys equals equations
(2)–(4) as written (values and gradients of Q, K, V and a float mask), for every block
size, mask shape and causal alignment, and grouped-query K, V without a copy per head;
fully masked rows, NaN, empty sizes, gradcheck, what is saved for backward, the size of
the largest temporary, torch.compile, and the errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TOL, assert_close_scaled, randn

from einattn import EinattnError, MultiHeadAttention, chunked, impls, masks, patterns
from einattn import functional as F
from einattn.impls import tiles

F64, F32 = torch.float64, torch.float32
N, MU, A, A_V = 2, 3, 4, 5  # all distinct, V's channel count its own


def qkv(L_q, L_k, *, dtype=F64, n=N, seed=0, requires_grad=True):
    """Q, K, V with the strides of heads split off a projection: ``(n, τ, μ, a)`` transposed."""
    Q = randn(n, L_q, MU, A, seed=seed, dtype=dtype).transpose(1, 2)
    K = randn(n, L_k, MU, A, seed=seed + 1, dtype=dtype).transpose(1, 2)
    V = randn(n, L_k, MU, A_V, seed=seed + 2, dtype=dtype).transpose(1, 2)
    return tuple(t.detach().requires_grad_(requires_grad) for t in (Q, K, V))


def einsum_path(Q, K, V, *, mask=None, causal=False):
    """Equations (2)–(4) as written, (2g) and (4g) when K and V have fewer heads than Q: the
    S and A of every (τ, σ) at once."""
    n, n_heads, L_q, _ = Q.shape
    L_k = K.shape[2]
    if mask is not None:
        mask = masks.as_nmts(mask, name="mask", n=n, n_heads=n_heads, L_q=L_q, L_k=L_k,
                             dtype=Q.dtype)
    if causal:
        mask = masks.combine(mask, masks.causal_mask(L_q, L_k))
    return F.weighted_values(F.masked_softmax(F.attention_scores(Q, K), mask), V)


# Mask shapes as written by the caller, from (τ, σ) to 4-D with axes of size 1.
SHAPES = {"τσ": lambda n, Lq, Lk: (Lq, Lk), "nτσ": lambda n, Lq, Lk: (n, Lq, Lk),
          "nμτσ": lambda n, Lq, Lk: (n, MU, Lq, Lk), "n11σ": lambda n, Lq, Lk: (n, 1, 1, Lk),
          "1μτ1": lambda n, Lq, Lk: (1, MU, Lq, 1), "11τσ": lambda n, Lq, Lk: (1, 1, Lq, Lk)}
MASKS = [None] + [f"bool {s}" for s in SHAPES] + [f"float {s}" for s in SHAPES]


def make_mask(kind, L_q, L_k, *, dtype=F64, n=N, seed=7):
    """A mask of the named kind; one with a τ axis fully masks row 1 (of sample and head 0)."""
    if kind is None:
        return None
    polarity, axes = kind.split()
    shape = SHAPES[axes](n, L_q, L_k)
    allowed = randn(*shape, seed=seed) > -0.5  # about 70 % allowed
    if "τ" in axes and L_q > 1:
        allowed[(0,) * (len(shape) - 2) + (1,)] = False
    if polarity == "bool":
        return allowed
    values = randn(*shape, seed=seed + 1, dtype=dtype).masked_fill(~allowed, float("-inf"))
    return values.requires_grad_()


def compare(Q, K, V, *, mask=None, causal=False, block_size, tol):
    """chunked.attention against the einsum path: Z and the gradients of every input."""
    Z = chunked.attention(Q, K, V, mask=mask, causal=causal, block_size=block_size)
    Z_ref = einsum_path(Q, K, V, mask=mask, causal=causal)
    assert_close_scaled(Z, Z_ref, tol)
    leaves = [t for t in (Q, K, V, mask) if t is not None and t.requires_grad]
    if not leaves:
        return Z
    dZ = randn(*Z.shape, seed=11, dtype=Z.dtype)
    for got, want in zip(torch.autograd.grad(Z, leaves, dZ, retain_graph=True),
                         torch.autograd.grad(Z_ref, leaves, dZ), strict=True):
        assert_close_scaled(got, want, tol)
    return Z


LENGTHS = {"self": (10, 10), "cross-longer-keys": (10, 13), "cross-longer-queries": (13, 10)}


# Every mask with blocks of 3 and 7 (neither divides 10 or 13); blocks of 1 (every key its
# own block) and 64 (one partial block) with a mask of each kind.
FLOAT64_CASES = [(b, kind) for b in (3, 7) for kind in MASKS] + [
    (b, kind) for b in (1, 64) for kind in (None, "bool nμτσ", "float 1μτ1", "float n11σ")]


@pytest.mark.parametrize("block_size, kind", FLOAT64_CASES, ids=str)
@pytest.mark.parametrize("lengths", list(LENGTHS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_equals_the_einsum_path_float64(block_size, kind, lengths, causal):
    L_q, L_k = LENGTHS[lengths]
    Q, K, V = qkv(L_q, L_k)
    compare(Q, K, V, mask=make_mask(kind, L_q, L_k), causal=causal, block_size=block_size,
            tol=TOL[F64])


@pytest.mark.parametrize("block_size", [3, 64])
@pytest.mark.parametrize("lengths", list(LENGTHS))
@pytest.mark.parametrize("kind", [None, "bool nτσ", "float 1μτ1", "float nμτσ"], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_equals_the_einsum_path_float32(block_size, lengths, kind, causal):
    L_q, L_k = LENGTHS[lengths]
    Q, K, V = qkv(L_q, L_k, dtype=F32)
    compare(Q, K, V, mask=make_mask(kind, L_q, L_k, dtype=F32), causal=causal,
            block_size=block_size, tol=TOL[F32])


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float16, 4e-3)])
def test_half_precision_against_float64(dtype, tol):
    """Running max, sum and output accumulate in float32: the error is the inputs' rounding."""
    Q, K, V = qkv(33, 41, requires_grad=False)
    Z = chunked.attention(Q.to(dtype), K.to(dtype), V.to(dtype), causal=True, block_size=7)
    assert Z.dtype == dtype
    Z_ref = einsum_path(*(t.to(dtype).double() for t in (Q, K, V)), causal=True)
    assert (Z.double() - Z_ref).abs().max() <= tol


def test_block_size_does_not_change_the_result_beyond_rounding():
    Q, K, V = qkv(17, 23, requires_grad=False)
    Zs = [chunked.attention(Q, K, V, causal=True, block_size=b) for b in (1, 2, 5, 23, 1000)]
    for Z in Zs[1:]:
        assert_close_scaled(Z, Zs[0], TOL[F64])


# -- grouped-query attention: K[n g σ a], V[n g σ a] serve the r query heads of each group --


def gqa_qkv(L_q, L_k, *, g, r, dtype=F64, seed=20):
    """Q with μ = g·r heads, K and V with g, each with a projection's strides."""
    Q = randn(N, L_q, g * r, A, seed=seed, dtype=dtype).transpose(1, 2)
    K = randn(N, L_k, g, A, seed=seed + 1, dtype=dtype).transpose(1, 2)
    V = randn(N, L_k, g, A_V, seed=seed + 2, dtype=dtype).transpose(1, 2)
    return tuple(t.detach().requires_grad_() for t in (Q, K, V))


@pytest.mark.parametrize("g, r", [(2, 3), (3, 2), (1, 4)], ids=lambda v: str(v))
@pytest.mark.parametrize("lengths", list(LENGTHS))
@pytest.mark.parametrize("mask, causal", [(None, False), (None, True), ("bool nμτσ", True),
                                          ("float n11σ", False)], ids=str)
@pytest.mark.parametrize("block_size", [3, 64])
def test_grouped_query_equals_the_einsum_path_float64(g, r, lengths, mask, causal,
                                                      block_size):
    L_q, L_k = LENGTHS[lengths]
    Q, K, V = gqa_qkv(L_q, L_k, g=g, r=r)
    if mask is not None:  # a mask over the μ = g·r query heads
        polarity, _ = mask.split()
        allowed = randn(N, g * r, L_q, L_k, seed=8) > -0.5
        allowed[0, 1, 1] = False  # a fully masked row
        mask = allowed if polarity == "bool" else \
            randn(N, 1, 1, L_k, seed=9).requires_grad_()
    compare(Q, K, V, mask=mask, causal=causal, block_size=block_size, tol=TOL[F64])


def test_grouped_query_keys_and_values_are_used_without_a_copy():
    """functional.attention hands K[n g σ a] and V[n g σ a] to chunked as they are: no tensor
    of the repeated shape (n, μ, σ, a) is made or saved, and the saved K and V are the
    caller's."""
    Q, K, V = gqa_qkv(9, 11, g=2, r=3)
    made = largest_outputs(lambda: F.attention(
        Q, K, V, causal=True, impl="chunked", block_size=4).sum().backward())
    # no (n, μ = 6, σ = 11, ·): K or V repeated per query head (a tile's [(n μ) ...] may be)
    assert not any(len(shape) == 4 and shape[1:3] == (6, 11) for shape in made)
    saved = saved_for_backward(lambda: F.attention(
        Q, K, V, causal=True, impl="chunked", block_size=4))
    pointers = {t.data_ptr() for t in saved}
    assert K.data_ptr() in pointers and V.data_ptr() in pointers
    assert all(t.shape[1] in (2, 6) for t in saved)  # g or μ heads, never K repeated


@pytest.mark.parametrize("context", [False, True], ids=["self", "cross"])
def test_grouped_query_layer_equals_the_einsum_path(context):
    torch.manual_seed(0)
    layer = MultiHeadAttention(24, 6, n_kv_heads=2, causal=True, bias=True, block_size=4,
                               dtype=F64)
    x = randn(N, 11, 24, seed=1, requires_grad=True)
    c = randn(N, 7, 24, seed=2, requires_grad=True) if context else None
    allowed = randn(N, 11, 7 if context else 11, seed=3) > -0.5
    leaves = [x, *([c] if context else []), *layer.parameters()]
    Y, Y_ref = (layer(x, c, mask=allowed, impl=impl) for impl in ("chunked", "einsum"))
    assert_close_scaled(Y, Y_ref, TOL[F64])
    dY = randn(*Y.shape, seed=4)
    for got, want in zip(torch.autograd.grad(Y, leaves, dY),
                         torch.autograd.grad(Y_ref, leaves, dY), strict=True):
        assert_close_scaled(got, want, TOL[F64])


# -- a few queries: split keys (decoding) ----------------------------------------------------


def tiles_refused(*args):
    raise AssertionError("a few queries whose keys fit one wide tile ran the tile loop")


@pytest.mark.parametrize("kind", [None, "bool nμτσ", "float n11σ", "bool 11τσ"], ids=str)
@pytest.mark.parametrize("L_q, L_k, block_size", [(1, 37, 8), (3, 37, 8), (8, 24, 8),
                                                  (1, 37, 64), (2, 5, 3)], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_split_keys_equal_the_einsum_path(kind, L_q, L_k, block_size, causal, monkeypatch):
    """Up to SPLIT_QUERIES queries take the split keys (blocks of block_size, the last one
    short or the only one), never the tile loop: Z and every gradient equal equations
    (2)–(4) as written (the backward recomputes over tiles from the split forward's lse)."""
    monkeypatch.setattr(tiles, "_tiled_forward", tiles_refused)
    Q, K, V = qkv(L_q, L_k)
    compare(Q, K, V, mask=make_mask(kind, L_q, L_k), causal=causal, block_size=block_size,
            tol=TOL[F64])


PATTERNS = {"window": dict(window=5), "softcap": dict(softcap=1.5), "alibi": dict(alibi=True),
            "sinks": dict(sinks=torch.tensor([0.3, -1.0, float("-inf")], dtype=F64)),
            "documents": dict(document_ids=torch.tensor([[0] * 20 + [1] * 17] * N))}


@pytest.mark.parametrize("name", list(PATTERNS))
@pytest.mark.parametrize("L_q", [1, 4])
def test_split_keys_take_every_pattern(name, L_q, monkeypatch):
    """Causal with each term of equation (3): a window's band alone is read (its reach), a
    sink is one more block, documents and ALiBi are evaluated over the reach."""
    Q, K, V = qkv(L_q, 37, requires_grad=False)
    pattern = patterns.build(n=N, n_heads=MU, L_q=L_q, L_k=37, dtype=F64, device=Q.device,
                             causal=True, **PATTERNS[name])
    want = impls.chunked._dense(Q, K, V, None, pattern)
    monkeypatch.setattr(tiles, "_tiled_forward", tiles_refused)
    got, lse = chunked.forward(Q, K, V, None, pattern, 8)
    assert_close_scaled(got, want, TOL[F64])
    assert torch.isfinite(lse).all()


def test_split_keys_of_a_row_with_no_key_give_zeros_and_minus_infinity():
    Q, K, V = qkv(2, 11, requires_grad=False)
    mask = torch.ones(2, 11, dtype=torch.bool)
    mask[1] = False
    Z, lse = chunked.forward(Q, K, V, masks.as_nmts(mask, name="mask", n=N, n_heads=MU,
                                                     L_q=2, L_k=11, dtype=F64),
                             patterns.build(n=N, n_heads=MU, L_q=2, L_k=11, dtype=F64,
                                            device=Q.device), 4)
    assert torch.equal(Z[:, :, 1], torch.zeros_like(Z[:, :, 1]))
    assert (lse[:, :, 1] == float("-inf")).all() and torch.isfinite(lse[:, :, 0]).all()


# -- fully masked rows: exact zeros, zero and finite gradients --------------------------


def dead_row_cases():
    L_q, L_k = 6, 5
    rows = torch.zeros(L_q, L_k, dtype=torch.bool)
    rows[[0, 3]] = True
    allowed = ~rows
    additive = torch.zeros(L_q, L_k, dtype=F64).masked_fill(rows, float("-inf"))
    return {  # name: (L_q, L_k, kwargs, dead rows)
        "bool": (L_q, L_k, dict(mask=allowed), [0, 3]),
        "float": (L_q, L_k, dict(mask=additive.requires_grad_()), [0, 3]),
        "causal more queries": (9, 4, dict(causal=True), [0, 1, 2, 3, 4]),
        "causal and bool": (9, 4, dict(causal=True, mask=torch.ones(9, 4, dtype=torch.bool)
                                       .index_fill(0, torch.tensor([7]), False)),
                            [0, 1, 2, 3, 4, 7]),
        "no keys": (4, 0, dict(), [0, 1, 2, 3]),
        "no keys causal": (4, 0, dict(causal=True), [0, 1, 2, 3]),
    }


@pytest.mark.parametrize("name", list(dead_row_cases()))
@pytest.mark.parametrize("block_size", [1, 2, 64])
def test_fully_masked_rows_are_exact_zeros_with_zero_gradients(name, block_size):
    L_q, L_k, kwargs, dead = dead_row_cases()[name]
    Q, K, V = qkv(L_q, L_k)
    Z = compare(Q, K, V, block_size=block_size, tol=TOL[F64], **kwargs)
    assert torch.equal(Z[:, :, dead], torch.zeros_like(Z[:, :, dead]))
    live = [t for t in range(L_q) if t not in dead]
    assert torch.isfinite(Z).all() and (Z[:, :, live] != 0).any(-1).all()
    mask = kwargs.get("mask")
    leaves = [t for t in (Q, K, V, mask) if t is not None and t.requires_grad]
    grads = torch.autograd.grad(Z, leaves, torch.ones_like(Z))
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.equal(grads[0][:, :, dead], torch.zeros_like(grads[0][:, :, dead]))
    if mask is not None and mask.requires_grad:
        dM = grads[-1]
        assert torch.equal(dM[dead], torch.zeros_like(dM[dead]))


def test_a_head_with_no_admissible_key_is_zero():
    Q, K, V = qkv(5, 7)
    allowed = torch.ones(1, MU, 1, 7, dtype=torch.bool)
    allowed[0, 1] = False
    Z = compare(Q, K, V, mask=allowed, block_size=3, tol=TOL[F64])
    assert torch.equal(Z[:, 1], torch.zeros_like(Z[:, 1])) and (Z[:, 0] != 0).all()


# -- NaN propagates from admissible inputs, and only from them ---------------------------


def compare_with_nan(Q, K, V, *, mask=None, causal=False, block_size=3):
    """Z NaN exactly where the einsum path's is. Gradients: the einsum path's ``A = 0`` at a
    causally blocked position still multiplies a NaN of its row (0 · NaN), where the chunked
    path skips that part of a block; so a chunked gradient is NaN only where the einsum one
    is, and equal wherever that one is finite."""
    Z = chunked.attention(Q, K, V, mask=mask, causal=causal, block_size=block_size)
    Z_ref = einsum_path(Q, K, V, mask=mask, causal=causal)
    assert_close_scaled(Z, Z_ref, TOL[F64])
    dZ = randn(*Z.shape, seed=11)
    for got, want in zip(torch.autograd.grad(Z, (Q, K, V), dZ),
                         torch.autograd.grad(Z_ref, (Q, K, V), dZ), strict=True):
        assert not (torch.isnan(got) & ~torch.isnan(want)).any()
        finite = ~torch.isnan(want)
        assert_close_scaled(got[finite], want[finite], TOL[F64])
    return Z


def test_nan_in_an_admissible_query_makes_its_row_nan():
    Q, K, V = qkv(6, 8)
    with torch.no_grad():
        Q[1, 2, 3, 0] = float("nan")
    Z = compare_with_nan(Q, K, V, causal=True)
    assert torch.isnan(Z[1, 2, 3]).all()
    assert torch.isnan(Z).sum() == A_V  # one row of one head of one sample


def test_nan_in_a_key_reaches_exactly_the_queries_that_may_see_it():
    Q, K, V = qkv(6, 8)
    with torch.no_grad():
        K[0, 1, 4, 2] = float("nan")
    Z = compare_with_nan(Q, K, V, causal=True)
    may_see = masks.causal_mask(6, 8)[:, 4]  # rows τ with 4 ≤ τ + 2
    assert torch.isnan(Z[0, 1]).all(-1).tolist() == may_see.tolist()
    assert not torch.isnan(Z[1]).any() and not torch.isnan(Z[0, 0]).any()


def test_nan_in_a_value_reaches_every_row():
    Q, K, V = qkv(4, 9)
    with torch.no_grad():
        V[0, 0, 8, 1] = float("nan")
    Z = compare_with_nan(Q, K, V, block_size=4)
    assert torch.isnan(Z[0, 0, :, 1]).all() and not torch.isnan(Z[0, 0, :, 0]).any()


def test_nan_in_a_masked_out_key_does_not_poison_the_row():
    Q, K, V = qkv(5, 7)
    with torch.no_grad():
        K[0, 0, 6] = float("nan")
    allowed = torch.ones(5, 7, dtype=torch.bool)
    allowed[:, 6] = False
    assert torch.isfinite(compare_with_nan(Q, K, V, mask=allowed)).all()
    Z = compare_with_nan(Q, K, V, causal=True)  # key 6 is seen by row 4 alone
    assert torch.isnan(Z[0, 0, 4]).all() and torch.isfinite(Z[0, 0, :4]).all()


# -- empty sizes --------------------------------------------------------------------------


@pytest.mark.parametrize("n, L_q, L_k", [(0, 5, 6), (2, 0, 6), (2, 5, 0), (2, 0, 0)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_empty_sizes(n, L_q, L_k, causal):
    Q, K, V = qkv(L_q, L_k, n=n)
    Z = compare(Q, K, V, causal=causal, block_size=3, tol=TOL[F64])
    assert Z.shape == (n, MU, L_q, A_V)
    assert torch.equal(Z, torch.zeros_like(Z))


@pytest.mark.parametrize("L_q", [3, 13], ids=["split keys", "tiles"])
def test_values_of_no_channel(L_q):
    """``V[n g σ a]`` with ``a = 0``: ``Z`` of no channel and zero gradients, as the einsum
    path gives (the bound of the unshifted tiles reads ``max |V|``: none here)."""
    Q, K, _ = qkv(L_q, 10)
    V = randn(N, MU, 10, 0, seed=2, requires_grad=True)
    Z = compare(Q, K, V, causal=True, block_size=3, tol=TOL[F64])
    assert Z.shape == (N, MU, L_q, 0)


@pytest.mark.parametrize("n, block_size", [(1, 3), (2, 3), (2, 256)])
@pytest.mark.parametrize("dtype", [F64, torch.bfloat16], ids=str)
def test_gradients_come_back_contiguous(n, block_size, dtype):
    """dQ, dK, dV in the shapes of Q, K, V, contiguous: the tiles read Q's own memory where
    they can (n = 1: a projection's Q is a view whose heads merge with n) and keep dK, dV as
    ``[(n g) a σ]`` for tiles of 256 (a copy to float32 makes bfloat16's contiguous anyway)."""
    Q, K, V = qkv(7, 9, n=n, dtype=dtype)
    Z = chunked.attention(Q, K, V, causal=True, block_size=block_size)
    for grad, T in zip(torch.autograd.grad(Z, (Q, K, V), torch.ones_like(Z)), (Q, K, V),
                       strict=True):
        assert grad.shape == T.shape and grad.dtype == dtype
        assert grad.is_contiguous(), grad.stride()


# -- gradcheck in float64 -----------------------------------------------------------------


@pytest.mark.parametrize("L_q, L_k, causal", [(3, 5, False), (3, 5, True), (5, 3, True),
                                              (4, 4, True)])
def test_gradcheck(L_q, L_k, causal):
    Q, K, V = (randn(1, 2, L, a, seed=s, requires_grad=True)
               for s, (L, a) in enumerate([(L_q, 3), (L_k, 3), (L_k, 2)]))
    assert torch.autograd.gradcheck(
        lambda Q, K, V: chunked.attention(Q, K, V, causal=causal, block_size=2), (Q, K, V))


def test_gradcheck_grouped_query():
    Q = randn(1, 4, 4, 3, seed=0, requires_grad=True)  # μ = 4 query heads, g = 2 groups
    K, V = (randn(1, 2, 5, a, seed=s, requires_grad=True) for s, a in [(1, 3), (2, 2)])
    assert torch.autograd.gradcheck(
        lambda Q, K, V: chunked.attention(Q, K, V, causal=True, block_size=2), (Q, K, V))


def test_gradcheck_with_masks():
    Q, K, V = (randn(2, 2, L, 3, seed=s, requires_grad=True) for s, L in enumerate([4, 5, 5]))
    M = randn(2, 1, 4, 5, seed=5, requires_grad=True)  # float: its gradient is checked too
    allowed = randn(2, 2, 4, 5, seed=6) > -0.5
    allowed[1, 0, 2] = False  # one fully masked row
    assert torch.autograd.gradcheck(
        lambda Q, K, V, M: chunked.attention(Q, K, V, mask=M, causal=True, block_size=2),
        (Q, K, V, M))
    assert torch.autograd.gradcheck(
        lambda Q, K, V: chunked.attention(Q, K, V, mask=allowed, block_size=3), (Q, K, V))


def test_second_derivatives_are_those_of_the_dense_equations():
    """With create_graph the backward runs the dense equations, which autograd differentiates
    again (the tiled backward reads the saved lse, which has no graph: it would give zeros)."""
    Q, K, V = (randn(2, 2, L, 3, seed=s, requires_grad=True) for s, L in enumerate([4, 5, 5]))
    M = randn(2, 1, 4, 5, seed=5, requires_grad=True)
    assert torch.autograd.gradgradcheck(
        lambda Q, K, V, M: chunked.attention(Q, K, V, mask=M, causal=True, block_size=2),
        (Q, K, V, M))


# -- memory: nothing of L_q × L_k elements is saved for backward ----------------------------


def saved_for_backward(f, *inputs):
    """Every tensor autograd saves while ``f(*inputs)`` runs."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        f(*inputs)
    return saved


@pytest.mark.parametrize("kind", [None, "bool nμτσ", "float 1μτ1"], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_saves_nothing_of_size_L_q_by_L_k(kind, causal):
    L_q, L_k = 48, 80  # a = 4 and 5: every O(L·d) tensor is far smaller than L_q × L_k
    Q, K, V = qkv(L_q, L_k)
    mask = make_mask(kind, L_q, L_k)
    saved = saved_for_backward(
        lambda: chunked.attention(Q, K, V, mask=mask, causal=causal, block_size=16))
    inputs = {t.data_ptr() for t in (Q, K, V, mask) if t is not None}
    created = [t for t in saved if t.data_ptr() not in inputs]  # Z and lse
    assert sorted(tuple(t.shape) for t in created) == [(N, MU, L_q), (N, MU, L_q, A_V)]
    assert all(t.numel() < L_q * L_k for t in saved if t.data_ptr() not in inputs)
    # The einsum path, by contrast, keeps S and A (L_q × L_k per head): the probe sees them.
    reference = saved_for_backward(lambda: einsum_path(Q, K, V, mask=mask, causal=causal))
    assert any(t.shape[-2:] == (L_q, L_k) and t.numel() >= N * MU * L_q * L_k
               for t in reference)


def test_the_saved_mask_is_the_callers_mask_not_a_copy():
    Q, K, V = qkv(6, 7)
    mask = make_mask("bool nμτσ", 6, 7)
    saved = saved_for_backward(lambda: chunked.attention(Q, K, V, mask=mask, block_size=3))
    assert next(t for t in saved if t.dtype == torch.bool).data_ptr() == mask.data_ptr()


def largest_outputs(f):
    """The shape of every tensor an aten op returns while ``f()`` runs, largest first."""
    from torch.utils._python_dispatch import TorchDispatchMode

    shapes = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    shapes.append(tuple(t.shape))
            return out

    with Record():
        f()
    return sorted(shapes, key=lambda shape: -torch.Size(shape).numel())


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_no_temporary_spans_every_query_of_a_key_block(causal):
    """Forward and backward create nothing larger than one tile of block_size queries ×
    SPAN · block_size keys per head (neighbouring tiles of a row run as one product), or
    an O(L·a) tensor such as Z, dQ, dK, dV, dZ⁺: never the L_q × block_size scores of all
    queries against one key block, nor a row of all keys."""
    L, b = 96, 8  # per head: a tile is 8 × 32 numbers, Z 480, L × b would be 768
    Q, K, V = qkv(L, L)
    made = largest_outputs(
        lambda: chunked.attention(Q, K, V, causal=causal, block_size=b).sum().backward())
    # Z, dV, and the backward's dZ⁺ = [dZ | −D] and v⁺ = [V | 1]: O(L·a)
    assert torch.Size(made[0]).numel() == N * MU * L * (A_V + 1)
    assert not any(len(shape) >= 3 and (shape[-2:] == (L, b) or shape[-2:] == (b, L))
                   for shape in made)
    tiles = [s for s in made if len(s) >= 3 and s[-2] == b and s[-1] % b == 0]
    assert max(torch.Size(s).numel() for s in tiles) == N * MU * b * chunked.SPAN * b



def test_a_causal_span_masks_only_its_last_block():
    """A causal row of tiles runs as one span of SPAN key blocks whose keys every query of
    the row sees but those of its last block: the plan's mask covers that block alone (its
    columns from c0 on, the first one seen by every query of the row), and the span's
    weights are the dense causal softmax's."""
    L, b = 40, 4
    pattern = patterns.build(n=N, n_heads=MU, L_q=L, L_k=L, dtype=F64,
                             device=torch.device("cpu"), causal=True, pattern=None)
    planned = impls.tile_plan.plan(pattern, b, F64)
    masked = [tile for tile in planned if tile.keep is not None]
    assert masked and all(tile.s1 - tile.s0 - tile.c0 == tile.keep.shape[-1] == b - 1
                          for tile in masked)  # the diagonal block less its first key
    assert max(tile.s1 - tile.s0 for tile in masked) > b
    Q, K, V = qkv(L, L)
    assert_close_scaled(chunked.attention(Q, K, V, causal=True, block_size=b),
                        einsum_path(Q, K, V, causal=True), TOL[F64])


# -- torch.compile -------------------------------------------------------------------------


def test_compiles_to_one_graph_forward_and_backward():
    """The autograd.Function traces whole under dynamo (aot_eager keeps it fast; the
    layer-level inductor compile is in tests/test_impls.py)."""
    torch._dynamo.reset()
    Q, K, V = qkv(7, 9)
    mask = make_mask("float n11σ", 7, 9)

    def f(Q, K, V, mask):
        return chunked.attention(Q, K, V, mask=mask, causal=True, block_size=4)

    compiled = torch.compile(f, fullgraph=chunked.TRACEABLE, backend="aot_eager")
    Z, Z_ref = compiled(Q, K, V, mask), f(Q, K, V, mask)
    assert_close_scaled(Z, Z_ref, TOL[F64])
    dZ = randn(*Z.shape, seed=3)
    leaves = (Q, K, V, mask)
    for got, want in zip(torch.autograd.grad(Z, leaves, dZ),
                         torch.autograd.grad(Z_ref, leaves, dZ), strict=True):
        assert_close_scaled(got, want, TOL[F64])
    torch._dynamo.reset()


def test_before_torch_2_13_the_function_runs_outside_the_graph(monkeypatch):
    """Where dynamo's traced backward is not trusted (torch < 2.13: 3.0 off on 2.11), the
    Function breaks the graph: gradients exact without fullgraph, fullgraph refused."""
    monkeypatch.setattr(impls.chunked, "TRACEABLE", False)
    torch._dynamo.reset()
    Q, K, V = qkv(7, 9)

    def f(Q, K, V):
        return chunked.attention(Q, K, V, causal=True, block_size=4)

    dZ = randn(*Q.shape[:3], V.shape[3], seed=3)
    got = torch.autograd.grad(torch.compile(f, backend="aot_eager")(Q, K, V), (Q, K, V), dZ)
    for g, want in zip(got, torch.autograd.grad(f(Q, K, V), (Q, K, V), dZ), strict=True):
        assert_close_scaled(g, want, TOL[F64])
    torch._dynamo.reset()
    with pytest.raises(Exception, match="disable"):
        torch.compile(f, fullgraph=True, backend="aot_eager")(Q, K, V)
    torch._dynamo.reset()


# -- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [0, -3, 2.0, True, "4", None])
def test_block_size_must_be_a_positive_int(block_size):
    Q, K, V = qkv(3, 4)
    with pytest.raises(EinattnError, match=r"block_size .*must be a positive int, got"):
        chunked.attention(Q, K, V, block_size=block_size)


def test_bad_operands_are_named():
    Q, K, V = qkv(3, 4, requires_grad=False)
    cases = [
        (dict(Q=Q[0]), r"Q must be 4-D Q\[n μ τ a\], got \(3, 3, 4\)"),
        (dict(V=V.tolist()), r"V must be 4-D V\[n g σ a\], got list"),
        (dict(K=K[..., :3]), r"index 'a' has size 3 in K but 4 in Q"),
        (dict(V=V[:, :, :2]), r"index 'σ' has size 2 in V but 4 in K"),
        (dict(K=K[:, :2], V=V[:, :2]), r"group \(g r\) of Q has length 3, not divisible by g=2"),
        (dict(K=K[:, :1]), r"index 'g' has size 3 in V but 1 in K"),
        (dict(mask=torch.ones(5, 4, dtype=torch.bool)),
         r"index 'τ' has size 5 in mask but 3 in the scores"),
        (dict(mask=torch.ones(3, 4, dtype=F32)), r"mask is torch.float32 but the scores are"),
    ]
    for changes, message in cases:
        args = dict(Q=Q, K=K, V=V) | changes
        mask = args.pop("mask", None)
        with pytest.raises(EinattnError, match=message):
            chunked.attention(args["Q"], args["K"], args["V"], mask=mask)


# -- docs/chunked.md shows the equations the code runs ---------------------------------------


def test_docs_show_the_equations_the_code_runs():
    doc = (Path(__file__).resolve().parent.parent / "docs" / "chunked.md").read_text("utf-8")
    for equation in (F.SCORES_GQA, F.VALUES_GQA, chunked.VALUE_GRADS, chunked.PROB_GRADS,
                     chunked.QUERY_GRADS, chunked.KEY_GRADS):
        assert equation.text in doc, equation


def test_the_online_softmax_equations_over_tiles_are_the_softmax():
    """RUNNING_MAX, WEIGHTS, RESCALE, RUNNING_SUM and RUNNING_VALUES, run tile by tile over
    three blocks of keys (the first fully masked for one row, from m = −∞), end at
    Z = O / l = softmax_σ(S) V with GQA; WEIGHTS equals the tile loop's in-place form."""
    n, g, r, L_q, a = 2, 3, 2, 5, 4
    S = randn(n, g * r, L_q, 11, seed=1)
    S[0, 4, 2, :4] = -torch.inf  # this row sees no key in the first block
    V = randn(n, g, 11, a, seed=2)
    m = torch.full((n, g * r, L_q), -torch.inf, dtype=torch.float64)
    total, out = torch.zeros_like(m), torch.zeros(n, g * r, L_q, a, dtype=torch.float64)
    for keys in (slice(0, 4), slice(4, 7), slice(7, 11)):
        S_b = S[..., keys]
        m_new = chunked.RUNNING_MAX(m=m, S=S_b)
        m_safe = m_new.masked_fill(m_new == -torch.inf, 0.0)
        P = chunked.WEIGHTS(S=S_b, m_new=m_safe)
        assert torch.equal(P, S_b.clone().sub_(m_safe[..., None]).exp_())
        c = chunked.RESCALE(m=m, m_new=m_safe)
        total = chunked.RUNNING_SUM(c=c, l=total, P=P)
        out = chunked.RUNNING_VALUES(c=c, O=out, P=P, V_b=V[:, :, keys])
        m = m_new
    A = torch.softmax(S, dim=-1)
    expected = (A.unflatten(1, (g, r)) @ V[:, :, None]).flatten(1, 2)
    assert_close_scaled(out / total[..., None], expected, TOL[torch.float64])
    assert_close_scaled(m + total.log(), S.logsumexp(-1), TOL[torch.float64])


def test_a_bounded_tiles_backward_is_five_products_and_two_passes():
    """Where the scores are bounded and nothing is masked, each tile of the backward makes
    four tensors of the tile's size: S (a product), exp(S) (a pass), dZ⁺ V⁺ᵀ = dP − D (a
    product) and dS = P ∘ (dP − D) (a pass); dV, dQ and dK are products into their rows.
    The subtraction of D as a pass of its own (five of the tile's size) is gone."""
    from torch.utils._python_dispatch import TorchDispatchMode

    L, b = 32, 8  # one row of tiles is one product of SPAN = 4 key blocks
    Q, K, V = qkv(L, L)
    Z = chunked.attention(Q, K, V, block_size=b)
    tile = (N * MU, b, chunked.SPAN * b)
    made = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and tuple(out.shape) == tile \
                    and not func.is_view:  # what computes, not the views of its memory
                made.append(func.__name__)
            return out

    with Record():
        Z.backward(torch.ones_like(Z))
    assert sorted(made) == sorted(["baddbmm_.default", "exp_.default", "baddbmm_.default",
                                   "mul_.Tensor"] * (L // b))
