"""SpikingJelly's ``activation_based.model.spiking_vgg`` path: spikefuse's
:class:`~spikefuse.models.SpikingVGG` with SpikingJelly's four configurations (VGG-11, 13, 16,
19, each with or without BatchNorm). ``pretrained=True`` is refused (no downloads)."""

from __future__ import annotations

from typing import Any

from ..models import (
    VGG_CONFIGS,
    SpikingVGG,
    spiking_vgg11,
    spiking_vgg11_bn,
    spiking_vgg16,
    spiking_vgg16_bn,
)
from ..models._common import _no_pretrained

__all__ = [
    "SpikingVGG",
    "cfgs",
    "spiking_vgg11",
    "spiking_vgg11_bn",
    "spiking_vgg13",
    "spiking_vgg13_bn",
    "spiking_vgg16",
    "spiking_vgg16_bn",
    "spiking_vgg19",
    "spiking_vgg19_bn",
]

_E: list[int | str] = [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M"]
_E += [512, 512, 512, 512, "M", 512, 512, 512, 512]
cfgs: dict[str, list[int | str]] = {
    "A": VGG_CONFIGS["A"],
    "B": [64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "D": VGG_CONFIGS["D"],
    "E": _E + ["M"],
}


def _vgg(cfg: str, batch_norm: bool, pretrained: bool, **kwargs: Any) -> SpikingVGG:
    _no_pretrained(pretrained)
    return SpikingVGG(cfgs[cfg], batch_norm=batch_norm, **kwargs)


def spiking_vgg13(pretrained=False, progress=True, spiking_neuron=None, **kwargs) -> SpikingVGG:
    """Spiking VGG-13 (configuration B) without BatchNorm."""
    return _vgg("B", False, pretrained, spiking_neuron=spiking_neuron, **kwargs)


def spiking_vgg13_bn(
    pretrained=False, progress=True, norm_layer=None, spiking_neuron=None, **kwargs
) -> SpikingVGG:
    """Spiking VGG-13 (configuration B) with BatchNorm."""
    return _vgg(
        "B", True, pretrained, norm_layer=norm_layer, spiking_neuron=spiking_neuron, **kwargs
    )


def spiking_vgg19(pretrained=False, progress=True, spiking_neuron=None, **kwargs) -> SpikingVGG:
    """Spiking VGG-19 (configuration E) without BatchNorm."""
    return _vgg("E", False, pretrained, spiking_neuron=spiking_neuron, **kwargs)


def spiking_vgg19_bn(
    pretrained=False, progress=True, norm_layer=None, spiking_neuron=None, **kwargs
) -> SpikingVGG:
    """Spiking VGG-19 (configuration E) with BatchNorm."""
    return _vgg(
        "E", True, pretrained, norm_layer=norm_layer, spiking_neuron=spiking_neuron, **kwargs
    )
