"""Patterns of one's own: ``MaskMod`` (FlexAttention's mask_mod), ``ScoreMod`` (its score_mod),
``Mask`` strings (an index predicate), and their compositions with ``&``, ``|``, ``~``.

Each equals a dense float64 reference written here (forward; gradients of Q, K, V and of a
tensor a ScoreMod captures) on einsum, sdpa and chunked, at tiles of 4 that cut windows and
documents mid-tile; with GQA, key padding, fully masked rows and a KV cache; flex's forward
equals FlexAttention called with the same functions. A Mask string's tile judgement is exact
against a dense evaluation and makes nothing of L_q × L_k; bad functions and strings raise.
"""

from __future__ import annotations

import gc
import importlib
from pathlib import Path

import pytest
import torch
from conftest import TOL, assert_close_scaled, randn
from test_bad_inputs import _raise_lines, reached_lines
from test_chunked import largest_outputs

from einattn import EinattnError, KVCache, MultiHeadAttention, patterns
from einattn import functional as F
from einattn.patterns import Causal, Mask, MaskMod, ScoreMod, Window

F64 = torch.float64
N, MU, G, A = 2, 6, 3, 5  # all distinct; μ = (g r), r = 2
IMPLS = ["einsum", "sdpa", "chunked"]
INF = float("inf")
IDS = torch.tensor([[0] * 5 + [1] * 6 + [2] * 2, [0] * 2 + [1] * 9 + [2] * 2])  # d[n σ], 13
BIAS = randn(MU, 25, seed=20)  # a relative-position bias b[μ, τ − σ + 12]


# -- the reference: equation (3) written out densely, from each case's own definitions --------


def reference(Q, K, V, allowed, score=None, key_padding_mask=None):
    """Z: K, V repeated per query head, the scores (then ``score``), the keys ``allowed``
    (``(n, μ, τ', σ)`` positions → bool), a row with nothing to see all zeros."""
    n, mu, L_q, a = Q.shape
    L_k = K.shape[2]
    K, V = (t.repeat_interleave(mu // t.shape[1], dim=1) for t in (K, V))
    S = torch.einsum("nhqa,nhka->nhqk", Q, K) / a ** 0.5
    b, h = torch.arange(n).view(-1, 1, 1, 1), torch.arange(mu).view(1, -1, 1, 1)
    tau = torch.arange(L_q).view(1, 1, -1, 1) + (L_k - L_q)
    sigma = torch.arange(L_k).view(1, 1, 1, -1)
    logits = S if score is None else score(S, b, h, tau, sigma)
    may = allowed(b, h, tau, sigma).expand(n, mu, L_q, L_k)
    if key_padding_mask is not None:
        may = may & ~key_padding_mask[:, None, None, :]
    logits = logits.masked_fill(~may, -INF)
    top = logits.amax(-1, keepdim=True).detach()
    e = torch.exp(logits - torch.where(top > -INF, top, 0.0))
    total = e.sum(-1, keepdim=True)
    return torch.einsum("nhqk,nhka->nhqa", e / torch.where(total > 0, total, 1.0), V)


def everything(b, h, tau, sigma):
    return tau >= 0


def relative_bias(s, b, h, q, kv):
    return s + BIAS[h, (q - kv).clamp(-12, 12) + 12]


CASES = {  # name -> (the pieces, the reference's allowed and score, written apart)
    "MaskMod window": (lambda: MaskMod(lambda b, h, q, kv: (kv <= q) & (q - kv < 3)),
                       lambda b, h, t, s: (s <= t) & (t - s < 3), None),
    "MaskMod per head": (lambda: MaskMod(lambda b, h, q, kv: (q - kv).abs() <= h),
                         lambda b, h, t, s: (t - s).abs() <= h, None),
    "MaskMod documents": (lambda: MaskMod(lambda b, h, q, kv: IDS[b, q] == IDS[b, kv]),
                          lambda b, h, t, s: IDS[b, t] == IDS[b, s], None),
    "Mask window": (lambda: Mask("σ ≤ τ ∧ τ − σ < w", w=3),
                    lambda b, h, t, s: (s <= t) & (t - s < 3), None),
    "Mask chunks or prefix": (lambda: Mask("⌊τ / 4⌋ = σ // 4 ∨ σ < p", p=2),
                              lambda b, h, t, s: (t // 4 == s // 4) | (s < 2), None),
    "Mask heads and samples": (lambda: Mask("¬(μ < τ − σ) ∧ σ ≤ τ + n"),
                               lambda b, h, t, s: (t - s <= h) & (s <= t + b), None),
    "& | ~": (lambda: Causal() & (Window(3) | Mask("σ < 2"))
              & ~MaskMod(lambda b, h, q, kv: kv == 5),
              lambda b, h, t, s: (s <= t) & (((t - s).abs() < 3) | (s < 2)) & (s != 5), None),
    "ScoreMod bias": (lambda: ScoreMod(relative_bias), everything,
                      lambda S, b, h, t, s: S + BIAS[h, (t - s).clamp(-12, 12) + 12]),
    "ScoreMod cap, MaskMod": (lambda: [ScoreMod(lambda s, b, h, q, kv: 2.0 * torch.tanh(s / 2.0)),
                                       MaskMod(lambda b, h, q, kv: kv <= q)],
                              lambda b, h, t, s: s <= t, lambda S, *_: 2.0 * torch.tanh(S / 2.0)),
}
LENGTHS = {"self": (13, 13), "cached": (5, 13)}  # (L_q, L_k): 5 queries at positions 8–12


def qkv(L_q: int, L_k: int, *, seed: int = 0, requires_grad: bool = True):
    return (randn(N, MU, L_q, A, seed=seed, requires_grad=requires_grad),
            randn(N, G, L_k, A, seed=seed + 1, requires_grad=requires_grad),
            randn(N, G, L_k, A, seed=seed + 2, requires_grad=requires_grad))


@pytest.mark.parametrize("lengths", list(LENGTHS))
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", list(CASES))
def test_each_piece_equals_its_reference(case, impl, lengths):
    """Forward and the gradients of Q, K, V and of the bias a ScoreMod captures."""
    pieces, allowed, score = CASES[case]
    Q, K, V = qkv(*LENGTHS[lengths])
    BIAS.requires_grad_(True)
    try:
        Z = F.attention(Q, K, V, pattern=pieces(), impl=impl, block_size=4)
        Z_ref = reference(Q, K, V, allowed, score)
        assert_close_scaled(Z, Z_ref, TOL[F64])
        wrt = [Q, K, V] + ([BIAS] if score is not None and "bias" in case else [])
        dZ = randn(*Z.shape, seed=9)
        for got, want in zip(torch.autograd.grad(Z, wrt, dZ), torch.autograd.grad(Z_ref, wrt, dZ),
                             strict=True):
            assert_close_scaled(got, want, TOL[F64])
    finally:
        BIAS.requires_grad_(False)


@pytest.mark.parametrize("impl", IMPLS)
def test_key_padding_and_fully_masked_rows(impl):
    """A MaskMod that leaves queries 0–2 no key, with padding: their rows are zeros, every
    gradient finite, the rest the reference's."""
    mod = MaskMod(lambda b, h, q, kv: (kv <= q) & (q >= 3))
    pad = torch.zeros(N, 13, dtype=torch.bool)
    pad[1, -4:] = True
    Q, K, V = qkv(13, 13)
    Z = F.attention(Q, K, V, pattern=mod, key_padding_mask=pad, impl=impl, block_size=4)
    Z_ref = reference(Q, K, V, lambda b, h, t, s: (s <= t) & (t >= 3), key_padding_mask=pad)
    assert_close_scaled(Z, Z_ref, TOL[F64])
    assert torch.equal(Z[:, :, :3], torch.zeros_like(Z[:, :, :3]))
    grads = torch.autograd.grad(Z.square().sum(), (Q, K, V))
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_kv_cache_decodes_one_token_at_a_time_as_one_forward(impl):
    """The layer's own Mask and a call's MaskMod, positions bound by the cache."""
    torch.manual_seed(0)
    layer = MultiHeadAttention(12, MU, d_head=A, n_kv_heads=G, dtype=F64, impl=impl,
                               block_size=4, pattern=Mask("σ ≤ τ ∧ τ − σ < w", w=4))
    mod = MaskMod(lambda b, h, q, kv: (q - kv != 1) | (h < 3))
    x = randn(N, 11, 12, seed=5)
    cache = KVCache()
    with torch.no_grad():
        steps = [layer(x[:, :6], cache=cache, pattern=mod)]
        steps += [layer(x[:, t:t + 1], cache=cache, pattern=mod) for t in range(6, 11)]
        assert_close_scaled(torch.cat(steps, dim=1), layer(x, pattern=mod), TOL[F64])


@pytest.mark.parametrize("w, L, block", [(5, 37, 8), (256, 300, 64)])
@pytest.mark.parametrize("impl", [*IMPLS, "flex"])
def test_a_mask_string_is_the_causal_window_on_every_impl(impl, w, L, block):
    Q, K, V = qkv(L, L, requires_grad=False)
    with torch.no_grad():
        by_string = F.attention(Q, K, V, pattern=Mask("σ ≤ τ ∧ τ − σ < w", w=w), impl=impl,
                                block_size=block)
        by_pieces = F.attention(Q, K, V, pattern=Causal() & Window(w), impl=impl,
                                block_size=block)
    assert_close_scaled(by_string, by_pieces, TOL[F64])


def test_a_mask_string_renders_as_latex():
    mask = Mask("σ ≤ τ ∧ τ − σ < w", w=256)
    assert r"\sigma \le \tau \wedge \tau - \sigma < w" in mask.latex()
    assert r"\left\lfloor \frac{\tau}{64} \right\rfloor = \left\lfloor \frac{\sigma}{64} " \
           r"\right\rfloor" in Mask("⌊τ / 64⌋ = σ // 64").latex()
    assert r"\neg \left(\mu < \tau\right) \vee \sigma \ne 0" in Mask("not μ < τ or σ != 0").latex()


PREDICATES = ["σ ≤ τ ∧ τ − σ < 5", "⌊τ / 6⌋ = ⌊σ / 6⌋ ∧ σ ≤ τ", "σ < 3 ∨ σ ≤ τ",
              "¬(τ − σ > 4) ∧ ¬(σ − τ > 2)", "τ − σ = 2 ∨ σ = 0", "0 ≤ τ − σ < μ + 2",
              "σ // 4 ≠ τ // 4 ∧ n ≤ σ − 3"]


@pytest.mark.parametrize("size", [3, 5])
@pytest.mark.parametrize("text", PREDICATES)
def test_a_mask_string_judges_each_tile_exactly(text, size):
    """Every tile's (some, every) is the dense truth, over every n and μ."""
    bound = patterns.build(n=N, n_heads=MU, L_q=23, L_k=23, dtype=F64, device="cpu",
                           pattern=Mask(text))
    if not bound.masks:
        return  # the piece masks nothing at these sizes
    may = bound.allowed(patterns.grid(N, MU, 23, 23, "cpu")).expand(N, MU, 23, 23)
    judge = bound.masks[0].judge(bound.frame, size)
    for t0 in range(0, 23, size):
        for s0 in range(0, 23, size):
            t1, s1 = min(t0 + size, 23) - 1, min(s0 + size, 23) - 1
            tile = may[:, :, t0:t1 + 1, s0:s1 + 1]
            assert judge(t0, t1, s0, s1) == (bool(tile.any()), bool(tile.all())), (t0, s0)


def test_a_mask_string_makes_nothing_of_L_q_by_L_k():
    """Forward and backward on chunked: no tensor of L_q × L_k elements per head."""
    L = 96
    Q, K, V = (randn(1, 2, L, 8, seed=s, requires_grad=True) for s in (1, 2, 3))
    made = largest_outputs(lambda: F.attention(
        Q, K, V, pattern=Mask("σ ≤ τ ∧ τ − σ < w", w=16), impl="chunked",
        block_size=16).sum().backward())
    assert max(torch.Size(s).numel() for s in made) < 2 * L * L / 4


def test_a_kept_judgement_is_never_another_functions():
    """Closures made one after another (the old one gone, its id free again) each get their
    own judgement: the function itself is the key."""
    Q, K, V = qkv(13, 13, requires_grad=False)
    for w in (1, 2, 3, 4, 1, 2):
        mod = MaskMod(lambda b, h, q, kv, w=w: (kv <= q) & (q - kv < w))
        with torch.no_grad():
            Z = F.attention(Q, K, V, pattern=mod, impl="chunked", block_size=4)
        assert_close_scaled(Z, reference(Q, K, V, lambda b, h, t, s, w=w: (s <= t) & (t - s < w)),
                            TOL[F64])
        del mod
        gc.collect()


def test_flex_equals_flex_attention_called_with_the_same_functions():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def mask_mod(b, h, q, kv):
        return (kv <= q) & (IDS[b, q] == IDS[b, kv])

    Q, K, V = qkv(13, 13, requires_grad=False)
    with torch.no_grad():
        ours = F.attention(Q, K, V, impl="flex",
                           pattern=[MaskMod(mask_mod), ScoreMod(relative_bias)])
        block_mask = create_block_mask(mask_mod, N, MU, 13, 13, device="cpu")
        theirs = flex_attention(Q, K, V, score_mod=relative_bias, block_mask=block_mask,
                                enable_gqa=True)
    assert_close_scaled(ours, theirs, TOL[F64])


ERRORS = {
    "MaskMod not bool": (lambda: F.attention(*qkv(4, 4), pattern=MaskMod(lambda b, h, q, kv:
                                                                          (q - kv).float())),
                         r"MaskMod\(<lambda>\) must return a bool tensor \(True = may attend\), "
                         r"got torch.float32"),
    "MaskMod not callable": (lambda: MaskMod(3), r"MaskMod takes a function mask_mod\(b, h, "
                                                r"q_idx, kv_idx\) -> bool tensor, .*got int"),
    "MaskMod shape": (lambda: F.attention(*qkv(4, 4), impl="chunked", pattern=MaskMod(
        lambda b, h, q, kv: torch.ones(3, 1, 1, 1, dtype=torch.bool))),
        r"MaskMod\(<lambda>\) must return a bool tensor that broadcasts to \(n, μ, τ, σ\)"),
    "ScoreMod shape": (lambda: F.attention(*qkv(4, 4), pattern=ScoreMod(
        lambda s, b, h, q, kv: s.sum(-1))),
        r"ScoreMod\(<lambda>\) must return a score of the shape it was given, "
        r"\(2, 6, 4, 4\), got \(2, 6, 4\)"),
    "ScoreMod dtype": (lambda: F.attention(*qkv(4, 4), pattern=ScoreMod(
        lambda s, b, h, q, kv: s.float())),
        r"ScoreMod\(<lambda>\) must return a score of the dtype it was given, torch.float64, "
        r"got torch.float32"),
    "ScoreMod in place": (lambda: F.attention(*qkv(4, 4), pattern=ScoreMod(
        lambda s, b, h, q, kv: s.div_(2).tanh_().mul_(2))),
        r"ScoreMod\(<lambda>\) writes into its score in a way autograd cannot differentiate"),
    "ScoreMod not callable": (lambda: ScoreMod("tanh"), r"ScoreMod takes a function "
                                                        r"score_mod\(score, b, h, q_idx, kv_idx\)"),
    "Mask unknown name": (lambda: Mask("σ ≤ t"), r"unknown name 't' in the mask: the indices "
                                                 r"are n, μ, τ, σ \(positions\), the parameters "
                                                 r"none given\n  σ ≤ t\n      \^"),
    "Mask not an integer": (lambda: Mask("τ − σ < 2.5"),
                            r"a mask's numbers are integers \(positions\), got 2.5\n"
                            r"  τ − σ < 2.5\n          \^"),
    "Mask parameter": (lambda: Mask("τ − σ < w", w=2.5),
                       r"Mask parameter w must be an int \(positions are integers\), got 2.5"),
    "Mask parameter named n": (lambda: Mask("τ − σ < n ∧ σ ≤ τ", n=3),
                               r"Mask parameter n is named as an index or a word of the "
                               r"predicate \(n, μ, τ, σ, and, or, not\)"),
    "Mask no comparison": (lambda: Mask("τ − σ"), r"expected a comparison \(<, ≤, =, ≠, ≥, >\) "
                                                  r"here\n  τ − σ\n       \^"),
    "Mask trailing": (lambda: Mask("σ ≤ τ τ"), r"expected ∧, ∨ or the end of the mask here"),
    "Mask bad character": (lambda: Mask("σ ≤ τ; w"), r"unexpected ';' in the mask"),
    "Mask divisor": (lambda: Mask("σ // 0 < τ"), r"a floor division divides by a positive "
                                                 r"integer or a parameter that is one"),
    "Mask parenthesis": (lambda: Mask("(σ < τ"), r"expected \) here"),
    "Mask operand": (lambda: Mask("σ < ∧"), r"expected an index \(n, μ, τ, σ\), an integer, a "
                                            r"parameter or \( here"),
    "Mask not a string": (lambda: Mask(3), r"Mask takes the predicate as a string"),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_bad_pieces_raise(name):
    call, match = ERRORS[name]
    with pytest.raises(EinattnError, match=match):
        call()


@pytest.mark.parametrize("module", ["_mods", "_predicate", "_intervals"])
def test_every_raise_site_is_reached(module):
    """Every ``raise`` of the user pieces' modules is reached by a row above (STYLE §4)."""
    source = Path(importlib.import_module(f"einattn.{module}").__file__).resolve()
    missing = sorted(_raise_lines(source) - reached_lines(ERRORS.values(), source))
    assert not missing, f"raise sites in {module}.py with no test: lines {missing}"
