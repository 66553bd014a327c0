"""Whole training steps captured in a CUDA graph (``torch.cuda.graph``, and forward + backward
with ``torch.cuda.make_graphed_callables``), and models under ``torch.compile`` (default and
reduce-overhead modes), give the eager results: the loss and every parameter gradient, unfused
and fused, fp32 and bf16 autocast.

Compile runs with ``fullgraph=True`` (a graph break fails). ``aot_eager`` runs the same kernels:
checked in fp32; in bf16 the compiled BatchNorm rounds differently from the folded one, which
flips spikes (as fused vs unfused bf16 does), and inductor generates its own kernels: those run
and their error is recorded, not checked (reduce-overhead's fp32 error is checked, at 1e-4).
"""

from __future__ import annotations

import copy
import gc
from typing import Any

import pytest
import torch
from torch import nn

from conftest import reldiff
from spikefuse import functional, fuse, layer, models, neuron, surrogate
from spikefuse.graphs import GraphedStep, capture_step

pytestmark = [pytest.mark.gpu, pytest.mark.quick]


@pytest.fixture(autouse=True)
def collect_garbage_after():
    """Destroy the graphs a test leaves in reference cycles (make_graphed_callables' results):
    the collector destroying one during a later test's capture would invalidate that capture
    (see spikefuse.graphs.capturing)."""
    yield
    gc.collect()


FUSED = pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
AMP = pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16-autocast"])


def sj_small() -> nn.Module:
    """A small network written the SpikingJelly way (Sigmoid surrogate, flat Sequential)."""

    def lif() -> neuron.LIFNode:
        return neuron.LIFNode(
            tau=4 / 3,
            decay_input=False,
            v_threshold=0.25,
            v_reset=0.0,
            surrogate_function=surrogate.Sigmoid(),
            step_mode="m",
            backend="cuda",
        )

    return nn.Sequential(
        layer.Conv2d(3, 16, 3, padding=1, bias=False, step_mode="m"),
        layer.BatchNorm2d(16, step_mode="m"),
        lif(),
        layer.AvgPool2d(2, step_mode="m"),
        layer.Conv2d(16, 32, 3, padding=1, bias=False, step_mode="m"),
        layer.BatchNorm2d(32, step_mode="m"),
        lif(),
        layer.AvgPool2d(2, step_mode="m"),
        layer.Flatten(step_mode="m"),
        layer.Linear(32 * 4 * 4, 64, bias=False, step_mode="m"),
        layer.BatchNorm1d(64, step_mode="m"),
        lif(),
        layer.Linear(64, 10, step_mode="m"),
    ).cuda()


def sj_residual() -> nn.Module:
    """Stem, two Spiking ResNet basic blocks (the second with a Conv1x1 -> BN downsample),
    average pooling, classifier: fused, the blocks' forwards are rewritten (residual chains)."""
    lif = dict(surrogate_function=surrogate.Sigmoid(), backend="cuda")

    def block(cin: int, cout: int, stride: int) -> models.BasicBlock:
        downsample = None
        if stride != 1 or cin != cout:
            downsample = nn.Sequential(
                layer.Conv2d(cin, cout, 1, stride, bias=False, step_mode="m"),
                layer.BatchNorm2d(cout, step_mode="m"),
            )
        return models.BasicBlock(
            cin, cout, stride, downsample, spiking_neuron=neuron.LIFNode, step_mode="m", **lif
        )

    return nn.Sequential(
        layer.Conv2d(3, 16, 3, padding=1, bias=False, step_mode="m"),
        layer.BatchNorm2d(16, step_mode="m"),
        neuron.LIFNode(step_mode="m", **lif),
        block(16, 16, 1),
        block(16, 32, 2),
        layer.AdaptiveAvgPool2d(1, step_mode="m"),
        layer.Flatten(step_mode="m"),
        layer.Linear(32, 10, step_mode="m"),
    ).cuda()


def autocast(amp: bool) -> torch.autocast:
    """bf16 autocast when ``amp``, without the weight cache (CUDA graphs need it off)."""
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp, cache_enabled=False)


def loss_and_grads(net: nn.Module, x, labels, amp: bool) -> torch.Tensor:
    with autocast(amp):
        loss = torch.nn.functional.cross_entropy(net(x).mean(0).float(), labels)
    loss.backward()
    functional.reset_net(net)
    return loss


def results(net: nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"loss": loss.detach(), **{n: p.grad for n, p in net.named_parameters()}}


@pytest.fixture(params=["sj_small", "sj_residual"])
def case(request, no_tf32):
    """(model before any step, its input, labels)."""
    torch.manual_seed(0)
    x = torch.rand(6, 8, 3, 16, 16, device="cuda")
    labels = torch.randint(0, 10, (8,), device="cuda")
    return {"sj_small": sj_small, "sj_residual": sj_residual}[request.param](), x, labels


def eager(base: nn.Module, x, labels, amp: bool) -> dict[str, torch.Tensor]:
    net = copy.deepcopy(base)
    return results(net, loss_and_grads(net, x, labels, amp))


def start(case, fused: bool, amp: bool) -> tuple[dict[str, torch.Tensor], nn.Module, Any, Any]:
    """(the eager step's results, a fresh copy of the (fused) model, its input, labels)."""
    base, x, labels = case
    base = fuse(base) if fused else base
    return eager(base, x, labels, amp), copy.deepcopy(base), x, labels


def dead_graph_in_a_cycle() -> None:
    """Capture a small graph and drop it in a reference cycle, as make_graphed_callables'
    results are dropped: only the garbage collector destroys it."""
    y = torch.zeros(4, device="cuda")
    y.add_(1)  # loads the kernel before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y.add_(1)
    cycle: list[object] = [graph]
    cycle.append(cycle)


@AMP
@FUSED
def test_cuda_graph_replay_matches_eager(case, fused, amp):
    """capture_step's replay gives the eager step's results, also with a dead graph around:
    destroying a graph during another capture invalidates that capture (its destructor's calls
    are not permitted then), and the collector may run at any allocation. Here a graph is
    dropped in a reference cycle in the last warm-up step and a collection runs in the
    captured one; capture_step collected it first. (The GPU check's first run on a fresh
    machine failed this way three times, in make_graphed_callables, on the previous test's
    graphs.)"""
    want, net, x, labels = start(case, fused, amp)
    loss = {}
    calls = []

    def step():
        calls.append(None)
        for p in net.parameters():
            p.grad = None
        loss["value"] = loss_and_grads(net, x, labels, amp).detach()
        if len(calls) == 3:  # the last warm-up step
            dead_graph_in_a_cycle()
        if len(calls) == 4:  # the captured step: as if the collector ran at an allocation
            gc.collect()

    capture_step(step)()
    torch.cuda.synchronize()
    got = results(net, loss["value"])
    err = max(reldiff(got[k], w) for k, w in want.items())
    assert err <= 1e-5, f"worst normalised error {err:.2e} over the loss and the gradients"


@FUSED
def test_graphed_step_trains_like_eager_steps(fused, no_tf32):
    """GraphedStep over an SGD training step, on batches of two sizes in mixed order (each
    size warmed up once, then captured and replayed, the smaller one interleaved with the
    larger one's replays), gives the losses and the parameters of the same steps run eagerly
    on a copy of the model: to 1e-3, since the two runs may sum in different orders (cuDNN)
    and eight steps can carry a spike that rounding flips; a replay of stale inputs or of
    another batch size's graph would miss by far more."""
    torch.manual_seed(0)
    base = fuse(sj_small()) if fused else sj_small()
    sizes = [8, 8, 8, 4, 4, 8, 4, 8]
    batches = [
        (torch.rand(6, b, 3, 16, 16, device="cuda"), torch.randint(0, 10, (b,), device="cuda"))
        for b in sizes
    ]

    def train_step(net: nn.Module) -> Any:
        optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)

        def step(x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            optimizer.zero_grad(set_to_none=True)
            loss = loss_and_grads(net, x, labels, amp=False)
            optimizer.step()
            return loss.detach()

        return step

    eager_net, graphed_net = copy.deepcopy(base), copy.deepcopy(base)
    eager_step, graphed = train_step(eager_net), GraphedStep(train_step(graphed_net), warmup=1)
    for i, (x, labels) in enumerate(batches):
        want = eager_step(x, labels)
        got = graphed(x, labels)
        assert reldiff(got, want) <= 1e-3, f"step {i}: loss {got.item()} against {want.item()}"
    assert len(graphed._graphs) == 2  # one captured graph per batch size, replayed
    for (name, got), want in zip(
        graphed_net.named_parameters(), eager_net.parameters(), strict=True
    ):
        assert (got - want).norm() <= 1e-3 * want.norm(), name


def test_a_failed_capture_leaves_random_numbers_and_captures_working():
    """A host sync in the captured step (here ``.item()``) invalidates the capture, and PyTorch
    raises while ending it, before it takes the CUDA random generator out of capture mode and
    restores the current stream: every later random op failed ("Offset increment outside graph
    capture"; in the GPU check's first runs on fresh machines, 24 tests after one failed
    capture). capture_step raises and leaves the process as it was: random numbers, dropout
    and a new capture with random numbers in it work."""
    x = torch.ones(8, device="cuda")
    stream = torch.cuda.current_stream()
    with pytest.raises(RuntimeError) as raised:
        capture_step(lambda: x.sum().item())
    assert "typically a host sync in the step" in raised.value.__notes__[0]
    assert torch.cuda.current_stream() == stream
    torch.rand(4, device="cuda")
    nn.functional.dropout(x, 0.5)
    noise = torch.zeros(2, 4, device="cuda")

    def draw() -> None:
        noise[1].copy_(noise[0])
        noise[0].uniform_()

    replay = capture_step(draw)
    replay()
    replay()
    torch.cuda.synchronize()
    assert not torch.equal(noise[0], noise[1])  # a fresh draw at every replay


def peak_growth(run) -> int:
    """Bytes ``run()`` allocated at its peak above what was allocated before, starting with no
    cuBLAS workspaces (cuBLAS keeps one per stream it ran on, for the life of the process)."""
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


@AMP
def test_capture_needs_no_more_memory_than_eager_steps(case, amp):
    """capture_step warms up and captures on one side stream, through capturing(): the
    warm-up's cuBLAS workspace is dropped and the capture allocates its own in the graph's
    pool. Captured on a fresh stream without the drop, the graph's pool got one workspace more
    and the graphed step peaked above the eager one."""
    base, x, labels = case
    net = fuse(base)

    def step():
        for p in net.parameters():
            p.grad = None
        loss_and_grads(net, x, labels, amp)

    def eager_steps():
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            for _ in range(4):
                step()

    eager_peak = peak_growth(eager_steps)
    graphed_peak = peak_growth(lambda: capture_step(step))
    assert graphed_peak <= 1.05 * eager_peak + 2**20, (
        f"capture peaked {graphed_peak / 2**20:.1f} MiB above what was allocated before, "
        f"eager steps {eager_peak / 2**20:.1f} MiB"
    )


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@AMP
@FUSED
def test_compiled_model_matches_eager(case, fused, amp, backend, record_property):
    want, net, x, labels = start(case, fused, amp)
    torch.compiler.reset()
    try:
        compiled = torch.compile(net, fullgraph=True, backend=backend)
        for _ in range(2):
            loss_and_grads(compiled, x, labels, amp)
        for p in net.parameters():  # the gradient of the third step only
            p.grad = None
        got = results(net, loss_and_grads(compiled, x, labels, amp))
    finally:
        torch.compiler.reset()
    err = max(reldiff(got[k], w) for k, w in want.items())
    record_property("worst_normalised_error", err)
    if backend == "aot_eager" and not amp:
        assert err <= 1e-5, f"worst normalised error {err:.2e} over the loss and the gradients"


@AMP
@FUSED
def test_reduce_overhead_compile_matches_eager(case, fused, amp, record_property):
    """``torch.compile(mode="reduce-overhead")``: inductor's CUDA graphs (cudagraph trees) replay
    forward and backward; gradients are graph outputs, so each step starts with ``grad = None``
    (``optimizer.zero_grad()``'s default) and reads them before the next step."""
    want, net, x, labels = start(case, fused, amp)
    torch.compiler.reset()
    try:
        compiled = torch.compile(net, mode="reduce-overhead", fullgraph=True)
        for _ in range(3):  # warm-up, recording, then replays
            for p in net.parameters():
                p.grad = None
            got = {
                k: v.clone()
                for k, v in results(net, loss_and_grads(compiled, x, labels, amp)).items()
            }
    finally:
        torch.compiler.reset()
    err = max(reldiff(got[k], w) for k, w in want.items())
    record_property("worst_normalised_error", err)
    if not amp:  # bf16: inductor's own kernels round differently (see the module docstring)
        assert err <= 1e-4, f"worst normalised error {err:.2e} over the loss and the gradients"


class ResetFirst(nn.Module):
    """``net`` run from reset neurons: ``make_graphed_callables`` runs its warm-up calls back
    to back and replays without running Python, so the reset must be part of the callable."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        functional.reset_net(self.net)
        return self.net(x)


@AMP
@FUSED
def test_make_graphed_callables_matches_eager(case, fused, amp):
    want, net, x, labels = start(case, fused, amp)
    with autocast(amp):
        graphed = torch.cuda.make_graphed_callables(ResetFirst(net), (x,))
    for _ in range(2):
        for p in net.parameters():
            p.grad = None
        with autocast(amp):
            loss = torch.nn.functional.cross_entropy(graphed(x).mean(0).float(), labels)
        loss.backward()
    torch.cuda.synchronize()
    got = results(net, loss)
    err = max(reldiff(got[k], w) for k, w in want.items())
    assert err <= 1e-5, f"worst normalised error {err:.2e} over the loss and the gradients"
