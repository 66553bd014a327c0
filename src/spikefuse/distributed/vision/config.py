"""SpikingJelly's ``distributed.vision.config`` names, which its model files subclass at import
(``SEWResNet34Config(ModelConfig)``, ``...Builder(ModelBuilder)``): the configuration records
and the neuron resolution work as there; the distributed builders' sharding refuses (see
:mod:`spikefuse.distributed.tensor_parallel`).

``NeuronConfig.class_path`` names a neuron of :mod:`spikefuse.neuron` (or SpikingJelly's path of
the same class, ``spikingjelly.activation_based.neuron.LIFNode``), ``surrogate`` one of
:mod:`spikefuse.surrogate`; names are looked up, never imported or evaluated.
"""

from __future__ import annotations

import abc
import copy
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, NoReturn

from torch import nn

from ... import neuron, surrogate
from ...errors import SpikefuseError
from .. import INSTEAD

__all__ = ["ModelBuilder", "ModelConfig", "NeuronConfig"]

_PACKAGES = {
    "neuron": ("spikefuse.neuron.", "spikingjelly.activation_based.neuron."),
    "surrogate": ("spikefuse.surrogate.", "spikingjelly.activation_based.surrogate."),
}


def _check_json(value: Any, name: str) -> None:
    """JSON-native values only (finite numbers), as SpikingJelly requires."""
    if value is None or isinstance(value, (str, bool, int)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise SpikefuseError(f"{name} must contain only finite numbers")
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            _check_json(item, f"{name}[{i}]")
        return
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        for key, item in value.items():
            _check_json(item, f"{name}.{key}")
        return
    raise SpikefuseError(f"{name} must contain only JSON-native values (str keys)")


@dataclass(frozen=True)
class NeuronConfig:
    """A neuron class by path, its keyword arguments and an optional surrogate."""

    class_path: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    surrogate: str | None = None
    surrogate_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("class_path", "surrogate"):
            value = getattr(self, name)
            if (value is not None or name == "class_path") and (
                not isinstance(value, str) or not value or value.strip() != value
            ):
                raise SpikefuseError(
                    f"{name} must be a non-empty fully qualified path, got {value!r}"
                )
        if not isinstance(self.kwargs, dict) or not isinstance(self.surrogate_kwargs, dict):
            raise SpikefuseError("neuron kwargs must be dictionaries")
        if {"backend", "step_mode", "surrogate_function"} & self.kwargs.keys():
            raise SpikefuseError(
                "backend selection is automatic; step_mode and surrogate_function are configured separately"
            )
        if self.surrogate is None and self.surrogate_kwargs:
            raise SpikefuseError("surrogate_kwargs requires a surrogate class")
        _check_json(self.kwargs, "kwargs")
        _check_json(self.surrogate_kwargs, "surrogate_kwargs")


def _resolve(path: str, kind: str, module: Any, base: type) -> type:
    prefix = next((p for p in _PACKAGES[kind] if path.startswith(p)), None)
    name = path[len(prefix) :] if prefix else ""
    found = getattr(module, name, None) if name.isidentifier() else None
    if not (isinstance(found, type) and issubclass(found, base)):
        raise SpikefuseError(
            f"unknown {kind} class {path!r}: name one of spikefuse.{kind}'s classes"
        )
    return found


def _resolve_neuron_config(config: NeuronConfig | None) -> tuple[type | None, dict[str, Any]]:
    """(neuron class or None, keyword arguments with the surrogate instance)."""
    if config is None:
        return None, {}
    config.__post_init__()
    neuron_class = _resolve(config.class_path, "neuron", neuron, neuron.BaseNode)
    kwargs = copy.deepcopy(config.kwargs)
    if config.surrogate is not None:
        surrogate_class = _resolve(config.surrogate, "surrogate", surrogate, nn.Module)
        kwargs["surrogate_function"] = surrogate_class(**copy.deepcopy(config.surrogate_kwargs))
    return neuron_class, kwargs


@dataclass(frozen=True)
class ModelConfig:
    """A model's settings (subclasses add fields and name their ``builder``)."""

    builder: ClassVar[str]
    time_steps: int = 4
    num_classes: int = 1000
    step_mode: str = "m"

    def __post_init__(self) -> None:
        if self.time_steps <= 0 or self.num_classes <= 0:
            raise SpikefuseError("time_steps and num_classes must be positive")
        if self.step_mode not in ("s", "m"):
            raise SpikefuseError("step_mode must be 's' or 'm'")

    def get_builder_cls(self) -> NoReturn:
        raise SpikefuseError(f"ModelConfig.get_builder_cls: {INSTEAD}")


class ModelBuilder(abc.ABC):  # noqa: B024  # SpikingJelly's base class has no abstract method either
    """Base of SpikingJelly's distributed model builders: keeps the config; the sharded
    builders' methods are the subclass's own (their sharding refuses)."""

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
