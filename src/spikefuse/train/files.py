"""Files a run writes: atomic replacement through fsynced temporary files, the checkpoint's
lock, and the removal of temporary files that dead runs left."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
from collections.abc import Iterator
from pathlib import Path

from spikefuse.errors import SpikefuseError


def os_reason(exc: OSError) -> str:
    return exc.strerror or str(exc) or type(exc).__name__


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


def replace_file(path: Path, data: bytes | memoryview, what: str) -> None:
    """Write ``data`` to ``path`` (or its symlink's target) atomically: through a fsynced
    temporary file renamed over it. A failure is a :class:`SpikefuseError` naming ``what``
    and the OS reason, and leaves ``path`` as it was."""
    target = checkpoint_target(path)
    tmp = temp_path(target, os.getpid())
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise SpikefuseError(
                f"cannot write {what} '{path}': {os_reason(exc)} ('{path}' is left as it was)"
            ) from exc
        raise


@contextlib.contextmanager
def checkpoint_lock(path: Path, target: Path) -> Iterator[None]:
    """Hold an exclusive lock on checkpoint ``target`` (``path`` as the user named it).

    The lock is ``flock`` on the sibling file ``.<name>.lock``, which the kernel releases
    when the process dies, so a killed run never leaves a stale lock. Raises
    :class:`SpikefuseError` when another run holds it.
    """
    lock_path = target.with_name(f".{target.name}.lock")
    while True:
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise SpikefuseError(
                f"cannot write checkpoint '{path}': creating '{lock_path}' failed: {os_reason(exc)}"
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.read(fd, 32).decode(errors="replace").strip()
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise SpikefuseError(
                    f"cannot lock checkpoint '{path}' ('{lock_path}'): {os_reason(exc)}"
                ) from exc
            raise SpikefuseError(
                f"checkpoint '{path}' is in use by another training run"
                + (f" (pid {holder})" if holder.isdigit() else "")
                + "; wait for it to finish or choose another --checkpoint"
            ) from None
        # The holder we waited on removes the lock file on exit; if that happened between
        # our open and flock, we hold a lock on a deleted file: try again.
        try:
            current = os.stat(lock_path)
        except FileNotFoundError:
            current = None
        if current is not None and os.path.samestat(current, os.fstat(fd)):
            break
        os.close(fd)
    try:
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())  # named in the refusal of other runs
        except OSError as exc:
            raise SpikefuseError(
                f"cannot write checkpoint '{path}': writing '{lock_path}' failed: {os_reason(exc)}"
            ) from exc
        yield
    finally:
        lock_path.unlink(missing_ok=True)  # still locked: no other run can be using it
        os.close(fd)


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_temp_files(target: Path) -> None:
    """Remove the temporary files of saves of ``target`` by processes no longer alive.

    Only called under the checkpoint's lock, where no other run is writing ``target``; the
    pid check still spares the files of a live run that took no lock.
    """
    pattern = re.compile(rf"\.{re.escape(target.name)}\.(\d+)\.tmp")
    try:
        for entry in target.parent.iterdir():
            match = pattern.fullmatch(entry.name)
            # A file named with our own pid is a leftover of an earlier process with our pid.
            if match and (int(match[1]) == os.getpid() or not _is_alive(int(match[1]))):
                entry.unlink(missing_ok=True)
    except OSError as exc:
        raise SpikefuseError(
            f"cannot clean up old temporary files of checkpoint '{target}': {os_reason(exc)}"
        ) from exc
