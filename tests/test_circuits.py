"""einattn.circuits: the QK and OV circuits of a layer reproduce its scores and its output
(float64, 1e-12), per head against loops over the separate projections, with and without
grouped-query attention; docs/layouts.md shows the equations the code runs."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from conftest import assert_close_scaled, randn

from einattn import EinattnError, Equation, MultiHeadAttention, circuits

N, L, D, H, A = 2, 7, 24, 6, 5  # batch, length, d_model, heads, d_head: all distinct
KV_HEADS = {"no grouping": None, "g=2": 2, "g=3": 3, "MQA g=1": 1}
LAYOUTS_DOC = Path(__file__).resolve().parent.parent / "docs" / "layouts.md"


def layer(n_kv_heads, seed=0):
    torch.manual_seed(seed)
    return MultiHeadAttention(D, H, d_head=A, n_kv_heads=n_kv_heads, dtype=torch.float64)


@pytest.mark.parametrize("g", KV_HEADS.values(), ids=KV_HEADS.keys())
def test_circuits_per_head_from_the_projections(g):
    """W_QK[μ] = W_q[μ]ᵀ W_k[group of μ] and W_OV[μ] = W_v[group of μ]ᵀ W_o[μ]ᵀ, head by head."""
    m = layer(g)
    p = m.projections()
    r = H // m.n_kv_heads
    W_QK, W_OV = circuits.qk(m), circuits.ov(m)
    assert W_QK.shape == W_OV.shape == (H, D, D)
    for mu in range(H):
        group = mu // r
        q = p.W_q[mu * A:(mu + 1) * A]                       # (a, i)
        k, v = (w[group * A:(group + 1) * A] for w in (p.W_k, p.W_v))
        o = p.W_o[:, mu * A:(mu + 1) * A]                    # (j, a)
        assert_close_scaled(W_QK[mu], q.T @ k, 1e-12)
        assert_close_scaled(W_OV[mu], v.T @ o.T, 1e-12)


@pytest.mark.parametrize("g", KV_HEADS.values(), ids=KV_HEADS.keys())
def test_qk_circuit_gives_the_scores(g):
    m = layer(g, seed=1)
    x = randn(N, L, D, seed=2)
    _, stages = m(x, return_intermediates=True, causal=True)
    W_QK = circuits.qk(m)
    S = torch.stack([torch.stack([x[n] @ W_QK[mu] @ x[n].T for mu in range(H)])
                     for n in range(N)]) / math.sqrt(A)
    assert_close_scaled(stages["S"], S, 1e-12)


@pytest.mark.parametrize("g", KV_HEADS.values(), ids=KV_HEADS.keys())
def test_ov_circuit_gives_the_output(g):
    m = layer(g, seed=3)
    x = randn(N, L, D, seed=4)
    Y, stages = m(x, return_intermediates=True, causal=True)
    A_ = stages["A"]
    W_OV = circuits.ov(m)
    Y_ov = torch.stack([sum(A_[n, mu] @ x[n] @ W_OV[mu] for mu in range(H)) for n in range(N)])
    assert_close_scaled(Y, Y_ov, 1e-12)


def test_circuits_see_which_group_a_head_reads():
    """Swapping the key rows of two groups changes W_QK of exactly the heads of those groups."""
    m = layer(3, seed=5)
    before = circuits.qk(m)
    with torch.no_grad():
        W4 = m.W.view(3, 4, A, D)  # g, C = r + 2 slots, a, i: slot 2 is the key
        W4[0, 2], W4[1, 2] = W4[1, 2].clone(), W4[0, 2].clone()
    changed = (circuits.qk(m) - before).abs().amax(dim=(1, 2)) > 0
    assert changed.tolist() == [True, True, True, True, False, False]


def test_circuits_of_bare_weights_and_gradients():
    m = layer(2, seed=6)
    W_QK = circuits.qk_circuit(m.W, n_heads=H, n_kv_heads=2)
    W_OV = circuits.ov_circuit(m.W, m.W_O, n_heads=H, n_kv_heads=2)
    assert torch.equal(W_QK, circuits.qk(m)) and torch.equal(W_OV, circuits.ov(m))
    (W_QK.sum() + W_OV.sum()).backward()
    assert m.W.grad is not None and m.W_O.grad is not None


def test_equations_are_module_constants():
    assert isinstance(circuits.QK_CIRCUIT, Equation) and isinstance(circuits.OV_CIRCUIT, Equation)
    assert circuits.QK_CIRCUIT.summed == ("a",) and circuits.OV_CIRCUIT.summed == ("a",)


def test_docs_show_the_circuit_equations():
    """The $$ displays of the Circuits section of docs/layouts.md are .latex() of the
    constants, in order, and the text blocks after them are the equation strings."""
    doc = LAYOUTS_DOC.read_text(encoding="utf-8")
    section = doc[doc.index("## Circuits"):]
    displays = [m.strip() for m in re.findall(r"^\$\$\n(.*?)\n\$\$$", section, re.M | re.S)]
    assert displays == [circuits.QK_CIRCUIT.latex(), circuits.OV_CIRCUIT.latex()]
    texts = re.findall(r"^```text\n(.*?)\n```$", section, re.M | re.S)
    assert texts[:2] == [circuits.QK_CIRCUIT.text, circuits.OV_CIRCUIT.text]


W_bad, W_O_bad = torch.ones(50, D), torch.ones(H, A, D)
ERRORS = {
    "qk not a layer": (lambda: circuits.qk(torch.nn.Linear(3, 3)),
                       r"layer must be an einattn.MultiHeadAttention, got Linear"),
    "qk with rope": (lambda: circuits.qk(MultiHeadAttention(D, H, d_head=A + 1, rope="half")),
                     r"this layer has rope='half': its scores turn Q and K by the positions"),
    "ov not a layer": (lambda: circuits.ov("layer"),
                       r"layer must be an einattn.MultiHeadAttention, got str"),
    "qk rows": (lambda: circuits.qk_circuit(torch.ones(49, D), n_heads=H, n_kv_heads=2),
                r"W has 49 rows; W\[\(g C a\) i\] needs g·C·a rows with g=2, C=r\+2=5"),
    "qk groups": (lambda: circuits.qk_circuit(W_bad, n_heads=H, n_kv_heads=4),
                  r"n_heads=6 is not a multiple of n_kv_heads=4"),
    "ov W_O 2-D": (lambda: circuits.ov_circuit(W_bad, torch.ones(30, D), n_heads=H,
                                               n_kv_heads=2),
                   r"W_O must be a 3-D tensor W_O\[μ a i\], got \(30, 24\)"),
    "ov W_O heads": (lambda: circuits.ov_circuit(W_bad, torch.ones(4, A, D), n_heads=H,
                                                 n_kv_heads=2),
                     r"group \(g r\) of W_O has length 4 but g=2·r=3 gives 6"),
    "ov W_O channels": (lambda: circuits.ov_circuit(W_bad, torch.ones(H, 4, D), n_heads=H,
                                                    n_kv_heads=2),
                        r"index 'a' has size 4 in W_O but 5 in W_V"),
    "ov W_O not a tensor": (lambda: circuits.ov_circuit(W_bad, None, n_heads=H, n_kv_heads=2),
                            r"W_O must be a 3-D tensor W_O\[μ a i\], got NoneType"),
}


@pytest.mark.parametrize("call, message", ERRORS.values(), ids=ERRORS.keys())
def test_errors(call, message):
    with pytest.raises(EinattnError, match=message):
        call()
