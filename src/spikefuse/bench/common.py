"""Shared helpers for the benchmarks: timing, peak memory, result tables, CSV and PNG output.

Timing is the median over measured iterations after a warm-up; on CUDA each iteration is
bracketed by CUDA events (so host-side launch overhead that overlaps GPU work is not counted
twice), on CPU by ``time.perf_counter``. Memory is the peak of ``torch.cuda.max_memory_allocated``
over the measured iterations (CPU runs report no memory figure).
"""

from __future__ import annotations

import csv
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

MIB = 1024 * 1024


@dataclass
class BenchResult:
    """One row of a benchmark table.

    ``ms`` is the median milliseconds per call, ``peak_mib`` the peak allocated MiB (NaN when
    not measured, e.g. on CPU), ``error`` the failure message of a variant that could not run.
    """

    bench: str
    variant: str
    dtype: str
    ms: float = math.nan
    peak_mib: float = math.nan
    error: str = ""
    note: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, *, warmup: int, iters: int) -> float:
    """Median wall time of ``fn()`` in milliseconds over ``iters`` calls after ``warmup`` calls."""
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    for _ in range(warmup):
        fn()
    synchronize(device)
    times: list[float] = []
    if device.type == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for start, end in zip(starts, ends, strict=True):
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        times = [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def peak_mib(fn: Callable[[], object], device: torch.device, *, iters: int = 1) -> float:
    """Peak allocated MiB while running ``fn()`` ``iters`` times (NaN off CUDA).

    Call it after a warm-up so that lazily created state (optimizer buffers, cuDNN plans,
    compiled graphs) is already resident and counted the way it is during training.
    """
    if device.type != "cuda":
        for _ in range(iters):
            fn()
        return math.nan
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    for _ in range(iters):
        fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) / MIB


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
        step = setup()
        result.ms = time_ms(step, device, warmup=warmup, iters=iters)
        result.peak_mib = peak_mib(step, device, iters=min(iters, 3))
    except Exception as exc:  # noqa: BLE001 - a failing variant must not end the benchmark
        message = str(exc).strip().splitlines()
        result.error = f"{type(exc).__name__}: {message[0] if message else ''}"[:200]
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result


def format_table(results: Sequence[BenchResult], *, baseline: str | None = None) -> str:
    """A fixed-width text table; with ``baseline``, speed-up and memory ratios per dtype."""
    header = ["bench", "variant", "dtype", "ms/iter", "peak MiB"]
    if baseline is not None:
        header += ["speedup", "mem ratio"]
    rows = [header]
    base = {r.dtype: r for r in results if r.variant == baseline and r.ok}
    for r in results:
        if not r.ok:
            rows.append([r.bench, r.variant, r.dtype, "FAILED: " + r.error])
            continue
        row = [r.bench, r.variant, r.dtype, f"{r.ms:.2f}", _fmt(r.peak_mib, ".0f")]
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


def plot_results(path: Path, results: Sequence[BenchResult], title: str) -> None:
    """Grouped bars: ms/iter and peak MiB per variant, one bar colour per dtype."""
    import matplotlib

    matplotlib.use("Agg")  # file output only; never needs a display
    import matplotlib.pyplot as plt

    variants = list(dict.fromkeys(r.variant for r in results))
    dtypes = list(dict.fromkeys(r.dtype for r in results))
    by_key = {(r.variant, r.dtype): r for r in results if r.ok}
    metrics = [("ms", "ms / iteration")]
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
