"""Time the BN-folded neuron kernels alone on a network's maps (needs a GPU).

    python benchmarks/bench_bn_kernels.py [--net medium|resnet18] [--T T] [--batch B]

For each conv map of the network ([T, B, C, H, W] channels-last; the medium DATE'22 net's six
with and without the 2x2 pooling folded in, T=10 B=64, the paper's LIF with the Sigmoid
surrogate; or SEW/Spiking ResNet-18's five at 224², T=4 B=32, LIF tau 2 with ATan and
detach_reset) and for bfloat16 and float32 storage: microseconds per launch of the forward
(``affine_fptt``), backward pass 1 (the per-channel sums) and pass 2 (dL/dy, recomputing the
neuron), and with 16-bit storage pass 1 keeping dL/dX and the element-wise pass 2 that reads
it (``affine_input_grad``, what 16-bit calls take). The median of 50 launches issued back to
back after 5 warm-up; then the totals over the maps (a step of the network runs each kernel
about that often) and the backward both ways.
"""

from __future__ import annotations

import argparse
import functools

import torch

from spikefuse import neuron, surrogate
from spikefuse.bench.common import time_step
from spikefuse.cuda import affine

# (channels, H = W, pool) of each map
NETS = {
    "medium": ((128, 32, 1), (128, 32, 2), (256, 16, 1), (256, 16, 2), (512, 8, 1), (512, 8, 2)),
    "resnet18": ((64, 112, 1), (64, 56, 1), (128, 28, 1), (256, 14, 1), (512, 7, 1)),
}
DEFAULT_TB = {"medium": (10, 64), "resnet18": (4, 32)}
COLUMNS = ("forward", "pass 1", "pass 2", "kept pass 1", "element-wise pass 2")


def microseconds(launch) -> float:
    """Median time of one launch, issued back to back (the benchmarks' queued timing)."""
    return time_step(launch, torch.device("cuda"), warmup=5, iters=50).queued * 1000


def node_of(net: str) -> neuron.LIFNode:
    if net == "medium":
        return neuron.LIFNode(
            tau=4 / 3, decay_input=False, v_threshold=0.25, surrogate_function=surrogate.Sigmoid()
        )
    return neuron.LIFNode(tau=2.0, detach_reset=True, surrogate_function=surrogate.ATan())


def map_times(node, dtype, T, B, C, H, pool) -> list[float | None]:
    """The :data:`COLUMNS` on one map (None where the dtype has no kept pass 1)."""
    program, constants = node.program, list(node.constants())
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
    pass_one = functools.partial(affine.affine_bptt, *common, grad_y=False, pool=pool)
    times: list[float | None] = [
        microseconds(functools.partial(affine.affine_fptt, *forward)),
        microseconds(pass_one),
        microseconds(
            functools.partial(affine.affine_bptt, *common, sums, inv_count, grad_y=True, pool=pool)
        ),
        None,
        None,
    ]
    if affine.keeps_input_grad(y):
        kept, _, _ = pass_one(keep_grad_input=True)
        assert kept is not None
        element_wise = functools.partial(
            affine.affine_input_grad, kept, y, mean, invstd, weight, sums, inv_count, kept.clone()
        )
        times[3] = microseconds(functools.partial(pass_one, keep_grad_input=True))
        times[4] = microseconds(element_wise)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--net", choices=tuple(NETS), default="medium")
    parser.add_argument("--T", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    args = parser.parse_args()
    T, B = args.T or DEFAULT_TB[args.net][0], args.batch or DEFAULT_TB[args.net][1]
    node = node_of(args.net)
    print(f"BN-folded LIF kernels, {args.net} maps, T={T} B={B}, {torch.cuda.get_device_name()}")
    for dtype in (torch.bfloat16, torch.float32):
        totals = [0.0] * len(COLUMNS)
        name = str(dtype)[6:]
        for C, H, pool in NETS[args.net]:
            times = map_times(node, dtype, T, B, C, H, pool)
            totals = [t + (u or 0.0) for t, u in zip(totals, times, strict=True)]
            cells = "  ".join(
                f"{c} {'-' if u is None else f'{u:6.1f}'}"
                for c, u in zip(COLUMNS, times, strict=True)
            )
            print(f"{name:9s} C={C:3d} H={H:3d} pool={pool}: {cells} us")
        print(
            f"{name:9s} total: "
            + "  ".join(f"{c} {t:.0f}" for c, t in zip(COLUMNS, totals, strict=True))
        )
        print(
            f"{name:9s} backward: recomputing {totals[1] + totals[2]:.0f} us, "
            + (f"from kept dL/dX {totals[3] + totals[4]:.0f} us" if totals[3] else "no kept dL/dX")
        )


if __name__ == "__main__":
    main()
