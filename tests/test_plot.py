"""einattn.plot: one heatmap per head from a real forward pass, tokens on the axes, a saved
PNG, and an EinattnError naming the index for every input it cannot draw."""

from __future__ import annotations

import struct
import sys

import numpy as np
import pytest
import torch

from einattn import EinattnError, MultiHeadAttention, plot

N_HEADS, L_Q, L_K, D_MODEL = 3, 5, 7, 12  # all distinct: a swapped axis cannot hide


def weights(L_q: int = L_Q, L_k: int = L_K) -> torch.Tensor:
    """A[μ τ σ] of one sample, from a forward pass of the layer (cross-attention)."""
    torch.manual_seed(0)
    layer = MultiHeadAttention(D_MODEL, N_HEADS)
    x, context = torch.randn(1, L_q, D_MODEL), torch.randn(1, L_k, D_MODEL)
    _, A = layer(x, context, need_weights=True)
    return A[0]


def panels(fig):
    return [ax for ax in fig.axes if ax.images]


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


@pytest.mark.parametrize("n_heads", [1, 3, 4, 6])
def test_one_panel_per_head_showing_that_heads_weights(n_heads):
    torch.manual_seed(n_heads)
    A = torch.rand(n_heads, L_Q, L_K).softmax(-1)
    fig = plot.attention(A)
    shown = panels(fig)
    assert len(shown) == n_heads
    for mu, ax in enumerate(shown):
        assert ax.get_title() == f"head μ = {mu}"
        image = torch.as_tensor(np.asarray(ax.images[0].get_array()))
        assert image.shape == (L_Q, L_K)  # rows are queries τ, columns keys σ
        torch.testing.assert_close(image, A[mu])


def test_tokens_label_queries_and_keys():
    query_tokens, key_tokens = list("abcde"), list("ABCDEFG")
    fig = plot.attention(weights(), tokens=query_tokens, key_tokens=key_tokens)
    for ax in panels(fig):
        assert [t.get_text() for t in ax.get_yticklabels()] == query_tokens
        assert [t.get_text() for t in ax.get_xticklabels()] == key_tokens


def test_tokens_label_both_axes_in_self_attention():
    fig = plot.attention(weights(L_K, L_K), tokens=list("abcdefg"))
    ax = panels(fig)[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == list("abcdefg")
    assert [t.get_text() for t in ax.get_yticklabels()] == list("abcdefg")


def test_colour_scale_is_zero_to_one_for_weights_and_the_range_otherwise():
    (ax, *_) = panels(plot.attention(weights()))
    assert ax.images[0].get_clim() == (0.0, 1.0)
    scores = torch.linspace(-2, 3, N_HEADS * L_Q * L_K).reshape(N_HEADS, L_Q, L_K)
    (ax, *_) = panels(plot.attention(scores))
    assert ax.images[0].get_clim() == pytest.approx((-2.0, 3.0))


def test_saved_png_is_a_figure_of_the_expected_size(tmp_path):
    fig = plot.attention(weights(), title="a forward pass")
    path = tmp_path / "attention.png"
    fig.savefig(path, dpi=50)
    width, height = png_size(path)
    expected = fig.get_size_inches() * 50
    assert (width, height) == pytest.approx(tuple(expected), abs=1)
    assert fig.get_suptitle() == "a forward pass"


def test_accepts_a_tensor_that_requires_grad_in_low_precision():
    A = weights().to(torch.bfloat16).requires_grad_()
    assert len(panels(plot.attention(A))) == N_HEADS


# -- bad input: every raise site ----------------------------------------------------------

def test_four_axes_are_refused_with_a_hint_to_pick_a_sample():
    with pytest.raises(EinattnError, match=r"three axes A\[μ τ σ\].*\(1, 3, 5, 7\).*A\[0\]"):
        plot.attention(weights()[None])


def test_two_axes_are_refused_with_a_hint_for_one_head():
    with pytest.raises(EinattnError, match=r"three axes A\[μ τ σ\].*\(5, 7\).*A\[None\]"):
        plot.attention(weights()[0])


def test_something_that_is_no_tensor_is_refused():
    with pytest.raises(EinattnError, match=r"A must be a tensor A\[μ τ σ\], got str"):
        plot.attention("attention")


def test_query_tokens_must_match_tau():
    with pytest.raises(EinattnError, match=r"index 'τ' has size 5 in A\[μ τ σ\] but tokens "
                                           r"has 4 entries"):
        plot.attention(weights(), tokens=list("abcd"), key_tokens=list("ABCDEFG"))


def test_key_tokens_must_match_sigma():
    with pytest.raises(EinattnError, match=r"index 'σ' has size 7 in A\[μ τ σ\] but "
                                           r"key_tokens has 6 entries$"):
        plot.attention(weights(), tokens=list("abcde"), key_tokens=list("ABCDEF"))


def test_tokens_alone_must_also_match_sigma_and_say_how_to_label_keys():
    with pytest.raises(EinattnError, match=r"index 'σ' has size 7 in A\[μ τ σ\] but tokens "
                                           r"has 5 entries; for cross-attention pass key_tokens"):
        plot.attention(weights(), tokens=list("abcde"))


def test_missing_matplotlib_says_which_extra_to_install(monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"from einattn's checkout, pip install '\.\[plot\]'"):
        plot.attention(weights())
