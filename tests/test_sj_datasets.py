"""spikefuse.datasets' event-to-frame functions: small cases computed by hand, and exact
equality with SpikingJelly's own functions on synthetic event arrays where SpikingJelly is
importable (its ``spikingjelly.datasets`` imports torchvision, which a stand-in replaces for
the import when missing: the functions compared never call it)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from spikefuse import datasets
from spikefuse.datasets import shd
from spikefuse.errors import SpikefuseError

H, W = 2, 3
# Seven events; the 4th and the 7th share (p=1, y=1, x=0).
EVENTS = {
    "t": np.array([0, 10, 20, 30, 40, 50, 60]),
    "x": np.array([0, 1, 2, 0, 1, 2, 0]),
    "y": np.array([0, 0, 1, 1, 0, 1, 1]),
    "p": np.array([1, 0, 1, 1, 0, 0, 1]),
}


def _frames(*frames: list[tuple[int, int, int]], h: int = H, w: int = W) -> np.ndarray:
    """Frames from their (p, y, x) events, one list per frame."""
    out = np.zeros((len(frames), 2, h, w))
    for i, events in enumerate(frames):
        for p, y, x in events:
            out[i, p, y, x] += 1
    return out


# ---- hand-computed cases ----------------------------------------------------------------------
def test_segment_to_frame_counts_by_polarity_y_x():
    frame = datasets.integrate_events_segment_to_frame(EVENTS["x"], EVENTS["y"], EVENTS["p"], H, W)
    want = _frames([(1, 0, 0), (0, 0, 1), (1, 1, 2), (1, 1, 0), (0, 0, 1), (0, 1, 2), (1, 1, 0)])
    assert frame.dtype == np.float64 and np.array_equal(frame, want[0])
    assert frame[1, 1, 0] == 2 and frame[0, 0, 1] == 2  # repeated positions add up
    part = datasets.integrate_events_segment_to_frame(
        EVENTS["x"], EVENTS["y"], EVENTS["p"], H, W, 2, 4
    )
    assert np.array_equal(part, _frames([(1, 1, 2), (1, 1, 0)])[0])


def test_fixed_frames_number_split_by_number():
    # N = 7, M = 3: N // M = 2 events per frame, the last takes the other 3
    j_l, j_r = datasets.cal_fixed_frames_number_segment_index(EVENTS["t"], "number", 3)
    assert j_l.tolist() == [0, 2, 4] and j_r.tolist() == [2, 4, 7]
    got = datasets.integrate_events_by_fixed_frames_number(EVENTS, "number", 3, H, W)
    want = _frames(
        [(1, 0, 0), (0, 0, 1)], [(1, 1, 2), (1, 1, 0)], [(0, 0, 1), (0, 1, 2), (1, 1, 0)]
    )
    assert np.array_equal(got, want)


def test_fixed_frames_number_split_by_time():
    # M = 4: dt = (60 - 0) // 4 = 15; [0, 15) [15, 30) [30, 45) [45, 60), the last to the end
    j_l, j_r = datasets.cal_fixed_frames_number_segment_index(EVENTS["t"], "time", 4)
    assert j_l.tolist() == [0, 2, 3, 5] and j_r.tolist() == [2, 3, 5, 7]
    got = datasets.integrate_events_by_fixed_frames_number(EVENTS, "time", 4, H, W)
    want = _frames(
        [(1, 0, 0), (0, 0, 1)], [(1, 1, 2)], [(1, 1, 0), (0, 0, 1)], [(0, 1, 2), (1, 1, 0)]
    )
    assert np.array_equal(got, want)


def test_fixed_duration():
    # duration 25: ceil(60 / 25) = 3 frames, t // 25 = 0 0 0 1 1 2 2
    got = datasets.integrate_events_by_fixed_duration(EVENTS, 25, H, W)
    want = _frames(
        [(1, 0, 0), (0, 0, 1), (1, 1, 2)], [(1, 1, 0), (0, 0, 1)], [(0, 1, 2), (1, 1, 0)]
    )
    assert np.array_equal(got, want)
    shifted = {**EVENTS, "t": EVENTS["t"].astype(np.uint32) + 1000}  # times count from t_min
    assert np.array_equal(datasets.integrate_events_by_fixed_duration(shifted, 25, H, W), want)


def test_fewer_events_than_frames_and_no_events():
    two = {k: v[:2] for k, v in EVENTS.items()}
    got = datasets.integrate_events_by_fixed_frames_number(two, "number", 3, H, W)
    assert np.array_equal(got, _frames([], [], [(1, 0, 0), (0, 0, 1)]))  # N // M = 0
    none = {k: v[:0] for k, v in EVENTS.items()}
    got = datasets.integrate_events_by_fixed_frames_number(none, "number", 3, H, W)
    assert got.shape == (3, 2, H, W) and not got.any()  # SpikingJelly's zero frames
    with pytest.raises(SpikefuseError, match="without events"):
        datasets.integrate_events_by_fixed_frames_number(none, "time", 3, H, W)
    with pytest.raises(SpikefuseError, match="frame 1 of 4 has no events"):
        gap = {**EVENTS, "t": np.array([0, 1, 2, 3, 4, 5, 100])}
        datasets.integrate_events_by_fixed_frames_number(gap, "time", 4, H, W)
    with pytest.raises(SpikefuseError, match="frames_num must be a positive int"):
        datasets.cal_fixed_frames_number_segment_index(EVENTS["t"], "number", 0)


SHD_EVENTS = {  # times in s, units 0..699
    "t": np.array([0.0, 0.001, 0.0025, 0.004, 0.006, 0.01]),
    "x": np.array([3, 3, 699, 0, 5, 3]),
}


def _units(*frames: dict[int, int]) -> np.ndarray:
    out = np.zeros((len(frames), 700))
    for i, counts in enumerate(frames):
        for unit, n in counts.items():
            out[i, unit] = n
    return out


def test_shd_frames_by_number_time_and_duration():
    got = shd.integrate_shd_by_fixed_frames_number(SHD_EVENTS, "number", 4)
    assert np.array_equal(got, _units({3: 1}, {3: 1}, {699: 1}, {0: 1, 5: 1, 3: 1}))
    # 'time': dt = 0.01 / 2 (a float division for SHD): [0, 0.005) and the rest
    got = shd.integrate_shd_by_fixed_frames_number(SHD_EVENTS, "time", 2)
    assert np.array_equal(got, _units({3: 2, 699: 1, 0: 1}, {5: 1, 3: 1}))
    # duration in ms: 0 1 2.5 4 6 10 ms // 4 = 0 0 0 1 1 2, ceil(10 / 4) = 3 frames
    got = shd.integrate_shd_by_fixed_duration(SHD_EVENTS, 4)
    assert np.array_equal(got, _units({3: 2, 699: 1}, {0: 1, 5: 1}, {3: 1}))


# ---- against SpikingJelly's own functions -------------------------------------------------------
@pytest.fixture(scope="module")
def sj():
    """SpikingJelly's ``datasets.utils`` and ``datasets.shd`` (skips without SpikingJelly)."""
    if importlib.util.find_spec("spikingjelly") is None:
        pytest.skip("SpikingJelly is not importable")
    script = Path(__file__).resolve().parents[1] / "scripts" / "sj_dropin.py"
    spec = importlib.util.spec_from_file_location("sj_dropin_harness", script)
    assert spec is not None and spec.loader is not None
    harness = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = harness
    spec.loader.exec_module(harness)
    with harness.stand_ins():
        from spikingjelly.datasets import shd as sj_shd
        from spikingjelly.datasets import utils as sj_utils
    return sj_utils, sj_shd


def _random_events(rng, n: int, h: int, w: int, dtype) -> dict[str, np.ndarray]:
    t = np.sort(rng.integers(0, 50_000, n)).astype(dtype)
    return {
        "t": t,
        "x": rng.integers(0, w, n).astype(dtype),
        "y": rng.integers(0, h, n).astype(dtype),
        "p": rng.integers(0, 2, n).astype(dtype),
    }


def _same_result(theirs, ours, *args):
    """Equal arrays of equal dtype, or both raise."""
    try:
        want = theirs(*args)
    except (IndexError, ValueError):
        with pytest.raises(SpikefuseError):
            ours(*args)
        return 0
    got = ours(*args)
    for a, b in zip(want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,), strict=True):  # fmt: skip
        assert a.dtype == b.dtype and np.array_equal(a, b)
    return 1


@pytest.mark.parametrize("dtype", [np.int64, np.uint32, np.uint16])
def test_frames_equal_spikingjellys(sj, dtype):
    sj_utils, _ = sj
    rng = np.random.default_rng(3)
    compared = 0
    for h, w, n in ((34, 34, 400), (128, 128, 900), (2, 3, 5), (4, 4, 1)):
        ev = _random_events(rng, n, h, w, dtype)
        for frames in (1, 2, 5, 8):
            for split_by in ("number", "time"):
                args = (ev, split_by, frames, h, w)
                compared += _same_result(
                    sj_utils.integrate_events_by_fixed_frames_number,
                    datasets.integrate_events_by_fixed_frames_number,
                    *args,
                )
                compared += _same_result(
                    sj_utils.cal_fixed_frames_number_segment_index,
                    datasets.cal_fixed_frames_number_segment_index,
                    ev["t"],
                    split_by,
                    frames,
                )
        # 1 µs frames only on the small sensors: 50 000 frames of 128 x 128 would not fit in memory
        for duration in (1, 700, 5_000, 60_000) if h * w < 100 else (700, 5_000, 60_000):
            compared += _same_result(
                sj_utils.integrate_events_by_fixed_duration,
                datasets.integrate_events_by_fixed_duration,
                ev,
                duration,
                h,
                w,
            )
        for j_l, j_r in ((0, None), (1, n // 2), (n // 2, n)):
            want = sj_utils.integrate_events_segment_to_frame(ev["x"], ev["y"], ev["p"], h, w, j_l, j_r)  # fmt: skip
            got = datasets.integrate_events_segment_to_frame(ev["x"], ev["y"], ev["p"], h, w, j_l, j_r)  # fmt: skip
            assert np.array_equal(got, want) and got.dtype == want.dtype
    assert compared > 60


def test_zero_events_by_number_equal_spikingjellys(sj):
    sj_utils, _ = sj
    none = {k: np.zeros(0, np.int64) for k in "txyp"}
    want = sj_utils.integrate_events_by_fixed_frames_number(none, "number", 4, 5, 6)
    assert np.array_equal(datasets.integrate_events_by_fixed_frames_number(none, "number", 4, 5, 6), want)  # fmt: skip


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_shd_frames_equal_spikingjellys(sj, dtype):
    _, sj_shd = sj
    rng = np.random.default_rng(4)
    for n in (1, 7, 300):
        ev = {
            "t": np.sort(rng.random(n) * 1.2).astype(dtype),
            "x": rng.integers(0, 700, n).astype(np.uint16),
        }
        for frames in (1, 3, 10):
            for split_by in ("number", "time"):
                _same_result(
                    lambda e, s, f: sj_shd._integrate_events_by_fixed_frames_number(e, s, f, 700),
                    shd.integrate_shd_by_fixed_frames_number,
                    ev,
                    split_by,
                    frames,
                )
        for duration in (1, 30, 500):
            _same_result(
                lambda e, d: sj_shd._integrate_events_by_fixed_duration(e, d, 700),
                shd.integrate_shd_by_fixed_duration,
                ev,
                duration,
            )


def test_atis_reader_and_npz_loader_equal_spikingjellys(sj, tmp_path):
    sj_utils, _ = sj
    rng = np.random.default_rng(5)
    n = 50
    x, y, p = rng.integers(0, 34, n), rng.integers(0, 34, n), rng.integers(0, 2, n)
    t = np.sort(rng.integers(0, 1 << 23, n))
    raw = np.stack([x, y, (p << 7) | (t >> 16), (t >> 8) & 255, t & 255], 1).astype(np.uint8)
    (tmp_path / "a.bin").write_bytes(raw.tobytes())
    want, got = (
        sj_utils.load_ATIS_bin(tmp_path / "a.bin"),
        datasets.load_ATIS_bin(tmp_path / "a.bin"),
    )
    for key in "txyp":
        assert got[key].dtype == want[key].dtype and np.array_equal(got[key], want[key]), key
    frames = datasets.integrate_events_by_fixed_frames_number(got, "number", 3, 34, 34)
    np.savez_compressed(tmp_path / "f.npz", frames=frames)
    loaded, theirs = datasets.load_npz_frames(tmp_path / "f.npz"), sj_utils.load_npz_frames(tmp_path / "f.npz")  # fmt: skip
    assert loaded.dtype == theirs.dtype == np.float32 and np.array_equal(loaded, theirs)


@pytest.fixture(scope="module")
def sj_base(sj):
    """SpikingJelly's ``datasets.base`` (its event loader), imported as ``sj`` imports the
    others."""
    with sys.modules["sj_dropin_harness"].stand_ins():
        from spikingjelly.datasets import base
    return base


def test_npy_sample_reads_and_integrates_as_spikingjellys(sj, sj_base, tmp_path):
    sj_utils, _ = sj
    rng = np.random.default_rng(6)
    events = np.zeros(60, [(key, np.int64) for key in "txyp"])
    events["t"] = np.sort(rng.integers(0, 10_000, 60))
    events["x"], events["y"], events["p"] = (rng.integers(0, n, 60) for n in (34, 34, 2))
    sample = tmp_path / "events_np" / "train" / "3" / "00000.npy"
    sample.parent.mkdir(parents=True)
    np.save(sample, events)
    theirs, ours = sj_base._load_events(sample), datasets.folder.load_events(sample)
    assert type(ours) is type(theirs) is np.ndarray
    assert ours.dtype == theirs.dtype and np.array_equal(ours, theirs)
    (tmp_path / "sj").mkdir()
    sj_utils.integrate_events_file_to_frames_file_by_fixed_frames_number(
        sj_base._load_events, str(sample), str(tmp_path / "sj"), "number", 3, 34, 34
    )
    (tmp_path / "events_np" / "test" / "3").mkdir(parents=True)
    frames = datasets.NMNIST(tmp_path, True, "frame", frames_number=3, split_by="number")
    written = [p.name for p in (tmp_path / "sj").iterdir()]
    assert [Path(path).name for path, _ in frames.samples] == written == ["00000.npy.npz"]
    assert np.array_equal(frames[0][0], sj_utils.load_npz_frames(tmp_path / "sj" / written[0]))
