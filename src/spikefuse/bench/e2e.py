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
the loss, optimizer and ``loss.item()`` eager); ``fused-min`` is
``fuse(model, memory="min")`` (blocks keep only their input and recompute the synapse),
``fused-auto`` ``fuse(model, memory="auto")`` (blocks choose one of the two where it pays).
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
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import functional, layer, models, neuron, surrogate
from ..fused import fuse
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

# Paper's LIF (Table I): u[t] = ALPHA u[t-1] (1 - s[t-1]) + x[t]; s = [u >= TH];
# surrogate derivative ETA inside (TH - HALF_WIDTH, TH + HALF_WIDTH).
ALPHA, TH, ETA, HALF_WIDTH = 0.25, 0.25, 1.0, 0.5
POOL = "AP"
# Conv widths (AP: pool), then hidden FC widths; the classifier has NUM_CLASSES outputs.
MODELS: dict[str, tuple[tuple[int | str, ...], tuple[int, ...]]] = {
    "small": ((128, POOL, 256, POOL, 512, POOL), (1024, 512)),
    "medium": ((128, 128, POOL, 256, 256, POOL, 512, 512, POOL), (1024, 512)),
    "large": ((128, 128, 128, POOL, 256, 256, 256, POOL, 512, 512, 512, POOL), (1024, 512)),
}
NUM_CLASSES, IMAGE_SIZE, IN_CHANNELS = 10, 32, 3


@dataclass(frozen=True)
class ZooNet:
    """A residual network of :mod:`spikefuse.models` and the input it is benchmarked on."""

    build: Callable[..., nn.Module]  # (spiking_neuron=..., **neuron kwargs) -> model
    image_size: int
    num_classes: int
    T: int  # default time steps and batch size of the benchmark
    batch: int


ZOO = {
    "resnet19": ZooNet(models.spiking_resnet19, 32, 10, T=4, batch=64),
    "sew-resnet18": ZooNet(
        lambda **kw: models.sew_resnet18(cnf="ADD", **kw), 224, 1000, T=4, batch=32
    ),
    "sew-resnet34": ZooNet(
        lambda **kw: models.sew_resnet34(cnf="ADD", **kw), 224, 1000, T=4, batch=32
    ),
    "spiking-resnet18": ZooNet(models.spiking_resnet18, 224, 1000, T=4, batch=32),
    "spiking-resnet34": ZooNet(models.spiking_resnet34, 224, 1000, T=4, batch=32),
}
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
    "fused-min",
    "fused-min+graph",
    "fused-min+model-graphs",
    "fused-auto",
    "fused-auto+graph",
    "fused-auto+model-graphs",
)
# How a step is written: "user" is a SpikingJelly-style loop left as its author wrote it (the
# batch ``repeat``ed over T, autocast with its weight cache, ``loss.item()`` each step; a
# ``+graph`` variant captures the same step without the read-back and the cache); "bench"
# expands the batch (fused stems then convolve one image per sample) and reads nothing back.
LOOPS = ("user", "bench")
DTYPES = {"fp32": None, "bf16": torch.bfloat16}
# fuse()'s memory mode of each fused variant (the part before any "+")
FUSED_MEMORY = {"fused": "default", "fused-min": "min", "fused-auto": "auto"}
# torch.compile's mode of each compiled variant's suffix (the part after "+")
COMPILE_MODES = {"compile": None, "reduce-overhead": "reduce-overhead"}


# ---- the vanilla PyTorch baseline -------------------------------------------------------------
class RectSpike(torch.autograd.Function):
    """s = [u >= TH]; ds/du = ETA for |u - TH| < HALF_WIDTH, else 0."""

    @staticmethod
    def forward(ctx, u: Tensor) -> Tensor:
        ctx.save_for_backward(u)
        return (u >= TH).to(u.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (u,) = ctx.saved_tensors
        return grad * ((u - TH).abs() < HALF_WIDTH).to(grad.dtype) * ETA


class VanillaLIF(nn.Module):
    """The paper's LIF as a Python loop over T on [T, B, ...] input (gradient through the reset)."""

    def forward(self, y: Tensor) -> Tensor:
        u = torch.zeros_like(y[0])
        s = torch.zeros_like(y[0])
        spikes = []
        for t in range(y.shape[0]):
            u = ALPHA * u * (1 - s) + y[t]
            s = RectSpike.apply(u)
            spikes.append(s)
        return torch.stack(spikes)


class Merged(nn.Sequential):
    """Runs its modules on [T*B, ...] for [T, B, ...] input."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x.flatten(0, 1)).unflatten(0, x.shape[:2])


def network(name: str, make: dict[str, Callable[..., list[nn.Module]]]) -> nn.Sequential:
    """The Table I network ``name`` from layer factories.

    ``make`` maps 'conv' (c_in, c_out), 'fc' (f_in, f_out) — each a synapse with BN and LIF —
    and 'pool', 'flatten', 'classifier' (f_in, f_out) to lists of modules.
    """
    convs, fcs = MODELS[name]
    layers: list[nn.Module] = []
    channels, size = IN_CHANNELS, IMAGE_SIZE
    for item in convs:
        if isinstance(item, int):
            layers += make["conv"](channels, item)
            channels = item
        else:  # POOL
            layers += make["pool"]()
            size //= 2
    layers += make["flatten"]()
    features = channels * size * size
    for width in fcs:
        layers += make["fc"](features, width)
        features = width
    layers += make["classifier"](features, NUM_CLASSES)
    return nn.Sequential(*layers)


def vanilla_model(name: str, make_neuron: Callable[[], nn.Module] = VanillaLIF) -> nn.Sequential:
    """Plain PyTorch: Conv/BN on the merged T·B batch, then ``make_neuron()`` per layer
    (:class:`VanillaLIF`; the ``ann`` variant's ``nn.ReLU``)."""
    make: dict[str, Callable[..., list[nn.Module]]] = {
        "conv": lambda i, o: [
            Merged(nn.Conv2d(i, o, 3, padding=1, bias=False), nn.BatchNorm2d(o)),
            make_neuron(),
        ],
        "fc": lambda i, o: [Merged(nn.Linear(i, o, bias=False), nn.BatchNorm1d(o)), make_neuron()],
        "pool": lambda: [Merged(nn.AvgPool2d(2))],
        "flatten": lambda: [Merged(nn.Flatten())],
        "classifier": lambda i, o: [Merged(nn.Linear(i, o))],
    }
    return network(name, make)


# The paper's LIF as a SpikingJelly user writes it: decay 1 - 1/tau = 0.25, threshold 0.25,
# hard reset to 0 (``neuron.LIFNode`` keyword arguments; the surrogate is chosen per model).
class LIFOptions(TypedDict):
    tau: float
    decay_input: bool
    v_threshold: float
    v_reset: float
    step_mode: str


SJ_LIF: LIFOptions = {
    "tau": 4.0 / 3.0,
    "decay_input": False,
    "v_threshold": 0.25,
    "v_reset": 0.0,
    "step_mode": "m",
}


def sj_lif(backend: str, make_surrogate: Callable[[], surrogate.Surrogate]) -> neuron.LIFNode:
    """:data:`SJ_LIF` with a fresh surrogate."""
    return neuron.LIFNode(**SJ_LIF, surrogate_function=make_surrogate(), backend=backend)


def spikefuse_model(
    name: str, backend: str, make_surrogate: Callable[[], surrogate.Surrogate] = surrogate.Sigmoid
) -> nn.Sequential:
    """The same network from spikefuse layers and :func:`sj_lif` neurons (by default with
    SpikingJelly's default surrogate, Sigmoid with alpha = 4)."""
    make: dict[str, Callable[..., list[nn.Module]]] = {
        "conv": lambda i, o: [
            layer.Conv2d(i, o, 3, padding=1, bias=False, step_mode="m"),
            layer.BatchNorm2d(o, step_mode="m"),
            sj_lif(backend, make_surrogate),
        ],
        "fc": lambda i, o: [
            layer.Linear(i, o, bias=False, step_mode="m"),
            layer.BatchNorm1d(o, step_mode="m"),
            sj_lif(backend, make_surrogate),
        ],
        "pool": lambda: [layer.AvgPool2d(2, step_mode="m")],
        "flatten": lambda: [layer.Flatten(step_mode="m")],
        "classifier": lambda i, o: [layer.Linear(i, o, step_mode="m")],
    }
    return network(name, make)


def zoo_model(
    model: str, backend: str | None, make_neuron: Callable[[], nn.Module] = VanillaLIF
) -> nn.Module:
    """A :data:`ZOO` network with :func:`sj_lif`-like neurons, or with ``make_neuron()`` (the
    vanilla Python-loop LIF; the ``ann`` variant's ``nn.ReLU``) when ``backend`` is None."""
    if backend is None:
        return ZOO[model].build(spiking_neuron=lambda **_: make_neuron(), step_mode="m")
    return ZOO[model].build(
        spiking_neuron=neuron.LIFNode,
        **SJ_LIF,
        surrogate_function=surrogate.Sigmoid(),
        backend=backend,
    )


def compiled(net: nn.Module, mode: str | None = None) -> nn.Module:
    """``torch.compile(net, mode=mode)``: an OptimizedModule, which torch's annotation (a
    callable) hides."""
    return cast(nn.Module, torch.compile(net, mode=mode))


def build(variant: str, model: str, device: torch.device) -> nn.Module:
    """The variant's model (``+graph`` is applied to its training step, not here)."""
    backend = "cuda" if device.type == "cuda" else "torch"
    base, _, mode = variant.partition("+")
    if base == "ann":  # the same layers, ReLU for the neurons: eager PyTorch's own host floor
        return zoo_model(model, None, nn.ReLU) if model in ZOO else vanilla_model(model, nn.ReLU)
    if base in ("vanilla", "vanilla-compile"):
        net = zoo_model(model, None) if model in ZOO else vanilla_model(model)
        return compiled(net) if variant == "vanilla-compile" else net
    if base != "spikefuse" and base not in FUSED_MEMORY:
        raise ValueError(f"unknown variant {variant!r}")
    net = zoo_model(model, backend) if model in ZOO else spikefuse_model(model, backend)
    if base in FUSED_MEMORY:
        net, report = fuse(net, inplace=True, return_report=True, memory=FUSED_MEMORY[base])
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
) -> Callable[[], None]:
    """A closure running one full training iteration on a fixed synthetic batch: the image
    ``repeat``ed over T (a copy, as SpikingJelly's examples make it) or expanded (a view), and,
    with ``read_back``, the loss read on the host after the step with autocast's weight cache
    on, as a user's loop does (a step to be captured in a CUDA graph can do neither)."""
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
        if repeat:
            x = images.unsqueeze(0).repeat(T, 1, 1, 1, 1)
        else:
            x = images.unsqueeze(0).expand(T, -1, -1, -1, -1)  # the same image at every step
        with autocast():
            loss = F.cross_entropy(net(x).mean(0), labels)
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
    net = build(variant, model, device)
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
        "--T", type=int, default=None, help="time steps (default: 10; the residual nets: 4)"
    )
    parser.add_argument(
        "--batch", type=int, default=None, help="batch size (default: 64; sew-resnet18: 32)"
    )
    parser.add_argument("--iters", type=int, default=20, help="timed iterations (default: 20)")
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed iterations first (default: 5; 1 on CPU)"
    )
    parser.add_argument(
        "--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS), help="default: all"
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
