"""Synchronised fused BatchNorm: 2 gloo processes × batch B train exactly like 1 × batch 2B.

Runs the DDP check ``scripts/ddp_check.py`` (DDP-wrapped fused model vs a whole-batch reference,
several SGD steps) as a program in two processes, the way torchrun starts it, on a free
loopback port: the small CNN and SEW-ResNet-18 (every memory mode), all checks in one run. ResNet-19, whose unfused
BatchNorms need torch's CUDA-only SyncBatchNorm, is checked on GPUs (scripts/gpu_all.sh); here
its refusal and its BatchNorm conversion are.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import spikefuse
from conftest import free_port
from spikefuse.fused import fuse

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ddp_check.py"
SRC = str(Path(spikefuse.__file__).resolve().parents[1])
WORLD = 2

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"
)


def _run_ddp_check(*args: str) -> list[tuple[int, str]]:
    """(exit status, output) of each of the WORLD processes running ddp_check.py with ``args``."""
    port = free_port()
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",  # gloo on CPU even where GPUs exist
        "OMP_NUM_THREADS": "1",
        # the spikefuse these tests import
        "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(WORLD),
        "LOCAL_WORLD_SIZE": str(WORLD),
    }
    command = [sys.executable, str(SCRIPT), *args]
    ranks = [
        subprocess.Popen(
            command,
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(WORLD)
    ]
    outputs = [rank.communicate(timeout=900)[0] for rank in ranks]
    return [(process.returncode, output) for process, output in zip(ranks, outputs, strict=True)]


#: The checks of the CPU run, one launch of two processes for all of them (each launch costs two
#: interpreters importing torch): (options, the PASS lines they print, by their start).
CHECKS = {
    "double_batch": (["--dtype", "float64", "float32"], ["cnn (memory=default) 2 x batch 4"] * 2),
    "repeated": (["--dtype", "float64", "--repeated"], ["cnn (memory=default, repeated)"]),
    "chunked": (
        ["--memory", "min", "--chunked", "--dtype", "float64"],
        ["cnn (memory=min, chunked)"],
    ),
    **{
        f"sew_resnet18_{memory}": (
            ["--model", "sew_resnet18", "--memory", memory, "--dtype", "float64"]
            + ["--steps", "2", "--batch", "2"],
            [f"sew_resnet18 (memory={memory})"],
        )
        for memory in ("default", "min", "auto")
    },
}
#: Last: ResNet-19, refused on the CPU (its unfused BatchNorms need torch's CUDA-only
#: SyncBatchNorm), so the run ends with that error after every other check has passed.
REFUSED = ["--model", "spiking_resnet19", "--steps", "1"]


@pytest.fixture(scope="module")
def cpu_run() -> list[tuple[int, str]]:
    args: list[str] = []
    for options, _ in CHECKS.values():
        args += [*options, "+"]
    return _run_ddp_check(*args, *REFUSED)


def _assert_passed(results: list[tuple[int, str]], check: str) -> None:
    """Rank 0 printed the check's PASS lines and no rank printed a FAIL."""
    lines = results[0][1].splitlines()
    for rank, (_, output) in enumerate(results):
        assert "FAIL" not in output, f"rank {rank}: a 2-process run differs\n{output}"
    expected = CHECKS[check][1]
    for start in set(expected):
        found = [line for line in lines if line.startswith(f"PASS: {start}")]
        assert len(found) == expected.count(start), results[0][1]


def test_two_processes_match_one_process_with_double_batch(cpu_run):
    _assert_passed(cpu_run, "double_batch")


def test_two_processes_match_one_process_on_an_input_repeated_over_time(cpu_run):
    """images.expand(T, ...): the first block's statistics come from one step, with the count
    of all T steps over both processes."""
    _assert_passed(cpu_run, "repeated")


def test_min_memory_blocks_in_batch_chunks_match_one_process(cpu_run):
    """memory="min" blocks run in chunks of one sample: the statistics combine over the chunks,
    then over the processes, and backward's sums likewise."""
    _assert_passed(cpu_run, "chunked")


@pytest.mark.parametrize("memory", ["default", "min", "auto"])
def test_fused_sew_resnet18_two_processes_match_one_process(cpu_run, memory):
    """SEW-ResNet-18 (every BatchNorm fused and synchronised), every memory mode."""
    _assert_passed(cpu_run, f"sew_resnet18_{memory}")


def test_resnet19_is_refused_on_cpu_naming_its_unfused_batchnorms(cpu_run):
    """ResNet-19's downsample BNs (the Conv1x1 -> BN shortcuts of its residual chains) need
    torch's SyncBatchNorm: CUDA only."""
    for returncode, output in cpu_run:
        assert returncode != 0, output
        assert "layer2.0.downsample.1" in output, output
        assert "SyncBatchNorm runs on CUDA only" in output, output


def test_checks_of_one_run_are_separated_by_plus(monkeypatch):
    """Each check of a run takes its own options; --chunked needs memory='min', and
    --share-gpu is one choice for the whole run."""
    ddp_check = _ddp_check_module(monkeypatch)
    parser = ddp_check.build_parser()
    checks = ddp_check.parse_checks(parser, ["--repeated", "+", "--memory", "min", "--chunked"])
    assert [(c.repeated, c.memory, c.chunked) for c in checks] == [
        (True, "default", False),
        (False, "min", True),
    ]
    for argv in (["--chunked"], ["--share-gpu", "+", "--repeated"]):
        with pytest.raises(SystemExit):
            ddp_check.parse_checks(parser, argv)


def _ddp_check_module(monkeypatch: pytest.MonkeyPatch):
    """scripts/ddp_check.py imported as a module."""
    spec = importlib.util.spec_from_file_location("ddp_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    ddp_check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "ddp_check", ddp_check)  # its dataclasses look it up
    spec.loader.exec_module(ddp_check)
    return ddp_check


def test_sharing_a_gpu_needs_one(monkeypatch, capsys):
    """--share-gpu (every rank on cuda:0 through gloo) refuses to run without a GPU, before
    any process group is set up."""
    ddp_check = _ddp_check_module(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as stopped:
        ddp_check.main(["--share-gpu"])
    assert stopped.value.code == 2
    assert "--share-gpu needs a CUDA GPU, and PyTorch sees none" in capsys.readouterr().err


def test_unfused_batchnorms_become_multi_step_sync_batchnorms_computing_the_same(monkeypatch):
    """Without a process group torch's SyncBatchNorm is BatchNorm: the converted ResNet-19
    computes what the fused one does, with the same parameters and buffers (shared)."""
    ddp_check = _ddp_check_module(monkeypatch)
    torch.manual_seed(0)
    fused = fuse(ddp_check.NETWORKS["spiking_resnet19"].build()).double()
    synced = copy.deepcopy(fused)
    ddp_check.synchronise_unfused_batchnorms(synced, None)
    assert ddp_check.unfused_batchnorms(fused) == ["layer2.0.downsample.1", "layer3.0.downsample.1"]
    assert isinstance(synced.layer2[0].downsample[1][0], torch.nn.SyncBatchNorm)
    x = torch.randn(2, 3, 3, 8, 8, dtype=torch.float64) * 2
    torch.testing.assert_close(synced(x), fused(x), rtol=0, atol=0)
    for (name, a), b in zip(fused.state_dict().items(), synced.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
