"""1-bit spike packing on the GPU (spikefuse.cuda.spike_bits): the kernels write the same bytes as
the torch composites (the CPU path), give the values back exactly, keep a NaN, and replay in a
CUDA graph."""

from __future__ import annotations

import pytest
import torch

from spikefuse.cuda import spike_bits as cuda_bits
from spikefuse.fused import spike_bits
from spikefuse.fused.spike_bits import PackedSpikes

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [1, 31, 32, 33, 1000, 4 * 1024 + 5, 3_000_001]


def random_spikes(n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(n)
    return (torch.rand(n, device="cuda", generator=g) > 0.7).to(dtype)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernels_match_the_torch_packing(n, dtype):
    spikes = random_spikes(n, dtype)
    packed = cuda_bits.pack(spikes)
    assert torch.equal(packed, spike_bits._pack_torch(spikes))
    assert torch.equal(cuda_bits.unpack(packed, torch.empty_like(spikes)), spikes)
    assert torch.equal(spike_bits._unpack_torch(packed, torch.empty_like(spikes)), spikes)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_packed_nan_comes_back_as_nan_everywhere(dtype):
    spikes = random_spikes(5000, dtype)
    spikes[4321] = float("nan")
    packed = cuda_bits.pack(spikes)
    assert packed[-1] == 1 and torch.equal(packed, spike_bits._pack_torch(spikes))
    assert cuda_bits.unpack(packed, torch.empty_like(spikes)).isnan().all()


def test_a_channels_last_map_round_trips_in_its_layout():
    x = random_spikes(2 * 3 * 5 * 7 * 9, torch.bfloat16).view(2, 3, 5, 7, 9)
    x = x.flatten(0, 1).contiguous(memory_format=torch.channels_last).unflatten(0, (2, 3))
    y = PackedSpikes.of(x).unpack()
    assert torch.equal(y, x) and y.stride() == x.stride()


def test_pack_and_unpack_replay_in_a_cuda_graph():
    spikes = random_spikes(100_003, torch.float32)
    for _ in range(2):  # compile and load, then warm the allocator, before capture
        out = PackedSpikes.of(spikes).unpack()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = PackedSpikes.of(spikes).unpack()
    spikes.copy_(random_spikes(100_003, torch.float32).flip(0))
    spikes[7] = 1
    graph.replay()
    assert torch.equal(out, spikes)
    spikes[7] = float("nan")
    graph.replay()
    assert out.isnan().all()
