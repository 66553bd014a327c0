"""The fused blocks' minimal-memory mode: keep only the block's input, recompute the synapse.

The DATE'22 blocks keep their synapse (Conv/Linear) output y for backward. With
``memory="min"`` a block keeps its *input* instead, packed at 1 bit per element when that
input is the spike output of another fused block (8 elements per byte: 1/32 of float32), and
recomputes y = synapse(input) in backward before the BatchNorm-neuron backward; the synapse's
own backward then runs on the recomputed graph. Backward costs one more synapse forward per
block; the gradients equal the default mode's (same operations on the same values).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..ops import forbid_double_backward
from .bn_neuron import (
    bn_neuron_forward,
    bn_neuron_grads,
    bn_param_grads,
    load_bn_context,
    save_bn_context,
)
from .device_constants import device_constant
from .neuron_call import NeuronCall
from .statistics import BNSpec, BNStats

_SPIKES = "_spikefuse_spikes"  # tag: the tensor holds only 0 and 1 (a fused block's output)


def mark_spikes(t: Tensor) -> Tensor:
    """Tag ``t`` as binary spikes (until it is modified in place); returns t."""
    setattr(t, _SPIKES, t._version)
    return t


def is_spikes(t: Tensor) -> bool:
    """Whether ``t`` (or the tensor it is a view of) is tagged as unmodified spikes."""
    for candidate in (t, t._base):
        if candidate is not None and getattr(candidate, _SPIKES, None) == candidate._version:
            return True
    return False


def _bit_weights(device: torch.device) -> Tensor:
    return device_constant(
        ("bit weights", device),
        lambda: torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=device),
    )


def memory_order(t: Tensor) -> tuple[int, ...]:
    """The dimension order in which ``t``'s elements lie in memory (outermost first), when
    that order is dense (e.g. a channels-last map), else the logical order."""
    strides = t.stride()
    order = tuple(sorted(range(t.dim()), key=lambda d: -strides[d]))
    return order if t.permute(order).is_contiguous() else tuple(range(t.dim()))


def pack_bits(spikes: Tensor, order: tuple[int, ...]) -> Tensor:
    """0/1 values → uint8 [ceil(n / 8)], read in ``order`` (:func:`memory_order`: no copy)."""
    bits = spikes.permute(order).reshape(-1) != 0
    pad = -bits.numel() % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    weights = _bit_weights(spikes.device)
    return (bits.view(-1, 8).to(torch.uint8) * weights).sum(dim=1, dtype=torch.uint8)


def unpack_bits(
    packed: Tensor, shape: torch.Size, dtype: torch.dtype, order: tuple[int, ...]
) -> Tensor:
    """The inverse of :func:`pack_bits`: a tensor of ``shape`` with the packed tensor's memory
    layout (a dense ``order``)."""
    dense_shape = [shape[d] for d in order]
    bits = (packed[:, None] & _bit_weights(packed.device)) != 0
    dense = bits.reshape(-1)[: shape.numel()].to(dtype).view(dense_shape)
    inverse = sorted(range(len(order)), key=lambda d: order[d])
    return dense.permute(inverse)


class SynapseRecomputeFunction(torch.autograd.Function):
    """spikes = neuron(BN(synapse(x))), keeping x (1-bit packed when it is spikes) for backward.

    ``apply(x, y, weight, bias, learnable, stats, bn, neuron, synapse, *synapse_params)``: y is
    ``synapse(x)``, computed by the caller without autograd (and freed after this forward);
    ``synapse`` recomputes it from x in backward, where autograd differentiates it with respect
    to x and ``synapse_params``. The other arguments are :class:`BNNeuronFunction`'s.
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
        synapse: Callable[[Tensor], Tensor],
        *synapse_params,
    ):
        spikes, saved = bn_neuron_forward(y, stats, neuron, learnable, True)
        packed = is_spikes(x)
        order = memory_order(x)
        kept = pack_bits(x, order) if packed else x
        save_bn_context(
            ctx,
            kept,
            learnable,
            stats=stats,
            saved=saved,
            weight=weight,
            bias=bias,
            neuron=neuron,
            bn=bn,
        )
        ctx.geometry = (x.shape, x.dtype, packed, order)
        # backward runs outside the forward's autocast context: recompute y under the same one
        device = x.device.type
        ctx.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
        ctx.synapse = synapse
        ctx.synapse_params = synapse_params  # parameters: alive anyway, not activations
        return spikes

    @staticmethod
    def backward(ctx, grad_spikes):
        forbid_double_backward("a fused block (memory='min')")
        kept, learnable, stats, saved = load_bn_context(ctx)
        shape, dtype, packed, order = ctx.geometry
        x = unpack_bits(kept, shape, dtype, order) if packed else kept
        needs_x, params_need = ctx.needs_input_grad[0], ctx.needs_input_grad[9:]
        device, dtype, enabled = ctx.autocast
        autocast = torch.autocast(device, dtype, enabled=enabled, cache_enabled=False)
        with torch.enable_grad(), autocast:
            x = x.detach().requires_grad_(needs_x)
            y = ctx.synapse(x)
        grad_y, grad_weight, grad_bias, grad_learnable = bn_neuron_grads(
            y=y.detach(),
            stats=stats,
            bn=ctx.bn,
            neuron=ctx.neuron,
            learnable=learnable,
            grad_spikes=grad_spikes,
            saved=saved,
            needs=ctx.needs_input_grad[2:5],
        )
        grad_weight, grad_bias = bn_param_grads(ctx, grad_weight, grad_bias)
        # y (as large as the block's output) is only the root of the graph below: a Conv's or
        # Linear's backward reads x and the weights, never y's values. Free its memory before
        # that backward allocates dL/dx, so the two are never alive together.
        y.untyped_storage().resize_(0)
        # the synapse's own backward, on the recomputed graph (only what needs a gradient)
        candidates = zip([x, *ctx.synapse_params], [needs_x, *params_need], strict=True)
        wanted = [t for t, need in candidates if need]
        grads = iter(torch.autograd.grad(y, wanted, grad_y) if wanted else ())
        grad_x = next(grads) if needs_x else None
        grad_params = [next(grads) if need else None for need in params_need]
        # x, y, weight, bias, learnable, stats, bn, neuron, synapse, *synapse_params
        grads_in = (grad_x, None, grad_weight, grad_bias, grad_learnable, None, None, None, None)
        return *grads_in, *grad_params
