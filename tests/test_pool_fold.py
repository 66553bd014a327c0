"""2 x 2 average pooling folded into fused Conv2d blocks: what fuse() folds and reports, the
block's torch path (CPU) against the unfused model in float64 for both memory modes, state
dicts, NIR export, and the pooled kernels' generated source and launch geometry (run on the GPU
by tests/gpu/test_pool_fold_gpu.py)."""

from __future__ import annotations

import copy
import re
import struct

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from spikefuse import functional, fuse, layer, neuron
from spikefuse.cuda import affine_plan
from spikefuse.cuda.definition_kernel import DefinitionKernel
from spikefuse.errors import SpikefuseError
from spikefuse.fused import FusedBlock, SpikePool, WindowAvgPool, paper_lif, paths
from spikefuse.fused.convert import FusedAttributeError
from spikefuse.fused.neuron_call import NeuronCall
from spikefuse.fused.recompute import is_spikes
from spikefuse.ops import run_neuron
from test_fuse_anywhere import assert_equivalent, randomized, training_step

T, B = 3, 2
FP64_TOL = dict(rtol=1e-9, atol=1e-11)


def lif() -> neuron.LIFNode:
    return neuron.LIFNode(tau=2.0, v_threshold=0.6, step_mode="m", backend="torch")


def conv_bn_lif(c_in: int, c_out: int) -> list[nn.Module]:
    return [
        layer.Conv2d(c_in, c_out, 3, padding=1, bias=False, step_mode="m"),
        layer.BatchNorm2d(c_out, step_mode="m"),
        lif(),
    ]


def pooled_net(pool_a: nn.Module | None = None, pool_b: nn.Module | None = None) -> nn.Sequential:
    """Conv-BN-LIF, pool, Conv-BN-LIF, pool, Flatten, Linear: both pools fold by default (the
    second inside a SeqToANNContainer)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        *conv_bn_lif(3, 4),
        pool_a if pool_a is not None else layer.AvgPool2d(2, step_mode="m"),
        *conv_bn_lif(4, 6),
        pool_b if pool_b is not None else layer.SeqToANNContainer(nn.AvgPool2d(2)),
        layer.Flatten(step_mode="m"),
        layer.Linear(6 * 2 * 2, 5, step_mode="m"),
    )
    return randomized(model)


def net_input(size: int = 8) -> torch.Tensor:
    return (
        torch.rand(
            T, B, 3, size, size, dtype=torch.float64, generator=torch.Generator().manual_seed(2)
        )
        * 2
    )


# ---- fuse(): what folds, and the report -------------------------------------------------------
@pytest.mark.parametrize("memory", ["default", "min"])
def test_folded_pools_give_the_unfused_results(memory):
    """Both pools fold (layer.AvgPool2d and SeqToANNContainer(nn.AvgPool2d)); forward, every
    gradient and the running statistics equal the unfused model's in float64."""
    model = pooled_net()
    fused, report = fuse(model, return_report=True, memory=memory)
    assert report.folded_pools == ["3", "7"]
    assert [c.pool for c in report.fused] == ["3", "7"] and report.pools == []
    assert "fused: 0 -> 1 -> 2, pooling 3 folded in" in str(report)
    blocks = [m for m in fused.modules() if isinstance(m, FusedBlock)]
    assert [type(b.pool) for b in blocks] == [layer.AvgPool2d, nn.AvgPool2d]
    assert not any(isinstance(m, SpikePool) for m in fused.modules())
    assert 0 < copy.deepcopy(model)(net_input()).abs().sum()  # what follows compares non-zeros
    assert_equivalent(model, fused, net_input())


def test_fold_pools_false_keeps_spike_pools():
    model = pooled_net()
    fused, report = fuse(model, return_report=True, fold_pools=False)
    assert report.folded_pools == [] and report.pools == ["3", "7"]
    assert report.unfolded_pools == {}
    assert sum(isinstance(m, SpikePool) for m in fused.modules()) == 2
    assert_equivalent(model, fused, net_input())
    with pytest.raises(TypeError, match="fold_pools must be a bool"):
        fuse(model, fold_pools=1)


@pytest.mark.parametrize(
    ("pool", "reason"),
    [
        (layer.MaxPool2d(2, step_mode="m"), "MaxPool2d is not an AvgPool2d"),
        (layer.AvgPool2d(3, step_mode="m"), "windows are 3x3; only 2x2 windows fold"),
        (layer.AvgPool2d(2, stride=1, step_mode="m"), "kernel differs from its stride"),
        (layer.AvgPool2d(2, padding=1, step_mode="m"), "pads"),
        (layer.AvgPool2d(2, ceil_mode=True, step_mode="m"), "ceil_mode"),
        (layer.AvgPool2d(2, divisor_override=3, step_mode="m"), "divisor_override"),
        (layer.AvgPool2d((2, 1), step_mode="m"), "windows are 2x1"),
    ],
)
def test_pools_that_do_not_fold_say_why(pool, reason):
    """A pooling after a chain that cannot fold stays a SpikePool; the report says why."""
    model = pooled_net(pool_a=pool)
    fused, report = fuse(model, return_report=True)
    assert report.folded_pools == ["7"] and report.pools == ["3"]
    assert reason in report.unfolded_pools["3"]
    assert f"pooling not folded: 3: {report.unfolded_pools['3']}" in str(report)


def test_a_pool_called_twice_does_not_fold():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Sequential(*conv_bn_lif(3, 4))
            self.b = nn.Sequential(*conv_bn_lif(4, 4))
            self.pool = layer.AvgPool2d(2, step_mode="m")

        def forward(self, x):
            return self.pool(self.b(self.pool(self.a(x))))

    model = Net().double()
    fused, report = fuse(model, return_report=True)
    assert len(report.fused) == 2 and report.folded_pools == []
    assert "called 2 times" in report.unfolded_pools["pool"]
    assert isinstance(fused.pool, SpikePool)
    torch.testing.assert_close(fused(net_input()), model(net_input()), **FP64_TOL)


def test_pool_with_another_user_does_not_fold():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(*conv_bn_lif(3, 4))
            self.pool = layer.AvgPool2d(2, step_mode="m")

        def forward(self, x):
            s = self.body(x)
            return self.pool(s).sum() + s.sum()

    fused, report = fuse(Net().double(), return_report=True)
    assert len(report.fused) == 1 and report.folded_pools == [] and report.pools == ["pool"]


def test_state_dicts_load_both_ways_and_the_pool_is_fused_away():
    model = pooled_net()
    fused = fuse(model)
    assert fused.state_dict().keys() == model.state_dict().keys()
    fused.load_state_dict(model.state_dict(), strict=True)
    fresh = pooled_net()
    fresh.load_state_dict(fused.state_dict(), strict=True)
    with pytest.raises(
        FusedAttributeError, match=r"'3' was fused into the FusedBlock at '0'.*'0.pool'"
    ):
        _ = fused[3].kernel_size


# ---- the block ---------------------------------------------------------------------------------
def test_pooled_block_output_is_not_tagged_as_spikes():
    """memory="min" packs a block's input at 1 bit where it is binary spikes: a pooled map (0,
    0.25, ...) must not be tagged as such."""
    block = FusedBlock(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), lif(), pool=nn.AvgPool2d(2)
    ).double()
    out = block(net_input())
    assert out.shape == (T, B, 4, 4, 4) and not is_spikes(out)
    assert set(out.unique().tolist()) <= {0.0, 0.25, 0.5, 0.75, 1.0}
    assert is_spikes(FusedBlock(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), lif()).double()(net_input()))


def test_odd_maps_pool_like_avg_pool2d():
    """H or W not a multiple of 2: the block pools its full spikes with torch ops, dropping the
    last row/column as AvgPool2d does (the kernels never see such maps)."""
    torch.manual_seed(0)
    conv, bn, node, pool = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), lif(), nn.AvgPool2d(2)
    block = FusedBlock(conv, bn, node, pool=pool).double()
    ref = nn.Sequential(
        layer.SeqToANNContainer(conv, bn), node, layer.SeqToANNContainer(pool)
    ).double()
    x = torch.rand(T, B, 3, 7, 6, dtype=torch.float64) * 2
    out_f, gx_f, _ = training_step(block, x)
    out_r, gx_r, _ = training_step(ref, x)
    torch.testing.assert_close(out_f, out_r, **FP64_TOL)
    torch.testing.assert_close(gx_f, gx_r, **FP64_TOL)
    assert out_f.shape == (T, B, 4, 3, 3)


def test_traced_forward_pools_after_the_neuron():
    """What torch.compile traces pools the spikes as the eager block does (the BN-neuron op
    pools them; on the CPU it pools the full spikes itself)."""
    block = (
        FusedBlock(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), lif(), pool=nn.AvgPool2d(2))
        .double()
        .eval()
    )
    x = net_input()
    torch.testing.assert_close(
        paths.traced_path(block, x, None, paths.TRACED_PLAN), block(x), **FP64_TOL
    )


@pytest.mark.parametrize(
    ("synapse", "pool", "match"),
    [
        (nn.Conv2d(3, 4, 1), nn.MaxPool2d(2), "MaxPool2d is not an AvgPool2d"),
        (nn.Conv2d(3, 4, 1), nn.AvgPool2d(4), "only 2x2 windows fold"),
        (nn.Linear(3, 4), nn.AvgPool2d(2), "only Conv2d blocks pool"),
    ],
)
def test_block_refuses_pools_it_cannot_fold(synapse, pool, match):
    with pytest.raises(SpikefuseError, match=match):
        FusedBlock(synapse, None, lif(), pool=pool)


def test_window_avg_pool_is_what_torch_path_blocks_use():
    """The torch path's pooling (WindowAvgPool) equals the kernels' contract: the window mean of
    the full spikes, channels-last in, channels-last out."""
    spikes = (torch.rand(6, 4, 6, 8) > 0.5).float().contiguous(memory_format=torch.channels_last)
    pooled = WindowAvgPool.apply(spikes, 2, 2)
    assert pooled.is_contiguous(memory_format=torch.channels_last)
    want = spikes.unflatten(3, (4, 2)).unflatten(2, (3, 2)).sum((3, 5)) * 0.25
    assert torch.equal(pooled, want)


# ---- NIR ---------------------------------------------------------------------------------------
def test_pooled_block_exports_pooling_after_the_neuron():
    nir_mod = pytest.importorskip("nir")  # noqa: F841
    from spikefuse.interop.nir import export_nir, import_nir

    node = lambda: neuron.LIFNode(tau=2.0, v_threshold=0.3, step_mode="m")  # noqa: E731
    model = (
        nn.Sequential(
            layer.Conv2d(1, 4, 3, padding=1, bias=False, step_mode="m"),
            layer.BatchNorm2d(4, step_mode="m"),
            node(),
            layer.AvgPool2d(2, step_mode="m"),
            layer.Flatten(step_mode="m"),
            layer.Linear(64, 5, step_mode="m"),
        )
        .double()
        .eval()
    )
    fused, report = fuse(model, return_report=True)
    assert report.folded_pools == ["3"]
    graph = export_nir(fused, (1, 8, 8), dt=1.0)
    assert list(graph.nodes)[1:4] == ["0", "0.node", "0.pool"]
    kinds = [type(n).__name__ for n in graph.nodes.values()]
    assert kinds[1:5] == ["Conv2d", "LIF", "AvgPool2d", "Flatten"]
    assert ("0.node", "0.pool") in graph.edges and ("0.pool", "4") in graph.edges
    x = torch.rand(4, 2, 1, 8, 8, dtype=torch.float64) * 2
    torch.testing.assert_close(import_nir(graph, dt=1.0)(x), model(x), **FP64_TOL)


# ---- the pooled kernels (generated source, arguments, launch geometry) -------------------------
def pooled_kernel(dtype=torch.float32) -> DefinitionKernel:
    return DefinitionKernel(paper_lif().program, dtype, 1, affine=True, pool=2)


def test_pooled_kernels_name_themselves_and_carry_the_map_width():
    kernel = pooled_kernel(torch.float16)
    code = kernel.full_codes
    assert "_affine_pool2_half_v1_fptt" in kernel.fptt_name
    assert "constexpr int POOL = 2;" in code and "index_t pool_width;" in code
    assert (
        "pool_width" not in DefinitionKernel(paper_lif().program, torch.float16, 1, True).prelude()
    )
    fields = re.findall(
        r"^    (?:index_t|float) (\w+(?:, \w+)*);",
        code.split("struct Args {")[1].split("};")[0],
        re.M,
    )
    names = [n for group in fields for n in group.split(", ")]
    assert names[:6] == ["T", "N", "channels", "inner", "channel_tiles", "pool_width"]
    pointers = {f.name: 1000 + i for i, f in enumerate(kernel.pointers)}
    constants = [0.5] * len(kernel.constant_names)
    packed = kernel.pack_args(pointers, 3, 64, 0.0, 0.0, constants, (4, 1), 0.25, pool_width=5)
    n_ptr = len(kernel.pointers)
    values = struct.unpack(f"<{n_ptr}Q6i", packed[: 8 * n_ptr + 4 * 6])
    assert values[n_ptr:] == (3, 64, 4, 1, 0, 5)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(vec=1, affine=False, pool=2), "pooled kernels take"),
        (dict(vec=4, affine=True, pool=2), "pooled kernels take"),
        (dict(vec=1, affine=True, pool=3), "pooled kernels take"),
    ],
)
def test_pooled_kernels_refuse_other_configurations(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DefinitionKernel(paper_lif().program, torch.float32, **kwargs)


def channels_last_map(t: int, b: int, c: int, h: int, w: int) -> torch.Tensor:
    return torch.zeros(t, b, h, w, c).permute(0, 1, 4, 2, 3)


def test_which_maps_the_pooled_kernels_take():
    assert affine_plan.can_pool(channels_last_map(2, 3, 5, 4, 6), 2)
    assert affine_plan.pooled_geometry(channels_last_map(2, 3, 5, 4, 6), 2) == (5, 3)
    assert affine_plan.can_pool(torch.zeros(2, 3, 1, 4, 4), 2)  # C = 1: both layouts are one
    assert not affine_plan.can_pool(torch.zeros(2, 3, 5, 4, 4), 2)  # channels-first
    assert not affine_plan.can_pool(channels_last_map(2, 3, 5, 5, 4), 2)  # odd H
    assert not affine_plan.can_pool(channels_last_map(2, 3, 5, 4, 7), 2)  # odd W
    assert not affine_plan.can_pool(channels_last_map(2, 3, 5, 6, 6), 3)  # only 2x2 kernels
    assert not affine_plan.can_pool(torch.zeros(2, 3, 5, 4), 2)
    with pytest.raises(ValueError, match="channels-last"):
        affine_plan.pooled_geometry(torch.zeros(2, 3, 5, 4, 4), 2)


def test_pooled_output_layout_matches_window_avg_pool():
    """The kernels' pooled map has WindowAvgPool's strides on a channels-last map (so a recipe
    recomputing either has the saved geometry) and is no view."""
    y = channels_last_map(2, 3, 5, 4, 6)
    out = affine_plan.pooled_empty(y, 2)
    want = WindowAvgPool.apply(y.flatten(0, 1), 2, 2).unflatten(0, (2, 3))
    assert out.shape == want.shape and out.stride() == want.stride() and out._base is None


# ---- the block's wiring to pooling kernels (stand-ins computing with torch ops) --------------
class PoolingKernels:
    """Stand-in BN-folded kernels (float64, any layout) that pool like the cuda ones: forward
    returns the pooled map, backward takes its gradient; records each call's pool and the shape
    of what it got. Composed of torch ops and autograd, so the block must give the torch
    path's results exactly when it wires them right."""

    def __init__(self, keeps: bool = False) -> None:
        self.calls: list[tuple[str, int, tuple[int, ...]]] = []
        self.keeps = keeps  # pass 1 keeps g for an element-wise pass 2 (the 16-bit kernels')

    def keeps_input_grad(self, y: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
        return self.keeps

    @staticmethod
    def can_pool(y: torch.Tensor, pool: int) -> bool:
        return pool == 2 and y.dim() == 5 and y.shape[3] % 2 == 0 and y.shape[4] % 2 == 0

    @staticmethod
    def _pooled_spikes(program, y, mean, invstd, weight, bias, constants, v_init, pool):
        view = lambda v: v.view(1, 1, -1, *([1] * (y.dim() - 3)))  # noqa: E731
        scale = invstd * weight
        x = y * view(scale) + view(bias - mean * scale)
        spikes = run_neuron(program, "torch", x, None, None, None, constants, [v_init, 0.0], False)
        out = spikes[0]
        if pool > 1:  # a new tensor, no view (as the kernels')
            out = F.avg_pool2d(out.flatten(0, 1), pool).unflatten(0, out.shape[:2]).clone()
        return x, out, view, scale

    def affine_fptt(self, program, y, mean, invstd, weight, bias, learnable, constants, v_init,
                    save_for_backward, pool=1, residual=None, pack_spikes=False):  # fmt: skip
        assert residual is None  # no residual blocks here
        self.calls.append(("fptt", pool, tuple(y.shape)))
        args = (program, y, mean, invstd, weight, bias, constants, v_init, pool)
        return self._pooled_spikes(*args)[1], None, None  # no packing: blocks recompute

    @staticmethod
    def laid_out_grad_spikes(program, y, grad_spikes, pool=1, residual=None):
        return grad_spikes  # torch ops read any layout

    def affine_bptt(self, program, y, grad_spikes, saved_v, learnable, constants, v_init, mean,
                    invstd, weight, bias, totals=None, inv_count=0.0, *, grad_y, pool=1,
                    residual=None, overwrite_y=False, keep_grad_input=False):  # fmt: skip
        assert residual is None and not (keep_grad_input and (grad_y or not self.keeps))
        self.calls.append(("bptt", pool, tuple(grad_spikes.shape)))
        with torch.enable_grad():
            leaf = y.detach().requires_grad_()
            args = (program, leaf, mean, invstd, weight, bias, constants, v_init, pool)
            x, out, view, scale = self._pooled_spikes(*args)
            (g,) = torch.autograd.grad(out, x, grad_spikes)
        if not grad_y:
            dims = [0, 1, 3, 4]
            sums = torch.stack([g.sum(dims), (g * (y - view(mean))).sum(dims)])
            return (g if keep_grad_input else None), sums, None
        grad = self.affine_input_grad(g, y, mean, invstd, weight, totals, inv_count)
        return (y.copy_(grad) if overwrite_y else grad), None, None

    def affine_input_grad(self, g, y, mean, invstd, weight, totals, inv_count, out=None):
        self.calls.append(("input_grad", 1, tuple(g.shape)))
        view = lambda v: v.view(1, 1, -1, *([1] * (y.dim() - 3)))  # noqa: E731
        scale = invstd * weight
        grad = g * view(scale)
        if totals is not None:
            mean_g, mean_gxhat = totals[0] * inv_count, totals[1] * invstd * inv_count
            coef_y = -scale * invstd * mean_gxhat
            grad = grad + y * view(coef_y) + view(-scale * mean_g - mean * coef_y)
        return grad if out is None else out.copy_(grad)


@pytest.mark.parametrize("keeps", [False, True], ids=["recomputing", "keeping-g"])
@pytest.mark.parametrize("memory", ["default", "min"])
def test_block_hands_the_pooling_to_kernels_that_can_pool(monkeypatch, memory, keeps):
    """Where the backend's BN-folded kernels can pool, the block asks them to (pool=2 in forward,
    both backward passes and, by default, the next block's recompute), passes them the pooled
    map's gradient and pools nothing itself; the results are the torch path's. memory="min"
    hands its recomputed y to pass 2 to overwrite with dL/dy. Kernels that keep g (16-bit
    storage) get pass 2 as one element-wise call on the full map's g in the default mode; the
    minimal mode, which overwrites y, keeps recomputing."""
    kernels = PoolingKernels(keeps)
    model = pooled_net()
    reference = fuse(model)
    folded = fuse(model, memory=memory)
    with monkeypatch.context() as patched:  # (undo() would also undo the suite's fixtures)
        patched.setattr(NeuronCall, "affine", property(lambda self: kernels))
        patched.setattr(WindowAvgPool, "apply", _refuse_window_avg_pool)
        out_f, gx_f, gp_f = training_step(folded, net_input())
    out_r, gx_r, gp_r = training_step(reference, net_input())
    torch.testing.assert_close(out_f, out_r, **FP64_TOL)
    torch.testing.assert_close(gx_f, gx_r, **FP64_TOL)
    for key in gp_r:
        torch.testing.assert_close(gp_f[key], gp_r[key], **FP64_TOL, msg=key)
    full_1, full_2 = (T, B, 4, 8, 8), (T, B, 6, 4, 4)
    pooled_1, pooled_2 = (T, B, 4, 4, 4), (T, B, 6, 2, 2)
    # the classifier's and the second conv's inputs, recomputed for their weight gradients
    # (memory="min" keeps the second conv's input, and the classifier its own)
    recomputed = [[("fptt", 2, full_2)], [("fptt", 2, full_1)]] if memory == "default" else [[], []]
    kept = keeps and memory == "default"
    # pass 2: a recompute (whose formula the stand-in shares), or the element-wise call alone
    pass_2 = [[("input_grad", 1, shape)] if kept else [("bptt", 2, pooled), ("input_grad", 1, shape)]
              for pooled, shape in ((pooled_2, full_2), (pooled_1, full_1))]  # fmt: skip
    assert kernels.calls == [
        ("fptt", 2, full_1),
        ("fptt", 2, full_2),
        *recomputed[0],
        ("bptt", 2, pooled_2),  # pass 1
        *pass_2[0],
        *recomputed[1],
        ("bptt", 2, pooled_1),
        *pass_2[1],
    ]


def _refuse_window_avg_pool(*_):
    raise AssertionError("the block pooled with torch ops although the kernels pool")


def test_a_pool_used_only_in_training_mode_does_not_fold():
    """fuse() traces training and eval mode: a pooling that only one of them applies is not
    folded (the chain still fuses) and the report says so."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.bn, self.sn = conv_bn_lif(3, 4)
            self.pool = layer.AvgPool2d(2, step_mode="m")

        def forward(self, x):
            s = self.sn(self.bn(self.conv(x)))
            return self.pool(s) if self.training else s

    model = Net().double()
    fused, report = fuse(model, return_report=True)
    assert len(report.fused) == 1 and report.folded_pools == [] and report.pools == ["pool"]
    assert "differently in training mode" in report.unfolded_pools["pool"]
    for training in (True, False):
        model.train(training)
        fused.train(training)
        torch.testing.assert_close(fused(net_input()), model(net_input()), **FP64_TOL)
        functional.reset_net(model)


def test_a_block_spec_records_its_parts_once():
    """BlockSpec: the synapse kind and input rank, BatchNorm, the folded pooling's kind and
    window (its output tagged as means of k² spikes), the residual; built once, validated."""
    from spikefuse.fused.spec import BlockSpec, PoolSpec

    conv = nn.Conv2d(3, 4, 3, padding=1)
    block = FusedBlock(conv, nn.BatchNorm2d(4), paper_lif(), pool=nn.AvgPool2d(2))
    assert block.spec == BlockSpec(nn.Conv2d, 5, True, PoolSpec("avg", 2), False)
    assert (block.spec.window, block.spec.pool.area, block.spec.pool.means_window) == (2, 4, 4)
    linear = FusedBlock(nn.Linear(3, 4), None, paper_lif(), residual=True)
    assert linear.spec == BlockSpec(nn.Linear, 3, False, None, True) and linear.spec.window == 1
    with pytest.raises(SpikefuseError, match="only 2x2 windows fold"):
        BlockSpec.of(conv, None, paper_lif(), nn.AvgPool2d(3), False)
