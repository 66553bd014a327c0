"""Neuron benchmark: LIF forward+backward on [T, 64, 32768], loop vs torch.compile vs cuda.

``python -m spikefuse bench neuron [--T 2 4 8 16 32] [--dtypes float32 float16 bfloat16]``

Each step is ``spikes = f(x); spikes.backward(g)`` with a fixed random upstream gradient. Times
are medians after warm-up: synchronised per step (the headline), back to back and host issue
time (see :mod:`spikefuse.bench.common`). "GB/s" is the floor traffic of five passes over [T, N]
in the storage dtype (read x, write spikes; read x again, read the gradient, write grad x)
divided by the back-to-back time, next to the device's measured copy bandwidth. "extra MiB" is
the peak allocation above the inputs during the step (a CUDA graph's replay allocates nothing
the allocator sees: its memory is the graph's pool, so graphed and reduce-overhead rows show
about 0). "cuda kernels only" calls the backend's
fptt and bptt directly (no module, no autograd): the difference to "cuda" is host-side overhead
that the GPU waits for; "cuda graphed" replays the module's step captured in a CUDA graph,
"cuda compiled" runs ``torch.compile(node)``, "cuda reduce-overhead" ``torch.compile(node,
mode="reduce-overhead")`` (inductor replays it from CUDA graphs); "autograd floor" is one custom autograd op that
launches nothing (PyTorch's host floor for any eager module's forward + backward), "compiled
floor" the same op under ``torch.compile`` (the floor of any compiled module: its runtime
wrappers). A second table compares every one-state neuron and Izhikevich with LIF on the cuda
backend, timed in interleaved rounds (``--rounds``; each round times every neuron in turn, a
neuron's figure is the median of its rounds) and given as ratios to LIF: the host's pace drifts
within a process by more than the neurons differ. Each of its steps first sets the neuron's
parameter gradients to None, as a training step's ``optimizer.zero_grad()`` does.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import neuron
from ..backends import get_backend
from ..graphs import capture_step
from ..program import NeuronProgram
from .common import (
    MIB,
    BenchResult,
    Timing,
    format_table,
    require_plots,
    time_interleaved,
    time_step,
    write_csv,
)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# the neuron table's rows; the first is the baseline of the ratios
NEURONS: dict[str, Callable[[], neuron.BaseNode]] = {
    "LIF": lambda: neuron.LIFNode(step_mode="m", backend="cuda"),
    "IF": lambda: neuron.IFNode(step_mode="m", backend="cuda"),
    "PLIF": lambda: neuron.ParametricLIFNode(step_mode="m", backend="cuda"),
    "QIF": lambda: neuron.QIFNode(step_mode="m", backend="cuda"),
    "EIF": lambda: neuron.EIFNode(step_mode="m", backend="cuda"),
    "Izhikevich": lambda: neuron.IzhikevichNode(step_mode="m", backend="cuda"),
}
# a LIF table row: its label, the model a step calls, whether the step is CUDA-graphed
_Variant = tuple[str, Callable[[torch.Tensor], torch.Tensor], bool]


class _SigmoidSpike(torch.autograd.Function):
    """Heaviside with SpikingJelly's Sigmoid surrogate (alpha=4), for the plain-torch loop."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return (x >= 0).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(4.0 * x)
        return grad * 4.0 * s * (1 - s)


def lif_loop(x_seq: torch.Tensor, tau: float = 2.0, v_th: float = 1.0) -> torch.Tensor:
    """The reference loop: LIF (decay_input, hard reset to 0) stepped in Python, autograd BPTT."""
    v = torch.zeros_like(x_seq[0])
    spikes = []
    for x in x_seq:
        h = v + (x - v) / tau
        s = _SigmoidSpike.apply(h - v_th)
        v = h * (1 - s)
        spikes.append(s)
    return torch.stack(spikes)


def copy_bandwidth_gbs(device: torch.device) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), 1 GiB buffers."""
    src = torch.empty(1 << 28, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    ms = time_step(lambda: dst.copy_(src), device, warmup=5, iters=30).queued
    return 2 * src.numel() * 4 / ms / 1e6


def _step(model: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, g: torch.Tensor):
    def step():
        x.grad = None
        out = model(x)
        if out.requires_grad:
            out.backward(g)

    return step


class _AutogradFloor(torch.autograd.Function):
    """One custom autograd op that launches nothing: forward and backward each only allocate
    their output. Its step time is PyTorch's own host floor for a module's forward + backward
    (the Function's Python, the autograd engine and its device thread); no neuron module can
    be faster eagerly."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(grad)


def autograd_floor(x: torch.Tensor) -> torch.Tensor:
    """:class:`_AutogradFloor` as a function (what ``torch.compile`` takes)."""
    return _AutogradFloor.apply(x)


class _KernelsOnly:
    """The backend's fptt + bptt on a node's program, outside autograd (returns a no-grad
    tensor, so the step skips ``backward``)."""

    def __init__(self, node: neuron.BaseNode, g: torch.Tensor) -> None:
        if not isinstance(node.program, NeuronProgram):
            raise TypeError(f"{type(node).__name__} has no kernel program (a torch-code neuron)")
        self.program, self.constants, self.g = node.program, node.constants(), g
        self.backend = get_backend("cuda")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        init = [0.0, 0.0]  # V and W start at 0
        x = x.detach()
        out = self.backend.fptt(
            program=self.program,
            x_seq=x,
            v0=None,
            w0=None,
            learnable=None,
            constants=self.constants,
            init=init,
            save_for_backward=True,
            store_v_seq=False,
        )
        self.backend.bptt(
            program=self.program,
            grad_spikes=self.g,
            grad_v_seq=None,
            grad_v_last=None,
            grad_w_last=None,
            x_seq=x,
            saved_v=out.saved_v,
            saved_w=out.saved_w,
            v0=None,
            w0=None,
            learnable=None,
            constants=self.constants,
            init=init,
        )
        return out.spikes


def _peak_mib(step: Callable[[], None], device: torch.device) -> float:
    """The peak allocation of one ``step()`` above what was allocated before it, in MiB."""
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / MIB


def _record(
    r: BenchResult, timing: Timing, step: Callable[[], None], device: torch.device, floor: int
) -> None:
    """Fill row ``r`` from a step's timing, its peak memory and its floor-traffic bandwidth."""
    r.ms, r.queued_ms, r.host_ms = timing.synced, timing.queued, timing.host
    r.peak_mib = _peak_mib(step, device)
    r.note = f"{floor / r.queued_ms / 1e6:.0f} GB/s"


def _error(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:150]}"


@dataclass(frozen=True)
class _Inputs:
    """One shape's step inputs: ``x`` [T, N, F] (a leaf requiring grad), the fixed upstream
    gradient ``g`` (like ``x``) and ``floor``, the bytes of five passes over ``x`` (GB/s)."""

    x: torch.Tensor
    g: torch.Tensor
    floor: int


def _inputs(T: int, args: argparse.Namespace, dtype: str, device: torch.device) -> _Inputs:
    """Random inputs of ``[T, args.batch, args.features]`` in ``dtype``, around 0.8 so that
    the neurons fire."""
    x = torch.randn(T, args.batch, args.features, device=device).add_(0.8)
    x = x.to(DTYPES[dtype]).requires_grad_(True)
    return _Inputs(x, torch.randn_like(x), 5 * x.numel() * x.element_size())


def _measure(
    bench: str,
    variant: str,
    dtype: str,
    model: Callable[[torch.Tensor], torch.Tensor],
    inputs: _Inputs,
    device: torch.device,
    *,
    warmup: int,
    iters: int,
    graphed: bool = False,
) -> BenchResult:
    r = BenchResult(bench=bench, variant=variant, dtype=dtype)
    try:
        x = inputs.x
        if graphed:  # a leaf of its own: x's gradient node already belongs to the eager runs
            x = x.detach().clone().requires_grad_()
        step = _step(model, x, inputs.g)
        if graphed:
            step = capture_step(step)
        timing = time_step(step, device, warmup=warmup, iters=iters)
        _record(r, timing, step, device, inputs.floor)
    except Exception as exc:  # one failing variant must not end the run
        r.error = _error(exc)
    return r


def _compare_neurons(
    makers: dict[str, Callable[[], neuron.BaseNode]],
    dtype: str,
    T: int,
    inputs: _Inputs,
    device: torch.device,
    *,
    warmup: int,
    iters: int,
    rounds: int,
) -> list[BenchResult]:
    """One row per neuron (the first is the baseline the others' ratio is to), timed in
    interleaved rounds (:func:`~spikefuse.bench.common.time_interleaved`): their ratios are
    what the table is for."""
    rows = {label: BenchResult(bench=f"T={T}", variant=label, dtype=dtype) for label in makers}
    steps: dict[str, Callable[[], None]] = {}
    for label, make in makers.items():
        node = make().to(device)

        def run(x: torch.Tensor, node: neuron.BaseNode = node) -> torch.Tensor:
            # A training step's optimizer.zero_grad(): learnable parameters (PLIF's tau) get
            # their gradient stored, not added to the last step's with one more kernel.
            node.zero_grad(set_to_none=True)
            node.reset()
            return node(x)

        step = _step(run, inputs.x, inputs.g)
        try:
            step()  # compiles and loads the kernels: a neuron that cannot run fails alone
        except Exception as exc:
            rows[label].error = _error(exc)
            continue
        steps[label] = step
    timings = time_interleaved(steps, device, warmup=warmup, iters=iters, rounds=rounds)
    baseline = next(iter(makers))
    for label, step in steps.items():
        r = rows[label]
        _record(r, timings[label], step, device, inputs.floor)
        if baseline in timings:
            r.note += f", {r.ms / timings[baseline].synced:.2f}x {baseline}"
    return list(rows.values())


def _parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    """The command line (see the module docstring) and its parser, for the errors found later."""
    parser = argparse.ArgumentParser(prog="spikefuse bench neuron", description=__doc__)
    parser.add_argument("--T", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--features", type=int, default=32768)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile variants")
    parser.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="interleaved rounds of the neuron comparison (each times every neuron --iters steps)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench_out"))
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    return args, parser


def _print_row(r: BenchResult) -> None:
    print(format_table([r]).splitlines()[-1], r.note, flush=True)


def _resetting(node: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """``node`` (a neuron or ``torch.compile``'s wrapper of one) reset before each call: every
    step starts from the resting state."""

    def run(x: torch.Tensor) -> torch.Tensor:
        node.reset()
        return node(x)

    return run


def _lif_variants(g: torch.Tensor, compiled: bool) -> list[_Variant]:
    """The LIF table's rows for one shape, in table order; the ``torch.compile`` ones only if
    ``compiled``. ``g`` is the upstream gradient the kernels-only row's backward reads."""

    def lif() -> neuron.LIFNode:
        return neuron.LIFNode(tau=2.0, step_mode="m", backend="cuda")

    node = lif()
    variants: list[_Variant] = [("torch loop", lif_loop, False)]
    if compiled:
        variants.append(("torch.compile loop", torch.compile(lif_loop, dynamic=False), False))
    variants += [("cuda", _resetting(node), False), ("cuda graphed", _resetting(lif()), True)]
    if compiled:
        variants.append(("cuda compiled", _resetting(torch.compile(lif())), False))
        # inductor's CUDA graphs (cudagraph trees) around the same op
        reduce_overhead = torch.compile(lif(), mode="reduce-overhead")
        variants.append(("cuda reduce-overhead", _resetting(reduce_overhead), False))
    variants.append(("cuda kernels only", _KernelsOnly(node, g), False))
    variants.append(("autograd floor", autograd_floor, False))
    if compiled:
        # PyTorch's host floor for any compiled module's forward + backward
        variants.append(("compiled floor", torch.compile(autograd_floor), False))
    return variants


def _run_lif(args: argparse.Namespace, device: torch.device) -> list[BenchResult]:
    """The LIF table: every variant for each dtype and T, each row printed as it is measured."""
    results: list[BenchResult] = []
    for dtype in args.dtypes:
        for T in args.T:
            # A fresh compilation per shape: dynamo's per-function recompile limit would
            # otherwise silently fall back to eager after a few shapes.
            torch._dynamo.reset()
            inputs = _inputs(T, args, dtype, device)
            for variant, model, graphed in _lif_variants(inputs.g, not args.no_compile):
                r = _measure(
                    f"LIF T={T}",
                    variant,
                    dtype,
                    model,
                    inputs,
                    device,
                    warmup=args.warmup,
                    iters=args.iters,
                    graphed=graphed,
                )
                results.append(r)
                _print_row(r)
            del inputs
            torch.cuda.empty_cache()
    return results


def _run_neurons(args: argparse.Namespace, device: torch.device) -> list[BenchResult]:
    """The neuron table: every neuron of :data:`NEURONS` against LIF, T = 8 and 32, each dtype."""
    results: list[BenchResult] = []
    for dtype in args.dtypes:
        for T in (8, 32):
            inputs = _inputs(T, args, dtype, device)
            rows = _compare_neurons(
                NEURONS,
                dtype,
                T,
                inputs,
                device,
                warmup=args.warmup,
                iters=args.iters,
                rounds=args.rounds,
            )
            results += rows
            for r in rows:
                _print_row(r)
            del inputs
            torch.cuda.empty_cache()
    return results


def _report(
    header: str, rounds: int, results: list[BenchResult], neuron_results: list[BenchResult]
) -> str:
    """The text report: both tables, each followed by its rows' notes (bandwidth, ratios)."""

    def notes(rows: list[BenchResult]) -> str:
        return "\n".join(f"{r.bench} {r.variant} {r.dtype}: {r.note}" for r in rows if r.ok)

    return (
        f"{header}\n{format_table(results)}\n\nfloor-traffic bandwidth:\n{notes(results)}\n\n"
        f"neurons (cuda backend, {rounds} interleaved rounds):\n{format_table(neuron_results)}\n"
        f"\nfloor-traffic bandwidth, ratio to LIF (synchronised):\n{notes(neuron_results)}\n"
    )


def _write(
    out: Path, text: str, header: str, results: list[BenchResult], neuron_results: list[BenchResult]
) -> None:
    """``neuron.txt`` (the report), ``neuron.csv`` (both tables) and ``neuron.png`` (the LIF
    table's plot) under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "neuron.txt").write_text(text)
    write_csv(out / "neuron.csv", results + neuron_results)
    _plot(out / "neuron.png", results, header)


def main(argv: list[str] | None = None) -> int:
    args, parser = _parse_args(argv)
    require_plots()
    if not torch.cuda.is_available():
        parser.error("the neuron benchmark needs a CUDA GPU")
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    bw = copy_bandwidth_gbs(device)
    print(f"device: {name}; measured copy bandwidth {bw:.0f} GB/s")
    results = _run_lif(args, device)
    neuron_results = _run_neurons(args, device)
    header = f"LIF forward+backward, [T, {args.batch}, {args.features}], {name}, copy {bw:.0f} GB/s"
    text = _report(header, args.rounds, results, neuron_results)
    print(text)
    _write(args.out, text, header, results, neuron_results)
    return 0


def _plot(path: Path, results: list[BenchResult], title: str) -> None:
    """ms per step against T, one panel per dtype, one line per variant (log-log)."""
    require_plots()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = list(dict.fromkeys(r.dtype for r in results))
    fig, axes = plt.subplots(1, len(dtypes), figsize=(5 * len(dtypes), 4), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes, strict=True):
        for variant in dict.fromkeys(r.variant for r in results):
            pts = [
                (int(r.bench.split("=")[1]), r.ms)
                for r in results
                if r.dtype == dtype and r.variant == variant and r.ok
            ]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=variant)
        ax.set(xscale="log", yscale="log", xlabel="T", ylabel="ms (fwd+bwd)", title=dtype)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
