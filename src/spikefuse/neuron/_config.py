"""The internals of a spiking neuron's configuration: construction from a NeuronDef or from
torch code, validation of every assignment and the kernel program. The public methods and the
forward pass are :class:`~spikefuse.neuron.BaseNode`'s."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from .. import definitions as defs
from ..errors import BackendUnavailableError, SpikefuseError
from ..program import NeuronProgram
from ..surrogate import Sigmoid, Surrogate, runs_in_kernels
from ._checks import (
    backend_and_store_v_seq,
    check_above,
    check_finite,
    check_threshold_and_reset,
)
from ._memory import MemoryModule

# Switches that take True or False only (SpikingJelly asserts detach_reset is a bool)
_FLAGS = ("detach_reset", "store_v_seq", "decay_input")


class _ConfiguredNode(MemoryModule):
    """How a :class:`~spikefuse.neuron.BaseNode` is built and validates every assignment (see
    there); its public methods and the forward pass are BaseNode's."""

    learnable_params: tuple[str, ...] = ()
    # Set by __init__. ``definition`` is None for a neuron written in torch code (SpikingJelly's
    # way; see :meth:`_neuron_def`), ``program`` None while the surrogate is torch code.
    definition: defs.NeuronDef | None
    program: NeuronProgram | None
    surrogate_function: Any  # a Surrogate, or torch code (see runs_in_kernels)
    v_threshold: float
    v_reset: float | None
    last_backend: str | None  # the backend the last call ran (the repr shows it for 'auto')
    _constants: list[float] | None
    # Memories: a float for every neuron until the first call makes them tensors (torch-code
    # neurons may keep anything there, as in SpikingJelly).
    v: Any
    w: Any
    v_seq: Tensor | None  # store_v_seq's record of V
    # parameter -> exclusive lower bound, checked on every call (e.g. tau > 1 keeps 1/tau in (0, 1))
    lower_bounds: Mapping[str, float] = {}
    # parameters that must be >= v_reset under hard reset (SpikingJelly's QIF/EIF: v_rest)
    at_least_v_reset: tuple[str, ...] = ()

    # The torch-code hooks a subclass overrides, found once per class by
    # BaseNode.__init_subclass__ (forward checks it).
    _torch_code_hooks: tuple[str, ...] = ()

    def _init_torch_code(
        self,
        v_threshold: float = 1.0,
        v_reset: float | None = 0.0,
        surrogate_function: Any = None,
        detach_reset: bool = False,
        step_mode: str = "s",
        backend: str = "torch",
        store_v_seq: bool = False,
        *,
        initial_v: float | None = None,
    ) -> None:
        super().__init__(step_mode)
        surrogate_function = Sigmoid() if surrogate_function is None else surrogate_function
        runs_in_kernels(surrogate_function)  # validates it
        self.definition = None  # from here on V_th and V_reset are checked when assigned
        self.v_threshold = v_threshold
        self.v_reset = v_reset
        self.surrogate_function = surrogate_function
        self.detach_reset = detach_reset
        self.backend, self.store_v_seq = backend_and_store_v_seq(
            self, backend, store_v_seq, "torch"
        )
        self.last_backend = None
        if initial_v is None:  # BaseNode's rule: V starts at V_reset (0 under soft reset)
            initial_v = 0.0 if v_reset is None else float(v_reset)
        self.register_memory("v", initial_v)
        self.set_memory("v_seq", None)  # not a memory: the user's attribute unless store_v_seq

    def _init_definition(
        self,
        definition: defs.NeuronDef,
        params: Mapping[str, float] | None = None,
        v_threshold: float = 1.0,
        v_reset: float | None = 0.0,
        surrogate_function: Surrogate | None = None,
        detach_reset: bool = False,
        step_mode: str = "s",
        backend: str = "auto",
        store_v_seq: bool = False,
        w_init: float = 0.0,
    ) -> None:
        super().__init__(step_mode)
        params = dict(params or {})
        missing = set(definition.params) - set(params) - set(self.learnable_params)
        extra = set(params) - set(definition.params)
        if missing or extra:
            raise SpikefuseError(
                f"{definition.name}: missing params {sorted(missing)}, unknown {sorted(extra)}"
            )
        surrogate_function = Sigmoid() if surrogate_function is None else surrogate_function
        check_finite(type(self).__name__, "w_init", w_init)
        runs_in_kernels(surrogate_function)  # validates it (torch-code surrogates: torch only)
        self.definition = definition
        for name, value in params.items():
            setattr(self, name, value)
        self.v_threshold = v_threshold
        self.v_reset = v_reset
        self.surrogate_function = surrogate_function
        self.detach_reset = detach_reset
        self.backend, self.store_v_seq = backend_and_store_v_seq(self, backend, store_v_seq, "auto")
        self._constants = self._validated_constants({})  # now, not at the first call
        self._update_program()  # from here on, every assignment is validated (__setattr__)
        self.last_backend = None
        self.register_memory("v", 0.0 if v_reset is None else float(v_reset))
        if definition.adaptive:
            self.register_memory("w", float(w_init))
        self.set_memory("v_seq", None)  # not a memory: the user's attribute unless store_v_seq

    def _neuron_def(self) -> defs.NeuronDef:
        """``definition``, where only a neuron built from a NeuronDef gets."""
        if self.definition is None:
            raise SpikefuseError(f"{type(self).__name__} is torch code: it has no NeuronDef")
        return self.definition

    def _torch_code_error(self, reason: str) -> BackendUnavailableError:
        return BackendUnavailableError(
            f"{type(self).__name__}: backend 'cuda' cannot run this neuron: {reason}. Only the "
            "torch backend runs torch code (use backend='torch' or 'auto'). For the fused kernels "
            "write the charge as a NeuronDef, e.g. BaseNode(NeuronDef('mine', charge='v + x**2'), "
            "...) or a subclass passing one to BaseNode.__init__, and use a "
            "spikefuse.surrogate.Surrogate (a derivative expression)"
        )

    # ---- what the kernels get ----------------------------------------------------------------
    _PROGRAM_FIELDS = ("surrogate_function", "v_reset", "detach_reset")

    def __setattr__(self, name: str, value: Any) -> None:
        # SpikingJelly's store_v_seq setter drops v_seq; a step-mode change drops a sequence
        # this neuron recorded (store_v_seq), never one the user keeps there
        drops_v_seq = name == "store_v_seq" or (
            name == "step_mode" and self.__dict__.get("store_v_seq") is True
        )
        self._set_attribute(name, value)
        if drops_v_seq:
            self.set_memory("v_seq", None)

    def _set_attribute(self, name: str, value: Any) -> None:
        if name == "surrogate_function":
            runs_in_kernels(value)  # validates it (torch-code surrogates: torch backend only)
        if name in _FLAGS and not isinstance(value, bool):  # bool("no") would be True
            raise SpikefuseError(
                f"{type(self).__name__}: {name} must be True or False, got {value!r}"
            )
        if "program" not in self.__dict__:  # in __init__: constants() validates them all
            # a torch-code neuron (its definition None once set) has no constants() to check them
            torch_code = "definition" in self.__dict__ and self.__dict__["definition"] is None
            if torch_code and name in ("v_threshold", "v_reset"):
                self._check_torch_code_constants({name: value})
            super().__setattr__(name, value)
            return
        constants = None
        if name in ("v_threshold", "v_reset") or name in self._neuron_def().params:
            constants = self._validated_constants({name: value})  # before anything changes
        super().__setattr__(name, value)
        if constants is not None:
            self.__dict__["_constants"] = constants
        # Rebuild the program eagerly when its configuration changes, so forward (and
        # torch.compile tracing it) only reads an attribute.
        if name in self._PROGRAM_FIELDS:
            self._update_program()

    def _check_torch_code_constants(self, change: dict[str, Any]) -> None:
        """A torch-code neuron's threshold and reset (it has no NeuronDef constants to check),
        once both exist (in __init__ the second assignment checks)."""
        names = ("v_threshold", "v_reset")
        current: dict[str, Any] = {n: self.__dict__[n] for n in names if n in self.__dict__}
        current.update(change)
        if len(current) == 2:
            check_threshold_and_reset(type(self).__name__, *(current[n] for n in names))

    def _update_program(self) -> None:
        if isinstance(self.surrogate_function, Surrogate):  # told of changes (spiking mode too)
            self.surrogate_function.add_user(self)
        if not runs_in_kernels(self.surrogate_function):  # torch code: no kernel program
            self.__dict__["program"] = None
            return
        self.__dict__["program"] = NeuronProgram(
            self._neuron_def(),
            self.surrogate_function,
            hard_reset=self.v_reset is not None,
            detach_reset=bool(self.detach_reset),
            learnable=self.learnable_params,
        )

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if isinstance(self.surrogate_function, Surrogate):  # it does not pickle its users
            self.surrogate_function.add_user(self)

    def _validated_constants(self, changes: Mapping[str, Any]) -> list[float]:
        """V_th, V_reset (0 for soft reset) and the non-learnable parameters, with ``changes``
        applied, validated (finite, lower bounds, V_th > V_reset under hard reset)."""
        current: dict[str, Any] = {"v_threshold": self.v_threshold, "v_reset": self.v_reset}
        names = [p for p in self._neuron_def().params if p not in self.learnable_params]
        current.update({p: getattr(self, p) for p in names})
        current.update(changes)
        hard = current["v_reset"] is not None
        check_threshold_and_reset(type(self).__name__, current["v_threshold"], current["v_reset"])
        values = [current["v_threshold"], current["v_reset"] if hard else 0.0]
        values += [current[p] for p in names]
        for name in names:
            check_finite(type(self).__name__, name, current[name])
            bound = self.lower_bounds.get(name)
            if bound is not None:
                check_above(type(self).__name__, name, current[name], bound, str(bound))
        for name in self.at_least_v_reset if hard else ():
            if not current[name] >= values[1]:
                raise SpikefuseError(
                    f"{type(self).__name__}: with hard reset {name} must be >= v_reset (got "
                    f"{current[name]} < {values[1]})"
                )
        return [float(v) for v in values]

    def extra_repr(self) -> str:
        if self.definition is None:
            return (
                f"v_threshold={self.v_threshold}, v_reset={self.v_reset}, "
                f"detach_reset={self.detach_reset}, step_mode={self.step_mode}, "
                f"backend={self.backend} (torch code)"
            )
        own = [p for p in self.definition.params if p not in self.learnable_params]
        params = ", ".join(f"{p}={getattr(self, p)}" for p in own)
        ran = f" (ran: {self.last_backend})" if self.backend == "auto" and self.last_backend else ""
        return (
            f"{params + ', ' if params else ''}v_threshold={self.v_threshold}, "
            f"v_reset={self.v_reset}, detach_reset={self.detach_reset}, "
            f"step_mode={self.step_mode}, backend={self.backend}{ran}"
        )
