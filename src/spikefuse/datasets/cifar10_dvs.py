"""CIFAR10-DVS with SpikingJelly's class, layout and frames (``spikingjelly.datasets.cifar10_dvs``).

Files (``root/download``, ``root/extract`` or ``root/events_np``), ``data_type`` and the
cached frames are as described in :mod:`spikefuse.datasets.folder`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import SpikefuseError
from . import events as ev
from .folder import NeuromorphicDatasetFolder, save_events

__all__ = ["CIFAR10DVS", "CIFAR10DVS_CLASS_NAMES"]

CIFAR10DVS_CLASS_NAMES = (
    "airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck",
)  # fmt: skip


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
