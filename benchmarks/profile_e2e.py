"""Where one end-to-end training iteration spends its time and memory (needs a GPU).

    python benchmarks/profile_e2e.py [--model medium] [--variants fused] [--dtypes fp32 bf16]
    python benchmarks/profile_e2e.py --memory      # the largest live allocations at the peak
    python benchmarks/profile_e2e.py --host        # where the host's Python time goes (cProfile)
    python benchmarks/profile_e2e.py --gaps        # where the GPU waits for the host in a step

Per variant and dtype: ms/step and peak MiB as the benchmark measures them, then either the
torch.profiler table of the kernels of 3 iterations (sorted by GPU time) or, with ``--memory``,
the allocations alive at the traced peak of one iteration and the code that made them, or with
``--host`` the Python functions that take the host's time (cProfile over 20 steps, by own time),
with the number of kernel launches per step, or with ``--gaps`` the GPU's idle time inside each
of three synchronised steps: the largest gaps between kernels and the kernels around them
(where the host paces the step), without the profiler's own stalls.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from spikefuse.bench import e2e
from spikefuse.bench.common import MIB, time_step


def peak_allocations(step, top: int = 14) -> None:
    """Replay the allocator trace of one step; print the largest blocks alive at its peak."""
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    step()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    live, total, peak, at_peak = {}, 0, 0, {}
    for e in snap["device_traces"][0]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            total += e["size"]
        elif e["action"] == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])["size"]
        if total > peak:
            peak, at_peak = total, dict(live)
    print(
        f"  peak of this iteration's allocations: {peak / MIB:.0f} MiB above the "
        f"{torch.cuda.memory_allocated() / MIB:.0f} MiB that stay resident"
    )
    for e in sorted(at_peak.values(), key=lambda e: -e["size"])[:top]:
        frames = [f for f in e.get("frames", []) if "spikefuse" in f["filename"]][:3]
        where = " <- ".join(
            f"{f['filename'].split('/')[-1]}:{f['line']} {f['name']}" for f in frames
        )
        print(f"  {e['size'] / MIB:8.1f} MiB  {where}")


def host_profile(step, rows: int, stats_file: str | None = None) -> None:
    """cProfile of 20 steps (the host's Python time by function) and kernel launches per step;
    the raw statistics go to ``stats_file`` too (for ``pstats``: callers, callees)."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    profiler.disable()
    if stats_file:
        profiler.dump_stats(stats_file)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(rows)
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(rows)
    print(text.getvalue())
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = sum(1 for e in prof.events() if e.device_type.name == "CUDA")
    print(f"  CUDA kernels (and copies) per step: {kernels}")


def idle_gaps(
    kernels: list[tuple[float, float, str]], stalls: list[tuple[float, float]]
) -> tuple[float, float, list[tuple[float, str, str]]]:
    """(busy, stalled, gaps) of GPU work ``kernels`` (start, end, name; any order, possibly
    overlapping) between its first start and last end: ``busy`` the time some kernel ran,
    ``stalled`` the idle time the profiler's own ``stalls`` (start, end) cover, and the idle
    gaps as (idle time outside those stalls, kernel before, kernel after). Times in any one
    unit."""
    kernels = sorted(kernels)
    gaps, busy, stalled = [], 0.0, 0.0
    end, previous = kernels[0][0], kernels[0][2]
    for start, stop, name in kernels:
        if start > end:
            covered = sum(max(0.0, min(start, b) - max(end, a)) for a, b in stalls)
            stalled += covered
            if start - end - covered > 0:
                gaps.append((start - end - covered, previous, name))
        busy += max(0.0, stop - max(start, end))
        previous, end = name, max(end, stop)
    return busy, stalled, gaps


def _trace_events(prof: profile) -> list[dict]:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text())["traceEvents"]


def gpu_gaps(step, rows: int, steps: int = 3) -> None:
    """GPU busy and idle time within each of ``steps`` synchronised steps, and the largest idle
    gaps of the last one. The profiler's own stalls are taken out: CUPTI's "Activity Buffer
    Request" blocks the host for milliseconds when it needs a new buffer (e.g. at the
    start of backward in a medium fused step), which would read as the host pacing the
    GPU. The profiler slows the host too, so the idle times are upper bounds."""
    for _ in range(steps):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        events = [e for e in _trace_events(prof) if e.get("ph") == "X"]
        kernels = [
            (e["ts"], e["ts"] + e["dur"], e["name"])
            for e in events
            if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
        ]
        stalls = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "overhead"]
        busy, stalled, gaps = idle_gaps(kernels, stalls)
        idle = sum(g for g, _, _ in gaps)
        print(
            f"  {len(kernels)} kernels: busy {busy / 1e3:.2f} ms, idle {idle / 1e3:.2f} ms in "
            f"{len(gaps)} gaps ({sum(g for g, _, _ in gaps if g > 20) / 1e3:.2f} ms in gaps over "
            f"20 us); the profiler's own stalls {stalled / 1e3:.2f} ms (left out)"
        )
    for gap, before, after in sorted(gaps, reverse=True)[:rows]:
        print(f"  {gap:8.1f} us  after {before[:60]}  before {after[:60]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="medium", choices=sorted(e2e.MODELS) + sorted(e2e.ZOO))
    parser.add_argument("--variants", nargs="+", default=["fused"], choices=e2e.variants())
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=sorted(e2e.DTYPES))
    parser.add_argument("--rows", type=int, default=25, help="kernel table rows")
    parser.add_argument("--memory", action="store_true", help="live allocations at the peak")
    parser.add_argument("--host", action="store_true", help="host Python time (cProfile)")
    parser.add_argument("--host-stats", metavar="FILE", help="with --host: write the raw stats")
    parser.add_argument("--gaps", action="store_true", help="GPU idle gaps in a synced step")
    parser.add_argument("--loop", default="bench", choices=e2e.LOOPS, help="as bench e2e's")
    args = parser.parse_args()
    device = torch.device("cuda")
    zoo = e2e.ZOO.get(args.model)
    T, batch = (zoo.T, zoo.batch) if zoo else (10, 64)  # as bench e2e runs them
    for dtype in args.dtypes:
        for variant in args.variants:
            torch.manual_seed(0)
            step = e2e.setup_variant(
                variant, args.model, device, T, batch, e2e.DTYPES[dtype], args.loop
            )
            t = time_step(step, device, warmup=5, iters=20)
            torch.cuda.reset_peak_memory_stats()
            step()
            peak = torch.cuda.max_memory_allocated() / MIB
            print(
                f"\n=== {args.model} {variant} {dtype}: {t.synced:.2f} ms/step synchronised, "
                f"{t.queued:.2f} back to back, host {t.host:.2f}; peak {peak:.0f} MiB"
            )
            if args.memory:
                peak_allocations(step)
            elif args.host:
                host_profile(step, args.rows, args.host_stats)
            elif args.gaps:
                gpu_gaps(step, args.rows)
            else:
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(3):
                        step()
                    torch.cuda.synchronize()
                table = prof.key_averages().table(
                    sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=70
                )
                print(table)
            del step
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
