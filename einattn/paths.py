"""``einattn.paths``: the routing of equations (2)–(4) to their impls, as before its move to
:mod:`einattn.impls` (one module per impl, one entry point each)."""

from .impls import masked_nonfinite_dropped, nonfinite, routed, run

__all__ = ["masked_nonfinite_dropped", "nonfinite", "routed", "run"]
