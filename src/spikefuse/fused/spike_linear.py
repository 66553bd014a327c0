"""A float32 Linear on spikes at float32 accuracy on bf16 tensor cores.

Full float32 matmuls (PyTorch's default precision) run on CUDA cores, several times slower
than bf16 tensor cores. When one operand is spikes (0 and 1, or the 2 x 2 means of
spikes a pooled block writes: multiples of 1/4), bf16 holds it exactly, so only the other needs
splitting: W = hi + mid + lo, three bf16 terms (the backends' ``bf16_split`` capability,
about 2^-26 relative), and

    y = x Wᵀ = x hiᵀ + x midᵀ + x loᵀ,

each term a bf16 matmul whose products are exact in float32 and which accumulates in float32:
the result is as accurate as the float32 matmul's. The three terms run as one matmul against the
stacked [3 N, K] terms, their three outputs summed after. The weight gradient dL/dW = gᵀ x
splits g the same way (one batched matmul, a product per term, summed after). The input
gradient g W has no exact operand (it would need six products) and stays one float32 matmul.

A fused Linear block takes this path (:func:`takes_split_path`) on CUDA, in float32 without
autocast, when PyTorch's float32 matmul precision is full ("highest"/"ieee": with TF32 allowed
the plain matmul is faster), on an input tagged as spikes or as means of 2 x 2 (4 x 4, ...)
spikes (a pooled block's output, also through a Flatten), where the matmul is large enough
to pay for the split (:data:`MIN_ROWS`, :data:`MIN_MACS`), and while a CUDA graph is being
captured: a replayed step is paced by the GPU alone. An eager step runs the plain matmul. Its
Linear blocks run where the host paces the step (the forward and the head of backward), so
the split's GPU saving is hidden there while its extra launches are not. Not under
torch.compile (the compiled graph runs torch's matmul).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor
from torch.cuda import is_current_stream_capturing

from ..backends import SplitKernels, capability
from ..ops import forbid_double_backward
from .recompute import means_window

# The split costs a pass over W (4 bytes read, 6 written per weight) and saves most of a
# float32 matmul's time: it pays from a few hundred rows (x's batch) and a few hundred
# microseconds of float32 work. Below these, the plain matmul runs.
MIN_ROWS = 256
MIN_MACS = 1 << 31  # multiply-adds of x Wᵀ


def holds_bf16_exact_spikes(x: Tensor) -> bool:
    """Whether ``x`` is tagged as values bf16 holds exactly: spikes, or the means of k x k
    spikes where k² is a power of two up to 256 (multiples of 1/k²: 8 significant bits)."""
    window = means_window(x)
    return window is not None and window <= 256 and window & (window - 1) == 0


def full_float32_matmul() -> bool:
    """Whether PyTorch runs float32 CUDA matmuls in full float32 (not TF32)."""
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)
    if precision is None:  # torch without the fp32_precision settings
        return not matmul.allow_tf32
    if precision == "none":  # inherits the global setting
        precision = getattr(torch.backends, "fp32_precision", "none")
    return precision in ("none", "ieee")


def _has_mm_out_dtype() -> bool:
    try:
        torch.ops.aten.mm.dtype  # noqa: B018 (the overloads exist from torch 2.8)
        torch.ops.aten.bmm.dtype  # noqa: B018
    except AttributeError:
        return False
    return True


_MM_OUT_DTYPE = _has_mm_out_dtype()


def _split_kernels(x: Tensor) -> SplitKernels | None:
    """The split kernel of a backend that runs x (the ``bf16_split`` capability), or None."""
    return cast("SplitKernels | None", capability("bf16_split", x))


def takes_split_path(x: Tensor, weight: Tensor) -> bool:
    """Whether ``F.linear(x, weight)`` of a fused block (x: [..., K], as tagged: a view of it
    does not see a tag put on another view) runs as :class:`SpikeLinearFunction` on x's rows:
    under CUDA graph capture (see the module docstring). An eager call that would split if
    captured loads the split kernel, so that capturing the step later can launch it."""
    rows, (outputs, inputs) = x.shape[:-1].numel(), weight.shape
    float32 = _MM_OUT_DTYPE and x.dtype == torch.float32 and weight.dtype == torch.float32
    kernels = _split_kernels(x) if float32 else None
    splits = (
        kernels is not None
        and not torch.compiler.is_compiling()
        and not torch.is_autocast_enabled(x.device.type)
        and rows >= MIN_ROWS
        and rows * outputs * inputs >= MIN_MACS
        and full_float32_matmul()
        and holds_bf16_exact_spikes(x)
    )
    if splits and kernels is not None and not is_current_stream_capturing():
        kernels.load(x.device)  # (a lookup once loaded)
        return False
    return splits


def split_bf16(t: Tensor) -> Tensor:
    """bfloat16 [3, *t.shape]: hi, mid, lo with hi + mid + lo = t (float32) to about 2^-26
    relative; one kernel on CUDA, torch ops elsewhere: the same bits."""
    t = t.contiguous()
    kernels = _split_kernels(t)
    if kernels is not None:
        return kernels.split(t)
    hi = t.to(torch.bfloat16)
    rest = t - hi.float()  # exact (Sterbenz), as in the kernel
    mid = rest.to(torch.bfloat16)
    return torch.stack((hi, mid, (rest - mid.float()).to(torch.bfloat16)))


def matmul_bf16_float32(a: Tensor, b: Tensor) -> Tensor:
    """a @ b of bfloat16 matrices (or batches of them), accumulated and returned in float32
    (exact products)."""
    if a.is_cuda:
        return (torch.bmm if a.dim() == 3 else torch.mm)(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()  # the same products and float32 sums, for CPU tests


class SpikeLinearFunction(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` (x: [M, K] whose values bf16 holds exactly, weight:
    [N, K], bias: [N] or None; all float32) on bf16 tensor cores at float32 accuracy. Saves x
    and the weight, as F.linear does, so a recipe that stands in for x (a fused block's
    spikes) still applies."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        rows, (outputs, inputs) = x.shape[0], weight.shape
        terms = split_bf16(weight).view(3 * outputs, inputs)
        out = matmul_bf16_float32(x.to(torch.bfloat16), terms.t())  # [M, 3 N]: one per term
        out = out.view(rows, 3, outputs).sum(1)
        return out if bias is None else out.add_(bias)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        forbid_double_backward("a fused Linear block on spikes")
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_out.mm(weight)
        if ctx.needs_input_grad[1]:
            terms = split_bf16(grad_out).transpose(1, 2)  # [3, N, M]: g = hi + mid + lo
            # One float32 product per term, summed after: summed inside one matmul's
            # accumulation instead (the terms stacked along M), the small terms' products lose
            # bits on tensor cores (a relative error of 2e-6 against float32's 2e-7).
            x_bf16 = x.to(torch.bfloat16).expand(3, *x.shape)
            grad_w = matmul_bf16_float32(terms, x_bf16).sum(0)
        if ctx.needs_input_grad[2]:  # False where bias is None
            grad_b = grad_out.sum(0)
        return grad_x, grad_w, grad_b
