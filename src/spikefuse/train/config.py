"""What a training run is: its options (:class:`TrainConfig`, validated on construction), the
networks ``--model`` can train and the neurons ``--neuron`` names."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from spikefuse import layer, models, neuron
from spikefuse.errors import SpikefuseError
from spikefuse.fused import memory_modes
from spikefuse.model import QKFormer, SpikeDrivenTransformer, Spikformer

CHECKPOINT_FORMAT = "spikefuse.train.digits"
# Version 2 added the "sha256" checksum of the payload; version 3 the model and data set to
# the config.
CHECKPOINT_VERSION = 3
CHECKPOINT_KEYS = frozenset(
    {"format", "version", "epoch", "config", "test_accuracy", "model", "optimizer", "sha256"}
)
# The types each value of a checkpoint's model configuration (TrainConfig.model_config) may
# have: plain values, which compare with the run's exactly (True == 1 and 1.0 == 1 do not pass).
MODEL_CONFIG_TYPES: dict[str, tuple[type, ...]] = {
    "architecture": (str,),
    "data": (str,),
    "neuron": (str,),
    "T": (int,),
    "seed": (int,),
    "limit": (int, type(None)),
}
ARCHITECTURE = "digits-cnn-v1"
NUM_CLASSES = 10
DIGITS_SAMPLES = 1797  # scikit-learn's digits
DIGITS_SIZE = 8
CIFAR10_SIZE = 32
# cifar-10-batches-bin: each record is 1 label byte, then 3x32x32 pixel bytes (R, G, B planes).
CIFAR10_RECORD_BYTES = 1 + 3 * CIFAR10_SIZE * CIFAR10_SIZE
CIFAR10_TRAIN_FILES = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
CIFAR10_TEST_FILE = "test_batch.bin"
# Neuromorphic data sets (spikefuse.datasets, read from --data-dir): image side, classes.
# SHD's 700 units are laid out as a 28 x 28 map (84 cells stay 0) for the convolutional nets.
NEUROMORPHIC = {
    "dvs128-gesture": (128, 11),
    "cifar10-dvs": (128, 10),
    "n-mnist": (34, 10),
    "shd": (28, 20),
}
DATA_SETS = {  # name -> image side
    "digits": DIGITS_SIZE,
    "cifar10": CIFAR10_SIZE,
    **{name: side for name, (side, _) in NEUROMORPHIC.items()},
}
CLASSES = {
    name: NEUROMORPHIC[name][1] if name in NEUROMORPHIC else NUM_CLASSES for name in DATA_SETS
}
AMP_MODES = ("none", "bf16")
# CUDA graphs: "model" replays the model's forward and backward (spikefuse.graph_model) inside
# the eager step, "step" the whole step (spikefuse.graphs.GraphedStep), "auto" is "model" on
# a GPU and "off" on the CPU.
CUDA_GRAPH_MODES = ("auto", "model", "step", "off")
MIN_SAMPLES = 10
TEST_FRACTION = 0.25
EVAL_BATCH_SIZE = 512
BACKENDS = ("auto", "torch", "cuda")
DEVICES = ("auto", "cpu", "cuda")
# numpy's and scikit-learn's generators both take seeds in [0, 2**32).
MAX_SEED = 2**32 - 1

# The optional packages (the "demo" extra) and what they are for; imported where used.
TRAIN = "spikefuse train"
NEEDS_DIGITS = {"sklearn": "the digits data set"}
NEEDS_PLOT = {"matplotlib": "the training plot"}
NEEDS_PROGRESS = {"tqdm": "the progress bar (or pass --quiet)"}

NEURONS: dict[str, Callable[..., nn.Module]] = {
    "if": neuron.IFNode,
    "lif": functools.partial(neuron.LIFNode, tau=2.0),
    "plif": functools.partial(neuron.ParametricLIFNode, init_tau=2.0),
    "qif": neuron.QIFNode,
    "eif": neuron.EIFNode,
    "izhikevich": neuron.IzhikevichNode,
}


class CheckpointError(SpikefuseError):
    """A checkpoint cannot be resumed from: missing, corrupted, foreign or mismatched."""


def check_limit(limit: int | None, data: str = "digits") -> None:
    """Raise :class:`SpikefuseError` unless ``limit`` is None or a usable sample count.

    The digits have a known size; CIFAR-10's files are checked to hold ``limit`` training
    samples when they are read.
    """
    if limit is None:
        return
    most = DIGITS_SAMPLES if data == "digits" else None
    if type(limit) is not int or limit < MIN_SAMPLES or (most is not None and limit > most):
        bounds = f"between {MIN_SAMPLES} and {most}" if most else f">= {MIN_SAMPLES}"
        raise SpikefuseError(f"--limit must be {bounds}, got {limit!r} (--data {data})")


@dataclass(frozen=True)
class ModelSpec:
    """A network ``--model`` can train: ``build(make_neuron, channels, size, classes)``
    returns it in multi-step mode for ``channels`` x ``size`` x ``size`` images,
    ``[T, N, classes]`` out.

    ``architecture`` is recorded in checkpoints; ``channels`` is the input channel count the
    network needs (None: any; grey digits are repeated to RGB for a 3-channel network);
    ``min_size`` is the smallest image side it is meant for; ``bn_stride`` how many times
    smaller than the image its last BatchNorm's maps are.
    """

    architecture: str
    channels: int | None
    min_size: int
    build: Callable[[Callable[..., nn.Module], int, int, int], nn.Module]
    bn_stride: int


def _zoo(constructor: Callable[..., nn.Module], **options: Any) -> Callable[..., nn.Module]:
    """A :class:`ModelSpec` builder for a :mod:`spikefuse.models` constructor (10 classes)."""

    def build(
        make_neuron: Callable[..., nn.Module], channels: int, size: int, classes: int
    ) -> nn.Module:
        # step_mode goes to every neuron and (an extension of SpikingJelly's) to the layers.
        if channels != 3:
            raise SpikefuseError(
                f"{constructor.__name__} takes RGB images; this data has {channels} channels "
                "(use --model digits-cnn)"
            )
        return constructor(
            spiking_neuron=make_neuron, num_classes=classes, step_mode="m", **options
        )

    return build


class _PerStep(nn.Module):
    """A network that averages over time itself (``[N, classes]`` out) as one step
    ``[1, N, classes]``, the shape the training loop averages over T."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).unsqueeze(0)


def _transformer(
    constructor: Callable[..., nn.Module], time_averaged: bool, **config: Any
) -> Callable[..., nn.Module]:
    """A :class:`ModelSpec` builder for a spiking transformer of :mod:`spikefuse.model` with
    ``config``. ``--neuron lif`` keeps each position's default LIF (``detach_reset``, attention
    products firing at 0.5, as the papers train them) with ``make_neuron``'s arguments; any
    other neuron class is used everywhere, as SpikingJelly's ``spiking_neuron`` is."""

    def build(
        make_neuron: Callable[..., nn.Module], channels: int, size: int, classes: int
    ) -> nn.Module:
        spiking_neuron: Callable[..., nn.Module] | None = make_neuron
        kwargs: dict[str, Any] = {}
        if isinstance(make_neuron, functools.partial) and make_neuron.func is neuron.LIFNode:
            spiking_neuron, kwargs = None, dict(make_neuron.keywords)
        net = constructor(
            in_channels=channels, num_classes=classes, spiking_neuron=spiking_neuron,
            **config, **kwargs,
        )  # fmt: skip
        return _PerStep(net) if time_averaged else net

    return build


def _digits_cnn(
    make_neuron: Callable[..., nn.Module], channels: int, size: int, classes: int
) -> nn.Module:
    return build_model(make_neuron, channels=channels, size=size, classes=classes)


MODELS: dict[str, ModelSpec] = {
    "digits-cnn": ModelSpec(ARCHITECTURE, None, 4, _digits_cnn, bn_stride=2),
    # ResNet-19 is CIFAR's: stride 1 stem, two stride-2 stages; it also fits the 8x8 digits.
    "spiking_resnet19": ModelSpec(
        "spiking_resnet19", 3, DIGITS_SIZE, _zoo(models.spiking_resnet19), bn_stride=4
    ),
    # The ImageNet layouts shrink the input 32-fold: CIFAR-10's 32x32 is their smallest sensible.
    "spiking_resnet18": ModelSpec(
        "spiking_resnet18", 3, CIFAR10_SIZE, _zoo(models.spiking_resnet18), bn_stride=32
    ),
    "sew_resnet18": ModelSpec(
        "sew_resnet18", 3, CIFAR10_SIZE, _zoo(models.sew_resnet18, cnf="ADD"), bn_stride=32
    ),
    # A 512-wide classifier instead of VGG's 4096 (on 10 classes 4096 only adds weights).
    "spiking_vgg11_bn": ModelSpec(
        "spiking_vgg11_bn",
        3,
        CIFAR10_SIZE,
        _zoo(models.spiking_vgg11_bn, classifier_features=512),
        bn_stride=16,
    ),
    # Small spiking transformers for 32 x 32 images (the papers' CIFAR models are 4-384 wide,
    # e.g. spikefuse.model.spikformer.spikformer_cifar10; these train in minutes on a CPU).
    "spikformer-2-128-cifar": ModelSpec(
        "spikformer-2-128-cifar",
        None,
        CIFAR10_SIZE,
        _transformer(
            Spikformer,
            False,
            img_size_h=32,
            img_size_w=32,
            patch_size=4,
            embed_dims=128,
            num_heads=8,
            depths=2,
        ),  # fmt: skip
        bn_stride=4,
    ),
    "sdt-2-128-cifar": ModelSpec(
        "sdt-2-128-cifar",
        None,
        CIFAR10_SIZE,
        _transformer(
            SpikeDrivenTransformer,
            True,
            embed_dims=128,
            num_heads=8,
            depths=2,
            pooling_stat="0011",
        ),  # fmt: skip
        bn_stride=4,
    ),
    "qkformer-3-128-cifar": ModelSpec(
        "qkformer-3-128-cifar",
        None,
        CIFAR10_SIZE,
        _transformer(QKFormer, True, embed_dims=128, num_heads=(2, 2, 4), depths=(1, 1, 1)),
        bn_stride=16,
    ),
}


def build_model(
    make_neuron: Callable[..., nn.Module],
    channels: int = 1,
    size: int = DIGITS_SIZE,
    classes: int = NUM_CLASSES,
) -> nn.Sequential:
    """The digits CNN: Conv-BN-spike-pool, twice, then a linear readout, all in multi-step
    mode, for ``channels`` x ``size`` x ``size`` images (``size`` a multiple of 4).

    ``make_neuron(step_mode="m")`` returns a neuron. The readout has no neuron: the logits
    are its output averaged over time, i.e. a linear function of the spike counts, which
    trains well with cross-entropy.
    """
    return nn.Sequential(
        layer.Conv2d(channels, 16, kernel_size=3, padding=1, bias=False, step_mode="m"),
        layer.BatchNorm2d(16, step_mode="m"),
        make_neuron(step_mode="m"),
        layer.MaxPool2d(2, step_mode="m"),  # 8x8 -> 4x4
        layer.Conv2d(16, 32, kernel_size=3, padding=1, bias=False, step_mode="m"),
        layer.BatchNorm2d(32, step_mode="m"),
        make_neuron(step_mode="m"),
        layer.MaxPool2d(2, step_mode="m"),  # 4x4 -> 2x2
        layer.Flatten(step_mode="m"),
        layer.Linear(32 * (size // 4) ** 2, classes, step_mode="m"),
    )


@dataclass(frozen=True)
class TrainConfig:
    """Everything that defines a training run (the CLI options), validated on construction."""

    epochs: int = 8
    batch_size: int = 32
    T: int = 4
    lr: float = 1e-2
    model: str = "digits-cnn"
    neuron: str = "lif"
    backend: str = "auto"
    device: str = "auto"
    data: str = "digits"
    data_dir: str | None = None
    fuse: bool = False
    memory: str = "default"
    amp: str = "none"
    seed: int = 0
    checkpoint: str = "checkpoints/digits.pt"
    resume: bool = False
    overwrite: bool = False
    limit: int | None = None
    quiet: bool = False
    cuda_graph: str = "auto"

    def __post_init__(self) -> None:
        """Reject every value that could crash or poison the run, before anything happens."""
        self._take_numpy_numbers()
        for name in ("epochs", "batch_size", "T"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                option = "--" + name.replace("_", "-")
                raise SpikefuseError(f"{option} must be a whole number >= 1, got {value!r}")
        if type(self.lr) not in (int, float) or not (math.isfinite(self.lr) and self.lr > 0):
            raise SpikefuseError(f"--lr must be a finite number > 0, got {self.lr!r}")
        if type(self.seed) is not int or not 0 <= self.seed <= MAX_SEED:
            raise SpikefuseError(f"--seed must be between 0 and {MAX_SEED}, got {self.seed!r}")
        for name, allowed in (
            ("model", list(MODELS)),
            ("neuron", sorted(NEURONS)),
            ("backend", BACKENDS),
            ("device", DEVICES),
            ("data", list(DATA_SETS)),
            ("amp", AMP_MODES),
            ("memory", memory_modes()),
            ("cuda_graph", CUDA_GRAPH_MODES),
        ):
            if getattr(self, name) not in allowed:
                raise SpikefuseError(
                    f"unknown --{name} {getattr(self, name)!r}; choose from {list(allowed)}"
                )
        check_limit(self.limit, self.data)
        self._check_data_and_model()
        self._check_run_options()

    def _check_data_and_model(self) -> None:
        """The data set, its folder and the model it feeds fit together."""
        if self.data == "cifar10" and not (isinstance(self.data_dir, str) and self.data_dir):
            raise SpikefuseError(
                "--data cifar10 needs --data-dir: the folder holding CIFAR-10's binary version "
                f"(cifar-10-batches-bin: {', '.join(CIFAR10_TRAIN_FILES)}, {CIFAR10_TEST_FILE})"
            )
        if self.data in NEUROMORPHIC and not (isinstance(self.data_dir, str) and self.data_dir):
            raise SpikefuseError(
                f"--data {self.data} needs --data-dir: the data set's root folder, as "
                "spikingjelly.datasets takes it (download/ with the published files, or "
                "extract/, or events_np/; nothing is downloaded)"
            )
        if self.data == "digits" and self.data_dir is not None:
            raise SpikefuseError(
                "--data-dir is for --data cifar10 or a neuromorphic set; the digits are built in"
            )
        size, least = DATA_SETS[self.data], MODELS[self.model].min_size
        if size < least:
            raise SpikefuseError(
                f"--model {self.model} is made for images of {least}x{least} or more; "
                f"--data {self.data} has {size}x{size} (use --data cifar10)"
            )
        if self.T == self.batch_size == 1 and self.last_bn_maps_are_1x1:
            raise SpikefuseError(
                f"--model {self.model} on {size}x{size} images shrinks its last BatchNorm's maps "
                "to 1x1: with --batch-size 1 and --T 1 BatchNorm would see one value per "
                "channel, which training cannot normalise; use --batch-size 2 or more"
            )

    def _check_run_options(self) -> None:
        """Fusing, the flags, the checkpoint path and the CUDA-graph mode."""
        if self.memory != "default" and not self.fuse:
            raise SpikefuseError("--memory applies to fused blocks: add --fuse")
        for name in ("fuse", "resume", "overwrite", "quiet"):
            if not isinstance(getattr(self, name), bool):
                raise SpikefuseError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.checkpoint, str) or not self.checkpoint:
            raise SpikefuseError(f"--checkpoint must be a file path, got {self.checkpoint!r}")
        if self.cuda_graph in ("model", "step") and self.device == "cpu":
            raise SpikefuseError(
                f"--cuda-graph replays steps on a GPU ({self.cuda_graph}); drop --device cpu "
                "or use --no-cuda-graph"
            )
        if self.resume and self.overwrite:
            raise SpikefuseError(
                "--resume and --overwrite exclude each other: --resume continues the "
                "checkpoint, --overwrite starts a new run in its place"
            )

    def graph_mode(self, device: torch.device) -> str:
        """``cuda_graph`` on ``device``: ``auto`` is ``model`` on a GPU and ``off`` on the CPU."""
        if self.cuda_graph == "auto":
            return "model" if device.type == "cuda" else "off"
        return self.cuda_graph

    def _take_numpy_numbers(self) -> None:
        """numpy integers and floats become Python numbers (as torch takes them), so that the
        checks below and the checkpoint see Python ints and floats; bools stay refused."""
        for name in ("epochs", "batch_size", "T", "seed", "limit", "lr"):
            value = getattr(self, name)
            if isinstance(value, np.integer):
                object.__setattr__(self, name, int(value))
            elif name == "lr" and isinstance(value, np.floating):
                object.__setattr__(self, name, float(value))

    @property
    def last_bn_maps_are_1x1(self) -> bool:
        """Whether the model's last BatchNorm sees 1 x 1 maps of this data's images: one sample
        at T = 1 then gives it one value per channel, which training cannot normalise."""
        return DATA_SETS[self.data] // MODELS[self.model].bn_stride <= 1

    def model_config(self) -> dict[str, Any]:
        """Settings a resumed run must share with its checkpoint.

        They fix the network (architecture, neuron, time steps) and the data (data set, seed
        and limit fix the split); the others (epochs, learning rate, batch size, device,
        --fuse, --amp, ...) may change: fused and unfused models share their state dicts.
        """
        return {
            "architecture": MODELS[self.model].architecture,
            "data": self.data,
            "neuron": self.neuron,
            "T": self.T,
            "seed": self.seed,
            "limit": self.limit,
        }
