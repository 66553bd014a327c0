"""The files under a dataset's root that spikefuse.datasets did not write itself: stray files
next to the samples, damaged or foreign ``.npz``/``.npy`` files, and folders of earlier builds.

Each case starts from SpikingJelly's ``events_np/`` layout (one ``.npz`` of events per sample,
in split and class folders), written here for N-MNIST's 34 x 34 sensor."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from spikefuse import datasets

FRAMES = {"frames_number": 2, "split_by": "number"}
FRAMES_DIR = "frames_number_2_split_by_number"


def _events(n: int = 40, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "t": np.arange(n) * 10,
        "x": rng.integers(0, 34, n),
        "y": rng.integers(0, 34, n),
        "p": rng.integers(0, 2, n),
    }


def _events_np(root: Path) -> Path:
    """``root/events_np`` with two classes of one sample each per split; returns the train
    sample of class 0."""
    for split in ("train", "test"):
        for label in range(2):
            folder = root / "events_np" / split / str(label)
            folder.mkdir(parents=True)
            np.savez(folder / "00000.npz", **_events(seed=label))
    return root / "events_np" / "train" / "0" / "00000.npz"


# ---- files that are not samples ---------------------------------------------------------------
def test_stray_files_are_skipped_as_the_sample_index_skips_them(tmp_path):
    sample = _events_np(tmp_path)
    (sample.parent / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1" + bytes(100))
    (tmp_path / "events_np" / "README.txt").write_text("notes\n")
    events = datasets.NMNIST(tmp_path, train=True)
    frames = datasets.NMNIST(tmp_path, True, "frame", **FRAMES)
    assert len(frames) == len(events) == 2 and frames.targets == events.targets
    made = sorted(p.name for p in (tmp_path / FRAMES_DIR).rglob("*") if p.is_file())
    assert made == ["00000.npz"] * 4  # frames of the samples only
