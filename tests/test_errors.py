"""Every ``raise`` of the Equation engine, with the message a user would read.

Each raise site in einattn/notation.py, _contraction.py, _sizes.py, _delta.py, _syntax.py
and _lowering.py has a case in ``SITES`` (the expression language's are in
tests/test_expression.py),
keyed by its message template (``{}`` for each interpolated value);
``test_every_raise_site_has_a_case`` reads the source and fails when a new raise site has
no case here. A case checks the
message names the index, the tensor and the sizes, and where the equation is shown, that
the caret stands under the right characters.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import here

import einattn
from einattn import EinattnError, Equation
from einattn import errors as errors_module
from einattn.errors import at

SCORES = "S[n μ τ σ] = Q[n μ τ a] K[n μ σ a]"
PROJECT = "P[n τ μ B a] = X[n τ i] W[(μ B a) i]"
CHAIN = "S[τ σ] = X[τ i] Wq[(μ a) i] Wk[(μ a) j] X[σ j]"
MANY = "O[] = T[" + " ".join(f"k{m}" for m in range(53)) + "]"  # 53 indices, 52 letters


def col(text: str, fragment: str, nth: int = 0) -> int:
    """Where the ``nth`` occurrence of ``fragment`` starts in ``text``."""
    starts = [m.start() for m in re.finditer(re.escape(fragment), text)]
    return starts[nth]


def carets(message: str) -> list[int]:
    """The columns of the carets under the equation line, relative to the equation."""
    lines = message.splitlines()
    if len(lines) < 3 or "^" not in lines[2] or set(lines[2]) - {" ", "^"}:
        return []
    return [k - 2 for k, c in enumerate(lines[2]) if c == "^"]


def q(*shape, **kw):
    return torch.zeros(shape, dtype=kw.pop("dtype", torch.float64), **kw)


@dataclass(frozen=True)
class Site:
    key: str  # the raise site's message as written, "{}" for each interpolated value
    id: str
    call: Callable[[], object]
    match: str
    equation: str | None = None  # shown under the message, when the error shows one
    carets: tuple[int, ...] = ()


def _calls(eq_text: str, **arguments):
    return lambda: Equation(eq_text)(**arguments)


SITES = [
    # -- notation.py: arguments ----------------------------------------------------------
    Site("missing tensor {}: this equation takes {}", "missing_tensor",
         _calls(SCORES, Q=q(2, 4, 5, 3)),
         r"^missing tensor K: this equation takes Q, K\n",
         SCORES, (col(SCORES, "K[n"),)),
    Site("missing tensor {}: this equation takes {}", "missing_two_tensors_of_three",
         _calls(CHAIN, Wq=q(12, 6)),
         r"^missing tensor X, Wk: this equation takes X, Wq, Wk\n",
         CHAIN, (col(CHAIN, "X[τ"), col(CHAIN, "Wk["), col(CHAIN, "X[σ"))),
    Site("size of index {} must be a non-negative int, got {}", "negative_size",
         _calls(PROJECT, X=q(2, 5, 16), W=q(48, 16), μ=-4, B=3),
         r"^size of index 'μ' must be a non-negative int, got -4$"),
    Site("size of index {} must be a non-negative int, got {}", "bool_size",
         _calls(PROJECT, X=q(2, 5, 16), W=q(48, 16), μ=4, B=True),
         r"^size of index 'B' must be a non-negative int, got True$"),
    Site("size of index {} must be a non-negative int, got {}", "float_size",
         _calls(PROJECT, X=q(2, 5, 16), W=q(48, 16), μ=4.0, B=3),
         r"^size of index 'μ' must be a non-negative int, got 4\.0$"),
    Site("size of index {} must be a non-negative int, got {}", "unhashable_size",
         _calls(PROJECT, X=q(2, 5, 16), W=q(48, 16), μ=[4], B=3),
         r"^size of index 'μ' must be a non-negative int, got \[4\]$"),
    Site("size of index {} must be a non-negative int, got {}", "size_in_sizes",
         lambda: Equation(PROJECT).sizes(X=(2, 5, 16), W=(48, 16), μ="4", B=3),
         r"^size of index 'μ' must be a non-negative int, got '4'$"),
    Site("{} is neither a tensor nor an index of this equation (tensors: {})", "unknown_keyword",
         _calls(SCORES, Q=q(2, 4, 5, 3), K=q(2, 4, 7, 3), V=q(2, 4, 7, 3)),
         r"^'V' is neither a tensor nor an index of this equation \(tensors: Q, K\)\n",
         SCORES),
    Site("{} is neither a tensor nor an index of this equation (tensors: {})", "unknown_size_name",
         lambda: Equation(PROJECT).explain(X=(2, 5, 16), W=(48, 16), mu=4, B=3),
         r"^'mu' is neither a tensor nor an index of this equation \(tensors: X, W\)\n",
         PROJECT),
    Site('an Equation is written as a string such as "S[n μ τ σ] = Q[n μ τ a] K[n μ σ a] / √a", '
         "got {}", "non_string_equation", lambda: Equation(None),
         r"^an Equation is written as a string such as .*, got NoneType$"),
    Site("{} must be {}, got {}", "non_tensor_operand",
         _calls(SCORES, Q=[[1.0]], K=q(2, 4, 7, 3)),
         r"^Q must be a torch\.Tensor, got list$"),
    Site("{} must be {}, got {}", "shape_tuple_in_a_call",
         _calls(SCORES, Q=q(2, 4, 5, 3), K=(2, 4, 7, 3)),
         r"^K must be a torch\.Tensor, got tuple$"),
    Site("{} must be {}, got {}", "non_shape_in_explain",
         lambda: Equation(SCORES).explain(Q=(2, 4, 5, 3), K="2 4 7 3"),
         r"^K must be a torch\.Tensor or a shape, got str$"),
    Site("shape of {} must be non-negative ints, got {}", "negative_shape_entry",
         lambda: Equation(SCORES).sizes(Q=(2, 4, -5, 3), K=(2, 4, 7, 3)),
         r"^shape of Q must be non-negative ints, got \(2, 4, -5, 3\)$"),
    Site("shape of {} must be non-negative ints, got {}", "float_shape_entry",
         lambda: Equation(SCORES).explain(Q=(2, 4, 5, 3), K=[2, 4, 7.5, 3]),
         r"^shape of K must be non-negative ints, got \(2, 4, 7\.5, 3\)$"),
    Site("{} is {} but {} is {}", "dtype_mismatch",
         _calls(SCORES, Q=q(2, 4, 5, 3), K=q(2, 4, 7, 3, dtype=torch.float32)),
         r"^K is torch\.float32 but Q is torch\.float64\n", SCORES),
    Site("{} is {} on {}, which this equation does not run on: it takes floating-point or "
         "complex tensors{}; convert with .to()", "integers_with_a_scale",
         _calls(SCORES + " / √a", Q=q(2, 4, 5, 3, dtype=torch.long),
                K=q(2, 4, 7, 3, dtype=torch.long)),
         r"^Q is torch\.int64 on cpu, which this equation does not run on: it takes "
         r"floating-point or complex tensors \(its scale / √a is not an integer\); convert "
         r"with \.to\(\)\n", SCORES + " / √a"),
    Site("{} is {} on {}, which this equation does not run on: it takes floating-point or "
         "complex tensors{}; convert with .to()", "bools",
         _calls(SCORES, Q=q(2, 4, 5, 3, dtype=torch.bool), K=q(2, 4, 7, 3, dtype=torch.bool)),
         r"^Q is torch\.bool on cpu, .* tensors, or integers where torch multiplies them; "
         r"convert with \.to\(\)\n", SCORES),
    Site("{} is on {} but {} is on {}", "device_mismatch",
         _calls(SCORES, Q=q(2, 4, 5, 3), K=q(2, 4, 7, 3, device="meta")),
         rf"^K is on meta but Q is on {here()}\n", SCORES),
    # -- notation.py: shapes and sizes, checked by index name ---------------------------
    Site("{} has {} axes {} but {} has {}{}", "too_few_axes",
         _calls(SCORES, Q=q(2, 4, 5), K=q(2, 4, 7, 3)),
         r"^Q has 3 axes \(2, 4, 5\) but Q\[n μ τ a\] has 4\n",
         SCORES, (col(SCORES, "Q["),)),
    Site("{} has {} axes {} but {} has {}{}", "wrong_axes_of_a_grouped_operand",
         _calls(PROJECT, X=q(2, 5, 16), W=q(4, 12, 16), μ=4),
         r"^W has 3 axes \(4, 12, 16\) but W\[\(μ B a\) i\] has 2 "
         r"\(or 4 with its groups opened\)\n",
         PROJECT, (col(PROJECT, "W["),)),
    Site("index {} has size {} in {} but {}", "size_mismatch_between_tensors",
         _calls(SCORES, Q=q(2, 4, 5, 4), K=q(2, 4, 7, 8)),
         r"^index 'a' has size 8 in K but 4 in Q\n",
         SCORES, (col(SCORES, "a]"), col(SCORES, "a]", 1))),
    Site("index {} has size {} in {} but {}", "size_mismatch_with_one_tensor_twice",
         _calls("G[τ σ] = X[τ i] X[σ i] Y[i]", X=q(5, 3), Y=q(4)),
         r"^index 'i' has size 4 in Y but 3 in X\n",
         "G[τ σ] = X[τ i] X[σ i] Y[i]", (13, 25)),
    Site("index {} has size {} in {} but {}", "size_mismatch_with_a_keyword",
         _calls(SCORES, Q=q(2, 4, 5, 3), K=q(2, 4, 7, 3), μ=6),
         r"^index 'μ' has size 4 in Q but μ=6 was given\n",
         SCORES, (col(SCORES, "μ", 1),)),
    Site("{} has length {} but {} gives {}", "group_product_mismatch",
         _calls(PROJECT, X=q(2, 5, 16), W=q(48, 16), μ=4, B=3, a=5),
         r"^group \(μ B a\) of W has length 48 but μ=4·B=3·a=5 gives 60\n",
         PROJECT, tuple(col(PROJECT, x, 1) for x in "μBa")),
    Site("{} has length {}, not divisible by {}", "group_not_divisible",
         _calls(PROJECT, X=q(2, 5, 16), W=q(48, 16), μ=5, B=3),
         r"^group \(μ B a\) of W has length 48, not divisible by μ=5·B=3 = 15\n",
         PROJECT, tuple(col(PROJECT, x, 1) for x in "μBa")),
    Site("{} has length {}, not divisible by {}", "group_with_a_zero_size",
         _calls(PROJECT, X=q(2, 5, 16), W=q(48, 16), μ=0, B=3),
         r"^group \(μ B a\) of W has length 48, not divisible by μ=0·B=3 = 0\n",
         PROJECT, tuple(col(PROJECT, x, 1) for x in "μBa")),
    Site("{} has length 0, and with {} any size of {} fits: give it as a keyword, {}=...",
         "group_of_length_zero_with_a_zero_size",
         _calls(PROJECT, X=q(2, 5, 16), W=q(0, 16), μ=0, B=3),
         r"^group \(μ B a\) of W has length 0, and with μ=0·B=3 = 0 any size of a fits: give "
         r"it as a keyword, a=\.\.\.\n", PROJECT, tuple(col(PROJECT, x, 1) for x in "μBa")),
    Site("cannot infer the sizes of {} in group ({}) of {} (length {}): give all but one "
         "as keywords, e.g. {}=...", "cannot_infer_group_sizes",
         _calls(PROJECT, X=q(2, 5, 16), W=q(48, 16), μ=4),
         r"^cannot infer the sizes of B, a in group \(μ B a\) of W \(length 48\): "
         r"give all but one as keywords, e\.g\. B=\.\.\.\n",
         PROJECT, tuple(col(PROJECT, x, 1) for x in "μBa")),
    Site("scale index {} has size 0: cannot divide by √0", "scale_index_of_size_0",
         _calls(SCORES + " / √a", Q=q(2, 4, 5, 0), K=q(2, 4, 7, 0)),
         r"^scale index 'a' has size 0: cannot divide by √0\n",
         SCORES + " / √a", (len(SCORES) + 4,)),
    Site("too many indices: einsum has {} letters", "too_many_indices",
         lambda: Equation(MANY),
         r"^too many indices: einsum has 52 letters\n", MANY),
    # -- _syntax.py ---------------------------------------------------------------------
    Site("unexpected character {}", "unexpected_character",
         lambda: Equation("S[τ σ] = Q[τ a] & K[σ a]"),
         r"^unexpected character '&'\n", "S[τ σ] = Q[τ a] & K[σ a]", (16,)),
    Site("unexpected character {}", "digit_as_index",
         lambda: Equation("S[τ 2] = Q[τ a]"),
         r"^unexpected character '2'\n", "S[τ 2] = Q[τ a]", (4,)),
    Site("expected {} but found {}", "missing_closing_bracket",
         lambda: Equation("S[τ σ = Q[τ a] K[σ a]"),
         r"^expected name or \( or \] but found '='\n", "S[τ σ = Q[τ a] K[σ a]", (6,)),
    Site("expected {} but found {}", "missing_bracket_at_the_end",
         lambda: Equation("S[τ σ] = Q[τ a] K[σ a"),
         r"^expected name or \( or \] but found the end\n", "S[τ σ] = Q[τ a] K[σ a", (21,)),
    Site("expected {} but found {}", "missing_opening_bracket",
         lambda: Equation("S[τ σ] = Q τ a] K[σ a]"),
         r"^expected \[ but found 'τ'\n", "S[τ σ] = Q τ a] K[σ a]", (11,)),
    Site("expected {} but found {}", "unclosed_group",
         lambda: Equation("P[n] = W[(μ B a i]"),
         r"^expected name but found '\]'\n", "P[n] = W[(μ B a i]", (17,)),
    Site("expected {} but found {}", "missing_equals",
         lambda: Equation("S[τ σ] Q[τ a] K[σ a]"),
         r"^expected = but found 'Q'\n", "S[τ σ] Q[τ a] K[σ a]", (7,)),
    Site("expected {} but found {}", "no_operands",
         lambda: Equation("S[τ σ] ="),
         r"^expected name but found the end\n", "S[τ σ] =", (8,)),
    Site("expected {} but found {}", "scale_without_root",
         lambda: Equation("S[τ σ] = Q[τ a] K[σ a] / a"),
         r"^expected √ or sqrt but found 'a'\n", "S[τ σ] = Q[τ a] K[σ a] / a", (25,)),
    Site("expected {} but found {}", "trailing_text",
         lambda: Equation("S[τ σ] = Q[τ a] K[σ a] / √a ]"),
         r"^expected end but found '\]'\n", "S[τ σ] = Q[τ a] K[σ a] / √a ]", (28,)),
    Site("empty group in {}", "empty_group",
         lambda: Equation("P[n] = W[() n]"),
         r"^empty group in W\n", "P[n] = W[() n]", (7,)),
    Site("index {} appears twice on the left of {}", "repeated_output_index",
         lambda: Equation("S[τ τ] = Q[τ a] K[τ a]"),
         r"^index 'τ' appears twice on the left of 'S\[τ τ\] = Q\[τ a\] K\[τ a\]'\n",
         "S[τ τ] = Q[τ a] K[τ a]", (2, 4)),
    Site("output index {} appears on no operand", "output_index_on_no_operand",
         lambda: Equation("S[τ σ] = Q[τ a] K[ρ a]"),
         r"^output index 'σ' appears on no operand\n", "S[τ σ] = Q[τ a] K[ρ a]", (4,)),
    Site("scale index {} appears on no operand", "scale_index_on_no_operand",
         lambda: Equation("S[τ σ] = Q[τ a] K[σ a] / √d"),
         r"^scale index 'd' appears on no operand\n", "S[τ σ] = Q[τ a] K[σ a] / √d", (26,)),
    Site("a group of {} repeats an index", "group_repeats_an_index",
         lambda: Equation("P[n] = W[(μ μ) n]"),
         r"^a group of W repeats an index\n", "P[n] = W[(μ μ) n]", (10, 12)),
    Site("{} is both the output and an operand", "output_is_an_operand",
         lambda: Equation("S[τ] = S[τ a] K[a]"),
         r"^S is both the output and an operand\n", "S[τ] = S[τ a] K[a]", (0,)),
    # -- _delta.py and _sizes.py: the Kronecker delta, made from the sizes -------------------
    Site("δ takes single indices, no group", "grouped_delta",
         lambda: Equation("Y[(τ σ)] = X[τ σ] δ[(τ σ)]"),
         r"^δ takes single indices, no group\n", "Y[(τ σ)] = X[τ σ] δ[(τ σ)]", (18,)),
    Site("{}: an equation with deltas is planned per call", "planned_with_a_delta",
         lambda: Equation("dX[τ σ] = dY[τ] δ[σ]").planned(dY=q(3), σ=4),
         r"^dX\[τ σ\] = dY\[τ\] δ\[σ\]: an equation with deltas is planned per call$"),
    Site("index {} is on δ alone: give its size as a keyword, {}=...", "delta_alone",
         _calls("dX[τ σ] = dY[τ] δ[σ]", dY=q(3)),
         r"^index 'σ' is on δ alone: give its size as a keyword, σ=\.\.\.\n",
         "dX[τ σ] = dY[τ] δ[σ]", (18,)),
]


@pytest.mark.parametrize("site", SITES, ids=lambda s: s.id)
def test_raise_site(site):
    with pytest.raises(EinattnError, match=site.match) as caught:
        site.call()
    message = str(caught.value)
    lines = message.splitlines()
    if site.equation is None:
        assert len(lines) in (1, 3)  # the message, or the message, equation and caret
    else:
        assert lines[1] == "  " + site.equation
        assert carets(message) == list(site.carets)
    # Raised on its own, not "during handling of" a KeyError or the backend's error.
    assert caught.value.__context__ is None or caught.value.__suppress_context__


def _raise_sites(path: Path) -> set[str]:
    """The message template of each ``raise at(...)``/``raise EinattnError(...)``."""
    keys = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            message = node.exc.args[0]
            parts = message.values if isinstance(message, ast.JoinedStr) else [message]
            keys.add("".join(p.value if isinstance(p, ast.Constant) else "{}" for p in parts))
    return keys


def test_every_raise_site_has_a_case():
    package = Path(einattn.__file__).parent
    sites = set().union(*(_raise_sites(package / name)
                          for name in ("notation.py", "_contraction.py", "_sizes.py",
                                       "_delta.py", "_syntax.py", "_lowering.py")))
    assert len(sites) >= 20
    assert sites == {s.key for s in SITES}


# -- the exception family -----------------------------------------------------------------


def test_einattn_error_is_a_value_error_exported_by_the_package():
    assert issubclass(EinattnError, ValueError)
    assert einattn.EinattnError is errors_module.EinattnError is EinattnError
    with pytest.raises(ValueError):
        Equation("S[τ τ] = Q[τ a]")


def test_at_puts_carets_under_every_position_and_none_without_positions():
    assert str(at("index 'a' differs", "S[τ σ] = Q[τ a] K[σ a]", 13, 20)) == (
        "index 'a' differs\n  S[τ σ] = Q[τ a] K[σ a]\n               ^      ^")
    assert str(at("too many", "O[] = T[x]")) == "too many\n  O[] = T[x]"
    assert isinstance(at("m", "t", 0), EinattnError)


# -- errors after a successful, cached call -----------------------------------------------


def test_wrong_shapes_after_a_cached_call_still_raise_einattn_error():
    eq = Equation(SCORES)
    eq(Q=q(2, 4, 5, 3), K=q(2, 4, 7, 3))
    with pytest.raises(EinattnError, match=r"index 'a' has size 8 in K but 3 in Q"):
        eq(Q=q(2, 4, 5, 3), K=q(2, 4, 7, 8))
    with pytest.raises(EinattnError, match=r"K has 3 axes \(2, 4, 7\) but K\[n μ σ a\] has 4"):
        eq(Q=q(2, 4, 5, 3), K=q(2, 4, 7))
    with pytest.raises(EinattnError, match=r"missing tensor K"):
        eq(Q=q(2, 4, 5, 3))
    with pytest.raises(EinattnError, match=r"Q must be a torch\.Tensor, got ndarray"):
        eq(Q=q(2, 4, 5, 3).cpu().numpy(), K=q(2, 4, 7, 3))  # same shape as the cached plan
    with pytest.raises(EinattnError, match=r"Q must be a torch\.Tensor, got Size"):
        eq(Q=torch.Size([2, 4, 5, 3]), K=q(2, 4, 7, 3))  # equal to the cached plan's key
    assert len(eq._plans) == 1


@pytest.mark.parametrize("text, arguments", [
    (SCORES, {"Q": (2, 4, 5, 3), "K": (2, 4, 7, 3)}),  # one einsum on the tensors as given
    (PROJECT + "", {"X": (2, 5, 16), "W": (48, 16), "μ": 4, "B": 3}),  # reshapes first
    (CHAIN + " / √a", {"X": (5, 16), "Wq": (12, 16), "Wk": (12, 16), "μ": 4}),  # steps
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.complex128])
def test_mismatched_dtypes_after_a_cached_call_raise_einattn_error(text, arguments, dtype):
    eq = Equation(text)
    tensors = {k: q(*v) if isinstance(v, tuple) else v for k, v in arguments.items()}
    eq(**tensors)
    first, *rest = eq.operands
    tensors[rest[-1]] = tensors[rest[-1]].to(dtype)
    with pytest.raises(EinattnError, match=rf"^{rest[-1]} is {dtype} but {first} is "
                                           r"torch\.float64\n") as caught:
        eq(**tensors)
    assert caught.value.__context__ is None or caught.value.__suppress_context__


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second real device")
def test_mismatched_devices_after_a_cached_call_raise_einattn_error():
    eq = Equation(SCORES)
    eq(Q=q(2, 4, 5, 3, device="cpu"), K=q(2, 4, 7, 3, device="cpu"))
    with pytest.raises(EinattnError, match=r"^K is on cuda:0 but Q is on cpu\n"):
        eq(Q=q(2, 4, 5, 3, device="cpu"), K=q(2, 4, 7, 3, device="cuda"))

