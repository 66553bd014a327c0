"""The float32 Linear on spikes over bf16 terms on the GPU (spikefuse.fused.spike_linear): the
split kernel writes the torch path's bits, the Function is as accurate as the float32 matmul, a
fused Linear block on a pooled block's means takes it under CUDA graph capture (eagerly: the plain
matmul), and a training step through it equals the plain matmul's and replays in a CUDA graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from spikefuse import layer
from spikefuse.cuda import bf16_split as cuda_split
from spikefuse.fused import fuse, paper_lif, spike_linear, synapse
from spikefuse.fused.recompute import mark_spikes
from spikefuse.fused.spike_linear import SpikeLinearFunction, split_bf16

from .replay import assert_close_but_for_sum_order, eager_and_replayed_grads, step_grads

pytestmark = pytest.mark.gpu


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return ((value.double() - reference).norm() / reference.norm()).item()


@pytest.mark.quick
@pytest.mark.parametrize("n", [1, 1000, 3_000_001])
def test_the_kernel_writes_the_torch_splits_bits(n):
    g = torch.Generator(device="cuda").manual_seed(n)
    values = torch.randn(n, device="cuda", generator=g) * torch.logspace(-40, 38, n, device="cuda")
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.4e38, -1e-45, 0.0])
    values[: min(n, 6)] = specials[: min(n, 6)].cuda()
    got = cuda_split.split(values).cpu()
    want = split_bf16(values.cpu())  # the torch path
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)  # (the sign of a NaN may differ)
    # The same terms, but where a value is near float32's subnormals (under 2^-100: its last
    # terms are subnormal in bf16) the two may round its last term differently.
    normal = (values.abs() >= 2.0**-100).cpu() | ~values.isfinite().cpu()
    same = normal.expand_as(nan) & ~nan
    differ = (got[same].float() != want[same].float()).nonzero()[:3].flatten().tolist()
    assert not differ, [(got[same][i].item(), want[same][i].item()) for i in differ]
    tiny = ~normal
    error = (got[:, tiny].double().sum(0) - want[:, tiny].double().sum(0)).abs()
    assert (error <= 2.0**-126).all()


@pytest.mark.quick
def test_the_function_is_as_accurate_as_the_float32_matmul():
    """[640, 4096] spikes x [1024, 4096] weights: the output and the weight gradient are at
    least as close to float64 as the float32 matmul's (measured about 8e-8 against 3e-7); the
    input and bias gradients are the float32 ones."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.rand(640, 4096, device="cuda", generator=g) < 0.2).float()
    w = torch.randn(1024, 4096, device="cuda", generator=g) / 64
    b = torch.randn(1024, device="cuda", generator=g)
    grad = torch.randn(640, 1024, device="cuda", generator=g) * 1e-3
    results = []
    for function in (SpikeLinearFunction.apply, F.linear):
        leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
        y = function(*leaves)
        y.backward(grad)
        results.append([y, *(t.grad for t in leaves)])
    leaves = [t.detach().double().requires_grad_() for t in (x, w, b)]
    y64 = F.linear(*leaves)
    y64.backward(grad.double())
    want = [y64, *(t.grad for t in leaves)]
    for ours, float32, reference in zip(*results, want, strict=True):
        assert relative_error(ours, reference) <= 1.01 * relative_error(float32, reference) + 1e-8
    assert (
        relative_error(results[0][0], y64) < 1e-7 and relative_error(results[0][2], want[2]) < 1e-7
    )


def pooled_then_linear() -> nn.Sequential:
    """Conv-BN-LIF-AvgPool(2) (the kernels pool and pack the 2 x 2 means), Flatten, a Linear
    block on those means, a Linear block on its spikes, a classifier: the medium net's tail."""
    torch.manual_seed(0)
    return nn.Sequential(
        layer.Conv2d(3, 64, 3, padding=1, bias=False, step_mode="m"),
        layer.BatchNorm2d(64, step_mode="m"),
        paper_lif(),
        layer.AvgPool2d(2, step_mode="m"),
        layer.Flatten(step_mode="m"),
        layer.Linear(64 * 8 * 8, 1024, bias=False, step_mode="m"),
        layer.BatchNorm1d(1024, step_mode="m"),
        paper_lif(),
        layer.Linear(1024, 4096, bias=False, step_mode="m"),
        layer.BatchNorm1d(4096, step_mode="m"),
        paper_lif(),
        nn.Linear(4096, 10),
    ).cuda()


@pytest.mark.quick
def test_fused_linear_blocks_split_under_capture_and_match_the_plain_matmul(no_tf32, monkeypatch):
    """Both Linear blocks of :func:`pooled_then_linear` (T=4, B=128: 512 rows) run the plain
    matmul eagerly and take the split path in a CUDA graph capture (the eager warm-up loads the
    split kernel). A training step through the split path (forced eagerly) equals the plain
    matmul's to float32 rounding (and the rare spike that rounding flips), eager and replayed;
    so does a replay captured the usual way against its eager warm-up."""
    x = torch.rand(
        4, 128, 3, 16, 16, device="cuda", generator=torch.Generator("cuda").manual_seed(0)
    )
    taken, takes_split_path = [], synapse.takes_split_path

    def spy(inputs: torch.Tensor, weight: torch.Tensor) -> bool:
        taken.append(takes_split_path(inputs, weight))
        return taken[-1]

    monkeypatch.setattr(synapse, "takes_split_path", spy)
    captured = fuse(pooled_then_linear())
    eager, (replayed,) = eager_and_replayed_grads(captured, x)
    assert taken == [False] * 4 + [True] * 2  # warm-up and eager steps, then the capture
    assert_equal_but_for_spikes_rounding_flips(replayed, eager)

    want = step_grads(fuse(pooled_then_linear()), x)
    monkeypatch.setattr(spike_linear, "is_current_stream_capturing", lambda: True)
    split = fuse(pooled_then_linear())
    taken.clear()
    got = step_grads(split, x)
    assert taken == [True, True]
    assert_equal_but_for_spikes_rounding_flips(got, want)
    eager, (replayed,) = eager_and_replayed_grads(split, x)
    assert_close_but_for_sum_order(replayed, eager)


def assert_equal_but_for_spikes_rounding_flips(got: list, want: list) -> None:
    """The split path's gradients against the plain matmul's. Rounding that differs from the
    plain matmul's (8e-8 against 3e-7 of float64) flips the spikes whose potential sits on the
    threshold among the 2 x 8.4 M neurons of the Linear blocks, which moves the gradients
    behind them: the first convolution's, which sums over all of them, by 1.2e-3 - 1.8e-3 of
    its norm on random inputs. Equal to 5e-3 of each norm."""
    for g, w in zip(got, want, strict=True):
        assert (g - w).norm() <= 5e-3 * w.norm() + 1e-6


def test_autocast_and_tf32_keep_the_plain_matmul(monkeypatch):
    """Under bf16 autocast or with TF32 matmuls allowed a Linear block on spikes runs F.linear
    (also in a capture: forced here, eagerly)."""
    from spikefuse.fused import FusedBlock

    monkeypatch.setattr(spike_linear, "is_current_stream_capturing", lambda: True)
    block = FusedBlock(nn.Linear(4096, 1024).cuda(), nn.BatchNorm1d(1024).cuda(), paper_lif())
    spikes = (torch.rand(4, 128, 4096, device="cuda") < 0.2).float()
    calls = []
    monkeypatch.setattr(SpikeLinearFunction, "apply", lambda *a: calls.append(1) or F.linear(*a))
    block(mark_spikes(spikes.clone()))
    assert calls == [1]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        block(mark_spikes(spikes.clone()))
    precision = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        block(mark_spikes(spikes.clone()))
    finally:
        torch.set_float32_matmul_precision(precision)
    assert calls == [1]
