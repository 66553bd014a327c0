"""Training checkpoints: nothing lost (overwrite rules, finite weights, atomic writes) and
nothing silent (checksum, validated entries, clear errors for unwritable paths). The lock and
the temporary files are tested in test_train_files.py."""

from __future__ import annotations

import errno
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import LOGS, error_of, listing, train
from spikefuse.train import CHECKPOINT_VERSION, TrainConfig, loop, payload_digest
from spikefuse.train.config import MODEL_CONFIG_TYPES

# Existing files: overwrite rules ------------------------------------------------------------


def test_existing_checkpoint_needs_resume_or_overwrite(
    copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = copy.read_bytes()
    assert train(copy, "--epochs", "2") == 1
    err = error_of(capsys, before_training=True)
    assert f"checkpoint '{copy}' already exists; pass --resume" in err and "--overwrite" in err
    assert copy.read_bytes() == before

    assert train(copy, "--epochs", "2", "--overwrite") == 0
    assert torch.load(copy, weights_only=True)["epoch"] == 2
    assert listing(copy.parent) == ["digits.pt", *LOGS]


@pytest.mark.parametrize("flags", [[], ["--overwrite"]])
@pytest.mark.parametrize(
    "content", [b"my notes\n", b"", b"PK\x03\x04 not a zip"], ids=["text", "empty", "zip"]
)
def test_a_file_that_is_no_checkpoint_is_never_overwritten(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], content: bytes
) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_bytes(content)
    assert train(notes, "--epochs", "1", *flags) == 1
    assert "exists and is not a spikefuse checkpoint; refusing to overwrite" in error_of(
        capsys, before_training=True
    )
    assert notes.read_bytes() == content
    assert listing(tmp_path) == ["notes.txt"]


def test_overwrite_replaces_a_checkpoint_of_an_older_version(copy: Path) -> None:
    payload = torch.load(copy, weights_only=True)
    payload["version"] = 1
    torch.save(payload, copy)
    assert train(copy, "--epochs", "1", "--overwrite") == 0
    assert torch.load(copy, weights_only=True)["version"] == CHECKPOINT_VERSION


# Unwritable paths --------------------------------------------------------------------------


def _parent_is_a_file(tmp_path: Path) -> tuple[Path, str]:
    (tmp_path / "afile").write_text("x")
    return tmp_path / "afile" / "sub" / "digits.pt", "is a file, not a directory"


def _a_directory(tmp_path: Path) -> tuple[Path, str]:
    (tmp_path / "adir").mkdir()
    return tmp_path / "adir", "is a directory; pass a file path"


def _not_a_regular_file(tmp_path: Path) -> tuple[Path, str]:
    os.mkfifo(tmp_path / "fifo")
    return tmp_path / "fifo", "is not a regular file"


@pytest.mark.parametrize("make", [_parent_is_a_file, _a_directory, _not_a_regular_file])
def test_unusable_checkpoint_paths_fail_before_training(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    make: Callable[[Path], tuple[Path, str]],
) -> None:
    path, message = make(tmp_path)
    before = listing(tmp_path)
    assert train(path, "--epochs", "1") == 1
    assert message in error_of(capsys, before_training=True)
    assert listing(tmp_path) == before


def test_a_read_only_directory_fails_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real_open = os.open

    def read_only(path: Any, flags: int, *args: Any) -> int:
        if str(path).endswith(".tmp"):  # the probe (the tests may run as root)
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", read_only)
    path = tmp_path / "digits.pt"
    assert train(path, "--epochs", "1") == 1
    assert f"cannot write checkpoint '{path}': Read-only file system" in error_of(
        capsys, before_training=True
    )
    assert listing(tmp_path) == []


def test_a_full_disk_keeps_the_checkpoint(
    copy: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    before = copy.read_bytes()
    assert train(copy, "--epochs", "2", "--resume") == 1
    err = error_of(capsys)  # the epoch's log row is written first, then the checkpoint
    assert f"cannot write training log '{copy}.csv': No space left on device" in err
    assert copy.read_bytes() == before
    assert listing(copy.parent) == ["digits.pt"]  # neither temp nor lock file left


def test_a_full_disk_at_the_start_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def full(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", full)  # the pid into the lock file
    path = tmp_path / "digits.pt"
    assert train(path, "--epochs", "1") == 1
    lock = tmp_path / ".digits.pt.lock"
    expected = f"cannot write checkpoint '{path}': writing '{lock}' failed: No space left on device"
    assert expected in error_of(capsys, before_training=True)
    assert listing(tmp_path) == []


# Never a non-finite checkpoint -------------------------------------------------------------


def _poison_weight(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    next(model.parameters()).data[0] = math.nan


def _poison_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.state[next(model.parameters())]["exp_avg_sq"].fill_(math.inf)


@pytest.mark.parametrize(
    ("poison", "where"),
    [
        (_poison_weight, "model['0.weight']"),
        (_poison_optimizer, "optimizer['state'][0]['exp_avg_sq']"),
    ],
)
def test_non_finite_state_is_never_saved(
    copy: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    poison: Callable[[torch.nn.Module, torch.optim.Optimizer], None],
    where: str,
) -> None:
    real_epoch = loop.train_epoch

    def diverging_epoch(model: Any, optimizer: Any, *args: Any) -> float:
        loss = real_epoch(model, optimizer, *args)
        poison(model, optimizer)
        return loss

    monkeypatch.setattr(loop, "train_epoch", diverging_epoch)
    before = copy.read_bytes()
    assert train(copy, "--epochs", "2", "--resume") == 1
    err = error_of(capsys)
    assert f"not writing checkpoint '{copy}' after epoch 2: {where} holds NaN or inf" in err
    assert copy.read_bytes() == before
    assert listing(copy.parent) == ["digits.pt"]


def test_a_huge_learning_rate_stops_with_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "digits.pt"
    assert train(path, "--epochs", "1", "--lr", "1e30") == 1
    err = error_of(capsys)
    assert "holds NaN or inf" in err or "the training diverged: the loss is" in err
    assert not path.exists()


def test_a_non_finite_loss_stops_the_run(
    copy: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real_loss = torch.nn.functional.cross_entropy
    monkeypatch.setattr(
        torch.nn.functional, "cross_entropy", lambda *args: real_loss(*args) * math.nan
    )
    before = copy.read_bytes()
    assert train(copy, "--epochs", "2", "--resume") == 1
    err = error_of(capsys)
    assert "the training diverged: the loss is nan in epoch 2, batch 1" in err
    assert copy.read_bytes() == before


# Loading: checksum and every entry validated -----------------------------------------------


def test_zeroed_bytes_fail_the_checksum(copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = bytearray(copy.read_bytes())
    weight = torch.load(copy, weights_only=True)["model"]["0.weight"]
    at = data.find(weight.numpy().tobytes())
    assert at > 0
    data[at + 8 : at + 18] = bytes(10)
    copy.write_bytes(bytes(data))
    assert train(copy, "--epochs", "2", "--resume") == 1
    err = error_of(capsys)
    assert f"checkpoint '{copy}' is damaged: its contents do not match their sha256" in err


def test_an_empty_checkpoint_is_a_clear_error(
    copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy.write_bytes(b"")
    assert train(copy, "--epochs", "2", "--resume") == 1
    assert f"checkpoint '{copy}' is empty (0 bytes)" in error_of(capsys)


def test_another_version_is_a_clear_error(copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    payload = torch.load(copy, weights_only=True)
    payload["version"] = 1
    torch.save(payload, copy)
    assert train(copy, "--epochs", "2", "--resume") == 1
    err = error_of(capsys)
    assert f"has format version 1; this spikefuse reads version {CHECKPOINT_VERSION}" in err


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda payload: payload.__setitem__(key, value)


def _nan_weight(payload: dict[str, Any]) -> None:
    payload["model"]["0.weight"][0] = math.nan


def _inf_moment(payload: dict[str, Any]) -> None:
    payload["optimizer"]["state"][1]["exp_avg"][0] = -math.inf


def _inf_lr(payload: dict[str, Any]) -> None:
    payload["optimizer"]["param_groups"][0]["lr"] = math.inf


def _other_betas(payload: dict[str, Any]) -> None:
    payload["optimizer"]["param_groups"][0]["betas"] = (0.0, 0.0)


def _wrong_moment_shape(payload: dict[str, Any]) -> None:
    payload["optimizer"]["state"][0]["exp_avg"] = torch.zeros(3)


def _config_without_limit(payload: dict[str, Any]) -> None:
    del payload["config"]["limit"]


def _no_checksum(payload: dict[str, Any]) -> None:
    del payload["sha256"]


def _config_of_tensors(payload: dict[str, Any]) -> None:
    for key in payload["config"]:
        payload["config"][key] = torch.zeros(2)


def _set_config(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda payload: payload["config"].__setitem__(key, value)


@pytest.mark.parametrize(
    ("tamper", "message"),
    [
        (_set("epoch", -5), "is damaged: its epoch is -5, not a whole number >= 1"),
        (_set("epoch", 0), "is damaged: its epoch is 0"),
        (_set("epoch", 1.5), "is damaged: its epoch is 1.5"),
        (_set("epoch", True), "is damaged: its epoch is True"),
        (_set("epoch", "1"), "is damaged: its epoch is '1'"),
        (_set("epoch", 3), "is at epoch 3, past --epochs 2 (pass --epochs 3 or more)"),
        (_set("test_accuracy", math.nan), "its test accuracy is nan"),
        (_set("config", [1]), "is damaged: its config is [1]"),
        (_config_without_limit, "with other keys than"),
        (_set("model", [1]), "its model is not a state dict of named tensors"),
        (_set("optimizer", 3), "its optimizer state is not a dict"),
        (_set("extra", 1), "has unknown entries 'extra'"),
        (_set("test_accuracy", torch.device("cpu")), "holds an unexpected value"),
        (_nan_weight, "holds NaN or inf (first in model['0.weight'])"),
        (_inf_moment, "holds NaN or inf (first in optimizer['state'][1]['exp_avg'])"),
        (_inf_lr, "holds NaN or inf (first in optimizer['param_groups'][0]['lr'])"),
        (_other_betas, "does not fit the model: optimizer setting betas=(0.0, 0.0)"),
        (_wrong_moment_shape, "does not fit the model: optimizer exp_avg of shape (3,)"),
        (_no_checksum, "is incomplete: no sha256"),
        (_config_of_tensors, "is damaged: its config's architecture is tensor([0., 0.]), a "),
        (_set_config("T", torch.tensor(2)), "its config's T is tensor(2), a Tensor; a config "),
        (_set_config("T", 2.0), "its config's T is 2.0, a float; a config holds plain values"),
        (_set_config("seed", True), "its config's seed is True, a bool"),
        (_set_config("limit", "200"), "its config's limit is '200', a str; a config holds plain "),
    ],
    ids=[
        *("epoch=-5 epoch=0 epoch=1.5 epoch=True epoch='1' epoch>epochs".split()),
        *("accuracy=nan config=list config-keys model=list optimizer=int extra".split()),
        *("device-leaf nan-weight inf-moment inf-lr betas moment-shape no-checksum".split()),
        *("config=tensors T=tensor T=float seed=bool limit=str".split()),
    ],
)
def test_every_entry_is_validated(
    copy: Path,
    capsys: pytest.CaptureFixture[str],
    tamper: Callable[[dict[str, Any]], None],
    message: str,
) -> None:
    # A crafted file with a matching checksum: each entry is still checked on its own.
    payload = torch.load(copy, weights_only=True)
    tamper(payload)
    if "sha256" in payload:
        try:
            payload["sha256"] = payload_digest(payload)
        except ValueError:
            pass  # not digestible: the loader must say so
    torch.save(payload, copy)
    before = copy.read_bytes()
    assert train(copy, "--epochs", "2", "--resume") == 1
    err = error_of(capsys)
    assert f"checkpoint '{copy}'" in err and message in err
    assert copy.read_bytes() == before


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--resume", "checkpoint '{}' cannot be read: Permission denied"),
        ("--overwrite", "cannot read '{}': Permission denied"),
    ],
)
def test_an_unreadable_checkpoint_says_why(
    copy: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    flag: str,
    message: str,
) -> None:
    def denied(path: Any, *args: Any, **kwargs: Any) -> None:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    monkeypatch.setattr(torch, "load", denied)  # the tests may run as root
    assert train(copy, "--epochs", "2", flag) == 1
    err = error_of(capsys)
    assert message.format(copy) in err
    assert "corrupted" not in err and "not a spikefuse checkpoint" not in err


@pytest.mark.parametrize("limit", [None, 200])
def test_the_config_types_cover_what_a_run_saves(limit: int | None) -> None:
    saved = TrainConfig(limit=limit).model_config()
    assert saved.keys() == MODEL_CONFIG_TYPES.keys()
    assert all(type(value) in MODEL_CONFIG_TYPES[key] for key, value in saved.items())
