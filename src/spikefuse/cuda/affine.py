"""Channel-affine neuron kernels: BatchNorm folded into the neuron's input, for the fused
Conv/Linear -> BatchNorm -> neuron blocks (:mod:`spikefuse.fused`).

Implements :class:`spikefuse.backends.AffineKernels`: :func:`affine_fptt` computes
spikes = neuron(BN(y)) in one launch, :func:`affine_bptt` BatchNorm's two backward passes through
the neuron, recomputing it from y chunk by chunk. The kernels are the neuron kernels' template
compiled with ``AFFINE`` (see :mod:`.codegen`); their launch geometry is planned once per call
signature in :mod:`.affine_plan`, launches go through :mod:`.runtime`. With ``pool`` = k > 1
both also fold the k x k average pooling of the spikes in (``POOL``): forward returns the
pooled spikes, backward takes their gradient. With a ``residual`` R (``RESIDUAL``) the neuron's
input is BN(y) + R, and backward pass 2 also returns dL/dR.
"""

from __future__ import annotations

import torch

from ..backends import as_channels_innermost, flags_at, packed_bytes, repeats_one_step
from ..program import NeuronProgram
from .affine_grad import affine_input_grad
from .affine_plan import LaunchPlan, affine_chunk, can_pool, empty, plan_for
from .kernel_spec import KEEPS_INPUT_GRAD
from .runtime import (
    check_checkpoints,
    check_input,
    checkpoints_like,
    launch,
    learnable_grad_buffers,
    pointer,
)

# What :class:`~spikefuse.backends.AffineKernels` names (can_pool is the plans').
__all__ = [
    "affine_bptt",
    "affine_fptt",
    "affine_input_grad",
    "affine_saved_like",
    "can_pool",
    "keeps_input_grad",
    "laid_out_grad_spikes",
]


def keeps_input_grad(y: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """Whether pass 1 of :func:`affine_bptt` on y (with this residual) can keep g = dL/dX for
    :func:`affine_input_grad` (``keep_grad_input``), which then replaces pass 2: y's dtype is
    one of :data:`~.kernel_spec.KEEPS_INPUT_GRAD` (16-bit storage), and with a residual y
    is not repeated over time (dL/dresidual is per step, a kept g then summed over T)."""
    return y.dtype in KEEPS_INPUT_GRAD and (residual is None or not repeats_one_step(y))


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


def per_channel_sum(per_neuron: torch.Tensor, channels: tuple[int, int]) -> torch.Tensor:
    """[K, M] per-neuron (or per-tile) values → [K, C] sums over each channel's (one launch)."""
    c, inner = channels
    return per_neuron.view(per_neuron.shape[0], -1, c, inner).sum(dim=(1, 3))


def affine_saved_like(program: NeuronProgram, y: torch.Tensor, save: bool) -> torch.Tensor | None:
    """Uninitialised checkpoints as :func:`affine_fptt` returns them (None if it returns None)."""
    return checkpoints_like(program, y, save, affine_chunk(y))[0]


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
    :func:`~.affine_plan.affine_chunk` steps but the last, float32; None where T fits one
    chunk).

    ``pool`` = k > 1 (a map y as :func:`~.affine_plan.pooled_geometry` describes): returns
    instead the means of the spikes over k x k windows [T, B, C, H/k, W/k] (channels-last),
    the average pooling of the spikes with kernel = stride = k; the full spikes are never
    written.

    ``residual``: a tensor shaped like y and of y's dtype, added to BN(y) (unpooled only).

    Unpooled, y may be one step repeated over time (stride 0 over T, ``expand``): the kernel
    reads that step at every step.

    ``pack_spikes``: a pooled launch also writes each mean as the k² spikes behind it, 1 bit
    each (the packing :class:`~spikefuse.fused.spike_bits.PackedSpikes` reads, in the means'
    memory order), returned third; else, and where the kernel cannot
    (:meth:`~.affine_plan.LaunchPlan.packs`), None. Only pooled kernels pack: restoring their
    output by rerunning this launch would read k² elements of y per mean, while an unpooled
    output costs about the same to recompute from y as to unpack (one read of y per spike
    against one write), so its bits would only take memory.
    """
    check_input(y)
    _check_residual(residual, y, pool)
    plan = plan_for(program, y, pool, residual, True, residual)
    y = plan.memory_of(y)
    spikes = empty(plan.steps, y)
    residual = None if residual is None else _laid_out(residual, plan.steps[1], y.dtype)
    # sized by the chunk the kernel is compiled for (a step of the neurons: pooled, y's)
    steps = spikes if pool == 1 else y
    v_ckpt = checkpoints_like(program, steps, save_for_backward, plan.kernel.chunk)[0]
    pointers = _reads(y, v_ckpt, learnable, residual, mean, invstd, weight, bias)
    pointers["spike_seq"] = spikes.data_ptr()
    packed = _packing(plan, pool, spikes, pointers) if pack_spikes else None
    if plan.N:
        launch(plan.kernel, True, y.device, plan.grid, plan.args(pointers, v_init, constants))
    return spikes, v_ckpt, packed


def _reads(
    y: torch.Tensor,
    v_ckpt: torch.Tensor | None,
    learnable: torch.Tensor | None,
    residual: torch.Tensor | None,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> dict[str, int]:
    """The addresses every affine kernel reads (absent tensors: null); a launch adds its own."""
    return {
        "x_seq": y.data_ptr(),
        "v_ckpt": pointer(v_ckpt),
        "learnable": pointer(learnable),
        "residual_seq": pointer(residual),
        "bn_mean": mean.data_ptr(),
        "bn_invstd": invstd.data_ptr(),
        "bn_weight": pointer(weight),
        "bn_bias": pointer(bias),
    }


def _put_rows(pointers: dict[str, int], names: tuple[str, str], pair: torch.Tensor | None) -> None:
    """The addresses of the two rows of a [2, K] tensor (none without it: null), from its base
    address: indexing would cost two tensor ops per launch."""
    if pair is None:
        return
    pointers[names[0]] = first = pair.data_ptr()
    pointers[names[1]] = first + pair.stride(0) * pair.element_size()


def _packing(
    plan: LaunchPlan, pool: int, spikes: torch.Tensor, pointers: dict[str, int]
) -> torch.Tensor | None:
    """The packing of the pooled means ``spikes`` that the forward kernel writes (None where it
    cannot, :meth:`~.affine_plan.LaunchPlan.packs`), its words and then its flags added to
    ``pointers``."""
    if not plan.packs(pool):
        return None
    n, window = spikes.numel(), pool * pool
    packed = torch.empty(packed_bytes(n, window), dtype=torch.uint8, device=spikes.device)
    pointers["spike_words"] = words = packed.data_ptr()
    pointers["spike_nan"] = words + flags_at(n, window)
    return packed


def _as_read(
    plan: LaunchPlan, grad_spikes: torch.Tensor, dtype: torch.dtype, pool: int
) -> torch.Tensor:
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
    return _as_read(plan_for(program, y, pool, residual, False), grad_spikes, y.dtype, pool)


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
    keep_grad_input: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """BPTT of :func:`affine_fptt` in one launch, recomputing the neuron from y chunk by chunk.

    With g = dL/dX (X = BN(y)), returns ``(dL/dy, sums, grad_learnable)``:

    * ``grad_y=False`` (pass 1): ``sums`` [2, C] float32, the per-channel sums over (T, B, *S)
      of g and of g (y - mean[c]), and dL/d(learnable) shaped like it (or None); dL/dy None,
      or with ``keep_grad_input`` (where :func:`keeps_input_grad`) g itself in y's dtype,
      laid out as y's memory is read (for a y repeated over time: summed over T, one step),
      for :func:`affine_input_grad`; with a residual it is dL/dresidual too (a residual
      with a y repeated over time keeps no g: dL/dresidual is per step).
    * ``grad_y=True`` (pass 2): dL/dy in y's dtype and layout, = scale g with running
      statistics (``totals`` None), or with batch statistics BatchNorm's full backward
      scale g + coef_y y + coef_0, coef_y = -scale invstd m_gy invstd, coef_0 = -scale m_g -
      mean coef_y, from ``totals`` [2, C] (pass 1's sums over all processes) times
      ``inv_count`` (m_g, m_gy). The other two are None.

    ``pool`` = k > 1: of :func:`affine_fptt` with that ``pool``; ``grad_spikes`` is the gradient
    of the pooled spikes, each neuron's dL/dS that of its window's mean divided by k².
    ``residual``: the forward's; pass 2 then returns ``(dL/dy, dL/dresidual = g, None)``, both
    in y's dtype and layout. A y repeated over time (see :func:`affine_fptt`): pass 2 returns
    dL/dy summed over T, the gradient of the one step [1, B, C, *S] (in that step's layout).
    ``overwrite_y`` (pass 2): dL/dy is written over y's memory and returned in it (y's values
    are lost). The kernel allows it: each thread reads its neurons' y of a chunk of steps
    before it writes their dL/dy, and no other thread touches them.
    """
    check_input(y)
    _check_residual(residual, y, pool)
    if keep_grad_input and (grad_y or not keeps_input_grad(y, residual)):
        raise ValueError(
            f"affine_bptt: only pass 1 keeps dL/dX, with 16-bit storage ({y.dtype}) and, with a "
            "residual, per step (not for a y repeated over time)"
        )
    # dL/dS and the residual as given: a copy made below would be aligned anyway
    plan = plan_for(program, y, pool, residual, False, grad_spikes, residual)
    y = plan.memory_of(y)
    grad_spikes = _as_read(plan, grad_spikes, y.dtype, pool)  # laid out already: itself
    residual = None if residual is None else _laid_out(residual, plan.steps[1], y.dtype)
    check_checkpoints(plan.T, saved_v, plan.kernel.chunk)
    pointers = _reads(y, saved_v, learnable, residual, mean, invstd, weight, bias)
    pointers["grad_spike_seq"] = grad_spikes.data_ptr()
    _put_rows(pointers, ("bn_total_g", "bn_total_gy"), totals)
    launch_args = (plan, y.device, pointers, v_init, constants, inv_count)
    if grad_y:
        out, grad_residual = _pass_two_outputs(plan, y, residual, overwrite_y, pointers)
        _launch_backward(*launch_args)
        return out, grad_residual, None
    sums, grad_learnable = _pass_one_outputs(plan, program, y, learnable, pointers)
    kept = None
    if keep_grad_input:  # g besides the sums, laid out as y's memory
        kept = empty(plan.memory, y)
        pointers["grad_input_seq"] = pointer(kept)
    _launch_backward(*launch_args)
    return kept, per_channel_sum(sums, plan.layout), grad_learnable


def _pass_one_outputs(
    plan: LaunchPlan,
    program: NeuronProgram,
    y: torch.Tensor,
    learnable: torch.Tensor | None,
    pointers: dict[str, int],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pass 1's outputs, their addresses added to ``pointers``: the [2, per_sum] partial sums
    (rows ``grad_sum`` and ``grad_dot``) and the learnable parameters' gradient (or None)."""
    sums = y.new_empty((2, plan.per_sum), dtype=torch.float32)
    _put_rows(pointers, ("grad_sum", "grad_dot"), sums)
    blocks = plan.grid[0] * plan.grid[1] if plan.N else 0
    grad_learnable, learnable_pointers = learnable_grad_buffers(program, learnable, blocks)
    pointers.update(learnable_pointers)
    return sums, grad_learnable


def _pass_two_outputs(
    plan: LaunchPlan,
    y: torch.Tensor,
    residual: torch.Tensor | None,
    overwrite_y: bool,
    pointers: dict[str, int],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pass 2's outputs, their addresses added to ``pointers``: dL/dy (y's memory itself with
    ``overwrite_y``; repeated: the one step's) and, with a residual, dL/dresidual."""
    out = y if overwrite_y else empty(plan.memory, y)
    pointers["grad_x_seq"] = pointer(out)
    grad_residual = None
    if residual is not None:
        grad_residual = empty(plan.steps, y)
        pointers["grad_residual_seq"] = pointer(grad_residual)
    return out, grad_residual


def _launch_backward(
    plan: LaunchPlan,
    device: torch.device,
    pointers: dict[str, int],
    v_init: float,
    constants: list[float],
    inv_count: float,
) -> None:
    if plan.N:  # nothing to launch for an empty map
        launch(
            plan.kernel, False, device, plan.grid, plan.args(pointers, v_init, constants, inv_count)
        )
