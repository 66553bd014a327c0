"""SpikingJelly's OTTT VGGs (``activation_based.model.spiking_vggws_ottt``): single-step
networks of :class:`~spikefuse.neuron.OTTTLIFNode` (default) in
:class:`~spikefuse.layer.OTTTSequential` containers, with weight-standardised convolutions
(``WSConv2d``, each followed by a ``Scale(2.74)``) in the ``_ws`` variants. Train them online:
one forward, ``loss.backward()`` and optimiser step per time step, memory constant in T."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any, cast

from torch import Tensor, nn

from .. import layer, neuron
from ..errors import SpikefuseError
from ..models import SpikingVGG
from .spiking_vgg import cfgs as _vgg_cfgs

__all__ = [
    "OTTTSpikingVGG",
    "Scale",
    "ottt_spiking_vgg11",
    "ottt_spiking_vgg11_ws",
    "ottt_spiking_vgg13",
    "ottt_spiking_vgg13_ws",
    "ottt_spiking_vgg16",
    "ottt_spiking_vgg16_ws",
    "ottt_spiking_vgg19",
    "ottt_spiking_vgg19_ws",
    "ottt_spiking_vggws",
]

WS_SCALE = 2.74  # SpikingJelly's factor after weight-standardised layers
cfgs: dict[str, list[int | str]] = {
    **_vgg_cfgs,
    "S": [64, 128, "A", 256, 256, "A", 512, 512, "A", 512, 512],
}


class Scale(nn.Module):
    """x * scale."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, x: Tensor) -> Tensor:
        return x * self.scale


def _neuron(spiking_neuron: Callable[..., nn.Module], kwargs: dict[str, Any]) -> nn.Module:
    return spiking_neuron(**copy.deepcopy(kwargs))


class OTTTSpikingVGG(nn.Module):
    """``features`` (Conv3x3 → neuron [→ Scale] [→ Dropout], MaxPool at "M", AvgPool at "A")
    and ``classifier`` (light: AdaptiveAvgPool → Flatten → Linear; else SpikingVGG's 4096-wide
    head), both :class:`~spikefuse.layer.OTTTSequential`."""

    def __init__(
        self,
        cfg: Sequence[int | str],
        weight_standardization: bool = True,
        num_classes: int = 1000,
        init_weights: bool = True,
        spiking_neuron: Callable[..., nn.Module] | None = None,
        light_classifier: bool = True,
        drop_rate: float = 0.0,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        if not callable(spiking_neuron):
            raise SpikefuseError(f"spiking_neuron must be a neuron class, got {spiking_neuron!r}")
        self.fc_hw = kwargs.get("fc_hw", 1)
        self.neuron = spiking_neuron
        self.features = self.make_layers(
            cfg, weight_standardization, spiking_neuron, drop_rate, **kwargs
        )
        if light_classifier:
            self.classifier = layer.OTTTSequential(
                layer.AdaptiveAvgPool2d((self.fc_hw, self.fc_hw)),
                layer.Flatten(1),
                layer.Linear(512 * self.fc_hw**2, num_classes),
            )
        else:
            self.classifier = self._heavy_classifier(
                weight_standardization, num_classes, spiking_neuron, kwargs
            )
        if init_weights:
            self._initialize_weights()

    @staticmethod
    def _heavy_classifier(
        ws: bool, num_classes: int, spiking_neuron: Callable[..., nn.Module], kwargs: dict[str, Any]
    ) -> layer.OTTTSequential:
        linear = layer.WSLinear if ws else layer.Linear
        scale = WS_SCALE if ws else 1.0
        return layer.OTTTSequential(
            layer.AdaptiveAvgPool2d((7, 7)),
            layer.Flatten(1),
            linear(512 * 7 * 7, 4096),
            _neuron(spiking_neuron, kwargs),
            Scale(scale),
            layer.Dropout(),
            linear(4096, 4096),
            _neuron(spiking_neuron, kwargs),
            Scale(scale),
            layer.Dropout(),
            layer.Linear(4096, num_classes),
        )

    def forward(self, x: Tensor) -> Any:
        return self.classifier(self.features(x))

    def _initialize_weights(self) -> None:
        """SpikingVGG's initialisation (Conv: Kaiming, BN: 1/0, Linear: N(0, 0.01)/0)."""
        SpikingVGG._initialize_weights(cast(Any, self))

    @staticmethod
    def make_layers(
        cfg: Sequence[int | str],
        weight_standardization: bool = True,
        neuron: Callable[..., nn.Module] | None = None,
        drop_rate: float = 0.0,
        **kwargs: Any,
    ) -> layer.OTTTSequential:
        if not callable(neuron):
            raise SpikefuseError(f"neuron must be a neuron class, got {neuron!r}")
        conv = layer.WSConv2d if weight_standardization else layer.Conv2d
        layers: list[nn.Module] = []
        in_channels = 3
        for v in cfg:
            if v == "M":
                layers.append(layer.MaxPool2d(kernel_size=2, stride=2))
            elif v == "A":
                layers.append(layer.AvgPool2d(kernel_size=2, stride=2))
            elif isinstance(v, int):
                layers += [conv(in_channels, v, kernel_size=3, padding=1), _neuron(neuron, kwargs)]
                if weight_standardization:
                    layers.append(Scale(WS_SCALE))
                in_channels = v
                if drop_rate > 0.0:
                    layers.append(layer.Dropout(drop_rate))
            else:
                raise SpikefuseError(f"cfg entries are channel counts, 'M' or 'A', got {v!r}")
        return layer.OTTTSequential(*layers)


def _ottt_vgg(
    cfg: str, ws: bool, spiking_neuron: Callable[..., nn.Module], light: bool, **kwargs: Any
) -> OTTTSpikingVGG:
    return OTTTSpikingVGG(
        cfgs[cfg],
        weight_standardization=ws,
        spiking_neuron=spiking_neuron,
        light_classifier=light,
        **kwargs,
    )


def ottt_spiking_vggws(spiking_neuron=neuron.OTTTLIFNode, **kwargs) -> OTTTSpikingVGG:
    """OTTT's light weight-standardised VGG (configuration S, light classifier)."""
    return _ottt_vgg("S", True, spiking_neuron, True, **kwargs)


def ottt_spiking_vgg11(spiking_neuron=neuron.OTTTLIFNode, **kwargs) -> OTTTSpikingVGG:
    """OTTT VGG-11."""
    return _ottt_vgg("A", False, spiking_neuron, False, **kwargs)


def ottt_spiking_vgg11_ws(spiking_neuron=neuron.OTTTLIFNode, **kwargs) -> OTTTSpikingVGG:
    """OTTT VGG-11, weight-standardised."""
    return _ottt_vgg("A", True, spiking_neuron, False, **kwargs)


def ottt_spiking_vgg13(spiking_neuron=neuron.OTTTLIFNode, **kwargs) -> OTTTSpikingVGG:
    """OTTT VGG-13."""
    return _ottt_vgg("B", False, spiking_neuron, False, **kwargs)


def ottt_spiking_vgg13_ws(spiking_neuron=neuron.OTTTLIFNode, **kwargs) -> OTTTSpikingVGG:
    """OTTT VGG-13, weight-standardised."""
    return _ottt_vgg("B", True, spiking_neuron, False, **kwargs)


def ottt_spiking_vgg16(spiking_neuron=neuron.OTTTLIFNode, **kwargs) -> OTTTSpikingVGG:
    """OTTT VGG-16."""
    return _ottt_vgg("D", False, spiking_neuron, False, **kwargs)


def ottt_spiking_vgg16_ws(spiking_neuron=neuron.OTTTLIFNode, **kwargs) -> OTTTSpikingVGG:
    """OTTT VGG-16, weight-standardised."""
    return _ottt_vgg("D", True, spiking_neuron, False, **kwargs)


def ottt_spiking_vgg19(spiking_neuron=neuron.OTTTLIFNode, **kwargs) -> OTTTSpikingVGG:
    """OTTT VGG-19."""
    return _ottt_vgg("E", False, spiking_neuron, False, **kwargs)


def ottt_spiking_vgg19_ws(spiking_neuron=neuron.OTTTLIFNode, **kwargs) -> OTTTSpikingVGG:
    """OTTT VGG-19, weight-standardised."""
    return _ottt_vgg("E", True, spiking_neuron, False, **kwargs)
