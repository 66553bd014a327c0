"""Spiking neuron modules with SpikingJelly's conventions.

``step_mode='s'`` takes one step ``[N, *]``; ``step_mode='m'`` takes a sequence ``[T, N, *]``.
State (``.v``, and ``.w`` for Izhikevich) persists across calls until
:func:`spikefuse.functional.reset_net`. ``backend`` is ``'torch'`` (reference), ``'cuda'`` (alias
``'cupy'``: fused NVRTC kernels) or ``'auto'`` (cuda for CUDA tensors when it can run them,
else torch; the repr shows which one ran).
"""

from __future__ import annotations

import copy
import functools
import logging
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

import torch
from torch import Tensor, nn

from . import backends
from . import definitions as defs
from .backends import BACKEND_NAMES, compute_dtype
from .errors import BackendUnavailableError, SpikefuseError
from .functional import STEP_MODES, check_sequence
from .ops import run_neuron
from .program import NeuronProgram
from .surrogate import Sigmoid, Surrogate, is_finite_real, runs_in_kernels

log = logging.getLogger("spikefuse")
# Methods a SpikingJelly-style subclass overrides with torch code (then only the torch backend
# runs it, as a per-step loop with autograd through the user's code).
TORCH_CODE_HOOKS = ("neuronal_charge", "neuronal_fire", "neuronal_reset")
# Switches that take True or False only (SpikingJelly asserts detach_reset is a bool)
_FLAGS = ("detach_reset", "store_v_seq", "decay_input")
TORCH_CODE_BACKENDS = ("auto", "torch")
_STEP_FORWARDS = ("single_step_forward", "multi_step_forward")


def _float32(value: float) -> float:
    """``value`` as float32 holds it: the neurons compute in float32 (float64 only for float64
    input), so constants are checked in that arithmetic."""
    return float(torch.tensor(float(value), dtype=torch.float32))


def _check_finite(owner: str, name: str, value: Any) -> None:
    if not is_finite_real(value):
        raise SpikefuseError(
            f"{owner}: {name} must be a finite float, got {value!r} ({type(value).__name__})"
        )
    if not math.isfinite(_float32(value)):
        raise SpikefuseError(
            f"{owner}: {name}={value!r} overflows float32, the arithmetic the neurons use"
        )


def _check_above(
    owner: str, name: str, value: float, bound: float, what: str, why: str = ""
) -> None:
    """``value`` > ``bound`` (``what`` names the bound; ``why`` says what breaks otherwise),
    also once both are float32: a value above the bound only in float64 is equal to it in the
    neurons' arithmetic."""
    if not value > bound:
        raise SpikefuseError(f"{owner}: {name} must be > {what}, got {value} <= {bound}{why}")
    if not _float32(value) > _float32(bound):
        raise SpikefuseError(
            f"{owner}: {name} must be > {what}, but {value!r} is so only in float64; in "
            f"float32, the arithmetic the neurons use, both are {_float32(bound)!r}{why}"
        )


def _check_threshold_and_reset(owner: str, v_threshold: Any, v_reset: Any) -> None:
    """Finite V_th and V_reset (None: soft reset), and V_th > V_reset under hard reset (else a
    neuron at rest would fire on every step), in float32 too."""
    _check_finite(owner, "v_threshold", v_threshold)
    if v_reset is None:
        return
    _check_finite(owner, "v_reset", v_reset)
    why = ": a neuron at rest would fire on every step"
    _check_above(owner, "with hard reset v_threshold", v_threshold, v_reset, "v_reset", why)


def _backend_and_store_v_seq(
    node: nn.Module, backend: Any, store_v_seq: bool, default: str
) -> tuple[Any, bool]:
    """(backend, store_v_seq) from a neuron's constructor arguments. SpikingJelly 2.0's neurons
    take ``store_v_seq`` right after ``step_mode`` (they have no ``backend``; earlier versions
    put ``backend`` there): a bool in ``backend``'s place is that flag, with the default
    backend."""
    if not isinstance(backend, bool):
        return backend, store_v_seq
    if store_v_seq is not False:
        raise SpikefuseError(
            f"{type(node).__name__}: backend={backend!r} and store_v_seq={store_v_seq!r}; the "
            "argument after step_mode is store_v_seq (SpikingJelly 2.0) or backend (earlier "
            "versions), not both: pass backend= by keyword"
        )
    return default, backend


class StepModeMixin:
    """A ``step_mode`` attribute, ``'s'`` or ``'m'``, validated on every assignment."""

    @property
    def step_mode(self) -> str:
        return self._step_mode

    @step_mode.setter
    def step_mode(self, mode: str) -> None:
        supported = self.supported_step_mode()
        if mode not in supported:
            allowed = " or ".join(repr(m) for m in supported)
            raise SpikefuseError(f"step_mode must be {allowed}, got {mode!r}")
        self._step_mode = mode

    def supported_step_mode(self) -> tuple[str, ...]:
        """The step modes this module takes (SpikingJelly's ``StepModule`` method)."""
        return STEP_MODES


class _OneStepMode(StepModeMixin):
    """A module that supports one step mode only: ``step_mode`` reads it before any
    assignment (SpikingJelly's subclasses rarely set it) and refuses the other mode."""

    _only_mode: str

    @property
    def step_mode(self) -> str:
        return self.__dict__.get("_step_mode", self._only_mode)

    @step_mode.setter
    def step_mode(self, mode: str) -> None:
        if mode != self._only_mode:
            raise SpikefuseError(
                f"{type(self).__name__}: step_mode must be {self._only_mode!r} (it is a "
                f"{'multi' if self._only_mode == 'm' else 'single'}-step module), got {mode!r}"
            )
        self.__dict__["_step_mode"] = mode

    def supported_step_mode(self) -> tuple[str, ...]:
        return (self._only_mode,)


class SingleStepModule(_OneStepMode):
    """Mixin of a module that takes one step ``[N, *]`` only (``step_mode`` is 's')."""

    _only_mode = "s"


class MultiStepModule(_OneStepMode):
    """Mixin of a module that takes sequences ``[T, N, *]`` only (``step_mode`` is 'm')."""

    _only_mode = "m"


class MemoryModule(StepModeMixin, nn.Module):
    """A module with per-sample state (memories) that :meth:`reset` restores to defaults."""

    def __init__(self, step_mode: str = "s") -> None:
        super().__init__()
        self._memory_defaults: dict[str, Any] = {}
        self.step_mode = step_mode

    def register_memory(self, name: str, value: Any) -> None:
        """Declare a state variable; ``value`` is restored by :meth:`reset`."""
        if name in self._parameters or name in self._buffers or name in self._modules:
            raise SpikefuseError(f"memory {name!r} clashes with a parameter, buffer or module")
        self._memory_defaults[name] = copy.deepcopy(value)
        setattr(self, name, value)

    def set_reset_value(self, name: str, value: Any) -> None:
        """Change the value :meth:`reset` restores memory ``name`` to (SpikingJelly's method)."""
        if name not in self._memory_defaults:
            raise SpikefuseError(f"{name!r} is not a memory of {type(self).__name__}")
        self._memory_defaults[name] = copy.deepcopy(value)

    def get_reset_value(self, name: str) -> Any:
        """SpikingJelly's name of :meth:`memory_default`."""
        if name not in self._memory_defaults:
            raise KeyError(f"{name} is not a registered memory.")
        return self._memory_defaults[name]

    def named_memories(self) -> Iterator[tuple[str, Any]]:
        """(name, current value) of every memory, in registration order."""
        for name in self._memory_defaults:
            yield name, getattr(self, name)

    def memories(self) -> Iterator[Any]:
        """The current value of every memory, in registration order."""
        for _, value in self.named_memories():
            yield value

    def memory_default(self, name: str) -> Any:
        """The value :meth:`reset` restores memory ``name`` to (given when it was registered:
        a neuron's ``v`` starts from the ``v_reset`` it was built with, as in SpikingJelly)."""
        return self._memory_defaults[name]

    def set_memory(self, name: str, value: Any) -> None:
        """Assign a memory. Memories are plain attributes, so outside ``torch.compile`` this
        skips ``nn.Module.__setattr__``'s parameter/buffer/module checks (a per-call cost)."""
        if torch.compiler.is_compiling():
            setattr(self, name, value)
        else:
            self.__dict__[name] = value

    def __getstate__(self) -> dict[str, Any]:
        """The module's state with tensor memories detached: after a training forward ``.v`` is
        part of an autograd graph, which neither pickles nor deep-copies; a copy starts a new one."""
        state = self.__dict__.copy()
        for name in self._memory_defaults:
            if isinstance(state.get(name), Tensor):
                state[name] = state[name].detach()
        return state

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> MemoryModule:
        """Tensor memories and their reset values move and convert with the module (``.to()``,
        ``.cuda()``, ``.double()``), as SpikingJelly's do."""
        for name, default in self._memory_defaults.items():
            value = self.__dict__.get(name)
            if isinstance(value, Tensor):
                self.set_memory(name, fn(value))
            if isinstance(default, Tensor):
                self._memory_defaults[name] = fn(default)
        return super()._apply(fn, recurse)

    def reset(self) -> None:
        """Restore every memory to its default (call between independent sequences)."""
        for name, value in self._memory_defaults.items():
            immutable = value is None or isinstance(value, (int, float))
            self.set_memory(name, value if immutable else copy.deepcopy(value))

    def single_step_forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Any:
        """One step ``[N, *]`` (SpikingJelly's method; subclasses written step by step define it)."""
        raise NotImplementedError(f"{type(self).__name__} must implement single_step_forward")

    def multi_step_forward(self, x_seq: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        """A sequence ``[T, N, *]``: by default a Python loop of :meth:`single_step_forward`
        over T, stacked (SpikingJelly's default)."""
        check_sequence(x_seq, type(self).__name__)
        return torch.stack([self.single_step_forward(x, *args, **kwargs) for x in x_seq])

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """'s': :meth:`single_step_forward`; 'm': :meth:`multi_step_forward`."""
        if self.step_mode == "m":
            return self.multi_step_forward(*args, **kwargs)
        return self.single_step_forward(*args, **kwargs)

    def detach(self) -> None:
        """Cut every tensor memory from the autograd graph of earlier steps, keeping its value
        (truncated BPTT; :func:`spikefuse.functional.detach_net` calls it on a whole network)."""
        for name in self._memory_defaults:
            value = getattr(self, name)
            if isinstance(value, Tensor):
                self.set_memory(name, value.detach())


class BaseNode(MemoryModule):
    """A spiking neuron layer running any :class:`~spikefuse.definitions.NeuronDef`.

    Use it directly for your own neuron definitions (every backend)::

        CUBIC = NeuronDef("cubic", charge="v + (x - k * v**3) / tau", params=("tau", "k"))
        node = BaseNode(CUBIC, params={"tau": 2.0, "k": 0.1}, step_mode="m")

    or subclass it the SpikingJelly way, overriding ``neuronal_charge`` with torch code (then
    SpikingJelly's constructor ``(v_threshold, v_reset, surrogate_function, detach_reset,
    step_mode, backend, store_v_seq)`` applies and only the torch backend runs it, as a
    per-step loop with autograd; see :attr:`torch_code`)::

        class SquareIFNode(BaseNode):
            def neuronal_charge(self, x):
                self.v = self.v + x**2

    Args:
        definition: the neuron's equations.
        params: a value for every parameter of ``definition`` (stored as attributes).
        v_threshold: V_th.
        v_reset: hard-reset potential, or ``None`` for soft reset (V -= V_th on a spike).
        surrogate_function: the spike's surrogate gradient.
        detach_reset: stop the gradient through the reset's dependence on S.
        step_mode: ``'s'`` (input [N, *]) or ``'m'`` (input [T, N, *]).
        backend: ``'auto'``, ``'torch'``, ``'cuda'`` or ``'cupy'`` (alias of cuda).
        store_v_seq: keep V[1..T] as ``.v_seq`` (shape of the input) in multi-step mode; in
            single-step mode append each step's V to it until ``reset()`` (SpikingJelly 2.0).
        w_init: initial W for two-state neurons.
    """

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

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """``BaseNode(definition, params, v_threshold, v_reset, surrogate_function, detach_reset,
        step_mode, backend, store_v_seq, w_init)`` for a :class:`~spikefuse.definitions.NeuronDef`
        (every backend); a subclass that overrides ``neuronal_charge`` (SpikingJelly's way) and
        passes no definition takes SpikingJelly's ``(v_threshold, v_reset, surrogate_function,
        detach_reset, step_mode, backend, store_v_seq)`` instead (torch backend)."""
        if hasattr(type(self), "single_step_functional_forward"):
            raise SpikefuseError(
                f"{type(self).__name__} defines single_step_functional_forward (SpikingJelly "
                "2.0's functional neuron API), which spikefuse does not run: override "
                "neuronal_charge with torch code (a neuron.SimpleBaseNode subclass) or write the "
                "charge as a NeuronDef (see the README's 'Defining your own neuron')"
            )
        given_definition = (args and isinstance(args[0], defs.NeuronDef)) or "definition" in kwargs
        if type(self).overrides_torch_code() and not given_definition:
            self._init_torch_code(*args, **kwargs)
        else:
            self._init_definition(*args, **kwargs)

    # The torch-code hooks a subclass overrides, found once per class (forward checks it).
    _torch_code_hooks: tuple[str, ...] = ()

    _overrides_step_forward = False
    # forward methods a subclass overrides (fused blocks, which run kernels, refuse them)
    _overridden_forward: tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._torch_code_hooks = tuple(
            hook for hook in TORCH_CODE_HOOKS if getattr(cls, hook) is not getattr(BaseNode, hook)
        )
        cls._overridden_forward = tuple(
            name
            for name in (*_STEP_FORWARDS, "forward", "_forward", "_forward_in_mode", "__call__")
            if getattr(cls, name) is not getattr(BaseNode, name)
        )
        # A subclass overriding these is run through them, as SpikingJelly's forward does.
        cls._overrides_step_forward = any(n in cls._overridden_forward for n in _STEP_FORWARDS)

    @classmethod
    def overrides_torch_code(cls) -> bool:
        """Whether the class overrides ``neuronal_charge``/``neuronal_fire``/``neuronal_reset``."""
        return bool(cls._torch_code_hooks)

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
        self.backend, self.store_v_seq = _backend_and_store_v_seq(
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
        _check_finite(type(self).__name__, "w_init", w_init)
        runs_in_kernels(surrogate_function)  # validates it (torch-code surrogates: torch only)
        self.definition = definition
        for name, value in params.items():
            setattr(self, name, value)
        self.v_threshold = v_threshold
        self.v_reset = v_reset
        self.surrogate_function = surrogate_function
        self.detach_reset = detach_reset
        self.backend, self.store_v_seq = _backend_and_store_v_seq(
            self, backend, store_v_seq, "auto"
        )
        self._constants = None
        self.constants()  # validates the parameters now, not at the first call
        self._update_program()  # from here on, every assignment is validated (__setattr__)
        self.last_backend = None
        self.register_memory("v", 0.0 if v_reset is None else float(v_reset))
        if definition.adaptive:
            self.register_memory("w", float(w_init))
        self.set_memory("v_seq", None)  # not a memory: the user's attribute unless store_v_seq

    @property
    def supported_backends(self) -> tuple[str, ...]:
        """The names ``backend`` accepts (SpikingJelly's attribute): all for a NeuronDef neuron,
        'auto' and 'torch' for a neuron whose charge is torch code."""
        return TORCH_CODE_BACKENDS if type(self).overrides_torch_code() else BACKEND_NAMES

    @property
    def torch_code(self) -> str | None:
        """Why this neuron runs as a per-step torch loop (torch backend only), or None when it
        runs from its NeuronDef on any backend."""
        if self._torch_code_hooks:
            return f"it overrides {', '.join(self._torch_code_hooks)} with torch code"
        surrogate = self.surrogate_function
        if isinstance(surrogate, Surrogate) and getattr(surrogate, "spiking", True):
            return None  # the common case, checked first: forward asks on every call
        if not runs_in_kernels(surrogate):
            return (
                f"its surrogate_function ({type(self.surrogate_function).__name__}) is torch code "
                "(not a spikefuse.surrogate.Surrogate in spiking mode)"
            )
        return None

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

    @property
    def backend(self) -> str:
        return self._backend

    @backend.setter
    def backend(self, name: str) -> None:
        if name not in BACKEND_NAMES:
            raise SpikefuseError(f"unknown backend {name!r}; choose one of {BACKEND_NAMES}")
        reason = self.torch_code
        if name not in self.supported_backends and reason is not None:  # reason: not None here
            raise self._torch_code_error(reason)
        self._backend = backends.canonical_name(name)

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
            _check_threshold_and_reset(type(self).__name__, *(current[n] for n in names))

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

    def surrogate_changed(self) -> None:
        """Called by the surrogate when one of its hyper-parameters or its spiking mode
        changes: rebuild the program if the change reaches it."""
        kernels = runs_in_kernels(self.surrogate_function)
        program = self.program
        if program is None:
            stale = kernels
        else:
            stale = not kernels or program.surrogate_key != self.surrogate_function.key
        if stale:
            self._update_program()

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if isinstance(self.surrogate_function, Surrogate):  # it does not pickle its users
            self.surrogate_function.add_user(self)

    # Whether reset() drops v_seq (SpikingJelly's BaseNode does; its SimpleBaseNode has no v_seq)
    _resets_v_seq = True

    def reset(self) -> None:
        """Restore V (and W) to their defaults and drop ``v_seq``, as SpikingJelly's
        ``BaseNode.reset`` does; other attributes (a user's ``s_seq``, ...) are left alone."""
        super().reset()
        if self._resets_v_seq:
            self.set_memory("v_seq", None)

    def detach(self) -> None:
        """As :meth:`MemoryModule.detach`, and a ``v_seq`` tensor is detached too."""
        super().detach()
        if isinstance(self.v_seq, Tensor):
            self.set_memory("v_seq", self.v_seq.detach())

    def __getstate__(self) -> dict[str, Any]:
        """As :meth:`MemoryModule.__getstate__`, with a recorded ``v_seq`` detached too."""
        state = super().__getstate__()
        if isinstance(state.get("v_seq"), Tensor):
            state["v_seq"] = state["v_seq"].detach()
        return state

    def _validated_constants(self, changes: Mapping[str, Any]) -> list[float]:
        """V_th, V_reset (0 for soft reset) and the non-learnable parameters, with ``changes``
        applied, validated (finite, lower bounds, V_th > V_reset under hard reset)."""
        current: dict[str, Any] = {"v_threshold": self.v_threshold, "v_reset": self.v_reset}
        names = [p for p in self._neuron_def().params if p not in self.learnable_params]
        current.update({p: getattr(self, p) for p in names})
        current.update(changes)
        hard = current["v_reset"] is not None
        _check_threshold_and_reset(type(self).__name__, current["v_threshold"], current["v_reset"])
        values = [current["v_threshold"], current["v_reset"] if hard else 0.0]
        values += [current[p] for p in names]
        for name in names:
            _check_finite(type(self).__name__, name, current[name])
            bound = self.lower_bounds.get(name)
            if bound is not None:
                _check_above(type(self).__name__, name, current[name], bound, str(bound))
        for name in self.at_least_v_reset if hard else ():
            if not current[name] >= values[1]:
                raise SpikefuseError(
                    f"{type(self).__name__}: with hard reset {name} must be >= v_reset (got "
                    f"{current[name]} < {values[1]})"
                )
        return [float(v) for v in values]

    def constants(self) -> list[float]:
        """V_th, V_reset (0 for soft reset) and the non-learnable parameters, validated.

        Validated again on every assignment of one of them (see ``__setattr__``)."""
        constants = self.__dict__["_constants"] = self._validated_constants({})
        return constants

    def learnable_values(
        self, device: torch.device, dtype: torch.dtype = torch.float32
    ) -> Tensor | None:
        """Learnable parameter values [P] in ``dtype`` (the compute dtype: float32, or float64
        for float64 input), in definition order, or a 0-dim tensor when P = 1; None by
        default."""
        return None

    # ---- forward ---------------------------------------------------------------------------------
    def _check_input(self, x: Tensor) -> Tensor:
        name = type(self).__name__
        if not isinstance(x, Tensor):
            raise SpikefuseError(f"{name}: input must be a torch.Tensor, got {type(x).__name__}")
        if not x.dtype.is_floating_point:
            raise SpikefuseError(f"{name}: input dtype must be floating point, got {x.dtype}")
        if self.step_mode == "m":
            if x.dim() < 2:
                raise SpikefuseError(
                    f"{name}: step_mode='m' needs input [T, N, *], got shape {tuple(x.shape)}"
                )
            if x.shape[0] == 0:
                raise SpikefuseError(f"{name}: the input has T = 0 time steps")
            return x
        if x.dim() < 1:
            raise SpikefuseError(f"{name}: step_mode='s' needs input [N, *], got a scalar")
        return x.unsqueeze(0)

    def _state(self, name: str, x_seq: Tensor) -> tuple[Tensor | None, float]:
        """(state tensor, 0.0), or (None, value) while the state is still a float for all."""
        value = getattr(self, name)
        if not isinstance(value, Tensor):
            return None, float(value)
        shape, dtype = x_seq.shape[1:], compute_dtype(x_seq.dtype)
        if value.shape != shape or value.device != x_seq.device or value.dtype != dtype:
            raise SpikefuseError(
                f"{type(self).__name__}: state {name} is {tuple(value.shape)} {value.dtype} on "
                f"{value.device}, but this input needs {tuple(shape)} {dtype} on {x_seq.device} "
                "(states of float16/bfloat16 input are float32: the neurons compute in float32); "
                "call spikefuse.functional.reset_net(net) after changing batch size, device or dtype"
            )
        return value, 0.0

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> BaseNode:
        """As :meth:`MemoryModule._apply`; where the neuron runs from its NeuronDef (not torch
        code), its states stay in the compute dtype: ``.half()`` moves V but keeps it float32,
        unrounded (those neurons compute 16-bit input in float32)."""
        states = {name: self.__dict__.get(name) for name in ("v", "w")}
        super()._apply(fn, recurse)
        if self.definition is not None and self.torch_code is None:
            for name, before in states.items():
                moved = self.__dict__.get(name)
                if isinstance(before, Tensor) and isinstance(moved, Tensor):
                    dtype = compute_dtype(moved.dtype)
                    if moved.dtype != dtype:
                        self.set_memory(name, before.to(device=moved.device, dtype=dtype))
        return self

    def resolve_backend(self, x_seq: Tensor) -> str:
        """The backend that runs for this input (raises if an explicit one cannot); see
        :func:`spikefuse.backends.resolve`. Logs the choice when it changes."""
        chosen = backends.resolve(self.backend, x_seq, type(self).__name__)
        if chosen != self.last_backend and not torch.compiler.is_compiling():
            log.info("%s: backend=%r runs %s", type(self).__name__, self.backend, chosen)
            self.last_backend = chosen
        return chosen

    def _check_no_nan(self, x_seq: Tensor, v0: Tensor | None, w0: Tensor | None = None) -> None:
        """Under ``torch.autograd.detect_anomaly`` (only: this reads a flag back from the
        device), NaN in the input or a state is an error instead of NaN spikes."""
        for what, t in (("input", x_seq), ("state v", v0), ("state w", w0)):
            if t is not None and bool(t.isnan().any()):
                raise SpikefuseError(
                    f"{type(self).__name__}: the {what} contains NaN (raised because autograd "
                    "anomaly detection is on; without it, NaN membrane potentials give NaN spikes)"
                )

    def forward(self, x: Tensor) -> Tensor:
        if self._overrides_step_forward:  # SpikingJelly dispatches forward to these methods
            return MemoryModule.forward(self, x)
        return self._forward(x)

    def _forward(self, x: Tensor) -> Tensor:
        """The neuron itself in the current step mode (torch code or the backend's ops)."""
        reason = self.torch_code
        if reason is not None:
            return self._torch_code_forward(x, reason)
        program = cast(NeuronProgram, self.program)  # not torch code: the program exists
        adaptive = program.definition.adaptive
        x_seq = self._check_input(x)
        constants = self._constants or self.constants()
        backend = self.resolve_backend(x_seq)
        v0, v_init = self._state("v", x_seq)
        w0, w_init = self._state("w", x_seq) if adaptive else (None, 0.0)
        if not torch.compiler.is_compiling() and torch.is_anomaly_enabled():
            self._check_no_nan(x_seq, v0, w0)
        learnable = self.learnable_values(x_seq.device, compute_dtype(x_seq.dtype))
        if learnable is not None and learnable.device != x_seq.device:
            raise SpikefuseError(
                f"{type(self).__name__}: parameters are on {learnable.device} but the input is on "
                f"{x_seq.device}; move the module with .to(device)"
            )
        multi_step = self.step_mode == "m"
        store_v_seq = self.store_v_seq and multi_step
        init = [v_init, w_init]
        spikes, v_seq, v_last, w_last = run_neuron(
            program, backend, x_seq, v0, w0, learnable, constants, init, store_v_seq
        )
        self.set_memory("v", v_last)
        if adaptive:
            self.set_memory("w", w_last)
        if store_v_seq:
            self.set_memory("v_seq", v_seq)
        elif self.store_v_seq:  # single-step
            self._append_v_seq(v_last)
        return spikes if multi_step else spikes[0]

    def _append_v_seq(self, v: Tensor) -> None:
        """Single-step mode with ``store_v_seq``: append this step's V (after the reset) to
        ``v_seq`` [steps since reset(), N, *], as SpikingJelly 2.0 does; a new sequence starts
        where the shape, device or dtype changes. Each step copies the sequence (O(T^2): for
        monitoring)."""
        step, seq = v.unsqueeze(0), self.v_seq
        if seq is not None and (seq.shape[1:], seq.device, seq.dtype) == (
            step.shape[1:],
            step.device,
            step.dtype,
        ):
            self.set_memory("v_seq", torch.cat((seq, step)))
        else:
            self.set_memory("v_seq", step.clone())

    def single_step_forward(self, x: Tensor) -> Tensor:
        """One step ``[N, *] -> [N, *]`` whatever ``step_mode`` is (SpikingJelly's method).

        Torch-code neurons: ``neuronal_charge`` (V <- H), ``neuronal_adaptation`` (two-state
        NeuronDefs), ``neuronal_fire`` (S = surrogate(H - V_th)), ``neuronal_reset``."""
        if self.torch_code is None:
            return self._forward_in_mode(x, "s")
        spike = self._torch_code_step(x)
        if self.store_v_seq:
            self._append_v_seq(self.v)
        return spike

    def _torch_code_step(self, x: Tensor) -> Tensor:
        """One step of a torch-code neuron (:meth:`single_step_forward` without ``v_seq``)."""
        self.v_float_to_tensor(x)
        self.neuronal_charge(x)
        if self.definition is not None and self.definition.adaptive:
            self.neuronal_adaptation()
        spike = self.neuronal_fire()
        self.neuronal_reset(spike)
        return spike

    def multi_step_forward(self, x_seq: Tensor) -> Tensor:
        """A sequence ``[T, N, *] -> [T, N, *]`` whatever ``step_mode`` is (SpikingJelly's
        method; runs the fused multi-step path, except for torch-code neurons, which loop over
        :meth:`single_step_forward`)."""
        if self.torch_code is None:
            return self._forward_in_mode(x_seq, "m")
        # a subclass's own single_step_forward runs at every step (SpikingJelly's loop);
        # otherwise the step itself, without single-step v_seq appends (O(T^2) copies)
        overridden = "single_step_forward" in self._overridden_forward
        step = self.single_step_forward if overridden else self._torch_code_step
        spikes, v_seq = [], []
        for x in x_seq:
            spikes.append(step(x))
            if self.store_v_seq:
                v_seq.append(self.v)
        if self.store_v_seq:
            self.set_memory("v_seq", torch.stack(v_seq))
        return torch.stack(spikes)

    def _torch_code_forward(self, x: Tensor, reason: str) -> Tensor:
        if self.backend == "cuda":
            raise self._torch_code_error(reason)
        self._check_input(x)
        if self.last_backend != "torch" and not torch.compiler.is_compiling():
            log.info("%s: runs torch code on the torch backend (%s)", type(self).__name__, reason)
            self.last_backend = "torch"
        if self.step_mode == "m":
            return self.multi_step_forward(x)
        return self.single_step_forward(x)

    # ---- SpikingJelly's torch-code hooks (used only by torch-code neurons) ---------------------
    def neuronal_charge(self, x: Tensor) -> None:
        """V <- H[t] = f(V[t-1], X[t]). Override with torch code to define a neuron the
        SpikingJelly way (torch backend); the default evaluates the NeuronDef's charge."""
        if self.definition is None:
            raise NotImplementedError(f"{type(self).__name__} must implement neuronal_charge")
        charge = _torch_equations(self.definition)[0]
        w = self.w if self.definition.adaptive else 0.0
        self.v = charge(self.v, x, w, 0.0, *self._equation_params(x))

    def neuronal_adaptation(self) -> None:
        """W <- Z[t] = g(H[t], W[t-1]) of a two-state NeuronDef (V holds H here)."""
        adaptation = _torch_equations(self.definition)[1]
        self.w = adaptation(self.v, 0.0, self.w, self.v, *self._equation_params(self.v))

    def neuronal_fire(self) -> Tensor:
        """S[t] = surrogate_function(H[t] - V_th) (V holds H here)."""
        return self.surrogate_function(self.v - self.v_threshold)

    def neuronal_reset(self, spike: Tensor) -> None:
        """Hard: V = (1 - S) H + S V_reset; soft: V = H - S V_th (S detached if detach_reset);
        two-state NeuronDefs add the jump to W with the undetached S."""
        spike_d = spike.detach() if self.detach_reset else spike
        if self.v_reset is None:
            self.v = self.v - spike_d * self.v_threshold
        else:
            self.v = (1.0 - spike_d) * self.v + spike_d * self.v_reset
        if self.definition is not None and self.definition.adaptive:
            jump = _torch_equations(self.definition)[2]
            self.w = (
                self.w + jump(self.v, 0.0, self.w, self.v, *self._equation_params(spike)) * spike
            )

    def v_float_to_tensor(self, x: Tensor) -> None:
        """Turn a float state (after reset) into a tensor like ``x``; a tensor state must
        already match ``x`` (else call ``functional.reset_net``)."""
        for name in (
            ("v", "w") if self.definition is not None and self.definition.adaptive else ("v",)
        ):
            value = getattr(self, name)
            if not isinstance(value, Tensor):
                self.set_memory(name, torch.full_like(x, float(value)))
            elif (value.shape, value.dtype, value.device) != (x.shape, x.dtype, x.device):
                raise SpikefuseError(
                    f"{type(self).__name__}: state {name} is {tuple(value.shape)} {value.dtype} on "
                    f"{value.device}, but this input needs {tuple(x.shape)} {x.dtype} on "
                    f"{x.device}; call spikefuse.functional.reset_net(net) after changing batch "
                    "size, device or dtype"
                )

    def _equation_params(self, like: Tensor) -> list:
        """Values of the definition's ``all_params`` (learnable ones as 0-dim tensors in
        ``like``'s compute dtype: a float32 value with 16-bit input, as SpikingJelly's PLIF
        takes its sigmoid of a float32 w)."""
        constants = iter(self._constants or self.constants())
        learnable = self.learnable_values(like.device, compute_dtype(like.dtype))
        learned = iter(learnable.reshape(-1).unbind(0)) if learnable is not None else iter(())
        return [
            next(learned) if p in self.learnable_params else next(constants)
            for p in self._neuron_def().all_params
        ]

    def _forward_in_mode(self, x: Tensor, mode: str) -> Tensor:
        if self._step_mode == mode:
            return self._forward(x)
        saved, self._step_mode = self._step_mode, mode
        try:
            return self._forward(x)
        finally:
            self._step_mode = saved

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


class SimpleBaseNode(BaseNode):
    """SpikingJelly 2.0's base class for neurons written in torch code: subclasses implement
    ``neuronal_charge(self, x)`` (V <- H from X); fire and reset are BaseNode's. As in
    SpikingJelly, V starts at 0 (not at V_reset) and there is no ``store_v_seq``. Runs on the
    torch backend as a per-step loop with autograd (see :class:`BaseNode`). ``reset()`` leaves
    ``v_seq`` alone (SpikingJelly's SimpleBaseNode does not manage it)."""

    _resets_v_seq = False

    def __init__(
        self,
        v_threshold: float = 1.0,
        v_reset: float | None = 0.0,
        surrogate_function: Any = None,
        detach_reset: bool = False,
        step_mode: str = "s",
    ) -> None:
        self._init_torch_code(
            v_threshold, v_reset, surrogate_function, detach_reset, step_mode, initial_v=0.0
        )

    def neuronal_charge(self, x: Tensor) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement neuronal_charge")


@functools.lru_cache(maxsize=64)
def _torch_equations(definition: defs.NeuronDef) -> tuple[Callable[..., Any], ...]:
    """charge, adaptation and jump of ``definition`` as torch functions of
    (v, x, w, h, *all_params), for torch-code neurons."""
    exprs = (definition.charge_expr, definition.adaptation_expr, definition.jump_expr)
    return tuple(defs.torch_function(definition, e) for e in exprs)


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
        _check_finite("IzhikevichNode", "w_rest", w_rest)
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
        _check_finite("IzhikevichNode", "w_rest", value)
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
        _check_finite("SimpleLIFNode", "tau", tau)
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


class _OnlineLIFNode(LIFNode):
    """A single-step LIFNode for online training through time: in training, V is detached
    from the earlier steps before each step, so backward never reaches back in time and the
    memory of a training step does not grow with T (call ``loss.backward()`` and the optimiser
    at every step). In eval mode it is a plain LIFNode. Only ``step_mode='s'``."""

    def __init__(
        self,
        tau: float,
        decay_input: bool,
        v_threshold: float,
        v_reset: float | None,
        surrogate_function: Surrogate | None,
        detach_reset: bool,
        step_mode: str,
        backend: str,
        store_v_seq: bool,
    ) -> None:
        if step_mode != "s":
            raise SpikefuseError(
                f"{type(self).__name__}: step_mode must be 's' (online training runs one step "
                f"at a time to keep memory constant in T), got {step_mode!r}"
            )
        super().__init__(
            tau,
            decay_input,
            v_threshold,
            v_reset,
            surrogate_function,
            detach_reset,
            step_mode,
            backend,
            store_v_seq,
        )

    def supported_step_mode(self) -> tuple[str, ...]:
        return ("s",)

    def _online_step(self, x: Tensor) -> Tensor:
        if self.training and isinstance(self.v, Tensor):
            self.set_memory("v", self.v.detach())  # no gradient path to earlier steps
        return BaseNode.forward(self, x)


class SLTTLIFNode(_OnlineLIFNode):
    """SLTT's LIF: a LIFNode whose V is detached from earlier steps in training (see
    :class:`_OnlineLIFNode`); returns the spikes [N, *]. SpikingJelly's defaults
    (``decay_input=True``, ``v_reset=0``, ``detach_reset=True``)."""

    def __init__(
        self,
        tau: float = 2.0,
        decay_input: bool = True,
        v_threshold: float = 1.0,
        v_reset: float | None = 0.0,
        surrogate_function: Surrogate | None = None,
        detach_reset: bool = True,
        step_mode: str = "s",
        backend: str = "auto",
        store_v_seq: bool = False,
    ) -> None:
        super().__init__(
            tau,
            decay_input,
            v_threshold,
            v_reset,
            surrogate_function,
            detach_reset,
            step_mode,
            backend,
            store_v_seq,
        )

    def forward(self, x: Tensor) -> Tensor:
        return self._online_step(x)


class OTTTLIFNode(_OnlineLIFNode):
    """OTTT's LIF (SpikingJelly's defaults: ``decay_input=False``, soft reset,
    ``detach_reset=True``). In training V is detached from earlier steps and the neuron also
    keeps a presynaptic trace, ``trace[t] = trace[t-1] (1 - 1/tau) + S[t]`` (no gradient); it
    returns ``[spike, trace]`` (a list, which :class:`spikefuse.layer.OTTTSequential` passes
    on: the next layer's weights get their gradient from the trace). In eval mode it returns
    the spikes only and leaves the trace alone."""

    trace: Tensor | None

    def __init__(
        self,
        tau: float = 2.0,
        decay_input: bool = False,
        v_threshold: float = 1.0,
        v_reset: float | None = None,
        surrogate_function: Surrogate | None = None,
        detach_reset: bool = True,
        step_mode: str = "s",
        backend: str = "auto",
        store_v_seq: bool = False,
    ) -> None:
        super().__init__(
            tau,
            decay_input,
            v_threshold,
            v_reset,
            surrogate_function,
            detach_reset,
            step_mode,
            backend,
            store_v_seq,
        )
        self.register_memory("trace", None)

    @staticmethod
    def track_trace(spike: Tensor, trace: Tensor, tau: float) -> Tensor:
        """trace (1 - 1/tau) + spike, without gradient."""
        with torch.no_grad():
            return trace * (1.0 - 1.0 / tau) + spike

    def forward(self, x: Tensor) -> Tensor | list[Tensor]:  # type: ignore[override]
        spike = self._online_step(x)
        if not self.training:
            return spike
        trace = torch.zeros_like(spike) if self.trace is None else self.trace
        self.set_memory("trace", self.track_trace(spike, trace, cast(float, self.tau)))
        return [spike, cast(Tensor, self.trace)]


# ---- non-spiking neurons --------------------------------------------------------------------------
NON_SPIKING_DECODES = (None, "max-mem", "max-abs-mem", "mean-mem", "last_mem")


def decode_membrane(v_seq: list[Tensor], decode: str | None) -> Tensor | list[Tensor]:
    """A non-spiking neuron's output from its membrane potentials ``v_seq`` (T tensors [N, *]).

    ``None``: ``v_seq`` itself (a list); ``'last_mem'``: V[T-1]; ``'max-mem'``: max_t V[t];
    ``'mean-mem'``: mean_t V[t]; ``'max-abs-mem'``: whichever of max_t V[t] and min_t V[t] is
    larger in magnitude (the minimum on a tie), each [N, *]. The maxima take SpikingJelly's
    ``torch.max(...).values``, so the gradient reaches one step per element as there."""
    if decode is None:
        return v_seq
    if decode == "last_mem":
        return v_seq[-1]
    stacked = torch.stack(v_seq)
    if decode == "mean-mem":
        return stacked.mean(0)
    high = stacked.max(0).values
    if decode == "max-mem":
        return high
    low = stacked.min(0).values
    # SpikingJelly adds high * mask + low * ~mask: the same values and gradients for finite V
    return torch.where(high.abs() > low.abs(), high, low)


class NonSpikingBaseNode(nn.Module, MultiStepModule):
    """A neuron that never fires: it integrates a sequence ``x_seq`` [T, N, *] into its
    membrane potential V, which starts at 0 on every call, and returns V (see
    :func:`decode_membrane` for ``decode``). Subclasses define the charge
    :meth:`neuronal_charge`, which updates ``self.v`` from one step of input.

    A plain torch module, as SpikingJelly's: with no threshold, spike or reset there is nothing
    for a :class:`~spikefuse.NeuronDef` and the fused kernels to do, and the decodings need the
    whole sequence. Multi-step only (``step_mode`` is 'm', as SpikingJelly's
    ``base.MultiStepModule``; ``set_step_mode(net, 's')`` refuses it where SpikingJelly skips
    it). No parameters or buffers, so the ``state_dict`` is empty; after a call ``v`` holds the
    last potential [N, *] (not a memory: ``reset_net`` leaves it, the next call starts over).
    Differences: ``decode`` other than those of :data:`NON_SPIKING_DECODES` is refused (there it
    returns the list), the input is checked, and the repr shows the arguments.
    """

    v: Tensor

    def __init__(self, decode: str | None = None) -> None:
        super().__init__()
        self.decode = decode

    @property
    def decode(self) -> str | None:
        """How :meth:`forward` decodes the potentials: one of :data:`NON_SPIKING_DECODES`."""
        return self._decode

    @decode.setter
    def decode(self, value: str | None) -> None:
        if value not in NON_SPIKING_DECODES:
            raise SpikefuseError(
                f"{type(self).__name__}: decode must be one of {NON_SPIKING_DECODES}, got {value!r}"
            )
        self._decode = value

    def neuronal_charge(self, x: Tensor) -> None:
        """Update ``self.v`` from one step of input ``x`` [N, *]."""
        raise NotImplementedError(f"{type(self).__name__} must implement neuronal_charge")

    def _check_input(self, x_seq: Tensor) -> None:
        name = type(self).__name__
        if not isinstance(x_seq, Tensor):
            raise SpikefuseError(
                f"{name}: input must be a torch.Tensor, got {type(x_seq).__name__}"
            )
        if not x_seq.dtype.is_floating_point:
            raise SpikefuseError(f"{name}: input dtype must be floating point, got {x_seq.dtype}")
        if x_seq.dim() < 1 or x_seq.shape[0] == 0:
            raise SpikefuseError(
                f"{name}: input must be a sequence [T, N, *] with T >= 1, got shape "
                f"{tuple(x_seq.shape)}"
            )

    def forward(self, x_seq: Tensor) -> Tensor | list[Tensor]:
        """``x_seq`` [T, N, *] -> the decoded potentials [N, *], or V[t] for each t (a list of
        T tensors [N, *]) when ``decode`` is None."""
        self._check_input(x_seq)
        self.v = torch.full_like(x_seq[0].data, fill_value=0.0)
        v_seq = []
        for t in range(x_seq.shape[0]):
            self.neuronal_charge(x_seq[t])
            v_seq.append(self.v)
        return decode_membrane(v_seq, self.decode)

    def __getstate__(self) -> dict[str, Any]:
        """As :meth:`MemoryModule.__getstate__`: ``v`` detached, so a trained model pickles."""
        state = self.__dict__.copy()
        if isinstance(state.get("v"), Tensor):
            state["v"] = state["v"].detach()
        return state

    def extra_repr(self) -> str:
        return f"decode={self.decode!r}"


class NonSpikingIFNode(NonSpikingBaseNode):
    """Non-spiking IF neuron: ``V[t] = V[t-1] + X[t]``, V[-1] = 0 (SpikingJelly's)."""

    def __init__(self, decode: str | None = None) -> None:
        super().__init__(decode)

    def neuronal_charge(self, x: Tensor) -> None:
        self.v = self.v + x


class NonSpikingLIFNode(NonSpikingBaseNode):
    """Non-spiking LIF neuron: ``V[t] = V[t-1] + (X[t] - V[t-1]) / tau``, V[-1] = 0
    (SpikingJelly's, computed in that order). ``tau`` is a finite float > 0 (checked: 0 would
    divide by zero; SpikingJelly takes any value)."""

    def __init__(self, tau: float = 2.0, decode: str | None = None) -> None:
        super().__init__(decode)
        self.tau = tau

    @property
    def tau(self) -> float:
        """The membrane time constant."""
        return self._tau

    @tau.setter
    def tau(self, value: float) -> None:
        if not (is_finite_real(value) and value > 0):
            raise SpikefuseError(
                f"{type(self).__name__}: tau must be a finite float > 0, got {value!r}"
            )
        self._tau = value

    def neuronal_charge(self, x: Tensor) -> None:
        self.v = self.v + (x - self.v) / self.tau

    def extra_repr(self) -> str:
        return f"tau={self.tau}, {super().extra_repr()}"
