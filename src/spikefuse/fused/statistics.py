"""BatchNorm's per-channel statistics for the fused blocks, synchronised across processes.

The batch statistics of the synapse output ``y`` [T, B, C, *spatial] over every dimension but C
(tdBN), all-reduced across processes when torch.distributed is initialised (so N processes with
batch B normalise like one with batch N·B), the running-statistics update, and the all-reduce
of backward's per-channel sums.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from torch import Tensor

from ..backends import (
    ChannelStatsKernels,
    capability,
    channels_innermost,
    compute_dtype,
    repeats_one_step,
)
from ..errors import SpikefuseError
from .device_constants import device_constant

# BatchNorm's running statistics a training call updates: (running_mean, running_var,
# num_batches_tracked, momentum), see spikefuse.cuda.channel_stats.channel_stats
RunningStats = tuple[Tensor, Tensor, Tensor, "float | None"]


@dataclass(frozen=True)
class BNStats:
    """Per-channel vectors [C] (compute dtype) of one BatchNorm call: x = y * scale + shift with
    scale = invstd * weight and shift = bias - mean * scale.

    ``weight``/``bias`` are gamma/beta in the compute dtype (None: 1 and 0). ``count`` is the
    number of elements per channel the statistics were taken over (all processes; a 0-dim
    tensor when distributed), 0 for running statistics.
    """

    mean: Tensor
    invstd: Tensor
    weight: Tensor | None
    bias: Tensor | None
    count: int | Tensor

    @property
    def scale(self) -> Tensor:
        return self.invstd if self.weight is None else self.invstd * self.weight

    def shift(self, scale: Tensor) -> Tensor:
        shift = -self.mean * scale
        return shift if self.bias is None else shift + self.bias

    @property
    def vectors(self) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        """(mean, invstd, weight, bias): what the channel-affine kernels read."""
        return self.mean, self.invstd, self.weight, self.bias


@dataclass
class BNSpec:
    """The BatchNorm side of a fused call (None weight/bias: affine=False).

    ``batch_stats`` says whether statistics come from the batch (training, or no running
    statistics) or from ``running_mean``/``running_var``. ``num_batches_tracked`` is given when
    this call updates the running statistics (training with tracked statistics): the call adds
    1 to it, then averages with factor ``momentum``, or 1 / num_batches_tracked when
    ``momentum`` is None (torch's cumulative average; on the device, no host sync).
    """

    weight: Tensor | None
    bias: Tensor | None
    running_mean: Tensor | None
    running_var: Tensor | None
    batch_stats: bool
    momentum: float | None
    eps: float
    group: dist.ProcessGroup | None = None
    num_batches_tracked: Tensor | None = None


def reduce_dims(ndim: int) -> list[int]:
    """The dimensions of a [T, B, C, *spatial] tensor that per-channel statistics sum over."""
    return [0, 1, *range(3, ndim)]


def is_distributed(group: dist.ProcessGroup | None) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def rows_by_channel(y: Tensor) -> Tensor | None:
    """y [T, B, C, *S] as the [rows, C] matrix its memory is, when channels are innermost and
    the rows dense (a channels-last Conv2d output; a contiguous Linear output [T, B, C]); else
    None (e.g. a contiguous Conv1d output, whose channels are not innermost). A view: no copy."""
    if not channels_innermost(y.shape, y.stride()):
        return None
    rows, channels = math.prod((*y.shape[:2], *y.shape[3:])), y.shape[2]
    return y.as_strided((rows, channels), (channels, 1))  # one op (movedim + view: two)


def _channel_stats(y: Tensor) -> ChannelStatsKernels | None:
    """The statistics kernel of a backend that runs y (the ``channel_stats`` capability: the
    cuda backend's, imported on first use), or None."""
    return cast("ChannelStatsKernels | None", capability("channel_stats", y))


# Below this many elements the kernel's two launches cost more than torch's one.
_KERNEL_MIN_ELEMENTS = 1 << 21


def batch_mean_invstd(
    y: Tensor, eps: float, running: RunningStats | None = None
) -> tuple[Tensor, Tensor] | None:
    """Per-channel (mean, 1/sqrt(biased var + eps)) [C] float32 of CUDA y [T, B, C, *] with at
    least one value per channel, as ``torch.batch_norm_stats`` computes them; with ``running``,
    BatchNorm's running statistics are updated in the same launches, or None is returned and
    nothing is computed where that is not possible (the caller then updates them itself).

    Where channels are innermost (:func:`rows_by_channel`), y is large (``_KERNEL_MIN_ELEMENTS``)
    and a backend with the ``channel_stats`` capability runs y, that kernel (the cuda backend's)
    streams y at memory bandwidth, where torch's Welford kernel reaches a fraction of it. Every
    other layout, dtype, or a missing CuPy keeps
    ``torch.batch_norm_stats`` (Welford in float32, any layout) on the [T*B, C, *] view. Eager
    only: under ``torch.compile`` neither op traces (CuPy launches are opaque, and
    ``batch_norm_stats`` has no fake-tensor kernel), so the callers use ``torch.var_mean`` there.
    """
    rows = rows_by_channel(y)
    large = y.numel() >= _KERNEL_MIN_ELEMENTS
    kernels = _channel_stats(y) if large and rows is not None else None
    if kernels is not None and rows is not None:
        if running is None or running[0].dtype == running[1].dtype == torch.float32:
            return kernels.channel_stats(rows, eps, running)
    if running is not None:
        return None
    return torch.batch_norm_stats(y.flatten(0, 1), eps)


def one_step_if_repeated(y: Tensor) -> Tensor:
    """y [T, B, C, *S], or its first step [1, B, C, *S] when y repeats it over time (stride 0
    over T: an input image's synapse output at every step): the same per-channel mean and
    variance, from T times fewer elements. Counts stay those of y."""
    return y[:1] if repeats_one_step(y) else y


def _eager_cuda(y: Tensor) -> bool:
    """Whether y's statistics can use the CUDA-only ops (:func:`batch_mean_invstd`, torch's
    running update): a CUDA tensor, outside ``torch.compile`` tracing (there ``var_mean`` and
    ``lerp_`` trace, and inductor fuses the float32 cast into the reduction)."""
    return y.is_cuda and not torch.compiler.is_compiling()


def local_mean_var(y: Tensor) -> tuple[Tensor, Tensor]:
    """Per-channel mean and biased variance [C] of y [T, B, C, *] on this process, in the
    compute dtype, one pass."""
    mean, spread, is_invstd = _local_moments(y)
    return mean, _variance_of(spread) if is_invstd else spread


def _local_moments(y: Tensor) -> tuple[Tensor, Tensor, bool]:
    """(mean, spread, is_invstd) [C] of y: spread is the biased variance, or (``is_invstd``)
    1/sqrt of it, 0 where it is 0, as eager CUDA's statistics kernels give it: float32
    statistics of any storage dtype and layout without a float32 copy of y."""
    if _eager_cuda(y):
        stats = batch_mean_invstd(y, 0.0)
        assert stats is not None  # computed whenever no running statistics are passed
        return stats[0], stats[1], True
    var, mean = torch.var_mean(y.to(compute_dtype(y.dtype)), dim=reduce_dims(y.dim()), correction=0)
    return mean, var, False


def _variance_of(invstd: Tensor) -> Tensor:
    """The biased variance of :func:`_local_moments`' 1/sqrt(var) (elementwise, any shape)."""
    return torch.where(invstd > 0, invstd.reciprocal().square(), 0.0)


class ChunkMoments:
    """The per-channel moments of a synapse output computed in equal batch chunks, gathered
    chunk by chunk (:meth:`add`) for :func:`bn_statistics_of_chunks`. Where the statistics
    kernels give 1/sqrt(var), the variances are taken once over all chunks (elementwise: the
    same values as chunk by chunk, in four launches instead of four per chunk)."""

    def __init__(self) -> None:
        self.means: list[Tensor] = []
        self.spreads: list[Tensor] = []
        self.is_invstd = False  # the same for every chunk: one device, one dtype

    def add(self, y: Tensor) -> None:
        """Take the moments of chunk y [T, b, C, *]."""
        mean, spread, self.is_invstd = _local_moments(y)
        self.means.append(mean)
        self.spreads.append(spread)

    def stacked(self) -> tuple[Tensor, Tensor]:
        """(means, biased variances) [chunks, C]."""
        spreads = torch.stack(self.spreads)
        return torch.stack(self.means), _variance_of(spreads) if self.is_invstd else spreads


def batch_stats(
    y: Tensor, group: dist.ProcessGroup | None = None
) -> tuple[Tensor, Tensor, int | Tensor]:
    """Per-channel (mean, biased var) over all dims but C, across processes; and the count n.

    Each process computes its local mean/var in one pass (:func:`reduce_moments` combines them).
    A process with no samples (n = 0) contributes zeros instead of the NaN moments of an empty
    tensor.
    """
    count = y.numel() // y.shape[2]
    if count == 0:  # no samples here: contribute nothing (n = 0) to the statistics of the rest
        mean = var = y.new_zeros(y.shape[2], dtype=compute_dtype(y.dtype))
    else:
        mean, var = local_mean_var(one_step_if_repeated(y))
    return reduce_moments(mean, var, count, group)


def reduce_moments(
    mean: Tensor, var: Tensor, count: int, group: dist.ProcessGroup | None
) -> tuple[Tensor, Tensor, int | Tensor]:
    """This process's per-channel (mean, biased var) of ``count`` values each, combined with the
    other processes' when distributed: they all-reduce (n·mean, n·(var + mean²), n) in float64,
    so recombining the moments loses nothing. Across processes n stays a 0-dim tensor: reading
    it on the host would stall the GPU stream."""
    if not is_distributed(group):
        return mean, var, count
    n = float(count)
    packed = torch.cat(
        [
            mean.double() * n,
            (var.double() + mean.double() ** 2) * n,
            mean.new_full((1,), n, dtype=torch.float64),
        ]
    )
    dist.all_reduce(packed, group=group)
    c = mean.numel()
    total = packed[-1]
    g_mean = packed[:c] / total
    g_var = (packed[c : 2 * c] / total - g_mean**2).clamp_(min=0)
    return g_mean.to(mean.dtype), g_var.to(mean.dtype), total


def refuse_join() -> None:
    """Raise inside a ``torch.distributed.algorithms.Join`` context that would let ranks run out
    of batches silently: the fused BatchNorm all-reduces (statistics in forward, sums in
    backward) are collectives that Join cannot shadow, so the remaining ranks would hang or
    pair them with other collectives. With ``throw_on_early_termination=True`` torch stops every
    rank once one runs out, before any fused block runs, which is safe.

    Reads the DDP module whose forward is running (PyTorch records it, with its join settings).
    """
    from torch.nn.parallel import DistributedDataParallel

    ddp = getattr(DistributedDataParallel, "_active_ddp_module", None)
    config = getattr(ddp, "_join_config", None)
    if config is not None and config.enable and not config.throw_on_early_termination:
        raise SpikefuseError(
            "fused blocks synchronise BatchNorm across processes with their own all-reduces, "
            "which torch.distributed.algorithms.Join cannot shadow for ranks that ran out of "
            "batches: give every rank the same number of batches (e.g. DistributedSampler("
            "drop_last=True)), use Join(..., throw_on_early_termination=True), or train unfused"
        )


def all_reduce_sums(sums: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """Sum a small per-channel tensor over processes, in place (no-op when not distributed)."""
    if is_distributed(group):
        dist.all_reduce(sums, group=group)
    return sums


def _count_tensor(count: int, like: Tensor) -> Tensor:
    """[count] for batch_norm_gather_stats_with_counts."""
    key = ("count", like.device, count, like.dtype)
    return device_constant(key, lambda: like.new_full((1,), float(count)))


def _check_count(count: int, y: Tensor) -> None:
    if count <= 1:
        raise SpikefuseError(
            f"BatchNorm in training needs more than 1 value per channel, got {count} "
            f"(input shape {tuple(y.shape)})"
        )


def _detached_as(t: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """t detached, in ``dtype`` (no cast op when it has it already)."""
    if t is None:
        return None
    return t.detach() if t.dtype == dtype else t.detach().to(dtype)


@torch.no_grad()
def bn_statistics(y: Tensor, bn: BNSpec) -> BNStats:
    """The per-channel vectors to normalise y with; updates the running statistics in training.

    No autograd here: BNNeuronFunction's backward carries the gradient through the statistics.
    On one CUDA process (eager) this is :func:`batch_mean_invstd`: two launches of the cuda
    backend's statistics kernel where channels are innermost and the map is large, which also
    count the batch and update the running statistics; else ``batch_norm_stats``, the counter's
    ``add_`` and ``batch_norm_gather_stats_with_counts`` (unbiased variance, torch's BatchNorm
    formula). Elsewhere (CPU, several processes, ``torch.compile``) ``var_mean`` and ``lerp_``.
    """
    cd = compute_dtype(y.dtype)
    weight, bias = _detached_as(bn.weight, cd), _detached_as(bn.bias, cd)
    running_mean, running_var, momentum = bn.running_mean, bn.running_var, bn.momentum
    if not bn.batch_stats:
        assert running_mean is not None and running_var is not None  # batch_stats=False: tracked
        mean, var = running_mean.to(cd), running_var.to(cd)
        return BNStats(mean, torch.rsqrt(var + bn.eps), weight, bias, 0)
    running: RunningStats | None = None  # what this call updates (training, tracked statistics)
    if bn.num_batches_tracked is not None and running_mean is not None and running_var is not None:
        running = (running_mean, running_var, bn.num_batches_tracked, momentum)
    if _eager_cuda(y) and not is_distributed(bn.group):
        local_count = y.numel() // y.shape[2]
        _check_count(local_count, y)
        source = one_step_if_repeated(y)
        # the statistics kernel updates the running statistics too, where it runs, with the
        # count of what it reads: not for a repeated y
        if running is not None and source is y:
            stats = batch_mean_invstd(y, bn.eps, running)
            if stats is not None:
                return BNStats(*stats, weight, bias, local_count)
        # torch's update op takes a float factor: the cumulative average (1 / count, a device
        # value) updates on the generic path below
        if running is None or momentum is not None:
            stats = batch_mean_invstd(source, bn.eps)
            assert stats is not None  # computed whenever no running statistics are passed
            mean, invstd = stats
            if running is not None and momentum is not None:
                running[2].add_(1)
                torch.batch_norm_gather_stats_with_counts(
                    source.flatten(0, 1),  # its dtype: the count is the argument below
                    mean[None],
                    invstd[None],
                    running[0],
                    running[1],
                    momentum,
                    bn.eps,
                    _count_tensor(local_count, mean),
                )
            return BNStats(mean, invstd, weight, bias, local_count)
    return _from_moments(*batch_stats(y, bn.group), bn, y)


@torch.no_grad()
def bn_statistics_of_chunks(moments: ChunkMoments, bn: BNSpec, y: Tensor) -> BNStats:
    """:func:`bn_statistics` of a synapse output computed in equal batch chunks, from each
    chunk's per-channel mean and biased variance (``moments``): the union's mean is the
    chunks' mean, its variance the mean of their variances plus the variance of their means.
    ``y`` is one chunk (its dtype and count per channel)."""
    means, variances = moments.stacked()
    mean = means.mean(0)
    var = variances.mean(0) + (means - mean).square().mean(0)
    count = means.shape[0] * (y.numel() // y.shape[2])
    return _from_moments(*reduce_moments(mean, var, count, bn.group), bn, y)


def _from_moments(mean: Tensor, var: Tensor, count: int | Tensor, bn: BNSpec, y: Tensor) -> BNStats:
    """BNStats of the batch moments (over all processes), updating the running statistics where
    this call tracks them (torch's rule: unbiased variance; momentum, or the cumulative average
    where it is None)."""
    cd = compute_dtype(y.dtype)
    weight, bias = _detached_as(bn.weight, cd), _detached_as(bn.bias, cd)
    running_mean, running_var, momentum = bn.running_mean, bn.running_var, bn.momentum
    if isinstance(count, int):
        _check_count(count, y)
    if bn.num_batches_tracked is not None and running_mean is not None and running_var is not None:
        tracked = bn.num_batches_tracked
        tracked.add_(1)
        # the cumulative average in the statistics' dtype (an int64 count would divide in float32)
        factor = 1.0 / tracked.to(running_mean.dtype) if momentum is None else momentum
        unbiased = var * (count / (count - 1))
        running_mean.lerp_(mean.to(running_mean.dtype), factor)
        running_var.lerp_(unbiased.to(running_var.dtype), factor)
    return BNStats(mean, torch.rsqrt(var + bn.eps), weight, bias, count)
