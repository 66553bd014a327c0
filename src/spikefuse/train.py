"""Train a small spiking CNN on scikit-learn's digits (8x8 images, 1797 samples, no download).

This is both the quick-start example and an end-to-end check of spikefuse's neurons, surrogate
gradients and backends: plain SpikingJelly-style code in the multi-step layout ``[T, N, *]``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from tqdm import tqdm

from spikefuse import functional, layer, neuron
from spikefuse.cuda import unavailable_reason
from spikefuse.errors import BackendUnavailableError, SpikefuseError

CHECKPOINT_FORMAT = "spikefuse.train.digits"
CHECKPOINT_VERSION = 1
ARCHITECTURE = "digits-cnn-v1"
NUM_CLASSES = 10
TEST_FRACTION = 0.25
EVAL_BATCH_SIZE = 512

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


@dataclass(frozen=True)
class TrainConfig:
    """Everything that defines a training run (the CLI options)."""

    epochs: int = 8
    batch_size: int = 32
    T: int = 4
    lr: float = 1e-2
    neuron: str = "lif"
    backend: str = "auto"
    device: str = "auto"
    seed: int = 0
    checkpoint: str = "checkpoints/digits.pt"
    resume: bool = False
    limit: int | None = None
    quiet: bool = False

    def model_config(self) -> dict[str, Any]:
        """Settings a resumed run must share with its checkpoint.

        They fix the network (architecture, neuron, time steps) and the data split (seed,
        limit); the others (epochs, learning rate, batch size, device, ...) may change.
        """
        return {
            "architecture": ARCHITECTURE,
            "neuron": self.neuron,
            "T": self.T,
            "seed": self.seed,
            "limit": self.limit,
        }


@dataclass(frozen=True)
class Digits:
    """The fixed train/test split, images scaled to [0, 1] with shape ``[N, 1, 8, 8]``."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    def to(self, device: torch.device) -> Digits:
        """Return the split on ``device`` (the whole data set fits on any device)."""
        return Digits(*(getattr(self, f.name).to(device) for f in fields(self)))


def load_data(seed: int, limit: int | None = None) -> Digits:
    """Load the digits and split them reproducibly; ``limit`` keeps a random subset."""
    digits = load_digits()
    images = digits.images.astype(np.float32) / 16.0  # pixel values are 0..16
    labels = digits.target.astype(np.int64)
    if limit is not None:
        if not 10 <= limit <= len(labels):
            raise SpikefuseError(f"--limit must be between 10 and {len(labels)}, got {limit}")
        keep = np.random.default_rng(seed).permutation(len(labels))[:limit]
        images, labels = images[keep], labels[keep]
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=TEST_FRACTION, random_state=seed
    )
    return Digits(
        *(torch.from_numpy(a) for a in (x_train[:, None], y_train, x_test[:, None], y_test))
    )


def build_model(neuron_kind: str, backend: str) -> nn.Sequential:
    """Conv-BN-spike-pool, twice, then a linear readout, all in multi-step mode.

    The readout has no neuron: the logits are its output averaged over time, i.e. a linear
    function of the spike counts, which trains well with cross-entropy.
    """
    make_neuron = functools.partial(NEURONS[neuron_kind], step_mode="m", backend=backend)
    return nn.Sequential(
        layer.Conv2d(1, 16, kernel_size=3, padding=1, bias=False, step_mode="m"),
        layer.BatchNorm2d(16, step_mode="m"),
        make_neuron(),
        layer.MaxPool2d(2, step_mode="m"),  # 8x8 -> 4x4
        layer.Conv2d(16, 32, kernel_size=3, padding=1, bias=False, step_mode="m"),
        layer.BatchNorm2d(32, step_mode="m"),
        make_neuron(),
        layer.MaxPool2d(2, step_mode="m"),  # 4x4 -> 2x2
        layer.Flatten(step_mode="m"),
        layer.Linear(32 * 2 * 2, NUM_CLASSES, step_mode="m"),
    )


def forward(model: nn.Module, images: torch.Tensor, T: int) -> torch.Tensor:
    """Direct encoding: feed the same image at each of the T steps; return ``[N, classes]``."""
    logits = model(images.unsqueeze(0).repeat(T, 1, 1, 1, 1)).mean(0)
    functional.reset_net(model)  # the next batch starts from resting neurons
    return logits


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
    """Say which neuron backend will run on ``device``; fail early if ``cuda`` cannot."""
    reason = unavailable_reason(torch.empty(0, device=device))
    if backend == "cuda" and reason is not None:
        raise BackendUnavailableError(f"--backend cuda: {reason}")
    if backend != "auto":
        return backend
    if reason is None:
        return "auto -> cuda"
    # On a GPU the user likely expected cuda, so say why it is not used.
    return "auto -> torch" + (f" ({reason})" if device.type == "cuda" else "")


def save_checkpoint(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` atomically: an interrupted save never leaves a truncated file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # same directory: replace is atomic
    try:
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load_checkpoint(path: Path, model_config: dict[str, Any]) -> dict[str, Any]:
    """Load and validate a checkpoint written by :func:`save_checkpoint` for this model."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint '{path}' does not exist (drop --resume to start over)")
    try:
        # weights_only: a checkpoint is data, never code to run.
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        # torch's messages run to paragraphs of advice; the first sentence names the problem.
        reason = str(exc).strip().split(". ")[0].splitlines()[0] or type(exc).__name__
        raise CheckpointError(
            f"checkpoint '{path}' cannot be read: the file is corrupted or is not a "
            f"spikefuse checkpoint ({reason})"
        ) from exc
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"'{path}' is not a spikefuse training checkpoint (no '{CHECKPOINT_FORMAT}' tag)"
        )
    if payload.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError(
            f"checkpoint '{path}' has format version {payload.get('version')!r}; "
            f"this spikefuse reads version {CHECKPOINT_VERSION}"
        )
    missing = sorted({"epoch", "config", "model", "optimizer"} - payload.keys())
    if missing:
        raise CheckpointError(f"checkpoint '{path}' is incomplete: no {', '.join(missing)}")
    saved = payload["config"]
    if not isinstance(saved, dict):
        raise CheckpointError(f"checkpoint '{path}' is damaged: its config is not a dict")
    differences = [
        f"{key}={saved.get(key)!r} in the checkpoint but {value!r} now"
        for key, value in model_config.items()
        if saved.get(key) != value
    ]
    if differences:
        raise CheckpointError(
            f"checkpoint '{path}' was made with a different configuration: "
            f"{'; '.join(differences)} (pass matching options, or drop --resume to start over)"
        )
    return payload


@torch.no_grad()
def evaluate(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, T: int) -> float:
    """Return the classification accuracy on ``images``."""
    model.eval()
    correct = 0
    for start in range(0, len(labels), EVAL_BATCH_SIZE):
        logits = forward(model, images[start : start + EVAL_BATCH_SIZE], T)
        correct += int((logits.argmax(1) == labels[start : start + EVAL_BATCH_SIZE]).sum())
    return correct / len(labels)


def train_epoch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: Digits,
    config: TrainConfig,
    epoch: int,
) -> float:
    """Run one epoch and return the mean training loss."""
    model.train()
    # Cosine decay, computed from the epoch alone so a resumed run needs no scheduler state.
    for group in optimizer.param_groups:
        group["lr"] = config.lr * 0.5 * (1.0 + math.cos(math.pi * epoch / config.epochs))
    # Seeded per epoch, so a resumed run sees the same batches as an uninterrupted one.
    order = torch.from_numpy(
        np.random.default_rng([config.seed, epoch]).permutation(len(data.y_train))
    ).to(data.y_train.device)
    batches = tqdm(
        order.split(config.batch_size),
        desc=f"epoch {epoch + 1}/{config.epochs}",
        unit="batch",
        leave=False,
        disable=True if config.quiet else None,  # None: only on a terminal
    )
    total_loss = 0.0
    for index in batches:
        loss = F.cross_entropy(forward(model, data.x_train[index], config.T), data.y_train[index])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        value = loss.item()
        total_loss += value * len(index)
        batches.set_postfix(loss=f"{value:.3f}")
    return total_loss / len(order)


def run(config: TrainConfig) -> float:
    """Train (or resume) as ``config`` says, print progress, and return the test accuracy."""
    if config.neuron not in NEURONS:
        raise SpikefuseError(f"unknown neuron {config.neuron!r}; choose from {sorted(NEURONS)}")
    device = resolve_device(config.device)
    backend = describe_backend(config.backend, device)
    torch.manual_seed(config.seed)
    data = load_data(config.seed, config.limit).to(device)
    model = build_model(config.neuron, config.backend).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    checkpoint = Path(config.checkpoint)
    print(
        f"device: {device}, backend: {backend}, neuron: {config.neuron}, T={config.T}, "
        f"train/test samples: {len(data.y_train)}/{len(data.y_test)}",
        flush=True,
    )

    start_epoch = 0
    if config.resume:
        payload = load_checkpoint(checkpoint, config.model_config())
        try:
            model.load_state_dict(payload["model"])
            optimizer.load_state_dict(payload["optimizer"])
            start_epoch = int(payload["epoch"])
        except (RuntimeError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(
                f"checkpoint '{checkpoint}' does not fit the model: {exc}"
            ) from exc
        print(f"resumed from '{checkpoint}' after epoch {start_epoch}", flush=True)

    with cpu_threads(device, 1):
        accuracy = None
        for epoch in range(start_epoch, config.epochs):
            began = time.perf_counter()
            loss = train_epoch(model, optimizer, data, config, epoch)
            accuracy = evaluate(model, data.x_test, data.y_test, config.T)
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
            print(
                f"epoch {epoch + 1}/{config.epochs}: train loss {loss:.4f}, "
                f"test accuracy {accuracy:.4f} ({time.perf_counter() - began:.1f}s)",
                flush=True,
            )
        if accuracy is None:  # resumed a run that had already finished
            accuracy = evaluate(model, data.x_test, data.y_test, config.T)
    print(f"checkpoint: {checkpoint}")
    print(f"final test accuracy: {accuracy:.4f}", flush=True)
    return accuracy


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """Return the parser for ``spikefuse train``; its defaults are :class:`TrainConfig`'s."""
    d = TrainConfig()
    p = argparse.ArgumentParser(
        prog="spikefuse train",
        description="Train a small spiking CNN on scikit-learn's 8x8 digits.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--epochs", type=_positive_int, default=d.epochs, help="total epochs")
    p.add_argument("--batch-size", type=_positive_int, default=d.batch_size, help="training batch")
    p.add_argument("--T", type=_positive_int, default=d.T, help="time steps per sample")
    p.add_argument("--lr", type=float, default=d.lr, help="Adam learning rate, cosine-decayed")
    p.add_argument("--neuron", choices=sorted(NEURONS), default=d.neuron, help="neuron model")
    p.add_argument(
        "--backend",
        choices=["auto", "torch", "cuda"],
        default=d.backend,
        help="neuron backend; auto lets each neuron pick the fastest available",
    )
    p.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default=d.device,
        help="auto: cuda if available",
    )
    p.add_argument("--seed", type=int, default=d.seed, help="seeds the split, init and batches")
    p.add_argument(
        "--checkpoint", default=d.checkpoint, help="written after every epoch", metavar="PATH"
    )
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    p.add_argument(
        "--limit", type=int, default=d.limit, metavar="N", help="use only N samples (smoke tests)"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``spikefuse train`` entry point; returns the exit status."""
    args = build_parser().parse_args(argv)
    run(TrainConfig(**vars(args)))
    return 0
