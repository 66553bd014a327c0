"""Pooling of fused-block spikes: :class:`WindowAvgPool` (the average pooling the blocks and
:class:`SpikePool` run) and :class:`SpikePool` (a pooling layer that stores no spikes; its max
pooling is :func:`~.ops.spike_max_pool.spike_max_pool2d`)."""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import Tensor, nn
from torch.nn.modules.utils import _pair

from ..errors import SpikefuseError
from ..ops import forbid_double_backward
from .ops.spike_max_pool import MAX_WINDOW, MaxPoolGeometry, pool_spikes
from .recompute import (
    mark_means,
    mark_packed,
    mark_recomputable,
    means_window,
    pack_now,
    recipe_of,
    saving_recomputed,
)
from .spec import EXACT, POOLS, MultiStepOnly, window_size


class WindowAvgPool(torch.autograd.Function):
    """Average pooling over non-overlapping k_h × k_w windows of [N, C, H, W] (kernel = stride,
    no padding; a remainder of rows/columns is dropped, as ``avg_pool2d`` does).

    Forward is one mean reduction, backward one broadcast write, both in the input's memory
    layout (NCHW or channels-last): torch's ``avg_pool2d`` kernels run well below memory
    bandwidth on these maps, both directions, both layouts.
    """

    @staticmethod
    def forward(ctx, x: Tensor, kh: int, kw: int) -> Tensor:
        n, c, h, w = x.shape
        ho, wo = h // kh, w // kw
        layout = _memory_format(x)
        out = torch.empty((n, c, ho, wo), dtype=x.dtype, device=x.device, memory_format=layout)
        torch.mean(_windows(x, kh, kw), dim=(3, 5), out=out)
        ctx.geometry = (x.shape, layout, kh, kw)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        forbid_double_backward("WindowAvgPool")
        shape, layout, kh, kw = ctx.geometry
        grad_x = torch.empty(shape, dtype=grad.dtype, device=grad.device, memory_format=layout)
        if shape[2] % kh or shape[3] % kw:  # the dropped rows/columns get no gradient
            grad_x.zero_()
        windows = _windows(grad_x, kh, kw)
        torch.mul(grad[:, :, :, None, :, None].expand(windows.shape), 1.0 / (kh * kw), out=windows)
        return grad_x, None, None


def _memory_format(x: Tensor) -> torch.memory_format:
    cl = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    return torch.channels_last if cl else torch.contiguous_format


def _windows(x: Tensor, kh: int, kw: int) -> Tensor:
    """[N, C, H, W] → the view [N, C, H/kh, kh, W/kw, kw] of its whole windows."""
    ho, wo = x.shape[2] // kh, x.shape[3] // kw
    return x[:, :, : ho * kh, : wo * kw].unflatten(3, (wo, kw)).unflatten(2, (ho, kh))


class SpikePool(MultiStepOnly, nn.Module):
    """Average or max pooling of multi-step spikes ``[T, B, C, H, W]`` that stores no spikes.

    On the spike output of a fused block, what average pooling saves is recomputed in
    backward, and its output is tagged so that the next fused block recomputes it too (the
    pooling applied to the recomputed spikes) instead of saving it; max pooling saves none of
    its input, tags its output as spikes and, under autograd, packs them at 1 bit per element
    for the next layer to keep (cheaper than recomputing them, see
    :func:`~.recompute.pack_now`); spikes of a block that keeps no synapse output
    (``memory="min"``) are saved at 1 bit per element; spikes under
    :data:`~.recompute.RECOMPUTE_MIN_BYTES` are saved as they are. Any other input is pooled
    plainly. ``pool``: an ``nn.AvgPool2d``/``nn.MaxPool2d`` (or spikefuse ``layer``
    version); average pooling with kernel = stride and no padding runs as
    :class:`WindowAvgPool`; max pooling (windows of at most
    :data:`~.ops.spike_max_pool.MAX_WINDOW` elements) as
    :func:`~.ops.spike_max_pool.spike_max_pool2d`, which keeps a byte per output value for
    backward instead of max_pool2d's int64 indices and needs no input in backward.
    """

    def __init__(self, pool: nn.Module) -> None:
        super().__init__()
        kind = next((k for k in POOLS if type(pool) in EXACT[k]), None)
        if kind is None:
            raise SpikefuseError(
                f"SpikePool: pool must be AvgPool2d or MaxPool2d, got {type(pool).__name__}"
            )
        if getattr(pool, "return_indices", False):
            raise SpikefuseError("SpikePool: return_indices=True is not supported")
        self.pool = pool
        self.training = pool.training  # the mode of the pooling it replaces
        self._kind: type[nn.Module] = kind
        self._window = window_size(pool)
        self.spike_max: MaxPoolGeometry | None = _spike_max_geometry(pool)
        """The geometry :func:`~.ops.spike_max_pool.spike_max_pool2d` pools with (None: not a
        max pooling, or its windows are too large for a byte code)."""

    def __setstate__(self, state: dict) -> None:
        """Unpickles SpikePools pickled before max pooling ran as spike_max_pool2d too."""
        super().__setstate__(state)
        if "spike_max" not in self.__dict__:
            self.spike_max = _spike_max_geometry(self.pool)

    def _pool(self, merged: Tensor) -> Tensor:
        if torch.compiler.is_compiling():  # the compiler generates its own kernels
            return self._kind.forward(self.pool, merged)
        if self._window is not None:
            return WindowAvgPool.apply(merged, *self._window)
        if self.spike_max is not None:
            return pool_spikes(merged, self.spike_max)
        return self._kind.forward(self.pool, merged)

    def forward(self, x: Tensor) -> Tensor:
        if not isinstance(x, Tensor) or x.dim() != 5:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise SpikefuseError(f"SpikePool: expected input [T, B, C, H, W], got {shape}")
        merged = x.flatten(0, 1)
        if torch.compiler.is_compiling():
            return self._pool(merged).unflatten(0, x.shape[:2])
        recipe = recipe_of(merged)
        # The spike max pooling keeps none of its input: nothing to intercept (and its codes
        # stay visible to the caller's saved-tensor hooks). Else, without a recipe: spikes
        # packed, if spikes.
        saving = nullcontext() if self.spike_max is not None else saving_recomputed(merged, recipe)
        with saving:
            out = self._pool(merged)
        window = means_window(merged)  # 1: spikes; k²: means of k² spikes
        if window is not None and self._kind is nn.MaxPool2d:  # the largest: the same kind
            mark_means(out, window)
        elif window is not None and self._window is not None:  # means of k x k of them
            mark_means(out, window * self._window[0] * self._window[1])
        result = out.unflatten(0, x.shape[:2])
        # A max pooling's spikes are kept packed: recomputing them would rerun the block's
        # neuron on every element of its windows and the pooling. The view returned carries
        # the packing too (a residual block keeps its input as it is given).
        packing = pack_now(out) if recipe is not None and self.spike_max is not None else None
        if packing is not None:
            mark_packed(result, packing.viewed_as(result))
        elif recipe is not None:
            mark_recomputable(out, lambda: self._pool(recipe()))
        return result


def _spike_max_geometry(pool: nn.Module) -> MaxPoolGeometry | None:
    """The geometry of a max pooling whose windows fit a byte code (else None; arguments
    max_pool2d refuses: None too, and max_pool2d raises when called)."""
    if not isinstance(pool, nn.MaxPool2d):
        return None
    kernel = _pair(pool.kernel_size)
    if kernel[0] * kernel[1] > MAX_WINDOW:
        return None
    try:
        return MaxPoolGeometry.of(
            pool.kernel_size, pool.stride, pool.padding, pool.dilation, pool.ceil_mode
        )
    except SpikefuseError:
        return None


class MaxPoolCodes(nn.Module):
    """A single-step ``nn.MaxPool2d`` (``pool``) on [N, C, H, W] as
    :func:`~.ops.spike_max_pool.spike_max_pool2d`: the same values and gradient, keeping a
    byte per output value for backward instead of its input and int64 indices. What
    :func:`~spikefuse.fused.fuse` puts inside a ``SeqToANNContainer`` that stays unfused because
    it max-pools BatchNorm's output before the neuron (Spikformer's and QKFormer's patch
    stems). Under ``torch.compile`` the pooling layer itself runs."""

    def __init__(self, pool: nn.MaxPool2d, geometry: MaxPoolGeometry) -> None:
        super().__init__()
        self.pool, self.geometry = pool, geometry

    @staticmethod
    def of(pool: nn.Module) -> MaxPoolCodes | None:
        """``pool`` as a MaxPoolCodes, or None where it is not a plain single-step max pooling
        whose windows fit a byte code."""
        plain = type(pool) in EXACT[nn.MaxPool2d] and getattr(pool, "step_mode", "s") == "s"
        geometry = _spike_max_geometry(pool) if plain else None
        if geometry is None or getattr(pool, "return_indices", False):
            return None
        return MaxPoolCodes(pool, geometry)  # type: ignore[arg-type]

    def forward(self, x: Tensor) -> Tensor:
        if torch.compiler.is_compiling() or not isinstance(x, Tensor) or x.dim() != 4:
            return self.pool(x)  # (the layer's own checks and errors for other input)
        return pool_spikes(x, self.geometry)
