"""The BN-folded backward's element-wise pass 2 from pass 1's kept dL/dX (16-bit storage).

:func:`spikefuse.cuda.affine_grad.affine_input_grad` against the same formula as torch ops, on
every layout it takes (and poisoned outputs, so that an unwritten element shows); the fused op
with it (what 16-bit calls take) against the op that recomputes the neuron in pass 2 (the
same sums and parameter gradients, dL/dy within one more rounding of g) and against the
float32 reference.
"""

from __future__ import annotations

import pytest
import torch

from conftest import TOLERANCE, assert_close, differ, reldiff
from spikefuse import neuron
from spikefuse.cuda import affine
from spikefuse.cuda.affine_grad import affine_input_grad
from spikefuse.fused.neuron_call import NeuronCall
from spikefuse.fused.ops.bn_neuron import BNNeuronArgs, BNNeuronFunction, kernel_pool
from spikefuse.fused.statistics import BNSpec, bn_statistics

pytestmark = pytest.mark.gpu

EPS = 1e-5
HALVES = [torch.bfloat16, torch.float16]


def _layout(shape, layout: str, dtype, g: torch.Generator, via=None) -> torch.Tensor:
    """Random [T, B, C, *S] in ``layout``: "cl" channels-last, "contiguous", or "repeated"
    (one channels-last step expanded over T); values rounded to ``via`` first, if given."""
    steps = 1 if layout == "repeated" else shape[0]
    y = torch.randn((steps, *shape[1:]), generator=g, device="cuda").to(via or dtype).to(dtype)
    if layout in ("cl", "repeated") and y.dim() == 5:
        merged = y.flatten(0, 1).contiguous(memory_format=torch.channels_last)
        y = merged.unflatten(0, (steps, shape[1]))
    return y.expand(shape) if layout == "repeated" else y


def _expected(g, y, mean, invstd, weight, totals, inv_count, steps):
    """The kernel's formula as float32 torch ops, per channel, rounded once to y's dtype."""
    view = (1, 1, -1, *([1] * (y.dim() - 3)))
    scale = invstd * weight if weight is not None else invstd
    out = g.float() * scale.view(view)
    if totals is not None:
        mean_g, mean_gxhat = totals[0] * inv_count, totals[1] * invstd * inv_count
        coef_y = -scale * invstd * mean_gxhat
        coef_0 = -scale * mean_g - mean * coef_y
        out = out + steps * (coef_y.view(view) * y.float() + coef_0.view(view))
    return out.to(y.dtype)


CASES = [
    ((4, 8, 64, 6, 5), "cl"),  # 8 per thread, one pack per thread
    ((4, 64, 64, 40, 40), "cl"),  # more packs than one wave: threads walk rows
    ((3, 4, 24, 5, 7), "contiguous"),  # channels not innermost: one element per thread
    ((2, 6, 5, 3, 3), "cl"),  # channels not a multiple of 8
    ((4, 16, 40), "contiguous"),  # a Linear's [T, B, C]
    ((4, 8, 32, 6, 6), "repeated"),  # g summed over the 4 steps
]


@pytest.mark.quick
@pytest.mark.parametrize("dtype", HALVES, ids=str)
@pytest.mark.parametrize(("shape", "layout"), CASES, ids=str)
@pytest.mark.parametrize("running", [False, True], ids=["batch-stats", "running-stats"])
@pytest.mark.parametrize("into", ["new", "g", "y"])
def test_input_grad_kernel_matches_its_formula(dtype, shape, layout, running, into):
    gen = torch.Generator(device="cuda").manual_seed(len(shape) + shape[2])
    y = _layout(shape, layout, dtype, gen)
    memory = y[:1] if layout == "repeated" else y
    g = torch.empty_like(memory).normal_(generator=gen)
    c = shape[2]
    mean = torch.randn(c, generator=gen, device="cuda") * 0.2
    invstd = torch.rand(c, generator=gen, device="cuda") + 0.5
    weight = None if running else torch.rand(c, generator=gen, device="cuda") + 0.5
    totals = None if running else torch.randn(2, c, generator=gen, device="cuda")
    inv_count = 1.0 / (y.numel() // c)
    steps = shape[0] if layout == "repeated" else 1
    want = _expected(g, memory, mean, invstd, weight, totals, inv_count, steps)
    out = {"new": None, "g": g, "y": memory.clone()}[into]
    if out is not None:  # poisoned: what the kernel leaves unwritten stays NaN
        source = out
        out = torch.full_like(out, float("nan"))
        if into == "g":
            g = out.copy_(source)
        else:
            out.copy_(source)
            memory = out
            y = out.expand(shape) if layout == "repeated" else out
    got = affine_input_grad(g, y, mean, invstd, weight, totals, inv_count, out)
    assert got.shape == memory.shape and got.stride() == memory.stride()
    assert not got.isnan().any()
    # fma against separate products, each rounded once: an ulp apart at most
    assert reldiff(got, want) <= TOLERANCE[dtype][0]


def test_input_grad_kernel_refuses_another_layout():
    y = torch.randn(2, 4, 16, 3, 3, device="cuda", dtype=torch.bfloat16)
    g = y.flatten(0, 1).contiguous(memory_format=torch.channels_last).unflatten(0, (2, 4))
    vectors = torch.ones(16, device="cuda")
    with pytest.raises(ValueError, match="not laid out as y's memory"):
        affine_input_grad(g, y, vectors, vectors, None, None, 0.0)


def _op_grads(shape, dtype, config: str, seed: int, via=None):
    """(spikes, grads of y, gamma, beta, tau, residual) of the fused op on the cuda backend,
    ``config``: "plain", "pooled", "residual", "repeated" or "running"; the inputs' values
    rounded to ``via`` first, if given."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    node = neuron.ParametricLIFNode(init_tau=1.7, step_mode="m", backend="cuda").cuda()
    repeat = shape[0] if config == "repeated" else 1
    steps = (1, *shape[1:]) if repeat > 1 else shape
    y = (_layout(steps, "cl", dtype, gen, via) * 2).requires_grad_()
    full = y.expand(shape)
    c = shape[2]
    weight = (torch.rand(c, generator=gen, device="cuda") + 0.5).requires_grad_()
    bias = (torch.rand(c, generator=gen, device="cuda") - 0.3).requires_grad_()
    res = None
    if config == "residual":
        res = _layout(shape, "cl", dtype, gen, via).requires_grad_()
    learnable = node.learnable_values(y.device).detach().requires_grad_()
    call = NeuronCall.from_node(node, full)
    running = config == "running"
    stats_running = (torch.zeros(c, device="cuda"), torch.ones(c, device="cuda"))
    spec = BNSpec(
        weight, bias, *(stats_running if running else (None, None)), not running, 0.1, EPS
    )
    stats = bn_statistics(full.detach(), spec)
    pool = 2 if config == "pooled" else 1
    assert kernel_pool(full, stats, call, pool) == pool
    args = BNNeuronArgs(call, stats, spec, pool, repeat, True, res)
    out = BNNeuronFunction.apply(args, y, weight, bias, learnable, res)[0]
    weights = torch.linspace(-1, 1, out.numel(), device="cuda").view_as(out).to(out.dtype)
    leaves = [t for t in (y, weight, bias, learnable, res) if t is not None]
    return out.detach(), torch.autograd.grad((out * weights).sum(), leaves)


OP_CASES = ["plain", "pooled", "residual", "repeated", "running"]


@pytest.mark.quick
@pytest.mark.parametrize("dtype", HALVES, ids=str)
@pytest.mark.parametrize("config", OP_CASES)
@pytest.mark.parametrize("shape", [(4, 8, 64, 16, 16), (3, 2, 24, 6, 6)], ids=str)
def test_kept_input_grad_matches_the_recomputing_pass(dtype, config, shape, monkeypatch):
    calls = []
    real = affine.affine_input_grad
    monkeypatch.setattr(affine, "affine_input_grad", lambda *a: calls.append(1) or real(*a))
    out, grads = _op_grads(shape, dtype, config, seed=shape[2])
    assert calls, "the 16-bit op did not take the element-wise pass 2"
    monkeypatch.setattr(affine, "keeps_input_grad", lambda y, residual=None: False)
    calls.clear()
    ref_out, ref_grads = _op_grads(shape, dtype, config, seed=shape[2])
    assert not calls
    assert differ(out, ref_out).sum().item() == 0, "spikes differ"
    grad_y, *rest = grads
    ref_grad_y, *ref_rest = ref_grads
    # pass 1 is the same launch: BatchNorm's and the neuron's parameter gradients are its sums
    for g, w in zip(rest[:3], ref_rest[:3], strict=True):
        assert torch.equal(g, w)
    # dL/dy (and dL/dresidual) after one more rounding of g to the storage dtype
    for g, w in zip([grad_y, *rest[3:]], [ref_grad_y, *ref_rest[3:]], strict=True):
        assert_close(g, w, dtype, grad=False, what=f"{config} {dtype} dL/dy")


@pytest.mark.parametrize("dtype", HALVES, ids=str)
@pytest.mark.parametrize("config", OP_CASES)
def test_kept_input_grad_matches_float32(dtype, config):
    """The 16-bit op against the same op in float32 on the same (rounded) inputs."""
    shape = (4, 8, 32, 12, 12)
    out, grads = _op_grads(shape, dtype, config, seed=3)
    ref_out, ref_grads = _op_grads(shape, torch.float32, config, seed=3, via=dtype)
    assert differ(out, ref_out).float().mean().item() <= 1e-2  # rounded inputs flip a few
    for g, w in zip(grads, ref_grads, strict=True):
        assert_close(g, w, dtype, grad=True, what=f"{config} {dtype} vs float32 gradient")
