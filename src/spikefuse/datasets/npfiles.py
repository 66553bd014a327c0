"""The NumPy files of ``events_np/`` and of the frames folders, checked before they are read.

A sample is an ``.npy`` array or an ``.npz`` of arrays, told apart by their first bytes as
``np.load`` tells them (SpikingJelly's loaders call it). An ``.npy`` is read after its size and
header are checked. An ``.npz`` is a zip of ``.npy`` arrays, stored or compressed (``np.savez``
writes the first, SpikingJelly's ``np_savez`` the second by default). It is read only after its
size
(:func:`~.events.check_file`), its zip directory (only ``.npy`` entries, declaring at most
:data:`~.events.MAX_FILE_BYTES` in all) and each array's header (no Python objects, no more
data than its entry holds) are checked: numpy allocates an array by the size its header
declares, so a damaged header would otherwise allocate that much before failing. Nothing is
unpickled. A file that fails a check, or turns out damaged while it is read, is refused with a
:class:`~spikefuse.errors.SpikefuseError` naming it.
"""

from __future__ import annotations

import contextlib
import math
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import numpy as np

from ..errors import SpikefuseError
from . import events

__all__ = ["is_npy", "read_npy", "read_npz"]

# numpy's header readers by format version. 3.0 is 2.0's layout with a UTF-8 header: read as
# latin-1, only its field names change, not the shape or item size checked here.
_HEADER_READERS = {
    (1, 0): np.lib.format.read_array_header_1_0,
    (2, 0): np.lib.format.read_array_header_2_0,
    (3, 0): np.lib.format.read_array_header_2_0,
}
NPY_MAGIC = b"\x93NUMPY"
# What zipfile, zlib and numpy raise on damaged data (besides OSError, a failed read):
# encrypted entries raise RuntimeError, unknown compression methods NotImplementedError.
_DAMAGED = (zipfile.BadZipFile, zlib.error, EOFError, ValueError, RuntimeError, NotImplementedError)


def damaged(path: str | Path, what: str, why: str) -> SpikefuseError:
    """The error for a damaged ``what`` file (``why``), saying how to make it again."""
    return SpikefuseError(
        f"{what} file '{path}' is damaged (truncated?) or not a NumPy file as np.save and "
        f"np.savez write them ({why}). Replace it, or delete it and make it again: spikefuse "
        "makes a deleted events_np/ again from extract/ or download/, and a deleted frames "
        "folder from events_np/"
    )


def read_array(f: IO[bytes], size: int, path: str | Path, what: str, name: str) -> np.ndarray:
    """The array of the ``.npy`` data ``f`` (``size`` bytes, ``name`` in ``path``), read after
    its header is checked against ``size``."""
    version = np.lib.format.read_magic(f)
    reader = _HEADER_READERS.get(version)
    if reader is None:
        raise damaged(path, what, f"{name} is in NumPy format version {version}")
    shape, _, dtype = reader(f)
    if dtype.hasobject:
        raise SpikefuseError(
            f"{what} file '{path}': {name} holds Python objects, which only unpickling reads, "
            "and spikefuse unpickles nothing (it could run code); save numeric arrays"
        )
    declared = f.tell() + math.prod(shape) * dtype.itemsize
    if declared > size:
        raise damaged(path, what, f"{name} declares {declared} bytes; it has {size}")
    f.seek(0)
    return np.lib.format.read_array(f, allow_pickle=False)


def is_npy(path: str | Path, what: str) -> bool:
    """Whether ``path`` holds one ``.npy`` array (else it is read as an ``.npz``)."""
    events.check_file(path, what)
    try:
        with open(path, "rb") as f:
            return f.read(len(NPY_MAGIC)) == NPY_MAGIC
    except OSError as exc:
        raise events.cannot_read(path, what, exc) from exc


def read_npy(path: str | Path, what: str) -> np.ndarray:
    """The array of ``.npy`` file ``path``, checked as the module says; ``what`` names the
    file in errors ('events', 'frames')."""
    size = events.check_file(path, what)
    with _reading(path, what), open(path, "rb") as f:
        return read_array(f, size, path, what, "its array")


def read_npz(path: str | Path, what: str) -> dict[str, np.ndarray]:
    """The arrays of ``.npz`` file ``path`` by name (``np.load``'s keys), checked as the
    module says; ``what`` names the file in errors ('events', 'frames')."""
    events.check_file(path, what)
    with _reading(path, what), zipfile.ZipFile(path) as archive:
        entries = archive.infolist()
        _check_directory(entries, path, what)
        arrays = {}
        for entry in entries:
            with archive.open(entry) as f:
                arrays[entry.filename[: -len(".npy")]] = read_array(
                    f, entry.file_size, path, what, entry.filename
                )
        return arrays


@contextlib.contextmanager
def _reading(path: str | Path, what: str) -> Iterator[None]:
    """Turn what reading ``path`` raises into a SpikefuseError naming the file (an OS error's
    reason, or the file as damaged); a SpikefuseError passes as it is."""
    try:
        yield
    except SpikefuseError:
        raise
    except OSError as exc:
        raise events.cannot_read(path, what, exc) from exc
    except _DAMAGED as exc:
        raise damaged(path, what, f"{type(exc).__name__}: {exc}") from exc


def _check_directory(entries: list[zipfile.ZipInfo], path: str | Path, what: str) -> None:
    """Refuse entries that are not ``.npy`` arrays and more than MAX_FILE_BYTES of them."""
    for entry in entries:
        if not entry.filename.endswith(".npy"):
            raise damaged(path, what, f"it holds '{entry.filename}', not only .npy arrays")
    declared = sum(entry.file_size for entry in entries)
    if declared > events.MAX_FILE_BYTES:
        raise SpikefuseError(
            f"{what} file '{path}' declares {declared} bytes of arrays, more than the "
            f"{events.MAX_FILE_BYTES} (MAX_FILE_BYTES) a file of these data sets may have: it "
            "is not one of their files"
        )
