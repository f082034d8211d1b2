"""``einattn verify --derive``: the gradient of each of equations (1)–(5) with respect to each
of its tensors, as :meth:`einattn.Equation.grad` derives it in index notation, each checked
against autograd exactly (in the finite field: :func:`einattn.verify.check_gradient` with
``gradient="auto"``)."""

from __future__ import annotations

from .. import functional
from ..verify import check_gradient
from .output import VERDICTS, Output, Paint, sizes_text, table

EQUATIONS = (("(1)", functional.PROJECT), ("(2)", functional.SCORES),
             ("(3)", functional.SOFTMAX), ("(4)", functional.VALUES), ("(5)", functional.HEADS))


def derived(sizes: dict[str, int]) -> list[dict]:
    """Each equation's gradient for each of its tensors, and its check."""
    found = []
    for label, equation in EQUATIONS:
        for wrt in equation.operands:
            gradient = equation.grad(wrt)
            r = check_gradient(equation, "auto", wrt=wrt, sizes=sizes, exact=True)
            found.append({"equation": label, "forward": equation.text, "wrt": wrt,
                          "gradient": gradient.text, "latex": gradient.latex(),
                          "mode": r.mode, "equal": r.equal,
                          "false_acceptance": r.false_acceptance,
                          "verdict": "PASS" if r.equal else "FAIL"})
    return found


def derive_output(sizes: dict[str, int], *, paint: Paint) -> Output:
    found = derived(sizes)
    rows = [[g["verdict"], g["mode"], f"≤ {g['false_acceptance']:.1e}", g["equation"],
             g["gradient"]] for g in found]
    count = {v: sum(g["verdict"] == v for g in found) for v in VERDICTS}
    summary = f"{len(found)} gradients: " + ", ".join(
        paint(f"{k} {verdict}", verdict) for verdict, k in count.items() if k)
    head = (f"gradients of equations (1)-(5) at {sizes_text(sizes)}, derived by "
            f"Equation.grad, each checked against autograd exactly (finite field)")
    header = ["verdict", "mode", "false acceptance", "eq.", "gradient"]
    failed = any(g["verdict"] == "FAIL" for g in found)
    document = {"sizes": sizes, "gradients": found, "passed": not failed}
    return Output(document, [head, "", *table(header, rows, paint), summary],
                  1 if failed else 0)
