"""1-bit packing of binary spikes on the GPU: one kernel each way, at memory bandwidth.

:func:`pack` and :func:`unpack` read and write the packing that :mod:`spikefuse.fused.spike_bits`
defines (little-endian 32-bit words of bits, then a NaN flag byte per word; see ``spike_bits.cuh``
next to this file, which holds the kernels). The pooling neuron kernels write the same packing of
their output (:func:`spikefuse.cuda.affine.affine_fptt`, 4 bits a mean), which :func:`unpack`
reads too. Packing reads the values once and writes 5 n / 32 bytes, bits and flags (the torch
composite it replaces took six passes); unpacking reads the bits and writes the values once, 16
bytes per thread. Compiled once per storage dtype and device with NVRTC through :mod:`.runtime`,
launched on PyTorch's current stream, no host sync: CUDA-graph capturable once loaded.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ..backends import flags_at, packed_bytes
from .kernel_spec import BLOCK_THREADS, STORAGE
from .runtime import launch_named

SOURCE_PATH = Path(__file__).with_name("spike_bits.cuh")
SOURCE_NAME = "spikefuse/cuda/spike_bits.cuh"
UNROLL = 4  # values per thread of the pack kernel (loads in flight before any is used)

#: The kernels' one argument, ``Args`` in spike_bits.cuh: values, words, flags, n, window.
ARGS = struct.Struct("=3Q2q")


@dataclass(frozen=True)
class SpikeBitsKernels:
    """The two kernels of one storage dtype: their source (the prelude, then ``spike_bits.cuh``),
    names, and the unpack kernel's values per thread (16 bytes of them)."""

    source: str
    pack_name: str
    unpack_name: str
    vec: int


@functools.cache  # per call: one lookup (source and names built, and hashed, once)
def kernels_for(dtype: torch.dtype) -> SpikeBitsKernels:
    """The kernels of a storage dtype."""
    storage = STORAGE[dtype]
    tag = storage.ctype.strip("_")
    pack_name, unpack_name = f"spikefuse_pack_spikes_{tag}", f"spikefuse_unpack_spikes_{tag}"
    vec = 16 // dtype.itemsize
    prelude = "\n".join(
        [
            f"// spikefuse 1-bit spike packing: {storage.ctype} storage",
            *storage.declarations(),
            f"constexpr int BLOCK_THREADS = {BLOCK_THREADS};",
            f"constexpr int UNROLL = {UNROLL};",
            f"constexpr int VEC = {vec};",
            f"#define PACK_KERNEL {pack_name}",
            f"#define UNPACK_KERNEL {unpack_name}",
        ]
    )
    template = SOURCE_PATH.read_text(encoding="utf-8")
    source = f'{prelude}\n#line 1 "{SOURCE_NAME}"\n{template}'
    return SpikeBitsKernels(source, pack_name, unpack_name, vec)


def _launch(
    source: str,
    name: str,
    values: torch.Tensor,
    packed: torch.Tensor,
    per_thread: int,
    window: int = 1,
) -> None:
    """Launch kernel ``name`` of ``source`` on n = values.numel() values (none: nothing to do),
    each thread taking ``per_thread`` of them."""
    n = values.numel()
    if n == 0:
        return
    flags = packed.data_ptr() + flags_at(n, window)
    args = ARGS.pack(values.data_ptr(), packed.data_ptr(), flags, n, window)
    grid = (-(-n // (BLOCK_THREADS * per_thread)), 1, 1)
    launch_named(source, name, values.device, grid, (BLOCK_THREADS, 1, 1), args)


def pack(flat: torch.Tensor) -> torch.Tensor:
    """The packing (uint8 [:func:`packed_bytes` (n)]) of ``flat``: a contiguous 1-D CUDA tensor
    of 0/1 values (NaN allowed) in float32, float16 or bfloat16."""
    packed = torch.empty(packed_bytes(flat.numel()), dtype=torch.uint8, device=flat.device)
    kernels = kernels_for(flat.dtype)
    _launch(kernels.source, kernels.pack_name, flat, packed, UNROLL)
    return packed


def unpack(packed: torch.Tensor, out: torch.Tensor, window: int = 1) -> torch.Tensor:
    """Write the values packed at ``window`` bits each (1: by :func:`pack`; 4: the 2 x 2 means
    the pooled neuron kernels pack) into ``out`` (a new, so 16-byte aligned, contiguous 1-D CUDA
    tensor of their number, float32, float16 or bfloat16) and return it: NaN in every element
    of a word whose flag is set."""
    if window not in (1, 2, 4):  # VEC values of `window` bits within one word
        raise ValueError(f"spikefuse: unpacking {window}-bit values (1, 2 or 4 supported)")
    kernels = kernels_for(out.dtype)
    _launch(kernels.source, kernels.unpack_name, out, packed, kernels.vec, window)
    return out
