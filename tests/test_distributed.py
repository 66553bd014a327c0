"""Synchronised fused BatchNorm: 2 gloo processes × batch B train exactly like 1 × batch 2B.

Runs the DDP check ``scripts/ddp_check.py`` (DDP-wrapped fused model vs a whole-batch reference,
several SGD steps) as a program in two processes, the way torchrun starts it, on a free
loopback port.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

import spikefuse
from conftest import free_port

ROOT = Path(__file__).resolve().parents[1]
SRC = str(Path(spikefuse.__file__).resolve().parents[1])
WORLD = 2

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"
)


def test_two_processes_match_one_process_with_double_batch():
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
    command = [
        sys.executable,
        str(ROOT / "scripts" / "ddp_check.py"),
        "--dtype",
        "float64",
        "float32",
    ]
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
    outputs = [rank.communicate(timeout=300)[0] for rank in ranks]
    for rank, (process, output) in enumerate(zip(ranks, outputs, strict=True)):
        assert process.returncode == 0, (
            f"rank {rank}: the 2-process run differs from the 1-process run\n{output}"
        )
    assert outputs[0].count("PASS") == 2, outputs[0]
