"""The derivation's identities through the softmax, each written with the equations that
run it and proved in the finite field (:mod:`einattn._field_check`), where a tolerance can
neither pass a wrong step nor fail a right one; :func:`einattn.derivation.steps` registers
them beside the float64 steps that run the code itself.

* The online softmax (:mod:`einattn.chunked`): after the keys ρ seen so far left the state
  ``m`` (any value: a free maximum), ``l = Σ_ρ exp(S_0 − m)`` and ``O = Σ_ρ exp(S_0 − m) V_0``,
  one tile of keys σ through ``RUNNING_MAX`` … ``RUNNING_VALUES`` and ``Z = O / l`` is the
  softmax over ρ ∪ σ. By induction the whole loop is, from its start ``l = 0, O = 0``
  (the state of no key), and a sink's start ``m = s_μ, l = 1, O = 0`` is one key more.
* The ring's merge (M1)–(M2) (:mod:`einattn.ring`) of two sets of keys: the softmax over both.
* Equations (3)→(4) with the mask as what ``exp`` makes of it, a 0/1 multiplier.
* The chunked tile's backward equations: the gradients :meth:`einattn.Equation.grad` derives
  from the tile's forward equations.

The softmax over all the keys ρ ∪ σ is written out, ``(Σ_ρ e^{S_0} V_0 + Σ_σ e^S V) /
(Σ_ρ e^{S_0} + Σ_σ e^S)``: the keys of two tensors have no one index of their own.
"""

from __future__ import annotations

from . import chunked, functional, ring
from ._step import Step
from .chain import Chain
from .gradient_steps import (
    ATTENTION_ROWS,
    TILE_SCORES,
    TILE_VALUES,
    TILE_WEIGHTS,
    chunked_score_grads,
    gradient_sizes,
)

ONE_PLUS_2_POW_MINUS_42 = "1.000000000000227373675443232059478759765625"  # exactly 1 + 2⁻⁴²
ULP_OF_ONE = "0.0000000000000002220446049250313080847263336181640625"  # exactly 2⁻⁵²

_SEEN = ("m[n μ τ] = max_ρ(S_0[n μ τ ρ])",
         "l[n μ τ] = sum_ρ(exp(S_0[n μ τ ρ] − m[n μ τ]))",
         "O[n (g r) τ a] = exp(S_0[n (g r) τ ρ] − m[n (g r) τ]) V_0[n g ρ a]")
_OUTPUT = "Z[n (g r) τ a] = O_new[n (g r) τ a] / l_new[n (g r) τ]"
ALL_KEYS = ("Z[n (g r) τ a] = (exp(S_0[n (g r) τ ρ]) V_0[n g ρ a] + exp(S[n (g r) τ σ]) "
            "V_b[n g σ a]) / (sum_ρ(exp(S_0[n (g r) τ ρ])) + sum_σ(exp(S[n (g r) τ σ])))")
_HALVES = ("lse_1[n μ τ] = logsumexp_ρ(S_1[n μ τ ρ])",
           "Z_1[n μ τ a] = softmax_ρ(S_1[n μ τ ρ]) V_1[n μ ρ a]",
           "lse_2[n μ τ] = logsumexp_σ(S_2[n μ τ σ])",
           "Z_2[n μ τ a] = softmax_σ(S_2[n μ τ σ]) V_2[n μ σ a]")
BOTH_SETS = ("Z[n μ τ a] = (exp(S_1[n μ τ ρ]) V_1[n μ ρ a] + exp(S_2[n μ τ σ]) V_2[n μ σ a])"
             " / (sum_ρ(exp(S_1[n μ τ ρ])) + sum_σ(exp(S_2[n μ τ σ])))")
_SINK = ("m_new[n μ τ] = max(s[μ], max_σ(S[n μ τ σ]))", chunked.WEIGHTS,
         "c[n μ τ] = exp(s[μ] − m_new[n μ τ])",
         "l_new[n μ τ] = c[n μ τ] + sum_σ(P[n μ τ σ])",
         "O_new[n (g r) τ a] = P[n (g r) τ σ] V_b[n g σ a]", _OUTPUT)
WITH_A_SINK = ("Z[n (g r) τ a] = exp(S[n (g r) τ σ]) V_b[n g σ a] / (exp(s[(g r)]) "
               "+ sum_σ(exp(S[n (g r) τ σ])))")
MASK_MULTIPLIER = ("Z[n μ τ a] = exp(S[n μ τ σ]) exp(M[n μ τ σ]) V[n μ σ a] "
                   "/ sum_σ(exp(S[n μ τ σ]) exp(M[n μ τ σ]))")


def field_sizes(s: dict[str, int]) -> dict[str, int]:
    """:func:`einattn.gradient_steps.gradient_sizes` (six distinct sizes, μ = (g r) of
    r = 2, g = 3), with μ and the earlier keys' ρ, of a size of its own."""
    z = gradient_sizes(s)
    rho = next(k for k in range(2, 20) if k not in z.values())
    return {**z, "μ": z["g"] * z["r"], "ρ": rho}


def online_softmax(rescale=chunked.RESCALE, values=chunked.RUNNING_VALUES) -> Chain:
    """The keys ρ seen, then one tile σ through einattn.chunked's running equations."""
    return Chain(*_SEEN, chunked.RUNNING_MAX, chunked.WEIGHTS, rescale, chunked.RUNNING_SUM,
                 values, _OUTPUT)


def merged(merge_z=ring.MERGE_Z) -> Chain:
    """Two sets of keys attended alone, merged by (M1)–(M2)."""
    return Chain(*_HALVES, ring.MERGE_LSE, merge_z)


def derived_backward(wrt: str):
    """The gradient :meth:`~einattn.Equation.grad` derives for the tile: of (2g) for
    ``Q_t``, ``K_b``, of (4g) for ``V_b``, ``P``, and through the softmax for ``S``."""
    if wrt in ("Q_t", "K_b"):
        return TILE_SCORES.grad(wrt)
    if wrt in ("V_b", "P"):
        return TILE_VALUES.grad(wrt)
    return Chain(TILE_WEIGHTS, TILE_VALUES.grad("P"), TILE_WEIGHTS.grad("S"))


def steps(s: dict[str, int]) -> list[Step]:
    """The identities, each proved in the finite field."""
    z, d = field_sizes(s), default_like(s)
    chunked_dS = Chain(*ATTENTION_ROWS.equations, *chunked_score_grads().equations)
    backward = [(f"chunked {e.output} = {e.output} derived by Equation.grad "
                 f"({'(2g)' if e in (chunked.QUERY_GRADS, chunked.KEY_GRADS) else '(4g)'})",
                 e, derived_backward(e.output[1:]))
                for e in (chunked.VALUE_GRADS, chunked.PROB_GRADS, chunked.QUERY_GRADS,
                          chunked.KEY_GRADS)]
    return [
        Step("online softmax: chunked's tile update after keys ρ = softmax over ρ ∪ σ",
             online_softmax(), ALL_KEYS, z, True),
        Step("ring merge (M1)–(M2) of keys ρ and σ = softmax over both", merged(),
             BOTH_SETS, z, True),
        Step("ring merge (M1): its lse = logsumexp over ρ ∪ σ",
             Chain(*_HALVES, ring.MERGE_LSE),
             "lse[n μ τ] = log(sum_ρ(exp(S_1[n μ τ ρ])) + sum_σ(exp(S_2[n μ τ σ])))", z, True),
        Step("sinks: chunked's start m = s_μ, l = 1, O = 0, one tile = s_μ in the denominator",
             Chain(*_SINK), WITH_A_SINK, z, True),
        Step("(3)→(4): softmax_σ(S + M) V = Σ_σ e^S e^M V / Σ_σ e^S e^M, e^M a 0/1 multiplier",
             Chain(functional.SOFTMAX, functional.VALUES), MASK_MULTIPLIER, d, True,
             masks=("M",)),
        *(Step(name, chunked_form, derived, z, True) for name, chunked_form, derived in backward),
        Step("chunked dS = P ∘ (dP − D) = dS derived by Equation.grad through (3) and (4g)",
             chunked_dS, derived_backward("S"), z, True),
    ]


def default_like(s: dict[str, int]) -> dict[str, int]:
    """The sizes of equations (3) and (4): ``s``'s n, μ, τ, σ, a."""
    return {k: s[k] for k in ("n", "μ", "τ", "σ", "a")}


def mutations(s: dict[str, int]) -> list[Step]:
    """Wrong steps every mode rejects."""
    z = field_sizes(s)
    no_rescale = "O_new[n (g r) τ a] = O[n (g r) τ a] + P[n (g r) τ σ] V_b[n g σ a]"
    swapped = ("Z[n μ τ a] = exp(lse_2[n μ τ] − lse[n μ τ]) · Z_1[n μ τ a] "
               "+ exp(lse_1[n μ τ] − lse[n μ τ]) · Z_2[n μ τ a]")
    return [
        Step("online softmax with O not rescaled by c", online_softmax(values=no_rescale),
             ALL_KEYS, z, True),
        Step("ring merge with the two weights swapped", merged(swapped), BOTH_SETS, z, True),
    ]


def subtle_mutations(s: dict[str, int]) -> list[Step]:
    """Wrong steps that float64 accepts (their error is below its 1e-12 tolerance) and the
    finite field rejects: the rescale factor off by a factor 1 + 2⁻⁴², the merge off by a
    term of one ulp of its weights."""
    z = field_sizes(s)
    rescale = f"c[n μ τ] = exp(m[n μ τ] − m_new[n μ τ]) · {ONE_PLUS_2_POW_MINUS_42}"
    merge = ("Z[n μ τ a] = exp(lse_1[n μ τ] − lse[n μ τ]) · Z_1[n μ τ a] "
             "+ exp(lse_2[n μ τ] − lse[n μ τ]) · Z_2[n μ τ a] "
             f"+ {ULP_OF_ONE} · Z_2[n μ τ a]")
    return [
        Step("online softmax with its rescale factor × (1 + 2⁻⁴²)",
             online_softmax(rescale=rescale), ALL_KEYS, z, True),
        Step("ring merge (M2) with one ulp (2⁻⁵²) of Z_2 too many", merged(merge), BOTH_SETS,
             z, True),
    ]
