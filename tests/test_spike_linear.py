"""The float32 Linear on spikes over bf16 terms (spikefuse.fused.spike_linear), on the CPU:
the split, the Function against float64, when a fused block takes it, and the block's result."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from spikefuse import layer
from spikefuse.cuda import bf16_split as cuda_split
from spikefuse.errors import SpikefuseError
from spikefuse.fused import SpikePool, fuse, spike_linear, synapse
from spikefuse.fused.recompute import (
    mark_means,
    mark_recomputable,
    mark_spikes,
    means_window,
    recipe_of,
)
from spikefuse.fused.spike_linear import (
    SpikeLinearFunction,
    full_float32_matmul,
    holds_bf16_exact_spikes,
    split_bf16,
    takes_split_path,
)
from test_codegen import assert_compiles_without_spills, needs_nvcc
from test_fused import FP32_TOL, assert_same_training_step, lif, randomize_bn, saved_bytes

pytestmark = pytest.mark.usefixtures("one_thread")


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return ((value.double() - reference).norm() / reference.norm()).item()


def test_split_terms_sum_to_the_value_within_2_to_the_minus_24():
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(4096, generator=gen) * torch.logspace(-30, 30, 4096)
    terms = split_bf16(t)
    assert terms.shape == (3, 4096) and terms.dtype == torch.bfloat16
    total = terms.double().sum(0)
    assert ((total - t.double()).abs() <= t.double().abs() * 2.0**-24).all()
    assert (terms[0].float() == t.to(torch.bfloat16).float()).all()  # hi: the nearest bf16


def test_split_never_makes_a_non_finite_value_finite():
    t = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.4e38])
    terms = split_bf16(t)
    assert terms[:, 0].isnan().all()  # NaN: NaN in every term
    assert terms[1:, 1:3].isnan().all()  # infinite: NaN below
    assert terms[0, 3] == float("inf") and terms[1, 3] == -float("inf")  # past bf16's largest
    x = torch.ones(1, 4, dtype=torch.bfloat16)
    for column in range(4):
        w = torch.zeros(1, 4)
        w[0, column] = t[column]
        assert SpikeLinearFunction.apply(x.float(), w, None).isnan().all()


def spikes(rows: int, features: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(rows, features, generator=gen) < 0.3).float()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("means", [False, True], ids=["spikes", "2x2-means"])
def test_function_matches_float64_at_float32_accuracy(bias, means):
    """Forward and every gradient within float32 rounding of float64 (the float32 F.linear's
    own error is of the same size)."""
    gen = torch.Generator().manual_seed(1)
    x = spikes(96, 200)
    if means:  # the values a pooled block's 2 x 2 means take: multiples of 1/4
        x = x * torch.randint(1, 5, x.shape, generator=gen) / 4
    w = (torch.randn(48, 200, generator=gen) / 14).requires_grad_()
    b = torch.randn(48, generator=gen).requires_grad_() if bias else None
    x.requires_grad_()
    g = torch.randn(96, 48, generator=gen)
    y = SpikeLinearFunction.apply(x, w, b)
    y.backward(g)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    b64 = None if b is None else b.detach().double().requires_grad_()
    y64 = F.linear(x64, w64, b64)
    y64.backward(g.double())
    assert relative_error(y, y64) < 1e-6
    assert relative_error(x.grad, x64.grad) < 1e-6
    assert relative_error(w.grad, w64.grad) < 1e-6
    if b is not None:
        assert relative_error(b.grad, b64.grad) < 1e-6


def test_function_refuses_double_backward():
    x, w = spikes(4, 6), torch.randn(3, 6, requires_grad=True)
    y = SpikeLinearFunction.apply(x, w, None)
    with pytest.raises(SpikefuseError, match="double backward"):
        torch.autograd.grad(y.sum(), w, create_graph=True)


def test_exact_values_are_known_from_tags_only():
    x = spikes(8, 8)
    assert not holds_bf16_exact_spikes(x)  # values alone say nothing: no tag
    assert holds_bf16_exact_spikes(mark_spikes(x.clone()).view(4, 16))
    for window, exact in ((4, True), (16, True), (9, False), (1024, False)):
        assert holds_bf16_exact_spikes(mark_means(torch.zeros(8, 8), window).flatten()) is exact
    edited = mark_spikes(x.clone())
    edited.add_(0.1)  # an in-place edit drops the tag
    assert not holds_bf16_exact_spikes(edited)


@pytest.mark.parametrize(
    "pool, window",
    [
        (layer.AvgPool2d(2, step_mode="m"), 4),
        (layer.AvgPool2d(3, step_mode="m"), 9),
        (layer.MaxPool2d(2, step_mode="m"), 1),
        (layer.AvgPool2d(3, stride=1, step_mode="m"), None),  # overlapping windows
    ],
)
def test_spike_pooling_tags_its_output_with_the_spikes_behind_a_value(pool, window):
    x = mark_spikes((torch.rand(2, 3, 4, 6, 6) > 0.5).float())
    out = SpikePool(pool)(x)
    assert means_window(out) == window
    assert means_window(SpikePool(layer.AvgPool2d(2, step_mode="m"))(out)) == (
        None if window is None else 4 * window
    )


def test_a_flattened_copy_keeps_the_tags_and_the_recipe():
    """Flatten of a channels-last map copies it: fuse's hook puts the map's tags and the
    flattening of its recipe on the copy."""
    model = fuse(nn.Sequential(layer.Flatten(step_mode="m")))
    recomputed = []

    def recipe() -> torch.Tensor:
        recomputed.append(1)
        return source.detach().clone().contiguous(memory_format=torch.channels_last)

    for tag in (mark_spikes, lambda t: mark_means(t, 4)):
        maps = (torch.rand(6, 4, 5, 5) > 0.5).float().contiguous(memory_format=torch.channels_last)
        source = tag(maps)
        mark_recomputable(source, recipe)
        out = model(source.unflatten(0, (2, 3)))
        assert out.untyped_storage().data_ptr() != source.untyped_storage().data_ptr()  # a copy
        assert means_window(out) == means_window(source)
        assert torch.equal(recipe_of(out)(), out) and recomputed


def test_which_matmuls_take_the_split_path(monkeypatch):
    x, w = mark_spikes(spikes(512, 4096)), torch.zeros(1024, 4096)
    loaded = []
    assert not takes_split_path(x, w) and not loaded  # the CPU: never
    kernels = SimpleNamespace(load=loaded.append)
    monkeypatch.setattr(spike_linear, "capability", lambda name, t: kernels)  # as on a GPU
    monkeypatch.setattr(spike_linear, "is_current_stream_capturing", lambda: False)
    # eager: the plain matmul, with the split kernel loaded for a later capture of the step
    assert not takes_split_path(x, w) and loaded == [x.device]
    monkeypatch.setattr(spike_linear, "is_current_stream_capturing", lambda: True)
    assert takes_split_path(x, w)
    assert not takes_split_path(x[:128], w)  # too few rows to pay for splitting W
    assert not takes_split_path(x, w[:256])  # too little work
    assert not takes_split_path(spikes(512, 4096), w)  # untagged
    assert not takes_split_path(mark_spikes(x.double()), w.double())  # float32 only
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not takes_split_path(x, w)
    precision = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")  # TF32 allowed: the plain matmul is faster
        assert not full_float32_matmul() and not takes_split_path(x, w)
    finally:
        torch.set_float32_matmul_precision(precision)
    assert full_float32_matmul()


def linear_stack() -> nn.Sequential:
    """Conv-BN-LIF-AvgPool(2), Flatten, two Linear-BN-LIF blocks (on the 2 x 2 means, then on
    spikes), a classifier."""
    torch.manual_seed(0)
    model = nn.Sequential(
        layer.Conv2d(3, 4, 3, padding=1, bias=False, step_mode="m"),
        layer.BatchNorm2d(4, step_mode="m"),
        lif(),
        layer.AvgPool2d(2, step_mode="m"),
        layer.Flatten(step_mode="m"),
        layer.Linear(4 * 3 * 3, 32, step_mode="m"),
        layer.BatchNorm1d(32, step_mode="m"),
        lif(),
        layer.Linear(32, 24, bias=True, step_mode="m"),
        layer.BatchNorm1d(24, step_mode="m"),
        lif(),
        nn.Linear(24, 10),
    )
    randomize_bn(model)
    return model


def test_fused_linear_blocks_on_spikes_match_the_unfused_model(monkeypatch):
    """The split path (forced on the CPU, where it computes the same float32 sums of exact
    products) gives the unfused model's training step, for the Linear blocks whose input is
    spikes, and keeps their input as its recipe as F.linear does (no more saved bytes)."""
    ref = linear_stack()
    x = torch.randn(3, 4, 3, 6, 6) * 2
    default_saved = saved_bytes(fuse(linear_stack()), x)
    taken = []

    def split_on_spikes(inputs, weight):
        taken.append(holds_bf16_exact_spikes(inputs))
        return taken[-1]

    monkeypatch.setattr(synapse, "takes_split_path", split_on_spikes)
    fused = fuse(linear_stack())
    assert_same_training_step(ref, fused, x, FP32_TOL)
    assert taken == [True, True]  # the means of the pooled block, then the first's spikes
    assert saved_bytes(fused, x) == default_saved


@needs_nvcc
def test_the_split_kernel_compiles_with_nvcc(tmp_path):
    assert_compiles_without_spills(tmp_path, [cuda_split.source()], ("SPLIT_KERNEL",))
