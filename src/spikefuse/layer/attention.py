"""SpikingJelly's attention layers (``activation_based.layer.attention``), with its names,
arguments, defaults, parameter names (so its checkpoints load) and arithmetic.

Token attention of spiking transformers (multi-step only, ``[T, N, C, L]`` or ``[T, N, C, H, W]``
in, the same shape out): :class:`SpikingSelfAttention` (Spikformer),
:class:`SpikeDrivenSelfAttention` (Spike-driven Transformer), :class:`QKAttention` with its
:class:`TokenQKAttention` and :class:`ChannelQKAttention` (QKFormer). Their neurons come from
``spiking_neuron`` (a neuron class; None: :class:`~spikefuse.neuron.LIFNode` with each position's
default parameters, ``tau=2``, ``detach_reset=True`` and ``v_threshold=0.5`` after the attention
product), built with ``**kwargs`` in multi-step mode.

Attention over axes of convolutional feature maps (``[T, N, C, H, W]``):
:class:`TemporalWiseAttention` (TA-SNN) and :class:`MultiDimensionalAttention` (MA-SNN).

Input that does not fit (wrong rank, channel count other than ``dim``) raises
:class:`~spikefuse.errors.SpikefuseError` (a ``ValueError``, as SpikingJelly raises), and so do
constructor arguments SpikingJelly asserts on.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, fx, nn

from .._neuron import _make_multi_step_neuron
from ..base import MultiStepModule
from ..errors import SpikefuseError
from ..spike_matmul import spike_gate, spike_matmul_chain_heads
from ._base import BatchNorm2d, Conv2d, SeqToANNContainer

__all__ = [
    "TemporalWiseAttention",
    "MultiDimensionalAttention",
    "SpikingSelfAttention",
    "QKAttention",
    "TokenQKAttention",
    "ChannelQKAttention",
    "SpikeDrivenSelfAttention",
]

NeuronClass = Callable[..., nn.Module]
# Each position's LIF parameters when spiking_neuron is None (SpikingJelly's).
_LIF = {"tau": 2.0, "detach_reset": True}
_ATTN_LIF = {"tau": 2.0, "v_threshold": 0.5, "detach_reset": True}


def _neuron(spiking_neuron: NeuronClass | None, kwargs: dict[str, Any], attn: bool = False):
    return _make_multi_step_neuron(spiking_neuron, kwargs, _ATTN_LIF if attn else _LIF)


def _check_int(who: str, name: str, value: Any) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise SpikefuseError(f"{who}: {name} must be an int >= 1, got {value!r}")


def _check_heads(who: str, dim: int, num_heads: int) -> None:
    _check_int(who, "dim", dim)
    _check_int(who, "num_heads", num_heads)
    if dim % num_heads != 0:
        raise SpikefuseError(f"{who}: dim {dim} should be divided by num_heads {num_heads}.")


def _check_input(who: str, x: Tensor, shape: str, channels: int | None = None) -> None:
    """``x`` must be a tensor of ``shape``'s rank with ``channels`` at dimension 2.

    A torch.fx proxy passes: :func:`~spikefuse.fused.fuse` traces the forward to find its
    chains, and the check runs on the tensors of every real call."""
    if isinstance(x, fx.Proxy):
        return
    rank = shape.count(",") + 1
    if not isinstance(x, Tensor) or x.dim() != rank:
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise SpikefuseError(f"{who}: expected {rank}D input with shape {shape}, but got {got}")
    if channels is not None and x.shape[2] != channels:
        raise SpikefuseError(
            f"{who}: input {shape} has C={x.shape[2]} channels, but the layer was built for "
            f"dim={channels}"
        )


def _conv1x1_bn(in_channels: int, out_channels: int) -> SeqToANNContainer:
    """Token-wise Conv1d(kernel 1, no bias) → BatchNorm1d on ``[T, N, C, L]``."""
    return SeqToANNContainer(
        nn.Conv1d(in_channels, out_channels, kernel_size=1, stride=1, bias=False),
        nn.BatchNorm1d(out_channels),
    )


class _HeadedAttention(nn.Module):
    """``dim`` channels in ``num_heads`` heads of ``head_dim = dim // num_heads``."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        _check_heads(type(self).__name__, dim, num_heads)
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = dim // num_heads

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_heads={self.num_heads}"


class SpikingSelfAttention(_HeadedAttention):
    """Spiking Self-Attention of Spikformer (Zhou et al., ICLR 2023) on spikes ``[T, N, C, L]``
    (``L`` tokens, ``C = dim``), returning spikes ``[T, N, C, L]``.

    With ``Q, K, V = LIF(BN(Conv1x1(x)))`` split into ``num_heads`` heads ``[C/heads, L]``:
    ``out = LIF_p(BN(Conv1x1(LIF_a(0.125 · (V Kᵀ) Q))))``, ``LIF_a`` firing at 0.5. No softmax:
    ``V Kᵀ`` and its product with ``Q`` are integer sums of spikes (evaluated in this order,
    as SpikingJelly does), computed by
    :func:`~spikefuse.spike_matmul.spike_matmul_chain_heads` (exact on CUDA tensor cores).

    Modules: ``qkv_conv_bn`` (Conv1d dim → 3·dim, BatchNorm1d), ``qkv_lif``, ``attn_lif``,
    ``proj_conv_bn``, ``proj_lif``; ``scale`` is 0.125."""

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        spiking_neuron: NeuronClass | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(dim, num_heads)
        self.scale = 0.125
        self.qkv_conv_bn = _conv1x1_bn(dim, dim * 3)
        self.qkv_lif = _neuron(spiking_neuron, kwargs)
        self.attn_lif = _neuron(spiking_neuron, kwargs, attn=True)
        self.proj_conv_bn = _conv1x1_bn(dim, dim)
        self.proj_lif = _neuron(spiking_neuron, kwargs)

    def forward(self, x_seq: Tensor) -> Tensor:
        _check_input("SpikingSelfAttention", x_seq, "[T, N, C, L]", self.dim)
        qkv = self.qkv_lif(self.qkv_conv_bn(x_seq))  # [T, N, 3C, L]
        # q, k, v: the heads [T, N, heads, C/heads, L] of qkv's three thirds, qkv_lif's spikes
        # by construction: their products are integer counts, exact on tensor cores on CUDA
        # (the plain matmul elsewhere, SpikingJelly's order); qkv's gradient comes back whole
        x_seq = spike_matmul_chain_heads(qkv, self.num_heads, self.scale)
        x_seq = self.attn_lif(x_seq).flatten(2, 3)  # [T, N, C, L]
        return self.proj_lif(self.proj_conv_bn(x_seq))


class QKAttention(_HeadedAttention):
    """Q-K Attention of QKFormer (Zhou et al., NeurIPS 2024) on spikes ``[T, N, C, L]``,
    returning spikes ``[T, N, C, L]``.

    With ``Q, K = LIF(BN(Conv1x1(x)))`` split into heads ``[C/heads, L]``, a spiking mask from
    the sum of Q, ``A = LIF_a(Σ Q)``, over the head's channels (``qka_type='token'``: a mask
    ``[1, L]`` per token) or over the tokens (``'channel'``: ``[C/heads, 1]`` per channel),
    gates K: ``out = LIF_p(BN(Conv1x1(A ⊙ K)))``, ``LIF_a`` firing at 0.5.

    Modules: ``qk_conv_bn`` (Conv1d dim → 2·dim, BatchNorm1d), ``qk_lif``, ``attn_lif``,
    ``proj_conv_bn``, ``proj_lif``. ``qka_type`` is read-only; ``sum_dim`` is the dimension of
    ``[T, N, heads, C/heads, L]`` summed over."""

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        qka_type: str = "token",
        spiking_neuron: NeuronClass | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(dim, num_heads)
        if qka_type not in ("token", "channel"):
            raise SpikefuseError(
                f"qka_type should be either 'token' or 'channel', but got {qka_type}."
            )
        self._qka_type = qka_type
        self.qk_conv_bn = _conv1x1_bn(dim, dim * 2)
        self.qk_lif = _neuron(spiking_neuron, kwargs)
        self.sum_dim = 3 if qka_type == "token" else 4
        self.attn_lif = _neuron(spiking_neuron, kwargs, attn=True)
        self.proj_conv_bn = _conv1x1_bn(dim, dim)
        self.proj_lif = _neuron(spiking_neuron, kwargs)

    @property
    def qka_type(self) -> str:
        """'token' or 'channel', fixed at construction."""
        return self._qka_type

    def forward(self, x_seq: Tensor) -> Tensor:
        _check_input(type(self).__name__, x_seq, "[T, N, C, L]", self.dim)
        qk = self.qk_lif(self.qk_conv_bn(x_seq))  # [T, N, 2C, L]
        q, k = qk.unflatten(2, (2 * self.num_heads, self.head_dim)).chunk(2, dim=2)
        attn = self.attn_lif(q.sum(dim=self.sum_dim, keepdim=True))
        # attn * k; backward keeps both as bytes, not the float Q/K spikes k is a view of
        x_seq = spike_gate(attn, k).flatten(2, 3)  # [T, N, C, L]
        return self.proj_lif(self.proj_conv_bn(x_seq))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_heads={self.num_heads}, qka_type={self.qka_type}"


class TokenQKAttention(QKAttention):
    """:class:`QKAttention` with ``qka_type='token'`` (a spiking mask per token)."""

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        spiking_neuron: NeuronClass | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(dim, num_heads, qka_type="token", spiking_neuron=spiking_neuron, **kwargs)


class ChannelQKAttention(QKAttention):
    """:class:`QKAttention` with ``qka_type='channel'`` (a spiking mask per channel)."""

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        spiking_neuron: NeuronClass | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            dim, num_heads, qka_type="channel", spiking_neuron=spiking_neuron, **kwargs
        )


class SpikeDrivenSelfAttention(_HeadedAttention):
    """Spike-Driven Self-Attention of the Spike-driven Transformer (Yao et al., NeurIPS 2023) on
    ``[T, N, C, H, W]`` (``C = dim``; membrane-like values, spiked first), returning
    ``[T, N, C, H, W]`` with the residual added.

    ``S = LIF_s(x)``; ``Q, K, V = LIF(BN(Conv1x1(S)))`` split into heads ``[H·W, C/heads]``;
    ``out = BN(Conv1x1(Q ⊙ LIF_a(Σ_tokens K ⊙ V))) + x``: element-wise products and a sum over
    the tokens instead of matrix products, ``LIF_a`` firing at 0.5.

    Modules: ``shortcut_lif``, ``q_conv``/``q_bn``/``q_lif`` (likewise ``k_``, ``v_``: Conv2d
    without bias, BatchNorm2d), ``attn_lif``, ``proj_conv`` (with bias), ``proj_bn``."""

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        spiking_neuron: NeuronClass | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(dim, num_heads)
        self.shortcut_lif = _neuron(spiking_neuron, kwargs)
        for name in ("q", "k", "v"):
            setattr(self, f"{name}_conv", Conv2d(dim, dim, 1, bias=False, step_mode="m"))
            setattr(self, f"{name}_bn", BatchNorm2d(dim, step_mode="m"))
            setattr(self, f"{name}_lif", _neuron(spiking_neuron, kwargs))
        self.attn_lif = _neuron(spiking_neuron, kwargs, attn=True)
        self.proj_conv = Conv2d(dim, dim, 1, step_mode="m")
        self.proj_bn = BatchNorm2d(dim, step_mode="m")

    def _heads(self, x: Tensor) -> Tensor:
        """``[T, N, C, H, W]`` → ``[T, N, heads, H·W, C/heads]``."""
        tokens = x.flatten(3).transpose(-1, -2)  # [T, N, HW, C]
        return tokens.unflatten(-1, (self.num_heads, self.head_dim)).permute(0, 1, 3, 2, 4)

    def _spikes(self, name: str, x: Tensor) -> Tensor:
        conv, bn, lif = (getattr(self, f"{name}_{part}") for part in ("conv", "bn", "lif"))
        return self._heads(lif(bn(conv(x))))

    def forward(self, x: Tensor) -> Tensor:
        _check_input("SpikeDrivenSelfAttention", x, "[T, N, C, H, W]", self.dim)
        identity = x
        x = self.shortcut_lif(x)
        q, k, v = (self._spikes(name, x) for name in ("q", "k", "v"))
        kv = self.attn_lif((k * v).sum(dim=-2, keepdim=True))  # [T, N, heads, 1, C/heads]
        x = (q * kv).transpose(3, 4).reshape(identity.shape)
        return self.proj_bn(self.proj_conv(x)) + identity


def _check_reduction(who: str, size_name: str, size: int, name: str, reduction: int) -> None:
    _check_int(who, size_name, size)
    _check_int(who, name, reduction)
    if size < reduction:
        raise SpikefuseError(f"{who}: {name} cannot be greater than {size_name}")


class TemporalWiseAttention(nn.Module, MultiStepModule):
    """Temporal-wise attention of TA-SNN (Yao et al., ICCV 2021), placed between a layer and
    its neurons: each sample's T steps are weighted by
    ``s = sigmoid(MLP(avg(x)) + MLP(max(x)))`` (pools over all but T, ``MLP`` =
    Linear(T, T // reduction) → ReLU → Linear(T // reduction, T), no biases), ``out = s ⊙ x``.

    Input ``[T, N, C, H, W]`` (``dimension=4``) or ``[T, N, L]`` (``dimension=2``), the same shape
    out. Multi-step only. Modules: ``avg_pool``, ``max_pool``, ``sharedMLP``."""

    def __init__(self, T: int, reduction: int = 16, dimension: int = 4) -> None:
        super().__init__()
        self.step_mode = "m"
        if dimension not in (2, 4):
            raise SpikefuseError(
                f"TemporalWiseAttention: dimension must be 4 or 2, got {dimension!r}"
            )
        _check_reduction("TemporalWiseAttention", "T", T, "reduction", reduction)
        self.dimension = dimension
        pools = (nn.AdaptiveAvgPool1d, nn.AdaptiveMaxPool1d)
        if dimension == 4:
            pools = (nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool3d)  # type: ignore[assignment]
        self.avg_pool, self.max_pool = pools[0](1), pools[1](1)
        self.sharedMLP = nn.Sequential(
            nn.Linear(T, T // reduction, bias=False),
            nn.ReLU(),
            nn.Linear(T // reduction, T, bias=False),
        )

    def forward(self, x_seq: Tensor) -> Tensor:
        shape = "[T, N, C, H, W]" if self.dimension == 4 else "[T, N, L]"
        _check_input("TemporalWiseAttention", x_seq, shape)
        if x_seq.shape[0] != self.sharedMLP[0].in_features:
            raise SpikefuseError(
                f"TemporalWiseAttention: built for T={self.sharedMLP[0].in_features} steps, got "
                f"input {shape} of shape {tuple(x_seq.shape)}"
            )
        x = x_seq.transpose(0, 1)  # [N, T, ...]: the pools see T as channels
        N, T = x.shape[:2]
        avg = self.sharedMLP(self.avg_pool(x).view(N, T))
        peak = self.sharedMLP(self.max_pool(x).view(N, T))
        scores = torch.sigmoid(avg + peak)
        return (x * scores.view(N, T, *(1,) * (x.dim() - 2))).transpose(0, 1)


class _AxisAttention(nn.Module):
    """Squeeze-and-excitation weights over one axis of ``[N, T, C, H, W]`` (T, or C with
    ``channel_axis``): ``sigmoid(MLP(avg) + MLP(max))``, MLP = Conv3d 1x1 → ReLU → Conv3d 1x1."""

    def __init__(self, in_planes: int, ratio: int, channel_axis: bool = False) -> None:
        super().__init__()
        self.channel_axis = channel_axis
        self.avg_pool = nn.AdaptiveAvgPool3d(1)
        self.max_pool = nn.AdaptiveMaxPool3d(1)
        self.sharedMLP = nn.Sequential(
            nn.Conv3d(in_planes, in_planes // ratio, 1, bias=False),
            nn.ReLU(),
            nn.Conv3d(in_planes // ratio, in_planes, 1, bias=False),
        )

    def forward(self, x: Tensor) -> Tensor:
        if self.channel_axis:
            x = x.transpose(1, 2)
        mlp = self.sharedMLP
        score = torch.sigmoid(mlp(self.avg_pool(x)) + mlp(self.max_pool(x)))
        return score.transpose(1, 2) if self.channel_axis else score


class _SpatialAttention(nn.Module):
    """Weights ``[N, 1, 1, H, W]`` of ``[N, T, C, H, W]``: ``sigmoid(Conv2d([mean, max]))`` with
    the mean and max over T and C together."""

    def __init__(self, kernel_size: int) -> None:
        super().__init__()
        padding = 3 if kernel_size == 7 else 1
        self.conv = nn.Conv2d(2, 1, kernel_size, padding=padding, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        x = x.flatten(1, 2)
        pooled = torch.cat((x.mean(dim=1, keepdim=True), x.max(dim=1, keepdim=True).values), 1)
        return torch.sigmoid(self.conv(pooled)).unsqueeze(1)


class MultiDimensionalAttention(nn.Module, MultiStepModule):
    """Multi-dimensional attention of MA-SNN (Yao et al., TPAMI 2023) on ``[T, N, C, H, W]``:
    temporal (``ta``), then channel (``ca``), then spatial (``sa``) weights, each
    ``out = w(out) ⊙ out``, and a final ReLU; the same shape out.

    ``use_temporal``, ``use_channel`` and ``use_spatial`` switch the axes off (at least one
    stays on; an axis switched off is ``None``). ``kernel_size`` (3 or 7) is the spatial
    convolution's. Multi-step only."""

    def __init__(
        self,
        T: int,
        C: int,
        reduction_t: int = 16,
        reduction_c: int = 16,
        kernel_size: int = 3,
        use_temporal: bool = True,
        use_channel: bool = True,
        use_spatial: bool = True,
    ) -> None:
        super().__init__()
        who = "MultiDimensionalAttention"
        if not (use_temporal or use_channel or use_spatial):
            raise SpikefuseError(
                f"{who}: at least one of use_temporal, use_channel, and use_spatial must be True"
            )
        if use_temporal:
            _check_reduction(who, "T", T, "reduction_t", reduction_t)
        if use_channel:
            _check_reduction(who, "C", C, "reduction_c", reduction_c)
        if kernel_size not in (3, 7):
            raise SpikefuseError(f"{who}: kernel size must be 3 or 7, got {kernel_size!r}")
        self.ta = _AxisAttention(T, reduction_t) if use_temporal else None
        self.ca = _AxisAttention(C, reduction_c, channel_axis=True) if use_channel else None
        self.sa = _SpatialAttention(kernel_size) if use_spatial else None
        self.relu = nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        _check_input("MultiDimensionalAttention", x, "[T, N, C, H, W]")
        out = x.transpose(0, 1)  # [N, T, C, H, W]
        for attention in (self.ta, self.ca, self.sa):
            if attention is not None:
                out = attention(out) * out
        return self.relu(out).transpose(0, 1)
