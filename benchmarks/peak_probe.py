"""Peak allocated MiB of the medium fused training step, with and without folded pooling (needs a
GPU): the first eager step, steady eager steps, and a CUDA graph's capture (its warm-up steps and
pool) and replays, in fp32 and under bf16 autocast.

    python benchmarks/peak_probe.py
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from spikefuse.bench import e2e, networks
from spikefuse.bench.common import MIB
from spikefuse.fused import fuse
from spikefuse.graphs import capture_step


def peak(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / MIB


def medium_step(fold: bool, amp: torch.dtype | None) -> Callable[[], None]:
    torch.manual_seed(0)
    net = fuse(networks.spikefuse_model("medium", "cuda"), inplace=True, fold_pools=fold)
    return e2e.training_step(net, torch.device("cuda"), 10, 64, amp, e2e.input_geometry("medium"))


def probe(fold: bool, amp: torch.dtype | None) -> tuple[float, float, float, float]:
    """(first eager step, steady eager steps, graph capture, graph replays) peaks."""
    step = medium_step(fold, amp)
    first = peak(step)
    steady = peak(lambda: [step() for _ in range(3)])
    del step
    torch.cuda.empty_cache()
    step = medium_step(fold, amp)
    replays: list[Callable[[], None]] = []
    capture = peak(lambda: replays.append(capture_step(step)))
    replay = peak(lambda: [replays[0]() for _ in range(3)])
    return first, steady, capture, replay


def main() -> None:
    print(f"medium fused step, T=10 B=64, {torch.cuda.get_device_name()}: peak MiB")
    for amp in (None, torch.bfloat16):
        for fold in (True, False):
            first, steady, capture, replay = probe(fold, amp)
            torch.cuda.empty_cache()
            print(
                f"{'bf16' if amp else 'fp32'} fold_pools={fold}: eager first {first:.0f}, "
                f"steady {steady:.0f}; graph capture {capture:.0f}, replay {replay:.0f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
