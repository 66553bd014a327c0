"""DVS128 Gesture, CIFAR10-DVS and N-MNIST with SpikingJelly's classes, layout and frames.

Each reads the published files from ``root`` (see :mod:`spikefuse.datasets.folder`): put the
archives in ``root/download`` (spikefuse downloads nothing; the error says which files and
where to get them), or their extracted contents in ``root/extract``, or SpikingJelly's
``root/events_np``. ``data_type='event'`` gives each sample's events (a dict of ``t, x, y, p``
arrays); ``data_type='frame'`` gives float32 frames ``[T, 2, H, W]``, integrated once
(``frames_number`` with ``split_by`` 'number' or 'time', or ``duration`` in µs) and cached.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import SpikefuseError
from . import events as ev
from .folder import NeuromorphicDatasetFolder, TrainTestFolder, save_events

__all__ = ["CIFAR10DVS", "CIFAR10DVS_CLASS_NAMES", "DVS128Gesture", "NMNIST"]

CIFAR10DVS_CLASS_NAMES = (
    "airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck",
)  # fmt: skip
GESTURE_CLASSES = 11


def _read_lines(path: Path) -> list[str]:
    try:
        return [line.strip() for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        raise SpikefuseError(
            f"DVS128 Gesture: '{path}' does not exist (is extract/ complete?)"
        ) from None


def _gesture_labels(csv_file: Path) -> np.ndarray:
    """Rows (class 1..11, start µs, end µs) of a ``*_labels.csv``."""
    try:
        rows = np.loadtxt(csv_file, dtype=np.int64, delimiter=",", skiprows=1, ndmin=2)
    except (OSError, ValueError) as exc:
        raise SpikefuseError(f"DVS128 Gesture: cannot read labels '{csv_file}': {exc}") from exc
    if rows.shape[1] != 3 or rows.size and not ((rows[:, 0] >= 1) & (rows[:, 0] <= 11)).all():
        raise SpikefuseError(
            f"DVS128 Gesture: '{csv_file}' is not class,startTime,endTime rows of classes 1..11"
        )
    return rows


def _split_gesture_recording(name: str, aedat: Path, csv_file: Path, out: Path) -> None:
    """One sample per labelled interval [start, end) of a recording: ``out/<class-1>/<name>_<k>.npz``."""
    events = ev.load_aedat_v3(aedat)
    counts = [0] * GESTURE_CLASSES
    for label, start, end in _gesture_labels(csv_file):
        label -= 1
        mask = (events["t"] >= start) & (events["t"] < end)
        sample = {key: value[mask] for key, value in events.items()}
        save_events(out / str(label) / f"{name}_{counts[label]}.npz", sample)
        counts[label] += 1


class DVS128Gesture(TrainTestFolder):
    """IBM's DVS128 Gesture (11 classes, 128 x 128): ``DvsGesture.tar.gz`` (with
    ``trials_to_train.txt``, ``trials_to_test.txt``, ``userXX_*.aedat`` AEDAT 3.1 recordings and
    their ``*_labels.csv``) split into one sample per labelled gesture."""

    @classmethod
    def get_H_W(cls) -> tuple[int, int]:
        return 128, 128

    @classmethod
    def resource_url_md5(cls) -> list[tuple[str, str, str]]:
        url = "https://ibm.ent.box.com/s/3hiq58ww1pbbjrinh367ykfdf60xsfm8/folder/50167556794"
        return [("DvsGesture.tar.gz", url, "8a5c71fb11e24e5ca5b11866ca6c00a1")]

    @classmethod
    def create_raw_from_extracted(cls, extract_root: Path, raw_root: Path) -> None:
        aedat_dir = extract_root / "DvsGesture"
        for split in ("train", "test"):
            for label in range(GESTURE_CLASSES):
                (raw_root / split / str(label)).mkdir(parents=True)
            for file in _read_lines(aedat_dir / f"trials_to_{split}.txt"):
                name = Path(file).stem
                csv_file = aedat_dir / f"{name}_labels.csv"
                _split_gesture_recording(name, aedat_dir / file, csv_file, raw_root / split)


class CIFAR10DVS(NeuromorphicDatasetFolder):
    """CIFAR10-DVS (10 classes, 128 x 128): one ``<class>.zip`` per class of AEDAT 2.0 files.
    As in SpikingJelly there is no train/test split (``train`` is not an argument)."""

    def __init__(
        self,
        root: str | Path,
        data_type: str = "event",
        frames_number: int | None = None,
        split_by: str | None = None,
        duration: int | None = None,
        custom_integrate_function: Callable[..., Any] | None = None,
        custom_integrated_frames_dir_name: str | None = None,
        transform: Callable[..., Any] | None = None,
        target_transform: Callable[..., Any] | None = None,
    ) -> None:
        super().__init__(
            root, None, data_type, frames_number, split_by, duration, custom_integrate_function,
            custom_integrated_frames_dir_name, transform, target_transform,
        )  # fmt: skip

    @classmethod
    def get_H_W(cls) -> tuple[int, int]:
        return 128, 128

    @classmethod
    def resource_url_md5(cls) -> list[tuple[str, str, str]]:
        url = "https://figshare.com/articles/dataset/CIFAR10-DVS_New/4724671"
        return [(f"{name}.zip", url, "") for name in CIFAR10DVS_CLASS_NAMES]

    @classmethod
    def create_raw_from_extracted(cls, extract_root: Path, raw_root: Path) -> None:
        for name in CIFAR10DVS_CLASS_NAMES:
            source = extract_root / name
            if not source.is_dir():
                raise SpikefuseError(f"CIFAR10-DVS: '{source}' is missing (is extract/ complete?)")
            (raw_root / name).mkdir()
            for file in sorted(source.iterdir()):
                if file.suffix == ".aedat":
                    save_events(
                        raw_root / name / f"{file.stem}.npz", ev.load_cifar10dvs_aedat(file)
                    )


class NMNIST(TrainTestFolder):
    """N-MNIST (10 classes, 34 x 34): ``Train.zip`` and ``Test.zip`` of ATIS ``.bin`` files
    in digit folders."""

    @classmethod
    def get_H_W(cls) -> tuple[int, int]:
        return 34, 34

    @classmethod
    def resource_url_md5(cls) -> list[tuple[str, str, str]]:
        url = "https://www.garrickorchard.com/datasets/n-mnist"
        return [
            ("Train.zip", url, "20959b8e626244a1b502305a9e6e2031"),
            ("Test.zip", url, "69ca8762b2fe404d9b9bad1103e97832"),
        ]

    @classmethod
    def create_raw_from_extracted(cls, extract_root: Path, raw_root: Path) -> None:
        for split in ("Train", "Test"):
            source = extract_root / split
            if not source.is_dir():
                raise SpikefuseError(f"N-MNIST: '{source}' is missing (is extract/ complete?)")
            for digit in sorted(p for p in source.iterdir() if p.is_dir()):
                out = raw_root / split.lower() / digit.name
                out.mkdir(parents=True)
                for file in sorted(digit.iterdir()):
                    if file.suffix == ".bin":
                        save_events(out / f"{file.stem}.npz", ev.load_ATIS_bin(file))
