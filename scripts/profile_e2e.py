"""Where the time of one e2e training iteration goes (kernel table per variant)."""

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from spikefuse.bench import e2e
from spikefuse.bench.common import time_ms

p = argparse.ArgumentParser()
p.add_argument("--model", default="medium")
p.add_argument("--variants", nargs="+", default=["spikefuse", "fused"])
p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
p.add_argument("--rows", type=int, default=25)
p.add_argument("--channels-last", action="store_true")
p.add_argument("--cudnn-benchmark", action="store_true")
p.add_argument("--affine-bptt-vec", type=int, default=None)
p.add_argument("--memory", action="store_true", help="largest live allocations at the peak")
a = p.parse_args()
torch.backends.cudnn.benchmark = a.cudnn_benchmark
if a.affine_bptt_vec:
    from spikefuse.cuda import backend

    backend.AFFINE_BPTT_VEC = a.affine_bptt_vec


def peak_allocations(step, top=14):
    """Replay the allocator trace of one step; print the live blocks at the peak."""
    torch.cuda.memory._record_memory_history(max_entries=200000)
    step()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    live, total, peak, at_peak = {}, 0, 0, {}
    base = sum(
        b["size"]
        for seg in snap["segments"]
        for b in seg["blocks"]
        if b["state"] == "active_allocated"
    )  # after the step; approximate start
    for e in snap["device_traces"][0]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            total += e["size"]
        elif e["action"] == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])["size"]
        if total > peak:
            peak, at_peak = total, dict(live)
    print(
        f"  traced peak above the resident set: {peak / 2**20:.0f} MiB "
        f"(resident after the step: {base / 2**20:.0f} MiB)"
    )
    for e in sorted(at_peak.values(), key=lambda e: -e["size"])[:top]:
        frames = [
            f
            for f in e.get("frames", [])
            if ".py" in f["filename"] and "torch/" not in f["filename"]
        ][:2]
        where = " <- ".join(
            f"{f['filename'].split('/')[-1]}:{f['line']} {f['name']}" for f in frames
        )
        print(f"  {e['size'] / 2**20:8.1f} MiB  {where}")


dev = torch.device("cuda")
for dtype in a.dtypes:
    for v in a.variants:
        torch.manual_seed(0)
        net = e2e.build(v, a.model, dev)
        if a.channels_last:
            net = net.to(memory_format=torch.channels_last)
        step = e2e.training_step(net, dev, 10, 64, e2e.DTYPES[dtype])
        ms = time_ms(step, dev, warmup=5, iters=20)
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**20
        if a.memory:
            peak_allocations(step)
            continue
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        ka = prof.key_averages()
        gpu = sum(e.self_device_time_total for e in ka) / 3 / 1e3
        print(
            f"\n=== {a.model} {v} {dtype}: {ms:.2f} ms/iter, peak {peak:.0f} MiB, "
            f"GPU kernel time {gpu:.2f} ms/iter",
            flush=True,
        )
        print(
            ka.table(sort_by="self_device_time_total", row_limit=a.rows, max_name_column_width=70)
        )
        del net, step
        torch.cuda.empty_cache()
