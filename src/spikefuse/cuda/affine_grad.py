"""BN-folded backward pass 2 from pass 1's dL/dX, element by element (16-bit storage).

The channel-affine kernels' pass 2 (:func:`~.affine.affine_bptt` with ``grad_y``) recomputes
the neuron through time to get g = dL/dX again and writes dL/dY = scale g + coef_y Y + coef_0.
With 16-bit storage that walk is bound by instruction issue (the same float32 arithmetic per
element as float32 storage, at half the bytes), so there pass 1 also writes g
(:data:`~.kernel_spec.KEEPS_INPUT_GRAD`) and :func:`affine_input_grad` turns it into dL/dY in
one pass bound by memory: it moves the bytes the recompute moved (reads two tensors of Y's
size, writes one) without its arithmetic. g is then rounded to the storage dtype before
BatchNorm's backward, as it is in an unfused model under autocast (the neuron's gradient
output has the input's dtype).

The kernel is ``affine_grad.cuh`` next to this file, compiled once per (storage dtype, vector
width, index width) and device with NVRTC through :mod:`.runtime`, launched on PyTorch's
current stream without a host sync: CUDA-graph capturable once loaded.
"""

from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ..backends import repeats_one_step
from .affine_plan import channel_layout
from .kernel_spec import BLOCK_THREADS, INDEX32_MAX, STORAGE
from .runtime import aligned, check_input, launch_named, pointer

SOURCE_PATH = Path(__file__).with_name("affine_grad.cuh")
SOURCE_NAME = "spikefuse/cuda/affine_grad.cuh"
KERNEL_NAME = "spikefuse_affine_input_grad"
_VECTOR_BYTES = 16  # the widest load: 16 bytes per thread and iteration
# Resident blocks per SM a launch fills (2048 threads an SM): one wave, each thread walking
# its packs, so that the channels' coefficients load once per thread.
_BLOCKS_PER_SM = 2048 // BLOCK_THREADS


@functools.cache
def source(dtype: torch.dtype, vec: int, wide_index: bool) -> str:
    """The prelude, then ``affine_grad.cuh``."""
    prelude = [
        f"// spikefuse BN-folded pass 2 from dL/dX: {dtype}, {vec} per thread",
        *STORAGE[dtype].declarations(),
        f"typedef {'long long' if wide_index else 'int'} index_t;",
        f"constexpr int VEC = {vec};",
        f"constexpr int BLOCK_THREADS = {BLOCK_THREADS};",
        f"#define GRAD_KERNEL {KERNEL_NAME}",
    ]
    template = SOURCE_PATH.read_text(encoding="utf-8")
    return "\n".join(prelude) + f'\n#line 1 "{SOURCE_NAME}"\n{template}'


@dataclass(frozen=True)
class GradPlan:
    """A launch's geometry, worked out once per signature (:func:`_plan`)."""

    source: str
    blocks: int
    channels: int
    inner: int
    args: struct.Struct  # Args: 8 pointers, M, channels, inner, inv_count, steps, padding


@functools.lru_cache(maxsize=256)
def _plan(
    dtype: torch.dtype, numel: int, layout: tuple[int, int], vectors: bool, sms: int
) -> GradPlan:
    """The plan of a launch over ``numel`` elements of ``layout`` (channels, inner); vector
    access where ``vectors`` (the pointers' alignment) and the layout allow."""
    channels, inner = layout
    vec = _VECTOR_BYTES // dtype.itemsize
    if not (vectors and inner == 1 and channels % vec == 0 and numel % vec == 0):
        vec = 1
    needed = -(-numel // (vec * BLOCK_THREADS))
    blocks = needed
    if needed > sms * _BLOCKS_PER_SM:
        blocks = sms * _BLOCKS_PER_SM
        if inner == 1:  # a stride of whole rows of channels: each thread keeps its channels
            rows = channels // math.gcd(channels, vec * BLOCK_THREADS)
            blocks = min(needed, -(-blocks // rows) * rows)
    wide = numel + blocks * BLOCK_THREADS * vec > INDEX32_MAX
    index, index_bytes = ("q", 8) if wide else ("i", 4)
    padding = -(3 * index_bytes + 8) % 8  # the struct's tail, to its 8-byte alignment
    layout_of_args = struct.Struct(f"=8Q3{index}2f{padding}x")
    return GradPlan(source(dtype, vec, wide), blocks, channels, inner, layout_of_args)


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def affine_input_grad(
    grad_input: torch.Tensor,
    y: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor | None,
    totals: torch.Tensor | None,
    inv_count: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """dL/dy = scale g + steps (coef_y y + coef_0) per channel (the BN-folded pass 2's formula,
    see :func:`~.affine.affine_bptt`) from g = ``grad_input``, the dL/dX that pass 1 kept.

    ``y`` [T, B, C, *S] as pass 1 read it; g has the layout of y's memory as the kernels read
    it (a y repeated over time: its one step, with g summed over the T steps, and steps = T;
    else steps = 1). ``totals`` [2, C] (pass 1's sums over all processes, times ``inv_count``
    their means) or None (running statistics: dL/dy = scale g). Writes ``out`` (g's shape and
    layout; it may be g itself, or y's memory) or a new tensor, and returns it.
    """
    check_input(y)
    steps = y.shape[0] if repeats_one_step(y) else 1
    memory, layout = channel_layout(y[:1] if steps > 1 else y)
    if grad_input.shape != memory.shape or grad_input.stride() != memory.stride():
        raise ValueError(
            f"affine_input_grad: dL/dX {tuple(grad_input.shape)} with strides "
            f"{grad_input.stride()} is not laid out as y's memory {tuple(memory.shape)}, "
            f"{memory.stride()}"
        )
    if grad_input.dtype != y.dtype or (out is not None and out.dtype != y.dtype):
        raise ValueError(f"affine_input_grad: dL/dX and dL/dy take y's dtype {y.dtype}")
    if out is None:
        out = torch.empty_like(grad_input)
    if not out.numel():
        return out
    index = y.device.index if y.device.index is not None else torch.cuda.current_device()
    vectors = aligned(grad_input, memory, out)
    plan = _plan(y.dtype, out.numel(), layout, vectors, _multiprocessors(index))
    rows = (None, None) if totals is None else (totals[0], totals[1])
    tensors = (grad_input, memory, out, mean, invstd, weight, *rows)
    args = plan.args.pack(
        *map(pointer, tensors), out.numel(), plan.channels, plan.inner, inv_count, float(steps)
    )
    launch_named(
        plan.source, KERNEL_NAME, y.device, (plan.blocks, 1, 1), (BLOCK_THREADS, 1, 1), args
    )
    return out
