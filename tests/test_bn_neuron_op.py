"""The fused BN → neuron (→ pool) (+ residual) op against its torch reference (CPU, float64).

Two implementations run here: the eager autograd Function (:class:`BNNeuronFunction`, with the
torch backend: the passes' torch composites) and the ``torch.library`` op that compiled blocks
call (:func:`traced_bn_neuron`). Both must give the reference's spikes exactly and its
gradients (y, gamma, beta, the neuron's learnable values, a residual) within float64 rounding.
The cuda backend's kernels are checked against the same reference in
``tests/gpu/test_bn_neuron_op_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from spikefuse import neuron
from spikefuse.fused import paper_lif
from spikefuse.fused.neuron_call import NeuronCall
from spikefuse.fused.ops.bn_neuron import (
    BNNeuronArgs,
    BNNeuronFunction,
    bn_neuron_naive,
    traced_bn_neuron,
)
from spikefuse.fused.ops.spike_max_pool.geometry import MaxPoolGeometry
from spikefuse.fused.statistics import BNSpec, bn_statistics

EPS = 1e-5
TOL = dict(rtol=1e-9, atol=1e-11)
# [T, B, C, *]: a Linear's, a Conv1d's, a Conv2d's output; one step, one channel, odd maps
SHAPES = [(3, 4, 5), (1, 3, 1), (2, 3, 4, 7), (3, 2, 3, 4, 6), (2, 2, 3, 5, 5)]

pytestmark = pytest.mark.usefixtures("one_thread")


def _node(kind: str) -> neuron.BaseNode:
    if kind == "plif":  # learnable: its gradient is checked too
        return neuron.ParametricLIFNode(init_tau=1.7, step_mode="m", backend="torch")
    return paper_lif(backend="torch")


class Case:
    """Leaves of one call: y, gamma, beta, learnable (and a residual), and what the op takes."""

    def __init__(self, shape, node_kind="lif", affine=True, running=False, residual=False):
        g = torch.Generator().manual_seed(sum(shape) + 7 * affine + 3 * running)
        c = shape[2]
        self.node = _node(node_kind)
        self.y = (torch.randn(shape, generator=g, dtype=torch.float64) * 2).requires_grad_()
        self.weight = self.bias = None
        if affine:
            self.weight = (torch.rand(c, generator=g, dtype=torch.float64) + 0.5).requires_grad_()
            self.bias = (torch.rand(c, generator=g, dtype=torch.float64) - 0.3).requires_grad_()
        self.running = None
        if running:
            var = torch.rand(c, generator=g, dtype=torch.float64) + 0.5
            self.running = (torch.randn(c, generator=g, dtype=torch.float64) * 0.3, var)
        self.residual = None
        if residual:
            self.residual = torch.randn(shape, generator=g, dtype=torch.float64).requires_grad_()
        self.learnable = self.node.learnable_values(self.y.device, torch.float64)
        if self.learnable is not None:
            self.learnable = self.learnable.detach().requires_grad_()
        self.neuron = NeuronCall.from_node(self.node, self.y)

    def leaves(self) -> list[torch.Tensor]:
        held = (self.y, self.weight, self.bias, self.learnable, self.residual)
        return [t for t in held if t is not None]

    def bn(self) -> BNSpec:
        mean, var = self.running or (None, None)
        batch = self.running is None
        return BNSpec(self.weight, self.bias, mean, var, batch, 0.1, EPS)

    def naive(self, pool: int = 1, y: torch.Tensor | None = None) -> torch.Tensor:
        y = self.y if y is None else y
        return bn_neuron_naive(
            y, self.neuron, self.learnable, self.weight, self.bias, EPS, self.running, pool,
            self.residual,
        )  # fmt: skip


def _outputs_and_grads(case: Case, run) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The output of ``run()`` and the leaves' gradients of a loss weighting every element."""
    out = run()
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    grads = torch.autograd.grad((out * weights).sum(), case.leaves())
    return out.detach(), list(grads)


def _assert_matches(case: Case, run, pool: int = 1) -> None:
    got, got_grads = _outputs_and_grads(case, run)
    want, want_grads = _outputs_and_grads(case, lambda: case.naive(pool))
    assert torch.equal(got, want)  # spikes (or their window means): exactly
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, **TOL)


def _eager(case: Case, repeat: int = 1):
    # statistics of the steps the op reads (a repeated step counts T times)
    y = case.y.detach()
    stats = bn_statistics(y if repeat == 1 else y.expand(repeat, *y.shape[1:]), case.bn())
    args = BNNeuronArgs(case.neuron, stats, case.bn(), 1, repeat, True, case.residual)
    out, packed = BNNeuronFunction.apply(
        args, case.y, case.weight, case.bias, case.learnable, case.residual
    )
    assert packed is None  # only the pooling kernels pack
    return out


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("running", [False, True], ids=["batch-stats", "running-stats"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "no-affine"])
def test_eager_op_matches_the_reference(shape, running, affine):
    case = Case(shape, affine=affine, running=running)
    _assert_matches(case, lambda: _eager(case))


@pytest.mark.parametrize("shape", [(3, 4, 5), (2, 2, 3, 5, 5)], ids=str)
def test_eager_op_with_a_residual_and_learnable_values(shape):
    case = Case(shape, node_kind="plif", residual=True)
    _assert_matches(case, lambda: _eager(case))


def test_eager_op_on_one_step_repeated_over_time():
    """repeat = T: y is one step [1, B, C, *] read at every step; its gradient sums the
    steps'."""
    case = Case((1, 3, 2, 4, 4))
    steps = 4
    run = lambda: _eager(case, repeat=steps)  # noqa: E731
    got, got_grads = _outputs_and_grads(case, run)
    expanded = case.y.expand(steps, *case.y.shape[1:])
    want, want_grads = _outputs_and_grads(case, lambda: case.naive(y=expanded))
    assert torch.equal(got, want)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, **TOL)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("running", [False, True], ids=["batch-stats", "running-stats"])
def test_traced_op_matches_the_reference(shape, running):
    case = Case(shape, node_kind="plif", running=running)

    def run() -> torch.Tensor:
        stats = bn_statistics(case.y.detach(), case.bn())
        return traced_bn_neuron(case.y, stats, case.bn(), case.neuron, case.learnable)

    _assert_matches(case, run)


@pytest.mark.parametrize("shape", [(3, 2, 3, 4, 6), (2, 2, 3, 5, 5), (1, 3, 1, 2, 2)], ids=str)
def test_traced_op_pools_like_the_reference(shape):
    """pool = 2 (the op pools the full spikes where the kernels cannot: the torch backend; an
    odd map's last row and column dropped and given no gradient)."""
    case = Case(shape)

    def run() -> torch.Tensor:
        stats = bn_statistics(case.y.detach(), case.bn())
        return traced_bn_neuron(case.y, stats, case.bn(), case.neuron, None, pool=2)

    _assert_matches(case, run, pool=2)


def test_traced_op_matches_the_reference_on_a_channels_last_map():
    case = Case((2, 3, 4, 4, 6))
    merged = case.y.detach().flatten(0, 1).contiguous(memory_format=torch.channels_last)
    case.y = merged.unflatten(0, case.y.shape[:2]).detach().requires_grad_()
    assert not case.y.is_contiguous()
    case.neuron = NeuronCall.from_node(case.node, case.y)

    def run() -> torch.Tensor:
        stats = bn_statistics(case.y.detach(), case.bn())
        return traced_bn_neuron(case.y, stats, case.bn(), case.neuron, None)

    _assert_matches(case, run)


# max_pool2d windows (kernel, stride, padding): Spikformer's 3/2/1, plain 2 x 2, ceil_mode
INPUT_POOLS = [((3, 3), (2, 2), (1, 1), False), ((2, 2), (2, 2), (0, 0), False)]
INPUT_POOLS += [((2, 3), (2, 1), (1, 0), True)]


@pytest.mark.parametrize("window", INPUT_POOLS, ids=str)
@pytest.mark.parametrize("running", [False, True], ids=["batch-stats", "running-stats"])
@pytest.mark.parametrize("repeat", [1, 3], ids=["sequence", "repeated-step"])
def test_eager_op_max_pools_the_neuron_input(window, running, repeat):
    """input_pool: spikes = neuron(maxpool(BN(y))) with BN's statistics over all of y. Channels
    with gamma < 0 (their windows take y's minimum) and overlapping windows (a position's
    gradient sums the windows it wins) included; a repeated step too."""
    kernel, stride, padding, ceil_mode = window
    geometry = MaxPoolGeometry.of(kernel, stride, padding, 1, ceil_mode)
    case = Case((1 if repeat > 1 else 3, 2, 4, 7, 6), node_kind="plif", running=running)
    with torch.no_grad():
        case.weight[::2] *= -1
    y = case.y.detach()
    seen = y if repeat == 1 else y.expand(repeat, *y.shape[1:])

    def fused() -> torch.Tensor:
        stats = bn_statistics(seen, case.bn())
        args = BNNeuronArgs(case.neuron, stats, case.bn(), 1, repeat, input_pool=geometry)
        return BNNeuronFunction.apply(args, case.y, case.weight, case.bias, case.learnable, None)[0]

    def naive() -> torch.Tensor:
        expanded = case.y if repeat == 1 else case.y.expand(repeat, *case.y.shape[1:])
        return bn_neuron_naive(
            expanded, case.neuron, case.learnable, case.weight, case.bias, EPS, case.running,
            input_pool=geometry,
        )  # fmt: skip

    got, got_grads = _outputs_and_grads(case, fused)
    want, want_grads = _outputs_and_grads(case, naive)
    assert got.shape == want.shape and torch.equal(got, want)
    assert 0.05 < want.mean() < 0.95  # neither silent nor saturated
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, **TOL)
