"""Check that fused blocks under DDP train N processes × batch B exactly like 1 process × N·B.

    torchrun --nproc_per_node=2 scripts/ddp_check.py             # NCCL on GPUs, gloo on CPU
    torchrun --nproc_per_node=2 scripts/ddp_check.py --dtype float32 --steps 5

Every rank trains the DDP-wrapped fused model on its slice of a global batch and, alongside, a
copy that sees the whole batch with BatchNorm synchronised over a group of itself only (the
single-process reference). After each step it compares outputs, input gradients (the local
gradient is N times the global-mean-loss gradient: the synchronised BN backward already sums
every rank's contribution), averaged parameter gradients, running statistics and, after the
optimizer step, the parameters. Prints PASS or FAIL (rank 0) and exits 0 or 1.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from spikefuse import functional, layer
from spikefuse.fused import fuse, paper_lif

T, CLASSES = 3, 5
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-5}


def build_model(dtype: torch.dtype, device: torch.device, group) -> nn.Module:
    torch.manual_seed(0)  # every rank and the reference start from the same weights
    model = nn.Sequential(
        layer.Conv2d(3, 8, 3, padding=1, bias=False, step_mode="m"),
        layer.BatchNorm2d(8, step_mode="m"),
        paper_lif(),
        layer.AvgPool2d(2, step_mode="m"),
        layer.Conv2d(8, 8, 3, padding=1, bias=False, step_mode="m"),
        layer.BatchNorm2d(8, step_mode="m"),
        paper_lif(),
        layer.Flatten(step_mode="m"),
        layer.Linear(8 * 4 * 4, 16, bias=False, step_mode="m"),
        layer.BatchNorm1d(16, step_mode="m"),
        paper_lif(),
        layer.Linear(16, CLASSES, step_mode="m"),
    )
    with torch.no_grad():  # non-trivial BN affine parameters
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.4)
    return fuse(model, process_group=group).to(device=device, dtype=dtype)


def max_rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()


def run_check(steps: int, batch: int, dtype: torch.dtype, device: torch.device) -> float:
    """The largest relative error seen on this rank over all compared quantities."""
    rank, world = dist.get_rank(), dist.get_world_size()
    singletons = [dist.new_group([r]) for r in range(world)]  # collective: all ranks create all
    reference = build_model(dtype, device, singletons[rank])
    model = DistributedDataParallel(build_model(dtype, device, None))
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    local = slice(rank * batch, (rank + 1) * batch)
    worst = 0.0

    def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        nonlocal worst
        err = max_rel_error(got, want)
        worst = max(worst, err)
        if err > TOLERANCE[dtype]:
            print(f"rank {rank}: {name}: relative error {err:.3e}", file=sys.stderr)

    for step in range(steps):
        images = torch.randn(world * batch, 3, 8, 8, generator=gen).to(device, dtype) * 2
        labels = torch.randint(0, CLASSES, (world * batch,), generator=gen).to(device)
        x_full = images.expand(T, -1, -1, -1, -1).clone().requires_grad_()
        x_local = x_full.detach()[:, local].clone().requires_grad_()

        out_ref = reference(x_full)
        F.cross_entropy(out_ref.mean(0), labels).backward()
        out = model(x_local)
        F.cross_entropy(out.mean(0), labels[local]).backward()

        check(f"step {step} output", out, out_ref[:, local])
        check(f"step {step} input grad", x_local.grad / world, x_full.grad[:, local])
        for (name, p), p_ref in zip(
            model.module.named_parameters(), reference.parameters(), strict=True
        ):
            check(f"step {step} grad {name}", p.grad, p_ref.grad)
        for (name, b), b_ref in zip(model.module.named_buffers(), reference.buffers(), strict=True):
            check(f"step {step} buffer {name}", b.double(), b_ref.double())
        for optimizer, net in ((opt_ref, reference), (opt, model)):
            optimizer.step()
            optimizer.zero_grad()
            functional.reset_net(net)
    for (name, p), p_ref in zip(
        model.module.named_parameters(), reference.parameters(), strict=True
    ):
        check(f"final {name}", p.detach(), p_ref.detach())
    return worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4, help="per-process batch size")
    parser.add_argument(
        "--dtype",
        nargs="+",
        choices=["float64", "float32"],
        default=None,
        help="default: float32 on GPUs (fused CUDA kernels), float64 on CPU",
    )
    args = parser.parse_args(argv)
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(
        os.environ.get("LOCAL_WORLD_SIZE", "1")
    )
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dtypes = [getattr(torch, name) for name in args.dtype or ["float32" if use_cuda else "float64"]]
    dist.init_process_group("nccl" if use_cuda else "gloo")
    ok = True
    try:
        for dtype in dtypes:
            worst = run_check(args.steps, args.batch, dtype, device)
            flag = torch.tensor([worst], dtype=torch.float64, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            passed = flag.item() <= TOLERANCE[dtype]
            ok &= passed
            if dist.get_rank() == 0:
                world = dist.get_world_size()
                print(
                    f"{'PASS' if passed else 'FAIL'}: {world} x batch {args.batch} vs 1 x batch "
                    f"{world * args.batch} ({dist.get_backend()}, {dtype}, {args.steps} steps): "
                    f"max relative error {flag.item():.2e}"
                )
    finally:
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
