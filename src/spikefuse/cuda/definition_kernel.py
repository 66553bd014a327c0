"""Kernels of a :class:`~spikefuse.program.NeuronProgram`: every device function the template
calls is printed from the program's sympy equations and partial derivatives."""

from __future__ import annotations

import itertools

import sympy as sp
import torch

from ..program import NeuronProgram
from .codegen import NeuronKernel
from .printer import CudaFloatPrinter, cuda_body


class DefinitionKernel(NeuronKernel):
    """Kernels whose device functions are printed from a program's sympy equations and partials.

    The forward's equations (charge, adaptation, jump) print exactly, in the operation order
    PyTorch evaluates, so that H matches it bit for bit; the derivatives (backward only) print
    with fast division and exp and with repeated subexpressions computed once (``sympy.cse``).
    """

    def __init__(
        self,
        program: NeuronProgram,
        dtype: torch.dtype,
        vec: int = 1,
        affine: bool = False,
        pool: int = 1,
        residual: bool = False,
        chunk: int | None = None,
        wide_index: bool = False,
    ) -> None:
        d = program.definition
        super().__init__(
            name=d.name,
            params=d.params,
            learnable=program.learnable,
            surrogate=program.surrogate,
            hard_reset=program.hard_reset,
            detach_reset=program.detach_reset,
            dtype=dtype,
            vec=vec,
            adaptive=d.adaptive,
            affine=affine,
            pool=pool,
            residual=residual,
            chunk=chunk,
            wide_index=wide_index,
        )
        self.definition = d
        self._param_names: dict[sp.Expr, str] = {d.symbols[n]: f"p.{n}" for n in d.all_params}
        # A call of a function on parameters only (PLIF's sigmoid(decay_logit)) is read from
        # Params: computed once per thread, not at every step (the same value either way).
        self._calls = self._parameter_calls()
        self._names = {**self._param_names, **{c: f"p.{n}" for c, n in self._calls.items()}}

    def _parameter_calls(self) -> dict[sp.Expr, str]:
        """The outermost calls of functions on parameters only in the printed expressions,
        each with its Params field: ``sigmoid_decay_logit`` for sigmoid(decay_logit),
        ``<function>N`` where the argument is not one parameter."""
        d = self.definition
        params = {d.symbols[n] for n in d.all_params}
        taken = set(d.all_params)
        calls: dict[sp.Expr, str] = {}

        def visit(expr: sp.Basic) -> None:
            if isinstance(expr, sp.Function) and expr.free_symbols <= params:
                if expr.free_symbols and expr not in calls:
                    function = type(expr).__name__.lower().removesuffix("function")
                    (arg, *more) = expr.args
                    base = f"{function}_{arg}" if arg.is_Symbol and not more else function
                    numbered = (f"{base}{i}" for i in itertools.count(1))
                    name = next(
                        n
                        for n in itertools.chain([base], numbered)
                        if n not in taken and f"rcp_{n}" not in taken  # its reciprocal's field
                    )
                    taken.add(name)
                    calls[expr] = name
                return
            for arg in expr.args:
                visit(arg)

        functions = ("charge", "adaptation", "adaptation_jump") if self.adaptive else ("charge",)
        for function in (*functions, *self.derivative_functions()):
            visit(sp.sympify(self._expression(function)[0]))
        return calls

    def parameter_functions(self) -> dict[str, str]:
        printer = CudaFloatPrinter(self._param_names)  # exact: the forward's charge reads them
        return {name: printer.doprint(call) for call, name in self._calls.items()}

    def _expression(self, function: str) -> tuple[sp.Expr, bool]:
        """(sympy expression, is a forward equation) of device function ``function``."""
        d, partials = self.definition, self.definition.partials
        forward = {"charge": d.charge_expr, "adaptation": d.adaptation_expr}
        forward["adaptation_jump"] = d.jump_expr
        if function in forward:
            return forward[function], True
        if function.startswith("dh_d") and function[4:] in self.learnable:
            return partials.dh_dparam[function[4:]], False
        return getattr(partials, function), False

    def body(self, function: str) -> list[str]:
        expr, forward = self._expression(function)
        return cuda_body(expr, self._names, fast=not forward, share_subexpressions=not forward)

    def constant_derivatives(self) -> tuple[str, ...]:
        params = set(self._param_names)
        return tuple(
            name
            for name in self.derivative_functions()
            if sp.sympify(self._expression(name)[0]).free_symbols <= params
        )
