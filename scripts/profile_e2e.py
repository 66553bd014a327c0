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
a = p.parse_args()
torch.backends.cudnn.benchmark = a.cudnn_benchmark
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
