"""What a model's call signature needs from its modules, checked in a few C-level passes.

:mod:`spikefuse.model_graphs` replays a captured graph only while everything the capture saw
still holds: the same modules, parameters and buffers (their identity, storage and
``requires_grad``), the same ``training`` flags, no forward hook but spikefuse's own, and every
neuron memory at its reset value. Walking the model for that on every call (``modules()``,
``parameters()``) costs about a millisecond of host time on a ResNet-18 while the GPU waits, so
a :class:`Layout` keeps the walk's results and is rebuilt when the structure may have changed:
when a module, parameter or buffer was registered or assigned anywhere (PyTorch's global
registration hooks count those), when the size of any of the model's module, parameter or
buffer tables changed (``del``, ``ModuleList.insert``, ``pop``), or when a forward hook was
added or removed. Only a raw write into those tables that keeps their sizes goes unseen:
call :meth:`~spikefuse.model_graphs.ModelGraphs.invalidate` after one.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter
from typing import Any

from torch import Tensor, nn
from torch.nn.modules import module as torch_module

from .neuron import MemoryModule

_registrations = 0  # modules, parameters and buffers registered or assigned in this process


def _count_registration(*_: object) -> None:
    global _registrations
    _registrations += 1


_watching = False  # whether the hooks below are installed (once per process)


def watch_registrations() -> None:
    """Count registrations from now on (a counter bump each, nothing else)."""
    global _watching
    if not _watching:
        torch_module.register_module_module_registration_hook(_count_registration)
        torch_module.register_module_parameter_registration_hook(_count_registration)
        torch_module.register_module_buffer_registration_hook(_count_registration)
        _watching = True


_training, _requires_grad = attrgetter("training"), attrgetter("requires_grad")


@dataclass(frozen=True)
class Layout:
    """A walk's results: the modules (breadth first), their parameters and buffers, their
    tables and hook tables (whose sizes are watched), the memories to check, and a cause that
    makes every call eager (``why``)."""

    registrations: int
    modules: list[nn.Module]
    tensors: list[Tensor]
    tables: list[dict[str, Any]]
    sizes: tuple[int, ...]
    hook_tables: list[dict[int, Any]]
    hooks: int
    memories: tuple[tuple[MemoryModule, str, Any], ...]  # (module, name, reset value)
    why: str | None


def walk(net: nn.Module) -> list[nn.Module]:
    """``net`` and its submodules, breadth first through ``_modules`` (None entries skipped)."""
    modules: list[nn.Module | None] = [net]
    for module in modules:  # grows while walked
        if module is not None and module._modules:
            modules.extend(module._modules.values())
    return [m for m in modules if m is not None]


def layout(net: nn.Module) -> Layout:
    """A new :class:`Layout` (checks every hook's origin and every memory's default)."""
    modules = walk(net)
    held: list[dict[str, Any]] = [m._parameters for m in modules] + [m._buffers for m in modules]
    tables: list[dict[str, Any]] = [m._modules for m in modules] + held
    hook_tables = [m._forward_hooks for m in modules] + [m._forward_pre_hooks for m in modules]
    tensors = [t for t in chain.from_iterable(d.values() for d in held) if t is not None]
    memories: list[tuple[MemoryModule, str, Any]] = []
    why = None
    for module in modules:
        why = why or _foreign_hook(module)
        if isinstance(module, MemoryModule):
            for name, default in module._memory_defaults.items():
                if isinstance(default, Tensor):
                    why = why or f"{type(module).__name__}.{name} resets to a tensor"
                memories.append((module, name, default))
    hooks = sum(map(len, hook_tables))
    sizes = tuple(map(len, tables))
    return Layout(
        _registrations, modules, tensors, tables, sizes, hook_tables, hooks, tuple(memories), why
    )


def _foreign_hook(module: nn.Module) -> str | None:
    for hooks in (module._forward_hooks, module._forward_pre_hooks):
        for hook in hooks.values():
            if not getattr(hook, "__module__", "").startswith("spikefuse."):
                name = getattr(hook, "__name__", repr(hook))
                return f"{type(module).__name__} has a forward hook ({name}), which a replay skips"
    return None


def current(net: nn.Module, known: Layout | None) -> Layout:
    """``known`` while the model may not have changed its structure or hooks, else anew."""
    if (
        known is not None
        and known.registrations == _registrations
        and tuple(map(len, known.tables)) == known.sizes
        and sum(map(len, known.hook_tables)) == known.hooks
        and known.modules[0] is net
    ):
        return known
    return layout(net)


def not_reset(memories: tuple[tuple[MemoryModule, str, Any], ...]) -> str | None:
    """Which memory is not at its reset value, if one is."""
    for module, name, default in memories:
        value = module.__dict__.get(name)
        if value is not default and not (type(value) is type(default) and value == default):
            return (
                f"{type(module).__name__}.{name} is not at its reset value (call "
                "functional.reset_net(net) after each step; single-step loops run eagerly)"
            )
    return None


def state_key(found: Layout) -> tuple[Hashable, ...]:
    """The module part of a call signature: training flags, and the identity, storage and
    ``requires_grad`` of every parameter and buffer (a tensor replaced, moved or frozen makes a
    new signature)."""
    tensors = found.tensors
    return (
        tuple(map(_training, found.modules)),
        tuple(map(id, tensors)),
        tuple(map(Tensor.data_ptr, tensors)),
        tuple(map(_requires_grad, tensors)),
    )
