"""Neuron definitions: a neuron is its charge equation; every derivative is derived from it.

Dynamics (the specification), for every neuron::

    H[t] = f(V[t-1], X[t], params[, W[t-1]])          charge (the only thing a neuron defines)
    S[t] = Θ(H[t] - V_th)                              fire
    V[t] = H[t](1 - S[t]) + V_reset S[t]               hard reset
         = H[t] - V_th S[t]                            soft reset
    Z[t] = g(H[t], W[t-1], params)                     adaptation (two-state neurons only)
    W[t] = Z[t] + jump · S[t]

Equations are strings over the symbols ``v`` (V[t-1]), ``x`` (X[t]), ``w`` (W[t-1]), ``h``
(H[t], adaptation only), ``v_threshold``, ``v_reset`` (0 under soft reset) and the neuron's own
parameters. They are parsed by a restricted arithmetic parser (never evaluated as Python): number
literals, those symbols, ``pi``, ``+ - * / **``, unary ``+``/``-``, parentheses and the functions
in :data:`FUNCTIONS`; anything else is a :class:`SpikefuseError`. sympy derives ∂H/∂X, ∂H/∂V,
∂H/∂W, ∂H/∂p, ∂Z/∂H and ∂Z/∂W; wherever a derivative needs X[t], X is eliminated through the
charge equation (solved for x) so that backward only needs the saved H sequence.
"""

from __future__ import annotations

import ast
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sympy as sp
from sympy.printing.pytorch import TorchPrinter

from .errors import SpikefuseError

V, X, W, H = sp.symbols("v x w h", real=True)


class SigmoidFunction(sp.Function):
    """σ(a) = 1 / (1 + exp(-a)), kept whole rather than expanded into exp: backends evaluate it
    as one function (``torch.sigmoid``; ``1.0f / (1.0f + expf(-a))`` in the kernels, PyTorch's
    CUDA formula), so that a neuron multiplying by σ of a parameter (PLIF's decay) computes
    exactly what SpikingJelly's ``w.sigmoid()`` does, and σ' = σ (1 - σ)."""

    @classmethod
    def eval(cls, arg: sp.Expr) -> sp.Expr | None:
        """A number's sigmoid is a number (the backends evaluate no call on a constant)."""
        return 1 / (1 + sp.exp(-arg)) if arg.is_Number else None

    def fdiff(self, argindex: int = 1) -> sp.Expr:
        s = SigmoidFunction(self.args[0])
        return s * (1 - s)

    def _torchcode(self, printer: Any) -> str:  # how lambdify's torch printer writes it
        return f"{printer._module_format('torch.sigmoid')}({printer._print(self.args[0])})"


BUILTIN_PARAMS = ("v_threshold", "v_reset")
_STATE_NAMES = {"v", "x", "w", "h"}

# The functions an equation may call (one argument each), and what they build.
FUNCTIONS: dict[str, Callable[[sp.Expr], sp.Expr]] = {
    "exp": sp.exp,
    "log": sp.log,
    "sqrt": sp.sqrt,
    "abs": sp.Abs,
    "tanh": sp.tanh,
    "sinh": sp.sinh,
    "cosh": sp.cosh,
    "sin": sp.sin,
    "cos": sp.cos,
    "sigmoid": SigmoidFunction,
}
_CONSTANTS = {"pi": sp.pi}
_BINARY = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.Pow: lambda a, b: a**b,
}
_UNARY = {ast.USub: lambda a: -a, ast.UAdd: lambda a: a}
_MAX_LENGTH = 10_000  # characters; equations are short, this bounds parser work
_MAX_INT_DIGITS = 30
_MAX_NUMERIC_EXPONENT = 64  # number ** number is evaluated exactly: 10**10**10 must not hang


class _EquationBuilder:
    """Builds a sympy expression from the AST of an arithmetic expression, node by node.

    Only the node types handled here are accepted; names resolve to ``symbols`` (an unknown name
    becomes a plain symbol, reported by the caller's symbol check), calls only to
    :data:`FUNCTIONS`. Nothing in the text is ever evaluated.
    """

    def __init__(self, symbols: dict[str, sp.Symbol]) -> None:
        self.symbols = symbols

    def build(self, node: ast.AST) -> sp.Expr:
        if isinstance(node, ast.Expression):
            return self.build(node.body)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self.build(node.left), self.build(node.right)
            # A numeric exponent is expanded exactly whatever the base (sqrt(6)**10**7 builds a
            # huge integer too), so it is bounded on its own; so is a numeric base.
            if isinstance(node.op, ast.Pow) and right.is_Number:
                huge_base = left.is_Rational and (
                    len(str(max(abs(left.p), left.q))) > _MAX_INT_DIGITS
                )
                if abs(right) > _MAX_NUMERIC_EXPONENT or huge_base:
                    raise _Rejected(f"the power {ast.unparse(node)} (number too large)")
            return _BINARY[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self.build(node.operand))
        if isinstance(node, ast.Constant):
            return self._number(node)
        if isinstance(node, ast.Name):
            if node.id in self.symbols:
                return self.symbols[node.id]
            if node.id in _CONSTANTS:
                return _CONSTANTS[node.id]
            if node.id in FUNCTIONS:
                raise _Rejected(f"the function name {node.id!r} used without a call")
            return sp.Symbol(node.id, real=True)
        if isinstance(node, ast.Call):
            return self._call(node)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
            raise _Rejected(f"{ast.unparse(node)!r} ('^' is not a power here: write '**')")
        if isinstance(node, (ast.BinOp, ast.UnaryOp)):
            raise _Rejected(f"{ast.unparse(node)!r} (operator {type(node.op).__name__})")
        raise _Rejected(f"{ast.unparse(node)!r} ({type(node).__name__} is not allowed)")

    @staticmethod
    def _number(node: ast.Constant) -> sp.Expr:
        value = node.value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _Rejected(f"the literal {value!r} (only real numbers are allowed)")
        if isinstance(value, int):
            if len(str(abs(value))) > _MAX_INT_DIGITS:
                raise _Rejected(f"an integer literal with more than {_MAX_INT_DIGITS} digits")
            return sp.Integer(value)
        if not math.isfinite(value):  # 1e400 reads as inf: never a valid coefficient
            raise _Rejected(f"the literal {ast.unparse(node)} (not a finite number)")
        return sp.Float(repr(value))

    def _call(self, node: ast.Call) -> sp.Expr:
        name = node.func.id if isinstance(node.func, ast.Name) else None
        if name not in FUNCTIONS:
            raise _Rejected(
                f"the call {ast.unparse(node)!r}; allowed functions: {', '.join(FUNCTIONS)}"
            )
        if node.keywords or len(node.args) != 1 or isinstance(node.args[0], ast.Starred):
            raise _Rejected(f"the call {ast.unparse(node)!r} ({name} takes one argument)")
        return FUNCTIONS[name](self.build(node.args[0]))


class _Rejected(Exception):
    """Part of an equation that the restricted parser does not accept (message: which part)."""


def parse_equation(text: str, symbols: dict[str, sp.Symbol]) -> sp.Expr:
    """The sympy expression of an arithmetic equation string, without evaluating any code.

    Raises :class:`SpikefuseError` (naming the offending part) for syntax errors and for
    anything beyond numbers, names, ``+ - * / **``, unary signs and calls of :data:`FUNCTIONS`.
    """
    if not isinstance(text, str):
        raise SpikefuseError(f"an equation must be a string, got {type(text).__name__}")
    if len(text) > _MAX_LENGTH:
        raise SpikefuseError(f"equation longer than {_MAX_LENGTH} characters")
    try:
        tree = ast.parse(text.strip(), mode="eval")
        expr = _EquationBuilder(symbols).build(tree)
    except (SyntaxError, ValueError) as exc:
        raise SpikefuseError(f"syntax error: {exc}") from None
    except _Rejected as exc:
        raise SpikefuseError(f"not allowed in an equation: {exc}") from None
    except (RecursionError, MemoryError):
        raise SpikefuseError("equation nested too deeply") from None
    # sympy evaluates x/0 to complex infinity (zoo) and absorbs the terms around it: the
    # kernels would compute inf or NaN, so a division by zero is an error here
    if expr.has(sp.zoo, sp.oo, -sp.oo, sp.nan):
        raise SpikefuseError(f"it divides by zero or is infinite (sympy reads it as {expr})")
    # functions of numbers (exp(-1), sqrt(2), log(2)) become their values: the backends would
    # call a tensor function on a plain number
    expr = expr.replace(
        lambda e: isinstance(e, (sp.Function, sp.Pow)) and not e.free_symbols,
        lambda e: sp.Float(_real_value(e, expr)),
    )
    if expr.has(sp.I):
        raise SpikefuseError(f"it has a complex value (sympy reads it as {expr})")
    return expr


def _real_value(constant: sp.Expr, expr: sp.Expr) -> float:
    """The finite real value of a constant sub-expression of ``expr``, or an error."""
    value = complex(constant.evalf())
    if value.imag or not math.isfinite(value.real):
        raise SpikefuseError(
            f"{constant} is {'complex' if value.imag else 'infinite'} (in {expr}): equations "
            "compute with finite real numbers"
        )
    return value.real


@dataclass(frozen=True)
class Partials:
    """Derivatives of a neuron definition, as sympy expressions over v, x, w, h and parameters."""

    dh_dx: sp.Expr
    dh_dv: sp.Expr
    dh_dw: sp.Expr
    dh_dparam: dict[str, sp.Expr]
    dz_dh: sp.Expr
    dz_dw: sp.Expr
    needs_x: bool  # some derivative still depends on X[t]: backward must keep x_seq
    needs_w: bool  # some derivative depends on W[t-1]: forward must keep the W sequence


@dataclass(frozen=True)
class NeuronDef:
    """A spiking neuron, declared by its charge equation (and adaptation, for two-state neurons).

    Args:
        name: identifier used in kernel names; letters, digits and ``_``.
        charge: H[t] as a function of ``v``, ``x``, parameters (and ``w`` if adaptive).
        params: names of the scalar parameters the equations use (besides the built-ins
            ``v_threshold`` and ``v_reset``).
        adaptation: Z[t] as a function of ``h``, ``w`` and parameters; makes the neuron two-state.
        adaptation_jump: spike-triggered increment of W (``W[t] = Z[t] + jump * S[t]``).

    Example (a cubic leaky neuron that spikefuse does not ship)::

        CUBIC = NeuronDef("cubic", charge="v + (x - k * v**3) / tau", params=("tau", "k"))
    """

    name: str
    charge: str
    params: tuple[str, ...] = ()
    adaptation: str | None = None
    adaptation_jump: str = "0"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise SpikefuseError(f"neuron name {self.name!r} must be an identifier")
        if not isinstance(self.params, tuple) or not all(isinstance(p, str) for p in self.params):
            raise SpikefuseError(
                f"{self.name}: params must be a tuple of names, got {self.params!r}"
            )
        # function and constant names too: the backends' code would call the parameter
        reserved = _STATE_NAMES | set(BUILTIN_PARAMS) | set(FUNCTIONS) | set(_CONSTANTS)
        clash = (set(self.params) & reserved) | {p for p in self.params if self.params.count(p) > 1}
        if clash:
            raise SpikefuseError(
                f"{self.name}: parameter names {sorted(clash)} are reserved/repeated"
            )
        for p in self.params:
            if not p.isidentifier():
                raise SpikefuseError(f"{self.name}: parameter name {p!r} is not an identifier")
        if X not in self.charge_expr.free_symbols:
            raise SpikefuseError(f"{self.name}: the charge equation must depend on x")
        self._check_symbols(self.charge_expr, {"v", "x"} | ({"w"} if self.adaptive else set()))
        if self.adaptive:
            self._check_symbols(self.adaptation_expr, {"h", "w"})
            self._check_symbols(self.jump_expr, set())
        elif self.adaptation_jump != "0":
            raise SpikefuseError(f"{self.name}: adaptation_jump needs an adaptation equation")

    @property
    def adaptive(self) -> bool:
        """Whether the neuron has the second state W."""
        return self.adaptation is not None

    @property
    def num_states(self) -> int:
        return 2 if self.adaptive else 1

    @functools.cached_property
    def symbols(self) -> dict[str, sp.Symbol]:
        """All symbols an equation may use, by name."""
        names = ("v", "x", "w", "h", *BUILTIN_PARAMS, *self.params)
        return {n: sp.Symbol(n, real=True) for n in names}

    @property
    def all_params(self) -> tuple[str, ...]:
        """Built-in parameters followed by the neuron's own, in kernel-argument order."""
        return (*BUILTIN_PARAMS, *self.params)

    def _parse(self, text: str, what: str) -> sp.Expr:
        try:
            return parse_equation(text, self.symbols)
        except SpikefuseError as exc:
            raise SpikefuseError(f"{self.name}: cannot parse {what} {text!r}: {exc}") from None

    def _check_symbols(self, expr: sp.Expr, allowed_states: set[str]) -> None:
        allowed = {self.symbols[n] for n in (*allowed_states, *self.all_params)}
        unknown = expr.free_symbols - allowed
        if unknown:
            raise SpikefuseError(
                f"{self.name}: unknown symbols {sorted(map(str, unknown))} in {expr}; "
                f"allowed: {sorted(map(str, allowed))} (declare parameters in params=)"
            )

    @functools.cached_property
    def charge_expr(self) -> sp.Expr:
        return self._parse(self.charge, "charge")

    @functools.cached_property
    def adaptation_expr(self) -> sp.Expr:
        return self._parse(self.adaptation or "w", "adaptation")

    @functools.cached_property
    def jump_expr(self) -> sp.Expr:
        return self._parse(self.adaptation_jump, "adaptation_jump")

    @functools.cached_property
    def partials(self) -> Partials:
        """The derivatives BPTT needs, with X eliminated where the charge can be solved for it."""
        f = self.charge_expr
        # Solved only where X occurs once (an inversion, quick; every built-in neuron): sympy's
        # solve can take minutes on nested roots of X, and may answer in functions no backend
        # prints (LambertW for x exp(x)). Otherwise X is kept (memory, not accuracy).
        solutions = []
        if sum(1 for e in sp.preorder_traversal(f) if e == X) == 1:
            try:
                solutions = sp.solve(sp.Eq(H, f), X)
            except Exception:  # sympy cannot solve it (e.g. sigmoid(x) + cosh(x)): keep X
                solutions = []
        # Eliminate X only where X(H) divides by nothing that a state can make zero: where
        # dH/dX vanishes for some state, X(H) divides by zero there (v + x (e_rev - v) at
        # v = e_rev gives dh_dv = (e_rev - h) / (e_rev - v), 0/0 = NaN; keeping X gives 1 - x).
        # Factors that are never zero (EIF's exp) are fine.
        x_of_h = None
        if len(solutions) == 1 and _printable(solutions[0]):
            factors = sp.Mul.make_args(sp.denom(sp.together(solutions[0])))
            if all(f.is_zero is False or not f.free_symbols & {V, W, H} for f in factors):
                x_of_h = solutions[0]

        def in_h(expr: sp.Expr) -> sp.Expr:
            if X in expr.free_symbols and x_of_h is not None:
                expr = sp.simplify(expr.subs(X, x_of_h))
                # simplify may expand a product, PLIF's (h - v)(1 - σ) into -hσ + h + vσ - v,
                # which rounds more (h ≈ v): factored where that takes fewer operations
                factored = sp.factor(expr)
                if sp.count_ops(factored) < sp.count_ops(expr):
                    expr = factored
            return expr

        g = self.adaptation_expr
        derived = {
            "dh_dx": in_h(sp.diff(f, X)),
            "dh_dv": in_h(sp.diff(f, V)),
            "dh_dw": in_h(sp.diff(f, W)),
            "dz_dh": sp.diff(g, H),
            "dz_dw": sp.diff(g, W),
        }
        dh_dparam = {p: in_h(sp.diff(f, self.symbols[p])) for p in self.params}
        exprs = [*derived.values(), *dh_dparam.values()]
        return Partials(
            **derived,
            dh_dparam=dh_dparam,
            needs_x=any(X in e.free_symbols for e in exprs),
            needs_w=self.adaptive and any(W in e.free_symbols for e in exprs),
        )

    def describe(self) -> str:
        """Canonical text of the definition (used for cache keys)."""
        return (
            f"{self.name}: h={self.charge_expr}; z={self.adaptation_expr if self.adaptive else ''};"
            f" jump={self.jump_expr}; params={','.join(self.params)}"
        )


# The sympy function classes an equation's functions make (sqrt makes a power, not a call).
_EQUATION_FUNCTIONS = frozenset(
    type(call) for call in (f(X) for f in FUNCTIONS.values()) if isinstance(call, sp.Function)
)


def _printable(expr: sp.Expr) -> bool:
    """Whether ``expr`` is real and calls only functions an equation may call (what the
    backends print), e.g. not a LambertW or a root of a polynomial that sympy's solve returned."""
    functions = {type(f) for f in expr.atoms(sp.Function)}
    return functions <= _EQUATION_FUNCTIONS and not expr.has(sp.I, sp.Piecewise)


class ExactFloatPrinter(TorchPrinter):
    """lambdify's torch printer, writing every float exactly (its shortest ``repr``): the
    default 15 significant digits move a constant such as 1/6 by a float64 step, and with it a
    surrogate's window edge (Rect(3.0) at x = 1/6)."""

    def _print_Float(self, expr: sp.Float) -> str:
        return repr(float(expr))


def lambdify_torch(
    args: Any, expr: sp.Expr, overrides: dict[str, Callable[..., Any]] | None = None
) -> Callable[..., Any]:
    """``sp.lambdify`` to torch ops with exact floats (:class:`ExactFloatPrinter`, set up as
    lambdify sets up its own printer); ``overrides`` replace torch functions by name."""
    overrides = overrides or {}
    printer = ExactFloatPrinter(
        {
            "fully_qualified_modules": False,
            "inline": True,
            "allow_unknown_functions": True,
            "user_functions": {name: name for name in overrides},
        }
    )
    return sp.lambdify(args, expr, modules=[overrides, "torch"], printer=printer)


def torch_function(definition: NeuronDef, expr: sp.Expr) -> Callable[..., Any]:
    """``expr`` (an equation or partial of ``definition``) as a function evaluated with torch
    ops, of (v, x, w, h, *all_params); it returns a tensor, or a Python number where ``expr`` is
    a constant."""
    args = [definition.symbols[n] for n in ("v", "x", "w", "h", *definition.all_params)]
    return lambdify_torch(args, expr)


IF = NeuronDef("if", charge="v + x")
LIF = NeuronDef("lif", charge="v + (x - (v - v_reset)) / tau", params=("tau",))
LIF_NO_DECAY_INPUT = NeuronDef("lif_ndi", charge="v - (v - v_reset) / tau + x", params=("tau",))
# PLIF is LIF with decay = 1/tau = sigmoid(decay_logit), the logit being what it learns
# (SpikingJelly's w): the kernels compute the sigmoid, so a step needs no sigmoid of its own.
PLIF = NeuronDef(
    "plif", charge="v + (x - (v - v_reset)) * sigmoid(decay_logit)", params=("decay_logit",)
)
PLIF_NO_DECAY_INPUT = NeuronDef(
    "plif_ndi", charge="v - (v - v_reset) * sigmoid(decay_logit) + x", params=("decay_logit",)
)
QIF = NeuronDef(
    "qif",
    charge="v + (x + a0 * (v - v_rest) * (v - v_c)) / tau",
    params=("tau", "a0", "v_rest", "v_c"),
)
EIF = NeuronDef(
    "eif",
    charge="v + (x - (v - v_rest) + delta_T * exp((v - theta_rh) / delta_T)) / tau",
    params=("tau", "v_rest", "delta_T", "theta_rh"),
)
IZHIKEVICH = NeuronDef(
    "izhikevich",
    charge="v + (x + a0 * (v - v_rest) * (v - v_c) - w) / tau",
    params=("tau", "a0", "v_rest", "v_c", "a", "tau_w", "b"),
    adaptation="w + (a * (h - v_rest) - w) / tau_w",
    adaptation_jump="b",
)
