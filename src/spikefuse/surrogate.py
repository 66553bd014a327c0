"""Surrogate gradients: a Heaviside forward whose derivative is defined once, as a sympy expression.

Each surrogate gives dΘ/dx for x = H - V_th. The torch backend evaluates the expression with
PyTorch ops, the CUDA backend prints it as C (:mod:`spikefuse.cuda.codegen`). Formulas and
defaults follow SpikingJelly where it has the same name.
"""

from __future__ import annotations

import functools
import math
import numbers
import types
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import sympy as sp
import torch
from torch import nn

from .definitions import lambdify_torch
from .errors import SpikefuseError

x_sym = sp.Symbol("x", real=True)


def is_finite_real(value: Any) -> bool:
    """Whether ``value`` is a finite real number (bools excluded)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def heaviside(x: torch.Tensor) -> torch.Tensor:
    """Θ(x) = 1 if x >= 0 else 0, in x's dtype; NaN where x is NaN.

    A NaN input is never a valid "no spike": the NaN reaches the spikes, where it is visible."""
    return torch.where(x.isnan(), x, (x >= 0).to(x.dtype))


def _where(condition: torch.Tensor, a, b) -> torch.Tensor:
    """torch.where for lambdified Piecewise: constant branches are float64 0-d tensors, so a
    piecewise-constant derivative (Rect) is not rounded to float32 before the cast to x's dtype
    (0-d tensors do not promote the dtype of x-dependent branches)."""
    a, b = (
        torch.tensor(v, dtype=torch.float64, device=condition.device)
        if isinstance(v, (int, float))
        else v
        for v in (a, b)
    )
    return torch.where(condition, a, b)


class _SurrogateSpike(torch.autograd.Function):
    """Θ(x) forward, ``derivative(x)`` times the incoming gradient backward: every spiking
    surrogate's autograd Function (the modules' and the functional forms')."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, derivative: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.derivative = derivative
        return heaviside(x)

    @staticmethod
    def backward(ctx: Any, grad_spike: torch.Tensor) -> tuple[torch.Tensor, None]:
        (x,) = ctx.saved_tensors
        return grad_spike * ctx.derivative(x), None


class _Derivative(NamedTuple):
    """The derivative built for one set of hyper-parameter values."""

    values: tuple[tuple[str, float], ...]
    expr: sp.Expr
    function: Callable[[torch.Tensor], torch.Tensor]
    key: str


class Surrogate(nn.Module):
    """Base class: subclasses set hyper-parameters and implement :meth:`expression`.

    Calling a surrogate on a tensor x returns Θ(x) with the surrogate derivative in backward.
    Hyper-parameters (the names :meth:`hyperparameters` returns) are validated on every
    assignment by :meth:`check_hyperparameters`; a new value takes effect at once (the derivative
    and its key are rebuilt at the next use, the neurons using the surrogate rebuild their
    programs). Surrogates pickle and deepcopy at any time: the built derivative is a cache,
    dropped from the pickled state.
    """

    def hyperparameters(self) -> dict[str, float]:
        """Hyper-parameter values by name (they are baked into generated kernels)."""
        return {}

    def check_hyperparameters(self, values: dict[str, float]) -> None:
        """Raise :class:`SpikefuseError` if ``values`` (all hyper-parameters, by name) are invalid.

        The base class requires finite real numbers; subclasses add their own constraints."""
        for name, value in values.items():
            if not is_finite_real(value):
                raise SpikefuseError(
                    f"{type(self).__name__}: {name} must be a finite real number, got {value!r}"
                )

    def __setattr__(self, name: str, value: Any) -> None:
        try:
            current = self.hyperparameters()
        except AttributeError:  # in __init__, before every hyper-parameter exists
            current = {}
        if name not in current:
            super().__setattr__(name, value)
            return
        self.check_hyperparameters({**current, name: value})  # before anything changes
        # torch annotates Module.__setattr__'s value as Tensor | Module; it takes any value
        super().__setattr__(name, float(value))  # type: ignore[arg-type]
        for user in list(self.__dict__.get("_users", ())):
            user.surrogate_changed()

    def add_user(self, user: Any) -> None:
        """Call ``user.surrogate_changed()`` whenever a hyper-parameter changes (weakly held)."""
        self.__dict__.setdefault("_users", weakref.WeakSet()).add(user)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_derivative", None)  # holds lambdified functions; rebuilt on first use
        state.pop("_users", None)  # weak references; users register again when restored
        return state

    def expression(self, x: sp.Symbol) -> sp.Expr:
        """dΘ/dx as a sympy expression of ``x`` (hyper-parameters as numbers)."""
        raise NotImplementedError

    def _built(self) -> _Derivative:
        """The derivative for the current hyper-parameter values (built once per set of values)."""
        values = tuple(self.hyperparameters().items())
        built = self.__dict__.get("_derivative")
        if built is None or built.values != values:
            self.check_hyperparameters(dict(values))  # user subclasses may not check in __init__
            expr = self.expression(x_sym).evalf()
            fn = lambdify_torch([x_sym], expr, {"where": _where})

            def function(x: torch.Tensor) -> torch.Tensor:
                # float32 math for 16-bit x: their rounding would cancel terms (Sigmoid's
                # derivative at x = 2 is 0 in float16)
                wide = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
                return torch.as_tensor(fn(wide), dtype=x.dtype, device=x.device).expand_as(x)

            built = _Derivative(values, expr, function, f"{type(self).__name__}({expr})")
            self.__dict__["_derivative"] = built
        return built

    @property
    def derivative_expr(self) -> sp.Expr:
        return self._built().expr

    @property
    def derivative(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """dΘ/dx evaluated with PyTorch ops (fp64 stays fp64)."""
        return self._built().function

    @property
    def key(self) -> str:
        """Identifies the derivative (for kernel caches); changes with the hyper-parameters."""
        return self._built().key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SurrogateSpike.apply(x, self.derivative)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.hyperparameters().items())


class _AlphaSurrogate(Surrogate):
    """A surrogate with SpikingJelly's ``(alpha, spiking)`` arguments. ``spiking=False``
    (SpikingJelly's primitive mode) makes forward return the smooth primitive function instead
    of spikes; neurons then run it as torch code (torch backend only). ``spiking_function(x,
    alpha)``, ``primitive_function(x, alpha)`` and ``backward(grad_output, x, alpha)`` take alpha
    per call and work on the class too, as SpikingJelly's static methods do."""

    default_alpha = 1.0

    def __init__(self, alpha: float | None = None, spiking: bool = True) -> None:
        super().__init__()
        alpha = self.default_alpha if alpha is None else alpha
        self.check_hyperparameters({"alpha": alpha})
        self.alpha = float(alpha)
        self.set_spiking_mode(spiking)

    def hyperparameters(self) -> dict[str, float]:
        return {"alpha": self.alpha}

    def check_hyperparameters(self, values: dict[str, float]) -> None:
        super().check_hyperparameters(values)
        if not values["alpha"] > 0:
            raise SpikefuseError(
                f"{type(self).__name__}: alpha must be finite and > 0, got {values['alpha']!r}"
            )

    def set_spiking_mode(self, spiking: bool) -> None:
        """SpikingJelly's switch: True for spikes, False for the primitive function."""
        if not isinstance(spiking, bool):
            raise SpikefuseError(f"{type(self).__name__}: spiking must be a bool, got {spiking!r}")
        self.spiking = spiking
        for user in list(self.__dict__.get("_users", ())):  # neurons switch program / torch code
            user.surrogate_changed()

    @classmethod
    def spiking_function(cls, x: torch.Tensor, alpha: float) -> torch.Tensor:
        """SpikingJelly's static method: Θ(x) forward, the derivative at ``alpha`` backward
        (``Sigmoid.spiking_function(x, 4.0)`` spikes as ``Sigmoid(4.0)(x)``)."""
        return _SurrogateSpike.apply(x, _derivative_at((cls, float(alpha))))

    @classmethod
    def backward(cls, grad_output: torch.Tensor, x: torch.Tensor, alpha: float) -> torch.Tensor:
        """SpikingJelly's static method: the gradient w.r.t. x, ``grad_output`` times the
        derivative at ``alpha`` evaluated at x."""
        return grad_output * _derivative_at((cls, float(alpha)))(x)

    @classmethod
    def primitive_function(cls, x: torch.Tensor, alpha: float) -> torch.Tensor:
        """SpikingJelly's static method: g(x) with g' = the surrogate at ``alpha``."""
        raise SpikefuseError(
            f"{cls.__name__} has no primitive function (as in SpikingJelly); use spiking=True"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) if self.spiking else self.primitive_function(x, self.alpha)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, spiking={self.spiking}"  # SpikingJelly's repr


class Sigmoid(_AlphaSurrogate):
    """Θ'(x) = α·σ(αx)(1 - σ(αx))."""

    default_alpha = 4.0

    def expression(self, x: sp.Symbol) -> sp.Expr:
        s = 1 / (1 + sp.exp(-self.alpha * x))
        return self.alpha * s * (1 - s)

    @classmethod
    def primitive_function(cls, x: torch.Tensor, alpha: float) -> torch.Tensor:
        return torch.sigmoid(alpha * x)


class ATan(_AlphaSurrogate):
    """Θ'(x) = α / (2 (1 + (π α x / 2)²))."""

    default_alpha = 2.0

    def expression(self, x: sp.Symbol) -> sp.Expr:
        return self.alpha / 2 / (1 + (sp.pi / 2 * self.alpha * x) ** 2)

    @classmethod
    def primitive_function(cls, x: torch.Tensor, alpha: float) -> torch.Tensor:
        return torch.atan(math.pi / 2 * alpha * x) / math.pi + 0.5


class PiecewiseQuadratic(_AlphaSurrogate):
    """Θ'(x) = α - α²|x| for |x| <= 1/α, else 0."""

    default_alpha = 1.0

    def expression(self, x: sp.Symbol) -> sp.Expr:
        a = self.alpha
        return sp.Piecewise((0, sp.Abs(x) > 1 / a), (a - a**2 * sp.Abs(x), True))

    @classmethod
    def primitive_function(cls, x: torch.Tensor, alpha: float) -> torch.Tensor:
        inner = -(alpha**2) / 2 * x.abs() * x + alpha * x + 0.5
        return torch.where(x > 1 / alpha, 1.0, torch.where(x < -1 / alpha, 0.0, inner))


class PiecewiseExp(_AlphaSurrogate):
    """Θ'(x) = (α/2) exp(-α|x|)."""

    default_alpha = 1.0

    def expression(self, x: sp.Symbol) -> sp.Expr:
        return self.alpha / 2 * sp.exp(-self.alpha * sp.Abs(x))

    @classmethod
    def primitive_function(cls, x: torch.Tensor, alpha: float) -> torch.Tensor:
        # |x| as a where, not abs(): autograd's abs'(0) = 0 would make the gradient at 0 zero
        half_exp = torch.exp(-alpha * torch.where(x < 0, -x, x)) / 2
        return torch.where(x < 0, half_exp, 1 - half_exp)


class SoftSign(_AlphaSurrogate):
    """Θ'(x) = α / (2 (1 + |αx|)²)."""

    default_alpha = 2.0

    def expression(self, x: sp.Symbol) -> sp.Expr:
        return self.alpha / (2 * (1 + sp.Abs(self.alpha * x)) ** 2)

    @classmethod
    def primitive_function(cls, x: torch.Tensor, alpha: float) -> torch.Tensor:
        return (torch.nn.functional.softsign(alpha * x) + 1) / 2


class SuperSpike(_AlphaSurrogate):
    """Θ'(x) = α / (1 + |x|)² (Zenke & Ganguli; SpikingJelly's formula: α scales the height)."""

    default_alpha = 1.0

    def expression(self, x: sp.Symbol) -> sp.Expr:
        return self.alpha / (sp.Abs(x) + 1) ** 2


class Erf(_AlphaSurrogate):
    """Θ'(x) = (α/√π) exp(-α²x²)."""

    default_alpha = 2.0

    def expression(self, x: sp.Symbol) -> sp.Expr:
        return self.alpha / sp.sqrt(sp.pi) * sp.exp(-(self.alpha**2) * x**2)

    @classmethod
    def primitive_function(cls, x: torch.Tensor, alpha: float) -> torch.Tensor:
        return torch.special.erfc(-alpha * x) / 2


class Rect(_AlphaSurrogate):
    """SpikingJelly's rectangular window: Θ'(x) = α for |x| < 1/(2α), else 0 (area 1).

    ``Rect()`` (α = 1) is the DATE'22 paper's window: 1 on (-0.5, 0.5) around the threshold;
    :class:`RectWindow` takes any height and (asymmetric) window."""

    default_alpha = 1.0

    def expression(self, x: sp.Symbol) -> sp.Expr:
        return sp.Piecewise((self.alpha, sp.Abs(x) < 1 / (2 * self.alpha)), (0, True))

    @classmethod
    def primitive_function(cls, x: torch.Tensor, alpha: float) -> torch.Tensor:
        return torch.clamp(alpha * x + 0.5, 0.0, 1.0)


class RectWindow(Surrogate):
    """A rectangular window of any height and position: Θ'(x) = η for th_l < x < th_r, else 0.

    The window is relative to the threshold (x = H - V_th): the DATE'22 paper's absolute window
    (-0.25, 0.75) around threshold 0.25 is ``RectWindow(eta=1., th_l=-0.5, th_r=0.5)``
    (= ``Rect()``). Not a SpikingJelly name.
    """

    def __init__(self, eta: float = 1.0, th_l: float = -0.5, th_r: float = 0.5) -> None:
        super().__init__()
        self.check_hyperparameters({"eta": eta, "th_l": th_l, "th_r": th_r})
        self.eta, self.th_l, self.th_r = float(eta), float(th_l), float(th_r)

    def hyperparameters(self) -> dict[str, float]:
        return {"eta": self.eta, "th_l": self.th_l, "th_r": self.th_r}

    def check_hyperparameters(self, values: dict[str, float]) -> None:
        super().check_hyperparameters(values)
        eta, th_l, th_r = values["eta"], values["th_l"], values["th_r"]
        if not (eta > 0 and th_l < th_r):
            raise SpikefuseError(
                f"RectWindow: need finite eta > 0 and th_l < th_r, got eta={eta!r}, th_l={th_l!r}, "
                f"th_r={th_r!r}"
            )

    def expression(self, x: sp.Symbol) -> sp.Expr:
        inside = sp.And(x > self.th_l, x < self.th_r)
        return sp.Piecewise((self.eta, inside), (0, True))


ALL = (Sigmoid, ATan, PiecewiseQuadratic, PiecewiseExp, SoftSign, SuperSpike, Erf, Rect, RectWindow)


# ---- SpikingJelly-style surrogates (torch backend only) -----------------------------------------
class SurrogateFunctionBase(nn.Module):
    """SpikingJelly's base class for surrogates written in torch code.

    Subclasses implement ``spiking_function(x, **params)`` (usually an autograd Function's
    ``apply``: Heaviside forward, surrogate backward) and optionally
    ``primitive_function(x, **params)`` (the smooth function whose derivative is the surrogate,
    used when ``spiking=False``). Both SpikingJelly constructor styles work:
    ``super().__init__(alpha, spiking)`` (earlier versions) and SpikingJelly 2.0's
    ``super().__init__(spiking, alpha=alpha)`` (a bool first is ``spiking``; any keyword becomes
    a parameter attribute).

    Neurons run such a surrogate on the torch backend only (a per-step loop with autograd);
    for the fused kernels write the derivative as a :class:`Surrogate` (``expression``).
    """

    def __init__(self, *args: Any, **params: Any):
        super().__init__()
        # SpikingJelly 2.0: (spiking=True, **params); earlier versions: (alpha, spiking=True)
        new_style = args and (isinstance(args[0], bool) or "alpha" in params)
        names = ("spiking",) if new_style else ("alpha", "spiking")
        if len(args) > len(names):
            raise TypeError(
                f"{type(self).__name__}: SurrogateFunctionBase takes at most {len(names)} "
                f"positional arguments ({', '.join(names)}), got {len(args)}"
            )
        positional = dict(zip(names, args, strict=False))
        if twice := sorted(positional.keys() & params.keys()):
            raise TypeError(f"{type(self).__name__}: got multiple values for {twice}")
        params = {**positional, **params}
        self.spiking = params.pop("spiking", True)
        if params.get("alpha", 0.0) is None:  # alpha=None: no alpha parameter
            del params["alpha"]
        self._sg_param_names = tuple(params)
        for name, value in params.items():
            setattr(self, name, value)

    def set_spiking_mode(self, spiking: bool) -> None:
        self.spiking = spiking

    @property
    def _sg_params(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in self._sg_param_names}

    @staticmethod
    def spiking_function(x: torch.Tensor, **params: float) -> torch.Tensor:
        raise NotImplementedError

    @staticmethod
    def primitive_function(x: torch.Tensor, **params: float) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fn = self.spiking_function if self.spiking else self.primitive_function
        return fn(x, **self._sg_params)

    def extra_repr(self) -> str:
        return ", ".join(
            [*(f"{k}={v}" for k, v in self._sg_params.items()), f"spiking={self.spiking}"]
        )


@functools.lru_cache(maxsize=256)
def _derivative_at(
    key: tuple[type[_AlphaSurrogate], float],
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``cls(alpha)``'s derivative for ``key = (cls, alpha)`` (validating alpha), built once per
    class and alpha: the functional forms and the static-style methods take alpha per call.
    One tuple argument, as mypy does not count classes as Hashable."""
    cls, alpha = key
    return cls(alpha).derivative


def _functional_form(cls: type[_AlphaSurrogate], name: str) -> type[torch.autograd.Function]:
    """SpikingJelly's functional form of ``cls``: ``name.apply(x, alpha)`` returns Θ(x) with
    ``cls(alpha)``'s derivative in backward (:class:`_SurrogateSpike` with its arguments)."""

    def forward(ctx: Any, x: torch.Tensor, alpha: float) -> torch.Tensor:
        return _SurrogateSpike.forward(ctx, x, _derivative_at((cls, float(alpha))))

    doc = (
        f"``{name}.apply(x, alpha)``: Θ(x) forward, :class:`{cls.__name__}`'s derivative backward."
    )
    return type(name, (_SurrogateSpike,), {"forward": staticmethod(forward), "__doc__": doc})


sigmoid = _functional_form(Sigmoid, "sigmoid")
atan = _functional_form(ATan, "atan")
piecewise_quadratic = _functional_form(PiecewiseQuadratic, "piecewise_quadratic")
piecewise_exp = _functional_form(PiecewiseExp, "piecewise_exp")
soft_sign = _functional_form(SoftSign, "soft_sign")
super_spike = _functional_form(SuperSpike, "super_spike")
erf = _functional_form(Erf, "erf")
rect = _functional_form(Rect, "rect")


def runs_in_kernels(surrogate_function: object) -> bool:
    """True for a spiking :class:`Surrogate` (a derivative expression: every backend); False for a
    surrogate written in torch code (torch backend only): a :class:`SurrogateFunctionBase`
    (spikefuse's or SpikingJelly's), a Python function or an autograd Function's ``apply``.
    Anything else raises."""
    if isinstance(surrogate_function, Surrogate):
        return getattr(surrogate_function, "spiking", True)  # primitive mode: torch code
    torch_code = (
        hasattr(surrogate_function, "spiking_function")  # SurrogateFunctionBase, ours or SJ's
        or isinstance(surrogate_function, (types.FunctionType, functools.partial))
        or (
            isinstance(surrogate_function, types.MethodType)
            and isinstance(surrogate_function.__self__, type)
            and issubclass(surrogate_function.__self__, torch.autograd.Function)
        )
    )
    if not torch_code:
        raise SpikefuseError(
            f"surrogate_function must be a spikefuse.surrogate.Surrogate (any backend), or, for "
            f"the torch backend only, a SurrogateFunctionBase subclass, a Python function of x "
            f"returning spikes or an autograd Function's apply; got "
            f"{type(surrogate_function).__name__}"
        )
    return False
