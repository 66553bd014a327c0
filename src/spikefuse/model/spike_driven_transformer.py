"""The Spike-driven Transformer (Yao et al., NeurIPS 2023) with SpikingJelly's names
(``activation_based.model.spike_driven_transformer``): the same modules, parameter names,
defaults and arithmetic, so its checkpoints load.

A patch embedding (Conv3x3 → BN → LIF [→ MaxPool] three times, a fourth Conv → BN [→ MaxPool],
plus a relative position embedding ``BN(Conv(LIF(x)))`` added to it; ``pooling_stat`` says
which of the four stages pool), ``depths`` blocks of
:class:`~spikefuse.layer.attention.SpikeDrivenSelfAttention` and a membrane-shortcut MLP
(``x + BN(Conv1x1(LIF(·)))``, twice), then the mean over the tokens, a LIF, the mean over time
and a Linear head: ``[N, num_classes]`` out. Input: ``[N, C, H, W]`` images (repeated over
``T``) or ``[T, N, C, H, W]`` sequences.

Neurons: ``spiking_neuron`` (a neuron class, built with ``**kwargs`` in multi-step mode) or, if
None, :class:`~spikefuse.neuron.LIFNode` with ``kwargs`` (the attention's neurons have their own
defaults).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, fx, nn

from .. import functional, layer
from ..errors import SpikefuseError
from ..layer.attention import SpikeDrivenSelfAttention
from ._tokens import NeuronClass, lif, to_sequence, token_mean

# fuse() traces the forward with torch.fx: the image-or-sequence branch is one opaque call
fx.wrap("to_sequence")

__all__ = ["SpikeDrivenTransformer", "sdt_8_384"]


def _conv_bn(in_channels: int, out_channels: int, bias: bool = True) -> list[nn.Module]:
    return [
        layer.Conv2d(in_channels, out_channels, 3, padding=1, bias=bias, step_mode="m"),
        layer.BatchNorm2d(out_channels, step_mode="m"),
    ]


def _pool() -> nn.Module:
    return layer.MaxPool2d(3, stride=2, padding=1, step_mode="m")


class _PatchEmbed(nn.Module):
    """``stages`` (Conv → BN → LIF [→ pool], x3), ``final_stage`` (Conv → BN [→ pool]),
    ``final_lif``, ``rpe_conv``, ``rpe_bn``: ``x + RPE(x)`` out."""

    def __init__(
        self,
        in_channels: int,
        embed_dims: int,
        pooling_stat: str,
        spiking_neuron: NeuronClass | None,
        neuron_kwargs: dict[str, Any],
    ) -> None:
        super().__init__()
        channels = (embed_dims // 8, embed_dims // 4, embed_dims // 2)
        self.stages = nn.ModuleList()
        previous = in_channels
        for pools, out_channels in zip(pooling_stat[:3], channels, strict=True):
            stage = [*_conv_bn(previous, out_channels), lif(spiking_neuron, neuron_kwargs)]
            if pools == "1":
                stage.append(_pool())
            self.stages.append(nn.Sequential(*stage))
            previous = out_channels
        final = _conv_bn(previous, embed_dims)
        if pooling_stat[3] == "1":
            final.append(_pool())
        self.final_stage = nn.Sequential(*final)
        self.final_lif = lif(spiking_neuron, neuron_kwargs)
        self.rpe_conv, self.rpe_bn = _conv_bn(embed_dims, embed_dims, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        for stage in self.stages:
            x = stage(x)
        x = self.final_stage(x)
        return self.rpe_bn(self.rpe_conv(self.final_lif(x))) + x


class _MLP(nn.Module):
    """``x + BN(Conv1x1(LIF(x)))`` into ``hidden_dim`` channels and back (the first residual only
    where the widths match): ``fc1``/``bn1``/``lif1``, ``fc2``/``bn2``/``lif2``."""

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        spiking_neuron: NeuronClass | None,
        neuron_kwargs: dict[str, Any],
    ) -> None:
        super().__init__()
        self.residual = dim == hidden_dim
        self.fc1 = layer.Conv2d(dim, hidden_dim, 1, step_mode="m")
        self.bn1 = layer.BatchNorm2d(hidden_dim, step_mode="m")
        self.lif1 = lif(spiking_neuron, neuron_kwargs)
        self.fc2 = layer.Conv2d(hidden_dim, dim, 1, step_mode="m")
        self.bn2 = layer.BatchNorm2d(dim, step_mode="m")
        self.lif2 = lif(spiking_neuron, neuron_kwargs)

    def forward(self, x: Tensor) -> Tensor:
        identity = x
        x = self.bn1(self.fc1(self.lif1(x)))
        if self.residual:
            x = identity = x + identity
        return self.bn2(self.fc2(self.lif2(x))) + identity


class _Block(nn.Module):
    """``attn`` (spike-driven self-attention, with its residual), then ``mlp``."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_ratio: float,
        spiking_neuron: NeuronClass | None,
        neuron_kwargs: dict[str, Any],
    ) -> None:
        super().__init__()
        self.attn = SpikeDrivenSelfAttention(
            dim, num_heads, spiking_neuron=spiking_neuron, **neuron_kwargs
        )
        self.mlp = _MLP(dim, int(dim * mlp_ratio), spiking_neuron, neuron_kwargs)

    def forward(self, x: Tensor) -> Tensor:
        return self.mlp(self.attn(x))


class SpikeDrivenTransformer(nn.Module):
    """Spike-driven Transformer-``depths``-``embed_dims`` (module docstring): ``patch_embed``,
    ``blocks``, ``head_lif``, ``head`` (an ``nn.Linear``). ``pooling_stat``: four '0'/'1'
    characters, whether each patch-embedding stage halves the maps ('1111': 16 x smaller, the
    ImageNet layout; '0011' suits CIFAR). ``[N, num_classes]`` out."""

    def __init__(
        self,
        T: int = 4,
        in_channels: int = 3,
        num_classes: int = 1000,
        embed_dims: int = 384,
        num_heads: int = 8,
        depths: int = 8,
        mlp_ratio: float = 4.0,
        pooling_stat: str = "1111",
        spiking_neuron: NeuronClass | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        mask = isinstance(pooling_stat, str) and len(pooling_stat) == 4
        if not mask or set(pooling_stat) - {"0", "1"}:
            raise SpikefuseError(
                f"pooling_stat must be a four-character 0/1 mask, got {pooling_stat!r}"
            )
        self.T = T
        self.patch_embed = _PatchEmbed(
            in_channels, embed_dims, pooling_stat, spiking_neuron, kwargs
        )
        self.blocks = nn.ModuleList(
            _Block(embed_dims, num_heads, mlp_ratio, spiking_neuron, kwargs) for _ in range(depths)
        )
        self.head_lif = lif(spiking_neuron, kwargs)
        self.head = nn.Linear(embed_dims, num_classes)
        functional.set_step_mode(self, "m")

    def forward(self, x: Tensor) -> Tensor:
        """``[N, C, H, W]`` or ``[T, N, C, H, W]`` → logits ``[N, num_classes]`` (time-averaged)."""
        x = self.patch_embed(to_sequence(x, self.T))
        for block in self.blocks:
            x = block(x)
        x = self.head_lif(token_mean(x))
        return self.head(x.mean(0))


def sdt_8_384(
    T: int = 4,
    in_channels: int = 3,
    num_classes: int = 1000,
    spiking_neuron: NeuronClass | None = None,
    **kwargs: Any,
) -> SpikeDrivenTransformer:
    """Spike-driven Transformer-8-384 (8 heads). ``kwargs`` naming a
    :class:`SpikeDrivenTransformer` argument (``pooling_stat``, ``mlp_ratio``) set it; the
    others go to the neurons."""
    return SpikeDrivenTransformer(
        T=T, in_channels=in_channels, num_classes=num_classes, embed_dims=384, num_heads=8,
        depths=8, spiking_neuron=spiking_neuron, **kwargs,
    )  # fmt: skip
