"""The neuron factory SpikingJelly's model files import (``_neuron._make_multi_step_neuron``)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from torch import nn

from .errors import SpikefuseError
from .neuron import LIFNode


def _make_multi_step_neuron(*args: Any) -> nn.Module:
    """A multi-step neuron: ``spiking_neuron(**defaults, **kwargs, step_mode='m')``, with
    ``LIFNode`` and ``defaults`` when ``spiking_neuron`` is None (``defaults`` apply only then).

    Takes both of SpikingJelly's signatures, ``(spiking_neuron, kwargs, defaults=None)`` and
    ``(backend, spiking_neuron, kwargs, defaults=None)`` (the latter also passes
    ``backend``). ``kwargs`` giving ``step_mode`` other than 'm' raises ``ValueError``, as
    there; arguments are deep-copied (each neuron gets its own surrogate)."""
    backend: str | None = None
    if args and isinstance(args[0], str):
        backend, args = args[0], args[1:]
    if len(args) not in (2, 3):
        raise SpikefuseError(
            "_make_multi_step_neuron takes (spiking_neuron, kwargs[, defaults]) or (backend, "
            f"spiking_neuron, kwargs[, defaults]), got {len(args)} arguments after the backend"
        )
    spiking_neuron: Callable[..., nn.Module] | None = args[0]
    kwargs: dict[str, Any] = args[1]
    defaults: dict[str, Any] | None = args[2] if len(args) == 3 else None
    if kwargs.get("step_mode", "m") != "m":
        raise ValueError("Spiking neurons require step_mode='m'.")
    parameters = copy.deepcopy(defaults) if spiking_neuron is None and defaults else {}
    parameters.update(copy.deepcopy(kwargs))
    parameters["step_mode"] = "m"
    if backend is not None:
        parameters["backend"] = backend
    return (LIFNode if spiking_neuron is None else spiking_neuron)(**parameters)
