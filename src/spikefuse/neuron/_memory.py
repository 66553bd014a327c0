"""Step-mode mixins and :class:`MemoryModule`, the stateful module class of every neuron and
stateful layer (also SpikingJelly's ``base`` classes, see :mod:`spikefuse.base`)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import SpikefuseError
from ..functional import STEP_MODES, check_sequence


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
    assignment (SpikingJelly's subclasses rarely set it) and refuses the other mode.

    A subclass with ``_reads_before_assigned = False`` has no ``step_mode`` until one is
    assigned, as SpikingJelly's one-mode modules: reading it raises ``AttributeError``."""

    _only_mode: str
    _reads_before_assigned: bool = True

    @property
    def step_mode(self) -> str:
        mode = self.__dict__.get("_step_mode")
        if mode is not None:
            return mode
        if self._reads_before_assigned:
            return self._only_mode
        raise AttributeError(f"{type(self).__name__} has no step_mode until one is assigned")

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
        """Declare a state variable; ``value`` is restored by :meth:`reset`. A name the module
        already has (an attribute, parameter, buffer, submodule or memory) raises
        ``AssertionError``, as in SpikingJelly."""
        if hasattr(self, name):
            # SpikingJelly's assert (its type and words), raised so that python -O keeps it
            raise AssertionError(
                f"{name} has been set as a member variable! ({type(self).__name__} already has "
                f"an attribute {name!r}; a memory needs a new name)"
            )
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

    def __delattr__(self, name: str) -> None:
        """``del module.<memory>`` removes the memory (its value and reset value), as in
        SpikingJelly; other names are deleted as by ``nn.Module``."""
        defaults = self.__dict__.get("_memory_defaults")
        if defaults is not None and name in defaults:
            del defaults[name]
            self.__dict__.pop(name, None)
        else:
            super().__delattr__(name)

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
