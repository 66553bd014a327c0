"""SpikingJelly's ``NeuromorphicDatasetFolder``: the on-disk layout, frame caching and the
torchvision ``DatasetFolder`` semantics its datasets have, without torchvision or downloads.

``root`` holds, as in SpikingJelly: ``download/`` (the published archives, which you put there:
spikefuse downloads nothing), ``extract/`` (their contents), ``events_np/`` (one ``.npz`` of
events per sample, in ``train``/``test`` and class folders) and one folder of integrated frames
per setting (``frames_number_{T}_split_by_{split_by}``, ``duration_{d}``, or the custom
function's name), built once and read from then on. Any of the first three may be given: the
next ones are made from it. A folder is written under a temporary name and renamed when
complete, so an interrupted build is redone, not read (:mod:`.building`).

Samples and labels follow torchvision's ``DatasetFolder`` (what SpikingJelly uses): classes are
the sorted folder names (so DVS128 Gesture's folder '10' is label 2), samples the ``.npy`` and
``.npz`` files in sorted order (read as :mod:`.npfiles` says; other files are skipped).
"""

from __future__ import annotations

import math
import os
import tarfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch.utils.data

from ..errors import SpikefuseError
from . import events as ev
from .building import build_atomically
from .npfiles import is_npy, read_npy, read_npz

__all__ = [
    "NeuromorphicDatasetConfig",
    "NeuromorphicDatasetFolder",
    "TrainTestFolder",
    "split_to_train_test_set",
]

EXTENSIONS = (".npy", ".npz")


def is_sample_file(name: str) -> bool:
    """Whether a file is a sample, as torchvision's ``DatasetFolder`` picks them: by its
    extension (:data:`EXTENSIONS`, any case). Other files (``.DS_Store``, notes) are skipped
    everywhere, so that the frames folders hold frames of exactly the indexed samples."""
    return name.lower().endswith(EXTENSIONS)


@dataclass(frozen=True)
class NeuromorphicDatasetConfig:
    """A dataset's settings, validated as SpikingJelly validates them."""

    root: Path
    train: bool | None
    data_type: str = "event"
    frames_number: int | None = None
    split_by: str | None = None
    duration: int | None = None
    custom_integrate_function: Callable[..., Any] | None = None
    custom_integrated_frames_dir_name: str | None = None
    transform: Callable[..., Any] | None = None
    target_transform: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        if self.data_type not in ("event", "frame"):
            raise SpikefuseError(f"data_type must be 'event' or 'frame', got {self.data_type!r}")
        if self.data_type == "event":
            return
        given = [self.frames_number, self.duration, self.custom_integrate_function]
        if sum(v is not None for v in given) != 1:
            raise SpikefuseError(
                "with data_type='frame', give exactly one of frames_number, duration and "
                "custom_integrate_function"
            )
        if self.frames_number is not None:
            if not _positive_int(self.frames_number):
                raise SpikefuseError(
                    f"frames_number must be an int > 0, got {self.frames_number!r}"
                )
            if self.split_by not in ("time", "number"):
                raise SpikefuseError(f"split_by must be 'time' or 'number', got {self.split_by!r}")
        if self.duration is not None and not _positive_int(self.duration):
            raise SpikefuseError(f"duration must be an int > 0 (µs), got {self.duration!r}")

    @property
    def frames_dir_name(self) -> str:
        """The folder of this setting's frames (SpikingJelly's names)."""
        if self.frames_number is not None:
            return f"frames_number_{self.frames_number}_split_by_{self.split_by}"
        if self.duration is not None:
            return f"duration_{self.duration}"
        if self.custom_integrated_frames_dir_name is not None:
            return self.custom_integrated_frames_dir_name
        return getattr(self.custom_integrate_function, "__name__", "custom")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def load_events(path: str | Path) -> dict[str, np.ndarray] | np.ndarray:
    """A sample's events as SpikingJelly's loader gives them: the arrays of an ``.npz`` by
    name (t, x, y, p in SpikingJelly's files), or the array of an ``.npy`` as it is."""
    return read_npy(path, "events") if is_npy(path, "events") else read_npz(path, "events")


def save_events(path: Path, events: dict[str, np.ndarray]) -> None:
    """One sample's events as SpikingJelly's ``events_np`` ``.npz`` (t, x, y, p)."""
    np.savez(path, t=events["t"], x=events["x"], y=events["y"], p=events["p"])


def load_npz_frames(path: str | Path) -> np.ndarray:
    """The frames of a sample's ``.npz``, float32 (SpikingJelly's ``load_npz_frames``), or of
    an ``.npy`` (its array: the sample index lists ``.npy`` files too): a damaged file, an
    ``.npz`` without the key 'frames' or frames that are not finite numbers raise
    :class:`SpikefuseError`."""
    if is_npy(path, "frames"):
        return _checked_frames(read_npy(path, "frames"), path)
    arrays = read_npz(path, "frames")
    if "frames" not in arrays:
        raise SpikefuseError(
            f"frames file '{path}' has the arrays {sorted(arrays)} but no 'frames': a frames "
            "file holds them under that key (np.savez(path, frames=...))"
        )
    return _checked_frames(arrays["frames"], path)


def _checked_frames(frames: np.ndarray, path: str | Path) -> np.ndarray:
    if frames.dtype.kind not in "biuf":
        raise SpikefuseError(f"frames file '{path}' holds {frames.dtype} frames, not numbers")
    with np.errstate(over="ignore"):  # values beyond float32 become inf, refused next
        frames = frames.astype(np.float32)
    if not np.isfinite(frames).all():  # event counts are finite; NaN is damage, not a sample
        raise SpikefuseError(
            f"frames file '{path}' holds NaN or infinite values (or values beyond float32): "
            "delete the frames folder that holds it to build it again"
        )
    return frames


def extract_archive(archive: Path, into: Path) -> None:
    """Unpack a .zip or .tar(.gz) archive, refusing members that would land outside ``into``."""
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as z:
            for name in z.namelist():
                if not (into / name).resolve().is_relative_to(into.resolve()):
                    raise SpikefuseError(f"archive '{archive}' has a member outside it: {name!r}")
            z.extractall(into)
    elif tarfile.is_tarfile(archive):
        with tarfile.open(archive) as t:
            t.extractall(into, filter="data")
    else:
        raise SpikefuseError(f"'{archive}' is not a zip or tar archive (truncated or corrupt?)")


def is_built(folder: Path) -> bool:
    """Whether ``folder`` exists, refusing one that SpikingJelly left half built: it builds in
    place, marking the build with ``<folder>.building`` until it completes."""
    marker = folder.with_name(f"{folder.name}.building")
    if marker.exists():
        raise SpikefuseError(
            f"'{marker}' says that SpikingJelly's build of '{folder}' did not complete: delete "
            "both (spikefuse then makes the folder again from the files before it)"
        )
    return folder.exists()


def find_samples(directory: Path) -> tuple[list[str], list[tuple[str, int]]]:
    """torchvision ``DatasetFolder``'s classes and (path, class index) samples."""
    if not directory.is_dir():
        raise SpikefuseError(f"'{directory}' is not a folder of class folders")
    classes = sorted(entry.name for entry in os.scandir(directory) if entry.is_dir())
    samples = []
    for index, name in enumerate(classes):
        for folder, _, files in sorted(os.walk(directory / name, followlinks=True)):
            for file in sorted(files):
                if is_sample_file(file):
                    samples.append((os.path.join(folder, file), index))
    return classes, samples


class NeuromorphicDatasetFolder(torch.utils.data.Dataset):
    """Base of the neuromorphic datasets; subclasses give the sensor size (:meth:`get_H_W`),
    the files to ask for (:meth:`resource_url_md5`), how to turn ``extract/`` into
    ``events_np/`` (:meth:`create_raw_from_extracted`) and the event reader."""

    def __init__(
        self,
        root: str | Path,
        train: bool | None = None,
        data_type: str = "event",
        frames_number: int | None = None,
        split_by: str | None = None,
        duration: int | None = None,
        custom_integrate_function: Callable[..., Any] | None = None,
        custom_integrated_frames_dir_name: str | None = None,
        transform: Callable[..., Any] | None = None,
        target_transform: Callable[..., Any] | None = None,
    ) -> None:
        self.cfg = NeuromorphicDatasetConfig(
            Path(root), train, data_type, frames_number, split_by, duration,
            custom_integrate_function, custom_integrated_frames_dir_name, transform,
            target_transform,
        )  # fmt: skip
        self.transform, self.target_transform = transform, target_transform
        self._check_config()
        self.prepare_raw_dataset()
        self.processed_root = self._build_frames() if data_type == "frame" else self.raw_root
        self.loader = load_npz_frames if data_type == "frame" else load_events
        self._index_samples()

    def _index_samples(self) -> None:
        """``classes``, ``class_to_idx``, ``samples`` and ``targets`` (DatasetFolder's)."""
        split = self.processed_root
        if self.cfg.train is not None:
            split = split / ("train" if self.cfg.train else "test")
        self.classes, self.samples = find_samples(split)
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}
        self.targets = [target for _, target in self.samples]

    def _check_config(self) -> None:
        """Refuse settings a subclass cannot honour (before any file is touched)."""

    @property
    def raw_root(self) -> Path:
        return self.cfg.root / "events_np"

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        path, target = self.samples[index]
        sample: Any = self.loader(path)
        if self.transform is not None:
            sample = self.transform(sample)
        return sample, (target if self.target_transform is None else self.target_transform(target))

    # ---- preparing the files ------------------------------------------------------------------
    def prepare_raw_dataset(self) -> None:
        """Make ``events_np/`` from ``extract/``, or ``extract/`` from ``download/`` first."""
        if is_built(self.raw_root):
            return
        extract_root = self.cfg.root / "extract"
        if not is_built(extract_root):
            download_root = self.cfg.root / "download"
            self._check_downloaded_files(download_root)
            build_atomically(
                extract_root, lambda into: self.extract_downloaded_files(download_root, into)
            )
        build_atomically(
            self.raw_root, lambda into: self.create_raw_from_extracted(extract_root, into)
        )

    @classmethod
    def _check_downloaded_files(cls, download_root: Path) -> None:
        missing = [
            name for name, _, _ in cls.resource_url_md5() if not (download_root / name).is_file()
        ]
        if missing:
            urls = sorted({url for _, url, _ in cls.resource_url_md5()})
            raise SpikefuseError(
                f"{cls.__name__}: missing {', '.join(missing)} in '{download_root}'. spikefuse "
                f"downloads nothing: get the files from {', '.join(urls)} and put them there (or "
                f"their extracted contents in '{download_root.parent / 'extract'}', or "
                f"SpikingJelly's '{download_root.parent / 'events_np'}')"
            )

    @classmethod
    def extract_downloaded_files(cls, download_root: Path, extract_root: Path) -> None:
        for name, _, _ in cls.resource_url_md5():
            path = download_root / name
            if path.suffix in (".zip", ".gz", ".tar", ".tgz"):
                extract_archive(path, extract_root)

    def _build_frames(self) -> Path:
        target = self.cfg.root / self.cfg.frames_dir_name
        if not is_built(target):
            build_atomically(target, self._integrate_all)
        return target

    def _integrate_all(self, into: Path) -> None:
        for folder, _, files in os.walk(self.raw_root):
            out = into / Path(folder).relative_to(self.raw_root)
            out.mkdir(parents=True, exist_ok=True)
            for file in filter(is_sample_file, files):
                self._save_frames(Path(folder) / file, out)

    def _save_frames(self, events_file: Path, out: Path) -> None:
        events: Any = load_events(events_file)
        H, W = self.get_H_W()
        cfg = self.cfg
        # A custom function gets what the file holds, as in SpikingJelly (dict or array).
        if cfg.custom_integrate_function is None:
            events = ev.checked_events(events, events_file)
        if cfg.frames_number is not None:
            assert cfg.split_by is not None  # validated
            frames = ev.integrate_events_by_fixed_frames_number(
                events, cfg.split_by, cfg.frames_number, H, W
            )
            np.savez(out / events_file.name, frames=frames)
        elif cfg.duration is not None:
            frames = ev.integrate_events_by_fixed_duration(events, cfg.duration, H, W)
            np.savez(out / f"{events_file.stem}_{frames.shape[0]}.npz", frames=frames)
        else:
            assert cfg.custom_integrate_function is not None  # validated
            frames = cfg.custom_integrate_function(events, H, W)
            np.savez(out / events_file.name, frames=frames)

    # ---- what subclasses give -----------------------------------------------------------------
    @classmethod
    def get_H_W(cls) -> tuple[int, int]:
        raise NotImplementedError

    @classmethod
    def resource_url_md5(cls) -> list[tuple[str, str, str]]:
        raise NotImplementedError

    @classmethod
    def downloadable(cls) -> bool:
        return False

    @classmethod
    def create_raw_from_extracted(cls, extract_root: Path, raw_root: Path) -> None:
        raise NotImplementedError


class TrainTestFolder(NeuromorphicDatasetFolder):
    """A data set published as a train and a test split: ``train`` (default True) must be
    True or False."""

    def __init__(
        self,
        root: str | Path,
        train: bool = True,
        data_type: str = "event",
        frames_number: int | None = None,
        split_by: str | None = None,
        duration: int | None = None,
        custom_integrate_function: Callable[..., Any] | None = None,
        custom_integrated_frames_dir_name: str | None = None,
        transform: Callable[..., Any] | None = None,
        target_transform: Callable[..., Any] | None = None,
    ) -> None:
        if not isinstance(train, bool):
            raise SpikefuseError(f"train must be True or False, got {train!r}")
        super().__init__(
            root, train, data_type, frames_number, split_by, duration, custom_integrate_function,
            custom_integrated_frames_dir_name, transform, target_transform,
        )  # fmt: skip


def split_to_train_test_set(
    train_ratio: float,
    origin_dataset: torch.utils.data.Dataset,
    num_classes: int,
    random_split: bool = False,
) -> tuple[torch.utils.data.Subset, torch.utils.data.Subset]:
    """SpikingJelly's per-class split: of each class's samples (in order, or shuffled with
    numpy's global generator when ``random_split``), the first ceil(n * train_ratio) train.
    Labels come from the dataset's ``targets`` where it has them (else each sample is read)."""
    if not 0 < train_ratio <= 1:
        raise SpikefuseError(f"train_ratio must be in (0, 1], got {train_ratio!r}")
    targets = getattr(origin_dataset, "targets", None)
    if targets is None:
        targets = [int(origin_dataset[i][1]) for i in range(len(origin_dataset))]  # type: ignore[arg-type]
    label_idx: list[list[int]] = [[] for _ in range(num_classes)]
    for i, label in enumerate(targets):
        if not 0 <= int(label) < num_classes:
            raise SpikefuseError(f"sample {i} has label {label}, not 0..{num_classes - 1}")
        label_idx[int(label)].append(i)
    train_idx, test_idx = [], []
    for indices in label_idx:
        if random_split:
            np.random.shuffle(indices)
        pos = math.ceil(len(indices) * train_ratio)
        train_idx += indices[:pos]
        test_idx += indices[pos:]
    return (
        torch.utils.data.Subset(origin_dataset, train_idx),
        torch.utils.data.Subset(origin_dataset, test_idx),
    )
