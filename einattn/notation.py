"""``Equation``: an index equation that parses, checks, renders as LaTeX and runs.

    >>> import torch
    >>> scores = Equation("S[n μ τ σ] = Q[n μ τ a] K[n μ σ a]")
    >>> Q, K = torch.ones(2, 4, 5, 3), torch.ones(2, 4, 7, 3)
    >>> scores(Q=Q, K=K).shape
    torch.Size([2, 4, 5, 7])
    >>> scores.latex()
    'S_{n \\\\mu \\\\tau \\\\sigma} = Q_{n \\\\mu \\\\tau a} K_{n \\\\mu \\\\sigma a}'

Summation is Einstein's: an index absent from the left is summed. opt_einsum plans the
order of a contraction of three or more operands, torch runs each step, and the plan is
cached per shape signature so a call in a training loop costs about one ``torch.einsum``.
A right side that is more than one product (``softmax_σ(S[…] + M[…])``) makes an
:class:`Expression`. The engines live apart (:mod:`einattn._contraction`,
:mod:`einattn._expression_run`); this module only puts the public classes together.
"""

from __future__ import annotations

from collections.abc import Iterable

from ._contraction import _MAX_PLANS as _MAX_PLANS  # the plan cache's size, for the tests
from ._contraction import Contraction, Explanation, opened, signature
from ._expression_run import ExpressionRun
from ._grad import derived
from ._latex_expression import names_a_function, read_expression, written_as_expression
from ._syntax import is_expression
from .errors import EinattnError
from .latex import read

__all__ = ["Equation", "Explanation", "Expression", "opened", "signature"]


class Equation(Contraction):
    """An index equation ``Out[...] = A[...] B[...] ... [/ √index]``.

    Call it with the operands as keyword tensors, and with keyword integers for sizes of
    grouped indices that cannot be inferred: ``eq(X=x, W=w, μ=4, B=3)``. A right side that
    is more than one product (``softmax_σ(S[…] + M[…])``, ``c · tanh(S[…] / c)``) makes an
    :class:`Expression`, this class with the expression language.
    """

    def __new__(cls, text: str = "") -> Equation:
        if cls is Equation and isinstance(text, str) and is_expression(text):
            cls = Expression
        return super().__new__(cls)

    @classmethod
    def from_latex(cls, tex: str, size_names: dict[str, str] | None = None,
                   labels: Iterable[str] = ()) -> Equation:
        """An equation from LaTeX index notation, read as :mod:`einattn.latex` says;
        ``size_names`` ties a size to an index: ``{"d_k": "a"}`` for ``\\sqrt{d_k}``;
        ``labels`` names superscripts that label a tensor: ``{"l"}`` reads ``h^{l}`` as ``h_l``.
        An equation that is more than one product (``\\operatorname{softmax}_{\\sigma}``,
        ``\\exp``, ``+``, ``\\frac{…}{…}``) is read by :mod:`einattn._latex_expression`."""
        try:
            if not names_a_function(tex):  # else the product reader reads a tensor's name
                return Equation(read(tex, size_names, labels))
        except EinattnError:
            if not written_as_expression(tex):  # a product with a mistake: its own message
                raise
        return Equation(read_expression(tex, size_names, labels, build=Equation))

    def grad(self, wrt: str) -> Equation:
        """The gradient of this equation with respect to its tensor ``wrt``, as an equation
        ``d<wrt>[…] = …`` of the forward's tensors, its output ``<Out>`` and the cotangent
        ``d<Out>`` (reverse mode, rule by rule: :mod:`einattn._grad`).

        >>> Equation("S[τ σ] = Q[τ a] K[σ a]").grad("Q")
        Equation('dQ[τ a] = dS[τ σ] K[σ a]')
        """
        return Equation(derived(self, wrt))


class Expression(ExpressionRun, Equation):
    """An :class:`Equation` whose right side is more than one product (``Equation`` makes
    one of these for such a text): named-axis functions, elementwise functions, sums,
    differences, quotients and named scalars, as :mod:`einattn._expression` reads them,
    run as :mod:`einattn._expression_run` says. Called like any equation, with each named
    scalar as a number or a 0-d tensor: ``eq(S=S, c=2.0)``."""
