"""einattn.latent: multi-head latent attention. Its absorbed and expanded forms give the same
outputs and gradients on the same parameters; each intermediate is its equation; every impl,
the cache and torch.compile agree with the einsum path; the absorption is proved exactly on
integers. (Parity with DeepSeek's own Hugging Face modules: tests/test_latent_hf.py.)

Sizes all distinct: n=2, L=9, i=42, μ=3, l=11, c=13, a=5, ρ=6, b=7.
"""

from __future__ import annotations

import pytest
import torch

from einattn import EinattnError, KVCache, LatentAttention
from einattn import latent as mla
from einattn.functional import masked_softmax
from einattn.latent_cache import LatentCache
from einattn.verify import check_equivalent
from tests.conftest import TOL, assert_close_scaled, randn, whole

F64 = torch.float64
N, L, D, H, DQ, DC, DA, DR, DV = 2, 9, 42, 3, 11, 13, 5, 6, 7
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 0.5, "mscale_all_dim": 1.0}
CONFIGS = {  # name -> constructor options beyond the sizes
    "query latent": {"d_query_latent": DQ},
    "no query latent": {},
    "yarn + bias": {"d_query_latent": DQ, "rope_scaling": YARN, "bias": True},
    "half rope, no query latent, bias": {"rope": "half", "bias": True},
}


def make(seed: int = 0, **options) -> LatentAttention:
    """A float64 layer with every parameter random (γ around 1, biases nonzero), so that a
    dropped or misplaced term shows."""
    layer = LatentAttention(D, H, d_latent=DC, d_head=DA, d_rope=DR, d_value=DV, dtype=F64,
                            **options)
    with torch.no_grad():
        for k, (name, p) in enumerate(layer.named_parameters()):
            p.copy_(randn(*p.shape, seed=seed * 100 + k) * 0.3 + name.startswith("gamma"))
    return layer


def left_padded() -> torch.Tensor:
    """Key padding (n, L), True = padding: row 1 starts with two pad tokens."""
    kpm = torch.zeros(N, L, dtype=torch.bool)
    kpm[1, :2] = True
    return kpm


def every_parameter(layer) -> list[torch.nn.Parameter]:
    return [p for _, p in sorted(layer.named_parameters())]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_absorbed_equals_expanded_forward_and_gradients(name):
    """The two forms on the same parameters: Y and the gradients of x and every parameter,
    with causal and left padding, float64 at 1e-12."""
    layer = make(**CONFIGS[name], causal=True)
    x = randn(N, L, D, seed=1, requires_grad=True)
    g = randn(N, L, D, seed=2)
    wrt = [x, *every_parameter(layer)]
    results = {}
    for form in mla.FORMS:
        Y = layer(x, key_padding_mask=left_padded(), form=form)
        results[form] = (Y, torch.autograd.grad((Y * g).sum(), wrt))
    (Y_e, grads_e), (Y_a, grads_a) = results["expanded"], results["absorbed"]
    assert_close_scaled(Y_a, Y_e, TOL[F64])
    assert Y_e.abs().max() > 0.1  # not a degenerate output
    for got, want in zip(grads_a, grads_e, strict=True):
        assert_close_scaled(got, want, TOL[F64])


def rms(C: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """(MLA2) written out: γ ⊙ C / √(mean over the latent of C² + 1e-6)."""
    return gamma * C / (C.pow(2).sum(-1, keepdim=True) / C.shape[-1] + 1e-6).sqrt()


@pytest.mark.parametrize("form", mla.FORMS)
def test_each_intermediate_is_its_equation(form):
    """return_intermediates: every stage recomputed from the ones before it by the
    equations the docs show (and softmax with the causal mask)."""
    layer = make(**CONFIGS["yarn + bias"], causal=True)
    x = randn(N, L, D, seed=3)
    Y, st = layer(x, form=form, return_intermediates=True)
    s = layer.softmax_scale
    C_KV = rms(mla.LATENT(X=x, W_DKV=layer.W_DKV) + layer.b_DKV, layer.gamma_KV)
    C_Q = rms(mla.QUERY_DOWN(X=x, W_DQ=layer.W_DQ) + layer.b_DQ, layer.gamma_Q)
    assert_close_scaled(st["C_Q"], C_Q, TOL[F64])
    assert_close_scaled(st["C_KV"], C_KV, TOL[F64])
    assert_close_scaled(st["Q_A"], mla.QUERY_UP_A(C_Q=C_Q, W_UQA=layer.W_UQA), TOL[F64])
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    if form == "expanded":
        assert_close_scaled(st["K_A"], mla.KEYS(C_KV=C_KV, W_UK=layer.W_UK), TOL[F64])
        assert_close_scaled(st["V"], mla.VALUES(C_KV=C_KV, W_UV=layer.W_UV), TOL[F64])
        S = mla.SCORES(Q_A=st["Q_A"], K_A=st["K_A"], Q_R=st["Q_R"], K_R=st["K_R"], s=s)
        Z = mla.WEIGHTED(A=st["A"], V=st["V"])
    else:
        assert_close_scaled(st["Q_C"], mla.ABSORB_Q(Q_A=st["Q_A"], W_UK=layer.W_UK), TOL[F64])
        S = mla.SCORES_ABSORBED(Q_C=st["Q_C"], C_KV=C_KV, Q_R=st["Q_R"], K_R=st["K_R"], s=s)
        assert_close_scaled(st["Z_C"], mla.WEIGHTED_LATENT(A=st["A"], C_KV=C_KV), TOL[F64])
        Z = mla.ABSORB_V(Z_C=st["Z_C"], W_UV=layer.W_UV)
    assert_close_scaled(st["S"], S, TOL[F64])
    assert_close_scaled(st["A"], masked_softmax(S, causal), TOL[F64])
    assert_close_scaled(st["Z"], Z, TOL[F64])
    assert_close_scaled(Y, mla.OUTPUT(Z=Z, W_O=layer.W_O) + layer.b_O, TOL[F64])
    assert torch.equal(st["Y"], Y)


def test_the_rotary_key_is_one_for_all_heads_and_turns_with_the_position():
    """K_R[n σ ρ] is shared: the expanded keys' ρ channels are equal across heads; and it
    turns: shifting every position by 3 changes K_R but not the scores (RoPE is relative)."""
    layer = make(**CONFIGS["query latent"])
    x = randn(N, L, D, seed=4)
    _, st = layer(x, return_intermediates=True)
    K = st["K"]
    assert torch.equal(K[:, 0, :, DA:], K[:, 2, :, DA:])
    _, shifted = layer(x, positions=torch.arange(3, 3 + L), return_intermediates=True)
    assert (shifted["K_R"] - st["K_R"]).abs().max() > 0.1
    assert_close_scaled(shifted["S"], st["S"], TOL[F64])


CASES = {  # each impl against einsum: (layer options, call options)
    "causal + left padding": ({"causal": True}, {"key_padding_mask": left_padded()}),
    "window + bool mask": ({"causal": True, "window": 3},
                           {"mask": randn(L, L, seed=5) > -0.8}),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("impl", ["sdpa", "chunked", "flex"])
@pytest.mark.parametrize("form", mla.FORMS)
def test_every_impl_equals_einsum(form, impl, case):
    options, call = CASES[case]
    layer = make(**CONFIGS["yarn + bias"], block_size=4, **options)
    x = randn(N, L, D, seed=6)
    with torch.no_grad():  # flex on the CPU runs without gradients
        want = layer(x, form=form, **call)
        got = layer(x, form=form, impl=impl, **call)
    assert_close_scaled(got, want, TOL[F64])


LOW = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}  # measured: 2e-7,
# 8e-3 and 9e-4 relative to the largest output, both forms, einsum and sdpa


@pytest.mark.parametrize("dtype", list(LOW), ids=str)
@pytest.mark.parametrize("impl", ["einsum", "sdpa"])
@pytest.mark.parametrize("form", mla.FORMS)
def test_lower_precision_stays_near_float64(form, impl, dtype):
    layer = make(**CONFIGS["yarn + bias"], causal=True)
    x = randn(N, L, D, seed=14)
    want = layer(x)
    got = layer.to(dtype)(x.to(dtype), form=form, impl=impl)
    assert got.dtype == dtype
    assert_close_scaled(got.double(), want, LOW[dtype])


@pytest.mark.parametrize("form", mla.FORMS)
@pytest.mark.parametrize("impl", ["einsum", "sdpa", "chunked"])
def test_torch_compile_equals_eager(impl, form):
    """fullgraph on einsum and sdpa (and chunked where its Function traces): forward and
    every gradient."""
    torch._dynamo.reset()
    layer = make(**CONFIGS["yarn + bias"], causal=True, impl=impl, block_size=4, form=form)
    compiled = torch.compile(layer, fullgraph=whole(impl), backend="aot_eager")
    x = randn(N, L, D, seed=7, requires_grad=True)
    wrt = [x, *every_parameter(layer)]
    Y, Y_eager = compiled(x, key_padding_mask=left_padded()), layer(
        x, key_padding_mask=left_padded())
    assert_close_scaled(Y, Y_eager, TOL[F64])
    for got, want in zip(torch.autograd.grad(Y.sum(), wrt),
                         torch.autograd.grad(Y_eager.sum(), wrt), strict=True):
        assert_close_scaled(got, want, TOL[F64])
    torch._dynamo.reset()


def decode(layer, x, form: str, kpm, positions=None, prefill: int = 5):
    """Prefill ``prefill`` tokens, then one token per call; the outputs concatenated."""
    cache, outs = LatentCache(), []
    for start, stop in [(0, prefill), *((t, t + 1) for t in range(prefill, x.shape[1]))]:
        pos = None if positions is None else positions[:, start:stop]
        outs.append(layer(x[:, start:stop], key_padding_mask=kpm[:, start:stop], cache=cache,
                          form=form, positions=pos))
    return torch.cat(outs, dim=1), cache


@pytest.mark.parametrize("positions", [False, True], ids=["default positions", "cumsum"])
@pytest.mark.parametrize("form", mla.FORMS)
def test_cached_decoding_equals_the_full_forward(form, positions):
    """Prefill then one-token steps, left padding (and, as generate() places left-padded
    rows, positions counted from each row's first real token), equal one causal forward."""
    layer = make(**CONFIGS["yarn + bias"], causal=True)
    x, kpm = randn(N, L, D, seed=8), left_padded()
    t = ((~kpm).cumsum(1) - 1).clamp(min=0) if positions else None
    with torch.no_grad():
        want = layer(x, key_padding_mask=kpm, positions=t, form=form)
        got, cache = decode(layer, x, form, kpm, t)
    assert_close_scaled(got, want, TOL[F64])
    assert len(cache) == L and cache.form == form
    per_token = DC + DR if form == "absorbed" else H * (DA + DR) + H * DV
    assert cache.numbers_per_token() == per_token  # 19 absorbed, 54 expanded


@pytest.mark.parametrize("form", mla.FORMS)
def test_decoding_past_the_first_storage_equals_the_full_forward(form):
    """40 tokens, 2 prefilled then one per call: the storage (made for 18 positions) grows
    twice, copying what it holds."""
    layer = make(**CONFIGS["no query latent"], causal=True)
    x, kpm = randn(N, 40, D, seed=12), torch.zeros(N, 40, dtype=torch.bool)
    kpm[0, 0] = True
    with torch.no_grad():
        got, cache = decode(layer, x, form, kpm, prefill=2)
        want = layer(x, key_padding_mask=kpm, form=form)
    assert cache._storage[0].shape[2] > 18
    assert_close_scaled(got, want, TOL[F64])


def test_the_absorbed_cache_holds_the_latent_and_the_rotary_key_only():
    layer = make(**CONFIGS["query latent"])
    x = randn(N, L, D, seed=9)
    cache = LatentCache()
    _, st = layer(x, cache=cache, form="absorbed", return_intermediates=True)
    (K,) = cache.tensors
    assert K.shape == (N, 1, L, DC + DR)
    assert torch.equal(K[:, 0, :, :DC], st["C_KV"]) and torch.equal(K[:, 0, :, DC:], st["K_R"])
    assert st["V"].data_ptr() == K.data_ptr()  # the values are a view of it, not a copy


def test_a_cache_with_gradients_concatenates_and_decodes_the_same():
    layer = make(**CONFIGS["no query latent"], causal=True)
    x = randn(N, L, D, seed=10, requires_grad=True)
    got, _ = decode(layer, x, "absorbed", left_padded())
    want = layer(x, key_padding_mask=left_padded())
    assert_close_scaled(got, want, TOL[F64])
    g_got, g_want = (torch.autograd.grad(y.sum(), x)[0] for y in (got, want))
    assert_close_scaled(g_got, g_want, TOL[F64])


def test_crop_reset_and_max_length():
    """crop(k) then decoding again equals decoding from k; a max_length cache keeps its
    storage across reset and refuses more positions than it holds."""
    layer = make(**CONFIGS["query latent"], causal=True)
    x = randn(1, L, D, seed=11)
    with torch.no_grad():
        cache = LatentCache(max_length=L)
        full = layer(x, cache=cache, form="absorbed")
        cache.crop(4)
        again = layer(x[:, 4:], cache=cache, form="absorbed")
        storage = cache._storage[0].data_ptr()
        cache.reset()
        assert len(cache) == 0 and cache._storage[0].data_ptr() == storage
        with pytest.raises(EinattnError, match="at most max_length=9 positions, but 0 cached "
                                               "and 10 new"):
            layer(torch.cat([x, x[:, :1]], 1), cache=cache, form="absorbed")
    assert_close_scaled(again, full[:, 4:], TOL[F64])


# -- the absorption, proved exactly on integers ---------------------------------------------

SIZES = {"n": 2, "μ": 3, "τ": 4, "σ": 5, "a": 2, "c": 3, "b": 2, "i": 3}


def scores_expanded(Q_A, C_KV, W_UK):
    """The a-part of (MLA10)'s scores as the expanded form groups it: Q_A · (C_KV W_UK)."""
    return SCORE_TERM(Q_A=Q_A, K_A=mla.KEYS(C_KV=C_KV, W_UK=W_UK))


def scores_absorbed(Q_A, C_KV, W_UK):
    """The same as the absorbed form groups it: (Q_A W_UK) · C_KV."""
    return LATENT_TERM(Q_C=mla.ABSORB_Q(Q_A=Q_A, W_UK=W_UK), C_KV=C_KV)


def output_expanded(A, C_KV, W_UV, W_O):
    """(MLA9), (MLA12), (MLA13): ((A (C_KV W_UV)) W_O)."""
    return mla.OUTPUT(Z=mla.WEIGHTED(A=A, V=mla.VALUES(C_KV=C_KV, W_UV=W_UV)), W_O=W_O)


def output_absorbed(A, C_KV, W_UV, W_O):
    """(MLA-A3), (MLA-A4), (MLA13): (((A C_KV) W_UV) W_O)."""
    Z = mla.ABSORB_V(Z_C=mla.WEIGHTED_LATENT(A=A, C_KV=C_KV), W_UV=W_UV)
    return mla.OUTPUT(Z=Z, W_O=W_O)


def output_folded(A, C_KV, W_UV, W_O):
    """W_UV folded into W_O once: ((A C_KV) (W_UV W_O))."""
    return FOLDED_OUT(Z_C=mla.WEIGHTED_LATENT(A=A, C_KV=C_KV),
                      W_OC=FOLD_O(W_UV=W_UV, W_O=W_O))


for _side, _degree in ((scores_expanded, 3), (scores_absorbed, 3), (output_expanded, 4),
                      (output_absorbed, 4), (output_folded, 4)):
    _side.degree = _degree  # the polynomial degree, for the exact check's bound

SCORE_TERM = mla.Equation("S_A[n μ τ σ] = Q_A[n μ τ a] K_A[n μ σ a]")
LATENT_TERM = mla.Equation("S_A[n μ τ σ] = Q_C[n μ τ c] C_KV[n σ c]")
FOLD_O = mla.Equation("W_OC[μ c i] = W_UV[μ b c] W_O[μ b i]")
FOLDED_OUT = mla.Equation("Y[n τ i] = Z_C[n μ τ c] W_OC[μ c i]")
SCORE_INPUTS = {"Q_A": "n μ τ a", "C_KV": "n σ c", "W_UK": "μ a c"}
OUTPUT_INPUTS = {"A": "n μ τ σ", "C_KV": "n σ c", "W_UV": "μ b c", "W_O": "μ b i"}
PROOFS = {  # name -> (lhs, rhs, inputs)
    "scores": (scores_expanded, scores_absorbed, SCORE_INPUTS),
    "output": (output_expanded, output_absorbed, OUTPUT_INPUTS),
    "output folded": (output_expanded, output_folded, OUTPUT_INPUTS),
}


@pytest.mark.parametrize("name", list(PROOFS))
def test_the_absorption_is_exact_on_integers(name):
    """Each re-association, on the layer's own Equation strings, gives identical integers:
    the absorbed form is the same sum as the expanded one, not an approximation."""
    lhs, rhs, inputs = PROOFS[name]
    report = check_equivalent(lhs, rhs, SIZES, exact=True, inputs=inputs)
    assert report.equal and report.max_deviation == 0, str(report)
    assert report.false_acceptance < 1e-9


def test_a_wrong_absorption_is_rejected_exactly():
    """W_UK with its a and c read the wrong way round (square here, a = c = 3) is caught."""
    def transposed(Q_A, C_KV, W_UK):
        return scores_absorbed(Q_A, C_KV, W_UK.transpose(1, 2))

    transposed.degree = 3
    report = check_equivalent(scores_expanded, transposed, {**SIZES, "a": 3}, exact=True,
                              inputs=SCORE_INPUTS)
    assert not report.equal


# -- refusals --------------------------------------------------------------------------------

SIZES_OK = {"d_latent": DC, "d_head": DA, "d_rope": DR}
BAD_OPTIONS = [  # (constructor options, the message)
    ({"d_latent": 0}, "d_latent must be a positive int, got 0"),
    ({"d_query_latent": 2.5}, "d_query_latent must be a positive int, got 2.5"),
    ({"d_query_latent": 0}, "d_query_latent must be a positive int, got 0"),
    ({"window": True}, "window must be a positive int, got True"),
    ({"d_rope": 5}, "d_rope .ρ, the channels RoPE turns in pairs. must be even, got 5"),
    ({"rope": None}, "rope must be 'interleaved' or 'half' .MLA turns"),
    ({"rope_scaling": {"rope_type": "yarn"}}, "rope_scaling of rope_type 'yarn' needs"),
    ({"eps": -1e-6}, "eps must be a finite non-negative number, got -1e-06"),
    ({"scale": 0}, "scale must be a finite positive number, got 0"),
    ({"dropout": 1.0}, r"dropout .the probability .* must be a number in \[0, 1\), got 1.0"),
    ({"form": "compressed"}, "form must be one of 'expanded', 'absorbed', got 'compressed'"),
    ({"impl": "flash"},
     "impl must be one of 'einsum', 'sdpa', 'chunked', 'flex', 'auto', got 'flash'"),
]


@pytest.mark.parametrize("options, message", BAD_OPTIONS)
def test_bad_options_are_refused_by_name(options, message):
    with pytest.raises(EinattnError, match=message):
        LatentAttention(D, H, **{**SIZES_OK, **options})


def test_repr_shows_the_sizes_and_the_options_set():
    layer = LatentAttention(D, H, **SIZES_OK, d_query_latent=DQ, bias=True, causal=True,
                            form="absorbed")
    assert repr(layer) == (
        "LatentAttention(d_model=42, n_heads=3, d_latent=13, d_head=5, d_rope=6, d_value=5, "
        "d_query_latent=11, bias=True, rope='interleaved', causal=True, form='absorbed', "
        "impl='einsum')")


def test_bad_calls_are_refused_by_name():
    layer = make(**CONFIGS["query latent"])
    x = randn(N, L, D, seed=13)
    with pytest.raises(EinattnError, match=r"x must be a torch\.Tensor, got list"):
        layer([1.0])
    with pytest.raises(EinattnError, match=r"x has shape \(2, 9, 41\) but the layer expects "
                                           r"\(n, L, d_model=42\)"):
        layer(x[..., :41])
    with pytest.raises(EinattnError, match=r"x is torch\.float32 on cpu but the layer's W_DKV "
                                           r"is torch\.float64"):
        layer(x.float())
    with pytest.raises(EinattnError, match=r"cache must be an einattn\.latent_cache\.LatentCache"):
        layer(x, cache=KVCache())
    with pytest.raises(EinattnError, match="form must be one of"):
        layer(x, form="latent")
    cache = LatentCache()
    layer(x[:, :3], cache=cache, form="absorbed")
    with pytest.raises(EinattnError, match="holds the absorbed form's tensors, not the "
                                           "expanded form's"):
        layer(x[:, 3:4], cache=cache)
    with pytest.raises(EinattnError, match="mask"):  # refused after the append: undone
        layer(x[:, 3:4], cache=cache, form="absorbed", mask=torch.ones(5, 5, dtype=torch.bool))
    assert len(cache) == 3

