"""torch.compile of whole SpikingJelly-style models: one graph, no graph break, no recompile from
one training step to the next, the eager results (fused and unfused; aot_eager on the CPU)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch.nn import functional as F

from spikefuse import functional, fuse, layer, neuron, surrogate


def sj_net() -> nn.Sequential:
    """Conv-BN-LIF, pooling, Flatten, Linear-BN-LIF, classifier: written the SpikingJelly way."""

    def lif():
        return neuron.LIFNode(
            tau=4 / 3,
            decay_input=False,
            v_threshold=0.25,
            v_reset=0.0,
            surrogate_function=surrogate.Sigmoid(),
            step_mode="m",
        )

    return nn.Sequential(
        layer.Conv2d(3, 8, 3, padding=1, bias=False, step_mode="m"),
        layer.BatchNorm2d(8, step_mode="m"),
        lif(),
        layer.AvgPool2d(2, step_mode="m"),
        layer.Conv2d(8, 8, 3, padding=1, bias=False, step_mode="m"),
        layer.BatchNorm2d(8, step_mode="m"),
        lif(),
        layer.MaxPool2d(2, step_mode="m"),
        layer.Flatten(step_mode="m"),
        layer.Linear(8 * 2 * 2, 16, bias=False, step_mode="m"),
        layer.BatchNorm1d(16, step_mode="m"),
        lif(),
        layer.Linear(16, 10, step_mode="m"),
    )


def train_steps(net: nn.Module, steps: int) -> list[torch.Tensor]:
    """Losses and final gradients of ``steps`` SGD steps on fixed data."""
    gen = torch.Generator().manual_seed(1)
    x = torch.rand(4, 2, 3, 8, 8, generator=gen)
    labels = torch.randint(0, 10, (2,), generator=gen)
    params = [p for p in net.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    losses = []
    for _ in range(steps):
        loss = nn.functional.cross_entropy(net(x).mean(0), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        functional.reset_net(net)
        losses.append(loss.detach())
    return losses + [p.grad for p in params]


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_model_compiles_to_one_graph_without_recompiles(fused):
    torch.manual_seed(0)
    model = sj_net()
    model = fuse(model) if fused else model
    eager = copy.deepcopy(model)
    torch.compiler.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    got = train_steps(compiled, 3)
    assert counter.frame_count == 1  # one graph for the forward, not recompiled by steps 2, 3
    want = train_steps(eager, 3)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    torch.compiler.reset()


def test_cumulative_average_batchnorm_needs_no_host_sync():
    """momentum=None (torch's cumulative average): the fused block's factor 1/num_batches_tracked
    stays a device tensor (CUDA-graph capturable) and gives torch's running statistics."""
    torch.manual_seed(0)
    model = nn.Sequential(
        layer.Conv2d(3, 4, 3, padding=1, bias=False, step_mode="m"),
        layer.BatchNorm2d(4, momentum=None, step_mode="m"),
        neuron.LIFNode(step_mode="m"),
    )
    fused = fuse(model)
    for _ in range(3):
        x = torch.randn(2, 3, 3, 6, 6)
        model(x), fused(x)
        functional.reset_net(model)
    torch.testing.assert_close(fused[0].bn.running_mean, model[1].running_mean)
    torch.testing.assert_close(fused[0].bn.running_var, model[1].running_var)
    assert int(fused[0].bn.num_batches_tracked) == 3


def _compiled_ops(model: nn.Module, x: torch.Tensor) -> set[str]:
    """The targets of the call_function nodes of the forward graph torch.compile traces."""
    targets: set[str] = set()

    def backend(gm: torch.fx.GraphModule, example_inputs):
        targets.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch.compiler.reset()
    try:
        torch.compile(model, fullgraph=True, backend=backend)(x)
    finally:
        torch.compiler.reset()
    return targets


def test_compiled_fused_blocks_run_the_bn_neuron_op():
    """A compiled fused block calls the fused BatchNorm → neuron op (the BN-folded kernels on
    CUDA), not torch's BatchNorm and the plain neuron."""
    model = fuse(sj_net())
    targets = _compiled_ops(model, torch.rand(4, 2, 3, 8, 8))
    assert sum("bn_neuron_fptt" in t for t in targets) >= 1
    assert not any("batch_norm" in t and "stats" not in t for t in targets), targets
    assert not any("neuron_fptt" in t and "bn_neuron" not in t for t in targets), targets


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_compiled_fused_plif_block_matches_eager(training):
    """Learnable neuron parameters, running statistics (eval) and BN without affine go through
    the op's backward like the eager block's."""
    torch.manual_seed(0)
    model = nn.Sequential(
        layer.Conv2d(3, 6, 3, padding=1, bias=False, step_mode="m"),
        layer.BatchNorm2d(6, affine=False, step_mode="m"),
        neuron.ParametricLIFNode(surrogate_function=surrogate.Sigmoid(), step_mode="m"),
        layer.Flatten(step_mode="m"),
        layer.Linear(6 * 16, 5, bias=False, step_mode="m"),
        layer.BatchNorm1d(5, step_mode="m"),
        neuron.ParametricLIFNode(step_mode="m"),
    )
    model = fuse(model).train(training)
    eager = copy.deepcopy(model)
    torch.compiler.reset()
    try:
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        x = torch.rand(3, 2, 3, 4, 4)
        for net in (compiled, eager):
            net(x).sum().backward()
    finally:
        torch.compiler.reset()
    for (name, got), want in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-7, msg=name)
    for got, want in zip(model.buffers(), eager.buffers(), strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    ("count", "shape", "pool"),
    [(0, (3, 2, 4, 4), 1), (96, (3, 2, 4, 4), 1), (2 * 3 * 5 * 5, (3, 2, 4, 5, 5), 2)],
    ids=["running-stats", "batch-stats", "pooled-odd-map"],
)
def test_opcheck_bn_neuron_ops(count, shape, pool):
    """Schema, fake tensors, autograd registration and AOT dispatch of the fused block's ops;
    pooled over 2 x 2 windows of a 5 x 5 map (the op pools the full spikes itself where the
    kernels cannot; the last row and column are dropped, as avg_pool2d drops them)."""
    g = torch.Generator().manual_seed(3)
    node = neuron.ParametricLIFNode(step_mode="m")
    y = torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()
    mean, invstd = torch.rand(4, dtype=torch.float64), torch.rand(4, dtype=torch.float64) + 0.5
    weight = torch.rand(4, dtype=torch.float64).requires_grad_()
    bias = torch.rand(4, dtype=torch.float64).requires_grad_()
    learnable = node.learnable_values(y.device, torch.float64).detach().requires_grad_()
    config = (node.program.key, "torch", list(node.constants()), 0.0, count, pool)
    args = (y, mean, invstd, weight, bias, learnable, *config, True)
    torch.library.opcheck(torch.ops.spikefuse.bn_neuron_fptt.default, args)


def test_pooled_bn_neuron_op_is_the_pooling_of_its_spikes():
    """The op with pool = 2 gives avg_pool2d of its unpooled spikes, and the same gradients
    (a 5 x 5 map: the last row and column are dropped and get no gradient)."""
    g = torch.Generator().manual_seed(5)
    node = neuron.LIFNode(step_mode="m")
    y = torch.randn(3, 2, 4, 5, 5, generator=g, dtype=torch.float64) * 2
    mean, invstd = torch.rand(4, dtype=torch.float64), torch.rand(4, dtype=torch.float64) + 0.5
    weight = torch.rand(4, dtype=torch.float64)
    grad = torch.randn(3, 2, 4, 2, 2, generator=g, dtype=torch.float64)

    def run(pool: int) -> tuple[torch.Tensor, ...]:
        leaves = [t.clone().requires_grad_() for t in (y, weight)]
        config = (node.program.key, "torch", list(node.constants()), 0.0, 150, pool)
        spikes, _ = torch.ops.spikefuse.bn_neuron_fptt.default(
            leaves[0], mean, invstd, leaves[1], None, None, *config, True
        )
        if pool == 1:
            spikes = F.avg_pool2d(spikes.flatten(0, 1), 2).unflatten(0, spikes.shape[:2])
        spikes.backward(grad)
        return spikes.detach(), *(t.grad for t in leaves)

    for got, want in zip(run(2), run(1), strict=True):
        torch.testing.assert_close(got, want)


def test_compiled_fused_model_on_an_input_repeated_over_time():
    """images.expand(T, ...) compiles to one graph (the first block's synapse runs once per
    image, as in eager) and gives the eager model's loss and gradients."""
    torch.manual_seed(0)
    model = fuse(sj_net())
    eager = copy.deepcopy(model)
    images = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    x = images.unsqueeze(0).expand(4, -1, -1, -1, -1)
    torch.compiler.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    results = []
    for net in (compiled, eager):
        for _ in range(2):
            loss = net(x).square().mean()
            loss.backward()
            functional.reset_net(net)
        results.append([loss.detach(), *(p.grad for p in net.parameters())])
    assert counter.frame_count == 1
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    torch.compiler.reset()
