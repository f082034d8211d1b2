"""``impl="flex"``: equations (2)–(4) by PyTorch's FlexAttention, from the same pattern.

The pattern's pieces (:mod:`einattn.patterns`) are FlexAttention's mods as they stand: a
mask piece's ``allowed(n, μ, τ, σ)`` is a ``mask_mod(b, h, q_idx, kv_idx)``, a score term's
``score(S, n, μ, τ, σ)`` a ``score_mod``. The ``BlockMask`` comes from the chunked path's
own judgement of each tile (empty, full or partial, from the tile's bounds), so no mask is
evaluated over ``L_q × L_k`` to build it (``create_block_mask`` does: 0.1 s at L = 4096
on one CPU thread, three times the attention itself). A user's mask or key padding is read
by the mods at each index; a sink is one more key, with value zero and score ``s_μ``.

FlexAttention runs compiled (``torch.compile(..., dynamic=False, fullgraph=True)``, once per
shape and pattern, a few seconds on a CPU); inside a ``torch.compile``'d model it is traced
with the model. What the installed torch cannot run is an :class:`EinattnError` that says
what to use instead (measured on torch 2.13's CPU build: forward only; on torch 2.11 with
CUDA: forward and backward, heads of at least 16 channels, which einattn pads to). Float64,
which no compiled kernel takes, runs FlexAttention's own eager reference, dense and exact.
"""

from __future__ import annotations

import contextlib
import math
import warnings

import torch

from ..errors import EinattnError

BLOCK = 128  # queries and keys per BlockMask tile (FlexAttention's own default)
_COMPILED: dict[str, object] = {}


def run(Q, K, V, M, pattern, spec, seen: bool) -> dict[str, torch.Tensor]:
    """The impls' entry point: ``{"Z": Z}``, or what FlexAttention cannot run here."""
    if spec.dropout:
        raise EinattnError(f"impl='flex' has no dropout (got dropout={spec.dropout}); use "
                           f"impl='chunked' (the same tiles, with dropout), 'einsum' or 'sdpa' "
                           f"while training with dropout")
    refusal = pattern.refusal("flex")
    if refusal:
        raise EinattnError(refusal)
    return {"Z": attention(Q, K, V, M, pattern)}


def attention(Q, K, V, mask, pattern) -> torch.Tensor:
    """``Z[n μ τ a]`` by FlexAttention, with ``mask`` (einattn's ``M[n μ τ σ]``, or None)
    and the pattern of equation (3)."""
    flex = _flex_module()
    _check_runs(Q, K, V, mask, pattern)
    if not torch.is_grad_enabled():  # FlexAttention refuses a tensor that requires grad on
        Q, K, V = Q.detach(), K.detach(), V.detach()  # the CPU even under no_grad
    (_, n_heads, L_q, _), L_k = Q.shape, K.shape[2]
    if L_k == 0:  # no key at all: every row is fully masked, Z = 0 (FlexAttention has no
        return Q.new_zeros(*Q.shape[:3], V.shape[3])  # block to run)
    if pattern.sinks is not None:  # the sink: key σ = L_k, value zero, score s_μ
        K, V = (torch.cat([t, t.new_zeros(*t.shape[:2], 1, t.shape[3])], dim=2) for t in (K, V))
    mask_mod, score_mod = _mods(pattern, mask, L_k)
    block_mask = None
    if mask_mod is not None:
        key = _reuse_key(pattern, mask)
        block_mask = _BLOCK_MASKS.get(key) if key is not None else None
        if block_mask is None:
            block_mask = _block_mask(flex, pattern, mask_mod, L_q, L_k, K.shape[2],
                                     partial=mask is not None, device=Q.device)
            _remember(key, block_mask)
    Q, K, V, a_V, scale = _widened(Q, K, V)
    if torch.compiler.is_compiling():  # traced with the model around it
        return flex.flex_attention(Q, K, V, score_mod=score_mod, block_mask=block_mask,
                                   scale=scale, enable_gqa=K.shape[1] != n_heads)[..., :a_V]
    try:
        with _compiling(Q):
            return _compiled(flex, Q)(Q, K, V, score_mod=score_mod, block_mask=block_mask,
                                      scale=scale, enable_gqa=K.shape[1] != n_heads)[..., :a_V]
    except Exception as error:  # a backend's failure, put in einattn's words
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise EinattnError(f"impl='flex': FlexAttention could not run here "
                           f"({type(error).__name__}: {first[:300]}); impl='chunked' runs "
                           f"the same pattern with its empty tiles skipped") from None


GPU_MIN_HEAD = 16  # FlexAttention's GPU kernel takes heads of at least 16 channels


def _widened(Q, K, V):
    """Q, K, V with ``a`` padded by zeros to :data:`GPU_MIN_HEAD` channels where the GPU
    kernel needs it, V's own width, and the scale ``1/√a`` of the unpadded heads (None:
    FlexAttention's own, the same): zero channels add nothing to ``Q K`` nor to ``Z``,
    whose padding is sliced off."""
    a, a_V = Q.shape[-1], V.shape[-1]
    if Q.device.type == "cpu" or min(a, a_V) >= GPU_MIN_HEAD:
        return Q, K, V, a_V, None
    Q, K, V = (torch.nn.functional.pad(t, (0, max(0, GPU_MIN_HEAD - t.shape[-1])))
               for t in (Q, K, V))
    return Q, K, V, a_V, 1.0 / math.sqrt(a)


def _flex_module():
    try:
        from torch.nn.attention import flex_attention as flex
    except ImportError:
        raise EinattnError(f"impl='flex' needs torch.nn.attention.flex_attention, which torch "
                           f"{torch.__version__} lacks; impl='chunked' runs the same pattern "
                           f"with its empty tiles skipped") from None
    return flex


def _check_runs(Q, K, V, mask, pattern) -> None:
    """Refuse up front what FlexAttention cannot do on this device."""
    if Q.device.type == "cpu" and torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (Q, K, V, mask, pattern.sinks)):
        raise EinattnError("impl='flex' has no backward on the CPU (FlexAttention's CPU kernels "
                           "are inference only): train with impl='chunked', which runs the "
                           "same pattern with its empty tiles skipped, or call under "
                           "torch.no_grad()")
    if not torch._dynamo.is_dynamo_supported():
        raise EinattnError("impl='flex' compiles FlexAttention, and torch.compile is not "
                           "supported on this Python; use impl='chunked'")


@contextlib.contextmanager
def _compiling(Q):
    """Room for one graph per shape and pattern (a model's layers may differ: Gemma 2
    alternates windowed and global ones), where dynamo's default is 8 per function; the
    float64 eager reference without its warning that it is not compiled."""
    with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT,
                                    accumulated_recompile_limit=RECOMPILE_LIMIT * 4), \
            warnings.catch_warnings():
        if Q.dtype == torch.float64:
            warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
        yield


RECOMPILE_LIMIT = 64


def _compiled(flex, Q):
    """FlexAttention compiled once per process (per shape inside), or its eager reference
    for float64, which neither Inductor's CPU kernel nor its Triton kernel takes."""
    if Q.dtype == torch.float64:
        return flex.flex_attention
    if "flex" not in _COMPILED:
        _COMPILED["flex"] = torch.compile(flex.flex_attention, dynamic=False, fullgraph=True)
    return _COMPILED["flex"]


def _mods(pattern, mask, L_k: int):
    """FlexAttention's ``mask_mod`` and ``score_mod`` for the pattern, the user's mask
    (bool: allowed; float: added, ``−∞`` blocked) and a sink at key ``L_k`` (or None)."""
    sinks, masks = pattern.sinks, pattern.masks
    bias = None
    if mask is not None and mask.dtype != torch.bool:
        mask, bias = mask != float("-inf"), mask.masked_fill(mask == float("-inf"), 0.0)

    def within(b, h, q, kv):  # the key index the pattern and the mask read: the sink's is L_k
        return kv.clamp(max=L_k - 1) if sinks is not None else kv

    def mask_mod(b, h, q, kv):
        k = within(b, h, q, kv)
        ok = pattern.allowed((b, h, q, k)) if masks else q >= 0
        if mask is not None:
            ok = ok & _at(mask, b, h, q, k)
        return ok | (kv == L_k) if sinks is not None else ok

    def score_mod(S, b, h, q, kv):
        k = within(b, h, q, kv)
        S = pattern.scored(S, (b, h, q, k))
        if bias is not None:
            S = S + _at(bias, b, h, q, k)
        return torch.where(kv == L_k, sinks[h].to(S.dtype), S) if sinks is not None else S

    needs_mask = bool(masks) or mask is not None or sinks is not None
    needs_score = bool(pattern.scores) or bias is not None or sinks is not None
    return (mask_mod if needs_mask else None), (score_mod if needs_score else None)


def _at(M: torch.Tensor, b, h, q, kv):
    """``M[n μ τ σ]`` at one index, its axes of size 1 broadcast."""
    return M[tuple(0 if size == 1 else i for size, i in zip(M.shape, (b, h, q, kv),
                                                            strict=True))]


_BLOCK_MASKS: dict = {}  # a pattern of the positions alone (causal, window) -> its BlockMask
_KEPT = 32


def _reuse_key(pattern, mask):
    """A key under which this call's BlockMask may be kept and found again, or None: where
    its mask_mod reads nothing but the positions (causal, a window, a MaskMod, a Mask; no
    mask, documents or sink), the same pattern at the same sizes has the same BlockMask. At
    L = 4096 building one costs 1 ms of Python, 3 % of the call it feeds."""
    if mask is not None or torch.compiler.is_compiling():
        return None
    return pattern.key


def _remember(key, block_mask) -> None:
    if key is None:
        return
    if len(_BLOCK_MASKS) >= _KEPT:  # the oldest goes
        _BLOCK_MASKS.pop(next(iter(_BLOCK_MASKS)))
    _BLOCK_MASKS[key] = block_mask


def _block_mask(flex, pattern, mask_mod, L_q: int, L_k: int, KV_LEN: int, *, partial: bool,
                device):
    """The ``BlockMask`` from the pattern's tiles of ``BLOCK`` × ``BLOCK``: a tile it leaves
    empty is absent, a full one runs without ``mask_mod`` (unless a user's ``mask`` needs
    reading), a sink's key block is in every row."""
    T_q, T_k = -(-L_q // BLOCK), -(-KV_LEN // BLOCK)
    rows = [([], []) for _ in range(T_q)]  # per query block: partial and full key blocks
    for t0, _, s0, _, some_masked in pattern.tiles(BLOCK):
        rows[t0 // BLOCK][0 if some_masked or partial else 1].append(s0 // BLOCK)
    if KV_LEN > L_k:  # the sink, in the last key block: every row reads it, through mask_mod
        last = (KV_LEN - 1) // BLOCK
        for partial_blocks, full_blocks in rows:
            if last in full_blocks:
                full_blocks.remove(last)
            if last not in partial_blocks:
                partial_blocks.append(last)
    counts, indices = [], []
    for which in (0, 1):
        lists = [row[which] for row in rows]
        counts.append(torch.tensor([len(blocks) for blocks in lists], dtype=torch.int32,
                                   device=device).view(1, 1, T_q))
        padded = [blocks + [0] * (T_k - len(blocks)) for blocks in lists]
        indices.append(torch.tensor(padded, dtype=torch.int32, device=device)
                       .view(1, 1, T_q, T_k))
    return flex.BlockMask.from_kv_blocks(counts[0], indices[0], counts[1], indices[1],
                                         BLOCK_SIZE=BLOCK, mask_mod=mask_mod,
                                         seq_lengths=(L_q, KV_LEN))
