"""SpikingJelly's ``activation_based.model.spiking_resnet`` path: spikefuse's Spiking ResNets
(:mod:`spikefuse.models`) and bottleneck ResNet-50/101/152. Only ``groups=1`` and
``width_per_group=64`` exist: the ResNeXt and wide builders raise, naming what to use instead.
The bottleneck's last Conv → BN → + shortcut → neuron is a residual chain :func:`spikefuse.fuse`
fuses, as in the basic block."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from torch import Tensor, nn

from .. import layer
from ..errors import SpikefuseError
from ..models import BasicBlock, SpikingResNet, spiking_resnet18, spiking_resnet34
from ..models._common import _neuron, _no_pretrained, _norm, _step_mode
from ..models._resnet import _conv1x1, _conv3x3
from ._refuse import refusing

__all__ = [
    "BasicBlock",
    "Bottleneck",
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


class Bottleneck(nn.Module):
    """Spiking ResNet's bottleneck: ``sn3(bn3(conv3(sn2(bn2(conv2(sn1(bn1(conv1(x)))))))) +
    shortcut(x))``, conv1/conv3 1x1, conv2 3x3 with the stride; 4x expansion. Only
    ``groups=1``, ``base_width=64`` and no dilation."""

    expansion = 4

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
        spiking_neuron: Callable[..., nn.Module] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        if groups != 1 or base_width != 64 or dilation != 1:
            raise SpikefuseError("Bottleneck supports only groups=1, base_width=64, dilation=1")
        mode, norm = _step_mode(kwargs), norm_layer or layer.BatchNorm2d
        self.conv1 = _conv1x1(inplanes, planes, 1, mode)
        self.bn1 = _norm(norm, planes, mode)
        self.sn1 = _neuron(spiking_neuron, kwargs)
        self.conv2 = _conv3x3(planes, planes, stride, mode)
        self.bn2 = _norm(norm, planes, mode)
        self.sn2 = _neuron(spiking_neuron, kwargs)
        self.conv3 = _conv1x1(planes, planes * self.expansion, 1, mode)
        self.bn3 = _norm(norm, planes * self.expansion, mode)
        self.sn3 = _neuron(spiking_neuron, kwargs)
        self.downsample = downsample
        self.stride = stride

    def branch(self, x: Tensor) -> Tensor:
        """bn3(conv3(sn2(bn2(conv2(sn1(bn1(conv1(x))))))))."""
        out = self.sn2(self.bn2(self.conv2(self.sn1(self.bn1(self.conv1(x))))))
        return self.bn3(self.conv3(out))

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        return self.sn3(self.branch(x) + identity)


def bottleneck_resnet(
    net: type[SpikingResNet],
    block: type[nn.Module],
    layers: list[int],
    pretrained: bool,
    **kwargs: Any,
) -> SpikingResNet:
    """``net(block, layers, **kwargs)``, with ``zero_init_residual`` zeroing each bottleneck's
    bn3 (SpikingJelly's), where spikefuse's builder zeroes bn2 (basic blocks)."""
    _no_pretrained(pretrained)
    zero = kwargs.pop("zero_init_residual", False)
    model = net(cast(Any, block), layers, **kwargs)
    for m in model.modules() if zero else ():
        if isinstance(m, block):
            nn.init.constant_(cast(Tensor, cast(Any, m).bn3.weight), 0)
    return model


def spiking_resnet50(pretrained=False, progress=True, spiking_neuron=None, **kwargs):
    """Spiking ResNet-50 (bottlenecks, stages of 3, 4, 6, 3)."""
    return bottleneck_resnet(
        SpikingResNet, Bottleneck, [3, 4, 6, 3], pretrained, spiking_neuron=spiking_neuron, **kwargs
    )


def spiking_resnet101(pretrained=False, progress=True, spiking_neuron=None, **kwargs):
    """Spiking ResNet-101 (bottlenecks, stages of 3, 4, 23, 3)."""
    return bottleneck_resnet(
        SpikingResNet,
        Bottleneck,
        [3, 4, 23, 3],
        pretrained,
        spiking_neuron=spiking_neuron,
        **kwargs,
    )


def spiking_resnet152(pretrained=False, progress=True, spiking_neuron=None, **kwargs):
    """Spiking ResNet-152 (bottlenecks, stages of 3, 8, 36, 3)."""
    return bottleneck_resnet(
        SpikingResNet,
        Bottleneck,
        [3, 8, 36, 3],
        pretrained,
        spiking_neuron=spiking_neuron,
        **kwargs,
    )


_WHY = "spikefuse's Spiking ResNet supports groups=1 and width_per_group=64 only"
_INSTEAD = "spiking_resnet18/34/50/101/152"
spiking_resnext50_32x4d = refusing("spiking_resnext50_32x4d", _WHY, _INSTEAD)
spiking_resnext101_32x8d = refusing("spiking_resnext101_32x8d", _WHY, _INSTEAD)
spiking_wide_resnet50_2 = refusing("spiking_wide_resnet50_2", _WHY, _INSTEAD)
spiking_wide_resnet101_2 = refusing("spiking_wide_resnet101_2", _WHY, _INSTEAD)
