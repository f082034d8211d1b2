"""einattn.derivation: every registered step of the derivation is true and every registered
mutation is caught, at the seed's sizes and at all-distinct sizes, in float mode and, where
the step allows, exactly (in the finite field for written sides, with integers for
functions of a multilinear step); the four-operand scores contract in the Q·K order."""

from __future__ import annotations

import pytest
import torch

from einattn import (
    EinattnError,
    Equation,
    _sides,
    derivation,
    field_steps,
    gradient_steps,
    model_steps,
    pattern_steps,
    ring_steps,
)
from einattn.derivation import Step, default_sizes, mutations, steps
from einattn.masks import alibi_slopes
from einattn.verify import assert_equivalent, check_equivalent

SIZES = {
    "seed": default_sizes(),  # n=2, L=5, d_model=16, 4 heads: d_head = 4 = n_heads
    "distinct": default_sizes(n=2, L=5, d_model=24, n_heads=3),  # d_head 8
    # Every size distinct (B is 3, so μ is not), and a key length of its own for the
    # steps that allow one.
    "distinct, L_k": default_sizes(n=2, L=5, d_model=28, n_heads=4, L_k=6),
}

# What the derivation must cover: one phrase per step, found in exactly one step's name.
STEP_TOPICS = [
    "(1q)+(1kv) = (1) when j = i",
    "fused projection = three separate projections",
    "scores as one four-operand contraction X W_Q W_K X = Q·K",
    "index fusion (a i) = a·p + i",
    "W_O[μ a i] contraction = concatenate heads + linear",
    "(μ B a) and (B μ a) related by a rearrangement",
    "(3) softmax_σ(S + M) as its Equation = torch.softmax with the mask applied",
    "additive causal M = boolean causal mask",
    "whole layer = reshape form",
    "GQA (g C a) layout = repeat-interleave reference",
    "W_QK circuit = Q·K scores",
    "W_OV circuit = A·V·W_O output",
    "RoPE (R1) rotation = Llama's rotate_half",
    "RoPE (R2) rotation = GPT-J's rotate_every_two",
    "RoPE scores depend on t − s only (positions + 1000)",
    "KV cache: prefill + token steps = one causal forward",
    "linear attention: (L1) as one equation = φ_Q (φ_Kᵀ V)",
    "causal linear attention: prefix sums (L4)–(L6) = masked weights",
    "linear attention = its quadratic form (no softmax)",
    "causal linear attention = its causal quadratic form",
    "sliding window, causal = its dense mask τ' − w < σ ≤ τ'",
    "sliding window = its dense mask |τ' − σ| < w",
    "softcap c·tanh(S/c) after the 1/√a scale, before B and M",
    "sinks = softmax over σ and one more logit s_μ (its value zero)",
    "ALiBi −m_μ|τ' − σ| = BLOOM's +m_μ·σ under causal (a per-row shift)",
    "documents = a block-diagonal mask",
    "packed documents, causal = each document alone, concatenated",
    "log-sum-exp merge (M1)–(M2) of two halves of the keys = softmax over all",
    "ring attention, zigzag chunks pair by pair, causal = causal attention",
    "backward VALUE_GRADS dV_b = Pᵀ dZ_t is d/dV_b of Z_t = P V_b",
    "backward PROB_GRADS dP = dZ_t V_bᵀ is d/dP of Z_t = P V_b",
    "backward QUERY_GRADS dQ_t = dS K_b / √a is d/dQ_t of (2g)",
    "backward KEY_GRADS dK_b = dSᵀ Q_t / √a is d/dK_b of (2g)",
    "softmax backward dS = A ∘ (dA − Σ_σ A ∘ dA)",
    "chunked dS = P ∘ (dP − D), D = Σ_a dZ Z is d/dS of softmax_σ(S) V_b",
    "online softmax: chunked's tile update after keys ρ = softmax over ρ ∪ σ",
    "ring merge (M1)–(M2) of keys ρ and σ = softmax over both",
    "ring merge (M1): its lse = logsumexp over ρ ∪ σ",
    "sinks: chunked's start m = s_μ, l = 1, O = 0, one tile = s_μ in the denominator",
    "(3)→(4): softmax_σ(S + M) V = Σ_σ e^S e^M V / Σ_σ e^S e^M, e^M a 0/1 multiplier",
    "chunked dV_b = dV_b derived by Equation.grad ((4g))",
    "chunked dP = dP derived by Equation.grad ((4g))",
    "chunked dQ_t = dQ_t derived by Equation.grad ((2g))",
    "chunked dK_b = dK_b derived by Equation.grad ((2g))",
    "chunked dS = P ∘ (dP − D) = dS derived by Equation.grad through (3) and (4g)",
    "MLA absorption: scores Q_A·(C_KV W_UK) = (Q_A W_UK)·C_KV",
    "MLA absorption: output ((A (C_KV W_UV)) W_O) = (((A C_KV) W_UV) W_O)",
    "(1b) W[(g e) i], e = (r a | a | b) = each group's rows by hand",
    "(1k), (1v): keys and values from contexts of their own = two linears",
    "qk-norm over the heads = OLMo 2's norm of the flat projection",
    "qk-norm without a gain commutes with RoPE (Llama 4's after = before)",
    "gate rows (μ B a) = Qwen3-Next's view(n, L, μ, 2a).chunk(2)",
    "(D4) (A_1 − λ A_2) V = Z_1 − λ Z_2",
    "differential heads (δ q r), value pairs (e q) = DiffLlama's halves",
    "(T3) β[n τ] Q, then the scores = the scores, then β[n τ] on their rows",
    "add_bias_kv: the slot, seen by every query = torch's (causal attn_mask)",
]
MUTATION_TOPICS = ["K and V swapped in W_KV", "swapped indices", "missing 1/√a scale",
                   "wrong group order",
                   "transposed W_O", "off-by-one causal mask", "softmax along τ", "tiling (a μ)",
                   "tiled GQA heads", "strict prefix", "window off by one",
                   "window aligned top-left", "softcap after B and M",
                   "softcap before the 1/√a scale", "sink counted in", "sign flipped",
                   "merge by averaging", "merge by the larger", "zigzag chunks ordered by rank",
                   "reverse head order", "documents without their ids",
                   "query heads read (r g)", "without its 1/√a", "no row sum",
                   "sum over queries τ", "D outside the product", "O not rescaled",
                   "two weights swapped", "W_UK read as [μ c a]", "value block read before",
                   "keys projected from the values' context", "taken per head",
                   "with a gain γ[a] after RoPE", "last μ·a rows", "λ on the first softmax",
                   "paired with their neighbours", "β at the key's position",
                   "hidden by torch's is_causal=True"]


def named(registry: list[Step], name: str) -> Step:
    (step,) = [s for s in registry if s.name == name]
    return step


def cases(registry) -> list:
    """(sizes label, step name, exact) for every step at every size set, exact steps twice."""
    return [pytest.param(label, step.name, exact, id=f"{step.name} [{label}, "
                         f"{'exact' if exact else 'float'}]")
            for label, sizes in SIZES.items() for step in registry(sizes)
            for exact in ([True, False] if step.exact else [False])]


def check(step: Step, exact: bool, seed: int = 0):
    return check_equivalent(step.lhs, step.rhs, step.sizes, exact=exact, seed=seed,
                            inputs=step.inputs or None, draws=step.draws, masks=step.masks)


def exact_mode(step: Step) -> str:
    """The mode an exact step runs in: the finite field where both sides are written."""
    sides = (Equation(s) if isinstance(s, str) else s for s in (step.lhs, step.rhs))
    return "field" if all(map(_sides.written, sides)) else "exact"


def test_default_sizes_are_the_seed_trace():
    assert default_sizes() == {"n": 2, "τ": 5, "σ": 5, "i": 16, "j": 16, "μ": 4, "a": 4, "B": 3}
    assert default_sizes(L=5, L_k=7)["σ"] == 7


def test_the_distinct_sizes_are_distinct():
    sizes = SIZES["distinct, L_k"]
    assert len({sizes[i] for i in "nτσiμaB"}) == 7


@pytest.mark.parametrize("label, name, exact", cases(steps))
def test_every_step_holds(label, name, exact):
    step = named(steps(SIZES[label]), name)
    report = check(step, exact)
    assert report.equal, str(report)
    assert report.mode == (exact_mode(step) if exact else "float")
    if exact:
        assert report.max_deviation == 0.0 and report.false_acceptance < 1e-8


@pytest.mark.parametrize("L_k", [None, 4], ids=["self", "L_k 4"])
def test_every_step_holds_at_one_query_position(L_k):
    """τ = 1: the cache step's prefill is then the one token, with no token steps after it."""
    for step in steps(default_sizes(n=1, L=1, d_model=6, n_heads=3, L_k=L_k)):
        report = check(step, step.exact)
        assert report.equal, f"{step.name}: {report}"


@pytest.mark.parametrize("label, name, exact", cases(mutations))
def test_every_mutation_is_rejected(label, name, exact):
    step = named(mutations(SIZES[label]), name)
    report = check(step, exact)
    assert not report.equal, str(report)
    assert report.max_deviation > report.tolerance
    with pytest.raises(AssertionError, match=r"^NOT equal(: exact \(finite field, p = \d+, "
                                             r"| \((exact|float), )3 draws"):
        assert_equivalent(step.lhs, step.rhs, step.sizes, exact=exact, inputs=step.inputs or None,
                          masks=step.masks)


@pytest.mark.parametrize("registry", [steps, mutations])
def test_exact_is_claimed_wherever_the_step_allows_it(registry):
    """A step marked float-only really cannot be exact (asked to, it runs in float64 and
    says why, or its code refuses integers), so no mutation that an exact mode could check
    is left to float64 alone."""
    for step in registry():
        if step.exact:
            assert check(step, exact=True).mode == exact_mode(step), step.name
            continue
        try:
            report = check(step, exact=True)
        except (EinattnError, RuntimeError):
            continue
        assert report.mode == "float" and report.note.startswith("float64: "), step.name


def _doubled(side, sizes: dict[str, int]):
    """``2 × side`` as a callable taking the same tensors."""
    side = Equation(side) if isinstance(side, str) else side
    return lambda **t: 2 * _sides.evaluated(side, t, sizes)


@pytest.mark.parametrize("name", [s.name for s in steps()])
def test_no_step_holds_vacuously(name):
    """Both sides are not identically zero: twice the right side is not the left side."""
    step = named(steps(), name)
    inputs = step.inputs or None
    assert not check_equivalent(step.lhs, _doubled(step.rhs, step.sizes), step.sizes,
                                exact=step.exact, inputs=inputs, masks=step.masks).equal


@pytest.mark.parametrize("label", list(SIZES))
def test_steps_use_the_sizes_they_are_given(label):
    """The derivation's own steps use the sizes as given (σ = τ for self-attention); the
    variations' steps add their indices (g, r, C, c) and keep n, τ and i; the patterns'
    keep every size but take one query fewer at self-attention sizes (τ' ≠ τ); the
    backward's run at gradient_sizes, six sizes that all differ; the ring's schedule at 8
    positions."""
    sizes = SIZES[label]
    variations = derivation.variation_steps(sizes) + derivation.variation_mutations(sizes)
    patterns = derivation.pattern_steps(sizes) + derivation.pattern_mutations(sizes)
    backward = gradient_steps.steps(sizes) + gradient_steps.mutations(sizes)
    field = field_steps.steps(sizes) + field_steps.mutations(sizes)
    models = model_steps.steps(sizes) + model_steps.mutations(sizes)
    three_four = "(3)→(4): softmax_σ(S + M) V = Σ_σ e^S e^M V / Σ_σ e^S e^M, e^M a 0/1 multiplier"
    on_the_ring = {"ring attention, zigzag chunks pair by pair, causal = causal attention",
                   "zigzag chunks ordered by rank, not by position"}
    for step in steps(sizes) + mutations(sizes):
        if step.name in on_the_ring:  # 8 positions: 2 ranks × 2 zigzag chunks of 2
            assert step.sizes == ring_steps.ring_sizes(sizes), step.name
        elif step.name == three_four:
            assert step.sizes == {k: sizes[k] for k in "nμτσa"}, step.name
        elif step.name in {f.name for f in field}:  # the backward's, and ρ beside them
            assert step.sizes == field_steps.field_sizes(sizes), step.name
            assert len({step.sizes[k] for k in "rgστanρ"}) == 7, step.name
        elif step.name in {b.name for b in backward}:
            assert step.sizes == gradient_steps.gradient_sizes(sizes), step.name
            assert len(set(step.sizes.values())) == 6, step.name
        elif step.name in {m.name for m in models}:
            assert step.sizes in model_steps.sizes_of(sizes).values(), step.name
        elif step.name in {v.name for v in variations}:
            assert all(step.sizes[k] == sizes[k] for k in "nτ"), step.name
        elif step.name in {p.name for p in patterns}:
            assert all(step.sizes[k] == sizes[k] for k in "nσiμa"), step.name
            assert step.sizes["τ"] == sizes["τ"] - (sizes["σ"] == sizes["τ"]), step.name
        else:
            assert step.sizes in (sizes, {**sizes, "σ": sizes["τ"]}), step.name


@pytest.mark.parametrize("label", [*SIZES, "one query"])
def test_the_model_steps_sizes_are_distinct(label):
    """Each family of today's models' steps has sizes all distinct, but for the three that
    meet on purpose: a = c where W_UK is read as [μ c a], i = μ·a for torch's heads, σ = τ
    where β[n σ] is read for β[n τ]."""
    s = default_sizes(n=1, L=1, d_model=6, n_heads=3) if label == "one query" else SIZES[label]
    families = model_steps.sizes_of(s)
    square, slot, tempered = families["square"], families["slot"], families["tempered"]
    assert square["a"] == square["c"] and slot["i"] == slot["μ"] * slot["a"]
    assert tempered["σ"] == tempered["τ"]
    for name, index in [("square", "c"), ("slot", "i"), ("tempered", "σ")]:
        families[name] = {k: v for k, v in families[name].items() if k != index}
    for name, z in families.items():
        assert len(set(z.values())) == len(z), (name, z)
    assert families["latent"]["τ"] == s["τ"]


@pytest.mark.parametrize("s, pattern, packed", [
    ({"τ": 5, "σ": 5}, {"τ": 4, "σ": 5}, {"τ": 4, "σ": 5}),
    ({"τ": 1, "σ": 1}, {"τ": 1, "σ": 2}, {"τ": 1, "σ": 2}),
    ({"τ": 5, "σ": 6}, {"τ": 5, "σ": 6}, {"τ": 5, "σ": 6}),
    ({"τ": 7, "σ": 4}, {"τ": 7, "σ": 4}, {"τ": 4, "σ": 4}),
], ids=["self", "one query", "more keys", "fewer keys"])
def test_the_patterns_sizes_keep_queries_and_keys_apart(s, pattern, packed):
    """Self-attention sizes give one query fewer (a key more for a single query), so that a
    pattern aligned top-left is caught; documents take no more queries than keys."""
    assert pattern_steps.pattern_sizes(s) == pattern
    assert pattern_steps.packed_sizes(s) == packed


# Fewer keys than queries: the first queries see no key under causal (zeros); documents
# then run at τ = σ, their queries' ids being the keys' last L_q.
FEWER_KEYS = default_sizes(n=3, L=7, d_model=20, n_heads=5, L_k=4)


@pytest.mark.parametrize("name", [s.name for s in derivation.pattern_steps(FEWER_KEYS)])
def test_every_pattern_step_holds_with_fewer_keys_than_queries(name):
    step = named(derivation.pattern_steps(FEWER_KEYS), name)
    assert step.sizes["τ"] > step.sizes["σ"] or "documents" in name
    report = check(step, exact=False)
    assert report.equal, str(report)


@pytest.mark.parametrize("name", [s.name for s in derivation.pattern_mutations(FEWER_KEYS)])
def test_every_pattern_mutation_is_rejected_with_fewer_keys_than_queries(name):
    report = check(named(derivation.pattern_mutations(FEWER_KEYS), name), exact=False)
    assert not report.equal and report.max_deviation > report.tolerance, str(report)


@pytest.mark.parametrize("h", range(1, 33))
def test_the_alibi_steps_bloom_slopes_are_einattns(h):
    """The ALiBi step's right side draws its slopes by BLOOM's own formula; they are
    einattn.masks.alibi_slopes for every head count, powers of two or not."""
    torch.testing.assert_close(pattern_steps.bloom_slopes(h, torch.float64),
                               alibi_slopes(h, dtype=torch.float64), rtol=1e-15, atol=0)


def test_the_steps_cover_the_derivation():
    names = [s.name for s in steps()]
    assert sorted(names) == sorted(STEP_TOPICS)


def test_the_mutations_cover_the_wrong_steps():
    names = [s.name for s in mutations()]
    for topic in MUTATION_TOPICS:
        assert sum(topic in name for name in names) == 1, topic
    assert len(names) == len(MUTATION_TOPICS) == len(set(names))


# -- the order opt_einsum picks for the four-operand scores ----------------------------------

FOUR = named(steps(), "scores as one four-operand contraction X W_Q W_K X = Q·K").lhs


@pytest.mark.parametrize("L", [5, 512])
def test_four_operand_scores_contract_X_with_W_first(L):
    """opt_einsum's order is X·W_Q → Q, X·W_K → K, then Q·K: the (τ σ)-sized product is
    formed only at the last step, and the FLOPs are far below the naive count."""
    s = default_sizes(L=L)
    equation = Equation(FOUR)
    plan = equation.explain(X=(s["n"], L, s["i"]), W_Q=(s["μ"], s["a"], s["i"]),
                            W_K=(s["μ"], s["a"], s["j"]))
    inputs, output = plan.einsum.split("->")
    letter: dict[str, str] = {}  # index -> the einsum letter it runs as
    for sub, term in zip(inputs.split(","), equation.terms, strict=True):
        letter.update(zip(term.indices, sub, strict=True))
    kind = {sub: t.name[0] for sub, t in zip(inputs.split(","), equation.terms, strict=True)}
    contractions = [step[2] for step in plan.info.contraction_list]
    assert len(contractions) == 3 and len(plan.path) == 3
    first = contractions[0].split("->")[0].split(",")
    assert sorted(kind[sub] for sub in first) == ["W", "X"]  # X with a W, not X with X
    results = [frozenset(c.split("->")[1]) for c in contractions]
    Q, K = (frozenset(letter[i] for i in ("n", "μ", p, "a")) for p in ("τ", "σ"))
    assert set(results[:2]) == {Q, K}  # Q[n μ τ a] and K[n μ σ a], in either order
    for r in results[:-1]:
        assert not {letter["τ"], letter["σ"]} <= r  # no (τ σ)-sized intermediate early
    assert results[-1] == set(output)
    assert plan.flops < plan.info.naive_cost / 50
    assert plan.largest_intermediate == s["n"] * s["μ"] * L * L  # S itself, nothing larger
    assert "path:" in str(plan) and f"FLOPs:    {plan.flops:,}" in str(plan)
