"""The spike max pooling as an autograd Function, and the function that calls it.

What it keeps for backward is one byte per output value, the position of each window's maximum
in the window (see :mod:`.passes`), where ``max_pool2d`` keeps int64 indices (8 bytes) and its
input; its backward gathers, each input element once, deterministic and without atomics. The
cuda backend's ``max_pool`` kernels (the ``max_pool`` capability of :mod:`spikefuse.backends`)
run it on CUDA tensors in float32, float16 and bfloat16, in the input's layout (NCHW or
channels-last); elsewhere (CPU, float64) the torch ops of :mod:`.passes` do.

The values and gradients equal ``F.max_pool2d``'s for any input, spikes or not (the kernels
follow ATen's rule, NaN included); the name says where :func:`~spikefuse.fused.fuse` puts it:
on the spike output of fused blocks (the stem of the ResNets), through
:class:`~spikefuse.fused.SpikePool`, whose saved input the memory machinery then never needs.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor

from ....backends import MaxPoolKernels, capability
from ....ops import forbid_double_backward
from .geometry import MaxPoolGeometry
from .passes import memory_format_of, pool_backward, pool_forward


def _kernels(t: Tensor) -> MaxPoolKernels | None:
    return cast("MaxPoolKernels | None", capability("max_pool", t))


def max_pool_forward(
    x: Tensor, geometry: MaxPoolGeometry, keep_codes: bool, flip: Tensor | None = None
) -> tuple[Tensor, Tensor | None]:
    """(out [N, C, OH, OW] in x's dtype and layout, each window's code (uint8) or None): by
    the backend's kernels where one runs x, else by torch ops. ``flip`` (float32 [C], e.g.
    a BatchNorm's gamma): the channels where it is negative take their windows' minimum (None:
    none)."""
    kernels = _kernels(x)
    if kernels is None:
        return pool_forward(x, geometry, keep_codes, flip)
    n, c, h, w = x.shape
    shape = (n, c, *geometry.output_size(h, w))
    layout = memory_format_of(x)
    out = torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=layout)
    codes = None
    if keep_codes:
        codes = torch.empty(shape, dtype=torch.uint8, device=x.device, memory_format=layout)
    kernels.max_pool_forward(x, out, codes, geometry.window, flip)
    return out, codes


def max_pool_backward(
    grad: Tensor,
    codes: Tensor,
    geometry: MaxPoolGeometry,
    shape: torch.Size,
    layout: torch.memory_format,
    terms: tuple[Tensor, Tensor, Tensor] | None = None,
) -> Tensor:
    """dL/dx (``shape``, ``layout``, grad's dtype) from dL/dout and the forward's codes;
    ``terms`` (x, coef_x, coef_0: float32 [C]): plus coef_x[c] x + coef_0[c] at every
    element, in float32 before dL/dx is rounded to its dtype."""
    kernels = _kernels(grad)
    if kernels is None:
        return pool_backward(grad, codes, geometry, shape, layout, terms)
    # dL/dout in the codes' layout (a copy where the next layer's backward gave another, e.g.
    # a neuron's NCHW after a channels-last pooling): the threads walking dL/dx then read it
    # coalesced, and channels-last maps take the vector kernels
    grad = grad.contiguous(memory_format=layout)
    grad_x = torch.empty(shape, dtype=grad.dtype, device=grad.device, memory_format=layout)
    kernels.max_pool_backward(grad, codes, grad_x, geometry.window, terms)
    return grad_x


class SpikeMaxPool2dFunction(torch.autograd.Function):
    """``max_pool2d`` of x [N, C, H, W] with ``geometry``, keeping a byte per output value
    for backward (only where x needs a gradient)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, geometry: MaxPoolGeometry) -> Tensor:
        geometry.check_input(x)
        keep = bool(ctx.needs_input_grad[0])
        out, codes = max_pool_forward(x, geometry, keep)
        if codes is not None:
            ctx.save_for_backward(codes)
        ctx.geometry, ctx.shape, ctx.layout = geometry, x.shape, memory_format_of(x)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        forbid_double_backward("spike_max_pool2d")
        (codes,) = ctx.saved_tensors
        return max_pool_backward(grad, codes, ctx.geometry, ctx.shape, ctx.layout), None


def pool_spikes(x: Tensor, geometry: MaxPoolGeometry) -> Tensor:
    """``max_pool2d`` of x [N, C, H, W] with ``geometry``: through
    :class:`SpikeMaxPool2dFunction` where a backward may follow (grad mode on, x needing a
    gradient), else the forward alone, which keeps nothing (a recipe recomputing the pooled
    map in backward, inference)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return cast(Tensor, SpikeMaxPool2dFunction.apply(x, geometry))
    return max_pool_forward(geometry.check_input(x), geometry, False)[0]


def spike_max_pool2d(
    x: Tensor,
    kernel_size: int | tuple[int, ...],
    stride: int | tuple[int, ...] | None = None,
    padding: int | tuple[int, ...] = 0,
    dilation: int | tuple[int, ...] = 1,
    ceil_mode: bool = False,
) -> Tensor:
    """``F.max_pool2d(x, kernel_size, stride, padding, dilation, ceil_mode)`` of a floating
    x [N, C, H, W]: the same values and gradient (windows of at most
    :data:`~.geometry.MAX_WINDOW` elements), keeping 1 byte per output value for backward
    where ``max_pool2d`` keeps 8 and its input.

    ``out[n, c, oh, ow] = max over i < k_h, j < k_w of x[n, c, oh s_h - p_h + i d_h,
    ow s_w - p_w + j d_w]`` (positions outside the map left out); of binary spikes, the OR of
    the window. The gradient of each window goes to its first maximal element in scan order
    (rows, then columns; where the window holds NaN, its last NaN), as in ATen."""
    return pool_spikes(x, MaxPoolGeometry.of(kernel_size, stride, padding, dilation, ceil_mode))
