"""The benchmarks' timing helpers, on the CPU (their GPU figures come from the device runs)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

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


def _profile_e2e():
    """scripts/profile_e2e.py imported as a module."""
    path = Path(__file__).resolve().parents[1] / "scripts" / "profile_e2e.py"
    spec = importlib.util.spec_from_file_location("profile_e2e", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gaps_leave_out_the_profilers_own_stalls() -> None:
    """A gap that a profiler stall covers is not the host pacing the GPU: only the rest of it
    counts as idle; overlapping kernels count once as busy."""
    kernels = [(0.0, 10.0, "a"), (5.0, 12.0, "b"), (20.0, 25.0, "c"), (100.0, 101.0, "d")]
    stalls = [(30.0, 95.0)]  # inside the gap between c and d
    busy, stalled, gaps = _profile_e2e().idle_gaps(kernels, stalls)
    assert busy == 12.0 + 5.0 + 1.0
    assert stalled == 65.0
    assert gaps == [(8.0, "b", "c"), (10.0, "c", "d")]  # 75 us between c and d, 65 stalled
