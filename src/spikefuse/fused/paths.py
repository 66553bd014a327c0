"""A fused block's call paths, each one straight line from the input to the output.

:meth:`FusedBlock.forward <spikefuse.fused.FusedBlock.forward>` checks its input, asks its memory
policy (:mod:`.memory`) for a :class:`Plan` and runs the plan's path:

- :func:`default_path`: keep the synapse output y (the DATE'22 blocks);
- :func:`min_memory_path`: keep only the input, recompute y in backward (:mod:`.low_memory`);
- :func:`chunked_path`: the same in equal batch chunks (:mod:`.chunked`);
- :func:`traced_path`: what ``torch.compile`` traces (the op of :mod:`.ops.bn_neuron.library`).

Every path returns the block's output tagged for the next layer (:func:`finish`): as spikes, or
means of k x k spikes where the block pools, with a recipe or the kernels' packing that lets
the next layer recompute it in backward instead of saving it (:mod:`.recompute`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..backends import compute_dtype
from ..errors import SpikefuseError
from ..neuron import BaseNode
from ..ops import run_neuron
from .chunked import ChunkedSynapseFunction, Chunking, LastChunk
from .low_memory import SynapseRecomputeFunction
from .neuron_call import NeuronCall
from .ops.bn_neuron import (
    BNNeuronArgs,
    BNNeuronFunction,
    bn_neuron_forward,
    kernel_pool,
    repeated,
    traced_bn_neuron,
)
from .pooling import WindowAvgPool
from .recompute import (
    Recipe,
    compact,
    expand,
    mark_means,
    mark_packed,
    mark_recomputable,
    mark_spikes,
)
from .spec import BN_FOR, BlockSpec
from .spike_bits import PackedSpikes
from .statistics import (
    BNSpec,
    BNStats,
    ChunkMoments,
    bn_statistics,
    bn_statistics_of_chunks,
    is_distributed,
)
from .synapse import Synapse


class Block(Protocol):
    """What the paths read of a fused block (:class:`~spikefuse.fused.FusedBlock`)."""

    spec: BlockSpec
    process_group: dist.ProcessGroup | None

    @property
    def bn(self) -> nn.modules.batchnorm._BatchNorm | None: ...
    @property
    def node(self) -> BaseNode: ...
    @property
    def pool(self) -> nn.AvgPool2d | None: ...
    @property
    def input_pool(self) -> nn.MaxPool2d | None: ...
    def synapse_op(self) -> Synapse: ...
    def checked_residual(self, residual: Tensor | None, y: Tensor) -> Tensor | None: ...
    def check_anomaly(self, y: Tensor) -> None: ...
    def prepare(
        self, y: Tensor, statistics: bool = True
    ) -> tuple[NeuronCall, Tensor | None, BNSpec | None, BNStats | None]: ...
    def repeat_of(self, x: Tensor) -> int: ...


Path = Callable[[Block, Tensor, "Tensor | None", "Plan"], Tensor]


@dataclass(frozen=True)
class Plan:
    """A memory policy's answer for one call: the path to run, and for :func:`chunked_path`
    the batch slices of its chunks."""

    path: Path
    parts: tuple[slice, ...] = ()


def default_path(block: Block, x: Tensor, residual: Tensor | None, plan: Plan) -> Tensor:
    """Keep the synapse output (one step of it for an input repeated over time: the block reads
    it at every step, as y, its expanded view) and the per-channel vectors for backward."""
    synapse, repeat = block.synapse_op(), block.repeat_of(x)
    kept_y = synapse.step(x) if repeat > 1 else synapse.saving_input(x)
    y = repeated(kept_y, repeat)
    residual = block.checked_residual(residual, y)
    neuron, learnable, bn, stats = block.prepare(y)
    weight, bias = (None, None) if bn is None else (bn.weight, bn.bias)
    grads = (kept_y, weight, bias, learnable, residual)
    save = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in grads)
    pool = _kernel_pool(block, y, stats, neuron, residual)
    kept = None if residual is None or not save else compact(residual)
    input_pool = block.spec.input_pool
    args = BNNeuronArgs(neuron, stats, bn, pool, repeat, save, kept, input_pool)
    out, packed = BNNeuronFunction.apply(args, kept_y, weight, bias, learnable, residual)
    if not save:
        return finish(block, out, pool)
    if packed is not None:  # restored by unpacking (packed only where the kernels pooled)
        return finish(block, out, pool, packed)
    y, learnable = y.detach(), None if learnable is None else learnable.detach()

    def recipe() -> Tensor:  # the kernels' output, recomputed
        shortcut = None if kept is None else expand(kept)
        return bn_neuron_forward(
            y, stats, neuron, learnable, False, pool, shortcut, input_pool=input_pool
        )[0]

    return finish(block, mark_recomputable(out, recipe), pool, recipe=recipe)


def min_memory_path(block: Block, x: Tensor, residual: Tensor | None, plan: Plan) -> Tensor:
    """Keep only the input; y is computed without autograd here and recomputed in backward (of
    an input repeated over time, as in :func:`default_path`, only one step)."""
    synapse, repeat = block.synapse_op(), block.repeat_of(x)
    with torch.no_grad():
        kept_y = synapse.kept(x, repeat)
    y = repeated(kept_y, repeat)
    residual = block.checked_residual(residual, y)
    neuron, learnable, bn, stats = block.prepare(y)
    weight, bias = (None, None) if bn is None else (bn.weight, bn.bias)
    pool = _kernel_pool(block, y, stats, neuron, residual)
    kept = None if residual is None else compact(residual)
    args = BNNeuronArgs(neuron, stats, bn, pool, repeat, True, kept, block.spec.input_pool)
    params = synapse.params()
    spikes, packed = SynapseRecomputeFunction.apply(
        args, synapse, x, kept_y, weight, bias, learnable, residual, *params
    )
    # without bits the next layer keeps the spikes (packed where binary and 4 MiB or more)
    return finish(block, spikes, pool, packed)


def chunked_path(block: Block, x: Tensor, residual: Tensor | None, plan: Plan) -> Tensor:
    """:func:`min_memory_path` in equal batch chunks (``plan.parts``; blocks with BatchNorm, no
    residual): a first pass over the chunks takes the batch statistics (each chunk's y
    computed and dropped, but the last; with running statistics only the first chunk's y, for
    the block's setup), then the Function recomputes the others for the neuron."""
    synapse, steps, parts = block.synapse_op(), x.shape[0], plan.parts
    chunking = Chunking(parts, synapse.autocast_weight(x))
    with torch.no_grad():
        y = synapse.on_merged(synapse.merged_part(x, parts[0]), steps, chunking.weight)
    neuron, learnable, bn, stats = block.prepare(y, statistics=False)
    assert bn is not None  # chunked blocks have BatchNorm
    if bn.batch_stats:
        moments = ChunkMoments()
        moments.add(y)
        with torch.no_grad():
            for part in parts[1:]:
                del y  # before the next chunk's
                y = synapse.on_merged(synapse.merged_part(x, part), steps, chunking.weight)
                block.check_anomaly(y)
                moments.add(y)
        stats = bn_statistics_of_chunks(moments, bn, y)
    else:
        stats = bn_statistics(y, bn)
    pool = _kernel_pool(block, y, stats, neuron, None)
    # the chunk computed last starts the Function's pass: one synapse forward fewer
    last = LastChunk(len(parts) - 1 if bn.batch_stats else 0, y)
    del y
    args = BNNeuronArgs(neuron, stats, bn, pool)
    params = synapse.params()
    spikes, packed = ChunkedSynapseFunction.apply(
        args, synapse, chunking, last, x, bn.weight, bn.bias, learnable, *params
    )
    return finish(block, spikes, pool, packed)


def traced_path(block: Block, x: Tensor, residual: Tensor | None, plan: Plan) -> Tensor:
    """What ``torch.compile`` traces: the synapse, the eager block's statistics (and
    running-statistics update), then BatchNorm → neuron as the ``bn_neuron_fptt`` op (the
    BN-folded kernels with the cuda backend; opaque to the compiler, no graph break; its
    backward keeps only y and the per-channel vectors), which also pools where the block pools
    (in the kernels where they can, as in eager: no full spike map is written). Without
    BatchNorm, the neuron's own op. The eager path's recomputation of the next layer's input
    (autograd saved-tensor hooks) cannot be traced: compiled, the next synapse saves the spikes
    it reads."""
    if is_distributed(block.process_group):
        raise SpikefuseError(
            "FusedBlock: under torch.compile the fused BatchNorm is not synchronised across "
            "processes; run the fused model eagerly (or CUDA-graph it) under torch.distributed"
        )
    y = block.synapse_op()(x)  # as in eager: the same layout
    residual = block.checked_residual(residual, y)
    if residual is not None or block.input_pool is not None:  # torch's BatchNorm (it updates
        # the running statistics), and pooling
        normed = y.flatten(0, 1)
        if block.bn is not None:
            normed = BN_FOR[block.spec.kind].forward(block.bn, normed)
        if block.input_pool is not None:
            normed = nn.MaxPool2d.forward(block.input_pool, normed)
        normed = normed.unflatten(0, x.shape[:2])
        if residual is not None:
            normed = normed + residual
        return _traced_neuron(block, normed).to(y.dtype)  # as eager: y's dtype
    neuron, learnable, bn, stats = block.prepare(y)
    if bn is not None and stats is not None:  # the eager block's functions, as ops (the op
        # pools: with the kernels where they can, which the compiler cannot trace)
        return traced_bn_neuron(y, stats, bn, neuron, learnable, block.spec.window)
    return _traced_neuron(block, y, neuron, learnable)


def _traced_neuron(
    block: Block, x: Tensor, neuron: NeuronCall | None = None, learnable: Tensor | None = None
) -> Tensor:
    """The neuron's own op on x (no BatchNorm left), pooled where the block pools."""
    if neuron is None:
        neuron = NeuronCall.from_node(block.node, x)
        learnable = block.node.learnable_values(x.device, compute_dtype(x.dtype))
    spikes, _, _, _ = run_neuron(
        program=neuron.program,
        backend=neuron.backend,
        x_seq=x,
        v0=None,
        w0=None,
        learnable=learnable,
        constants=neuron.constants,
        init=[neuron.v_init, 0.0],  # every call starts from the reset state, as in eager
        store_v_seq=False,
    )
    return _pooled(block, spikes, 1)


def _kernel_pool(
    block: Block, y: Tensor, stats: BNStats | None, neuron: NeuronCall, residual: Tensor | None
) -> int:
    """The window the kernels pool the spikes over: the block's, where they can pool
    themselves (:func:`kernel_pool`), else 1 (the block pools the full spikes)."""
    if block.spec.pool is None or residual is not None:
        return 1
    return kernel_pool(y, stats, neuron, block.spec.window)


def finish(
    block: Block,
    out: Tensor,
    pool: int,
    packed: Tensor | None = None,
    recipe: Recipe | None = None,
) -> Tensor:
    """The block's output from the neuron's ``out``: pooled with torch ops where the block
    pools and the kernels did not (``pool`` 1), with the pooling of ``recipe`` (out's recipe)
    as its recipe; tagged with ``packed`` where the pooling kernels packed it (the spikes
    behind each mean: unpacking it is then the output's recipe, and a min-memory block keeps
    it as its input instead of the map, :func:`~.recompute.compact`); and tagged as binary
    spikes, or as the means of k x k spikes where the block pools."""
    if packed is not None:
        out = mark_packed(out, PackedSpikes.written(packed, out, pool * pool))
    out = _pooled(block, out, pool, recipe)
    spec = block.spec.pool
    return mark_spikes(out) if spec is None else mark_means(out, spec.means_window)


def _pooled(block: Block, out: Tensor, kernel_pool: int, recipe: Recipe | None = None) -> Tensor:
    """``out`` as it is, or where the block pools and the kernels did not (``kernel_pool`` 1),
    the pooling of the full spikes with torch ops, tagged with the pooling of ``recipe``."""
    if block.spec.pool is None or kernel_pool > 1:
        return out
    pooled = _pool_merged(block, out.flatten(0, 1))
    if recipe is not None:  # views of the merged map (this unflatten, a flatten) read its tag
        mark_recomputable(pooled, lambda: _pool_merged(block, recipe().flatten(0, 1)))
    return pooled.unflatten(0, out.shape[:2])


def _pool_merged(block: Block, merged: Tensor) -> Tensor:
    """The block's pooling of full spikes [T*B, C, H, W] with torch ops."""
    assert block.pool is not None  # called for pooling blocks only
    if torch.compiler.is_compiling():  # the compiler generates its own kernels
        return nn.AvgPool2d.forward(block.pool, merged)
    window = block.spec.window
    return WindowAvgPool.apply(merged, window, window)


DEFAULT_PLAN = Plan(default_path)
MIN_MEMORY_PLAN = Plan(min_memory_path)
TRACED_PLAN = Plan(traced_path)
