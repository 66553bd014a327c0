"""Launch geometry of the channel-affine kernels (:mod:`.affine`): how y's memory is read, the
layouts of the outputs, the backward's grid, and the per-signature :class:`LaunchPlan` that
holds all of it together with the compiled variant.

Everything here depends only on a call's signature (program, y's dtype, shape and strides,
pooling, residual, direction, pointer alignment), so :func:`plan_for` works it out once per
signature from a meta tensor and a call only looks it up.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ..backends import channels_innermost, repeats_one_step
from ..program import NeuronProgram
from .codegen import NeuronKernel
from .kernel_spec import (
    AFFINE_BPTT_VEC,
    AFFINE_CHUNK,
    BLOCK_THREADS,
    POOLS,
    VEC,
    chunk_steps,
    needs_wide_index,
)
from .runtime import aligned, blocks_for, kernel_for, vector_width

# Rows of a channel-tiled backward block (the template's TILE_ROWS: 32 channels x this many rows).
TILE_ROWS = BLOCK_THREADS // 32
# A channel-tiled backward block walks up to this many groups of TILE_ROWS rows: its threads set
# up their channel's vectors and coefficients, and the block its sums, once for all of them
# (at small T the set-up is a sizeable share of a backward bound by instruction issue), and
# pass 1 writes as many times fewer partial sums.
GROUPS_PER_BLOCK = 8
# ... but fewer where the grid would then have fewer blocks than this: four waves of an H200's
# 132 SMs at four resident blocks each, about.
GRID_BLOCKS = 2048
MAX_GRID_ROWS = 65535  # CUDA's limit on gridDim.y

Geometry = tuple[torch.Size, tuple[int, ...]]  # (shape, strides)


def channel_layout(y: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
    """y [T, B, C, *S] as dense memory with T outermost, and (channels, inner) such that the
    channel of element n of a step is (n // inner) % channels.

    Contiguous y has inner = prod(S); y with channels innermost (the [T, B, C, H, W] view of a
    channels-last convolution output) has inner = 1 and is used as it is; anything else is
    made contiguous.
    """
    shape = y.shape
    channels, spatial = shape[2], math.prod(shape[3:])
    if y.is_contiguous():
        return y, (channels, spatial)
    if channels_innermost(shape, y.stride()):
        return y, (channels, 1)
    return y.contiguous(), (channels, spatial)


def unpooled_memory(y: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int], int | None]:
    """(memory, (channels, inner), x_step) of y [T, B, C, *S] for the unpooled kernels: y as
    :func:`channel_layout` gives it and x_step None (N), or for a y repeated over time (stride
    0 over T, T > 1: an input image's synapse output at every step) its one step [1, B, C, *S]
    and x_step 0."""
    if repeats_one_step(y):
        one, layout = channel_layout(y[:1])
        return one, layout, 0
    y, layout = channel_layout(y)
    return y, layout, None


def _sequence_empty(memory: torch.Tensor, steps: int) -> torch.Tensor:
    """Uninitialised [steps, B, C, *S] laid out step after step like ``memory`` [1 or T, B, C,
    *S] (dense): what the kernels read and write at element t * N + n."""
    shape = (steps, *memory.shape[1:])
    strides = (memory[0].numel(), *memory.stride()[1:])
    return torch.empty_strided(shape, strides, dtype=memory.dtype, device=memory.device)


def can_pool(y: torch.Tensor, pool: int) -> bool:
    """Whether the pooled kernels take y [T, B, C, H, W] with ``pool`` x ``pool`` windows (one
    of :data:`~.kernel_spec.POOLS`): channels innermost in memory (a channels-last convolution's
    output), H and W multiples of ``pool``."""
    shape = y.shape
    return (
        pool in POOLS[1:]
        and len(shape) == 5
        and shape[3] % pool == 0
        and shape[4] % pool == 0
        and channels_innermost(shape, y.stride())
    )


def pooled_geometry(y: torch.Tensor, pool: int) -> tuple[int, int]:
    """(channels, W / pool) of a map y that :func:`can_pool`; raises ValueError for others."""
    if not can_pool(y, pool):
        raise ValueError(
            f"pooled affine kernels take windows of {POOLS[1:]} on a channels-last [T, B, C, H, "
            f"W] map with H and W multiples of the window; got pool={pool}, shape "
            f"{tuple(y.shape)}, strides {y.stride()}"
        )
    return y.shape[2], y.shape[4] // pool


def pooled_empty(y: torch.Tensor, pool: int) -> torch.Tensor:
    """Uninitialised [T, B, C, H/pool, W/pool] in y's dtype, channels innermost like y (the
    layout :class:`~spikefuse.fused.WindowAvgPool` gives a channels-last map); not a view."""
    T, B, C, H, W = y.shape
    h, w = H // pool, W // pool
    strides = (B * h * w * C, h * w * C, 1, w * C, C)
    return torch.empty_strided((T, B, C, h, w), strides, dtype=y.dtype, device=y.device)


def bptt_grid(
    n: int, channels: tuple[int, int], vec: int, pool: int = 1
) -> tuple[int, tuple[int, int], int]:
    """(channel_tiles, grid, partial sums per sum of pass 1) of the backward over ``n`` slots
    (the neurons, or the pooled kernels' windows).

    With channels innermost in whole warps (inner 1, C a multiple of 32, one neuron per thread,
    no pooling, at most 65535 rows of blocks: CUDA's bound on grid rows) block (x, y) owns the
    32 channels of tile x in the groups of ``TILE_ROWS`` rows y, y + grid rows, ..., and pass 1
    writes one sum per channel and row of blocks (``channel_tiles`` = C / 32; grid (C / 32,
    rows of blocks)). A block walks up to :data:`GROUPS_PER_BLOCK` groups, fewer where the grid
    would have fewer than :data:`GRID_BLOCKS` blocks. Otherwise the grid is one row of blocks,
    every slot writing its own sums (``channel_tiles`` 0).
    """
    c, inner = channels
    tiles = c // 32
    if inner != 1 or c % 32 or not tiles or vec != 1 or pool != 1:
        return 0, (blocks_for(n, vec), 1), n
    row_groups = -(-(n // c) // TILE_ROWS)
    walked = -(-row_groups // GROUPS_PER_BLOCK)
    grid_rows = min(row_groups, max(walked, -(-GRID_BLOCKS // tiles)))
    if not 0 < grid_rows <= MAX_GRID_ROWS:
        return 0, (blocks_for(n, vec), 1), n
    return tiles, (tiles, grid_rows), grid_rows * c


def affine_chunk(y: torch.Tensor) -> int:
    """Steps per backward chunk of the affine kernels on y [T, ...] (see ``chunk_steps``)."""
    return chunk_steps(y.shape[0], AFFINE_CHUNK[y.dtype])


@dataclass(frozen=True)
class LaunchPlan:
    """What a launch needs that depends only on the call's signature (program, y's dtype,
    shape and strides, pooling, residual, direction, alignment): worked out once per signature
    by :func:`plan`, so that a call only allocates its outputs, reads the pointers and launches.
    """

    kernel: NeuronKernel
    T: int
    N: int  # neurons per step
    layout: tuple[int, int]  # (channels, inner), see channel_layout
    pool_width: int  # pooled kernels: W / pool; else 0
    x_step: int | None  # unpooled: y's step stride (None: N; 0: one step repeated over time)
    copy: bool  # y is copied to contiguous memory first (a layout the kernels do not read)
    memory: Geometry  # y's memory as the kernels read it ([1, B, C, *S] if repeated)
    steps: Geometry  # a per-step sequence (spikes, dL/dS, residual): [T, B, C, *S] or pooled
    grid: tuple[int, int]
    channel_tiles: int  # backward: see bptt_grid
    per_sum: int  # backward pass 1: partial sums per sum

    def args(
        self,
        pointers: dict[str, int],
        v_init: float,
        constants: list[float],
        inv_count: float = 0.0,
    ) -> bytes:
        """The kernel's packed ``Args`` for this call's pointers and values."""
        return self.kernel.pack_args(
            pointers,
            self.T,
            self.N,
            v_init,
            0.0,  # w_init: one-state neurons
            constants,
            self.layout,
            inv_count,
            channel_tiles=self.channel_tiles,
            pool_width=self.pool_width,
            x_step=self.x_step,
        )

    def memory_of(self, y: torch.Tensor) -> torch.Tensor:
        """y's memory as this plan reads it: y itself, its one repeated step, or a contiguous
        copy."""
        one = y[:1] if self.x_step == 0 else y
        return one.contiguous() if self.copy else one

    def packs(self, pool: int) -> bool:
        """Whether this forward kernel packs its means: a pooled kernel (a mean takes k² = 4
        bits, :data:`~.kernel_spec.POOLS`, which unpacking reads) of whole warps (the lanes of a
        word exchange their bits)."""
        window = pool * pool
        return pool > 1 and 32 % window == 0 and self.N // window % 32 == 0


@functools.lru_cache(maxsize=256)
def plan(
    program: NeuronProgram,
    dtype: torch.dtype,
    shape: torch.Size,
    strides: tuple[int, ...],
    pool: int,
    residual: bool,
    forward: bool,
    vectors: bool,
) -> LaunchPlan:
    """The plan of a call on y of this geometry, read with the launchers' own layout helpers
    from a meta tensor of it. ``vectors``: the call's pointers allow vector access (see
    :func:`~.runtime.aligned`; else one neuron per thread). Raises what those helpers raise
    (e.g. for a map the pooled kernels cannot take)."""
    y = torch.empty_strided(shape, strides, dtype=dtype, device="meta")
    T, N = shape[0], y[:1].numel()
    x_step = None
    if pool > 1:
        channels, pool_width = pooled_geometry(y, pool)
        memory, layout, steps = y, (channels, 1), pooled_empty(y, pool)
    else:
        memory, layout, x_step = unpooled_memory(y)
        steps, pool_width = _sequence_empty(memory, T), 0
    # .contiguous() copies exactly when the strides differ (read from the geometry: tensor
    # identity fails under inference_mode, where views have no _base)
    copy = memory.stride() != (y[:1] if x_step == 0 else y).stride()
    vec = 1
    if pool == 1 and vectors:
        vec = vector_width(N, vec=VEC if forward else AFFINE_BPTT_VEC)
    wide = needs_wide_index(T, N, layout[0])
    kernel = kernel_for(program, dtype, vec, True, pool, residual, affine_chunk(y), wide)
    tiles, grid, per_sum = 0, (blocks_for(N // pool**2, vec), 1), 0
    if not forward:
        tiles, grid, per_sum = bptt_grid(N // pool**2, layout, vec, pool)
    geometry = (memory.shape, memory.stride()), (steps.shape, steps.stride())
    return LaunchPlan(
        kernel, T, N, layout, pool_width, x_step, copy, *geometry, grid, tiles, per_sum
    )


def plan_for(
    program: NeuronProgram,
    y: torch.Tensor,
    pool: int,
    residual: torch.Tensor | None,
    forward: bool,
    *read: torch.Tensor | None,
) -> LaunchPlan:
    """The plan of a call on y, with vector access where y (unless the call copies it: a copy
    is aligned) and the other tensors the kernel reads as given (``read``) are aligned. A plan
    of one neuron per thread is the same either way: its pointers are not looked at."""
    key = (program, y.dtype, y.shape, y.stride(), pool, residual is not None, forward)
    found = plan(*key, True)
    if found.kernel.vec > 1 and (not aligned(*read) or (not found.copy and not aligned(y))):
        found = plan(*key, False)
    return found


def empty(geometry: Geometry, like: torch.Tensor) -> torch.Tensor:
    """Uninitialised tensor of a plan's ``geometry`` in ``like``'s dtype and device."""
    return torch.empty_strided(*geometry, dtype=like.dtype, device=like.device)
