"""einattn.masks: causal alignment, the additive form, combine, broadcasting and errors."""

from __future__ import annotations

import pytest
import torch
from conftest import here, randn

from einattn import EinattnError, masks
from einattn import functional as F

INF = float("inf")


def test_causal_mask_is_aligned_bottom_right():
    # query τ sits at absolute position τ + L_k − L_q = τ + 2
    assert torch.equal(masks.causal_mask(3, 5), torch.tensor([
        [True, True, True, False, False],
        [True, True, True, True, False],
        [True, True, True, True, True]]))
    assert masks.causal_mask(3, 5).dtype == torch.bool


def test_causal_mask_with_more_queries_than_keys_masks_the_first_rows():
    assert torch.equal(masks.causal_mask(5, 3), torch.tensor([
        [False, False, False],
        [False, False, False],
        [True, False, False],
        [True, True, False],
        [True, True, True]]))


@pytest.mark.parametrize("L", [1, 4, 7])
def test_square_causal_mask_is_lower_triangular(L):
    tril = torch.ones(L, L, dtype=torch.bool).tril()
    assert torch.equal(masks.causal_mask(L), tril)
    assert torch.equal(masks.causal_mask(L, L), tril)


@pytest.mark.parametrize("L_q, L_k", [(4, 4), (3, 5), (5, 3), (1, 6)])
def test_causal_mask_matches_its_definition(L_q, L_k):
    m = masks.causal_mask(L_q, L_k)
    assert m.shape == (L_q, L_k)
    for tau in range(L_q):
        for sigma in range(L_k):
            assert bool(m[tau, sigma]) == (sigma <= tau + L_k - L_q)


@pytest.mark.parametrize("L_q, L_k", [(4, 4), (3, 5), (5, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_additive_causal_mask_is_the_bool_mask_converted(L_q, L_k, dtype):
    M = masks.additive_causal_mask(L_q, L_k, dtype=dtype)
    allowed = masks.causal_mask(L_q, L_k)
    assert M.dtype == dtype and M.shape == (L_q, L_k)
    assert (M[allowed] == 0).all() and (M[~allowed] == -INF).all()
    expected = torch.full((L_q, L_k), -INF, dtype=dtype).triu(L_k - L_q + 1)
    assert torch.equal(M, expected)
    S = randn(2, 3, L_q, L_k, seed=1, dtype=dtype)
    assert torch.equal(F.masked_softmax(S, M), F.masked_softmax(S, allowed))


def test_additive_causal_mask_default_is_square_float32():
    M = masks.additive_causal_mask(3)
    assert M.dtype == torch.float32
    assert torch.equal(M, torch.tensor([[0, -INF, -INF], [0, 0, -INF], [0, 0, 0]]))


# -- combine ----------------------------------------------------------------------------------

b1 = torch.tensor([[True, True, False], [False, True, True]])
b2 = torch.tensor([[True, False, True], [False, True, True]])
f1 = torch.tensor([[0.5, -1.0, 2.0], [-INF, 3.0, 0.0]])
f2 = torch.tensor([[1.0, 1.0, -INF], [0.25, 0.5, 0.75]])


def test_combine_of_nothing_is_none():
    assert masks.combine() is None
    assert masks.combine(None, None) is None


def test_combine_of_one_mask_is_that_mask():
    assert masks.combine(None, b1, None) is b1
    assert masks.combine(f1, None) is f1


def test_combine_ands_boolean_masks():
    assert torch.equal(masks.combine(b1, b2), b1 & b2)
    assert torch.equal(masks.combine(b1, b2), torch.tensor([[True, False, False],
                                                            [False, True, True]]))


def test_combine_adds_float_masks():
    assert torch.equal(masks.combine(f1, f2), torch.tensor([[1.5, 0.0, -INF],
                                                            [-INF, 3.5, 0.75]]))


def test_combine_float_with_bool_keeps_values_where_allowed():
    expected = torch.tensor([[0.5, -1.0, -INF], [-INF, 3.0, 0.0]])
    assert torch.equal(masks.combine(f1, b1), expected)
    assert torch.equal(masks.combine(b1, f1), expected)  # order does not matter
    assert torch.equal(masks.combine(b1, f1, b2, f2),
                       torch.tensor([[1.5, -INF, -INF], [-INF, 3.5, 0.75]]))


def test_combine_broadcasts():
    small = torch.tensor([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]])  # (τ, σ)
    big = torch.ones(2, 1, 2, 3, dtype=torch.bool)  # (n, μ, τ, σ)
    big[1, 0, 0, 2] = False
    out = masks.combine(small, big)
    assert out.shape == (2, 1, 2, 3)
    assert torch.equal(out[0, 0], small)
    assert out[1, 0, 0, 2] == -INF and out[1, 0, 1, 2] == 5.0
    assert masks.combine(b1, big).shape == (2, 1, 2, 3)


# -- as_nmts -----------------------------------------------------------------------------------

SHAPE = dict(n=2, n_heads=3, L_q=4, L_k=5, dtype=torch.float64)


@pytest.mark.parametrize("shape, expected", [
    ((4, 5), (1, 1, 4, 5)),
    ((2, 4, 5), (2, 1, 4, 5)),
    ((2, 3, 4, 5), (2, 3, 4, 5)),
    ((1, 5), (1, 1, 1, 5)),
    ((4, 1), (1, 1, 4, 1)),
    ((1, 4, 5), (1, 1, 4, 5)),
    ((2, 1, 5), (2, 1, 1, 5)),
    ((1, 1, 1, 5), (1, 1, 1, 5)),
    ((2, 3, 1, 5), (2, 3, 1, 5)),
    ((1, 3, 4, 1), (1, 3, 4, 1)),
])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_as_nmts_views_masks_as_n_mu_tau_sigma(shape, expected, kind):
    mask = randn(*shape, seed=1) > 0 if kind == "bool" else randn(*shape, seed=1)
    full = masks.as_nmts(mask, name="mask", **SHAPE)
    assert full.shape == expected
    assert full.dtype == mask.dtype
    assert torch.equal(full.reshape(mask.shape), mask)  # same values, axes only inserted
    full.expand(2, 3, 4, 5)  # and it broadcasts to the scores


def test_a_3d_mask_is_per_sample_not_per_head():
    """(n, τ, σ): its first axis is n, whatever torch's right-aligned broadcast would say."""
    mask = torch.zeros(2, 4, 5, dtype=torch.bool)
    mask[1] = True
    full = masks.as_nmts(mask, name="mask", **SHAPE).expand(2, 3, 4, 5)
    assert not full[0].any() and full[1].all()
    with pytest.raises(EinattnError, match=r"index 'n' has size 3 in mask but 2"):
        masks.as_nmts(torch.ones(3, 4, 5, dtype=torch.bool), name="mask", **SHAPE)


AS_NMTS_ERRORS = {
    "not a tensor": ([[True]], r"attn_mask must be a torch.Tensor, got list"),
    "int dtype": (torch.ones(4, 5, dtype=torch.int64),
                  r"attn_mask must be bool \(True = may attend\) or float \(added to the scores\), "
                  r"got torch.int64; for a mask where 0 = blocked pass `attn_mask != 0`"),
    "float dtype": (torch.zeros(4, 5, dtype=torch.float32),
                    r"attn_mask is torch.float32 but the scores are torch.float64"),
    "1-D": (torch.ones(5, dtype=torch.bool),
            r"attn_mask has 1 axes \(5,\); expected \(τ, σ\), \(n, τ, σ\) or \(n, μ, τ, σ\)"),
    "5-D": (torch.ones(1, 2, 3, 4, 5, dtype=torch.bool), r"attn_mask has 5 axes \(1, 2, 3, 4, 5\)"),
    "n": (torch.ones(3, 3, 4, 5, dtype=torch.bool),
          r"attn_mask has shape \(3, 3, 4, 5\): index 'n' has size 3 in attn_mask but 2 in the "
          r"scores S\[n μ τ σ\] \(2, 3, 4, 5\)"),
    "μ": (torch.ones(2, 2, 4, 5, dtype=torch.bool), r"index 'μ' has size 2 in attn_mask but 3"),
    "τ": (torch.ones(5, 5, dtype=torch.bool), r"index 'τ' has size 5 in attn_mask but 4"),
    "σ": (torch.ones(2, 4, 4, dtype=torch.bool), r"index 'σ' has size 4 in attn_mask but 5"),
}


@pytest.mark.parametrize("mask, message", AS_NMTS_ERRORS.values(), ids=AS_NMTS_ERRORS.keys())
def test_as_nmts_errors(mask, message):
    with pytest.raises(EinattnError, match=message):
        masks.as_nmts(mask, name="attn_mask", **SHAPE)


# -- key padding -------------------------------------------------------------------------------


def test_from_key_padding_inverts_a_bool_mask():
    pad = torch.tensor([[False, False, False, True, True], [False] * 5])
    m = masks.from_key_padding(pad, **SHAPE)
    assert m.shape == (2, 1, 1, 5)
    assert torch.equal(m[:, 0, 0], ~pad)


@pytest.mark.parametrize("kpm, message", [
    (torch.zeros(2, 4, dtype=torch.bool), r"key_padding_mask has shape \(2, 4\) but must be "
                                          r"\(n, σ\) = \(2, 5\)"),
    (torch.zeros(5, dtype=torch.bool), r"key_padding_mask has shape \(5,\)"),
    ([[False]], r"key_padding_mask has shape list"),
    (torch.zeros(2, 5, dtype=torch.float64), r"key_padding_mask must be bool with True = "
                                             r"padding .* got torch.float64; .* attention_mask"),
    (torch.ones(2, 5, dtype=torch.int64), r"key_padding_mask=\(attention_mask == 0\)"),
    (torch.zeros(2, 5, dtype=torch.bool, device="meta"), r"key_padding_mask is on meta but "
                                                         rf"the scores are on {here()}"),
])
def test_from_key_padding_errors(kpm, message):
    with pytest.raises(EinattnError, match=message):
        masks.from_key_padding(kpm, **SHAPE, device=torch.empty(0).device)
