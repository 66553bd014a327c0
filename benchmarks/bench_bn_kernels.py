"""Time the BN-folded neuron kernels alone on the medium DATE'22 net's maps (needs a GPU).

    python benchmarks/bench_bn_kernels.py [--T 10] [--batch 64]

For each of the medium net's six conv maps ([T, B, C, H, W] channels-last, with and without the
2x2 pooling folded in) and for bfloat16 and float32 storage: microseconds per launch of the
forward (``affine_fptt``), backward pass 1 (the per-channel sums) and pass 2 (dL/dy), the
median of 50 launches issued back to back after 5 warm-up, for the paper's LIF with the Sigmoid
surrogate; then the totals over the six maps (a step of the network runs each kernel about that
often).
"""

from __future__ import annotations

import argparse
import functools

import torch

from spikefuse import neuron, surrogate
from spikefuse.bench.common import time_step
from spikefuse.cuda import affine

MAPS = ((128, 32, 1), (128, 32, 2), (256, 16, 1), (256, 16, 2), (512, 8, 1), (512, 8, 2))


def microseconds(launch) -> float:
    """Median time of one launch, issued back to back (the benchmarks' queued timing)."""
    return time_step(launch, torch.device("cuda"), warmup=5, iters=50).queued * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--T", type=int, default=10)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    node = neuron.LIFNode(
        tau=4 / 3, decay_input=False, v_threshold=0.25, surrogate_function=surrogate.Sigmoid()
    )
    program, constants, T, B = node.program, list(node.constants()), args.T, args.batch
    print(f"BN-folded LIF kernels, T={T} B={B}, {torch.cuda.get_device_name()}")
    for dtype in (torch.bfloat16, torch.float32):
        totals = [0.0, 0.0, 0.0]
        for C, H, pool in MAPS:
            gen = torch.Generator(device="cuda").manual_seed(0)
            y = torch.randn(T, B, H, H, C, device="cuda", generator=gen).to(dtype)
            y = y.permute(0, 1, 4, 2, 3)  # [T, B, C, H, W], channels-last
            mean = torch.randn(C, device="cuda", generator=gen) * 0.1
            invstd = torch.rand(C, device="cuda", generator=gen) + 0.5
            weight = torch.rand(C, device="cuda", generator=gen) + 0.5
            bias = torch.randn(C, device="cuda", generator=gen) * 0.1
            bn = (mean, invstd, weight, bias)
            forward = (program, y, *bn, None, constants, 0.0, True, pool)
            spikes, saved, _ = affine.affine_fptt(*forward)
            grad = torch.empty_like(spikes).normal_(generator=gen)  # laid out like the spikes
            common = (program, y, grad, saved, None, constants, 0.0, *bn)
            _, sums, _ = affine.affine_bptt(*common, grad_y=False, pool=pool)
            inv_count = 1.0 / (T * B * H * H)
            times = [
                microseconds(functools.partial(affine.affine_fptt, *forward)),
                microseconds(
                    functools.partial(affine.affine_bptt, *common, grad_y=False, pool=pool)
                ),
                microseconds(
                    functools.partial(
                        affine.affine_bptt, *common, sums, inv_count, grad_y=True, pool=pool
                    )
                ),
            ]
            totals = [t + u for t, u in zip(totals, times, strict=True)]
            print(
                f"{str(dtype)[6:]:9s} C={C:3d} H={H:2d} pool={pool}: forward {times[0]:6.1f} us"
                f"  pass 1 {times[1]:6.1f}  pass 2 {times[2]:6.1f}"
            )
        print(
            f"{str(dtype)[6:]:9s} total: forward {totals[0]:.0f} us  pass 1 {totals[1]:.0f}"
            f"  pass 2 {totals[2]:.0f}"
        )


if __name__ == "__main__":
    main()
