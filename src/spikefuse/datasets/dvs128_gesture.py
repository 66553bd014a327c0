"""DVS128 Gesture with SpikingJelly's class, layout and frames
(``spikingjelly.datasets.dvs128_gesture``).

Files (``root/download``, ``root/extract`` or ``root/events_np``), ``data_type`` and the
cached frames are as described in :mod:`spikefuse.datasets.folder`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import SpikefuseError
from . import events as ev
from .folder import TrainTestFolder, save_events

__all__ = ["DVS128Gesture"]

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
