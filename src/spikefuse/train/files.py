"""Files a run writes: atomic replacement through fsynced temporary files, the checkpoint's
lock, and the removal of temporary files that dead runs left.

Every file is created exclusively (``O_EXCL``, which never follows a symbolic link), and only
a file that is provably spikefuse's is written into or removed: a lock file holding a lock
record, a temporary file holding what spikefuse writes there."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import stat
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

from spikefuse.errors import SpikefuseError, os_reason

# What a lock file holds: nothing else is ever taken over or removed as a lock.
_LOCK_RECORD = re.compile(rb"spikefuse checkpoint lock\npid ([1-9][0-9]{0,18})\n")
_MAX_LOCK_BYTES = 64  # a record has about 40
# An empty lock file may be one that another run has just created and not yet written its
# record into: it is looked at again this many times, this many seconds apart, before it
# counts as a file that is not ours.
_EMPTY_LOCK_LOOKS = 20
_EMPTY_LOCK_WAIT_S = 0.005
# Each attempt loses a race with another run (or sees an empty file); far more than races
# between a few runs take.
_LOCK_ATTEMPTS = 100
# The first bytes of a temporary file that tell whether spikefuse wrote it.
TEMP_HEAD_BYTES = 1 << 16
# Creates a file that does not exist yet: never one already there, nor a symlink's target.
_CREATE = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# Opens an existing file without following a symlink or blocking on a FIFO.
_EXISTING_FILE = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def temp_path(target: Path, pid: int) -> Path:
    """The temporary file process ``pid`` writes ``target`` through (same directory: the
    final rename is atomic)."""
    return target.with_name(f".{target.name}.{pid}.tmp")


def checkpoint_target(path: Path) -> Path:
    """Return the file that writing checkpoint ``path`` replaces: symlinks are followed, so
    a linked checkpoint is updated where the link points instead of being replaced."""
    try:
        return path.resolve()
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop before Python 3.13
        raise SpikefuseError(f"checkpoint path '{path}' cannot be resolved: {exc}") from exc


def create_temp_file(path: Path, target: Path, what: str) -> tuple[int, Path]:
    """Create this process's temporary file of ``target`` (``path`` as the user named it) and
    return its descriptor (open for writing) and path. Raises :class:`SpikefuseError` naming
    ``what`` where it cannot be created, or where a file of that name exists: it is not ours
    to truncate, and a symlink there is never followed."""
    tmp = temp_path(target, os.getpid())
    try:
        return os.open(tmp, os.O_WRONLY | _CREATE, 0o666), tmp
    except FileExistsError as exc:
        raise SpikefuseError(
            f"cannot write {what} '{path}': '{tmp}' exists and is not a temporary file of "
            f"this run; move it away ('{path}' is left as it was)"
        ) from exc
    except OSError as exc:
        raise SpikefuseError(
            f"cannot write {what} '{path}': {os_reason(exc)} ('{path}' is left as it was)"
        ) from exc


def replace_file(path: Path, data: bytes | memoryview, what: str) -> None:
    """Write ``data`` to ``path`` (or its symlink's target) atomically: through a fsynced
    temporary file renamed over it. A failure is a :class:`SpikefuseError` naming ``what``
    and the OS reason, and leaves ``path`` as it was."""
    target = checkpoint_target(path)
    fd, tmp = create_temp_file(path, target, what)
    try:
        with open(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)  # created above, so ours
        if isinstance(exc, OSError):
            raise SpikefuseError(
                f"cannot write {what} '{path}': {os_reason(exc)} ('{path}' is left as it was)"
            ) from exc
        raise


def lock_record(pid: int) -> bytes:
    """What the lock file of a run with process id ``pid`` holds."""
    return f"spikefuse checkpoint lock\npid {pid}\n".encode()


@contextlib.contextmanager
def checkpoint_lock(path: Path, target: Path) -> Iterator[None]:
    """Hold an exclusive lock on checkpoint ``target`` (``path`` as the user named it).

    The lock is ``flock`` on the sibling file ``.<name>.lock``, which holds a lock record
    naming the holder's pid. The kernel releases the lock when the process dies, so a killed
    run's lock file (a record that no process holds the lock on) is taken over. Raises
    :class:`SpikefuseError` when another run holds the lock, or when ``.<name>.lock`` is
    something else (a symlink, an empty or other file), which is then left as it is.
    """
    lock_path = target.with_name(f".{target.name}.lock")
    fd = _take_lock(path, lock_path)
    try:
        yield
    finally:
        try:
            if _names(lock_path, fd):  # still locked: no other run can be using it
                lock_path.unlink()
        finally:
            os.close(fd)


def _take_lock(path: Path, lock_path: Path) -> int:
    """The descriptor of ``lock_path`` locked by this process and holding its record."""
    empty_looks = 0
    try:
        for _ in range(_LOCK_ATTEMPTS):
            fd, created = _open_lock_file(path, lock_path)
            if fd is None:  # removed between our two opens
                continue
            try:
                outcome = _lock_opened(path, lock_path, fd, created)
            except BaseException:
                os.close(fd)
                raise
            if outcome == "locked":
                return fd
            os.close(fd)
            if outcome == "empty":
                if empty_looks == _EMPTY_LOCK_LOOKS:
                    raise _foreign_lock(path, lock_path, "an empty file")
                empty_looks += 1
                time.sleep(_EMPTY_LOCK_WAIT_S)
    except OSError as exc:
        raise SpikefuseError(
            f"cannot lock checkpoint '{path}' ('{lock_path}'): {os_reason(exc)}"
        ) from exc
    raise SpikefuseError(
        f"cannot lock checkpoint '{path}': '{lock_path}' kept changing (other runs starting "
        f"on it?); try again"
    )


def _lock_opened(
    path: Path, lock_path: Path, fd: int, created: bool
) -> Literal["locked", "retry", "empty"]:
    """Try to lock the lock file open as ``fd`` (``created`` by this process or not):
    ``"locked"`` where this process now holds it with its record, ``"retry"`` where the file
    changed meanwhile, ``"empty"`` where it is an empty file that no process holds. Raises
    :class:`SpikefuseError` where another run holds it, or it holds something else."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _LOCK_RECORD.fullmatch(_read_lock_file(fd))
        if holder and int(holder[1]) == os.getpid():
            # A file this process created, that another run is looking at or taking over
            # (as the record of a dead run, before this process locked it): look again.
            return "retry"
        raise SpikefuseError(
            f"checkpoint '{path}' is in use by another training run"
            + (f" (pid {holder[1].decode()})" if holder else "")
            + "; wait for it to finish or choose another --checkpoint"
        ) from None
    # Holding the lock, the file must still be the one named lock_path: the holder we raced
    # with may have removed it on exit, or taken it over as stale.
    if not _names(lock_path, fd):
        return "retry"
    if created:
        return "locked"
    content = _read_lock_file(fd)
    if _LOCK_RECORD.fullmatch(content):
        # No process holds the lock, so the run that wrote the record is gone (the pid it
        # names may since belong to another process). Its file is ours to remove.
        lock_path.unlink()
        return "retry"
    if content:
        raise _foreign_lock(path, lock_path, "a file of other contents")
    return "empty"


def _open_lock_file(path: Path, lock_path: Path) -> tuple[int | None, bool]:
    """Create ``lock_path`` holding this process's record, or else open the existing one
    (None where it has gone meanwhile); and whether it was created."""
    try:
        fd = os.open(lock_path, os.O_RDWR | _CREATE, 0o644)
    except FileExistsError:
        return _open_existing_lock(path, lock_path), False
    except OSError as exc:
        raise SpikefuseError(
            f"cannot write checkpoint '{path}': creating '{lock_path}' failed: {os_reason(exc)}"
        ) from exc
    record = lock_record(os.getpid())
    try:
        if os.write(fd, record) != len(record):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    except OSError as exc:
        try:
            if _names(lock_path, fd):  # ours, and holding no record: no run takes it over
                lock_path.unlink()
        finally:
            os.close(fd)
        raise SpikefuseError(
            f"cannot write checkpoint '{path}': writing '{lock_path}' failed: {os_reason(exc)}"
        ) from exc
    return fd, True


def _open_existing_lock(path: Path, lock_path: Path) -> int | None:
    """Open the existing lock file ``lock_path`` (None where it has gone); refuse one that is
    not a regular file, without following a symlink."""
    try:
        fd = os.open(lock_path, os.O_RDWR | _EXISTING_FILE)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if lock_path.is_symlink():
            raise _foreign_lock(path, lock_path, "a symbolic link") from exc
        if exc.errno == errno.EISDIR:
            raise _foreign_lock(path, lock_path, "a directory") from exc
        raise SpikefuseError(
            f"cannot lock checkpoint '{path}' ('{lock_path}'): {os_reason(exc)}"
        ) from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _foreign_lock(path, lock_path, "not a regular file")
    return fd


def _read_lock_file(fd: int) -> bytes:
    """The contents of lock file ``fd``, or a marker that is no record where it is too big
    to be one."""
    if os.fstat(fd).st_size > _MAX_LOCK_BYTES:
        return b"(too big)"
    return os.pread(fd, _MAX_LOCK_BYTES + 1, 0)


def _names(path: Path, fd: int) -> bool:
    """Whether ``path`` names the file open as ``fd`` (without following a symlink)."""
    try:
        return os.path.samestat(os.lstat(path), os.fstat(fd))
    except FileNotFoundError:
        return False


def _foreign_lock(path: Path, lock_path: Path, what: str) -> SpikefuseError:
    return SpikefuseError(
        f"cannot lock checkpoint '{path}': its lock file '{lock_path}' is {what}, not a lock "
        f"spikefuse wrote; refusing to use or remove it (remove it yourself if no training "
        f"run uses '{path}', or choose another --checkpoint)"
    )


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _holds_ours(path: Path, is_ours: Callable[[bytes], bool]) -> bool:
    """Whether ``path`` is a regular file (not a symlink) whose first bytes pass ``is_ours``."""
    try:
        fd = os.open(path, os.O_RDONLY | _EXISTING_FILE)
    except OSError:  # a symlink (ELOOP), or gone
        return False
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return False
        return is_ours(os.read(fd, min(info.st_size, TEMP_HEAD_BYTES)))
    finally:
        os.close(fd)


def remove_stale_temp_files(target: Path, is_ours: Callable[[bytes], bool]) -> None:
    """Remove the temporary files of saves of ``target`` by processes no longer alive, where
    their first bytes (``is_ours``) show that spikefuse wrote them.

    Only called under the checkpoint's lock, where no other run is writing ``target``; the
    pid check still spares the files of a live run that took no lock. Any other file named
    like one is left alone, with a warning; one named with this process's pid, which this
    run could not write ``target`` through, is a :class:`SpikefuseError`.
    """
    pattern = re.compile(rf"\.{re.escape(target.name)}\.(\d+)\.tmp")
    try:
        for entry in sorted(target.parent.iterdir()):
            match = pattern.fullmatch(entry.name)
            # A file named with our own pid is a leftover of an earlier process with our pid.
            if not match or (int(match[1]) != os.getpid() and _is_alive(int(match[1]))):
                continue
            if _holds_ours(entry, is_ours):
                entry.unlink()
            elif int(match[1]) == os.getpid():
                raise SpikefuseError(
                    f"cannot write '{target}': '{entry}', where this run would write it "
                    f"first, exists and is not a temporary file spikefuse wrote; move it away"
                )
            else:
                warnings.warn(
                    f"leaving '{entry}' alone: it is named like a temporary file of "
                    f"'{target}', but does not hold what spikefuse writes there",
                    stacklevel=2,
                )
    except OSError as exc:
        raise SpikefuseError(
            f"cannot clean up old temporary files of checkpoint '{target}': {os_reason(exc)}"
        ) from exc
