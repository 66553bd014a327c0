"""What SpikingJelly's spiking transformers (``model.spikformer``, ``spike_driven_transformer``,
``qkformer``) share: the image-or-sequence input, the neuron factory and the mean over tokens."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor, fx, nn

from .._neuron import _make_multi_step_neuron
from ..errors import SpikefuseError

NeuronClass = Callable[..., nn.Module]


def to_sequence(x: Tensor, T: int) -> Tensor:
    """``[N, C, H, W]`` images repeated over ``T`` steps, or a ``[T', N, C, H, W]`` sequence as
    it is (its own ``T'``)."""
    if not isinstance(x, Tensor) or x.dim() not in (4, 5):
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise SpikefuseError(
            "expected 4D image input [N, C, H, W] or 5D sequence input [T, N, C, H, W], but got "
            f"{got}"
        )
    return x.unsqueeze(0).repeat(T, 1, 1, 1, 1) if x.dim() == 4 else x


def lif(
    spiking_neuron: NeuronClass | None,
    kwargs: dict[str, Any],
    defaults: dict[str, Any] | None = None,
) -> nn.Module:
    """A multi-step neuron: ``spiking_neuron(**kwargs)``, or ``LIFNode(**defaults, **kwargs)``
    when ``spiking_neuron`` is None (SpikingJelly's ``_make_multi_step_neuron``)."""
    return _make_multi_step_neuron(spiking_neuron, kwargs, defaults)


def check_count(who: str, name: str, value: Any) -> None:
    """``value`` must be an int >= 1."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SpikefuseError(f"{who}: {name} must be an int >= 1, got {value!r}")


class _TokenMean(torch.autograd.Function):
    """``x.flatten(3).mean(-1)`` whose gradient is dense in x's layout, not an expanded view."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        # x's strides where x is dense (empty_like keeps them), else contiguous ones
        ctx.shape, ctx.stride = x.shape, torch.empty_like(x, device="meta").stride()
        return x.flatten(3).mean(dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        tokens = ctx.shape[3:].numel()
        spread = (grad / tokens).view(*grad.shape, *(1,) * (len(ctx.shape) - 3))
        out = torch.empty_strided(ctx.shape, ctx.stride, dtype=grad.dtype, device=grad.device)
        return out.copy_(spread.expand(ctx.shape))


def token_mean(x: Tensor) -> Tensor:
    """``x.flatten(3).mean(-1)``: the average over the tokens of ``[T, N, C, *tokens]``, the
    same values and gradient as that expression. The gradient comes back dense in x's memory
    layout (a fused block's channels innermost) where autograd's mean gives an expanded view:
    the residual additions it then meets in backward run in one layout, and the blocks read
    their gradients without a copy."""
    if isinstance(x, fx.Proxy):  # fuse() tracing the model: one call node
        return cast(Tensor, x.tracer.create_proxy("call_function", token_mean, (x,), {}))
    return cast(Tensor, _TokenMean.apply(x))
