"""The per-channel BatchNorm statistics kernel (spikefuse.cuda.channel_stats) on the CPU: which
layouts the fused blocks send to it, its launch geometry and argument struct, its source compiling
with nvcc, and the kernel source itself run on the CPU by a C++ emulation of the CUDA features it
uses (one std::thread per CUDA thread, a barrier for __syncthreads) against float64 statistics.
The GPU runs are in tests/gpu/test_channel_stats_gpu.py."""

from __future__ import annotations

import ctypes
import fnmatch
import re
import shutil
import subprocess
import tomllib
import types
from pathlib import Path

import pytest
import torch

from spikefuse.cuda import channel_stats as cs
from spikefuse.errors import BackendUnavailableError, SpikefuseError
from spikefuse.fused import statistics
from test_codegen import assert_compiles_without_spills, needs_nvcc


# ---- which layouts go to the kernel --------------------------------------------------------------
def channels_last_y(T: int, B: int, C: int, H: int, W: int) -> torch.Tensor:
    """[T, B, C, H, W] as the fused Conv2d block's synapse output is laid out on CUDA."""
    y = torch.randn(T * B, C, H, W).contiguous(memory_format=torch.channels_last)
    return y.unflatten(0, (T, B))


def test_rows_by_channel_is_a_view_of_channels_innermost_memory():
    y = channels_last_y(2, 3, 5, 4, 6)
    rows = statistics.rows_by_channel(y)
    assert rows is not None and rows.shape == (2 * 3 * 4 * 6, 5) and rows.is_contiguous()
    assert rows.data_ptr() == y.data_ptr()  # no copy
    assert torch.equal(rows, y.permute(0, 1, 3, 4, 2).reshape(-1, 5))
    linear = torch.randn(4, 3, 7)  # a Linear block's [T, B, C]
    rows = statistics.rows_by_channel(linear)
    assert rows is not None and rows.data_ptr() == linear.data_ptr()
    assert torch.equal(rows, linear.reshape(-1, 7))
    squeezed = torch.randn(2, 3, 4, 1)  # a Conv1d output of length 1: channels innermost too
    assert statistics.rows_by_channel(squeezed) is not None


@pytest.mark.parametrize(
    "y",
    [
        torch.randn(2, 3, 4, 5),  # contiguous Conv1d [T, B, C, L]: channels not innermost
        torch.randn(2, 3, 4, 5, 6),  # contiguous (NCHW) Conv2d
        torch.randn(2, 7, 3).transpose(1, 2),  # a [T, B, C] view with channels not innermost
        torch.randn(2, 3, 8)[..., ::2],  # channels innermost but not dense
    ],
    ids=["conv1d", "nchw", "transposed", "strided"],
)
def test_other_layouts_are_not_rows_by_channel(y):
    assert statistics.rows_by_channel(y) is None


@pytest.fixture
def routes(monkeypatch):
    """Records which implementation batch_mean_invstd calls: the kernel gets the [rows, C]
    view, torch.batch_norm_stats the [T*B, C, *] one (the cuda backend counted as available)."""
    calls = []

    def kernel(rows, eps, running=None):
        calls.append(("kernel", rows, eps))
        return rows.new_zeros(rows.shape[1]), rows.new_ones(rows.shape[1])

    def torch_stats(flat, eps):
        calls.append(("torch", flat, eps))
        return flat.new_zeros(flat.shape[1]), flat.new_ones(flat.shape[1])

    kernels = types.SimpleNamespace(channel_stats=kernel)
    monkeypatch.setattr(statistics, "capability", lambda name, x: kernels)
    monkeypatch.setattr(torch, "batch_norm_stats", torch_stats)
    monkeypatch.setattr(statistics, "_KERNEL_MIN_ELEMENTS", 0)
    return calls


def test_channels_innermost_layouts_go_to_the_kernel(routes):
    y = channels_last_y(2, 3, 5, 4, 4)
    statistics.batch_mean_invstd(y, 1e-3)
    (route, rows, eps) = routes.pop()
    assert route == "kernel" and eps == 1e-3 and rows.shape == (2 * 3 * 16, 5)
    assert rows.data_ptr() == y.data_ptr()
    statistics.batch_mean_invstd(torch.randn(3, 2, 6), 1e-5)
    assert routes.pop()[0] == "kernel"


def test_small_maps_keep_torch_batch_norm_stats(routes, monkeypatch):
    """Below _KERNEL_MIN_ELEMENTS torch's single launch is faster than the kernel's two."""
    monkeypatch.setattr(statistics, "_KERNEL_MIN_ELEMENTS", 2 * 3 * 5 * 16 + 1)
    statistics.batch_mean_invstd(channels_last_y(2, 3, 5, 4, 4), 1e-3)
    assert routes.pop()[0] == "torch"
    monkeypatch.setattr(statistics, "_KERNEL_MIN_ELEMENTS", 2 * 3 * 5 * 16)
    statistics.batch_mean_invstd(channels_last_y(2, 3, 5, 4, 4), 1e-3)
    assert routes.pop()[0] == "kernel"


def test_torch_compile_traces_var_mean_not_the_cuda_ops(monkeypatch):
    """A compiled fused model used to reach the kernel's CuPy launch, and then
    ``torch.batch_norm_stats`` (no fake-tensor kernel), while dynamo traced: graph breaks and
    slower steps. While compiling, CUDA statistics take the traceable var_mean route."""
    cuda_like = types.SimpleNamespace(is_cuda=True)
    assert statistics._eager_cuda(cuda_like)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not statistics._eager_cuda(cuda_like)


def test_other_layouts_keep_torch_batch_norm_stats(routes):
    conv1d = torch.randn(2, 3, 4, 5)
    statistics.batch_mean_invstd(conv1d, 1e-5)
    (route, flat, _) = routes.pop()
    assert route == "torch" and flat.shape == (6, 4, 5)


def test_without_the_cuda_backend_torch_batch_norm_stats_runs(routes, monkeypatch):
    monkeypatch.setattr(statistics, "capability", lambda name, x: None)  # no backend offers it
    statistics.batch_mean_invstd(torch.randn(3, 2, 6), 1e-5)
    assert routes.pop()[0] == "torch"


# ---- launch geometry, arguments, source ----------------------------------------------------------
@pytest.mark.parametrize(
    ("channels", "element_size", "address", "vec"),
    [
        (128, 4, 0, 4),
        (128, 2, 0, 8),
        (130, 4, 0, 2),
        (130, 2, 0, 2),
        (10, 2, 0, 2),
        (3, 4, 0, 1),
        (128, 4, 8, 2),  # 8-byte aligned data: 8-byte loads
        (128, 2, 2, 1),
    ],
)
def test_vector_width(channels, element_size, address, vec):
    assert cs.vector_width(channels, element_size, address) == vec


@pytest.mark.parametrize("sm_count", [1, 132])
@pytest.mark.parametrize("element_size", [4, 2])
@pytest.mark.parametrize(
    ("rows", "channels"),
    [(1, 3), (7, 10), (7, 130), (65537, 128), (655360, 128), (640, 1024), (40960, 512), (3, 9000)],
)
def test_plan_covers_every_row_and_channel(rows, channels, element_size, sm_count):
    p = cs.plan(rows, channels, element_size, 0, sm_count)
    tx, ty, _ = p.block
    assert tx * ty <= cs.MAX_THREADS and p.block[2] == p.grid[2] == 1
    assert (
        channels % p.vec == 0 and p.grid[0] * tx * p.vec >= channels > (p.grid[0] - 1) * tx * p.vec
    )
    assert p.rows_per_chunk % ty == 0 and p.rows_per_chunk >= ty * cs.MIN_ROWS_PER_THREAD
    assert p.chunks * p.rows_per_chunk >= rows > (p.chunks - 1) * p.rows_per_chunk
    assert 1 <= p.chunks <= 65535  # CUDA's limit on gridDim.y
    # one wave of blocks (no tail of a few blocks), filling the GPU where there are rows enough
    wave = sm_count * cs.BLOCKS_PER_SM
    assert p.grid[0] * p.chunks <= max(wave, p.grid[0])
    if rows >= 100 * wave * ty:
        assert p.grid[0] * p.chunks > wave * 0.9


def test_python_constants_match_the_kernel_source():
    source = cs.SOURCE_PATH.read_text()
    constants = dict(re.findall(r"constexpr int (\w+) = (\d+);", source))
    assert int(constants["MAX_THREADS"]) == cs.MAX_THREADS
    assert int(constants["UNROLL"]) == cs.UNROLL
    assert int(constants["MERGE_CHANNELS"]) == cs.MERGE_CHANNELS
    assert int(constants["MERGE_LANES"]) == cs.MERGE_LANES
    assert int(constants["MIN_BLOCKS"]) == cs.BLOCKS_PER_SM


def test_medium_net_layer_plan():
    """The 32x32 layer of the medium net in bfloat16: 16-byte loads, 16x16 blocks, one wave of
    3 blocks per SM of an H100, each thread streaming ~100 rows."""
    p = cs.plan(640 * 32 * 32, 128, 2, 0, 132)
    assert p.vec == 8 and p.block == (16, 16, 1) and p.grid[0] == 1
    assert 390 <= p.chunks <= 132 * cs.BLOCKS_PER_SM
    assert 100 <= p.rows_per_chunk // 16 <= 110


def test_args_struct_matches_the_source():
    source = cs.SOURCE_PATH.read_text()
    body = re.search(r"struct Args \{(.*?)\};", source, re.S)
    assert body is not None
    fields = re.findall(r"^\s*[\w\s\*]*?(\w+);", body.group(1), re.M)
    assert fields == [
        "y",
        "partial",
        "mean",
        "invstd",
        "running_mean",
        "running_var",
        "batches_tracked",
        "rows",
        "rows_per_chunk",
        "channels",
        "chunks",
        "eps",
        "momentum",
        "cumulative",
    ]
    assert cs.ARGS.size == 96  # 7 pointers, 2 long long, 2 int, 2 float, int, padding to 8


def test_source_names_its_kernels_and_storage():
    kernels = cs.kernels_for(torch.bfloat16, 8)
    source = kernels.source
    assert kernels.partial_name == "spikefuse_channel_stats_partial_nv_bfloat16_v8"
    assert kernels.merge_name == "spikefuse_channel_stats_merge_nv_bfloat16_v8"
    assert f"#define PARTIAL_KERNEL {kernels.partial_name}" in source
    assert "typedef __nv_bfloat16 scalar_t;" in source and "constexpr int VEC = 8;" in source
    assert f'#line 1 "{cs.SOURCE_NAME}"' in source
    assert cs.kernels_for(torch.bfloat16, 8) is kernels  # cached: compiled once per variant


def test_channel_stats_refuses_what_it_cannot_compute(monkeypatch):
    with pytest.raises(BackendUnavailableError, match="CUDA tensor"):
        cs.channel_stats(torch.randn(4, 3), 1e-5)
    monkeypatch.setattr(cs, "check_input", lambda y: None)  # as if y were a CUDA tensor
    with pytest.raises(SpikefuseError, match=r"\[rows, C\] matrix"):
        cs.channel_stats(torch.randn(4, 3, 2), 1e-5)
    with pytest.raises(SpikefuseError, match=r"\[rows, C\] matrix"):
        cs.channel_stats(torch.randn(3, 4).t(), 1e-5)
    with pytest.raises(SpikefuseError, match="0 rows"):
        cs.channel_stats(torch.randn(0, 4), 1e-5)


VARIANTS = [(torch.float32, v) for v in (4, 2, 1)] + [
    (dtype, v) for dtype in (torch.float16, torch.bfloat16) for v in (8, 4, 2, 1)
]


@needs_nvcc
def test_every_channel_stats_variant_compiles_with_nvcc(tmp_path):
    """Every (dtype, vector width) compiles for sm_80 and sm_90, optimised as NVRTC compiles it,
    without spilling registers (a spill in the streaming loop would cost bandwidth)."""
    sources = [cs.kernels_for(dtype, vec).source for dtype, vec in VARIANTS]
    assert_compiles_without_spills(tmp_path, sources, ("PARTIAL_KERNEL", "MERGE_KERNEL"))


# ---- the kernel source, run on the CPU -----------------------------------------------------------
# The CUDA features channel_stats.cuh uses, in C++20: every CUDA thread of a block is a std::thread,
# blocks run one after another (so __shared__ = static is the block's shared memory), and
# __syncthreads() is a barrier over the block's threads. Float arithmetic as on the GPU (fmaf
# correctly rounded; __frcp_rn and rsqrtf as exact division and square root).
EMULATION = r"""
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>
struct Dim3 { int x, y, z; };
thread_local Dim3 threadIdx, blockIdx;
Dim3 blockDim;
std::barrier<>* block_barrier;
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __syncthreads() block_barrier->arrive_and_wait()
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float rsqrtf(float a) { return 1.0f / std::sqrt(a); }
using std::min;
#if BF16
struct scalar_t { uint16_t bits; };
inline float to_float(const scalar_t x)
{
    const uint32_t u = uint32_t(x.bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
#else
typedef float scalar_t;
inline float to_float(const scalar_t x) { return x; }
#endif
#define PARTIAL_KERNEL partial_kernel
#define MERGE_KERNEL merge_kernel
#include KERNEL_SOURCE

static void run_grid(void (*kernel)(const Args), const Args& a, Dim3 grid, Dim3 block)
{
    blockDim = block;
    for (int j = 0; j < grid.y; ++j)
        for (int i = 0; i < grid.x; ++i) {
            std::barrier<> barrier(block.x * block.y);
            block_barrier = &barrier;
            std::vector<std::thread> threads;
            for (int ty = 0; ty < block.y; ++ty)
                for (int tx = 0; tx < block.x; ++tx)
                    threads.emplace_back([=, &a] {
                        threadIdx = {tx, ty, 0};
                        blockIdx = {i, j, 0};
                        kernel(a);
                    });
            for (auto& t : threads)
                t.join();
        }
}

static_assert(sizeof(Args) == 96, "channel_stats.py packs 96 bytes");

// One launch with the argument struct as channel_stats.py packs it (the x86-64 and CUDA layouts
// of Args are the same: naturally aligned fields).
extern "C" void launch_packed(int merge, const void* packed, int gx, int gy, int bx, int by)
{
    Args a;
    std::memcpy(&a, packed, sizeof(Args));
    run_grid(merge ? merge_kernel : partial_kernel, a, {gx, gy, 1}, {bx, by, 1});
}

extern "C" void channel_stats(const void* y, float* partial, float* mean, float* invstd,
    long long rows, long long rows_per_chunk, int channels, int chunks, float eps, int tiles,
    int tx, int ty)
{
    const Args a{(const scalar_t*)y, partial, mean, invstd, nullptr, nullptr, nullptr, rows,
                 rows_per_chunk, channels, chunks, eps, 0.0f, 0};
    run_grid(partial_kernel, a, {tiles, chunks, 1}, {tx, ty, 1});
    run_grid(merge_kernel, a, {(channels + MERGE_CHANNELS - 1) / MERGE_CHANNELS, 1, 1},
             {MERGE_CHANNELS, MERGE_LANES, 1});
}
"""
GXX = shutil.which("g++")


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """channel_stats(y, eps, sm_count) computed by the kernel source on the CPU (float32 and
    bfloat16 storage), with the launch geometry of cs.plan."""
    if GXX is None:
        pytest.skip("g++ not found on PATH: the kernel source is not run on the CPU")
    folder = tmp_path_factory.mktemp("channel_stats_emulation")
    (folder / "emulation.cpp").write_text(EMULATION)
    libraries: dict[tuple[bool, int], ctypes.CDLL] = {}

    def library(bf16: bool, vec: int) -> ctypes.CDLL:
        if (bf16, vec) not in libraries:
            out = folder / f"emulation_{int(bf16)}_{vec}.so"
            defines = [f"-DBF16={int(bf16)}", f'-DKERNEL_SOURCE="{cs.SOURCE_PATH}"']
            prelude = folder / f"vec{vec}.h"
            prelude.write_text(f"constexpr int VEC = {vec};\n")
            cmd = [GXX, "-std=c++20", "-O1", "-shared", "-fPIC", *defines, "-include", str(prelude)]
            r = subprocess.run(
                [*cmd, "-o", str(out), str(folder / "emulation.cpp"), "-lpthread"],
                capture_output=True,
                text=True,
            )
            if r.returncode and "barrier" in r.stderr:
                pytest.skip(f"g++ lacks C++20 <barrier>: {r.stderr[:200]}")
            assert r.returncode == 0, r.stderr[-3000:]
            libraries[bf16, vec] = ctypes.CDLL(str(out))
        return libraries[bf16, vec]

    def run(y: torch.Tensor, eps: float, sm_count: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
        rows, channels = y.shape
        p = cs.plan(rows, channels, y.element_size(), y.data_ptr(), sm_count)
        partial = torch.empty(2, p.chunks, channels)
        mean, invstd = torch.full((channels,), -7.0), torch.full((channels,), -7.0)
        fn = library(y.dtype == torch.bfloat16, p.vec).channel_stats
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_longlong] * 2 + [ctypes.c_int] * 2
        fn.argtypes += [ctypes.c_float] + [ctypes.c_int] * 3
        pointers = (y.data_ptr(), partial.data_ptr(), mean.data_ptr(), invstd.data_ptr())
        fn(*pointers, rows, p.rows_per_chunk, channels, p.chunks, eps, p.grid[0], *p.block[:2])
        return mean, invstd

    run.library = library
    return run


def reference(y: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, invstd) in float64."""
    var, mean = torch.var_mean(y.double(), dim=0, correction=0)
    return mean, (var + eps).rsqrt()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def mean_error(got: torch.Tensor, want: torch.Tensor, want_invstd: torch.Tensor) -> float:
    """max |got - want| over the larger of max |mean| and the largest standard deviation: the
    kernel's mean is exact to float32 rounding of the deviations from its pivot (a sample), so
    its error scales with the spread where the means are near 0."""
    scale = max(want.abs().max().item(), want_invstd.reciprocal().max().item())
    return (got.double() - want).abs().max().item() / scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("rows", "channels"), [(1, 3), (7, 10), (7, 130), (3001, 128), (513, 130), (100, 1030)]
)
def test_emulated_kernel_matches_float64(emulated, rows, channels, dtype):
    """Every geometry (vector widths 1 to 8, idle threads, partial chunks, several channel
    tiles): mean and invstd within 1e-6 of float64 statistics of the same stored values."""
    g = torch.Generator().manual_seed(rows * channels)
    y = (torch.randn(rows, channels, generator=g) * 0.7 + 0.3).to(dtype)
    mean, invstd = emulated(y, 1e-5)
    want_mean, want_invstd = reference(y, 1e-5)
    assert mean_error(mean, want_mean, want_invstd) < 1e-6
    assert relative_error(invstd, want_invstd) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_channel_stats_launches_the_emulated_kernels(emulated, monkeypatch, dtype):
    """channel_stats itself, its launches run by the emulation: the packed arguments, grids and
    blocks reach the kernels as they expect them (a channels-last map's [rows, C] view)."""
    launches = []

    def launch_named(source, name, device, grid, block, args):
        vec = int(name.rsplit("_v", 1)[1])
        library = emulated.library(dtype == torch.bfloat16, vec)
        library.launch_packed.argtypes = [ctypes.c_int, ctypes.c_char_p] + [ctypes.c_int] * 4
        library.launch_packed("merge" in name, args, *grid[:2], *block[:2])
        launches.append(name)

    monkeypatch.setattr(cs, "check_input", lambda y: None)  # as if y were a CUDA tensor
    monkeypatch.setattr(cs, "launch_named", launch_named)
    monkeypatch.setattr(cs, "_sm_count", lambda index: 3)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    y = torch.randn(6, 130, 5, 7, generator=torch.Generator().manual_seed(4)).to(dtype)
    y = y.contiguous(memory_format=torch.channels_last)
    rows = statistics.rows_by_channel(y.unflatten(0, (2, 3)))
    assert rows is not None
    mean, invstd = cs.channel_stats(rows, 1e-3)
    tag = "nv_bfloat16_v2" if dtype == torch.bfloat16 else "float_v2"
    assert launches == [f"spikefuse_channel_stats_{k}_{tag}" for k in ("partial", "merge")]
    want_mean, want_invstd = reference(rows, 1e-3)
    assert mean_error(mean, want_mean, want_invstd) < 1e-6
    assert relative_error(invstd, want_invstd) < 1e-6


@pytest.mark.parametrize("momentum", [0.1, None])
def test_emulated_kernels_update_running_statistics_as_torch_batchnorm(
    emulated, monkeypatch, momentum
):
    """With running statistics, the same two launches count the batch and update them as torch's
    BatchNorm does (the unbiased variance; momentum None: the cumulative average), twice over."""

    def launch_named(source, name, device, grid, block, args):
        library = emulated.library(False, int(name.rsplit("_v", 1)[1]))
        library.launch_packed.argtypes = [ctypes.c_int, ctypes.c_char_p] + [ctypes.c_int] * 4
        library.launch_packed("merge" in name, args, *grid[:2], *block[:2])

    monkeypatch.setattr(cs, "check_input", lambda y: None)
    monkeypatch.setattr(cs, "launch_named", launch_named)
    monkeypatch.setattr(cs, "_sm_count", lambda index: 3)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    bn = torch.nn.BatchNorm2d(34, momentum=momentum).train()
    running = (torch.randn(34), torch.rand(34) + 0.5, torch.tensor(3))
    bn.running_mean.copy_(running[0]), bn.running_var.copy_(running[1])
    bn.num_batches_tracked.fill_(3)
    g = torch.Generator().manual_seed(5)
    for _ in range(2):
        y = (torch.randn(6, 34, 5, 7, generator=g) * 1.5 + 0.4).contiguous(
            memory_format=torch.channels_last
        )
        bn(y)
        rows = y.permute(0, 2, 3, 1).reshape(-1, 34)  # a view: channels innermost
        cs.channel_stats(rows, bn.eps, (*running, momentum))
    assert running[2].item() == bn.num_batches_tracked.item() == 5
    torch.testing.assert_close(running[0], bn.running_mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(running[1], bn.running_var, rtol=1e-6, atol=1e-6)


def test_channel_stats_refuses_running_statistics_it_cannot_update(monkeypatch):
    monkeypatch.setattr(cs, "check_input", lambda y: None)
    y = torch.randn(4, 3)
    counter = torch.tensor(0)
    with pytest.raises(SpikefuseError, match="float32 \\[C\\] vectors"):
        cs.channel_stats(y, 1e-5, (torch.zeros(3).half(), torch.ones(3), counter, 0.1))
    with pytest.raises(SpikefuseError, match="float32 \\[C\\] vectors"):
        cs.channel_stats(y, 1e-5, (torch.zeros(4), torch.ones(3), counter, 0.1))
    with pytest.raises(SpikefuseError, match="at least 2 rows"):
        cs.channel_stats(y[:1], 1e-5, (torch.zeros(3), torch.ones(3), counter, 0.1))
    assert counter.item() == 0


def test_emulated_kernel_keeps_a_small_variance_under_a_large_mean(emulated):
    """mean 1000, std 0.01: float32 sums of squares would lose every digit of the variance."""
    g = torch.Generator().manual_seed(0)
    y = (torch.randn(20000, 4, generator=g, dtype=torch.float64) * 0.01 + 1000).float()
    mean, invstd = emulated(y, 0.0)
    want_mean, want_invstd = reference(y, 0.0)
    assert relative_error(mean, want_mean) < 1e-7
    assert relative_error(invstd.double() ** -2, want_invstd**-2) < 1e-5


def test_emulated_kernel_with_an_outlying_pivot(emulated):
    """Row 0 (the pivot) 1000 standard deviations from the mean: the variance stays accurate;
    the mean's error is bounded by float32 rounding of the pivot's magnitude."""
    g = torch.Generator().manual_seed(1)
    y = torch.randn(20000, 4, generator=g)
    y[0] = 1000.0
    mean, invstd = emulated(y, 0.0)
    want_mean, want_invstd = reference(y, 0.0)
    assert (mean.double() - want_mean).abs().max() < 1000 * 2**-23
    assert relative_error(invstd.double() ** -2, want_invstd**-2) < 1e-5


def test_emulated_kernel_propagates_nan_and_inf(emulated):
    """A NaN or ±Inf anywhere in a channel (also in row 0, the pivot) gives a non-finite mean
    and a NaN invstd; the other channels are unaffected."""
    y = torch.randn(5000, 8, generator=torch.Generator().manual_seed(2))
    y[0, 1] = float("nan")
    y[4000, 2] = float("inf")
    y[10, 3] = float("-inf")
    y[0, 4] = float("inf")
    y[1, 5], y[2, 5] = float("inf"), float("-inf")
    mean, invstd = emulated(y, 1e-5)
    assert not mean[1:6].isfinite().any() and invstd[1:6].isnan().all()
    finite = [0, 6, 7]
    want_mean, want_invstd = reference(y[:, finite], 1e-5)
    assert mean_error(mean[finite], want_mean, want_invstd) < 1e-6
    assert relative_error(invstd[finite], want_invstd) < 1e-6


def test_emulated_kernel_constant_channels(emulated):
    """Zero variance: invstd = 1/sqrt(eps), and 0 for eps = 0 (as torch.batch_norm_stats)."""
    y = torch.full((100, 4), 2.5)
    mean, invstd = emulated(y, 0.0)
    assert torch.equal(mean, torch.full((4,), 2.5)) and torch.equal(invstd, torch.zeros(4))
    _, invstd = emulated(y, 0.25)
    assert torch.allclose(invstd, torch.full((4,), 2.0), rtol=1e-6)


def test_emulated_kernel_is_deterministic_across_chunkings(emulated):
    """The same call gives the same bits; other chunkings (GPU sizes) agree to rounding."""
    y = torch.randn(4000, 16, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    first, second = emulated(y, 1e-5, 2), emulated(y, 1e-5, 2)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    other = emulated(y, 1e-5, 5)
    assert all(relative_error(a, b.double()) < 1e-6 for a, b in zip(other, first, strict=True))


def test_kernel_source_is_package_data():
    """The wheel ships channel_stats.cuh (pyproject's package-data patterns)."""
    root = Path(__file__).resolve().parents[1]
    config = tomllib.loads((root / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["spikefuse"]
    relative = cs.SOURCE_PATH.relative_to(root / "src" / "spikefuse").as_posix()
    assert any(fnmatch.fnmatch(relative, pattern) for pattern in patterns)
