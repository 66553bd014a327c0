"""BatchNorm → neuron of a fused block as two ``torch.library`` ops, for ``torch.compile``.

Eager fused blocks run :class:`~.autograd.BNNeuronFunction`; the compiler cannot
trace an ``autograd.Function`` that takes Python objects (the statistics, the neuron call), so a
compiled block calls these ops instead: the same functions behind them (BN-folded kernels with
the cuda backend, torch composites with the torch backend), opaque to the compiler and with
their backward registered, so a compiled fused model runs the fused kernels and keeps, like
the eager block, only the synapse output and per-channel vectors for this part's backward.

``bn_neuron_fptt(y, mean, invstd, weight, bias, learnable, ...) -> (spikes, checkpoints)``:
spikes = neuron(y * scale[c] + shift[c]) with ``mean``/``invstd`` the statistics the block
normalised with (computed without autograd, as in eager; BatchNorm's gradient through them is
in the backward formula); ``checkpoints`` is what the neuron's forward keeps (the cuda kernels'
chunk-end potentials; empty when nothing is kept). ``bn_neuron_bptt`` returns
(dL/dy, dL/dgamma, dL/dbeta, dL/dlearnable), empty for absent inputs.

``pool`` = k > 1 (a block that pools its spikes over k x k windows): ``bn_neuron_fptt`` returns
the spikes averaged over those windows [T, B, C, H/k, W/k], and ``bn_neuron_bptt`` takes their
gradient. The BN-folded kernels pool where they can (:func:`~.passes.kernel_pool`), as in
eager: the full spike map and its gradient are never written. Elsewhere (the torch backend, H or
W not a multiple of k) the op pools the full spikes itself, with the same result.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F

from ....backends import affine_kernels, compute_dtype
from ....ops import forbid_double_backward, register_op_pair
from ....program import lookup
from ...neuron_call import Kept, NeuronCall
from ...spike_bits import empty_in_order, strides_in_order
from ...statistics import BNSpec, BNStats
from .passes import bn_neuron_forward, bn_neuron_grads, kernel_pool

_LIB = torch.library.Library("spikefuse", "FRAGMENT")
_ARGS = (
    "Tensor y, Tensor mean, Tensor invstd, Tensor? weight, Tensor? bias, Tensor? learnable, "
    "str program, str backend, float[] constants, float v_init, int count, int pool"
)
_LIB.define(f"bn_neuron_fptt({_ARGS}, bool save) -> (Tensor, Tensor)")
_LIB.define(
    f"bn_neuron_bptt({_ARGS}, Tensor grad_spikes, Tensor checkpoints) "
    "-> (Tensor, Tensor, Tensor, Tensor)"
)


def _call(
    y: Tensor,
    mean: Tensor,
    invstd: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    program: str,
    backend: str,
    constants: list[float],
    v_init: float,
    count: int,
) -> tuple[BNStats, NeuronCall]:
    """The eager block's statistics and neuron call (``count`` 0: running statistics)."""
    cd = compute_dtype(y.dtype)
    weight = None if weight is None else weight.to(cd)
    bias = None if bias is None else bias.to(cd)
    stats = BNStats(mean, invstd, weight, bias, count)
    return stats, NeuronCall(lookup(program), backend, constants, v_init)


def _empty(like: Tensor) -> Tensor:
    return like.new_empty(0)


def _pooled_shape(y: Tensor, pool: int) -> tuple[int, ...]:
    """[T, B, C, H/pool, W/pool] of y [T, B, C, H, W]."""
    return (*y.shape[:3], y.shape[3] // pool, y.shape[4] // pool)


def _spikes_like(y: Tensor, pool: int) -> Tensor:
    """Uninitialised spikes of y [T, B, C, *] in y's dtype and dimension order in memory,
    averaged over ``pool`` x ``pool`` windows where ``pool`` > 1: the layout the fake promises
    (the pooling kernels' too: channels innermost for a channels-last y)."""
    if pool == 1:
        return torch.empty_like(y)
    return empty_in_order(y, _pooled_shape(y, pool))


def bn_neuron_fptt(
    y: Tensor,
    mean: Tensor,
    invstd: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    learnable: Tensor | None,
    program: str,
    backend: str,
    constants: list[float],
    v_init: float,
    count: int,
    pool: int,
    save: bool,
) -> tuple[Tensor, Tensor]:
    stats, neuron = _call(y, mean, invstd, weight, bias, program, backend, constants, v_init, count)
    window = kernel_pool(y, stats, neuron, pool)
    spikes, kept, _ = bn_neuron_forward(y, stats, neuron, learnable, save, window)
    if window < pool:  # the full spikes, pooled here
        spikes = F.avg_pool2d(spikes.flatten(0, 1), pool).unflatten(0, spikes.shape[:2])
    promised = y.stride() if pool == 1 else strides_in_order(y, _pooled_shape(y, pool))
    if spikes.stride() != promised:  # the layout the fake promises
        spikes = _spikes_like(y, pool).copy_(spikes)
    checkpoints = kept[0] if kept is not None else None
    return spikes, _empty(y) if checkpoints is None else checkpoints


def _bn_neuron_fptt_fake(
    y: Tensor,
    mean: Tensor,
    invstd: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    learnable: Tensor | None,
    program: str,
    backend: str,
    *config: Any,
) -> tuple[Tensor, Tensor]:
    """Shapes of :func:`bn_neuron_fptt` (``config``: constants, v_init, count, pool, save)."""
    pool, save = config[-2:]
    affine = affine_kernels(backend)
    checkpoints = None
    if affine is not None:
        checkpoints = affine.affine_saved_like(lookup(program), y, save)
    return _spikes_like(y, pool), _empty(y) if checkpoints is None else checkpoints


def bn_neuron_bptt(
    y: Tensor,
    mean: Tensor,
    invstd: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    learnable: Tensor | None,
    program: str,
    backend: str,
    constants: list[float],
    v_init: float,
    count: int,
    pool: int,
    grad_spikes: Tensor,
    checkpoints: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    stats, neuron = _call(y, mean, invstd, weight, bias, program, backend, constants, v_init, count)
    window = kernel_pool(y, stats, neuron, pool)
    if window < pool:  # the full spikes' gradient (the pooling's backward)
        grad_spikes = torch.ops.aten.avg_pool2d_backward(
            grad_spikes.flatten(0, 1), y.flatten(0, 1), [pool], [pool], [0], False, True, None
        ).unflatten(0, y.shape[:2])
    saved: Kept = None  # the torch backend kept nothing: backward recomputes the neuron
    if neuron.affine is not None:
        saved = (checkpoints if checkpoints.numel() else None,)
    bn = BNSpec(
        weight=weight,
        bias=bias,
        running_mean=None,
        running_var=None,
        batch_stats=count > 0,
        momentum=None,
        eps=0.0,
        group=None,  # compiled fused blocks refuse torch.distributed (FusedBlock._traced_forward)
    )
    needs = (weight is not None, bias is not None, learnable is not None)
    grads = bn_neuron_grads(y, stats, bn, neuron, learnable, grad_spikes, saved, needs, window)
    grad_y, grad_weight, grad_bias, grad_learnable, _ = grads
    return (
        grad_y,
        _empty(y) if grad_weight is None or weight is None else grad_weight.to(weight.dtype),
        _empty(y) if grad_bias is None or bias is None else grad_bias.to(bias.dtype),
        _empty(y) if grad_learnable is None or learnable is None else grad_learnable,
    )


def _bn_neuron_bptt_fake(
    y: Tensor,
    mean: Tensor,
    invstd: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    learnable: Tensor | None,
    *config_and_grads: Any,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Shapes of :func:`bn_neuron_bptt`: like its inputs."""
    return (
        torch.empty_like(y),
        _empty(y) if weight is None else torch.empty_like(weight),
        _empty(y) if bias is None else torch.empty_like(bias),
        _empty(y) if learnable is None else torch.empty_like(learnable),
    )


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    y, mean, invstd, weight, bias, learnable, *config, save = inputs
    if not save:
        raise RuntimeError("spikefuse: bn_neuron_fptt saved nothing for a backward")
    ctx.config = config  # program, backend, constants, v_init, count, pool
    ctx.save_for_backward(y, mean, invstd, weight, bias, learnable, output[1])


def _backward(ctx: Any, grad_spikes: Tensor, _grad_checkpoints: Tensor) -> tuple[Any, ...]:
    forbid_double_backward("a fused block (bn_neuron_fptt)")
    y, mean, invstd, weight, bias, learnable, checkpoints = ctx.saved_tensors
    grad_y, grad_weight, grad_bias, grad_learnable = torch.ops.spikefuse.bn_neuron_bptt.default(
        y, mean, invstd, weight, bias, learnable, *ctx.config, grad_spikes, checkpoints
    )
    return (
        grad_y,
        None,
        None,
        None if weight is None else grad_weight,
        None if bias is None else grad_bias,
        None if learnable is None else grad_learnable,
        *(None,) * 7,  # program, backend, constants, v_init, count, pool, save
    )


register_op_pair(
    _LIB,
    (bn_neuron_fptt, _bn_neuron_fptt_fake),
    (bn_neuron_bptt, _bn_neuron_bptt_fake),
    (_backward, _setup_context),
)


def traced_bn_neuron(
    y: Tensor,
    stats: BNStats,
    bn: BNSpec,
    neuron: NeuronCall,
    learnable: Tensor | None,
    pool: int = 1,
) -> Tensor:
    """Spikes of a compiled fused block: :func:`bn_neuron_fptt` through its op (the
    arguments as :class:`~.autograd.BNNeuronArgs` holds them), averaged
    over ``pool`` x ``pool`` windows where ``pool`` > 1."""
    assert isinstance(stats.count, int)  # compiled blocks refuse torch.distributed
    spikes, _ = torch.ops.spikefuse.bn_neuron_fptt.default(
        y,
        stats.mean,
        stats.invstd,
        bn.weight,
        bn.bias,
        learnable,
        neuron.program.key,
        neuron.backend,
        neuron.constants,
        neuron.v_init,
        stats.count,
        pool,
        torch.is_grad_enabled(),
    )
    return spikes
