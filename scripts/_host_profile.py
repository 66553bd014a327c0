import cProfile, pstats, io, torch
from spikefuse.bench import e2e
dev = torch.device("cuda")
for variant in ("fused", "spikefuse"):
    step = e2e.setup_variant(variant, "medium", dev, 10, 64, None)
    for _ in range(5): step()
    torch.cuda.synchronize()
    pr = cProfile.Profile(); pr.enable()
    for _ in range(20): step()
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(40)
    print("=====", variant); print(s.getvalue()[:9000])
