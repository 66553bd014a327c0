"""The data sets ``spikefuse train`` reads: scikit-learn's digits, CIFAR-10's binary version
and the neuromorphic sets of :mod:`spikefuse.datasets`."""

from __future__ import annotations

import functools
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from spikefuse import datasets
from spikefuse.errors import SpikefuseError, os_reason
from spikefuse.extras import require
from spikefuse.train.config import (
    CIFAR10_RECORD_BYTES,
    CIFAR10_SIZE,
    CIFAR10_TEST_FILE,
    CIFAR10_TRAIN_FILES,
    NEEDS_DIGITS,
    NEUROMORPHIC,
    NUM_CLASSES,
    TEST_FRACTION,
    TRAIN,
    TrainConfig,
    check_limit,
)

CIFAR10_FILE_RECORDS = 10_000  # in each of the binary version's six files
READ_CHUNK_BYTES = 1 << 24


@dataclass(frozen=True)
class Dataset:
    """A fixed train/test split: images scaled to [0, 1] with shape ``[N, C, H, W]``, or
    sequences of frames ``[N, T, C, H, W]`` (neuromorphic data)."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    def to(self, device: torch.device) -> Dataset:
        """Return the split on ``device`` (the whole data set is kept on the device)."""
        return Dataset(*(getattr(self, f.name).to(device) for f in fields(self)))

    def with_channels(self, channels: int) -> Dataset:
        """Return the split with grey images repeated to ``channels`` channels."""
        if self.x_train.shape[-3] == channels:
            return self
        if self.x_train.shape[-3] != 1:
            raise SpikefuseError(
                f"the network takes {channels}-channel input; this data has "
                f"{self.x_train.shape[-3]} channels (use --model digits-cnn)"
            )
        expand = functools.partial(torch.repeat_interleave, repeats=channels, dim=-3)
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
    a whole number of records (truncated), larger than the format's files or holds a label
    outside 0..9. The size is checked from the file system before anything is read, then the
    file is read in pieces of at most READ_CHUNK_BYTES. (The binary version is plain bytes;
    the python version's pickles are never read: unpickling can run code.)
    """
    size = _cifar10_size(path)
    raw = np.empty(size, dtype=np.uint8)
    try:
        with open(path, "rb", buffering=0) as f:
            done = 0
            while done < size:
                got = f.readinto(raw.data[done : done + READ_CHUNK_BYTES])
                if not got:
                    break
                done += got
            grew = f.read(1)
    except OSError as exc:
        raise SpikefuseError(f"cannot read CIFAR-10 file '{path}': {os_reason(exc)}") from exc
    if done != size or grew:
        raise SpikefuseError(f"CIFAR-10 file '{path}' changed while it was read; try again")
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


def _cifar10_size(path: Path) -> int:
    """The size of CIFAR-10 file ``path``, checked to be a whole number of records that the
    format's files can hold."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise SpikefuseError(
            f"CIFAR-10 file '{path}' does not exist: --data-dir must be the folder of CIFAR-10's "
            f"binary version (cifar-10-batches-bin), holding {', '.join(CIFAR10_TRAIN_FILES)} "
            f"and {CIFAR10_TEST_FILE}"
        ) from None
    except OSError as exc:
        raise SpikefuseError(f"cannot read CIFAR-10 file '{path}': {os_reason(exc)}") from exc
    if not stat.S_ISREG(info.st_mode):
        raise SpikefuseError(f"cannot read CIFAR-10 file '{path}': it is not a regular file")
    size = info.st_size
    if size == 0 or size % CIFAR10_RECORD_BYTES:
        raise SpikefuseError(
            f"CIFAR-10 file '{path}' is truncated or not in CIFAR-10's binary format: its "
            f"{size} bytes are not a whole number >= 1 of {CIFAR10_RECORD_BYTES}-byte "
            f"records (a label byte and 3x32x32 pixel bytes)"
        )
    if size > CIFAR10_FILE_RECORDS * CIFAR10_RECORD_BYTES:
        raise SpikefuseError(
            f"CIFAR-10 file '{path}' has {size // CIFAR10_RECORD_BYTES} records; the files of "
            f"CIFAR-10's binary version hold {CIFAR10_FILE_RECORDS} each"
        )
    return size


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


NEUROMORPHIC_TRAIN_RATIO = 0.9  # CIFAR10-DVS has no split: SpikingJelly's examples take 9:1


def _frame_dataset(name: str, root: Path, T: int, train: bool) -> Any:
    """spikefuse.datasets' ``name`` as frames: T frames of equal event counts (CIFAR10-DVS,
    which has no split, ignores ``train``)."""
    if name == "cifar10-dvs":
        return datasets.CIFAR10DVS(root, "frame", frames_number=T, split_by="number")
    kinds = {
        "dvs128-gesture": datasets.DVS128Gesture,
        "n-mnist": datasets.NMNIST,
        "shd": datasets.SHD,
    }
    return kinds[name](root, train, "frame", frames_number=T, split_by="number")


def _as_images(frames: np.ndarray, name: str) -> np.ndarray:
    """[T, C, H, W] frames; SHD's [T, 700] spike counts laid out as [T, 1, 28, 28]."""
    if name != "shd":
        return frames
    side = NEUROMORPHIC[name][0]
    padded = np.zeros((frames.shape[0], side * side), np.float32)
    padded[:, : frames.shape[1]] = frames
    return padded.reshape(-1, 1, side, side)


def _stack(data: Any, indices: Sequence[int], name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Frames ``[N, T, C, H, W]`` (event counts) and labels of ``data[indices]``."""
    samples = [data[i] for i in indices]
    x = np.stack([_as_images(frames, name) for frames, _ in samples])
    return torch.from_numpy(x), torch.tensor([int(label) for _, label in samples])


def load_neuromorphic(
    name: str, root: Path, T: int, seed: int, limit: int | None = None
) -> Dataset:
    """A neuromorphic data set (``--data dvs128-gesture|cifar10-dvs|n-mnist|shd``) from the
    files under ``root`` (see :mod:`spikefuse.datasets`), as ``T`` frames per sample
    (SpikingJelly's ``frames_number=T, split_by='number'``, cached in ``root``); ``limit``
    keeps a seeded random subset of the training samples (and as many test samples at most)."""
    check_limit(limit, name)
    if name == "cifar10-dvs":
        every = _frame_dataset(name, root, T, True)
        train_part, test_part = datasets.split_to_train_test_set(
            NEUROMORPHIC_TRAIN_RATIO, every, NEUROMORPHIC[name][1]
        )
        train_set, train_idx = every, list(train_part.indices)
        test_set, test_idx = every, list(test_part.indices)
    else:
        train_set, test_set = (_frame_dataset(name, root, T, train) for train in (True, False))
        train_idx, test_idx = list(range(len(train_set))), list(range(len(test_set)))
    if limit is not None and limit > len(train_idx):
        raise SpikefuseError(
            f"--limit {limit}: '{root}' holds only {len(train_idx)} training samples"
        )
    train_keep = np.asarray(train_idx)[_subset(seed, len(train_idx), limit)]
    test_limit = None if limit is None else min(limit, len(test_idx))
    test_keep = np.asarray(test_idx)[_subset(seed, len(test_idx), test_limit)]
    return Dataset(
        *_stack(train_set, train_keep.tolist(), name), *_stack(test_set, test_keep.tolist(), name)
    )


def load_data(config: TrainConfig) -> Dataset:
    """The data set ``config`` names, split and limited as it says."""
    if config.data in NEUROMORPHIC:
        assert config.data_dir is not None  # TrainConfig requires it
        return load_neuromorphic(
            config.data, Path(config.data_dir), config.T, config.seed, config.limit
        )
    if config.data_dir is not None:  # TrainConfig: a --data-dir exactly for --data cifar10
        return load_cifar10(Path(config.data_dir), config.seed, config.limit)
    return load_digits_split(config.seed, config.limit)
