"""SpikingJelly's built-in spiking neurons: IF, LIF, PLIF, QIF, EIF and Izhikevich from
their NeuronDefs (every backend), and the torch-code :class:`SimpleLIFNode`."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from .. import definitions as defs
from ..errors import SpikefuseError
from ..surrogate import Surrogate, is_finite_real
from ._base import BaseNode, SimpleBaseNode
from ._checks import check_finite


class IFNode(BaseNode):
    """Integrate-and-fire: H[t] = V[t-1] + X[t]."""

    def __init__(
        self,
        v_threshold: float = 1.0,
        v_reset: float | None = 0.0,
        surrogate_function: Surrogate | None = None,
        detach_reset: bool = False,
        step_mode: str = "s",
        backend: str = "auto",
        store_v_seq: bool = False,
    ) -> None:
        super().__init__(
            defs.IF,
            {},
            v_threshold=v_threshold,
            v_reset=v_reset,
            surrogate_function=surrogate_function,
            detach_reset=detach_reset,
            step_mode=step_mode,
            backend=backend,
            store_v_seq=store_v_seq,
        )


class _ChargeByDecayInput:
    """``decay_input`` chooses the charge equations (``_DEFINITIONS``: with, without). SpikingJelly
    reads the attribute at every step, so assigning it after construction takes effect at once
    here too: the node switches equations and rebuilds its program."""

    _DEFINITIONS: tuple[defs.NeuronDef, defs.NeuronDef]
    definition: defs.NeuronDef | None  # BaseNode's

    @property
    def decay_input(self) -> bool:
        return self.__dict__["_decay_input"]

    @decay_input.setter
    def decay_input(self, value: bool) -> None:
        self.__dict__["_decay_input"] = value
        if "program" in self.__dict__:  # after __init__ (which passes the definition itself)
            self.definition = self._charge_definition
            self._update_program()  # type: ignore[attr-defined]  # BaseNode's

    @property
    def _charge_definition(self) -> defs.NeuronDef:
        """The equations ``decay_input`` chooses."""
        return self._DEFINITIONS[0] if self.decay_input else self._DEFINITIONS[1]

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "decay_input" in state:  # pickled before decay_input was a property
            state["_decay_input"] = state.pop("decay_input")
        super().__setstate__(state)  # type: ignore[misc]  # BaseNode's

    def extra_repr(self) -> str:
        return f"decay_input={self.decay_input}, " + super().extra_repr()  # type: ignore[misc]


class LIFNode(_ChargeByDecayInput, BaseNode):
    """Leaky integrate-and-fire.

    decay_input=True:  H[t] = V[t-1] + (X[t] - (V[t-1] - V_reset)) / tau
    decay_input=False: H[t] = V[t-1] - (V[t-1] - V_reset) / tau + X[t]
    (V_reset is 0 under soft reset.) Requires tau > 1.
    """

    lower_bounds = {"tau": 1.0}
    _DEFINITIONS = (defs.LIF, defs.LIF_NO_DECAY_INPUT)

    def __init__(
        self,
        tau: float = 2.0,
        decay_input: bool = True,
        v_threshold: float = 1.0,
        v_reset: float | None = 0.0,
        surrogate_function: Surrogate | None = None,
        detach_reset: bool = False,
        step_mode: str = "s",
        backend: str = "auto",
        store_v_seq: bool = False,
    ) -> None:
        self.decay_input = decay_input
        super().__init__(
            self._charge_definition,
            {"tau": tau},
            v_threshold=v_threshold,
            v_reset=v_reset,
            surrogate_function=surrogate_function,
            detach_reset=detach_reset,
            step_mode=step_mode,
            backend=backend,
            store_v_seq=store_v_seq,
        )


class ParametricLIFNode(_ChargeByDecayInput, BaseNode):
    """LIF with a learnable time constant (PLIF): 1/tau = sigmoid(w), w initialised from init_tau.

    The charge equations are LIF's with 1/tau = sigmoid(decay_logit) and ``self.w`` as the
    logit: the backends compute the sigmoid and the gradient of ``w`` (no autograd op of its
    own around the neuron).
    """

    learnable_params = ("decay_logit",)
    _DEFINITIONS = (defs.PLIF, defs.PLIF_NO_DECAY_INPUT)

    def __init__(
        self,
        init_tau: float = 2.0,
        decay_input: bool = True,
        v_threshold: float = 1.0,
        v_reset: float | None = 0.0,
        surrogate_function: Surrogate | None = None,
        detach_reset: bool = False,
        step_mode: str = "s",
        backend: str = "auto",
        store_v_seq: bool = False,
    ) -> None:
        if not (is_finite_real(init_tau) and init_tau > 1):
            raise SpikefuseError(
                f"ParametricLIFNode: init_tau must be finite and > 1, got {init_tau}"
            )
        self.decay_input = decay_input
        super().__init__(
            self._charge_definition,
            {},
            v_threshold=v_threshold,
            v_reset=v_reset,
            surrogate_function=surrogate_function,
            detach_reset=detach_reset,
            step_mode=step_mode,
            backend=backend,
            store_v_seq=store_v_seq,
        )
        self.w = nn.Parameter(torch.tensor(-math.log(init_tau - 1.0)))

    def learnable_values(self, device: torch.device, dtype: torch.dtype = torch.float32) -> Tensor:
        return self.w.to(dtype)  # 0-dim: the one value, without a reshape in the autograd graph

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if self._neuron_def().params == ("decay",):  # pickled before PLIF learned the logit
            self.definition = self._charge_definition
            self._update_program()

    def extra_repr(self) -> str:
        return f"tau={1.0 / self.w.detach().sigmoid().item():.4f}, " + super().extra_repr()


class QIFNode(BaseNode):
    """Quadratic integrate-and-fire: H = V + (X + a0 (V - v_rest)(V - v_c)) / tau."""

    lower_bounds = {"tau": 1.0, "a0": 0.0}
    at_least_v_reset = ("v_rest",)

    def __init__(
        self,
        tau: float = 2.0,
        v_c: float = 0.8,
        a0: float = 1.0,
        v_threshold: float = 1.0,
        v_rest: float = 0.0,
        v_reset: float | None = -0.1,
        surrogate_function: Surrogate | None = None,
        detach_reset: bool = False,
        step_mode: str = "s",
        backend: str = "auto",
        store_v_seq: bool = False,
    ) -> None:
        params = {"tau": tau, "a0": a0, "v_rest": v_rest, "v_c": v_c}
        super().__init__(
            defs.QIF,
            params,
            v_threshold=v_threshold,
            v_reset=v_reset,
            surrogate_function=surrogate_function,
            detach_reset=detach_reset,
            step_mode=step_mode,
            backend=backend,
            store_v_seq=store_v_seq,
        )


class EIFNode(BaseNode):
    """Exponential integrate-and-fire:
    H = V + (X - (V - v_rest) + delta_T exp((V - theta_rh) / delta_T)) / tau."""

    lower_bounds = {"tau": 1.0, "delta_T": 0.0}
    at_least_v_reset = ("v_rest",)

    def __init__(
        self,
        tau: float = 2.0,
        delta_T: float = 1.0,
        theta_rh: float = 0.8,
        v_threshold: float = 1.0,
        v_rest: float = 0.0,
        v_reset: float | None = -0.1,
        surrogate_function: Surrogate | None = None,
        detach_reset: bool = False,
        step_mode: str = "s",
        backend: str = "auto",
        store_v_seq: bool = False,
    ) -> None:
        params = {"tau": tau, "v_rest": v_rest, "delta_T": delta_T, "theta_rh": theta_rh}
        super().__init__(
            defs.EIF,
            params,
            v_threshold=v_threshold,
            v_reset=v_reset,
            surrogate_function=surrogate_function,
            detach_reset=detach_reset,
            step_mode=step_mode,
            backend=backend,
            store_v_seq=store_v_seq,
        )


class IzhikevichNode(BaseNode):
    """Izhikevich (two states V, W):
    H = V + (X + a0 (V - v_rest)(V - v_c) - W) / tau,
    Z = W + (a (H - v_rest) - W) / tau_w,  W[t] = Z + b S[t]."""

    lower_bounds = {"tau": 1.0, "tau_w": 0.0, "a0": 0.0}

    def __init__(
        self,
        tau: float = 2.0,
        v_c: float = 0.8,
        a0: float = 1.0,
        v_threshold: float = 1.0,
        v_reset: float | None = 0.0,
        v_rest: float = -0.1,
        w_rest: float = 0.0,
        tau_w: float = 2.0,
        a: float = 0.0,
        b: float = 0.0,
        surrogate_function: Surrogate | None = None,
        detach_reset: bool = False,
        step_mode: str = "s",
        backend: str = "auto",
        store_v_seq: bool = False,
    ) -> None:
        check_finite("IzhikevichNode", "w_rest", w_rest)
        params = {
            "tau": tau,
            "a0": a0,
            "v_rest": v_rest,
            "v_c": v_c,
            "a": a,
            "tau_w": tau_w,
            "b": b,
        }
        super().__init__(
            defs.IZHIKEVICH,
            params,
            v_threshold=v_threshold,
            v_reset=v_reset,
            surrogate_function=surrogate_function,
            detach_reset=detach_reset,
            step_mode=step_mode,
            backend=backend,
            store_v_seq=store_v_seq,
            w_init=w_rest,
        )

    @property
    def w_rest(self) -> float:
        """W's reset value (what :meth:`reset` restores ``.w`` to)."""
        return self._memory_defaults["w"]

    @w_rest.setter
    def w_rest(self, value: float) -> None:
        check_finite("IzhikevichNode", "w_rest", value)
        self._memory_defaults["w"] = float(value)


class SimpleLIFNode(SimpleBaseNode):
    """SpikingJelly's torch-code LIF (no kernels, no ``store_v_seq``; V starts at 0):

    decay_input=True:  H[t] = V[t-1] + (V_reset - V[t-1] + X[t]) / tau
    decay_input=False: H[t] = V[t-1] + (V_reset - V[t-1]) / tau + X[t]

    ``tau`` and ``decay_input`` have no defaults, as in SpikingJelly. Extension: under soft reset
    (``v_reset=None``, where SpikingJelly's charge fails on None) V leaks towards 0, as
    :func:`spikefuse.functional.lif_charge` does."""

    def __init__(
        self,
        tau: float,
        decay_input: bool,
        v_threshold: float = 1.0,
        v_reset: float | None = 0.0,
        surrogate_function: Any = None,
        detach_reset: bool = False,
        step_mode: str = "s",
    ) -> None:
        check_finite("SimpleLIFNode", "tau", tau)
        if not tau > 0:
            raise SpikefuseError(f"SimpleLIFNode: tau must be > 0, got {tau}")
        if not isinstance(decay_input, bool):
            raise SpikefuseError(
                f"SimpleLIFNode: decay_input must be True or False, got {decay_input!r}"
            )
        super().__init__(v_threshold, v_reset, surrogate_function, detach_reset, step_mode)
        self.tau = tau
        self.decay_input = decay_input

    def neuronal_charge(self, x: Tensor) -> None:
        v_reset = 0.0 if self.v_reset is None else self.v_reset
        if self.decay_input:
            self.v = self.v + (v_reset - self.v + x) / self.tau
        else:
            self.v = self.v + (v_reset - self.v) / self.tau + x

    def extra_repr(self) -> str:
        return f"tau={self.tau}, decay_input={self.decay_input}, " + super().extra_repr()
