"""1-bit spike packing on the GPU (spikefuse.cuda.spike_bits): the kernels write the same bytes as
the torch composites (the CPU path), give the values back exactly, keep a NaN, and replay in a
CUDA graph; the BN-folded forward kernels write the same packing of their spikes (pooled: of the
window means), which fused blocks restore their output from in backward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from spikefuse import backends
from spikefuse.cuda import spike_bits as cuda_bits
from spikefuse.fused import FusedBlock, paper_lif, spike_bits
from spikefuse.fused.recompute import compact, recipe_of
from spikefuse.fused.spike_bits import PackedSpikes

from .replay import assert_close_but_for_sum_order, eager_and_replayed_grads
from .variants import AFFINE_CHUNK

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
def test_a_packed_nan_comes_back_as_nan_in_its_word(dtype):
    spikes = random_spikes(5000, dtype)
    spikes[4321] = float("nan")  # word 135: elements 4320 .. 4351
    packed = cuda_bits.pack(spikes)
    flags = packed[4 * backends.packed_words(5000) :]
    assert flags.nonzero().flatten().tolist() == [135]
    assert torch.equal(packed, spike_bits._pack_torch(spikes))
    out = cuda_bits.unpack(packed, torch.empty_like(spikes))
    assert out[4320:4352].isnan().all()
    assert torch.equal(out[:4320], spikes[:4320]) and torch.equal(out[4352:], spikes[4352:])


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
    assert out[:32].isnan().all() and torch.equal(out[32:], spikes[32:])


def conv_block(
    dtype: torch.dtype, channels: int, pool: bool, memory: str = "default"
) -> FusedBlock:
    """Conv2d(3x3, ``dtype``) -> BatchNorm2d (float32) -> the paper's LIF [-> AvgPool2d(2)] on
    CUDA."""
    conv, bn = nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)
    conv, bn = conv.to("cuda", dtype), bn.cuda()
    pooling = nn.AvgPool2d(2) if pool else None
    return FusedBlock(conv, bn, paper_lif(), pool=pooling, memory=memory)


def restored(out: torch.Tensor) -> tuple[torch.Tensor, PackedSpikes | None]:
    """What backward gets back for a block's output (its recipe run), and the packing the
    recipe unpacks (None: it recomputes instead)."""
    recipe = recipe_of(out)
    assert recipe is not None
    packing = getattr(recipe, "__self__", None)
    return recipe(), packing if isinstance(packing, PackedSpikes) else None


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal strides where they matter (a dimension of size 1 has any)."""
    return all(n == 1 or s == t for n, s, t in zip(a.shape, a.stride(), b.stride(), strict=True))


# (T, B, C, H, W): means per step in whole warps (the kernels pack), T past the longest chunk.
PACKED_SHAPES = [(4, 2, 32, 8, 8), (max(AFFINE_CHUNK.values()) + 2, 4, 64, 4, 4), (3, 2, 64, 2, 2)]


@pytest.mark.quick
@pytest.mark.parametrize("shape", PACKED_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_pooled_blocks_restore_their_output_from_the_bits_the_kernels_wrote(dtype, shape):
    """The pooled forward kernel's packing (the 4 spikes behind each mean) gives the means back
    exactly, in the output's layout; a NaN comes back as NaN in its word."""
    T, B, C, H, W = shape
    g = torch.Generator(device="cuda").manual_seed(T * C)
    block = conv_block(dtype, C, pool=True)
    x = (torch.rand(shape, device="cuda", generator=g) > 0.6).to(dtype).requires_grad_()
    out = block(x)
    got, packing = restored(out)
    assert packing is not None and packing.window == 4
    assert torch.equal(got, out) and same_layout(got, out)
    x = x.detach().clone()
    x[1, 0, 0, 1, 1] = float("nan")  # NaN from step 1 on in the neurons it reaches
    out = block(x.requires_grad_())
    got, packing = restored(out)
    nan = out.isnan()
    assert nan.any() and got[nan].isnan().all()
    assert torch.equal(got[~got.isnan()], out[~got.isnan()])
    words = packing.bits[4 * backends.packed_words(out.numel(), packing.window) :]
    assert 0 < words.count_nonzero() <= nan.sum()  # flagged: only words holding a NaN


@pytest.mark.parametrize("pool", [False, True], ids=["unpooled", "pooled-odd"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_other_blocks_recompute_their_output(dtype, pool):
    """Unpooled blocks, and pooled ones whose means per step are not whole warps (2 x 3 x 3 x 3
    = 54), rerun the forward kernel instead."""
    block = conv_block(dtype, 3, pool)
    x = (torch.rand(4, 2, 3, 6, 6, device="cuda") > 0.6).to(dtype).requires_grad_()
    out = block(x)
    got, packing = restored(out)
    assert packing is None and torch.equal(got, out)


@pytest.mark.parametrize("memory", ["default", "min"])
def test_a_min_memory_block_keeps_the_packing_of_its_pooled_input(memory, no_tf32):
    """memory="min": the block after a pooled block keeps the 4-bit packing the pooling kernels
    wrote as its input (5/32 of the float32 map; so does a min-memory pooled block's output), and
    the training step equals the default mode's."""

    def model(memory: str) -> nn.Sequential:
        torch.manual_seed(0)
        first = conv_block(torch.float32, 32, pool=True, memory=memory)
        return nn.Sequential(first, conv_block(torch.float32, 32, pool=False, memory="min"))

    x = (torch.rand(4, 2, 32, 8, 8, device="cuda") > 0.6).float()
    low, default = model(memory), model("default")
    pooled = low[0](x.requires_grad_())
    kept = compact(pooled)
    assert isinstance(kept, PackedSpikes) and kept.window == 4
    assert kept.bits.numel() == backends.packed_bytes(pooled.numel(), 4)
    assert torch.equal(kept.unpack(), pooled)
    grads = []
    for net in (default, low):
        net(x).sum().backward()
        grads.append([x.grad.clone()] + [p.grad for p in net.parameters()])
        x.grad = None
    for got, want in zip(grads[1], grads[0], strict=True):  # y recomputed: float32 rounding
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_a_block_restores_its_output_in_a_cuda_graph_replay():
    """Capture forward and backward of two blocks (the second saves the first's output, which
    backward restores from its bits); replays match eager gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(conv_block(torch.float32, 32, False), conv_block(torch.float32, 32, True))
    x = (torch.rand(4, 2, 32, 8, 8, device="cuda") > 0.6).float()

    want, replays = eager_and_replayed_grads(model, x, replays=2)
    for grads in replays:
        assert_close_but_for_sum_order(grads, want)


@pytest.mark.quick
@pytest.mark.parametrize("steps", [4, max(AFFINE_CHUNK.values()) + 2], ids=["T4", "T-past-a-chunk"])
def test_min_memory_in_batch_chunks_matches_the_default_mode(steps, no_tf32, monkeypatch):
    """memory="min" blocks in 2 batch chunks (a pooled block; an unpooled one, which keeps the
    pooled block's packing; another, which packs its input spikes per chunk): the pooled output
    keeps the chunks' packings joined into the whole map's, and a training step (eager, then
    replayed from a CUDA graph) equals the default mode's to float32 rounding (and the rare
    spike that rounding flips)."""
    from spikefuse.fused import memory

    def model(memory: str) -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(
            conv_block(torch.float32, 32, pool=True, memory=memory),
            conv_block(torch.float32, 32, pool=False, memory=memory),
            conv_block(torch.float32, 32, pool=False, memory=memory),
        )

    default, low = model("default"), model("min")
    monkeypatch.setattr(memory, "batch_chunks", lambda batch, y_bytes: 2)
    x = (torch.rand(steps, 4, 32, 8, 8, device="cuda") > 0.6).float().requires_grad_()
    pooled = low[0](x)
    kept = compact(pooled)
    assert isinstance(kept, PackedSpikes) and kept.window == 4
    assert torch.equal(kept.unpack(), pooled)
    del pooled, kept  # their autograd graph would keep the parameters' AccumulateGrad nodes
    # (made on this stream) alive into the capture below, which then fails

    def step(net: nn.Sequential) -> list[torch.Tensor]:
        x.grad = None
        net.zero_grad(set_to_none=False)
        net(x).sum().backward()
        return [x.grad.clone()] + [p.grad.clone() for p in net.parameters()]

    want = step(default)
    # The statistics and the weight gradients summed over chunks round differently, which
    # can flip a spike whose potential sits on the threshold (changing a few gradients
    # locally): equal to 1e-3 of each gradient's norm.
    for got, expected in zip(step(low), want, strict=True):
        assert (got - expected).norm() <= 1e-3 * expected.norm()
    eager, (replayed,) = eager_and_replayed_grads(low, x.detach())
    assert_close_but_for_sum_order(replayed, eager)


@pytest.mark.quick
@pytest.mark.parametrize("features", [100, 128])
def test_a_chunked_linear_block_on_spikes_matches_the_default_mode(features, monkeypatch):
    """Linear -> BN -> LIF in 2 batch chunks on tagged spikes [3, 2, features]: a chunk's step
    of 100 bits is no whole number of words (backward unpacks the input whole), one of 128
    is (backward unpacks the chunks' parts of the packing)."""
    from spikefuse.fused import memory
    from spikefuse.fused.recompute import mark_spikes

    def block(memory: str) -> FusedBlock:
        torch.manual_seed(0)
        linear, bn = nn.Linear(features, 64), nn.BatchNorm1d(64)
        return FusedBlock(linear.cuda(), bn.cuda(), paper_lif(), memory=memory)

    default, low = block("default"), block("min")
    monkeypatch.setattr(memory, "batch_chunks", lambda batch, y_bytes: 2)
    spikes = (torch.rand(3, 2, features, device="cuda") > 0.5).float()
    grads = []
    for net in (default, low):
        x = mark_spikes(spikes.clone()).requires_grad_()
        net(x).sum().backward()
        grads.append([x.grad] + [p.grad for p in net.parameters()])
    # the Linear's bias gradient is rounding noise (~1e-6: BatchNorm removes the bias)
    for got, want in zip(grads[1], grads[0], strict=True):
        assert (got - want).norm() <= 1e-3 * want.norm() + 1e-4
