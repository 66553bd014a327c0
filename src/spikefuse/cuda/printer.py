"""Print sympy expressions as CUDA single-precision C."""

from __future__ import annotations

import sympy as sp
from sympy.codegen.ast import float32, real
from sympy.printing.c import C99CodePrinter


class CudaFloatPrinter(C99CodePrinter):
    """C99 printer with float literals and functions (expf, fabsf, ...) and no slow powf for
    small integer powers, so generated arithmetic stays in fp32 registers."""

    def __init__(self, symbol_names: dict[sp.Symbol, str]) -> None:
        super().__init__({"type_aliases": {real: float32}})
        self._names = symbol_names

    def _print_Symbol(self, expr: sp.Symbol) -> str:
        return self._names.get(expr, expr.name)

    def _print_Pi(self, expr) -> str:
        return "3.14159265358979f"

    def _print_Exp1(self, expr) -> str:
        return "2.71828182845905f"

    def _print_Pow(self, expr: sp.Pow) -> str:
        base, exp = expr.as_base_exp()
        if exp.is_Integer and 0 < abs(int(exp)) <= 4:
            product = "*".join([f"({self._print(base)})"] * abs(int(exp)))
            return f"({product})" if exp > 0 else f"(1.0f/({product}))"
        return super()._print_Pow(expr)

    def _print_Integer(self, expr) -> str:
        return f"{int(expr)}.0f"


def cuda_expr(expr: sp.Expr, symbol_names: dict[sp.Symbol, str] | None = None) -> str:
    """A CUDA float expression for ``expr``; ``symbol_names`` renames symbols."""
    return CudaFloatPrinter(symbol_names or {}).doprint(sp.sympify(expr))
