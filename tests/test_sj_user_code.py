"""Real-script-style compatibility: user attributes on neurons, SpikingJelly module paths."""

from __future__ import annotations

import torch
from torch import nn

from spikefuse import encoding, functional, layer, neuron, surrogate

F64 = torch.float64


def _lif_reference(x_seq: torch.Tensor, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """SpikingJelly's LIFNode (decay_input, hard reset to 0): V after reset and S, per step."""
    v = torch.zeros_like(x_seq[0])
    vs, ss = [], []
    for x in x_seq:
        h = v + (x - v) / tau
        s = (h >= 1.0).to(x.dtype)
        v = h * (1 - s)
        vs.append(v)
        ss.append(s)
    return torch.stack(vs), torch.stack(ss)


def test_lif_fc_mnist_hook_records_v_seq_and_s_seq():
    """SpikingJelly's lif_fc_mnist example, after training: ``v_seq``/``s_seq`` set to lists on
    the output layer, a forward hook appends to them, then they are concatenated."""
    torch.manual_seed(0)
    net = nn.Sequential(
        layer.Flatten(),
        layer.Linear(28 * 28, 10, bias=False),
        neuron.LIFNode(tau=2.0, surrogate_function=surrogate.ATan()),
    ).to(F64)
    encoder = encoding.PoissonEncoder()
    output_layer = net[-1]
    output_layer.v_seq = []
    output_layer.s_seq = []

    def save_hook(m, x, y):
        m.v_seq.append(m.v.unsqueeze(0))
        m.s_seq.append(y.unsqueeze(0))

    output_layer.register_forward_hook(save_hook)
    img = torch.rand(1, 1, 28, 28, dtype=F64) * 3
    inputs = []
    with torch.no_grad():
        out_fr = 0.0
        for _ in range(8):
            encoded = encoder(img)
            inputs.append(net[1](net[0](encoded)))
            out_fr += net(encoded)
        output_layer.v_seq = torch.cat(output_layer.v_seq)
        output_layer.s_seq = torch.cat(output_layer.s_seq)
    want_v, want_s = _lif_reference(torch.stack(inputs), 2.0)
    assert output_layer.v_seq.shape == (8, 1, 10)
    torch.testing.assert_close(output_layer.v_seq, want_v, rtol=0, atol=1e-12)
    assert torch.equal(output_layer.s_seq, want_s)
    assert torch.equal(out_fr, want_s.sum(0))


def test_user_attributes_survive_forward_and_reset_as_in_spikingjelly():
    """store_v_seq=False: forward leaves ``v_seq`` alone; reset() sets it to None (SpikingJelly's
    BaseNode.reset) and leaves every attribute it does not manage."""
    for mode, x in (("s", torch.rand(2, 3)), ("m", torch.rand(4, 2, 3))):
        node = neuron.LIFNode(step_mode=mode)
        node.v_seq, node.s_seq, node.note = ["mine"], ["also mine"], 7
        node(x)
        assert node.v_seq == ["mine"] and node.s_seq == ["also mine"]
        node.step_mode = "m" if mode == "s" else "s"
        assert node.v_seq == ["mine"]  # SpikingJelly's step_mode setter leaves it
        functional.reset_net(node)
        assert node.v_seq is None and node.s_seq == ["also mine"] and node.note == 7


def test_simple_base_node_reset_leaves_v_seq():
    class Square(neuron.SimpleBaseNode):
        def neuronal_charge(self, x):
            self.v = self.v + x * x

    node = Square()
    node.v_seq = []
    node.register_forward_hook(lambda m, x, y: m.v_seq.append(m.v))
    node(torch.ones(2))
    node.reset()
    assert len(node.v_seq) == 1  # SimpleBaseNode has no v_seq of its own


def test_store_v_seq_assignment_drops_a_user_value_as_in_spikingjelly():
    node = neuron.IFNode(step_mode="m")
    node.v_seq = []
    node.store_v_seq = False
    assert node.v_seq is None
    node.store_v_seq = True
    node(torch.rand(3, 2))
    assert node.v_seq.shape == (3, 2)


# ---- base, _neuron, SimpleLIFNode, lif_charge / voltage_reset ----------------------------------
def test_base_names_are_spikefuse_classes():
    from spikefuse import base, layer

    node = neuron.LIFNode()
    assert isinstance(node, base.MemoryModule) and isinstance(node, base.StepModule)
    assert isinstance(layer.Linear(2, 3), base.StepModule)

    class Stateful(base.MemoryModule):
        def __init__(self):
            super().__init__()
            self.register_memory("acc", 0.0)

        def single_step_forward(self, x):
            self.acc = self.acc + x
            return self.acc

    m = Stateful()
    m.step_mode = "m"
    out = m(torch.ones(3, 2))
    assert out[:, 0].tolist() == [1.0, 2.0, 3.0]
    assert dict(base.named_memories(nn.Sequential(m)))["0.acc"].tolist() == [3.0, 3.0]
    saved = base.extract_memories(m)
    m.reset()
    assert m.acc == 0.0 and m.get_reset_value("acc") == 0.0
    base.load_memories(m, saved)
    assert m.acc.tolist() == [3.0, 3.0]


def test_multi_step_module_mixin():
    import pytest

    from spikefuse import base
    from spikefuse.errors import SpikefuseError

    class Block(nn.Module, base.MultiStepModule):
        def forward(self, x):
            return x

    b = Block()
    assert b.step_mode == "m" and b.supported_step_mode() == ("m",)
    functional.set_step_mode(b, "m")
    with pytest.raises(SpikefuseError, match="supports step_mode"):
        functional.set_step_mode(b, "s")
    with pytest.raises(SpikefuseError, match="step_mode must be 'm'"):
        b.step_mode = "s"


def test_make_multi_step_neuron_both_signatures():
    import pytest

    from spikefuse import _neuron

    a = _neuron._make_multi_step_neuron(None, {"v_threshold": 0.5}, {"tau": 3.0})
    assert type(a) is neuron.LIFNode and a.tau == 3.0 and a.v_threshold == 0.5
    assert a.step_mode == "m"
    b = _neuron._make_multi_step_neuron("torch", neuron.IFNode, {}, {"tau": 3.0})
    assert type(b) is neuron.IFNode and b.backend == "torch" and b.step_mode == "m"
    with pytest.raises(ValueError, match="step_mode='m'"):
        _neuron._make_multi_step_neuron(None, {"step_mode": "s"})


def test_simple_lif_node_matches_spikingjelly_formula():
    x = torch.rand(6, 3, dtype=F64, generator=torch.Generator().manual_seed(1)) * 2
    for decay_input in (True, False):
        node = neuron.SimpleLIFNode(3.0, decay_input, v_reset=-0.1, step_mode="m")
        spikes = node(x)
        v, want = torch.zeros(3, dtype=F64), []
        for xt in x:
            v = v + (-0.1 - v + xt) / 3.0 if decay_input else v + (-0.1 - v) / 3.0 + xt
            s = (v >= 1.0).to(F64)
            v = (1 - s) * v + s * -0.1
            want.append(s)
        assert torch.equal(spikes, torch.stack(want))
        torch.testing.assert_close(node.v, v, rtol=0, atol=1e-15)


def test_lif_charge_and_voltage_reset():
    x, v = torch.tensor([0.5, 2.0], dtype=F64), torch.tensor([0.2, -0.3], dtype=F64)
    got = functional.lif_charge(x, v, 2.0, True, -0.1)
    torch.testing.assert_close(got, v + (x - (v + 0.1)) / 2.0, rtol=0, atol=0)
    got = functional.lif_charge(x, v, 2.0, False, None)
    torch.testing.assert_close(got, v - v / 2.0 + x, rtol=0, atol=0)
    s = torch.tensor([1.0, 0.0], dtype=F64, requires_grad=True)
    hard = functional.voltage_reset(v, s, 1.0, 0.0, detach_reset=False)
    assert hard.tolist() == [0.0, -0.3]
    soft = functional.voltage_reset(v, s, 1.0, None, detach_reset=True)
    assert soft.tolist() == [0.2 - 1.0, -0.3] and not soft.requires_grad


# ---- OTTT and weight standardisation ----------------------------------------------------------
def test_ottt_node_formula_trace_and_eval():
    node = neuron.OTTTLIFNode(tau=2.0).to(F64)
    xs = torch.rand(5, 4, dtype=F64, generator=torch.Generator().manual_seed(2)) * 2
    v, trace = torch.zeros(4, dtype=F64), torch.zeros(4, dtype=F64)
    for x in xs:
        spike, got_trace = node(x)
        h = v - v / 2.0 + x  # decay_input=False, soft reset
        s = (h >= 1.0).to(F64)
        v, trace = h - s, trace * 0.5 + s
        assert torch.equal(spike, s)
        torch.testing.assert_close(got_trace, trace, rtol=0, atol=1e-15)
    node.eval()
    assert isinstance(node(xs[0]), torch.Tensor)


def test_ottt_sequential_online_training_constant_memory():
    """One backward per step: the graph never reaches back to earlier steps, and the second
    layer's weight gradient is the one the trace gives (SpikingJelly's OTTT)."""
    torch.manual_seed(0)
    net = layer.OTTTSequential(
        layer.Linear(4, 6), neuron.OTTTLIFNode(), layer.Flatten(), layer.Linear(6, 3)
    ).to(F64)
    xs = torch.rand(6, 2, 4, dtype=F64) * 3
    for x in xs:
        net.zero_grad()
        out = net(x)
        _, trace = net[1].v.detach(), net[1].trace
        out.sum().backward()  # would fail on a graph shared with an earlier step
        want = torch.ones(2, 3, dtype=F64).T @ trace
        torch.testing.assert_close(net[3].weight.grad, want, rtol=0, atol=1e-12)
        assert net[1].v.grad_fn is not None  # this step's graph only
    functional.reset_net(net)
    assert net[1].trace is None


def test_ottt_refuses_multi_step():
    import pytest

    from spikefuse.errors import SpikefuseError

    with pytest.raises(SpikefuseError, match="step_mode must be 's'"):
        neuron.OTTTLIFNode(step_mode="m")
    with pytest.raises(SpikefuseError, match="supports step_mode"):
        functional.set_step_mode(nn.Sequential(neuron.SLTTLIFNode()), "m")


def _ws_reference(w: torch.Tensor, eps: float) -> torch.Tensor:
    flat = w.reshape(w.shape[0], -1)
    mean = flat.mean(1, keepdim=True)
    var = ((flat - mean) ** 2).sum(1, keepdim=True) / (flat.shape[1] - 1)
    return ((flat - mean) / torch.sqrt(var * flat.shape[1] + eps)).reshape(w.shape)


def test_ws_layers_standardise_the_weight():
    conv = layer.WSConv2d(2, 3, 3, padding=1, step_mode="m").to(F64)
    w = _ws_reference(conv.weight.detach(), 1e-4)
    torch.testing.assert_close(conv.get_weight().detach(), w, rtol=0, atol=1e-14)
    x = torch.rand(2, 1, 2, 5, 5, dtype=F64)
    want = torch.nn.functional.conv2d(x[1], w, conv.bias, padding=1)
    torch.testing.assert_close(conv(x)[1].detach(), want, rtol=0, atol=1e-13)
    lin = layer.WSLinear(5, 4, gain=True, eps=1e-3).to(F64)
    torch.testing.assert_close(
        lin.get_weight().detach(), _ws_reference(lin.weight.detach(), 1e-3), rtol=0, atol=1e-14
    )
    assert lin(torch.rand(3, 2, 5, dtype=F64)).shape == (3, 2, 4)
    assert layer.WSLinear(5, 4, gain=False).gain is None


# ---- rnn --------------------------------------------------------------------------------------
def _heaviside(x: torch.Tensor) -> torch.Tensor:
    return (x >= 0).to(x.dtype)


def test_spiking_lstm_matches_spikingjelly_cell_equations():
    from spikefuse import rnn

    torch.manual_seed(0)
    net = rnn.SpikingLSTM(3, 4, num_layers=2).to(F64)
    x = torch.randn(5, 2, 3, dtype=F64)
    y, (h, c) = net(x)
    assert y.shape == (5, 2, 4) and h.shape == (2, 2, 4) and c.shape == (2, 2, 4)
    seq = x
    for index, cell in enumerate(net.cells):
        hh, cc, outs = torch.zeros(2, 4, dtype=F64), torch.zeros(2, 4, dtype=F64), []
        for xt in seq:
            pre = cell.linear_ih(xt) + cell.linear_hh(hh)
            i, f, g, o = _heaviside(pre).split(4, dim=1)
            cc = (cc * f + i * g).clamp(max=1.0)
            hh = cc * o
            outs.append(hh)
        seq = torch.stack(outs)
        torch.testing.assert_close(h[index], hh, rtol=0, atol=0)
        torch.testing.assert_close(c[index], cc, rtol=0, atol=0)
    torch.testing.assert_close(y, seq, rtol=0, atol=0)
    y.sum().backward()  # surrogate gradients reach the weights
    assert net.cells[0].linear_ih.weight.grad is not None


def test_spiking_gru_and_vanilla_bidirectional_states():
    from spikefuse import rnn

    torch.manual_seed(1)
    gru = rnn.SpikingGRU(3, 5, 1, bidirectional=True).to(F64)
    x = torch.randn(4, 2, 3, dtype=F64)
    y, h = gru(x)
    assert y.shape == (4, 2, 10) and h.shape == (2, 2, 5)
    cell_r, hr, outs = gru.cells_reverse[0], torch.zeros(2, 5, dtype=F64), []
    for xt in x.flip(0):
        a, b = cell_r.linear_ih(xt).split(5, 1), cell_r.linear_hh(hr).split(5, 1)
        r, z = _heaviside(a[0] + b[0]), _heaviside(a[1] + b[1])
        n = _heaviside(a[2] + r * b[2])
        hr = (1 - z) * n + z * hr
        outs.append(hr)
    torch.testing.assert_close(y[..., 5:], torch.stack(outs).flip(0), rtol=0, atol=0)
    torch.testing.assert_close(h[1], hr, rtol=0, atol=0)
    vanilla = rnn.SpikingVanillaRNN(3, 2, 2, dropout_p=0.5, invariant_dropout_mask=True)
    out, state = vanilla(torch.randn(4, 2, 3), torch.zeros(2, 2, 2))
    assert out.shape == (4, 2, 2) and state.shape == (2, 2, 2)


def test_rnn_rejects_bad_states():
    import pytest

    from spikefuse import rnn
    from spikefuse.errors import SpikefuseError

    net = rnn.SpikingLSTM(3, 4, 1)
    with pytest.raises(SpikefuseError, match="states must have shape"):
        net(torch.randn(2, 2, 3), torch.zeros(1, 2, 4))
    with pytest.raises(SpikefuseError, match="must both be spiking"):
        from spikefuse import surrogate

        rnn.SpikingLSTMCell(
            2,
            2,
            surrogate_function1=surrogate.Erf(spiking=False),
            surrogate_function2=surrogate.Erf(),
        )


# ---- model zoo paths, memopt, distributed, and fusion of models written with these names ------
def test_model_zoo_paths_build_and_run():
    from spikefuse.model import parametric_lif_net as plif
    from spikefuse.model import sew_resnet, spiking_resnet, spiking_vgg, spiking_vggws_ottt

    net = plif.DVSGestureNet(channels=4, spiking_neuron=neuron.ParametricLIFNode)
    assert net(torch.rand(2, 2, 128, 128)).shape == (2, 11)
    functional.reset_net(net)
    functional.set_step_mode(net, "m")
    assert net(torch.rand(3, 2, 2, 128, 128)).shape == (3, 2, 11)
    assert plif.NMNISTNet(4, neuron.IFNode)(torch.rand(1, 2, 34, 34)).shape == (1, 10)
    assert plif.CIFAR10Net(4, neuron.IFNode)(torch.rand(1, 3, 32, 32)).shape == (1, 10)
    assert plif.CIFAR10DVSNet(4, neuron.IFNode)(torch.rand(1, 2, 128, 128)).shape == (1, 10)
    assert plif.FashionMNISTNet(4, neuron.IFNode)(torch.rand(1, 1, 28, 28)).shape == (1, 10)
    r = spiking_resnet.spiking_resnet18(spiking_neuron=neuron.IFNode, num_classes=3)
    assert r(torch.rand(2, 3, 32, 32)).shape == (2, 3)
    s = sew_resnet.sew_resnet18(spiking_neuron=neuron.IFNode, cnf="ADD", num_classes=3)
    assert s(torch.rand(2, 3, 32, 32)).shape == (2, 3)
    v = spiking_vgg.spiking_vgg13_bn(spiking_neuron=neuron.IFNode, num_classes=3)
    assert len([m for m in v.features if isinstance(m, layer.Conv2d)]) == 10
    assert len([c for c in spiking_vgg.cfgs["E"] if c != "M"]) == 16
    o = spiking_vggws_ottt.ottt_spiking_vggws(num_classes=5)
    out = o(torch.rand(2, 3, 32, 32))
    assert isinstance(out, torch.Tensor) and out.shape == (2, 5)


def test_missing_zoo_names_say_what_to_use():
    import pytest

    from spikefuse import model
    from spikefuse.errors import SpikefuseError
    from spikefuse.model import spiking_resnet

    with pytest.raises(SpikefuseError, match="use spiking_resnet18/34/50/101/152"):
        spiking_resnet.spiking_resnext50_32x4d(spiking_neuron=neuron.IFNode)
    with pytest.raises(SpikefuseError, match="MaxFormer is not ported"):
        getattr(model, "maxformer_cifar")  # noqa: B009


def test_distributed_names_refuse_clearly():
    import pytest

    from spikefuse import distributed
    from spikefuse.errors import SpikefuseError

    assert distributed.TENSOR_PARALLEL_AVAILABLE is False
    from spikefuse.distributed import make_tensor_shard_memory_module

    with pytest.raises(SpikefuseError, match="DistributedDataParallel"):
        make_tensor_shard_memory_module(nn.Linear(2, 2))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        getattr(distributed, "nope")  # noqa: B009


def _sj_style_net() -> nn.Module:
    """A multi-step net written as SpikingJelly's model files write them."""
    from spikefuse import _neuron, base

    class Block(nn.Module, base.MultiStepModule):
        def __init__(self):
            super().__init__()
            self.conv = layer.Conv2d(2, 4, 3, padding=1, bias=False, step_mode="m")
            self.bn = layer.BatchNorm2d(4, step_mode="m")
            self.sn = _neuron._make_multi_step_neuron(None, {}, {"tau": 2.0, "v_threshold": 0.5})
            self.fc = layer.Linear(4 * 8 * 8, 3, step_mode="m")
            self.sn2 = _neuron._make_multi_step_neuron("torch", neuron.IFNode, {})

        def forward(self, x):
            return self.sn2(self.fc(self.sn(self.bn(self.conv(x))).flatten(2)))

    torch.manual_seed(0)
    return Block().to(F64)


def test_models_written_with_the_new_names_fuse():
    from spikefuse import fuse

    net = _sj_style_net()
    fused, report = fuse(net, return_report=True)
    assert len(report.fused) == 2, str(report)
    x = torch.rand(4, 2, 2, 8, 8, dtype=F64) * 2
    net.eval(), fused.eval()
    with torch.no_grad():
        torch.testing.assert_close(fused(x), net(x), rtol=0, atol=1e-12)


def test_optimize_memory_maps_onto_memory_modes():
    import pytest

    from spikefuse import memopt

    net = _sj_style_net()
    assert memopt.optimize_memory(net, neuron.LIFNode, level=0) is net
    with pytest.raises(ValueError, match="example_forward is required"):
        memopt.optimize_memory(net, neuron.LIFNode, level=1)
    with pytest.raises(ValueError, match="level must be one of"):
        memopt.optimize_memory(net, neuron.LIFNode, lambda m: m, level=5)
    probe = lambda m: m(torch.rand(2, 1, 2, 8, 8, dtype=F64))  # noqa: E731
    same, summary = memopt.optimize_memory(
        net, (neuron.LIFNode,), probe, level=1, can_chunk=lambda m: True, return_summary=True
    )
    assert same is net and summary.memory == "min" and len(summary.report.fused) == 2
    assert "not applicable: can_chunk" in str(summary)
    net.train()
    net(torch.rand(4, 2, 2, 8, 8, dtype=F64)).sum().backward()
    assert net.conv.synapse.weight.grad is not None
    _, auto = memopt.optimize_memory(
        _sj_style_net(), neuron.LIFNode, probe, level=1, compress=False, return_summary=True
    )
    assert auto.memory == "auto"


def test_ms_resnet_and_max_resnet():
    from spikefuse import fuse
    from spikefuse.model import ms_resnet

    torch.manual_seed(0)
    net = ms_resnet.MSResNet(T=2, num_classes=5, layers=(1, 2, 1), base_channels=4).to(F64)
    x = torch.rand(2, 3, 32, 32, dtype=F64)
    assert net(x).shape == (2, 5)
    block = net.layer2[1]  # no downsample: bn2 starts at weight 0, so the block passes x on
    seq = torch.rand(2, 2, 8, 4, 4, dtype=F64)
    functional.reset_net(net)
    assert torch.equal(block(seq), seq)
    fused, report = fuse(net, return_report=True)
    assert len(report.fused) >= 3, str(report)
    net.eval(), fused.eval()
    functional.reset_net(net)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), net(x), rtol=0, atol=1e-10)
    small = ms_resnet.max_resnet18(T=2, num_classes=3)
    assert isinstance(small.layer2[0], ms_resnet._MaxResNetMaxBlock)
    assert small(torch.rand(2, 3, 16, 16)).shape == (2, 3)


def test_bottleneck_resnets_follow_spikingjelly_and_fuse():
    from spikefuse import fuse
    from spikefuse.model import sew_resnet, spiking_resnet

    torch.manual_seed(0)
    net = spiking_resnet.spiking_resnet50(
        spiking_neuron=neuron.IFNode, num_classes=3, zero_init_residual=True, step_mode="m"
    ).to(F64)
    blocks = [m for m in net.modules() if isinstance(m, spiking_resnet.Bottleneck)]
    assert len(blocks) == 16 and all(b.bn3.weight.abs().sum() == 0 for b in blocks)
    assert all(b.bn2.weight.min() == 1 for b in blocks)
    assert net.fc.in_features == 2048
    x = torch.rand(2, 2, 3, 32, 32, dtype=F64)
    fused, report = fuse(net, return_report=True)
    assert len(report.fused) >= 16 * 2, str(report)
    net.eval(), fused.eval()
    with torch.no_grad():
        torch.testing.assert_close(fused(x), net(x), rtol=0, atol=1e-10)
    sew = sew_resnet.sew_resnet50(spiking_neuron=neuron.IFNode, cnf="IAND", num_classes=3)
    first = sew.layer1[0]
    assert isinstance(first, sew_resnet.Bottleneck) and hasattr(first, "downsample_sn")
    assert sew(torch.rand(2, 3, 32, 32)).shape == (2, 3)


def test_sew_bottleneck_connects_the_branch_first():
    """SpikingJelly's SEW bottleneck calls sew_function(branch, shortcut, cnf) (IAND: branch
    AND NOT shortcut), where its basic block puts the shortcut first."""
    from spikefuse.model import sew_resnet

    torch.manual_seed(1)
    block = sew_resnet.Bottleneck(16, 4, cnf="IAND", spiking_neuron=neuron.IFNode).to(F64)
    x = (torch.rand(2, 16, 5, 5, dtype=F64) > 0.5).to(F64)
    with torch.no_grad():
        got = block(x)
        functional.reset_net(block)
        branch = block.sn3(block.branch(x))
    assert torch.equal(got, branch * (1.0 - x))


def test_if_and_lif_steps_match_the_neurons():
    from spikefuse import surrogate

    x = torch.rand(5, 3, dtype=F64, generator=torch.Generator().manual_seed(3)) * 2
    for make, step in (
        (
            lambda: neuron.IFNode(v_reset=None, backend="torch"),
            lambda xt, v: functional.if_step(xt, v, 1.0, None, surrogate.Sigmoid()),
        ),
        (
            lambda: neuron.LIFNode(tau=3.0, decay_input=False, backend="torch"),
            lambda xt, v: functional.lif_step(xt, v, 3.0, False, 1.0, 0.0, surrogate.Sigmoid()),
        ),
    ):
        node, v = make(), torch.zeros(3, dtype=F64)
        for xt in x:
            s, v = step(xt, v)
            assert torch.equal(node(xt), s)
            torch.testing.assert_close(node.v, v, rtol=0, atol=1e-15)


def test_distributed_modules_spikingjellys_model_files_import():
    """SpikingJelly's sew_resnet/spikformer import these at module level and subclass the
    configs: importable; the config records and neuron resolution work; sharding refuses."""
    import dataclasses

    import pytest

    from spikefuse.distributed.tensor_parallel import ChannelShardConv2d
    from spikefuse.distributed.tensor_parallel.channel import _ColwiseBackwardAllReduce
    from spikefuse.distributed.vision.config import (
        ModelBuilder,
        ModelConfig,
        NeuronConfig,
        _resolve_neuron_config,
    )
    from spikefuse.errors import SpikefuseError

    @dataclasses.dataclass(frozen=True)
    class NetConfig(ModelConfig):
        builder = "x.Builder"
        neuron_config: NeuronConfig | None = None

    class Builder(ModelBuilder):
        pass

    config = NetConfig(
        num_classes=3,
        neuron_config=NeuronConfig(
            "spikingjelly.activation_based.neuron.LIFNode",
            {"tau": 3.0},
            "spikefuse.surrogate.ATan",
            {"alpha": 3.0},
        ),
    )
    assert Builder(config).config.num_classes == 3
    cls, kwargs = _resolve_neuron_config(config.neuron_config)
    node = cls(**kwargs)
    assert type(node) is neuron.LIFNode and node.tau == 3.0
    assert node.surrogate_function.alpha == 3.0
    with pytest.raises(SpikefuseError, match="unknown neuron class"):
        _resolve_neuron_config(NeuronConfig("os.system"))
    with pytest.raises(SpikefuseError, match="step_mode"):
        NeuronConfig("spikefuse.neuron.IFNode", {"step_mode": "m"})
    with pytest.raises(SpikefuseError, match="no tensor/pipeline"):
        ChannelShardConv2d(nn.Conv2d(2, 2, 1), None, "colwise")
    with pytest.raises(SpikefuseError, match="no tensor/pipeline"):
        _ColwiseBackwardAllReduce.apply(torch.ones(1), None)
