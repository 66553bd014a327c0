"""What a model's call signature needs from its modules, read in one cheap walk per call.

:mod:`spikefuse.model_graphs` replays a captured graph only while everything the capture saw
still holds: the same modules, parameters and buffers (their identity, storage and
``requires_grad``), the same ``training`` flags, no forward hook but spikefuse's own, and every
neuron memory at its reset value. Reading that through ``modules()``/``parameters()``/
``buffers()`` costs a millisecond-scale share of a step's host time on a ResNet; this walks
``_modules`` once and keeps what only changes with the model's structure (which memories to
check, whether the hooks are spikefuse's) in a :class:`Layout` rebuilt when the walk differs.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter, methodcaller
from typing import Any

from torch import Tensor, nn

from .neuron import MemoryModule


@dataclass(frozen=True)
class Layout:
    """What only changes with the structure: the modules (breadth first), the number of
    forward hooks (all spikefuse's), the memories to check, or a cause that makes every call
    eager (``why``)."""

    modules: list[nn.Module]
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


# C-level readers: a call reads a few hundred attributes, and a Python loop per item would
# cost more than the graph replay's own launch.
_params, _buffers = attrgetter("_parameters"), attrgetter("_buffers")
_hooks, _pre_hooks = attrgetter("_forward_hooks"), attrgetter("_forward_pre_hooks")
_values, _data_ptr = methodcaller("values"), methodcaller("data_ptr")
_training, _requires_grad = attrgetter("training"), attrgetter("requires_grad")


def held_tensors(modules: list[nn.Module]) -> list[Tensor]:
    """Every parameter and buffer of ``modules`` (None entries skipped)."""
    held = chain.from_iterable(map(_values, chain(map(_params, modules), map(_buffers, modules))))
    return [t for t in held if t is not None]


def hook_count(modules: list[nn.Module]) -> int:
    return sum(map(len, map(_hooks, modules))) + sum(map(len, map(_pre_hooks, modules)))


def layout(modules: list[nn.Module]) -> Layout:
    """The :class:`Layout` of a walk (checks every hook's origin and every memory's default)."""
    memories: list[tuple[MemoryModule, str, Any]] = []
    why = None
    for module in modules:
        why = why or _foreign_hook(module)
        if isinstance(module, MemoryModule):
            for name, default in module._memory_defaults.items():
                if isinstance(default, Tensor):
                    why = why or f"{type(module).__name__}.{name} resets to a tensor"
                memories.append((module, name, default))
    return Layout(modules, hook_count(modules), tuple(memories), why)


def _foreign_hook(module: nn.Module) -> str | None:
    for hooks in (module._forward_hooks, module._forward_pre_hooks):
        for hook in hooks.values():
            if not getattr(hook, "__module__", "").startswith("spikefuse."):
                name = getattr(hook, "__name__", repr(hook))
                return f"{type(module).__name__} has a forward hook ({name}), which a replay skips"
    return None


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


def current(net: nn.Module, known: Layout | None) -> Layout:
    """``known`` if the model still has its modules and hooks, else a new :class:`Layout`."""
    modules = walk(net)
    hooks = hook_count(modules)
    if known is not None and hooks == known.hooks and _same(modules, known.modules):
        return known
    return layout(modules)


def _same(a: list[Any], b: list[Any]) -> bool:
    """Element-wise identity (``==`` on tensors would compare their values)."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def state_key(found: Layout) -> tuple[Hashable, ...]:
    """The module part of a call signature: training flags, and the identity, storage and
    ``requires_grad`` of every parameter and buffer (a tensor replaced, moved or frozen makes a
    new signature)."""
    tensors = held_tensors(found.modules)
    return (
        tuple(map(_training, found.modules)),
        tuple(map(id, tensors)),
        tuple(map(_data_ptr, tensors)),
        tuple(map(_requires_grad, tensors)),
    )
