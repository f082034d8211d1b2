"""einattn.hf.layer of today's models' attention modules (issue 36, items 3–6 and 8): Qwen3
(full and sliding), Gemma 3 (sliding and full), OLMo 2, Qwen3-Next, DiffLlama, Llama 4
(chunked and NoPE) each become the einattn layer that writes them as equations, equal to the
module's own forward in float64: with its float32 islands patched (tests/hf_today.py) at
1e-12, unpatched at 1e-6; forward on a left-padded batch, the gradients of the input and of
every parameter; decoding with a KVCache equals the full forward. DeepSeek's modules become
LatentAttention (tests/test_latent_hf.py tests them); what cannot be converted is refused by
name. Through einattn.hf.register() the whole models give HF's tokens and logits.
"""

from __future__ import annotations

import contextlib
import copy
import itertools

import pytest
import torch

from einattn import EinattnError, KVCache, LatentAttention, hf
from tests import hf_today as today
from tests.conftest import TOL, assert_close_scaled, randn

transformers = pytest.importorskip("transformers")
F64, N, L = today.F64, today.N, today.L
CASES = list(today.CASES)
LOOSER = {"llama4 nope": 1e-8}  # unpatched: β in float32 (2e-9 measured), not only cos/sin


def call(case, m, layer, x, kpm, shipped: bool = False, offset: int = 0, cache=None):
    """The module's output for the tokens ``x`` at ``offset …`` (its mask, its positions)."""
    y, _ = m(x, position_embeddings=today.positions(case, m, layer, x, offset, shipped),
             attention_mask=today.allowed(case, kpm, x.shape[1], offset), cache=cache)
    return y


@pytest.mark.parametrize("name", CASES)
def test_forward_equals_the_module(name, monkeypatch):
    case = today.CASES[name]
    m = today.module(case)
    x, kpm = randn(N, L, m.config.hidden_size, seed=1), today.left_padded()
    layer = hf.layer(m)
    shipped = call(case, m, layer, x, kpm, shipped=True)
    real = ~kpm  # a padded query sees no key: HF's row is NaN or garbage, einattn's zeros
    assert_close_scaled(layer(x, key_padding_mask=kpm)[real], shipped[real],
                        LOOSER.get(name, today.UNPATCHED))
    with today.patched(case, m, monkeypatch):
        layer = hf.layer(m)  # DiffLlama's λ is exact now: convert again
        want = call(case, m, layer, x, kpm)
    Y = layer(x, key_padding_mask=kpm)
    assert_close_scaled(Y[real], want[real], TOL[F64])
    assert Y[real].abs().max() > 0.1  # not a degenerate output


@pytest.mark.parametrize("name", CASES)
def test_gradients_of_the_input_and_every_parameter_equal_the_modules(name, monkeypatch):
    """HF's gradients, copied into a twin of the module and converted by hf.layer (a pure
    re-indexing of the weights), are the layer's, parameter by parameter."""
    case = today.CASES[name]
    m = today.module(case, seed=2)
    x, g = randn(N, L, m.config.hidden_size, seed=3, requires_grad=True), randn(
        N, L, m.config.hidden_size, seed=4)
    kpm = today.left_padded()
    with today.patched(case, m, monkeypatch):
        layer = hf.layer(m)
        want = call(case, m, layer, x, kpm)
        hf_grads = torch.autograd.grad((want[~kpm] * g[~kpm]).sum(), [x, *m.parameters()])
    ours = dict(layer.named_parameters())
    Y = layer(x, key_padding_mask=kpm)
    got = torch.autograd.grad((Y[~kpm] * g[~kpm]).sum(), [x, *ours.values()])
    assert_close_scaled(got[0], hf_grads[0], TOL[F64])
    twin = copy.deepcopy(m)
    with torch.no_grad():
        for p, grad in zip(twin.parameters(), hf_grads[1:], strict=True):
            p.copy_(grad)
    laid_out = dict(hf.layer(twin).named_parameters())
    for (param, grad) in zip(ours, got[1:], strict=True):
        # DiffLlama's λ: HF sums λ_q·λ_k in float32, so its gradient comes back through float32
        tol = today.UNPATCHED if param.startswith("lambda") else TOL[F64]
        assert_close_scaled(grad, laid_out[param], tol)
    numbers = [sum(p.numel() for p in module.parameters()) for module in (layer, m)]
    assert numbers[0] == numbers[1]  # every number of the module's is one of the layer's


@pytest.mark.parametrize("name", CASES)
def test_cached_decoding_equals_the_full_forward_and_the_modules_own(name, monkeypatch):
    """Prefill 5 left-padded tokens, then one a call: einattn's KVCache against its full
    forward, and against the module with its own DynamicCache, step by step (where that
    cache keeps every key: a sliding or chunked layer's keeps the last few, whose mask the
    model crops, and equals the full forward there too, tests/test_hf_models.py)."""
    case = today.CASES[name]
    m = today.module(case, seed=5)
    x, kpm = randn(N, L, m.config.hidden_size, seed=6), today.left_padded()
    with today.patched(case, m, monkeypatch):
        layer = hf.layer(m)
        cache, hf_cache, outs = KVCache(), transformers.DynamicCache(config=m.config), []
        empty = torch.zeros(N, 2, 0, 8, dtype=F64)
        for layer_idx in range(len(hf_cache.layers), case.layer):  # the layers before it,
            hf_cache.update(empty, empty, layer_idx)  # where the cache grows by those seen
        with torch.no_grad():
            for a, b in itertools.pairwise([0, 5, *range(6, L + 1)]):
                rows = ~kpm[:, a:b]
                step = layer(x[:, a:b], key_padding_mask=kpm[:, a:b], cache=cache)
                if case.window is None and case.chunk is None:
                    theirs = call(case, m, layer, x[:, a:b], kpm, offset=a, cache=hf_cache)
                    assert_close_scaled(step[rows], theirs[rows], TOL[F64])
                outs.append(step)
            want = layer(x, key_padding_mask=kpm)
    assert_close_scaled(torch.cat(outs, 1)[~kpm], want[~kpm], TOL[F64])


def test_what_each_module_becomes():
    """The options each conversion sets: read from the module, not from defaults."""
    layers = {name: hf.layer(today.module(case)) for name, case in today.CASES.items()}
    assert layers["qwen3 sliding"].window == 4 and layers["qwen3 full"].window is None
    assert layers["qwen3 full"].qk_norm.gain == "gamma" and layers["qwen3 full"].rope == "half"
    gemma = layers["gemma3 full"]
    assert gemma.softcap is None and gemma.qk_norm.gain == "1+gamma"  # HF never applies it
    assert gemma.rope_scaling["factor"] == 2.0 and layers["gemma3 sliding"].rope_base == 10.0
    assert layers["olmo2"].qk_norm.over == "heads" and layers["olmo2"].gamma_Q.shape == (6, 8)
    assert layers["qwen3_next"].gate and layers["qwen3_next"].rotary_dim == 4
    assert layers["diffllama"].differential.lambda_init == pytest.approx(0.470713, abs=1e-6)
    chunked, nope = layers["llama4 chunked"], layers["llama4 nope"]
    assert chunked.qk_norm.after_rope and chunked.qk_norm.gain is None
    assert repr(chunked.pattern) == "(ChunkedLocal(c=4),)" and chunked.rope == "interleaved"
    assert nope.rope is None and nope.temperature.floor_scale == 3 and nope.qk_norm is None


def test_deepseek_becomes_latent_attention_and_what_cannot_be_converted_is_refused():
    from tests.test_latent_hf import module as deepseek
    assert isinstance(hf.layer(deepseek()), LatentAttention)
    grouped = deepseek(num_key_value_heads=1)
    with pytest.raises(EinattnError, match="num_key_value_heads=1 below num_attention_heads=3: "
                                           "multi-head latent attention has no key/value"):
        hf.layer(grouped)
    both_ways = today.module(today.CASES["gemma3 sliding"])
    both_ways.is_causal = False
    with pytest.raises(EinattnError, match=r"Gemma3Attention \(model_type 'gemma3_text'\) "
                                           r"attends both ways"):
        hf.layer(both_ways)


def _deepseek(version: int):
    from tests.test_latent_hf import YARN, config
    return lambda **extra: config(version, rope=YARN if version == 3 else None, **extra)


REGISTERED = {  # name -> (model class, config): the tiny whole models
    "deepseek_v3 (yarn)": ("DeepseekV3ForCausalLM", _deepseek(3)),
    "deepseek_v2": ("DeepseekV2ForCausalLM", _deepseek(2)),
    "qwen3": ("Qwen3ForCausalLM", today.qwen3_config),
    "gemma3 (softcap set, never applied)": ("Gemma3ForCausalLM", today.gemma3_config),
    "olmo2": ("Olmo2ForCausalLM", today.olmo2_config),
    "qwen3_next": ("Qwen3NextForCausalLM", today.qwen3_next_config),
    "diffllama": ("DiffLlamaForCausalLM", today.diffllama_config),
    "llama4": ("Llama4ForCausalLM", today.llama4_config),
}


@pytest.mark.parametrize("name", list(REGISTERED))
def test_register_runs_the_whole_models_as_hfs_sdpa(name):
    """A left-padded batch, greedy generate of 3 tokens: einattn's tokens and logits equal
    HF's sdpa (float64), whatever the module computes around the attention interface."""
    hf.register()
    cls, config = REGISTERED[name]
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    runs = {}
    for implementation in ("sdpa", "einattn"):
        torch.manual_seed(0)
        model = getattr(transformers, cls)(config(pad_token_id=0)).to(F64).eval()
        model.set_attn_implementation(implementation)
        with hf.capture(model) if implementation == "einattn" else contextlib.nullcontext(
                {0: None}) as stages:
            out = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
        assert stages  # einattn ran every attention layer it was given
        runs[implementation] = out.sequences, torch.stack(out.logits)
    assert torch.equal(runs["einattn"][0], runs["sdpa"][0])
    assert_close_scaled(runs["einattn"][1], runs["sdpa"][1], TOL[F64])
