"""Synchronised fused BatchNorm: 2 gloo processes × batch B train exactly like 1 × batch 2B.

Runs ``scripts/ddp_check.py`` (DDP-wrapped fused model vs a whole-batch reference, several SGD
steps) in two processes started with torch.multiprocessing on a free loopback port.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))  # spawned workers inherit sys.path, so they find it too

import ddp_check  # noqa: E402

WORLD = 2

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"
)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, argv: list[str]) -> None:
    addresses = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ranks = dict(RANK=str(rank), LOCAL_RANK=str(rank))
    os.environ.update(**addresses, **ranks, WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    status = ddp_check.main(argv)
    if status != 0:
        raise AssertionError(f"rank {rank}: the 2-process run differs from the 1-process run")


def test_two_processes_match_one_process_with_double_batch(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # gloo on CPU even where GPUs exist
    argv = ["--dtype", "float64", "float32"]
    mp.spawn(_worker, args=(_free_port(), argv), nprocs=WORLD, join=True)
