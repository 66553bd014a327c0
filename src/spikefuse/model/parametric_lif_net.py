"""The networks of the PLIF paper (Fang et al., "Incorporating Learnable Membrane Time Constant
to Enhance Learning of Spiking Neural Networks", ICCV 2021), with SpikingJelly's names and
layouts (``activation_based.model.parametric_lif_net``).

``spiking_neuron`` is a neuron class; every other keyword argument goes to each neuron (a deep
copy each). The layers are single-step: ``functional.set_step_mode(net, 'm')`` makes a network
multi-step (input ``[T, N, C, H, W]``), and its Conv → BN → neuron chains are then fused by
:func:`spikefuse.fuse`. Outputs are ``VotingLayer`` averages over groups of 10 output neurons.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from .. import layer
from ..errors import SpikefuseError

__all__ = [
    "CIFAR10DVSNet",
    "CIFAR10Net",
    "DVSGestureNet",
    "FashionMNISTNet",
    "MNISTNet",
    "NMNISTNet",
]


def _neuron(spiking_neuron: Callable[..., nn.Module] | None, kwargs: dict[str, Any]) -> nn.Module:
    if not callable(spiking_neuron):
        raise SpikefuseError(
            "spiking_neuron must be a neuron class (e.g. spikefuse.neuron.LIFNode), got "
            f"{spiking_neuron!r}"
        )
    return spiking_neuron(**copy.deepcopy(kwargs))


def _conv_stages(
    in_channels: int, channels: int, stages: int, per_stage: int, neuron: Callable[[], nn.Module]
) -> list[nn.Module]:
    """``stages`` times (``per_stage`` times Conv3x3 → BN → neuron), then MaxPool 2x2."""
    modules: list[nn.Module] = []
    for _ in range(stages):
        for _ in range(per_stage):
            modules += [
                layer.Conv2d(in_channels, channels, kernel_size=3, padding=1, bias=False),
                layer.BatchNorm2d(channels),
                neuron(),
            ]
            in_channels = channels
        modules.append(layer.MaxPool2d(2, 2))
    return modules


def _classifier(
    features: int, hidden: int, neuron: Callable[[], nn.Module], outputs: int = 100
) -> list[nn.Module]:
    """Flatten → Dropout → Linear(hidden) → neuron → Dropout → Linear(outputs) → neuron →
    votes of 10."""
    return [
        layer.Flatten(),
        layer.Dropout(0.5),
        layer.Linear(features, hidden),
        neuron(),
        layer.Dropout(0.5),
        layer.Linear(hidden, outputs),
        neuron(),
        layer.VotingLayer(10),
    ]


@dataclass(frozen=True)
class _Layout:
    """A PLIF network: ``stages`` x (``per_stage`` x Conv → BN → neuron, MaxPool) on
    ``in_channels``, leaving ``side`` x ``side`` maps, then the classifier (``hidden`` wide,
    ``outputs`` neurons voting in groups of 10)."""

    in_channels: int
    stages: int
    per_stage: int
    side: int
    hidden: int
    outputs: int = 100


class _PLIFNet(nn.Module):
    """``conv_fc``: the network of ``layout`` (a class attribute of each subclass)."""

    layout: _Layout

    def __init__(
        self,
        channels: int = 128,
        spiking_neuron: Callable[..., nn.Module] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        shape = self.layout
        sn = lambda: _neuron(spiking_neuron, kwargs)  # noqa: E731
        self.conv_fc = nn.Sequential(
            *_conv_stages(shape.in_channels, channels, shape.stages, shape.per_stage, sn),
            *_classifier(channels * shape.side**2, shape.hidden, sn, shape.outputs),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.conv_fc(x)


class MNISTNet(_PLIFNet):
    """[N, 1, 28, 28] → two (Conv → BN → neuron → MaxPool) stages → 2048 → 100 → 10 votes."""

    layout = _Layout(1, 2, 1, 7, 2048)


class FashionMNISTNet(MNISTNet):
    """:class:`MNISTNet` for Fashion-MNIST (the same layout)."""


class NMNISTNet(MNISTNet):
    """:class:`MNISTNet` for N-MNIST: 2 input channels, [N, 2, 34, 34] input (8 x 8 after the
    two poolings). Built as SpikingJelly builds it: an MNISTNet whose first Conv and first
    Linear are then replaced."""

    def __init__(
        self,
        channels: int = 128,
        spiking_neuron: Callable[..., nn.Module] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(channels, spiking_neuron, **kwargs)
        self.conv_fc[0] = layer.Conv2d(2, channels, kernel_size=3, padding=1, bias=False)
        self.conv_fc[-6] = layer.Linear(channels * 8 * 8, 2048)


class CIFAR10Net(_PLIFNet):
    """[N, 3, 32, 32] → two stages of three Conv → BN → neuron, each + MaxPool → 2048 → 100 →
    10 votes (``channels`` default 256)."""

    layout = _Layout(3, 2, 3, 8, 2048)

    def __init__(
        self,
        channels: int = 256,
        spiking_neuron: Callable[..., nn.Module] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(channels, spiking_neuron, **kwargs)


class CIFAR10DVSNet(_PLIFNet):
    """[N, 2, 128, 128] → four (Conv → BN → neuron → MaxPool) stages → 512 → 100 → 10 votes."""

    layout = _Layout(2, 4, 1, 8, 512)


class DVSGestureNet(_PLIFNet):
    """[N, 2, 128, 128] → five (Conv → BN → neuron → MaxPool) stages → 512 → 110 → 11 votes."""

    layout = _Layout(2, 5, 1, 4, 512, 110)
