"""memory="min" with less host work per call: a chunked block packs its spike input once and
cuts it into the chunks' rows, autocast's weight cast is made once and shared, the chunks'
statistics are combined in one pass; the results are those of the default mode."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import gen
from spikefuse import fuse
from spikefuse.fused import FusedBlock, chunked, spike_bits, statistics
from spikefuse.fused import memory as memory_module
from spikefuse.fused.recompute import mark_spikes
from spikefuse.fused.spike_bits import PackedSpikes, memory_order
from spikefuse.fused.synapse import Synapse
from test_fused import FP64_TOL, assert_same_training_step, conv_bn_lif


class TagSpikes(nn.Module):
    """Tags its (0/1) input as a fused block's spikes, as if one made it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mark_spikes(x * 1)


def _spikes(shape: tuple[int, ...], channels_last: bool) -> torch.Tensor:
    x = (torch.rand(shape, generator=gen(4)) > 0.5).float()
    x.view(-1)[5] = float("nan")  # its word's flag: the rows carry the flags too
    if channels_last:  # [T, B, C, H, W] stored as [T, B, H, W, C]
        x = x.permute(0, 1, 3, 4, 2).contiguous().permute(0, 1, 4, 2, 3)
    return x


@pytest.mark.parametrize(
    ("shape", "channels_last", "chunks"),
    [((3, 8, 4, 4, 8), False, 4), ((3, 8, 4, 4, 8), True, 2), ((2, 6, 64), False, 3)],
)
def test_the_rows_of_one_packing_are_the_chunks_packings(shape, channels_last, chunks):
    """Cut from one packing of the whole input, each row holds what packing its chunk's
    merged input [T*b, ...] writes (words, then flags), padded to 16 bytes."""
    x = _spikes(shape, channels_last)
    size = shape[1] // chunks
    layout = torch.channels_last if channels_last else torch.contiguous_format
    merged = [
        x[:, c * size : (c + 1) * size].flatten(0, 1).contiguous(memory_format=layout)
        for c in range(chunks)
    ]
    rows = chunked._rows_of_whole(x, chunks, memory_order(merged[0]))
    assert rows is not None
    for row, chunk in zip(rows, merged, strict=True):
        bits = PackedSpikes.of(chunk).bits
        assert row.numel() == -(-bits.numel() // 16) * 16
        assert torch.equal(row[: bits.numel()], bits)


def test_chunks_that_do_not_fill_words_are_packed_one_by_one():
    x = _spikes((2, 6, 5), False)  # 10 bits of a chunk's step: not whole words
    assert chunked._rows_of_whole(x, 3, (0, 1)) is None
    packing = PackedSpikes.of(x)
    assert spike_bits.batch_chunk_rows(packing, 3, 16) is None
    assert chunked._rows_of_whole(x.transpose(0, 1), 3, (0, 1)) is None  # batch outermost


def _spike_model(chunks: int, monkeypatch) -> tuple[nn.Module, nn.Module]:
    monkeypatch.setattr(memory_module, "batch_chunks", lambda batch, y_bytes: chunks)
    torch.manual_seed(0)
    model = nn.Sequential(TagSpikes(), *conv_bn_lif(4, 8), *conv_bn_lif(8, 8)).double()
    return fuse(copy.deepcopy(model)), fuse(copy.deepcopy(model), memory="min")


def test_a_chunked_block_packs_its_spike_input_once(monkeypatch):
    """Spike input [T, B, ...] in 4 chunks: one packing of the whole input (not one per
    chunk), and the training step equals the default mode's."""
    default, low = _spike_model(4, monkeypatch)
    x = (torch.rand(2, 8, 4, 8, 8, dtype=torch.float64, generator=gen(6)) > 0.5).double()
    assert_same_training_step(default, low, x, FP64_TOL)
    packed: list[torch.Size] = []
    real = spike_bits.pack_bits

    def counting(spikes: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
        packed.append(spikes.shape)
        return real(spikes, order)

    monkeypatch.setattr(spike_bits, "pack_bits", counting)
    monkeypatch.setattr(chunked, "pack_bits", counting)
    low(x).sum().backward()
    # each block's input whole: the model's (tagged) and the first block's spikes
    assert packed == [torch.Size((2, 8, 4, 8, 8)), torch.Size((2, 8, 8, 8, 8))]


class _WeightCasts(TorchDispatchMode):
    """Counts the float32 → bfloat16 casts of tensors shaped like ``shape``."""

    def __init__(self, shape: torch.Size) -> None:
        super().__init__()
        self.shape, self.count = shape, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        source = args[0] if args else None
        if (
            func.overloadpacket is torch.ops.aten._to_copy
            and isinstance(source, torch.Tensor)
            and source.shape == self.shape
            and source.dtype == torch.float32
            and kwargs.get("dtype") == torch.bfloat16
        ):
            self.count += 1
        return func(*args, **kwargs)


@pytest.mark.parametrize(("chunks", "casts"), [(1, 2), (2, 1)], ids=["whole", "chunked"])
def test_autocast_casts_a_min_blocks_weight_once_a_pass(chunks, casts, monkeypatch):
    """bf16 autocast: an unchunked min block casts its weight once in forward (autocast) and
    once in backward for the recomputation and both gradients; a chunked one once for all of
    its chunks' synapse calls, forward and backward. Gradients as the default mode's (the
    chunks' bf16 weight gradients summed in float32: to 1e-2 of the norm)."""
    monkeypatch.setattr(memory_module, "batch_chunks", lambda batch, y_bytes: chunks)
    torch.manual_seed(0)
    model = nn.Sequential(TagSpikes(), *conv_bn_lif(4, 8))
    grads = []
    for memory in ("default", "min"):
        fused = fuse(copy.deepcopy(model), memory=memory)
        block = next(m for m in fused.modules() if isinstance(m, FusedBlock))
        x = (torch.rand(2, 4, 4, 8, 8, generator=gen(7)) > 0.5).float().requires_grad_()
        with _WeightCasts(block.synapse.weight.shape) as counter:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = fused(x)
            out.float().sum().backward()
        grads.append([x.grad, *(p.grad for p in fused.parameters())])
        if memory == "min":
            assert counter.count == casts
    for g_default, g_min in zip(*grads, strict=True):
        assert (g_min - g_default).norm() <= 1e-2 * g_default.norm()


def test_chunk_moments_combine_the_chunks_statistics():
    """Gathered chunk by chunk, the moments are those of each chunk (float64 here: the
    variance itself; the CUDA kernels' 1/sqrt(var) is converted once for all chunks)."""
    y = torch.randn(3, 8, 5, 4, 4, dtype=torch.float64, generator=gen(8))
    moments = statistics.ChunkMoments()
    for part in itertools.pairwise(range(0, 9, 2)):
        moments.add(y[:, slice(*part)])
    means, variances = moments.stacked()
    for c, (lo, hi) in enumerate(itertools.pairwise(range(0, 9, 2))):
        mean, var = statistics.local_mean_var(y[:, lo:hi])
        assert torch.equal(means[c], mean) and torch.equal(variances[c], var)


@pytest.mark.parametrize("chunks", [2, 4])
@pytest.mark.parametrize("train", [True, False], ids=["batch-stats", "running-stats"])
def test_a_pass_starts_with_the_chunk_the_pass_before_ended_with(chunks, train, monkeypatch):
    """In K chunks a block runs its synapse forward 4K - 2 times a training step, not 4K:
    the statistics pass hands its last chunk's y to the neuron pass, backward's pass 1 its
    last chunk's y (and dL/dspikes part) to pass 2. With running statistics forward has no
    statistics pass (its first chunk's y, made for the block's setup, starts the neuron pass):
    3K - 1. The step equals the default mode's."""
    default, low = _spike_model(chunks, monkeypatch)
    default.train(train)
    low.train(train)
    x = (torch.rand(2, 8, 4, 8, 8, dtype=torch.float64, generator=gen(9)) > 0.5).double()
    calls: list[int] = []
    real = Synapse.on_merged

    def counting(self, merged, steps, weight=None):
        calls.append(merged.shape[0])
        return real(self, merged, steps, weight)

    monkeypatch.setattr(Synapse, "on_merged", counting)
    assert_same_training_step(default, low, x, FP64_TOL)
    chunk_rows = 2 * 8 // chunks  # T * b of a chunk
    per_block = 4 * chunks - 2 if train else 3 * chunks - 1
    assert calls.count(chunk_rows) == 2 * per_block  # two chunked blocks
