"""Max pooling with a byte per window on the GPU: the ``max_pool`` capability's two kernels.

:func:`max_pool_forward` writes the pooled map and, for backward, each window's argmax code (its
position in the window, one byte); :func:`max_pool_backward` gathers each input element's
gradient from the windows whose code points at it (see ``spike_max_pool.cuh`` next to this file,
which holds the kernels, and :mod:`spikefuse.fused.ops.spike_max_pool`, whose torch ops compute
the same). Per element of a 3 x 3 / stride 2 pooling's input: forward reads it (about once:
windows overlap in cache) and writes a quarter of an output value and a byte; backward reads a
quarter of a gradient value and a byte and writes the input's gradient once. Compiled once per
storage dtype, window and device with NVRTC through :mod:`.runtime` (the window's sizes are
constants: dividing by a stride costs a shift), launched on PyTorch's current stream, no host
sync: CUDA-graph capturable once loaded.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from .kernel_spec import BLOCK_THREADS, STORAGE
from .runtime import launch_named

SOURCE_PATH = Path(__file__).with_name("spike_max_pool.cuh")
SOURCE_NAME = "spikefuse/cuda/spike_max_pool.cuh"

#: The kernels' one argument, ``Args`` in spike_max_pool.cuh: five pointers, n, three sets of
#: four strides, three dividers (divisor, magic, shift), then five ints (H, W, OH, OW,
#: channels_last).
ARGS = struct.Struct("=5Qq12q9I5i")
_WINDOW_NAMES = ("KH", "KW", "SH", "SW", "PH", "PW", "DH", "DW")


@dataclass(frozen=True)
class MaxPoolKernelPair:
    """The two kernels of one storage dtype and window: their source (the prelude, then
    ``spike_max_pool.cuh``) and names."""

    source: str
    forward_name: str
    backward_name: str


@functools.cache
def kernels_for(dtype: torch.dtype, window: tuple[int, ...]) -> MaxPoolKernelPair:
    """The kernels of a storage dtype (float32, float16, bfloat16) and a window (k_h, k_w,
    stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w), compiled in as constants."""
    storage = STORAGE[dtype]
    kh, kw, sh, sw, ph, pw, dh, dw = window
    tag = f"{storage.ctype.strip('_')}_k{kh}x{kw}_s{sh}x{sw}_p{ph}x{pw}_d{dh}x{dw}"
    forward_name = f"spikefuse_max_pool_forward_{tag}"
    backward_name = f"spikefuse_max_pool_backward_{tag}"
    prelude = "\n".join(
        [
            f"// spikefuse max pooling with byte codes: {storage.ctype} storage",
            *storage.declarations(),
            f"constexpr int BLOCK_THREADS = {BLOCK_THREADS};",
            *(f"constexpr int {n} = {v};" for n, v in zip(_WINDOW_NAMES, window, strict=True)),
            f"#define FORWARD_KERNEL {forward_name}",
            f"#define BACKWARD_KERNEL {backward_name}",
        ]
    )
    template = SOURCE_PATH.read_text(encoding="utf-8")
    source = f'{prelude}\n#line 1 "{SOURCE_NAME}"\n{template}'
    return MaxPoolKernelPair(source, forward_name, backward_name)


def divider(d: int) -> tuple[int, int, int]:
    """(d, magic, shift) with ``(umulhi(n, magic) + n) >> shift == n // d`` for 0 <= n < 2^31
    (PyTorch's IntDivider); d < 1 (an empty dimension, nothing launched) counts as 1."""
    d = max(d, 1)
    shift = (d - 1).bit_length()  # the least s with 2^s >= d
    return d, ((1 << 32) * ((1 << shift) - d)) // d + 1, shift


def _channels_last(t: torch.Tensor) -> bool:
    """Whether the dense tensor the threads walk lies channels-last (else NCHW)."""
    if t.is_contiguous():
        return False
    if t.is_contiguous(memory_format=torch.channels_last):
        return True
    raise ValueError("spikefuse max_pool: the written tensor must be NCHW or channels-last dense")


def _args(
    pointers: tuple[int, int, int, int, int],
    walked: torch.Tensor,
    strides: tuple[tuple[int, ...], ...],
    sizes: tuple[int, ...],
) -> bytes:
    """``Args``: the pointers, the threads' count (``walked``'s elements), the strides of x,
    codes and dL/dout, dividers by ``walked``'s C, H and W, then the input's H, W and the
    output's OH, OW, and the threads' order."""
    flat = [s for stride in strides for s in stride]
    dividers = [v for d in walked.shape[1:] for v in divider(d)]
    cl = _channels_last(walked)
    return ARGS.pack(*pointers, walked.numel(), *flat, *dividers, *sizes, cl)


def _launch(name: str, source: str, walked: torch.Tensor, args: bytes) -> None:
    n = walked.numel()
    if n == 0:
        return
    grid = (-(-n // BLOCK_THREADS), 1, 1)
    launch_named(source, name, walked.device, grid, (BLOCK_THREADS, 1, 1), args)


_NO_STRIDES = (0, 0, 0, 0)


def max_pool_forward(
    x: torch.Tensor, out: torch.Tensor, codes: torch.Tensor | None, window: tuple[int, ...]
) -> None:
    """Pool x [N, C, H, W] (CUDA, float32/float16/bfloat16, any strides) into ``out`` [N, C,
    OH, OW] (dense, NCHW or channels-last, x's dtype) and, unless None, each window's code into
    ``codes`` (uint8, out's strides)."""
    if codes is not None and codes.stride() != out.stride():
        raise ValueError("spikefuse max_pool: codes must have the output's strides")
    kernels = kernels_for(x.dtype, window)
    pointers = (x.data_ptr(), out.data_ptr(), 0 if codes is None else codes.data_ptr(), 0, 0)
    strides = (x.stride(), _NO_STRIDES, _NO_STRIDES)
    args = _args(pointers, out, strides, (*x.shape[2:], *out.shape[2:]))
    _launch(kernels.forward_name, kernels.source, out, args)


def max_pool_backward(
    grad: torch.Tensor, codes: torch.Tensor, grad_x: torch.Tensor, window: tuple[int, ...]
) -> None:
    """Write dL/dx into ``grad_x`` [N, C, H, W] (dense, NCHW or channels-last, grad's dtype)
    from dL/dout ``grad`` [N, C, OH, OW] (any strides) and the forward's ``codes``."""
    if grad.shape != codes.shape:
        raise ValueError(
            f"spikefuse max_pool: gradient {tuple(grad.shape)} and codes {tuple(codes.shape)}"
        )
    kernels = kernels_for(grad.dtype, window)
    pointers = (0, 0, codes.data_ptr(), grad.data_ptr(), grad_x.data_ptr())
    strides = (_NO_STRIDES, codes.stride(), grad.stride())
    args = _args(pointers, grad_x, strides, (*grad_x.shape[2:], *grad.shape[2:]))
    _launch(kernels.backward_name, kernels.source, grad_x, args)
