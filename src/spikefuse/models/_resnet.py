"""SpikingJelly's Spiking ResNet and SEW-ResNet (basic blocks; ResNet-18 and 34) and the CIFAR
ResNet-19."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

from torch import Tensor, nn

from .. import layer
from ..errors import SpikefuseError
from ._common import _count, _flatten, _neuron, _no_pretrained, _norm, _step_mode

CONNECT_FUNCTIONS = ("ADD", "AND", "IAND")


def _check_cnf(cnf: str | None) -> str:
    if cnf not in CONNECT_FUNCTIONS:
        raise SpikefuseError(f"cnf must be one of {CONNECT_FUNCTIONS}, got {cnf!r}")
    return cnf


def sew_function(x: Tensor, y: Tensor, cnf: str) -> Tensor:
    """SEW-ResNet's connect function g(x, y): 'ADD' x + y, 'AND' x·y, 'IAND' x·(1 - y)."""
    if cnf == "ADD":
        return x + y
    if cnf == "AND":
        return x * y
    if cnf == "IAND":
        return x * (1.0 - y)
    raise SpikefuseError(f"cnf must be one of {CONNECT_FUNCTIONS}, got {cnf!r}")


def _conv3x3(in_planes: int, out_planes: int, stride: int, step_mode: str) -> nn.Module:
    return layer.Conv2d(
        in_planes, out_planes, 3, stride=stride, padding=1, bias=False, step_mode=step_mode
    )


def _conv1x1(in_planes: int, out_planes: int, stride: int, step_mode: str) -> nn.Module:
    return layer.Conv2d(in_planes, out_planes, 1, stride=stride, bias=False, step_mode=step_mode)


def _init_resnet(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.constant_(m.weight, 1)
            nn.init.constant_(m.bias, 0)


class BasicBlock(nn.Module):
    """Spiking ResNet's basic block: ``sn2(bn2(conv2(sn1(bn1(conv1(x))))) + shortcut(x))``;
    the shortcut is ``downsample`` (Conv1x1 → BN) or the identity."""

    expansion = 1

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
            raise SpikefuseError("BasicBlock supports only groups=1, base_width=64, dilation=1")
        mode = _step_mode(kwargs)
        norm_layer = norm_layer or layer.BatchNorm2d
        self.conv1 = _conv3x3(inplanes, planes, stride, mode)
        self.bn1 = _norm(norm_layer, planes, mode)
        self.sn1 = _neuron(spiking_neuron, kwargs)
        self.conv2 = _conv3x3(planes, planes, 1, mode)
        self.bn2 = _norm(norm_layer, planes, mode)
        self.sn2 = _neuron(spiking_neuron, kwargs)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: Tensor) -> Tensor:
        identity = x
        out = self.sn1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        return self.sn2(out + identity)


class SEWBasicBlock(BasicBlock):
    """SEW-ResNet's basic block: ``g(sn2(bn2(conv2(sn1(bn1(conv1(x)))))), shortcut(x))`` with
    the connect function ``g`` = :func:`sew_function` (``cnf``); the shortcut is the identity or
    ``downsample_sn(downsample(x))`` (Conv1x1 → BN → neuron)."""

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
            inplanes,
            planes,
            stride,
            downsample,
            groups=groups,
            base_width=base_width,
            dilation=dilation,
            norm_layer=norm_layer,
            spiking_neuron=spiking_neuron,
            **kwargs,
        )
        if downsample is not None:
            self.downsample_sn = _neuron(spiking_neuron, kwargs)
        self.cnf = _check_cnf(cnf)

    def forward(self, x: Tensor) -> Tensor:
        identity = x
        out = self.sn1(self.bn1(self.conv1(x)))
        out = self.sn2(self.bn2(self.conv2(out)))
        if self.downsample is not None:
            identity = self.downsample_sn(self.downsample(x))
        return sew_function(identity, out, self.cnf)

    def extra_repr(self) -> str:
        return f"cnf={self.cnf}"


def _make_layer(
    block: type[BasicBlock],
    inplanes: int,
    planes: int,
    blocks: int,
    stride: int,
    norm_layer: Callable[..., nn.Module],
    block_kwargs: dict[str, Any],
) -> nn.Sequential:
    mode = _step_mode(block_kwargs)
    downsample = None
    if stride != 1 or inplanes != planes * block.expansion:
        downsample = nn.Sequential(
            _conv1x1(inplanes, planes * block.expansion, stride, mode),
            _norm(norm_layer, planes * block.expansion, mode),
        )
    layers = [block(inplanes, planes, stride, downsample, norm_layer=norm_layer, **block_kwargs)]
    for _ in range(1, blocks):
        layers.append(
            block(planes * block.expansion, planes, norm_layer=norm_layer, **block_kwargs)
        )
    return nn.Sequential(*layers)


class SpikingResNet(nn.Module):
    """SpikingJelly's Spiking ResNet (ImageNet layout): Conv7x7/2 → BN → neuron → MaxPool3x3/2,
    four stages of ``block`` (64, 128, 256, 512 channels), adaptive average pooling, Linear.
    Only ``groups=1``, ``width_per_group=64`` and no dilation are supported (basic blocks)."""

    layer1: nn.Sequential
    layer2: nn.Sequential
    layer3: nn.Sequential
    layer4: nn.Sequential

    def __init__(
        self,
        block: type[BasicBlock],
        layers: Sequence[int],
        num_classes: int = 1000,
        zero_init_residual: bool = False,
        groups: int = 1,
        width_per_group: int = 64,
        replace_stride_with_dilation: Sequence[bool] | None = None,
        norm_layer: Callable[..., nn.Module] | None = None,
        spiking_neuron: Callable[..., nn.Module] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        self._build(
            block,
            layers,
            num_classes=num_classes,
            zero_init_residual=zero_init_residual,
            groups=groups,
            width_per_group=width_per_group,
            dilation=replace_stride_with_dilation,
            norm_layer=norm_layer,
            spiking_neuron=spiking_neuron,
            kwargs=kwargs,
        )

    def _build(
        self,
        block: type[BasicBlock],
        layers: Sequence[int],
        *,
        num_classes: int,
        zero_init_residual: bool,
        groups: int,
        width_per_group: int,
        dilation: Sequence[bool] | None,
        norm_layer: Callable[..., nn.Module] | None,
        spiking_neuron: Callable[..., nn.Module] | None,
        kwargs: dict[str, Any],
        **block_options: Any,
    ) -> None:
        """Build the layers; ``kwargs`` go to every neuron, ``block_options`` to every block."""
        num_classes = _count("num_classes", num_classes)
        if groups != 1 or width_per_group != 64 or (dilation is not None and any(dilation)):
            raise SpikefuseError(
                f"{type(self).__name__}: only groups=1, width_per_group=64 and no dilation are "
                "supported"
            )
        if len(layers) != 4:
            raise SpikefuseError(f"layers must give 4 stage lengths, got {list(layers)}")
        mode = _step_mode(kwargs)
        norm_layer = norm_layer or layer.BatchNorm2d
        self.conv1 = layer.Conv2d(3, 64, 7, stride=2, padding=3, bias=False, step_mode=mode)
        self.bn1 = _norm(norm_layer, 64, mode)
        self.sn1 = _neuron(spiking_neuron, kwargs)
        self.maxpool = layer.MaxPool2d(kernel_size=3, stride=2, padding=1, step_mode=mode)
        block_kwargs = dict(kwargs, spiking_neuron=spiking_neuron, **block_options)
        inplanes = 64
        for index, (planes, count) in enumerate(zip((64, 128, 256, 512), layers, strict=True)):
            stride = 1 if index == 0 else 2
            stage = _make_layer(block, inplanes, planes, count, stride, norm_layer, block_kwargs)
            setattr(self, f"layer{index + 1}", stage)
            inplanes = planes * block.expansion
        self.avgpool = layer.AdaptiveAvgPool2d((1, 1), step_mode=mode)
        self.fc = layer.Linear(512 * block.expansion, num_classes, step_mode=mode)
        _init_resnet(self)
        if zero_init_residual:
            for m in self.modules():
                if isinstance(m, block):
                    # bn2 is a BatchNorm (norm_layer): its weight is a tensor
                    nn.init.constant_(cast(Tensor, m.bn2.weight), 0)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.sn1(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = _flatten(self.avgpool(x), self.avgpool.step_mode)
        return self.fc(x)


class SEWResNet(SpikingResNet):
    """SpikingJelly's SEW-ResNet: :class:`SpikingResNet`'s layout with SEW blocks, whose
    connect function ``cnf`` is 'ADD', 'AND' or 'IAND'."""

    def __init__(
        self,
        block: type[BasicBlock],
        layers: Sequence[int],
        num_classes: int = 1000,
        zero_init_residual: bool = False,
        groups: int = 1,
        width_per_group: int = 64,
        replace_stride_with_dilation: Sequence[bool] | None = None,
        norm_layer: Callable[..., nn.Module] | None = None,
        cnf: str | None = None,
        spiking_neuron: Callable[..., nn.Module] | None = None,
        **kwargs: Any,
    ) -> None:
        nn.Module.__init__(self)
        self._build(
            block,
            layers,
            num_classes=num_classes,
            zero_init_residual=zero_init_residual,
            groups=groups,
            width_per_group=width_per_group,
            dilation=replace_stride_with_dilation,
            norm_layer=norm_layer,
            spiking_neuron=spiking_neuron,
            kwargs=kwargs,
            cnf=_check_cnf(cnf),
        )


def spiking_resnet18(pretrained=False, progress=True, spiking_neuron=None, **kwargs):
    """Spiking ResNet-18 (basic blocks, stages of 2, 2, 2, 2)."""
    _no_pretrained(pretrained)
    return SpikingResNet(BasicBlock, [2, 2, 2, 2], spiking_neuron=spiking_neuron, **kwargs)


def spiking_resnet34(pretrained=False, progress=True, spiking_neuron=None, **kwargs):
    """Spiking ResNet-34 (basic blocks, stages of 3, 4, 6, 3)."""
    _no_pretrained(pretrained)
    return SpikingResNet(BasicBlock, [3, 4, 6, 3], spiking_neuron=spiking_neuron, **kwargs)


def sew_resnet18(pretrained=False, progress=True, cnf=None, spiking_neuron=None, **kwargs):
    """SEW-ResNet-18 with connect function ``cnf`` ('ADD', 'AND' or 'IAND')."""
    _no_pretrained(pretrained)
    blocks = [2, 2, 2, 2]
    return SEWResNet(SEWBasicBlock, blocks, cnf=cnf, spiking_neuron=spiking_neuron, **kwargs)


def sew_resnet34(pretrained=False, progress=True, cnf=None, spiking_neuron=None, **kwargs):
    """SEW-ResNet-34 with connect function ``cnf`` ('ADD', 'AND' or 'IAND')."""
    _no_pretrained(pretrained)
    blocks = [3, 4, 6, 3]
    return SEWResNet(SEWBasicBlock, blocks, cnf=cnf, spiking_neuron=spiking_neuron, **kwargs)


class ResNet19(nn.Module):
    """ResNet-19 for CIFAR (Zheng et al., "Going Deeper With Directly-Trained Larger Spiking
    Neural Networks", AAAI 2021): Conv3x3(128) → BN → neuron, stages of 3, 3, 2 Spiking ResNet
    :class:`BasicBlock` s (128, 256, 512 channels; stride 2 from the second stage), adaptive
    average pooling, Linear(512, 256) → neuron → Linear(256, num_classes).

    The paper's threshold-dependent BatchNorm (tdBN) normalises to α·V_th; here it is torch's
    BatchNorm (tdBN's scale is BN's weight initialised to α·V_th: set ``bn.weight`` to do so).
    """

    def __init__(
        self,
        num_classes: int = 10,
        norm_layer: Callable[..., nn.Module] | None = None,
        spiking_neuron: Callable[..., nn.Module] | None = None,
        **kwargs: Any,
    ) -> None:
        num_classes = _count("num_classes", num_classes)
        super().__init__()
        mode = _step_mode(kwargs)
        norm_layer = norm_layer or layer.BatchNorm2d
        self.conv1 = _conv3x3(3, 128, 1, mode)
        self.bn1 = _norm(norm_layer, 128, mode)
        self.sn1 = _neuron(spiking_neuron, kwargs)
        block_kwargs = dict(kwargs, spiking_neuron=spiking_neuron)
        self.layer1 = _make_layer(BasicBlock, 128, 128, 3, 1, norm_layer, block_kwargs)
        self.layer2 = _make_layer(BasicBlock, 128, 256, 3, 2, norm_layer, block_kwargs)
        self.layer3 = _make_layer(BasicBlock, 256, 512, 2, 2, norm_layer, block_kwargs)
        self.avgpool = layer.AdaptiveAvgPool2d((1, 1), step_mode=mode)
        self.fc1 = layer.Linear(512, 256, step_mode=mode)
        self.sn2 = _neuron(spiking_neuron, kwargs)
        self.fc2 = layer.Linear(256, num_classes, step_mode=mode)
        _init_resnet(self)

    def forward(self, x: Tensor) -> Tensor:
        x = self.sn1(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        x = _flatten(self.avgpool(x), self.avgpool.step_mode)
        return self.fc2(self.sn2(self.fc1(x)))


def spiking_resnet19(pretrained=False, progress=True, spiking_neuron=None, **kwargs) -> ResNet19:
    """ResNet-19 for CIFAR (:class:`ResNet19`); ``num_classes`` defaults to 10."""
    _no_pretrained(pretrained)
    return ResNet19(spiking_neuron=spiking_neuron, **kwargs)
