"""The files under a dataset's root that spikefuse.datasets did not write itself: stray files
next to the samples, damaged or foreign ``.npz``/``.npy`` files, and folders of earlier builds.

Each case starts from SpikingJelly's ``events_np/`` layout (one ``.npz`` of events per sample,
in split and class folders), written here for N-MNIST's 34 x 34 sensor."""

from __future__ import annotations

import fcntl
import io
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from spikefuse import datasets
from spikefuse.datasets import building
from spikefuse.errors import SpikefuseError

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


# ---- damaged and foreign .npz files -------------------------------------------------------------
def _frames_of(root: Path) -> datasets.NMNIST:
    return datasets.NMNIST(root, True, "frame", **FRAMES)


def test_a_truncated_npz_is_named_with_how_to_make_it_again(tmp_path):
    sample = _events_np(tmp_path)
    sample.write_bytes(sample.read_bytes()[:100])
    named = rf"'{sample}' is damaged \(truncated\?\).*delete it and make it again"
    with pytest.raises(SpikefuseError, match=named):
        _frames_of(tmp_path)
    events = datasets.NMNIST(tmp_path, train=True)
    with pytest.raises(SpikefuseError, match=named):
        events[0]


def test_an_npz_without_an_event_array_names_the_keys_expected(tmp_path):
    sample = _events_np(tmp_path)
    np.savez(sample, **{k: v for k, v in _events().items() if k != "p"})
    named = rf"'{sample}' has no p \(its arrays: t, x, y\).*holds the arrays t, x, y and p"
    with pytest.raises(SpikefuseError, match=named):
        _frames_of(tmp_path)


@pytest.mark.parametrize(
    "events, problem",
    [
        ({**_events(), "x": np.arange(3)}, "1-d arrays of one length"),
        ({**_events(), "t": np.full(40, np.nan)}, "t has NaN"),
        ({**_events(), "y": np.array(["a"] * 40)}, "y holds <U1, not numbers"),
    ],
)
def test_events_that_cannot_be_integrated_are_named(tmp_path, events, problem):
    sample = _events_np(tmp_path)
    np.savez(sample, **events)
    with pytest.raises(SpikefuseError, match=rf"'{sample}'.*{problem}"):
        _frames_of(tmp_path)


def test_any_cut_or_flipped_byte_gives_a_spikefuse_error_or_the_events(tmp_path):
    path, original = tmp_path / "s.npz", _events()
    for save in (np.savez, np.savez_compressed):
        save(path, **original)
        good = path.read_bytes()
        variants = [good[:n] for n in range(0, len(good), 7)]
        for n in range(0, len(good), 5):
            variants.append(good[:n] + bytes([good[n] ^ 0xFF]) + good[n + 1 :])
        for data in variants:
            path.write_bytes(data)
            try:
                events = datasets.folder.load_events(path)
            except SpikefuseError as exc:
                assert str(path) in str(exc)
            else:  # a flipped byte of the zip directory can rename or hide an entry
                assert events and all(
                    np.array_equal(a, original[k]) for k, a in events.items() if k in original
                )


def test_an_array_header_is_checked_before_numpy_allocates_by_it(tmp_path):
    npy = io.BytesIO()  # a header declaring 2**40 float64 values, then 4 of them
    np.lib.format.write_array_header_1_0(
        npy, {"descr": "<f8", "fortran_order": False, "shape": (2**40,)}
    )
    npy.write(np.zeros(4).tobytes())
    path = tmp_path / "s.npz"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("frames.npy", npy.getvalue())
    declared = rf"'{path}' is damaged.*frames.npy declares 8796093022[0-9]{{3}} bytes; it has 160"
    with pytest.raises(SpikefuseError, match=declared):
        datasets.load_npz_frames(path)


def test_pickled_arrays_are_never_unpickled(tmp_path):
    path = tmp_path / "s.npz"
    np.savez(path, frames=np.array([{"a": 1}], dtype=object))
    with pytest.raises(SpikefuseError, match=rf"'{path}': frames.npy holds Python objects"):
        datasets.load_npz_frames(path)


def test_files_over_the_size_bound_are_refused_before_they_are_read(tmp_path, monkeypatch):
    path = tmp_path / "s.npz"
    np.savez_compressed(path, frames=np.zeros((50, 2, 34, 34)))  # 924 kB in ~1 kB
    monkeypatch.setattr(datasets.events, "MAX_FILE_BYTES", 100_000)
    with pytest.raises(SpikefuseError, match=rf"'{path}' declares 924[0-9]{{3}} bytes of arrays"):
        datasets.load_npz_frames(path)
    monkeypatch.setattr(datasets.events, "MAX_FILE_BYTES", 100)
    with pytest.raises(SpikefuseError, match=rf"'{path}' has [0-9]+ bytes, more than the 100"):
        datasets.load_npz_frames(path)
    (tmp_path / "a.aedat").write_bytes(b"#!AER-DAT3.1\r\n" + bytes(200))
    with pytest.raises(SpikefuseError, match="more than the 100"):  # every reader's bound
        datasets.load_aedat_v3(tmp_path / "a.aedat")


@pytest.mark.parametrize(
    "arrays, problem",
    [
        ({"counts": np.zeros((2, 2, 3, 3))}, r"has the arrays \['counts'\] but no 'frames'"),
        ({"frames": np.full((2, 2, 3, 3), np.nan)}, "NaN or infinite"),
        ({"frames": np.full((1,), 1e39)}, "beyond float32"),
        ({"frames": np.array(["a"])}, "<U1 frames, not numbers"),
    ],
)
def test_frames_files_hold_finite_frames(tmp_path, arrays, problem):
    np.savez(tmp_path / "f.npz", **arrays)
    with pytest.raises(SpikefuseError, match=rf"'{tmp_path / 'f.npz'}' .*{problem}"):
        datasets.load_npz_frames(tmp_path / "f.npz")


# ---- .npy samples -------------------------------------------------------------------------------
def _structured(events: dict[str, np.ndarray]) -> np.ndarray:
    array = np.zeros(events["t"].size, [(key, np.int64) for key in "txyp"])
    for key in "txyp":
        array[key] = events[key]
    return array


def test_npy_samples_are_read_as_spikingjelly_reads_them(tmp_path):
    sample = _events_np(tmp_path)
    events = _events(seed=7)
    np.save(sample.with_name("00001.npy"), _structured(events))
    data = datasets.NMNIST(tmp_path, train=True)
    assert len(data) == 3 and data.samples[1][0].endswith("00001.npy")
    array, label = data[1]  # the array as it is (SpikingJelly's _load_events)
    assert label == 0 and np.array_equal(array, _structured(events))
    frames = _frames_of(tmp_path)
    assert len(frames) == 3 and frames.samples[1][0].endswith("00001.npy.npz")  # np.savez's name
    want = datasets.integrate_events_by_fixed_frames_number(events, "number", 2, 34, 34)
    assert np.array_equal(frames[1][0], want.astype(np.float32))


def test_npy_without_event_fields_is_named_when_integrated(tmp_path):
    sample = _events_np(tmp_path)
    np.save(sample.with_name("00001.npy"), np.zeros((4, 40)))
    assert datasets.NMNIST(tmp_path, train=True)[1][0].shape == (4, 40)
    with pytest.raises(SpikefuseError, match=r"00001.npy' has no t, x, y, p \(its arrays: none"):
        _frames_of(tmp_path)


def test_npy_frames_are_read_and_checked(tmp_path):
    path = tmp_path / "f.npy"
    np.save(path, np.arange(12.0).reshape(1, 2, 2, 3))
    frames = datasets.load_npz_frames(path)
    assert frames.dtype == np.float32 and np.array_equal(frames.ravel(), np.arange(12.0))
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(SpikefuseError, match=rf"'{path}' is damaged.*its array declares 224"):
        datasets.load_npz_frames(path)
    np.save(path, np.full(3, np.inf))
    with pytest.raises(SpikefuseError, match="NaN or infinite"):
        datasets.load_npz_frames(path)


# ---- folders of earlier builds -------------------------------------------------------------------
def _partials(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if ".partial" in p.name)


def test_a_folder_that_is_not_a_builds_is_never_removed(tmp_path):
    _events_np(tmp_path)
    for name in (f"{FRAMES_DIR}.partial", f"{FRAMES_DIR}.partial-0123456789abcdef"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "mine.txt").write_text("not spikefuse's")
    assert len(_frames_of(tmp_path)) == 2
    for name in (f"{FRAMES_DIR}.partial", f"{FRAMES_DIR}.partial-0123456789abcdef"):
        assert (tmp_path / name / "mine.txt").read_text() == "not spikefuse's"


def test_a_failed_build_removes_its_folder_and_the_next_one_completes(tmp_path):
    sample = _events_np(tmp_path)
    good = sample.read_bytes()
    sample.write_bytes(good[:100])
    with pytest.raises(SpikefuseError, match="damaged"):
        _frames_of(tmp_path)
    assert _partials(tmp_path) == [] and not (tmp_path / FRAMES_DIR).exists()
    sample.write_bytes(good)
    assert len(_frames_of(tmp_path)) == 2 and _partials(tmp_path) == []
    assert not list((tmp_path / FRAMES_DIR).rglob(building.MARKER))
    (tmp_path / "plain").mkdir()  # the umask's permissions, as a plain folder's
    assert (tmp_path / FRAMES_DIR).stat().st_mode == (tmp_path / "plain").stat().st_mode


def test_a_killed_builds_folder_is_removed_and_a_running_ones_kept(tmp_path):
    _events_np(tmp_path)
    target = tmp_path / FRAMES_DIR
    killed = (  # a build that dies inside: no cleanup runs, the kernel drops its lock
        "import os, sys; from pathlib import Path; from spikefuse.datasets import building; "
        "building.build_atomically(Path(sys.argv[1]), lambda p: os._exit(3))"
    )
    assert subprocess.run([sys.executable, "-c", killed, str(target)]).returncode == 3
    [stale] = _partials(tmp_path)
    assert (tmp_path / stale / building.MARKER).is_file()
    running = tmp_path / f"{FRAMES_DIR}.partial-{'a' * 16}"
    other_host = tmp_path / f"{FRAMES_DIR}.partial-{'b' * 16}"
    for folder, host in ((running, socket.gethostname()), (other_host, "elsewhere")):
        folder.mkdir()
        (folder / building.MARKER).write_text(f"{host}\n1\n")
    with open(running / building.MARKER) as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as its building process holds it
        assert len(_frames_of(tmp_path)) == 2
    assert _partials(tmp_path) == sorted([running.name, other_host.name])


def test_a_target_completed_by_another_process_meanwhile_is_kept(tmp_path):
    target = tmp_path / "events_np"

    def build(into: Path) -> None:
        (into / "ours").mkdir()
        (target / "theirs").mkdir(parents=True)  # another rank renamed its build first

    building.build_atomically(target, build)
    assert [p.name for p in target.iterdir()] == ["theirs"] and _partials(tmp_path) == []


def test_ranks_building_the_same_frames_at_once_all_get_them(tmp_path):
    for split in ("train", "test"):
        for label in range(2):
            folder = tmp_path / "events_np" / split / str(label)
            folder.mkdir(parents=True)
            for i in range(30):
                np.savez(folder / f"{i:05d}.npz", **_events(seed=i))
    rank = (
        "import sys; from spikefuse import datasets; "
        "d = datasets.NMNIST(sys.argv[1], True, 'frame', frames_number=2, split_by='number'); "
        "print(len(d), d[45][1])"
    )
    ranks = [
        subprocess.Popen([sys.executable, "-c", rank, str(tmp_path)], stdout=subprocess.PIPE)
        for _ in range(3)
    ]
    assert [(r.communicate()[0], r.returncode) for r in ranks] == [(b"60 1\n", 0)] * 3
    assert _partials(tmp_path) == []


@pytest.mark.parametrize("folder", ["events_np", FRAMES_DIR])
def test_a_folder_spikingjelly_left_half_built_is_refused_and_kept(tmp_path, folder):
    _events_np(tmp_path)
    (tmp_path / FRAMES_DIR).mkdir()  # as SpikingJelly makes it, before integrating
    (tmp_path / f"{folder}.building").touch()
    with pytest.raises(SpikefuseError, match=rf"build of '{tmp_path / folder}' did not complete"):
        _frames_of(tmp_path)
    assert (tmp_path / folder).is_dir() and (tmp_path / f"{folder}.building").is_file()
