"""SpikingJelly's ``activation_based.base`` names, on spikefuse's module classes.

``StepModule`` is spikefuse's step-mode mixin and ``MemoryModule`` its stateful module class,
so ``isinstance(m, base.MemoryModule)`` holds for every spikefuse neuron and stateful layer, and
a user's SpikingJelly-style subclass (``register_memory`` in ``__init__``, ``single_step_forward``
/ ``multi_step_forward``) runs as it does there. Differences: ``MemoryModule.__init__`` also
takes ``step_mode`` (default 's', SpikingJelly sets 's' too), and it has no ``backend``
attribute (spikefuse's neurons have their own; a user's module may define one).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import nn

from .errors import SpikefuseError
from .neuron import MemoryModule, MultiStepModule, SingleStepModule, StepModeMixin

__all__ = [
    "MemoryModule",
    "MultiStepModule",
    "SingleStepModule",
    "StepModule",
    "extract_memories",
    "load_memories",
    "memories",
    "named_memories",
]

StepModule = StepModeMixin


def named_memories(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted name, value) of every memory of ``module`` and its submodules."""
    for name, sub in module.named_modules(prefix=prefix):
        if isinstance(sub, MemoryModule):
            for memory, value in sub.named_memories():
                yield (f"{name}.{memory}" if name else memory), value


def memories(module: nn.Module) -> Iterator[Any]:
    """The value of every memory of ``module`` and its submodules."""
    for _, value in named_memories(module):
        yield value


def extract_memories(module: nn.Module) -> list[Any]:
    """The values of every memory (the order of :func:`named_memories`)."""
    return list(memories(module))


def load_memories(module: nn.Module, memory_list: list[Any]) -> None:
    """Assign the values of :func:`extract_memories` back (same order and count)."""
    named = [name for name, _ in named_memories(module)]
    if len(named) != len(memory_list):
        raise SpikefuseError(
            f"load_memories: the model has {len(named)} memories but the list has "
            f"{len(memory_list)}"
        )
    for name, value in zip(named, memory_list, strict=True):
        owner, _, attribute = name.rpartition(".")
        target = module.get_submodule(owner) if owner else module
        if not isinstance(target, MemoryModule):
            raise SpikefuseError(f"load_memories: {owner!r} is not a MemoryModule")
        target.set_memory(attribute, value)
