"""SpikingJelly's ``activation_based.model.sew_resnet`` path: spikefuse's SEW-ResNets
(:mod:`spikefuse.models`). Only basic-block SEW-ResNets exist: the bottleneck, ResNeXt and wide
builders raise, naming what to use instead."""

from __future__ import annotations

from ..models import SEWBasicBlock, SEWResNet, sew_function, sew_resnet18, sew_resnet34
from ._refuse import refusing

__all__ = [
    "SEWBasicBlock",
    "SEWResNet",
    "sew_function",
    "sew_resnet101",
    "sew_resnet152",
    "sew_resnet18",
    "sew_resnet34",
    "sew_resnet50",
    "sew_resnext101_32x8d",
    "sew_resnext50_32x4d",
    "sew_wide_resnet101_2",
    "sew_wide_resnet50_2",
]

BasicBlock = SEWBasicBlock  # SpikingJelly's name inside this module
_WHY = "spikefuse's SEW-ResNet has basic blocks only (no Bottleneck, groups or width)"
_INSTEAD = "sew_resnet18 or sew_resnet34"
sew_resnet50 = refusing("sew_resnet50", _WHY, _INSTEAD)
sew_resnet101 = refusing("sew_resnet101", _WHY, _INSTEAD)
sew_resnet152 = refusing("sew_resnet152", _WHY, _INSTEAD)
sew_resnext50_32x4d = refusing("sew_resnext50_32x4d", _WHY, _INSTEAD)
sew_resnext101_32x8d = refusing("sew_resnext101_32x8d", _WHY, _INSTEAD)
sew_wide_resnet50_2 = refusing("sew_wide_resnet50_2", _WHY, _INSTEAD)
sew_wide_resnet101_2 = refusing("sew_wide_resnet101_2", _WHY, _INSTEAD)
