"""2 x 2 average pooling folded into the BN-folded kernels (``POOL = 2``) on the GPU: a pooled
fused block against the unpooled kernels followed by the pooling and against the torch
composite (BatchNorm + the reference neuron + the pooling), in every storage dtype and on awkward
shapes; that the pooled kernels are what runs and that no full-size spike map is allocated; and
the medium DATE'22 network fused with folding against fused without it and unfused."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from conftest import TOLERANCE, assert_close, differ, gen, reldiff, seed_of
from spikefuse import backends, fuse
from spikefuse.bench.e2e import spikefuse_model
from spikefuse.cuda.kernel_spec import KEEPS_INPUT_GRAD
from spikefuse.fused import FusedBlock, paper_lif

from .test_fused_gpu import training_step
from .variants import AFFINE_CHUNK, DTYPES

pytestmark = pytest.mark.gpu

# (T, B, C, H, W): odd channel counts (C = 3, and 130: not a multiple of a warp), the smallest
# map (2 x 2: one window per channel), T = 1 and T > the longest chunk (checkpoints).
SHAPES = [
    (4, 2, 3, 6, 6),
    (max(AFFINE_CHUNK.values()) + 1, 2, 130, 2, 2),
    (1, 3, 16, 6, 2),
    (AFFINE_CHUNK[torch.float32] + 3, 4, 32, 8, 8),
]


def identity_block(dtype, channels, gamma, beta, batch_stats, backend, pool) -> FusedBlock:
    """Conv2d(1x1, identity) -> BatchNorm2d -> the paper's LIF [-> AvgPool2d(2)], so that the
    kernels see the test's map y exactly (see test_fused_gpu.identity_block)."""
    conv, bn = nn.Conv2d(channels, channels, 1, bias=False), nn.BatchNorm2d(channels)
    with torch.no_grad():
        conv.weight.copy_(torch.eye(channels).view(conv.weight.shape))
        bn.weight.copy_(gamma)
        bn.bias.copy_(beta)
        bn.running_var.fill_(1.5)
    conv, bn = conv.to("cuda", dtype), bn.cuda().train(batch_stats)
    return FusedBlock(conv, bn, paper_lif(backend=backend), pool=nn.AvgPool2d(2) if pool else None)


def run_block(block: FusedBlock, y: torch.Tensor, upstream: torch.Tensor, pool_after: bool):
    """The block's (pooled) output, and the gradients of y, gamma and beta; ``pool_after``:
    pool the unpooled block's spikes with F.avg_pool2d."""
    y = y.detach().clone().requires_grad_()
    out = block(y)
    if pool_after:
        out = F.avg_pool2d(out.flatten(0, 1), 2).unflatten(0, out.shape[:2])
    (out.float() * upstream).sum().backward()
    return {
        "out": out.detach(),
        "grad_y": y.grad,
        "grad_gamma": block.bn.weight.grad,
        "grad_beta": block.bn.bias.grad,
        "running_mean": block.bn.running_mean.clone(),
        "running_var": block.bn.running_var.clone(),
    }


@pytest.fixture
def launches(monkeypatch):
    """The names of the BN-folded kernels launched (forward and backward)."""
    affine = backends.affine_kernels("cuda")
    names: list[str] = []
    real = affine.launch

    def spy(kernel, forward, *args):
        names.append(f"{kernel.kernel_prefix}_{'fptt' if forward else 'bptt'}")
        return real(kernel, forward, *args)

    monkeypatch.setattr(affine, "launch", spy)
    return names


@pytest.mark.quick
@pytest.mark.parametrize("batch_stats", [True, False], ids=["batch-stats", "running-stats"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_pooled_block_matches_unpooled_kernels_and_torch(
    dtype, shape, batch_stats, launches, no_tf32
):
    """The pooled output equals, in every dtype, both the unpooled kernels' spikes pooled by
    F.avg_pool2d and the torch composite's (the mean of 2 x 2 spikes is exact); the gradients
    of y, gamma and beta and the running statistics agree within the dtype's tolerance (the
    kernels sum BatchNorm's per-channel sums in another order)."""
    T, B, C, H, W = shape
    g = gen(seed_of("pool", dtype, shape, batch_stats), device="cuda")
    y = (torch.randn((T, B, C, H, W), generator=g, device="cuda") * 0.8 + 0.3).to(dtype)
    gamma = torch.rand(C, generator=g, device="cuda") + 0.5
    beta = torch.rand(C, generator=g, device="cuda") * 0.6 - 0.2
    pooled_shape = (T, B, C, H // 2, W // 2)
    upstream = torch.randn(pooled_shape, generator=g, device="cuda").to(dtype).float()

    def run(backend: str, pool: bool):
        block = identity_block(dtype, C, gamma, beta, batch_stats, backend, pool)
        launches.clear()
        res = run_block(block, y, upstream, pool_after=not pool)
        return res, list(launches)

    got, names = run("cuda", True)
    # fptt and both backward passes; with 16-bit storage pass 2 is the element-wise kernel on
    # the g pass 1 kept (spikefuse.cuda.affine_grad), not a neuron kernel
    launched = 2 if dtype in KEEPS_INPUT_GRAD else 3
    assert len(names) == launched and all("_pool2_" in n for n in names), names
    assert got["out"].shape == pooled_shape
    assert got["out"].flatten(0, 1).is_contiguous(memory_format=torch.channels_last)
    unpooled, names = run("cuda", False)
    assert names and not any("_pool" in n for n in names)
    composite, names = run("torch", True)
    assert not names
    for want in (unpooled, composite):
        assert differ(got["out"], want["out"]).sum().item() == 0, "pooled spikes differ"
        for key in ("grad_y", "grad_gamma", "grad_beta", "running_mean", "running_var"):
            assert_close(got[key], want[key], dtype, grad=True, what=key)


def test_forward_writes_no_full_size_spike_map(no_tf32):
    """Forward of a pooled block allocates one full-size map fewer than the unpooled kernels
    followed by the pooling (the spikes), measured as the peak of PyTorch's allocator."""
    T, B, C, H, W = 4, 8, 64, 32, 32
    g = gen(1, device="cuda")
    y = torch.randn((T, B, C, H, W), generator=g, device="cuda")
    ones = torch.ones(C, device="cuda")

    def peak(pool: bool) -> int:
        block = identity_block(torch.float32, C, ones, ones * 0.1, True, "cuda", pool)
        x = y.detach().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        out = block(x)
        if not pool:
            out = F.avg_pool2d(out.flatten(0, 1), 2)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start

    for pool in (True, False):  # warm-up: cuDNN's algorithm choice and workspaces
        peak(pool)
    spikes_bytes = y.numel() * y.element_size()
    assert peak(True) <= peak(False) - 0.9 * spikes_bytes


def medium_net() -> nn.Module:
    torch.manual_seed(0)
    model = spikefuse_model("medium", "cuda").cuda()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.4)
    return model.to(memory_format=torch.channels_last)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_medium_net_folded_matches_unfolded_and_unfused(autocast, no_tf32, record_property):
    """The medium DATE'22 network (three 2 x 2 average poolings, each after a Conv-BN-LIF
    block): folded pooling gives the same output as the fused network without folding (exactly)
    and the same gradients (fp32 to 5e-5: BatchNorm's sums in another order); in fp32 both
    equal the unfused network within 1e-4 (as the other fused-model tests)."""
    model = medium_net()
    folded, report = fuse(model, return_report=True)
    assert len(report.folded_pools) == 3, str(report)
    unfolded = fuse(model, fold_pools=False)
    x = torch.rand(4, 4, 3, 32, 32, device="cuda")
    want = training_step(unfolded, x, autocast)
    got = training_step(folded, x, autocast)
    assert differ(got["out"], want["out"]).sum().item() == 0
    errors = {k: reldiff(got[k], w) for k, w in want.items()}
    worst = max(errors, key=errors.get)
    record_property("worst_folded_vs_unfolded", errors[worst])
    # bf16: a gradient may round to the neighbouring bf16 value (TOLERANCE's gradient bound);
    # fp32: BatchNorm's per-channel sums (16384 values each here), added per window
    # (folded) or per 8-row tile (unfolded): orders whose float32 results differ by ~1e-5 of
    # a gradient's scale
    bound = TOLERANCE[torch.bfloat16][1] if autocast else 5e-5
    assert errors[worst] < bound, f"{worst}: normalised error {errors[worst]:.2e}"
    if not autocast:
        reference = training_step(model, x, False)
        errors = {k: reldiff(got[k], w) for k, w in reference.items()}
        worst = max(errors, key=errors.get)
        record_property("worst_folded_vs_unfused", errors[worst])
        assert errors[worst] < 1e-4, f"{worst}: normalised error {errors[worst]:.2e}"
