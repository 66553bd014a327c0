"""The fused Conv/Linear -> BatchNorm -> neuron blocks on the GPU: the channel-affine
(BatchNorm-folded) kernels against BatchNorm + the reference neuron, and fused models (both
memory modes) against the unfused modules."""

from __future__ import annotations

import itertools
from functools import partial

import pytest
import torch
from torch import nn

from conftest import TOLERANCE, assert_close, differ, gen, reldiff, seed_of
from spikefuse import backends, functional, fuse, layer, models, neuron, surrogate
from spikefuse.fused import FusedBlock, paper_lif
from spikefuse.fused.blocks import MEMORY_MODES

from .variants import AFFINE_CHUNK, CHUNK, DTYPES, ONE_STATE, Variant, params

pytestmark = pytest.mark.gpu

AFFINE_VARIANTS = [
    Variant(name, surrogate.Rect, dtype, hard, affine=True)
    for name, dtype, hard in itertools.product(ONE_STATE, DTYPES, (True, False))
]
# (T, the synapse output's shape [B, C, *S], synapse): channels-first with odd sizes and a
# partial chunk (a Conv1d), channels innermost (a Conv2d runs channels-last on CUDA),
# Linear-shaped at T = 1, and a larger map.
AFFINE_SHAPES = [
    (max(AFFINE_CHUNK.values()) + 5, (3, 5, 9), nn.Conv1d),
    (4, (2, 7, 6, 6), nn.Conv2d),
    (1, (5, 33), nn.Linear),
    (10, (4, 16, 8, 8), nn.Conv2d),
    # channels innermost in whole warps: backward pass 1 sums per block (a partial last row group)
    (3, (5, 64, 3, 3), nn.Conv2d),
    (max(AFFINE_CHUNK.values()) + 1, (3, 96), nn.Linear),
]

BATCH_STATS = pytest.mark.parametrize(
    "batch_stats", [True, False], ids=["batch-stats", "running-stats"]
)


def shape_cases(*cases: tuple) -> pytest.MarkDecorator:
    """``shape_case`` over these of :data:`AFFINE_SHAPES`, named T<T>-<shape>-<synapse>."""
    return pytest.mark.parametrize(
        "shape_case", cases, ids=lambda c: f"T{c[0]}-{'x'.join(map(str, c[1]))}-{c[2].__name__}"
    )


def identity_block(
    variant: Variant,
    synapse_kind: type[nn.Module],
    backend: str,
    channels: int,
    gamma: torch.Tensor,
    beta: torch.Tensor,
    batch_stats: bool,
) -> FusedBlock:
    """synapse -> BatchNorm -> neuron whose synapse is the identity in the variant's dtype, so
    that the kernels see the test's synapse output y exactly: BatchNorm with (gamma, beta),
    batch statistics or the running ones (mean 0, variance 1.5)."""
    eye = torch.eye(channels)
    if synapse_kind is nn.Linear:
        synapse, bn = nn.Linear(channels, channels, bias=False), nn.BatchNorm1d(channels)
        identity = eye
    elif synapse_kind is nn.Conv1d:  # not pointwise: it runs channels-first (see Synapse)
        synapse, bn = (
            nn.Conv1d(channels, channels, 3, padding=1, bias=False),
            nn.BatchNorm1d(channels),
        )
        identity = torch.stack((torch.zeros_like(eye), eye, torch.zeros_like(eye)), -1)
    else:
        synapse, bn = nn.Conv2d(channels, channels, 1, bias=False), nn.BatchNorm2d(channels)
        identity = eye.view(synapse.weight.shape)
    with torch.no_grad():
        synapse.weight.copy_(identity)
        bn.weight.copy_(gamma)
        bn.bias.copy_(beta)
        bn.running_var.fill_(1.5)
    synapse = synapse.to("cuda", variant.dtype)
    bn = bn.cuda().train(batch_stats)
    return FusedBlock(synapse, bn, variant.make(step_mode="m", backend=backend).cuda())


def run_affine(
    block: FusedBlock, y: torch.Tensor, upstream: torch.Tensor, *residual: torch.Tensor
) -> dict:
    """Spikes and the gradients of y, BatchNorm's weight and bias (and PLIF's tau)."""
    y = y.detach().clone().requires_grad_()
    spikes = block(y, *residual)
    (spikes.float() * upstream).sum().backward()
    res = {
        "spikes": spikes.detach(),
        "grad_y": y.grad,
        "grad_gamma": block.bn.weight.grad,
        "grad_beta": block.bn.bias.grad,
    }
    if isinstance(block.node, neuron.ParametricLIFNode):
        res["grad_w_param"] = block.node.w.grad.reshape(1)
    return res


@BATCH_STATS
@shape_cases(*AFFINE_SHAPES)
@pytest.mark.parametrize("variant", params(AFFINE_VARIANTS))
def test_affine_kernels_match_batchnorm_and_reference(
    variant, shape_case, batch_stats, monkeypatch, no_tf32
):
    """Both sides see the same synapse output y and BatchNorm statistics, so spikes must be
    identical in every dtype; gradients within the variant's tolerance."""
    T, shape, synapse_kind = shape_case
    g = gen(seed_of(variant.id, T, shape, batch_stats), device="cuda")
    y = (torch.randn((T, *shape), generator=g, device="cuda") * 0.8 + 0.3).to(variant.dtype)
    c = shape[1]
    gamma = torch.rand(c, generator=g, device="cuda") + 0.5
    beta = torch.rand(c, generator=g, device="cuda") * 0.6 - 0.2
    upstream = torch.randn((T, *shape), generator=g, device="cuda").to(variant.dtype).float()

    # the cuda side must take the BN-folded kernels, the reference BatchNorm + the neuron
    assert backends.affine_kernels("torch") is None
    affine = backends.affine_kernels("cuda")
    launched = []
    real_fptt = affine.affine_fptt
    monkeypatch.setattr(
        affine, "affine_fptt", lambda *a, **k: launched.append(1) or real_fptt(*a, **k)
    )
    results = {}
    for backend in ("cuda", "torch"):
        launched.clear()
        block = identity_block(variant, synapse_kind, backend, c, gamma, beta, batch_stats)
        results[backend] = run_affine(block, y, upstream)
        assert bool(launched) == (backend == "cuda"), f"{backend}: affine kernels launched"
    got, ref = results["cuda"], results["torch"]

    spikes = got["spikes"]
    if synapse_kind is nn.Conv2d:  # the spikes keep the convolution's channels-last layout
        assert spikes.flatten(0, 1).is_contiguous(memory_format=torch.channels_last)
    else:
        assert spikes.is_contiguous()
    assert differ(spikes, ref["spikes"]).sum().item() == 0, "spikes differ"
    for key, want in ref.items():
        if key == "grad_w_param":
            # PLIF's parameter gradient is one float32 sum, on both sides, over every neuron and
            # step, of terms of both signs; where they cancel to a small sum, its relative error
            # grows with the cancellation (T13-3x96-Linear: 0.0081, error 1.4e-4 to 2e-4 in
            # float32, where the gradients of y, gamma and beta stay within 1e-4)
            err = reldiff(got[key], want)
            assert err <= max(TOLERANCE[variant.dtype][1], 1e-3), f"{key}: error {err:.2e}"
        elif key != "spikes":
            assert_close(got[key], want, variant.dtype, grad=True, what=key)


REPEATED_VARIANTS = [
    Variant(name, surrogate.Sigmoid, dtype, True, affine=True)
    for name, dtype in itertools.product(("LIF", "PLIF"), (torch.float32, torch.bfloat16))
]


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@BATCH_STATS
@shape_cases(AFFINE_SHAPES[3], AFFINE_SHAPES[4], AFFINE_SHAPES[5])
@pytest.mark.parametrize("variant", params(REPEATED_VARIANTS))
def test_affine_kernels_on_a_synapse_output_repeated_over_time(
    variant, shape_case, batch_stats, residual, no_tf32
):
    """An input repeated over T as a view: the block reads its one-step synapse output at every
    step (x_step 0) and pass 2 sums dL/dy over T (a residual block's shortcut stays per step).
    Spikes equal those of the materialised sequence; the synapse weight's, gamma's, beta's (and
    tau's, the shortcut's) gradients and the running statistics agree within the dtype's
    gradient tolerance."""
    T, shape, synapse_kind = shape_case
    g = gen(seed_of(variant.id, T, shape, batch_stats, residual, "repeated"), device="cuda")
    c = shape[1]
    gamma = torch.rand(c, generator=g, device="cuda") + 0.5
    beta = torch.rand(c, generator=g, device="cuda") * 0.6 - 0.2
    image = (torch.randn(shape, generator=g, device="cuda") * 0.8 + 0.3).to(variant.dtype)
    shortcut = (torch.rand((T, *shape), generator=g, device="cuda") < 0.3).to(variant.dtype)
    upstream = torch.randn((T, *shape), generator=g, device="cuda")
    results = []
    for x in (image.expand(T, *shape), image.expand(T, *shape).contiguous()):
        block = identity_block(variant, synapse_kind, "cuda", c, gamma, beta, batch_stats)
        block.residual = residual
        r = shortcut.clone().requires_grad_()
        spikes = block(x, *((r,) if residual else ()))
        (spikes.float() * upstream).sum().backward()
        params_ = {n: p.grad for n, p in block.named_parameters()}
        stats = {"running_mean": block.bn.running_mean, "running_var": block.bn.running_var}
        results.append({"spikes": spikes.detach(), **params_, **stats})
        if residual:
            results[-1]["grad_r"] = r.grad
    got, want = results
    assert differ(got["spikes"], want["spikes"]).sum().item() == 0, "spikes differ"
    for key, ref in want.items():
        if key != "spikes":
            assert_close(got[key], ref, variant.dtype, grad=True, what=key)


@pytest.mark.parametrize("case", ["plain", "pooled", "residual", "repeated"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_pass_two_may_write_dl_dy_over_y(dtype, case):
    """``overwrite_y`` (memory="min"'s recomputed y): pass 2 writes dL/dy over y's memory and
    returns it, bit for bit what it writes to a new tensor; T past a checkpointed chunk."""
    from spikefuse.cuda import affine as kernels
    from spikefuse.fused.neuron_call import NeuronCall

    T, B, C, H, W = max(AFFINE_CHUNK.values()) + 1, 4, 64, 8, 8
    g = gen(seed_of("overwrite", dtype, case), device="cuda")
    steps = 1 if case == "repeated" else T
    y = torch.randn(steps * B, C, H, W, generator=g, device="cuda") * 0.8 + 0.3
    y = y.to(dtype).contiguous(memory_format=torch.channels_last).unflatten(0, (steps, B))
    y = y.expand(T, -1, -1, -1, -1) if case == "repeated" else y
    residual = (
        (torch.rand_like(y, dtype=torch.float32) < 0.3).to(dtype) if case == "residual" else None
    )
    pool = 2 if case == "pooled" else 1
    call = NeuronCall.from_node(paper_lif(backend="cuda"), y)
    mean = torch.randn(C, generator=g, device="cuda") * 0.1 + 0.3
    invstd = torch.rand(C, generator=g, device="cuda") + 0.5
    gamma = torch.rand(C, generator=g, device="cuda") + 0.5
    beta = torch.rand(C, generator=g, device="cuda") * 0.6 - 0.2
    bn = {"mean": mean, "invstd": invstd, "weight": gamma, "bias": beta}
    spikes, ckpt, _ = kernels.affine_fptt(
        call.program, y, **bn, learnable=None, constants=call.constants, v_init=call.v_init,
        save_for_backward=True, pool=pool, residual=residual,
    )  # fmt: skip
    assert ckpt is not None  # T past a chunk: checkpoints
    upstream = torch.randn(spikes.shape, generator=g, device="cuda").to(dtype)

    def bptt(y_, grad_y, totals=None, overwrite=False):
        return kernels.affine_bptt(
            call.program, y_, upstream, ckpt, None, call.constants, call.v_init, **bn,
            totals=totals, inv_count=1.0 / (T * B * H * W), grad_y=grad_y, pool=pool,
            residual=residual, overwrite_y=overwrite,
        )  # fmt: skip

    _, sums, _ = bptt(y, False)
    want, want_r, _ = bptt(y, True, sums)
    memory = y[:1].clone() if case == "repeated" else y.clone()
    y_copy = memory.expand(T, -1, -1, -1, -1) if case == "repeated" else memory
    got, got_r, _ = bptt(y_copy, True, sums, overwrite=True)
    assert got.data_ptr() == memory.data_ptr() and got.stride() == want.stride()
    assert torch.equal(got, want)
    if residual is not None:
        assert torch.equal(got_r, want_r)


RESIDUAL_VARIANTS = [
    Variant(name, surrogate.Rect, dtype, hard, affine=True)
    for name, dtype, hard in itertools.product(("LIF", "PLIF", "IF"), DTYPES, (True, False))
]


@BATCH_STATS
@shape_cases(AFFINE_SHAPES[0], AFFINE_SHAPES[1], AFFINE_SHAPES[4])
@pytest.mark.parametrize("variant", params(RESIDUAL_VARIANTS))
def test_residual_affine_kernels_match_batchnorm_and_reference(
    variant, shape_case, batch_stats, monkeypatch, no_tf32
):
    """neuron(BN(y) + R) in the residual BN-folded kernels against BatchNorm + R + the reference
    neuron: identical spikes; gradients of y, gamma, beta and R within the dtype's tolerance."""
    T, shape, synapse_kind = shape_case
    g = gen(seed_of(variant.id, T, shape, batch_stats, "residual"), device="cuda")
    y = (torch.randn((T, *shape), generator=g, device="cuda") * 0.8 + 0.3).to(variant.dtype)
    shortcut = (torch.rand((T, *shape), generator=g, device="cuda") < 0.3).to(variant.dtype)
    c = shape[1]
    gamma = torch.rand(c, generator=g, device="cuda") + 0.5
    beta = torch.rand(c, generator=g, device="cuda") * 0.6 - 0.4
    upstream = torch.randn((T, *shape), generator=g, device="cuda").to(variant.dtype).float()
    affine = backends.affine_kernels("cuda")
    residuals = []
    real_fptt = affine.affine_fptt
    monkeypatch.setattr(
        affine,
        "affine_fptt",
        lambda *a, **k: residuals.append(k.get("residual")) or real_fptt(*a, **k),
    )
    results = {}
    for backend in ("cuda", "torch"):
        residuals.clear()
        block = identity_block(variant, synapse_kind, backend, c, gamma, beta, batch_stats)
        block.residual = True
        r = shortcut.clone().requires_grad_()
        results[backend] = run_affine(block, y, upstream, r)
        results[backend]["grad_r"] = r.grad
        launched = bool(residuals) and all(t is not None for t in residuals)
        assert launched == (backend == "cuda"), f"{backend}: residual affine kernels launched"
    got, ref = results["cuda"], results["torch"]
    assert differ(got["spikes"], ref["spikes"]).sum().item() == 0, "spikes differ"
    for key, want in ref.items():
        if key != "spikes":
            assert_close(got[key], want, variant.dtype, grad=True, what=key)


# ---- fused models vs the unfused modules --------------------------------------------------------
def paper_net() -> nn.Sequential:
    """A small CNN of Conv/Linear -> BN -> the paper's LIF (cuda) blocks, channels-last."""
    torch.manual_seed(0)
    model = nn.Sequential(
        layer.Conv2d(3, 16, 3, padding=1, bias=False, step_mode="m"),
        layer.BatchNorm2d(16, step_mode="m"),
        paper_lif(backend="cuda"),
        layer.AvgPool2d(2, step_mode="m"),
        layer.Conv2d(16, 32, 3, padding=1, bias=False, step_mode="m"),
        layer.BatchNorm2d(32, step_mode="m"),
        paper_lif(backend="cuda"),
        layer.Flatten(step_mode="m"),
        layer.Linear(32 * 8 * 8, 64, bias=False, step_mode="m"),
        layer.BatchNorm1d(64, step_mode="m"),
        paper_lif(backend="cuda"),
        layer.Linear(64, 10, step_mode="m"),
    ).cuda()
    # The fused convolutions run channels-last: the reference too (its weights), so that both
    # get the same cuDNN algorithm.
    return model.to(memory_format=torch.channels_last)


def training_step(net: nn.Module, x: torch.Tensor, autocast: bool) -> dict:
    """Output, input gradient, parameter gradients (in module order: the fused blocks name them
    differently) and BatchNorm's running statistics after one step."""
    xs = x.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        out = net(xs).float()
    weights = torch.linspace(-1, 1, out.numel(), device="cuda").view_as(out)
    (out * weights).sum().backward()
    functional.reset_net(net)
    grads = {f"param{i}": p.grad.clone() for i, p in enumerate(net.parameters())}
    stats = {
        f"buffer{i}": b.clone() for i, b in enumerate(net.buffers()) if b.dtype.is_floating_point
    }
    net.zero_grad(set_to_none=True)
    return {"out": out.detach(), "grad_x": xs.grad, **grads, **stats}


@pytest.mark.quick
@pytest.mark.parametrize("memory", MEMORY_MODES)
@pytest.mark.parametrize(
    "T", [CHUNK // 2, max(AFFINE_CHUNK.values()) + 3]
)  # > every chunk: checkpoints
def test_fused_model_matches_unfused(T, memory, no_tf32, record_property):
    """fp32 within 1e-4 over the output, x's gradient, the parameter gradients and the running
    statistics; bf16 autocast against the fp32 unfused model is recorded, not checked (bf16
    flips spikes near the threshold)."""
    model = paper_net()
    fused = fuse(model, memory=memory)  # before any step changes BatchNorm
    x = torch.randn(T, 8, 3, 16, 16, device="cuda")
    want = training_step(model, x, False)
    got = training_step(fused, x, False)
    errors = {k: reldiff(got[k], w) for k, w in want.items()}
    worst = max(errors, key=errors.get)
    record_property("worst_fp32", errors[worst])
    assert errors[worst] < 1e-4, f"{worst}: normalised error {errors[worst]:.2e}"
    if memory == "default":
        got16 = training_step(fused, x, True)
        record_property("worst_bf16_autocast", max(reldiff(got16[k], w) for k, w in want.items()))


def fused_conv_weights(net: nn.Module) -> list[torch.Tensor]:
    blocks = [m for m in net.modules() if isinstance(m, FusedBlock)]
    return [b.synapse.weight for b in blocks if isinstance(b.synapse, nn.Conv2d)]


@pytest.mark.quick
def test_fused_conv_weights_are_kept_channels_last():
    """On CUDA a fused Conv2d's weight is kept channels-last, the layout the convolution runs
    in: fuse() of a CUDA model and .cuda() of a fused CPU model convert it (values unchanged),
    and its gradient comes in that layout (no copy kernels around the convolutions)."""
    cl = torch.channels_last
    model = paper_net().to(memory_format=torch.contiguous_format)
    values = [w.detach().clone() for w in fused_conv_weights(fuse(model.cpu()))]
    assert values and not values[0].is_contiguous(memory_format=cl)  # CPU: as it was
    for fused in (fuse(model.cuda()), fuse(model.cpu()).cuda()):
        weights = fused_conv_weights(fused)
        assert all(w.is_contiguous(memory_format=cl) for w in weights)
        assert all(torch.equal(w.cpu(), v) for w, v in zip(weights, values, strict=True))
        fused(torch.randn(4, 2, 3, 16, 16, device="cuda")).sum().backward()
        assert all(w.grad.is_contiguous(memory_format=cl) for w in weights)
    state = {k: v.contiguous() for k, v in fused.state_dict().items()}
    fused.load_state_dict(state, assign=True)  # replaces the parameters: laid out again
    assert all(w.is_contiguous(memory_format=cl) for w in fused_conv_weights(fused))


@pytest.mark.quick
@pytest.mark.parametrize("memory", MEMORY_MODES)
def test_fused_model_matches_unfused_on_an_input_repeated_over_time(memory, no_tf32):
    """images.expand(T, ...): both models convolve the images once (layer.Conv2d and the fused
    block alike) and agree in fp32 within 1e-4 (output, parameter gradients, statistics)."""
    model = paper_net()
    fused = fuse(model, memory=memory)
    images = torch.randn(8, 3, 16, 16, device="cuda")
    x = images.unsqueeze(0).expand(6, -1, -1, -1, -1)
    results = []
    for net in (model, fused):
        out = net(x).float()
        weights = torch.linspace(-1, 1, out.numel(), device="cuda").view_as(out)
        (out * weights).sum().backward()
        functional.reset_net(net)
        grads = [p.grad.clone() for p in net.parameters()]
        stats = [b.clone() for b in net.buffers() if b.dtype.is_floating_point]
        net.zero_grad(set_to_none=True)
        results.append([out.detach(), *grads, *stats])
    errors = [reldiff(got, want) for got, want in zip(results[1], results[0], strict=True)]
    assert max(errors) < 1e-4, f"normalised errors {errors}"


def residual_net(name: str) -> nn.Module:
    """A model-zoo residual network on the cuda backend with non-trivial BatchNorm affine
    parameters, channels-last like its fused convolutions (the same cuDNN algorithms)."""
    torch.manual_seed(0)
    make = {
        "spiking_resnet19": models.spiking_resnet19,
        "sew_resnet18": partial(models.sew_resnet18, cnf="ADD"),
    }[name]
    model = make(spiking_neuron=neuron.LIFNode, num_classes=10, step_mode="m", backend="cuda")
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.4)
    return model.cuda().to(memory_format=torch.channels_last)


@pytest.mark.parametrize("memory", MEMORY_MODES)
@pytest.mark.parametrize(("name", "size"), [("spiking_resnet19", 16), ("sew_resnet18", 32)])
def test_fused_residual_network_matches_unfused(name, size, memory, no_tf32, record_property):
    """ResNet-19 and SEW-ResNet-18 fused (every memory mode) equal the unfused network in fp32:
    output, input and parameter gradients and running statistics, within 1e-4."""
    model = residual_net(name)
    fused, report = fuse(model, memory=memory, return_report=True)
    assert report.fused_fraction == 1.0, str(report)
    x = torch.rand(4, 4, 3, size, size, device="cuda") * 2
    for _ in range(2):  # the second step sees the first one's running statistics
        want = training_step(model, x, False)
        got = training_step(fused, x, False)
    errors = {k: reldiff(got[k], w) for k, w in want.items()}
    worst = max(errors, key=errors.get)
    record_property("worst_fp32", errors[worst])
    assert errors[worst] < 1e-4, f"{worst}: normalised error {errors[worst]:.2e}"
