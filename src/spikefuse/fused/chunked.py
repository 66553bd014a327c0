"""The minimal-memory mode in equal batch chunks, for blocks whose synapse output is large.

A block whose y is large (:data:`CHUNKED_FROM`) runs :class:`ChunkedSynapseFunction` instead of
:class:`~.low_memory.SynapseRecomputeFunction` (BatchNorm and the neuron as there): forward needs
each chunk's y twice, once for the batch statistics and once for the neuron, and backward twice,
once per BN-folded pass (pass 2 needs pass 1's sums over the whole batch), then the chunk's weight
and input gradients. A pass starts with the chunk the pass before it ended with, whose y it is
handed (:class:`LastChunk`) instead of computing it: in K chunks, 4K - 2 chunk forwards a training
step, not 4K, at no more memory (that y would be recomputed in its place). Input spikes are packed
per chunk (a pooling kernel's packing of the input is kept whole and cut into the chunks' parts,
:func:`~.spike_bits.packing_part`); backward unpacks one chunk at a time. Only chunk-sized
temporaries are alive besides the block's output (forward) or its input gradient (backward), for
2 - 2/K more whole synapse forwards a training step than the unchunked minimal mode runs
(1 - 1/K with running statistics). Each chunk's y is computed by the same call on the same input
wherever it is computed, so backward sees forward's y to the bit; against the unchunked modes it
may differ by rounding (another batch size may get another convolution algorithm).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

from ..ops import forbid_double_backward
from .low_memory import (
    check_params_unmodified,
    forward_autocast,
    keep_autocast,
    keep_param_versions,
)
from .neuron_call import Kept
from .ops.bn_neuron.autograd import (
    BNNeuronArgs,
    bn_param_grads,
    load_bn_context,
    save_bn_context,
)
from .ops.bn_neuron.passes import (
    batch_totals,
    bn_affine_grads,
    bn_input_grad,
    bn_neuron_backward,
    bn_neuron_forward,
)
from .recompute import Compact, compact, expand, is_spikes, packing_of
from .spike_bits import (
    PackedSpikes,
    batch_chunk_rows,
    can_cut,
    empty_in_order,
    joined_batch_chunks,
    memory_order,
    pack_bits,
    packed_bytes,
    packing_part,
)
from .statistics import BNStats
from .synapse import Synapse

#: memory="min" runs a block whose synapse output y takes at least CHUNKED_FROM bytes in equal
#: batch chunks of at most CHUNK_BYTES each (see :func:`batch_chunks`). A network's peak is at
#: its largest maps, and each chunked block pays 2 - 2/K more synapse forwards per step in K
#: chunks (and host and launch time per chunk), so only the large maps are chunked, in few
#: chunks: of 128 MiB, a quarter of the 224² ResNet stem's output at T·B = 128, whose backward
#: then holds a quarter of what unchunked would. Smaller chunks cut the peak a little more (a
#: sixteenth of the stem's output at 48 MiB) at up to twice the step time of the eager loop
#: (see docs/fused.md).
CHUNKED_FROM = 256 << 20
CHUNK_BYTES = 128 << 20


def batch_chunks(batch: int, y_bytes: int) -> int:
    """How many equal chunks a batch of ``batch`` samples whose synapse output takes
    ``y_bytes`` runs in: 1 below :data:`CHUNKED_FROM`, else the fewest that divide the batch
    and bring a chunk's output within :data:`CHUNK_BYTES` (one sample each where none does)."""
    if y_bytes < CHUNKED_FROM:
        return 1
    fitting = (k for k in range(2, batch + 1) if batch % k == 0 and y_bytes <= k * CHUNK_BYTES)
    return next(fitting, batch)


def batch_parts(batch: int, chunks: int) -> list[slice]:
    """The ``chunks`` equal slices of a batch dimension of ``batch`` samples."""
    size = batch // chunks
    return [slice(i * size, (i + 1) * size) for i in range(chunks)]


def empty_batch(like: Tensor, batch: int, dtype: torch.dtype | None = None) -> Tensor:
    """An uninitialised [T, batch, ...] tensor with the layout of the chunk ``like``
    [T, b, ...] (its dimension order in memory), for the chunks to be copied into."""
    return empty_in_order(like, (like.shape[0], batch, *like.shape[2:]), dtype)


def dense_part(t: Tensor, part: slice) -> Tensor:
    """t[:, part] as a dense tensor with t's dimension order in memory (one copy)."""
    src = t[:, part]
    return empty_batch(src, src.shape[1]).copy_(src)


class LastChunk:
    """The chunk whose y was made last before a pass over the chunks (by the statistics pass,
    else the block's setup; in backward by pass 1, with its part of dL/dspikes), handed over
    once (:meth:`take`) to that pass, which starts with that chunk instead of making them
    again. A holder, not a tensor argument: what it hands over is freed as soon as its taker
    drops it."""

    def __init__(self, index: int, *made: Tensor) -> None:
        self.index = index
        self._made: tuple[Tensor, ...] | None = made or None  # nothing made: nothing to take

    def order(self, chunks: int) -> list[int]:
        """The chunks in the order the next pass takes them: this one first."""
        return [self.index, *(c for c in range(chunks) if c != self.index)]

    def take(self, c: int) -> tuple[Tensor, ...] | None:
        """What was made for chunk c, the first time it is asked for (else None)."""
        if c != self.index or self._made is None:
            return None
        made, self._made = self._made, None
        return made


class _ChunkedForward:
    """Forward's chunks, gathered: the spikes, the neuron's checkpoints, the kernels' packings
    and, where x is tagged spikes, each chunk's input packed in a row of its own."""

    def __init__(self, x: Tensor, chunks: int) -> None:
        self.x, self.chunks = x, chunks
        self.spikes: Tensor | None = None
        self.checkpoints: Tensor | None = None
        self.rows: Tensor | None = None
        self.kept_any = False
        self.packings: list[Tensor | None] = [None] * chunks
        # tagged spikes (not a kernel's packing): each chunk's input packed as backward
        # unpacks it, into one row each of a [K, bytes] tensor
        self.per_chunk = packing_of(x) is None and is_spikes(x)
        self.packed_as: tuple[torch.Size, tuple[int, ...]] | None = None
        self.whole = False  # the rows were cut from one packing of x

    def input(self, c: int, merged: Tensor) -> None:
        """Pack chunk c's merged input (where it is spikes): at the first chunk taken, all
        chunks' rows at once from one packing of x where x's memory holds the chunks in the
        merged inputs' order (:func:`_rows_of_whole`), else each chunk's as it comes."""
        if not self.per_chunk:
            return
        if self.packed_as is None:
            self.packed_as = (merged.shape, memory_order(merged))
            self.rows = _rows_of_whole(self.x, self.chunks, self.packed_as[1])
            self.whole = self.rows is not None
        if not self.whole:
            self.rows = _packed_row(self.rows, merged, c, self.chunks)

    def output(self, c: int, part: slice, chunk: Tensor, saved: Kept, packed) -> None:
        if self.spikes is None:
            self.spikes = empty_batch(chunk, self.x.shape[1])
        self.spikes[:, part] = chunk
        self.kept_any = saved is not None  # the same for every chunk
        if saved is not None and saved[0] is not None:
            if self.checkpoints is None:
                self.checkpoints = saved[0].new_empty((self.chunks, *saved[0].shape))
            self.checkpoints[c] = saved[0]
        self.packings[c] = packed

    def kept(self) -> Compact:
        """What backward restores the input from."""
        if self.rows is not None and self.packed_as is not None:
            return PackedSpikes(self.rows, self.packed_as[0], self.x.dtype, self.packed_as[1])
        return compact(self.x)

    def packed(self) -> Tensor | None:
        if self.packings[0] is None:
            return None
        return joined_batch_chunks(cast(list[Tensor], self.packings), self.x.shape[0])


@dataclass(frozen=True)
class Chunking:
    """How a chunked call runs its synapse: the batch slices of its chunks
    (:func:`batch_parts`) and, under autocast, the synapse weight cast once to the autocast
    dtype (:meth:`~.synapse.Synapse.weight_in`) for every chunk's synapse call forward and
    backward, where autocast would cast it for each (None: autocast off)."""

    parts: tuple[slice, ...]
    weight: Tensor | None = None


class ChunkedSynapseFunction(torch.autograd.Function):
    """:class:`~.low_memory.SynapseRecomputeFunction` in equal batch chunks.

    ``apply(args, synapse, chunking, last, x, weight, bias, learnable, *synapse_params)``
    returns ``(spikes, packed)`` as :class:`~.ops.bn_neuron.BNNeuronFunction` does;
    ``chunking`` holds the batch slices (:class:`Chunking`), ``args.stats`` the batch
    statistics of the whole synapse output (the caller's first pass over the chunks), ``last``
    the y of the chunk the caller computed last (a :class:`LastChunk`). Kept for
    backward: where x is tagged spikes, each chunk's merged input packed at 1 bit per element
    (a row each), else x as :func:`compact` keeps it (a kernel's packing is cut into the
    chunks' parts in backward, :func:`~.spike_bits.packing_part`); and the neuron's checkpoints
    of every chunk.
    """

    @staticmethod
    def forward(ctx, args: BNNeuronArgs, synapse: Synapse, chunking: Chunking, last: LastChunk, x, weight, bias, learnable, *synapse_params):  # fmt: skip
        gathered = _ChunkedForward(x, len(chunking.parts))
        for c in last.order(len(chunking.parts)):
            y = _made_y(last.take(c))
            if y is None or gathered.per_chunk:
                merged = synapse.merged_part(x, chunking.parts[c])
                gathered.input(c, merged)
                if y is None:
                    y = synapse.on_merged(merged, x.shape[0], chunking.weight)
                del merged
            chunk, saved, packed = bn_neuron_forward(
                y, args.stats, args.neuron, learnable, True, args.pool, pack_spikes=True
            )
            del y
            gathered.output(c, chunking.parts[c], chunk, saved, packed)
            del chunk
        assert gathered.spikes is not None  # at least one part
        saved_all = (gathered.checkpoints,) if gathered.kept_any else None
        save_bn_context(ctx, gathered.kept(), learnable, args, saved_all, (weight, bias))
        keep_autocast(ctx, x)
        keep_param_versions(ctx, synapse_params)
        ctx.synapse, ctx.pool, ctx.chunking = synapse, args.pool, chunking
        ctx.per_chunk = gathered.rows is not None
        ctx.geometry = (x.shape, x.dtype)
        ctx.set_materialize_grads(False)  # as BNNeuronFunction: no zeros for the packing
        return gathered.spikes, gathered.packed()

    @staticmethod
    def backward(ctx, grad_spikes, _):
        forbid_double_backward("a fused block (memory='min')")
        if grad_spikes is None:  # the spikes did not reach what backward started from
            return (None,) * len(ctx.needs_input_grad)
        check_params_unmodified(ctx)
        kept, learnable, stats, saved, _ = load_bn_context(ctx)
        assert stats is not None  # chunked blocks have BatchNorm
        needs_x, params_need = ctx.needs_input_grad[4], ctx.needs_input_grad[8:]
        chunks = _ChunkedBackward(ctx, kept, saved)
        sums, grad_learnable = chunks.sums(stats, learnable, grad_spikes)
        grad_weight, grad_bias = bn_affine_grads(sums, stats, ctx.needs_input_grad[5:7])
        grad_weight, grad_bias = bn_param_grads(ctx, grad_weight, grad_bias)
        grad_x: Tensor | None = None
        grad_params: list[Tensor | None] = [None] * len(params_need)
        if needs_x or any(params_need):
            # once: all-reduced when distributed
            totals, inv_count = batch_totals(sums, stats, ctx.bn)

            def grad_y_of(c: int) -> Tensor:
                y, part = chunks.made(c, grad_spikes)
                return bn_input_grad(
                    None, y, stats, totals, inv_count, ctx.neuron, learnable, part, chunks.saved(c),
                    ctx.pool, overwrite_y=True,  # y is ours: dL/dy may take its memory
                )[0]  # fmt: skip

            grad_x, grad_params = _chunked_synapse_grads(chunks, grad_y_of, needs_x, params_need)
        grads = (grad_x, grad_weight, grad_bias, grad_learnable)
        return None, None, None, None, *grads, *grad_params


class _ChunkedBackward:
    """Backward's view of the chunks: each chunk's input and y, recomputed as forward made
    them, and what forward kept of its neuron."""

    def __init__(self, ctx: Any, kept: Compact, saved: Kept) -> None:
        self.ctx, self.kept, self.kept_neuron = ctx, kept, saved
        self.synapse: Synapse = ctx.synapse
        self.parts: tuple[slice, ...] = ctx.chunking.parts
        self.shape, self.x_dtype = ctx.geometry
        self.autocast, _ = forward_autocast(ctx)
        self.cast: Tensor | None = ctx.chunking.weight  # forward's cast of the weight
        # the weight the gradients are computed with: forward's cast, else the weight itself
        self.weight = self.synapse.weight_in(self.synapse.module.weight.dtype)
        if self.cast is not None:
            self.weight = self.cast
        self.whole: list[Tensor] = []  # x unpacked, where its packing cannot be cut
        # pass 1's last chunk: its y and part of dL/dspikes, for pass 2 to start with
        self.last = LastChunk(0)

    def input(self, c: int) -> Tensor:
        """Chunk c's merged input, as forward made it: from its row of packed chunks, or its
        part of x's packing (a copy of 1/K of it), else x itself (unpacked once)."""
        kept = self.kept
        if isinstance(kept, PackedSpikes) and self.ctx.per_chunk:
            row = kept.bits[c, : packed_bytes(kept.shape.numel())]
            return PackedSpikes(row, kept.shape, kept.dtype, kept.order).unpack()
        if isinstance(kept, PackedSpikes):
            part = packing_part(kept, c, len(self.parts))
            if part is not None:
                return self.synapse.merged_part(part.unpack(), slice(None))
            if not self.whole:
                self.whole.append(kept.unpack())
        source = self.whole[0] if self.whole else expand(kept)
        return self.synapse.merged_part(source, self.parts[c])

    def recomputed(self, c: int) -> Tensor:
        """Chunk c's y, as forward made it (its input freed before anything else is
        allocated: taken again where needed, it is cheaper than the memory)."""
        with torch.no_grad(), self.autocast:
            return self.synapse.on_merged(self.input(c), self.shape[0], self.cast)

    def made(self, c: int, grad_spikes: Tensor) -> tuple[Tensor, Tensor]:
        """Chunk c's y and its part of dL/dspikes (dense) for pass 2: pass 1's where c is
        the chunk it ended with, else made again."""
        made = self.last.take(c)
        if made is not None:
            return made[0], made[1]
        return self.recomputed(c), dense_part(grad_spikes, self.parts[c])

    def saved(self, c: int) -> Kept:
        """What forward kept of chunk c's neuron (see :meth:`NeuronCall.forward`)."""
        saved = self.kept_neuron
        if saved is None or saved[0] is None:
            return saved
        return (saved[0][c],)

    def sums(
        self, stats: BNStats, learnable: Tensor | None, grad_spikes: Tensor
    ) -> tuple[Tensor, Tensor | None]:
        """Pass 1 over the chunks: the per-channel sums over the batch, and dL/dlearnable."""
        sums, grad_learnable = None, None
        need_learnable = self.ctx.needs_input_grad[7]
        for c, part in enumerate(self.parts):
            y, grad_part = self.recomputed(c), dense_part(grad_spikes, part)
            _, chunk_sums, chunk_learnable = bn_neuron_backward(
                y, stats, self.ctx.neuron, learnable, grad_part, self.saved(c), self.ctx.pool
            )
            if c == len(self.parts) - 1:  # read, not written: pass 2 starts with them
                self.last = LastChunk(c, y, grad_part)
            del y, grad_part
            assert chunk_sums is not None  # BatchNorm
            sums = chunk_sums if sums is None else sums.add_(chunk_sums)
            if chunk_learnable is not None and need_learnable:
                grad_learnable = (
                    chunk_learnable if grad_learnable is None else grad_learnable + chunk_learnable
                )
        assert sums is not None
        return sums, grad_learnable


def _made_y(made: tuple[Tensor, ...] | None) -> Tensor | None:
    """The y of what :meth:`LastChunk.take` gave (None: nothing)."""
    return None if made is None else made[0]


def _row_bytes(packed: int) -> int:
    """A row's bytes for a packing of ``packed`` bytes: padded to 16, as the unpack kernel
    reads a row's words as aligned 32-bit (and vector) loads."""
    return -(-packed // 16) * 16


def _packed_row(rows: Tensor | None, merged: Tensor, index: int, chunks: int) -> Tensor:
    """``rows`` [chunks, bytes] (made on the first call) with row ``index`` holding the packing
    of the spikes ``merged`` (rows padded, :func:`_row_bytes`)."""
    bits = PackedSpikes.of(merged).bits
    if rows is None:
        rows = bits.new_empty((chunks, _row_bytes(bits.numel())))
    rows[index, : bits.numel()] = bits
    return rows


def _rows_of_whole(x: Tensor, chunks: int, merged_order: tuple[int, ...]) -> Tensor | None:
    """The rows of :func:`_packed_row` for all chunks of the spikes x [T, B, ...] at once
    (one packing of x, cut in two copies: :func:`~.spike_bits.batch_chunk_rows`) where x's
    memory holds each chunk's merged input [T*b, ...] in ``merged_order`` (its memory order)
    and the chunks fill words of their own; else None."""
    order = memory_order(x)
    if merged_order[0] != 0 or order != (0, 1, *(d + 1 for d in merged_order[1:])):
        return None
    if not can_cut(x.shape, order, 1, chunks):
        return None
    packing = PackedSpikes(pack_bits(x, order), x.shape, x.dtype, order)
    return batch_chunk_rows(packing, chunks, _row_bytes(packed_bytes(x.numel() // chunks)))


def _at_least_float32(t: Tensor) -> Tensor:
    """t in float32 where its dtype is narrower (float64 stays): a sum's accumulator."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _chunked_synapse_grads(
    chunks: _ChunkedBackward,
    grad_y_of: Callable[[int], Tensor],
    needs_x: bool,
    params_need: tuple[bool, ...],
) -> tuple[Tensor | None, list[Tensor | None]]:
    """Pass 2 of a chunked block: per chunk, dL/dy (``grad_y_of``), the synapse parameters'
    gradients (summed over chunks in at least float32) and the chunk's dL/dx, written into
    dL/dx of the whole batch [T, B, ...] (x's dtype)."""
    synapse, shape = chunks.synapse, chunks.shape
    need_b = len(params_need) > 1 and params_need[1]
    grad_x: Tensor | None = None
    param_sums: list[Tensor | None] = [None] * len(params_need)
    for c in chunks.last.order(len(chunks.parts)):
        part = chunks.parts[c]
        grad_y = grad_y_of(c).flatten(0, 1)
        if any(params_need):
            merged = chunks.input(c)
            chunk_grads = synapse.param_grads(merged, grad_y, chunks.weight, need_b)
            del merged
            param_sums = [
                g if g is None else (_at_least_float32(g) if total is None else total.add_(g))
                for total, g in zip(param_sums, chunk_grads, strict=False)
            ]
        if needs_x:
            merged_shape = grad_y.shape[:1] + shape[2:]
            grad_chunk = synapse.input_grad(merged_shape, grad_y, chunks.weight)
            del grad_y  # before the chunk's input gradient is copied out
            grad_chunk = grad_chunk.unflatten(0, (shape[0], -1))
            if grad_x is None:
                grad_x = empty_batch(grad_chunk, shape[1], chunks.x_dtype)
            grad_x[:, part] = grad_chunk
            del grad_chunk
    params = synapse.params()  # the Function's synapse_params: weight, bias
    grads = [
        None if total is None or not need else total.to(param.dtype)
        for total, need, param in zip(param_sums, params_need, params, strict=False)
    ]
    return grad_x, grads
