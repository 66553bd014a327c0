"""``spikefuse train`` on the GPU: the digits CNN unfused, fused, fused with memory='min',
eagerly, with model graphs (the default on a GPU) or whole-step graphs, and fused under bf16
autocast reach the same test accuracy within noise (0.03)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from spikefuse.cli import main

pytestmark = [pytest.mark.gpu, pytest.mark.quick]

RUNS = {  # on a GPU the model's forward and backward replay from CUDA graphs by default
    "eager": ["--no-cuda-graph"],
    "fused-eager": ["--fuse", "--no-cuda-graph"],
    "fused": ["--fuse"],
    "fused-memory-min": ["--fuse", "--memory", "min"],
    "step-graph": ["--cuda-graph"],
    "fused-step-graph": ["--fuse", "--cuda-graph", "step"],
    "fused-min-model-graph": ["--fuse", "--memory", "min", "--cuda-graph", "model"],
    "fused-bf16": ["--fuse", "--amp", "bf16"],
}


def trained_accuracy(folder: Path, name: str, options: list[str]) -> float:
    """Train 4 epochs on the GPU with the cuda backend; the final test accuracy (from the log
    written next to the checkpoint)."""
    checkpoint = folder / f"{name}.pt"
    argv = ["train", "--epochs", "4", "--device", "cuda", "--backend", "cuda", "--quiet"]
    assert main([*argv, "--checkpoint", str(checkpoint), *options]) == 0
    with checkpoint.with_name(checkpoint.name + ".csv").open(newline="") as f:
        return float(list(csv.DictReader(f))[-1]["test_accuracy"])


@pytest.fixture(scope="module")
def unfused_accuracy(tmp_path_factory: pytest.TempPathFactory) -> float:
    return trained_accuracy(tmp_path_factory.mktemp("train"), "unfused", [])


def test_unfused_training_learns(unfused_accuracy):
    assert unfused_accuracy > 0.9


@pytest.mark.parametrize("name", list(RUNS))
def test_training_matches_unfused(name, unfused_accuracy, tmp_path, record_property):
    accuracy = trained_accuracy(tmp_path, name, RUNS[name])
    record_property("test_accuracy", accuracy)
    assert abs(accuracy - unfused_accuracy) <= 0.03, (accuracy, unfused_accuracy)
