"""QKFormer (Zhou et al., "QKFormer: Hierarchical Spiking Transformer using Q-K Attention",
NeurIPS 2024) with SpikingJelly's names (``activation_based.model.qkformer``): the same modules,
parameter names, defaults and arithmetic, so its checkpoints load.

Three stages of ``embed_dims`` / 4, / 2 and / 1 channels, each a residual patch embedding
(Conv → BN [→ MaxPool] → LIF with a strided Conv1x1 → BN → LIF shortcut; the first one shrinks
the maps 4 x, the others 2 x) and blocks ``x += attn(x); x += MLP(x)`` on the tokens
(:class:`~spikefuse.layer.attention.QKAttention` in the first two stages,
:class:`~spikefuse.layer.attention.SpikingSelfAttention` in the third; MLP: Conv1x1 → BN → LIF
twice); then the mean over tokens and time and a Linear head: ``[N, num_classes]`` out. Input:
``[N, C, H, W]`` images (repeated over ``T``) or ``[T, N, C, H, W]`` sequences.

Neurons: ``spiking_neuron`` (a neuron class, built with ``**kwargs`` in multi-step mode) or, if
None, :class:`~spikefuse.neuron.LIFNode` with ``kwargs`` (the attention's neurons have their own
defaults).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor, fx, nn

from .. import functional, layer
from ..errors import SpikefuseError
from ..layer.attention import QKAttention, SpikingSelfAttention
from ._tokens import NeuronClass, lif, to_sequence, token_mean

# fuse() traces the forward with torch.fx: the image-or-sequence branch is one opaque call
fx.wrap("to_sequence")

__all__ = ["QKFormer", "qkformer_10_384"]


def _conv_bn(in_channels: int, out_channels: int, kernel: int = 3, stride: int = 1):
    conv = layer.Conv2d(
        in_channels, out_channels, kernel, stride=stride, padding=kernel // 2, step_mode="m"
    )
    return conv, layer.BatchNorm2d(out_channels, step_mode="m")


def _pool() -> nn.Module:
    return layer.MaxPool2d(3, stride=2, padding=1, step_mode="m")


def _shortcut(in_channels: int, out_channels: int, neuron: nn.Module) -> nn.Sequential:
    """Conv1x1 (stride 2) → BN → neuron."""
    return nn.Sequential(*_conv_bn(in_channels, out_channels, 1, 2), neuron)


class _PatchEmbedInit(nn.Module):
    """Conv → BN → pool → LIF, twice (to ``out_channels`` / 2, then ``out_channels``), then
    Conv → BN → LIF, plus the shortcut of the first stage's spikes: 4 x smaller maps."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        spiking_neuron: NeuronClass | None,
        neuron_kwargs: dict[str, Any],
    ) -> None:
        super().__init__()
        hidden = out_channels // 2
        self.conv1, self.bn1 = _conv_bn(in_channels, hidden)
        self.pool1 = _pool()
        self.lif1 = lif(spiking_neuron, neuron_kwargs)
        self.conv2, self.bn2 = _conv_bn(hidden, out_channels)
        self.pool2 = _pool()
        self.lif2 = lif(spiking_neuron, neuron_kwargs)
        self.conv3, self.bn3 = _conv_bn(out_channels, out_channels)
        self.lif3 = lif(spiking_neuron, neuron_kwargs)
        self.shortcut = _shortcut(hidden, out_channels, lif(spiking_neuron, neuron_kwargs))

    def forward(self, x: Tensor) -> Tensor:
        identity = x = self.lif1(self.pool1(self.bn1(self.conv1(x))))
        x = self.lif2(self.pool2(self.bn2(self.conv2(x))))
        return self.lif3(self.bn3(self.conv3(x))) + self.shortcut(identity)


class _PatchEmbedStage(nn.Module):
    """Conv → BN → pool → LIF, Conv → BN → LIF, plus the shortcut of the input: 2 x smaller."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        spiking_neuron: NeuronClass | None,
        neuron_kwargs: dict[str, Any],
    ) -> None:
        super().__init__()
        self.conv1, self.bn1 = _conv_bn(in_channels, out_channels)
        self.pool = _pool()
        self.lif1 = lif(spiking_neuron, neuron_kwargs)
        self.conv2, self.bn2 = _conv_bn(out_channels, out_channels)
        self.lif2 = lif(spiking_neuron, neuron_kwargs)
        self.shortcut = _shortcut(in_channels, out_channels, lif(spiking_neuron, neuron_kwargs))

    def forward(self, x: Tensor) -> Tensor:
        identity = x
        x = self.lif1(self.pool(self.bn1(self.conv1(x))))
        return self.lif2(self.bn2(self.conv2(x))) + self.shortcut(identity)


class _MLP(nn.Module):
    """``LIF(BN(Conv1x1(·)))`` into ``hidden_dim`` channels and back, on ``[T, N, C, L]``."""

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        spiking_neuron: NeuronClass | None,
        neuron_kwargs: dict[str, Any],
    ) -> None:
        super().__init__()
        self.fc1 = layer.Conv1d(dim, hidden_dim, kernel_size=1, step_mode="m")
        self.bn1 = layer.BatchNorm1d(hidden_dim, step_mode="m")
        self.lif1 = lif(spiking_neuron, neuron_kwargs)
        self.fc2 = layer.Conv1d(hidden_dim, dim, kernel_size=1, step_mode="m")
        self.bn2 = layer.BatchNorm1d(dim, step_mode="m")
        self.lif2 = lif(spiking_neuron, neuron_kwargs)

    def forward(self, x: Tensor) -> Tensor:
        return self.lif2(self.bn2(self.fc2(self.lif1(self.bn1(self.fc1(x))))))


class _Block(nn.Module):
    """``x += attn(x); x += mlp(x)`` on the tokens of ``[T, N, C, H, W]``."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_ratio: float,
        qka_type: str,
        self_attention: bool,
        spiking_neuron: NeuronClass | None,
        neuron_kwargs: dict[str, Any],
    ) -> None:
        super().__init__()
        self.attn: nn.Module
        if self_attention:
            self.attn = SpikingSelfAttention(dim, num_heads, spiking_neuron, **neuron_kwargs)
        else:
            self.attn = QKAttention(dim, num_heads, qka_type, spiking_neuron, **neuron_kwargs)
        self.mlp = _MLP(dim, int(dim * mlp_ratio), spiking_neuron, neuron_kwargs)

    def forward(self, x: Tensor) -> Tensor:
        tokens = x.flatten(3)
        tokens = tokens + self.attn(tokens)
        tokens = tokens + self.mlp(tokens)
        return tokens.reshape(x.shape)


class QKFormer(nn.Module):
    """QKFormer (module docstring): ``patch_embed1..3``, ``stage1..3``, ``head`` (an
    ``nn.Linear``). ``num_heads`` and ``depths`` give each stage's heads and blocks;
    ``qka_type`` ('token' or 'channel') the Q-K attention's mask. ``[N, num_classes]`` out."""

    def __init__(
        self,
        T: int = 4,
        in_channels: int = 3,
        num_classes: int = 1000,
        embed_dims: int = 384,
        num_heads: Sequence[int] = (3, 6, 6),
        depths: Sequence[int] = (1, 2, 7),
        mlp_ratio: float = 4.0,
        qka_type: str = "token",
        spiking_neuron: NeuronClass | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        if len(num_heads) != 3 or len(depths) != 3:
            raise SpikefuseError("num_heads and depths must contain three stage values")
        if embed_dims % 4:
            raise SpikefuseError("embed_dims must be divisible by 4")
        dims = (embed_dims // 4, embed_dims // 2, embed_dims)
        self.T = T
        self.patch_embed1 = _PatchEmbedInit(in_channels, dims[0], spiking_neuron, kwargs)
        self.patch_embed2 = _PatchEmbedStage(dims[0], dims[1], spiking_neuron, kwargs)
        self.patch_embed3 = _PatchEmbedStage(dims[1], dims[2], spiking_neuron, kwargs)
        for index in range(3):
            blocks = (
                _Block(
                    dims[index],
                    num_heads[index],
                    mlp_ratio,
                    qka_type,
                    index == 2,
                    spiking_neuron,
                    kwargs,
                )  # fmt: skip
                for _ in range(depths[index])
            )
            setattr(self, f"stage{index + 1}", nn.ModuleList(blocks))
        self.head = nn.Linear(embed_dims, num_classes)
        functional.set_step_mode(self, "m")

    def forward(self, x: Tensor) -> Tensor:
        """``[N, C, H, W]`` or ``[T, N, C, H, W]`` → logits ``[N, num_classes]`` (time-averaged)."""
        x = to_sequence(x, self.T)
        for index in (1, 2, 3):
            x = getattr(self, f"patch_embed{index}")(x)
            for block in getattr(self, f"stage{index}"):
                x = block(x)
        return self.head(token_mean(x).mean(0))


def qkformer_10_384(
    T: int = 4,
    in_channels: int = 3,
    num_classes: int = 1000,
    spiking_neuron: NeuronClass | None = None,
    **kwargs: Any,
) -> QKFormer:
    """QKFormer-10-384 (1, 2 and 7 blocks of 6 heads). ``kwargs`` naming a :class:`QKFormer`
    argument (``qka_type``, ``mlp_ratio``) set it; the others go to the neurons."""
    return QKFormer(
        T=T, in_channels=in_channels, num_classes=num_classes, embed_dims=384,
        num_heads=(6, 6, 6), depths=(1, 2, 7), spiking_neuron=spiking_neuron, **kwargs,
    )  # fmt: skip
