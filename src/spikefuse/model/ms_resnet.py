"""MS-ResNet and Max-ResNet with SpikingJelly's names (``activation_based.model.ms_resnet``).

MS-ResNet (Hu et al., "Advancing Spiking Neural Networks towards Deep Residual Learning"): each
residual branch spikes before its convolutions (LIF → Conv → BN, twice) and the shortcut adds
membrane-potential-like values, never spikes. Max-ResNet ("Spiking Neural Networks Need High
Frequency Information") downsamples with a max-pool inside the transition blocks. The networks
are multi-step: ``forward`` takes ``[N, C, H, W]`` images (repeated over ``T``) or ``[T, N, C,
H, W]`` sequences and returns ``[N, num_classes]`` (the mean over time). Their LIF → Conv → BN
→ LIF runs fuse with :func:`spikefuse.fuse` where a BN's output feeds only the next neuron.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from torch import Tensor, nn

from .. import functional, layer, surrogate
from .._neuron import _make_multi_step_neuron
from ..errors import SpikefuseError

__all__ = ["MSResNet", "MaxResNet", "max_resnet18", "ms_resnet18", "ms_resnet34"]

SpikingNeuron = Callable[..., nn.Module]


def _conv3x3(in_channels: int, out_channels: int, stride: int = 1) -> nn.Module:
    return layer.Conv2d(
        in_channels, out_channels, kernel_size=3, stride=stride, padding=1, bias=False,
        step_mode="m",
    )  # fmt: skip


def _conv1x1(in_channels: int, out_channels: int, stride: int = 1) -> nn.Module:
    return layer.Conv2d(
        in_channels, out_channels, kernel_size=1, stride=stride, bias=False, step_mode="m"
    )


def _bn(channels: int, weight: float) -> nn.Module:
    bn = layer.BatchNorm2d(channels, step_mode="m")
    nn.init.constant_(bn.weight, weight)
    return bn


class _MSBlock(nn.Module):
    """LIF → Conv3x3 → BN → LIF → Conv3x3 → BN, plus the shortcut (``downsample`` or x).

    The neurons are ``spiking_neuron(**neuron_kwargs, step_mode='m')``; with
    ``spiking_neuron=None`` a ``LIFNode`` of the paper's parameters (:meth:`_lif_defaults`),
    which ``neuron_kwargs`` override one by one (SpikingJelly's ``_make_lif``)."""

    tau: ClassVar[float] = 4.0 / 3.0
    bn_weight: ClassVar[float] = 0.5
    zero_init: ClassVar[bool] = True

    @classmethod
    def _lif_defaults(cls) -> dict[str, Any]:
        return {
            "tau": cls.tau, "v_threshold": 0.5, "detach_reset": True, "decay_input": False,
            "surrogate_function": surrogate.Rect(alpha=2.0),
        }  # fmt: skip

    @classmethod
    def _make_lif(
        cls,
        spiking_neuron: SpikingNeuron | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> nn.Module:
        return _make_multi_step_neuron(spiking_neuron, kwargs or {}, cls._lif_defaults())

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        stride: int,
        downsample: nn.Module | None,
        spiking_neuron: SpikingNeuron | None = None,
        neuron_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.spike1 = self._make_lif(spiking_neuron, neuron_kwargs)
        self.conv1 = _conv3x3(in_channels, out_channels, stride)
        self.bn1 = _bn(out_channels, self.bn_weight)
        self.spike2 = self._make_lif(spiking_neuron, neuron_kwargs)
        self.conv2 = _conv3x3(out_channels, out_channels)
        self.bn2 = _bn(out_channels, 0.0 if self.zero_init else self.bn_weight)
        self.downsample = downsample

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.bn1(self.conv1(self.spike1(x)))
        return self.bn2(self.conv2(self.spike2(out))) + identity


class _MaxResNetBlock(_MSBlock):
    tau = 2.0
    bn_weight = 1.0
    zero_init = False

    @classmethod
    def _lif_defaults(cls) -> dict[str, Any]:
        return {"tau": cls.tau, "detach_reset": True}


class _MaxResNetMaxBlock(_MaxResNetBlock):
    """The transition block: stride-1 convolutions and a 3x3 max-pool of ``stride`` between."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        stride: int,
        downsample: nn.Module | None,
        spiking_neuron: SpikingNeuron | None = None,
        neuron_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(in_channels, out_channels, 1, downsample, spiking_neuron, neuron_kwargs)
        self.max_pool = layer.MaxPool2d(kernel_size=3, stride=stride, padding=1, step_mode="m")

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.max_pool(self.bn1(self.conv1(self.spike1(x))))
        return self.bn2(self.conv2(self.spike2(out))) + identity


class MSResNet(nn.Module):
    """Membrane-shortcut ResNet: stem Conv → BN [→ MaxPool], three or four stages of blocks,
    then LIF → adaptive average pool → Linear, averaged over time (SpikingJelly's defaults).

    Every neuron is ``spiking_neuron(**kwargs, step_mode='m')``; with ``spiking_neuron=None``
    each is the paper's LIF, whose parameters ``kwargs`` override one by one (e.g.
    ``backend='cuda'``). ``kwargs`` with ``step_mode`` other than 'm' raises ``ValueError``."""

    _block_type: ClassVar[type[_MSBlock]] = _MSBlock
    _transition_block_type: ClassVar[type[_MSBlock]] = _MSBlock
    _first_stage_stride: ClassVar[int] = 2
    _bn_weight: ClassVar[float] = 0.5

    def __init__(
        self,
        T: int = 6,
        in_channels: int = 3,
        num_classes: int = 1000,
        layers: tuple[int, ...] = (2, 2, 2, 2),
        base_channels: int = 64,
        stem_kernel_size: int = 7,
        stem_stride: int = 2,
        stem_pool: bool = False,
        stage_channels: tuple[int, ...] | None = None,
        spiking_neuron: SpikingNeuron | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        if len(layers) not in (3, 4):
            raise SpikefuseError(f"layers must give three or four stage depths, got {layers!r}")
        if stage_channels is None:
            stage_channels = tuple(base_channels * 2**i for i in range(len(layers)))
        if len(stage_channels) != len(layers):
            raise SpikefuseError("stage_channels must have one entry per stage of layers")
        self.T, self.inplanes = T, base_channels
        # what _make_layer builds the neurons from (a subclass may override it); removed below
        self._spiking_neuron, self._neuron_kwargs = spiking_neuron, kwargs
        stem_conv = layer.Conv2d(
            in_channels, base_channels, stem_kernel_size, stride=stem_stride,
            padding=stem_kernel_size // 2, bias=False, step_mode="m",
        )  # fmt: skip
        self.stem = nn.Sequential(stem_conv, _bn(base_channels, self._bn_weight))
        if stem_pool:
            self.stem.append(layer.MaxPool2d(3, stride=2, padding=1, step_mode="m"))
        strides = (self._first_stage_stride, 2, 2, 2)[: len(layers)]
        stages = [
            self._make_layer(c, n, s)
            for c, n, s in zip(stage_channels, layers, strides, strict=True)
        ]
        self.layer1, self.layer2, self.layer3 = stages[:3]
        self.layer4 = stages[3] if len(stages) == 4 else None
        self.head_lif = self._block_type._make_lif(spiking_neuron, kwargs)
        self.avgpool = layer.AdaptiveAvgPool2d((1, 1), step_mode="m")
        self.head = layer.Linear(stage_channels[-1], num_classes, step_mode="m")
        del self._spiking_neuron, self._neuron_kwargs
        functional.set_step_mode(self, "m")

    def _make_layer(self, out_channels: int, blocks: int, stride: int) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != out_channels:
            downsample = nn.Sequential(
                _conv1x1(self.inplanes, out_channels, stride), _bn(out_channels, self._bn_weight)
            )
        first = self._transition_block_type if stride != 1 else self._block_type
        neuron = (self._spiking_neuron, self._neuron_kwargs)
        modules = [first(self.inplanes, out_channels, stride, downsample, *neuron)]
        self.inplanes = out_channels
        modules += [
            self._block_type(out_channels, out_channels, 1, None, *neuron) for _ in range(1, blocks)
        ]
        return nn.Sequential(*modules)

    def _to_sequence(self, x: Tensor) -> Tensor:
        if x.ndim == 4:
            return x.unsqueeze(0).repeat(self.T, 1, 1, 1, 1)
        if x.ndim == 5:
            return x
        raise SpikefuseError(
            f"expected [N, C, H, W] or [T, N, C, H, W] input, got {tuple(x.shape)}"
        )

    def forward(self, x: Tensor) -> Tensor:
        x = self.layer3(self.layer2(self.layer1(self.stem(self._to_sequence(x)))))
        if self.layer4 is not None:
            x = self.layer4(x)
        x = self.avgpool(self.head_lif(x)).flatten(2)
        return self.head(x).mean(0)


class MaxResNet(MSResNet):
    """Max-ResNet: :class:`MSResNet` with max-pool downsampling in the transition blocks."""

    _block_type = _MaxResNetBlock
    _transition_block_type = _MaxResNetMaxBlock
    _first_stage_stride = 1
    _bn_weight = 1.0


def ms_resnet18(
    T: int = 6,
    in_channels: int = 3,
    num_classes: int = 1000,
    spiking_neuron: SpikingNeuron | None = None,
    **kwargs: Any,
) -> MSResNet:
    """MS-ResNet-18 (stages of 2, 2, 2, 2); ``spiking_neuron`` and ``kwargs`` as in
    :class:`MSResNet`."""
    return MSResNet(
        T=T, in_channels=in_channels, num_classes=num_classes, spiking_neuron=spiking_neuron,
        **kwargs,
    )  # fmt: skip


def ms_resnet34(
    T: int = 6,
    in_channels: int = 3,
    num_classes: int = 1000,
    spiking_neuron: SpikingNeuron | None = None,
    **kwargs: Any,
) -> MSResNet:
    """MS-ResNet-34 (stages of 3, 4, 6, 3); ``spiking_neuron`` and ``kwargs`` as in
    :class:`MSResNet`."""
    return MSResNet(
        T=T, in_channels=in_channels, num_classes=num_classes, layers=(3, 4, 6, 3),
        spiking_neuron=spiking_neuron, **kwargs,
    )  # fmt: skip


def max_resnet18(
    T: int = 4,
    in_channels: int = 3,
    num_classes: int = 10,
    spiking_neuron: SpikingNeuron | None = None,
    **kwargs: Any,
) -> MaxResNet:
    """Max-ResNet-18's CIFAR configuration (stages of 3, 3, 2 with 128, 256, 512 channels,
    3x3 stride-1 stem); ``spiking_neuron`` and ``kwargs`` as in :class:`MSResNet`."""
    return MaxResNet(
        T=T, in_channels=in_channels, num_classes=num_classes, layers=(3, 3, 2),
        stage_channels=(128, 256, 512), stem_kernel_size=3, stem_stride=1, stem_pool=False,
        spiking_neuron=spiking_neuron, **kwargs,
    )  # fmt: skip
