"""The cases of a sequence-parallel layer, for tests/test_ring.py (the sequence alone, on 2
and 3 processes) and tests/test_shard.py (heads × sequence, on 4): a layer, its inputs and
pieces by name, and :func:`compare`, the sharded layer against one process running the
whole sequence, in float64.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from conftest import randn
from ranks import scaled_error
from torch.distributed.tensor import DTensor

from einattn import MultiHeadAttention, patterns
from einattn import parallel as par

F64 = torch.float64
TOL = 1e-12
# n, L (cut into 4 or 6 chunks by 2 or 3 ranks), d_model, μ, a (even, for RoPE), g.
N, L, D, MU, A, G = 3, 12, 11, 6, 4, 2
BLOCK = 2  # chunked: several tiles in every chunk of 2, 3, 4 or 6 positions


def make_layer(options: str, impl: str) -> MultiHeadAttention:
    """A float64 layer with every parameter (the sinks too) random, the same on every rank;
    a window of 5 keys reaches across chunks of 2, 3, 4 or 6."""
    layer = MultiHeadAttention(D, MU, d_head=A, n_kv_heads=G if "gqa" in options else None,
                               bias=True, dtype=F64, impl=impl, block_size=BLOCK,
                               causal="causal" in options,
                               rope="half" if "rope" in options else None,
                               window=5 if "window" in options else None,
                               softcap=1.5 if "softcap" in options else None,
                               alibi="alibi" in options, sinks="sinks" in options)
    with torch.no_grad():
        for k, p in enumerate(layer.parameters()):
            p.copy_(randn(*p.shape, seed=k) * p.shape[-1] ** -0.5)
    return layer


def padding_for(options: str) -> torch.Tensor | None:
    """Key padding ``(n, L)``: sample 0 its last five positions, sample 1 its first two (so
    its first rows see no key under causal), sample 2 every key (no row sees one)."""
    if "padding" not in options:
        return None
    pad = torch.zeros(N, L, dtype=torch.bool)
    pad[0, -5:], pad[1, :2], pad[2] = True, True, True
    return pad


def documents_for(options: str) -> torch.Tensor | None:
    """Document ids ``d[n τ]`` ``(n, L)`` crossing the chunks of 2, 3, 4 and 6 positions:
    sample 0 three documents of 3, 3 and 6 tokens, sample 1 one, sample 2 three of 4, 5 and 3
    tokens with ids out of order; "same documents": three of 4 on every sample, so that
    pairs of chunks that share none are skipped."""
    if "documents" not in options:
        return None
    if "same documents" in options:
        return torch.arange(3).repeat_interleave(4).expand(N, L).clone()
    return torch.tensor([[0] * 3 + [1] * 3 + [2] * 6, [7] * 12, [4] * 4 + [1] * 5 + [9] * 3])


def own_pattern(options: str, bias: torch.Tensor) -> list:
    """Pieces of one's own, read at global positions: "own", a Mask string (chunks of 4
    positions, and the first 3 keys for every query), a MaskMod and a ScoreMod capturing
    ``bias`` (per head ``[μ, 17]``, or per distance ``[17]``, whichever ``bias`` is);
    "prefix", a prefix LM of one prefix per sample; "local", Llama 4's chunks of 5."""
    def relative(s, b, h, q, kv):
        d = (q - kv).clamp(-8, 8) + 8
        return s + (bias[h, d] if bias.ndim == 2 else bias[d])
    pieces = []
    if "own" in options:
        pieces += [patterns.Mask("⌊τ / 4⌋ = ⌊σ / 4⌋ ∨ σ < 3"),
                   patterns.MaskMod(lambda b, h, q, kv: (q - kv) % 5 != 1),
                   patterns.ScoreMod(relative)]
    if "prefix" in options:
        pieces.append(patterns.PrefixLM(torch.tensor([4, 0, 9])))
    if "local" in options:
        pieces.append(patterns.ChunkedLocal(5))
    return pieces


def compare(lay: MultiHeadAttention, ref: MultiHeadAttention, sequence, heads=None, *,
            layout: str, options: str) -> dict[str, float]:
    """``lay``, ``ref`` sharded over the 1-D mesh ``sequence`` (and ``heads``), against
    ``ref`` on the whole sequence: its output and the gradient of x gathered over
    ``sequence``, every parameter's gradient whole over ``heads`` and summed over
    ``sequence`` (never over the world: the ``heads`` ranks hold the same tokens), and with
    pieces of one's own the gradient of the tensor a ScoreMod captures (each rank's heads
    and tokens: summed over both)."""
    biases = [randn(*((MU,) if heads is None else ()), 17, seed=7).requires_grad_()
              for _ in range(2)]
    ref.pattern, lay.pattern = own_pattern(options, biases[0]), own_pattern(options, biases[1])
    x, T, pad, ids = randn(N, L, D, seed=1, requires_grad=True), randn(N, L, D, seed=2), \
        padding_for(options), documents_for(options)
    Y = ref(x, key_padding_mask=pad, document_ids=ids)
    (Y * T).sum().backward()

    def mine(t):
        return None if t is None else par.split_sequence(t, sequence, layout=layout)

    x_k = mine(x.detach()).requires_grad_()
    pad_k = None if pad is None else mine(pad).T.contiguous().T  # strided, as a slice is
    Y_k = lay(x_k, key_padding_mask=pad_k, document_ids=mine(ids))
    (Y_k * mine(T)).sum().backward()
    errors = {"Y": scaled_error(par.gather_sequence(Y_k.detach(), sequence, layout=layout),
                                Y.detach()),
              "dx": scaled_error(par.gather_sequence(x_k.grad, sequence, layout=layout), x.grad)}
    for name, p in lay.named_parameters():
        errors[f"d{name}"] = scaled_error(summed(p.grad, sequence), getattr(ref, name).grad)
    if "own" in options:  # a captured tensor's, as a parameter's
        errors["dbias"] = scaled_error(summed(biases[1].grad, sequence, heads), biases[0].grad)
    bad = {k: e for k, e in errors.items() if not e <= TOL}
    assert not bad, f"errors above {TOL:g}: {bad}"
    return errors


def summed(grad: torch.Tensor, *meshes) -> torch.Tensor:
    """A gradient whole (a DTensor's ``full_tensor``), summed over the 1-D ``meshes``."""
    grad = (grad.full_tensor() if isinstance(grad, DTensor) else grad).clone()
    for mesh in meshes:
        if mesh is not None:
            dist.all_reduce(grad, group=mesh.get_group())
    return grad


def reference(options: str, impl: str) -> tuple[MultiHeadAttention, MultiHeadAttention]:
    """The layer of a case and a copy of it, to be sharded."""
    ref = make_layer(options, impl)
    return ref, copy.deepcopy(ref)
