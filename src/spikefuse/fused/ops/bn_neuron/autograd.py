"""The BN → neuron (→ pool) (+ residual) op as an autograd Function with one argument record.

:class:`BNNeuronArgs` holds everything the op takes besides the tensors autograd tracks (y,
BatchNorm's gamma and beta, the neuron's learnable values, a residual); the fused blocks build
one per call and hand it to :class:`BNNeuronFunction` (and the minimal-memory Functions, which
reuse its context helpers: :func:`save_bn_context`, :func:`load_bn_context`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ....ops import forbid_double_backward
from ...neuron_call import Kept, NeuronCall
from ...recompute import Compact, expand, join, split
from ...statistics import BNSpec, BNStats
from ..spike_max_pool.geometry import MaxPoolGeometry
from .passes import bn_neuron_forward, bn_neuron_grads, repeated


@dataclass(frozen=True, slots=True)
class BNNeuronArgs:
    """What one call of the op takes besides its autograd-tracked tensors.

    ``stats``: the per-channel vectors (:func:`~spikefuse.fused.statistics.bn_statistics`;
    None: no BatchNorm); ``bn``: BatchNorm's side of the call (its process group and whether
    statistics come from the batch); ``pool`` = k > 1 (where :func:`~.passes.kernel_pool`
    says): the spikes averaged over k x k windows; ``repeat`` = T > 1: y is one step
    [1, B, C, *] that each of T steps repeats (an input image's synapse output: the op runs on
    the view y.expand(T, ...), keeps only the one step, and y's gradient is the sum of the
    steps'); ``save``: a backward will follow (keep the neuron's checkpoints);
    ``kept_residual``: what backward keeps of the residual (itself, or its 1-bit packing when
    it is spikes: :func:`~spikefuse.fused.recompute.compact`); ``input_pool``: the max pooling
    of the BN output before the neuron (:func:`~.passes.input_pooled`; None: none).
    """

    neuron: NeuronCall
    stats: BNStats | None
    bn: BNSpec | None
    pool: int = 1
    repeat: int = 1
    save: bool = True
    kept_residual: Compact | None = None
    input_pool: MaxPoolGeometry | None = None


def _as_dtype(grad: Tensor | None, dtype: torch.dtype | None) -> Tensor | None:
    if grad is None or dtype is None:
        return None
    return grad if grad.dtype == dtype else grad.to(dtype)


def param_dtypes(*params: Tensor | None) -> tuple[torch.dtype | None, ...]:
    """The parameters' dtypes (None for absent ones): what their gradients are cast to."""
    return tuple(None if p is None else p.dtype for p in params)


def save_bn_context(
    ctx: Any,
    first: Compact,
    learnable: Tensor | None,
    args: BNNeuronArgs,
    saved: Kept,
    params: tuple[Tensor | None, Tensor | None],
) -> None:
    """Keep for backward ``first`` (y, or what the synapse output is recomputed from, perhaps
    1-bit packed), the learnable values, the per-channel vectors, what the neuron's forward
    kept (``saved``) and ``args``' kept residual; ``params``: BatchNorm's (gamma, beta), whose
    dtypes the gradients take. See :func:`load_bn_context`. Every tensor goes through
    ``ctx.save_for_backward``, so an in-place edit of one before backward raises."""
    first_saved, ctx.first_packing = split(first)
    residual = args.kept_residual
    residual_saved, ctx.residual_packing = (None, None) if residual is None else split(residual)
    stats = args.stats
    vectors = () if stats is None else stats.vectors
    ctx.save_for_backward(first_saved, learnable, residual_saved, *vectors, *(saved or ()))
    ctx.kept = saved is not None
    ctx.count = None if stats is None else stats.count
    ctx.neuron, ctx.bn, ctx.input_pool = args.neuron, args.bn, args.input_pool
    ctx.param_dtypes = param_dtypes(*params)


def load_bn_context(
    ctx: Any,
) -> tuple[Compact, Tensor | None, BNStats | None, Kept, Compact | None]:
    """(first, learnable, stats, saved, residual) as :func:`save_bn_context` kept them."""
    first, learnable, residual, *rest = ctx.saved_tensors
    stats = None
    if ctx.count is not None:
        stats = BNStats(rest[0], rest[1], rest[2], rest[3], ctx.count)
        rest = rest[4:]
    kept_residual = None if residual is None else join(residual, ctx.residual_packing)
    saved = (rest[0],) if ctx.kept else None
    return join(first, ctx.first_packing), learnable, stats, saved, kept_residual


def bn_param_grads(
    ctx: Any, grad_weight: Tensor | None, grad_bias: Tensor | None
) -> tuple[Tensor | None, Tensor | None]:
    """BatchNorm's gamma/beta gradients in the parameters' dtypes."""
    weight_dtype, bias_dtype = ctx.param_dtypes
    return _as_dtype(grad_weight, weight_dtype), _as_dtype(grad_bias, bias_dtype)


class BNNeuronFunction(torch.autograd.Function):
    """spikes = neuron(BN(y) [+ residual]) (pooled where ``args.pool`` > 1); saves y and the
    per-channel vectors only (see :mod:`.passes`), and a residual as ``args.kept_residual``.

    ``apply(args, y, weight, bias, learnable, residual)`` returns ``(spikes, packed)``, packed
    being the pooled spikes' packing where a backward will follow (``args.save``) and the
    BN-folded kernels write it (else None; see :func:`~.passes.bn_neuron_forward`).
    ``weight``/``bias`` are BN's gamma/beta (or None), inputs so that autograd tracks them
    (``args.stats`` already holds their values); ``residual``: a tensor like y added to the BN
    output (None: none).
    """

    @staticmethod
    def forward(
        ctx: Any,
        args: BNNeuronArgs,
        y: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        learnable: Tensor | None,
        residual: Tensor | None,
    ) -> tuple[Tensor, Tensor | None]:
        spikes, saved, packed = bn_neuron_forward(
            repeated(y, args.repeat),
            args.stats,
            args.neuron,
            learnable,
            args.save,
            args.pool,
            residual,
            pack_spikes=args.save,
            input_pool=args.input_pool,
        )
        save_bn_context(ctx, y, learnable, args, saved, (weight, bias))
        ctx.pool, ctx.repeat = args.pool, args.repeat
        # no zeros made in backward for the packing's gradient (it has none): autograd would
        # allocate them like the packing, at the peak of memory
        ctx.set_materialize_grads(False)
        return spikes, packed

    @staticmethod
    def backward(ctx: Any, grad_spikes: Tensor | None, _: None) -> tuple[Tensor | None, ...]:
        forbid_double_backward("a fused block (BNNeuronFunction)")
        if grad_spikes is None:  # the spikes did not reach what backward started from
            return (None,) * len(ctx.needs_input_grad)
        kept_y, learnable, stats, saved, kept_residual = load_bn_context(ctx)
        y = expand(kept_y)  # y itself: it is never packed
        residual = None if kept_residual is None else expand(kept_residual)
        grad_y, grad_weight, grad_bias, grad_learnable, grad_residual = bn_neuron_grads(
            repeated(y, ctx.repeat),
            stats,
            ctx.bn,
            ctx.neuron,
            learnable,
            grad_spikes,
            saved,
            ctx.needs_input_grad[2:5],
            ctx.pool,
            residual,
            input_pool=ctx.input_pool,
        )
        grad_weight, grad_bias = bn_param_grads(ctx, grad_weight, grad_bias)
        return None, grad_y, grad_weight, grad_bias, grad_learnable, grad_residual
