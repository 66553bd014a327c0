"""Markdown tables of a committed result set, as the docs and the README quote them.

    python benchmarks/tables.py benchmarks/h200          # every table of the H200 set
    python benchmarks/tables.py benchmarks/h200 --headline

The docs' tables are this script's output, pasted; tests/test_docs.py checks that they still
are, so that every figure on the benchmark page comes from the committed CSV files.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from pathlib import Path

from spikefuse.bench.common import BenchResult, read_csv

MODELS = ("small", "medium", "large")
#: The residual networks at their own input sizes (``e2e_<name>.csv`` in ``<set>/zoo``).
ZOO_MODELS = (
    "sew-resnet18",
    "sew-resnet34",
    "spiking-resnet18",
    "spiking-resnet34",
    "resnet19",
    "spikformer-4-384-cifar",
    "qkformer-10-384-cifar",
    "sdt-2-512-cifar",
)
#: The variants of the end-to-end tables, in order, with their names on the page.
E2E_VARIANTS = {
    "vanilla": "vanilla PyTorch",
    "ann": "ann (ReLU, no time loop)",
    "spikingjelly": "SpikingJelly 2.0",
    "spikefuse": "spikefuse modules",
    "fused": "fused",
    "fused-min": 'fused, memory="min"',
    "fused+graph": "fused + CUDA graph",
    "fused-min+graph": 'fused, memory="min" + CUDA graph',
    "fused+compile": "fused + torch.compile",
}
#: The LIF layer's variants, in order.
NEURON_VARIANTS = (
    "torch loop",
    "torch.compile loop",
    "cuda",
    "cuda graphed",
    "cuda compiled",
    "cuda kernels only",
    "autograd floor",
)


def _markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _e2e(folder: Path, models: Sequence[str]) -> dict[str, list[BenchResult]]:
    return {m: read_csv(path) for m in models if (path := folder / f"e2e_{m}.csv").exists()}


def e2e_table(folder: Path, dtype: str, models: Sequence[str] = MODELS) -> str:
    """Per variant and network: ms per step (synchronised), its speed-up over vanilla PyTorch,
    and the peak allocated MiB (the DATE'22 networks; ``models=ZOO_MODELS`` with the ``zoo``
    subfolder for the residual networks)."""
    runs = _e2e(folder, models)
    header = ["variant", *(f"{m} {dtype}" for m in runs)]
    rows = []
    for variant, label in E2E_VARIANTS.items():
        cells = []
        for results in runs.values():
            by_variant = {r.variant: r for r in results if r.dtype == dtype and r.ok}
            r, base = by_variant.get(variant), by_variant.get("vanilla")
            if r is None:
                cells.append("-")
                continue
            speedup = f" ({base.ms / r.ms:.1f}x)" if base is not None else ""
            memory = "" if math.isnan(r.peak_mib) else f", {r.peak_mib:.0f} MiB"
            cells.append(f"{r.ms:.2f} ms{speedup}{memory}")
        if any(c != "-" for c in cells):
            rows.append([label, *cells])
    return _markdown(header, rows)


def headline_table(folder: Path, model: str = "medium") -> str:
    """One network, both dtypes: vanilla PyTorch, torch.compile of the fused model and the
    fused model replayed from a CUDA graph."""
    results = read_csv(folder / f"e2e_{model}.csv")
    by_key = {(r.variant, r.dtype): r for r in results if r.ok}
    variants = [v for v in ("vanilla", "fused+compile", "fused+graph") if (v, "fp32") in by_key]
    rows = []
    for dtype in ("fp32", "bf16"):
        base = by_key[("vanilla", dtype)]
        cells = [
            f"{by_key[(v, dtype)].ms:.1f} ms ({base.ms / by_key[(v, dtype)].ms:.1f}x)"
            for v in variants
        ]
        rows.append([dtype, *cells])
    return _markdown(["dtype", *(E2E_VARIANTS[v] for v in variants)], rows)


#: The user-loop set's networks (``e2e_<name>.csv`` in ``<set>/user-loop``).
USER_LOOP_MODELS = ("medium", "sew-resnet18", "spiking-resnet18")


def user_loop_table(folder: Path) -> str:
    """Per network, dtype and memory mode, in a SpikingJelly-style loop (``repeat`` over T,
    ``loss.item()`` each step): ms per step of the fused model eager, with
    :func:`spikefuse.graph_model`, with the whole step captured, and the model graphs' ratio
    to the whole-step graph; peak MiB eager and with model graphs; reduce-overhead's ms and MiB
    where measured."""
    runs = {
        model: read_csv(path)
        for model in USER_LOOP_MODELS
        if (path := folder / "user-loop" / f"e2e_{model}.csv").exists()
    }
    peer = any(r.variant == "spikingjelly" and r.ok for results in runs.values() for r in results)
    header = ["network", "dtype", "memory", "eager", "model graphs", "whole step", "ratio"]
    header += ["peak MiB eager / graphs", "reduce-overhead"]
    header += ["SpikingJelly 2.0 eager"] if peer else []
    rows = []
    for model, results in runs.items():
        for dtype in ("fp32", "bf16"):
            by_variant = {r.variant: r for r in results if r.dtype == dtype and r.ok}
            for base in ("fused", "fused-min"):
                eager, graphs = by_variant.get(base), by_variant.get(f"{base}+model-graphs")
                whole = by_variant.get(f"{base}+graph")
                if eager is None or graphs is None or whole is None:
                    continue
                compiled = by_variant.get(f"{base}+reduce-overhead")
                cells = [f"{eager.ms:.2f}", f"{graphs.ms:.2f}", f"{whole.ms:.2f}"]
                cells += [f"{graphs.ms / whole.ms:.2f}x"]
                cells += [f"{eager.peak_mib:.0f} / {graphs.peak_mib:.0f}"]
                cells += [
                    "-"
                    if compiled is None
                    else f"{compiled.ms:.2f} ms, {compiled.peak_mib:.0f} MiB"
                ]
                sj = by_variant.get("spikingjelly") if base == "fused" else None
                cells += ([f"{sj.ms:.2f} ms, {sj.peak_mib:.0f} MiB" if sj else "-"]) if peer else []
                memory = "min" if base == "fused-min" else "default"
                rows.append([model, dtype, memory, *cells])
    return _markdown(header, rows)


def neuron_table(folder: Path) -> str:
    """The LIF layer's forward + backward, ms per step (synchronised), per T and dtype."""
    results = [r for r in read_csv(folder / "neuron.csv") if r.bench.startswith("LIF T=")]
    variants = [v for v in NEURON_VARIANTS if any(r.variant == v for r in results)]
    by_key = {(r.bench, r.dtype, r.variant): r for r in results if r.ok}
    rows = []
    for bench, dtype in dict.fromkeys((r.bench, r.dtype) for r in results):
        cells = [by_key.get((bench, dtype, v)) for v in variants]
        ms = ["-" if r is None else f"{r.ms:.2f}" for r in cells]
        rows.append([bench.removeprefix("LIF T="), dtype, *ms])
    return _markdown(["T", "dtype", *variants], rows)


def all_tables(folder: Path) -> str:
    parts = [f"{dtype}:\n\n{e2e_table(folder, dtype)}" for dtype in ("fp32", "bf16")]
    if (folder / "zoo").is_dir():
        parts += [
            f"Residual networks, {dtype}:\n\n{e2e_table(folder / 'zoo', dtype, ZOO_MODELS)}"
            for dtype in ("fp32", "bf16")
        ]
    parts.append(f"LIF layer:\n\n{neuron_table(folder)}")
    if (folder / "user-loop").is_dir():
        parts.append(f"User loop:\n\n{user_loop_table(folder)}")
    return "\n\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="a result set, e.g. benchmarks/h200")
    parser.add_argument("--headline", action="store_true", help="only the README's table")
    args = parser.parse_args(argv)
    print(headline_table(args.folder) if args.headline else all_tables(args.folder))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
