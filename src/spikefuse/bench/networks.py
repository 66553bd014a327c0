"""The networks the end-to-end benchmark trains: the DATE'22 paper's CIFAR10 networks (its
Table I) in vanilla PyTorch and as a SpikingJelly user writes them with spikefuse's layers, and
residual networks of :mod:`spikefuse.models` with the input each is benchmarked on."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, TypedDict

import torch
from torch import Tensor, nn

from .. import layer, models, neuron, surrogate
from ..model import qkformer, spike_driven_transformer, spikformer

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
    # the builder takes T=, and the network [B, C, H, W] images that it repeats over T itself
    # (SpikingJelly's transformers)
    static: bool = False
    averaged: bool = False  # the output is [B, classes], already averaged over T


def cifar_transformer(build: Callable[..., nn.Module], averaged: bool = True) -> ZooNet:
    """A SpikingJelly spiking transformer at CIFAR size (T=4, B=64): 32 x 32 images that it
    repeats over T itself, 10 classes; ``averaged``: it returns time-averaged logits."""
    return ZooNet(build, 32, 10, T=4, batch=64, static=True, averaged=averaged)


# the Spike-driven Transformer paper's CIFAR setting: 2 blocks of 512, 8 heads, 8 x 8 tokens
SDT_CIFAR: dict[str, Any] = {
    "num_classes": 10,
    "embed_dims": 512,
    "num_heads": 8,
    "depths": 2,
    "pooling_stat": "0011",
}

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
    "spikformer-4-384-cifar": cifar_transformer(spikformer.spikformer_cifar10, averaged=False),
    "qkformer-10-384-cifar": cifar_transformer(
        lambda **kw: qkformer.qkformer_10_384(num_classes=10, **kw)
    ),
    "sdt-2-512-cifar": cifar_transformer(
        lambda **kw: spike_driven_transformer.SpikeDrivenTransformer(**SDT_CIFAR, **kw)
    ),
}


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


def layered_model(
    name: str, layers: ModuleType, make_neuron: Callable[[], nn.Module]
) -> nn.Sequential:
    """The network written the SpikingJelly way from ``layers`` (a module with SpikingJelly's
    multi-step ``Conv2d``, ``BatchNorm2d``, ``Linear``, ``BatchNorm1d``, ``AvgPool2d`` and
    ``Flatten``: :mod:`spikefuse.layer` or SpikingJelly's own) and ``make_neuron()``."""
    make: dict[str, Callable[..., list[nn.Module]]] = {
        "conv": lambda i, o: [
            layers.Conv2d(i, o, 3, padding=1, bias=False, step_mode="m"),
            layers.BatchNorm2d(o, step_mode="m"),
            make_neuron(),
        ],
        "fc": lambda i, o: [
            layers.Linear(i, o, bias=False, step_mode="m"),
            layers.BatchNorm1d(o, step_mode="m"),
            make_neuron(),
        ],
        "pool": lambda: [layers.AvgPool2d(2, step_mode="m")],
        "flatten": lambda: [layers.Flatten(step_mode="m")],
        "classifier": lambda i, o: [layers.Linear(i, o, step_mode="m")],
    }
    return network(name, make)


def spikefuse_model(
    name: str, backend: str, make_surrogate: Callable[[], surrogate.Surrogate] = surrogate.Sigmoid
) -> nn.Sequential:
    """The same network from spikefuse layers and :func:`sj_lif` neurons (by default with
    SpikingJelly's default surrogate, Sigmoid with alpha = 4)."""
    return layered_model(name, layer, lambda: sj_lif(backend, make_surrogate))


def zoo_model(
    model: str,
    backend: str | None,
    make_neuron: Callable[[], nn.Module] = VanillaLIF,
    T: int | None = None,
) -> nn.Module:
    """A :data:`ZOO` network with :func:`sj_lif`-like neurons, or with ``make_neuron()`` (the
    vanilla Python-loop LIF; the ``ann`` variant's ``nn.ReLU``) when ``backend`` is None;
    ``T``: the time steps of a ``static`` network (None: its builder's default)."""
    steps = {"T": T} if T is not None and ZOO[model].static else {}
    if backend is None:
        return ZOO[model].build(spiking_neuron=lambda **_: make_neuron(), step_mode="m", **steps)
    return ZOO[model].build(
        **steps,
        spiking_neuron=neuron.LIFNode,
        **SJ_LIF,
        surrogate_function=surrogate.Sigmoid(),
        backend=backend,
    )
