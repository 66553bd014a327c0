"""Train a spiking network: by default a small CNN on scikit-learn's digits (8x8 images, 1797
samples, no download), or a model of :mod:`spikefuse.models` on CIFAR-10 read from a local folder.

This is both the quick-start example and an end-to-end check of spikefuse's neurons, surrogate
gradients, backends and fused blocks: plain SpikingJelly-style code in the multi-step layout
``[T, N, *]``. Under ``torchrun`` (``WORLD_SIZE`` > 1) it trains with DistributedDataParallel.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import functools
import gc
import hashlib
import io
import math
import os
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from spikefuse import backends, functional, layer, models, neuron
from spikefuse.errors import BackendUnavailableError, SpikefuseError
from spikefuse.extras import require
from spikefuse.fused import fuse, match_optimizer_state
from spikefuse.fused.blocks import MEMORY_MODES
from spikefuse.graphs import GraphedStep

CHECKPOINT_FORMAT = "spikefuse.train.digits"
# Version 2 added the "sha256" checksum of the payload; version 3 the model and data set to
# the config.
CHECKPOINT_VERSION = 3
CHECKPOINT_KEYS = frozenset(
    {"format", "version", "epoch", "config", "test_accuracy", "model", "optimizer", "sha256"}
)
ARCHITECTURE = "digits-cnn-v1"
NUM_CLASSES = 10
DIGITS_SAMPLES = 1797  # scikit-learn's digits
DIGITS_SIZE = 8
CIFAR10_SIZE = 32
# cifar-10-batches-bin: each record is 1 label byte, then 3x32x32 pixel bytes (R, G, B planes).
CIFAR10_RECORD_BYTES = 1 + 3 * CIFAR10_SIZE * CIFAR10_SIZE
CIFAR10_TRAIN_FILES = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
CIFAR10_TEST_FILE = "test_batch.bin"
DATA_SETS = {"digits": DIGITS_SIZE, "cifar10": CIFAR10_SIZE}  # name -> image side
AMP_MODES = ("none", "bf16")
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
    """A network ``--model`` can train: ``build(make_neuron, channels, size)`` returns it in
    multi-step mode for ``channels`` x ``size`` x ``size`` images, ``[T, N, classes]`` out.

    ``architecture`` is recorded in checkpoints; ``channels`` is the input channel count the
    network needs (None: any; grey digits are repeated to RGB for a 3-channel network);
    ``min_size`` is the smallest image side it is meant for; ``bn_stride`` how many times
    smaller than the image its last BatchNorm's maps are.
    """

    architecture: str
    channels: int | None
    min_size: int
    build: Callable[[Callable[..., nn.Module], int, int], nn.Module]
    bn_stride: int


def _zoo(constructor: Callable[..., nn.Module], **options: Any) -> Callable[..., nn.Module]:
    """A :class:`ModelSpec` builder for a :mod:`spikefuse.models` constructor (10 classes)."""

    def build(make_neuron: Callable[..., nn.Module], channels: int, size: int) -> nn.Module:
        # step_mode goes to every neuron and (an extension of SpikingJelly's) to the layers.
        return constructor(
            spiking_neuron=make_neuron, num_classes=NUM_CLASSES, step_mode="m", **options
        )

    return build


def _digits_cnn(make_neuron: Callable[..., nn.Module], channels: int, size: int) -> nn.Module:
    return build_model(make_neuron, channels=channels, size=size)


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
}


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
    cuda_graph: bool = False

    def __post_init__(self) -> None:
        """Reject every value that could crash or poison the run, before anything happens."""
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
            ("memory", MEMORY_MODES),
        ):
            if getattr(self, name) not in allowed:
                raise SpikefuseError(
                    f"unknown --{name} {getattr(self, name)!r}; choose from {list(allowed)}"
                )
        check_limit(self.limit, self.data)
        if self.memory != "default" and not self.fuse:
            raise SpikefuseError("--memory applies to fused blocks: add --fuse")
        for name in ("fuse", "resume", "overwrite", "quiet", "cuda_graph"):
            if not isinstance(getattr(self, name), bool):
                raise SpikefuseError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.data == "cifar10" and not (isinstance(self.data_dir, str) and self.data_dir):
            raise SpikefuseError(
                "--data cifar10 needs --data-dir: the folder holding CIFAR-10's binary version "
                f"(cifar-10-batches-bin: {', '.join(CIFAR10_TRAIN_FILES)}, {CIFAR10_TEST_FILE})"
            )
        if self.data == "digits" and self.data_dir is not None:
            raise SpikefuseError("--data-dir is for --data cifar10; the digits are built in")
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
        if not isinstance(self.checkpoint, str) or not self.checkpoint:
            raise SpikefuseError(f"--checkpoint must be a file path, got {self.checkpoint!r}")
        if self.cuda_graph and self.device == "cpu":
            raise SpikefuseError("--cuda-graph replays steps on a GPU; drop --device cpu")
        if self.resume and self.overwrite:
            raise SpikefuseError(
                "--resume and --overwrite exclude each other: --resume continues the "
                "checkpoint, --overwrite starts a new run in its place"
            )

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


@dataclass(frozen=True)
class Dataset:
    """A fixed train/test split, images scaled to [0, 1] with shape ``[N, C, H, W]``."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    def to(self, device: torch.device) -> Dataset:
        """Return the split on ``device`` (the whole data set is kept on the device)."""
        return Dataset(*(getattr(self, f.name).to(device) for f in fields(self)))

    def with_channels(self, channels: int) -> Dataset:
        """Return the split with grey images repeated to ``channels`` channels."""
        if self.x_train.shape[1] == channels:
            return self
        expand = functools.partial(torch.repeat_interleave, repeats=channels, dim=1)
        return Dataset(expand(self.x_train), self.y_train, expand(self.x_test), self.y_test)


def _subset(seed: int, count: int, limit: int | None) -> np.ndarray | slice:
    """A seeded random choice of ``limit`` of ``count`` indices (all of them for None)."""
    if limit is None:
        return slice(None)
    return np.random.default_rng(seed).permutation(count)[:limit]


def load_digits_split(seed: int, limit: int | None = None) -> Dataset:
    """Load the digits and split them reproducibly; ``limit`` keeps a random subset."""
    check_limit(limit)
    require(TRAIN, "demo", NEEDS_DIGITS)
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = digits.images.astype(np.float32) / 16.0  # pixel values are 0..16
    labels = digits.target.astype(np.int64)
    keep = _subset(seed, len(labels), limit)
    images, labels = images[keep], labels[keep]
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=TEST_FRACTION, random_state=seed
    )
    return Dataset(
        *(torch.from_numpy(a) for a in (x_train[:, None], y_train, x_test[:, None], y_test))
    )


def read_cifar10_file(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Read one file of CIFAR-10's binary version: images ``uint8 [N, 3, 32, 32]``, labels.

    Raises :class:`SpikefuseError` naming the file when it is missing, unreadable, empty, not
    a whole number of records (truncated) or holds a label outside 0..9. (The binary version
    is plain bytes; the python version's pickles are never read: unpickling can run code.)
    """
    try:
        raw = np.fromfile(path, dtype=np.uint8)
    except FileNotFoundError:
        raise SpikefuseError(
            f"CIFAR-10 file '{path}' does not exist: --data-dir must be the folder of CIFAR-10's "
            f"binary version (cifar-10-batches-bin), holding {', '.join(CIFAR10_TRAIN_FILES)} "
            f"and {CIFAR10_TEST_FILE}"
        ) from None
    except (OSError, ValueError) as exc:  # ValueError: numpy on a directory
        reason = _os_reason(exc) if isinstance(exc, OSError) else str(exc)
        raise SpikefuseError(f"cannot read CIFAR-10 file '{path}': {reason}") from exc
    if raw.size == 0 or raw.size % CIFAR10_RECORD_BYTES:
        raise SpikefuseError(
            f"CIFAR-10 file '{path}' is truncated or not in CIFAR-10's binary format: its "
            f"{raw.size} bytes are not a whole number >= 1 of {CIFAR10_RECORD_BYTES}-byte "
            f"records (a label byte and 3x32x32 pixel bytes)"
        )
    records = raw.reshape(-1, CIFAR10_RECORD_BYTES)
    labels = records[:, 0].astype(np.int64)
    bad = np.flatnonzero(labels >= NUM_CLASSES)
    if bad.size:
        raise SpikefuseError(
            f"CIFAR-10 file '{path}' is corrupt: record {bad[0]} has label {labels[bad[0]]}, "
            f"not 0..{NUM_CLASSES - 1}"
        )
    images = records[:, 1:].reshape(-1, 3, CIFAR10_SIZE, CIFAR10_SIZE)
    return images, labels


def load_cifar10(data_dir: Path, seed: int, limit: int | None = None) -> Dataset:
    """Load CIFAR-10's training and test batches from ``data_dir``, pixels scaled to [0, 1].

    ``limit`` keeps a seeded random subset of that many training samples (and as many test
    samples, or all when there are fewer).
    """
    check_limit(limit, "cifar10")
    parts = [read_cifar10_file(data_dir / name) for name in CIFAR10_TRAIN_FILES]
    train_images = np.concatenate([images for images, _ in parts])
    train_labels = np.concatenate([labels for _, labels in parts])
    test_images, test_labels = read_cifar10_file(data_dir / CIFAR10_TEST_FILE)
    if limit is not None and limit > len(train_labels):
        raise SpikefuseError(
            f"--limit {limit}: the CIFAR-10 files in '{data_dir}' hold only "
            f"{len(train_labels)} training samples"
        )
    train_keep = _subset(seed, len(train_labels), limit)
    test_keep = _subset(
        seed, len(test_labels), None if limit is None else min(limit, len(test_labels))
    )

    def scaled(images: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(images.astype(np.float32) / 255.0)

    return Dataset(
        scaled(train_images[train_keep]),
        torch.from_numpy(train_labels[train_keep]),
        scaled(test_images[test_keep]),
        torch.from_numpy(test_labels[test_keep]),
    )


def load_data(config: TrainConfig) -> Dataset:
    """The data set ``config`` names, split and limited as it says."""
    if config.data_dir is not None:  # TrainConfig: a --data-dir exactly for --data cifar10
        return load_cifar10(Path(config.data_dir), config.seed, config.limit)
    return load_digits_split(config.seed, config.limit)


def build_model(
    make_neuron: Callable[..., nn.Module], channels: int = 1, size: int = DIGITS_SIZE
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
        layer.Linear(32 * (size // 4) ** 2, NUM_CLASSES, step_mode="m"),
    )


def build_network(config: TrainConfig, data: Dataset) -> tuple[nn.Module, Dataset]:
    """``config.model`` for ``data``'s images, and ``data`` with the channels it needs."""
    spec = MODELS[config.model]
    if spec.channels is not None:
        data = data.with_channels(spec.channels)
    make_neuron = functools.partial(NEURONS[config.neuron], backend=config.backend)
    _, channels, size, _ = data.x_train.shape
    return spec.build(make_neuron, channels, size), data


def forward(
    model: nn.Module, images: torch.Tensor, T: int, amp: str = "none", graphed: bool = False
) -> torch.Tensor:
    """Direct encoding: feed the same image at each of the T steps (a view, ``expand``: the
    first synapse then runs once per image); return ``[N, classes]`` (float32).
    ``amp="bf16"`` runs the model under bf16 autocast (CPU or CUDA); ``graphed``: the call is
    captured into a CUDA graph, where autocast must not cache its weight casts."""
    with torch.autocast(
        images.device.type, torch.bfloat16, enabled=amp == "bf16", cache_enabled=not graphed
    ):
        logits = model(images.unsqueeze(0).expand(T, *images.shape)).mean(0)
    functional.reset_net(model)  # the next batch starts from resting neurons
    return logits.float()


def resolve_device(name: str) -> torch.device:
    """Map ``auto`` to CUDA when PyTorch sees a GPU, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise SpikefuseError("--device cuda: PyTorch sees no CUDA GPU")
    return torch.device(name)


@contextlib.contextmanager
def cpu_threads(device: torch.device, count: int) -> Iterator[None]:
    """Limit torch's intra-op CPU threads while training on the CPU.

    The digits network's ops are too small to gain from threads, and spinning OpenMP threads
    slow down many times over when other processes share the cores. A fixed count also makes
    the results independent of the machine's core count.
    """
    if device.type != "cpu":
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def describe_backend(backend: str, device: torch.device) -> str:
    """Say which neuron backend will run on ``device``; fail early if an explicit one cannot."""
    probe = torch.empty(0, device=device)
    if backend != "auto":
        reason = backends.unavailable_reason(backend, probe)
        if reason is not None:
            raise BackendUnavailableError(f"--backend {backend}: {reason}")
        return backend
    chosen = backends.resolve("auto", probe)
    if chosen == "cuda" or device.type != "cuda":
        return f"auto -> {chosen}"
    # On a GPU the user likely expected cuda, so say why it is not used.
    return f"auto -> torch ({backends.unavailable_reason('cuda', probe)})"


def _leaves(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    """Yield ``(path, leaf)`` for each tensor or scalar in nested dicts, lists and tuples.

    ``path`` spells the way to the leaf (``model['0.weight']``); empty containers are leaves
    too, so the sequence of leaves pins down the whole structure.
    """
    if isinstance(value, dict) and value:
        for key, item in value.items():
            yield from _leaves(item, f"{path}[{key!r}]")
    elif isinstance(value, (list, tuple)) and value:
        for index, item in enumerate(value):
            yield from _leaves(item, f"{path}[{index}]")
    else:
        yield path, value


def payload_digest(payload: dict[str, Any]) -> str:
    """Return the sha256 of a checkpoint payload's contents, its ``"sha256"`` entry excluded.

    The digest covers every entry (paths, tensor dtypes, shapes and bytes, scalars), not the
    file's bytes, so it does not depend on how torch lays out the file or which device the
    tensors came from. Raises ``ValueError`` for a leaf that no checkpoint holds.
    """
    digest = hashlib.sha256()
    content = {key: value for key, value in payload.items() if key != "sha256"}
    for path, leaf in _leaves(content, ""):
        if isinstance(leaf, torch.Tensor):
            flat = leaf.detach().cpu().contiguous().reshape(-1)
            header = f"tensor:{leaf.dtype}:{tuple(leaf.shape)}:".encode()
            data = header + flat.view(torch.uint8).numpy().tobytes()
        elif isinstance(leaf, (bool, int, float, str, type(None))):
            data = f"{type(leaf).__name__}:{leaf!r}".encode()
        elif isinstance(leaf, (dict, list, tuple)):  # empty: a dict and a sequence differ
            data = b"{}" if isinstance(leaf, dict) else b"[]"
        else:
            raise ValueError(f"{path} is a {type(leaf).__name__}")
        for part in (path.encode(), data):  # length-prefixed: no two sequences encode alike
            digest.update(len(part).to_bytes(8, "little"))
            digest.update(part)
    return digest.hexdigest()


def first_non_finite(value: Any, path: str) -> str | None:
    """Return the path of the first NaN or infinite float or tensor in ``value``, else None."""
    for leaf_path, leaf in _leaves(value, path):
        if isinstance(leaf, torch.Tensor):
            if leaf.is_floating_point() or leaf.is_complex():
                if not bool(torch.isfinite(leaf).all()):
                    return leaf_path
        elif isinstance(leaf, float) and not math.isfinite(leaf):
            return leaf_path
    return None


def _non_finite_state(payload: dict[str, Any]) -> str | None:
    """Where the first NaN or infinity of a payload's weights or optimizer state is, if any."""
    return first_non_finite(payload["model"], "model") or first_non_finite(
        payload["optimizer"], "optimizer"
    )


def _os_reason(exc: OSError) -> str:
    return exc.strerror or str(exc) or type(exc).__name__


def _temp_path(target: Path, pid: int) -> Path:
    """The temporary file process ``pid`` writes ``target`` through (same directory: the
    final rename is atomic)."""
    return target.with_name(f".{target.name}.{pid}.tmp")


def checkpoint_target(path: Path) -> Path:
    """Return the file that writing checkpoint ``path`` replaces: symlinks are followed, so
    a linked checkpoint is updated where the link points instead of being replaced."""
    try:
        return path.resolve()
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop before Python 3.13
        raise SpikefuseError(f"checkpoint path '{path}' cannot be resolved: {exc}") from exc


def save_checkpoint(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` plus its ``"sha256"`` digest atomically to ``path`` (or its target).

    The payload is first serialized in memory, then written to a temporary file that is
    fsynced and renamed over the checkpoint: an interrupted or failed save never leaves a
    truncated file and keeps the previous checkpoint. Refuses (:class:`SpikefuseError`) a
    payload holding NaN or infinity; a failed write is a :class:`SpikefuseError` naming the
    OS reason.
    """
    bad = _non_finite_state(payload)
    if bad is not None:
        raise SpikefuseError(
            f"not writing checkpoint '{path}' after epoch {payload['epoch']}: {bad} holds NaN "
            f"or inf, the training diverged (a smaller --lr may help); '{path}' is left "
            f"as it was"
        )
    buffer = io.BytesIO()
    torch.save({**payload, "sha256": payload_digest(payload)}, buffer)
    replace_file(path, buffer.getbuffer(), "checkpoint")


def replace_file(path: Path, data: bytes | memoryview, what: str) -> None:
    """Write ``data`` to ``path`` (or its symlink's target) atomically: through a fsynced
    temporary file renamed over it. A failure is a :class:`SpikefuseError` naming ``what``
    and the OS reason, and leaves ``path`` as it was."""
    target = checkpoint_target(path)
    tmp = _temp_path(target, os.getpid())
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise SpikefuseError(
                f"cannot write {what} '{path}': {_os_reason(exc)} ('{path}' is left as it was)"
            ) from exc
        raise


def _first_sentence(exc: Exception) -> str:
    # torch's messages run to paragraphs of advice; the first sentence names the problem.
    lines = str(exc).strip().split(". ")[0].splitlines()
    return lines[0] if lines else type(exc).__name__


def is_checkpoint(path: Path) -> bool:
    """Whether ``path`` holds a spikefuse training checkpoint of any version, intact or not
    (only such a file may be overwritten)."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except OSError as exc:
        raise SpikefuseError(f"cannot read '{path}': {_os_reason(exc)}") from exc
    except Exception:
        return False
    return isinstance(payload, dict) and payload.get("format") == CHECKPOINT_FORMAT


def load_checkpoint(path: Path, config: TrainConfig) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` and validate every entry.

    Raises :class:`CheckpointError` for a missing, empty, unreadable, foreign, other-version,
    incomplete or damaged (checksum) file, for NaN or infinite weights or optimizer state,
    for an epoch outside ``1..config.epochs`` and for a model configuration other than
    ``config``'s.
    """
    if not path.exists():
        raise CheckpointError(f"checkpoint '{path}' does not exist (drop --resume to start over)")
    if not path.is_file():
        raise CheckpointError(f"checkpoint '{path}' is not a regular file")
    if path.stat().st_size == 0:
        raise CheckpointError(
            f"checkpoint '{path}' is empty (0 bytes): it is not a spikefuse checkpoint"
        )
    try:
        # weights_only: a checkpoint is data, never code to run.
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except OSError as exc:
        raise CheckpointError(f"checkpoint '{path}' cannot be read: {_os_reason(exc)}") from exc
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint '{path}' cannot be read: the file is corrupted or is not a "
            f"spikefuse checkpoint ({_first_sentence(exc)})"
        ) from exc
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"'{path}' is not a spikefuse training checkpoint (no '{CHECKPOINT_FORMAT}' tag)"
        )
    if payload.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError(
            f"checkpoint '{path}' has format version {payload.get('version')!r}; this "
            f"spikefuse reads version {CHECKPOINT_VERSION} (start over with --overwrite, or "
            f"resume with the spikefuse that wrote it)"
        )
    missing = sorted(CHECKPOINT_KEYS - payload.keys())
    if missing:
        raise CheckpointError(f"checkpoint '{path}' is incomplete: no {', '.join(missing)}")
    unexpected = sorted(map(repr, payload.keys() - CHECKPOINT_KEYS))
    if unexpected:
        raise CheckpointError(f"checkpoint '{path}' has unknown entries {', '.join(unexpected)}")

    def damaged(what: str) -> CheckpointError:
        return CheckpointError(f"checkpoint '{path}' is damaged: {what}")

    try:
        digest = payload_digest(payload)
    except (ValueError, RuntimeError, TypeError) as exc:
        raise damaged(f"it holds an unexpected value ({exc})") from exc
    if payload["sha256"] != digest:
        raise damaged("its contents do not match their sha256 checksum")
    # The checksum catches accidents; the checks below also reject a crafted file.
    epoch = payload["epoch"]
    if type(epoch) is not int or epoch < 1:
        raise damaged(f"its epoch is {epoch!r}, not a whole number >= 1")
    if epoch > config.epochs:
        raise CheckpointError(
            f"checkpoint '{path}' is at epoch {epoch}, past --epochs {config.epochs} "
            f"(pass --epochs {epoch} or more)"
        )
    accuracy = payload["test_accuracy"]
    if type(accuracy) is not float or not 0.0 <= accuracy <= 1.0:
        raise damaged(f"its test accuracy is {accuracy!r}, not a number in [0, 1]")
    if not isinstance(payload["model"], dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in payload["model"].items()
    ):
        raise damaged("its model is not a state dict of named tensors")
    if not isinstance(payload["optimizer"], dict):
        raise damaged("its optimizer state is not a dict")
    bad = _non_finite_state(payload)
    if bad is not None:
        raise CheckpointError(
            f"checkpoint '{path}' holds NaN or inf (first in {bad}): its run diverged and "
            f"cannot be resumed"
        )
    saved = payload["config"]
    model_config = config.model_config()
    if not isinstance(saved, dict) or saved.keys() != model_config.keys():
        raise damaged(f"its config is {saved!r}, with other keys than {sorted(model_config)}")
    differences = [
        f"{key}={saved[key]!r} in the checkpoint but {value!r} now"
        for key, value in model_config.items()
        if saved[key] != value
    ]
    if differences:
        raise CheckpointError(
            f"checkpoint '{path}' was made with a different configuration: "
            f"{'; '.join(differences)} (pass matching options to continue it, or --overwrite "
            "instead of --resume to start a new run in its place)"
        )
    return payload


def restore(
    model: nn.Module, optimizer: torch.optim.Optimizer, payload: dict[str, Any], path: Path
) -> None:
    """Load a validated checkpoint payload into ``model`` and ``optimizer``."""
    try:
        model.load_state_dict(payload["model"])
        optimizer.load_state_dict(payload["optimizer"])
        match_optimizer_state(optimizer)  # fused conv weights are channels-last on CUDA
    except (RuntimeError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint '{path}' does not fit the model: {exc}") from exc
    # load_state_dict checks neither the optimizer's settings nor its buffers' shapes; a
    # mismatch would change the training silently or fail only in the first step.
    for group in optimizer.param_groups:
        for key, default in optimizer.defaults.items():
            # lr: set every epoch; capturable: how this run steps (see set_capturable)
            if key not in ("lr", "capturable") and group.get(key, default) != default:
                raise CheckpointError(
                    f"checkpoint '{path}' does not fit the model: optimizer setting "
                    f"{key}={group[key]!r}, expected {default!r}"
                )
        for param in group["params"]:
            for name, buffer in optimizer.state.get(param, {}).items():
                if (
                    isinstance(buffer, torch.Tensor)
                    and buffer.dim()
                    and buffer.shape != param.shape
                ):
                    raise CheckpointError(
                        f"checkpoint '{path}' does not fit the model: optimizer {name} of "
                        f"shape {tuple(buffer.shape)} for a parameter of shape "
                        f"{tuple(param.shape)}"
                    )


def set_capturable(optimizer: torch.optim.Optimizer, capturable: bool) -> None:
    """Make a loaded optimizer step as this run does: capturable keeps Adam's step count on
    the parameters' device (CUDA graphs), otherwise on the CPU."""
    for group in optimizer.param_groups:
        group["capturable"] = capturable
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            if isinstance(state.get("step"), torch.Tensor):
                device = param.device if capturable else torch.device("cpu")
                state["step"] = state["step"].to(device, torch.float32)


@contextlib.contextmanager
def checkpoint_lock(path: Path, target: Path) -> Iterator[None]:
    """Hold an exclusive lock on checkpoint ``target`` (``path`` as the user named it).

    The lock is ``flock`` on the sibling file ``.<name>.lock``, which the kernel releases
    when the process dies, so a killed run never leaves a stale lock. Raises
    :class:`SpikefuseError` when another run holds it.
    """
    lock_path = target.with_name(f".{target.name}.lock")
    while True:
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise SpikefuseError(
                f"cannot write checkpoint '{path}': creating '{lock_path}' failed: "
                f"{_os_reason(exc)}"
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.read(fd, 32).decode(errors="replace").strip()
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise SpikefuseError(
                    f"cannot lock checkpoint '{path}' ('{lock_path}'): {_os_reason(exc)}"
                ) from exc
            raise SpikefuseError(
                f"checkpoint '{path}' is in use by another training run"
                + (f" (pid {holder})" if holder.isdigit() else "")
                + "; wait for it to finish or choose another --checkpoint"
            ) from None
        # The holder we waited on removes the lock file on exit; if that happened between
        # our open and flock, we hold a lock on a deleted file: try again.
        try:
            current = os.stat(lock_path)
        except FileNotFoundError:
            current = None
        if current is not None and os.path.samestat(current, os.fstat(fd)):
            break
        os.close(fd)
    try:
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())  # named in the refusal of other runs
        except OSError as exc:
            raise SpikefuseError(
                f"cannot write checkpoint '{path}': writing '{lock_path}' failed: {_os_reason(exc)}"
            ) from exc
        yield
    finally:
        lock_path.unlink(missing_ok=True)  # still locked: no other run can be using it
        os.close(fd)


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_temp_files(target: Path) -> None:
    """Remove the temporary files of saves of ``target`` by processes no longer alive.

    Only called under the checkpoint's lock, where no other run is writing ``target``; the
    pid check still spares the files of a live run that took no lock.
    """
    pattern = re.compile(rf"\.{re.escape(target.name)}\.(\d+)\.tmp")
    try:
        for entry in target.parent.iterdir():
            match = pattern.fullmatch(entry.name)
            # A file named with our own pid is a leftover of an earlier process with our pid.
            if match and (int(match[1]) == os.getpid() or not _is_alive(int(match[1]))):
                entry.unlink(missing_ok=True)
    except OSError as exc:
        raise SpikefuseError(
            f"cannot clean up old temporary files of checkpoint '{target}': {_os_reason(exc)}"
        ) from exc


def prepare_checkpoint_dir(path: Path, target: Path, config: TrainConfig) -> None:
    """Check what can be checked of checkpoint ``path`` (resolved: ``target``) before taking
    its lock, and create its directory."""
    try:
        _prepare_checkpoint_dir(path, target, config)
    except OSError as exc:  # e.g. a parent directory that may not be searched
        raise SpikefuseError(f"cannot use checkpoint '{path}': {_os_reason(exc)}") from exc


def _prepare_checkpoint_dir(path: Path, target: Path, config: TrainConfig) -> None:
    if target.is_dir():
        raise SpikefuseError(f"checkpoint '{path}' is a directory; pass a file path")
    if target.exists() and not target.is_file():
        raise SpikefuseError(f"checkpoint '{path}' is not a regular file")
    if config.resume and not target.exists():
        raise CheckpointError(f"checkpoint '{path}' does not exist (drop --resume to start over)")
    existing = next(p for p in target.parents if p.exists())  # the root always exists
    if not existing.is_dir():
        raise SpikefuseError(f"checkpoint '{path}': '{existing}' is a file, not a directory")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SpikefuseError(
            f"cannot create the directory of checkpoint '{path}': {_os_reason(exc)}"
        ) from exc


def check_checkpoint_writable(path: Path, target: Path, config: TrainConfig) -> None:
    """Under the lock: refuse to replace what must not be replaced, and make sure the
    checkpoint can be written, before any training time is spent."""
    if target.exists() and not config.resume:
        if not is_checkpoint(target):
            raise SpikefuseError(
                f"'{path}' exists and is not a spikefuse checkpoint; refusing to overwrite "
                f"it (choose another --checkpoint)"
            )
        if not config.overwrite:
            raise SpikefuseError(
                f"checkpoint '{path}' already exists; pass --resume to continue its run or "
                f"--overwrite to start a new one in its place"
            )
    probe = _temp_path(target, os.getpid())
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
        probe.unlink()
    except OSError as exc:
        raise SpikefuseError(f"cannot write checkpoint '{path}': {_os_reason(exc)}") from exc


LOG_HEADER = "epoch,train_loss,test_accuracy,seconds"
PLOT_MARKER = b"spikefuse training plot"  # in the PNG's Software text chunk: marks it as ours
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def log_paths(target: Path) -> tuple[Path, Path]:
    """The per-epoch CSV log and the loss/accuracy plot (PNG) beside checkpoint ``target``:
    its whole name with ``.csv`` / ``.png`` added (``digits.pt.csv``), so that checkpoints
    sharing a stem (``a.pt``, ``a.ckpt``) never share a log."""
    return target.with_name(f"{target.name}.csv"), target.with_name(f"{target.name}.png")


def _is_our_log(path: Path) -> bool:
    """Whether ``path`` holds a training log or plot that spikefuse wrote (only such a file
    may be replaced)."""
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError as exc:
        raise SpikefuseError(f"cannot read '{path}': {_os_reason(exc)}") from exc
    if path.suffix == ".png":
        return head.startswith(PNG_SIGNATURE) and PLOT_MARKER in head
    return head.split(b"\n", 1)[0].decode(errors="replace").strip() == LOG_HEADER


def check_logs_writable(target: Path, config: TrainConfig) -> None:
    """Under the lock, with the checkpoint checked: the log and plot beside checkpoint
    ``target`` follow its rules. Another kind of file is never replaced; an existing log
    needs ``--resume`` (continued) or ``--overwrite`` (replaced)."""
    for path in log_paths(target):
        resolved = checkpoint_target(path)
        if resolved == target:
            raise SpikefuseError(  # a symbolic link where the log goes, to the checkpoint
                f"checkpoint '{config.checkpoint}' would be overwritten by its own training "
                f"log or plot ('{path}' leads to it); remove that link"
            )
        if not resolved.exists():
            continue
        if not resolved.is_file() or not _is_our_log(resolved):
            raise SpikefuseError(
                f"'{path}' exists and is not a spikefuse training log or plot; refusing to "
                f"overwrite it (move it away or choose another --checkpoint)"
            )
        if not (config.resume or config.overwrite):
            # --resume needs the run's checkpoint too: without it only --overwrite can start
            resume = "pass --resume to continue its run or " if target.exists() else ""
            raise SpikefuseError(
                f"training log '{path}' already exists; {resume}pass --overwrite to start a new "
                "run in its place"
            )


@dataclass
class TrainingLog:
    """The per-epoch log beside a checkpoint ``<name>``: ``<name>.csv`` (epoch, train loss, test
    accuracy, seconds) and ``<name>.png`` (loss and accuracy over the epochs), both rewritten
    atomically after every epoch. A resumed run keeps the rows up to the checkpoint's epoch and
    appends."""

    checkpoint: Path
    resumed_epoch: int
    rows: list[tuple[int, float, float, float]] = field(default_factory=list)

    @property
    def csv_path(self) -> Path:
        return log_paths(self.checkpoint)[0]

    @property
    def png_path(self) -> Path:
        return log_paths(self.checkpoint)[1]

    def load(self) -> None:
        """Read the rows of a resumed run, up to its checkpoint's epoch (later ones belong to
        epochs whose checkpoint was not kept); none when the run starts over or has no log."""
        if not self.resumed_epoch or not self.csv_path.exists():
            return
        try:
            lines = self.csv_path.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise SpikefuseError(f"cannot read training log '{self.csv_path}': {exc}") from exc
        for number, line in enumerate(lines[1:], start=2):
            try:
                epoch, loss, accuracy, seconds = line.split(",")
                row = (int(epoch), float(loss), float(accuracy), float(seconds))
            except ValueError:
                raise SpikefuseError(
                    f"training log '{self.csv_path}' is damaged: line {number} is {line!r}, not "
                    f"{LOG_HEADER}; move it away to resume"
                ) from None
            if row[0] <= self.resumed_epoch:
                self.rows.append(row)

    def append(self, epoch: int, loss: float, accuracy: float, seconds: float) -> None:
        """Add an epoch's row and rewrite the CSV and the plot."""
        self.rows.append((epoch, loss, accuracy, seconds))
        text = "".join(f"{e},{lo:.6g},{a:.6g},{s:.3f}\n" for e, lo, a, s in self.rows)
        replace_file(self.csv_path, f"{LOG_HEADER}\n{text}".encode(), "training log")
        replace_file(self.png_path, self._plot(), "training plot")

    def _plot(self) -> bytes:
        require(TRAIN, "demo", NEEDS_PLOT)
        # Figure, not pyplot: no global figure state and no GUI backend (PNG renders with Agg).
        from matplotlib.figure import Figure

        epochs = [row[0] for row in self.rows]
        figure = Figure(figsize=(8, 3.2))
        loss_axes, accuracy_axes = figure.subplots(1, 2)
        loss_axes.plot(epochs, [row[1] for row in self.rows], marker="o")
        loss_axes.set(xlabel="epoch", ylabel="train loss", title=self.checkpoint.name)
        accuracy_axes.plot(epochs, [row[2] for row in self.rows], marker="o", color="C1")
        accuracy_axes.set(xlabel="epoch", ylabel="test accuracy", ylim=(0, 1))
        for axes in (loss_axes, accuracy_axes):
            axes.grid(alpha=0.3)
            axes.xaxis.get_major_locator().set_params(integer=True)
        figure.tight_layout()
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", metadata={"Software": PLOT_MARKER.decode()})
        return buffer.getvalue()


@torch.no_grad()
def evaluate(
    model: nn.Module, images: torch.Tensor, labels: torch.Tensor, T: int, amp: str = "none"
) -> float:
    """Return the classification accuracy on ``images``."""
    model.eval()
    correct = 0
    for start in range(0, len(labels), EVAL_BATCH_SIZE):
        logits = forward(model, images[start : start + EVAL_BATCH_SIZE], T, amp)
        correct += int((logits.argmax(1) == labels[start : start + EVAL_BATCH_SIZE]).sum())
    return correct / len(labels)


TrainStep = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (images, labels) -> loss


@dataclass(frozen=True)
class Ranks:
    """This process's place in a ``torchrun`` job (rank 0 of 1 without one)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def main(self) -> bool:
        """Whether this process writes the checkpoint and log and prints (rank 0)."""
        return self.rank == 0


def ranks_from_env(environ: dict[str, str] | None = None) -> Ranks:
    """Read ``WORLD_SIZE``, ``RANK`` and ``LOCAL_RANK`` as ``torchrun`` sets them.

    Without ``WORLD_SIZE`` (or with 1) the run is a single process. Raises
    :class:`SpikefuseError` for values that are no whole numbers or out of range.
    """
    env = os.environ if environ is None else environ
    if env.get("WORLD_SIZE", "1") == "1":
        return Ranks()
    values = {}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        text = env.get(name)
        if text is None or not text.isdigit():
            raise SpikefuseError(
                f"distributed run (WORLD_SIZE={env['WORLD_SIZE']!r}): {name} is {text!r}, not a "
                f"whole number >= 0; start the run with torchrun, which sets it"
            )
        values[name] = int(text)
    ranks = Ranks(values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"])
    if not 0 <= ranks.rank < ranks.world_size:
        raise SpikefuseError(f"RANK={ranks.rank} is outside 0..WORLD_SIZE-1={ranks.world_size - 1}")
    return ranks


def agree(ranks: Ranks, error: SpikefuseError | None) -> None:
    """Raise on every rank when any rank failed (``error``) at this point of the run.

    A rank that failed alone (rank 0's checkpoint and log checks and writes, a rank that
    cannot read the data or checkpoint) would otherwise leave the others waiting forever in
    their next collective. The failed rank raises its ``error``; the others raise one that
    quotes the first failed rank's message.
    """
    if ranks.distributed:
        messages: list[str | None] = [None] * ranks.world_size
        torch.distributed.all_gather_object(messages, None if error is None else str(error))
        failed = [(rank, message) for rank, message in enumerate(messages) if message]
        if error is None and failed:
            raise SpikefuseError(f"rank {failed[0][0]} stopped the run: {failed[0][1]}")
    if error is not None:
        raise error


def epoch_order(config: TrainConfig, epoch: int, count: int, ranks: Ranks) -> torch.Tensor:
    """This rank's training sample indices for ``epoch``, in batch order.

    The permutation is seeded by (seed, epoch), so a resumed run sees the same batches as an
    uninterrupted one. Rank r of W takes every W-th sample from the r-th on, and every rank
    the same number, ``count // W`` (the rest of the permutation is dropped this epoch): all
    ranks run the same batches count and sizes, so their gradient and fused-BatchNorm
    all-reduces pair up.
    """
    order = np.random.default_rng([config.seed, epoch]).permutation(count)
    per_rank = count // ranks.world_size
    return torch.from_numpy(order[ranks.rank :: ranks.world_size][:per_rank])


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, config: TrainConfig, graphed: bool = False
) -> TrainStep:
    """One optimisation step on a batch, returning its loss (on the device). ``graphed``: the
    step is to be captured in a CUDA graph (see :func:`forward`)."""

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = forward(model, x, config.T, config.amp, graphed=graphed)
        loss = F.cross_entropy(logits, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


def train_epoch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: Dataset,
    config: TrainConfig,
    epoch: int,
    graphed: GraphedStep[torch.Tensor] | None = None,
    ranks: Ranks = Ranks(),
) -> float:
    """Run one epoch and return the mean training loss (over all ranks). ``graphed``: this
    ``model``'s and ``optimizer``'s :func:`train_step`, replayed from CUDA graphs; else the
    steps run eagerly. ``model`` may be DistributedDataParallel."""
    model.train()
    # Cosine decay, computed from the epoch alone so a resumed run needs no scheduler state.
    for group in optimizer.param_groups:
        group["lr"] = config.lr * 0.5 * (1.0 + math.cos(math.pi * epoch / config.epochs))
    step: TrainStep
    if graphed is None:
        step = train_step(model, optimizer, config)
    else:
        graphed.invalidate()  # captured with the last epoch's learning rate
        step = graphed
    order = epoch_order(config, epoch, len(data.y_train), ranks).to(data.y_train.device)
    batches = order.split(config.batch_size)
    if config.T == 1 and config.last_bn_maps_are_1x1 and len(batches) > 1 and len(batches[-1]) == 1:
        # a last batch of one sample (batch sizes of 1 are refused): skipped, since the order
        # changes every epoch, each sample is still seen
        batches = batches[:-1]
    progress = None
    if not config.quiet and ranks.main:
        require(TRAIN, "demo", NEEDS_PROGRESS)
        from tqdm import tqdm

        progress = tqdm(
            batches,
            desc=f"epoch {epoch + 1}/{config.epochs}",
            unit="batch",
            leave=False,
            disable=None,  # only on a terminal
        )
    total_loss, seen = 0.0, 0
    for batch, index in enumerate(batches if progress is None else progress):
        x, y = data.x_train[index], data.y_train[index]
        loss = step(x, y)
        if ranks.distributed:  # every rank sees the same loss, so all stop together on NaN
            loss = loss.clone()
            torch.distributed.all_reduce(loss)
            loss /= ranks.world_size
        value = loss.item()
        if not math.isfinite(value):
            raise SpikefuseError(
                f"the training diverged: the loss is {value} in epoch {epoch + 1}, batch "
                f"{batch + 1} (a smaller --lr may help); checkpoint '{config.checkpoint}' "
                f"is left as it was"
            )
        total_loss, seen = total_loss + value * len(index), seen + len(index)
        if progress is not None:
            progress.set_postfix(loss=f"{value:.3f}")
    return total_loss / seen


def optional_needs(config: TrainConfig) -> dict[str, str]:
    """The optional packages (:mod:`spikefuse.extras`) a run of ``config`` imports, and what
    for. Every rank checks the same ones, so that a missing one stops all of them at once."""
    return {
        **NEEDS_PLOT,
        **(NEEDS_DIGITS if config.data == "digits" else {}),
        **(NEEDS_PROGRESS if not config.quiet else {}),
    }


def run(config: TrainConfig) -> float:
    """Train (or resume) as ``config`` says, print progress, and return the test accuracy.

    The checkpoint is locked for the whole run, and checked to be writable (and, unless
    ``config.resume`` or ``config.overwrite``, not to exist) before training starts. Under
    ``torchrun`` (``WORLD_SIZE`` > 1 in the environment) every process runs this: the model is
    wrapped in DistributedDataParallel (gloo on the CPU, NCCL on GPUs, one per local rank),
    and rank 0 alone takes the lock, writes the checkpoint and log, and prints.
    """
    require(TRAIN, "demo", optional_needs(config))
    ranks = ranks_from_env()
    device = resolve_device(config.device)
    if config.cuda_graph and device.type != "cuda":
        raise SpikefuseError("--cuda-graph needs a CUDA GPU, and PyTorch sees none")
    if not ranks.distributed:
        backend = describe_backend(config.backend, device)
        return _run_locked(config, device, backend, ranks)
    if config.cuda_graph:
        raise SpikefuseError(
            "--cuda-graph does not run under torchrun (DistributedDataParallel's all-reduces "
            "are not captured); drop one of them"
        )
    if device.type == "cuda":
        if ranks.local_rank >= torch.cuda.device_count():
            raise SpikefuseError(
                f"LOCAL_RANK={ranks.local_rank}, but PyTorch sees {torch.cuda.device_count()} "
                f"GPU(s): start at most one process per GPU (torchrun --nproc-per-node)"
            )
        device = torch.device("cuda", ranks.local_rank)
        torch.cuda.set_device(device)
    backend = describe_backend(config.backend, device)
    torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        return _run_locked(config, device, backend, ranks)
    finally:
        # DistributedDataParallel holds reference cycles: collect it, and its reducer, while the
        # process group still exists (a reducer that outlives it can abort the process at exit).
        gc.collect()
        torch.distributed.destroy_process_group()


def _run_locked(config: TrainConfig, device: torch.device, backend: str, ranks: Ranks) -> float:
    checkpoint = Path(config.checkpoint)
    with contextlib.ExitStack() as stack:
        error = None
        if ranks.main:
            try:
                target = checkpoint_target(checkpoint)
                prepare_checkpoint_dir(checkpoint, target, config)
                stack.enter_context(checkpoint_lock(checkpoint, target))
                for path in (target, *log_paths(target)):
                    remove_stale_temp_files(path)
                check_checkpoint_writable(checkpoint, target, config)
                check_logs_writable(target, config)
            except SpikefuseError as exc:
                error = exc
        agree(ranks, error)
        return _train(config, device, backend, checkpoint, ranks)


def _train(
    config: TrainConfig, device: torch.device, backend: str, checkpoint: Path, ranks: Ranks
) -> float:
    say = functools.partial(print, flush=True) if ranks.main else lambda *args, **kw: None
    error = None
    try:
        model, optimizer, data, log = _set_up(config, device, backend, checkpoint, ranks, say)
    except SpikefuseError as exc:
        error = exc
    agree(ranks, error)
    start_epoch = log.resumed_epoch

    trained = model
    if ranks.distributed:
        device_ids = [device.index] if device.type == "cuda" else None
        trained = nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    graphed = None
    if config.cuda_graph:  # a batch shape's first step runs eagerly, the next is captured
        graphed = GraphedStep(train_step(trained, optimizer, config, graphed=True), warmup=1)
    with cpu_threads(device, 1):
        accuracy = None
        for epoch in range(start_epoch, config.epochs):
            began = time.perf_counter()
            loss = train_epoch(trained, optimizer, data, config, epoch, graphed, ranks)
            accuracy = evaluate(model, data.x_test, data.y_test, config.T, config.amp)
            seconds = time.perf_counter() - began
            error = None
            if ranks.main:
                try:
                    save_checkpoint(
                        checkpoint,
                        {
                            "format": CHECKPOINT_FORMAT,
                            "version": CHECKPOINT_VERSION,
                            "epoch": epoch + 1,
                            "config": config.model_config(),
                            "test_accuracy": accuracy,
                            "model": model.state_dict(),
                            "optimizer": optimizer.state_dict(),
                        },
                    )
                    log.append(epoch + 1, loss, accuracy, seconds)
                except SpikefuseError as exc:
                    error = exc
            agree(ranks, error)
            say(
                f"epoch {epoch + 1}/{config.epochs}: train loss {loss:.4f}, "
                f"test accuracy {accuracy:.4f} ({seconds:.1f}s)"
            )
        if accuracy is None:  # resumed a run that had already finished
            accuracy = evaluate(model, data.x_test, data.y_test, config.T, config.amp)
    say(f"checkpoint: {checkpoint}")
    say(f"final test accuracy: {accuracy:.4f}")
    return accuracy


def _set_up(
    config: TrainConfig,
    device: torch.device,
    backend: str,
    checkpoint: Path,
    ranks: Ranks,
    say: Callable[..., None],
) -> tuple[nn.Module, torch.optim.Optimizer, Dataset, TrainingLog]:
    """Load the data, build (and fuse) the model, resume it and the log if asked."""
    torch.manual_seed(config.seed)
    data = load_data(config)
    model, data = build_network(config, data)
    data, model = data.to(device), model.to(device)
    report = None
    if config.fuse:
        # Under torchrun the fused BatchNorms synchronise over the default process group.
        model, report = fuse(model, return_report=True, memory=config.memory)
    # capturable: Adam's step count stays on the GPU, so a graph can replay optimizer.step
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr, capturable=config.cuda_graph)
    say(
        f"device: {device}, backend: {backend}, neuron: {config.neuron}, T={config.T}, "
        f"train/test samples: {len(data.y_train)}/{len(data.y_test)}"
        + (f", model: {config.model}" if config.model != "digits-cnn" else "")
        + (f", processes: {ranks.world_size}" if ranks.distributed else "")
    )
    if report is not None:
        say(str(report).splitlines()[0])
    start_epoch = 0
    if config.resume:  # every rank reads the checkpoint: all start from the same state
        payload = load_checkpoint(checkpoint, config)
        restore(model, optimizer, payload, checkpoint)
        set_capturable(optimizer, config.cuda_graph)  # the checkpoint's run may have differed
        start_epoch = payload["epoch"]
        say(f"resumed from '{checkpoint}' after epoch {start_epoch}")
    log = TrainingLog(checkpoint_target(checkpoint), start_epoch)
    if ranks.main:
        log.load()
    return model, optimizer, data, log


def build_parser() -> argparse.ArgumentParser:
    """Return the parser for ``spikefuse train``; its defaults are :class:`TrainConfig`'s.

    Values are range-checked by :class:`TrainConfig` (see :func:`main`).
    """
    d = TrainConfig()
    p = argparse.ArgumentParser(
        prog="spikefuse train",
        description="Train a spiking network: by default a small CNN on scikit-learn's 8x8 "
        "digits; under torchrun with DistributedDataParallel. Writes a checkpoint, and beside it "
        "a per-epoch CSV log and a loss/accuracy plot (PNG) of the same name.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--epochs", type=int, default=d.epochs, help="total epochs")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="training batch")
    p.add_argument("--T", type=int, default=d.T, help="time steps per sample")
    p.add_argument("--lr", type=float, default=d.lr, help="Adam learning rate, cosine-decayed")
    p.add_argument(
        "--model",
        choices=list(MODELS),
        default=d.model,
        help="network: the digits CNN or a spikefuse.models network (10 classes)",
    )
    p.add_argument("--neuron", choices=sorted(NEURONS), default=d.neuron, help="neuron model")
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default=d.backend,
        help="neuron backend; auto lets each neuron pick the fastest available",
    )
    p.add_argument("--device", choices=DEVICES, default=d.device, help="auto: cuda if available")
    p.add_argument(
        "--data",
        choices=list(DATA_SETS),
        default=d.data,
        help="digits: scikit-learn's, built in; cifar10: read from --data-dir",
    )
    p.add_argument(
        "--data-dir",
        default=d.data_dir,
        metavar="PATH",
        help="CIFAR-10's binary version (cifar-10-batches-bin: data_batch_1..5.bin, "
        "test_batch.bin)",
    )
    p.add_argument(
        "--fuse",
        action="store_true",
        help="train with fused Conv/Linear -> BatchNorm -> neuron blocks (spikefuse.fuse)",
    )
    p.add_argument(
        "--memory",
        choices=MEMORY_MODES,
        default=d.memory,
        help="with --fuse: 'min' keeps only each block's (1-bit packed) input and recomputes "
        "its Conv/Linear in backward; 'auto' does so in the blocks where it pays",
    )
    p.add_argument(
        "--amp",
        choices=AMP_MODES,
        default=d.amp,
        help="bf16: run the forward under bf16 autocast (CPU or CUDA)",
    )
    p.add_argument(
        "--seed", type=int, default=d.seed, help=f"0..{MAX_SEED}; seeds the split, init, batches"
    )
    p.add_argument(
        "--checkpoint",
        default=d.checkpoint,
        metavar="PATH",
        help="written after every epoch; locked while the run lasts",
    )
    existing = p.add_mutually_exclusive_group()
    existing.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    existing.add_argument(
        "--overwrite",
        action="store_true",
        help="start over, replacing an existing --checkpoint (never a file of another kind)",
    )
    p.add_argument(
        "--limit",
        type=int,
        default=d.limit,
        metavar="N",
        help=f"use only N samples (smoke tests): digits {MIN_SAMPLES}..{DIGITS_SAMPLES}; "
        "cifar10 N training and up to N test samples",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--cuda-graph",
        action="store_true",
        help="replay each training step from a CUDA graph (no per-kernel host work; GPU only)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``spikefuse train`` entry point; returns the exit status.

    An invalid option value exits with status 2 and a usage message, before anything runs.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = TrainConfig(**vars(args))
    except SpikefuseError as exc:
        parser.error(str(exc))
    run(config)
    return 0
