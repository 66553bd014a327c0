"""Max pooling with a byte per window on the GPU: the ``max_pool`` capability's kernels.

:func:`max_pool_forward` writes the pooled map and, for backward, each window's argmax code (its
position in the window, one byte); :func:`max_pool_backward` gathers each input element's
gradient from the windows whose code points at it (see ``spike_max_pool.cuh`` next to this file,
which holds the kernels, and :mod:`spikefuse.fused.ops.spike_max_pool`, whose torch ops compute
the same). Per element of a 3 x 3 / stride 2 pooling's input: forward reads it (about once:
windows overlap in cache) and writes a quarter of an output value and a byte; backward reads a
quarter of a gradient value and a byte and writes the input's gradient once.

Each direction has a scalar kernel (a thread per value, any input strides, NCHW or
channels-last output) and a vector kernel (a thread per VEC = 16 bytes / element size
neighbouring channels of one position: one 16-byte load per window element, one 16-byte store,
the codes as one VEC-byte word), which :func:`vector_width` picks for channels-last tensors whose
channels, strides and addresses allow aligned vectors; both give the same bits. Compiled once
per storage dtype, window and device with NVRTC through :mod:`.runtime` (the window's sizes are
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

#: The kernels' one argument, ``Args`` in spike_max_pool.cuh: eight pointers, the threads'
#: count, three sets of four strides, three dividers (divisor, magic, shift), then five ints
#: (H, W, OH, OW, channels_last).
ARGS = struct.Struct("=8Qq12q9I5i")
_WINDOW_NAMES = ("KH", "KW", "SH", "SW", "PH", "PW", "DH", "DW")
#: Bytes of values per thread of the vector kernels: one load per window element.
VECTOR_BYTES = 16


@dataclass(frozen=True)
class MaxPoolKernelSet:
    """The four kernels of one storage dtype and window: their source (the prelude, then
    ``spike_max_pool.cuh``), the tag their names share, and ``vec``, the channels per thread of
    the vector kernels (16 bytes of values)."""

    source: str
    tag: str
    vec: int

    def name(self, backward: bool, vec: int) -> str:
        """The forward or backward kernel handling ``vec`` channels per thread (1 or
        :attr:`vec`)."""
        return _kernel_name(self.tag, backward, vec)


def _kernel_name(tag: str, backward: bool, vec: int) -> str:
    direction = "backward" if backward else "forward"
    width = "" if vec == 1 else f"_v{vec}"
    return f"spikefuse_max_pool_{direction}{width}_{tag}"


def _entry_points(vec: int) -> tuple[tuple[str, bool, int], ...]:
    """(macro naming it in spike_max_pool.cuh, backward, channels per thread) of each kernel."""
    return (
        ("FORWARD_KERNEL", False, 1),
        ("BACKWARD_KERNEL", True, 1),
        ("FORWARD_VECTOR_KERNEL", False, vec),
        ("BACKWARD_VECTOR_KERNEL", True, vec),
    )


@functools.cache
def kernels_for(dtype: torch.dtype, window: tuple[int, ...]) -> MaxPoolKernelSet:
    """The kernels of a storage dtype (float32, float16, bfloat16) and a window (k_h, k_w,
    stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w), compiled in as constants."""
    storage = STORAGE[dtype]
    vec = VECTOR_BYTES // dtype.itemsize
    kh, kw, sh, sw, ph, pw, dh, dw = window
    tag = f"{storage.ctype.strip('_')}_k{kh}x{kw}_s{sh}x{sw}_p{ph}x{pw}_d{dh}x{dw}"
    prelude = "\n".join(
        [
            f"// spikefuse max pooling with byte codes: {storage.ctype} storage",
            *storage.declarations(),
            f"constexpr int BLOCK_THREADS = {BLOCK_THREADS};",
            f"constexpr int VEC = {vec};",
            *(f"constexpr int {n} = {v};" for n, v in zip(_WINDOW_NAMES, window, strict=True)),
            *(
                f"#define {macro} {_kernel_name(tag, backward, v)}"
                for macro, backward, v in _entry_points(vec)
            ),
        ]
    )
    template = SOURCE_PATH.read_text(encoding="utf-8")
    return MaxPoolKernelSet(f'{prelude}\n#line 1 "{SOURCE_NAME}"\n{template}', tag, vec)


def divider(d: int) -> tuple[int, int, int]:
    """(d, magic, shift) with ``(umulhi(n, magic) + n) >> shift == n // d`` for 0 <= n < 2^31
    (PyTorch's IntDivider); d < 1 (an empty dimension, nothing launched) counts as 1."""
    d = max(d, 1)
    shift = (d - 1).bit_length()  # the least s with 2^s >= d
    return d, ((1 << 32) * ((1 << shift) - d)) // d + 1, shift


def _vectors_fit(t: torch.Tensor, vec: int, alignment: int) -> bool:
    """Whether each group of ``vec`` channels of t (from a multiple of vec) lies side by side at
    an address that is a multiple of ``alignment`` bytes: C a multiple of vec, channels adjacent,
    the other dimensions' strides multiples of vec (a dimension of size 1 is never stepped) and
    t's address aligned."""
    n, c, h, w = t.shape
    if c % vec or t.stride(1) != 1 or t.data_ptr() % alignment:
        return False
    others = zip((n, h, w), (t.stride(0), t.stride(2), t.stride(3)), strict=True)
    return all(size == 1 or stride % vec == 0 for size, stride in others)


def vector_width(walked: torch.Tensor, values: torch.Tensor, codes: torch.Tensor | None) -> int:
    """Channels per thread: VEC (16 bytes of ``walked``'s dtype), the vector kernels, where
    ``walked`` (the tensor written: out, or dL/dx) is channels-last dense and it, ``values`` (the
    values read: x, or dL/dout) and ``codes`` (None: not written) fit vectors (see
    :func:`_vectors_fit`; values 16-byte aligned, codes VEC-byte aligned); else 1, the scalar
    kernels, which take any strides and addresses."""
    vec = VECTOR_BYTES // walked.element_size()
    if not walked.is_contiguous(memory_format=torch.channels_last):
        return 1
    fits = _vectors_fit(walked, vec, VECTOR_BYTES) and _vectors_fit(values, vec, VECTOR_BYTES)
    return vec if fits and (codes is None or _vectors_fit(codes, vec, vec)) else 1


def _channels_last(t: torch.Tensor) -> bool:
    """Whether the dense tensor the threads walk lies channels-last (else NCHW)."""
    if t.is_contiguous():
        return False
    if t.is_contiguous(memory_format=torch.channels_last):
        return True
    raise ValueError("spikefuse max_pool: the written tensor must be NCHW or channels-last dense")


@dataclass(frozen=True)
class Walk:
    """The threads of one launch: ``vec`` neighbouring channels of ``tensor`` (the dense tensor
    written, out or dL/dx) each, in its memory order (channels-last where vec > 1)."""

    tensor: torch.Tensor
    vec: int

    @property
    def threads(self) -> int:
        return self.tensor.numel() // self.vec

    def dividers(self) -> list[int]:
        """``Args``'s dividers by C / vec, H and W (each: divisor, magic, shift)."""
        _, c, h, w = self.tensor.shape
        return [v for d in (c // self.vec, h, w) for v in divider(d)]

    @property
    def channels_last(self) -> bool:
        return self.vec > 1 or _channels_last(self.tensor)


def _args(
    pointers: tuple[int, ...],
    walk: Walk,
    strides: tuple[tuple[int, ...], ...],
    sizes: tuple[int, ...],
) -> bytes:
    """``Args``: the pointers, the threads' count, the strides of x, codes and dL/dout, the
    walk's dividers, then the input's H, W and the output's OH, OW, and the threads' order."""
    flat = [s for stride in strides for s in stride]
    cl = walk.channels_last
    return ARGS.pack(*pointers, walk.threads, *flat, *walk.dividers(), *sizes, cl)


def _launch(name: str, source: str, walk: Walk, args: bytes) -> None:
    n = walk.threads
    if n == 0:
        return
    grid = (-(-n // BLOCK_THREADS), 1, 1)
    launch_named(source, name, walk.tensor.device, grid, (BLOCK_THREADS, 1, 1), args)


_NO_STRIDES = (0, 0, 0, 0)


def _channel_vector(t: torch.Tensor | None, channels: int, name: str) -> int:
    """The address of a float32 [C] vector (0 for None), checked."""
    if t is None:
        return 0
    if t.dtype != torch.float32 or t.shape != (channels,) or not t.is_contiguous():
        raise ValueError(f"spikefuse max_pool: {name} must be a dense float32 [{channels}]")
    return t.data_ptr()


def max_pool_forward(
    x: torch.Tensor,
    out: torch.Tensor,
    codes: torch.Tensor | None,
    window: tuple[int, ...],
    flip: torch.Tensor | None = None,
) -> None:
    """Pool x [N, C, H, W] (CUDA, float32/float16/bfloat16, any strides) into ``out`` [N, C,
    OH, OW] (dense, NCHW or channels-last, x's dtype) and, unless None, each window's code into
    ``codes`` (uint8, out's strides); ``flip`` (float32 [C]): the channels where it is
    negative take their windows' minimum (None: none)."""
    if codes is not None and codes.stride() != out.stride():
        raise ValueError("spikefuse max_pool: codes must have the output's strides")
    kernels = kernels_for(x.dtype, window)
    walk = Walk(out, vector_width(out, x, codes))
    flips = _channel_vector(flip, x.shape[1], "flip")
    code_pointer = 0 if codes is None else codes.data_ptr()
    pointers = (x.data_ptr(), out.data_ptr(), code_pointer, 0, 0, flips, 0, 0)
    strides = (x.stride(), _NO_STRIDES, _NO_STRIDES)
    args = _args(pointers, walk, strides, (*x.shape[2:], *out.shape[2:]))
    _launch(kernels.name(False, walk.vec), kernels.source, walk, args)


def max_pool_backward(
    grad: torch.Tensor,
    codes: torch.Tensor,
    grad_x: torch.Tensor,
    window: tuple[int, ...],
    terms: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Write dL/dx into ``grad_x`` [N, C, H, W] (dense, NCHW or channels-last, grad's dtype)
    from dL/dout ``grad`` [N, C, OH, OW] (any strides) and the forward's ``codes``; ``terms``
    (x like grad_x, any strides; coef_x, coef_0 float32 [C]): also ``coef_x[c] x + coef_0[c]``
    at every element, added to the gathered sum in float32."""
    if grad.shape != codes.shape:
        raise ValueError(
            f"spikefuse max_pool: gradient {tuple(grad.shape)} and codes {tuple(codes.shape)}"
        )
    kernels = kernels_for(grad.dtype, window)
    vec = vector_width(grad_x, grad, codes)
    x_pointer, coefs = 0, (0, 0)
    x_strides: tuple[int, ...] = _NO_STRIDES
    if terms is not None:
        x, coef_x, coef_0 = terms
        if x.shape != grad_x.shape or x.dtype != grad_x.dtype:
            raise ValueError("spikefuse max_pool: the terms' x must be shaped like dL/dx")
        if vec > 1 and not _vectors_fit(x, vec, VECTOR_BYTES):
            vec = 1
        x_pointer, x_strides = x.data_ptr(), x.stride()
        channels = x.shape[1]
        coefs = (
            _channel_vector(coef_x, channels, "coef_x"),
            _channel_vector(coef_0, channels, "coef_0"),
        )
    walk = Walk(grad_x, vec)
    pointers = (x_pointer, 0, codes.data_ptr(), grad.data_ptr(), grad_x.data_ptr(), 0, *coefs)
    strides = (x_strides, codes.stride(), grad.stride())
    args = _args(pointers, walk, strides, (*grad_x.shape[2:], *grad.shape[2:]))
    _launch(kernels.name(True, walk.vec), kernels.source, walk, args)
