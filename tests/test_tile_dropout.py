"""Attention dropout on the chunked path (einattn._tile_dropout): the forward and the
recomputing backward equal autograd through ``Z = (A ∘ R) V`` on the einsum path's ``A`` with
the same mask ``R``, drawn per tile; the keep rate is ``1 − p``; a fixed seed reproduces
the output; ``p = 0`` and eval mode are the path without dropout, drawing nothing."""

from __future__ import annotations

import pytest
import torch
from conftest import TOL, assert_close_scaled, randn

from einattn import EinattnError, MultiHeadAttention, chunked, impls, masks, patterns
from einattn import functional as F
from einattn._tile_dropout import TileDropout

F64 = torch.float64
N, MU, G, A, A_V = 2, 6, 3, 4, 5  # n, μ = (g r) with g = 3, r = 2, a, V's own a


def _inputs(L_q, L_k, g=G, seed=0):
    Q = randn(N, MU, L_q, A, seed=seed, requires_grad=True)
    K = randn(N, g, L_k, A, seed=seed + 1, requires_grad=True)
    V = randn(N, g, L_k, A_V, seed=seed + 2, requires_grad=True)
    return Q, K, V


def _plain(Q, K):
    """The pattern with no piece, bound to the sizes of Q and K."""
    return patterns.build(n=Q.shape[0], n_heads=Q.shape[1], L_q=Q.shape[2], L_k=K.shape[2],
                          dtype=Q.dtype, device=Q.device)


CASES = {  # name -> (L_q, L_k, block_size, pattern options, float mask)
    "plain": (13, 11, 4, {}, False),
    "causal": (17, 17, 5, {"causal": True}, False),
    "float mask": (9, 14, 4, {}, True),
    "window": (19, 19, 3, {"causal": True, "window": 6}, False),
    "softcap, sinks": (7, 10, 3, {"softcap": 2.0, "sinks": randn(MU, seed=9)}, False),
    "few queries": (3, 23, 4, {"causal": True}, False),  # dropout: tiles, not split keys
}


def _call(name, p, seed):
    """``(Z, Q, K, V, M, pattern, side)`` of one chunked call with dropout ``p`` after
    ``torch.manual_seed(seed)``; the pattern's sinks require grad."""
    L_q, L_k, block_size, options, float_mask = CASES[name]
    Q, K, V = _inputs(L_q, L_k)
    if "sinks" in options:
        options = {**options, "sinks": options["sinks"].clone().requires_grad_(True)}
    pattern = patterns.build(n=N, n_heads=MU, L_q=L_q, L_k=L_k, dtype=F64, device="cpu",
                             **options)
    M = randn(N, 1, L_q, L_k, seed=4, requires_grad=True) if float_mask else None
    torch.manual_seed(seed)
    Z = chunked.attend(Q, K, V, M, pattern, block_size, dropout=p)
    return Z, Q, K, V, M, pattern, impls.chunked._tile_side(pattern, block_size)


@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_backward_equal_autograd_through_the_same_mask(name):
    p, seed = 0.3, 11
    Z, Q, K, V, M, pattern, side = _call(name, p, seed)
    torch.manual_seed(seed)  # the call's seed, drawn again
    drop = TileDropout.drawn(p)
    A = impls.einsum.stages(Q, K, V, M, pattern, 0.0, scratch=False)["A"]  # equation (3)
    R = drop.dense(impls.tiles.tiles(pattern, side), A.shape, A.device, A.dtype)
    assert 0.5 < (R[A > 0] > 0).double().mean() < 0.9  # some dropped, most kept
    want = F.weighted_values(A * R, V)  # Z = (A ∘ R) V, equation (4g)
    assert_close_scaled(Z, want, TOL[F64])
    dZ = randn(*Z.shape, seed=3)
    inputs = [t for t in (Q, K, V, M, pattern.sinks) if t is not None]
    got = torch.autograd.grad(Z, inputs, dZ)
    expected = torch.autograd.grad(want, inputs, dZ)
    for g_chunked, g_dense in zip(got, expected, strict=True):
        assert_close_scaled(g_chunked, g_dense, TOL[F64])


def test_second_derivatives_read_the_same_mask():
    """``create_graph=True`` differentiates the dense equations with the tiles' ``R``: the
    same first derivative, and one that can be differentiated again."""
    grads = []
    for create_graph in (False, True):
        Z, Q, K, V, *_ = _call("causal", 0.4, 5)
        grads.append(torch.autograd.grad(Z, (Q, K, V), randn(*Z.shape, seed=3),
                                         create_graph=create_graph))
    for first, again in zip(*grads, strict=True):
        assert_close_scaled(first, again, TOL[F64])
    assert grads[1][0].requires_grad


def _kept(p, seed, L_q=300, L_k=200, block_size=64):
    """The keep mask ``ξ[n μ τ σ]`` the chunked forward applied, read back from its output:
    with ``Q = 0`` every weight is ``1 / L_k`` and ``V`` one-hot per key (``a = σ``), so
    ``Z[n μ τ σ] = R / L_k``."""
    Q = torch.zeros(N, MU, L_q, A, dtype=F64)
    K = randn(N, G, L_k, A, seed=1)
    V = torch.eye(L_k, dtype=F64).expand(N, G, L_k, L_k)
    torch.manual_seed(seed)
    Z = chunked.attend(Q, K, V, None, _plain(Q, K), block_size, dropout=p)
    kept = Z * L_k * (1 - p)
    assert torch.all((kept == 0) | ((kept - 1).abs() < 1e-12))  # 0 or 1/(1 − p), nothing else
    return kept == 1 if p < 1 else kept != 0


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_the_keep_rate_is_one_minus_p(p):
    """Over 360 000 weights the kept fraction is within 6 standard deviations of ``1 − p``
    (σ = √(p(1 − p) / 360 000) ≤ 8.4e-4), in every tile row and key block alike."""
    kept = _kept(p, seed=2).double()
    sd = (p * (1 - p) / kept.numel()) ** 0.5
    assert abs(kept.mean() - (1 - p)) < 6 * sd
    tiles = kept.unflatten(2, (-1, 60)).unflatten(-1, (-1, 40)).mean(dim=(0, 1, 3, 5))
    assert (tiles - (1 - p)).abs().max() < 6 * (p * (1 - p) / (N * MU * 60 * 40)) ** 0.5


def test_tiles_draw_unrelated_masks_and_p_one_keeps_nothing():
    kept = _kept(0.5, seed=4, block_size=50)  # tiles of 50 × 50 (L_q = 300, L_k = 200)
    first = kept[:, :, :50, :50]
    assert not any(torch.equal(first, kept[:, :, t:t + 50, s:s + 50])
                   for t in range(0, 300, 50) for s in range(0, 200, 50) if (t, s) != (0, 0))
    assert not _kept(1.0, seed=4).any()


def test_a_fixed_seed_reproduces_the_output_and_another_does_not():
    Z1, Z2, Z3 = (_call("causal", 0.3, seed)[0] for seed in (8, 8, 9))
    assert torch.equal(Z1, Z2) and not torch.equal(Z1, Z3)
    torch.manual_seed(8)
    with torch.no_grad():  # without a graph: the forward alone, the same masks
        Q, K, V = _inputs(17, 17)
        pattern = patterns.build(n=N, n_heads=MU, L_q=17, L_k=17, dtype=F64, device="cpu",
                                 causal=True)
        assert torch.equal(chunked.attend(Q, K, V, None, pattern, 5, dropout=0.3), Z1)


def test_no_dropout_and_eval_mode_are_the_path_without_it_and_draw_nothing():
    Q, K, V = _inputs(13, 13)
    pattern = patterns.build(n=N, n_heads=MU, L_q=13, L_k=13, dtype=F64, device="cpu",
                             causal=True)
    layer = MultiHeadAttention(12, 3, dropout=0.5, causal=True, impl="chunked", dtype=F64)
    x = randn(N, 13, 12, seed=6)
    same = MultiHeadAttention(12, 3, causal=True, impl="chunked", dtype=F64)
    same.load_state_dict(layer.state_dict())
    state = torch.random.get_rng_state()
    plain = chunked.attend(Q, K, V, None, pattern, 4)
    assert torch.equal(chunked.attend(Q, K, V, None, pattern, 4, dropout=0.0), plain)
    assert torch.equal(layer.eval()(x), same(x))
    assert torch.equal(torch.random.get_rng_state(), state)
    trained = layer.train()(x)  # training mode: a seed drawn, some weights dropped
    assert not torch.equal(torch.random.get_rng_state(), state)
    assert not torch.allclose(trained, same(x))


def test_the_layer_trains_on_the_chunked_path_with_dropout():
    """Through functional.attention and the layer: the chunked impl with dropout equals the
    dense equations with the mask the chunked tiles drew (read back as in the tests above)."""
    Q, K, V = _inputs(10, 12, g=MU)
    torch.manual_seed(3)
    Z = F.attention(Q, K, V, causal=True, impl="chunked", dropout=0.2, block_size=4)
    torch.manual_seed(3)
    pattern = patterns.build(n=N, n_heads=MU, L_q=10, L_k=12, dtype=F64, device="cpu",
                             causal=True)
    R = TileDropout.drawn(0.2).dense(impls.tiles.tiles(pattern, 4), (N, MU, 10, 12), "cpu",
                                     F64)
    A = F.masked_softmax(F.attention_scores(Q, K), masks.causal_mask(10, 12))
    assert_close_scaled(Z, F.weighted_values(A * R, V), TOL[F64])


def test_torch_func_transforms_refuse_the_tiles_dropout():
    Q, K, V = (t.detach() for t in _inputs(5, 5))
    with pytest.raises(EinattnError, match=r"impl='chunked' draws its dropout \(got "
                                           r"dropout=0.1\) per tile, which torch.func's "
                                           r"transforms cannot run: use impl='einsum'"):
        torch.func.vmap(lambda q: chunked.attend(q, K, V, None, _plain(q, K), 4,
                                                 dropout=0.1))(Q[None])


def test_under_torch_compile_the_tiles_run_eagerly_with_the_same_masks():
    """A graph break around the dropping tiles: each call's seed would be a constant of a
    graph, compiled again for every call; eagerly, the masks are the eager path's."""
    import torch._dynamo.testing
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    Q, K, V = _inputs(11, 11)
    pattern = patterns.build(n=N, n_heads=MU, L_q=11, L_k=11, dtype=F64, device="cpu",
                             causal=True)

    def f(Q, K, V):
        return 2 * chunked.attend(Q, K, V, None, pattern, 4, dropout=0.3)

    compiled, frames = torch.compile(f, backend=counter), []
    for seed in (1, 2, 3):
        torch.manual_seed(seed)
        Z = compiled(Q, K, V)
        torch.manual_seed(seed)
        assert torch.equal(Z, f(Q, K, V))
        frames.append(counter.frame_count)
    assert frames[0] == frames[-1]  # no graph compiled again for a new seed
    torch._dynamo.reset()
