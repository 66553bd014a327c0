"""Channel-affine neuron kernels: BatchNorm folded into the neuron's input, for the fused
Conv/Linear -> BatchNorm -> neuron blocks (:mod:`spikefuse.fused`).

Implements :class:`spikefuse.backends.AffineKernels`: :func:`affine_fptt` computes
spikes = neuron(BN(y)) in one launch, :func:`affine_bptt` BatchNorm's two backward passes through
the neuron, recomputing it from y chunk by chunk. The kernels are the neuron kernels' template
compiled with ``AFFINE`` (see :mod:`.codegen`); launches go through :mod:`.runtime`. With
``pool`` = k > 1 both also fold the k x k average pooling of the spikes in (``POOL``): forward
returns the pooled spikes, backward takes their gradient. With a ``residual`` R (``RESIDUAL``)
the neuron's input is BN(y) + R, and backward pass 2 also returns dL/dR.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ..backends import (
    as_channels_innermost,
    channels_innermost,
    flags_at,
    packed_bytes,
    repeats_one_step,
)
from ..program import NeuronProgram
from .codegen import (
    AFFINE_BPTT_VEC,
    AFFINE_CHUNK,
    BLOCK_THREADS,
    POOLS,
    VEC,
    NeuronKernel,
    chunk_steps,
)
from .runtime import (
    aligned,
    blocks_for,
    check_checkpoints,
    check_input,
    checkpoints_like,
    kernel_for,
    launch,
    learnable_grad_buffers,
    pointer,
    vector_width,
)


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


def _memory(y: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int], int | None]:
    """(memory, (channels, inner), x_step) of y [T, B, C, *S] for the unpooled kernels: y as
    :func:`channel_layout` gives it and x_step None (N), or for a y repeated over time (stride
    0 over T, T > 1: an input image's synapse output at every step) its one step [1, B, C, *S]
    and x_step 0."""
    if repeats_one_step(y):
        one, layout = channel_layout(y[:1])
        return one, layout, 0
    y, layout = channel_layout(y)
    return y, layout, None


def _step_strides(memory: torch.Tensor) -> tuple[int, ...]:
    """Strides of a [T, B, C, *S] sequence laid out step after step like ``memory`` [1 or T, B,
    C, *S] (dense): what the kernels read and write at element t * N + n."""
    return (memory[0].numel(), *memory.stride()[1:])


def _sequence_empty(memory: torch.Tensor, steps: int) -> torch.Tensor:
    """Uninitialised [steps, B, C, *S] with :func:`_step_strides` of ``memory``."""
    shape = (steps, *memory.shape[1:])
    return torch.empty_strided(
        shape, _step_strides(memory), dtype=memory.dtype, device=memory.device
    )


def can_pool(y: torch.Tensor, pool: int) -> bool:
    """Whether the pooled kernels take y [T, B, C, H, W] with ``pool`` x ``pool`` windows (one
    of :data:`~.codegen.POOLS`): channels innermost in memory (a channels-last convolution's
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


def _pooled_empty(y: torch.Tensor, pool: int) -> torch.Tensor:
    """Uninitialised [T, B, C, H/pool, W/pool] in y's dtype, channels innermost like y (the
    layout :class:`~spikefuse.fused.WindowAvgPool` gives a channels-last map); not a view."""
    T, B, C, H, W = y.shape
    h, w = H // pool, W // pool
    strides = (B * h * w * C, h * w * C, 1, w * C, C)
    return torch.empty_strided((T, B, C, h, w), strides, dtype=y.dtype, device=y.device)


def _laid_out(t: torch.Tensor, strides: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """t with these strides and dtype, copied only if they differ."""
    if t.stride() == strides and t.dtype == dtype:
        return t
    out = torch.empty_strided(t.shape, strides, dtype=dtype, device=t.device)
    return out.copy_(t)


def _check_residual(residual: torch.Tensor | None, y: torch.Tensor, pool: int) -> None:
    if residual is not None and (
        residual.shape != y.shape or residual.dtype != y.dtype or pool > 1
    ):
        raise ValueError(
            f"residual affine kernels add a tensor of y's shape {tuple(y.shape)} and dtype "
            f"{y.dtype}, unpooled; got {tuple(residual.shape)}, {residual.dtype}, pool={pool}"
        )


# Rows of a channel-tiled backward block (the template's TILE_ROWS: 32 channels x this many rows).
TILE_ROWS = BLOCK_THREADS // 32
MAX_GRID_ROWS = 65535  # CUDA's limit on gridDim.y


def _per_channel_sum(per_neuron: torch.Tensor, channels: tuple[int, int]) -> torch.Tensor:
    """[K, M] per-neuron (or per-tile) values → [K, C] sums over each channel's (one launch)."""
    c, inner = channels
    return per_neuron.view(per_neuron.shape[0], -1, c, inner).sum(dim=(1, 3))


def _bptt_grid(
    n: int, channels: tuple[int, int], vec: int, pool: int = 1
) -> tuple[int, tuple[int, int], int]:
    """(channel_tiles, grid, partial sums per sum of pass 1) of the backward over ``n`` slots
    (the neurons, or the pooled kernels' windows).

    With channels innermost in whole warps (inner 1, C a multiple of 32, one neuron per thread,
    no pooling, at most 65535 groups of ``TILE_ROWS`` rows: CUDA's bound on grid rows) block
    (x, y) owns the 32 channels of tile x in the rows of group y, and pass 1 writes one sum per
    channel and row group (``channel_tiles`` = C / 32; grid (C / 32, row groups)); otherwise
    the grid is one row of blocks, every slot writing its own sums (``channel_tiles`` 0).
    """
    c, inner = channels
    row_groups = -(-(n // c) // TILE_ROWS)
    if inner != 1 or c % 32 or vec != 1 or pool != 1 or not 0 < row_groups <= MAX_GRID_ROWS:
        return 0, (blocks_for(n, vec), 1), n
    return c // 32, (c // 32, row_groups), row_groups * c


def _rows(names: tuple[str, str], pair: torch.Tensor | None) -> dict[str, int]:
    """The addresses of the two rows of a float32 [2, K] tensor (null without it), from its
    base address: indexing would cost two tensor ops per launch."""
    if pair is None:
        return dict.fromkeys(names, 0)
    first = pair.data_ptr()
    return {names[0]: first, names[1]: first + pair.stride(0) * pair.element_size()}


def _bn_pointers(
    mean: torch.Tensor, invstd: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None
) -> dict[str, int]:
    return {
        "bn_mean": mean.data_ptr(),
        "bn_invstd": invstd.data_ptr(),
        "bn_weight": pointer(weight),
        "bn_bias": pointer(bias),
    }


def affine_saved_like(program: NeuronProgram, y: torch.Tensor, save: bool) -> torch.Tensor | None:
    """Uninitialised checkpoints as :func:`affine_fptt` returns them (None if it returns None)."""
    return checkpoints_like(program, y, save, affine_chunk(y))[0]


def affine_chunk(y: torch.Tensor) -> int:
    """Steps per backward chunk of the affine kernels on y [T, ...] (see ``chunk_steps``)."""
    return chunk_steps(y.shape[0], AFFINE_CHUNK[y.dtype])


Geometry = tuple[torch.Size, tuple[int, ...]]  # (shape, strides)


@dataclass(frozen=True)
class _Plan:
    """What a launch needs that depends only on the call's signature (program, y's dtype,
    shape and strides, pooling, residual, direction, alignment): worked out once per signature
    by :func:`_plan`, so that a call only allocates its outputs, reads the pointers and launches.
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
    channel_tiles: int  # backward: see _bptt_grid
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


@functools.lru_cache(maxsize=256)
def _plan(
    program: NeuronProgram,
    dtype: torch.dtype,
    shape: torch.Size,
    strides: tuple[int, ...],
    pool: int,
    residual: bool,
    forward: bool,
    vectors: bool,
) -> _Plan:
    """The plan of a call on y of this geometry, read with the launchers' own layout helpers
    from a meta tensor of it. ``vectors``: the call's pointers allow vector access (see
    :func:`~.runtime.aligned`; else one neuron per thread). Raises what those helpers raise
    (e.g. for a map the pooled kernels cannot take)."""
    y = torch.empty_strided(shape, strides, dtype=dtype, device="meta")
    T, N = shape[0], y[:1].numel()
    x_step = None
    if pool > 1:
        channels, pool_width = pooled_geometry(y, pool)
        memory, layout, steps = y, (channels, 1), _pooled_empty(y, pool)
    else:
        memory, layout, x_step = _memory(y)
        steps, pool_width = _sequence_empty(memory, T), 0
    # .contiguous() copies exactly when the strides differ (read from the geometry: tensor
    # identity fails under inference_mode, where views have no _base)
    copy = memory.stride() != (y[:1] if x_step == 0 else y).stride()
    vec = 1
    if pool == 1 and vectors:
        vec = vector_width(N, vec=VEC if forward else AFFINE_BPTT_VEC)
    kernel = kernel_for(program, dtype, vec, True, pool, residual, affine_chunk(y))
    tiles, grid, per_sum = 0, (blocks_for(N // pool**2, vec), 1), 0
    if not forward:
        tiles, grid, per_sum = _bptt_grid(N // pool**2, layout, vec, pool)
    return _Plan(
        kernel,
        T,
        N,
        layout,
        pool_width,
        x_step,
        copy,
        (memory.shape, memory.stride()),
        (steps.shape, steps.stride()),
        grid,
        tiles,
        per_sum,
    )


def _plan_for(
    program: NeuronProgram,
    y: torch.Tensor,
    pool: int,
    residual: torch.Tensor | None,
    forward: bool,
    *read: torch.Tensor | None,
) -> _Plan:
    """The plan of a call on y, with vector access where y (unless the call copies it: a copy
    is aligned) and the other tensors the kernel reads as given (``read``) are aligned."""
    key = (program, y.dtype, y.shape, y.stride(), pool, residual is not None, forward)
    plan = _plan(*key, True)
    if not aligned(*read) or (not plan.copy and not aligned(y)):
        plan = _plan(*key, False)
    return plan


def _memory_of(y: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """y's memory as ``plan`` reads it: y itself, its one repeated step, or a contiguous copy."""
    one = y[:1] if plan.x_step == 0 else y
    return one.contiguous() if plan.copy else one


def _empty(geometry: Geometry, like: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(*geometry, dtype=like.dtype, device=like.device)


def affine_fptt(
    program: NeuronProgram,
    y: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    learnable: torch.Tensor | None,
    constants: list[float],
    v_init: float,
    save_for_backward: bool,
    pool: int = 1,
    residual: torch.Tensor | None = None,
    pack_spikes: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """spikes = neuron(BN(y) [+ residual]) for y [T, B, C, *] in one launch.

    BN(y) = y * scale[c] + shift[c] with scale = invstd * weight, shift = bias - mean * scale
    (weight None: 1, bias None: 0); the vectors are float32 [C]. The neuron starts from the
    constant ``v_init``. Returns the spikes (y's dtype and layout) and, with
    ``save_for_backward``, the chunk checkpoints (V at the end of every chunk of
    :func:`affine_chunk` steps but the last, float32; None where T fits one chunk).

    ``pool`` = k > 1 (a map y as :func:`pooled_geometry` describes): returns instead the means
    of the spikes over k x k windows [T, B, C, H/k, W/k] (channels-last), the average pooling
    of the spikes with kernel = stride = k; the full spikes are never written.

    ``residual``: a tensor shaped like y and of y's dtype, added to BN(y) (unpooled only).

    Unpooled, y may be one step repeated over time (stride 0 over T, ``expand``): the kernel
    reads that step at every step.

    ``pack_spikes``: a pooled launch also writes each mean as the k² spikes behind it, 1 bit
    each (the packing :class:`~spikefuse.fused.spike_bits.PackedSpikes` reads, in the means'
    memory order), returned third; else, and where the kernel cannot (:func:`_packs`), None.
    Only pooled kernels pack: restoring their output by rerunning this launch would read k²
    elements of y per mean, while an unpooled output costs about the same to recompute from y
    as to unpack (one read of y per spike against one write), so its bits would only take
    memory.
    """
    check_input(y)
    _check_residual(residual, y, pool)
    plan = _plan_for(program, y, pool, residual, True, residual)
    y = _memory_of(y, plan)
    spikes = _empty(plan.steps, y)
    residual = None if residual is None else _laid_out(residual, plan.steps[1], y.dtype)
    # sized by the chunk the kernel is compiled for (a step of the neurons: pooled, y's)
    steps = spikes if pool == 1 else y
    v_ckpt = checkpoints_like(program, steps, save_for_backward, plan.kernel.chunk)[0]
    packed, window = None, pool * pool
    if pack_spikes and _packs(plan, pool):
        packed = torch.empty(
            packed_bytes(spikes.numel(), window), dtype=torch.uint8, device=y.device
        )
    if plan.N:
        pointers = {
            "x_seq": y.data_ptr(),
            "spike_seq": spikes.data_ptr(),
            **_packing_pointers(packed, spikes.numel(), window),
            "v_ckpt": pointer(v_ckpt),
            "learnable": pointer(learnable),
            "residual_seq": pointer(residual),
            **_bn_pointers(mean, invstd, weight, bias),
        }
        launch(plan.kernel, True, y.device, plan.grid, plan.args(pointers, v_init, constants))
    return spikes, v_ckpt, packed


def _packs(plan: _Plan, pool: int) -> bool:
    """Whether the forward kernel of ``plan`` packs its means: a pooled kernel (a mean takes
    k² = 4 bits, :data:`POOLS`, which unpacking reads) of whole warps (the lanes of a word
    exchange their bits)."""
    window = pool * pool
    return pool > 1 and 32 % window == 0 and plan.N // window % 32 == 0


def _packing_pointers(packed: torch.Tensor | None, n: int, window: int) -> dict[str, int]:
    """The kernel's ``spike_words`` and ``spike_nan``: the words, then the flags, of the
    packing ``packed`` of n values of ``window`` bits (None: no fields, null)."""
    if packed is None:
        return {}
    return {
        "spike_words": packed.data_ptr(),
        "spike_nan": packed.data_ptr() + flags_at(n, window),
    }


def _as_read(plan: _Plan, grad_spikes: torch.Tensor, dtype: torch.dtype, pool: int) -> torch.Tensor:
    """dL/dS as ``plan``'s backward kernels read it, in ``dtype``: channels innermost (pooled)
    or in the steps' layout of y's memory; itself where it is that already, else one copy."""
    if pool > 1:
        return as_channels_innermost(grad_spikes, dtype)
    return _laid_out(grad_spikes, plan.steps[1], dtype)


def laid_out_grad_spikes(
    program: NeuronProgram,
    y: torch.Tensor,
    grad_spikes: torch.Tensor,
    pool: int = 1,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """dL/dS as :func:`affine_bptt` with these arguments reads it, in y's dtype (itself where it
    is laid out so, else one copy): a caller running both passes lays it out once, where each
    pass would otherwise copy it."""
    return _as_read(_plan_for(program, y, pool, residual, False), grad_spikes, y.dtype, pool)


def affine_bptt(
    program: NeuronProgram,
    y: torch.Tensor,
    grad_spikes: torch.Tensor,
    saved_v: torch.Tensor | None,
    learnable: torch.Tensor | None,
    constants: list[float],
    v_init: float,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    totals: torch.Tensor | None = None,
    inv_count: float = 0.0,
    *,
    grad_y: bool,
    pool: int = 1,
    residual: torch.Tensor | None = None,
    overwrite_y: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """BPTT of :func:`affine_fptt` in one launch, recomputing the neuron from y chunk by chunk.

    With g = dL/dX (X = BN(y)), returns ``(dL/dy, sums, grad_learnable)``:

    * ``grad_y=False`` (pass 1): ``sums`` [2, C] float32, the per-channel sums over (T, B, *S)
      of g and of g (y - mean[c]), and dL/d(learnable) shaped like it (or None); dL/dy is
      None.
    * ``grad_y=True`` (pass 2): dL/dy in y's dtype and layout, = scale g with running
      statistics (``totals`` None), or with batch statistics BatchNorm's full backward
      scale g + coef_y y + coef_0, coef_y = -scale invstd m_gy invstd, coef_0 = -scale m_g -
      mean coef_y, from ``totals`` [2, C] (pass 1's sums over all processes) times
      ``inv_count`` (m_g, m_gy). The other two are None.

    ``pool`` = k > 1: of :func:`affine_fptt` with that ``pool``; ``grad_spikes`` is the gradient
    of the pooled spikes, each neuron's dL/dS that of its window's mean divided by k².
    ``residual``: the forward's; pass 2 then returns ``(dL/dy, dL/dresidual = g, None)``, both
    in y's dtype and layout.

    A y repeated over time (see :func:`affine_fptt`): pass 2 returns dL/dy summed over T, the
    gradient of the one step [1, B, C, *S] (in that step's layout).

    ``overwrite_y`` (pass 2): dL/dy is written over y's memory and returned in it (y's values
    are lost). The kernel allows it: each thread reads its neurons' y of a chunk of steps
    before it writes their dL/dy, and no other thread touches them.
    """
    check_input(y)
    _check_residual(residual, y, pool)
    # dL/dS and the residual as given: a copy made below would be aligned anyway
    plan = _plan_for(program, y, pool, residual, False, grad_spikes, residual)
    y = _memory_of(y, plan)
    grad_spikes = _as_read(plan, grad_spikes, y.dtype, pool)  # laid out already: itself
    residual = None if residual is None else _laid_out(residual, plan.steps[1], y.dtype)
    check_checkpoints(plan.T, saved_v, plan.kernel.chunk)
    out = None  # dL/dy; repeated: the one step's
    if grad_y:
        out = y if overwrite_y else _empty(plan.memory, y)
    grad_residual = _empty(plan.steps, y) if grad_y and residual is not None else None
    sums = None if grad_y else y.new_empty((2, plan.per_sum), dtype=torch.float32)
    grad_learnable, learnable_pointers = (
        (None, {})
        if grad_y
        else learnable_grad_buffers(
            program, learnable, plan.grid[0] * plan.grid[1] if plan.N else 0
        )
    )
    if plan.N:
        pointers = {
            "x_seq": y.data_ptr(),
            "v_ckpt": pointer(saved_v),
            "learnable": pointer(learnable),
            "grad_spike_seq": grad_spikes.data_ptr(),
            "grad_x_seq": pointer(out),
            **learnable_pointers,
            "residual_seq": pointer(residual),
            "grad_residual_seq": pointer(grad_residual),
            **_rows(("grad_sum", "grad_dot"), sums),
            **_rows(("bn_total_g", "bn_total_gy"), totals),
            **_bn_pointers(mean, invstd, weight, bias),
        }
        args = plan.args(pointers, v_init, constants, inv_count)
        launch(plan.kernel, False, y.device, plan.grid, args)
    if sums is None:  # pass 2
        return out, grad_residual, None
    return None, _per_channel_sum(sums, plan.layout), grad_learnable
