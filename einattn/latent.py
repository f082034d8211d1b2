"""``LatentAttention``: multi-head latent attention (MLA), as DeepSeek V2 and V3 compute it.

Keys and values come from one low-rank latent per token, ``C_KV[n σ c]``, shared by every
head; a few rotary channels ``ρ`` of each query and of one key per token, shared by every
head too, carry the position. Sizes: ``i`` d_model, ``μ`` n_heads, ``l`` d_query_latent
(optional), ``c`` d_latent, ``a`` d_head (the non-rotary query/key channels), ``ρ`` d_rope,
``b`` d_value (docs/models.md)::

    (MLA1)  C_Q[n τ l]   = X[n τ i] W_DQ[l i]                 (+ b_DQ[l])
    (MLA2)  C[n τ c]     ← γ[c] · C[n τ c] / √(Σ_c C[n τ c]² / d_c + ε)   RMS norm, of C_Q and C_KV
    (MLA3)  Q_A[n μ τ a] = C_Q[n τ l] W_UQA[μ a l]     (MLA3') without a query latent:
    (MLA4)  Q_R[n μ τ ρ] = C_Q[n τ l] W_UQR[μ ρ l]             X[n τ i] W_QA[μ a i], W_QR[μ ρ i]
    (MLA5)  C_KV[n σ c]  = X[n σ i] W_DKV[c i]                (+ b_DKV[c]), then (MLA2)
    (MLA6)  K_R[n σ ρ]   = X[n σ i] W_KR[ρ i]                 (+ b_KR[ρ])
    (MLA7)  Q_R and K_R turned by RoPE over ρ ((R1) or (R2) of einattn.rotary)

The expanded form materialises every head's keys and values, then attends:

    (MLA8)  K_A[n μ σ a] = C_KV[n σ c] W_UK[μ a c]
    (MLA9)  V[n μ σ b]   = C_KV[n σ c] W_UV[μ b c]
    (MLA10) S[n μ τ σ]   = s · (Q_A[n μ τ a] K_A[n μ σ a] + Q_R[n μ τ ρ] K_R[n σ ρ])
    (MLA11) A[n μ τ σ]   = softmax_σ(S[n μ τ σ] + M[n μ τ σ])
    (MLA12) Z[n μ τ b]   = A[n μ τ σ] V[n μ σ b]
    (MLA13) Y[n τ i]     = Z[n μ τ b] W_O[μ b i]              (+ b_O[i])

The absorbed form re-associates the same sums so that nothing per head is made per key:

    (MLA-A1) Q_C[n μ τ c] = Q_A[n μ τ a] W_UK[μ a c]
    (MLA-A2) S[n μ τ σ]   = s · (Q_C[n μ τ c] C_KV[n σ c] + Q_R[n μ τ ρ] K_R[n σ ρ])
    (MLA-A3) Z_C[n μ τ c] = A[n μ τ σ] C_KV[n σ c]
    (MLA-A4) Z[n μ τ b]   = Z_C[n μ τ c] W_UV[μ b c]          then (MLA13)

(MLA10)–(MLA12) are equations (2)–(4) of einattn.functional with query/key channels
``(a ρ)`` and value channels ``b``; (MLA-A2), (MLA11), (MLA-A3) are the same with one
key/value head (multi-query attention), keys ``[C_KV | K_R]`` of width ``c + ρ`` and values
``C_KV``: both run as :func:`einattn.functional.attention`, with every mask, pattern and impl
it has. The strings below run where the layer computes them; SCORES, WEIGHTED and
WEIGHTED_LATENT state what that call computes (the layer runs SCORES for its intermediates,
and tests/test_latent.py proves the call's S, A and Z are these equations).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from . import functional, rotary
from ._checks import check_dropout, check_impl
from .errors import EinattnError
from .latent_cache import FORMS, LatentCache
from .notation import Equation

QUERY_DOWN = Equation("C_Q[n τ l] = X[n τ i] W_DQ[l i]")  # (MLA1)
QUERY_UP_A = Equation("Q_A[n μ τ a] = C_Q[n τ l] W_UQA[μ a l]")  # (MLA3)
QUERY_UP_R = Equation("Q_R[n μ τ ρ] = C_Q[n τ l] W_UQR[μ ρ l]")  # (MLA4)
QUERY_A = Equation("Q_A[n μ τ a] = X[n τ i] W_QA[μ a i]")  # (MLA3')
QUERY_R = Equation("Q_R[n μ τ ρ] = X[n τ i] W_QR[μ ρ i]")  # (MLA4')
LATENT = Equation("C_KV[n σ c] = X[n σ i] W_DKV[c i]")  # (MLA5)
ROTARY_KEY = Equation("K_R[n σ ρ] = X[n σ i] W_KR[ρ i]")  # (MLA6)
KEYS = Equation("K_A[n μ σ a] = C_KV[n σ c] W_UK[μ a c]")  # (MLA8)
VALUES = Equation("V[n μ σ b] = C_KV[n σ c] W_UV[μ b c]")  # (MLA9)
SCORES = Equation(
    "S[n μ τ σ] = s · (Q_A[n μ τ a] K_A[n μ σ a] + Q_R[n μ τ ρ] K_R[n σ ρ])")  # (MLA10)
WEIGHTED = Equation("Z[n μ τ b] = A[n μ τ σ] V[n μ σ b]")  # (MLA12)
OUTPUT = Equation("Y[n τ i] = Z[n μ τ b] W_O[μ b i]")  # (MLA13)
ABSORB_Q = Equation("Q_C[n μ τ c] = Q_A[n μ τ a] W_UK[μ a c]")  # (MLA-A1)
SCORES_ABSORBED = Equation(
    "S[n μ τ σ] = s · (Q_C[n μ τ c] C_KV[n σ c] + Q_R[n μ τ ρ] K_R[n σ ρ])")  # (MLA-A2)
WEIGHTED_LATENT = Equation("Z_C[n μ τ c] = A[n μ τ σ] C_KV[n σ c]")  # (MLA-A3)
ABSORB_V = Equation("Z[n μ τ b] = Z_C[n μ τ c] W_UV[μ b c]")  # (MLA-A4)


def rms_norm(C: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    """(MLA2): ``C[n τ c] ← γ[c] · C[n τ c] / √(Σ_c C[n τ c]² / d_c + ε)``, over the
    whole latent (not per head); in float32 for float16/bfloat16 inputs, cast back before
    ``γ``, as DeepSeek's norm does.

    >>> rms_norm(torch.tensor([[3.0, 4.0]]), torch.ones(2), 0.0)
    tensor([[0.8485, 1.1314]])
    """
    work = C.float() if C.dtype in (torch.float16, torch.bfloat16) else C
    normed = work * torch.rsqrt(work.pow(2).mean(-1, keepdim=True) + eps)
    return gamma * normed.to(C.dtype)


def deepseek_scale(d_head: int, d_rope: int, rope_scaling: dict | None) -> float:
    """DeepSeek's softmax scale ``s = (a + ρ)^(−1/2) · m²``, with ``m = 0.1 · mscale_all_dim ·
    ln(factor) + 1`` where ``rope_scaling`` (any rope_type but "default") has a nonzero
    ``mscale_all_dim`` and ``factor > 1``, else ``m = 1``. (YaRN's own attention factor,
    which turns R, is :func:`einattn.rotary.frequencies`'s ``m``: a separate factor.)

    >>> round(deepseek_scale(128, 64, {"rope_type": "yarn", "factor": 40.0,
    ...                                "mscale_all_dim": 1.0}), 6)
    0.135234
    """
    s = (d_head + d_rope) ** -0.5
    if not rope_scaling or rope_scaling.get("rope_type", "default") == "default":
        return s
    weight, factor = rope_scaling.get("mscale_all_dim"), rope_scaling.get("factor", 1.0)
    if not weight or factor <= 1:
        return s
    m = 0.1 * weight * math.log(factor) + 1.0
    return s * m * m


class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek V2/V3) whose forward is (MLA1)–(MLA13), or
    their absorbed form (MLA-A1)–(MLA-A4), on the same parameters (module docstring).

    Parameters, named as in the equations: with ``d_query_latent`` (l) ``W_DQ[l i]``,
    ``gamma_Q[l]`` (γ of (MLA2)), ``W_UQA[μ a l]``, ``W_UQR[μ ρ l]``, else ``W_QA[μ a i]``,
    ``W_QR[μ ρ i]``; always ``W_DKV[c i]``, ``W_KR[ρ i]``, ``gamma_KV[c]``, ``W_UK[μ a c]``,
    ``W_UV[μ b c]``, ``W_O[μ b i]``; with ``bias=True`` also ``b_DQ[l]``, ``b_DKV[c]``,
    ``b_KR[ρ]`` and ``b_O[i]`` (where DeepSeek's ``attention_bias`` puts them). ``rope``
    ("interleaved" or "half") pairs the ρ channels as (R2) or (R1), with ``rope_base`` and
    ``rope_scaling`` as :mod:`einattn.rotary` takes them; ``scale`` defaults to
    :func:`deepseek_scale`. ``form`` ("expanded" or "absorbed") is how forward runs unless
    a call says otherwise; ``causal``, ``window``, ``dropout``, ``impl`` and ``block_size``
    are :func:`einattn.functional.attention`'s.

    >>> layer = LatentAttention(32, 4, d_latent=12, d_head=6, d_rope=4, d_value=5,
    ...                         causal=True)
    >>> layer(torch.randn(2, 7, 32)).shape
    torch.Size([2, 7, 32])
    """

    def __init__(self, d_model: int, n_heads: int, *, d_latent: int, d_head: int, d_rope: int,
                 d_value: int | None = None, d_query_latent: int | None = None,
                 bias: bool = False, eps: float = 1e-6, rope: str = "interleaved",
                 rope_base: float = 10000.0, rope_scaling: dict | None = None,
                 scale: float | None = None, causal: bool = False, window: int | None = None,
                 dropout: float = 0.0, form: str = "expanded", impl: str = "einsum",
                 block_size: int = 256, device=None, dtype=None):
        super().__init__()
        d_value = d_head if d_value is None else d_value
        for name, size in (("d_model", d_model), ("n_heads", n_heads), ("d_latent", d_latent),
                           ("d_head", d_head), ("d_rope", d_rope), ("d_value", d_value),
                           ("d_query_latent", d_query_latent), ("block_size", block_size),
                           ("window", window)):
            if size is not None or name not in ("d_query_latent", "window"):
                _check_positive_int(name, size)
        self.d_model, self.n_heads, self.d_latent = d_model, n_heads, d_latent
        self.d_head, self.d_rope, self.d_value = d_head, d_rope, d_value
        self.d_query_latent = d_query_latent
        if d_rope % 2:
            raise EinattnError(f"d_rope (ρ, the channels RoPE turns in pairs) must be even, got "
                               f"{d_rope}")
        if rope not in rotary.STYLES:
            raise EinattnError(f"rope must be 'interleaved' or 'half' (MLA turns its d_rope "
                               f"channels ρ always), got {rope!r}")
        self.rope, self.rope_base, self.rope_scaling, _ = rotary.check_options(
            rope, rope_base, rope_scaling, None, d_rope)
        self.eps, self.scale = _check_number("eps", eps, zero=True), None if scale is None \
            else _check_number("scale", scale)
        self.causal, self.window, self.block_size = bool(causal), window, block_size
        self.dropout = check_dropout(dropout)
        self.form, self.impl = check_form(form), check_impl(impl)
        self._make_parameters(bias, {"device": device, "dtype": dtype})
        self.reset_parameters()

    def _make_parameters(self, bias: bool, kw: dict) -> None:
        μ, i, lq, c = self.n_heads, self.d_model, self.d_query_latent, self.d_latent
        a, ρ, b = self.d_head, self.d_rope, self.d_value
        shapes = {"W_DKV": (c, i), "W_KR": (ρ, i), "gamma_KV": (c,), "W_UK": (μ, a, c),
                  "W_UV": (μ, b, c), "W_O": (μ, b, i)}
        shapes |= {"W_QA": (μ, a, i), "W_QR": (μ, ρ, i)} if lq is None else {
            "W_DQ": (lq, i), "gamma_Q": (lq,), "W_UQA": (μ, a, lq), "W_UQR": (μ, ρ, lq)}
        if bias:
            shapes |= {"b_DKV": (c,), "b_KR": (ρ,), "b_O": (i,)} | (
                {} if lq is None else {"b_DQ": (lq,)})
        for name in ("W_QA", "W_QR", "W_DQ", "gamma_Q", "W_UQA", "W_UQR", "b_DQ", "b_DKV",
                     "b_KR", "b_O"):
            self.register_parameter(name, None)  # read as None where the layer has none
        for name, shape in shapes.items():
            setattr(self, name, nn.Parameter(torch.empty(*shape, **kw)))

    def reset_parameters(self) -> None:
        """Each weight uniform in ±1/√(the size it sums over), as ``nn.Linear`` draws its
        weight; biases 0, the norms' γ 1."""
        summed = {"W_QA": self.d_model, "W_QR": self.d_model, "W_DQ": self.d_model,
                  "W_UQA": self.d_query_latent, "W_UQR": self.d_query_latent,
                  "W_DKV": self.d_model, "W_KR": self.d_model, "W_UK": self.d_latent,
                  "W_UV": self.d_latent, "W_O": self.n_heads * self.d_value}
        with torch.no_grad():
            for name, p in self.named_parameters(recurse=False):
                if name in summed:
                    nn.init.uniform_(p, -summed[name] ** -0.5, summed[name] ** -0.5)
                else:
                    p.fill_(1.0 if name.startswith("gamma") else 0.0)

    @property
    def softmax_scale(self) -> float:
        """``s`` of (MLA10): ``scale`` if given, else :func:`deepseek_scale`."""
        return self.scale if self.scale is not None else deepseek_scale(
            self.d_head, self.d_rope, self.rope_scaling)

    def extra_repr(self) -> str:
        shown = [f"{k}={getattr(self, k)}" for k in ("d_model", "n_heads", "d_latent", "d_head",
                                                      "d_rope", "d_value", "d_query_latent")]
        shown.append(f"bias={self.b_O is not None}")
        shown += [f"{k}={getattr(self, k)!r}" for k in ("rope", "rope_scaling", "scale", "causal",
                                                         "window", "dropout", "form", "impl")
                  if getattr(self, k) not in (None, False, 0.0)]
        return ", ".join(shown)

    @classmethod
    def from_hf(cls, module: nn.Module, **layer_options) -> LatentAttention:
        """An equal layer from a Hugging Face ``DeepseekV3Attention`` or
        ``DeepseekV2Attention``: its weights (copied), sizes, RoPE (V3's ``rope_interleave``,
        V2 always interleaved), ``rope_parameters``, scale, bias, dropout and train/eval
        mode, causal as the module is. ``layer_options`` (``form``, ``impl``, ...) are passed
        on. ``transformers`` is not imported: the class is recognised by its name."""
        from ._latent_hf import from_hf

        return from_hf(cls, module, layer_options)

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor | None = None,
                key_padding_mask: torch.Tensor | None = None, causal: bool | None = None,
                positions: torch.Tensor | None = None, cache: LatentCache | None = None,
                form: str | None = None, impl: str | None = None, need_weights: bool = False,
                return_intermediates: bool = False):
        """``Y[n τ i]`` from ``x`` ``(n, L, d_model)``.

        ``mask``, ``key_padding_mask`` and ``causal`` (which overrides the constructor's)
        as in :func:`einattn.functional.attention`; ``positions`` (``(L,)`` or ``(n, L)``
        integers) place the tokens for RoPE, by default after those in ``cache``. With a
        :class:`~einattn.latent_cache.LatentCache`, this call's keys are appended to it
        (the latent and the rotary key absorbed, every head's keys and values expanded) and
        the queries attend over all of it, ``key_padding_mask`` marking the new keys.
        ``form`` ("expanded" or "absorbed") overrides the constructor's; both give the same
        Y. ``need_weights=True`` returns ``(Y, A)``; ``return_intermediates=True`` returns
        ``(Y, stages)``, every intermediate by its equation's name (C_Q with a query latent,
        Q_A, Q_R, C_KV, K_R, then K_A and V expanded or Q_C absorbed, the Q, K, V that
        attention ran on, S, A, Z_C absorbed, Z, Y); the keys' and values' over every key
        attended, cached ones included (C_KV expanded: this call's, as its cache keeps none).
        """
        form = self.form if form is None else check_form(form)
        self._check_input(x)
        if cache is not None and not isinstance(cache, LatentCache):
            raise EinattnError(f"cache must be an einattn.latent_cache.LatentCache (it holds the "
                               f"latent per token), got {type(cache).__name__}")
        positions, offset = (positions, 0) if cache is None else \
            cache.placed(positions, x.shape[1], x.device)
        stages = self._projected(x, positions, offset)
        Q, new = (self._expanded if form == "expanded" else self._absorbed)(stages)
        if cache is None:
            return self._attended(form, stages, Q, new, key_padding_mask, mask, causal, impl,
                                  need_weights, return_intermediates)
        with cache.undo_on_error():  # a call that raises adds nothing to the cache
            new, key_padding_mask = cache.append(form, new, key_padding_mask)
            return self._attended(form, stages, Q, new, key_padding_mask, mask, causal, impl,
                                  need_weights, return_intermediates)

    def _projected(self, x: torch.Tensor, positions, offset: int) -> dict:
        """(MLA1)–(MLA7): Q_A, Q_R (turned), C_KV, K_R[n 1 σ ρ] (turned), and C_Q."""
        stages = {}
        if self.d_query_latent is None:
            Q_A, Q_R = QUERY_A(X=x, W_QA=self.W_QA), QUERY_R(X=x, W_QR=self.W_QR)
        else:
            C_Q = rms_norm(_biased(QUERY_DOWN(X=x, W_DQ=self.W_DQ), self.b_DQ), self.gamma_Q,
                           self.eps)
            Q_A, Q_R = QUERY_UP_A(C_Q=C_Q, W_UQA=self.W_UQA), QUERY_UP_R(C_Q=C_Q,
                                                                        W_UQR=self.W_UQR)
            stages["C_Q"] = C_Q
        C_KV = rms_norm(_biased(LATENT(X=x, W_DKV=self.W_DKV), self.b_DKV), self.gamma_KV,
                        self.eps)
        K_R = _biased(ROTARY_KEY(X=x, W_KR=self.W_KR), self.b_KR)[:, None]  # one head
        n, L = x.shape[:2]
        t = rotary.positions_for(positions, n=n, L=L, offset=offset, device=x.device)
        R = rotary.rotations(t, d_head=self.d_rope, base=self.rope_base, dtype=x.dtype,
                             scaling=self.rope_scaling)
        Q_R, K_R = rotary.rotate(Q_R, R, self.rope), rotary.rotate(K_R, R, self.rope)
        return stages | {"Q_A": Q_A, "Q_R": Q_R, "C_KV": C_KV, "K_R": K_R}

    def _expanded(self, stages: dict) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """(MLA8), (MLA9): every head's keys ``[K_A | K_R]`` and values V of this call's
        tokens."""
        K_A = KEYS(C_KV=stages["C_KV"], W_UK=self.W_UK)
        K_R = stages["K_R"]
        K = torch.cat([K_A, K_R.expand(-1, self.n_heads, -1, -1)], dim=-1)
        Q = torch.cat([stages["Q_A"], stages["Q_R"]], dim=-1)
        return Q, (K, VALUES(C_KV=stages["C_KV"], W_UV=self.W_UV))

    def _absorbed(self, stages: dict) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """(MLA-A1): queries ``[Q_C | Q_R]`` and the one key head ``[C_KV | K_R]``."""
        Q_C = ABSORB_Q(Q_A=stages["Q_A"], W_UK=self.W_UK)
        stages["Q_C"] = Q_C
        K = torch.cat([stages["C_KV"][:, None], stages["K_R"]], dim=-1)
        return torch.cat([Q_C, stages["Q_R"]], dim=-1), (K,)

    def _attended(self, form: str, stages: dict, Q, kept: tuple, key_padding_mask, mask, causal,
                  impl, need_weights: bool, return_intermediates: bool):
        """(MLA10)–(MLA13), or (MLA-A2), (MLA11), (MLA-A3), (MLA-A4) then (MLA13), over every
        cached key."""
        K, V = kept if form == "expanded" else (kept[0], kept[0][..., :self.d_latent])
        seen = need_weights or return_intermediates
        out = functional.attention(
            Q, K, V, mask=mask, key_padding_mask=key_padding_mask,
            causal=self.causal if causal is None else causal, window=self.window,
            dropout=self.dropout if self.training else 0.0,
            impl=self.impl if impl is None else impl, block_size=self.block_size,
            scale=self.softmax_scale, need_weights=seen)
        Z, A = out if seen else (out, None)
        if form == "absorbed":
            stages["Z_C"], Z = Z, ABSORB_V(Z_C=Z, W_UV=self.W_UV)
        Y = _biased(OUTPUT(Z=Z, W_O=self.W_O), self.b_O)
        if return_intermediates:
            return Y, self._stages(form, stages, Q, K, V, A, Z, Y)
        return (Y, A) if need_weights else Y

    def _stages(self, form: str, stages: dict, Q, K, V, A, Z, Y) -> dict:
        """The intermediates by name: the keys' (K_A, K_R expanded; C_KV, K_R absorbed) over
        every key attended, cached ones included, and S by (MLA10) or (MLA-A2) from them."""
        a, c, s = self.d_head, self.d_latent, self.softmax_scale
        if form == "expanded":
            K_R = K[:, 0, :, a:]
            stages |= {"K_A": K[..., :a], "V": V, "K_R": K_R}
            S = SCORES(Q_A=stages["Q_A"], K_A=K[..., :a], Q_R=stages["Q_R"], K_R=K_R, s=s)
        else:
            C_KV, K_R = K[:, 0, :, :c], K[:, 0, :, c:]
            stages |= {"C_KV": C_KV, "K_R": K_R}
            S = SCORES_ABSORBED(Q_C=stages["Q_C"], C_KV=C_KV, Q_R=stages["Q_R"], K_R=K_R, s=s)
        return stages | {"Q": Q, "K": K, "V": V, "S": S, "A": A, "Z": Z, "Y": Y}

    def _check_input(self, x) -> None:
        """``x`` is ``(n, L, d_model)`` in the dtype and on the device of the weights."""
        if not isinstance(x, torch.Tensor):
            raise EinattnError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.ndim != 3 or x.shape[-1] != self.d_model:
            raise EinattnError(f"x has shape {tuple(x.shape)} but the layer expects (n, L, "
                               f"d_model={self.d_model}) (index 'i' has size {self.d_model} "
                               f"in W_DKV)")
        W = self.W_DKV
        if x.dtype != W.dtype or x.device != W.device:
            raise EinattnError(f"x is {x.dtype} on {x.device} but the layer's W_DKV is "
                               f"{W.dtype} on {W.device}; convert one with .to()")


def check_form(form) -> str:
    """``form`` itself, once it is known to be "expanded" or "absorbed"."""
    if form not in FORMS:
        raise EinattnError(f"form must be one of {', '.join(map(repr, FORMS))}, got {form!r}")
    return form


def _biased(T: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return T if b is None else T + b


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise EinattnError(f"{name} must be a positive int, got {value!r}")


def _check_number(name: str, value, zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            (0 <= value if zero else 0 < value) and value < math.inf):
        raise EinattnError(f"{name} must be a finite {'non-negative' if zero else 'positive'} "
                           f"number, got {value!r}")
    return value
