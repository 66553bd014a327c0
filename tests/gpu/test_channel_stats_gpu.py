"""The per-channel BatchNorm statistics kernel on the GPU (spikefuse.cuda.channel_stats): against
float64 statistics and torch.batch_norm_stats in every storage dtype and awkward shape, its
numerics (a large mean with a small variance, NaN and Inf), determinism, streams and CUDA graphs,
and the fused blocks that use it against the unfused modules.

Tolerances, as normalised errors over the channels: max |got - want| / max |want| for invstd
(and the variance), and for the mean max |got - want| / max(max |mean|, max std) (the kernel's
mean is exact to float32 rounding of the deviations from its pivot, a sample of the channel, so
its error scales with the spread where means are near 0):

* against float64 statistics of the same stored values: 2e-6 for mean and invstd in every
  storage dtype (the kernel reads 16-bit values exactly and accumulates in float32);
* against torch.batch_norm_stats (itself float32 Welford): 5e-6 for both;
* mean 1000, std 0.01 (float32): the variance within 1e-5 of float64's, the mean within 2e-6.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from conftest import gen, reldiff, seed_of
from spikefuse import functional, fuse, layer, neuron
from spikefuse.cuda import channel_stats as cs
from spikefuse.fused import FusedConvBNNeuron, paper_lif, statistics
from spikefuse.fused.statistics import BNSpec, bn_statistics

from .test_fused_gpu import paper_net, training_step

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EXACT, TORCH = 2e-6, 5e-6  # the tolerances of the module's docstring


def reference(rows: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, invstd) of [rows, C] in float64."""
    var, mean = torch.var_mean(rows.double(), dim=0, correction=0)
    return mean, (var + eps).rsqrt()


def mean_error(got: torch.Tensor, want: torch.Tensor, want_invstd: torch.Tensor) -> float:
    """max |got - want| / max(max |want|, largest standard deviation)."""
    scale = max(want.abs().max().item(), want_invstd.double().reciprocal().max().item())
    return (got.double() - want.double()).abs().max().item() / scale


def check(rows: torch.Tensor, torch_view: torch.Tensor, eps: float = 1e-5) -> None:
    """channel_stats(rows) against float64 and torch.batch_norm_stats of torch_view (the same
    memory as [N, C, *])."""
    mean, invstd = cs.channel_stats(rows, eps)
    assert mean.dtype == invstd.dtype == torch.float32 and mean.shape == (rows.shape[1],)
    want_mean, want_invstd = reference(rows, eps)
    error = mean_error(mean, want_mean, want_invstd)
    assert error <= EXACT, f"mean vs float64: {error:.1e}"
    assert reldiff(invstd, want_invstd) <= EXACT, f"invstd: {reldiff(invstd, want_invstd):.1e}"
    torch_mean, torch_invstd = torch.batch_norm_stats(torch_view, eps)
    error = mean_error(mean, torch_mean, want_invstd)
    assert error <= TORCH, f"mean vs torch: {error:.1e}"
    assert reldiff(invstd, torch_invstd) <= TORCH, (
        f"invstd vs torch: {reldiff(invstd, torch_invstd):.1e}"
    )


@pytest.mark.quick
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape", [(640, 128, 8, 8), (64, 130, 5, 7), (7, 3, 4, 4), (1, 10, 1, 1), (3, 1024, 2, 2)]
)
def test_channels_last_maps(shape, dtype):
    """[T*B, C, H, W] channels-last, as the fused Conv2d blocks' synapse output."""
    g = gen(seed_of(shape, dtype), device="cuda")
    y = (torch.randn(shape, generator=g, device="cuda") * 0.7 + 0.3).to(dtype)
    y = y.contiguous(memory_format=torch.channels_last)
    rows = y.movedim(1, -1).reshape(-1, shape[1])
    assert rows.data_ptr() == y.data_ptr()  # the view the fused blocks pass
    check(rows, y)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("channels", [3, 10, 128, 130])
@pytest.mark.parametrize("n_rows", [1, 7, 65537])
def test_rows_by_channels(n_rows, channels, dtype):
    """[rows, C], as the fused Linear blocks' [T, B, C]: every vector width, one row (variance
    0: invstd = 1/sqrt(eps)), a partial last chunk."""
    g = gen(seed_of(n_rows, channels, dtype), device="cuda")
    rows = (torch.randn(n_rows, channels, generator=g, device="cuda") * 0.7 + 0.3).to(dtype)
    check(rows, rows)


@pytest.mark.parametrize("dtype", DTYPES)
def test_misaligned_data_takes_narrower_loads(dtype):
    """Data starting one element past a 16-byte boundary: one channel per thread."""
    g = gen(seed_of("misaligned", dtype), device="cuda")
    storage = torch.randn(1000 * 128 + 1, generator=g, device="cuda").to(dtype)
    rows = storage[1:].view(1000, 128)
    assert cs.vector_width(128, rows.element_size(), rows.data_ptr()) == 1
    check(rows, rows)


def test_large_mean_small_variance():
    """mean 1000, std 0.01 in float32: the variance keeps its digits (float32 sums of squares
    lose all of them); torch's error is recorded for comparison."""
    g = gen(7, device="cuda")
    rows = (
        torch.randn(655360, 4, generator=g, device="cuda", dtype=torch.float64) * 0.01 + 1000
    ).float()
    _, want_invstd = reference(rows, 0.0)
    want_var = want_invstd**-2
    mean, invstd = cs.channel_stats(rows, 0.0)
    assert reldiff(mean, reference(rows, 0.0)[0]) <= EXACT
    error = reldiff(invstd.double() ** -2, want_var)
    torch_error = reldiff(torch.batch_norm_stats(rows, 0.0)[1].double() ** -2, want_var)
    assert error <= 1e-5, f"variance: relative error {error:.1e} (torch: {torch_error:.1e})"


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_and_inf_give_non_finite_statistics(dtype):
    """NaN or ±Inf in a channel (also in row 0, the kernel's pivot): a non-finite mean and a NaN
    invstd, never finite statistics from non-finite input; other channels unaffected."""
    g = gen(seed_of("nan", dtype), device="cuda")
    rows = torch.randn(5000, 16, generator=g, device="cuda").to(dtype)
    rows[0, 1] = math.nan
    rows[4000, 2] = math.inf
    rows[10, 3] = -math.inf
    rows[0, 4] = math.inf
    rows[1, 5], rows[2, 5] = math.inf, -math.inf
    rows[4999, 6] = math.nan
    mean, invstd = cs.channel_stats(rows, 1e-5)
    bad = list(range(1, 7))
    assert not mean[bad].isfinite().any(), mean[bad]
    assert invstd[bad].isnan().all(), invstd[bad]
    good = [0, *range(7, 16)]
    want_mean, want_invstd = reference(rows[:, good], 1e-5)
    assert mean_error(mean[good], want_mean, want_invstd) <= EXACT
    assert reldiff(invstd[good], want_invstd) <= EXACT


def test_zero_variance_and_zero_eps():
    """As torch.batch_norm_stats: invstd 0 where the variance and eps are both 0."""
    rows = torch.full((300, 9), 2.5, device="cuda")
    mean, invstd = cs.channel_stats(rows, 0.0)
    assert torch.equal(mean, torch.full_like(mean, 2.5)) and torch.equal(
        invstd, torch.zeros(9, device="cuda")
    )
    _, invstd = cs.channel_stats(rows, 0.25)
    assert torch.allclose(invstd, torch.full_like(invstd, 2.0))


def test_deterministic():
    rows = torch.randn(655360, 128, device="cuda").to(torch.bfloat16)
    first, second = cs.channel_stats(rows, 1e-5), cs.channel_stats(rows, 1e-5)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_side_stream_and_cuda_graph():
    """Launches go to the current stream, and a captured call replays on new data."""
    rows = torch.randn(4096, 256, device="cuda")
    want = cs.channel_stats(rows, 1e-5)  # also loads the kernels: capture cannot
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = cs.channel_stats(rows, 1e-5)
    torch.cuda.current_stream().wait_stream(side)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = cs.channel_stats(rows, 1e-5)
    rows.copy_(torch.randn_like(rows) * 3 + 1)
    graph.replay()
    want = cs.channel_stats(rows, 1e-5)
    assert all(torch.equal(a, b) for a, b in zip(captured, want, strict=True))


# ---- in the fused blocks ------------------------------------------------------------------------
@pytest.fixture
def kernel_calls(monkeypatch):
    """The [rows, C] shapes the fused blocks' statistics pass to the kernel."""
    calls = []

    def counted(rows, eps, running=None):
        calls.append(tuple(rows.shape))
        return cs.channel_stats(rows, eps, running)

    kernels = SimpleNamespace(channel_stats=counted)
    monkeypatch.setattr(statistics, "_channel_stats", lambda y: kernels)
    monkeypatch.setattr(statistics, "_KERNEL_MIN_ELEMENTS", 0)  # these nets' maps are small
    return calls


@pytest.mark.quick
def test_fused_model_uses_the_kernel_and_matches_unfused(kernel_calls, no_tf32):
    """The paper's small CNN (two Conv2d blocks, channels-last; a Linear block) fused: every
    block's statistics from the kernel, and output, gradients and running statistics within 1e-4
    of the unfused Conv2d -> BatchNorm2d -> LIFNode network (fp32)."""
    model = paper_net()
    fused = fuse(model)
    x = torch.randn(4, 8, 3, 16, 16, device="cuda")
    want = training_step(model, x, False)
    got = training_step(fused, x, False)
    assert kernel_calls == [(4 * 8 * 16 * 16, 16), (4 * 8 * 8 * 8, 32), (4 * 8, 64)]
    errors = {k: reldiff(got[k], w) for k, w in want.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-4, f"{worst}: normalised error {errors[worst]:.2e}"


def test_fused_conv_block_matches_unfused(kernel_calls, no_tf32):
    """FusedConvBNNeuron forward and backward (two steps: the second normalises after the
    first's running-statistics update, then eval) against Conv2d -> BatchNorm2d -> LIFNode."""
    torch.manual_seed(0)
    block = FusedConvBNNeuron(3, 24, 3, padding=1, node=paper_lif(backend="cuda")).cuda()
    with torch.no_grad():
        block.bn.weight.uniform_(0.5, 1.5)
        block.bn.bias.uniform_(-0.2, 0.4)
    unfused = nn.Sequential(
        layer.Conv2d(3, 24, 3, padding=1, bias=False, step_mode="m"),
        layer.BatchNorm2d(24, step_mode="m"),
        paper_lif(backend="cuda"),
    ).cuda()
    unfused[0].load_state_dict(block.synapse.state_dict())
    unfused[1].load_state_dict(block.bn.state_dict())
    unfused = unfused.to(memory_format=torch.channels_last)
    x = torch.rand(6, 4, 3, 12, 12, device="cuda") * 2
    for train in (True, True, False):
        results = []
        for net in (block, unfused):
            net.train(train)
            xs = x.clone().requires_grad_()
            out = net(xs)
            (out * torch.linspace(-1, 1, out.numel(), device="cuda").view_as(out)).sum().backward()
            grads = [p.grad.clone() for p in net.parameters()]
            net.zero_grad(set_to_none=True)
            functional.reset_net(net)
            results.append([out.detach(), xs.grad, *grads, *net.buffers()])
        for got, want in zip(*results, strict=True):
            assert reldiff(got.float(), want.float()) < 1e-4
    assert len(kernel_calls) == 2  # the two training steps; eval uses the running statistics


def test_fused_conv1d_keeps_torch_statistics(kernel_calls):
    """A contiguous Conv1d output has its channels outside the length: torch's kernel."""
    model = nn.Sequential(
        layer.Conv1d(3, 8, 3, padding=1, bias=False, step_mode="m"),
        layer.BatchNorm1d(8, step_mode="m"),
        neuron.LIFNode(step_mode="m", backend="cuda"),
    ).cuda()
    fused, report = fuse(model, return_report=True)
    assert report.fused_fraction == 1.0, str(report)
    fused(torch.randn(2, 4, 3, 20, device="cuda")).sum().backward()
    assert kernel_calls == []


@pytest.mark.parametrize("route", ["kernel", "torch"])
@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "cumulative"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_bn_statistics_running_update_matches_torch(dtype, momentum, route, monkeypatch):
    """bn_statistics on channels-last bf16/fp16/fp32 y, by the kernel (which also counts the
    batch and updates the running statistics in its two launches) or by torch's ops, against
    torch.batch_norm_stats and BatchNorm's update, over two training calls."""
    if route == "kernel":
        monkeypatch.setattr(statistics, "_KERNEL_MIN_ELEMENTS", 0)
    g = gen(seed_of("running", dtype), device="cuda")
    running = [torch.zeros(32, device="cuda"), torch.ones(32, device="cuda")]
    tracked = torch.tensor(2, device="cuda")
    spec = BNSpec(None, None, *running, True, momentum, 1e-5, num_batches_tracked=tracked)
    bn = nn.BatchNorm2d(32, momentum=momentum).cuda().train()
    bn.num_batches_tracked.fill_(2)
    for _ in range(2):
        y = (torch.randn(40, 32, 6, 6, generator=g, device="cuda") + 0.5).to(dtype)
        y = y.contiguous(memory_format=torch.channels_last).unflatten(0, (5, 8))
        stats = bn_statistics(y, spec)
        flat = y.flatten(0, 1)
        want_mean, want_invstd = torch.batch_norm_stats(flat, 1e-5)
        bn(flat.float())
        assert mean_error(stats.mean, want_mean, want_invstd) <= TORCH
        assert reldiff(stats.invstd, want_invstd) <= TORCH
    assert tracked.item() == bn.num_batches_tracked.item() == 4
    assert reldiff(running[0], bn.running_mean) <= TORCH
    assert reldiff(running[1], bn.running_var) <= TORCH


def test_distributed_local_statistics_use_the_kernel(kernel_calls):
    """Each process's local (mean, var) before the all-reduce: the kernel on channels-last y."""
    y = torch.randn(40, 16, 5, 5, device="cuda").contiguous(memory_format=torch.channels_last)
    y = y.unflatten(0, (5, 8))
    mean, var = statistics.local_mean_var(y)
    assert kernel_calls == [(5 * 8 * 25, 16)]
    want_var, want_mean = torch.var_mean(y.double(), dim=(0, 1, 3, 4), correction=0)
    assert mean_error(mean, want_mean, want_var.rsqrt()) <= EXACT
    assert reldiff(var, want_var) <= 4 * EXACT  # from invstd: var = invstd^-2


def test_timing_helper_runs(capsys):
    cs.benchmark(repeats=2)
    out = capsys.readouterr().out
    assert out.count("bfloat16") == len(cs.MEDIUM_NET_SHAPES)
