"""Spikformer (Zhou et al., "Spikformer: When Spiking Neural Network Meets Transformer", ICLR
2023) with SpikingJelly's names (``activation_based.model.spikformer``): the same modules,
parameter names, defaults and arithmetic, so its checkpoints load.

A convolutional patch stem (Conv → BN [→ MaxPool] → LIF, four times, plus a Conv → BN → LIF
positional encoding added to its input) turns ``[T, N, C, H, W]`` into ``[T, N, D, H/p, W/p]``;
``depths`` blocks ``x += SSA(x); x += MLP(x)`` on its ``L = H·W/p²`` tokens
(:class:`~spikefuse.layer.attention.SpikingSelfAttention`; the MLP is Conv1x1 → BN → LIF twice)
follow, then the mean over the tokens and a multi-step Linear head: ``[T, N, num_classes]`` out
(average it over T for the prediction). Input: ``[N, C, H, W]`` images (repeated over ``T``) or
``[T, N, C, H, W]`` sequences.

Neurons: ``spiking_neuron`` (a neuron class, built with ``**kwargs`` in multi-step mode) or, if
None, LIF with each position's defaults (``tau=2``, ``detach_reset=True``, attention products
firing at 0.5), ``kwargs`` overriding them. SpikingJelly's distributed builder configurations
(``SpikformerConfig``, ``SpikformerCIFAR10Config``) are not provided.
"""

from __future__ import annotations

from typing import Any, NoReturn

from torch import Tensor, fx, nn

from .. import functional, layer
from ..errors import SpikefuseError
from ..layer.attention import SpikingSelfAttention
from ._tokens import NeuronClass, lif, to_sequence, token_mean

# fuse() traces the forward with torch.fx: the image-or-sequence branch is one opaque call
fx.wrap("to_sequence")

__all__ = ["Spikformer", "spikformer_cifar10", "spikformer_s", "spikformer_ti"]

_LIF = {"tau": 2.0, "detach_reset": True}


def _lif(spiking_neuron: NeuronClass | None, kwargs: dict[str, Any]) -> nn.Module:
    return lif(spiking_neuron, kwargs, _LIF)


class SpikformerConv2dBN(nn.Module):
    """Conv2d (no bias) → BatchNorm2d [→ MaxPool2d(3, 2, 1)] on ``[T, N, C, H, W]``."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        stride: int = 1,
        padding: int = 0,
        pool: bool = False,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = [
            nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding, bias=False),
            nn.BatchNorm2d(out_channels),
        ]
        if pool:
            layers.append(nn.MaxPool2d(kernel_size=3, stride=2, padding=1))
        self.block = layer.SeqToANNContainer(*layers)

    def forward(self, x_seq: Tensor) -> Tensor:
        return self.block(x_seq)


class SpikformerConv2dBNLIF(nn.Module):
    """:class:`SpikformerConv2dBN` → a neuron (``neuron``)."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        stride: int = 1,
        padding: int = 0,
        pool: bool = False,
        spiking_neuron: NeuronClass | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        self.conv_bn = SpikformerConv2dBN(
            in_channels, out_channels, kernel_size, stride, padding, pool
        )
        self.neuron = _lif(spiking_neuron, kwargs)

    def forward(self, x_seq: Tensor) -> Tensor:
        return self.neuron(self.conv_bn(x_seq))


class SpikformerPatchStem(nn.Module):
    """Four Conv3x3 → BN [→ MaxPool] → LIF stages (``embed_dims`` / 8, / 4, / 2, / 1 channels;
    the last two pool for ``patch_size=4``, all four for 16), then ``x + PE(x)`` with the
    positional encoding ``PE`` a Conv3x3 → BN → LIF: ``[T, N, C, H, W]`` →
    ``[T, N, embed_dims, H/p, W/p]``."""

    def __init__(
        self,
        img_size_h: int = 224,
        img_size_w: int = 224,
        patch_size: int = 16,
        in_channels: int = 3,
        embed_dims: int = 256,
        spiking_neuron: NeuronClass | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        if patch_size not in {4, 16}:
            raise SpikefuseError(
                f"SpikformerPatchStem supports patch_size=4 or 16, but got {patch_size}."
            )
        self.image_size = (img_size_h, img_size_w)
        self.patch_size = patch_size
        self.embed_dims = embed_dims
        dims = [embed_dims // 8, embed_dims // 4, embed_dims // 2, embed_dims]
        pool_from = 2 if patch_size == 4 else 0
        stages, previous = [], in_channels
        for index, channels in enumerate(dims):
            stages.append(
                SpikformerConv2dBNLIF(
                    previous, channels, 3, 1, 1, index >= pool_from, spiking_neuron, **kwargs
                )
            )
            previous = channels
        self.stages = nn.Sequential(*stages)
        self.positional_encoding = SpikformerConv2dBNLIF(
            embed_dims, embed_dims, 3, 1, 1, False, spiking_neuron, **kwargs
        )
        self.grid_size = (img_size_h // patch_size, img_size_w // patch_size)
        self.num_patches = self.grid_size[0] * self.grid_size[1]

    def forward(self, x_seq: Tensor) -> Tensor:
        x_seq = self.stages(x_seq)
        return self.positional_encoding(x_seq) + x_seq


def _conv1x1_bn(in_channels: int, out_channels: int) -> nn.Module:
    return layer.SeqToANNContainer(
        nn.Conv1d(in_channels, out_channels, kernel_size=1, bias=False),
        nn.BatchNorm1d(out_channels),
    )


class SpikformerMLP(nn.Module):
    """Token-wise ``LIF(BN(Conv1x1(·)))`` twice on ``[T, N, C, L]``: ``fc1``/``neuron1``,
    ``fc2``/``neuron2``."""

    def __init__(
        self,
        in_features: int,
        hidden_features: int,
        out_features: int,
        spiking_neuron: NeuronClass | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        self.fc1 = _conv1x1_bn(in_features, hidden_features)
        self.neuron1 = _lif(spiking_neuron, kwargs)
        self.fc2 = _conv1x1_bn(hidden_features, out_features)
        self.neuron2 = _lif(spiking_neuron, kwargs)

    def forward(self, x_seq: Tensor) -> Tensor:
        return self.neuron2(self.fc2(self.neuron1(self.fc1(x_seq))))


class SpikformerBlock(nn.Module):
    """``x += SSA(x); x += MLP(x)`` on the tokens of ``[T, N, C, H, W]`` (same shape out).

    With the default neurons, ``tau`` and ``detach_reset`` in ``kwargs`` reach the MLP's
    neurons only; the attention keeps its own (SpikingJelly's behaviour)."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        spiking_neuron: NeuronClass | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        attention_kwargs = kwargs
        if spiking_neuron is None:
            attention_kwargs = {k: v for k, v in kwargs.items() if k not in _LIF}
        self.attn = SpikingSelfAttention(dim, num_heads, spiking_neuron, **attention_kwargs)
        self.mlp = SpikformerMLP(dim, int(dim * mlp_ratio), dim, spiking_neuron, **kwargs)

    def forward(self, x_seq: Tensor) -> Tensor:
        # a torch.fx proxy passes: fuse() traces the forward to find its chains
        proxy = isinstance(x_seq, fx.Proxy)
        if not proxy and (not isinstance(x_seq, Tensor) or x_seq.dim() != 5):
            got = tuple(x_seq.shape) if isinstance(x_seq, Tensor) else type(x_seq).__name__
            raise SpikefuseError(f"expected 5D input with shape [T, N, C, H, W], but got {got}")
        tokens = x_seq.flatten(3)
        tokens = tokens + self.attn(tokens)
        tokens = tokens + self.mlp(tokens)
        # in the tokens' layout (SpikingJelly makes it contiguous): fused pointwise blocks
        # write channels innermost, which the next block's blocks then read without a copy
        return tokens.reshape(x_seq.shape)


class Spikformer(nn.Module):
    """Spikformer-``depths``-``embed_dims`` (module docstring): ``patch_embed``, ``blocks``,
    ``head``; linear and convolution weights truncated-normal (std 0.02), biases 0, BatchNorm
    1 and 0. Multi-step: ``[N, C, H, W]`` or ``[T, N, C, H, W]`` in, ``[T, N, num_classes]``
    out."""

    def __init__(
        self,
        T: int = 4,
        in_channels: int = 3,
        img_size_h: int = 224,
        img_size_w: int = 224,
        patch_size: int = 16,
        num_classes: int = 1000,
        embed_dims: int = 256,
        num_heads: int = 8,
        mlp_ratio: float = 4.0,
        depths: int = 4,
        spiking_neuron: NeuronClass | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        self.T = T
        self.num_classes = num_classes
        self.embed_dims = embed_dims
        self.num_heads = num_heads
        self.depths = depths
        self.patch_embed = SpikformerPatchStem(
            img_size_h, img_size_w, patch_size, in_channels, embed_dims, spiking_neuron, **kwargs
        )
        self.blocks = nn.ModuleList(
            SpikformerBlock(embed_dims, num_heads, mlp_ratio, spiking_neuron, **kwargs)
            for _ in range(depths)
        )
        self.head = layer.Linear(embed_dims, num_classes, step_mode="m")
        self._init_weights()
        functional.set_step_mode(self, "m")

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d)):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.constant_(m.bias, 0.0)
            elif isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
                nn.init.constant_(m.weight, 1.0)
                nn.init.constant_(m.bias, 0.0)

    def forward_features(self, x_seq: Tensor) -> Tensor:
        """``[T, N, C, H, W]`` → the blocks' output averaged over the tokens, ``[T, N, D]``."""
        x_seq = self.patch_embed(x_seq)
        for block in self.blocks:
            x_seq = block(x_seq)
        return token_mean(x_seq)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.forward_features(to_sequence(x, self.T)))


def spikformer_ti(
    T: int = 4,
    in_channels: int = 3,
    img_size_h: int = 224,
    img_size_w: int = 224,
    num_classes: int = 1000,
    spiking_neuron: NeuronClass | None = None,
    **kwargs: Any,
) -> Spikformer:
    """Spikformer-4-256 for ImageNet (patch 16, 8 heads)."""
    return Spikformer(
        T, in_channels, img_size_h, img_size_w, 16, num_classes, 256, 8, 4.0, 4,
        spiking_neuron, **kwargs,
    )  # fmt: skip


def spikformer_s(
    T: int = 4,
    in_channels: int = 3,
    img_size_h: int = 224,
    img_size_w: int = 224,
    num_classes: int = 1000,
    spiking_neuron: NeuronClass | None = None,
    **kwargs: Any,
) -> Spikformer:
    """Spikformer-6-384 for ImageNet (patch 16, 12 heads)."""
    return Spikformer(
        T, in_channels, img_size_h, img_size_w, 16, num_classes, 384, 12, 4.0, 6,
        spiking_neuron, **kwargs,
    )  # fmt: skip


def spikformer_cifar10(
    T: int = 4,
    num_classes: int = 10,
    spiking_neuron: NeuronClass | None = None,
    **kwargs: Any,
) -> Spikformer:
    """Spikformer-4-384 for CIFAR's 32 x 32 RGB images (patch 4: 64 tokens, 12 heads)."""
    return Spikformer(
        T, 3, 32, 32, 4, num_classes, 384, 12, 4.0, 4, spiking_neuron, **kwargs
    )  # fmt: skip


_NOT_PORTED = ("SpikformerConfig", "SpikformerCIFAR10Config", "SpikformerBuilder")


def __getattr__(name: str) -> NoReturn:
    if name in _NOT_PORTED:
        raise SpikefuseError(
            f"spikefuse.model.spikformer.{name} (SpikingJelly's distributed model builder) is "
            "not available; build the model with spikformer_ti, spikformer_s, "
            "spikformer_cifar10 or Spikformer and train it with `spikefuse train` or DDP"
        )
    raise AttributeError(f"module 'spikefuse.model.spikformer' has no attribute {name!r}")
