"""N-MNIST with SpikingJelly's class, layout and frames (``spikingjelly.datasets.n_mnist``).

Files (``root/download``, ``root/extract`` or ``root/events_np``), ``data_type`` and the
cached frames are as described in :mod:`spikefuse.datasets.folder`.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import SpikefuseError
from . import events as ev
from .folder import TrainTestFolder, save_events

__all__ = ["NMNIST"]


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
