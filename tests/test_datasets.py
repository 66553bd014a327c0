"""spikefuse.datasets on small files written here in each published format.

The expected frames come from a per-event reference of SpikingJelly's integration (written
from its semantics), computed from the events the files were written with."""

from __future__ import annotations

import io
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest

from spikefuse import datasets
from spikefuse.errors import SpikefuseError

RNG = np.random.default_rng(0)


# ---- reference integration (SpikingJelly's semantics, one event at a time) ---------------------
def _slices(
    t: np.ndarray, split_by: str, frames: int, float_dt: bool = False
) -> list[tuple[int, int]]:
    n = t.size
    if split_by == "number":
        di = n // frames
        bounds = [(i * di, i * di + di) for i in range(frames)]
    else:
        dt = (t[-1] - t[0]) / frames if float_dt else (int(t[-1]) - int(t[0])) // frames
        bounds = []
        for i in range(frames):
            lo = dt * i + t[0]
            idx = [j for j in range(n) if lo <= t[j] < lo + dt]
            bounds.append((idx[0], idx[-1] + 1))
    bounds[-1] = (bounds[-1][0], n)
    return bounds


def _reference_frames(ev: dict, split_by: str, frames: int, H: int, W: int) -> np.ndarray:
    out = np.zeros((frames, 2, H, W))
    for i, (lo, hi) in enumerate(_slices(ev["t"], split_by, frames)):
        for j in range(lo, hi):
            out[i, int(ev["p"][j] != 0), ev["y"][j], ev["x"][j]] += 1
    return out


def _reference_duration(ev: dict, duration: int, H: int, W: int) -> np.ndarray:
    t = ev["t"].astype(np.int64) - ev["t"].min()
    count = int(np.ceil(t[-1] / duration))
    out = np.zeros((count, 2, H, W))
    for j in range(t.size):
        out[min(t[j] // duration, count - 1), int(ev["p"][j] != 0), ev["y"][j], ev["x"][j]] += 1
    return out


def _events(n: int, H: int, W: int, t0: int = 1000, span: int = 100_000) -> dict:
    t = np.sort(RNG.integers(t0, t0 + span, n))
    t[0], t[-1] = t0, t0 + span  # events at both ends: every time slice has some
    t = np.sort(np.concatenate([t, np.linspace(t0, t0 + span, 64).astype(np.int64)]))
    m = t.size
    return {
        "t": t,
        "x": RNG.integers(0, W, m),
        "y": RNG.integers(0, H, m),
        "p": RNG.integers(0, 2, m),
    }


# ---- writers of the published formats ---------------------------------------------------------
def _aedat3(ev: dict, packet: int = 50) -> bytes:
    out = io.BytesIO()
    out.write(b"#!AER-DAT3.1\r\n#Format: RAW\r\n#Source 1: DVS128\r\n#!END-HEADER\r\n")
    # a special-event packet (type 2), which the reader skips
    out.write(np.array([2, 1], "<u2").tobytes())
    out.write(np.array([8, 4, 0, 1, 1, 1], "<u4").tobytes() + np.zeros(2, "<u4").tobytes())
    for s in range(0, ev["t"].size, packet):
        sl = slice(s, s + packet)
        addr = (ev["x"][sl] << 17) | (ev["y"][sl] << 2) | (ev["p"][sl] << 1) | 1
        n = addr.size
        out.write(np.array([1, 1], "<u2").tobytes())
        out.write(np.array([8, 4, 0, n, n, n], "<u4").tobytes())
        out.write(np.stack([addr, ev["t"][sl]], 1).astype("<u4").tobytes())
    return out.getvalue()


def _gesture_download(root: Path) -> dict:
    """DvsGesture.tar.gz with two recordings (train, test) of two gestures each."""
    buf, samples = io.BytesIO(), {}
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:

        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(f"DvsGesture/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))

        for split, user in (("train", "user01_fluorescent"), ("test", "user24_led")):
            ev = _events(800, 128, 128, span=400_000)
            add(f"{user}.aedat", _aedat3(ev))
            rows = [(3, 1000, 200_000), (11, 200_000, 401_000)]
            add(
                f"{user}_labels.csv",
                (
                    "class,startTime_usec,endTime_usec\n"
                    + "".join(f"{c},{a},{b}\n" for c, a, b in rows)
                ).encode(),
            )
            add(f"trials_to_{split}.txt", f"{user}.aedat\n".encode())
            for c, a, b in rows:
                mask = (ev["t"] >= a) & (ev["t"] < b)
                samples[(split, c - 1)] = {k: v[mask] for k, v in ev.items()}
    (root / "download").mkdir(parents=True)
    (root / "download" / "DvsGesture.tar.gz").write_bytes(buf.getvalue())
    return samples


def test_dvs128_gesture_events_and_frames_from_the_archive(tmp_path):
    samples = _gesture_download(tmp_path)
    train = datasets.DVS128Gesture(tmp_path, train=True, data_type="event")
    assert len(train) == 2 and train.classes[:3] == ["0", "1", "10"]  # DatasetFolder's order
    events, label = train[0]  # class folder '10' sorts before '2'
    assert label == 2 and train.classes[label] == "10"
    for key in "txyp":
        assert np.array_equal(events[key], samples[("train", 10)][key])
    for split_by in ("number", "time"):
        frames = datasets.DVS128Gesture(
            tmp_path, False, "frame", frames_number=4, split_by=split_by
        )
        got, label = frames[1]
        assert (
            frames.classes[label] == "2"
            and got.dtype == np.float32
            and got.shape == (4, 2, 128, 128)
        )
        want = _reference_frames(samples[("test", 2)], split_by, 4, 128, 128)
        assert np.array_equal(got, want.astype(np.float32))
    timed = datasets.DVS128Gesture(tmp_path, True, "frame", duration=50_000)
    got, _ = timed[1]
    assert np.array_equal(got, _reference_duration(samples[("train", 2)], 50_000, 128, 128))
    assert (tmp_path / "frames_number_4_split_by_time" / "test" / "2").is_dir()


def test_frames_are_cached(tmp_path):
    _gesture_download(tmp_path)
    first = datasets.DVS128Gesture(tmp_path, True, "frame", frames_number=2, split_by="number")
    path = Path(first.samples[0][0])
    np.savez(path, frames=np.full((2, 2, 128, 128), 7.0))
    again = datasets.DVS128Gesture(tmp_path, True, "frame", frames_number=2, split_by="number")
    assert (again[0][0] == 7.0).all()  # read from the cache, not integrated again


def _cifar10dvs_aedat(ev: dict) -> bytes:
    x_raw, y_raw, p_raw = 127 - ev["y"], 127 - ev["x"], 1 - ev["p"]
    address = (y_raw << 8) | (x_raw << 1) | p_raw
    body = np.stack([address, ev["t"]], 1).astype(">u4").tobytes()
    return b"#!AER-DAT2.0\r\n# This is a raw AE data file\r\n" + body


def test_cifar10_dvs_reads_aedat2_in_spikingjelly_orientation(tmp_path):
    (tmp_path / "download").mkdir()
    want = {}
    for i, name in enumerate(datasets.CIFAR10DVS_CLASS_NAMES):
        ev = _events(300, 128, 128)
        want[i] = ev
        with zipfile.ZipFile(tmp_path / "download" / f"{name}.zip", "w") as z:
            z.writestr(f"{name}/cifar10_{name}_0.aedat", _cifar10dvs_aedat(ev))
    data = datasets.CIFAR10DVS(tmp_path)
    assert len(data) == 10 and data.classes == list(datasets.CIFAR10DVS_CLASS_NAMES)
    events, label = data[3]
    for key in "txyp":
        assert np.array_equal(events[key], want[3][key])
    frames = datasets.CIFAR10DVS(tmp_path, data_type="frame", frames_number=3, split_by="time")
    got, label = frames[5]
    assert np.array_equal(got, _reference_frames(want[5], "time", 3, 128, 128).astype(np.float32))


def _atis(ev: dict) -> bytes:
    t = ev["t"]
    cols = [ev["x"], ev["y"], (ev["p"] << 7) | ((t >> 16) & 127), (t >> 8) & 255, t & 255]
    return np.stack(cols, 1).astype(np.uint8).tobytes()


def test_nmnist_reads_atis_bin(tmp_path):
    (tmp_path / "download").mkdir()
    want = {}
    for split in ("Train", "Test"):
        with zipfile.ZipFile(tmp_path / "download" / f"{split}.zip", "w") as z:
            for digit in range(10):
                ev = _events(200, 34, 34, t0=0, span=300_000)
                want[(split, digit)] = ev
                z.writestr(f"{split}/{digit}/{digit:05d}.bin", _atis(ev))
    test = datasets.NMNIST(tmp_path, train=False)
    events, label = test[7]
    assert label == 7 and all(np.array_equal(events[k], want[("Test", 7)][k]) for k in "txyp")
    frames = datasets.NMNIST(tmp_path, True, "frame", frames_number=5, split_by="number")
    got, label = frames[4]
    assert np.array_equal(
        got, _reference_frames(want[("Train", 4)], "number", 5, 34, 34).astype(np.float32)
    )


def _write_shd(path: Path, samples: list[tuple[np.ndarray, np.ndarray, int]]) -> None:
    h5py = pytest.importorskip("h5py")
    with h5py.File(path, "w") as f:
        times = f.create_dataset("spikes/times", (len(samples),), dtype=h5py.vlen_dtype(np.float32))
        units = f.create_dataset("spikes/units", (len(samples),), dtype=h5py.vlen_dtype(np.uint16))
        for i, (t, u, _) in enumerate(samples):
            times[i], units[i] = t, u
        f.create_dataset("labels", data=np.array([s[2] for s in samples], np.uint8))


def test_shd_events_and_frames(tmp_path):
    pytest.importorskip("h5py")
    (tmp_path / "extract").mkdir()
    made = {}
    for split in ("train", "test"):
        samples = []
        for i in range(3):
            t = np.sort(RNG.uniform(0, 0.9, 400)).astype(np.float32)
            t[0], t[-1] = 0.0, 0.9
            samples.append((t, RNG.integers(0, 700, 400).astype(np.uint16), (i * 7) % 20))
        made[split] = samples
        _write_shd(tmp_path / "extract" / f"shd_{split}.h5", samples)
    data = datasets.SHD(tmp_path, train=True)
    events, label = data[1]
    assert label == 7 and np.array_equal(events["x"], made["train"][1][1])
    frames = datasets.SpikingHeidelbergDigits(
        tmp_path, False, "frame", frames_number=6, split_by="time"
    )
    t, u, lab = made["test"][2]
    got = next(f for f, target in frames if frames.classes[target] == str(lab))
    want = np.zeros((6, 700))
    for i, (lo, hi) in enumerate(_slices(t, "time", 6, float_dt=True)):
        np.add.at(want[i], u[lo:hi].astype(int), 1)
    assert np.array_equal(got, want.astype(np.float32))


# ---- errors -----------------------------------------------------------------------------------
def test_missing_files_say_where_to_put_them(tmp_path):
    with pytest.raises(
        SpikefuseError, match=r"missing DvsGesture.tar.gz in .*download.*downloads nothing"
    ):
        datasets.DVS128Gesture(tmp_path / "nowhere")
    with pytest.raises(SpikefuseError, match="Train.zip, Test.zip"):
        datasets.NMNIST(tmp_path / "n")


def test_corrupt_files_are_refused(tmp_path):
    good = _aedat3(_events(10, 128, 128))
    (tmp_path / "cut.aedat").write_bytes(good[:-5])
    with pytest.raises(SpikefuseError, match="truncated"):
        datasets.load_aedat_v3(tmp_path / "cut.aedat")
    (tmp_path / "not.aedat").write_bytes(b"hello")
    with pytest.raises(SpikefuseError, match="not an AEDAT 3"):
        datasets.load_aedat_v3(tmp_path / "not.aedat")
    (tmp_path / "cut.bin").write_bytes(b"\x00" * 7)
    with pytest.raises(SpikefuseError, match="5-byte events"):
        datasets.load_ATIS_bin(tmp_path / "cut.bin")
    (tmp_path / "extract").mkdir()
    (tmp_path / "extract" / "shd_train.h5").write_bytes(b"not hdf5")
    (tmp_path / "extract" / "shd_test.h5").write_bytes(b"not hdf5")
    with pytest.raises(SpikefuseError, match="not an HDF5 file"):
        datasets.SHD(tmp_path)


def test_settings_are_validated(tmp_path):
    with pytest.raises(SpikefuseError, match="split_by must be"):
        datasets.NMNIST(tmp_path, True, "frame", frames_number=4, split_by="space")
    with pytest.raises(SpikefuseError, match="exactly one of"):
        datasets.NMNIST(tmp_path, True, "frame", frames_number=4, duration=10, split_by="time")
    with pytest.raises(SpikefuseError, match="train must be True or False"):
        datasets.DVS128Gesture(tmp_path, train=None)


# ---- spikefuse train --data <neuromorphic> -----------------------------------------------------
def _nmnist_extract(root: Path, per_class: int = 2) -> None:
    for split in ("Train", "Test"):
        for digit in range(10):
            folder = root / "extract" / split / str(digit)
            folder.mkdir(parents=True)
            for k in range(per_class):
                (folder / f"{k:05d}.bin").write_bytes(_atis(_events(60, 34, 34, t0=0, span=50_000)))


def test_train_loads_neuromorphic_frames(tmp_path):
    from spikefuse.train.data import load_neuromorphic

    _nmnist_extract(tmp_path)
    data = load_neuromorphic("n-mnist", tmp_path, T=3, seed=0)
    assert data.x_train.shape == (20, 3, 2, 34, 34) and data.y_test.shape == (20,)
    frames, label = datasets.NMNIST(tmp_path, True, "frame", frames_number=3, split_by="number")[5]
    assert np.array_equal(data.x_train[5].numpy(), frames) and int(data.y_train[5]) == label
    limited = load_neuromorphic("n-mnist", tmp_path, T=3, seed=0, limit=10)
    assert len(limited.y_train) == 10 and len(limited.y_test) == 10


def test_spikefuse_train_runs_on_n_mnist(tmp_path, capsys):
    from spikefuse.cli import main

    _nmnist_extract(tmp_path / "nmnist")
    args = ["train", "--epochs", "1", "--T", "2", "--batch-size", "5", "--quiet", "--device", "cpu"]
    args += ["--data", "n-mnist", "--data-dir", str(tmp_path / "nmnist")]
    assert main([*args, "--checkpoint", str(tmp_path / "run.pt")]) == 0
    assert "train/test samples: 20/20" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["train", "--data", "shd", "--checkpoint", str(tmp_path / "x.pt")])
    assert "--data shd needs --data-dir" in capsys.readouterr().err


# ---- against SpikingJelly itself, where it is importable ---------------------------------------
def test_integration_equals_spikingjellys():
    sj = pytest.importorskip("spikingjelly.datasets")
    ev = _events(500, 34, 34)
    for split_by in ("number", "time"):
        want = sj.integrate_events_by_fixed_frames_number(ev, split_by, 6, 34, 34)
        got = datasets.integrate_events_by_fixed_frames_number(ev, split_by, 6, 34, 34)
        assert np.array_equal(got, want)
    want = sj.integrate_events_by_fixed_duration(ev, 7_000, 34, 34)
    assert np.array_equal(datasets.integrate_events_by_fixed_duration(ev, 7_000, 34, 34), want)
