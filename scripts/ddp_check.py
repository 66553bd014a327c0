"""Check that fused blocks under DDP train N processes × batch B exactly like 1 process × N·B.

    torchrun --nproc_per_node=2 scripts/ddp_check.py             # NCCL on GPUs, gloo on CPU
    torchrun --nproc_per_node=2 scripts/ddp_check.py --dtype float32 --steps 5
    torchrun --nproc_per_node=2 scripts/ddp_check.py --model sew_resnet18 --memory min
    torchrun --nproc_per_node=2 scripts/ddp_check.py --repeated   # input images.expand(T, ...)
    torchrun --nproc_per_node=2 scripts/ddp_check.py --memory min --chunked  # batch chunks
    torchrun --nproc_per_node=2 scripts/ddp_check.py --share-gpu  # a 1-GPU machine: gloo on cuda:0
    torchrun --nproc_per_node=2 scripts/ddp_check.py --model-graphs --steps 6  # graph_model
    torchrun --nproc_per_node=2 scripts/ddp_check.py --repeated + --memory min   # several checks

Several checks in one run share its processes and process group: separate their options with
``+`` (``--share-gpu`` must be the same in all of them).

Every rank trains the DDP-wrapped fused model on its slice of a global batch and, alongside, a
copy that sees the whole batch with BatchNorm synchronised over a group of itself only (the
single-process reference). After each step it compares outputs, input gradients (the local
gradient is N times the global-mean-loss gradient: the synchronised BN backward already sums
every rank's contribution), averaged parameter gradients, running statistics and, after the
optimizer step, the parameters. Prints PASS or FAIL (rank 0) and exits 0 or 1.

The spikes of every fused block and neuron are compared exactly (a spike flipped by rounding
fails the check: float32 tolerances cover rounding only). With ``--model-graphs`` the DDP
model is :func:`spikefuse.graph_model`'s (its forward and backward, with the fused blocks'
synchronising all-reduces, replayed from CUDA graphs after two warm-up steps; DDP's gradient
all-reduce eager): its spikes are not recorded (a forward hook would make it run eagerly), the
rest is compared as above, and the check fails unless the graphs were captured.

Models (``--model``, fused with ``--memory``; every Conv/Linear → BN → neuron chain must fuse),
all with non-trivial BN affine parameters: a small CNN with the DATE'22 paper's LIF (``cnn``),
SEW-ResNet-18 ('ADD') on 16×16 input and ResNet-19 on 8×8 input with SpikingJelly's LIF.

BatchNorms that ``fuse`` leaves unfused (ResNet-19's downsample BNs, the shortcuts of its residual
chains) would be per-process under plain DDP, so they become
``torch.nn.SyncBatchNorm`` (multi-step through ``layer.SeqToANNContainer``:
``convert_sync_batchnorm`` alone would drop the ``step_mode`` of spikefuse's BatchNorm
subclasses). torch's SyncBatchNorm runs on CUDA only, so such a model (``spiking_resnet19``) is
refused on CPU; ``cnn`` and ``sew_resnet18`` (every BN fused) run on CPU with gloo too. cuDNN's
TF32 is switched off: both sides must run the same float32 arithmetic.

``--share-gpu`` runs every rank on cuda:0 and communicates through gloo (NCCL refuses two ranks on
one device): on a machine with one GPU this checks the fused blocks' synchronisation (their
all-reduces), DDP's gradient buckets and the CUDA kernels. It is not the NCCL run: SyncBatchNorm
takes its gloo code path (``all_gather`` of a list), and gloo's CUDA collectives copy through the
host and synchronise, so a stream-ordering fault that NCCL would expose goes unseen.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel

from spikefuse import functional, layer, models, neuron, surrogate
from spikefuse.fused import FusedBlock, chunked, fuse, memory_modes, paper_lif
from spikefuse.model_graphs import graph_model, model_graphs
from spikefuse.neuron import BaseNode

CLASSES = 5


def small_cnn() -> nn.Module:
    return nn.Sequential(
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


# SpikingJelly's LIF with its smooth sigmoid surrogate (a rectangular window's edges would flip
# gradients on float32 rounding in these deep nets), threshold lowered for ~20% spikes.
RESNET_NEURONS: dict[str, Any] = dict(
    spiking_neuron=neuron.LIFNode,
    v_threshold=0.5,
    surrogate_function=surrogate.Sigmoid(),
    step_mode="m",
)


@dataclass(frozen=True)
class Network:
    """An unfused network to check, its input image size (square), number of time steps, SGD
    learning rate and the largest relative error allowed in float32 (float64: 1e-9)."""

    build: Callable[[], nn.Module]
    image_size: int
    time_steps: int
    lr: float = 0.5
    float32_tolerance: float = 1e-5

    def tolerance(self, dtype: torch.dtype) -> float:
        return self.float32_tolerance if dtype == torch.float32 else 1e-9


NETWORKS = {
    "cnn": Network(small_cnn, image_size=8, time_steps=3),
    # The ResNets: inputs small enough for a quick CPU run (every stage's map stays >= 1×1); a
    # smaller learning rate, as 0.5 amplifies float32 rounding through 18 layers and the steps
    # (SEW-ResNet-18 on CPU, batch 4: 2e-5 after 5 steps at lr 0.5, 1.4e-6 after 3 at 0.1);
    # 3e-5 in float32 for GPU convolutions (the CNN's error is 4x larger on GPU than on CPU)
    # accumulating over up to 4608 terms.
    "sew_resnet18": Network(
        lambda: models.sew_resnet18(cnf="ADD", num_classes=CLASSES, **RESNET_NEURONS),
        image_size=16,
        time_steps=2,
        lr=0.1,
        float32_tolerance=3e-5,
    ),
    "spiking_resnet19": Network(
        lambda: models.spiking_resnet19(num_classes=CLASSES, **RESNET_NEURONS),
        image_size=8,
        time_steps=2,
        lr=0.1,
        float32_tolerance=3e-5,
    ),
}


def unfused_batchnorms(model: nn.Module) -> list[str]:
    """The names of the BatchNorms of a fused ``model`` that no FusedBlock holds."""
    blocks = [name + "." for name, m in model.named_modules() if isinstance(m, FusedBlock)]
    return [
        name
        for name, m in model.named_modules()
        if isinstance(m, _BatchNorm) and not name.startswith(tuple(blocks))
    ]


def synchronise_unfused_batchnorms(model: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Make the BatchNorms outside fused blocks ``torch.nn.SyncBatchNorm`` over ``group``,
    keeping their parameters, buffers and step mode (multi-step: SyncBatchNorm on [T*B, ...])."""
    for name in unfused_batchnorms(model):
        bn = model.get_submodule(name)
        synced = nn.SyncBatchNorm.convert_sync_batchnorm(bn, process_group=group)
        multi_step = getattr(bn, "step_mode", "s") == "m"
        model.set_submodule(name, layer.SeqToANNContainer(synced) if multi_step else synced)


def build_model(
    network: str,
    memory: str,
    dtype: torch.dtype,
    device: torch.device,
    group: dist.ProcessGroup | None,
) -> nn.Module:
    torch.manual_seed(0)  # every rank and the reference start from the same weights
    model = NETWORKS[network].build()
    with torch.no_grad():  # non-trivial BN affine parameters
        for m in model.modules():
            if isinstance(m, _BatchNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.4)
    fused, report = fuse(model, process_group=group, memory=memory, return_report=True)
    if report.fused_fraction != 1.0:
        raise SystemExit(f"{network}: not every chain was fused\n{report}")
    unfused = unfused_batchnorms(fused)
    if unfused and device.type != "cuda":
        raise SystemExit(
            f"{network} keeps BatchNorms outside fused blocks ({', '.join(unfused)}), which DDP "
            "needs synchronised, and torch.nn.SyncBatchNorm runs on CUDA only: run this check "
            "on GPUs (torchrun --nproc_per_node=2 on a machine with 2 GPUs, or with --share-gpu "
            "on one)"
        )
    synchronise_unfused_batchnorms(fused, group)
    return fused.to(device=device, dtype=dtype)


def record_spikes(model: nn.Module) -> dict[str, torch.Tensor]:
    """name → the spikes of each fused block and unfused neuron in ``model``'s last forward."""
    spikes: dict[str, torch.Tensor] = {}
    # a fused block's neuron never runs its own forward (hooking it raises): the block's do
    fused_nodes = {id(m.node) for m in model.modules() if isinstance(m, FusedBlock)}
    for name, m in model.named_modules():
        if isinstance(m, FusedBlock) or (isinstance(m, BaseNode) and id(m) not in fused_nodes):
            m.register_forward_hook(
                lambda _m, _args, out, name=name: spikes.__setitem__(name, out.detach())
            )
    return spikes


def max_rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()


class Comparison:
    """The largest relative error seen on this rank; errors over the network's tolerance are
    printed (and fail the run), a quantity one side lacks ends it."""

    def __init__(self, rank: int, tolerance: float) -> None:
        self.rank, self.tolerance, self.worst = rank, tolerance, 0.0

    def __call__(self, name: str, got: torch.Tensor | None, want: torch.Tensor | None) -> None:
        if got is None or want is None:  # a gradient that one side lacks
            raise SystemExit(f"rank {self.rank}: {name}: missing on one side ({got=}, {want=})")
        err = max_rel_error(got, want)
        self.worst = max(self.worst, err)
        if err > self.tolerance:
            print(f"rank {self.rank}: {name}: relative error {err:.3e}", file=sys.stderr)


def compare_step(
    check: Comparison,
    step: int,
    pair: tuple[nn.Module, nn.Module],
    outputs: tuple[torch.Tensor, torch.Tensor],
    inputs: tuple[torch.Tensor, torch.Tensor] | None,
    spikes: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None,
    local: slice,
) -> None:
    """One step's output, spikes (unless None), input gradients (unless None: a repeated
    input needs none), parameter gradients and buffers: the DDP model's (first of each pair)
    against the whole-batch reference's rows of this rank."""
    (model, reference), (out, out_ref) = pair, outputs
    check(f"step {step} output", out, out_ref[:, local])
    for name, s_ref in spikes[1].items() if spikes is not None else ():  # 0/1: a flip errs by 1
        check(f"step {step} spikes {name}", spikes[0][name], s_ref[:, local])
    if inputs is not None:
        grad_local, grad_full = inputs[0].grad, inputs[1].grad
        assert grad_local is not None and grad_full is not None  # both inputs require grad
        world = grad_full.shape[1] // grad_local.shape[1]
        check(f"step {step} input grad", grad_local / world, grad_full[:, local])
    for (name, p), p_ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        check(f"step {step} grad {name}", p.grad, p_ref.grad)
    for (name, b), b_ref in zip(model.named_buffers(), reference.buffers(), strict=True):
        check(f"step {step} buffer {name}", b.double(), b_ref.double())


def run_check(
    network: str,
    memory: str,
    steps: int,
    batch: int,
    dtype: torch.dtype,
    device: torch.device,
    repeated: bool = False,
    graphed: bool = False,
) -> float:
    """The largest relative error seen on this rank over all compared quantities."""
    rank, world = dist.get_rank(), dist.get_world_size()
    singletons = [dist.new_group([r]) for r in range(world)]  # collective: all ranks create all
    reference = build_model(network, memory, dtype, device, singletons[rank])
    inner = build_model(network, memory, dtype, device, None)
    model = DistributedDataParallel(graph_model(inner) if graphed else inner)
    spec = NETWORKS[network]
    spikes_ref, spikes = record_spikes(reference), {} if graphed else record_spikes(inner)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=spec.lr, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=spec.lr, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    local = slice(rank * batch, (rank + 1) * batch)
    check = Comparison(rank, spec.tolerance(dtype))
    for step in range(steps):
        shape = (world * batch, 3, spec.image_size, spec.image_size)
        images = torch.randn(shape, generator=gen).to(device, dtype) * 2
        labels = torch.randint(0, CLASSES, (world * batch,), generator=gen).to(device)
        x_full = images.expand(spec.time_steps, -1, -1, -1, -1)
        x_local = images[local].expand(spec.time_steps, -1, -1, -1, -1)
        if not repeated:  # materialised sequences, whose input gradients are compared too
            x_full = x_full.clone().requires_grad_()
            x_local = x_local.clone().requires_grad_()
        out_ref = reference(x_full)
        F.cross_entropy(out_ref.mean(0), labels).backward()
        out = model(x_local)
        F.cross_entropy(out.mean(0), labels[local]).backward()
        compare_step(
            check,
            step,
            (model.module, reference),
            (out, out_ref),
            None if repeated else (x_local, x_full),
            None if graphed else (spikes, spikes_ref),
            local,
        )
        for optimizer, net in ((opt_ref, reference), (opt, model)):
            optimizer.step()
            optimizer.zero_grad()
            functional.reset_net(net)
    for (name, p), p_ref in zip(
        model.module.named_parameters(), reference.parameters(), strict=True
    ):
        check(f"final {name}", p.detach(), p_ref.detach())
    graphs = model_graphs(inner)
    if graphed and (graphs is None or graphs.captured == 0):
        raise SystemExit(f"rank {rank}: --model-graphs: no graph was captured in {steps} steps")
    return check.worst


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(NETWORKS), default="cnn")
    parser.add_argument(
        "--memory", choices=memory_modes(), default="default", help="fuse's memory mode"
    )
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--repeated",
        action="store_true",
        help="feed images.expand(T, ...) (no input gradient): the first block runs one step",
    )
    parser.add_argument(
        "--chunked",
        action="store_true",
        help="memory='min' blocks run in batch chunks of one sample whatever their size "
        "(statistics and sums combined over chunks, then processes)",
    )
    parser.add_argument("--batch", type=int, default=4, help="per-process batch size")
    parser.add_argument(
        "--model-graphs",
        action="store_true",
        help="DDP over spikefuse.graph_model(model) (CUDA only; use --steps 4 or more)",
    )
    parser.add_argument(
        "--dtype",
        nargs="+",
        choices=["float64", "float32"],
        default=None,
        help="default: float32 on GPUs (fused CUDA kernels), float64 on CPU",
    )
    parser.add_argument(
        "--share-gpu",
        action="store_true",
        help="every rank on cuda:0, communicating through gloo (a machine with one GPU)",
    )
    return parser


def parse_checks(parser: argparse.ArgumentParser, argv: list[str]) -> list[argparse.Namespace]:
    """One namespace per check: ``argv`` split at each ``+``."""
    segments: list[list[str]] = [[]]
    for arg in argv:
        if arg == "+":
            segments.append([])
        else:
            segments[-1].append(arg)
    checks = [parser.parse_args(segment) for segment in segments]
    for args in checks:
        if args.chunked and args.memory != "min":
            parser.error("--chunked is memory='min''s batch chunking: add --memory min")
        if args.model_graphs and not torch.cuda.is_available():
            parser.error("--model-graphs replays CUDA graphs, and PyTorch sees no GPU")
    if len({args.share_gpu for args in checks}) > 1:
        parser.error("--share-gpu must be given to every check of a run or to none")
    return checks


def run_checks(checks: list[argparse.Namespace], device: torch.device) -> bool:
    """Run every check (each dtype of each) and print PASS or FAIL per run on rank 0."""
    ok = True
    chunking = chunked.CHUNKED_FROM, chunked.CHUNK_BYTES
    for args in checks:
        use_cuda = device.type == "cuda"
        dtypes = [getattr(torch, n) for n in args.dtype or ["float32" if use_cuda else "float64"]]
        if args.chunked:  # every map is "large", and no chunk holds more than one sample
            chunked.CHUNKED_FROM, chunked.CHUNK_BYTES = 0, 1
        try:
            for dtype in dtypes:
                worst = run_check(
                    args.model,
                    args.memory,
                    args.steps,
                    args.batch,
                    dtype,
                    device,
                    args.repeated,
                    args.model_graphs,
                )
                flag = torch.tensor([worst], dtype=torch.float64, device=device)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                passed = flag.item() <= NETWORKS[args.model].tolerance(dtype)
                ok &= passed
                if dist.get_rank() == 0:
                    world = dist.get_world_size()
                    options = "".join(
                        f", {name}"
                        for name in ("repeated", "chunked", "model_graphs")
                        if getattr(args, name)
                    )
                    print(
                        f"{'PASS' if passed else 'FAIL'}: {args.model} "
                        f"(memory={args.memory}{options}) "
                        f"{world} x batch {args.batch} vs 1 x batch {world * args.batch} "
                        f"({dist.get_backend()}, {dtype}, {args.steps} steps): "
                        f"max relative error {flag.item():.2e}"
                    )
        finally:
            chunked.CHUNKED_FROM, chunked.CHUNK_BYTES = chunking
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    checks = parse_checks(parser, sys.argv[1:] if argv is None else argv)
    share_gpu = checks[0].share_gpu
    if share_gpu and not torch.cuda.is_available():
        parser.error("--share-gpu needs a CUDA GPU, and PyTorch sees none")
    use_cuda = share_gpu or (
        torch.cuda.is_available()
        and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    )
    if use_cuda:
        index = 0 if share_gpu else int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    # Both sides run the same float32 arithmetic; cuDNN's TF32 would round convolution inputs
    # to 10 mantissa bits, its algorithms (chosen per batch size) differently, flipping spikes.
    torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group("nccl" if use_cuda and not share_gpu else "gloo")
    try:
        ok = run_checks(checks, device)
    finally:
        gc.collect()  # DDP's reducers (reference cycles) must go before their process group
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
