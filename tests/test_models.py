"""spikefuse.models: every network fuses completely and the fused network equals the unfused one
(outputs, input and parameter gradients, running statistics; float64 on the CPU); and how
``spikefuse.model.ms_resnet`` builds its neurons (SpikingJelly's ``spiking_neuron, **kwargs``)."""

from __future__ import annotations

import io
import pickletools
import zipfile

import pytest
import torch
from torch import nn

from spikefuse import functional, fuse, layer, models, neuron, surrogate
from spikefuse.errors import SpikefuseError
from spikefuse.fused import FusedBlock

T, B = 2, 2
FP64_TOL = dict(rtol=1e-9, atol=1e-11)


pytestmark = pytest.mark.usefixtures("one_thread")


def _if(**kw):
    return neuron.IFNode(surrogate_function=surrogate.ATan(), detach_reset=True, **kw)


# (constructor, neuron class, input size, number of Conv/Linear -> [BN] -> neuron chains)
CASES = {
    "spiking_vgg11": (models.spiking_vgg11, neuron.LIFNode, 32, 8 + 2),
    "spiking_vgg11_bn": (models.spiking_vgg11_bn, neuron.ParametricLIFNode, 32, 8 + 2),
    "spiking_vgg16_bn": (models.spiking_vgg16_bn, neuron.LIFNode, 32, 13 + 2),
    "spiking_resnet18": (models.spiking_resnet18, neuron.LIFNode, 32, 1 + 8 + 8),
    "spiking_resnet34": (models.spiking_resnet34, _if, 32, 1 + 16 + 16),
    "sew_resnet18_ADD": (lambda **kw: models.sew_resnet18(cnf="ADD", **kw), _if, 32, 1 + 16 + 3),
    "sew_resnet18_IAND": (
        lambda **kw: models.sew_resnet18(cnf="IAND", **kw),
        neuron.LIFNode,
        32,
        1 + 16 + 3,
    ),
    "sew_resnet18_AND": (
        lambda **kw: models.sew_resnet18(cnf="AND", **kw),
        neuron.QIFNode,
        32,
        1 + 16 + 3,
    ),
    "sew_resnet34_ADD": (
        lambda **kw: models.sew_resnet34(cnf="ADD", **kw),
        neuron.LIFNode,
        32,
        1 + 32 + 3,
    ),
    "sew_resnet34_IAND": (
        lambda **kw: models.sew_resnet34(cnf="IAND", **kw),
        _if,
        32,
        1 + 32 + 3,
    ),
    "sew_resnet34_AND": (
        lambda **kw: models.sew_resnet34(cnf="AND", **kw),
        neuron.LIFNode,
        32,
        1 + 32 + 3,
    ),
    "spiking_resnet19": (models.spiking_resnet19, neuron.LIFNode, 8, 1 + 8 + 8 + 1),
}


def build(name: str) -> tuple[nn.Module, int, int]:
    make, node, size, chains = CASES[name]
    extra = {"classifier_features": 32} if "vgg" in name else {}  # VGG's 4096 is too big here
    torch.manual_seed(0)
    model = make(spiking_neuron=node, num_classes=10, step_mode="m", backend="torch", **extra)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # non-trivial BatchNorm affine parameters
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.copy_(torch.rand(m.weight.shape, generator=gen) + 0.5)
                m.bias.copy_(torch.rand(m.bias.shape, generator=gen) * 0.6 - 0.2)
            elif isinstance(m, nn.Linear):  # VGG's N(0, 0.01) leaves the classifier silent
                m.weight.copy_(torch.randn(m.weight.shape, generator=gen) * 3 / m.in_features**0.5)
            elif isinstance(m, nn.Conv2d) and name == "spiking_vgg11":  # no BN: keep it active
                m.weight.mul_(5)
    return model.double(), size, chains


def by_key(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers under their state_dict keys (the same for fused and unfused)."""
    return model.state_dict(keep_vars=True)


def step(model: nn.Module, x: torch.Tensor):
    x = x.detach().clone().requires_grad_()
    torch.manual_seed(7)  # the same Dropout masks for both models
    out = model(x)
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    (out * weights).sum().backward()
    functional.reset_net(model)
    grads = {k: v.grad for k, v in by_key(model).items() if isinstance(v, nn.Parameter)}
    return out.detach(), x.grad, grads


RESIDUAL = ("spiking_resnet18", "sew_resnet18_ADD", "sew_resnet18_IAND", "spiking_resnet19")


@pytest.mark.parametrize(
    ("name", "memory"),
    [(name, "default") for name in CASES]
    + [(name, memory) for name in RESIDUAL for memory in ("min", "auto")],
)
def test_fused_model_equals_unfused(name, memory):
    model, size, chains = build(name)
    fused, report = fuse(model, return_report=True, memory=memory)
    assert report.fused_fraction == 1.0, str(report)
    assert len(report.fused) == report.chains == chains, str(report)
    assert sum(isinstance(m, FusedBlock) for m in fused.modules()) == chains
    assert type(fused) is type(model) and not report.untraced
    assert list(fused.state_dict()) == list(model.state_dict())
    x = torch.rand(T, B, 3, size, size, dtype=torch.float64) * 2
    for training in (True, True, False):  # two steps update running statistics, then eval
        model.train(training)
        fused.train(training)
        out_r, gx_r, gp_r = step(model, x)
        out_f, gx_f, gp_f = step(fused, x)
        assert out_r.shape == (T, B, 10)
        if training:  # not a vacuous comparison (eval's running statistics may silence a net)
            assert sum(g.abs().sum() for g in gp_r.values()) > 0
        torch.testing.assert_close(out_f, out_r, **FP64_TOL)
        torch.testing.assert_close(gx_f, gx_r, **FP64_TOL)
        assert gp_f.keys() == gp_r.keys()
        for key in gp_r:
            torch.testing.assert_close(gp_f[key], gp_r[key], **FP64_TOL, msg=key)
        model.zero_grad()
        fused.zero_grad()
    buffers_r, buffers_f = model.state_dict(), fused.state_dict()
    for key, value in buffers_r.items():
        torch.testing.assert_close(buffers_f[key], value, **FP64_TOL, msg=key)


def test_single_step_models_become_multi_step_with_set_step_mode():
    """SpikingJelly's way: build (single-step), then functional.set_step_mode(net, 'm')."""
    torch.manual_seed(0)
    net = models.sew_resnet18(cnf="ADD", spiking_neuron=neuron.IFNode, num_classes=4)
    assert net.conv1.step_mode == "s"
    x = torch.rand(B, 3, 32, 32)
    assert net(x).shape == (B, 4)
    functional.reset_net(net)
    functional.set_step_mode(net, "m")
    fused, report = fuse(net, return_report=True)
    assert report.fused_fraction == 1.0 and len(report.fused) == 20
    xs = torch.rand(T, B, 3, 32, 32)
    torch.testing.assert_close(fused(xs), net(xs))


def test_unfused_state_dict_loads_into_the_fused_model_and_back():
    model, _, _ = build("sew_resnet18_ADD")
    fused = fuse(model)
    other, _, _ = build("sew_resnet18_ADD")
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.5)
    fused.load_state_dict(other.state_dict(), strict=True)
    for key, value in other.state_dict().items():
        assert torch.equal(fused.state_dict()[key], value), key
    model.load_state_dict(fused.state_dict(), strict=True)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in other.state_dict().items())


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: models.sew_resnet18(spiking_neuron=neuron.IFNode), "cnf must be one of"),
        (lambda: models.sew_resnet18(cnf="OR", spiking_neuron=neuron.IFNode), "'OR'"),
        (lambda: models.spiking_resnet18(), "spiking_neuron must be a neuron class"),
        (
            lambda: models.spiking_vgg11_bn(pretrained=True, spiking_neuron=neuron.IFNode),
            "pretrained=True is not supported",
        ),
        (
            lambda: models.SpikingResNet(
                models.BasicBlock, [2, 2, 2, 2], groups=2, spiking_neuron=neuron.IFNode
            ),
            "groups=1",
        ),
        (
            lambda: models.SpikingVGG([8, "X"], spiking_neuron=neuron.IFNode),
            "cfg entries are channel counts or 'M', got 'X'",
        ),
    ],
    ids=["no-cnf", "bad-cnf", "no-neuron", "pretrained", "groups", "bad-cfg"],
)
def test_bad_arguments_raise(make, match):
    with pytest.raises(SpikefuseError, match=match):
        make()


def test_sew_function():
    x = torch.tensor([0.0, 0.0, 1.0, 1.0])
    y = torch.tensor([0.0, 1.0, 0.0, 1.0])
    assert models.sew_function(x, y, "ADD").tolist() == [0, 1, 1, 2]
    assert models.sew_function(x, y, "AND").tolist() == [0, 0, 0, 1]
    assert models.sew_function(x, y, "IAND").tolist() == [0, 0, 1, 0]


@pytest.mark.parametrize("name", ["spiking_vgg11_bn", "sew_resnet18_ADD", "spiking_resnet19"])
def test_saved_model_loads_and_pickles_under_the_public_module(name):
    """torch.save(model) records each class of spikefuse.models under ``spikefuse.models``, the
    path users import, not the private submodule defining it; the saved model loads and runs."""
    model, size, _ = build(name)
    model.eval()
    buffer = io.BytesIO()
    torch.save(model, buffer)  # pickle protocol 2: a GLOBAL opcode names each class
    buffer.seek(0)
    with zipfile.ZipFile(buffer) as archive:
        (pickled,) = [n for n in archive.namelist() if n.endswith("/data.pkl")]
        ops = pickletools.genops(archive.read(pickled))
        classes = {arg for op, arg, _ in ops if op.name == "GLOBAL"}
    ours = {c for c in classes if c.startswith("spikefuse.models")}
    assert f"spikefuse.models {type(model).__name__}" in ours
    assert {c.split()[0] for c in ours} == {"spikefuse.models"}, ours
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert type(loaded) is type(model)
    x = torch.rand(T, B, 3, size, size, dtype=torch.float64) * 2
    with torch.no_grad():
        expected = model(x)
        functional.reset_net(model)
        torch.testing.assert_close(loaded(x), expected, rtol=0, atol=0)


# ---- spikefuse.model.ms_resnet: the neurons from spiking_neuron and kwargs ------------------------
def _spiking_neurons(net: nn.Module) -> list[nn.Module]:
    return [m for m in net.modules() if isinstance(m, neuron.BaseNode)]


def test_ms_resnet_builds_a_custom_neuron_from_the_kwargs_alone():
    from spikefuse.model import ms_resnet

    net = ms_resnet.ms_resnet18(T=2, num_classes=3, spiking_neuron=neuron.IFNode, v_threshold=0.5)
    nodes = _spiking_neurons(net)
    assert len(nodes) == 2 * 8 + 1  # two per block, then the head's
    for node in nodes:  # the class's defaults: none of the paper's LIF parameters
        assert type(node) is neuron.IFNode and node.v_threshold == 0.5 and node.step_mode == "m"
        assert not node.detach_reset and type(node.surrogate_function) is surrogate.Sigmoid
    assert len({id(n.surrogate_function) for n in nodes}) == len(nodes)
    assert net(torch.rand(1, 3, 32, 32)).shape == (1, 3)


def test_ms_resnet_kwargs_override_the_paper_lif_one_by_one():
    from spikefuse.model import ms_resnet

    ms = ms_resnet.ms_resnet34(T=2, num_classes=3, v_threshold=0.3, backend="torch")
    for node in _spiking_neurons(ms):
        assert type(node) is neuron.LIFNode and node.tau == 4.0 / 3.0 and not node.decay_input
        assert node.v_threshold == 0.3 and node.detach_reset and node.backend == "torch"
        assert type(node.surrogate_function) is surrogate.Rect
        assert node.surrogate_function.alpha == 2.0
    max_net = ms_resnet.max_resnet18(T=2, num_classes=3, tau=3.0)
    for node in _spiking_neurons(max_net):  # Max-ResNet's LIF: tau 2 (here 3), threshold 1
        assert type(node) is neuron.LIFNode and node.tau == 3.0 and node.v_threshold == 1.0
        assert node.detach_reset and node.decay_input
    with pytest.raises(ValueError, match="step_mode='m'"):
        ms_resnet.MSResNet(layers=(1, 1, 1), base_channels=4, step_mode="s")


def test_ms_resnet_blocks_take_spikingjellys_arguments_for_subclasses():
    """SpikingJelly's ``model.masnn`` subclasses ``_MSBlock`` and calls ``_conv1x1``."""
    from spikefuse.model import ms_resnet

    down = nn.Sequential(ms_resnet._conv1x1(4, 8, 2), layer.BatchNorm2d(8, step_mode="m"))
    block = ms_resnet._MSBlock(4, 8, 2, down)
    assert isinstance(block.spike1, neuron.LIFNode) and block.conv1.stride == (2, 2)
    custom = ms_resnet._MaxResNetMaxBlock(4, 4, 1, None, neuron.IFNode, {"v_threshold": 0.2})
    assert isinstance(custom.spike2, neuron.IFNode) and custom.spike2.v_threshold == 0.2
    x = torch.rand(T, B, 4, 8, 8)
    assert block(x).shape == (T, B, 8, 4, 4) and custom(x).shape == x.shape
