"""The benchmarks' timing helpers, on the CPU (their GPU figures come from the device runs)."""

from __future__ import annotations

import pytest
import torch

from spikefuse.bench.common import time_interleaved


def test_interleaved_rounds_time_every_step_in_turn() -> None:
    calls: list[str] = []
    steps = {name: (lambda name=name: calls.append(name)) for name in ("a", "b")}
    timings = time_interleaved(steps, torch.device("cpu"), warmup=1, iters=2, rounds=3)
    assert set(timings) == {"a", "b"}
    assert calls == (["a"] * 3 + ["b"] * 3) * 3  # per round: a's warm-up + steps, then b's
    assert all(t.synced >= 0 and t.synced == t.queued == t.host for t in timings.values())


def test_interleaved_rounds_need_one() -> None:
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        time_interleaved({"a": lambda: None}, torch.device("cpu"), warmup=0, iters=1, rounds=0)
