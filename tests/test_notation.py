"""The ``Equation`` engine against hand-written ``torch.einsum`` references.

Every reference below is written independently of einattn: ASCII einsum letters chosen by
hand, groups opened with an explicit ``view``/``reshape`` and ``permute``. Sizes are
all distinct within an equation and mostly not powers of two, so an index that lands on
the wrong axis changes a shape or a value instead of hiding. Where one tensor appears
twice (``X[τ i] ... X[σ j]``) the math itself forces two sizes to agree.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import opt_einsum
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import einattn
from einattn import Equation
from einattn.notation import _MAX_PLANS, Explanation

# One size per index; all distinct, so a swapped index cannot hide.
n, μ, τ, σ, a, i, j, B = 6, 5, 7, 9, 10, 11, 12, 3
g, r = 3, 4  # grouped-query attention: μ = (g r) heads (only in the GQA case)

es = torch.einsum


@dataclass(frozen=True)
class Case:
    id: str
    text: str
    shapes: dict[str, tuple[int, ...]]
    reference: Callable[..., torch.Tensor]
    sizes: dict[str, int] = field(default_factory=dict)


CASES = [
    # -- products of two operands ----------------------------------------------------------
    Case("matmul", "Y[τ j] = X[τ i] U[i j]", {"X": (τ, i), "U": (i, j)},
         lambda X, U: es("ti,ij->tj", X, U)),
    Case("matmul_middle_dot", "Y[τ j] = X[τ i] · U[i j]", {"X": (τ, i), "U": (i, j)},
         lambda X, U: X @ U),
    Case("matmul_star", "Y[τ j] = X[τ i] * U[i j]", {"X": (τ, i), "U": (i, j)},
         lambda X, U: X @ U),
    Case("matmul_no_spaces", "Y[τ j]=X[τ i]U[i j]", {"X": (τ, i), "U": (i, j)},
         lambda X, U: X @ U),
    Case("matvec", "y[τ] = X[τ i] v[i]", {"X": (τ, i), "v": (i,)},
         lambda X, v: X @ v),
    Case("dot", "s[] = u[i] v[i]", {"u": (i,), "v": (i,)},
         lambda u, v: (u * v).sum()),
    Case("batched_matmul", "Y[n τ j] = X[n τ i] U[n i j]", {"X": (n, τ, i), "U": (n, i, j)},
         lambda X, U: torch.bmm(X, U)),
    Case("hadamard", "O[τ i] = X[τ i] Y[τ i]", {"X": (τ, i), "Y": (τ, i)},
         lambda X, Y: X * Y),
    Case("outer", "O[τ σ] = u[τ] v[σ]", {"u": (τ,), "v": (σ,)},
         lambda u, v: torch.outer(u, v)),
    Case("batched_outer", "O[n τ σ] = u[n τ] v[n σ]", {"u": (n, τ), "v": (n, σ)},
         lambda u, v: u[:, :, None] * v[:, None, :]),
    Case("scalar_operand", "O[τ] = x[τ] c[]", {"x": (τ,), "c": ()},
         lambda x, c: x * c),
    # -- one operand: trace, diagonal, sum-out, transpose ------------------------------------
    Case("trace", "t[] = M[i i]", {"M": (i, i)}, lambda M: torch.trace(M)),
    Case("diagonal", "d[i] = M[i i]", {"M": (i, i)}, lambda M: torch.diagonal(M)),
    Case("batched_diagonal", "d[n i] = M[n i i]", {"M": (n, i, i)},
         lambda M: torch.diagonal(M, dim1=1, dim2=2)),
    Case("diagonal_times_vector", "y[i] = M[i i] v[i]", {"M": (i, i), "v": (i,)},
         lambda M, v: torch.diagonal(M) * v),
    Case("sum_out", "s[τ] = X[τ i]", {"X": (τ, i)}, lambda X: X.sum(1)),
    Case("sum_all", "s[] = X[n τ i]", {"X": (n, τ, i)}, lambda X: X.sum()),
    Case("transpose", "T[i τ] = X[τ i]", {"X": (τ, i)}, lambda X: X.T),
    Case("permute_4d", "P[a τ n μ] = Q[n μ τ a]", {"Q": (n, μ, τ, a)},
         lambda Q: Q.permute(3, 2, 0, 1)),
    # -- the attention stages -----------------------------------------------------------------
    Case("scores", "S[n μ τ σ] = Q[n μ τ a] K[n μ σ a]",
         {"Q": (n, μ, τ, a), "K": (n, μ, σ, a)},
         lambda Q, K: es("nhqd,nhkd->nhqk", Q, K)),
    Case("scores_scaled_root", "S[n μ τ σ] = Q[n μ τ a] K[n μ σ a] / √a",
         {"Q": (n, μ, τ, a), "K": (n, μ, σ, a)},
         lambda Q, K: Q @ K.transpose(-1, -2) / math.sqrt(a)),
    Case("scores_scaled_sqrt", "S[n μ τ σ] = Q[n μ τ a] K[n μ σ a] / sqrt(a)",
         {"Q": (n, μ, τ, a), "K": (n, μ, σ, a)},
         lambda Q, K: Q @ K.transpose(-1, -2) / math.sqrt(a)),
    Case("scores_scaled_by_other_index", "S[n μ τ σ] = Q[n μ τ a] K[n μ σ a] / √σ",
         {"Q": (n, μ, τ, a), "K": (n, μ, σ, a)},
         lambda Q, K: Q @ K.transpose(-1, -2) / math.sqrt(σ)),
    Case("values", "Z[n μ τ a] = A[n μ τ σ] V[n μ σ a]",
         {"A": (n, μ, τ, σ), "V": (n, μ, σ, a)},
         lambda A, V: A @ V),
    Case("heads", "Y[n τ i] = Z[n μ τ a] W_O[μ a i]",
         {"Z": (n, μ, τ, a), "W_O": (μ, a, i)},
         lambda Z, W_O: Z.permute(0, 2, 1, 3).reshape(n, τ, μ * a) @ W_O.reshape(μ * a, i)),
    Case("head_terms", "Y_μ[n μ τ i] = Z[n μ τ a] W_O[μ a i]",
         {"Z": (n, μ, τ, a), "W_O": (μ, a, i)},
         lambda Z, W_O: es("nhtd,hdc->nhtc", Z, W_O)),
    # -- chains of three and four operands (opt_einsum plans the order) -------------------
    Case("chain3", "Y[τ j] = X[τ i] U[i a] V[a j]", {"X": (τ, i), "U": (i, a), "V": (a, j)},
         lambda X, U, V: X @ U @ V),
    Case("chain4_scores_summed_over_heads", "S[τ σ] = X[τ i] Wq[(μ a) i] Wk[(μ a) j] X[σ j]",
         {"X": (τ, i), "Wq": (μ * a, i), "Wk": (μ * a, i)},
         lambda X, Wq, Wk: (X @ Wq.T) @ (X @ Wk.T).T, {"μ": μ}),
    Case("chain4_scores_per_head_scaled",
         "S[μ τ σ] = X[τ i] Wq[(μ a) i] Wk[(μ a) j] X[σ j] / √a",
         {"X": (τ, i), "Wq": (μ * a, i), "Wk": (μ * a, i)},
         lambda X, Wq, Wk: es("tmd,smd->mts", (X @ Wq.T).reshape(τ, μ, a),
                              (X @ Wk.T).reshape(τ, μ, a)) / math.sqrt(a), {"μ": μ}),
    # -- groups: decomposed row-major on inputs, flattened on the output ------------------
    Case("projection_grouped", "P[B n μ τ a] = X[n τ i] W[(μ B a) i]",
         {"X": (n, τ, i), "W": (μ * B * a, i)},
         lambda X, W: es("nti,hbdi->bnhtd", X, W.view(μ, B, a, i)), {"μ": μ, "B": B}),
    Case("projection_grouped_is_linear", "P[B n μ τ a] = X[n τ i] W[(μ B a) i]",
         {"X": (n, τ, i), "W": (μ * B * a, i)},
         lambda X, W: torch.nn.functional.linear(X, W).view(n, τ, μ, B, a)
         .permute(3, 0, 2, 1, 4), {"μ": μ, "a": a}),
    Case("projection_opened", "P[B n μ τ a] = X[n τ i] W[(μ B a) i]",
         {"X": (n, τ, i), "W": (μ, B, a, i)},
         lambda X, W: es("nti,hbdi->bnhtd", X, W)),
    Case("split_heads", "Z[n μ τ a] = Y[n τ (μ a)]", {"Y": (n, τ, μ * a)},
         lambda Y: Y.view(n, τ, μ, a).permute(0, 2, 1, 3), {"μ": μ}),
    Case("merge_heads", "Y[n τ (μ a)] = Z[n μ τ a]", {"Z": (n, μ, τ, a)},
         lambda Z: Z.permute(0, 2, 1, 3).reshape(n, τ, μ * a)),
    Case("relayout_groups_both_sides", "V[(B μ a) i] = W[(μ B a) i]", {"W": (μ * B * a, i)},
         lambda W: W.view(μ, B, a, i).permute(1, 0, 2, 3).reshape(B * μ * a, i),
         {"μ": μ, "B": B}),
    Case("group_inferred_from_other_operand", "Y[n τ i] = Z[n τ (μ a)] W_O[μ a i]",
         {"Z": (n, τ, μ * a), "W_O": (μ, a, i)},
         lambda Z, W_O: Z @ W_O.reshape(μ * a, i)),
    Case("grouped_query_attention", "S[n g r τ σ] = Q[n (g r) τ a] K[n g σ a]",
         {"Q": (n, g * r, τ, a), "K": (n, g, σ, a)},
         lambda Q, K: es("nxytd,nxsd->nxyts", Q.view(n, g, r, τ, a), K)),
    # -- names: Greek, several letters, letters that collide, one tensor twice ------------
    Case("greek", "O[α β] = A[α γ] C[γ β]", {"A": (τ, i), "C": (i, σ)},
         lambda A, C: A @ C),
    Case("multi_letter", "S[batch head pos key] = Q[batch head pos dim] K[batch head key dim]",
         {"Q": (n, μ, τ, a), "K": (n, μ, σ, a)},
         lambda Q, K: es("abcd,abed->abce", Q, K)),
    Case("multi_letter_among_ascii", "O[b head] = X[b c] Y[c head d] z[d]",
         {"X": (τ, i), "Y": (i, μ, a), "z": (a,)},
         lambda X, Y, z: es("pq,qrs,s->pr", X, Y, z)),
    Case("gram_one_tensor_twice", "G[τ σ] = X[τ i] X[σ i]", {"X": (τ, i)},
         lambda X: X @ X.T),
    Case("one_tensor_twice_with_other", "y[τ] = X[τ i] U[i j] X[τ j]",
         {"X": (τ, i), "U": (i, i)},
         lambda X, U: ((X @ U) * X).sum(1)),
]


def _tensors(case: Case, seed: int = 0, **kwargs) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, dtype=torch.float64, generator=gen, **kwargs)
            for name, shape in case.shapes.items()}


def test_the_table_is_large_and_its_ids_unique():
    assert len(CASES) >= 25
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_matches_hand_written_einsum(case):
    tensors = _tensors(case)
    got = Equation(case.text)(**tensors, **case.sizes)
    want = case.reference(**tensors)
    assert got.shape == want.shape
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_the_path_torch_compile_traces_agrees(case, monkeypatch):
    """Under torch.compile an equation runs as one einsum without the planner; the same
    code run eagerly (is_compiling patched to True) matches the hand-written reference."""
    tensors = _tensors(case)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    eq = Equation(case.text)
    got = eq(**tensors, **case.sizes)
    assert not eq._plans
    torch.testing.assert_close(got, case.reference(**tensors), rtol=1e-12, atol=1e-12)


def test_torch_compile_fullgraph_runs_a_grouped_scaled_equation():
    eq = Equation("S[μ τ σ] = X[τ i] Wq[(μ a) i] Wk[(μ a) j] X[σ j] / √a")
    x, wq, wk = torch.randn(τ, i), torch.randn(μ * a, i), torch.randn(μ * a, i)
    compiled = torch.compile(lambda x, wq, wk: eq(X=x, Wq=wq, Wk=wk, μ=μ), fullgraph=True)
    torch.testing.assert_close(compiled(x, wq, wk), eq(X=x, Wq=wq, Wk=wk, μ=μ))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_a_cache_hit_gives_the_identical_result(case):
    eq = Equation(case.text)
    tensors = _tensors(case)
    first = eq(**tensors, **case.sizes)
    assert len(eq._plans) == 1
    second = eq(**tensors, **case.sizes)
    assert len(eq._plans) == 1
    assert torch.equal(first, second)


# -- plans and their cache ---------------------------------------------------------------


def test_second_call_with_the_same_shapes_reuses_the_plan(monkeypatch):
    eq = Equation("P[B n μ τ a] = X[n τ i] W[(μ B a) i]")
    x, w = torch.randn(n, τ, i), torch.randn(μ * B * a, i)
    eq(X=x, W=w, μ=μ, B=B)
    (plan,) = eq._plans.values()

    def must_not_plan(arguments):
        raise AssertionError("planned again on a cache hit")

    monkeypatch.setattr(eq, "_plan", must_not_plan)
    eq(X=torch.randn(n, τ, i), W=torch.randn(μ * B * a, i), μ=μ, B=B)
    assert list(eq._plans.values()) == [plan]


def test_a_new_shape_or_keyword_size_makes_a_new_plan():
    eq = Equation("P[B n μ τ a] = X[n τ i] W[(μ B a) i]")
    w = torch.randn(μ * B * a, i)
    eq(X=torch.randn(n, τ, i), W=w, μ=μ, B=B)
    eq(X=torch.randn(n + 1, τ, i), W=w, μ=μ, B=B)
    assert len(eq._plans) == 2
    # Same shapes, sizes given another way: a different signature, the same answer.
    x = torch.randn(n, τ, i)
    assert torch.equal(eq(X=x, W=w, μ=μ, B=B), eq(X=x, W=w, μ=μ, a=a))
    assert len(eq._plans) == 3
    p = eq(X=x, W=w, μ=a, B=B)  # μ and a swapped: a valid, different decomposition
    assert p.shape == (B, n, a, τ, μ)
    assert len(eq._plans) == 4


def test_the_order_of_keywords_does_not_change_the_answer():
    eq = Equation("P[B n μ τ a] = X[n τ i] W[(μ B a) i]")
    x, w = torch.randn(n, τ, i), torch.randn(μ * B * a, i)
    want = eq(X=x, W=w, μ=μ, B=B)
    assert torch.equal(eq(B=B, W=w, μ=μ, X=x), want)
    # Shapes are keyed by operand name, not by keyword position: swapping which tensor
    # comes first cannot pick up the other call's plan.
    sq = Equation("Y[τ j] = X[τ i] U[i j]")
    u, v = torch.randn(τ, i), torch.randn(i, τ)
    assert sq(X=u, U=v).shape == (τ, τ)
    assert sq(U=u, X=v).shape == (i, i)
    torch.testing.assert_close(sq(U=u, X=v), v @ u, rtol=1e-12, atol=1e-12)

def test_the_plan_cache_is_bounded():
    eq = Equation("s[τ] = X[τ i]")
    for length in range(1, _MAX_PLANS + 5):
        eq(X=torch.ones(length, 2))
    assert 0 < len(eq._plans) <= _MAX_PLANS
    assert torch.equal(eq(X=torch.ones(3, 2)), torch.full((3,), 2.0))


def test_one_plan_has_no_backend_steps_beyond_a_single_einsum():
    eq = Equation("S[n μ τ σ] = Q[n μ τ a] K[n μ σ a]")
    eq(Q=torch.randn(n, μ, τ, a), K=torch.randn(n, μ, σ, a))
    (plan,) = eq._plans.values()
    assert plan.direct and plan.steps == () and plan.reshapes == ()


@pytest.mark.parametrize("L_q, L_k", [(τ, σ), (σ, τ)], ids=["Q smaller", "K smaller"])
def test_a_scaled_pair_runs_in_one_call_with_the_scale_applied_once(L_q, L_k):
    """The scale folds into the smaller operand, whichever side it is on, and the plan's
    call skips the general ``_run`` (the scale is its only extra)."""
    eq = Equation("S[n μ τ σ] = Q[n μ τ a] K[n μ σ a] / √a")
    gen = torch.Generator().manual_seed(7)
    Q = torch.randn(n, μ, L_q, a, dtype=torch.float64, generator=gen)
    K = torch.randn(n, μ, L_k, a, dtype=torch.float64, generator=gen)
    got = eq(Q=Q, K=K)
    torch.testing.assert_close(got, es("nmta,nmsa->nmts", Q, K) / math.sqrt(a),
                               rtol=1e-12, atol=1e-12)
    (plan,) = eq._plans.values()
    assert plan.scale_slot == (0 if L_q < L_k else 1)
    assert plan.call != plan._run


def test_chains_run_opt_einsums_path_once_per_shape(monkeypatch):
    text = "S[τ σ] = X[τ i] Wq[(μ a) i] Wk[(μ a) j] X[σ j]"
    eq = Equation(text)
    calls = []
    real = opt_einsum.contract_path

    def spy(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(opt_einsum, "contract_path", spy)
    x, wq, wk = torch.randn(τ, i), torch.randn(μ * a, i), torch.randn(μ * a, i)
    eq(X=x, Wq=wq, Wk=wk, μ=μ)
    eq(X=x, Wq=wq, Wk=wk, μ=μ)
    assert len(calls) == 1
    (plan,) = eq._plans.values()
    # The steps are opt_einsum's own, for the atomic (groups opened) shapes.
    atomic = [(τ, i), (μ, a, i), (μ, a, i), (τ, i)]
    _, info = real(calls[0], *atomic, shapes=True)
    assert [popped for popped, _ in plan.steps] == [tuple(c[0]) for c in info.contraction_list]
    assert len(plan.steps) == 3
    # And the path pays: far fewer FLOPs than the naive single-sweep contraction.
    assert info.opt_cost < info.naive_cost / 10


# -- gradients ----------------------------------------------------------------------------


def test_gradients_match_torch_einsum():
    eq = Equation("S[μ τ σ] = X[τ i] Wq[(μ a) i] Wk[(μ a) j] X[σ j] / √a")
    gen = torch.Generator().manual_seed(1)
    x0, wq0, wk0 = (torch.randn(s, dtype=torch.float64, generator=gen)
                    for s in [(τ, i), (μ * a, i), (μ * a, i)])
    upstream = torch.randn(μ, τ, τ, dtype=torch.float64, generator=gen)

    x, wq, wk = (t.clone().requires_grad_() for t in (x0, wq0, wk0))
    (eq(X=x, Wq=wq, Wk=wk, μ=μ) * upstream).sum().backward()

    xr, wqr, wkr = (t.clone().requires_grad_() for t in (x0, wq0, wk0))
    want = es("ti,mdi,mdj,sj->mts", xr, wqr.view(μ, a, i), wkr.view(μ, a, i), xr) / math.sqrt(a)
    (want * upstream).sum().backward()

    for got, ref in [(x, xr), (wq, wqr), (wk, wkr)]:
        torch.testing.assert_close(got.grad, ref.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("text, shapes, sizes", [
    ("P[B n μ τ a] = X[n τ i] W[(μ B a) i]", {"X": (2, 3, 5), "W": (2 * 3 * 2, 5)},
     {"μ": 2, "B": 3}),
    ("S[n μ τ σ] = Q[n μ τ a] K[n μ σ a] / √a", {"Q": (2, 3, 4, 5), "K": (2, 3, 6, 5)}, {}),
    ("Y[n τ (μ a)] = Z[n μ τ a] W[μ a]", {"Z": (2, 3, 4, 5), "W": (3, 5)}, {}),
    ("S[τ σ] = X[τ i] Wq[(μ a) i] Wk[(μ a) j] X[σ j]", {"X": (3, 4), "Wq": (6, 4), "Wk": (6, 4)},
     {"μ": 2}),
])
def test_gradcheck(text, shapes, sizes):
    eq = Equation(text)
    names = list(shapes)
    gen = torch.Generator().manual_seed(2)
    inputs = tuple(torch.randn(shapes[k], dtype=torch.float64, generator=gen, requires_grad=True)
                   for k in names)
    def call(*ts):
        return eq(**dict(zip(names, ts, strict=True)), **sizes)

    assert torch.autograd.gradcheck(call, inputs)


# -- LaTeX --------------------------------------------------------------------------------


@pytest.mark.parametrize("text, want", [
    ("S[n μ τ σ] = Q[n μ τ a] K[n μ σ a]",
     r"S_{n \mu \tau \sigma} = Q_{n \mu \tau a} K_{n \mu \sigma a}"),
    ("S[n μ τ σ] = Q[n μ τ a] K[n μ σ a] / √a",
     r"S_{n \mu \tau \sigma} = \frac{Q_{n \mu \tau a} K_{n \mu \sigma a}}{\sqrt{d_{a}}}"),
    ("S[n μ τ σ] = Q[n μ τ a] · K[n μ σ a] / sqrt(μ)",
     r"S_{n \mu \tau \sigma} = \frac{Q_{n \mu \tau a} K_{n \mu \sigma a}}{\sqrt{d_{\mu}}}"),
    ("P[B n μ τ a] = X[n τ i] W[(μ B a) i]",
     r"P_{B n \mu \tau a} = X_{n \tau i} W_{(\mu B a) i}"),
    ("Y[n τ i] = Z[n μ τ a] W_O[μ a i]",
     r"Y_{n \tau i} = Z_{n \mu \tau a} (W_{O})_{\mu a i}"),
    ("Y_μ[n μ τ i] = Z[n μ τ a] * W_O[μ a i]",
     r"(Y_{\mu})_{n \mu \tau i} = Z_{n \mu \tau a} (W_{O})_{\mu a i}"),
    ("Y[n τ (μ a)] = Z[n μ τ a]", r"Y_{n \tau (\mu a)} = Z_{n \mu \tau a}"),
    ("S[head pos] = Q[head pos dim] K[head pos dim]",
     r"S_{\mathrm{head} \mathrm{pos}} = Q_{\mathrm{head} \mathrm{pos} \mathrm{dim}} "
     r"K_{\mathrm{head} \mathrm{pos} \mathrm{dim}}"),
    ("t[] = M[i i]", r"t_{} = M_{i i}"),
    ("N[τ c] = phi_Q[τ a] phi_K[σ a] V[σ c]",  # spelled-out Greek names become commands
     r"N_{\tau c} = (\phi_{Q})_{\tau a} (\phi_{K})_{\sigma a} V_{\sigma c}"),
])
def test_latex(text, want):
    assert Equation(text).latex() == want


# -- explain, introspection -----------------------------------------------------------------


def test_explain_scores_agrees_with_opt_einsum():
    eq = Equation("S[n μ τ σ] = Q[n μ τ a] K[n μ σ a]")
    ex = eq.explain(Q=torch.randn(n, μ, τ, a), K=(n, μ, σ, a))
    assert isinstance(ex, Explanation)
    # ASCII one-letter names keep their letter; μ, τ, σ take the first free ones.
    assert ex.einsum == "nbca,nbda->nbcd"
    assert ex.sizes == {"n": n, "μ": μ, "τ": τ, "σ": σ, "a": a}
    path, info = opt_einsum.contract_path(ex.einsum, (n, μ, τ, a), (n, μ, σ, a), shapes=True)
    assert ex.path == list(path)
    assert ex.flops == info.opt_cost
    assert ex.largest_intermediate == info.largest_intermediate == n * μ * τ * σ
    text = str(ex)
    for part in (eq.text, ex.einsum, str(ex.path), f"{ex.flops:,}",
                 f"largest intermediate: {ex.largest_intermediate:,}", "σ=9"):
        assert part in text


def test_explain_accepts_tensors_shapes_and_keyword_sizes_alike():
    eq = Equation("P[B n μ τ a] = X[n τ i] W[(μ B a) i]")
    from_shapes = eq.explain(X=(n, τ, i), W=[μ * B * a, i], μ=μ, B=B)
    from_tensors = eq.explain(X=torch.randn(n, τ, i), W=torch.randn(μ * B * a, i), μ=μ, B=B)
    from_opened = eq.explain(X=torch.Size([n, τ, i]), W=(μ, B, a, i))
    assert from_shapes.einsum == "nci,bBai->Bnbca"
    for other in (from_tensors, from_opened):
        assert (other.einsum, other.sizes, other.path, other.flops,
                other.largest_intermediate) == (from_shapes.einsum, from_shapes.sizes,
                                                from_shapes.path, from_shapes.flops,
                                                from_shapes.largest_intermediate)
    assert from_shapes.flops == opt_einsum.contract_path(
        from_shapes.einsum, (n, τ, i), (μ, B, a, i), shapes=True)[1].opt_cost


def test_explain_a_chain_reports_opt_einsums_path():
    eq = Equation("S[τ σ] = X[τ i] Wq[(μ a) i] Wk[(μ a) j] X[σ j]")
    ex = eq.explain(X=(τ, i), Wq=(μ * a, i), Wk=(μ * a, i), μ=μ)
    path, info = opt_einsum.contract_path(ex.einsum, (τ, i), (μ, a, i), (μ, a, i), (τ, i),
                                          shapes=True)
    assert (ex.path, ex.flops, ex.largest_intermediate) == (
        list(path), info.opt_cost, info.largest_intermediate)
    assert len(ex.path) == 3


def test_introspection():
    eq = Equation("P[B n μ τ a] = X[n τ i] W[(μ B a) i]")
    assert eq.output == "P"
    assert eq.operands == ("X", "W")
    assert eq.indices == ("B", "n", "μ", "τ", "a", "i")
    assert eq.summed == ("i",)
    assert str(eq) == "P[B n μ τ a] = X[n τ i] W[(μ B a) i]"
    assert repr(eq) == "Equation('P[B n μ τ a] = X[n τ i] W[(μ B a) i]')"
    sizes = eq.sizes(X=(n, τ, i), W=torch.randn(μ * B * a, i), μ=μ, B=B)
    assert sizes == {"B": B, "n": n, "μ": μ, "τ": τ, "a": a, "i": i}
    assert list(sizes) == list(eq.indices)


def test_introspection_of_a_chain_with_one_tensor_twice():
    eq = Equation("S[τ σ] = X[τ i] Wq[(μ a) i] Wk[(μ a) j] X[σ j] / √a")
    assert eq.operands == ("X", "Wq", "Wk")
    assert eq.indices == ("τ", "σ", "i", "μ", "a", "j")
    assert eq.summed == ("i", "μ", "a", "j")
    assert eq.sizes(X=(τ, i), Wq=(μ * a, i), Wk=(μ, a, i), μ=μ) == {
        "τ": τ, "σ": τ, "i": i, "μ": μ, "a": a, "j": i}


def test_terms_lhs_and_scale_expose_the_parse():
    eq = Equation("S[τ σ] = X[τ i] Wq[(μ a) i] Wk[(μ a) j] X[σ j] / √a")
    assert eq.scale == "a"
    assert Equation("S[τ σ] = Q[τ a] K[σ a]").scale is None
    assert [t.name for t in eq.terms] == ["X", "Wq", "Wk", "X"]  # X twice, in order
    assert [t.indices for t in eq.terms] == [("τ", "i"), ("μ", "a", "i"), ("μ", "a", "j"),
                                             ("σ", "j")]
    assert [t.grouped for t in eq.terms] == [False, True, True, False]
    assert eq.terms[1].text() == "Wq[(μ a) i]"
    out = Equation("Y[n τ (μ a)] = Z[n μ τ a]").lhs
    assert (out.name, out.indices, out.grouped, len(out.axes)) == (
        "Y", ("n", "τ", "μ", "a"), True, 3)

def test_exported_from_the_package():
    assert einattn.Equation is Equation


# -- properties ---------------------------------------------------------------------------

_NAMES = ["n", "μ", "τ", "σ", "a", "head", "pos", "i"]


@st.composite
def _two_operand_equations(draw):
    left = draw(st.lists(st.sampled_from(_NAMES), unique=True, max_size=4))
    right = draw(st.lists(st.sampled_from(_NAMES), unique=True, max_size=4))
    union = list(dict.fromkeys(left + right))
    out = draw(st.permutations(union))[: draw(st.integers(0, len(union)))]
    sizes = {k: draw(st.integers(1, 4)) for k in union}
    return left, right, out, sizes


@settings(max_examples=60, deadline=None)
@given(_two_operand_equations())
def test_any_two_operand_equation_matches_einsum(spec):
    left, right, out, sizes = spec
    text = f"O[{' '.join(out)}] = A[{' '.join(left)}] C[{' '.join(right)}]"
    letter = {name: "pqrstuvw"[k] for k, name in enumerate(_NAMES)}  # our own mapping

    def sub(names):
        return "".join(letter[x] for x in names)

    A = torch.randn([sizes[x] for x in left], dtype=torch.float64)
    C = torch.randn([sizes[x] for x in right], dtype=torch.float64)
    want = es(f"{sub(left)},{sub(right)}->{sub(out)}", A, C)
    torch.testing.assert_close(Equation(text)(A=A, C=C), want, rtol=1e-12, atol=1e-12)


def _grouped(draw, names: list[str]) -> list[list[str]]:
    """``names`` cut into runs of adjacent indices, each run one axis: ``[[μ, a], [i]]``."""
    cuts = [k for k in range(1, len(names)) if draw(st.booleans())]
    bounds = [0, *cuts, len(names)]
    return [names[lo:hi] for lo, hi in itertools.pairwise(bounds) if hi > lo]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_operands_passed_with_their_groups_closed_match_einsum(data):
    """Operands arrive with groups of adjacent indices as single axes (as ``W[(μ B a) i]``
    arrives 2-D): whether the lowering uses them as they lie or opens them, the result is
    einsum's on the opened tensors."""
    left, right, out, sizes = data.draw(_two_operand_equations())
    axes_a, axes_c = _grouped(data.draw, left), _grouped(data.draw, right)

    def term(name, axes):
        return f"{name}[{' '.join('(' + ' '.join(g) + ')' if len(g) > 1 else g[0] for g in axes)}]"

    letter = {name: "pqrstuvw"[k] for k, name in enumerate(_NAMES)}
    A = torch.randn([sizes[x] for x in left], dtype=torch.float64)
    C = torch.randn([sizes[x] for x in right], dtype=torch.float64)
    closed = {name: t.reshape([math.prod(sizes[x] for x in g) for g in axes])
              for name, t, axes in (("A", A, axes_a), ("C", C, axes_c))}
    eq = Equation(f"O[{' '.join(out)}] = {term('A', axes_a)} {term('C', axes_c)}")
    want = es(f"{''.join(letter[x] for x in left)},{''.join(letter[x] for x in right)}->"
              f"{''.join(letter[x] for x in out)}", A, C)
    for _ in range(2):  # planned, then from the plan cache
        got = eq(**closed, **{k: v for k, v in sizes.items() if k in left + right})
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4), st.integers(1, 5),
       st.sampled_from(["μ", "B", "a"]))
def test_groups_open_row_major_whichever_sizes_are_given(h, b, d, c, left_out):
    eq = Equation("P[B n μ τ a] = X[n τ i] W[(μ B a) i]")
    x, w = torch.randn(2, 3, c, dtype=torch.float64), torch.randn(h * b * d, c, dtype=torch.float64)
    given_sizes = {k: v for k, v in {"μ": h, "B": b, "a": d}.items() if k != left_out}
    want = es("nti,hbdi->bnhtd", x, w.reshape(h, b, d, c))
    torch.testing.assert_close(eq(X=x, W=w, **given_sizes), want, rtol=1e-12, atol=1e-12)
