"""1-bit packing of binary spikes on the GPU: one kernel each way, at memory bandwidth.

:func:`pack` and :func:`unpack` read and write the packing that
:mod:`spikefuse.fused.spike_bits` defines (ceil(n / 32) little-endian 32-bit words of bits, then
a NaN flag byte); the kernels are in ``spike_bits.cuh`` next to this file. Packing reads the
values once and writes n / 8 bytes (the torch composite it replaces took six passes); unpacking
reads the bits and writes the values once, 16 bytes per thread. Compiled once per storage dtype and device with NVRTC
through :mod:`.runtime`, launched on PyTorch's current stream, no host sync: CUDA-graph
capturable once loaded.
"""

from __future__ import annotations

import functools
import struct
from pathlib import Path

import torch

from .codegen import _STORAGE
from .runtime import launch_named

SOURCE_PATH = Path(__file__).with_name("spike_bits.cuh")
SOURCE_NAME = "spikefuse/cuda/spike_bits.cuh"
BLOCK_THREADS, UNROLL = 256, 4  # as in spike_bits.cuh (UNROLL: values per thread of pack)

#: The kernels' one argument, ``Args`` in spike_bits.cuh: values, words, flag, n.
ARGS = struct.Struct("=3Qq")


def packed_bytes(n: int) -> int:
    """Bytes of the packing of n values: ceil(n / 32) 32-bit words, then the NaN flag byte."""
    return 4 * -(-n // 32) + 1


@functools.cache
def _source(dtype: torch.dtype) -> str:
    """The prelude (storage type, kernel names), then ``spike_bits.cuh``."""
    storage = _STORAGE[dtype]
    tag = storage.ctype.strip("_")
    prelude = "\n".join(
        [
            f"// spikefuse 1-bit spike packing: {storage.ctype} storage",
            *storage.declarations(),
            f"#define PACK_KERNEL spikefuse_pack_spikes_{tag}",
            f"#define UNPACK_KERNEL spikefuse_unpack_spikes_{tag}",
        ]
    )
    template = SOURCE_PATH.read_text(encoding="utf-8")
    return f'{prelude}\n#line 1 "{SOURCE_NAME}"\n{template}'


def _launch(direction: str, values: torch.Tensor, packed: torch.Tensor) -> None:
    n = values.numel()
    if n == 0:
        return
    tag = _STORAGE[values.dtype].ctype.strip("_")
    flag = packed.data_ptr() + packed.numel() - 1
    args = ARGS.pack(values.data_ptr(), packed.data_ptr(), flag, n)
    per_thread = UNROLL if direction == "pack" else 16 // values.element_size()  # unpack: VEC
    grid = (-(-n // (BLOCK_THREADS * per_thread)), 1, 1)
    name = f"spikefuse_{direction}_spikes_{tag}"
    launch_named(_source(values.dtype), name, values.device, grid, (BLOCK_THREADS, 1, 1), args)


def pack(flat: torch.Tensor) -> torch.Tensor:
    """The packing (uint8 [:func:`packed_bytes` (n)]) of ``flat``: a contiguous 1-D CUDA tensor
    of 0/1 values (NaN allowed) in float32, float16 or bfloat16."""
    packed = torch.empty(packed_bytes(flat.numel()), dtype=torch.uint8, device=flat.device)
    packed[-1:].zero_()  # the kernel only sets the flag
    _launch("pack", flat, packed)
    return packed


def unpack(packed: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The n values (a contiguous 1-D tensor of ``dtype``) that :func:`pack` packed: NaN in
    every element when a NaN was packed."""
    flat = torch.empty(n, dtype=dtype, device=packed.device)
    _launch("unpack", flat, packed)
    return flat
