"""What a model's call signature needs from its modules, checked in a few C-level passes.

:mod:`spikefuse.model_graphs` replays a captured graph only while everything the capture saw
still holds: the same modules, parameters and buffers (their identity, storage and
``requires_grad``), the same ``training`` flags, no forward or backward hook but spikefuse's
own, and every neuron memory at its reset value. Walking the model for that on every call
(``modules()``, ``parameters()``) costs about a millisecond of host time on a ResNet-18 while
the GPU waits, so a :class:`Layout` keeps the walk's results and is rebuilt when the structure
may have changed:

- a module, parameter or buffer was registered or assigned anywhere (PyTorch's global
  registration hooks count those);
- a module table, or a parameter, buffer or hook table that was not empty, changed its size
  (``del``, ``ModuleList.insert``, ``pop``, a hook removed);
- a hook table grew: every hook registration makes a ``RemovableHandle``, whose class counts
  them, and only when that count moved are all the hook tables' sizes compared.

An empty parameter, buffer or hook table grows only through those registrations. Only a raw
write into a table that its size does not show goes unseen: call
:meth:`~spikefuse.model_graphs.ModelGraphs.invalidate` after one.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, replace
from itertools import chain
from operator import attrgetter, itemgetter
from typing import Any

from torch import Tensor, nn
from torch.nn.modules import module as torch_module
from torch.utils.hooks import RemovableHandle

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


_requires_grad = attrgetter("requires_grad")


@dataclass(frozen=True)
class Layout:
    """A walk's results: the modules (breadth first), their parameters and buffers, the tables
    whose sizes are watched (see the module docstring), the memories to check, where each
    module's ``training`` flag is read, and a cause that makes every call eager (``why``)."""

    registrations: int
    handles: int  # RemovableHandle.next_id: hook registrations in this process
    modules: list[nn.Module]
    tensors: list[Tensor]
    watched: list[dict[Any, Any]]
    sizes: tuple[int, ...]
    hook_tables: list[dict[int, Any]]
    hook_sizes: tuple[int, ...]
    memories: tuple[tuple[MemoryModule, str, Any], ...]  # (module, name, reset value)
    flags: tuple[Any, list[Any]]  # (getter, objects): map(getter, objects) is the flags
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
    hooks = [table for m in modules for table in _hook_tables(m)]
    watched = [m._modules for m in modules] + [table for table in held + hooks if table]
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
    return Layout(
        registrations=_registrations,
        handles=RemovableHandle.next_id,
        modules=modules,
        tensors=tensors,
        watched=watched,
        sizes=tuple(map(len, watched)),
        hook_tables=hooks,
        hook_sizes=tuple(map(len, hooks)),
        memories=tuple(memories),
        flags=_flags(modules),
        why=why,
    )


# A module's hook tables, by the pass whose Python they run (a replay runs none of it).
_HOOK_TABLES = (
    ("forward", "_forward_hooks"),
    ("forward", "_forward_pre_hooks"),
    ("backward", "_backward_hooks"),
    ("backward", "_backward_pre_hooks"),
)


def _hook_tables(module: nn.Module) -> list[dict[int, Any]]:
    return [getattr(module, table) for _, table in _HOOK_TABLES]


def _flags(modules: list[nn.Module]) -> tuple[Any, list[Any]]:
    """How the ``training`` flags are read: from the modules' ``__dict__`` (twice as fast as
    attribute lookups through their classes) where every module keeps it there."""
    dicts = [m.__dict__ for m in modules]
    if all(type(d.get("training")) is bool for d in dicts):
        return itemgetter("training"), dicts
    return attrgetter("training"), modules


def _foreign_hook(module: nn.Module) -> str | None:
    for kind, table in _HOOK_TABLES:
        for hook in getattr(module, table).values():
            if not getattr(hook, "__module__", "").startswith("spikefuse."):
                name = getattr(hook, "__name__", repr(hook))
                return f"{type(module).__name__} has a {kind} hook ({name}), which a replay skips"
    return None


def current(net: nn.Module, known: Layout | None) -> Layout:
    """``known`` while the model may not have changed its structure or hooks, else anew."""
    if (
        known is None
        or known.modules[0] is not net
        or known.registrations != _registrations
        or tuple(map(len, known.watched)) != known.sizes
    ):
        return layout(net)
    if known.handles != RemovableHandle.next_id:  # a hook registered somewhere: on this model?
        if tuple(map(len, known.hook_tables)) != known.hook_sizes:
            return layout(net)
        return replace(known, handles=RemovableHandle.next_id)
    return known


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
        tuple(map(*found.flags)),
        tuple(map(id, tensors)),
        tuple(map(Tensor.data_ptr, tensors)),
        tuple(map(_requires_grad, tensors)),
    )
