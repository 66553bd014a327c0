"""The spiking neuron layer :class:`BaseNode` (any NeuronDef, or SpikingJelly-style torch
code) and :class:`SimpleBaseNode`."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor

from .. import backends
from .. import definitions as defs
from ..backends import BACKEND_NAMES, compute_dtype
from ..errors import SpikefuseError
from ..ops import run_neuron
from ..program import NeuronProgram
from ..surrogate import Surrogate, runs_in_kernels
from ._config import _ConfiguredNode
from ._memory import MemoryModule

log = logging.getLogger("spikefuse")
# Methods a SpikingJelly-style subclass overrides with torch code (then only the torch backend
# runs it, as a per-step loop with autograd through the user's code).
TORCH_CODE_HOOKS = ("neuronal_charge", "neuronal_fire", "neuronal_reset")
_STEP_FORWARDS = ("single_step_forward", "multi_step_forward")
TORCH_CODE_BACKENDS = ("auto", "torch")


class BaseNode(_ConfiguredNode):
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

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> _ConfiguredNode:
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
