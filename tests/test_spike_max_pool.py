"""spike_max_pool2d (spikefuse.fused.ops.spike_max_pool) on the CPU: values, gradients and
layouts equal F.max_pool2d's exactly (ties, all-zero windows, padding, dilation, ceil_mode, odd
maps, channels-last, NaN and -inf); what it keeps for backward; what it refuses; SpikePool and
fuse() using it in the ResNets; and the cuda kernels' source, compiled with nvcc and run on the
CPU as C++ through the launcher's packed arguments (the vector kernels against the scalar ones,
bit for bit, in every dtype). Which tensors take the vector kernels:
tests/test_spike_max_pool_vectors.py; GPU runs: tests/gpu/test_spike_max_pool_gpu.py.
"""

from __future__ import annotations

import ctypes
import itertools
import re
import shutil
import subprocess

import pytest
import torch

from spikefuse import backends, fuse, layer
from spikefuse.cuda import spike_max_pool as kernels
from spikefuse.errors import SpikefuseError
from spikefuse.fused import SpikePool, pooling, spike_max_pool2d
from spikefuse.fused.ops import spike_max_pool as op
from spikefuse.fused.ops.spike_max_pool import MaxPoolGeometry, pool_spikes, spike_max_pool2d_naive
from spikefuse.fused.ops.spike_max_pool.passes import memory_format_of, pool_backward, pool_forward
from spikefuse.fused.recompute import (
    mark_means,
    mark_recomputable,
    mark_spikes,
    packing_of,
    recipe_of,
)
from test_codegen import assert_compiles_without_spills, needs_nvcc

pytestmark = pytest.mark.usefixtures("one_thread")

# (kernel_size, stride, padding, dilation, ceil_mode): the ResNet stem's, VGG's, and awkward ones
GEOMETRIES = [
    (3, 2, 1, 1, False),
    (2, 2, 0, 1, False),
    (2, None, 0, 1, True),
    (3, 2, 1, 1, True),
    (3, 1, 1, 2, False),
    ((3, 2), (2, 1), (1, 0), (1, 2), True),
    (4, 3, 2, 1, True),
    (1, 1, 0, 1, False),
]
GEOMETRY_IDS = ["stem", "2x2", "2x2-ceil", "stem-ceil", "dilated", "rect", "4x4s3p2", "1x1"]


def spikes(shape, density: float, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=gen) < density).to(dtype)


def run(pool, x: torch.Tensor, upstream: torch.Tensor | None = None):
    """(out, dL/dx) for L = sum(out * upstream) (upstream: fixed random, with ties)."""
    x = x.detach().clone().requires_grad_()
    out = pool(x)
    if upstream is None:
        gen = torch.Generator().manual_seed(5)
        upstream = torch.randint(-3, 4, out.shape, generator=gen).to(out.dtype) / 4
    out.backward(upstream)
    return out.detach(), x.grad


def assert_same(got, want) -> None:
    """Equal values (NaN where NaN) and strides."""
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.nan_to_num(7.0), w.nan_to_num(7.0))
        assert g.stride() == w.stride() and g.dtype == w.dtype


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=GEOMETRY_IDS)
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("density", [0.0, 0.3, 1.0])
def test_spike_max_pool_equals_max_pool2d(geometry, channels_last, density):
    """Random spike maps (density 0: every window all zero; 1: every element tied), odd sizes,
    T*B merged: values, gradients and their layouts equal max_pool2d's."""
    x = spikes((2 * 3, 5, 9, 11), density, torch.float64)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    g = MaxPoolGeometry.of(*geometry)
    assert_same(
        run(lambda t: spike_max_pool2d(t, *geometry), x),
        run(lambda t: spike_max_pool2d_naive(t, g), x),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_exact_for_any_values_nan_and_minus_infinity(dtype):
    """Not only spikes: ATen's rule (greater, or NaN; -inf windows keep their first element
    inside the map) holds for any values, so the op is never silently wrong."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randint(-2, 3, (3, 4, 10, 9), generator=gen).to(dtype)
    x[0, 0, 2, 2:4] = float("nan")
    x[1, 1] = float("-inf")
    x[2, 2, :3, :3] = float("-inf")
    for geometry in GEOMETRIES:
        g = MaxPoolGeometry.of(*geometry)
        assert_same(
            run(lambda t, g=g: op.SpikeMaxPool2dFunction.apply(t, g), x),
            run(lambda t, g=g: spike_max_pool2d_naive(t, g), x),
        )


def test_sums_of_overlapping_windows_are_added_in_atens_order():
    """An input element that is the maximum of four overlapping windows (a 3 x 3 stride-1
    pooling of one spike) gets their gradients summed in ATen's order, bit for bit."""
    x = torch.zeros(1, 1, 5, 5)
    x[0, 0, 2, 2] = 1.0
    upstream = torch.tensor([1e8, 1.0, -1e8, 3.0, 0.5, 1e-8, 7.0, -3.0, 2.0]).view(1, 1, 3, 3)
    g = MaxPoolGeometry.of(3, 1, 0)
    want = run(lambda t: spike_max_pool2d_naive(t, g), x, upstream)
    assert_same(run(lambda t: spike_max_pool2d(t, 3, 1, 0), x, upstream), want)


def test_keeps_one_byte_per_output_value_and_nothing_without_a_gradient(monkeypatch):
    """Codes are written and kept only where a backward may follow: not under no_grad (a
    recipe recomputing the pooled map in backward) nor for an x needing no gradient."""
    keeps: list[bool] = []
    forward = op.autograd.max_pool_forward
    monkeypatch.setattr(
        op.autograd,
        "max_pool_forward",
        lambda x, g, keep: keeps.append(keep) or forward(x, g, keep),
    )
    x = spikes((4, 3, 12, 12), 0.3).requires_grad_()
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = spike_max_pool2d(x, 3, 2, 1)
        assert len(saved) == 1 and saved[0].dtype == torch.uint8 and saved[0].shape == out.shape
        with torch.no_grad():
            assert torch.equal(spike_max_pool2d(x, 3, 2, 1), out)
        assert torch.equal(spike_max_pool2d(x.detach(), 3, 2, 1), out)
    assert len(saved) == 1 and keeps == [True, False, False]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda x: spike_max_pool2d(x, 3, 2, 2), "at most half the kernel"),
        (lambda x: spike_max_pool2d(x, 17, 1, 0), "more than 256 elements"),
        (lambda x: spike_max_pool2d(x, 0), "kernel_size must be >= 1"),
        (lambda x: spike_max_pool2d(x, 2, 0), "stride must be >= 1"),
        (lambda x: spike_max_pool2d(x, 2, 2, -1), "padding must be >= 0"),
        (lambda x: spike_max_pool2d(x, (2, 2, 2)), "one or two ints"),
        (lambda x: spike_max_pool2d(x, 2, ceil_mode=1), "ceil_mode must be a bool"),
        (lambda x: spike_max_pool2d(x, (1, 40)), "empty"),
        (lambda x: spike_max_pool2d(x[0], 2), r"\[N, C, H, W\]"),
        (lambda x: spike_max_pool2d(x.to(torch.uint8), 2), "floating point"),
    ],
)
def test_refuses_what_max_pool2d_refuses(call, match):
    with pytest.raises(SpikefuseError, match=match):
        call(spikes((2, 3, 20, 20), 0.3))


def test_double_backward_is_refused():
    x = spikes((2, 3, 8, 8), 0.5).requires_grad_()
    out = spike_max_pool2d(x, 2)
    with pytest.raises(SpikefuseError, match="double backward"):
        torch.autograd.grad(out.sum(), x, create_graph=True)


def test_the_cuda_backend_offers_the_max_pool_capability():
    assert "max_pool" in backends.CAPABILITIES
    assert ("cuda", "spikefuse.cuda.spike_max_pool") in backends._capability_providers("max_pool")
    assert backends.capability("max_pool", torch.zeros(1)) is None  # CPU: torch ops


# ---- SpikePool and fuse() ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "pool",
    [
        layer.MaxPool2d(3, 2, 1, step_mode="m"),
        layer.SeqToANNContainer(torch.nn.MaxPool2d(2)),
        layer.MaxPool2d(17, 1, 8, step_mode="m"),  # 289 elements: max_pool2d itself
    ],
    ids=["stem", "container", "large"],
)
def test_spike_pool_max_pools_with_the_op_where_windows_fit_a_byte(pool):
    inner = pool[0] if isinstance(pool, layer.SeqToANNContainer) else pool
    spike_pool = SpikePool(inner)
    x = spikes((2, 3, 4, 18, 18), 0.2, torch.float64).requires_grad_()
    out = spike_pool(x)
    fits = inner.kernel_size != 17
    assert (spike_pool.spike_max is not None) == fits
    pooled = out.grad_fn.next_functions[0][0]  # under the unflatten's view
    assert ("SpikeMaxPool2dFunction" in type(pooled).__name__) == fits
    assert torch.equal(out, pool(x))


def test_a_spike_pool_pickled_without_the_op_max_pools_with_it_when_loaded():
    import pickle

    old = SpikePool(layer.MaxPool2d(3, 2, 1, step_mode="m"))
    del old.spike_max  # as pickled before
    loaded = pickle.loads(pickle.dumps(old))
    assert loaded.spike_max == MaxPoolGeometry.of(3, 2, 1)
    x = spikes((2, 3, 4, 9, 9), 0.2)
    assert torch.equal(loaded(x), old.pool(x))


@pytest.mark.parametrize("case", ["spikes", "no-grad", "means", "no-recipe"])
def test_spike_pool_packs_max_pooled_spikes_only_where_a_recipe_would_rerun(case):
    """Max-pooled spikes with a recipe are packed as they are written, under autograd: the
    output and its returned view carry the packing, which unpacks to the output. Without
    autograd (nothing saved), of means of spikes (not binary) or of spikes without a recipe
    (``memory="min"``: saved packed anyway) nothing is packed, and a recipe, if any, stays."""
    x = spikes((2, 3, 4, 18, 18), 0.3).requires_grad_(case != "no-grad")
    source = x.detach().clone()
    if case == "means":
        mark_means(x, 4)  # the means of 2 x 2 spikes
    else:
        mark_spikes(x)
    if case != "no-recipe":
        mark_recomputable(x, lambda: source)
    with torch.set_grad_enabled(case != "no-grad"):
        out = SpikePool(layer.MaxPool2d(3, 2, 1, step_mode="m"))(x)
    packing = packing_of(out)
    if case == "spikes":
        assert packing is not None and torch.equal(packing.unpack(), out)
        assert packing_of(out._base) is not None
        assert torch.equal(recipe_of(out.flatten(0, 1))(), out.flatten(0, 1))
        return
    assert packing is None and packing_of(out._base) is None
    assert (recipe_of(out) is None) == (case == "no-recipe")


def resnet_step(name: str):
    from test_models import build, step

    model, size, _ = build(name)
    fused, report = fuse(model, return_report=True)
    x = torch.rand(2, 2, 3, size, size, dtype=torch.float64) * 2
    return model, fused, report, x, step


@pytest.mark.parametrize("name", ["sew_resnet18_ADD", "spiking_resnet18"])
def test_fuse_runs_the_resnet_stem_max_pool_as_spike_max_pool(name, monkeypatch):
    """The stem's conv1 -> bn1 -> sn1 -> maxpool: maxpool becomes a SpikePool running
    spike_max_pool2d, named in the report; the state dict keys stay; fused equals unfused.
    The pooled spikes are packed as they are written, and backward unpacks them for the next
    layers (the convolution's weight gradient, Spiking ResNet's residual) instead of rerunning
    the stem's neuron and the pooling."""
    model, fused, report, x, step = resnet_step(name)
    assert report.spike_max_pools == ["maxpool"] and "maxpool" in report.pools
    assert "max pooling as spike_max_pool2d: maxpool" in str(report)
    assert isinstance(fused.maxpool, SpikePool) and fused.maxpool.spike_max is not None
    assert list(fused.state_dict()) == list(model.state_dict())
    out_r, gx_r, gp_r = step(model, x)
    poolings = []
    monkeypatch.setattr(pooling, "pool_spikes", lambda *a: poolings.append(a) or pool_spikes(*a))
    out_f, gx_f, gp_f = step(fused, x)
    assert len(poolings) == 1  # forward's: backward reran none
    tol = dict(rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(out_f, out_r, **tol)
    torch.testing.assert_close(gx_f, gx_r, **tol)
    for key in gp_r:
        torch.testing.assert_close(gp_f[key], gp_r[key], **tol, msg=key)


# ---- the cuda kernels' source ------------------------------------------------------------------
WINDOWS = [MaxPoolGeometry.of(*g).window for g in GEOMETRIES]


@needs_nvcc
def test_every_max_pool_kernel_compiles_with_nvcc(tmp_path):
    """Every storage dtype, with the stem's window and a dilated rectangular one, compiles for
    sm_80 and sm_90, as NVRTC compiles it, without spills (the scalar and vector kernels)."""
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    sources = [kernels.kernels_for(d, w).source for d in dtypes for w in WINDOWS[::5]]
    macros = (
        "FORWARD_KERNEL",
        "BACKWARD_KERNEL",
        "FORWARD_VECTOR_KERNEL",
        "BACKWARD_VECTOR_KERNEL",
    )
    assert_compiles_without_spills(tmp_path, sources, macros)


def test_kernel_names_say_the_dtype_window_and_vector_width():
    pair = kernels.kernels_for(torch.bfloat16, WINDOWS[0])
    assert pair.name(False, 1) == "spikefuse_max_pool_forward_nv_bfloat16_k3x3_s2x2_p1x1_d1x1"
    assert pair.name(True, 8) == "spikefuse_max_pool_backward_v8_nv_bfloat16_k3x3_s2x2_p1x1_d1x1"
    for backward, vec in itertools.product((False, True), (1, 8)):
        assert f" {pair.name(backward, vec)}\n" in pair.source
    assert "atomicAdd" not in pair.source and "constexpr int SH = 2;" in pair.source
    assert pair.vec == 8 and "constexpr int VEC = 8;" in pair.source
    assert kernels.kernels_for(torch.float32, WINDOWS[0]).vec == 4


@pytest.mark.parametrize("d", [1, 2, 3, 7, 64, 112, 3136, 12544, 2**31 - 1])
def test_dividers_divide_every_index_below_two_to_the_31(d):
    d, magic, shift = kernels.divider(d)
    assert 0 < magic < 2**32
    gen = torch.Generator().manual_seed(d)
    values = [
        0,
        1,
        d - 1,
        d,
        d + 1,
        2**31 - 1,
        *torch.randint(0, 2**31, (200,), generator=gen).tolist(),
    ]
    for n in values:
        assert (((n * magic) >> 32) + n) >> shift == n // d, n


# The kernels' source as C++ on the CPU: one thread after another (they share nothing). The
# 16-bit storage types come from stand-ins of CUDA's headers (HEADERS): __half is GCC's _Float16,
# __nv_bfloat16 the upper half of a float, both rounded to nearest even as on the GPU.
EMULATION = r"""
#include <cstdint>
#include <cstring>
struct Dim3 { int x, y, z; };
static Dim3 threadIdx, blockIdx;
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
inline float __int_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __ldg(const float* p) { return *p; }
inline unsigned int __umulhi(unsigned int a, unsigned int b)
{
    return (unsigned int)(((unsigned long long)a * b) >> 32);
}
#include KERNEL_SOURCE

extern "C" int args_size() { return sizeof(Args); }

// kernel: 2 * vector + backward
extern "C" void launch(int kernel, const void* packed, int blocks)
{
    static void (*const kernels[4])(const Args) = {
        FORWARD_KERNEL, BACKWARD_KERNEL, FORWARD_VECTOR_KERNEL, BACKWARD_VECTOR_KERNEL};
    Args a;
    std::memcpy(&a, packed, sizeof(Args));
    for (int b = 0; b < blocks; ++b)
        for (int t = 0; t < BLOCK_THREADS; ++t) {
            blockIdx = {b, 0, 0};
            threadIdx = {t, 0, 0};
            kernels[kernel](a);
        }
}
"""
HEADERS = {
    "cuda_fp16.h": r"""
typedef _Float16 __half;
inline float __half2float(__half x) { return (float)x; }
inline __half __float2half_rn(float x) { return (__half)x; }
""",
    "cuda_bf16.h": r"""
#include <cstdint>
#include <cstring>
struct __nv_bfloat16 { std::uint16_t bits; };
inline float __bfloat162float(__nv_bfloat16 x)
{
    const std::uint32_t u = std::uint32_t(x.bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline __nv_bfloat16 __float2bfloat16_rn(float f)
{
    std::uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return {std::uint16_t((u >> 16) | 0x40u)};  // NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return {std::uint16_t(u >> 16)};
}
""",
}
GXX = shutil.which("g++")
KERNEL_NAME = re.compile(r"spikefuse_max_pool_(forward|backward)(_v\d+)?_")


def emulation_compiler(tmp_path_factory, name: str, emulation: str, args_size: int):
    """``library(source)``: the ctypes library of ``emulation`` (C++ including a kernel source
    as KERNEL_SOURCE, with the stand-in HEADERS) compiled by g++ once per source; its
    ``args_size()`` must be ``args_size`` (the host's packed struct is the kernels' Args)."""
    if GXX is None:
        pytest.skip("g++ not found on PATH: the kernel source is not run on the CPU")
    folder = tmp_path_factory.mktemp(name)
    (folder / "emulation.cpp").write_text(emulation)
    for header, text in HEADERS.items():
        (folder / header).write_text(text)
    libraries: dict[str, ctypes.CDLL] = {}

    def library(source: str) -> ctypes.CDLL:
        if source not in libraries:
            i = len(libraries)
            (folder / f"source{i}.h").write_text(source)
            out = folder / f"emulation{i}.so"
            define = f'-DKERNEL_SOURCE="{folder / f"source{i}.h"}"'
            cmd = [GXX, "-std=c++17", "-O1", "-shared", "-fPIC", f"-I{folder}", define]
            r = subprocess.run(
                [*cmd, "-o", str(out), str(folder / "emulation.cpp")],
                capture_output=True,
                text=True,
            )
            if r.returncode and "_Float16" in r.stderr:
                pytest.skip(f"g++ lacks _Float16: {r.stderr[:200]}")
            assert r.returncode == 0, r.stderr[-3000:]
            libraries[source] = ctypes.CDLL(str(out))
            assert libraries[source].args_size() == args_size
        return libraries[source]

    return library


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """A ``launch_named`` stand-in running the kernels' source (each dtype's and window's
    compiled for the CPU on first use); ``.names`` lists the kernels it launched."""
    library = emulation_compiler(
        tmp_path_factory, "max_pool_emulation", EMULATION, kernels.ARGS.size
    )

    def launch_named(source, name, device, grid, block, args):
        assert block == (256, 1, 1) and grid[1:] == (1, 1) and len(args) == kernels.ARGS.size
        direction, vector = KERNEL_NAME.match(name).groups()
        launch_named.names.append(name)
        kernel = 2 * (vector is not None) + (direction == "backward")
        library(source).launch(kernel, args, grid[0])

    launch_named.names = []
    return launch_named


@pytest.fixture
def on_kernels(emulated, monkeypatch):
    """The autograd Function running the emulated cuda kernels; yields their launched names."""
    monkeypatch.setattr(kernels, "launch_named", emulated)
    monkeypatch.setattr(op.autograd, "_kernels", lambda t: kernels)
    emulated.names.clear()
    return emulated.names


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=GEOMETRY_IDS)
@pytest.mark.parametrize("channels_last", [False, True])
def test_the_kernel_source_equals_max_pool2d(on_kernels, geometry, channels_last):
    """The autograd Function on the cuda kernels (their source run on the CPU): values,
    gradients and layouts equal max_pool2d's, also for a gradient of other strides."""
    x = spikes((3, 5, 9, 11), 0.3, seed=4)
    x[0, 0, 0, :4] = float("nan")
    x[1, 1, 2:5, 2:5] = float("-inf")
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    g = MaxPoolGeometry.of(*geometry)
    want = run(lambda t: spike_max_pool2d_naive(t, g), x)
    assert_same(run(lambda t: op.SpikeMaxPool2dFunction.apply(t, g), x), want)
    upstream = torch.randn(want[0].shape[::-1]).permute(3, 2, 1, 0)  # neither layout
    want = run(lambda t: spike_max_pool2d_naive(t, g), x, upstream)
    assert_same(run(lambda t: op.SpikeMaxPool2dFunction.apply(t, g), x, upstream), want)
    assert all(KERNEL_NAME.match(name).group(2) is None for name in on_kernels)  # C = 5


def awkward_map(dtype: torch.dtype, channels: int = 16) -> torch.Tensor:
    """A channels-last [3, C, 9, 11] map: spikes (ties), all-zero windows, NaN, -inf, and
    other values tied and not."""
    x = spikes((3, channels, 9, 11), 0.3, seed=6)
    x[2, :, :5, :5] = 0.0
    x[0, 3, 0, :4] = float("nan")
    x[1, :, 2:5, 2:5] = float("-inf")
    x[1, 5] = torch.randint(-2, 3, (9, 11), generator=torch.Generator().manual_seed(2)).float()
    return x.to(dtype).contiguous(memory_format=torch.channels_last)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=GEOMETRY_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_vector_kernels_equal_the_scalar_kernels_bit_for_bit(
    on_kernels, monkeypatch, geometry, dtype
):
    """Channels-last maps with C a multiple of VEC run the vector kernels (VEC channels per
    thread); their values, codes' gradients and layouts equal the scalar kernels' bit for bit,
    and max_pool2d's computed in float32 and rounded to the dtype."""
    x = awkward_map(dtype)
    g = MaxPoolGeometry.of(*geometry)
    shape = (3, 16, *g.output_size(9, 11))
    upstream = torch.randn(shape, generator=torch.Generator().manual_seed(8)).to(dtype)
    upstream = upstream.contiguous(memory_format=torch.channels_last)
    pair = kernels.kernels_for(dtype, g.window)
    vector = run(lambda t: op.SpikeMaxPool2dFunction.apply(t, g), x, upstream)
    assert on_kernels == [pair.name(False, pair.vec), pair.name(True, pair.vec)]
    on_kernels.clear()
    monkeypatch.setattr(kernels, "vector_width", lambda *tensors: 1)
    scalar = run(lambda t: op.SpikeMaxPool2dFunction.apply(t, g), x, upstream)
    assert on_kernels == [pair.name(False, 1), pair.name(True, 1)]
    for v, s in zip(vector, scalar, strict=True):
        assert torch.equal(bits(v), bits(s)) and v.stride() == s.stride()
    want = run(lambda t: spike_max_pool2d_naive(t, g), x.float(), upstream.float())
    assert_same(vector, tuple(w.to(dtype) for w in want))


def test_a_misaligned_input_takes_the_scalar_forward_and_its_gradient_vectors(on_kernels):
    """x one float past a 16-byte boundary (channels-last dense): the scalar forward kernel;
    dL/dx, allocated aligned, the vector backward; both exact."""
    base = awkward_map(torch.float32)
    x = torch.empty(base.numel() + 1)[1:].view(3, 9, 11, 16).permute(0, 3, 1, 2).copy_(base)
    assert x.is_contiguous(memory_format=torch.channels_last) and x.data_ptr() % 16
    g = MaxPoolGeometry.of(3, 2, 1)
    pair = kernels.kernels_for(torch.float32, g.window)
    out = op.SpikeMaxPool2dFunction.apply(x.requires_grad_(), g)  # no clone: x's own address
    upstream = torch.randn(out.shape).contiguous(memory_format=torch.channels_last)
    (grad,) = torch.autograd.grad(out, x, upstream)
    assert on_kernels == [pair.name(False, 1), pair.name(True, 4)]
    assert_same((out.detach(), grad), run(lambda t: spike_max_pool2d_naive(t, g), base, upstream))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels-last"])
def test_the_kernel_source_flips_channels_and_adds_batchnorm_terms(
    on_kernels, dtype, channels_last
):
    """The options of a fused block that max-pools its BatchNorm output: ``flip`` (channels
    whose windows take their minimum) and the backward's ``terms`` (coef_x x + coef_0 at every
    element), on the kernels' source against the torch passes."""
    x = awkward_map(dtype)
    x = x if channels_last else x.contiguous()
    flip = torch.linspace(1.0, 2.0, 16)  # e.g. a BatchNorm's gamma
    flip[::3] *= -1
    g = MaxPoolGeometry.of(3, 2, 1)
    want, want_codes = pool_forward(x, g, True, flip)
    got, codes = op.autograd.max_pool_forward(x, g, True, flip)
    assert want_codes is not None and codes is not None
    assert_same((got, codes), (want, want_codes))
    grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    values = torch.randn(x.shape, generator=torch.Generator().manual_seed(4)).to(dtype)
    values = torch.empty_like(x).copy_(values)  # x's layout
    terms = (values, torch.linspace(-1, 2, 16), torch.linspace(0.5, -0.5, 16))
    layout = memory_format_of(x)
    want_grad = pool_backward(grad, want_codes, g, x.shape, layout, terms)
    got_grad = op.autograd.max_pool_backward(grad, codes, g, x.shape, layout, terms)
    assert got_grad.stride() == want_grad.stride()
    torch.testing.assert_close(got_grad, want_grad)  # within rounding: the dtype's defaults
    vector = any(KERNEL_NAME.match(name).group(2) for name in on_kernels)
    assert vector == channels_last  # the vector kernels ran on channels-last maps
