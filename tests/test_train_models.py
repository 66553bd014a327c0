"""`spikefuse train` beyond the digits CNN: --model (the spikefuse.models zoo), --fuse, --amp bf16,
CIFAR-10 from its binary files, DistributedDataParallel under torchrun, and the per-epoch CSV
log and plot beside the checkpoint."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import conftest
from conftest import free_port, set_torchrun_environment, status_worker
from spikefuse import train as train_module
from spikefuse.cli import main
from spikefuse.errors import SpikefuseError
from spikefuse.train import (
    CIFAR10_RECORD_BYTES,
    CIFAR10_TEST_FILE,
    CIFAR10_TRAIN_FILES,
    LOG_HEADER,
    MODELS,
    TrainConfig,
    build_model,
    forward,
    load_cifar10,
    loop,
    ranks_from_env,
)

QUICK = ["--device", "cpu", "--quiet", "--epochs", "1", "--T", "1"]
RECORDS = 20  # per CIFAR-10 file


def train(checkpoint: Path, *extra: str) -> int:
    return main(["train", *QUICK, "--checkpoint", str(checkpoint), *extra])


def write_cifar10(folder: Path, records: int = RECORDS, seed: int = 0) -> Path:
    return conftest.write_cifar10(folder, records, seed)


@pytest.fixture(scope="module")
def cifar(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_cifar10(tmp_path_factory.mktemp("data") / "cifar-10-batches-bin")


def usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as info:
        main(["train", *argv])
    assert info.value.code == 2
    return capsys.readouterr().err


# --model and --fuse ---------------------------------------------------------------------------


@pytest.mark.parametrize("model", [m for m in MODELS if m != "digits-cnn"])
def test_zoo_models_train_on_cifar10(
    tmp_path: Path, cifar: Path, capsys: pytest.CaptureFixture[str], model: str
) -> None:
    path = tmp_path / "run.pt"
    data = ["--data", "cifar10", "--data-dir", str(cifar), "--limit", "10", "--batch-size", "5"]
    assert train(path, "--model", model, *data) == 0
    out = capsys.readouterr().out
    assert f"model: {model}" in out and "train/test samples: 10/10" in out
    payload = torch.load(path, weights_only=True)
    assert payload["config"]["architecture"] == model and payload["config"]["data"] == "cifar10"


@pytest.mark.parametrize("fused", [False, True])
def test_a_lone_last_sample_at_one_step_is_skipped(
    tmp_path: Path, cifar: Path, fused: bool
) -> None:
    """SEW-ResNet-18 shrinks 32 x 32 images to 1 x 1: one sample at T = 1 would give BatchNorm
    one value per channel (10 samples in batches of 3 leave one)."""
    data = ["--data", "cifar10", "--data-dir", str(cifar), "--limit", "10", "--batch-size", "3"]
    extra = ["--fuse"] if fused else []
    assert train(tmp_path / "run.pt", "--model", "sew_resnet18", *data, *extra) == 0


def test_resnet19_trains_fused_on_the_digits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "r19.pt"
    options = ["--model", "spiking_resnet19", "--limit", "12", "--batch-size", "9", "--fuse"]
    assert train(path, *options) == 0
    lines = capsys.readouterr().out.splitlines()
    # The grey digits are repeated to the RGB input the zoo's networks take.
    assert lines[0].startswith("device: cpu") and "model: spiking_resnet19" in lines[0]
    assert lines[1] == "fuse: fused 18 of 18 Conv/Linear -> BatchNorm -> neuron chains (100%)"
    assert torch.load(path, weights_only=True)["config"]["architecture"] == "spiking_resnet19"


def test_fused_training_matches_unfused_and_their_checkpoints_interchange(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    options = ["--limit", "100", "--batch-size", "25", "--T", "2"]
    assert train(tmp_path / "plain.pt", *options) == 0
    assert train(tmp_path / "fused.pt", *options, "--fuse") == 0
    plain = torch.load(tmp_path / "plain.pt", weights_only=True)
    fused = torch.load(tmp_path / "fused.pt", weights_only=True)
    assert plain["model"].keys() == fused["model"].keys()  # fuse keeps the state dict's names
    for key, value in plain["model"].items():
        torch.testing.assert_close(fused["model"][key], value, atol=1e-4, rtol=1e-4, msg=key)
    assert "fuse: fused 2 of 2" in capsys.readouterr().out
    # A fused run resumes unfused and the other way round (the same parameters, in order).
    assert train(tmp_path / "fused.pt", *options, "--epochs", "2", "--resume") == 0
    assert train(tmp_path / "plain.pt", *options, "--epochs", "2", "--resume", "--fuse") == 0


def test_resuming_with_another_model_or_data_set_is_refused(
    tmp_path: Path, cifar: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "digits.pt"
    assert train(path, "--limit", "20") == 0
    capsys.readouterr()
    resume = ["--limit", "20", "--epochs", "2", "--resume"]
    assert train(path, *resume, "--model", "spiking_resnet19") == 1
    err = capsys.readouterr().err
    assert "architecture='digits-cnn-v1' in the checkpoint but 'spiking_resnet19' now" in err
    assert train(path, *resume, "--data", "cifar10", "--data-dir", str(cifar)) == 1
    assert "data='digits' in the checkpoint but 'cifar10' now" in capsys.readouterr().err


def test_a_model_needs_images_it_is_made_for(capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error(capsys, "--model", "spiking_vgg11_bn")
    assert "--model spiking_vgg11_bn is made for images of 32x32 or more" in err
    assert "--data digits has 8x8 (use --data cifar10)" in err
    assert "invalid choice: 'resnet'" in usage_error(capsys, "--model", "resnet")
    with pytest.raises(SpikefuseError, match="unknown --model 'resnet'"):
        TrainConfig(model="resnet")


# --amp ----------------------------------------------------------------------------------------


def test_bf16_autocast_runs_the_network_in_bf16_on_the_cpu(tmp_path: Path) -> None:
    from spikefuse import neuron

    model = build_model(neuron.LIFNode)
    dtypes = []
    model[0].register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))
    images = torch.rand(4, 1, 8, 8)
    assert forward(model, images, T=2).dtype == torch.float32
    assert forward(model, images, T=2, amp="bf16").dtype == torch.float32  # logits for the loss
    assert dtypes == [torch.float32, torch.bfloat16]
    # And a whole run, fused, trains under it.
    options = ["--limit", "40", "--batch-size", "20", "--amp", "bf16", "--fuse"]
    assert train(tmp_path / "bf16.pt", *options) == 0


def test_amp_is_validated_while_parsing(capsys: pytest.CaptureFixture[str]) -> None:
    assert "argument --amp: invalid choice: 'fp16'" in usage_error(capsys, "--amp", "fp16")
    with pytest.raises(SpikefuseError, match="unknown --amp 'fp8'"):
        TrainConfig(amp="fp8")
    with pytest.raises(SpikefuseError, match="fuse must be True or False"):
        TrainConfig(fuse="yes")


# CIFAR-10 --------------------------------------------------------------------------------------


def test_cifar10_is_read_from_its_binary_format(tmp_path: Path) -> None:
    folder = write_cifar10(tmp_path / "bin")
    raw = np.fromfile(folder / CIFAR10_TEST_FILE, dtype=np.uint8).reshape(RECORDS, -1)
    data = load_cifar10(folder, seed=0)
    assert data.x_train.shape == (5 * RECORDS, 3, 32, 32) and data.x_test.shape == (
        RECORDS,
        3,
        32,
        32,
    )
    assert data.x_train.dtype == torch.float32 and data.y_train.dtype == torch.int64
    # Record i of the test file: label byte, then 1024 red, 1024 green and 1024 blue pixels.
    torch.testing.assert_close(data.y_test, torch.from_numpy(raw[:, 0].astype(np.int64)))
    pixels = torch.from_numpy(raw[:, 1:].astype(np.float32) / 255).reshape(RECORDS, 3, 32, 32)
    torch.testing.assert_close(data.x_test, pixels)
    assert 0.0 <= float(data.x_train.min()) and float(data.x_train.max()) <= 1.0
    limited = load_cifar10(folder, seed=0, limit=30)
    assert len(limited.y_train) == 30 and len(limited.y_test) == RECORDS
    with pytest.raises(SpikefuseError, match="hold only 100 training samples"):
        load_cifar10(folder, seed=0, limit=101)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda path: path.unlink(), "does not exist: --data-dir must be the folder of"),
        (lambda path: path.write_bytes(b""), "is truncated or not in CIFAR-10's binary format"),
        (
            lambda path: path.write_bytes(path.read_bytes()[:-1]),
            f"its {RECORDS * CIFAR10_RECORD_BYTES - 1} bytes are not a whole number",
        ),
        (
            lambda path: path.write_bytes(b"\x0c" + path.read_bytes()[1:]),
            "is corrupt: record 0 has label 12, not 0..9",
        ),
        (lambda path: (path.unlink(), path.mkdir()), "cannot read CIFAR-10 file"),
    ],
    ids=["missing", "empty", "short", "label", "directory"],
)
def test_bad_cifar10_files_are_clear_errors_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], damage, message: str
) -> None:
    folder = write_cifar10(tmp_path / "bin")
    bad = folder / CIFAR10_TRAIN_FILES[2]
    damage(bad)
    path = tmp_path / "run.pt"
    assert train(path, "--data", "cifar10", "--data-dir", str(folder)) == 1
    err = capsys.readouterr().err
    assert err.startswith("spikefuse: error: ") and "Traceback" not in err
    assert f"CIFAR-10 file '{bad}'" in err and message in err
    assert not path.exists()


def test_cifar10_options_are_validated_while_parsing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "--data cifar10 needs --data-dir" in usage_error(capsys, "--data", "cifar10")
    err = usage_error(capsys, "--data-dir", str(tmp_path))
    assert "--data-dir is for --data cifar10 or a neuromorphic set; the digits are built in" in err
    err = usage_error(capsys, "--data", "cifar10", "--data-dir", str(tmp_path), "--limit", "5")
    assert "--limit must be >= 10, got 5 (--data cifar10)" in err
    # Beyond the digits' 1797 is fine for CIFAR-10 (checked against the files when read).
    TrainConfig(data="cifar10", data_dir=str(tmp_path), limit=5000)


# torchrun / DistributedDataParallel -----------------------------------------------------------

WORLD = 2


def _ddp_worker(rank: int, port: int, folder: str, argv: list[str]) -> None:
    set_torchrun_environment(rank, WORLD, port)
    # Keep each rank's final weights: the model evaluate() sees after the last epoch.
    evaluate = loop.evaluate

    def recording_evaluate(model, *args, **kwargs):
        torch.save(model.state_dict(), Path(folder, f"rank{rank}.weights"))
        return evaluate(model, *args, **kwargs)

    loop.evaluate = recording_evaluate  # the name the training loop calls
    status = main(["train", *argv])
    if status != 0:
        raise AssertionError(f"rank {rank} exited with {status}")


@pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"
)
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_two_gloo_processes_train_identical_replicas(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], fused: bool
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # gloo on the CPU even where GPUs exist
    checkpoint = tmp_path / "ddp" / "digits.pt"
    # 75 training samples: 37 per rank (one dropped), batches of 10, 10, 10 and 7 on each.
    argv = [*QUICK, "--limit", "100", "--batch-size", "10", "--checkpoint", str(checkpoint)]
    mp.spawn(
        _ddp_worker,
        args=(free_port(), str(tmp_path), argv + (["--fuse"] if fused else [])),
        nprocs=WORLD,
        join=True,
    )
    rank0 = torch.load(tmp_path / "rank0.weights", weights_only=True)
    rank1 = torch.load(tmp_path / "rank1.weights", weights_only=True)
    assert rank0.keys() == rank1.keys()
    params = {k for k in rank0 if "running" not in k and "num_batches" not in k}
    for key in params if not fused else rank0:  # fused BatchNorm synchronises running stats too
        torch.testing.assert_close(rank1[key], rank0[key], rtol=0, atol=0, msg=key)
    saved = torch.load(checkpoint, weights_only=True)["model"]
    for key in params:
        torch.testing.assert_close(saved[key], rank0[key], rtol=0, atol=0, msg=key)
    out = capfd.readouterr().out
    assert out.count("epoch 1/1: ") == 1 and "processes: 2" in out  # rank 0 alone prints
    written = sorted(p.name for p in checkpoint.parent.iterdir())
    assert written == ["digits.pt", "digits.pt.csv", "digits.pt.png"]


@pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"
)
def test_when_rank_0_refuses_the_checkpoint_every_rank_stops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    checkpoint = tmp_path / "digits.pt"
    assert train(checkpoint, "--limit", "20") == 0  # exists: a new run needs --overwrite
    capfd.readouterr()
    before = checkpoint.read_bytes()
    argv = [*QUICK, "--limit", "20", "--checkpoint", str(checkpoint)]
    args = (free_port(), str(tmp_path), [argv] * WORLD)
    mp.spawn(status_worker, args=args, nprocs=WORLD, join=True)
    assert [Path(tmp_path, f"rank{r}.status").read_text() for r in range(WORLD)] == ["1", "1"]
    err = capfd.readouterr().err
    assert "already exists; pass --resume" in err and "rank 0 stopped the run: " in err
    assert checkpoint.read_bytes() == before


@pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"
)
def test_when_another_rank_cannot_read_the_data_every_rank_stops(
    tmp_path: Path, cifar: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    checkpoint = tmp_path / "run.pt"
    argv = [*QUICK, "--data", "cifar10", "--limit", "10", "--checkpoint", str(checkpoint)]
    per_rank = [[*argv, "--data-dir", str(cifar)], [*argv, "--data-dir", str(tmp_path / "none")]]
    mp.spawn(status_worker, args=(free_port(), str(tmp_path), per_rank), nprocs=WORLD, join=True)
    assert [Path(tmp_path, f"rank{r}.status").read_text() for r in range(WORLD)] == ["1", "1"]
    err = capfd.readouterr().err
    assert f"rank 1 stopped the run: CIFAR-10 file '{tmp_path / 'none'}" in err
    assert not checkpoint.exists()


def test_each_rank_takes_an_equal_share_of_the_epoch() -> None:
    config = TrainConfig(seed=3)
    shares = [
        train_module.epoch_order(config, 1, 75, train_module.Ranks(rank, 2)) for rank in (0, 1)
    ]
    assert len(shares[0]) == len(shares[1]) == 37
    assert not set(shares[0].tolist()) & set(shares[1].tolist())
    whole = train_module.epoch_order(config, 1, 75, train_module.Ranks())
    assert sorted(whole.tolist()) == list(range(75))  # one process: every sample, as before


def test_torchrun_environment_is_validated() -> None:
    assert not ranks_from_env({}).distributed
    assert not ranks_from_env({"WORLD_SIZE": "1"}).distributed
    ranks = ranks_from_env({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1"})
    assert (ranks.rank, ranks.world_size, ranks.local_rank, ranks.main) == (3, 4, 1, False)
    with pytest.raises(SpikefuseError, match="RANK is None, not a whole number"):
        ranks_from_env({"WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    with pytest.raises(SpikefuseError, match="RANK=2 is outside 0..WORLD_SIZE-1=1"):
        ranks_from_env({"WORLD_SIZE": "2", "RANK": "2", "LOCAL_RANK": "0"})


# The CSV log and the plot ----------------------------------------------------------------------


def read_log(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_the_log_and_plot_follow_the_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "run.pt"
    options = ["--limit", "40", "--batch-size", "20"]
    assert train(path, *options, "--epochs", "2") == 0
    log = train_module.log_paths(path)[0]
    assert log.read_text().splitlines()[0] == LOG_HEADER
    rows = read_log(log)
    assert [row["epoch"] for row in rows] == ["1", "2"]
    for row in rows:
        assert float(row["train_loss"]) > 0 and 0 <= float(row["test_accuracy"]) <= 1
        assert float(row["seconds"]) >= 0
    payload = torch.load(path, weights_only=True)
    assert float(rows[-1]["test_accuracy"]) == pytest.approx(payload["test_accuracy"], abs=1e-5)
    plot = train_module.log_paths(path)[1].read_bytes()
    assert plot.startswith(b"\x89PNG\r\n\x1a\n")

    # Resume appends; rows after the checkpoint's epoch (a checkpoint put back) are dropped.
    assert train(path, *options, "--epochs", "3", "--resume") == 0
    assert [row["epoch"] for row in read_log(log)] == ["1", "2", "3"]
    torch.save(payload, path)  # back at epoch 2
    assert train(path, *options, "--epochs", "4", "--resume") == 0
    assert [row["epoch"] for row in read_log(log)] == ["1", "2", "3", "4"]
    assert read_log(log)[:2] == rows

    # Overwrite starts the log over.
    assert train(path, *options, "--overwrite") == 0
    assert [row["epoch"] for row in read_log(log)] == ["1"]


@pytest.mark.parametrize("suffix", [".csv", ".png"])
@pytest.mark.parametrize("flags", [[], ["--overwrite"], ["--resume"]])
def test_a_foreign_file_where_the_log_goes_is_never_replaced(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    suffix: str,
    flags: list[str],
) -> None:
    path = tmp_path / "run.pt"
    options = ["--limit", "20", "--epochs", "2"]
    if flags:
        assert train(path, *options[:2]) == 0
    capsys.readouterr()
    foreign = path.with_name(path.name + suffix)
    foreign.write_bytes(b"my results\n")
    before = path.read_bytes() if path.exists() else None
    assert train(path, *options, *flags) == 1
    captured = capsys.readouterr()
    assert f"'{foreign}' exists and is not a spikefuse training log or plot" in captured.err
    assert captured.out == ""  # refused before training
    assert foreign.read_bytes() == b"my results\n"
    assert (path.read_bytes() if path.exists() else None) == before


def test_a_left_over_log_needs_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without its checkpoint the run cannot resume: the error offers --overwrite only."""
    path = tmp_path / "run.pt"
    assert train(path, "--limit", "20") == 0
    path.unlink()  # the log and plot stay
    log = train_module.log_paths(path)[0].read_bytes()
    assert train(path, "--limit", "20") == 1
    err = capsys.readouterr().err
    expected = f"training log '{train_module.log_paths(path)[0]}' already exists; pass --overwrite"
    assert expected in err and "--resume" not in err
    assert train_module.log_paths(path)[0].read_bytes() == log and not path.exists()
    assert train(path, "--limit", "20", "--overwrite") == 0


def test_a_damaged_log_stops_a_resume(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "run.pt"
    assert train(path, "--limit", "20") == 0
    log = train_module.log_paths(path)[0]
    log.write_text(f"{LOG_HEADER}\n1,abc,0.5,1.0\n")
    assert train(path, "--limit", "20", "--epochs", "2", "--resume") == 1
    assert "line 2 is '1,abc,0.5,1.0'" in capsys.readouterr().err
    assert torch.load(path, weights_only=True)["epoch"] == 1


def test_a_log_linked_to_its_checkpoint_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "run.pt"
    train_module.log_paths(path)[0].symlink_to(path)
    assert train(path, "--limit", "20") == 1
    assert "would be overwritten by its own training log or plot" in capsys.readouterr().err
    assert not path.exists()


def test_checkpoints_sharing_a_stem_keep_their_logs_apart(tmp_path: Path) -> None:
    first, second = tmp_path / "a.pt", tmp_path / "a.ckpt"
    assert train(first, "--limit", "20") == 0
    log = train_module.log_paths(first)[0].read_bytes()
    assert train(second, "--limit", "20") == 0  # no "log already exists", nothing replaced
    assert train_module.log_paths(first)[0].read_bytes() == log
    assert train_module.log_paths(second)[0].exists()


@pytest.mark.parametrize("memory", ["min", "auto"])
def test_memory_mode_training_matches_default_fused(tmp_path, memory):
    """--fuse --memory min (or auto) trains exactly like --fuse (same gradients, recomputed)."""
    from spikefuse.cli import main

    options = "--limit 200 --batch-size 50 --T 2 --device cpu --quiet --epochs 1 --fuse"
    common = ["train", *options.split()]
    assert main([*common, "--checkpoint", str(tmp_path / "a.pt")]) == 0
    assert main([*common, "--memory", memory, "--checkpoint", str(tmp_path / "b.pt")]) == 0
    a = torch.load(tmp_path / "a.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "b.pt", weights_only=True)["model"]
    for key in a:
        torch.testing.assert_close(b[key], a[key], msg=key)
    with pytest.raises(SystemExit):
        main(["train", "--memory", "min", "--device", "cpu"])  # without --fuse
