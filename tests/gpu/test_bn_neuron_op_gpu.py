"""The fused BN → neuron (→ pool) (+ residual) op's CUDA kernels against its torch reference.

:class:`BNNeuronFunction` and the ``torch.library`` op (:func:`traced_bn_neuron`) with the cuda
backend (the BN-folded kernels, pooling in the kernels where the map is channels-last) against
:func:`bn_neuron_naive` (torch ops and the reference neuron, autograd through BatchNorm's
statistics) on the same float32 tensors: spikes (and their window means) equal, gradients
within the float32 tolerances of ``tests/conftest.py``, as the other kernel tests compare. The
CPU twin of this file is ``tests/test_bn_neuron_op.py``.
"""

from __future__ import annotations

import pytest
import torch

from conftest import assert_close, differ
from spikefuse import neuron
from spikefuse.fused.neuron_call import NeuronCall
from spikefuse.fused.ops.bn_neuron import (
    BNNeuronArgs,
    BNNeuronFunction,
    bn_neuron_naive,
    kernel_pool,
    traced_bn_neuron,
)
from spikefuse.fused.ops.spike_max_pool.geometry import MaxPoolGeometry
from spikefuse.fused.statistics import BNSpec, bn_statistics

pytestmark = pytest.mark.gpu

EPS = 1e-5
DTYPE = torch.float32
# [T, B, C, *]: a Linear's, a Conv2d's (odd channel count; T = 1; more steps than a chunk);
# channels in whole warps, where backward blocks walk several row groups (the last one short)
SHAPES = [
    (4, 8, 33),
    (3, 2, 5, 6, 6),
    (1, 4, 16, 4, 2),
    (40, 2, 8, 4, 4),
    (2, 16, 64, 33, 31),
    (4, 16, 32, 45, 47),
]


def _leaves(shape, seed: int, residual: bool, channels_last: bool):
    g = torch.Generator(device="cuda").manual_seed(seed)
    y = torch.randn(shape, generator=g, device="cuda", dtype=DTYPE) * 2
    if channels_last:
        y = y.flatten(0, 1).contiguous(memory_format=torch.channels_last).unflatten(0, shape[:2])
    c = shape[2]
    weight = torch.rand(c, generator=g, device="cuda", dtype=DTYPE) + 0.5
    bias = torch.rand(c, generator=g, device="cuda", dtype=DTYPE) - 0.3
    res = torch.randn(y.shape, generator=g, device="cuda", dtype=DTYPE) if residual else None
    if res is not None and channels_last:
        res = torch.empty_like(y).copy_(res)
    return [t if t is None else t.detach().requires_grad_() for t in (y, weight, bias, res)]


def _run(fn, leaves):
    out = fn()
    weights = torch.linspace(-1, 1, out.numel(), device="cuda", dtype=out.dtype).view_as(out)
    wanted = [t for t in leaves if t is not None]
    return out.detach(), torch.autograd.grad((out * weights).sum(), wanted)


def _compare(got, want, what: str) -> None:
    (out, grads), (ref, ref_grads) = got, want
    assert differ(out, ref).sum().item() == 0, f"{what}: spikes differ"
    for g, w in zip(grads, ref_grads, strict=True):
        assert_close(g, w, DTYPE, grad=True, what=f"{what} gradient")


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("running", [False, True], ids=["batch-stats", "running-stats"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_kernels_match_the_reference(shape, running, residual):
    conv = len(shape) == 5
    node = neuron.ParametricLIFNode(init_tau=1.7, step_mode="m", backend="cuda").cuda()
    y, weight, bias, res = _leaves(shape, len(shape) + 2 * running, residual, conv)
    learnable = node.learnable_values(y.device).detach().requires_grad_()
    call = NeuronCall.from_node(node, y)
    assert call.affine is not None  # the BN-folded kernels run
    c = shape[2]
    stats_running = None
    if running:
        stats_running = (torch.randn(c, device="cuda") * 0.3, torch.rand(c, device="cuda") + 0.5)
    spec = BNSpec(weight, bias, *(stats_running or (None, None)), not running, 0.1, EPS)
    stats = bn_statistics(y.detach(), spec)
    pool = 2 if conv and not residual and kernel_pool(y, stats, call, 2) == 2 else 1
    leaves = [y, weight, bias, learnable, res]

    def fused():
        args = BNNeuronArgs(call, stats, spec, pool, 1, True, res)
        return BNNeuronFunction.apply(args, y, weight, bias, learnable, res)[0]

    def naive():
        return bn_neuron_naive(y, call, learnable, weight, bias, EPS, stats_running, pool, res)

    want = _run(naive, leaves)
    _compare(_run(fused, leaves), want, f"BNNeuronFunction (pool {pool})")
    if not residual:  # compiled residual blocks run torch's BatchNorm, not this op

        def traced():
            return traced_bn_neuron(y, stats, spec, call, learnable, pool)

        _compare(_run(traced, leaves), want, f"library op (pool {pool})")


@pytest.mark.parametrize("shape", [(3, 4, 16, 9, 8), (4, 8, 64, 32, 32)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kernels_max_pool_the_neuron_input_like_the_reference(shape, dtype):
    """input_pool (Spikformer's MaxPool2d(3, 2, 1) of the BN output) on a channels-last y,
    channels with gamma < 0 included: the BN-folded kernels on the pooled map against BatchNorm,
    max_pool2d and the reference neuron as torch ops."""
    node = neuron.ParametricLIFNode(init_tau=1.7, step_mode="m", backend="cuda").cuda()
    y, weight, bias, _ = _leaves(shape, 11, False, True)
    with torch.no_grad():
        weight[::3] *= -1
    y = y.detach().to(dtype).requires_grad_()
    learnable = node.learnable_values(y.device).detach().requires_grad_()
    call = NeuronCall.from_node(node, y)
    assert call.affine is not None  # the BN-folded kernels run
    spec = BNSpec(weight, bias, None, None, True, 0.1, EPS)
    stats = bn_statistics(y.detach(), spec)
    geometry = MaxPoolGeometry.of(3, 2, 1)
    leaves = [y, weight, bias, learnable]

    def fused():
        args = BNNeuronArgs(call, stats, spec, input_pool=geometry)
        return BNNeuronFunction.apply(args, y, weight, bias, learnable, None)[0]

    def naive():
        return bn_neuron_naive(y, call, learnable, weight, bias, EPS, input_pool=geometry)

    (out, grads), (ref, ref_grads) = _run(fused, leaves), _run(naive, leaves)
    pooled = tuple((size - 1) // 2 + 1 for size in shape[3:])  # (H + 2 - 3) // 2 + 1
    assert out.dtype == dtype and out.shape == (*shape[:3], *pooled)
    assert differ(out, ref).float().mean().item() <= (0 if dtype == torch.float32 else 1e-3)
    for g, w in zip(grads, ref_grads, strict=True):
        assert_close(g, w, dtype, grad=True, what=f"input-pooled {dtype} gradient")


@pytest.mark.quick
@pytest.mark.parametrize("shape", [(3, 2, 5, 6, 6), (2, 16, 64, 33, 31)], ids=str)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_64_bit_index_kernels_match_the_reference(shape, residual, monkeypatch):
    """The variants the launchers take for maps past 32-bit indices, forced on small ones (a
    pooled map, and channels in whole warps: the channel-tiled backward)."""
    from spikefuse.cuda import affine_plan, kernel_spec

    monkeypatch.setattr(kernel_spec, "INDEX32_MAX", 0)
    affine_plan.plan.cache_clear()  # plans name their kernel variant
    try:
        test_kernels_match_the_reference(shape, False, residual)
        y = torch.empty(shape, device="meta")
        program = NeuronCall.from_node(neuron.LIFNode(), y).program
        plan = affine_plan.plan(program, y.dtype, y.shape, y.stride(), 1, residual, False, True)
        assert plan.kernel.wide_index
    finally:
        affine_plan.plan.cache_clear()
