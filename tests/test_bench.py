"""The benchmarks' timing helpers, on the CPU (their GPU figures come from the device runs)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from conftest import import_script
from spikefuse.bench.common import BenchResult, read_csv, time_interleaved, write_csv


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


def test_gaps_leave_out_the_profilers_own_stalls() -> None:
    """A gap that a profiler stall covers is not the host pacing the GPU: only the rest of it
    counts as idle; overlapping kernels count once as busy."""
    kernels = [(0.0, 10.0, "a"), (5.0, 12.0, "b"), (20.0, 25.0, "c"), (100.0, 101.0, "d")]
    stalls = [(30.0, 95.0)]  # inside the gap between c and d
    busy, stalled, gaps = import_script("benchmarks/profile_e2e.py").idle_gaps(kernels, stalls)
    assert busy == 12.0 + 5.0 + 1.0
    assert stalled == 65.0
    assert gaps == [(8.0, "b", "c"), (10.0, "c", "d")]  # 75 us between c and d, 65 stalled


def test_results_read_back_as_written(tmp_path: Path) -> None:
    rows = [
        BenchResult("e2e-small", "fused", "fp32", 1.5, 1.25, 0.5, 700.0, note="a, b"),
        BenchResult("e2e-small", "vanilla", "bf16", error="RuntimeError: out of memory"),
    ]
    write_csv(tmp_path / "r.csv", rows)
    back = read_csv(tmp_path / "r.csv")
    assert back[0] == rows[0]
    assert back[1].error == rows[1].error and math.isnan(back[1].ms) and not back[1].ok


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_each_result_set_has_what_its_benchmarks_write(gpu: str) -> None:
    """A README, and per benchmark the CSV, the plot (and the neuron benchmark's text), with
    a measured row for every variant of the end-to-end runs and both dtypes."""
    folder = BENCHMARKS / gpu
    names = {f"e2e_{m}.{ext}" for m in ("small", "medium", "large") for ext in ("csv", "png")}
    names |= {"neuron.csv", "neuron.png", "neuron.txt", "README.md"}
    assert {p.name for p in folder.iterdir()} - {"user-loop", "zoo", "profile"} == names
    user_loop = folder / "user-loop"
    for path in sorted(user_loop.glob("e2e_*.csv")) if user_loop.is_dir() else ():
        rows = read_csv(path)
        assert {r.dtype for r in rows} == {"fp32", "bf16"}
        assert all(r.ok and r.ms > 0 and r.peak_mib > 0 for r in rows), path.name
        assert {"fused", "fused+model-graphs", "fused+graph"} <= {r.variant for r in rows}
        assert path.with_suffix(".png").exists()
    for path in sorted((folder / "zoo").glob("e2e_*.csv")):
        rows = read_csv(path)  # SpikingJelly's rows may say it is missing or lacks the network
        assert all(r.ok and r.ms > 0 for r in rows if r.variant != "spikingjelly"), path.name
        assert {"vanilla", "fused", "fused+graph"} <= {r.variant for r in rows}
    for model in ("small", "medium", "large"):
        rows = read_csv(folder / f"e2e_{model}.csv")
        assert {r.dtype for r in rows} == {"fp32", "bf16"}
        assert all(r.ok and r.ms > 0 and r.peak_mib > 0 for r in rows)
        assert {"vanilla", "fused", "fused+graph"} <= {r.variant for r in rows}


def test_tables_of_a_result_set_quote_its_csv() -> None:
    tables = import_script("benchmarks/tables.py")
    rows = {(r.variant, r.dtype): r for r in read_csv(BENCHMARKS / "h200" / "e2e_medium.csv")}
    vanilla, graphed = rows["vanilla", "fp32"], rows["fused+graph", "fp32"]
    cell = f"{graphed.ms:.1f} ms ({vanilla.ms / graphed.ms:.1f}x)"
    assert cell in tables.headline_table(BENCHMARKS / "h200").splitlines()[2]
    text = tables.all_tables(BENCHMARKS / "h100")
    assert "| fused + CUDA graph |" in text and "| 32 | float32 |" in text
    assert "fused + torch.compile" not in text  # a variant the set did not run has no row


def test_bench_variants_follow_the_memory_registry(monkeypatch) -> None:
    """Every registered memory mode is a fused variant of the end-to-end benchmark
    (``fused-<mode>``, with its suffixes), which the command line takes and build() fuses with
    that mode; the listed variants keep their order."""
    from spikefuse.bench import e2e
    from spikefuse.fused import FusedBlock
    from spikefuse.fused import memory as memory_module

    before = e2e.variants()
    assert before[: len(e2e.VARIANTS)] == e2e.VARIANTS
    assert before[len(e2e.VARIANTS) :] == tuple(
        f"fused-{mode}{suffix}"
        for mode in ("min", "auto")
        for suffix in ("", "+graph", "+model-graphs")
    )
    monkeypatch.setattr(memory_module, "_POLICIES", dict(memory_module._POLICIES))

    @memory_module.register_memory
    class KeepAll(memory_module.DefaultMemory):
        name = "keep-all"

    assert e2e.fused_memory()["fused-keep-all"] == "keep-all"
    assert e2e.variants()[-3:] == (
        "fused-keep-all",
        "fused-keep-all+graph",
        "fused-keep-all+model-graphs",
    )
    args = e2e.build_parser().parse_args(["--variants", "fused-keep-all"])
    assert args.variants == ["fused-keep-all"]
    net = e2e.build("fused-keep-all", "small", torch.device("cpu"))
    blocks = [m for m in net.modules() if isinstance(m, FusedBlock)]
    assert blocks and all(block.memory == "keep-all" for block in blocks)


def test_neuron_bench_rows_match_its_committed_tables() -> None:
    """The LIF table's variants and the neuron table's neurons, in the order of the committed
    H200 result set; only "cuda graphed" captures its step; --no-compile drops the compiled."""
    from spikefuse.bench import neuron

    rows = read_csv(BENCHMARKS / "h200" / "neuron.csv")
    g = torch.zeros(2, 1, 4)
    variants = neuron._lif_variants(g, compiled=True)
    labels = [label for label, _, _ in variants]
    assert labels == list(dict.fromkeys(r.variant for r in rows if r.bench.startswith("LIF")))
    assert [label for label, _, graphed in variants if graphed] == ["cuda graphed"]
    eager = [label for label, _, _ in neuron._lif_variants(g, compiled=False)]
    compiled = {"torch.compile loop", "cuda compiled", "cuda reduce-overhead", "compiled floor"}
    assert eager == [label for label in labels if label not in compiled]
    neurons = [r.variant for r in rows if not r.bench.startswith("LIF")]
    assert list(dict.fromkeys(neurons)) == list(neuron.NEURONS)


def test_neuron_bench_checks_its_arguments_and_writes_its_report(tmp_path: Path) -> None:
    """Bad arguments end the command line before anything runs; the report and the files
    written from measured rows hold both tables, and failed rows keep their error."""
    from spikefuse.bench import neuron

    with pytest.raises(SystemExit):
        neuron.main(["--rounds", "0"])
    args, _ = neuron._parse_args(["--T", "8", "--out", str(tmp_path)])
    assert (args.T, args.batch, args.features, args.rounds) == ([8], 64, 32768, 5)
    pytest.importorskip("matplotlib")
    lif = [
        BenchResult("LIF T=8", "cuda", "float32", 0.5, 0.4, 0.1, 64.0, note="600 GB/s"),
        BenchResult("LIF T=8", "cuda graphed", "float32", error="RuntimeError: capture"),
    ]
    neurons = [BenchResult("T=8", "IF", "float32", 0.6, 0.5, 0.1, 64.0, note="1.20x LIF")]
    text = neuron._report("LIF forward+backward", 3, lif, neurons)
    assert "T=8 IF float32: 1.20x LIF" in text and "LIF T=8 cuda float32: 600 GB/s" in text
    assert "neurons (cuda backend, 3 interleaved rounds)" in text
    neuron._write(args.out, text, "LIF forward+backward", lif, neurons)
    assert (tmp_path / "neuron.txt").read_text() == text
    back = read_csv(tmp_path / "neuron.csv")
    assert [r.variant for r in back] == ["cuda", "cuda graphed", "IF"]
    assert back[0] == lif[0] and back[2] == neurons[0] and back[1].error == lif[1].error
    assert (tmp_path / "neuron.png").stat().st_size > 0
