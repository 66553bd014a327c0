"""Shared helpers for the benchmarks: timing, peak memory, result tables, CSV and PNG output.

Three times per step, each the median over measured steps after a warm-up (see
:func:`time_step`): the headline ``ms`` is what a training loop that synchronises once per step
sees (CUDA events around each step, ``synchronize`` after it: host time is not hidden behind
queued work); ``queued_ms`` is the same steps issued back to back (the GPU's pace when the host
keeps ahead); ``host_ms`` is the host time to issue one step. ``host_ms`` close to ``ms`` means
the step is host-bound. Memory is the peak of ``torch.cuda.max_memory_allocated`` over the
setup (model, warm-up and, for CUDA graphs, the capture, whose memory the graph keeps) and the
measured iterations (CPU runs report no memory figure).
"""

from __future__ import annotations

import csv
import gc
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from ..extras import require

MIB = 1024 * 1024


def require_plots() -> None:
    """Raise :class:`~spikefuse.extras.MissingExtraError` unless matplotlib (the ``bench``
    extra) is installed; the benchmarks call it before measuring, so that a missing plotting
    package does not surface only after a long run."""
    require("spikefuse bench", "bench", {"matplotlib": "the result plots"})


@dataclass
class BenchResult:
    """One row of a benchmark table.

    ``ms`` is the median milliseconds per step with a synchronize after each (the headline),
    ``queued_ms`` the median of back-to-back steps, ``host_ms`` the median host time to issue a
    step, ``peak_mib`` the peak allocated MiB (NaN when not measured, e.g. on CPU), ``error``
    the failure message of a variant that could not run.
    """

    bench: str
    variant: str
    dtype: str
    ms: float = math.nan
    queued_ms: float = math.nan
    host_ms: float = math.nan
    peak_mib: float = math.nan
    error: str = ""
    note: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Timing:
    """Medians in milliseconds per step (see the module docstring)."""

    synced: float
    queued: float
    host: float


def time_step(fn: Callable[[], object], device: torch.device, *, warmup: int, iters: int) -> Timing:
    """Time ``fn()`` (one step) ``iters`` times after ``warmup`` calls, three ways.

    Synchronised: CUDA events around each call and a ``synchronize`` after it (the headline);
    the host time of each such call is read with ``perf_counter`` before the synchronize.
    Queued: ``iters`` more calls issued back to back, events around each, one synchronize at
    the end. On the CPU all three are the wall time of a call.
    """
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    for _ in range(warmup):
        fn()
    synchronize(device)
    if device.type != "cuda":
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        ms = statistics.median(times)
        return Timing(ms, ms, ms)
    synced, host = [], []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        fn()
        end.record()
        host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize(device)
        synced.append(start.elapsed_time(end))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, end in zip(starts, ends, strict=True):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    queued = [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]
    return Timing(statistics.median(synced), statistics.median(queued), statistics.median(host))


def time_interleaved(
    steps: Mapping[str, Callable[[], object]],
    device: torch.device,
    *,
    warmup: int,
    iters: int,
    rounds: int,
) -> dict[str, Timing]:
    """:func:`time_step` of several steps in ``rounds`` rounds, each timing every step once
    (``iters`` calls after ``warmup``), in turn; per step the median of its rounds' medians.

    For comparing steps with each other: the host's pace drifts within a process (clock,
    caches, other work on the machine) by more than the differences between neurons, and one
    step timed after another would carry that drift into their ratio."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    runs: dict[str, list[Timing]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, fn in steps.items():
            runs[name].append(time_step(fn, device, warmup=warmup, iters=iters))
    return {
        name: Timing(
            statistics.median(t.synced for t in timings),
            statistics.median(t.queued for t in timings),
            statistics.median(t.host for t in timings),
        )
        for name, timings in runs.items()
    }


def measure(
    bench: str,
    variant: str,
    dtype: str,
    setup: Callable[[], Callable[[], object]],
    device: torch.device,
    *,
    warmup: int,
    iters: int,
    note: str = "",
) -> BenchResult:
    """Build a step with ``setup()`` and time it; any exception becomes the row's ``error``.

    ``setup`` runs inside the guard too, so a variant that cannot even be constructed (missing
    backend, compile failure, out of memory) is reported in its row instead of ending the run.
    """
    result = BenchResult(bench=bench, variant=variant, dtype=dtype, note=note)
    try:
        if device.type == "cuda":
            # A predecessor's model caught in a reference cycle stays allocated until the
            # cyclic collector runs: collect it now, or this variant's peak would count it
            # (the cache itself is emptied after each variant, below).
            gc.collect()
            torch.cuda.reset_peak_memory_stats(device)
        step = setup()
        timing = time_step(step, device, warmup=warmup, iters=iters)
        result.ms, result.queued_ms, result.host_ms = timing.synced, timing.queued, timing.host
        # The peak over setup, warm-up and the timed steps: a CUDA graph holds the memory its
        # capture allocated (in setup for +graph; in the first calls under torch.compile's
        # reduce-overhead, whose replays allocate nothing the allocator sees).
        result.peak_mib = (
            torch.cuda.max_memory_allocated(device) / MIB if device.type == "cuda" else math.nan
        )
    except Exception as exc:  # a failing variant must not end the benchmark
        message = str(exc).strip().splitlines()
        result.error = f"{type(exc).__name__}: {message[0] if message else ''}"[:200]
    finally:
        if device.type == "cuda":
            # cuBLAS keeps a workspace per stream it ran on (32 MiB on Hopper) for the life of
            # the process: a variant's peak would count the ones its predecessors' side streams
            # left behind (as PyTorch's own memory-leak checks do, drop them between variants).
            torch._C._cuda_clearCublasWorkspaces()
            torch.cuda.empty_cache()
    return result


def format_table(results: Sequence[BenchResult], *, baseline: str | None = None) -> str:
    """A fixed-width text table; with ``baseline``, speed-up and memory ratios per dtype."""
    header = ["bench", "variant", "dtype", "ms/step", "queued", "host", "peak MiB"]
    if baseline is not None:
        header += ["speedup", "mem ratio"]
    rows = [header]
    base = {r.dtype: r for r in results if r.variant == baseline and r.ok}
    for r in results:
        if not r.ok:
            rows.append([r.bench, r.variant, r.dtype, "FAILED: " + r.error])
            continue
        row = [r.bench, r.variant, r.dtype, f"{r.ms:.2f}"]
        row += [_fmt(r.queued_ms, ".2f"), _fmt(r.host_ms, ".2f"), _fmt(r.peak_mib, ".0f")]
        if baseline is not None:
            b = base.get(r.dtype)
            row += [
                _fmt(b.ms / r.ms if b else math.nan, ".2f", suffix="x"),
                _fmt(r.peak_mib / b.peak_mib if b else math.nan, ".2f", suffix="x"),
            ]
        rows.append(row)
    full = [row for row in rows if len(row) == len(header)]
    widths = [max(len(row[i]) for row in full) for i in range(len(header))]
    lines = []
    for row in rows:
        if len(row) < len(header):  # a failure message spans the remaining columns
            cells = [c.ljust(w) for c, w in zip(row[:-1], widths, strict=False)] + [row[-1]]
        else:
            cells = [c.ljust(w) for c, w in zip(row, widths, strict=True)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _fmt(value: float, spec: str, suffix: str = "") -> str:
    return "-" if math.isnan(value) else f"{value:{spec}}{suffix}"


def write_csv(path: Path, results: Sequence[BenchResult]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[fld.name for fld in fields(BenchResult)])
        writer.writeheader()
        for r in results:
            writer.writerow(asdict(r))


def read_csv(path: Path) -> list[BenchResult]:
    """The rows :func:`write_csv` wrote to ``path`` (a missing figure reads back as NaN)."""
    floats = {fld.name for fld in fields(BenchResult) if fld.type in (float, "float")}
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    results = []
    for row in rows:
        values: dict[str, Any] = {
            k: float(v or "nan") if k in floats else v for k, v in row.items()
        }
        results.append(BenchResult(**values))
    return results


def plot_results(path: Path, results: Sequence[BenchResult], title: str) -> None:
    """Grouped bars: ms/iter and peak MiB per variant, one bar colour per dtype."""
    require_plots()
    import matplotlib

    matplotlib.use("Agg")  # file output only; never needs a display
    import matplotlib.pyplot as plt

    variants = list(dict.fromkeys(r.variant for r in results))
    dtypes = list(dict.fromkeys(r.dtype for r in results))
    by_key = {(r.variant, r.dtype): r for r in results if r.ok}
    metrics = [("ms", "ms / step (synchronised)")]
    if any(not math.isnan(r.peak_mib) for r in by_key.values()):
        metrics.append(("peak_mib", "peak allocated MiB"))
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.5 * len(metrics), 4.2), squeeze=False)
    width = 0.8 / max(len(dtypes), 1)
    for ax, (attr, label) in zip(axes[0], metrics, strict=True):
        for j, dtype in enumerate(dtypes):
            xs, heights = [], []
            for i, variant in enumerate(variants):
                r = by_key.get((variant, dtype))
                if r is not None and not math.isnan(getattr(r, attr)):
                    xs.append(i + (j - (len(dtypes) - 1) / 2) * width)
                    heights.append(getattr(r, attr))
            bars = ax.bar(xs, heights, width, label=dtype)
            ax.bar_label(bars, fmt="%.0f" if attr == "peak_mib" else "%.1f", fontsize=7)
        ax.set_xticks(range(len(variants)), variants, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
