"""A user's functions as pieces, at their edges: what a ``MaskMod`` or a ``ScoreMod`` reads
besides its arguments (a global rebound, a tensor changed in place, a module's parameter),
a ``ScoreMod`` that masks a whole row with −∞ (FlexAttention's idiom), one that writes into
its score, and the memory of judging a ``MaskMod`` (:mod:`einattn._mods`,
:mod:`einattn._reads`).

Each result is checked against a dense float64 reference written here (forward and the
gradients of Q, K, V and of the tensors the functions read) on einsum, sdpa and chunked, at
tiles of 4 (and flex's forward where it keeps a BlockMask).
"""

from __future__ import annotations

import pytest
import torch
from conftest import TOL, assert_close_scaled, randn
from test_chunked import largest_outputs
from test_own_patterns import IMPLS, INF, N, qkv, reference

from einattn import EinattnError, KVCache, MultiHeadAttention, _mods, patterns
from einattn import functional as F
from einattn.impls import flex
from einattn.patterns import Causal, Mask, MaskMod, ScoreMod

F64 = torch.float64
MU, L = 6, 13
DOCS = torch.tensor([[0] * 5 + [1] * 8, [0] * 9 + [1] * 4])  # d[n σ], rebound below


def same_doc(b, h, q, kv):  # FlexAttention's document idiom, reading the global DOCS
    return DOCS[b, q] == DOCS[b, kv]


def documents(ids):
    return lambda b, h, t, s: ids[b, t] == ids[b, s]


# -- a kept judgement follows what the function reads ------------------------------------------


@pytest.mark.parametrize("which", ["a new MaskMod", "the same MaskMod"])
def test_a_global_rebound_is_judged_again(which):
    """The global the function reads is rebound between two calls: the second call sees the
    new documents (the old code kept the first judgement and skipped tiles the new
    documents see: 1.68 off)."""
    global DOCS
    Q, K, V = qkv(L, L, requires_grad=False)
    mod = MaskMod(same_doc)
    old = DOCS
    try:
        with torch.no_grad():
            F.attention(Q, K, V, pattern=mod, impl="chunked", block_size=4)
            DOCS = torch.tensor([[0] * 2 + [1] * 11, [0] * 11 + [1] * 2])
            again = mod if which == "the same MaskMod" else MaskMod(same_doc)
            Z = F.attention(Q, K, V, pattern=again, impl="chunked", block_size=4)
        assert_close_scaled(Z, reference(Q, K, V, documents(DOCS)), TOL[F64])
    finally:
        DOCS = old


def test_flex_keeps_no_block_mask_across_a_rebinding():
    """FlexAttention's BlockMask is built from the pattern's tiles of 128 and kept under the
    pattern's key: after the global is rebound the key is another and the tiles are the new
    documents' (old code: the same key, the old tiles, without queries 0–127 × keys
    256–299)."""
    global DOCS
    old = DOCS
    try:
        DOCS = torch.tensor([[0] * 150 + [1] * 150] * N)
        mod = MaskMod(same_doc)
        first = patterns.build(n=N, n_heads=MU, L_q=300, L_k=300, dtype=F64, device="cpu",
                               pattern=mod)
        first.tiles(flex.BLOCK)
        DOCS = torch.tensor([[0] * 297 + [1] * 3] * N)
        second = patterns.build(n=N, n_heads=MU, L_q=300, L_k=300, dtype=F64, device="cpu",
                                pattern=mod)
        assert second.key != first.key
        assert (0, 256) in {(t0, s0) for t0, _, s0, _, _ in second.tiles(flex.BLOCK)}
    finally:
        DOCS = old


def test_a_tensor_changed_in_place_is_judged_again():
    """The same MaskMod, its captured ids changed in place (their version moves)."""
    ids = DOCS.clone()
    mod = MaskMod(lambda b, h, q, kv: ids[b, q] == ids[b, kv])
    Q, K, V = qkv(L, L, requires_grad=False)
    with torch.no_grad():
        F.attention(Q, K, V, pattern=mod, impl="chunked", block_size=4)
        ids.zero_()  # one document: the tiles judged empty before are full now
        Z = F.attention(Q, K, V, pattern=mod, impl="chunked", block_size=4)
    assert_close_scaled(Z, reference(Q, K, V, documents(ids)), TOL[F64])


def test_a_maskmod_is_judged_in_blocks_of_rows(monkeypatch):
    """Judging a MaskMod (its tiles and each row's reach) evaluates it a block of rows at a
    time: nothing of L_q × L_k, even for the one tile of the whole call (old code: L × L)."""
    monkeypatch.setattr(_mods, "_ROWS", 8 * 96)  # 8 rows of 96 keys at a time
    Q = randn(1, 1, 96, 4, seed=1)
    mod = MaskMod(lambda b, h, q, kv: (kv <= q) & (q - kv < 16))
    with torch.no_grad():
        made = largest_outputs(lambda: F.attention(Q, Q, Q, pattern=mod, impl="chunked",
                                                   block_size=16))
        Z = F.attention(Q, Q, Q, pattern=mod, impl="chunked", block_size=16)
    assert max(torch.Size(s).numel() for s in made) < 96 * 96 / 4
    assert_close_scaled(Z, reference(Q, Q, Q, lambda b, h, t, s: (s <= t) & (t - s < 16)),
                        TOL[F64])


# -- a ScoreMod reading a module's parameter --------------------------------------------------


class RelativeBias(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(randn(MU, 2 * L - 1, seed=30))

    def score_mod(self, score, b, h, q, kv):
        return score + self.table[h, q - kv + L - 1]


RELATIVE = RelativeBias()


def _global_module_mod(s, b, h, q, kv):
    return s + RELATIVE.table[h, q - kv + L - 1]


@pytest.mark.parametrize("frozen", [False, True], ids=["qkv-grad", "qkv-frozen"])
@pytest.mark.parametrize("reader", ["bound method", "global module"])
@pytest.mark.parametrize("impl", IMPLS)
def test_a_module_parameter_gets_its_gradient(impl, reader, frozen):
    """``table.grad`` equals the reference's (old chunked code: None, or torch's in-place
    error with Q, K, V frozen)."""
    fn = RELATIVE.score_mod if reader == "bound method" else _global_module_mod
    Q, K, V = qkv(L, L, requires_grad=not frozen)
    Z = F.attention(Q, K, V, pattern=[ScoreMod(fn), Causal()], impl=impl, block_size=4)
    Z_ref = reference(Q, K, V, lambda b, h, t, s: s <= t,
                      lambda S, b, h, t, s: S + RELATIVE.table[h, t - s + L - 1])
    assert_close_scaled(Z, Z_ref, TOL[F64])
    dZ = randn(*Z.shape, seed=9)
    got, = torch.autograd.grad(Z, RELATIVE.table, dZ)
    want, = torch.autograd.grad(Z_ref, RELATIVE.table, dZ)
    assert_close_scaled(got, want, TOL[F64])


class Hidden:
    table = torch.zeros(MU, requires_grad=True)  # a class attribute: not searched


def test_a_tensor_read_where_it_is_not_found_is_refused_on_chunked():
    """Not a silent missing gradient: an EinattnError that says what to do."""
    mod = ScoreMod(lambda s, b, h, q, kv: s + Hidden.table[h])
    with pytest.raises(EinattnError, match=r"ScoreMod\(<lambda>\) reads a tensor of shape "
                                           r"\(6,\) that requires grad where einattn does not "
                                           r"find it.*use impl='einsum' or 'sdpa'"):
        F.attention(*qkv(L, L), pattern=mod, impl="chunked")
    with torch.no_grad():  # nothing to differentiate: it runs
        F.attention(*qkv(L, L), pattern=mod, impl="chunked")
    Z = F.attention(*qkv(L, L), pattern=mod, impl="einsum")
    assert torch.autograd.grad(Z.sum(), Hidden.table)[0] is not None


# -- a ScoreMod that masks a whole row with −∞ ----------------------------------------------


def _row_masked(s, b, h, q, kv):  # query position 2's whole row −∞
    return torch.where(q != 2, s, -INF)


@pytest.mark.parametrize("L_q", [6, 12], ids=["split-keys", "tiles"])
@pytest.mark.parametrize("impl", IMPLS)
def test_a_row_of_minus_infinity_gives_zeros_and_zero_gradients(impl, L_q):
    """As a fully masked row: exact zeros, every gradient finite and the reference's (old
    einsum and sdpa: NaN in Z and the gradients; chunked at ≤ 8 queries: NaN in Z)."""
    Q, K, V = qkv(L_q, L_q)
    Z = F.attention(Q, K, V, pattern=ScoreMod(_row_masked), impl=impl, block_size=4)
    Z_ref = reference(Q, K, V, lambda b, h, t, s: t != 2)
    assert torch.equal(Z[:, :, 2], torch.zeros_like(Z[:, :, 2]))
    assert_close_scaled(Z, Z_ref, TOL[F64])
    dZ = randn(*Z.shape, seed=9)
    for got, want in zip(torch.autograd.grad(Z, (Q, K, V), dZ),
                         torch.autograd.grad(Z_ref, (Q, K, V), dZ), strict=True):
        assert_close_scaled(got, want, TOL[F64])


@pytest.mark.parametrize("impl", IMPLS)
def test_a_row_of_minus_infinity_while_decoding(impl):
    """One-token steps with a KV cache equal the full forward, position 2's row zeros."""
    torch.manual_seed(0)
    layer = MultiHeadAttention(12, MU, d_head=5, n_kv_heads=3, dtype=F64, impl=impl,
                               block_size=4, causal=True, pattern=ScoreMod(_row_masked))
    x = randn(N, 7, 12, seed=5)
    cache = KVCache()
    with torch.no_grad():
        steps = [layer(x[:, :2], cache=cache)]
        steps += [layer(x[:, t:t + 1], cache=cache) for t in range(2, 7)]
        full = layer(x)
    assert_close_scaled(torch.cat(steps, dim=1), full, TOL[F64])
    assert not full.isnan().any()


# -- a ScoreMod that writes into its score ---------------------------------------------------

BIAS = randn(MU, seed=31)


def _add_in_place(s, b, h, q, kv):
    s += BIAS[h]
    return s


@pytest.mark.parametrize("impl", IMPLS)
def test_a_score_written_in_place_runs_on_every_impl(impl):
    """``s += bias[h]; return s``: forward and the gradients of Q, K, V and the bias equal
    the reference's (old chunked code: torch's "leaf Variable ... in-place" error)."""
    Q, K, V = qkv(L, L)
    BIAS.requires_grad_(True)
    try:
        Z = F.attention(Q, K, V, pattern=[ScoreMod(_add_in_place), Causal()], impl=impl,
                        block_size=4)
        Z_ref = reference(Q, K, V, lambda b, h, t, s: s <= t,
                          lambda S, b, h, t, s: S + BIAS[h])
        assert_close_scaled(Z, Z_ref, TOL[F64])
        dZ = randn(*Z.shape, seed=9)
        for got, want in zip(torch.autograd.grad(Z, (Q, K, V, BIAS), dZ),
                             torch.autograd.grad(Z_ref, (Q, K, V, BIAS), dZ), strict=True):
            assert_close_scaled(got, want, TOL[F64])
    finally:
        BIAS.requires_grad_(False)


def _cap_in_place(s, b, h, q, kv):
    return s.div_(2).tanh_().mul_(2)


@pytest.mark.parametrize("impl", IMPLS)
def test_an_in_place_chain_autograd_cannot_differentiate(impl):
    """``s.div_(2).tanh_().mul_(2)``: without grad it runs, equal to the reference; with
    grad an EinattnError says to return a new tensor (old code: torch's errors)."""
    Q, K, V = qkv(L, L, requires_grad=False)
    with torch.no_grad():
        Z = F.attention(Q, K, V, pattern=ScoreMod(_cap_in_place), impl=impl, block_size=4)
    assert_close_scaled(Z, reference(Q, K, V, lambda b, h, t, s: t >= 0,
                                     lambda S, *_: 2 * torch.tanh(S / 2)), TOL[F64])
    with pytest.raises(EinattnError, match=r"ScoreMod\(_cap_in_place\) writes into its score "
                                           r"in a way autograd cannot differentiate.*return a "
                                           r"new tensor"):
        F.attention(*qkv(L, L), pattern=ScoreMod(_cap_in_place), impl=impl,
                    block_size=4).sum().backward()


@pytest.mark.parametrize("name", ["n", "μ", "τ", "σ", "and", "not"])
def test_a_mask_parameter_named_as_an_index_is_refused(name):
    """``Mask("τ − σ < n ∧ σ ≤ τ", n=3)`` read n as the sample index (old code: every row
    masked, zeros, no error)."""
    with pytest.raises(EinattnError, match=rf"Mask parameter {name} is named as an index or "
                                           rf"a word of the predicate"):
        Mask("σ ≤ τ", **{name: 3})
