"""The command line: a training smoke run, resuming, and clear errors for bad checkpoints."""

from __future__ import annotations

import re
import subprocess
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from conftest import train
from spikefuse.cli import main
from spikefuse.errors import SpikefuseError
from spikefuse.train import CHECKPOINT_FORMAT, CheckpointError, TrainConfig, run


def test_train_prints_progress_and_saves_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "sub" / "digits.pt"
    assert train(path, "--epochs", "2") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("device: cpu, backend: auto -> torch, neuron: lif, T=2")
    assert re.fullmatch(r"epoch 1/2: train loss \d+\.\d{4}, test accuracy [01]\.\d{4} .*", lines[1])
    assert lines[2].startswith("epoch 2/2: ")
    assert re.fullmatch(r"final test accuracy: [01]\.\d{4}", lines[-1])
    payload = torch.load(path, weights_only=True)
    assert payload["format"] == CHECKPOINT_FORMAT
    assert payload["epoch"] == 2
    assert payload["config"] == {
        "architecture": "digits-cnn-v1",
        "data": "digits",
        "neuron": "lif",
        "T": 2,
        "seed": 0,
        "limit": 200,
    }
    # The log and plot beside the checkpoint, and no temp file left behind.
    assert sorted(p.name for p in path.parent.iterdir()) == [
        "digits.pt",
        "digits.pt.csv",
        "digits.pt.png",
    ]


def test_resume_continues_where_the_run_stopped(
    tmp_path: Path, checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    resumed = tmp_path / "resumed.pt"
    resumed.write_bytes(checkpoint.read_bytes())
    assert train(resumed, "--epochs", "2", "--resume") == 0
    out = capsys.readouterr().out
    assert f"resumed from '{resumed}' after epoch 1" in out
    assert "epoch 1/2" not in out and "epoch 2/2: " in out
    assert torch.load(resumed, weights_only=True)["epoch"] == 2

    # Seeded per-epoch batch order: stopping and resuming changes nothing.
    straight = tmp_path / "straight.pt"
    assert train(straight, "--epochs", "2") == 0
    a = torch.load(resumed, weights_only=True)["model"]
    b = torch.load(straight, weights_only=True)["model"]
    assert a.keys() == b.keys()
    assert all(torch.allclose(a[k].float(), b[k].float()) for k in a)


def test_resume_of_a_finished_run_only_evaluates(
    tmp_path: Path, checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    done = tmp_path / "done.pt"
    done.write_bytes(checkpoint.read_bytes())
    assert train(done, "--epochs", "1", "--resume") == 0
    out = capsys.readouterr().out
    assert "epoch 1/1" not in out
    assert out.splitlines()[-1].startswith("final test accuracy: ")


def _corrupted(path: Path, checkpoint: Path) -> None:
    path.write_bytes(checkpoint.read_bytes()[:500])


def _random_bytes(path: Path, checkpoint: Path) -> None:
    path.write_bytes(bytes(range(256)) * 4)


def _plain_tensor(path: Path, checkpoint: Path) -> None:
    torch.save(torch.zeros(3), path)


def _untagged_dict(path: Path, checkpoint: Path) -> None:
    payload = torch.load(checkpoint, weights_only=True)
    del payload["format"]
    torch.save(payload, path)


def _incomplete(path: Path, checkpoint: Path) -> None:
    payload = torch.load(checkpoint, weights_only=True)
    del payload["optimizer"]
    torch.save(payload, path)


def _copy(path: Path, checkpoint: Path) -> None:
    path.write_bytes(checkpoint.read_bytes())


@pytest.mark.parametrize(
    ("make", "extra", "message"),
    [
        (None, [], "does not exist"),
        (_corrupted, [], "cannot be read: the file is corrupted or is not a spikefuse checkpoint"),
        (_random_bytes, [], "cannot be read: the file is corrupted"),
        (_plain_tensor, [], "is not a spikefuse training checkpoint"),
        (_untagged_dict, [], "is not a spikefuse training checkpoint"),
        (_incomplete, [], "is incomplete: no optimizer"),
        (_copy, ["--neuron", "if"], "neuron='lif' in the checkpoint but 'if' now"),
        (_copy, ["--T", "3"], "T=2 in the checkpoint but 3 now"),
    ],
    ids=["missing", "truncated", "garbage", "tensor", "untagged", "incomplete", "neuron", "T"],
)
def test_bad_checkpoint_is_a_clear_error(
    tmp_path: Path,
    checkpoint: Path,
    capsys: pytest.CaptureFixture[str],
    make: Callable[[Path, Path], None] | None,
    extra: list[str],
    message: str,
) -> None:
    path = tmp_path / "bad.pt"
    if make is not None:
        make(path, checkpoint)
    before = path.read_bytes() if path.exists() else None
    assert train(path, "--epochs", "2", "--resume", *extra) == 1
    err = capsys.readouterr().err
    assert err.startswith("spikefuse: error: ") and str(path) in err and message in err
    assert "Traceback" not in err
    assert (path.read_bytes() if path.exists() else None) == before  # left untouched


def test_checkpoint_errors_are_spikefuse_errors(tmp_path: Path) -> None:
    path = tmp_path / "tensor.pt"
    torch.save(torch.zeros(3), path)
    config = TrainConfig(checkpoint=str(path), resume=True, limit=200, device="cpu", quiet=True)
    with pytest.raises(CheckpointError, match="not a spikefuse training checkpoint") as info:
        run(config)
    assert isinstance(info.value, SpikefuseError)


def test_invalid_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # --limit is now checked with the other options while parsing (a usage error, status 2),
    # not once the data is loaded (status 1).
    with pytest.raises(SystemExit) as info:
        train(tmp_path / "x.pt", "--limit", "5")
    assert info.value.code == 2
    assert "--limit must be between 10 and 1797" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        train(tmp_path / "x.pt", "--epochs", "0")
    assert info.value.code == 2
    assert not (tmp_path / "x.pt").exists()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--lr", "inf"], "--lr must be a finite number > 0, got inf"),
        (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
        (["--lr", "-1"], "--lr must be a finite number > 0, got -1.0"),
        (["--lr", "0"], "--lr must be a finite number > 0, got 0.0"),
        (["--epochs", "-2"], "--epochs must be a whole number >= 1, got -2"),
        (["--batch-size", "0"], "--batch-size must be a whole number >= 1, got 0"),
        (["--T", "0"], "--T must be a whole number >= 1, got 0"),
        (["--limit", "5000"], "--limit must be between 10 and 1797, got 5000"),
        (["--seed", "-1"], "--seed must be between 0 and 4294967295, got -1"),
        (["--seed", str(2**32)], "--seed must be between 0 and 4294967295, got 4294967296"),
        (["--checkpoint", ""], "--checkpoint must be a file path, got ''"),
        (["--overwrite"], "argument --overwrite: not allowed with argument --resume"),
        (["--epochs", "1.5"], "argument --epochs: invalid int value: '1.5'"),
        (
            ["--model", "sew_resnet18", "--data", "cifar10", "--data-dir", "x"]
            + ["--batch-size", "1", "--T", "1"],
            "--model sew_resnet18 on 32x32 images shrinks its last BatchNorm's maps to 1x1",
        ),
    ],
)
def test_bad_option_values_are_usage_errors(
    tmp_path: Path,
    checkpoint: Path,
    capsys: pytest.CaptureFixture[str],
    options: list[str],
    message: str,
) -> None:
    # With --resume, a bad value once overwrote a good checkpoint with NaN weights (--lr inf),
    # or failed after loading it with a raw traceback (--lr -1, --seed -1).
    path = tmp_path / "digits.pt"
    path.write_bytes(checkpoint.read_bytes())
    with pytest.raises(SystemExit) as info:
        train(path, "--epochs", "2", "--resume", *options)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"spikefuse train: error: {message}" in err and "Traceback" not in err
    assert path.read_bytes() == checkpoint.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["digits.pt"]


@pytest.mark.parametrize(
    ("field", "value"),
    [("lr", float("nan")), ("epochs", 0), ("T", 2.0), ("seed", -1), ("neuron", "x")],
)
def test_train_config_validates_its_fields(field: str, value: object) -> None:
    with pytest.raises(SpikefuseError, match=f"--{field}"):
        TrainConfig(**{field: value})
    with pytest.raises(SpikefuseError, match="exclude each other"):
        TrainConfig(resume=True, overwrite=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine with no GPU")
def test_cuda_backend_without_gpu_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert train(tmp_path / "x.pt", "--backend", "cuda") == 1
    assert "spikefuse: error: --backend cuda: " in capsys.readouterr().err


def test_bench_passes_arguments_through(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []
    fake = types.ModuleType("spikefuse.bench.e2e")
    fake.main = lambda argv: calls.append(argv) or 3
    monkeypatch.setitem(sys.modules, "spikefuse.bench.e2e", fake)
    assert main(["bench", "e2e", "--T", "8", "--help", "x"]) == 3
    assert calls == [["--T", "8", "--help", "x"]]


def test_python_m_spikefuse_train_help() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "spikefuse", "train", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "usage: spikefuse train" in done.stdout and "--resume" in done.stdout
    assert "--overwrite" in done.stdout


def test_cuda_graph_needs_a_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        train(tmp_path / "a.pt", "--cuda-graph")  # SMALL says --device cpu
    assert exit_info.value.code == 2
    assert "--cuda-graph replays steps on a GPU" in capsys.readouterr().err
    if not torch.cuda.is_available():
        args = ["train", "--limit", "200", "--quiet", "--cuda-graph", "--checkpoint"]
        assert main([*args, str(tmp_path / "b.pt")]) == 1
        assert "--cuda-graph step needs a CUDA GPU" in capsys.readouterr().err
        assert not (tmp_path / "b.pt").exists()
