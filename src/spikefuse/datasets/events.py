"""Readers of the published event-file formats and SpikingJelly's frame integration.

Events are dicts of equal-length arrays: ``t`` (timestamps, µs), ``x``, ``y``, ``p``
(polarity 0/1). Frames are float64 ``[T, 2, H, W]``: channel 0 counts the events of polarity
0, channel 1 the others (SpikingJelly's ``integrate_events_*``). Every reader checks the file's
size (at most :data:`MAX_FILE_BYTES`) before reading and its header after, and raises
:class:`~spikefuse.errors.SpikefuseError` naming the file when it is missing, too large,
truncated or not in the format.
"""

from __future__ import annotations

import math
import operator
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import SpikefuseError, os_reason

__all__ = [
    "cal_fixed_frames_number_segment_index",
    "integrate_events_by_fixed_duration",
    "integrate_events_by_fixed_frames_number",
    "integrate_events_segment_to_frame",
    "load_ATIS_bin",
    "load_aedat_v3",
    "load_cifar10dvs_aedat",
]

Events = dict[str, np.ndarray]
AEDAT3_MAGIC = b"#!AER-DAT3"
AEDAT3_END = b"#!END-HEADER\r\n"
PACKET_HEADER = 28  # bytes of an AEDAT 3.1 event packet header
POLARITY_EVENT = 1
EVENT_KEYS = ("t", "x", "y", "p")
# The largest file a reader reads, and the most bytes of arrays an .npz may declare: far above
# any sample of these data sets (DVS128 Gesture's longest recordings have tens of MB of events).
MAX_FILE_BYTES = 2**32


def cannot_read(path: str | Path, what: str, exc: OSError) -> SpikefuseError:
    """The error for ``what`` file ``path`` that the OS failed to read (``exc``)."""
    return SpikefuseError(f"cannot read {what} file '{path}': {os_reason(exc)}")


def check_file(path: str | Path, what: str) -> int:
    """The size of ``what`` file ``path``, from the file system: refused (naming the file) when
    it is missing, unreadable, not a regular file or over :data:`MAX_FILE_BYTES`."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise SpikefuseError(f"{what} file '{path}' does not exist") from None
    except OSError as exc:
        raise cannot_read(path, what, exc) from exc
    if not stat.S_ISREG(info.st_mode):
        raise SpikefuseError(f"{what} file '{path}' is not a regular file")
    if info.st_size > MAX_FILE_BYTES:
        raise SpikefuseError(
            f"{what} file '{path}' has {info.st_size} bytes, more than the {MAX_FILE_BYTES} "
            "(MAX_FILE_BYTES) a file of these data sets may have: it is not one of their files"
        )
    return info.st_size


def _read(path: str | Path, what: str) -> bytes:
    check_file(path, what)
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise cannot_read(path, what, exc) from exc


def checked_events(events: Any, path: str | Path) -> Events:
    """The t, x, y and p of ``events`` (read from ``path``: a dict, or an ``.npy``'s array of
    those fields, which SpikingJelly integrates too), refused unless they are 1-d arrays of
    numbers, of one length, without NaN."""
    names = (events.dtype.names or ()) if isinstance(events, np.ndarray) else tuple(events)
    missing = [key for key in EVENT_KEYS if key not in names]
    if missing:
        raise SpikefuseError(
            f"events file '{path}' has no {', '.join(missing)} (its arrays: "
            f"{', '.join(names) or 'none with names'}); a sample of events_np/ holds the "
            "arrays t, x, y and p, as np.savez(path, t=..., x=..., y=..., p=...) writes them"
        )
    arrays = {key: np.asarray(events[key]) for key in EVENT_KEYS}
    shapes = {key: a.shape for key, a in arrays.items()}
    if any(a.ndim != 1 for a in arrays.values()) or len(set(shapes.values())) > 1:
        raise SpikefuseError(
            f"events file '{path}': t, x, y and p must be 1-d arrays of one length, not {shapes}"
        )
    for key, a in arrays.items():
        if a.dtype.kind not in "biuf":
            raise SpikefuseError(f"events file '{path}': {key} holds {a.dtype}, not numbers")
        if a.dtype.kind == "f" and not np.isfinite(a).all():
            raise SpikefuseError(f"events file '{path}': {key} has NaN or infinite values")
    return arrays


def _aedat3_packets(data: bytes, start: int, path: str | Path) -> list[np.ndarray]:
    """The [capacity, 2] uint32 (address, timestamp) rows of every polarity packet."""
    rows, offset = [], start
    while offset < len(data):
        if len(data) - offset < PACKET_HEADER:
            raise SpikefuseError(f"AEDAT 3.1 file '{path}' is truncated inside a packet header")
        header = np.frombuffer(data, "<u4", count=7, offset=offset)
        kind = int(np.frombuffer(data, "<u2", count=1, offset=offset)[0])
        size, overflow, capacity = int(header[1]), int(header[3]), int(header[4])
        end = offset + PACKET_HEADER + size * capacity
        if end > len(data):
            raise SpikefuseError(
                f"AEDAT 3.1 file '{path}' is truncated: a packet of {capacity} events of "
                f"{size} bytes ends past the file's {len(data)} bytes"
            )
        if kind == POLARITY_EVENT and capacity:
            if size < 8 or size % 4:
                raise SpikefuseError(f"AEDAT 3.1 file '{path}': polarity events of {size} bytes")
            words = np.frombuffer(data[offset + PACKET_HEADER : end], "<u4")
            packet = words.reshape(capacity, size // 4)[:, :2].astype(np.int64)
            packet[:, 1] |= overflow << 31
            rows.append(packet)
        offset = end
    return rows


def load_aedat_v3(file_name: str | Path) -> Events:
    """Polarity events of an AEDAT 3.1 file (DVS128 Gesture): x = bits 17-31 of the address,
    y = bits 2-16, p = bit 1, t = the timestamp | (packet overflow << 31), as SpikingJelly's
    ``load_aedat_v3`` reads them (every event, int64 arrays)."""
    data = _read(file_name, "AEDAT 3.1")
    if not data.startswith(AEDAT3_MAGIC):
        raise SpikefuseError(f"'{file_name}' is not an AEDAT 3.x file (no '#!AER-DAT3' header)")
    end = data.find(AEDAT3_END)
    if end < 0:
        raise SpikefuseError(f"AEDAT 3.1 file '{file_name}' has no '#!END-HEADER' line")
    packets = _aedat3_packets(data, end + len(AEDAT3_END), file_name)
    rows = np.concatenate(packets) if packets else np.zeros((0, 2), np.int64)
    address, t = rows[:, 0], rows[:, 1]
    return {
        "t": t,
        "x": (address >> 17) & 0x7FFF,
        "y": (address >> 2) & 0x7FFF,
        "p": (address >> 1) & 1,
    }


def _skip_header(data: bytes) -> int:
    """Bytes of the leading '#' lines (SpikingJelly's ``_skip_header``)."""
    offset = 0
    while offset < len(data):
        newline = data.find(b"\n", offset)
        line = data[offset : len(data) if newline < 0 else newline + 1]
        try:
            text = line.decode().strip()
        except UnicodeDecodeError:
            break
        if not text or text[0] != "#":
            break
        offset += len(line)
    return offset


def load_cifar10dvs_aedat(file_name: str | Path) -> Events:
    """Events of a CIFAR10-DVS ``.aedat`` file (AEDAT 2.0: '#' header lines, then big-endian
    (address, timestamp) uint32 pairs), in SpikingJelly's orientation: x = 127 - address bits
    8-14, y = 127 - bits 1-7, p = 1 - bit 0."""
    data = _read(file_name, "CIFAR10-DVS aedat")
    body = data[_skip_header(data) :]
    if len(body) % 8:
        raise SpikefuseError(
            f"CIFAR10-DVS file '{file_name}' is truncated: {len(body)} bytes of events are not "
            "a whole number of 8-byte (address, timestamp) records"
        )
    words = np.frombuffer(body, ">u4")
    address, t = words[::2].astype(np.uint32), words[1::2].astype(np.uint32)
    x = (address & 0xFE) >> 1
    y = (address & 0x7F00) >> 8
    return {"t": t, "x": 127 - y, "y": 127 - x, "p": 1 - (address & 1).astype(np.int64)}


def load_ATIS_bin(file_name: str | Path) -> Events:  # noqa: N802  # SpikingJelly's name
    """Events of an N-MNIST ``.bin`` file: 5 bytes each, x, y, then polarity (bit 7) and a
    23-bit timestamp (µs), as SpikingJelly's ``load_ATIS_bin`` reads them (uint32 arrays)."""
    raw = np.frombuffer(_read(file_name, "N-MNIST bin"), np.uint8).astype(np.uint32)
    if raw.size % 5:
        raise SpikefuseError(
            f"N-MNIST file '{file_name}' is truncated or not an ATIS .bin file: its {raw.size} "
            "bytes are not a whole number of 5-byte events"
        )
    b2 = raw[2::5]
    t = ((b2 & 127) << 16) | (raw[3::5] << 8) | raw[4::5]
    return {"t": t, "x": raw[0::5], "y": raw[1::5], "p": (b2 & 128) >> 7}


def integrate_events_segment_to_frame(
    x: np.ndarray,
    y: np.ndarray,
    p: np.ndarray,
    H: int,
    W: int,
    j_l: int = 0,
    j_r: int | None = None,
) -> np.ndarray:
    """Event counts of events ``j_l:j_r`` per (polarity, y, x): float64 [2, H, W]."""
    xs, ys = x[j_l:j_r].astype(np.int64), y[j_l:j_r].astype(np.int64)
    if xs.size and (xs.min() < 0 or xs.max() >= W or ys.min() < 0 or ys.max() >= H):
        raise SpikefuseError(
            f"events outside the {H} x {W} sensor (x in 0..{W - 1}, y in 0..{H - 1})"
        )
    position = (p[j_l:j_r] != 0).astype(np.int64) * H * W + ys * W + xs
    return np.bincount(position, minlength=2 * H * W).reshape(2, H, W).astype(float)


def segment_index(
    events_t: np.ndarray, split_by: str, frames_num: int, divide: Callable[[Any, int], Any]
) -> tuple[np.ndarray, np.ndarray]:
    """The slices of :func:`cal_fixed_frames_number_segment_index`, with the 'time' span
    ``divide(t[-1] - t[0], frames_num)`` (SpikingJelly divides with ``//`` for DVS events and
    with ``/`` for SHD's float times)."""
    if (
        isinstance(frames_num, bool)
        or not isinstance(frames_num, int | np.integer)
        or frames_num < 1
    ):
        raise SpikefuseError(f"frames_num must be a positive int, got {frames_num!r}")
    if split_by not in ("number", "time"):
        raise SpikefuseError(f"split_by must be 'time' or 'number', got {split_by!r}")
    n = events_t.size
    j_l, j_r = np.zeros(frames_num, dtype=int), np.zeros(frames_num, dtype=int)
    if split_by == "number":  # no events: every slice is empty (SpikingJelly's zero frames)
        di = n // frames_num
        j_l[:] = np.arange(frames_num) * di
        j_r[:] = j_l + di
    else:
        if n == 0:
            raise SpikefuseError("split_by='time' cannot slice a sample without events")
        dt = divide(events_t[-1] - events_t[0], frames_num)
        for i in range(frames_num):
            t_l = dt * i + events_t[0]
            inside = np.flatnonzero((events_t >= t_l) & (events_t < t_l + dt))
            if inside.size == 0:
                raise SpikefuseError(
                    f"split_by='time': frame {i} of {frames_num} has no events (SpikingJelly "
                    "fails here too); use fewer frames or split_by='number'"
                )
            j_l[i], j_r[i] = inside[0], inside[-1] + 1
    j_r[-1] = n
    return j_l, j_r


def cal_fixed_frames_number_segment_index(
    events_t: np.ndarray, split_by: str, frames_num: int
) -> tuple[np.ndarray, np.ndarray]:
    """Start and end indices of ``frames_num`` slices of N events: 'number' (slice j is
    [j * (N // M), (j + 1) * (N // M)), the rest in the last) or 'time' (the events in
    [t0 + j dt, t0 + (j + 1) dt) with dt = (t[-1] - t0) // M; the last slice runs to the end)."""
    return segment_index(events_t, split_by, frames_num, operator.floordiv)


def integrate_events_by_fixed_frames_number(
    events: Events, split_by: str, frames_num: int, H: int, W: int
) -> np.ndarray:
    """``frames_num`` frames [T, 2, H, W] (SpikingJelly's fixed-frames-number integration)."""
    j_l, j_r = cal_fixed_frames_number_segment_index(events["t"], split_by, frames_num)
    frames = np.zeros([frames_num, 2, H, W])
    for i in range(frames_num):
        frames[i] = integrate_events_segment_to_frame(
            events["x"], events["y"], events["p"], H, W, j_l[i], j_r[i]
        )
    return frames


def integrate_events_by_fixed_duration(events: Events, duration: int, H: int, W: int) -> np.ndarray:
    """Frames of ``duration`` µs each, ceil((t_max - t_min) / duration) of them (the last takes
    the events at t_max too): SpikingJelly's fixed-duration integration."""
    x, y, p = events["x"], events["y"], events["p"]
    t = events["t"].astype(np.int64)
    if t.size == 0:
        raise SpikefuseError("cannot integrate a sample without events into frames")
    t = t - t.min()
    frames_num = int(math.ceil(t[-1] / duration))
    if frames_num == 0:
        raise SpikefuseError("all events of the sample have one timestamp: no frame to fill")
    frames = np.zeros([frames_num, 2, H, W])
    frame_index = t // duration
    left = 0
    for i in range(frames_num - 1):
        right = int(np.searchsorted(frame_index, i + 1, side="left"))
        frames[i] = integrate_events_segment_to_frame(x, y, p, H, W, left, right)
        left = right
    frames[-1] = integrate_events_segment_to_frame(x, y, p, H, W, left, t.size)
    return frames
