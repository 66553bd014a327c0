"""End-to-end training benchmark on the DATE'22 paper's CIFAR10 networks (its Table I, with BN).

One iteration = forward, cross-entropy loss, backward and an SGD (momentum) step on a synthetic
CIFAR-shaped batch: the image [B, 3, 32, 32] is repeated over T steps, the output is averaged
over T. Networks (3×3 convs with padding 1, 2×2 average pooling, every Conv/FC but the last
followed by BatchNorm and the paper's LIF)::

    small:  128C-AP-256C-AP-512C-AP-1024FC-512FC-10FC
    medium: 128C-128C-AP-256C-256C-AP-512C-512C-AP-1024FC-512FC-10FC
    large:  128C-128C-128C-AP-256C-256C-256C-AP-512C-512C-512C-AP-1024FC-512FC-10FC

Variants: ``ann`` (the same layers in plain PyTorch with ``nn.ReLU`` for the neurons and no
time loop: no spiking network, but the host time any eager PyTorch implementation of these
layers needs on the machine, the floor under the eager variants' host column), ``vanilla``
(plain PyTorch: Conv/BN on the merged T·B batch, a Python loop over T for the LIF with a
rectangular-surrogate autograd function), ``vanilla-compile`` (``torch.compile``
of it), ``spikefuse`` (the network as a SpikingJelly user writes it: ``layer.Conv2d`` →
``layer.BatchNorm2d`` → ``neuron.LIFNode(tau=4/3, decay_input=False, v_threshold=0.25,
surrogate_function=surrogate.Sigmoid())``, ``layer.AvgPool2d``, ...; cuda backend on GPUs) and
``fused`` (:func:`spikefuse.fuse` of that model); ``+graph`` replays the whole training step
captured in a CUDA graph, ``+compile`` runs ``torch.compile(model)``, ``+reduce-overhead``
``torch.compile(model, mode="reduce-overhead")`` (inductor replays forward and backward from
CUDA graphs; the optimizer step stays eager), ``+model-graphs``
:func:`spikefuse.graph_model` (forward and backward replayed from CUDA graphs inside the loop;
the loss, optimizer and ``loss.item()`` eager); ``fused-<mode>`` is ``fuse(model,
memory="<mode>")`` for every other registered memory mode (:func:`spikefuse.fused.memory_modes`):
``fused-min`` (blocks keep only their input and recompute the synapse), ``fused-auto`` (blocks
choose one of the two where it pays).
Eager, ``+model-graphs`` and compiled variants run the step a SpikingJelly user writes
(``--loop user``, the default: the batch ``repeat``ed over T, autocast with its weight cache,
``loss.item()`` every step); ``+graph`` variants capture that step whole, without the
read-back. ``--loop bench`` expands the image over T instead (a view: the fused stem then
convolves each image once) and reads nothing back. Reports ms per step (synchronised, back to back,
host issue time; see
:mod:`spikefuse.bench.common`) and peak
allocated MiB, for fp32 and bf16 autocast; writes ``e2e_<model>.csv`` and ``.png``.

Residual networks from :mod:`spikefuse.models` (``--model resnet19``: ResNet-19 on 32×32,
default T=4, B=64; ``--model sew-resnet18``: SEW-ResNet-18 (ADD) on 224×224 with 1000 classes,
default T=4, B=32): the same variants, with the zoo's blocks; ``vanilla`` uses the same layers
with the Python-loop LIF; a fused variant prints how many of the Conv → BN → neuron chains
:func:`spikefuse.fuse` fused.

    python -m spikefuse bench e2e --model medium
    python -m spikefuse bench e2e --device cpu --T 2 --batch 2 --iters 2   # smoke test
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from .. import functional
from ..fused import fuse, memory_modes
from ..graphs import capture_step
from ..model_graphs import graph_model
from .common import (
    BenchResult,
    format_table,
    measure,
    plot_results,
    require_plots,
    write_csv,
)
from .networks import (
    IMAGE_SIZE,
    IN_CHANNELS,
    MODELS,
    NUM_CLASSES,
    ZOO,
    ZooNet,
    spikefuse_model,
    vanilla_model,
    zoo_model,
)
from .peers import spikingjelly_model

# The variants besides the fused models of the memory modes other than "default" (see
# variants(), which adds those from the registry).
VARIANTS = (
    "ann",
    "vanilla",
    "vanilla-compile",
    "spikefuse",
    "spikefuse+graph",
    "spikefuse+compile",
    "spikefuse+reduce-overhead",
    "spikefuse+model-graphs",
    "fused",
    "fused+graph",
    "fused+model-graphs",
    "fused+compile",
    "fused+reduce-overhead",
    "spikingjelly",
)
# The suffixes the fused models of the memory modes besides "default" run with.
MEMORY_MODE_SUFFIXES = ("", "+graph", "+model-graphs")
# How a step is written: "user" is a SpikingJelly-style loop left as its author wrote it (the
# batch ``repeat``ed over T, autocast with its weight cache, ``loss.item()`` each step; a
# ``+graph`` variant captures the same step without the read-back and the cache); "bench"
# expands the batch (fused stems then convolve one image per sample) and reads nothing back.
LOOPS = ("user", "bench")
DTYPES = {"fp32": None, "bf16": torch.bfloat16}
# torch.compile's mode of each compiled variant's suffix (the part after "+")
COMPILE_MODES = {"compile": None, "reduce-overhead": "reduce-overhead"}


def fused_memory() -> dict[str, str]:
    """fuse()'s memory mode of each fused model (a variant's part before any "+"): "fused" is
    the "default" mode's, "fused-<mode>" every other registered mode's (read from the registry
    on every call, so a mode registered after import is a variant too)."""
    return {("fused" if m == "default" else f"fused-{m}"): m for m in memory_modes()}


def variants() -> tuple[str, ...]:
    """Every variant: :data:`VARIANTS`, then each other memory mode's fused model with the
    suffixes of :data:`MEMORY_MODE_SUFFIXES`."""
    others = [base for base in fused_memory() if base != "fused"]
    return (*VARIANTS, *(base + suffix for base in others for suffix in MEMORY_MODE_SUFFIXES))


def compiled(net: nn.Module, mode: str | None = None) -> nn.Module:
    """``torch.compile(net, mode=mode)``: an OptimizedModule, which torch's annotation (a
    callable) hides."""
    return cast(nn.Module, torch.compile(net, mode=mode))


def build(variant: str, model: str, device: torch.device, T: int | None = None) -> nn.Module:
    """The variant's model (``+graph`` is applied to its training step, not here); ``T``: the
    time steps of a static zoo network (it repeats its images itself)."""
    backend = "cuda" if device.type == "cuda" else "torch"
    base, _, mode = variant.partition("+")
    if base == "ann":  # the same layers, ReLU for the neurons: eager PyTorch's own host floor
        return zoo_model(model, None, nn.ReLU, T) if model in ZOO else vanilla_model(model, nn.ReLU)
    if base in ("vanilla", "vanilla-compile"):
        net = zoo_model(model, None, T=T) if model in ZOO else vanilla_model(model)
        return compiled(net) if variant == "vanilla-compile" else net
    if variant == "spikingjelly":  # SpikingJelly 2.0's own modules, as its users run them
        return spikingjelly_model(model, T)
    memory = fused_memory()
    if base != "spikefuse" and base not in memory:
        raise ValueError(f"unknown variant {variant!r}")
    net = zoo_model(model, backend, T=T) if model in ZOO else spikefuse_model(model, backend)
    if base in memory:
        net, report = fuse(net, inplace=True, return_report=True, memory=memory[base])
        print(f"  {variant}: fused {len(report.fused)} of {report.chains} chains", flush=True)
    if mode == "model-graphs":
        return graph_model(net)
    return compiled(net, COMPILE_MODES[mode]) if mode in COMPILE_MODES else net


def input_geometry(model: str) -> tuple[int, int]:
    """(image size, classes) of a benchmark network."""
    zoo = ZOO.get(model)
    return (zoo.image_size, zoo.num_classes) if zoo else (IMAGE_SIZE, NUM_CLASSES)


def training_step(
    net: nn.Module,
    device: torch.device,
    T: int,
    batch: int,
    amp: torch.dtype | None,
    geometry: tuple[int, int] = (IMAGE_SIZE, NUM_CLASSES),
    *,
    repeat: bool = False,
    read_back: bool = False,
    zoo: ZooNet | None = None,
) -> Callable[[], None]:
    """A closure running one full training iteration on a fixed synthetic batch: the image
    ``repeat``ed over T (a copy, as SpikingJelly's examples make it) or expanded (a view), and,
    with ``read_back``, the loss read on the host after the step with autocast's weight cache
    on, as a user's loop does (a step to be captured in a CUDA graph can do neither). A
    ``zoo.static`` network gets the images [B, C, H, W] and repeats them itself; a
    ``zoo.averaged`` one returns logits already averaged over T."""
    static, averaged = (zoo.static, zoo.averaged) if zoo else (False, False)
    net = net.to(device).train()
    size, classes = geometry
    gen = torch.Generator(device="cpu").manual_seed(0)
    images = torch.rand(batch, IN_CHANNELS, size, size, generator=gen).to(device)
    labels = torch.randint(0, classes, (batch,), generator=gen).to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    autocast = functools.partial(
        torch.autocast, device.type, amp or torch.float32, amp is not None, cache_enabled=read_back
    )

    def step() -> None:
        if static:
            x = images
        elif repeat:
            x = images.unsqueeze(0).repeat(T, 1, 1, 1, 1)
        else:
            x = images.unsqueeze(0).expand(T, -1, -1, -1, -1)  # the same image at every step
        with autocast():
            out = net(x)
            loss = F.cross_entropy(out if averaged else out.mean(0), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        functional.reset_net(net)
        if read_back:
            loss.item()  # the logging every training script does: a host sync per step

    return step


def setup_variant(
    variant: str,
    model: str,
    device: torch.device,
    T: int,
    batch: int,
    amp: torch.dtype | None,
    loop: str = "bench",
) -> Callable[[], None]:
    net = build(variant, model, device, T)
    user, whole_step = loop == "user", variant.endswith("+graph")
    step = training_step(
        net,
        device,
        T,
        batch,
        amp,
        input_geometry(model),
        repeat=user,
        read_back=user and not whole_step,
        zoo=ZOO.get(model),
    )
    return capture_step(step) if whole_step else step


def run(
    model: str,
    device: torch.device,
    T: int,
    batch: int,
    variants: Sequence[str],
    dtypes: Sequence[str],
    *,
    warmup: int,
    iters: int,
    loop: str = "bench",
) -> list[BenchResult]:
    results = []
    for dtype in dtypes:
        for variant in variants:
            torch.manual_seed(0)
            result = measure(
                f"e2e-{model}",
                variant,
                dtype,
                functools.partial(
                    setup_variant, variant, model, device, T, batch, DTYPES[dtype], loop
                ),
                device,
                warmup=warmup,
                iters=iters,
            )
            if variant == "vanilla-compile" or variant.partition("+")[2] in COMPILE_MODES:
                torch.compiler.reset()  # drop compiled graphs (and the models they hold)
            print(format_table([result]).splitlines()[-1], flush=True)
            results.append(result)
    return results


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spikefuse bench e2e",
        description="End-to-end SNN training benchmark on the DATE'22 CIFAR10 networks.",
    )
    parser.add_argument(
        "--model",
        choices=sorted(MODELS) + sorted(ZOO),
        default="medium",
        help="a DATE'22 network size or a residual network (default: medium)",
    )
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="torch device (default: cuda when available, else cpu)",
    )
    parser.add_argument(
        "--T",
        type=int,
        default=None,
        help="time steps (default: 10; the residual nets and the transformers: 4)",
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=None,
        help="batch size (default: 64; the 224x224 ResNets: 32)",
    )
    parser.add_argument("--iters", type=int, default=20, help="timed iterations (default: 20)")
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed iterations first (default: 5; 1 on CPU)"
    )
    parser.add_argument(
        "--variants", nargs="+", choices=variants(), default=list(variants()), help="default: all"
    )
    parser.add_argument(
        "--dtypes",
        nargs="+",
        choices=sorted(DTYPES),
        default=["fp32", "bf16"],
        help="fp32 and/or bf16 autocast (default: both)",
    )
    parser.add_argument(
        "--loop",
        choices=LOOPS,
        default="user",
        help="how steps are written: 'user' (a SpikingJelly-style loop: repeat over T, "
        "loss.item() each step; +graph captures it without the read-back) or 'bench' (expand "
        "over T, no read-back) (default: user)",
    )
    parser.add_argument(
        "--cudnn-benchmark",
        action="store_true",
        help="let cuDNN autotune convolution algorithms (all variants alike; default: off)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("bench_out"),
        help="directory for the CSV and PNG (default: bench_out/)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    require_plots()
    zoo = ZOO.get(args.model)
    if args.T is None:
        args.T = zoo.T if zoo else 10
    if args.batch is None:
        args.batch = zoo.batch if zoo else 64
    for name in ("T", "batch", "iters"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if args.warmup is not None and args.warmup < 0:
        parser.error("--warmup must be >= 0")
    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        parser.error(f"--device: {exc}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("CUDA is not available; use --device cpu")
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    warmup = args.warmup if args.warmup is not None else (5 if device.type == "cuda" else 1)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"e2e {args.model}: T={args.T} B={args.batch} on {where}, {args.loop} loop, median of "
        f"{args.iters} iterations after {warmup} warm-up"
    )
    results = run(
        args.model,
        device,
        args.T,
        args.batch,
        args.variants,
        args.dtypes,
        warmup=warmup,
        iters=args.iters,
        loop=args.loop,
    )
    print()
    print(format_table(results, baseline="vanilla"))
    csv_path = args.out / f"e2e_{args.model}.csv"
    png_path = args.out / f"e2e_{args.model}.png"
    write_csv(csv_path, results)
    plot_results(png_path, results, f"{args.model}: T={args.T}, B={args.batch}, {where}")
    print(f"\nwrote {csv_path} and {png_path}")
    return 0 if any(r.ok for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
