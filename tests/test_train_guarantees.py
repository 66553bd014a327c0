"""What `spikefuse train` guarantees when things go wrong: the checkpoint, log and plot agree
at every instant an interrupt can land (and --resume repairs or refuses, never drops a row);
ranks agree on the work before their first collective; input files are checked from the file
system before they are read."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import free_port, status_worker, write_cifar10
from spikefuse.cli import main
from spikefuse.train import (
    CIFAR10_RECORD_BYTES,
    CIFAR10_TRAIN_FILES,
    LOG_HEADER,
    log_paths,
)

QUICK = ["--device", "cpu", "--quiet", "--T", "1", "--limit", "20", "--batch-size", "10"]


def train(checkpoint: Path, *extra: str) -> int:
    return main(["train", *QUICK, "--checkpoint", str(checkpoint), *extra])


def logged_epochs(checkpoint: Path) -> list[int]:
    with open(log_paths(checkpoint)[0], newline="") as f:
        return [int(row["epoch"]) for row in csv.DictReader(f)]


# Per epoch three files are replaced: the log row, the checkpoint, the plot.
@pytest.mark.parametrize("instant", range(6))
def test_an_interrupt_after_any_write_loses_no_log_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, instant: int
) -> None:
    path = tmp_path / "run.pt"
    real_replace, replaced = os.replace, []

    def interrupted(source: str, target: str) -> None:
        real_replace(source, target)
        replaced.append(target)
        if len(replaced) == instant + 1:
            raise KeyboardInterrupt  # Ctrl-C right after this file was written

    monkeypatch.setattr(os, "replace", interrupted)
    assert train(path, "--epochs", "2") == 130
    monkeypatch.undo()
    # A checkpoint resumes; without one the log of its run is started over.
    assert train(path, "--epochs", "2", "--resume" if path.exists() else "--overwrite") == 0
    assert torch.load(path, weights_only=True)["epoch"] == 2
    assert logged_epochs(path) == [1, 2]
    log, plot = log_paths(path)
    assert plot.stat().st_mtime_ns >= log.stat().st_mtime_ns  # drawn from the final rows


def test_a_resume_refuses_a_log_that_lacks_an_epoch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "run.pt"
    assert train(path, "--epochs", "2") == 0
    log = log_paths(path)[0]
    rows = log.read_text().splitlines()
    log.write_text("\n".join([LOG_HEADER, rows[1]]) + "\n")  # the row of epoch 2 is gone
    before = (path.read_bytes(), log.read_bytes())
    assert train(path, "--epochs", "3", "--resume") == 1
    err = capsys.readouterr().err
    assert f"training log '{log}' has no row for epochs [2]" in err
    assert "is at epoch 2; resuming would lose those rows" in err
    assert (path.read_bytes(), log.read_bytes()) == before


def test_a_resume_refuses_a_log_too_large_to_be_ours(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from spikefuse.train import logs

    path = tmp_path / "run.pt"
    assert train(path, "--epochs", "1") == 0
    monkeypatch.setattr(logs, "MAX_LOG_BYTES", 40)  # instead of writing 64 MiB
    assert train(path, "--epochs", "2", "--resume") == 1
    assert "is larger than 40 bytes" in capsys.readouterr().err


# ---- ranks ----------------------------------------------------------------------------------
@pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"
)
def test_ranks_that_see_different_data_stop_together(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    complete, partial = write_cifar10(tmp_path / "a", 4), write_cifar10(tmp_path / "b", 3, 1)
    argv = ["--device", "cpu", "--quiet", "--T", "1", "--data", "cifar10", "--batch-size", "2"]
    argv += ["--checkpoint", str(tmp_path / "run.pt")]
    per_rank = [[*argv, "--data-dir", str(complete)], [*argv, "--data-dir", str(partial)]]
    context = mp.start_processes(
        status_worker,
        args=(free_port(), str(tmp_path), per_rank),
        nprocs=2,
        join=False,
        start_method="spawn",
    )
    for process in context.processes:
        process.join(120)  # before the fix the ranks hang in their first all-reduce
    hung = [p.pid for p in context.processes if p.is_alive()]
    for process in context.processes:
        if process.is_alive():
            process.kill()
    assert not hung, "the ranks hang"
    assert [Path(tmp_path, f"rank{r}.status").read_text() for r in range(2)] == ["1", "1"]
    err = capfd.readouterr().err
    assert "training samples: 15 on rank 1, 20 on rank 0" in err
    assert "every rank must read the same data" in err
    assert not (tmp_path / "run.pt").exists()


# ---- files checked before they are read -----------------------------------------------------
def test_a_cifar10_file_larger_than_the_format_is_refused_unread(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = write_cifar10(tmp_path / "bin", 2)
    huge = folder / CIFAR10_TRAIN_FILES[1]
    with open(huge, "r+b") as f:
        f.truncate(CIFAR10_RECORD_BYTES * 10**8)  # 307 GB, sparse: nothing is written
    assert train(tmp_path / "run.pt", "--data", "cifar10", "--data-dir", str(folder)) == 1
    err = capsys.readouterr().err
    assert f"CIFAR-10 file '{huge}' has 100000000 records; the files of CIFAR-10's" in err


def test_a_huge_file_at_the_checkpoint_path_is_not_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "run.pt"
    with open(path, "wb") as f:
        f.write(b"PK\x03\x04")
        f.truncate(2**40)  # 1 TiB, sparse
    for flag in ("--overwrite", "--resume"):
        assert train(path, flag) == 1
    err = capsys.readouterr().err
    assert "exists and is not a spikefuse checkpoint; refusing to overwrite" in err
    assert "cannot be read: the file is corrupted or is not a spikefuse checkpoint (it has" in err


def test_a_checkpoint_declaring_more_than_it_holds_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import zipfile

    path = tmp_path / "run.pt"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("run/data/0", bytes(50 * 2**20))  # 50 MiB of zeros in a few KiB
    assert train(path, "--resume") == 1
    assert "(its entries declare 52428800 bytes" in capsys.readouterr().err
