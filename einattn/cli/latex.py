"""``einattn latex``: the derivation's equations as the LaTeX docs/derivation.md displays."""

from __future__ import annotations

import argparse

from .. import functional
from .options import Command
from .output import Output, Paint
from .trace import EQUATIONS

SOFTMAX_LATEX = functional.SOFTMAX.latex()  # (3), as the Equation renders itself


def latex_equations() -> list[dict]:
    """Equations (1)–(5), (5a) and grouped-query (1g), (2g), (4g): number, name, equation
    string and LaTeX."""
    found = []
    for name, number in EQUATIONS.items():
        equation = getattr(functional, name)
        found.append({"number": number, "name": name, "equation": str(equation),
                      "latex": equation.latex()})
    return found


def latex_command(args: argparse.Namespace, paint: Paint) -> Output:
    equations = latex_equations()
    lines = [f"$$\n{e['latex']} \\tag{{{e['number']}}}\n$$" for e in equations]
    return Output({"equations": equations}, "\n\n".join(lines).splitlines())


COMMAND = Command(latex_command, "the derivation's equations (1)–(5), (5a) and (1g), (2g), "
                  "(4g) as LaTeX")
