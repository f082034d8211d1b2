"""Whole Hugging Face models with einattn as their attention implementation
(:func:`einattn.hf.register`): tiny random-weight float64 models built from configs (no hub)
give, on every real token of a left-padded batch, what Hugging Face gives each sequence
alone; greedy ``generate`` picks the same tokens; ``output_attentions`` and
:func:`einattn.hf.capture` give eager's weights; every parameter's gradient is HF's.

The reference is HF's sdpa path where the model has one (exact in float64); Gemma 2 and
gpt-oss have only eager, which takes Gemma 2's softmax in float32 (there 1e-6 of the
largest logit).
"""

from __future__ import annotations

import sys

import pytest
import torch

from einattn import EinattnError, hf

transformers = pytest.importorskip("transformers")

F64 = torch.float64
SMALL = {"vocab_size": 50, "max_position_embeddings": 64}
LLAMA_LIKE = {"hidden_size": 24, "intermediate_size": 32, "num_hidden_layers": 2,
              "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 8, **SMALL}
MODELS = {  # name -> (config, HF's reference implementation, its tolerance)
    "gpt2": (lambda: transformers.GPT2Config(n_embd=24, n_layer=2, n_head=4, vocab_size=50,
                                             n_positions=64, attn_pdrop=0.0, resid_pdrop=0.0,
                                             embd_pdrop=0.0), "sdpa", 1e-12),
    "llama": (lambda: transformers.LlamaConfig(**LLAMA_LIKE), "sdpa", 1e-12),
    "mistral": (lambda: transformers.MistralConfig(sliding_window=4, **LLAMA_LIKE), "sdpa",
                1e-12),
    "qwen2": (lambda: transformers.Qwen2Config(use_sliding_window=True, sliding_window=4,
                                               max_window_layers=1, **LLAMA_LIKE), "sdpa", 1e-12),
    "gemma2": (lambda: transformers.Gemma2Config(sliding_window=4, attn_logit_softcapping=2.0,
                                                 final_logit_softcapping=None, **LLAMA_LIKE),
               "eager", 1e-6),
    "gpt_oss": (lambda: transformers.GptOssConfig(sliding_window=4, num_local_experts=2,
                                                  num_experts_per_tok=1, **LLAMA_LIKE),
                "eager", 1e-12),
}
HF_SDPA = {"gpt2", "llama", "mistral", "qwen2"}  # einattn_sdpa: HF checks its models' sdpa


def _model(name: str):
    """A tiny float64 model (seeded), its sinks drawn, loaded with HF's reference path."""
    config, reference, _ = MODELS[name]
    hf.register()
    torch.manual_seed(7)
    extra = {"experts_implementation": "eager"} if name == "gpt_oss" else {}
    model = transformers.AutoModelForCausalLM.from_config(
        config(), dtype=F64, attn_implementation=reference, **extra).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
                module.sinks.normal_()
    return model, reference


def _impls(name: str) -> list[str]:
    """Every einattn implementation HF lets this model choose (flex: forward, float64 by
    FlexAttention's eager reference on a CPU build)."""
    return [i for i in hf.IMPLEMENTATIONS if i != "einattn_sdpa" or name in HF_SDPA]


def _batch():
    """Two sequences of 9 tokens, the second left-padded by 3, and their positions."""
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


CASES = [(name, impl) for name in MODELS for impl in _impls(name)]


@pytest.mark.parametrize("name, impl", CASES, ids=[f"{n}-{i}" for n, i in CASES])
def test_left_padded_batch_equals_each_sequence_alone(name, impl):
    model, reference = _model(name)
    ids, mask, positions = _batch()
    model.set_attn_implementation(impl)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, position_ids=positions).logits
    assert torch.isfinite(logits).all()  # padded rows too: zeros, never NaN
    model.set_attn_implementation(reference)
    for b in range(2):
        real = mask[b].bool()
        with torch.no_grad():
            alone = model(ids[b:b + 1, real]).logits[0]
        assert (logits[b, real] - alone).abs().max() <= MODELS[name][2] * alone.abs().max()


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_generate_picks_the_same_tokens(name):
    """A left-padded batch through HF's generate (its dynamic cache) continues each
    sequence as HF's reference continues it alone (eager itself turns a left-padded float64
    row NaN, so the reference sees no padding)."""
    model, _ = _model(name)
    ids, mask, _ = _batch()
    alone = []
    for b in range(2):
        real = ids[b:b + 1, mask[b].bool()]
        alone.append(model.generate(real, max_new_tokens=6, do_sample=False,
                                    pad_token_id=0)[0, real.shape[1]:])
    for impl in ("einattn", "einattn_chunked"):
        model.set_attn_implementation(impl)
        tokens = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                pad_token_id=0)
        for b in range(2):
            assert torch.equal(tokens[b, ids.shape[1]:], alone[b]), (impl, b)


def _decode_with(model, cache, steps: int = 4) -> torch.Tensor:
    """Greedy decoding by hand through ``cache``, as ``generate`` runs it (positions from the
    left-padded mask): the float64 logits of the prefill's last token and of every step."""
    ids, mask, positions = _batch()
    logits = []
    with torch.no_grad():
        for _ in range(steps + 1):
            out = model(ids, attention_mask=mask, position_ids=positions, cache=cache,
                        use_cache=True)
            logits.append(out.logits[:, -1])
            ids, positions = logits[-1].argmax(-1, keepdim=True), positions[:, -1:] + 1
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    return torch.stack(logits, dim=1)


CACHES = {"dynamic": lambda model: transformers.DynamicCache(config=model.config),
          "static": lambda model: transformers.StaticCache(config=model.config, max_cache_len=16)}


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("name", sorted(HF_SDPA))
def test_decoding_through_hfs_caches_equals_hfs_sdpa(name, cache):
    """A left-padded batch decoded step by step through Hugging Face's own caches, the
    DynamicCache (which concatenates) and the StaticCache (written in place, its empty slots
    hidden by HF's mask): every einattn implementation's float64 logits equal HF's sdpa's."""
    model, _ = _model(name)
    want = _decode_with(model, CACHES[cache](model))
    for impl in ("einattn", "einattn_sdpa", "einattn_chunked"):
        model.set_attn_implementation(impl)
        got = _decode_with(model, CACHES[cache](model))
        assert (got - want).abs().max() <= 1e-12 * want.abs().max(), impl
    assert torch.isfinite(want).all()


@pytest.mark.parametrize("name", list(MODELS))
def test_output_attentions_and_capture_give_eagers_weights(name):
    model, _ = _model(name)
    ids = _batch()[0]
    model.set_attn_implementation("eager")
    with torch.no_grad():
        want = model(ids, output_attentions=True).attentions
    model.set_attn_implementation("einattn")
    with torch.no_grad():
        got = model(ids, output_attentions=True).attentions
        with hf.capture(model) as stages:
            model(ids)
    assert sorted(stages) == [0, 1] and sorted(stages[0]) == ["A", "K", "Q", "S", "V", "Z"]
    for layer, (A, A_eager) in enumerate(zip(got, want, strict=True)):
        assert (A - A_eager).abs().max() < 1e-7
        assert torch.equal(stages[layer]["A"], A)


def _eagers_weights(model, ids):
    model.set_attn_implementation("eager")
    with torch.no_grad():
        return model(ids, output_attentions=True).attentions


@pytest.mark.parametrize("name", list(MODELS))
def test_output_attentions_gives_the_weights_on_every_name(name):
    """``output_attentions=True`` in the call (GPT-2 keeps it from its attention: einattn
    reads what Hugging Face gathers), then ``config.output_attentions=True`` (set while the
    config is eager, as Hugging Face's setter requires, then the einattn name chosen): every
    name returns eager's weights, which keep their gradient (HF's
    test_retain_grad_hidden_states_attentions)."""
    model, _ = _model(name)
    ids = _batch()[0]
    want = _eagers_weights(model, ids)
    for impl in _impls(name):
        model.set_attn_implementation("eager")
        model.config.output_attentions = False
        model.set_attn_implementation(impl)
        with torch.set_grad_enabled(impl != "einattn_flex"):  # flex: forward only on a CPU
            asked = model(ids, output_attentions=True).attentions
            model.set_attn_implementation("eager")
            model.config.output_attentions = True
            model.set_attn_implementation(impl)
            got = model(ids).attentions
        assert len(asked) == len(got) == 2, impl
        for A_asked, A_config, A_eager in zip(asked, got, want, strict=True):
            assert (A_asked - A_eager).abs().max() < 1e-7, impl
            assert (A_config - A_eager).abs().max() < 1e-7, impl
        if impl != "einattn_flex":
            got[0].retain_grad()
            got[-1].sum().backward()  # through layer 1 back to layer 0's weights
            assert got[0].grad is not None and torch.isfinite(got[0].grad).all(), impl


def test_without_hfs_record_of_outputs_the_flags_still_ask(monkeypatch):
    """Where transformers keeps no ``output_capturing._active_collector`` (another
    version), the call's and the config's flags still ask for ``A`` (Llama hands the call's
    to its attention)."""
    model, _ = _model("llama")
    ids = _batch()[0]
    want = _eagers_weights(model, ids)
    hf._output_collector.cache_clear()
    monkeypatch.setitem(sys.modules, "transformers.utils.output_capturing", None)
    try:
        assert hf._output_collector() is None
        model.set_attn_implementation("einattn_chunked")
        with torch.no_grad():
            got = model(ids, output_attentions=True).attentions
    finally:
        hf._output_collector.cache_clear()
    assert len(got) == 2
    assert all((A - B).abs().max() < 1e-7 for A, B in zip(got, want, strict=True))


def test_without_hfs_record_of_outputs_register_warns(monkeypatch):
    """There GPT-2's ``model(..., output_attentions=True)`` gets no maps from the fast names
    (its attention is not told): ``register`` says so once, rather than nothing."""
    hf._output_collector.cache_clear()
    monkeypatch.setitem(sys.modules, "transformers.utils.output_capturing", None)
    try:
        with pytest.warns(UserWarning, match=r"no attention maps from einattn_sdpa, "
                                             r"einattn_chunked, einattn_flex or einattn_auto"):
            hf.register()
    finally:
        hf._output_collector.cache_clear()


@pytest.mark.parametrize("name", list(MODELS))
def test_every_parameters_gradient_is_hfs(name):
    model, reference = _model(name)
    ids, mask, positions = _batch()
    if reference == "eager":  # eager turns NaN on a left-padded float64 batch's real tokens
        mask = torch.ones_like(mask)
    model.train()
    grads = {}
    for impl in (reference, "einattn", "einattn_chunked"):
        model.set_attn_implementation(impl)
        model.zero_grad()
        model(ids, attention_mask=mask, position_ids=positions, labels=ids).loss.backward()
        grads[impl] = torch.cat([p.grad.flatten() for p in model.parameters()])
    scale = grads[reference].abs().max()
    for impl in ("einattn", "einattn_chunked"):
        assert (grads[impl] - grads[reference]).abs().max() <= MODELS[name][2] * scale


def _gpt2_grads(dropout: float, implementation: str, checkpointing: bool) -> torch.Tensor:
    """Every parameter's gradient of a GPT-2 with attention dropout alone (attn_pdrop),
    one training step after ``torch.manual_seed(5)``."""
    config = MODELS["gpt2"][0]()
    config.attn_pdrop = dropout
    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(
        config, dtype=F64, attn_implementation=implementation).train()
    if checkpointing:  # HF's test_training_gradient_checkpointing: the forward runs twice
        getattr(model, "activation_checkpointing_enable",  # the newer name
                model.gradient_checkpointing_enable)()
    ids, mask, positions = _batch()
    torch.manual_seed(5)
    model(ids, attention_mask=mask, position_ids=positions, labels=ids).loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_gpt2_trains_on_chunked_with_attention_dropout_and_checkpointing():
    """attn_pdrop=0.1 on "einattn_chunked" (HF's test_training): a gradient that the dropout
    changes, and that gradient checkpointing, which recomputes each layer's forward with
    torch's generator restored, reproduces (the tiles' masks drawn again the same)."""
    hf.register()
    grads = _gpt2_grads(0.1, "einattn_chunked", checkpointing=False)
    assert torch.isfinite(grads).all()
    again = _gpt2_grads(0.1, "einattn_chunked", checkpointing=True)
    assert (again - grads).abs().max() <= 1e-12 * grads.abs().max()
    undropped = _gpt2_grads(0.0, "einattn_chunked", checkpointing=False)
    assert (undropped - _gpt2_grads(0.0, "sdpa", checkpointing=False)).abs().max() \
        <= 1e-12 * undropped.abs().max()
    assert (grads - undropped).abs().max() > 1e-3 * undropped.abs().max()


def test_register_is_idempotent_and_capture_refuses_other_implementations():
    hf.register()
    hf.register()
    config = MODELS["llama"][0]()
    fresh = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="einattn")
    assert fresh.config._attn_implementation == "einattn"
    model, _ = _model("llama")
    with pytest.raises(EinattnError, match=r"LlamaForCausalLM is not loaded with an einattn "
                                           r"attention implementation .* got "
                                           r"attn_implementation='sdpa'"):
        with hf.capture(model):
            pass


def test_flex_runs_a_left_padded_batch_forward(tmp_path):
    """einattn_flex (forward only on a CPU build; float64 through FlexAttention's eager
    reference) on a model saved and loaded again with from_pretrained."""
    model, _ = _model("llama")
    model.save_pretrained(tmp_path)
    ids, mask, _ = _batch()
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        loaded = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path, dtype=F64, attn_implementation="einattn_flex").eval()
        got = loaded(ids, attention_mask=mask).logits
    real = mask.bool()
    assert (got - want)[real].abs().max() <= 1e-12 * want.abs().max()


def test_a_term_einattn_does_not_have_is_refused_by_name():
    model, _ = _model("llama")
    attention = model.model.layers[0].self_attn
    Q = torch.zeros(1, 6, 3, 8, dtype=F64)
    K = torch.zeros(1, 2, 3, 8, dtype=F64)
    with pytest.raises(EinattnError, match=r"LlamaAttention \(model_type 'llama'\) hands its "
                                           r"attention position_bias, a term einattn's "
                                           r"equations do not have"):
        hf._FORWARDS["einsum"](attention, Q, K, K, None, position_bias=torch.zeros(1))


# -- which architectures run einattn at all ---------------------------------------------------

TINY = {"hidden_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4, **SMALL}
NO_HEAD_DIM = {k: v for k, v in LLAMA_LIKE.items() if k != "head_dim"}
ROUTES, IGNORES = "routes", "ignores"  # and the error HF raises where it is neither
ARCHITECTURES = {  # model_type -> (name in docs/huggingface.md, config, the model's fate):
    # ROUTES: every layer calls the function registered under config._attn_implementation;
    # IGNORES: it loads and computes attention itself; "KeyError": its own table of attention
    # classes refuses the name at load; "AttributeError": its forward reads the mask that
    # the name's mask function (HF's sdpa_mask) leaves out
    "gpt2": ("GPT-2", MODELS["gpt2"][0], ROUTES),
    "llama": ("Llama", MODELS["llama"][0], ROUTES),
    "mistral": ("Mistral", MODELS["mistral"][0], ROUTES),
    "qwen2": ("Qwen2", MODELS["qwen2"][0], ROUTES),
    "gemma": ("Gemma", lambda: transformers.GemmaConfig(**LLAMA_LIKE), ROUTES),
    "gemma2": ("Gemma 2", MODELS["gemma2"][0], ROUTES),
    "stablelm": ("StableLM", lambda: transformers.StableLmConfig(**NO_HEAD_DIM), ROUTES),
    "glm": ("GLM", lambda: transformers.GlmConfig(pad_token_id=0, **LLAMA_LIKE), ROUTES),
    "qwen3": ("Qwen3", lambda: transformers.Qwen3Config(**LLAMA_LIKE), ROUTES),
    "gpt_oss": ("gpt-oss", MODELS["gpt_oss"][0], ROUTES),
    "phi": ("Phi", lambda: transformers.PhiConfig(**NO_HEAD_DIM), ROUTES),
    "gpt_neox": ("GPT-NeoX", lambda: transformers.GPTNeoXConfig(intermediate_size=32, **TINY),
                 ROUTES),
    "opt": ("OPT", lambda: transformers.OPTConfig(ffn_dim=32, word_embed_proj_dim=24, **TINY),
            ROUTES),
    "bloom": ("BLOOM", lambda: transformers.BloomConfig(vocab_size=50, hidden_size=24,
                                                        n_layer=2, n_head=4), IGNORES),
    "falcon": ("Falcon", lambda: transformers.FalconConfig(**TINY), "KeyError"),
    "gpt_neo": ("GPT-Neo", lambda: transformers.GPTNeoConfig(
        vocab_size=50, hidden_size=24, num_layers=2, num_heads=4, window_size=4,
        attention_types=[[["global", "local"], 1]], max_position_embeddings=64), "KeyError"),
    "mpt": ("MPT", lambda: transformers.MptConfig(vocab_size=50, d_model=24, n_layers=2,
                                                  n_heads=4, max_seq_len=64), "AttributeError"),
}
SPIED = []  # the attention modules that called the spy, HF's interface's function


def _spy(module, *args, **kwargs):
    """An attention function registered with HF's interface (einattn's equations inside):
    whether a model calls it is Hugging Face's fact, observed without einattn.hf.check."""
    SPIED.append(module)
    return hf._FORWARDS["einsum"](module, *args, **kwargs)


def _load(name: str, implementation: str):
    """A tiny float32 model of this architecture with ``implementation``."""
    extra = {"experts_implementation": "eager"} if name == "gpt_oss" else {}
    return transformers.AutoModelForCausalLM.from_config(
        ARCHITECTURES[name][1](), attn_implementation=implementation, **extra).eval()


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_check_says_where_hfs_attention_interface_is_called(name):
    """Each architecture's fate under a registered name (a spy's: HF's own behaviour), and
    einattn.hf.check, capture and layer on it: an architecture that calls the interface runs
    einattn in every layer; one that does not is refused by name, never ignored silently."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    hf.register()
    AttentionInterface.register("spy", _spy)
    AttentionMaskInterface.register("spy", sdpa_mask)
    fate, ids = ARCHITECTURES[name][2], _batch()[0]
    SPIED.clear()
    with torch.no_grad():
        if fate == "KeyError":  # HF raises in the model's __init__: einattn cannot intercept
            with pytest.raises(KeyError, match="spy"):
                _load(name, "spy")
        elif fate == "AttributeError":
            with pytest.raises(AttributeError):
                _load(name, "spy")(ids)
        else:  # ROUTES, IGNORES
            _load(name, "spy")(ids)
    assert len(SPIED) == (2 if fate == ROUTES else 0)  # 2 layers
    model = _load(name, "eager" if fate == "KeyError" else "einattn")
    if fate == ROUTES:
        assert hf.check(model) == "einattn"
        with hf.capture(model) as stages, torch.no_grad():
            model(ids)
        assert sorted(stages) == [0, 1]
        return
    model.set_attn_implementation("einattn")  # HF only warns, and keeps the model's own
    who = rf"{type(model).__name__} \(model_type '{name}'\) computes attention in its own code"
    with pytest.raises(EinattnError, match=who + r", not through Hugging Face's attention "
                                                 r"interface \(transformers\.models\..*"
                                                 r"never calls ALL_ATTENTION_FUNCTIONS"):
        hf.check(model)
    with pytest.raises(EinattnError, match=who):
        with hf.capture(model):
            pass
    attention = next(m for m in model.modules() if type(m).__name__.endswith("Attention"))
    for module in (model, attention):  # not "no config" for an attention module (a review)
        with pytest.raises(EinattnError, match=rf"^{type(module).__name__} .*computes "
                                               r"attention in its own code"):
            hf.layer(module)


def test_the_docs_list_the_architectures_checked():
    """docs/huggingface.md's table: those that run einattn, and those refused."""
    from pathlib import Path
    page = (Path(__file__).parent.parent / "docs" / "huggingface.md").read_text()
    row = page.split("| --- | --- |\n", 1)[1].split("\n", 1)[0]
    routes, refused = ([n.strip() for n in cell.split(",")] for cell in row.strip("| ").split("|"))
    assert routes == [shown for shown, _, fate in ARCHITECTURES.values() if fate == ROUTES]
    assert refused == [shown for shown, _, fate in ARCHITECTURES.values() if fate != ROUTES]


def test_capture_refuses_on_exit_a_model_whose_attention_never_reached_einattn(monkeypatch):
    """Where Hugging Face's reading of the source would be wrong (here made so: BLOOM's
    classes said to call the interface), the forward inside capture shows it."""
    hf.register()
    model = _load("bloom", "einattn")
    for cls in (type(model), type(model.transformer)):
        monkeypatch.setattr(cls, "_can_set_attn_implementation", classmethod(lambda c: True))
    with hf.capture(model) as stages:  # no forward inside: nothing to say
        pass
    with pytest.raises(EinattnError, match=r"BloomForCausalLM \(model_type 'bloom'\) ran "
                                           r"inside einattn.hf.capture, but none of its "
                                           r"attention calls reached einattn"):
        with hf.capture(model) as stages, torch.no_grad():
            model(_batch()[0])
    assert stages == {}
    with pytest.raises(RuntimeError, match="the body's own"):  # not replaced by capture's
        with hf.capture(model), torch.no_grad():
            model(_batch()[0])
            raise RuntimeError("the body's own")


def test_check_refuses_what_is_not_a_model():
    with pytest.raises(EinattnError, match=r"einattn.hf.check takes a Hugging Face model "
                                           r"\(an nn.Module\), got str"):
        hf.check("gpt2")
    with pytest.raises(EinattnError, match=r"Linear is not loaded with an einattn attention "
                                           r"implementation .* got attn_implementation=None"):
        hf.check(torch.nn.Linear(2, 2))
