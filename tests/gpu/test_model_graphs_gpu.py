"""spikefuse.graph_model on the GPU: a SpikingJelly-style training loop, unchanged but for the
switch, trains like the same loop run eagerly (losses, parameters, BatchNorm statistics),
fused and unfused, fp32 and bf16 autocast, with dropout, GradScaler and gradient clipping; and
evaluation under ``torch.no_grad`` replays a forward-only graph.

Training runs are compared with cuDNN's deterministic algorithms (its default weight gradients
may differ between two identical eager runs). Tolerances: ten steps can still carry a spike
that rounding flips (a captured fused Linear block on spikes takes the bf16-split path), which
moves the mean loss of a batch of four by about 1e-3, so losses and parameters are compared
norm-wise at 5e-3 (bf16: 2e-2); a stale input, a wrong signature's graph or a missing
BatchNorm update misses by far more."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch import nn

from conftest import reldiff
from spikefuse import functional, fuse, layer
from spikefuse.model_graphs import graph_model, model_graphs

from .test_graphs_compile import sj_residual, sj_small

pytestmark = [pytest.mark.gpu, pytest.mark.quick]

FUSED = pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
AMP = pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16-autocast"])


@pytest.fixture(autouse=True)
def collect_garbage_after():
    yield
    gc.collect()


def with_dropout(net: nn.Sequential) -> nn.Sequential:
    """``net`` with SpikingJelly's multi-step Dropout before its classifier."""
    return nn.Sequential(*net[:-1], layer.Dropout(0.3, step_mode="m"), net[-1]).cuda()


def train(net: nn.Module, batches, amp: bool, scaler: bool) -> list[torch.Tensor]:
    """The loop as a SpikingJelly example writes it; optionally GradScaler and clipping."""
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    grad_scaler = torch.amp.GradScaler("cuda", enabled=scaler)
    losses = []
    for x, labels in batches:
        x_seq = x.unsqueeze(0).repeat(4, 1, 1, 1, 1)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            loss = torch.nn.functional.cross_entropy(net(x_seq).mean(0).float(), labels)
        optimizer.zero_grad()
        grad_scaler.scale(loss).backward()
        if scaler:
            grad_scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        grad_scaler.step(optimizer)
        grad_scaler.update()
        functional.reset_net(net)
        losses.append(loss.detach())
        loss.item()  # a host sync between steps, as logging does
    return losses


@pytest.mark.parametrize("extras", [False, True], ids=["plain", "dropout-scaler-clip"])
@AMP
@FUSED
def test_model_graphs_train_like_eager_steps(fused, amp, extras, no_tf32, deterministic_cudnn):
    torch.manual_seed(0)
    base = with_dropout(sj_small()) if extras else sj_small()
    base = fuse(base) if fused else base
    sizes = [8, 8, 8, 4, 8, 4, 4, 8, 8, 8]
    batches = [
        (torch.rand(b, 3, 16, 16, device="cuda"), torch.randint(0, 10, (b,), device="cuda"))
        for b in sizes
    ]
    eager_net, graphed_net = copy.deepcopy(base), graph_model(copy.deepcopy(base), warmup=2)
    torch.manual_seed(1)
    want = train(eager_net, batches, amp, extras)
    torch.manual_seed(1)
    got = train(graphed_net, batches, amp, extras)
    assert model_graphs(graphed_net).captured == 2  # one signature per batch size
    # a spike that rounding flips moves a 4-sample batch's mean loss by about 1e-3
    tolerance = 2e-2 if amp else 5e-3
    print(f"worst loss error {max(reldiff(g, w) for g, w in zip(got, want, strict=True)):.1e}")
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert reldiff(g, w) <= tolerance, f"step {i}: loss {g.item()} against {w.item()}"
    for (name, g), w in zip(
        graphed_net.state_dict().items(), eager_net.state_dict().values(), strict=True
    ):
        if g.is_floating_point():
            assert (g - w).norm() <= tolerance * w.norm() + 1e-6, name
        else:
            assert torch.equal(g, w), name


@FUSED
def test_evaluation_without_grad_replays_a_forward_graph(fused, no_tf32):
    torch.manual_seed(0)
    base = sj_residual()
    base = fuse(base) if fused else base
    x = torch.rand(4, 8, 3, 16, 16, device="cuda")
    eager_net, graphed_net = copy.deepcopy(base).eval(), graph_model(copy.deepcopy(base).eval())
    with torch.no_grad():
        want = eager_net(x)
        functional.reset_net(eager_net)
        outs = []
        for _ in range(4):  # two warm-ups, a capture, a replay
            outs.append(graphed_net(x))
            functional.reset_net(graphed_net)
    assert model_graphs(graphed_net).captured == 1
    for out in outs:  # the first replay's output survived the second replay
        assert (out - want).norm() <= 1e-5 * want.norm()


def test_model_graphs_need_no_more_memory_than_eager_steps(no_tf32):
    """Peak allocated memory over the first steps (eager warm-ups, capture, replays): the
    graphs' pool replaces the eager step's activations rather than adding to them."""
    torch.manual_seed(0)
    base = fuse(sj_residual())
    x, labels = torch.rand(16, 3, 32, 32, device="cuda"), torch.randint(0, 10, (16,), device="cuda")

    def peak(net: nn.Module) -> int:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        train(net, [(x, labels)] * 5, amp=False, scaler=False)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()

    eager_peak = peak(copy.deepcopy(base))
    graphed_peak = peak(graph_model(copy.deepcopy(base)))
    print(f"peak allocated: eager {eager_peak / 2**20:.1f} MiB, graphed {graphed_peak / 2**20:.1f}")
    assert graphed_peak <= 1.1 * eager_peak


def test_replays_are_not_slower_than_eager_calls():
    """Not a timing target: a sanity check that steps after the capture replay (one graph
    launch) rather than running eagerly (many launches)."""
    torch.manual_seed(0)
    net = graph_model(fuse(sj_small()))
    x, labels = torch.rand(8, 3, 16, 16, device="cuda"), torch.randint(0, 10, (8,), device="cuda")
    train(net, [(x, labels)] * 4, amp=False, scaler=False)
    entry = next(iter(model_graphs(net)._entries.values()))
    assert entry.graphs is not None and entry.eager_because is None
    assert torch.allclose(entry.graphs.inputs[0][0], x)  # the last replay's input was copied in
