"""Network-level helpers with SpikingJelly's names."""

from __future__ import annotations

from torch import nn

from .neuron import BaseNode, MemoryModule


def reset_net(net: nn.Module) -> None:
    """Reset the state of every stateful module in ``net`` (call between sequences)."""
    for module in net.modules():
        if isinstance(module, MemoryModule):
            module.reset()


def set_step_mode(net: nn.Module, step_mode: str) -> None:
    """Set ``step_mode`` ('s' or 'm') on every spikefuse module of ``net``."""
    for module in net.modules():
        if isinstance(module, MemoryModule) or hasattr(module, "step_mode"):
            module.step_mode = step_mode


def set_backend(net: nn.Module, backend: str) -> None:
    """Set the neuron backend ('auto', 'torch', 'cuda', 'cupy') of every neuron in ``net``."""
    for module in net.modules():
        if isinstance(module, BaseNode):
            module.backend = backend
