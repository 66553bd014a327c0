"""Per-channel BatchNorm statistics at memory bandwidth, for the fused blocks' synapse output.

:func:`channel_stats` returns what ``torch.batch_norm_stats`` returns, (mean [C], invstd [C])
in float32 with invstd = 1 / sqrt(biased variance + eps), for a [rows, C] matrix with channels
innermost: the memory of a channels-last convolution output [T*B, C, H, W] or of a Linear
output [T, B, C]. On that layout torch's kernel reaches a fraction of the bandwidth (0.56 TB/s in
bfloat16 on an H100); this one streams it once with vector loads.

The kernels are in ``channel_stats.cuh`` (next to this file; its header explains the algorithm
and the numerics: a per-channel pivot, Welford per thread, Chan's merges in a fixed order). Two
launches, compiled once per (storage dtype, vector width) and device with NVRTC through
:mod:`.runtime`, on PyTorch's current stream, writing only tensors from PyTorch's allocator and
never syncing the host: CUDA-graph capturable once loaded.

``python -m spikefuse.cuda.channel_stats`` times it against ``torch.batch_norm_stats`` on the
medium DATE'22 network's shapes (a CUDA GPU with CuPy needed).
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import SpikefuseError
from .kernel_spec import STORAGE
from .runtime import check_input, launch_named

SOURCE_PATH = Path(__file__).with_name("channel_stats.cuh")
SOURCE_NAME = "spikefuse/cuda/channel_stats.cuh"

# As in channel_stats.cuh (the kernels' block shapes and loop structure).
MAX_THREADS = 256  # threads per block of the partial kernel
UNROLL = 4  # rows each thread loads before using any
MERGE_CHANNELS, MERGE_LANES = 32, 32  # the merge kernel's block: channels x chunks side by side
#: Blocks of the partial kernel per SM the row chunks aim at: MIN_BLOCKS, the residency its
#: launch bounds guarantee, so that one wave of equally long blocks streams everything (no tail).
BLOCKS_PER_SM = 3
#: Fewest rows each thread of a chunk streams: fewer would make the [2, chunks, C] partial
#: results a noticeable fraction of the traffic (and leave the loads no time in flight).
MIN_ROWS_PER_THREAD = 2 * UNROLL
_VECTOR_BYTES = 16  # the widest load: 16 bytes per thread and row

#: The kernels' one argument, ``Args`` in channel_stats.cuh: y, partial, mean, invstd,
#: running_mean, running_var, batches_tracked, rows, rows_per_chunk, channels, chunks, eps,
#: momentum, cumulative (and the struct's tail padding to 8 bytes).
ARGS = struct.Struct("=7Q2q2i2fi4x")


#: BatchNorm's running statistics that a training call updates, as torch's BatchNorm does:
#: (running_mean, running_var, num_batches_tracked, momentum): num_batches_tracked += 1, then
#: running = (1 - m) running + m batch (the unbiased batch variance for running_var) with
#: m = momentum, or 1 / num_batches_tracked when momentum is None (the cumulative average).
#: running_mean/var float32 [C], num_batches_tracked int64 [].
RunningStats = tuple[torch.Tensor, torch.Tensor, torch.Tensor, "float | None"]


@dataclass(frozen=True)
class LaunchPlan:
    """How one call is cut up: ``vec`` channels per thread (one vector load per row), blocks of
    ``block`` = (TX channel vectors, TY rows) threads on a grid of ``grid`` = (channel tiles,
    row chunks) for the partial kernel; each chunk holds ``rows_per_chunk`` rows (the last one
    fewer), a multiple of TY."""

    vec: int
    block: tuple[int, int, int]
    grid: tuple[int, int, int]
    rows_per_chunk: int

    @property
    def chunks(self) -> int:
        return self.grid[1]


def vector_width(channels: int, element_size: int, address: int) -> int:
    """Channels per thread: the widest vector of up to 16 bytes that divides C and whose loads
    the data's address keeps aligned (rows are C elements apart, so row 0 decides; only the
    address modulo 16 matters)."""
    vec = _VECTOR_BYTES // element_size
    while vec > 1 and (channels % vec or address % (vec * element_size)):
        vec //= 2
    return vec


@functools.cache  # per call: one lookup (the address enters modulo 16)
def plan(rows: int, channels: int, element_size: int, address: int, sm_count: int) -> LaunchPlan:
    """The launch geometry for a [rows, channels] matrix (rows, channels >= 1) at ``address``
    (modulo 16 is enough) on a GPU with ``sm_count`` SMs: channel vectors across a block's
    threads (consecutive threads read consecutive memory, a warp spans whole rows when C is
    narrow), rows across the rest of the block, and as many row chunks as fill the GPU with one
    wave of :data:`BLOCKS_PER_SM` blocks per SM while each thread still streams
    :data:`MIN_ROWS_PER_THREAD` rows."""
    vec = vector_width(channels, element_size, address)
    vectors = channels // vec
    tx = min(vectors, MAX_THREADS)
    ty = MAX_THREADS // tx
    tiles = -(-vectors // tx)
    target_chunks = max(1, sm_count * BLOCKS_PER_SM // tiles)  # at most one wave of blocks
    rows_per_chunk = max(-(-rows // target_chunks), ty * MIN_ROWS_PER_THREAD)
    rows_per_chunk = -(-rows_per_chunk // ty) * ty
    chunks = -(-rows // rows_per_chunk)
    return LaunchPlan(vec, (tx, ty, 1), (tiles, chunks, 1), rows_per_chunk)


@dataclass(frozen=True)
class StatsKernels:
    """The two kernels of one (storage dtype, vector width): source and names."""

    dtype: torch.dtype
    vec: int

    @property
    def tag(self) -> str:
        return f"{STORAGE[self.dtype].ctype.strip('_')}_v{self.vec}"

    @functools.cached_property
    def partial_name(self) -> str:
        return f"spikefuse_channel_stats_partial_{self.tag}"

    @functools.cached_property
    def merge_name(self) -> str:
        return f"spikefuse_channel_stats_merge_{self.tag}"

    @functools.cached_property
    def source(self) -> str:
        """The prelude (storage type, VEC, kernel names), then ``channel_stats.cuh``."""
        storage = STORAGE[self.dtype]
        lines = [
            f"// spikefuse channel statistics: {storage.ctype} storage, VEC = {self.vec}",
            *storage.declarations(),
            f"constexpr int VEC = {self.vec};  // channels per thread",
            f"#define PARTIAL_KERNEL {self.partial_name}",
            f"#define MERGE_KERNEL {self.merge_name}",
        ]
        prelude = "\n".join(lines)
        return f'{prelude}\n#line 1 "{SOURCE_NAME}"\n{_template()}'


@functools.cache
def _template() -> str:
    return SOURCE_PATH.read_text(encoding="utf-8")


@functools.cache
def kernels_for(dtype: torch.dtype, vec: int) -> StatsKernels:
    """The kernels of a variant (cached: their source is built and hashed once)."""
    return StatsKernels(dtype, vec)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def channel_stats(
    y: torch.Tensor, eps: float, running: RunningStats | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel (mean, invstd) of ``y`` [rows, C] (CUDA, contiguous, float32/float16/
    bfloat16), both [C] float32: mean_c = sum_r y[r, c] / rows and invstd_c = 1 / sqrt(var_c +
    eps) with the biased var_c = sum_r (y[r, c] - mean_c)^2 / rows (0 where var_c = eps = 0),
    as ``torch.batch_norm_stats`` returns them for the [N, C, *] tensor whose memory y is.
    With ``running`` (rows > 1), the same launches also update BatchNorm's running statistics
    as ``torch.batch_norm_gather_stats_with_counts`` does (see :class:`RunningStats`).

    Accumulates in float32 with Welford's update around a per-channel pivot; deterministic (the
    same bits on every run). NaN or Inf in a channel gives a NaN or Inf mean and a NaN invstd.
    Two launches on the current stream; no host sync.
    """
    check_input(y)
    if y.dim() != 2 or not y.is_contiguous():
        raise SpikefuseError(
            f"channel_stats: expected a contiguous [rows, C] matrix, got shape {tuple(y.shape)} "
            f"with strides {y.stride()}; pass the [rows, C] view of channels-innermost memory"
        )
    rows, channels = y.shape
    if rows == 0:
        raise SpikefuseError("channel_stats: statistics of 0 rows are undefined")
    if running is not None:
        _check_running(running, channels, rows)
    mean = y.new_empty(channels, dtype=torch.float32)
    invstd = torch.empty_like(mean)
    if channels == 0:
        if running is not None:
            running[2].add_(1)
        return mean, invstd
    index = y.device.index if y.device.index is not None else torch.cuda.current_device()
    address = y.data_ptr()
    geometry = plan(rows, channels, y.element_size(), address % _VECTOR_BYTES, _sm_count(index))
    partial = y.new_empty((2, geometry.chunks, channels), dtype=torch.float32)
    args = ARGS.pack(
        address,
        partial.data_ptr(),
        mean.data_ptr(),
        invstd.data_ptr(),
        *((0, 0, 0) if running is None else (t.data_ptr() for t in running[:3])),
        rows,
        geometry.rows_per_chunk,
        channels,
        geometry.chunks,
        eps,
        0.0 if running is None or running[3] is None else running[3],
        running is not None and running[3] is None,
    )
    kernels = kernels_for(y.dtype, geometry.vec)
    launch_named(
        kernels.source, kernels.partial_name, y.device, geometry.grid, geometry.block, args
    )
    merge_grid = (-(-channels // MERGE_CHANNELS), 1, 1)
    merge_block = (MERGE_CHANNELS, MERGE_LANES, 1)
    launch_named(kernels.source, kernels.merge_name, y.device, merge_grid, merge_block, args)
    return mean, invstd


def _check_running(running: RunningStats, channels: int, rows: int) -> None:
    """Raise unless the kernels can update ``running`` in place for [rows, channels] input."""
    mean, var, tracked, _ = running
    vectors_ok = (
        mean.dtype == var.dtype == torch.float32
        and mean.shape == var.shape == (channels,)
        and mean.is_contiguous()
        and var.is_contiguous()
    )
    if not vectors_ok or tracked.dtype != torch.int64 or tracked.numel() != 1:
        raise SpikefuseError(
            "channel_stats: running statistics must be float32 [C] vectors and an int64 counter; "
            f"got {mean.dtype} {tuple(mean.shape)}, {var.dtype} {tuple(var.shape)}, "
            f"{tracked.dtype} {tuple(tracked.shape)} for C = {channels}"
        )
    if rows < 2:
        raise SpikefuseError("channel_stats: the unbiased variance needs at least 2 rows")


# ---- timing: python -m spikefuse.cuda.channel_stats ---------------------------------------------
#: The medium DATE'22 network's synapse outputs at T = 10, B = 64: [T*B, C, H, W] channels-last
#: convolutions and a [T*B, C] Linear.
MEDIUM_NET_SHAPES = ((640, 128, 32, 32), (640, 256, 16, 16), (640, 512, 8, 8), (640, 1024))


def _microseconds(fn, repeats: int) -> float:
    """Mean GPU time of ``fn()`` in microseconds over ``repeats`` back-to-back calls."""
    for _ in range(3):  # compile, load, warm the allocator
        fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) * 1000.0 / repeats


def benchmark(repeats: int = 100, eps: float = 1e-5) -> None:
    """Print us per call and GB/s (bytes of y read once) of ``torch.batch_norm_stats`` and
    :func:`channel_stats` on :data:`MEDIUM_NET_SHAPES` in float32 and bfloat16, and the largest
    relative differences of mean and invstd between them."""
    print(f"{torch.cuda.get_device_name()}: batch_norm_stats vs channel_stats ({repeats} calls)")
    header = f"{'shape':<22}{'dtype':<10}{'torch us':>10}{'GB/s':>8}{'ours us':>10}{'GB/s':>8}"
    print(f"{header}{'speed-up':>10}{'d mean':>10}{'d invstd':>10}")
    for shape in MEDIUM_NET_SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            y = torch.randn(shape, device="cuda").mul_(0.5).add_(0.2).to(dtype)
            if y.dim() == 4:
                y = y.contiguous(memory_format=torch.channels_last)
            rows = y.movedim(1, -1).reshape(-1, shape[1])  # a view: channels innermost
            gigabytes = y.numel() * y.element_size() / 1e9
            theirs = _microseconds(lambda y=y: torch.batch_norm_stats(y, eps), repeats)
            ours = _microseconds(lambda rows=rows: channel_stats(rows, eps), repeats)
            want, got = torch.batch_norm_stats(y, eps), channel_stats(rows, eps)
            d_mean, d_invstd = (
                ((g - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want, strict=True)
            )
            print(
                f"{'x'.join(map(str, shape)):<22}{str(dtype)[6:]:<10}"
                f"{theirs:>10.1f}{gigabytes / theirs * 1e6:>8.0f}"
                f"{ours:>10.1f}{gigabytes / ours * 1e6:>8.0f}{theirs / ours:>10.2f}"
                f"{d_mean:>10.1e}{d_invstd:>10.1e}"
            )


if __name__ == "__main__":
    benchmark()
