"""Train a small spiking CNN on scikit-learn's digits (8x8 images, 1797 samples, no download).

This is both the quick-start example and an end-to-end check of spikefuse's neurons, surrogate
gradients and backends: plain SpikingJelly-style code in the multi-step layout ``[T, N, *]``.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import functools
import hashlib
import io
import math
import os
import re
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
# Version 2 added the "sha256" checksum of the payload.
CHECKPOINT_VERSION = 2
CHECKPOINT_KEYS = frozenset(
    {"format", "version", "epoch", "config", "test_accuracy", "model", "optimizer", "sha256"}
)
ARCHITECTURE = "digits-cnn-v1"
NUM_CLASSES = 10
DIGITS_SAMPLES = 1797  # scikit-learn's digits
MIN_SAMPLES = 10
TEST_FRACTION = 0.25
EVAL_BATCH_SIZE = 512
BACKENDS = ("auto", "torch", "cuda")
DEVICES = ("auto", "cpu", "cuda")
# numpy's and scikit-learn's generators both take seeds in [0, 2**32).
MAX_SEED = 2**32 - 1

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


def check_limit(limit: int | None) -> None:
    """Raise :class:`SpikefuseError` unless ``limit`` is None or a usable sample count."""
    if limit is not None and (type(limit) is not int or not MIN_SAMPLES <= limit <= DIGITS_SAMPLES):
        raise SpikefuseError(
            f"--limit must be between {MIN_SAMPLES} and {DIGITS_SAMPLES}, got {limit!r}"
        )


@dataclass(frozen=True)
class TrainConfig:
    """Everything that defines a training run (the CLI options), validated on construction."""

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
    overwrite: bool = False
    limit: int | None = None
    quiet: bool = False

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
        check_limit(self.limit)
        for name, allowed in (
            ("neuron", sorted(NEURONS)),
            ("backend", BACKENDS),
            ("device", DEVICES),
        ):
            if getattr(self, name) not in allowed:
                raise SpikefuseError(
                    f"unknown --{name} {getattr(self, name)!r}; choose from {list(allowed)}"
                )
        if not isinstance(self.checkpoint, str) or not self.checkpoint:
            raise SpikefuseError(f"--checkpoint must be a file path, got {self.checkpoint!r}")
        if self.resume and self.overwrite:
            raise SpikefuseError(
                "--resume and --overwrite exclude each other: --resume continues the "
                "checkpoint, --overwrite starts a new run in its place"
            )

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
    check_limit(limit)
    digits = load_digits()
    images = digits.images.astype(np.float32) / 16.0  # pixel values are 0..16
    labels = digits.target.astype(np.int64)
    if limit is not None:
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
    target = checkpoint_target(path)
    tmp = _temp_path(target, os.getpid())
    try:
        with open(tmp, "wb") as f:
            f.write(buffer.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise SpikefuseError(
                f"cannot write checkpoint '{path}': {_os_reason(exc)} ('{path}' is left as it was)"
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
            f"{'; '.join(differences)} (pass matching options, or drop --resume to start over)"
        )
    return payload


def restore(
    model: nn.Module, optimizer: torch.optim.Optimizer, payload: dict[str, Any], path: Path
) -> None:
    """Load a validated checkpoint payload into ``model`` and ``optimizer``."""
    try:
        model.load_state_dict(payload["model"])
        optimizer.load_state_dict(payload["optimizer"])
    except (RuntimeError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint '{path}' does not fit the model: {exc}") from exc
    # load_state_dict checks neither the optimizer's settings nor its buffers' shapes; a
    # mismatch would change the training silently or fail only in the first step.
    for group in optimizer.param_groups:
        for key, default in optimizer.defaults.items():
            if key != "lr" and group.get(key, default) != default:  # lr: set every epoch
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
    for batch, index in enumerate(batches):
        loss = F.cross_entropy(forward(model, data.x_train[index], config.T), data.y_train[index])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        value = loss.item()
        if not math.isfinite(value):
            raise SpikefuseError(
                f"the training diverged: the loss is {value} in epoch {epoch + 1}, batch "
                f"{batch + 1} (a smaller --lr may help); checkpoint '{config.checkpoint}' "
                f"is left as it was"
            )
        total_loss += value * len(index)
        batches.set_postfix(loss=f"{value:.3f}")
    return total_loss / len(order)


def run(config: TrainConfig) -> float:
    """Train (or resume) as ``config`` says, print progress, and return the test accuracy.

    The checkpoint is locked for the whole run, and checked to be writable (and, unless
    ``config.resume`` or ``config.overwrite``, not to exist) before training starts.
    """
    device = resolve_device(config.device)
    backend = describe_backend(config.backend, device)
    checkpoint = Path(config.checkpoint)
    target = checkpoint_target(checkpoint)
    prepare_checkpoint_dir(checkpoint, target, config)
    with checkpoint_lock(checkpoint, target):
        remove_stale_temp_files(target)
        check_checkpoint_writable(checkpoint, target, config)
        return _train(config, device, backend, checkpoint)


def _train(config: TrainConfig, device: torch.device, backend: str, checkpoint: Path) -> float:
    torch.manual_seed(config.seed)
    data = load_data(config.seed, config.limit).to(device)
    model = build_model(config.neuron, config.backend).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    print(
        f"device: {device}, backend: {backend}, neuron: {config.neuron}, T={config.T}, "
        f"train/test samples: {len(data.y_train)}/{len(data.y_test)}",
        flush=True,
    )

    start_epoch = 0
    if config.resume:
        payload = load_checkpoint(checkpoint, config)
        restore(model, optimizer, payload, checkpoint)
        start_epoch = payload["epoch"]
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


def build_parser() -> argparse.ArgumentParser:
    """Return the parser for ``spikefuse train``; its defaults are :class:`TrainConfig`'s.

    Values are range-checked by :class:`TrainConfig` (see :func:`main`).
    """
    d = TrainConfig()
    p = argparse.ArgumentParser(
        prog="spikefuse train",
        description="Train a small spiking CNN on scikit-learn's 8x8 digits.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--epochs", type=int, default=d.epochs, help="total epochs")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="training batch")
    p.add_argument("--T", type=int, default=d.T, help="time steps per sample")
    p.add_argument("--lr", type=float, default=d.lr, help="Adam learning rate, cosine-decayed")
    p.add_argument("--neuron", choices=sorted(NEURONS), default=d.neuron, help="neuron model")
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default=d.backend,
        help="neuron backend; auto lets each neuron pick the fastest available",
    )
    p.add_argument("--device", choices=DEVICES, default=d.device, help="auto: cuda if available")
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
        help=f"use only N samples, {MIN_SAMPLES}..{DIGITS_SAMPLES} (smoke tests)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
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
