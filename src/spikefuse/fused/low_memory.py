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

A block whose y is large (:data:`CHUNKED_FROM`) runs in equal batch chunks instead
(:class:`ChunkedSynapseFunction`; BatchNorm and the neuron as above): forward computes each
chunk's y twice, once for the batch statistics and once for the neuron, and backward twice,
once per BN-folded pass (pass 2 needs pass 1's sums over the whole batch), then the chunk's
weight and input gradients. Input spikes are packed per chunk (a pooling kernel's packing of
the input is kept whole and cut into the chunks' parts, :func:`~.spike_bits.packing_part`);
backward unpacks one chunk at a time. Only chunk-sized temporaries are alive besides the
block's output (forward) or its input gradient (backward), for two more synapse forwards per
call. Each chunk's y is computed by the same call on the same input in all four places, so backward
sees forward's y to the bit; against the unchunked modes it may differ by rounding (another
batch size may get another convolution algorithm).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.modules.conv import _ConvNd

from ..cuda import spike_bits as cuda_bits
from ..functional import repeated_over_time
from ..ops import forbid_double_backward
from .bn_neuron import (
    batch_totals,
    bn_affine_grads,
    bn_input_grad,
    bn_neuron_backward,
    bn_neuron_forward,
    bn_neuron_grads,
    bn_param_grads,
    load_bn_context,
    repeated,
    save_bn_context,
)
from .neuron_call import NeuronCall
from .spike_bits import (
    Compact,
    PackedSpikes,
    compact,
    empty_in_order,
    expand,
    is_spikes,
    joined_batch_chunks,
    memory_order,
    packing_of,
    packing_part,
)
from .statistics import BNSpec, BNStats

if TYPE_CHECKING:
    from .blocks import FusedBlock

Synapse = nn.Linear | _ConvNd

#: memory="min" runs a block whose synapse output y takes at least CHUNKED_FROM bytes in equal
#: batch chunks of at most CHUNK_BYTES each (see :func:`batch_chunks`). A network's peak is at
#: its largest maps, and each chunked block pays two more synapse forwards per step (and host
#: time per chunk), so only the large maps are chunked (medium CIFAR net, fp32, H100: chunking
#: every map of 64 MiB or more, 804 MiB at 26.1 ms graphed; the 320 MiB maps alone, 733 MiB at
#: 19.5 ms). Chunks of 48 MiB keep the temporaries of such a block's backward (a chunk's input
#: and y, then its input gradient) a fraction of its whole input gradient (32 MiB: 691 MiB, but
#: eager host time 45 against 30 ms).
CHUNKED_FROM = 256 << 20
CHUNK_BYTES = 48 << 20


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


def keep_autocast(ctx: Any, x: Tensor) -> None:
    """Keep the forward's autocast state on ``ctx``: backward runs outside the forward's
    autocast context, and recomputes y under the same one (:func:`forward_autocast`)."""
    device = x.device.type
    ctx.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))


def forward_autocast(ctx: Any) -> tuple[torch.autocast, torch.dtype | None]:
    """The forward's autocast context (without the weight cache, which CUDA graph capture
    cannot take) and its dtype (None: autocast was off)."""
    device, dtype, enabled = ctx.autocast
    context = torch.autocast(device, dtype, enabled=enabled, cache_enabled=False)
    return context, dtype if enabled else None


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
        keep_autocast(ctx, x)
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
        autocast, autocast_dtype = forward_autocast(ctx)
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
                autocast_dtype,
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


class ChunkedSynapseFunction(torch.autograd.Function):
    """:class:`SynapseRecomputeFunction` in equal batch chunks (see the module docstring).

    ``apply(x, weight, bias, learnable, stats, bn, neuron, block, pool, parts, *synapse_params)``
    returns ``(spikes, packed)`` as :class:`BNNeuronFunction` does; ``parts`` are the batch
    slices (:func:`batch_parts`), ``stats`` the batch statistics of the whole synapse output
    (the caller's first pass over the chunks), the rest as in SynapseRecomputeFunction. Kept
    for backward: where x is tagged spikes, each chunk's merged input packed at 1 bit per
    element (a row each), else x as :func:`compact` keeps it (a kernel's packing is cut into
    the chunks' parts in backward, :func:`~.spike_bits.packing_part`); and the neuron's
    checkpoints of every chunk.
    """

    @staticmethod
    def forward(
        ctx,
        x,
        weight,
        bias,
        learnable,
        stats: BNStats,
        bn: BNSpec,
        neuron: NeuronCall,
        block: FusedBlock,
        pool: int,
        parts: list[slice],
        *synapse_params,
    ):
        spikes = checkpoints = rows = None
        kept_any, packings = False, []
        # tagged spikes (not a kernel's packing): each chunk's input packed as backward unpacks
        # it, into one row each of a [K, bytes] tensor
        per_chunk = packing_of(x) is None and is_spikes(x)
        for c, part in enumerate(parts):
            merged = block._merged_part(x, part)
            y = block._synapse_merged(merged, x.shape[0])
            if per_chunk:
                rows = _packed_row(rows, merged, c, len(parts))
                packed_as = (merged.shape, memory_order(merged))
            del merged
            chunk, saved, packed = bn_neuron_forward(
                y, stats, neuron, learnable, True, pool, pack_spikes=True
            )
            del y
            if spikes is None:
                spikes = empty_batch(chunk, x.shape[1])
            spikes[:, part] = chunk
            del chunk
            kept_any = saved is not None  # the same for every chunk
            if saved is not None and saved[0] is not None:
                if checkpoints is None:
                    checkpoints = saved[0].new_empty((len(parts), *saved[0].shape))
                checkpoints[c] = saved[0]
            packings.append(packed)
        assert spikes is not None  # at least one part
        if rows is not None:  # the shape and memory order: a chunk's merged input's
            kept: Compact = PackedSpikes(rows, packed_as[0], x.dtype, packed_as[1])
        else:
            kept = compact(x)
        save_bn_context(
            ctx,
            kept,
            learnable,
            stats=stats,
            saved=(checkpoints,) if kept_any else None,
            weight=weight,
            bias=bias,
            neuron=neuron,
            bn=bn,
        )
        keep_autocast(ctx, x)
        ctx.block, ctx.pool, ctx.parts, ctx.per_chunk = block, pool, parts, rows is not None
        ctx.geometry = (x.shape, x.dtype)
        ctx.set_materialize_grads(False)  # as BNNeuronFunction: no zeros for the packing
        packed = None
        if packings[0] is not None:
            packed = joined_batch_chunks(cast(list[Tensor], packings), x.shape[0])
        return spikes, packed

    @staticmethod
    def backward(ctx, grad_spikes, _):
        forbid_double_backward("a fused block (memory='min')")
        if grad_spikes is None:  # the spikes did not reach what backward started from
            return (None,) * len(ctx.needs_input_grad)
        kept, learnable, stats, saved, _ = load_bn_context(ctx)
        assert stats is not None  # chunked blocks have BatchNorm
        block, pool, parts = ctx.block, ctx.pool, ctx.parts
        shape, x_dtype = ctx.geometry
        needs_x, params_need = ctx.needs_input_grad[0], ctx.needs_input_grad[10:]
        autocast, autocast_dtype = forward_autocast(ctx)
        neuron = ctx.neuron
        whole: list[Tensor] = []  # x unpacked, where its packing cannot be cut into chunks

        def chunk_input(c: int) -> Tensor:
            """Chunk c's merged input, as forward made it: from its row of packed chunks, or
            its part of x's packing (a copy of 1/K of it), else x itself (unpacked once)."""
            if isinstance(kept, PackedSpikes) and ctx.per_chunk:
                row = kept.bits[c, : cuda_bits.packed_bytes(kept.shape.numel())]
                return PackedSpikes(row, kept.shape, kept.dtype, kept.order).unpack()
            if isinstance(kept, PackedSpikes):
                part = packing_part(kept, c, len(parts))
                if part is not None:
                    return block._merged_part(part.unpack(), slice(None))
                if not whole:
                    whole.append(kept.unpack())
            return block._merged_part(whole[0] if whole else expand(kept), parts[c])

        def recomputed(c: int) -> Tensor:
            """Chunk c's y, as forward made it (its input freed before anything else is
            allocated: taken again where needed, it is cheaper than the memory)."""
            with torch.no_grad(), autocast:
                return block._synapse_merged(chunk_input(c), shape[0])

        def checkpoints(c: int) -> tuple[Tensor | None] | None:
            """What forward kept of chunk c's neuron (see :meth:`NeuronCall.forward`)."""
            if saved is None or saved[0] is None:
                return saved
            return (saved[0][c],)

        sums, grad_learnable = None, None
        for c, part in enumerate(parts):  # pass 1: the per-channel sums over the batch
            y = recomputed(c)
            _, chunk_sums, chunk_learnable = bn_neuron_backward(
                y, stats, neuron, learnable, dense_part(grad_spikes, part), checkpoints(c), pool
            )
            del y
            assert chunk_sums is not None  # BatchNorm
            sums = chunk_sums if sums is None else sums.add_(chunk_sums)
            if chunk_learnable is not None and ctx.needs_input_grad[3]:
                grad_learnable = (
                    chunk_learnable if grad_learnable is None else grad_learnable + chunk_learnable
                )
        assert sums is not None
        grad_weight, grad_bias = bn_affine_grads(sums, stats, ctx.needs_input_grad[1:3])
        grad_weight, grad_bias = bn_param_grads(ctx, grad_weight, grad_bias)
        grad_x: Tensor | None = None
        grad_params: list[Tensor | None] = [None] * len(params_need)
        if needs_x or any(params_need):
            totals = batch_totals(sums, stats, ctx.bn)  # once: all-reduced when distributed
            grad_x, grad_params = _chunked_synapse_grads(
                block,
                parts,
                shape,
                x_dtype,
                lambda c: bn_input_grad(
                    None,
                    recomputed(c),
                    stats,
                    *totals,
                    neuron,
                    learnable,
                    dense_part(grad_spikes, parts[c]),
                    checkpoints(c),
                    pool,
                    overwrite_y=True,  # y is ours: dL/dy may take its memory
                )[0],
                chunk_input,
                autocast_dtype,
                needs_x,
                params_need,
            )
        grads = (grad_x, grad_weight, grad_bias, grad_learnable)
        return *grads, None, None, None, None, None, None, *grad_params


def _packed_row(rows: Tensor | None, merged: Tensor, index: int, chunks: int) -> Tensor:
    """``rows`` [chunks, bytes] (made on the first call) with row ``index`` holding the packing
    of the spikes ``merged``. Rows are padded to 16 bytes: the unpack kernel reads a row's
    words as aligned 32-bit (and vector) loads."""
    bits = PackedSpikes.of(merged).bits
    if rows is None:
        rows = bits.new_empty((chunks, -(-bits.numel() // 16) * 16))
    rows[index, : bits.numel()] = bits
    return rows


def _at_least_float32(t: Tensor) -> Tensor:
    """t in float32 where its dtype is narrower (float64 stays): a sum's accumulator."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _chunked_synapse_grads(
    block: FusedBlock,
    parts: list[slice],
    shape: torch.Size,
    x_dtype: torch.dtype,
    grad_y_of: Callable[[int], Tensor],
    chunk_input: Callable[[int], Tensor],
    autocast_dtype: torch.dtype | None,
    needs_x: bool,
    params_need: tuple[bool, ...],
) -> tuple[Tensor | None, list[Tensor | None]]:
    """Pass 2 of a chunked block: per chunk, dL/dy (``grad_y_of``), the synapse parameters'
    gradients (summed over chunks in at least float32) and the chunk's dL/dx, written into dL/dx of the
    whole batch [T, B, ...] (x's dtype)."""
    synapse = block.synapse
    compute = autocast_dtype or synapse.weight.dtype
    need_b = len(params_need) > 1 and params_need[1]
    grad_x: Tensor | None = None
    param_sums: list[Tensor | None] = [None] * len(params_need)
    for c, part in enumerate(parts):
        grad_y = grad_y_of(c).flatten(0, 1)
        if any(params_need):
            merged = chunk_input(c)
            chunk_grads = synapse_param_grads(synapse, merged, grad_y, compute, need_b)
            del merged
            param_sums = [
                g if g is None else (_at_least_float32(g) if total is None else total.add_(g))
                for total, g in zip(param_sums, chunk_grads, strict=False)
            ]
        if needs_x:
            merged_shape = grad_y.shape[:1] + shape[2:]
            grad_chunk = synapse_input_grad(synapse, merged_shape, grad_y, compute)
            del grad_y  # before the chunk's input gradient is copied out
            grad_chunk = grad_chunk.unflatten(0, (shape[0], -1))
            if grad_x is None:
                grad_x = empty_batch(grad_chunk, shape[1], x_dtype)
            grad_x[:, part] = grad_chunk
            del grad_chunk
    params = list(synapse.parameters())  # the Function's synapse_params: weight, bias
    grads = [
        None if total is None or not need else total.to(param.dtype)
        for total, need, param in zip(param_sums, params_need, params, strict=False)
    ]
    return grad_x, grads
