"""Neuron definitions: a neuron is its charge equation; every derivative is derived from it.

Dynamics (seed 003), for every neuron::

    H[t] = f(V[t-1], X[t], params[, W[t-1]])          charge (the only thing a neuron defines)
    S[t] = Θ(H[t] - V_th)                              fire
    V[t] = H[t](1 - S[t]) + V_reset S[t]               hard reset
         = H[t] - V_th S[t]                            soft reset
    Z[t] = g(H[t], W[t-1], params)                     adaptation (two-state neurons only)
    W[t] = Z[t] + jump · S[t]

Equations are strings over the symbols ``v`` (V[t-1]), ``x`` (X[t]), ``w`` (W[t-1]), ``h``
(H[t], adaptation only), ``v_threshold``, ``v_reset`` (0 under soft reset) and the neuron's own
parameters. sympy derives ∂H/∂X, ∂H/∂V, ∂H/∂W, ∂H/∂p, ∂Z/∂H and ∂Z/∂W; wherever a derivative
needs X[t], X is eliminated through the charge equation (solved for x) so that backward only
needs the saved H sequence.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import sympy as sp

from .errors import SpikefuseError

V, X, W, H = sp.symbols("v x w h", real=True)
BUILTIN_PARAMS = ("v_threshold", "v_reset")
_STATE_NAMES = {"v", "x", "w", "h"}


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
        if not self.name.isidentifier():
            raise SpikefuseError(f"neuron name {self.name!r} must be an identifier")
        clash = (set(self.params) & (_STATE_NAMES | set(BUILTIN_PARAMS))) | {
            p for p in self.params if self.params.count(p) > 1
        }
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
            return sp.sympify(text, locals=dict(self.symbols))
        except (sp.SympifyError, SyntaxError, TypeError) as exc:
            raise SpikefuseError(f"{self.name}: cannot parse {what} {text!r}: {exc}") from exc

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
        solutions = sp.solve(sp.Eq(H, f), X)
        x_of_h = solutions[0] if len(solutions) == 1 else None

        def in_h(expr: sp.Expr) -> sp.Expr:
            if X in expr.free_symbols and x_of_h is not None:
                expr = sp.simplify(expr.subs(X, x_of_h))
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


IF = NeuronDef("if", charge="v + x")
LIF = NeuronDef("lif", charge="v + (x - (v - v_reset)) / tau", params=("tau",))
LIF_NO_DECAY_INPUT = NeuronDef("lif_ndi", charge="v - (v - v_reset) / tau + x", params=("tau",))
# PLIF is LIF with the learnable decay = 1/tau as its parameter.
PLIF = NeuronDef("plif", charge="v + (x - (v - v_reset)) * decay", params=("decay",))
PLIF_NO_DECAY_INPUT = NeuronDef(
    "plif_ndi", charge="v - (v - v_reset) * decay + x", params=("decay",)
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
