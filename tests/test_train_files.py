"""The files a training run keeps beside its checkpoint for its own use: the lock (two runs on
one checkpoint refuse each other; a killed run's lock never blocks) and the temporary files
(created exclusively, never through a symlink, and removed after a kill only where spikefuse
provably wrote them). A file of either name that spikefuse did not write is neither written
into nor removed."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import LOGS, SMALL, error_of, listing, train
from spikefuse import train as train_module
from spikefuse.errors import SpikefuseError
from spikefuse.train import checkpoint_lock, replace_file
from spikefuse.train.files import lock_record, temp_path

# Lock --------------------------------------------------------------------------------------


@pytest.fixture
def held_lock(copy: Path) -> Iterator[Path]:
    """Hold the lock of ``copy`` as another run would (flock is per open file)."""
    lock = copy.with_name(".digits.pt.lock")
    with open(lock, "wb") as f:
        f.write(lock_record(4242))
        f.flush()
        fcntl.flock(f, fcntl.LOCK_EX)
        yield lock


def test_a_second_run_on_a_locked_checkpoint_refuses(
    copy: Path, held_lock: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = copy.read_bytes()
    for flags in (["--resume"], ["--overwrite"]):
        assert train(copy, "--epochs", "2", *flags) == 1
        err = error_of(capsys, before_training=True)
        assert f"checkpoint '{copy}' is in use by another training run (pid 4242)" in err
    assert copy.read_bytes() == before
    assert held_lock.exists()  # the holder's lock file stays


def test_two_processes_on_one_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "digits.pt"
    command = [sys.executable, "-m", "spikefuse", "train", *SMALL, "--checkpoint", str(path)]
    env = {**os.environ, "PYTHONPATH": str(Path(train_module.__file__).parents[2])}
    first = subprocess.Popen([*command, "--epochs", "1000"], env=env, stdout=subprocess.PIPE)
    assert first.stdout is not None
    assert first.stdout.readline().startswith(b"device: ")  # the first run holds the lock
    second = subprocess.run(
        [*command, "--epochs", "1", "--overwrite"], env=env, capture_output=True, text=True
    )
    first.kill()  # the kernel releases a dead process's lock
    first.wait()
    first.stdout.close()
    assert second.returncode == 1
    assert f"checkpoint '{path}' is in use by another training run (pid {first.pid})" in (
        second.stderr
    )
    assert train(path, "--epochs", "1", "--overwrite") == 0


@pytest.mark.parametrize("pid", [999999999, os.getppid()], ids=["dead", "reused"])
def test_a_stale_lock_file_does_not_block(copy: Path, pid: int) -> None:
    # Left by a killed run: its record, but no lock (the kernel released it). The lock, not
    # the pid, tells: the pid may since have gone to another process.
    copy.with_name(".digits.pt.lock").write_bytes(lock_record(pid))
    assert train(copy, "--epochs", "2", "--resume") == 0
    assert listing(copy.parent) == ["digits.pt", *LOGS]


def _symlink_to_precious(lock: Path) -> str:
    lock.symlink_to(lock.with_name("precious.txt"))
    return "is a symbolic link"


def _dangling_symlink(lock: Path) -> str:
    lock.symlink_to(lock.with_name("elsewhere.txt"))
    return "is a symbolic link"


def _user_file(lock: Path) -> str:
    lock.write_text("my notes\n")
    return "is a file of other contents"


def _bare_pid(lock: Path) -> str:
    lock.write_text("4242\n")  # a record spikefuse does not write
    return "is a file of other contents"


def _empty_file(lock: Path) -> str:
    lock.touch()
    return "is an empty file"


def _directory(lock: Path) -> str:
    lock.mkdir()
    return "is a directory"


def _fifo(lock: Path) -> str:
    os.mkfifo(lock)
    return "is not a regular file"


@pytest.mark.parametrize(
    "make",
    [
        _symlink_to_precious,
        _dangling_symlink,
        _user_file,
        _bare_pid,
        _empty_file,
        _directory,
        _fifo,
    ],
)
def test_a_lock_file_spikefuse_did_not_write_is_left_alone(
    copy: Path, capsys: pytest.CaptureFixture[str], make: Callable[[Path], str]
) -> None:
    precious = copy.with_name("precious.txt")
    precious.write_text("precious\n")
    lock = copy.with_name(".digits.pt.lock")
    what = make(lock)
    before = {
        p.name: (p.lstat().st_mode, p.read_bytes() if p.is_file() else None)
        for p in copy.parent.iterdir()
    }
    for flags in (["--resume"], ["--overwrite"]):
        assert train(copy, "--epochs", "2", *flags) == 1
        err = error_of(capsys, before_training=True)
        assert f"cannot lock checkpoint '{copy}': its lock file '{lock}' {what}" in err
        assert "remove it yourself if no training run uses" in err
    after = {
        p.name: (p.lstat().st_mode, p.read_bytes() if p.is_file() else None)
        for p in copy.parent.iterdir()
    }
    assert after == before


def _hold_the_lock_in_turns(path: Path, start: Any, rounds: int, results: Any) -> None:
    """Try for the lock of ``path`` once per round, all workers at once, and put what
    happened in ``results``; inside, a file created exclusively shows whether another worker
    is inside too."""
    inside = path.with_name("inside")
    outcomes = []
    for _ in range(rounds):
        start.wait()
        try:
            with checkpoint_lock(path, path):
                try:
                    os.close(os.open(inside, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
                except FileExistsError:
                    outcomes.append("overlap")
                    continue
                time.sleep(0.005)
                inside.unlink()
                outcomes.append("locked")
        except SpikefuseError as exc:
            outcomes.append("busy" if "is in use by another training run" in str(exc) else str(exc))
    results.put(outcomes)


def test_runs_starting_at_once_take_the_lock_one_at_a_time(tmp_path: Path) -> None:
    workers, rounds = 8, 20
    context = multiprocessing.get_context("fork")  # the worker is a function of this module
    start, results = context.Barrier(workers), context.Queue()
    args = (tmp_path / "digits.pt", start, rounds, results)
    processes = [context.Process(target=_hold_the_lock_in_turns, args=args) for _ in range(workers)]
    for process in processes:
        process.start()
    outcomes = [outcome for _ in processes for outcome in results.get(timeout=60)]
    for process in processes:
        process.join()
    assert set(outcomes) <= {"locked", "busy"}, set(outcomes)  # neither overlap nor refusal
    assert outcomes.count("locked") >= rounds
    assert listing(tmp_path) == []


# Symlinks and temp files -------------------------------------------------------------------


def test_a_symlinked_checkpoint_is_written_through(tmp_path: Path, copy: Path) -> None:
    link = tmp_path / "links" / "latest.pt"
    link.parent.mkdir()
    link.symlink_to(copy)
    assert train(link, "--epochs", "2", "--resume") == 0
    assert link.is_symlink() and link.resolve() == copy
    assert torch.load(copy, weights_only=True)["epoch"] == 2
    assert listing(link.parent) == ["latest.pt"]
    assert listing(tmp_path) == ["digits.pt", *LOGS, "links"]  # beside the link's target

    dangling = tmp_path / "links" / "new.pt"
    dangling.symlink_to(tmp_path / "new-target.pt")
    assert train(dangling, "--epochs", "1") == 0
    assert dangling.is_symlink() and (tmp_path / "new-target.pt").is_file()


def test_stale_temp_files_are_removed_and_live_ones_kept(
    tmp_path: Path, copy: Path, checkpoint: Path
) -> None:
    # What the run that made ``checkpoint`` wrote, cut short as by a kill mid-write.
    written = [checkpoint, *(checkpoint.with_name(name) for name in LOGS)]
    for source in written:
        (tmp_path / f".{source.name}.999999999.tmp").write_bytes(source.read_bytes()[:4096])
    live = tmp_path / f".digits.pt.{os.getppid()}.tmp"
    live.write_bytes(checkpoint.read_bytes())
    other = tmp_path / ".other.pt.999999999.tmp"
    other.write_bytes(checkpoint.read_bytes())
    assert train(copy, "--epochs", "2", "--resume") == 0
    assert listing(tmp_path) == sorted([copy.name, live.name, other.name, *LOGS])


def _partial(entry: Path) -> None:
    entry.write_bytes(b"partial")


def _someone_elses_zip(entry: Path) -> None:
    entry.write_bytes(b"PK\x03\x04 my archive")


def _log_header_elsewhere(entry: Path) -> None:
    entry.write_bytes(b"my notes\nepoch,train_loss,test_accuracy,seconds\n")


def _symlink(entry: Path) -> None:
    entry.symlink_to(entry.with_name("precious.txt"))


@pytest.mark.parametrize("make", [_partial, _someone_elses_zip, _log_header_elsewhere, _symlink])
@pytest.mark.parametrize("name", ["digits.pt", *LOGS])
def test_files_named_like_temp_files_that_spikefuse_did_not_write_are_kept(
    copy: Path, make: Callable[[Path], None], name: str
) -> None:
    precious = copy.with_name("precious.txt")
    precious.write_text("precious\n")
    entry = copy.with_name(f".{name}.999999999.tmp")
    make(entry)
    content = os.readlink(entry) if entry.is_symlink() else entry.read_bytes()
    with pytest.warns(UserWarning, match=f"leaving '{entry}' alone: it is named like a temp"):
        assert train(copy, "--epochs", "2", "--resume") == 0
    assert (os.readlink(entry) if entry.is_symlink() else entry.read_bytes()) == content
    assert precious.read_text() == "precious\n"


@pytest.mark.parametrize("name", ["digits.pt", *LOGS])
def test_a_foreign_file_at_this_runs_temp_path_stops_it_before_training(
    copy: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    entry = copy.with_name(f".{name}.{os.getpid()}.tmp")  # the run is this process
    entry.write_bytes(b"my notes\n")
    before = copy.read_bytes()
    assert train(copy, "--epochs", "2", "--resume") == 1
    err = error_of(capsys, before_training=True)
    assert f"'{entry}', where this run would write it first, exists and is not a temp" in err
    assert entry.read_bytes() == b"my notes\n" and copy.read_bytes() == before


def test_replace_file_never_writes_through_a_symlink_at_its_temp_path(tmp_path: Path) -> None:
    precious = tmp_path / "precious.txt"
    precious.write_text("precious\n")
    target = tmp_path / "out.bin"
    tmp = temp_path(target, os.getpid())
    tmp.symlink_to(precious)
    with pytest.raises(SpikefuseError, match=f"'{tmp}' exists and is not a temporary file"):
        replace_file(target, b"data", "output")
    assert precious.read_text() == "precious\n" and tmp.is_symlink() and not target.exists()
