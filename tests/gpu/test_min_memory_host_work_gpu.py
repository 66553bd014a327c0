"""memory="min" with less host work, on the GPU: the chunks' statistics from the kernels'
1/sqrt(var) converted once for all chunks, a channels-last spike input packed once and cut
into the chunks' rows, and a chunked block under bf16 autocast with one cast of its weight."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from spikefuse.fused import FusedBlock, chunked, paper_lif, statistics
from spikefuse.fused.recompute import mark_spikes
from spikefuse.fused.spike_bits import PackedSpikes, memory_order

pytestmark = [pytest.mark.gpu, pytest.mark.quick]


def test_chunk_moments_equal_each_chunks_statistics():
    """The variances converted for all chunks at once equal those of each chunk's call."""
    y = torch.randn(4, 8, 16, 32, 32, device="cuda")
    y = y.flatten(0, 1).contiguous(memory_format=torch.channels_last).unflatten(0, (4, 8))
    moments = statistics.ChunkMoments()
    parts = [slice(0, 4), slice(4, 8)]
    for part in parts:
        moments.add(y[:, part])
    means, variances = moments.stacked()
    assert moments.is_invstd  # the statistics kernel ran
    for c, part in enumerate(parts):
        mean, var = statistics.local_mean_var(y[:, part])
        assert torch.equal(means[c], mean) and torch.equal(variances[c], var)


def test_a_channels_last_spike_input_is_cut_into_the_chunks_packings():
    x = (torch.rand(3, 8, 16, 8, 8, device="cuda") > 0.5).float()
    x = x.flatten(0, 1).contiguous(memory_format=torch.channels_last).unflatten(0, (3, 8))
    merged = [
        x[:, c : c + 2].flatten(0, 1).contiguous(memory_format=torch.channels_last)
        for c in range(0, 8, 2)
    ]
    rows = chunked._rows_of_whole(x, 4, memory_order(merged[0]))
    assert rows is not None
    for row, chunk in zip(rows, merged, strict=True):
        bits = PackedSpikes.of(chunk).bits
        assert torch.equal(row[: bits.numel()], bits)


def test_a_chunked_block_under_bf16_autocast_matches_the_default_mode(monkeypatch):
    """Conv -> BN -> LIF in 2 chunks under bf16 autocast (the weight cast once for every
    chunk's convolution, forward and backward): gradients as the default mode's, to bf16
    rounding and the rare spike it flips."""
    from spikefuse.fused import memory

    def block(memory: str) -> FusedBlock:
        torch.manual_seed(0)
        conv, bn = nn.Conv2d(16, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32)
        return FusedBlock(conv.cuda(), bn.cuda(), paper_lif(), memory=memory)

    default, low = block("default"), block("min")
    monkeypatch.setattr(memory, "batch_chunks", lambda batch, y_bytes: 2)
    spikes = (torch.rand(4, 4, 16, 8, 8, device="cuda") > 0.5).to(torch.bfloat16)
    grads = []
    for net in (default, low):
        x = mark_spikes(spikes.clone()).requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = net(x)
        out.float().sum().backward()
        grads.append([x.grad.float()] + [p.grad for p in net.parameters()])
    for got, want in zip(grads[1], grads[0], strict=True):
        assert (got - want).norm() <= 2e-2 * want.norm() + 1e-3
