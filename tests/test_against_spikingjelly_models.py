"""Optional: the names added for SpikingJelly's model files, monitors, OTTT and RNNs against an
installed SpikingJelly 2.0 (skipped when it is not importable; e.g. ``pip install --no-deps
--target /tmp/sj spikingjelly==2.0.0 loguru`` and ``PYTHONPATH=src:/tmp/sj``). Same weights and
input, float64."""

from __future__ import annotations

import inspect
import sys
import types

import pytest
import torch
from torch import nn

sj = pytest.importorskip("spikingjelly.activation_based")


def _import_monitor() -> types.ModuleType:
    """SpikingJelly's monitor module; its tensorboard import (unused here) is stubbed for the
    import only when tensorboard is missing."""
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        stub = types.ModuleType("torch.utils.tensorboard")
        stub.SummaryWriter = object  # type: ignore[attr-defined]
        sys.modules["torch.utils.tensorboard"] = stub
        try:
            from spikingjelly.activation_based import monitor
        finally:
            del sys.modules["torch.utils.tensorboard"]
        return monitor
    from spikingjelly.activation_based import monitor

    return monitor


sj_monitor = _import_monitor()
from spikingjelly.activation_based import functional as sj_functional  # noqa: E402
from spikingjelly.activation_based import layer as sj_layer  # noqa: E402
from spikingjelly.activation_based import neuron as sj_neuron  # noqa: E402
from spikingjelly.activation_based import rnn as sj_rnn  # noqa: E402
from spikingjelly.activation_based import surrogate as sj_surrogate  # noqa: E402

from spikefuse import functional, layer, monitor, neuron, rnn, surrogate  # noqa: E402

F64 = torch.float64


def _same(a, b, atol=1e-12):
    torch.testing.assert_close(a, b, rtol=0, atol=atol)


def test_lif_fc_mnist_recording_hook_matches():
    torch.manual_seed(0)
    x = (torch.rand(8, 1, 784, dtype=F64) > 0.7).to(F64)
    records = []
    for lib_neuron, lib_layer, sg in (
        (sj_neuron, sj_layer, sj_surrogate),
        (neuron, layer, surrogate),
    ):
        torch.manual_seed(1)
        net = nn.Sequential(
            lib_layer.Linear(784, 10, bias=False),
            lib_neuron.LIFNode(tau=2.0, surrogate_function=sg.ATan()),
        ).to(F64)
        out = net[-1]
        out.v_seq, out.s_seq = [], []
        out.register_forward_hook(
            lambda m, i, y: (m.v_seq.append(m.v.unsqueeze(0)), m.s_seq.append(y.unsqueeze(0)))
        )
        with torch.no_grad():
            for xt in x:
                net(xt)
        records.append((torch.cat(out.v_seq), torch.cat(out.s_seq)))
        out.reset()
        assert out.v_seq is None and len(out.s_seq) == 8
    _same(records[0][0], records[1][0])
    assert torch.equal(records[0][1], records[1][1])


def test_simple_lif_and_charge_functions_match():
    x = torch.rand(6, 2, 3, dtype=F64) * 2
    theirs = sj_neuron.SimpleLIFNode(3.0, False, v_reset=-0.2, step_mode="m")
    ours = neuron.SimpleLIFNode(3.0, False, v_reset=-0.2, step_mode="m")
    assert torch.equal(theirs(x), ours(x))
    _same(theirs.v, ours.v)
    v = torch.rand(2, 3, dtype=F64)
    for decay_input, v_reset in ((True, 0.0), (False, None)):
        _same(
            sj_functional.lif_charge(x[0], v, 2.0, decay_input, v_reset),
            functional.lif_charge(x[0], v, 2.0, decay_input, v_reset),
            0,
        )
    s = (x[0] > 1).to(F64)
    for v_reset in (0.0, None):
        _same(
            sj_functional.voltage_reset(v, s, 1.0, v_reset, True),
            functional.voltage_reset(v, s, 1.0, v_reset, True),
            0,
        )


def _ottt_net(lib_layer, lib_neuron):
    torch.manual_seed(2)
    return lib_layer.OTTTSequential(
        lib_layer.Linear(4, 6), lib_neuron.OTTTLIFNode(), lib_layer.Linear(6, 3)
    ).to(F64)


def test_ottt_online_training_matches():
    theirs, ours = _ottt_net(sj_layer, sj_neuron), _ottt_net(layer, neuron)
    ours.load_state_dict(theirs.state_dict())
    xs = torch.rand(5, 2, 4, dtype=F64) * 3
    for x in xs:
        results = []
        for net in (theirs, ours):
            net.zero_grad()
            out = net(x)
            out.sum().backward()
            results.append(
                (out.detach(), net[1].trace.clone(), [p.grad.clone() for p in net.parameters()])
            )
        _same(results[0][0], results[1][0])
        _same(results[0][1], results[1][1])
        for a, b in zip(results[0][2], results[1][2], strict=True):
            _same(a, b)


def test_ws_layers_match():
    torch.manual_seed(3)
    theirs = sj_layer.WSConv2d(3, 4, 3, padding=1).to(F64)
    ours = layer.WSConv2d(3, 4, 3, padding=1).to(F64)
    ours.load_state_dict(theirs.state_dict())
    x = torch.rand(2, 3, 6, 6, dtype=F64)
    _same(theirs(x), ours(x))
    theirs_l, ours_l = (
        sj_layer.WSLinear(5, 4, gain=False).to(F64),
        layer.WSLinear(5, 4, gain=False).to(F64),
    )
    ours_l.load_state_dict(theirs_l.state_dict())
    _same(theirs_l(x[:, 0, 0, :5]), ours_l(x[:, 0, 0, :5]))


@pytest.mark.parametrize("name", ["SpikingLSTM", "SpikingGRU", "SpikingVanillaRNN"])
def test_rnns_match(name):
    torch.manual_seed(4)
    theirs = getattr(sj_rnn, name)(3, 5, 2, bidirectional=True).to(F64)
    ours = getattr(rnn, name)(3, 5, 2, bidirectional=True).to(F64)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(4, 2, 3, dtype=F64, requires_grad=True)
    y_t, s_t = theirs(x)
    y_o, s_o = ours(x)
    _same(y_t, y_o)
    for a, b in zip(
        s_t if isinstance(s_t, tuple) else (s_t,),
        s_o if isinstance(s_o, tuple) else (s_o,),
        strict=True,
    ):
        _same(a, b)
    g_t = torch.autograd.grad(y_t.sum(), x)[0]
    g_o = torch.autograd.grad(y_o.sum(), x)[0]
    _same(g_t, g_o, 1e-10)


def test_monitors_record_the_same():
    torch.manual_seed(5)
    nets = []
    for lib_layer, lib_neuron in ((sj_layer, sj_neuron), (layer, neuron)):
        torch.manual_seed(5)
        net = nn.Sequential(
            lib_layer.Linear(6, 4), lib_neuron.IFNode(), lib_layer.Linear(4, 2), lib_neuron.IFNode()
        ).to(F64)
        nets.append(net)
    x = torch.rand(3, 6, dtype=F64) * 2
    mons = [
        (
            sj_monitor.OutputMonitor(nets[0], sj_neuron.IFNode),
            monitor.OutputMonitor(nets[1], neuron.IFNode),
        ),
        (
            sj_monitor.AttributeMonitor("v", False, nets[0], sj_neuron.IFNode),
            monitor.AttributeMonitor("v", False, nets[1], neuron.IFNode),
        ),
        (
            sj_monitor.InputMonitor(nets[0], sj_neuron.IFNode),
            monitor.InputMonitor(nets[1], neuron.IFNode),
        ),
    ]
    for net in nets:
        net(x).sum()
    for theirs, ours in mons:
        assert theirs.monitored_layers == ours.monitored_layers
        for a, b in zip(theirs.records, ours.records, strict=True):
            _same(a.detach(), b.detach())


def test_monitor_close_and_context_manager_behave_the_same():
    """``close()`` (also on leaving ``with``, and at garbage collection) stops recording and
    removes the hooks but keeps the records, in both libraries."""
    counts = []
    for lib_layer, lib_neuron, lib_monitor in (
        (sj_layer, sj_neuron, sj_monitor),
        (layer, neuron, monitor),
    ):
        torch.manual_seed(5)
        net = nn.Sequential(lib_layer.Linear(6, 4), lib_neuron.IFNode()).to(F64)
        x = torch.rand(3, 6, dtype=F64) * 2
        with lib_monitor.OutputMonitor(net, lib_neuron.IFNode) as mon:
            net(x)
        net(x)
        mon.close()  # again: nothing more happens
        mon.enable()  # the hooks are gone: enabling records nothing
        net(x)
        records = mon.records
        del mon  # __del__ closes; records another reference holds stay
        counts.append((len(records), len(net[1]._forward_hooks)))
    assert counts[0] == counts[1] == (1, 0)


def test_ms_resnets_take_spikingjellys_arguments():
    from spikingjelly.activation_based.model import ms_resnet as sj_ms

    from spikefuse.model import ms_resnet

    names = "MSResNet MaxResNet ms_resnet18 ms_resnet34 max_resnet18 _MSBlock _MaxResNetBlock"
    for name in [*names.split(), "_MaxResNetMaxBlock", "_conv1x1", "_conv3x3"]:
        theirs, ours = (inspect.signature(getattr(m, name)).parameters for m in (sj_ms, ms_resnet))
        assert [(p.name, p.default, p.kind) for p in theirs.values()] == [
            (p.name, p.default, p.kind) for p in ours.values()
        ], name
    assert inspect.signature(sj_ms._MSBlock._make_lif).parameters.keys() == (
        inspect.signature(ms_resnet._MSBlock._make_lif).parameters.keys()
    )
    # the builders pass the neuron arguments on (eval mode: running statistics, one step)
    builds = [
        ("ms_resnet18", lambda lib: {"spiking_neuron": lib.IFNode, "v_threshold": 0.5}),
        ("max_resnet18", lambda lib: {"tau": 3.0}),
    ]
    for build, kwargs in builds:
        theirs = getattr(sj_ms, build)(T=1, num_classes=3, **kwargs(sj_neuron)).to(F64).eval()
        ours = getattr(ms_resnet, build)(T=1, num_classes=3, **kwargs(neuron)).to(F64).eval()
        ours.load_state_dict(theirs.state_dict())
        x = torch.rand(1, 3, 16, 16, dtype=F64) * 4
        with torch.no_grad():
            _same(theirs(x), ours(x))


@pytest.mark.parametrize(
    "build, neuron_kwargs",
    [
        ("MSResNet", lambda lib_neuron, lib_sg: {}),
        ("MSResNet", lambda lib_neuron, lib_sg: {"spiking_neuron": lib_neuron.IFNode, "v_threshold": 0.5}),
        (
            "MSResNet",
            lambda lib_neuron, lib_sg: {
                "spiking_neuron": lib_neuron.ParametricLIFNode, "init_tau": 3.0,
                "surrogate_function": lib_sg.ATan(), "detach_reset": True,
            },
        ),
        ("MaxResNet", lambda lib_neuron, lib_sg: {}),
        ("MaxResNet", lambda lib_neuron, lib_sg: {"v_threshold": 0.8, "surrogate_function": lib_sg.Erf()}),
    ],
    ids=["default", "IFNode", "PLIF", "max-default", "max-kwargs"],
)  # fmt: skip
def test_ms_resnets_match_with_spikingjellys_weights(build, neuron_kwargs):
    """The same outputs and gradients from SpikingJelly's state_dict, training and eval mode,
    with the paper's neurons, a custom neuron class and keyword arguments for the neurons."""
    from spikingjelly.activation_based.model import ms_resnet as sj_ms

    from spikefuse.model import ms_resnet

    small = {"layers": (1, 1, 1), "base_channels": 4, "stem_kernel_size": 3, "stem_stride": 1}
    theirs, ours = (
        getattr(lib, build)(T=2, num_classes=3, **small, **neuron_kwargs(lib_neuron, lib_sg)).to(F64)
        for lib, lib_neuron, lib_sg in ((sj_ms, sj_neuron, sj_surrogate), (ms_resnet, neuron, surrogate))
    )  # fmt: skip
    ours.load_state_dict(theirs.state_dict())
    x = torch.rand(2, 3, 16, 16, dtype=F64) * 2
    outputs = []
    for net in (theirs, ours):
        y = net(x)
        y.square().sum().backward()
        sj_functional.reset_net(net)
        net.eval()
        with torch.no_grad():
            outputs.append((y, net(x), [p.grad for p in net.parameters()]))
    assert outputs[0][0].abs().sum() > 0
    _same(outputs[0][0], outputs[1][0])
    _same(outputs[0][1], outputs[1][1])
    for a, b in zip(outputs[0][2], outputs[1][2], strict=True):
        _same(a, b, 1e-10)


def test_zoo_constructors_share_state_dicts_and_outputs():
    from spikingjelly.activation_based.model import ms_resnet as sj_ms
    from spikingjelly.activation_based.model import parametric_lif_net as sj_plif

    from spikefuse.model import ms_resnet, parametric_lif_net

    cases = [
        (
            lambda: sj_plif.DVSGestureNet(4, sj_neuron.IFNode),
            lambda: parametric_lif_net.DVSGestureNet(4, neuron.IFNode),
            (2, 2, 128, 128),
        ),
        (
            lambda: sj_plif.NMNISTNet(4, sj_neuron.IFNode),
            lambda: parametric_lif_net.NMNISTNet(4, neuron.IFNode),
            (2, 2, 34, 34),
        ),
        (
            lambda: sj_ms.MSResNet(T=2, num_classes=3, layers=(1, 1, 1), base_channels=4),
            lambda: ms_resnet.MSResNet(T=2, num_classes=3, layers=(1, 1, 1), base_channels=4),
            (2, 3, 16, 16),
        ),
    ]
    _compare_zoo(cases)


def test_ottt_vgg_and_more_plif_nets_share_state_dicts_and_outputs():
    from spikingjelly.activation_based.model import parametric_lif_net as sj_plif
    from spikingjelly.activation_based.model import spiking_vggws_ottt as sj_ottt

    from spikefuse.model import parametric_lif_net, spiking_vggws_ottt

    _compare_zoo(
        [
            (
                lambda: sj_ottt.ottt_spiking_vggws(num_classes=4),
                lambda: spiking_vggws_ottt.ottt_spiking_vggws(num_classes=4),
                (2, 3, 16, 16),
            ),
            (
                lambda: sj_plif.CIFAR10Net(4, sj_neuron.IFNode),
                lambda: parametric_lif_net.CIFAR10Net(4, neuron.IFNode),
                (2, 3, 32, 32),
            ),
            (
                lambda: sj_plif.MNISTNet(4, sj_neuron.IFNode),
                lambda: parametric_lif_net.MNISTNet(4, neuron.IFNode),
                (2, 1, 28, 28),
            ),
        ]
    )


def test_bottleneck_resnets_share_state_dicts_and_outputs(monkeypatch):
    try:  # SpikingJelly's ResNet files import torchvision's weight loader, unused here
        import torchvision  # noqa: F401
    except ImportError:
        stub = types.ModuleType("torchvision._internally_replaced_utils")
        stub.load_state_dict_from_url = None  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "torchvision", types.ModuleType("torchvision"))
        monkeypatch.setitem(sys.modules, "torchvision._internally_replaced_utils", stub)
    from spikingjelly.activation_based.model import sew_resnet as sj_sew
    from spikingjelly.activation_based.model import spiking_resnet as sj_res

    from spikefuse.model import sew_resnet, spiking_resnet

    _compare_zoo(
        [
            (
                lambda: sj_sew.sew_resnet50(
                    spiking_neuron=sj_neuron.IFNode, cnf="IAND", num_classes=3
                ),
                lambda: sew_resnet.sew_resnet50(
                    spiking_neuron=neuron.IFNode, cnf="IAND", num_classes=3
                ),
                (2, 3, 32, 32),
            ),
            (
                lambda: sj_res.spiking_resnet50(
                    spiking_neuron=sj_neuron.IFNode, num_classes=3, zero_init_residual=True
                ),
                lambda: spiking_resnet.spiking_resnet50(
                    spiking_neuron=neuron.IFNode, num_classes=3, zero_init_residual=True
                ),
                (2, 3, 32, 32),
            ),
        ]
    )


def _compare_zoo(cases):
    for make_theirs, make_ours, shape in cases:
        torch.manual_seed(6)
        theirs = make_theirs().to(F64)
        torch.manual_seed(6)
        ours = make_ours().to(F64)
        for (k1, v1), (k2, v2) in zip(
            theirs.state_dict().items(), ours.state_dict().items(), strict=True
        ):
            assert k1 == k2 and torch.equal(v1, v2), k1  # same layout, same seeded initial weights
        theirs.eval(), ours.eval()
        x = torch.rand(*shape, dtype=F64) * 2
        with torch.no_grad():
            _same(theirs(x), ours(x), 1e-10)
