"""SpikingJelly's spiking VGG (:class:`SpikingVGG`) and its VGG-11 and VGG-16 builders."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor, nn

from .. import layer
from ..errors import SpikefuseError
from ._common import _count, _flatten, _neuron, _no_pretrained, _norm, _step_mode

VGG_CONFIGS: dict[str, list[int | str]] = {
    "A": [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "D": [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"],
}


class SpikingVGG(nn.Module):
    """SpikingJelly's spiking VGG: ``features`` (Conv3x3 [→ BN] → neuron, MaxPool 2×2 at "M"),
    ``avgpool`` (adaptive, 7×7), ``classifier`` (Linear → neuron → Dropout, twice, → Linear).

    Extension: ``classifier_features`` (SpikingJelly: 4096) is the classifier's hidden width.
    """

    def __init__(
        self,
        cfg: Sequence[int | str],
        batch_norm: bool = False,
        norm_layer: Callable[..., nn.Module] | None = None,
        num_classes: int = 1000,
        init_weights: bool = True,
        spiking_neuron: Callable[..., nn.Module] | None = None,
        *,
        classifier_features: int = 4096,
        **kwargs: Any,
    ) -> None:
        num_classes = _count("num_classes", num_classes)
        hidden = _count("classifier_features", classifier_features)
        super().__init__()
        mode = _step_mode(kwargs)
        self.features = self.make_layers(cfg, batch_norm, norm_layer, spiking_neuron, **kwargs)
        channels = [v for v in cfg if v != "M"][-1]
        self.avgpool = layer.AdaptiveAvgPool2d((7, 7), step_mode=mode)
        self.classifier = nn.Sequential(
            layer.Linear(channels * 7 * 7, hidden, step_mode=mode),
            _neuron(spiking_neuron, kwargs),
            layer.Dropout(step_mode=mode),
            layer.Linear(hidden, hidden, step_mode=mode),
            _neuron(spiking_neuron, kwargs),
            layer.Dropout(step_mode=mode),
            layer.Linear(hidden, num_classes, step_mode=mode),
        )
        if init_weights:
            self._initialize_weights()

    def forward(self, x: Tensor) -> Tensor:
        x = self.features(x)
        x = self.avgpool(x)
        x = _flatten(x, self.avgpool.step_mode)
        return self.classifier(x)

    def _initialize_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                if m.bias is not None:
                    nn.init.constant_(m.bias, 0)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.constant_(m.bias, 0)

    @staticmethod
    def make_layers(
        cfg: Sequence[int | str],
        batch_norm: bool = False,
        norm_layer: Callable[..., nn.Module] | None = None,
        neuron: Callable[..., nn.Module] | None = None,
        **kwargs: Any,
    ) -> nn.Sequential:
        mode = _step_mode(kwargs)
        if norm_layer is None:
            norm_layer = layer.BatchNorm2d
        layers: list[nn.Module] = []
        in_channels = 3
        for v in cfg:
            if v == "M":
                layers.append(layer.MaxPool2d(kernel_size=2, stride=2, step_mode=mode))
                continue
            if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < 1:
                raise SpikefuseError(f"cfg entries are channel counts or 'M', got {v!r}")
            v = int(v)
            layers.append(layer.Conv2d(in_channels, v, kernel_size=3, padding=1, step_mode=mode))
            if batch_norm:
                layers.append(_norm(norm_layer, v, mode))
            layers.append(_neuron(neuron, kwargs))
            in_channels = v
        return nn.Sequential(*layers)


def _spiking_vgg(cfg: str, batch_norm: bool, pretrained: bool, **kwargs: Any) -> SpikingVGG:
    _no_pretrained(pretrained)
    return SpikingVGG(VGG_CONFIGS[cfg], batch_norm=batch_norm, **kwargs)


def spiking_vgg11(pretrained=False, progress=True, spiking_neuron=None, **kwargs) -> SpikingVGG:
    """Spiking VGG-11 (configuration A) without BatchNorm."""
    return _spiking_vgg("A", False, pretrained, spiking_neuron=spiking_neuron, **kwargs)


def spiking_vgg11_bn(
    pretrained=False, progress=True, norm_layer=None, spiking_neuron=None, **kwargs
) -> SpikingVGG:
    """Spiking VGG-11 (configuration A) with BatchNorm after every convolution."""
    return _spiking_vgg(
        "A", True, pretrained, norm_layer=norm_layer, spiking_neuron=spiking_neuron, **kwargs
    )


def spiking_vgg16(pretrained=False, progress=True, spiking_neuron=None, **kwargs) -> SpikingVGG:
    """Spiking VGG-16 (configuration D) without BatchNorm."""
    return _spiking_vgg("D", False, pretrained, spiking_neuron=spiking_neuron, **kwargs)


def spiking_vgg16_bn(
    pretrained=False, progress=True, norm_layer=None, spiking_neuron=None, **kwargs
) -> SpikingVGG:
    """Spiking VGG-16 (configuration D) with BatchNorm after every convolution."""
    return _spiking_vgg(
        "D", True, pretrained, norm_layer=norm_layer, spiking_neuron=spiking_neuron, **kwargs
    )
