"""einattn.parallel.shard: one layer over the named dimensions of a device mesh, on 4 gloo
processes on the CPU as 2 (heads) × 2 (sequence), in float64, against one process running
every head over the whole sequence (the cases of tests/sequence_cases.py): the gathered
output, the gathered gradient of the input, every parameter's gradient (whole over
``heads``, summed over ``seq``). Then FSDP2 around it: a small model's training step on a
``(dp, heads, seq)`` mesh (``dp`` = 1 on 4 processes; 2 on 8 with EINATTN_SLOW=1), and the
refusals, each naming what is wrong.
"""

from __future__ import annotations

import copy
import functools
import os
from functools import partial

import pytest
import torch
import torch.distributed as dist
from conftest import randn
from ranks import (
    assert_on_every_rank,
    raised_in,
    rank_tests,
    run_checks,
    scaled_error,
    unreached_raise_sites,
)
from sequence_cases import F64, TOL, D, L, N, compare, reference
from torch import nn

from einattn import MultiHeadAttention
from einattn import parallel as par

WORLD = 4
CHECKS: dict[str, object] = {}


def check(fn=None, *, name=None):
    CHECKS[name or fn.__name__] = fn
    return fn


@functools.cache
def two_by_two(order: tuple[str, str]):
    """The 2 × 2 mesh with dimensions ``order``: ("heads", "seq") puts ranks 0, 1 on one
    ring, ("seq", "heads") ranks 0, 2. Made once per process (each makes gloo groups), in
    the order the checks ask, the same on every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=order)


def heads_by_sequence(_, *, order: tuple, layout: str, impl: str, options: str) -> dict:
    """``shard(heads="heads", sequence="seq")`` against one process."""
    mesh = two_by_two(order)
    ref, lay = reference(options, impl)
    assert par.shard(lay, mesh, heads="heads", sequence="seq", layout=layout) is lay
    return compare(lay, ref, mesh["seq"], mesh["heads"], layout=layout, options=options)


HS, SH = ("heads", "seq"), ("seq", "heads")
CASES = [  # (mesh order, layout, impl, options); without "gqa" 6 heads, 3 a rank
    (HS, "zigzag", "chunked", "causal gqa rope"),
    (SH, "zigzag", "chunked", "causal gqa rope"),
    (HS, "contiguous", "einsum", "causal gqa rope"),
    (HS, "zigzag", "chunked", "causal window sinks padding"),
    (SH, "contiguous", "einsum", "causal window softcap sinks gqa"),
    (HS, "zigzag", "chunked", "causal documents gqa rope padding"),
    (SH, "zigzag", "einsum", "documents window alibi"),
    (HS, "contiguous", "chunked", "same documents gqa"),
    (SH, "zigzag", "chunked", "causal own gqa padding"),
    (HS, "zigzag", "chunked", "prefix gqa rope"),
    (SH, "contiguous", "chunked", "local window alibi padding"),
]
for _order, _layout, _impl, _options in CASES:
    check(partial(heads_by_sequence, order=_order, layout=_layout, impl=_impl,
                  options=_options),
          name=f"heads × sequence[{' × '.join(_order)}, {_layout}, {_impl}, {_options}]")


@check
def either_alone_is_the_one_dimensional_sharding(_):
    """``shard(heads=)`` is ``shard_heads`` on that dimension, ``shard(sequence=)`` is
    ``shard_sequence``: the same class, the same output to the last bit; parameter names
    are unchanged, and a DTensor parameter lives on the ``heads`` dimension alone."""
    mesh = two_by_two(HS)
    ref = reference("causal gqa rope", "chunked")[0]
    x, names = randn(N, L, D, seed=3), [name for name, _ in ref.named_parameters()]
    a = par.shard(copy.deepcopy(ref), mesh, heads="heads")
    b = par.shard_heads(copy.deepcopy(ref), mesh["heads"])
    assert type(a) is type(b) and torch.equal(a(x), b(x))
    assert all(p.device_mesh.mesh_dim_names == ("heads",) for p in a.parameters())
    x_k = par.split_sequence(x, mesh["seq"], layout="contiguous")
    a = par.shard(copy.deepcopy(ref), mesh, sequence="seq", layout="contiguous")
    b = par.shard_sequence(copy.deepcopy(ref), mesh["seq"], layout="contiguous")
    assert type(a) is type(b) and torch.equal(a(x_k), b(x_k))
    both = par.shard(copy.deepcopy(ref), mesh, heads="heads", sequence="seq")
    for layer in (a, both):
        assert [name for name, _ in layer.named_parameters()] == names
    assert isinstance(both, par.HeadParallel) and isinstance(both, par.SequenceParallel)
    assert "mesh size=2" in repr(both) and "sequence over a mesh of size 2" in repr(both)
    return {}


def _layer(*args, **kwargs) -> MultiHeadAttention:
    return MultiHeadAttention(*args, dtype=F64, **kwargs)


def dimension_errors(mesh) -> dict[str, tuple[object, str]]:
    """name -> (call, match) for ``shard``'s refusals of its mesh and dimension names."""
    from torch.distributed.device_mesh import init_device_mesh
    flat = init_device_mesh("cpu", (WORLD,))
    return {
        "no such dimension": (lambda: par.shard(_layer(8, 2), mesh, heads="tp", sequence="seq"),
                              r"heads='tp' is not a dimension of the mesh, whose dimensions "
                              r"are 'heads', 'seq'"),
        "two dimensions": (lambda: par.shard(_layer(8, 2), mesh, sequence=("heads", "seq")),
                           r"sequence=\('heads', 'seq'\) is not a dimension of the mesh"),
        "same dimension": (lambda: par.shard(_layer(8, 2), mesh, heads="seq", sequence="seq"),
                           r"heads and sequence both name the mesh dimension 'seq': each needs "
                           r"a dimension of its own"),
        "no dimension": (lambda: par.shard(_layer(8, 2), mesh),
                         r"shard needs heads= or sequence= \(or both\).*among 'heads', 'seq'"),
        "unnamed mesh": (lambda: par.shard(_layer(8, 2), flat, heads="heads"),
                         r"shard finds the mesh's dimensions by name, but this mesh has none: "
                         r"init_device_mesh\(\.\.\., mesh_dim_names="),
        "not a mesh": (lambda: par.shard(_layer(8, 2), "heads", heads="heads"),
                       r"mesh must be a torch.distributed DeviceMesh, got str"),
        "bad layout": (lambda: par.shard(_layer(8, 2), mesh, sequence="seq", layout="ring"),
                       r"layout must be one of 'zigzag', 'contiguous', got 'ring'"),
    }


def layer_errors(mesh) -> dict[str, tuple[object, str]]:
    """name -> (call, match) for ``shard``'s refusals of a layer and of its calls."""
    from torch.distributed.fsdp import fully_shard

    def sharded():
        return par.shard(_layer(8, 2, causal=True), mesh, heads="heads", sequence="seq")

    return {
        "heads not divisible": (
            lambda: par.shard(_layer(9, 3), mesh, heads="heads"),
            r"index 'μ' has size n_heads=3.*whole heads: 3 is not divisible by the mesh size 2 "
            r"\(mesh dimension 'heads'\)"),
        "groups not divisible": (
            lambda: par.shard(_layer(8, 4, n_kv_heads=1), mesh, heads="heads", sequence="seq"),
            r"index 'g' has size n_kv_heads=1, so W\[\(g C a\) i\] cannot give each rank whole "
            r"key/value groups \(of r=4 query heads each\): 1 is not divisible by the mesh "
            r"size 2 \(mesh dimension 'heads'\)"),
        "length not divisible": (
            lambda: sharded()(torch.zeros(1, 5, 8, dtype=F64)),
            r"the whole sequence \(x's length × the mesh size 2 \(mesh dimension 'seq'\)\) "
            r"has 10 positions, which layout='zigzag' cannot cut into 4 equal chunks"),
        "after fully_shard": (lambda: par.shard(fully_shard(_layer(8, 2), mesh=mesh["seq"]),
                                                mesh, heads="heads"),
                              r"shard needs the layer's own parameters, but W is already a "
                              r"DTensor \(fully_shard, or distribute_tensor\): call shard first, "
                              r"then fully_shard"),
        "twice": (lambda: par.shard(sharded(), mesh, heads="heads"),
                  r"this layer already runs sequence-parallel over a mesh of size 2 \(mesh "
                  r"dimension 'seq'\); shard a fresh copy"),
    }


@check
def errors_with_a_mesh(_):
    """Each refusal, with its message; a refusal leaves the layer as it was (the heads are
    not sharded where the sequence is refused). Returns the lines of einattn/parallel.py
    that raised."""
    mesh = two_by_two(HS)
    lines = set()
    for call, match in {**dimension_errors(mesh), **layer_errors(mesh)}.values():
        lines |= raised_in(call, match, [par.__file__])
    layer = MultiHeadAttention(8, 2, batch_first=False)
    raised_in(lambda: par.shard(layer, mesh, heads="heads", sequence="seq"),
              r"build the layer with batch_first=True", [])
    assert type(layer) is MultiHeadAttention and type(layer.W) is nn.Parameter
    return {"raise lines": sorted(lines)}


# -- FSDP2 around it ----------------------------------------------------------------------------

VOCAB, WIDTH, LENGTH = 13, 12, 16  # L = 16: 4 chunks of 4 on 2 sequence ranks


class Block(nn.Module):
    """Attention (4 heads in 2 key/value groups, causal, RoPE, packed documents) and an
    MLP, each with its residual."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = MultiHeadAttention(WIDTH, 4, d_head=2, n_kv_heads=2, bias=True, causal=True,
                                       rope="half", impl="chunked", block_size=2, dtype=F64)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH, dtype=F64), nn.GELU(),
                                 nn.Linear(2 * WIDTH, WIDTH, dtype=F64))

    def forward(self, x, ids):
        x = x + self.attn(x, document_ids=ids)
        return x + self.mlp(x)


class Tiny(nn.Module):
    """An embedding, two blocks and the logits; every parameter random, the same on every
    rank."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH, dtype=F64)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.out = nn.Linear(WIDTH, VOCAB, dtype=F64)
        with torch.no_grad():
            for k, p in enumerate(self.parameters()):
                p.copy_(randn(*p.shape, seed=20 + k) * p.shape[-1] ** -0.5)

    def forward(self, tokens, ids):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, ids)
        return self.out(x)


def batch(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens, their documents (5, 7 and 4 tokens: across the chunks of 4) and targets."""
    g = torch.Generator().manual_seed(5)
    tokens, targets = (torch.randint(VOCAB, (n, LENGTH), generator=g) for _ in range(2))
    ids = torch.tensor([0] * 5 + [1] * 7 + [2] * 4).expand(n, LENGTH)
    return tokens, ids, targets


def loss_of(model, tokens, ids, targets, count: int) -> torch.Tensor:
    """The cross-entropy summed over the tokens given, over ``count`` (every token's)."""
    logits = model(tokens, ids)
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                       reduction="sum") / count


def fsdp_model(ref: Tiny, mesh):
    """``ref``'s copy with each attention sharded over ``heads`` × ``seq`` and FSDP2 over
    ``dp`` and ``seq`` flattened (the gradients summed there, never averaged)."""
    from torch.distributed.fsdp import fully_shard
    model = copy.deepcopy(ref)  # before fully_shard, which refuses deepcopy
    for block in model.blocks:
        par.shard(block.attn, mesh, heads="heads", sequence="seq")
    dp_seq = mesh["dp", "seq"]._flatten("dp_seq")  # torchtitan's dp_shard_cp
    for module in (*model.blocks, model):
        fully_shard(module, mesh=dp_seq)
        module.set_gradient_divide_factor(1.0)      # the loss is over every token already
        module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM (float32)
    return model, dp_seq


@check
def fsdp_step(_):
    """One training step (SGD) of :class:`Tiny` under FSDP2 on a (dp, 2, 2) mesh, each
    dp rank its samples and each seq rank its tokens, against one process on the whole
    batch: the loss, every parameter's gradient and every parameter after the step."""
    from torch.distributed.device_mesh import init_device_mesh
    dp = dist.get_world_size() // 4
    mesh = init_device_mesh("cpu", (dp, 2, 2), mesh_dim_names=("dp", "heads", "seq"))
    ref = Tiny()
    model, dp_seq = fsdp_model(ref, mesh)
    tokens, ids, targets = batch(2 * dp)
    loss = loss_of(ref, tokens, ids, targets, tokens.numel())
    loss.backward()
    d = mesh.get_local_rank("dp")
    mine = [par.split_sequence(t[2 * d:2 * d + 2], mesh["seq"]) for t in (tokens, ids, targets)]
    loss_k = loss_of(model, *mine, tokens.numel())
    loss_k.backward()
    dist.all_reduce(total := loss_k.detach().clone(), group=dp_seq.get_group())
    errors = {"loss": scaled_error(total, loss.detach())}
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        errors[f"d{name}"] = scaled_error(p.grad.full_tensor(), grads[name].grad)
    for m in (ref, model):
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    for name, p in model.named_parameters():
        errors[f"{name} after"] = scaled_error(p.detach().full_tensor(), grads[name].detach())
    bad = {k: e for k, e in errors.items() if not e <= TOL}
    assert not bad, f"errors above {TOL:g}: {bad}"
    assert {name for name, _ in model.named_parameters()} == set(grads)  # names unchanged
    return {"max error": max(errors.values()), "parameters": len(grads)}


# -- the processes --------------------------------------------------------------------------

ranks, test_on_every_rank = rank_tests(__name__, [WORLD], CHECKS)


def test_every_raise_site_of_shard_is_reached(ranks):
    """STYLE §4: each ``raise`` in einattn/parallel.py has a ``pytest.raises`` test."""
    unreached = unreached_raise_sites(ranks, par.__file__)
    assert not unreached, f"raise sites with no test: {sorted(unreached)}"


@pytest.mark.skipif(not os.environ.get("EINATTN_SLOW"),
                    reason="8 processes (about a minute): set EINATTN_SLOW=1 to run")
def test_fsdp_step_on_a_three_dimensional_mesh(tmp_path):
    """The FSDP2 step on 8 processes: a (2, 2, 2) mesh, two dp ranks of two samples each."""
    results = run_checks(__name__, 8, tmp_path, only=("fsdp_step",))
    assert_on_every_rank(results, "fsdp_step")
