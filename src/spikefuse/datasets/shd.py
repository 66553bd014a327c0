"""The Spiking Heidelberg Digits (SHD) with SpikingJelly's class and frames.

Files: ``shd_train.h5`` and ``shd_test.h5`` (HDF5: ``spikes/times`` in seconds and
``spikes/units`` 0..699 per sample, ``labels`` 0..19), in ``root/events_h5``, or zipped
(``shd_*.h5.zip``) in ``root/download``, or unzipped in ``root/extract``. Reading them needs
h5py (``pip install spikefuse[datasets]``). ``data_type='event'`` gives ``({'t', 'x'}, label)``
read from the file; ``data_type='frame'`` gives float32 frames ``[T, 700]`` (spike counts per
unit), integrated once and cached: ``frames_number`` with ``split_by`` 'number' or 'time'
(spans of (t[-1] - t[0]) / T), or ``duration`` in ms.
"""

from __future__ import annotations

import math
import operator
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import SpikefuseError
from .events import segment_index
from .folder import TrainTestFolder

__all__ = ["SHD_N_CLASSES", "SHD_UNITS", "SpikingHeidelbergDigits"]

SHD_N_CLASSES = 20
SHD_UNITS = 700
HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"


def _h5py() -> Any:
    try:
        import h5py  # type: ignore[import-untyped]  # optional (the datasets extra), untyped
    except ImportError:
        raise SpikefuseError(
            "SpikingHeidelbergDigits reads HDF5 files with h5py: pip install 'spikefuse[datasets]'"
        ) from None
    return h5py


def open_shd(path: Path) -> Any:
    """The opened SHD file, after checking it is HDF5 with spikes/times, spikes/units, labels."""
    try:
        with path.open("rb") as f:
            magic = f.read(len(HDF5_MAGIC))
    except FileNotFoundError:
        raise SpikefuseError(f"SHD file '{path}' does not exist") from None
    if magic != HDF5_MAGIC:
        raise SpikefuseError(f"SHD file '{path}' is not an HDF5 file (truncated or corrupt?)")
    h5 = _h5py().File(path, "r")
    needed = ("spikes/times", "spikes/units", "labels")
    missing = [name for name in needed if name not in h5]
    if missing or not len(h5["labels"]) == len(h5["spikes/times"]) == len(h5["spikes/units"]):
        h5.close()
        raise SpikefuseError(
            f"SHD file '{path}' lacks {missing} or its datasets differ in length: not an SHD file"
        )
    return h5


def _counts(x: np.ndarray) -> np.ndarray:
    if x.size and (x.min() < 0 or x.max() >= SHD_UNITS):
        raise SpikefuseError(f"SHD units must be in 0..{SHD_UNITS - 1}")
    return np.bincount(x.astype(np.int64), minlength=SHD_UNITS).astype(float)


def integrate_shd_by_fixed_frames_number(
    events: dict[str, np.ndarray], split_by: str, frames_num: int
) -> np.ndarray:
    """``frames_num`` frames [T, 700] of spike counts."""
    j_l, j_r = segment_index(events["t"], split_by, frames_num, operator.truediv)
    return np.stack([_counts(events["x"][j_l[i] : j_r[i]]) for i in range(frames_num)])


def integrate_shd_by_fixed_duration(events: dict[str, np.ndarray], duration: int) -> np.ndarray:
    """Frames of ``duration`` ms (times are in s), ceil(span / duration) of them."""
    t = 1000 * events["t"]
    t = t - t[0]
    frames_num = int(math.ceil(t[-1] / duration))
    if frames_num == 0:
        raise SpikefuseError("all spikes of the sample have one time: no frame to fill")
    index = t // duration
    bounds = [0, *(int(np.searchsorted(index, i + 1, side="left")) for i in range(frames_num - 1))]
    bounds.append(t.size)
    return np.stack([_counts(events["x"][bounds[i] : bounds[i + 1]]) for i in range(frames_num)])


class SpikingHeidelbergDigits(TrainTestFolder):
    """SHD (20 classes, 700 input units): SpikingJelly's ``SpikingHeidelbergDigits``."""

    _h5: Any = None  # the open file of event mode (per process: not pickled)

    def _check_config(self) -> None:
        if self.cfg.custom_integrate_function is not None:
            raise SpikefuseError(
                "SpikingHeidelbergDigits: custom_integrate_function is not supported (its "
                "SpikingJelly form writes files from an open h5py file); use frames_number or "
                "duration, or data_type='event' and integrate in a transform"
            )

    @property
    def raw_root(self) -> Path:
        return self.cfg.root / "events_h5"

    def _h5_path(self, split: str) -> Path:
        return self.raw_root / f"shd_{split}.h5"

    @classmethod
    def get_H_W(cls) -> tuple[int, int]:
        return 0, SHD_UNITS  # SpikingJelly: (None, 700)

    @classmethod
    def resource_url_md5(cls) -> list[tuple[str, str, str]]:
        return [
            ("shd_train.h5.zip", "https://zenkelab.org/datasets/shd_train.h5.zip", "f3252aeb598ac776c1b526422d90eecb"),
            ("shd_test.h5.zip", "https://zenkelab.org/datasets/shd_test.h5.zip", "1503a5064faa34311c398fb0a1ed0a6f"),
        ]  # fmt: skip

    @classmethod
    def create_raw_from_extracted(cls, extract_root: Path, raw_root: Path) -> None:
        for split in ("train", "test"):
            source = extract_root / f"shd_{split}.h5"
            if not source.is_file():
                raise SpikefuseError(f"SHD: '{source}' is missing (is extract/ complete?)")
            shutil.copyfile(source, raw_root / source.name)

    def _index_samples(self) -> None:
        """Frame mode: class folders; event mode reads the HDF5 file itself."""
        if self.cfg.data_type != "event":
            super()._index_samples()
            return
        with open_shd(self._split_file) as h5:
            labels = np.asarray(h5["labels"][:], dtype=np.int64)
        self.classes = [str(i) for i in range(SHD_N_CLASSES)]
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}
        self.samples = [("", int(label)) for label in labels]
        self.targets = [int(label) for label in labels]

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def _split_file(self) -> Path:
        return self._h5_path("train" if self.cfg.train else "test")

    def __getstate__(self) -> dict[str, Any]:
        """Without the open file (DataLoader workers open their own)."""
        return {**self.__dict__, "_h5": None}

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        if self.cfg.data_type != "event":
            return super().__getitem__(index)
        if self._h5 is None:
            self._h5 = open_shd(self._split_file)
        sample: Any = {"t": self._h5["spikes/times"][index], "x": self._h5["spikes/units"][index]}
        label: Any = self.targets[index]
        if self.transform is not None:
            sample = self.transform(sample)
        return sample, (label if self.target_transform is None else self.target_transform(label))

    def _integrate_all(self, into: Path) -> None:
        for split in ("train", "test"):
            with open_shd(self._h5_path(split)) as h5:
                for label in range(SHD_N_CLASSES):
                    (into / split / str(label)).mkdir(parents=True)
                for i in range(len(h5["labels"])):
                    events = {"t": h5["spikes/times"][i], "x": h5["spikes/units"][i]}
                    label = int(h5["labels"][i])
                    np.savez(into / split / str(label) / f"{i}.npz", frames=self._frames(events))

    def _frames(self, events: dict[str, np.ndarray]) -> np.ndarray:
        if self.cfg.frames_number is not None:
            assert self.cfg.split_by is not None  # validated
            return integrate_shd_by_fixed_frames_number(
                events, self.cfg.split_by, self.cfg.frames_number
            )
        assert self.cfg.duration is not None  # validated
        return integrate_shd_by_fixed_duration(events, self.cfg.duration)
