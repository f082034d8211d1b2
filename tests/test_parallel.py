"""einattn.parallel: head-parallel attention on torch.distributed, on WORLD gloo processes
on the CPU, checked against the single-process layer.

The processes are started once for the module (spawning them costs more than every
check together). Each runs every check of ``CHECKS`` in order and records, per check, its
measured errors or its traceback; one pytest test per check then fails if any rank failed.
Each rank builds its single-process reference from the same seed, so "equal to one
process" is checked on every rank, in float64 at 1e-12 relative to scale.
"""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
import torch.distributed as dist
from conftest import randn
from head_cases import (
    F64,
    L_Q,
    MU,
    A,
    D,
    G,
    N,
    full,
    inputs,
    make_layer,
    rope_in,
    run,
    within,
)
from ranks import (
    raised_in,
    rank_tests,
    scaled_error,
    unreached_raise_sites,
)
from torch import nn

import einattn
from einattn import MultiHeadAttention, _sharding, head_parallel, patterns
from einattn import parallel as par

WORLD = 2  # the ranks; G key/value groups and MU heads of head_cases split over them
CHECKS: dict[str, object] = {}  # name -> check(mesh) -> {quantity: error}, run on every rank


def check(fn=None, *, name=None):
    CHECKS[name or fn.__name__] = fn
    return fn


def compare(mesh, *, n_kv_heads, impl, options) -> dict[str, float]:
    """Output and the gradients of x, context, a float mask, W, W_O, b and b_O: sharded
    vs one process."""
    ref = make_layer(n_kv_heads=n_kv_heads, impl=impl, rope=rope_in(options))
    lay = par.shard_heads(copy.deepcopy(ref), mesh)
    assert lay.n_heads == MU and lay.n_local_heads == MU // WORLD
    call_ref, call_lay = inputs(options), inputs(options)
    T = randn(N, L_Q, D, seed=99)
    Y_ref, Y_lay = run(ref, call_ref), run(lay, call_lay)
    (Y_ref * T).sum().backward()
    (Y_lay * T).sum().backward()
    errors = {"Y": scaled_error(Y_lay, Y_ref)}
    for name in ("x", "context", "mask"):
        if name in call_ref and call_ref[name].requires_grad:
            errors[f"d{name}"] = scaled_error(call_lay[name].grad, call_ref[name].grad)
    for name in ("W", "W_O", "b", "b_O"):
        grad = getattr(lay, name).grad
        assert isinstance(grad, torch.distributed.tensor.DTensor)
        assert grad.placements == (par.PLACEMENTS[name],)
        errors[f"d{name}"] = scaled_error(grad.full_tensor(), getattr(ref, name).grad)
    return within(errors)


# (impl, n_kv_heads, what the call has); every impl with and without grouping.
CASES = [
    ("einsum", None, "causal"),
    ("sdpa", None, "causal"),
    ("chunked", None, "causal"),
    ("einsum", G, "causal"),
    ("sdpa", G, "causal"),
    ("chunked", G, "causal"),
    ("einsum", None, "context padding"),
    ("sdpa", G, "context padding"),
    ("chunked", None, "context bool nμτσ"),
    ("einsum", G, "bool nμτσ causal"),
    ("sdpa", None, "float nμτσ"),
    ("chunked", G, "float nμτσ padding"),
    ("sdpa", G, "bool n1τσ"),
    ("einsum", G, "float τσ causal"),
    ("chunked", None, "context float τσ"),
    ("einsum", G, "half causal"),  # RoPE: "half" or "interleaved", default or given positions
    ("sdpa", None, "interleaved positions causal"),
    ("chunked", G, "half positions padding"),
]
for _impl, _g, _options in CASES:
    check(partial(compare, n_kv_heads=_g, impl=_impl, options=_options),
          name=f"forward_backward[{_impl}, n_kv_heads={_g}, {_options}]")


@check
def pieces_of_positions(mesh):
    """Pieces of one's own that read positions alone (a Mask string, a MaskMod, a ScoreMod
    of the distance, a prefix LM, chunks) run on the rank's heads as on one device, the
    layer's and the call's."""
    bias = randn(17, seed=3)
    own = [patterns.Mask("⌊τ / 3⌋ = ⌊σ / 3⌋ ∨ σ < 2"),
           patterns.MaskMod(lambda b, h, q, kv: (q - kv) % 4 != 1),
           patterns.ScoreMod(lambda s, b, h, q, kv: s + bias[(q - kv).clamp(-8, 8) + 8])]
    ref = make_layer(n_kv_heads=G, impl="chunked", pattern=own)
    lay = par.shard_heads(copy.deepcopy(ref), mesh)
    call = inputs("causal padding")
    extra = {"pattern": [patterns.PrefixLM(torch.tensor([2, 0, 5, 1])), patterns.ChunkedLocal(4)]}
    return within({"Y": scaled_error(run(lay, call, **extra), run(ref, call, **extra))})


@check
def weights_and_intermediates(mesh):
    """need_weights gives every head's A; return_intermediates every stage, gathered."""
    errors = {}
    for g in (None, G):
        ref = make_layer(n_kv_heads=g)
        lay = par.shard_heads(copy.deepcopy(ref), mesh)
        call = inputs("context bool nμτσ")
        _, A_ref = run(ref, call, need_weights=True)
        _, A_lay = run(lay, call, need_weights=True, impl="sdpa")  # A exists on einsum only
        errors[f"A, n_kv_heads={g}"] = scaled_error(A_lay, A_ref)
        _, stages_ref = run(ref, call, return_intermediates=True)
        _, stages_lay = run(lay, call, return_intermediates=True)
        assert stages_lay.keys() == stages_ref.keys()
        for name, t in stages_ref.items():
            errors[f"{name}, n_kv_heads={g}"] = scaled_error(stages_lay[name], t)
    return within(errors)


@check
def training_steps(mesh):
    """Three SGD steps on the DTensor parameters keep the layer equal to one process, with
    the attention patterns that hold per-head values (sinks, ALiBi's slopes) and a window."""
    ref = make_layer(n_kv_heads=G, impl="chunked", sinks=True, alibi=True, window=3)
    lay = par.shard_heads(copy.deepcopy(ref), mesh)
    optimisers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, lay)]
    for step in range(3):
        for m, opt in zip((ref, lay), optimisers, strict=True):
            opt.zero_grad()
            (run(m, inputs("causal", seed=step)) ** 2).mean().backward()
            opt.step()
    errors = {name: scaled_error(full(getattr(lay, name)).detach(), getattr(ref, name).detach())
              for name in par.PLACEMENTS}
    errors["Y"] = scaled_error(run(lay, inputs("causal")), run(ref, inputs("causal")))
    return within(errors)


@check
def dropout_in_training(mesh):
    """With dropout each rank drops weights of its own heads; the summed output is still
    one tensor, the same on every rank, and backward runs."""
    for impl in ("einsum", "sdpa"):
        layer = make_layer(n_kv_heads=G, impl=impl)
        layer.dropout = 0.3
        lay = par.shard_heads(layer, mesh).train()
        call = inputs("causal")
        Y = run(lay, call)
        Y.sum().backward()
        everyone = [torch.empty_like(Y) for _ in range(WORLD)]
        dist.all_gather(everyone, Y.detach())
        assert all(torch.equal(e, Y) for e in everyone), "ranks disagree on Y"
        assert not torch.allclose(Y, run(lay.eval(), inputs("causal")))
        assert torch.isfinite(call["x"].grad).all() and torch.isfinite(lay.W.grad.to_local()).all()
    return {}


@check
def sharding_is_by_whole_heads(mesh):
    """Rank k's rows of W are heads [k·μ/w, (k+1)·μ/w) of the unsharded W[(μ B a) i]
    (groups, with n_kv_heads); its slice of W_O is the same heads."""
    rank = mesh.get_local_rank()
    for g in (None, G):
        ref = make_layer(n_kv_heads=g)
        lay = par.shard_heads(copy.deepcopy(ref), mesh)
        groups = g or MU
        rows = ref.W.shape[0] // groups  # rows per group: C·a, or B·a = 3·a
        local = range(rank * groups // WORLD, (rank + 1) * groups // WORLD)
        assert torch.equal(lay.W.to_local(), ref.W[local.start * rows:local.stop * rows])
        assert torch.equal(lay.b.to_local(), ref.b[local.start * rows:local.stop * rows])
        assert lay.local_heads == range(rank * MU // WORLD, (rank + 1) * MU // WORLD)
        assert torch.equal(lay.W_O.to_local(), ref.W_O[lay.local_heads.start:
                                                       lay.local_heads.stop])
        assert torch.equal(lay.b_O.to_local(), ref.b_O)
        assert lay.n_local_kv_heads == groups // WORLD
        assert isinstance(lay, par.HeadParallel) and isinstance(lay, MultiHeadAttention)
        assert f"mesh size={WORLD}" in repr(lay)
    return {}


@check
def gather_heads_and_projections(mesh):
    """gather_heads returns the unsharded layer (RoPE and its base too); projections and
    to_torch go through it."""
    ref = make_layer(n_kv_heads=None, rope="interleaved")
    ref.rope_base = 500.0
    lay = par.shard_heads(copy.deepcopy(ref), mesh)
    plain = par.gather_heads(lay)
    assert type(plain) is MultiHeadAttention
    assert (plain.rope, plain.rope_base) == ("interleaved", 500.0)
    for name in par.PLACEMENTS:
        if getattr(ref, name) is not None:
            assert torch.equal(getattr(plain, name), getattr(ref, name)), name
    for a, b in zip(lay.projections(), ref.projections(), strict=True):
        assert torch.equal(a, b)
    lay.batch_first = False  # kept by the gathered layer
    assert plain.batch_first and par.gather_heads(lay).batch_first is False
    lay.batch_first = True
    call = inputs("causal")
    errors = {"Y": scaled_error(run(plain, call), run(ref, call))}
    torch.manual_seed(0)  # to_torch needs μ·a = d_model
    narrow = MultiHeadAttention(12, 6, bias=True, dtype=F64)
    mha = par.shard_heads(copy.deepcopy(narrow), mesh).to_torch()
    for name, t in narrow.to_torch().state_dict().items():
        assert torch.equal(mha.state_dict()[name], t), name
    return within(errors)


OWN = (head_parallel.__file__, _sharding.__file__)  # the modules whose raises are tested here


def _raised_in_parallel_py(call, match: str) -> set[tuple[str, int]]:
    """Run ``call``, which must raise EinattnError matching ``match``; the lines of
    einattn/head_parallel.py and einattn/_sharding.py in its traceback."""
    return raised_in(call, match, OWN)


def _replicated_W(layer: MultiHeadAttention, mesh) -> MultiHeadAttention:
    """``layer`` with its W a DTensor, as ``fully_shard`` or ``distribute_tensor`` leaves it."""
    from torch.distributed.tensor import Replicate, distribute_tensor
    layer.W = nn.Parameter(distribute_tensor(layer.W.detach(), mesh, [Replicate()]))
    return layer


def distributed_errors(mesh) -> dict[str, tuple[object, str]]:
    """name -> (call, match) for the errors that need a mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    def sharded():
        return par.shard_heads(make_layer(), mesh)

    return {
        "μ not divisible": (lambda: par.shard_heads(MultiHeadAttention(9, 3), mesh),
                            r"index 'μ' has size n_heads=3.*whole heads: 3 is not divisible "
                            r"by the mesh size 2"),
        "g not divisible": (lambda: par.shard_heads(MultiHeadAttention(12, 6, n_kv_heads=3),
                                                    mesh),
                            r"index 'g' has size n_kv_heads=3.*whole key/value groups \(of "
                            r"r=2 query heads each\): 3 is not divisible by the mesh size 2"),
        "one kv group": (lambda: par.shard_heads(MultiHeadAttention(12, 6, n_kv_heads=1), mesh),
                         r"index 'g' has size n_kv_heads=1.*not divisible by the mesh size 2"),
        "2-D mesh": (lambda: par.shard_heads(make_layer(),
                                             init_device_mesh("cpu", (1, WORLD))),
                     r"needs a 1-D device mesh, got 2-D \(1, 2\); pass the head-parallel"),
        "already sharded": (lambda: par.shard_heads(sharded(), mesh),
                            r"already sharded by heads over a mesh of size 2; gather_heads"),
        "already sequence-parallel": (lambda: par.shard_heads(
            par.shard_sequence(make_layer(), mesh), mesh),
            r"already runs sequence-parallel over a mesh of size 2; shard a fresh copy"),
        "DTensor parameter": (lambda: par.shard_heads(_replicated_W(make_layer(), mesh), mesh),
                              r"shard_heads needs the layer's own parameters, but W is already "
                              r"a DTensor \(fully_shard, or distribute_tensor\): call "
                              r"shard_heads first, then fully_shard"),
        "per-head mask": (lambda: sharded()(randn(N, L_Q, D, seed=1),
                                            mask=torch.ones(N, 4, L_Q, L_Q, dtype=torch.bool)),
                          r"index 'μ' has size 4 in mask but 6 in the scores S\[n μ τ σ\] "
                          r"\(all heads, before sharding\)"),
        **{f"{name} of μ": (lambda piece=piece: sharded()(randn(N, L_Q, D, seed=1),
                                                          pattern=piece),
                            rf"the pattern piece {name}.* reads the head index μ, but on a "
                            rf"head-sharded layer μ counts the rank's own heads from 0 \(here "
                            rf"the layer's heads \d\.\.\d\)")
           for name, piece in HEAD_PIECES.items()},
    }


HEAD_PIECES = {  # pieces that read the head index μ
    "MaskMod": patterns.MaskMod(lambda b, h, q, kv: (h + q - kv) % 3 != 1),
    "ScoreMod": patterns.ScoreMod(lambda s, b, h, q, kv: s - 0.1 * h),
    "AllOf": patterns.Mask("μ ≤ τ") & patterns.Causal(),  # a Mask string of μ, and-ed
    "ALiBi": patterns.ALiBi(),
    "Sinks": patterns.Sinks(torch.zeros(MU, dtype=F64)),
}


@check
def errors_with_a_mesh(mesh):
    """Each raise that needs a mesh, with its message; returns the lines that raised."""
    lines = set()
    for call, match in distributed_errors(mesh).values():
        lines |= _raised_in_parallel_py(call, match)
    return {"raise lines": sorted(lines)}


@check
def data_parallel(mesh):
    """An unsharded layer under DistributedDataParallel: each rank its half of the batch,
    and both ranks end with the gradient of the whole batch (DDP averages)."""
    rank = mesh.get_local_rank()
    ref = make_layer(n_kv_heads=G, impl="sdpa")
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(ref))
    call = inputs("causal padding")
    T = randn(N, L_Q, D, seed=99)
    half = slice(rank * N // WORLD, (rank + 1) * N // WORLD)
    mine = {k: v[half] if k in ("x", "key_padding_mask") else v for k, v in call.items()}
    (run(ddp, mine) * T[half]).sum().backward()
    (run(ref, call) * T).sum().div(WORLD).backward()
    errors = {}
    for (name, p), q in zip(ddp.module.named_parameters(), ref.parameters(), strict=True):
        everyone = [torch.empty_like(p.grad) for _ in range(WORLD)]
        dist.all_gather(everyone, p.grad)
        assert all(torch.equal(e, everyone[0]) for e in everyone), f"d{name} differs by rank"
        errors[f"d{name}"] = scaled_error(p.grad, q.grad)
    return within(errors)


@check
def kv_cache_decode(mesh):
    """Prefill, then one token at a time, with an einattn.KVCache on the sharded layer:
    each rank caches its own groups' keys and values K[n g σ a], and the outputs equal the
    unsharded layer's causal forward over the whole sequence. The last step's stages (K and
    V: the whole cache) are gathered from the ranks and equal the unsharded layer's."""
    rank, steps = mesh.get_local_rank(), 3
    x = randn(N, L_Q + steps, D, seed=5)
    padding = torch.zeros(N, L_Q + steps, dtype=torch.bool)
    padding[1, :2] = True  # a left-padded prompt
    errors = {}
    for g, rope, impl in ((G, None, "sdpa"), (None, "half", "einsum"), (G, "half", "chunked")):
        ref = make_layer(n_kv_heads=g, impl=impl, rope=rope)
        lay = par.shard_heads(copy.deepcopy(ref), mesh)
        case = f"n_kv_heads={g}, rope={rope}, {impl}"
        whole = ref(x, causal=True, key_padding_mask=padding)
        caches = {"ref": einattn.KVCache(), "sharded": einattn.KVCache()}
        ys = [lay(x[:, :L_Q], causal=True, key_padding_mask=padding[:, :L_Q],
                  cache=caches["sharded"])]
        ref(x[:, :L_Q], causal=True, key_padding_mask=padding[:, :L_Q], cache=caches["ref"])
        for t in range(L_Q, L_Q + steps - 1):
            ys.append(lay(x[:, t:t + 1], causal=True, cache=caches["sharded"]))
            ref(x[:, t:t + 1], causal=True, cache=caches["ref"])
        last = {name: layer(x[:, -1:], causal=True, cache=caches[name],
                            return_intermediates=True)[1]
                for name, layer in (("ref", ref), ("sharded", lay))}
        errors[f"Y, {case}"] = scaled_error(torch.cat([*ys, last["sharded"]["Y"]], dim=1),
                                            whole)
        groups = lay.n_local_kv_heads
        mine = slice(rank * groups, (rank + 1) * groups)
        for name in ("K", "V"):
            held = getattr(caches["sharded"], name)
            assert held.shape == (N, groups, L_Q + steps, A), held.shape
            errors[f"cached {name}, {case}"] = scaled_error(
                held, getattr(caches["ref"], name)[:, mine])
        for name, t in last["ref"].items():
            errors[f"last step {name}, {case}"] = scaled_error(last["sharded"][name], t)
    return within(errors)


@check
def hooks_of_the_user(mesh):
    """The user's hooks, registered before sharding, see what the unsharded layer sees:
    a pre-hook the caller's x, a forward hook the whole layer's Y (not one rank's part)."""
    ref = make_layer(n_kv_heads=G)
    layer = copy.deepcopy(ref)
    seen = {}
    layer.register_forward_pre_hook(lambda m, args: seen.setdefault("x", args[0]))
    layer.register_forward_hook(lambda m, args, out: seen.setdefault("Y", out))
    lay = par.shard_heads(layer, mesh)
    call = inputs("causal")
    Y = run(lay, call)
    assert seen["x"] is call["x"] and seen["Y"] is Y
    return within({"Y": scaled_error(Y, run(ref, call))})


# -- the processes --------------------------------------------------------------------------

ranks, test_on_every_rank = rank_tests(__name__, [WORLD], CHECKS)


# -- in this process ------------------------------------------------------------------------

SINGLE_PROCESS_ERRORS = {
    "not a layer": (lambda: par.shard_heads(nn.Linear(3, 3), None),
                    r"shard_heads needs an einattn.MultiHeadAttention, got Linear"),
    "not a mesh": (lambda: par.shard_heads(MultiHeadAttention(8, 2), [0, 1]),
                   r"device_mesh must be a torch.distributed DeviceMesh, got list"),
    "own context width": (lambda: par.shard_heads(MultiHeadAttention(8, 2, d_context=6), None),
                          r"this layer projects a context of width d_context=6 through W_Q and "
                          r"W_KV, which it does not shard yet"),
    "gather unsharded": (lambda: par.gather_heads(MultiHeadAttention(8, 2)),
                         r"gather_heads needs a layer sharded by shard_heads, got "
                         r"MultiHeadAttention"),
}


def test_forward_is_the_layers_own():
    """The sharded layer has no forward of its own, so it takes every argument of
    MultiHeadAttention.forward (cache=, positions=, ...), now and after any that is added;
    a subclass of the layer keeps its own forward too."""
    assert "forward" not in vars(par.HeadParallel)
    sharded = _sharding.parallel_class(par.HeadParallel, MultiHeadAttention)
    assert sharded.forward is MultiHeadAttention.forward

    class Mine(MultiHeadAttention):
        def forward(self, x, *, scale: float = 1.0):
            return super().forward(x) * scale

    assert _sharding.parallel_class(par.HeadParallel, Mine).forward is Mine.forward


@pytest.mark.parametrize("name", list(SINGLE_PROCESS_ERRORS))
def test_bad_input_raises_einattn_error(name):
    call, match = SINGLE_PROCESS_ERRORS[name]
    _raised_in_parallel_py(call, match)


def test_every_raise_site_of_head_parallelism_is_reached(ranks):
    """STYLE §4: each ``raise`` in einattn/head_parallel.py (and in the checks every
    parallelism shares, einattn/_sharding.py) has a ``pytest.raises`` test, here or on the
    ranks."""
    reached = set()
    for call, match in SINGLE_PROCESS_ERRORS.values():
        reached |= _raised_in_parallel_py(call, match)
    unreached = unreached_raise_sites(ranks, *OWN) - reached
    assert not unreached, f"raise sites with no test: {sorted(unreached)}"

