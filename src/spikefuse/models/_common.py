"""Helpers the networks of :mod:`spikefuse.models` (and :mod:`spikefuse.model`) share: neurons
built as SpikingJelly builds them, norm layers in the model's step mode, argument checks."""

from __future__ import annotations

import copy
import numbers
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import SpikefuseError


def _neuron(spiking_neuron: Callable[..., nn.Module] | None, kwargs: dict[str, Any]) -> nn.Module:
    if spiking_neuron is None or not callable(spiking_neuron):
        raise SpikefuseError(
            "spiking_neuron must be a neuron class (e.g. spikefuse.neuron.LIFNode), got "
            f"{spiking_neuron!r}"
        )
    return spiking_neuron(**copy.deepcopy(kwargs))


def _step_mode(kwargs: dict[str, Any]) -> str:
    """The layers' step mode: the neurons' ``step_mode`` keyword argument, else 's'."""
    return kwargs.get("step_mode", "s")


def _norm(norm_layer: Callable[..., nn.Module], channels: int, step_mode: str) -> nn.Module:
    """``norm_layer(channels)`` as SpikingJelly calls it (any BatchNorm class or partial), set
    to the model's step mode where the layer has one."""
    norm: Any = norm_layer(channels)  # a class of any kind: it may or may not have a step_mode
    if hasattr(norm, "step_mode"):
        norm.step_mode = step_mode
    return norm


def _count(name: str, value: Any) -> int:
    """``value`` as an int >= 1 (numpy integers included, as torch takes them; bools not)."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise SpikefuseError(f"{name} must be an int >= 1, got {value!r} ({type(value).__name__})")
    return int(value)


def _no_pretrained(pretrained: bool) -> None:
    if pretrained:
        raise SpikefuseError(
            "pretrained=True is not supported: spikefuse downloads no weights; load a "
            "state_dict yourself (fused and unfused models use the same keys)"
        )


def _flatten(x: Tensor, step_mode: str) -> Tensor:
    # [N, C, 1, 1] -> [N, C] single-step; [T, N, C, 1, 1] -> [T, N, C] multi-step.
    return torch.flatten(x, 1 if step_mode == "s" else 2)
