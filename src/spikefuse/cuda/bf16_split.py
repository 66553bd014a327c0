"""float32 → three bfloat16 terms (hi + mid + lo) on the GPU, one pass: what lets a float32
matmul whose other operand bf16 holds exactly (spikes) run on bf16 tensor cores at float32
accuracy (:mod:`spikefuse.fused.spike_linear`). The kernel is ``bf16_split.cuh`` next to this
file; compiled once per device with NVRTC through :mod:`.runtime`, launched on PyTorch's
current stream, no host sync: CUDA-graph capturable once loaded.
"""

from __future__ import annotations

import functools
import struct
from pathlib import Path

import torch

from .kernel_spec import BLOCK_THREADS
from .runtime import launch_named, load_named

SOURCE_PATH = Path(__file__).with_name("bf16_split.cuh")
SOURCE_NAME = "spikefuse/cuda/bf16_split.cuh"
KERNEL_NAME = "spikefuse_split_bf16x3"
UNROLL = 4  # values per thread (loads in flight before any is used)

#: The kernel's one argument, ``Args`` in bf16_split.cuh: values, terms, n.
ARGS = struct.Struct("=2Qq")


@functools.cache
def source() -> str:
    """The prelude, then ``bf16_split.cuh``."""
    prelude = "\n".join(
        [
            "// spikefuse bf16 split of float32 values",
            f"constexpr int BLOCK_THREADS = {BLOCK_THREADS};",
            f"constexpr int UNROLL = {UNROLL};",
            f"#define SPLIT_KERNEL {KERNEL_NAME}",
        ]
    )
    template = SOURCE_PATH.read_text(encoding="utf-8")
    return f'{prelude}\n#line 1 "{SOURCE_NAME}"\n{template}'


def split(values: torch.Tensor) -> torch.Tensor:
    """bfloat16 [3, *values.shape]: hi, mid and lo with hi + mid + lo = values to about 2^-26
    relative (see bf16_split.cuh), of a contiguous float32 CUDA tensor."""
    terms = torch.empty((3, *values.shape), dtype=torch.bfloat16, device=values.device)
    n = values.numel()
    if n:
        grid = (-(-n // (BLOCK_THREADS * UNROLL)), 1, 1)
        args = ARGS.pack(values.data_ptr(), terms.data_ptr(), n)
        launch_named(source(), KERNEL_NAME, values.device, grid, (BLOCK_THREADS, 1, 1), args)
    return terms


def load(device: torch.device) -> None:
    """Compile and load the kernel on ``device`` (once; later calls are a lookup): a fused
    Linear block that runs the plain matmul eagerly splits under CUDA graph capture, which
    cannot load it (see :func:`spikefuse.fused.spike_linear.takes_split_path`)."""
    load_named(source(), KERNEL_NAME, device)
