"""What SpikingJelly's spiking transformers (``model.spikformer``, ``spike_driven_transformer``,
``qkformer``) share: the image-or-sequence input and the neuron factory."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from .._neuron import _make_multi_step_neuron
from ..errors import SpikefuseError

NeuronClass = Callable[..., nn.Module]


def to_sequence(x: Tensor, T: int) -> Tensor:
    """``[N, C, H, W]`` images repeated over ``T`` steps, or a ``[T', N, C, H, W]`` sequence as
    it is (its own ``T'``)."""
    if not isinstance(x, Tensor) or x.dim() not in (4, 5):
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise SpikefuseError(
            "expected 4D image input [N, C, H, W] or 5D sequence input [T, N, C, H, W], but got "
            f"{got}"
        )
    return x.unsqueeze(0).repeat(T, 1, 1, 1, 1) if x.dim() == 4 else x


def lif(
    spiking_neuron: NeuronClass | None,
    kwargs: dict[str, Any],
    defaults: dict[str, Any] | None = None,
) -> nn.Module:
    """A multi-step neuron: ``spiking_neuron(**kwargs)``, or ``LIFNode(**defaults, **kwargs)``
    when ``spiking_neuron`` is None (SpikingJelly's ``_make_multi_step_neuron``)."""
    return _make_multi_step_neuron(spiking_neuron, kwargs, defaults)


def check_count(who: str, name: str, value: Any) -> None:
    """``value`` must be an int >= 1."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SpikefuseError(f"{who}: {name} must be an int >= 1, got {value!r}")
