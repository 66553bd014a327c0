"""SpikingJelly's ``activation_based.model.sew_resnet`` path: spikefuse's SEW-ResNets
(:mod:`spikefuse.models`) and bottleneck SEW-ResNet-50/101/152. Only ``groups=1`` and
``width_per_group=64`` exist: the ResNeXt and wide builders raise, naming what to use instead."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from ..models import SEWBasicBlock, SEWResNet, sew_function, sew_resnet18, sew_resnet34
from ..models._common import _neuron
from ..models._resnet import _check_cnf
from ._refuse import refusing
from .spiking_resnet import Bottleneck as _SpikingBottleneck
from .spiking_resnet import bottleneck_resnet

__all__ = [
    "Bottleneck",
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


class Bottleneck(_SpikingBottleneck):
    """SEW-ResNet's bottleneck: ``g(sn3(bn3(conv3(...))), shortcut(x))`` with the connect
    function ``g`` = :func:`sew_function` (``cnf``; the branch first, as in SpikingJelly); the
    shortcut is the identity or ``downsample_sn(downsample(x))``."""

    def __init__(
        self,
        inplanes: int,
        planes: int,
        stride: int = 1,
        downsample: nn.Module | None = None,
        groups: int = 1,
        base_width: int = 64,
        dilation: int = 1,
        norm_layer: Callable[..., nn.Module] | None = None,
        cnf: str | None = None,
        spiking_neuron: Callable[..., nn.Module] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            inplanes, planes, stride, downsample, groups, base_width, dilation, norm_layer,
            spiking_neuron, **kwargs,
        )  # fmt: skip
        if downsample is not None:
            self.downsample_sn = _neuron(spiking_neuron, kwargs)
        self.cnf = _check_cnf(cnf)

    def forward(self, x: Tensor) -> Tensor:
        out = self.sn3(self.branch(x))
        identity = x if self.downsample is None else self.downsample_sn(self.downsample(x))
        return sew_function(out, identity, self.cnf)

    def extra_repr(self) -> str:
        return f"cnf={self.cnf}"


def sew_resnet50(pretrained=False, progress=True, cnf=None, spiking_neuron=None, **kwargs):
    """SEW-ResNet-50 (bottlenecks, stages of 3, 4, 6, 3)."""
    return bottleneck_resnet(
        SEWResNet,
        Bottleneck,
        [3, 4, 6, 3],
        pretrained,
        cnf=cnf,
        spiking_neuron=spiking_neuron,
        **kwargs,
    )


def sew_resnet101(pretrained=False, progress=True, cnf=None, spiking_neuron=None, **kwargs):
    """SEW-ResNet-101 (bottlenecks, stages of 3, 4, 23, 3)."""
    return bottleneck_resnet(
        SEWResNet,
        Bottleneck,
        [3, 4, 23, 3],
        pretrained,
        cnf=cnf,
        spiking_neuron=spiking_neuron,
        **kwargs,
    )


def sew_resnet152(pretrained=False, progress=True, cnf=None, spiking_neuron=None, **kwargs):
    """SEW-ResNet-152 (bottlenecks, stages of 3, 8, 36, 3)."""
    return bottleneck_resnet(
        SEWResNet,
        Bottleneck,
        [3, 8, 36, 3],
        pretrained,
        cnf=cnf,
        spiking_neuron=spiking_neuron,
        **kwargs,
    )


_WHY = "spikefuse's SEW-ResNet supports groups=1 and width_per_group=64 only"
_INSTEAD = "sew_resnet18/34/50/101/152"
sew_resnext50_32x4d = refusing("sew_resnext50_32x4d", _WHY, _INSTEAD)
sew_resnext101_32x8d = refusing("sew_resnext101_32x8d", _WHY, _INSTEAD)
sew_wide_resnet50_2 = refusing("sew_wide_resnet50_2", _WHY, _INSTEAD)
sew_wide_resnet101_2 = refusing("sew_wide_resnet101_2", _WHY, _INSTEAD)
