"""The two passes of the max pooling with byte codes, in torch ops (the reference backend's
algorithm; the cuda backend's ``max_pool`` kernels compute the same, one thread per element).

Forward scans each window in torch's order (rows, then columns) and takes an element where it
is greater than the maximum so far or NaN, as ATen's max_pool2d kernels do on CPU and CUDA: the
first of equal maxima wins, padded positions never do, and a window of -inf (no element
greater than the start) keeps its first element inside the map. Of binary spikes that is the
first spike in the window, else its first element. The code of the winner (:mod:`.geometry`) is
saved, a byte per output value, instead of ATen's int64 index.

Backward is a gather: each input element sums, in float32 (float64 stays), the gradients of
the windows whose code points at it, in ascending window order, and is written once, as
ATen's CUDA backward does; its values equal ATen's on CPU and CUDA.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ....backends import compute_dtype
from .geometry import MaxPoolGeometry


def memory_format_of(x: Tensor) -> torch.memory_format:
    """channels_last where ``x`` is laid out so (and is not also contiguous), else contiguous:
    the layout max_pool2d gives its output and its input's gradient."""
    cl = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    return torch.channels_last if cl else torch.contiguous_format


def _padded_extent(size: int, out: int, kernel: int, pad: int, stride: int, dil: int) -> int:
    """Rows (or columns) of the map padded so that every window lies inside it."""
    return max(size + pad, (out - 1) * stride + (kernel - 1) * dil + 1)


def _window_views(padded: Tensor, g: MaxPoolGeometry, out: tuple[int, int]) -> list[Tensor]:
    """For each window offset (i, j) in scan order, the [N, C, OH, OW] view of ``padded`` at
    offset (i, j) of every window."""
    (kh, kw), (sh, sw), (dh, dw) = g.kernel, g.stride, g.dilation
    oh, ow = out
    return [
        padded[
            :, :, i * dh : i * dh + (oh - 1) * sh + 1 : sh, j * dw : j * dw + (ow - 1) * sw + 1 : sw
        ]
        for i in range(kh)
        for j in range(kw)
    ]


def _first_codes(g: MaxPoolGeometry, out: tuple[int, int], device: torch.device) -> Tensor:
    """[OH, OW] uint8: the code of each window's first element inside the map."""
    firsts = []
    for size, stride, pad, dil in zip(out, g.stride, g.padding, g.dilation, strict=True):
        start = torch.arange(size, device=device) * stride - pad
        firsts.append(torch.where(start < 0, (-start + dil - 1) // dil, 0))
    return (firsts[0][:, None] * g.kernel[1] + firsts[1][None, :]).to(torch.uint8)


def pool_forward(
    x: Tensor, g: MaxPoolGeometry, keep_codes: bool, flip: Tensor | None = None
) -> tuple[Tensor, Tensor | None]:
    """(out [N, C, OH, OW] in x's dtype and layout, codes (uint8, same shape) or None);
    ``flip`` ([C]): the channels where it is negative take their windows' minimum (None:
    none)."""
    if flip is not None:  # the maximum of -x: its values times -1 again (exact)
        signs = torch.where(flip < 0, -1.0, 1.0).to(x.dtype).view(1, -1, 1, 1)
        out, codes = pool_forward(x * signs, g, keep_codes)
        return out.mul_(signs), codes
    n, c, h, w = x.shape
    oh, ow = g.output_size(h, w)
    rows = _padded_extent(h, oh, g.kernel[0], g.padding[0], g.stride[0], g.dilation[0])
    cols = _padded_extent(w, ow, g.kernel[1], g.padding[1], g.stride[1], g.dilation[1])
    padded = x.new_full((n, c, rows, cols), float("-inf"))
    padded[:, :, g.padding[0] : g.padding[0] + h, g.padding[1] : g.padding[1] + w] = x
    best = x.new_full((n, c, oh, ow), float("-inf"))
    codes = _first_codes(g, (oh, ow), x.device).expand(n, c, oh, ow) if keep_codes else None
    for code, values in enumerate(_window_views(padded, g, (oh, ow))):
        wins = (values > best) | values.isnan()
        best = torch.where(wins, values, best)
        if codes is not None:
            codes = torch.where(wins, code, codes)
    layout = memory_format_of(x)
    if codes is not None:
        codes = codes.to(torch.uint8).contiguous(memory_format=layout)
    return best.contiguous(memory_format=layout), codes


def pool_backward(
    grad: Tensor,
    codes: Tensor,
    g: MaxPoolGeometry,
    shape: torch.Size,
    layout: torch.memory_format,
    terms: tuple[Tensor, Tensor, Tensor] | None = None,
) -> Tensor:
    """dL/dx [N, C, H, W] (``shape``, in ``layout``, grad's dtype) from dL/dout and the codes;
    ``terms`` (x, coef_x [C], coef_0 [C]): plus coef_x[c] x + coef_0[c] at every element.

    Window offsets are visited from the last to the first: an input element lies at offset
    (i, j) of window (oh, ow) with oh decreasing in i and ow in j, so each element receives its
    windows' gradients in ascending (oh, ow) order, the order ATen adds them in."""
    n, c, h, w = shape
    oh, ow = codes.shape[2:]
    rows = _padded_extent(h, oh, g.kernel[0], g.padding[0], g.stride[0], g.dilation[0])
    cols = _padded_extent(w, ow, g.kernel[1], g.padding[1], g.stride[1], g.dilation[1])
    total = grad.new_zeros((n, c, rows, cols), dtype=compute_dtype(grad.dtype))
    upstream = grad.to(total.dtype)
    views = _window_views(total, g, (oh, ow))
    for code in reversed(range(g.area)):
        views[code] += torch.where(codes == code, upstream, 0.0)
    inside = total[:, :, g.padding[0] : g.padding[0] + h, g.padding[1] : g.padding[1] + w]
    if terms is not None:
        x, coef_x, coef_0 = (t.to(total.dtype) for t in terms)
        inside = inside + torch.addcmul(coef_0.view(1, -1, 1, 1), x, coef_x.view(1, -1, 1, 1))
    return inside.to(grad.dtype, memory_format=layout)
