"""einattn.parallel.shard_sequence: ring attention on 2 and 3 gloo processes on the CPU, in
float64, checked against one process running the whole sequence (the cases of
tests/sequence_cases.py, packed documents among them): the gathered output, the gathered
gradient of the input, and the parameter gradients summed over the ranks.
einattn.ring's layouts, schedule and merge, in this process.
"""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
from conftest import randn
from ranks import (
    raised_in,
    rank_tests,
    scaled_error,
    unreached_raise_sites,
)
from sequence_cases import (
    F64,
    MU,
    TOL,
    A,
    D,
    L,
    N,
    compare,
    documents_for,
    make_layer,
    reference,
)
from torch import nn

from einattn import EinattnError, MultiHeadAttention, patterns, ring, sequence_parallel
from einattn import functional as F
from einattn import parallel as par
from einattn.impls import tiles

CHECKS: dict[str, object] = {}


def check(fn=None, *, name=None):
    CHECKS[name or fn.__name__] = fn
    return fn


def sequence_only(mesh, *, layout: str, impl: str, options: str) -> dict[str, float]:
    """The sequence-parallel layer against the same layer on the whole sequence."""
    ref, lay = reference(options, impl)
    return compare(par.shard_sequence(lay, mesh, layout=layout), ref, mesh, layout=layout,
                   options=options)


CASES = ["causal gqa rope", "padding", "causal gqa padding",
         "causal window softcap sinks gqa padding", "window alibi rope", "causal own gqa padding",
         "causal documents gqa rope padding", "documents window softcap sinks alibi",
         "same documents gqa", "prefix gqa rope", "local window alibi padding"]
for _layout in ring.LAYOUTS:
    for _impl in ("chunked", "einsum"):
        for _options in CASES:
            check(partial(sequence_only, layout=_layout, impl=_impl, options=_options),
                  name=f"compare[{_layout}, {_impl}, {_options}]")


@check
def data_parallel_averages_per_rank_means(mesh):
    """Under DistributedDataParallel (which averages the ranks' gradients), a loss that is
    each rank's mean over its own tokens gives the gradient of the mean over all of them."""
    ref = make_layer("causal gqa rope", "chunked")
    lay = nn.parallel.DistributedDataParallel(par.shard_sequence(copy.deepcopy(ref), mesh),
                                              process_group=mesh.get_group())  # its ranks'
    x = randn(N, L, D, seed=3)
    ref(x).square().mean().backward()
    lay(par.split_sequence(x, mesh)).square().mean().backward()
    errors = {f"d{name}": scaled_error(p.grad, getattr(ref, name).grad)
              for name, p in lay.module.named_parameters()}
    assert max(errors.values()) <= TOL, errors
    return errors


@check
def split_then_gather(mesh):
    """gather_sequence(split_sequence(t)) = t along any dim, for both layouts, and its
    backward gives each rank the gradient of its own part; the ranks' positions cover the
    sequence once."""
    R, t = mesh.size(), randn(2, L, 3, L, seed=4)
    for layout in ring.LAYOUTS:
        for dim in (1, 3, -1):
            back = par.gather_sequence(par.split_sequence(t, mesh, layout=layout, dim=dim),
                                       mesh, layout=layout, dim=dim)
            assert torch.equal(back, t), (layout, dim)
        part = par.split_sequence(t, mesh, layout=layout).requires_grad_()
        (par.gather_sequence(part, mesh, layout=layout) * t).sum().backward()
        assert torch.equal(part.grad, par.split_sequence(t, mesh, layout=layout))  # its own
        covered = torch.cat([ring.positions(k, R, L // R, layout) for k in range(R)])
        assert sorted(covered.tolist()) == list(range(L)), (layout, covered)
    return {"layouts": list(ring.LAYOUTS)}


def _sharded(mesh, options="causal", impl="chunked"):
    return par.shard_sequence(make_layer(options, impl), mesh)


def call_errors(mesh) -> dict[str, tuple[object, str]]:
    """name -> (call, match) for the refusals of a sequence-parallel layer's calls."""
    R = mesh.size()
    x = randn(N, L // R, D, seed=5)
    forward_refusals = {
        "cache": r"takes no cache: a KVCache is for decoding",
        "mask": r"takes no mask: a mask of \(τ, σ\) spans the whole sequence",
        "need_weights": r"takes no need_weights: the weights A\[n μ τ σ\] never exist whole",
        "positions": r"takes no positions: each rank's positions follow from the layout",
    }
    calls = {name: (lambda name=name: _sharded(mesh)(x, **{name: True}), match)
             for name, match in forward_refusals.items()}
    return {
        **calls,
        "not divisible": (lambda: _sharded(mesh)(randn(N, 5, D, seed=6)),
                          rf"the whole sequence \(x's length × the mesh size {R}\) has {5 * R} "
                          rf"positions, which layout='zigzag' cannot cut into {2 * R} equal"),
        "documents whole": (lambda: _sharded(mesh)(x, document_ids=torch.zeros(N, L, dtype=int)),
                            rf"document_ids is torch.int64 of shape \({N}, {L}\), but a "
                            rf"sequence-parallel layer needs integers \(n, L/R\) = "
                            rf"\({N}, {L // R}\): this rank's part"),
        "documents float": (lambda: _sharded(mesh)(x, document_ids=torch.zeros(N, L // R)),
                            r"document_ids is torch.float32 of shape .* needs integers"),
        "padding list": (lambda: _sharded(mesh)(x, key_padding_mask=[[True]]),
                         r"key_padding_mask is list, but a sequence-parallel layer needs bool"),
        "sdpa": (lambda: _sharded(mesh, impl="sdpa")(x),
                 r"runs each block with impl 'chunked' or 'einsum'.*got impl='sdpa'"),
        "padding shape": (lambda: _sharded(mesh)(x, key_padding_mask=torch.zeros(N, L, dtype=bool)),
                          rf"key_padding_mask is torch.bool of shape \({N}, {L}\), but a "
                          rf"sequence-parallel layer needs bool \(n, L/R\) = \({N}, {L // R}\)"),
        "dropout": (lambda: par.shard_sequence(MultiHeadAttention(D, MU, d_head=A, dropout=0.1,
                                                                   dtype=F64), mesh)(x),
                    r"takes no dropout: each block runs the chunked path"),
    }


def sharding_errors(mesh) -> dict[str, tuple[object, str]]:
    """name -> (call, match) for the refusals of shard_sequence and split_sequence."""
    from torch.distributed.device_mesh import init_device_mesh
    R = mesh.size()
    return {
        "split not divisible": (lambda: par.split_sequence(torch.ones(2, 2 * R + 1), mesh),
                                r"dim 1 of t has \d+ positions.*pad the sequence to a multiple"),
        "2-D mesh": (lambda: par.shard_sequence(make_layer("", "chunked"),
                                                init_device_mesh("cpu", (1, R))),
                     r"shard_sequence needs a 1-D device mesh, got 2-D"),
        "dynamic rope": (lambda: par.shard_sequence(
            MultiHeadAttention(8, 2, rope="half", rope_scaling={
                "rope_type": "dynamic", "factor": 2.0,
                "max_position_embeddings": 8}), mesh),
            r"rope_scaling 'dynamic' scales by the longest position"),
        "head-parallel": (lambda: par.shard_sequence(
            par.shard_heads(make_layer("", "chunked"), mesh), mesh),
            r"already sharded by heads over a mesh of size"),
        "sequence first": (lambda: par.shard_sequence(
            MultiHeadAttention(8, 2, batch_first=False), mesh),
            r"shard_sequence cuts the tokens along dim 1 of x \(n, L, d_model\): build the "
            r"layer with batch_first=True"),
        "bad layout": (lambda: par.shard_sequence(make_layer("", "chunked"), mesh,
                                                  layout="striped"),
                       r"layout must be one of 'zigzag', 'contiguous', got 'striped'"),
    }


@check
def errors_with_a_mesh(mesh):
    """Each raise that needs a mesh; returns the lines of einattn/sequence_parallel.py that
    raised."""
    lines = set()
    for call, match in {**call_errors(mesh), **sharding_errors(mesh)}.values():
        lines |= raised_in(call, match, [sequence_parallel.__file__])
    return {"raise lines": sorted(lines)}


# -- the processes --------------------------------------------------------------------------


def on_three_ranks_slow(world: int) -> list[str]:
    """On 3 ranks, the comparisons other than zigzag with chunked tiles and other than packed
    documents (every layout and impl) run with EINATTN_SLOW=1: 2 ranks run them all."""
    if world != 3:
        return []
    return [name for name in CHECKS if name.startswith("compare[")
            and not name.startswith("compare[zigzag, chunked,") and "documents" not in name]


ranks, test_on_every_rank = rank_tests(__name__, [2, 3], CHECKS, slow=on_three_ranks_slow)


def test_every_raise_site_of_sequence_parallelism_is_reached(ranks):
    """STYLE §4: each ``raise`` in einattn/sequence_parallel.py has a ``pytest.raises`` test
    on the ranks."""
    unreached = unreached_raise_sites(ranks, sequence_parallel.__file__)
    assert not unreached, f"raise sites with no test: {sorted(unreached)}"


# -- in this process ------------------------------------------------------------------------

def test_merge_equals_the_softmax_over_both_sets_of_keys():
    """(M1)–(M2) on rows that see keys in one set, in both, or in neither; on rows with a
    key, ``merge`` is MERGE_LSE and MERGE_Z as written."""
    S, V = randn(2, 3, 4, 9, seed=7), randn(2, 3, 9, 5, seed=8)
    S[0, 1, 1, :4] = -torch.inf  # keys of the second set only
    S[1, 2, 2] = -torch.inf      # no key at all
    parts = []
    for keys in (slice(0, 4), slice(4, 9)):
        lse = S[..., keys].logsumexp(-1)
        Z = torch.softmax(S[..., keys], -1).nan_to_num(0.0) @ V[..., keys, :]
        parts.append((Z, lse))
    Z, lse = ring.merge(*parts[0], *parts[1])
    A = torch.softmax(S, -1).nan_to_num(0.0)
    torch.testing.assert_close(Z, A @ V, rtol=0, atol=1e-15)
    torch.testing.assert_close(lse, S.logsumexp(-1), rtol=0, atol=1e-15)
    assert Z[1, 2, 2].eq(0).all() and lse[1, 2, 2] == -torch.inf
    (Z_1, lse_1), (Z_2, lse_2) = parts
    lse_1, lse_2 = lse_1.clamp(min=-30.0), lse_2.clamp(min=-30.0)  # every row sees a key
    Z, lse = ring.merge(Z_1, lse_1, Z_2, lse_2)
    torch.testing.assert_close(lse, ring.MERGE_LSE(lse_1=lse_1, lse_2=lse_2), rtol=0, atol=1e-12)
    torch.testing.assert_close(Z, ring.MERGE_Z(lse_1=lse_1, Z_1=Z_1, lse_2=lse_2, Z_2=Z_2, lse=lse),
                               rtol=0, atol=1e-12)


def test_a_blocks_backward_with_the_whole_rows_lse_stays_finite():
    """A pair's backward reads the whole row's ``lse``: rows of a window that see no key of
    an earlier chunk, whose keys elsewhere score about −800 (``e^{−lse}`` overflows float64),
    give it no gradient, and its dK, dV are the dense ones (its own keys' scores are small,
    which once took ``exp(S) e^{−lse}`` unshifted: 0 · ∞ = NaN)."""
    c, e0 = 6, torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=F64)
    Q, K, V = (randn(1, 2, L, a, seed=k) for k, (L, a) in enumerate([(c, 4), (2 * c, 4),
                                                                       (2 * c, 3)]))
    K[:, :, :c] *= 0.01  # chunk 0: small scores
    Q[:, :, :3, 0] = 0.0  # positions 6-8: small scores on chunk 1 too
    Q[:, :, 3:], K[:, :, c:] = 40.0 * e0, K[:, :, c:] * 0.1 - 40.0 * e0  # 9-11 on 6-11: ≈ −800
    Q, K, V = (t.requires_grad_() for t in (Q, K, V))
    Z = F.attention(Q, K, V, causal=True, window=4, impl="einsum")  # queries at 6 … 11
    dZ = randn(*Z.shape, seed=3)
    dK, dV = (g[:, :, :c] for g in torch.autograd.grad(Z, (K, V), dZ))
    mine = patterns.build(n=1, n_heads=2, L_q=c, L_k=2 * c, dtype=F64, device="cpu",
                          causal=True, window=4)
    _, lse = tiles.forward(Q, K, V, None, mine, 8)
    assert lse[:, :, 3:].max() < -700
    whole = patterns.build(n=1, n_heads=2, L_q=2 * c, L_k=2 * c, dtype=F64, device="cpu",
                           causal=True, window=4)
    (_, _, pair), _ = ring.pairs((1,), (0, 1), c, whole)  # chunk 1's queries, chunk 0's keys
    dQ_p, dK_p, dV_p, *_ = tiles.backward(Q, K[:, :, :c], V[:, :, :c], Z, tiles.for_backward(
        lse), None, dZ, pair, 8, mask_grad=False)
    assert torch.isfinite(dQ_p).all() and torch.equal(dQ_p[:, :, 3:], torch.zeros(1, 2, 3, 4))
    assert scaled_error(dK_p, dK) <= TOL and scaled_error(dV_p, dV) <= TOL


def causal_tiles(R: int, layout: str, L: int, block_size: int) -> list[int]:
    """The tiles of ``block_size`` each rank computes under causal attention over ``L``."""
    c = L // ring.n_chunks(R, layout)
    causal = patterns.build(n=1, n_heads=1, L_q=L, L_k=L, dtype=torch.float64, device="cpu",
                            causal=True)
    return [sum(len(p.tiles(block_size)) for k in range(R) for _, _, p in
                ring.pairs(ring.chunks(rank, R, layout), ring.chunks(k, R, layout), c, causal))
            for rank in range(R)]


@pytest.mark.parametrize("R", [2, 3, 4, 8])
def test_zigzag_balances_causal_work(R):
    """Under causal attention every zigzag rank computes the same number of tiles; with
    contiguous chunks rank k computes k whole pairs and one causal one."""
    zigzag, contiguous = (causal_tiles(R, layout, 32 * R, 8) for layout in ring.LAYOUTS)
    assert len(set(zigzag)) == 1, zigzag
    assert contiguous == [16 * k + 10 for k in range(R)], contiguous  # 32 × 32 chunks


def test_pairs_follow_the_chunks_global_order():
    """Query chunks (1, 2) against key chunks (2, 0) of 4 positions: causal skips (1, 2);
    a window of 3 keys also skips (2, 0), 5 to 11 positions behind; each pair's pieces are
    the sequence's, bound to the queries' positions i·c … and the keys' j·c …, and a piece
    that masks nothing in a pair (causal, for an earlier chunk of keys) is dropped there."""
    def whole(**options):
        return patterns.build(n=1, n_heads=1, L_q=12, L_k=12, dtype=torch.float64,
                              device="cpu", **options)
    causal, window = whole(causal=True), whole(causal=True, window=3)
    assert [(q, k) for q, k, _ in ring.pairs((1, 2), (2, 0), 4, causal)] == \
        [(0, 1), (1, 0), (1, 1)]
    assert [(q, k) for q, k, _ in ring.pairs((1, 2), (2, 0), 4, window)] == [(0, 1), (1, 0)]
    assert len(ring.pairs((1, 2), (2, 0), 4, whole())) == 4
    (_, _, p), *_ = ring.pairs((1, 2), (2, 0), 4, window)
    assert p.masks == (patterns.Window(3),) and (p.frame.q0, p.frame.k0) == (4, 0)


def test_pairs_that_share_no_document_are_skipped():
    """With the whole sequence's document ids, a pair of chunks none of whose queries shares
    a document with its keys is skipped (as causal skips a later chunk); a pair of one
    document each side is whole (no mask work); within a pair, the tiles between two
    documents are skipped."""
    def whole(options):
        return patterns.build(n=N, n_heads=1, L_q=L, L_k=L, dtype=torch.float64,
                              device="cpu", document_ids=documents_for(options))
    same = whole("same documents")  # documents [0, 4), [4, 8), [8, 12) on every n
    kept = ring.pairs((0, 5), (0, 5), 2, same)  # 3 ranks, zigzag: rank 0's chunks 0 and 5
    assert [(q, k) for q, k, _ in kept] == [(0, 0), (1, 1)]  # in documents 0 and 2
    (_, _, p), = ring.pairs((3,), (2,), 2, same)  # positions 6, 7 against 4, 5: document 1
    assert p.tiles(2) == [(0, 2, 0, 2, False)]
    (_, _, p), = ring.pairs((1,), (0,), 3, same)  # 3, 4, 5 against 0, 1, 2: only 3 sees them
    assert p.tiles(1) == [(0, 1, s, s + 1, False) for s in range(3)]
    assert len(ring.pairs((0, 5), (0, 5), 2, whole("documents"))) == 4  # sample 1: one


def test_documents_change_one_process_output():
    """The ring's comparisons with documents could fail: the ids change the output."""
    layer = make_layer("causal gqa", "chunked")
    x = randn(N, L, D, seed=1)
    assert (layer(x) - layer(x, document_ids=documents_for("documents"))).abs().max() > 0.1


SINGLE_PROCESS_ERRORS = {
    "not a layer": (lambda: par.shard_sequence(nn.Linear(3, 3), None),
                    r"shard_sequence needs an einattn.MultiHeadAttention, got Linear"),
    "not a mesh": (lambda: par.split_sequence(torch.ones(2, 4), [0, 1]),
                   r"device_mesh must be a torch.distributed DeviceMesh, got list"),
    "layout": (lambda: ring.check_layout("ring"),
               r"layout must be one of 'zigzag', 'contiguous', got 'ring'"),
    "length": (lambda: ring.check_length(10, 3, "contiguous", what="x"),
               r"x has 10 positions, which layout='contiguous' cannot cut into 3 equal chunks "
               r"\(one chunk on each of 3 ranks\): pad the sequence to a multiple of 3"),
}


@pytest.mark.parametrize("name", list(SINGLE_PROCESS_ERRORS))
def test_bad_input_raises_einattn_error(name):
    call, match = SINGLE_PROCESS_ERRORS[name]
    with pytest.raises(EinattnError, match=match):
        call()
