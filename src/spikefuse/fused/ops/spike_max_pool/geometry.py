"""The window geometry of a 2-D max pooling: its arguments as torch takes them, validated as
torch validates them, and the output size torch computes.

A window of output (oh, ow) covers input rows ``oh * stride_h - pad_h + i * dilation_h`` for
``i < kernel_h`` (columns alike); padded positions (outside the map) never win. The position of
a window's maximum is saved as its *code* ``i * kernel_w + j`` (one byte: windows of at most
:data:`MAX_WINDOW` elements).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from ....errors import SpikefuseError

#: The most elements a window may hold: its codes 0 .. k_h k_w - 1 fit in one byte.
MAX_WINDOW = 256

Pair = tuple[int, int]


def _pair(name: str, value: object, default: Pair | None = None) -> Pair:
    """An int or a sequence of one or two ints as (h, w), the way torch's pooling reads it."""
    if value is None or (isinstance(value, (tuple, list)) and len(value) == 0):
        if default is None:
            raise SpikefuseError(f"spike_max_pool2d: {name} is required")
        return default
    if isinstance(value, int) and not isinstance(value, bool):
        return value, value
    if isinstance(value, (tuple, list)) and len(value) in (1, 2):
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return (value[0], value[-1])
    raise SpikefuseError(
        f"spike_max_pool2d: {name} must be an int or a tuple of one or two ints, got {value!r}"
    )


def _output_size(size: int, kernel: int, pad: int, stride: int, dilation: int, ceil: bool) -> int:
    """torch's ``pooling_output_shape``: windows that start inside the map or its left/top
    padding; ``ceil``: a last, partial window where one starts there."""
    span = dilation * (kernel - 1) + 1
    out = (size + 2 * pad - span + (stride - 1 if ceil else 0)) // stride + 1
    if ceil and (out - 1) * stride >= size + pad:  # the last window would start in the padding
        out -= 1
    return out


@dataclass(frozen=True)
class MaxPoolGeometry:
    """``kernel``, ``stride``, ``padding``, ``dilation``: (h, w) pairs; ``ceil_mode``: as
    ``torch.nn.functional.max_pool2d`` takes them (``stride`` None: the kernel size)."""

    kernel: Pair
    stride: Pair
    padding: Pair
    dilation: Pair
    ceil_mode: bool

    @classmethod
    def of(
        cls,
        kernel_size: object,
        stride: object = None,
        padding: object = 0,
        dilation: object = 1,
        ceil_mode: object = False,
    ) -> MaxPoolGeometry:
        """The geometry of these arguments; raises :class:`SpikefuseError` for what
        ``max_pool2d`` refuses and for windows of more than :data:`MAX_WINDOW` elements."""
        kernel = _pair("kernel_size", kernel_size)
        geometry = cls(
            kernel,
            _pair("stride", stride, kernel),
            _pair("padding", padding),
            _pair("dilation", dilation),
            ceil_mode if isinstance(ceil_mode, bool) else _not_bool(ceil_mode),
        )
        geometry._check()
        return geometry

    def _check(self) -> None:
        for name, pair, least in (
            ("kernel_size", self.kernel, 1),
            ("stride", self.stride, 1),
            ("dilation", self.dilation, 1),
            ("padding", self.padding, 0),
        ):
            if min(pair) < least:
                raise SpikefuseError(f"spike_max_pool2d: {name} must be >= {least}, got {pair}")
        if any(p > k // 2 for p, k in zip(self.padding, self.kernel, strict=True)):
            raise SpikefuseError(
                f"spike_max_pool2d: padding {self.padding} must be at most half the kernel size "
                f"{self.kernel} (as max_pool2d requires)"
            )
        if self.area > MAX_WINDOW:
            raise SpikefuseError(
                f"spike_max_pool2d: a {self.kernel[0]}x{self.kernel[1]} window has more than "
                f"{MAX_WINDOW} elements; the position of its maximum is saved in one byte"
            )

    @property
    def area(self) -> int:
        """Elements per window, k_h k_w."""
        return self.kernel[0] * self.kernel[1]

    def output_size(self, height: int, width: int) -> Pair:
        """(OH, OW) of a map of ``height`` x ``width``; raises where it would be empty."""
        out = tuple(
            _output_size(size, *args, self.ceil_mode)
            for size, args in zip(
                (height, width),
                zip(self.kernel, self.padding, self.stride, self.dilation, strict=True),
                strict=True,
            )
        )
        if min(out) < 1:
            raise SpikefuseError(
                f"spike_max_pool2d: a {height}x{width} map gives an empty {out[0]}x{out[1]} "
                f"output with kernel {self.kernel}, padding {self.padding}, dilation "
                f"{self.dilation}"
            )
        return out[0], out[1]

    @property
    def window(self) -> tuple[int, ...]:
        """(k_h, k_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w): what the
        kernels take."""
        return (*self.kernel, *self.stride, *self.padding, *self.dilation)

    def check_input(self, x: object) -> Tensor:
        """``x`` if it is a floating [N, C, H, W] tensor this pooling gives a non-empty output
        for, else raises."""
        if not isinstance(x, Tensor) or x.dim() != 4 or not x.is_floating_point():
            what = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
            raise SpikefuseError(
                f"spike_max_pool2d: expected a floating point [N, C, H, W] tensor, got {what}"
            )
        self.output_size(x.shape[2], x.shape[3])
        return x


def _not_bool(value: object) -> bool:
    raise SpikefuseError(f"spike_max_pool2d: ceil_mode must be a bool, got {value!r}")
