"""Fused synapse → BatchNorm → neuron blocks against the unfused spikefuse modules (CPU)."""

from __future__ import annotations

import contextlib
import copy
import csv
import gc
import importlib.util
import weakref

import pytest
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

from spikefuse import cli, functional, layer, neuron, surrogate
from spikefuse.bench import e2e, networks
from spikefuse.errors import BackendUnavailableError, SpikefuseError
from spikefuse.fused import (
    FusedBlock,
    FusedConvBNNeuron,
    FusedLinearBNNeuron,
    SpikePool,
    WindowAvgPool,
    fuse,
    match_optimizer_state,
    paper_lif,
    recompute,
)
from spikefuse.fused.neuron_call import NeuronCall
from spikefuse.fused.ops.bn_neuron import passes
from spikefuse.fused.recompute import mark_spikes

T, B = 3, 4
# fp32: outputs are spikes and must match exactly; gradients differ only by summation order.
FP32_TOL = dict(rtol=1e-4, atol=1e-5)
FP64_TOL = dict(rtol=1e-9, atol=1e-11)


pytestmark = pytest.mark.usefixtures("one_thread")


def lif(**kw) -> neuron.LIFNode:
    return paper_lif(backend="torch", **kw)


def conv_bn_lif(c_in: int, c_out: int) -> list[nn.Module]:
    """Conv2d (3x3, padding 1, no bias) → BatchNorm2d → :func:`lif`, multi-step."""
    conv = layer.Conv2d(c_in, c_out, 3, padding=1, bias=False, step_mode="m")
    return [conv, layer.BatchNorm2d(c_out, step_mode="m"), lif()]


def linear_bn_lif(f_in: int, f_out: int) -> list[nn.Module]:
    """Linear (no bias) → BatchNorm1d → :func:`lif`, multi-step."""
    linear = layer.Linear(f_in, f_out, bias=False, step_mode="m")
    return [linear, layer.BatchNorm1d(f_out, step_mode="m"), lif()]


def randomize_bn(model: nn.Module) -> None:
    """Non-trivial affine parameters, so that the gamma/beta paths are exercised."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.affine:
                m.weight.copy_(torch.rand(m.weight.shape, generator=gen) + 0.5)
                m.bias.copy_(torch.rand(m.bias.shape, generator=gen) * 0.6 - 0.2)


def conv_stack(dtype: torch.dtype, bn: bool = True, node=lif) -> nn.Sequential:
    """Conv-BN-LIF, AvgPool, Conv-BN-LIF, Conv-BN-LIF, Flatten, Linear-BN-LIF, Linear."""
    torch.manual_seed(0)

    def norm(c: int, kind=layer.BatchNorm2d) -> list[nn.Module]:
        return [kind(c, step_mode="m")] if bn else []

    def block(synapse: nn.Module, channels: int, kind=layer.BatchNorm2d) -> list[nn.Module]:
        return [synapse, *norm(channels, kind), node()]

    def conv(c_in: int, bias: bool) -> nn.Module:
        return layer.Conv2d(c_in, 8, 3, padding=1, bias=bias, step_mode="m")

    model = nn.Sequential(
        *block(conv(3, bias=not bn), 8),
        layer.AvgPool2d(2, step_mode="m"),
        *block(conv(8, bias=False), 8),
        *block(conv(8, bias=True), 8),
        layer.Flatten(step_mode="m"),
        *block(layer.Linear(8 * 4 * 4, 16, step_mode="m"), 16, layer.BatchNorm1d),
        nn.Linear(16, 10),
    ).to(dtype)
    randomize_bn(model)
    return model


def run(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    x = x.detach().clone().requires_grad_()
    out = model(x)
    # A loss that depends on every output element differently.
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    (out * weights).sum().backward()
    functional.reset_net(model)
    return out.detach(), x.grad, [p.grad for p in model.parameters()]


def assert_same_training_step(ref: nn.Module, fused: nn.Module, x: torch.Tensor, tol) -> None:
    out_r, gx_r, gp_r = run(ref, x)
    out_f, gx_f, gp_f = run(fused, x)
    torch.testing.assert_close(out_f, out_r, **tol)
    torch.testing.assert_close(gx_f, gx_r, **tol)
    assert len(gp_f) == len(gp_r)
    for name_r, g_r, g_f in zip(dict(ref.named_parameters()), gp_r, gp_f, strict=True):
        torch.testing.assert_close(g_f, g_r, **tol, msg=lambda m, n=name_r: f"{n}: {m}")
    for b_r, b_f in zip(ref.buffers(), fused.buffers(), strict=True):
        torch.testing.assert_close(b_f, b_r, **tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("bn", [True, False])
def test_fused_model_matches_unfused(dtype, bn):
    ref = conv_stack(dtype, bn=bn)
    fused = fuse(ref)
    assert sum(isinstance(m, FusedBlock) for m in fused.modules()) == 4
    x = torch.randn(T, B, 3, 8, 8, dtype=dtype) * 2
    tol = FP64_TOL if dtype == torch.float64 else FP32_TOL
    assert_same_training_step(ref, fused, x, tol)  # training: batch statistics
    ref.eval()
    fused.eval()
    assert_same_training_step(ref, fused, x, tol)  # eval: running statistics


def test_pass_two_recomputes_g_when_pass_one_returns_none(monkeypatch):
    """A pass-1 kernel may drop g (the paper's Alg. 2-3): pass 2 recomputes it, same result."""
    real = passes.bn_neuron_backward

    def without_g(*args):
        _, *rest = real(*args)
        return (None, *rest)

    monkeypatch.setattr(passes, "bn_neuron_backward", without_g)
    ref = conv_stack(torch.float64)
    x = torch.randn(T, B, 3, 8, 8, dtype=torch.float64) * 2
    assert_same_training_step(ref, fuse(ref), x, FP64_TOL)


@pytest.mark.parametrize(
    "bn_options",
    [dict(momentum=None), dict(track_running_stats=False), dict(affine=False)],
    ids=["cumulative-average", "no-running-stats", "no-affine"],
)
def test_batchnorm_options(bn_options):
    torch.manual_seed(0)
    ref = nn.Sequential(
        layer.Conv2d(3, 8, 3, padding=1, step_mode="m"),
        layer.BatchNorm2d(8, step_mode="m", **bn_options),
        lif(),
    ).double()
    fused = fuse(ref)
    # three updates: the cumulative average's third factor, 1 / 3, is inexact in float32
    for mode in ("train", "train", "train", "eval"):
        ref.train(mode == "train")
        fused.train(mode == "train")
        x = torch.randn(T, B, 3, 6, 6, dtype=torch.float64) * 2
        assert_same_training_step(ref, fused, x, FP64_TOL)


def test_block_reuses_its_neuron_call_until_the_node_changes(monkeypatch):
    """The per-call neuron setup (program, backend, constants) is made once per block, not per
    call (host time), and made again once the node changes, so that a new threshold applies."""
    torch.manual_seed(0)
    block = FusedBlock(nn.Linear(5, 6), nn.BatchNorm1d(6), lif()).eval()
    resolutions = []
    resolve = type(block.node).resolve_backend
    monkeypatch.setattr(
        type(block.node),
        "resolve_backend",
        lambda node, x: resolutions.append(1) or resolve(node, x),
    )
    x = torch.randn(T, B, 5)
    block(x)
    first = block._neuron_call
    block(x)
    assert block._neuron_call is first and len(resolutions) == 1
    block.node.v_threshold = 0.05
    out = block(x)
    assert block._neuron_call is not first and block._neuron_call.constants[0] == 0.05
    # the backend is resolved again only where its setting or the input's device or dtype
    # changed: an explicit backend that cannot run still raises then
    resolved = block._neuron_call
    block.double()(x.double())
    assert block._neuron_call is not resolved and block._neuron_call.backend == "torch"
    block.float()
    block.node.backend = "cuda"
    with pytest.raises(BackendUnavailableError, match="cuda"):
        block(x)
    block.node.backend = "auto"
    assert torch.equal(block(x), out)
    again = copy.deepcopy(block)  # after a forward: the kept call copies, and still works
    resolutions.clear()
    assert torch.equal(again(x), out)
    assert resolutions == [1]  # a copy (or a pickle, maybe in another process) resolves again
    fresh = FusedBlock(block.synapse, block.bn, lif(v_threshold=0.05)).eval()
    assert torch.equal(fresh(x), out)


def test_block_submodules_read_and_assign_as_module_attributes():
    """The block reads its submodules straight from _modules (host time): they are registered
    (also where None), assigning one replaces what the next call runs, and a non-module is
    refused as nn.Module refuses it."""
    torch.manual_seed(0)
    block = FusedBlock(nn.Linear(5, 6), None, lif()).eval()
    assert [name for name, _ in block.named_children()] == ["synapse", "node"]
    assert block.bn is None and block.pool is None and block.node is block._modules["node"]
    x = torch.randn(T, B, 5)
    block.node = lif(v_threshold=0.05)
    assert torch.equal(block(x), FusedBlock(block.synapse, None, lif(v_threshold=0.05))(x))
    block.bn = nn.BatchNorm1d(6)
    assert "bn.running_mean" in block.state_dict()
    with pytest.raises(TypeError, match="child module 'bn'"):
        block.bn = 3
    assert isinstance(copy.deepcopy(block).bn, nn.BatchNorm1d)


def test_a_v_reset_changed_after_construction_starts_fused_and_unfused_alike():
    """V starts where reset() puts it: the v_reset the node was built with (SpikingJelly's
    registered memory), while the new v_reset is the reset value; fused blocks started from the
    new one, so the two models gave different spikes."""
    torch.manual_seed(0)
    net = nn.Sequential(layer.Linear(4, 5, bias=False), layer.BatchNorm1d(5), neuron.IFNode())
    functional.set_step_mode(net.double(), "m")
    net[2].v_reset = -0.8
    fused = fuse(net)
    x = torch.rand(3, 6, 4, dtype=torch.float64) * 2
    functional.reset_net(net)
    assert net[2].v == 0.0  # reset() restores the V it was built with
    assert torch.equal(fused(x), net(x))


def test_hooks_added_to_a_fused_blocks_modules_are_refused():
    """A hook on a module inside a fused block would never run (the block runs kernels
    instead): the call raises instead of silently skipping it."""
    net = nn.Sequential(layer.Linear(4, 5), layer.BatchNorm1d(5), lif())
    functional.set_step_mode(net, "m")
    fused = fuse(net)
    x = torch.rand(3, 2, 4)
    fused(x)
    for module in (fused[0].node, fused[0].bn, fused[0].synapse):
        for register, kind in (
            (module.register_forward_hook, "forward"),
            (module.register_forward_pre_hook, "forward"),
            (module.register_full_backward_hook, "backward"),
            (module.register_full_backward_pre_hook, "backward"),
        ):
            handle = register(lambda *args: None)
            with pytest.raises(SpikefuseError, match=f"has {kind} hooks, which never run"):
                fused(x)
            handle.remove()
    fused[0].register_forward_hook(lambda *args: None)  # on the block: runs
    fused(x)


def test_store_v_seq_set_on_a_fused_blocks_node_is_refused():
    net = nn.Sequential(layer.Linear(4, 5), layer.BatchNorm1d(5), lif())
    functional.set_step_mode(net, "m")
    fused = fuse(net)
    x = torch.rand(3, 2, 4)
    fused(x)
    fused[0].node.store_v_seq = True
    with pytest.raises(SpikefuseError, match="keeps no V, but its LIFNode now has store_v_seq"):
        fused(x)


def test_fuse_keeps_a_frozen_batchnorm_frozen():
    net = nn.Sequential(layer.Conv2d(3, 4, 3, padding=1), layer.BatchNorm2d(4), lif())
    functional.set_step_mode(net, "m")
    net[1].eval()  # frozen statistics in a training model
    fused = fuse(net)
    assert fused[0].training and not fused[0].bn.training
    before = fused[0].bn.running_mean.clone()
    fused(torch.rand(2, 3, 3, 6, 6))
    assert torch.equal(fused[0].bn.running_mean, before)


def test_neuron_call_runs_any_time_major_layout_in_place():
    """Channels-last maps (the fused Conv2d's layout on CUDA) go through the plain neuron
    kernels in their memory order: spikes and dL/dx keep x's strides, own their memory (not
    views) and equal the contiguous call's."""
    torch.manual_seed(0)
    node = neuron.ParametricLIFNode(init_tau=3.0, step_mode="m", backend="torch").double()
    call = NeuronCall.from_node(node, torch.zeros(1))
    merged = torch.randn(T * B, 4, 5, 6, dtype=torch.float64)
    x = merged.contiguous(memory_format=torch.channels_last).unflatten(0, (T, B))
    learnable = node.learnable_values(x.device, x.dtype)
    grad = torch.randn(x.shape, dtype=x.dtype)
    spikes, kept = call.forward(x, learnable, True)
    want, _ = call.forward(x.contiguous(), learnable, True)
    g, g_learnable = call.input_grad(x, learnable, grad, kept)
    g_want, g_learnable_want = call.input_grad(x.contiguous(), learnable, grad, None)
    assert spikes.stride() == x.stride() == g.stride() and spikes._base is None
    assert torch.equal(spikes, want) and torch.equal(g, g_want)
    assert torch.equal(g_learnable, g_learnable_want)


@pytest.mark.parametrize(
    "make_node",
    [
        lambda: neuron.IFNode(v_reset=None, step_mode="m", backend="torch"),  # soft reset
        lambda: neuron.LIFNode(
            tau=2.0,
            surrogate_function=surrogate.ATan(),
            detach_reset=True,
            step_mode="m",
            backend="torch",
        ),
        lambda: neuron.ParametricLIFNode(init_tau=3.0, step_mode="m", backend="torch"),
        lambda: neuron.QIFNode(step_mode="m", backend="torch"),
    ],
    ids=["if-soft", "lif-atan-detach", "plif", "qif"],
)
def test_other_one_state_neurons(make_node):
    ref = conv_stack(torch.float64, node=make_node)
    ref[3] = layer.MaxPool2d(2, step_mode="m")  # max pooling keeps spikes binary
    fused = fuse(ref)
    assert isinstance(fused[3], SpikePool)
    x = torch.randn(T, B, 3, 8, 8, dtype=torch.float64) * 2
    assert_same_training_step(ref, fused, x, FP64_TOL)


def test_container_patterns_and_shared_parameters():
    conv = nn.Conv2d(3, 4, 3, padding=1)
    bn = nn.BatchNorm2d(4)
    model = nn.Sequential(
        layer.SeqToANNContainer(conv, bn),
        lif(),
        nn.Sequential(layer.Flatten(step_mode="m"), nn.Linear(4 * 8 * 8, 6), lif()),
        layer.SeqToANNContainer(nn.Linear(6, 5)),
        layer.SeqToANNContainer(nn.BatchNorm1d(5)),
        lif(),
        nn.Linear(5, 3),  # no neuron after it: stays as it is
    ).double()
    randomize_bn(model)
    fused = fuse(model, inplace=True)
    assert fused is model
    blocks = [m for m in model.modules() if isinstance(m, FusedBlock)]
    assert len(blocks) == 3
    assert blocks[0].synapse is conv and blocks[0].bn is bn
    assert isinstance(model[1], nn.Identity) and isinstance(model[2][1], FusedBlock)
    assert blocks[1].bn is None and blocks[2].bn is not None
    ref = copy.deepcopy(model)
    # Undo the fusion in the copy by rebuilding the original layout for comparison.
    first, second, third = ref[0], ref[2][1], ref[3]
    unfused = nn.Sequential(
        layer.SeqToANNContainer(first.synapse, first.bn),
        first.node,
        nn.Sequential(ref[2][0], second.synapse, second.node),
        layer.SeqToANNContainer(third.synapse),
        layer.SeqToANNContainer(third.bn),
        third.node,
        ref[6],
    )
    x = torch.randn(T, B, 3, 8, 8, dtype=torch.float64)
    assert_same_training_step(unfused, model, x, FP64_TOL)


def test_fuse_leaves_unsupported_patterns_alone():
    model = nn.Sequential(
        layer.Conv2d(3, 4, 3, step_mode="m"),
        neuron.IzhikevichNode(step_mode="m", backend="torch"),  # two states
        layer.Conv2d(4, 4, 3, step_mode="s"),  # single-step layer
        lif(),
        layer.Conv2d(4, 4, 3, step_mode="m"),
        lif(store_v_seq=True),  # needs V
        layer.Conv2d(4, 4, 3, step_mode="m"),
        layer.BatchNorm2d(4, step_mode="m"),
        layer.AvgPool2d(2, step_mode="m"),  # something between BN and neuron
        lif(),
    )
    fused = fuse(model)
    assert not any(isinstance(m, FusedBlock) for m in fused.modules())


def test_direct_blocks_and_paper_neuron():
    block = FusedConvBNNeuron(3, 6, 3, padding=1, node=lif()).double()
    assert block.synapse.bias is None and block.bn is not None
    node = block.node
    assert node.v_threshold == 0.25 and node.v_reset == 0.0 and not node.decay_input
    assert abs((1 - 1 / node.tau) - 0.25) < 1e-12
    x = torch.randn(T, B, 3, 5, 5, dtype=torch.float64)
    s = block(x)
    assert s.shape == (T, B, 6, 5, 5) and s.dtype == torch.float64
    assert set(s.unique().tolist()) <= {0.0, 1.0}
    fc = FusedLinearBNNeuron(6, 7, bn=False, node=lif()).double()
    assert fc.bn is None and fc.synapse.bias is not None
    assert fc(torch.randn(T, B, 6, dtype=torch.float64)).shape == (T, B, 7)


def test_paper_lif_dynamics():
    """u[t] = 0.25 u[t-1] (1 - s[t-1]) + x[t], s = [u >= 0.25]."""
    block = FusedLinearBNNeuron(1, 1, bn=False, node=lif()).double()
    with torch.no_grad():
        block.synapse.weight.fill_(1.0)
        block.synapse.bias.zero_()
    x = torch.tensor([0.2, 0.2, 0.1, 0.3, 0.05], dtype=torch.float64).view(5, 1, 1)
    u, s_prev, expected = 0.0, 0.0, []
    for xt in x.flatten().tolist():
        u = 0.25 * u * (1 - s_prev) + xt
        s_prev = float(u >= 0.25)
        expected.append(s_prev)
    assert block(x).flatten().tolist() == expected == [0.0, 1.0, 0.0, 1.0, 0.0]


def test_bad_input_raises():
    conv = FusedConvBNNeuron(3, 4, 3, node=lif())
    with pytest.raises(SpikefuseError, match="rank 5"):
        conv(torch.randn(B, 3, 8, 8))
    with pytest.raises(SpikefuseError, match="T = 0"):
        conv(torch.randn(0, B, 3, 8, 8))
    with pytest.raises(SpikefuseError, match="floating point"):
        conv(torch.zeros(T, B, 3, 8, 8, dtype=torch.int64))
    with pytest.raises(SpikefuseError, match=r"\[T, B, F\]"):
        FusedLinearBNNeuron(3, 4, node=lif())(torch.randn(B, 3))
    with pytest.raises(SpikefuseError, match="more than 1 value"):
        FusedLinearBNNeuron(3, 4, node=lif())(torch.randn(1, 1, 3))
    with pytest.raises(SpikefuseError, match="BatchNorm2d"):
        FusedBlock(nn.Conv2d(3, 4, 3), nn.BatchNorm1d(4), lif())
    with pytest.raises(SpikefuseError, match="features"):
        FusedBlock(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(5), lif())
    with pytest.raises(SpikefuseError, match="one-state"):
        FusedBlock(nn.Linear(3, 4), None, neuron.IzhikevichNode(step_mode="m"))
    with pytest.raises(SpikefuseError, match="Conv1d, Conv2d or Linear"):
        FusedBlock(nn.ConvTranspose2d(3, 4, 3), None, lif())
    assert issubclass(SpikefuseError, ValueError)


def test_recipe_is_dropped_by_inplace_edit_and_follows_views():
    s = FusedLinearBNNeuron(3, 4, node=lif())(torch.randn(T, B, 3))
    recipe = recompute.recipe_of(s)
    assert recipe is not None and torch.equal(recipe(), s)
    flat = s.flatten(0, 1)  # a same-memory view uses its base's recipe
    assert torch.equal(recompute.recipe_of(flat)(), flat)
    assert recompute.recipe_of(s * 1) is None
    assert recompute.recipe_of(s[:, :2]) is None  # a view of part of the memory
    s.mul_(0.5)
    assert recompute.recipe_of(s) is None
    with torch.no_grad():  # nothing will be saved: no recipe, no reference to y
        assert (
            recompute.recipe_of(FusedLinearBNNeuron(3, 4, node=lif())(torch.randn(T, B, 3))) is None
        )


def test_recomputed_input_restores_a_strided_view():
    """A saved channels-last view of tagged memory comes back with the same strides."""
    x = torch.rand(2, 3, 4, 5).gt(0.5).float().contiguous(memory_format=torch.channels_last)
    calls = []

    def recipe() -> torch.Tensor:
        calls.append(1)
        return x.clone(memory_format=torch.preserve_format)

    recompute.mark_recomputable(x, recipe)
    w = torch.randn(6, 3, 3, 3, requires_grad=True)
    with recompute.saving_recomputed(x):
        out = F.conv2d(x, w, padding=1)
    upstream = torch.randn_like(out)
    out.backward(upstream)
    assert calls == [1]  # the input was recomputed, not kept
    (want,) = torch.autograd.grad(F.conv2d(x, w, padding=1), w, upstream)
    torch.testing.assert_close(w.grad, want)


def test_recompute_skips_small_inputs(monkeypatch):
    """In use, an input under RECOMPUTE_MIN_BYTES (a Linear block's spikes) is saved as it is:
    no recipe runs and nothing is packed in backward; one that size or larger is recomputed."""
    monkeypatch.undo()  # the suite's recompute_any_size fixture
    calls = []

    def run(x: torch.Tensor) -> None:
        recompute.mark_recomputable(x, lambda: calls.append(1) or x.clone())
        w = torch.randn(6, x.shape[1], requires_grad=True)
        with recompute.saving_recomputed(x):
            out = F.linear(x, w)
        out.sum().backward()

    limit = recompute.RECOMPUTE_MIN_BYTES // 4  # float32 elements
    run(mark_spikes(torch.rand(limit // 64 - 1, 64).gt(0.5).float()))
    assert calls == []
    run(torch.rand(limit // 64, 64).gt(0.5).float())
    assert calls == [1]
    # tagged spikes without a recipe: packed at 1 bit per element only from the threshold on
    small, large = (mark_spikes(torch.zeros(rows, 64)) for rows in (limit // 64 - 1, limit // 64))
    assert isinstance(recompute.saving_recomputed(small), contextlib.nullcontext)
    assert not isinstance(recompute.saving_recomputed(large), contextlib.nullcontext)


# ---- what stays alive for backward ----------------------------------------------------------
def saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes of distinct tensors autograd keeps for backward, beyond parameters/buffers/input."""
    resident = [*model.parameters(), *model.buffers()]
    skip = {t.untyped_storage().data_ptr() for t in resident}
    skip.add(x.untyped_storage().data_ptr())
    storages: dict[int, int] = {}

    def count(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
        out = model(x)
    functional.reset_net(model)
    del out
    return sum(storages.values())


def test_saved_memory_per_block():
    """Fused: the conv outputs y (fp32) + mean and invstd per channel each (gamma and beta are the
    parameters themselves, stored anyway); spikes are recomputed.

    Unfused: conv1 saves nothing new (its input is the model input), BN1 saves y1, the neuron
    saves H1 (its initial state is the constant V_reset: nothing); conv2 saves the fp32 spikes
    s1; BN2 saves y2; the neuron H2.
    """
    t, b, c, h, w = 4, 8, 16, 8, 8
    model = nn.Sequential(*conv_bn_lif(3, c), *conv_bn_lif(c, c))
    x = torch.randn(t, b, 3, h, w)
    n = t * b * c * h * w  # elements of one conv output
    vectors = 2 * c * 4  # mean, invstd
    fused_bytes = saved_bytes(fuse(model), x)
    assert fused_bytes == 2 * (4 * n + vectors)
    unfused_bytes = saved_bytes(model, x)
    stats = 2 * 4 * c  # BN's saved mean and invstd
    assert unfused_bytes == 2 * (4 * n + stats + 4 * n) + 4 * n
    assert fused_bytes / unfused_bytes < 0.42


def test_input_repeated_over_time_keeps_one_step_of_the_first_synapse_output():
    """images.expand(T, ...): the first block keeps its conv output of one step (B images), not
    T copies; the conv keeps its input of one step too (x itself is the model's input)."""
    t, b, c, h, w = 4, 8, 16, 8, 8
    model = fuse(nn.Sequential(*conv_bn_lif(3, c), *conv_bn_lif(c, c)))
    images = torch.randn(b, 3, h, w)
    dense = saved_bytes(model, images.expand(t, -1, -1, -1, -1).contiguous())
    repeated = saved_bytes(model, images.expand(t, -1, -1, -1, -1))
    assert dense - repeated == (t - 1) * b * c * h * w * 4  # one conv output step less, T-1 times


@pytest.mark.parametrize("fold_pools", [False, True])
def test_no_spike_map_outlives_the_forward(fold_pools):
    """Nothing (saved tensors, recipes, tags, hooks) keeps a fused block's spikes or pooled maps
    alive after the next layer consumed them: only synapse outputs stay for backward. (The
    last block's spikes feed a plain nn.Linear, which fuse() hooks to save them as their
    recipe too.) With ``fold_pools`` the pooling is part of the first block: one map fewer."""
    model = fuse(conv_stack(torch.float32), fold_pools=fold_pools)
    maps = []
    for m in model:
        if isinstance(m, (FusedBlock, SpikePool)):
            m.register_forward_hook(lambda mod, args, out: maps.append(weakref.ref(out)))
    out = model(torch.randn(T, B, 3, 8, 8))
    gc.collect()
    assert len(maps) == (4 if fold_pools else 5)
    assert all(r() is None for r in maps)
    out.sum().backward()  # and backward recomputes them


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize(("size", "window"), [((8, 8), (2, 2)), ((7, 9), (2, 3)), ((5, 6), (3, 2))])
def test_window_avg_pool_matches_avg_pool2d(layout, size, window):
    x = torch.randn(3, 4, *size, dtype=torch.float64).contiguous(memory_format=layout)
    x.requires_grad_()
    out = WindowAvgPool.apply(x, *window)
    want = F.avg_pool2d(x, window)
    torch.testing.assert_close(out, want, **FP64_TOL)
    upstream = torch.randn_like(want)
    (grad,) = torch.autograd.grad(out, x, upstream)
    (grad_want,) = torch.autograd.grad(want, x, upstream)
    torch.testing.assert_close(grad, grad_want, **FP64_TOL)
    assert grad.stride() == x.stride() and out.is_contiguous(memory_format=layout)


@pytest.mark.parametrize("fold_pools", [False, True])
def test_saved_memory_with_pooling(fold_pools):
    """Pooled fused spikes are recomputed (spikes, then the pooling) wherever they are saved,
    whether the pooling is a SpikePool or folded into the block (``fold_pools``).

    Conv-BN-LIF, AvgPool, Conv-BN-LIF, AvgPool, Flatten, Linear-BN-LIF: the saved state is the
    three synapse outputs and their per-channel vectors. (The flatten of the last pooled map
    is a view here; on CUDA channels-last maps it is a copy, saved by the Linear as it is.)
    """
    t, b, c, f = 2, 4, 8, 6
    model = nn.Sequential(
        *conv_bn_lif(3, c),
        layer.AvgPool2d(2, step_mode="m"),
        *conv_bn_lif(c, c),
        layer.SeqToANNContainer(nn.AvgPool2d(2)),
        layer.Flatten(step_mode="m"),
        *linear_bn_lif(c * 4, f),
    )
    x = torch.randn(t, b, 3, 8, 8)
    n1, n2, n3 = t * b * c * 64, t * b * c * 16, t * b * f
    vectors = 2 * 4 * (c + c + f)  # mean and invstd per channel
    fused = fuse(model, fold_pools=fold_pools)
    assert sum(isinstance(m, SpikePool) for m in fused.modules()) == (0 if fold_pools else 2)
    assert sum(m.pool is not None for m in fused.modules() if isinstance(m, FusedBlock)) == (
        2 if fold_pools else 0
    )
    assert saved_bytes(fused, x) == 4 * (n1 + n2 + n3) + vectors


def test_bf16_autocast_keeps_bf16_output_and_halves_saved_y():
    torch.manual_seed(0)
    block = FusedConvBNNeuron(3, 8, 3, padding=1, node=lif())
    x = torch.randn(T, B, 3, 8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        s = block(x)
        saved = saved_bytes(block, x)
    assert s.dtype == torch.bfloat16
    assert set(s.unique().tolist()) <= {0.0, 1.0}
    y_bf16, vectors = 2 * T * B * 8 * 8 * 8, 2 * 8 * 4  # mean, invstd
    autocast_copies = 2 * x.numel() + 2 * block.synapse.weight.numel()  # the conv's bf16 operands
    assert saved == y_bf16 + vectors + autocast_copies
    s32 = block(x)
    assert abs(s.float().mean() - s32.mean()) < 0.05  # bf16 conv rounding flips few spikes
    x.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        s = block(x)
    s.float().sum().backward()
    grads = [x.grad, block.synapse.weight.grad, block.bn.weight.grad, block.bn.bias.grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert block.synapse.weight.grad.dtype == torch.float32


def test_bf16_parameters():
    block = FusedConvBNNeuron(3, 8, 3, padding=1, node=lif()).bfloat16()
    x = torch.randn(T, B, 3, 8, 8, dtype=torch.bfloat16, requires_grad=True)
    s = block(x)
    assert s.dtype == torch.bfloat16
    s.float().sum().backward()
    for t in (x, block.synapse.weight, block.bn.weight, block.bn.bias):
        assert t.grad.dtype == torch.bfloat16 and torch.isfinite(t.grad.float()).all()


# ---- training follows the unfused loss curve --------------------------------------------------
def digits_model() -> nn.Sequential:
    torch.manual_seed(1)
    return nn.Sequential(
        *conv_bn_lif(1, 16),
        layer.AvgPool2d(2, step_mode="m"),
        *conv_bn_lif(16, 32),
        layer.AvgPool2d(2, step_mode="m"),
        layer.Flatten(step_mode="m"),
        *linear_bn_lif(32 * 4, 64),
        layer.Linear(64, 10, step_mode="m"),
    )


def train_digits(model: nn.Module, steps: int, t: int = 4, batch: int = 64) -> torch.Tensor:
    digits = load_digits()
    images = torch.tensor(digits.data, dtype=torch.float32).view(-1, 1, 8, 8) / 16
    labels = torch.tensor(digits.target)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, len(images), (batch,), generator=gen)
        rate = model(images[idx].expand(t, -1, -1, -1, -1)).mean(0)
        loss = F.cross_entropy(rate, labels[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        functional.reset_net(model)
        losses.append(loss.item())
    return torch.tensor(losses)


def test_digits_training_follows_unfused_loss_curve():
    steps, window = 200, 50
    ref = train_digits(digits_model(), steps)
    fused = train_digits(fuse(digits_model()), steps)
    # Identical until float rounding first flips a spike (here after about 15 steps; when
    # depends on the summation order of every op), then the same curve.
    torch.testing.assert_close(fused[:10], ref[:10], rtol=1e-4, atol=1e-5)
    ref_means = ref.view(-1, window).mean(1)
    fused_means = fused.view(-1, window).mean(1)
    assert (ref_means - fused_means).abs().max() < 0.05, (ref_means, fused_means)
    assert ref_means[-1] < 0.2 and fused_means[-1] < 0.2


# ---- the end-to-end benchmark (CPU smoke test) -----------------------------------------------
def test_vanilla_baseline_computes_the_same_network():
    """The benchmark's plain-PyTorch LIF network equals the spikefuse one with equal weights."""
    torch.manual_seed(0)
    vanilla = networks.vanilla_model("small").double()
    # with the vanilla network's surrogate: the paper's rectangle
    ours = networks.spikefuse_model(
        "small", backend="torch", make_surrogate=surrogate.Rect
    ).double()
    randomize_bn(vanilla)
    with torch.no_grad():
        for p_ours, p_vanilla in zip(ours.parameters(), vanilla.parameters(), strict=True):
            p_ours.copy_(p_vanilla)
    x = torch.rand(2, 2, 3, 32, 32, dtype=torch.float64) * 4
    assert_same_training_step(vanilla, ours, x, FP64_TOL)


@pytest.mark.parametrize("model", ["small", "resnet19"])
def test_ann_floor_is_the_vanilla_network_with_relu_for_its_neurons(model):
    """bench e2e's "ann" row (eager PyTorch's host floor for the network's layers): the
    vanilla network's layers and parameters, a ReLU wherever vanilla has its LIF; it trains."""
    cpu = torch.device("cpu")
    ann, vanilla = (e2e.build(v, model, cpu) for v in ("ann", "vanilla"))
    assert [p.shape for p in ann.parameters()] == [p.shape for p in vanilla.parameters()]
    relus = sum(isinstance(m, nn.ReLU) for m in ann.modules())
    assert relus == sum(isinstance(m, networks.VanillaLIF) for m in vanilla.modules()) > 0
    assert not any(isinstance(m, networks.VanillaLIF) for m in ann.modules())
    if model == "small":
        e2e.training_step(ann, cpu, T=2, batch=2, amp=None)()


@pytest.mark.parametrize("variant", e2e.variants())
def test_every_e2e_bench_variant_builds(variant):
    """Every listed variant builds a model (a listed one that build() rejects fails here);
    the SpikingJelly peer where SpikingJelly is installed, else an error saying how."""
    if variant == "spikingjelly" and importlib.util.find_spec("spikingjelly") is None:
        with pytest.raises(RuntimeError, match="pip install spikingjelly==2.0.0"):
            e2e.build(variant, "small", torch.device("cpu"))
        return
    assert isinstance(e2e.build(variant, "small", torch.device("cpu")), nn.Module)


def test_e2e_bench_smoke(tmp_path, monkeypatch, capsys):
    real_build = e2e.build

    def build(variant, model, device, T=None):
        if variant == "spikefuse":
            raise RuntimeError("simulated failure")
        return real_build(variant, model, device, T)

    monkeypatch.setattr(e2e, "build", build)
    argv = [
        *("--model", "small", "--device", "cpu", "--T", "2", "--batch", "2", "--iters", "1"),
        *("--warmup", "0", "--variants", "vanilla", "spikefuse", "fused", "--dtypes", "fp32"),
        *("--out", str(tmp_path)),
    ]
    assert cli.main(["bench", "e2e", *argv]) == 0  # the shipped subcommand
    out = capsys.readouterr().out
    assert "FAILED: RuntimeError: simulated failure" in out
    rows = list(csv.DictReader((tmp_path / "e2e_small.csv").open()))
    assert [(r["variant"], r["error"] == "") for r in rows] == [
        ("vanilla", True),
        ("spikefuse", False),
        ("fused", True),
    ]
    assert float(rows[2]["ms"]) > 0
    assert (tmp_path / "e2e_small.png").stat().st_size > 0


def test_chunked_forward_refuses_fused_blocks():
    """Review: chunking restarted fused neurons at every chunk (a silently different result)."""
    model = fuse(nn.Sequential(layer.Linear(3, 4, step_mode="m"), lif()))
    x = torch.rand(6, 2, 3)
    with pytest.raises(SpikefuseError, match="restart at every chunk"):
        functional.chunk_multi_step_forward(3, x, model)
    assert torch.equal(functional.chunk_multi_step_forward(6, x, model), model(x))


def test_a_surrogate_changed_to_torch_code_after_building_is_a_clear_error():
    """The block checks its neuron at construction; a torch-code surrogate set later used to
    fail deep in the reference backend ('NoneType' has no attribute 'torch_functions')."""
    block = FusedLinearBNNeuron(4, 3, node=lif())
    block.node.surrogate_function = surrogate.Sigmoid(spiking=False)
    with pytest.raises(SpikefuseError, match="LIFNode runs torch code"):
        block(torch.randn(T, B, 4))
    assert block.bn.num_batches_tracked.item() == 0  # refused before BatchNorm counted the batch


class _ConvBatchSizes(torch.overrides.TorchFunctionMode):
    """Records the batch size of every 2-D convolution's input."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.conv2d, F.conv2d):
            self.batches.append(args[0].shape[0])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("memory", ["default", "min"])
def test_input_repeated_over_time_runs_the_first_synapse_once_per_sample(memory):
    """images.expand(T, ...) (stride 0 over T): the first block convolves the B images once and
    repeats the result; outputs, parameter gradients and BatchNorm statistics equal those of
    the same model on the materialised sequence."""
    ref = conv_stack(torch.float64)
    fused = fuse(copy.deepcopy(ref), memory=memory)
    images = torch.randn(B, 3, 8, 8, dtype=torch.float64) * 2
    static = images.unsqueeze(0).expand(T, -1, -1, -1, -1)
    outs = []
    for model, x in ((ref, static.contiguous()), (fused, static)):
        with _ConvBatchSizes() as convs:
            out = model(x)
            weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
            (out * weights).sum().backward()
        functional.reset_net(model)
        outs.append((out.detach(), convs.batches))
    torch.testing.assert_close(outs[1][0], outs[0][0], **FP64_TOL)
    assert outs[0][1][0] == T * B and outs[1][1][0] == B  # the first convolution's batch
    for (name, p_r), p_f in zip(ref.named_parameters(), fused.parameters(), strict=True):
        torch.testing.assert_close(
            p_f.grad, p_r.grad, **FP64_TOL, msg=lambda m, n=name: f"{n}: {m}"
        )
    for b_r, b_f in zip(ref.buffers(), fused.buffers(), strict=True):
        torch.testing.assert_close(b_f, b_r, **FP64_TOL)


def test_input_repeated_over_time_that_needs_a_gradient_runs_every_step():
    """A stride-0 input that needs a gradient runs on all T*B samples (a gradient of the view
    itself keeps its steps apart)."""
    fused = fuse(conv_stack(torch.float64))
    base = torch.randn(1, B, 3, 8, 8, dtype=torch.float64, requires_grad=True)
    with _ConvBatchSizes() as convs:
        fused(base.expand(T, -1, -1, -1, -1))
    assert convs.batches[0] == T * B


def test_optimizer_state_is_laid_out_like_its_parameters():
    """match_optimizer_state: momentum saved for a contiguous weight, loaded for a channels-last
    one (a fused Conv2d on CUDA), is copied into the parameter's layout, values unchanged."""
    conv = nn.Conv2d(3, 8, 3)
    optimizer = torch.optim.SGD(conv.parameters(), lr=0.1, momentum=0.9)
    conv(torch.randn(2, 3, 5, 5)).sum().backward()
    optimizer.step()
    saved = copy.deepcopy(optimizer.state_dict())
    conv.weight.data = conv.weight.data.contiguous(memory_format=torch.channels_last)
    optimizer.load_state_dict(saved)
    momentum = optimizer.state[conv.weight]["momentum_buffer"]
    assert momentum.stride() != conv.weight.stride()
    assert match_optimizer_state(optimizer) == 1  # the bias's is 1-D: nothing to lay out
    moved = optimizer.state[conv.weight]["momentum_buffer"]
    assert moved.stride() == conv.weight.stride() and torch.equal(moved, momentum)
    assert match_optimizer_state(optimizer) == 0


def test_linear_blocks_without_batchnorm_take_tokens():
    """[T, B, N, F] (a spiking MLP or transformer's tokens): the Linear and the neuron act on
    each token alike, as unfused; with BatchNorm1d (which would normalise N) it is refused."""
    torch.manual_seed(0)
    node = lambda: neuron.LIFNode(v_threshold=0.3, step_mode="m", backend="torch")  # noqa: E731
    net = nn.Sequential(layer.Linear(8, 8), node(), layer.Linear(8, 6), node()).double()
    functional.set_step_mode(net, "m")
    fused = fuse(net)
    assert sum(isinstance(m, FusedBlock) for m in fused.modules()) == 2
    x = torch.rand(4, 2, 5, 8, dtype=torch.float64)
    outs, grads = [], []
    for model in (net, fused):
        xi = x.clone().requires_grad_()
        out = model(xi)
        weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
        grads.append(torch.autograd.grad((out * weights).sum(), [xi, *model.parameters()]))
        outs.append(out)
        functional.reset_net(model)
    assert outs[1].shape == (4, 2, 5, 6) and 0 < outs[0].mean() < 1
    assert torch.equal(outs[1], outs[0])
    for got, want in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, want)
    with_bn = nn.Sequential(layer.Linear(8, 6), layer.BatchNorm1d(6), node())
    functional.set_step_mode(with_bn, "m")
    with_bn = fuse(with_bn)
    assert isinstance(with_bn[0], FusedBlock)
    with pytest.raises(SpikefuseError, match=r"BatchNorm1d takes \[T, B, F\] only"):
        with_bn(x.float())


def test_a_block_pickled_without_its_spec_unpickles():
    """A block pickled before the spec and memory policies existed (its state then held
    ``_kind``, ``_window``, ``memory`` and ``memory_choice``) unpickles and runs."""
    import pickle

    block = FusedConvBNNeuron(3, 4, 3, padding=1, node=lif())
    state = dict(block.__dict__)
    for new in ("spec", "_synapse_op", "_memory", "_policy"):
        state.pop(new)
    state.update(_kind=nn.Conv2d, _window=1, memory="min", memory_choice="min")
    old = FusedBlock.__new__(FusedBlock)
    old.__setstate__(state)
    again = pickle.loads(pickle.dumps(old))
    assert again.spec.kind is nn.Conv2d and again.memory == "min" and "_kind" not in vars(again)
    x = torch.rand(T, B, 3, 6, 6)
    torch.testing.assert_close(again(x), block(x))


def test_a_block_pickled_without_an_input_pool_unpickles():
    """A block pickled before blocks could pool their neuron's input (no ``input_pool``
    submodule) unpickles, runs and reports its hooks as before."""
    import pickle

    block = FusedConvBNNeuron(3, 4, 3, padding=1, node=lif())
    state = dict(block.__dict__)
    state["_modules"] = {k: v for k, v in state["_modules"].items() if k != "input_pool"}
    old = FusedBlock.__new__(FusedBlock)
    old.__setstate__(state)
    again = pickle.loads(pickle.dumps(old))
    assert again.input_pool is None
    x = torch.rand(T, B, 3, 6, 6)
    torch.testing.assert_close(again(x), block(x))


def test_fused_blocks_reach_kernels_through_backend_capabilities():
    """The packing, statistics and split-matmul kernels come from the backend contract: none on
    the CPU (torch ops run), an unknown capability refused; no fused module imports the cuda
    package."""
    import pathlib
    import re

    from spikefuse import backends

    cpu = torch.zeros(4)
    for name in backends.CAPABILITIES:
        assert backends.capability(name, cpu) is None
    with pytest.raises(SpikefuseError, match="unknown capability"):
        backends.capability("bogus", cpu)
    assert backends.packed_bytes(33) == 5 * backends.packed_words(33) == 10
    fused_dir = pathlib.Path(backends.__file__).parent / "fused"
    cuda_import = re.compile(r"from \.+cuda\b|spikefuse\.cuda import|import spikefuse\.cuda")
    for path in fused_dir.rglob("*.py"):
        assert cuda_import.search(path.read_text()) is None, path
