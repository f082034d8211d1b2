"""``Chain``: equations run in order, each reading the inputs and the outputs of those
before it, as a derivation defines its intermediate tensors line by line; the chain's value
is its last equation's output. A side of :func:`einattn.verify.check_equivalent` may be a
chain, so that a step such as the online softmax, which defines ``m``, ``P``, ``c``, ``l`` and
``O`` before ``Z``, is checked whole, in float64 or in the finite field.

    >>> import torch
    >>> weights = Chain("m[τ] = max_σ(S[τ σ])",
    ...                 "P[τ σ] = exp(S[τ σ] − m[τ])",
    ...                 "A[τ σ] = P[τ σ] / sum_σ(P[τ σ])")
    >>> weights.operands, weights.output
    (('S',), 'A')
    >>> S = torch.randn(3, 4, dtype=torch.float64)
    >>> torch.allclose(weights(S=S), S.softmax(-1))
    True
"""

from __future__ import annotations

from typing import Any

import torch

from ._field_eval import evaluate
from .errors import EinattnError
from .notation import Equation


class Chain:
    """Equations run in order (each an :class:`~einattn.Equation` or its text); the inputs
    are the tensors and scalars that no earlier equation defines."""

    def __init__(self, *equations: Equation | str):
        if not equations:
            raise EinattnError("a Chain holds one equation at least")
        self.equations = tuple(e if isinstance(e, Equation) else Equation(e) for e in equations)
        defined: set[str] = set()
        terms, scalars = {}, {}
        for equation in self.equations:
            for term in equation.terms:
                if term.name not in defined:
                    terms.setdefault(term.name, term)
            for name in getattr(equation, "scalars", ()):
                scalars.setdefault(name, None)
            if equation.output in defined or equation.output in terms:
                raise EinattnError(f"{equation.output} is defined twice, or read before it is "
                                   f"defined, in the chain {self._joined()}")
            defined.add(equation.output)
        self.terms = tuple(terms.values())
        self.operands = tuple(terms)
        self.scalars = tuple(scalars)
        self.text = self._joined()

    def _joined(self) -> str:
        return "; ".join(e.text for e in self.equations)

    @property
    def output(self) -> str:
        return self.equations[-1].output

    @property
    def lhs(self):
        return self.equations[-1].lhs

    @property
    def indices(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(i for e in self.equations for i in e.indices))

    @property
    def is_contraction(self) -> bool:
        """Whether every equation is one product (the chain is multilinear in its inputs)."""
        return all(e.is_contraction for e in self.equations)

    @property
    def scale(self) -> str | None:
        """The first index whose size's root an equation divides by, if any."""
        return next((e.scale for e in self.equations if e.scale is not None), None)

    @property
    def degree(self) -> int:
        """The chain's degree as a polynomial of its inputs, for a chain of products: each
        equation's output has the summed degree of its operands."""
        degrees: dict[str, int] = {}
        for e in self.equations:
            degrees[e.output] = sum(degrees.get(t.name, 1) for t in e.terms)
        return degrees[self.output]

    def __repr__(self) -> str:
        return f"Chain({', '.join(repr(e.text) for e in self.equations)})"

    def __str__(self) -> str:
        return self.text

    def latex(self) -> str:
        """The equations in LaTeX, one line each (an ``aligned`` body)."""
        return " \\\\\n".join(e.latex() for e in self.equations)

    def __call__(self, **arguments: Any) -> torch.Tensor:
        """The last output from the inputs (tensors, scalars and index sizes by keyword)."""
        sizes = {k: v for k, v in arguments.items() if k in self.indices and k not in
                 self.scalars}
        values = {k: v for k, v in arguments.items() if k not in sizes}
        for e in self.equations:
            names = (*e.operands, *getattr(e, "scalars", ()))
            missing = [n for n in names if n not in values]
            if missing:
                raise EinattnError(f"missing tensor {', '.join(missing)}: the chain "
                                   f"{self.text} takes {', '.join(self.operands)}")
            values[e.output] = e(**{n: values[n] for n in names},
                                 **{k: v for k, v in sizes.items() if k in e.indices})
        return values[self.output]

    def field_value(self, env: dict, sizes: dict[str, int]):
        """The last output over the field tensors ``env`` (:mod:`einattn._field_eval`)."""
        env = dict(env)
        for e in self.equations:
            env[e.output] = evaluate(e, env, sizes)
        return env[self.output]
