"""SpikingJelly's monitors: record module outputs, inputs, attributes or gradients via hooks.

``OutputMonitor(net, instance=neuron.LIFNode)`` records the output of every module of ``net``
that is an ``instance`` (default: the class of ``net`` itself) at every call, in call order;
``monitor.records`` is the flat list, ``monitor['name']`` the records of one module,
``monitor.monitored_layers`` the names. ``function_on_*`` maps each value before it is kept
(e.g. ``lambda s: s.mean().item()`` for firing rates). As in SpikingJelly, a one-element tuple
of inputs or gradients is unpacked, and a monitor is a context manager: leaving ``with
OutputMonitor(net, ...) as mon:`` calls :meth:`~BaseMonitor.close` (the hooks go, the records
stay).

A fused model (:func:`spikefuse.fuse`) has no neuron modules left in its fused chains (they are
``FusedAway``): monitor the unfused model, or monitor the ``FusedBlock`` outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Any, Literal, Self

from torch import nn
from torch.utils.hooks import RemovableHandle

from .errors import SpikefuseError

__all__ = [
    "AttributeMonitor",
    "BaseMonitor",
    "GradInputMonitor",
    "GradOutputMonitor",
    "InputMonitor",
    "OutputMonitor",
]

Instance = type | tuple[type, ...] | None


def _identity(x: Any) -> Any:
    return x


def _unpack_len1_tuple(x: Any) -> Any:
    return x[0] if isinstance(x, tuple) and len(x) == 1 else x


class BaseMonitor:
    """Records and hooks shared by the monitors (SpikingJelly's ``BaseMonitor``)."""

    def __init__(self) -> None:
        self.hooks: list[RemovableHandle] = []
        self.monitored_layers: list[str] = []
        self.records: list[Any] = []
        self.name_records_index: dict[str, list[int]] = {}
        self._enable = True

    def __getitem__(self, i: int | str) -> Any:
        if isinstance(i, int):
            return self.records[i]
        if isinstance(i, str):
            return [self.records[index] for index in self.name_records_index[i]]
        raise SpikefuseError(f"a monitor is indexed by int or layer name, got {i!r}")

    def _monitor_modules(self, net: nn.Module, instance: Instance) -> list[tuple[str, nn.Module]]:
        if not isinstance(net, nn.Module):
            raise SpikefuseError(f"{type(self).__name__}: net must be an nn.Module, got {net!r}")
        kinds: Any = type(net) if instance is None else instance
        modules: list[tuple[str, nn.Module]] = [
            (name, m) for name, m in net.named_modules() if isinstance(m, kinds)
        ]
        self.monitored_layers.extend(name for name, _ in modules)
        self.name_records_index.update((name, []) for name, _ in modules)
        return modules

    def _record(self, name: str, value: Any) -> None:
        self.name_records_index[name].append(len(self.records))
        self.records.append(value)

    def clear_recorded_data(self) -> None:
        self.records.clear()
        for indices in self.name_records_index.values():
            indices.clear()

    def enable(self) -> None:
        self._enable = True

    def disable(self) -> None:
        self._enable = False

    def is_enable(self) -> bool:
        return self._enable

    def remove_hooks(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()

    def close(self) -> None:
        """Stop recording and remove every hook for good, keeping the records (calling it again
        does nothing more; monitor anew with a new monitor)."""
        self.disable()
        self.remove_hooks()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> Literal[False]:
        """Close the monitor; an exception raised in the block propagates."""
        self.close()
        return False

    def __del__(self) -> None:
        # __del__ also runs when __init__ raised before the hooks existed
        if "hooks" in self.__dict__:
            self.close()


class OutputMonitor(BaseMonitor):
    """Records ``function_on_output(output)`` of the monitored modules at every call."""

    def __init__(
        self,
        net: nn.Module,
        instance: Instance = None,
        function_on_output: Callable[[Any], Any] = _identity,
    ) -> None:
        super().__init__()
        self.function_on_output = function_on_output
        for name, module in self._monitor_modules(net, instance):
            self.hooks.append(module.register_forward_hook(self.create_hook(name)))

    def create_hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            if self.is_enable():
                self._record(name, self.function_on_output(_unpack_len1_tuple(output)))

        return hook


class InputMonitor(BaseMonitor):
    """Records ``function_on_input(input)`` of the monitored modules at every call."""

    def __init__(
        self,
        net: nn.Module,
        instance: Instance = None,
        function_on_input: Callable[[Any], Any] = _identity,
    ) -> None:
        super().__init__()
        self.function_on_input = function_on_input
        for name, module in self._monitor_modules(net, instance):
            self.hooks.append(module.register_forward_hook(self.create_hook(name)))

    def create_hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            if self.is_enable():
                self._record(name, self.function_on_input(_unpack_len1_tuple(inputs)))

        return hook


class AttributeMonitor(BaseMonitor):
    """Records ``function_on_attribute(getattr(module, attribute_name))`` before
    (``pre_forward``) or after every call (e.g. a neuron's ``v``)."""

    def __init__(
        self,
        attribute_name: str,
        pre_forward: bool,
        net: nn.Module,
        instance: Instance = None,
        function_on_attribute: Callable[[Any], Any] = _identity,
    ) -> None:
        super().__init__()
        if not isinstance(attribute_name, str):
            raise SpikefuseError(
                f"AttributeMonitor: attribute_name must be a str, got {attribute_name!r}"
            )
        self.attribute_name = attribute_name
        self.function_on_attribute = function_on_attribute
        for name, module in self._monitor_modules(net, instance):
            if pre_forward:
                self.hooks.append(module.register_forward_pre_hook(self.create_hook(name)))
            else:
                self.hooks.append(module.register_forward_hook(self.create_hook(name)))

    def create_hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, *args: Any) -> None:
            if self.is_enable():
                value = getattr(module, self.attribute_name)
                self._record(name, self.function_on_attribute(value))

        return hook


class GradInputMonitor(BaseMonitor):
    """Records ``function_on_grad_input(grad_input)`` (the gradient w.r.t. the module's input)
    at every backward through the monitored modules."""

    def __init__(
        self,
        net: nn.Module,
        instance: Instance = None,
        function_on_grad_input: Callable[[Any], Any] = _identity,
    ) -> None:
        super().__init__()
        self.function_on_grad_input = function_on_grad_input
        for name, module in self._monitor_modules(net, instance):
            self.hooks.append(module.register_full_backward_hook(self.create_hook(name)))

    def create_hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, grad_input: Any, grad_output: Any) -> None:
            if self.is_enable():
                self._record(name, self.function_on_grad_input(_unpack_len1_tuple(grad_input)))

        return hook


class GradOutputMonitor(BaseMonitor):
    """Records ``function_on_grad_output(grad_output)`` (the gradient w.r.t. the module's
    output) at every backward through the monitored modules."""

    def __init__(
        self,
        net: nn.Module,
        instance: Instance = None,
        function_on_grad_output: Callable[[Any], Any] = _identity,
    ) -> None:
        super().__init__()
        self.function_on_grad_output = function_on_grad_output
        for name, module in self._monitor_modules(net, instance):
            self.hooks.append(module.register_full_backward_hook(self.create_hook(name)))

    def create_hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, grad_input: Any, grad_output: Any) -> None:
            if self.is_enable():
                value = _unpack_len1_tuple(grad_output)
                self._record(name, self.function_on_grad_output(value))

        return hook
