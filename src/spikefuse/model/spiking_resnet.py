"""SpikingJelly's ``activation_based.model.spiking_resnet`` path: spikefuse's Spiking ResNets
(:mod:`spikefuse.models`). Only basic-block ResNets with ``groups=1``/``width_per_group=64``
exist: the bottleneck, ResNeXt and wide builders raise, naming what to use instead."""

from __future__ import annotations

from ..models import BasicBlock, SpikingResNet, spiking_resnet18, spiking_resnet34
from ._refuse import refusing

__all__ = [
    "BasicBlock",
    "SpikingResNet",
    "spiking_resnet101",
    "spiking_resnet152",
    "spiking_resnet18",
    "spiking_resnet34",
    "spiking_resnet50",
    "spiking_resnext101_32x8d",
    "spiking_resnext50_32x4d",
    "spiking_wide_resnet101_2",
    "spiking_wide_resnet50_2",
]

_WHY = "spikefuse's Spiking ResNet has basic blocks only (no Bottleneck, groups or width)"
_INSTEAD = "spiking_resnet18 or spiking_resnet34 (or models.ResNet19)"
spiking_resnet50 = refusing("spiking_resnet50", _WHY, _INSTEAD)
spiking_resnet101 = refusing("spiking_resnet101", _WHY, _INSTEAD)
spiking_resnet152 = refusing("spiking_resnet152", _WHY, _INSTEAD)
spiking_resnext50_32x4d = refusing("spiking_resnext50_32x4d", _WHY, _INSTEAD)
spiking_resnext101_32x8d = refusing("spiking_resnext101_32x8d", _WHY, _INSTEAD)
spiking_wide_resnet50_2 = refusing("spiking_wide_resnet50_2", _WHY, _INSTEAD)
spiking_wide_resnet101_2 = refusing("spiking_wide_resnet101_2", _WHY, _INSTEAD)
