"""``nn.MultiheadAttention``'s options through ``from_torch`` and ``to_torch`` (issue 36, item
7): ``kdim ≠ vdim`` (einattn's ``d_context=(j, k)``: keys and values from contexts of their
own widths), ``add_bias_kv`` (``bias_kv``: one more key and value, seen by every query) and
``add_zero_attn`` (``zero_attn``: a sink of logit 0), each and all together, against torch
itself: forward (exact in float64), the per-head weights, every gradient, every impl, the
round trip. Sizes: n=2, L_q=5, L_k=7, E=12, μ=3 (a=4), kdim=9, vdim=11.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from einattn import EinattnError, KVCache, MultiHeadAttention, patterns
from tests.conftest import TOL, assert_close_scaled, randn

F64 = torch.float64
N, L_Q, L_K, E, H, KDIM, VDIM = 2, 5, 7, 12, 3, 9, 11
OPTIONS = {
    "kdim ≠ vdim": {"kdim": KDIM, "vdim": VDIM},
    "add_bias_kv": {"add_bias_kv": True},
    "add_zero_attn": {"add_zero_attn": True},
    "all three": {"kdim": KDIM, "vdim": VDIM, "add_bias_kv": True, "add_zero_attn": True},
}


def torch_mha(seed: int = 0, **options) -> nn.MultiheadAttention:
    """A float64 nn.MultiheadAttention with every parameter random (its biases start at 0)."""
    mha = nn.MultiheadAttention(E, H, batch_first=True, dtype=F64, **options).eval()
    with torch.no_grad():
        for k, p in enumerate(mha.parameters()):
            p.copy_(randn(*p.shape, seed=seed * 10 + k) * 0.5)
    return mha


def inputs(mha: nn.MultiheadAttention, seed: int = 1):
    """x, the keys' context and the values' (the same one where kdim = vdim: einattn's layer
    then takes one context)."""
    x, k = randn(N, L_Q, E, seed=seed), randn(N, L_K, mha.kdim, seed=seed + 1)
    return x, k, k if mha.kdim == mha.vdim else randn(N, L_K, mha.vdim, seed=seed + 2)


def call(layer, mha, x, k, v, **kw):
    """The layer on torch's three inputs: (x, k, v) with d_context=(j, k), else (x, k)."""
    return layer(x, k, v, **kw) if mha.kdim != mha.vdim else layer(x, k, **kw)


def padded() -> torch.Tensor:
    """Key padding, True = ignore: sample 0 wholly padded (a row with nothing but the slots)."""
    kpm = torch.zeros(N, L_K, dtype=torch.bool)
    kpm[0] = True
    kpm[1, :2] = True
    return kpm


@pytest.mark.parametrize("impl", ["einsum", "sdpa", "chunked", "flex"])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_equals_torch_with_padding_and_a_mask(name, impl):
    mha = torch_mha(**OPTIONS[name])
    layer = MultiHeadAttention.from_torch(mha)
    x, k, v = inputs(mha)
    blocked = randn(L_Q, L_K, seed=7) > 0.8  # torch's bool attn_mask: True = blocked
    want, _ = mha(x, k, v, key_padding_mask=padded(), attn_mask=blocked)
    with torch.no_grad():  # flex on the CPU runs without gradients
        got = call(layer, mha, x, k, v, key_padding_mask=padded(), mask=~blocked, impl=impl)
    if mha.bias_k is None and not mha.add_zero_attn:  # torch: NaN in the padded row
        got, want = got[1], want[1]
    assert_close_scaled(got, want, TOL[F64])


def test_the_weights_are_torchs_per_head_slots_included():
    """need_weights: A over the keys and the bias slot; the zero slot is the sink, which no
    column of A shows (the rows sum to less than one by its weight)."""
    mha = torch_mha(**OPTIONS["all three"])
    layer = MultiHeadAttention.from_torch(mha)
    x, k, v = inputs(mha)
    _, A_torch = mha(x, k, v, key_padding_mask=padded(), average_attn_weights=False)
    _, A = call(layer, mha, x, k, v, key_padding_mask=padded(), need_weights=True)
    assert A.shape == (N, H, L_Q, L_K + 1)
    assert_close_scaled(A, A_torch[..., :L_K + 1], TOL[F64])
    assert torch.equal(A[0, :, :, :L_K], torch.zeros(H, L_Q, L_K))  # padded: slots alone


def test_every_gradient_is_torchs():
    mha = torch_mha(**OPTIONS["all three"])
    layer = MultiHeadAttention.from_torch(mha)
    x, k, v = (t.requires_grad_(True) for t in inputs(mha))  # kdim ≠ vdim: three inputs
    g = randn(N, L_Q, E, seed=9)
    want, _ = mha(x, k, v, key_padding_mask=padded())
    theirs = dict(mha.named_parameters())
    grads = torch.autograd.grad((want * g).sum(), [x, k, v, *theirs.values()])
    mine = dict(layer.named_parameters())
    got = torch.autograd.grad((layer(x, k, v, key_padding_mask=padded()) * g).sum(),
                              [x, k, v, *mine.values()])
    for a, b in zip(got[:3], grads[:3], strict=True):
        assert_close_scaled(a, b, TOL[F64])
    as_torch = dict(zip(theirs, grads[3:], strict=True))
    with torch.no_grad():  # the layer's gradients, laid out as torch's by to_torch's copy
        for name, t in zip(mine, got[3:], strict=True):
            getattr(layer, name).copy_(t)
    for name, p in layer.to_torch().named_parameters():
        assert_close_scaled(p, as_torch[name], TOL[F64])


@pytest.mark.parametrize("name", list(OPTIONS))
def test_from_torch_to_torch_round_trips(name):
    mha = torch_mha(seed=3, **OPTIONS[name])
    layer = MultiHeadAttention.from_torch(mha)
    assert layer.bias_kv == (mha.bias_k is not None)
    assert layer.zero_attn == mha.add_zero_attn
    assert layer.d_context == (None if mha.kdim == E else (KDIM, VDIM))
    back = layer.to_torch()
    for (a, p), (b, q) in zip(mha.named_parameters(), back.named_parameters(), strict=True):
        assert a == b and torch.equal(p, q)
    assert (back.kdim, back.vdim, back.add_zero_attn) == (mha.kdim, mha.vdim, mha.add_zero_attn)


def test_a_causal_layer_sees_the_slots_with_every_query():
    """einattn's one meaning: the slots are seen by every query, causal or not (torch's
    is_causal=True without need_weights hides them: its SDPA's top-left mask)."""
    mha = torch_mha(add_bias_kv=True, add_zero_attn=True)
    layer = MultiHeadAttention.from_torch(mha, causal=True)
    x = randn(N, L_Q, E, seed=4)
    future = torch.ones(L_Q, L_Q, dtype=torch.bool).triu(1)
    want, _ = mha(x, x, x, attn_mask=future)
    assert_close_scaled(layer(x), want, TOL[F64])
    hidden, _ = mha(x, x, x, attn_mask=future, is_causal=True, need_weights=False)
    assert (hidden - want).abs().max() > 0.1  # torch's other meaning, which einattn has not


def test_decoding_with_the_slots_equals_the_full_forward():
    """A KVCache holds the projected keys; the slot is added after it, once, every call."""
    layer = MultiHeadAttention.from_torch(torch_mha(add_bias_kv=True, add_zero_attn=True),
                                          causal=True)
    x = randn(N, 8, E, seed=5)
    cache, outs = KVCache(), []
    with torch.no_grad():
        for a, b in itertools.pairwise([0, 3, 4, 5, 6, 7, 8]):
            outs.append(layer(x[:, a:b], cache=cache))
        want = layer(x)
    assert_close_scaled(torch.cat(outs, 1), want, TOL[F64])
    assert len(cache) == 8  # the slot is not cached


def test_the_zero_sink_is_a_piece_and_the_slots_refuse_what_they_cannot_take():
    layer = MultiHeadAttention(E, H, dtype=F64, causal=True)
    x = randn(N, L_Q, E, seed=6)
    zero = MultiHeadAttention.from_fused(layer.W.detach(), layer.W_O.detach(), causal=True,
                                         zero_attn=True)
    assert_close_scaled(zero(x), layer(x, pattern=patterns.ZeroSink()), TOL[F64])
    slot = MultiHeadAttention(E, H, dtype=F64, bias_kv=True, softcap=5.0)
    with pytest.raises(EinattnError, match="add_bias_kv's key is seen by every query, but a "
                                           "term of the scores"):
        slot(x)
    with pytest.raises(EinattnError, match=r"nn\.MultiheadAttention's values are as wide as "
                                           r"its queries, but this layer has d_value=5 ≠ "
                                           r"d_head=4"):
        MultiHeadAttention(E, H, d_value=5).to_torch()


def test_two_contexts_are_checked_by_name():
    from einattn import cross
    layer = MultiHeadAttention.from_torch(torch_mha(**OPTIONS["kdim ≠ vdim"]))
    x = randn(N, L_Q, E, seed=8)
    with pytest.raises(EinattnError, match=r"every key needs its value: C_K\[n σ j\] "
                                           r"\(2, 7, 9\) and C_V\[n σ j\] \(2, 6, 11\) differ"):
        layer(x, randn(N, L_K, KDIM, seed=9), randn(N, L_K - 1, VDIM, seed=10))
    with pytest.raises(EinattnError, match=r"project the keys and the values from two "
                                           r"contexts C_K\[n σ j\] and C_V\[n σ j\]: pass both"):
        cross.project(x, layer.W_Q, randn(N, L_K, KDIM, seed=9), (layer.W_K, layer.W_V),
                      n_heads=H)
