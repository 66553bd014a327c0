"""1-bit spike packing: the CUDA kernels against the torch composites they replaced on the GPU
(which the CPU still runs), on the medium DATE'22 network's widest spike map (T = 10, B = 64,
128 x 32 x 32) in float32 and bfloat16. Prints us per call and GB/s (bytes of the values, read
or written once). Needs a CUDA GPU with CuPy:

    python benchmarks/bench_spike_bits.py
"""

from __future__ import annotations

from functools import partial

import torch

from spikefuse.bench.common import time_step
from spikefuse.cuda import spike_bits as kernels
from spikefuse.fused import spike_bits as composites


def _microseconds(fn, repeats: int) -> float:
    """Median GPU time of ``fn()`` in microseconds over ``repeats`` calls queued back to back."""
    return 1000.0 * time_step(fn, torch.device("cuda"), warmup=3, iters=repeats).queued


def main(repeats: int = 20) -> None:
    n = 10 * 64 * 128 * 32 * 32
    print(f"{torch.cuda.get_device_name()}: 1-bit packing of {n} spikes, {repeats} calls")
    print(f"{'dtype':<10}{'direction':<10}{'torch us':>10}{'kernel us':>10}{'GB/s':>8}")
    for dtype in (torch.float32, torch.bfloat16):
        spikes = (torch.rand(n, device="cuda") > 0.8).to(dtype)
        packed, out = kernels.pack(spikes), torch.empty_like(spikes)
        gigabytes = n * spikes.element_size() / 1e9
        calls = {
            "pack": (partial(composites._pack_torch, spikes), partial(kernels.pack, spikes)),
            "unpack": (
                partial(composites._unpack_torch, packed, out),
                partial(kernels.unpack, packed, out),
            ),
        }
        for direction, (theirs, ours) in calls.items():
            slow, fast = _microseconds(theirs, repeats), _microseconds(ours, repeats)
            print(
                f"{str(dtype)[6:]:<10}{direction:<10}{slow:>10.0f}{fast:>10.0f}"
                f"{gigabytes / fast * 1e6:>8.0f}"
            )


if __name__ == "__main__":
    main()
