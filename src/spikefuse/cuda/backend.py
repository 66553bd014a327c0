"""The cuda backend: a neuron program's fused forward and backward kernels, launched on [T, *].

Implements :class:`spikefuse.backends.NeuronBackend`. The kernels come from :mod:`.codegen`
(source) and :mod:`.runtime` (compilation, caching, launch); the BatchNorm-folded variants the
fused blocks use are in :mod:`.affine`.
"""

from __future__ import annotations

import math

import torch

from ..backends import BPTTOut, FPTTOut
from ..program import NeuronProgram
from . import unavailable_reason
from .kernel_spec import BPTT_VEC, CHUNK, VEC, chunk_steps, needs_wide_index
from .runtime import (
    blocks_for,
    check_checkpoints,
    check_input,
    checkpoints_like,
    compiled,
    kernel_for,
    launch,
    learnable_grad_buffers,
    pointer,
    precompile,
    vector_width,
)

# The backend contract (spikefuse.backends.NeuronBackend), and the kernel access the GPU check
# and the benchmarks use (kernel_for, compiled, precompile).
__all__ = [
    "SAVES_SEQUENCE",
    "bptt",
    "compiled",
    "fptt",
    "keeps_x",
    "kernel_for",
    "precompile",
    "saved_like",
    "unavailable_reason",
]

SAVES_SEQUENCE = False  # forward keeps only chunk-end states, not a [T, N] sequence


def keeps_x(program: NeuronProgram) -> bool:
    """Backward recomputes H from X, so X is always kept."""
    return True


def saved_like(
    program: NeuronProgram, x_seq: torch.Tensor, save: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Uninitialised tensors shaped like what forward saves: V (and W) at the end of every chunk
    of ``chunk_steps(T, CHUNK)`` steps but the last, float32 (None when not saving or T fits
    one chunk: backward starts from V[-1])."""
    return checkpoints_like(program, x_seq, save, chunk_steps(x_seq.shape[0], CHUNK))


def _contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    """A float32 contiguous state tensor (or None): what the kernels read as ``float*``."""
    return None if t is None else t.float().contiguous()


def fptt(
    program: NeuronProgram,
    x_seq: torch.Tensor,
    v0: torch.Tensor | None,
    w0: torch.Tensor | None,
    learnable: torch.Tensor | None,
    constants: list[float],
    init: list[float],
    save_for_backward: bool,
    store_v_seq: bool,
) -> FPTTOut:
    """Forward through time with one fused kernel; same contract as the reference ``fptt``,
    except what is saved: V (and W) at chunk ends (see :func:`saved_like`)."""
    check_input(x_seq)
    adaptive = program.definition.adaptive
    x = x_seq.contiguous()
    T, N = x.shape[0], math.prod(x.shape[1:])
    spikes = torch.empty_like(x)
    v_seq = torch.empty_like(x) if store_v_seq else None
    v_last = x.new_empty(x.shape[1:], dtype=torch.float32)
    w_last = torch.empty_like(v_last) if adaptive else None
    chunk = chunk_steps(T, CHUNK)
    v_ckpt, w_ckpt = checkpoints_like(program, x, save_for_backward, chunk)
    if N:
        vec = vector_width(N, x, vec=VEC)
        kernel = kernel_for(program, x.dtype, vec, chunk=chunk, wide_index=needs_wide_index(T, N))
        v0, w0 = _contiguous(v0), _contiguous(w0)  # bound: alive until the launch
        pointers = {
            "x_seq": x.data_ptr(),
            "v0": pointer(v0),
            "w0": pointer(w0),
            "spike_seq": spikes.data_ptr(),
            "v_seq": pointer(v_seq),
            "v_last": v_last.data_ptr(),
            "w_last": pointer(w_last),
            "v_ckpt": pointer(v_ckpt),
            "w_ckpt": pointer(w_ckpt),
            "learnable": pointer(learnable),
        }
        args = kernel.pack_args(pointers, T, N, init[0], init[1], constants)
        launch(kernel, True, x.device, blocks_for(N, vec), args)
    return FPTTOut(spikes, v_seq, v_last, w_last, v_ckpt, w_ckpt)


def bptt(
    program: NeuronProgram,
    grad_spikes: torch.Tensor,
    grad_v_seq: torch.Tensor | None,
    grad_v_last: torch.Tensor | None,
    grad_w_last: torch.Tensor | None,
    saved_v: torch.Tensor | None,
    saved_w: torch.Tensor | None,
    x_seq: torch.Tensor,
    v0: torch.Tensor | None,
    w0: torch.Tensor | None,
    learnable: torch.Tensor | None,
    constants: list[float],
    init: list[float],
) -> BPTTOut:
    """Backward through time with one fused kernel (recomputing H from X chunk by chunk).

    T >= 1, as for the reference backend (the modules reject T = 0 before any kernel runs)."""
    check_input(x_seq)
    adaptive = program.definition.adaptive
    x = x_seq.contiguous()
    dtype = x.dtype
    T, N = x.shape[0], math.prod(x.shape[1:])
    chunk = chunk_steps(T, CHUNK)
    check_checkpoints(T, saved_v, chunk)
    grad_spikes = grad_spikes.to(dtype).contiguous()
    grad_v_seq = None if grad_v_seq is None else grad_v_seq.to(dtype).contiguous()
    grad_x = torch.empty_like(x)
    # contiguous whatever v0's strides: the kernel writes them as it reads v0, a contiguous copy
    contiguous = torch.contiguous_format
    grad_v0 = None if v0 is None else torch.empty_like(v0, memory_format=contiguous)
    grad_w0 = None if w0 is None or not adaptive else torch.empty_like(w0, memory_format=contiguous)
    vec = vector_width(N, x, grad_spikes, grad_v_seq, vec=BPTT_VEC[dtype])
    blocks = blocks_for(N, vec)
    grad_learnable, learnable_pointers = learnable_grad_buffers(
        program, learnable, blocks if N else 0
    )
    if N:
        kernel = kernel_for(program, dtype, vec, chunk=chunk, wide_index=needs_wide_index(T, N))
        v0, w0 = _contiguous(v0), _contiguous(w0)
        grad_v_last, grad_w_last = _contiguous(grad_v_last), _contiguous(grad_w_last)
        pointers = {
            "x_seq": x.data_ptr(),
            "v0": pointer(v0),
            "w0": pointer(w0),
            "v_ckpt": pointer(saved_v),
            "w_ckpt": pointer(saved_w),
            "learnable": pointer(learnable),
            "grad_spike_seq": grad_spikes.data_ptr(),
            "grad_v_seq": pointer(grad_v_seq),
            "grad_v_last": pointer(grad_v_last),
            "grad_w_last": pointer(grad_w_last),
            "grad_x_seq": grad_x.data_ptr(),
            "grad_v0": pointer(grad_v0),
            "grad_w0": pointer(grad_w0),
            **learnable_pointers,
        }
        args = kernel.pack_args(pointers, T, N, init[0], init[1], constants)
        launch(kernel, False, x.device, blocks, args)
    return BPTTOut(grad_x, grad_v0, grad_w0, grad_learnable)
