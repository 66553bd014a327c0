"""The spike products' autograd Functions: exact tensor-core forwards (:mod:`.rules`), backward
from the spikes alone.

Each Function keeps its operands as ``torch.bool`` (1 byte per spike, against 4 in float32) and
the chain recomputes its counts ``a @ b`` in backward instead of keeping them. The gradients
are those of the plain matmuls, computed in the output gradient's dtype::

    out = a @ b:                 da = g bᵀ,        db = aᵀ g
    out = ((a @ b) @ c) s:       P = a @ b,  g' = g s,  dc = Pᵀ g',
                                 dP = g' cᵀ,  da = dP bᵀ,  db = aᵀ dP

The heads' chain (:class:`SpikeHeadsChainFunction`) takes q, k, v as one tensor and returns
their gradients as one tensor in its layout: on CUDA by the backend's kernels, one launch each
way; elsewhere by matmuls that scale P and q (factors of g's sums) instead of g and write each
gradient from a product laid out as its slot of that tensor.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor

from ..backends import HeadsChainKernels, capability
from ..ops import forbid_double_backward
from .rules import Plan, plan, plan_for


def compact(t: Tensor, dtype: torch.dtype) -> Tensor:
    """t [..., M, K] in ``dtype``, dense: row-major, or column-major (a transposed view of
    row-major memory) where t's stride-1 dimension is its rows, e.g. a head of tokens laid out
    channels innermost, [.., C/heads, L] with the channels at stride 1. One copy, whose reads
    run along that dimension (a row-major copy of such a view reads with a stride of the
    channel count: several times slower); matmuls take either order as it is."""
    if t.dim() >= 2 and t.stride(-2) == 1 and t.stride(-1) != 1:
        dense = t.transpose(-2, -1).to(dtype, memory_format=torch.contiguous_format)
        return dense.transpose(-2, -1)
    return t.to(dtype, memory_format=torch.contiguous_format)


def product(a: Tensor, b: Tensor, how: Plan, dtype: torch.dtype | None = None) -> Tensor:
    """``a @ b`` ([..., M, K] @ [..., K, N], equal batch dims) as ``how`` says, in ``dtype``
    (None: a's): on tensor cores over ``how.operands`` with float32 sums (a and b of any dtype,
    bool spikes too, converted once), or the plain matmul (a and b in ``dtype`` already)."""
    if how.operands is None:
        return a @ b
    batch, (m, k), n = a.shape[:-2], a.shape[-2:], b.shape[-1]
    left = compact(a, how.operands).reshape(-1, m, k)  # views of the dense copies
    right = compact(b, how.operands).reshape(-1, k, n)
    if a.is_cuda:
        # autocast would recast the operands (fp16 counts to bf16, which does not hold them)
        with torch.autocast("cuda", enabled=False):
            out = torch.bmm(left, right, out_dtype=torch.float32)
    else:  # the same products and float32 sums (torch has no such bmm on CPU), for tests
        out = left.float() @ right.float()
    return out.view(*batch, m, n).to(a.dtype if dtype is None else dtype)


class SpikeMatmulFunction(torch.autograd.Function):
    """``a @ b`` of spike tensors (see :func:`spikefuse.spike_matmul.spike_matmul`)."""

    @staticmethod
    def forward(ctx: Any, a: Tensor, b: Tensor) -> Tensor:
        ctx.save_for_backward(compact(a, torch.bool), compact(b, torch.bool))
        return product(a, b, plan(a, a.shape[-1]))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        forbid_double_backward("spike_matmul")
        a, b = ctx.saved_tensors
        grad_a = (
            grad @ _float_as(b, grad.dtype).transpose(-2, -1) if ctx.needs_input_grad[0] else None
        )
        grad_b = (
            _float_as(a, grad.dtype).transpose(-2, -1) @ grad if ctx.needs_input_grad[1] else None
        )
        return grad_a, grad_b


class SpikeMatmulChainFunction(torch.autograd.Function):
    """``((a @ b) @ c) * scale`` of spike tensors (see
    :func:`spikefuse.spike_matmul.spike_matmul_chain`)."""

    @staticmethod
    def forward(ctx: Any, a: Tensor, b: Tensor, c: Tensor, scale: float) -> Tensor:
        ctx.save_for_backward(*(compact(t, torch.bool) for t in (a, b, c)))
        ctx.dtype, ctx.scale = a.dtype, scale
        counts = _counts(a, b, a.dtype)
        out = product(counts, c, plan(a, c.shape[-2], count=a.shape[-1]))
        return out.mul_(scale)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        forbid_double_backward("spike_matmul_chain")
        a, b, c = ctx.saved_tensors
        needs_a, needs_b, needs_c = ctx.needs_input_grad[:3]
        grad = grad * ctx.scale
        grad_a = grad_b = grad_c = None
        if needs_c:
            counts = _float_as(_counts(a, b, ctx.dtype), grad.dtype)  # recomputed: never kept
            grad_c = counts.transpose(-2, -1) @ grad
        if needs_a or needs_b:
            grad_counts = grad @ _float_as(c, grad.dtype).transpose(-2, -1)
            if needs_a:
                grad_a = grad_counts @ _float_as(b, grad.dtype).transpose(-2, -1)
            if needs_b:
                grad_b = _float_as(a, grad.dtype).transpose(-2, -1) @ grad_counts
        return grad_a, grad_b, grad_c, None


def _counts(a: Tensor, b: Tensor, dtype: torch.dtype) -> Tensor:
    """``a @ b`` of spikes (bool or float) in ``dtype``: the same values in forward and backward.
    On tensor cores the operands are converted once, straight to the cores' dtype; the plain
    matmul runs in ``dtype``."""
    how = plan_for(a.device, dtype, a.shape[-1])
    if how.operands is None:
        return _float_as(a, dtype) @ _float_as(b, dtype)
    return product(a, b, how, dtype)


def _float_as(t: Tensor, dtype: torch.dtype) -> Tensor:
    """t in ``dtype``: itself, or a copy along its stride-1 dimension (:func:`compact`)."""
    return t if t.dtype == dtype else compact(t, dtype)


def heads(qkv: Tensor, num_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v [..., heads, C/heads, L]: views of the channels 0..C, C..2C and 2C..3C of qkv
    [..., 3C, L] (SpikingJelly's split of Spikformer's one Q/K/V convolution)."""
    q, k, v = qkv.unflatten(-2, (3 * num_heads, -1)).chunk(3, dim=-3)
    return q, k, v


class SpikeGateFunction(torch.autograd.Function):
    """``mask * spikes`` of two spike tensors that broadcast (see
    :func:`spikefuse.spike_matmul.spike_gate`), keeping each operand backward needs as
    ``torch.bool``: the other's gradient is ``grad * operand`` summed to its shape, as
    autograd's ``mul`` computes it."""

    @staticmethod
    def forward(ctx: Any, mask: Tensor, spikes: Tensor) -> Tensor:
        needs_mask, needs_spikes = ctx.needs_input_grad[:2]
        ctx.save_for_backward(
            spikes.to(torch.bool) if needs_mask else None,
            mask.to(torch.bool) if needs_spikes else None,
        )
        ctx.shapes = mask.shape, spikes.shape
        return mask * spikes

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        forbid_double_backward("spike_gate")
        spikes, mask = ctx.saved_tensors
        mask_shape, spikes_shape = ctx.shapes
        grad_mask = None if spikes is None else (grad * spikes).sum_to_size(mask_shape)
        grad_spikes = None if mask is None else (grad * mask).sum_to_size(spikes_shape)
        return grad_mask, grad_spikes


def _heads_kernels(like: Tensor, head_dim: int, tokens: int) -> HeadsChainKernels | None:
    """The backend's heads-chain kernels where they run ``like``'s device and dtype and heads of
    this size (None: the torch matmuls)."""
    kernels = cast("HeadsChainKernels | None", capability("heads_chain", like))
    if kernels is None or kernels.unsupported(head_dim, tokens) is not None:
        return None
    return kernels


class SpikeHeadsChainFunction(torch.autograd.Function):
    """``((v @ kᵀ) @ q) * scale`` of the heads of qkv spikes [..., 3C, L] (see
    :func:`spikefuse.spike_matmul.spike_matmul_chain_heads`): out [..., heads, C/heads, L].

    Where the backend's ``heads_chain`` kernels run (CUDA), one kernel each way computes every
    head with its counts in shared memory, and out lies channels innermost (a [..., L, C]
    tensor's view), as fused blocks lay out their spikes; elsewhere torch matmuls compute the
    same, out dense."""

    @staticmethod
    def forward(ctx: Any, qkv: Tensor, num_heads: int, scale: float) -> Tensor:
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(qkv.to(torch.bool))  # one copy, in qkv's layout
        ctx.num_heads, ctx.dtype, ctx.scale = num_heads, qkv.dtype, scale
        *lead, channels, tokens = qkv.shape
        head_dim = channels // (3 * num_heads)
        kernels = _heads_kernels(qkv, head_dim, tokens)
        if kernels is not None:
            rows = qkv.reshape(-1, channels, tokens)
            out = qkv.new_empty((rows.shape[0], tokens, channels // 3)).transpose(1, 2)
            kernels.heads_chain_forward(rows, out, num_heads, scale)
            return out.view(*lead, num_heads, head_dim, tokens)
        q, k, v = heads(qkv, num_heads)
        counts = _counts(v, k.transpose(-2, -1), qkv.dtype)
        out = product(counts, q, plan(qkv, q.shape[-2], count=v.shape[-1]))
        return out.mul_(scale)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None]:
        """On the kernels: one launch writing dL/dqkv in the saved spikes' layout. Else each
        gradient [.., C/heads, L] is computed as its transpose [.., L, C/heads], so that it lies
        as its slot of qkv does where qkv has the channels innermost (a fused block's spikes):
        the copies into that slot read and write along the channels."""
        forbid_double_backward("spike_matmul_chain_heads")
        (spikes,) = ctx.saved_tensors
        *_, channels, tokens = spikes.shape
        kernels = _heads_kernels(grad, channels // (3 * ctx.num_heads), tokens)
        if kernels is not None:
            rows = spikes.reshape(-1, channels, tokens)
            grad_rows = torch.empty_like(rows, dtype=grad.dtype)
            grad_out = grad.reshape(rows.shape[0], channels // 3, tokens)
            kernels.heads_chain_backward(grad_out, rows, grad_rows, ctx.num_heads, ctx.scale)
            return grad_rows.view(spikes.shape), None, None
        q, k, v = heads(spikes, ctx.num_heads)
        counts = _counts(v, k.transpose(-2, -1), ctx.dtype)  # P = v kᵀ, recomputed
        # the scale multiplies a factor of each sum, not the sum: float16 sums stay as far
        # from overflow as the plain matmuls' (g s)
        scaled_q = compact(q, grad.dtype).mul_(ctx.scale)
        k, v = compact(k, grad.dtype), compact(v, grad.dtype)
        grad_qkv = torch.empty_like(spikes, dtype=grad.dtype)
        grad_q, grad_k, grad_v = heads(grad_qkv, ctx.num_heads)
        scaled = counts.to(grad.dtype).mul_(ctx.scale)  # P s
        grad_q.copy_((grad.transpose(-2, -1) @ scaled).transpose(-2, -1))  # (g s)ᵀ P, transposed
        grad_counts = grad @ scaled_q.transpose(-2, -1)  # dP = g s qᵀ
        grad_v.copy_((k.transpose(-2, -1) @ grad_counts.transpose(-2, -1)).transpose(-2, -1))
        grad_k.copy_((v.transpose(-2, -1) @ grad_counts).transpose(-2, -1))  # (vᵀ dP)ᵀ
        return grad_qkv, None, None
