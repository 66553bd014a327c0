"""The fused blocks' minimal-memory mode: keep only the block's input, recompute the synapse.

The DATE'22 blocks keep their synapse (Conv/Linear) output y for backward. With ``memory="min"`` a
block keeps its *input* instead, packed at 1 bit per element when that input is the spike output of
another fused block (8 elements per byte: 1/32 of float32, plus a NaN flag byte per 32), or as the 4
bits per mean that the pooling kernels of the block before wrote of their output, and recomputes y =
synapse(input) in backward before the BatchNorm-neuron backward. The synapse's own backward is then
called explicitly, weight gradient first, input gradient last; a Conv with a string padding or a
non-zero padding mode differentiates the recomputed graph with autograd instead. Backward costs one
more synapse forward per block; the gradients equal the default mode's to rounding.

Backward holds at most two block-sized tensors besides the upstream gradient: the recomputed
y (with the input unpacked for it alone), which the BN-folded kernels overwrite with dL/dy;
then dL/dy and the unpacked input for the weight gradient, and last dL/dy and dL/dx.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.modules.conv import _ConvNd

from ..functional import repeated_over_time
from ..ops import forbid_double_backward
from .bn_neuron import (
    bn_neuron_forward,
    bn_neuron_grads,
    bn_param_grads,
    load_bn_context,
    repeated,
    save_bn_context,
)
from .neuron_call import NeuronCall
from .spike_bits import Compact, compact, expand
from .statistics import BNSpec, BNStats

if TYPE_CHECKING:
    from .blocks import FusedBlock

Synapse = nn.Linear | _ConvNd


def explicit_backward(synapse: Synapse) -> bool:
    """Whether :func:`synapse_grads` handles ``synapse`` (a Linear, or a Conv whose padding is
    numbers and zeros); otherwise autograd differentiates the recomputed synapse."""
    if isinstance(synapse, nn.Linear):
        return True
    return synapse.padding_mode == "zeros" and not isinstance(synapse.padding, str)


def synapse_param_grads(
    synapse: Synapse, x: Tensor, grad_y: Tensor, dtype: torch.dtype, need_b: bool
) -> tuple[Tensor, Tensor | None]:
    """(dL/dweight, dL/dbias or None) of ``y = synapse(x)`` on merged [T*B, ...] tensors,
    computed in ``dtype`` (the forward's autocast dtype, else the weight's) and returned in the
    parameters' dtypes."""
    grad_y, x = grad_y.to(dtype), x.to(dtype)
    if isinstance(synapse, nn.Linear):
        g = grad_y.flatten(0, -2)
        grad_w, grad_b = g.t() @ x.flatten(0, -2), (g.sum(0) if need_b else None)
    else:
        weight = synapse.weight.to(dtype)
        _, grad_w, grad_b = torch.ops.aten.convolution_backward(
            grad_y,
            x,
            weight,
            [weight.shape[0]] if need_b else None,
            synapse.stride,
            synapse.padding,
            synapse.dilation,
            False,
            [0] * (grad_y.dim() - 2),
            synapse.groups,
            [False, True, need_b],
        )
    bias = synapse.bias
    grad_b = None if grad_b is None or bias is None else grad_b.to(bias.dtype)
    return grad_w.to(synapse.weight.dtype), grad_b


def synapse_input_grad(
    synapse: Synapse, x_shape: torch.Size, grad_y: Tensor, dtype: torch.dtype
) -> Tensor:
    """dL/dx of ``y = synapse(x)`` on merged [T*B, ...] tensors, in ``dtype``. A Conv's is the
    transposed convolution of dL/dy (cuDNN's data-gradient kernels, in dL/dy's memory layout;
    x's values are not needed), with the output padding that restores x's size. Not
    ``torch.nn.grad.conv2d_input``: its stand-in input (a broadcast scalar) has no channels-last
    layout, so cuDNN transposes dL/dy and its result (measured on an H100: +1.3 GB, slower)."""
    grad_y, weight = grad_y.to(dtype), synapse.weight.to(dtype)
    if isinstance(synapse, nn.Linear):
        return grad_y @ weight
    assert not isinstance(synapse.padding, str)  # explicit_backward
    spatial = range(grad_y.dim() - 2)
    output_padding = [
        x_shape[2 + d]
        - (
            (grad_y.shape[2 + d] - 1) * synapse.stride[d]
            - 2 * synapse.padding[d]
            + synapse.dilation[d] * (synapse.kernel_size[d] - 1)
            + 1
        )
        for d in spatial
    ]
    transposed = F.conv_transpose1d if grad_y.dim() == 3 else F.conv_transpose2d
    return transposed(
        grad_y,
        weight,
        None,
        synapse.stride,
        synapse.padding,
        output_padding,
        synapse.groups,
        synapse.dilation,
    )


class SynapseRecomputeFunction(torch.autograd.Function):
    """spikes = neuron(BN(synapse(x))), keeping x for backward as :func:`compact` keeps it (1-bit
    packed when it is spikes, the packing the kernels wrote of a pooled block's output).

    ``apply(x, y, weight, bias, learnable, stats, bn, neuron, residual, kept_residual, block, pool,
    repeat, *synapse_params)`` returns ``(spikes, packed)`` as :class:`BNNeuronFunction` does
    (packed: the pooling kernels' packing of their output, else None). y is ``block``'s synapse
    output for x, computed by the caller without autograd (and freed after this forward); backward
    recomputes it from x and differentiates it with respect to x and ``synapse_params`` (the
    synapse's weight and bias). ``repeat`` = T > 1: x is an input repeated over time that needs no
    gradient and y the synapse output of its one step [1, B, ...], as :class:`BNNeuronFunction`
    takes it (backward then recomputes that one step). The other arguments are BNNeuronFunction's.
    """

    @staticmethod
    def forward(
        ctx,
        x,
        y,
        weight,
        bias,
        learnable,
        stats: BNStats | None,
        bn: BNSpec | None,
        neuron: NeuronCall,
        residual: Tensor | None,
        kept_residual: Compact | None,
        block: FusedBlock,
        pool: int,
        repeat: int,
        *synapse_params,
    ):
        spikes, saved, packed = bn_neuron_forward(
            repeated(y, repeat), stats, neuron, learnable, True, pool, residual, pack_spikes=True
        )
        save_bn_context(
            ctx,
            x if repeat > 1 else compact(x),  # repeated: the caller's view of its images
            learnable,
            stats=stats,
            saved=saved,
            weight=weight,
            bias=bias,
            neuron=neuron,
            bn=bn,
            residual=kept_residual,
        )
        ctx.geometry = (x.shape, x.dtype)
        # backward runs outside the forward's autocast context: recompute y under the same one
        device = x.device.type
        ctx.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
        ctx.block, ctx.pool, ctx.repeat = block, pool, repeat
        ctx.synapse_params = synapse_params  # parameters: alive anyway, not activations
        ctx.set_materialize_grads(False)  # as BNNeuronFunction: no zeros for the packing
        return spikes, packed

    @staticmethod
    def backward(ctx, grad_spikes, _):
        forbid_double_backward("a fused block (memory='min')")
        if grad_spikes is None:  # the spikes did not reach what backward started from
            return (None,) * len(ctx.needs_input_grad)
        kept, learnable, stats, saved, kept_residual = load_bn_context(ctx)
        shape, x_dtype = ctx.geometry
        block, pool, repeat = ctx.block, ctx.pool, ctx.repeat
        needs_x, params_need = ctx.needs_input_grad[0], ctx.needs_input_grad[13:]
        device, dtype, enabled = ctx.autocast
        autocast = torch.autocast(device, dtype, enabled=enabled, cache_enabled=False)
        explicit = explicit_backward(block.synapse)
        # y in one call, as forward made it: the same shapes give the same convolution
        # algorithm and so the same y to the bit (in chunks, cuDNN may pick another algorithm
        # and round differently, and a potential on the threshold would then spike in one pass
        # and not in the other)
        if explicit:
            with torch.no_grad(), autocast:
                y = block._synapse_kept(expand(kept), repeat)  # the unpacked input freed here
        else:  # autograd on the recomputed graph (which keeps x)
            with torch.enable_grad(), autocast:
                x = expand(kept).detach().requires_grad_(needs_x)
                y = block._synapse_kept(x, repeat)
        residual = None if kept_residual is None else expand(kept_residual)
        grad_y, grad_weight, grad_bias, grad_learnable, grad_residual = bn_neuron_grads(
            y=repeated(y.detach(), repeat),
            stats=stats,
            bn=ctx.bn,
            neuron=ctx.neuron,
            learnable=learnable,
            grad_spikes=grad_spikes,
            saved=saved,
            needs=ctx.needs_input_grad[2:5],
            pool=pool,
            residual=residual,
            overwrite_y=explicit,  # y is ours: dL/dy may take its memory
        )
        del residual
        grad_weight, grad_bias = bn_param_grads(ctx, grad_weight, grad_bias)
        if explicit:
            del y
            grad_x, grad_params = _explicit_grads(
                block,
                kept,
                shape,
                x_dtype,
                grad_y,
                dtype if enabled else None,
                needs_x,
                params_need,
            )
        else:
            # y is only the root of the graph below: a Conv's or Linear's backward reads x and
            # the weights, never y's values; free it before that backward allocates dL/dx.
            y.untyped_storage().resize_(0)
            candidates = zip([x, *ctx.synapse_params], [needs_x, *params_need], strict=True)
            wanted = [t for t, need in candidates if need]
            grads = iter(torch.autograd.grad(y, wanted, grad_y) if wanted else ())
            grad_x = next(grads) if needs_x else None
            grad_params = [next(grads) if need else None for need in params_need]
        # x, y, weight, bias, learnable, stats, bn, neuron, residual, kept_residual, block, ...
        grads = (grad_x, None, grad_weight, grad_bias, grad_learnable, None, None, None)
        return *grads, grad_residual, None, None, None, None, *grad_params


def _explicit_grads(
    block: FusedBlock,
    kept: Compact,
    shape: torch.Size,
    x_dtype: torch.dtype,
    grad_y: Tensor,
    autocast_dtype: torch.dtype | None,
    needs_x: bool,
    params_need: tuple[bool, ...],
) -> tuple[Tensor | None, list[Tensor | None]]:
    """dL/dx and the synapse parameters' gradients, weight gradient first: the input is
    restored (unpacked) for it alone and freed before dL/dx is allocated. dL/dy is [1, B, ...]
    for an input repeated over time (its steps' gradients summed), else [T, B, ...]."""
    synapse = block.synapse
    dtype = autocast_dtype or synapse.weight.dtype
    has_bias = len(params_need) > 1
    grad_w: Tensor | None = None
    grad_b: Tensor | None = None
    if any(params_need):  # both gradients in one call (a bias gradient alone is rare)
        x = expand(kept)
        if grad_y.shape[0] == 1 or repeated_over_time(x):  # one step's input, steps summed
            x_merged, g_merged = block._merged(x[:1]), grad_y.sum(0)
        else:
            x_merged, g_merged = block._merged(x), grad_y.flatten(0, 1)
        del x
        grad_w, grad_b = synapse_param_grads(
            synapse, x_merged, g_merged, dtype, has_bias and params_need[1]
        )
        del x_merged, g_merged
    grad_x = None
    if needs_x:  # never for an input repeated over time (it needs no gradient)
        merged_shape = torch.Size((shape[0] * shape[1], *shape[2:]))
        merged_x = synapse_input_grad(synapse, merged_shape, grad_y.flatten(0, 1), dtype)
        grad_x = merged_x.unflatten(0, shape[:2]).to(x_dtype)
    grad_w = grad_w if params_need[0] else None
    return grad_x, [grad_w, *([grad_b] if has_bias else [])]
