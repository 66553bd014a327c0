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

A block whose y is large runs in equal batch chunks instead (:mod:`.chunked`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor

from ..errors import SpikefuseError
from ..functional import repeated_over_time
from ..ops import forbid_double_backward
from .ops.bn_neuron.autograd import (
    BNNeuronArgs,
    bn_param_grads,
    load_bn_context,
    save_bn_context,
)
from .ops.bn_neuron.passes import bn_neuron_forward, bn_neuron_grads, repeated
from .recompute import Compact, compact, expand
from .synapse import Synapse


def keep_autocast(ctx: Any, x: Tensor) -> None:
    """Keep the forward's autocast state on ``ctx``: backward runs outside the forward's
    autocast context, and recomputes y under the same one (:func:`forward_autocast`)."""
    device = x.device.type
    ctx.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))


def keep_param_versions(ctx: Any, params: tuple[Tensor, ...]) -> None:
    """Keep the synapse parameters and their versions on ``ctx``: backward recomputes y from the
    parameters as they are then, which autograd's check of saved tensors does not cover
    (:func:`check_params_unmodified`)."""
    ctx.synapse_params = params  # parameters: alive anyway, not activations
    ctx.param_versions = tuple(p._version for p in params)


def check_params_unmodified(ctx: Any) -> None:
    """Raise where a synapse parameter was modified in place since forward (an optimizer step
    before backward): the recomputed y, and so every gradient, would be silently wrong."""
    versions = zip(ctx.synapse_params, ctx.param_versions, strict=True)
    if any(p._version != version for p, version in versions):
        raise SpikefuseError(
            "a fused block's synapse parameter was modified in place between its forward and "
            "backward (e.g. optimizer.step() before loss.backward()); its backward recomputes "
            "the synapse output from the parameters, so call backward before changing them"
        )


def forward_autocast(
    ctx: Any,
) -> tuple[contextlib.AbstractContextManager[Any], torch.dtype | None]:
    """The forward's autocast context (without the weight cache, which CUDA graph capture
    cannot take) and its dtype (None: autocast was off). Where autocast was off and is off
    now, no context: making and entering one is host work on every backward."""
    device, dtype, enabled = ctx.autocast
    if not enabled and not torch.is_autocast_enabled(device):
        return contextlib.nullcontext(), None
    context = torch.autocast(device, dtype, enabled=enabled, cache_enabled=False)
    return context, dtype if enabled else None


class SynapseRecomputeFunction(torch.autograd.Function):
    """spikes = neuron(BN(synapse(x))), keeping x for backward as :func:`compact` keeps it (1-bit
    packed when it is spikes, the packing the kernels wrote of a pooled block's output).

    ``apply(args, synapse, x, y, weight, bias, learnable, residual, *synapse_params)`` returns
    ``(spikes, packed)`` as :class:`~.ops.bn_neuron.BNNeuronFunction` does (packed: the
    pooling kernels' packing of their output, else None). y is ``synapse(x)``, computed by the
    caller without autograd (and freed after this forward); backward recomputes it from x and
    differentiates it with respect to x and ``synapse_params`` (the synapse's weight and
    bias). ``args.repeat`` = T > 1: x is an input repeated over time that needs no gradient and
    y the synapse output of its one step [1, B, ...] (backward then recomputes that one step).
    """

    @staticmethod
    def forward(ctx, args: BNNeuronArgs, synapse: Synapse, x, y, weight, bias, learnable, residual, *synapse_params):  # fmt: skip
        spikes, saved, packed = bn_neuron_forward(
            repeated(y, args.repeat),
            args.stats,
            args.neuron,
            learnable,
            True,
            args.pool,
            residual,
            pack_spikes=True,
            input_pool=args.input_pool,
        )
        # repeated: the caller's view of its images
        first = x if args.repeat > 1 else compact(x)
        save_bn_context(ctx, first, learnable, args, saved, (weight, bias))
        ctx.geometry = (x.shape, x.dtype)
        keep_autocast(ctx, x)
        ctx.synapse, ctx.pool, ctx.repeat = synapse, args.pool, args.repeat
        keep_param_versions(ctx, synapse_params)
        ctx.set_materialize_grads(False)  # as BNNeuronFunction: no zeros for the packing
        return spikes, packed

    @staticmethod
    def backward(ctx, grad_spikes, _):
        forbid_double_backward("a fused block (memory='min')")
        if grad_spikes is None:  # the spikes did not reach what backward started from
            return (None,) * len(ctx.needs_input_grad)
        check_params_unmodified(ctx)
        kept, learnable, stats, saved, kept_residual = load_bn_context(ctx)
        synapse, repeat = ctx.synapse, ctx.repeat
        needs_x, params_need = ctx.needs_input_grad[2], ctx.needs_input_grad[8:]
        autocast, autocast_dtype = forward_autocast(ctx)
        # one cast of the weight where autocast would cast it for each use below
        dtype = autocast_dtype or synapse.module.weight.dtype
        weight = synapse.weight_in(dtype) if synapse.explicit_backward() else None
        x, y = _recomputed(synapse, kept, repeat, autocast, weight, needs_x)
        residual = None if kept_residual is None else expand(kept_residual)
        grad_y, grad_weight, grad_bias, grad_learnable, grad_residual = bn_neuron_grads(
            y=repeated(y.detach(), repeat),
            stats=stats,
            bn=ctx.bn,
            neuron=ctx.neuron,
            learnable=learnable,
            grad_spikes=grad_spikes,
            saved=saved,
            needs=ctx.needs_input_grad[4:7],
            pool=ctx.pool,
            residual=residual,
            overwrite_y=weight is not None,  # y is ours: dL/dy may take its memory
            input_pool=ctx.input_pool,
        )
        del residual
        grad_weight, grad_bias = bn_param_grads(ctx, grad_weight, grad_bias)
        if weight is not None:
            del y
            shape, x_dtype = ctx.geometry
            grad_x, grad_params = _explicit_grads(
                synapse, kept, shape, x_dtype, grad_y, weight, needs_x, params_need
            )
        else:
            grad_x, grad_params = _autograd_grads(ctx, x, y, grad_y, needs_x, params_need)
        grads = (grad_x, None, grad_weight, grad_bias, grad_learnable, grad_residual)
        return None, None, *grads, *grad_params


def _recomputed(
    synapse: Synapse,
    kept: Compact,
    repeat: int,
    autocast: contextlib.AbstractContextManager[Any],
    weight: Tensor | None,
    needs_x: bool,
) -> tuple[Tensor | None, Tensor]:
    """(x or None, y): the synapse output recomputed in one call, as forward made it (the same
    shapes give the same convolution algorithm and so the same y to the bit; in chunks, cuDNN
    may pick another algorithm and round differently, and a potential on the threshold would
    then spike in one pass and not in the other). ``weight``: the weight cast for an explicit
    backward (:meth:`~.synapse.Synapse.weight_in`); None: autograd records the recomputation
    (which keeps x)."""
    if weight is not None:
        with torch.no_grad(), autocast:  # the unpacked input freed here
            return None, synapse.kept(expand(kept), repeat, weight)
    with torch.enable_grad(), autocast:
        x = expand(kept).detach().requires_grad_(needs_x)
        return x, synapse.kept(x, repeat)


def _autograd_grads(
    ctx: Any,
    x: Tensor | None,
    y: Tensor,
    grad_y: Tensor,
    needs_x: bool,
    params_need: tuple[bool, ...],
) -> tuple[Tensor | None, list[Tensor | None]]:
    """dL/dx and the synapse parameters' gradients through the recomputed graph."""
    # y is only the root of the graph below: a Conv's or Linear's backward reads x and the
    # weights, never y's values; free it before that backward allocates dL/dx.
    y.untyped_storage().resize_(0)
    candidates = zip([x, *ctx.synapse_params], [needs_x, *params_need], strict=True)
    wanted = [t for t, need in candidates if need]
    grads = iter(torch.autograd.grad(y, wanted, grad_y) if wanted else ())
    grad_x = next(grads) if needs_x else None
    return grad_x, [next(grads) if need else None for need in params_need]


def _explicit_grads(
    synapse: Synapse,
    kept: Compact,
    shape: torch.Size,
    x_dtype: torch.dtype,
    grad_y: Tensor,
    weight: Tensor,
    needs_x: bool,
    params_need: tuple[bool, ...],
) -> tuple[Tensor | None, list[Tensor | None]]:
    """dL/dx and the synapse parameters' gradients in the dtype of ``weight`` (the weight in
    the forward's autocast dtype, else its own), weight gradient first: the input is restored
    (unpacked) for it alone and freed before dL/dx is allocated. dL/dy is [1, B, ...] for an
    input repeated over time (its steps' gradients summed), else [T, B, ...]."""
    has_bias = len(params_need) > 1
    grad_w: Tensor | None = None
    grad_b: Tensor | None = None
    if any(params_need):  # both gradients in one call (a bias gradient alone is rare)
        x = expand(kept)
        if grad_y.shape[0] == 1 or repeated_over_time(x):  # one step's input, steps summed
            x_merged, g_merged = synapse.merged(x[:1]), grad_y.sum(0)
        else:
            x_merged, g_merged = synapse.merged(x), grad_y.flatten(0, 1)
        del x
        grad_w, grad_b = synapse.param_grads(
            x_merged, g_merged, weight, has_bias and params_need[1]
        )
        del x_merged, g_merged
    grad_x = None
    if needs_x:  # never for an input repeated over time (it needs no gradient)
        merged_shape = torch.Size((shape[0] * shape[1], *shape[2:]))
        merged_x = synapse.input_grad(merged_shape, grad_y.flatten(0, 1), weight)
        grad_x = merged_x.unflatten(0, shape[:2]).to(x_dtype)
    grad_w = grad_w if params_need[0] else None
    return grad_x, [grad_w, *([grad_b] if has_bias else [])]
