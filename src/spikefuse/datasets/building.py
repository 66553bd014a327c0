"""Folders built whole (``extract/``, ``events_np/``, the frames folders): a build runs in a new
folder next to its target and is renamed to the target when complete, so that an interrupted
build is redone, never read.

The new folder, ``<target>.partial-<16 hex digits>``, is provably a build's: its name is fresh
and random, and before anything is written into it, it gets the marker file
``.spikefuse-partial`` naming this host, on which the building process holds an exclusive
``flock`` until the folder is renamed (the marker is removed first) or, when the build fails,
removed. The kernel releases the lock when the process dies. So a later build removes only
folders of that name whose marker names this host and can be locked: leftovers of builds that
were killed. Folders without the marker (made by anyone else), of other hosts (locks may not
reach across a network file system) or of a build still running (another rank of the same
training run, say) are never touched.
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import shutil
import socket
import stat
from collections.abc import Callable
from pathlib import Path

from ..errors import SpikefuseError, os_reason

__all__ = ["MARKER", "build_atomically", "remove_stale_partials"]

MARKER = ".spikefuse-partial"
_PARTIAL = re.compile(r"\.partial-[0-9a-f]{16}")


def build_atomically(target: Path, build: Callable[[Path], None]) -> None:
    """Run ``build`` into a new folder next to ``target`` and rename that to ``target`` when
    ``build`` returns (if another process completed ``target`` meanwhile, its folder is kept
    and this one removed). A build that raises removes its folder. Leftovers of killed builds
    of ``target`` on this host are removed first."""
    remove_stale_partials(target)
    partial, lock = _new_partial(target)
    try:
        build(partial)
        (partial / MARKER).unlink()  # still locked, so no other process takes it for stale
        _rename(partial, target)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)  # ours: made and marked by this call
        raise
    finally:
        os.close(lock)


def _new_partial(target: Path) -> tuple[Path, int]:
    """A new, marked folder next to ``target`` and the descriptor holding its marker's lock."""
    partial = target.with_name(f"{target.name}.partial-{secrets.token_hex(8)}")
    try:
        partial.mkdir()
    except OSError as exc:
        raise SpikefuseError(
            f"cannot create '{partial}' to build '{target}' in: {os_reason(exc)} (is "
            f"'{target.parent}' an existing folder you can write to?)"
        ) from exc
    staging = partial / f"{MARKER}.new"
    try:
        fd = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            # Locked before it takes its name: a marker found under MARKER is locked for as
            # long as its build runs.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(fd, f"{socket.gethostname()}\n{os.getpid()}\n".encode())
            os.rename(staging, partial / MARKER)
        except BaseException:
            os.close(fd)
            raise
    except BaseException as exc:
        shutil.rmtree(partial, ignore_errors=True)
        if isinstance(exc, OSError):
            raise SpikefuseError(
                f"cannot mark '{partial}' as the build of '{target}': {os_reason(exc)}"
            ) from exc
        raise
    return partial, fd


def _rename(partial: Path, target: Path) -> None:
    if target.exists():  # another process completed it first: keep theirs
        shutil.rmtree(partial)
        return
    try:
        partial.rename(target)
    except OSError as exc:
        if not target.is_dir():
            raise SpikefuseError(
                f"cannot rename '{partial}' to '{target}': {os_reason(exc)}"
            ) from exc
        shutil.rmtree(partial)  # completed by another process between the check and here


def remove_stale_partials(target: Path) -> None:
    """Remove the folders of killed builds of ``target`` on this host (see the module)."""
    try:
        entries = list(os.scandir(target.parent))
    except FileNotFoundError:
        return
    except OSError as exc:
        raise SpikefuseError(f"cannot list '{target.parent}': {os_reason(exc)}") from exc
    for entry in entries:
        suffix = entry.name[len(target.name) :]
        if (
            entry.name.startswith(target.name)
            and _PARTIAL.fullmatch(suffix)
            and entry.is_dir(follow_symlinks=False)
        ):
            _remove_if_stale(Path(entry.path))


def _remove_if_stale(partial: Path) -> None:
    marker = partial / MARKER
    try:
        fd = os.open(marker, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return  # no marker (not a build's, or one that just completed) or not ours to open
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return  # not a marker we wrote (a read could block on a FIFO)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return  # its build is running (or this file system has no locks)
        host = os.read(fd, 1024).decode(errors="replace").split("\n")[0]
        try:
            current = os.stat(marker, follow_symlinks=False)
        except OSError:
            return
        # The file locked must still be the marker: a completed build unlinks it and renames
        # the folder to its target before releasing the lock.
        if host == socket.gethostname() and os.path.samestat(current, os.fstat(fd)):
            shutil.rmtree(partial, ignore_errors=True)
    finally:
        os.close(fd)
