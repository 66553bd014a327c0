"""spike_max_pool2d on the GPU (the cuda backend's ``max_pool`` kernels): values and gradients
equal F.max_pool2d's exactly in float32, float16 and bfloat16, NCHW and channels-last, on spike
maps with ties and all-zero windows, padding, dilation and ceil_mode; channels-last maps with C a
multiple of the vector width run the vector kernels (NaN and -inf too), misaligned ones the
scalar kernels, both exact; a captured CUDA graph replays it; and a fused SEW-ResNet-18 step,
whose stem max-pools this way, equals the unfused one."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from conftest import gen, reldiff
from spikefuse import fuse
from spikefuse.cuda import spike_max_pool as kernels
from spikefuse.fused import spike_max_pool2d
from spikefuse.fused.ops.spike_max_pool import MaxPoolGeometry
from spikefuse.fused.ops.spike_max_pool import autograd as op_autograd

from .test_fused_gpu import residual_net, training_step

pytestmark = [pytest.mark.gpu, pytest.mark.quick]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (kernel_size, stride, padding, dilation, ceil_mode)
GEOMETRIES = [
    (3, 2, 1, 1, False),
    (2, 2, 0, 1, False),
    (3, 2, 1, 1, True),
    (3, 1, 1, 2, False),
    ((3, 2), (2, 1), (1, 0), (1, 2), True),
]
GEOMETRY_IDS = ["stem", "2x2", "stem-ceil", "dilated", "rect"]
# [N, C, H, W]: the stem's channels at a small map, odd sizes, more than one block per channel
SHAPES = [(8, 64, 28, 28), (6, 5, 9, 11), (2, 130, 7, 5)]


def spike_map(shape, density: float, dtype: torch.dtype, channels_last: bool) -> torch.Tensor:
    x = (torch.rand(shape, device="cuda", generator=gen(7, "cuda")) < density).to(dtype)
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


def pooled_and_grad(pool, x: torch.Tensor, upstream: torch.Tensor):
    x = x.detach().clone().requires_grad_()
    out = pool(x)
    out.backward(upstream)
    return out.detach(), x.grad


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=GEOMETRY_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("density", [0.0, 0.2, 1.0])
def test_kernels_equal_max_pool2d(geometry, dtype, channels_last, density, monkeypatch):
    """Bit for bit, against ATen's NCHW kernels (which sum overlapping windows' gradients in
    float, in the same order); the output and gradient keep x's layout; the cuda kernels ran."""
    calls = []
    forward = kernels.max_pool_forward
    monkeypatch.setattr(kernels, "max_pool_forward", lambda *a: calls.append(1) or forward(*a))
    for shape in SHAPES:
        x = spike_map(shape, density, dtype, channels_last)
        out_shape = F.max_pool2d(x[:1, :1].float(), *geometry[:4], ceil_mode=geometry[4]).shape
        upstream = torch.randn(
            (shape[0], shape[1], *out_shape[2:]), device="cuda", generator=gen(3, "cuda")
        ).to(dtype)
        got = pooled_and_grad(lambda t: spike_max_pool2d(t, *geometry), x, upstream)
        want = pooled_and_grad(
            lambda t: F.max_pool2d(t, *geometry[:4], ceil_mode=geometry[4]),
            x.contiguous(),
            upstream.contiguous(),
        )
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), shape
        layout = torch.channels_last if channels_last else torch.contiguous_format
        assert got[0].is_contiguous(memory_format=layout)
        assert got[1].is_contiguous(memory_format=layout)
    assert len(calls) == len(SHAPES)


# Channels-last maps whose C is a multiple of every dtype's vector width (8 for 16-bit storage):
# odd sizes, and the SEW-ResNet stem's map at a smaller batch.
VECTOR_SHAPES = [(4, 64, 17, 19), (4, 64, 112, 112)]


def spy_launches(monkeypatch) -> list[str]:
    """The names of the kernels launched from now on."""
    names: list[str] = []
    launch = kernels.launch_named

    def spy(source, name, *rest):
        names.append(name)
        return launch(source, name, *rest)

    monkeypatch.setattr(kernels, "launch_named", spy)
    return names


def assert_equal_to_max_pool2d(got, x: torch.Tensor, geometry, upstream: torch.Tensor) -> None:
    """(out, dL/dx) equal F.max_pool2d's on NCHW copies (ATen's NCHW kernels), NaN where NaN."""
    want = pooled_and_grad(
        lambda t: F.max_pool2d(t, *geometry[:4], ceil_mode=geometry[4]),
        x.contiguous(),
        upstream.contiguous(),
    )
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.nan_to_num(7.0), w.nan_to_num(7.0))


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=GEOMETRY_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_vector_kernels_equal_max_pool2d(geometry, dtype, monkeypatch):
    """Channels-last maps with C % 8 == 0 run the vector kernels in both directions; values and
    gradients equal max_pool2d's bit for bit with ties, all-zero windows, NaN and -inf."""
    names = spy_launches(monkeypatch)
    pair = kernels.kernels_for(dtype, MaxPoolGeometry.of(*geometry).window)
    for shape in VECTOR_SHAPES:
        x = spike_map(shape, 0.2, dtype, True)
        x[0, 3, 0, :4] = float("nan")
        x[1, :, 2:9, 2:9] = 0.0
        x[2, 5, :3, :3] = float("-inf")
        out_shape = F.max_pool2d(x[:1, :1].float(), *geometry[:4], ceil_mode=geometry[4]).shape
        upstream = torch.randn(
            (shape[0], shape[1], *out_shape[2:]), device="cuda", generator=gen(3, "cuda")
        ).to(dtype)
        upstream = upstream.contiguous(memory_format=torch.channels_last)
        got = pooled_and_grad(lambda t: spike_max_pool2d(t, *geometry), x, upstream)
        assert_equal_to_max_pool2d(got, x, geometry, upstream)
        assert got[0].is_contiguous(memory_format=torch.channels_last)
        assert got[1].is_contiguous(memory_format=torch.channels_last)
    vector = [pair.name(False, pair.vec), pair.name(True, pair.vec)]
    assert names == vector * len(VECTOR_SHAPES)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_an_nchw_gradient_of_a_channels_last_pooling_takes_the_vector_backward(dtype, monkeypatch):
    """A neuron after a channels-last pooling hands back an NCHW gradient: it is laid out like
    the codes first, so the backward reads it coalesced with the vector kernel, exactly."""
    names = spy_launches(monkeypatch)
    geometry = (3, 2, 1, 1, False)
    pair = kernels.kernels_for(dtype, MaxPoolGeometry.of(*geometry).window)
    x = spike_map((4, 64, 17, 19), 0.2, dtype, True).requires_grad_()
    upstream = torch.randn(4, 64, 9, 10, device="cuda", generator=gen(3, "cuda")).to(dtype)
    out = spike_max_pool2d(x, *geometry)
    (grad,) = torch.autograd.grad(out, x, upstream)
    assert_equal_to_max_pool2d((out.detach(), grad), x.detach(), geometry, upstream)
    assert grad.is_contiguous(memory_format=torch.channels_last)
    assert names == [pair.name(False, pair.vec), pair.name(True, pair.vec)]


def misaligned(t: torch.Tensor) -> torch.Tensor:
    """A channels-last dense copy of t one element past a 16-byte boundary."""
    n, c, h, w = t.shape
    buffer = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    return buffer[1:].view(n, h, w, c).permute(0, 3, 1, 2).copy_(t)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_misaligned_tensors_take_the_scalar_kernels_exactly(dtype, monkeypatch):
    """A channels-last input one element off alignment pools with the scalar forward kernel; a
    misaligned output gradient takes the scalar backward, an aligned one the vector backward;
    all equal max_pool2d's bit for bit."""
    names = spy_launches(monkeypatch)
    geometry = (3, 2, 1, 1, False)
    pair = kernels.kernels_for(dtype, MaxPoolGeometry.of(*geometry).window)
    x = misaligned(spike_map((4, 64, 17, 19), 0.2, dtype, True)).requires_grad_()
    assert x.is_contiguous(memory_format=torch.channels_last) and x.data_ptr() % 16
    aligned = torch.randn(4, 64, 9, 10, device="cuda", generator=gen(3, "cuda")).to(dtype)
    aligned = aligned.contiguous(memory_format=torch.channels_last)
    for upstream, backward_vec in ((misaligned(aligned), 1), (aligned, pair.vec)):
        out = spike_max_pool2d(x, *geometry)
        (grad,) = torch.autograd.grad(out, x, upstream)
        assert_equal_to_max_pool2d((out.detach(), grad), x.detach(), geometry, upstream)
        assert names[-2:] == [pair.name(False, 1), pair.name(True, backward_vec)]


def test_a_captured_graph_replays_the_pooling():
    x = spike_map((4, 16, 20, 20), 0.3, torch.float32, True).requires_grad_()
    upstream = torch.randn(4, 16, 10, 10, device="cuda").contiguous(
        memory_format=torch.channels_last
    )
    want = pooled_and_grad(lambda t: F.max_pool2d(t, 3, 2, 1), x, upstream)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        pooled_and_grad(lambda t: spike_max_pool2d(t, 3, 2, 1), x, upstream)  # loads the kernels
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # autograd.grad: no leaf gradient accumulated elsewhere
        out = spike_max_pool2d(x, 3, 2, 1)
        (grad,) = torch.autograd.grad(out, x, upstream)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want[0]) and torch.equal(grad, want[1])


def test_fused_sew_resnet18_step_max_pools_its_stem_with_the_kernels(no_tf32, monkeypatch):
    """SEW-ResNet-18 (32 x 32, T = 4): the stem's maxpool runs the kernels (a byte per window
    kept) and the fused step equals the unfused one within 1e-4 in float32."""
    model = residual_net("sew_resnet18")
    fused, report = fuse(model, return_report=True)
    assert report.spike_max_pools == ["maxpool"], str(report)
    saved: list[torch.Tensor] = []
    backward = op_autograd.max_pool_backward

    def spy(grad, codes, *rest):
        saved.append(codes)
        return backward(grad, codes, *rest)

    monkeypatch.setattr(op_autograd, "max_pool_backward", spy)
    x = torch.rand(4, 4, 3, 32, 32, device="cuda") * 2
    for _ in range(2):  # the second step sees the first one's running statistics
        want = training_step(model, x, False)
        got = training_step(fused, x, False)
    assert [c.dtype for c in saved] == [torch.uint8, torch.uint8]
    errors = {k: reldiff(got[k], w) for k, w in want.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-4, f"{worst}: normalised error {errors[worst]:.2e}"
