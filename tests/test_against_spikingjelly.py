"""Optional: spikefuse against an installed SpikingJelly (skipped when it is not installed;
SpikingJelly is never a dependency). Same weights and input, float64, torch backends."""

from __future__ import annotations

import inspect

import pytest
import torch

sj = pytest.importorskip("spikingjelly.activation_based")
from spikingjelly.activation_based import base as sj_base  # noqa: E402
from spikingjelly.activation_based import encoding as sj_encoding  # noqa: E402
from spikingjelly.activation_based import functional as sj_functional  # noqa: E402
from spikingjelly.activation_based import layer as sj_layer  # noqa: E402
from spikingjelly.activation_based import neuron as sj_neuron  # noqa: E402
from spikingjelly.activation_based import surrogate as sj_surrogate  # noqa: E402

from spikefuse import SpikefuseError, base, encoding, functional, layer, neuron, surrogate  # noqa: E402

F64 = torch.float64

NEURONS = {
    "IFNode": {},
    "LIFNode": {"tau": 1.8},
    "ParametricLIFNode": {"init_tau": 2.5},
    "QIFNode": {"tau": 2.5},
    "EIFNode": {"tau": 2.0},
    "IzhikevichNode": {"a": 0.4, "b": 0.2},
}


@pytest.mark.parametrize("v_reset", [0.0, None], ids=["hard", "soft"])
@pytest.mark.parametrize(
    "name",
    list(NEURONS),
)
def test_neurons_match_spikingjelly(name, v_reset):
    kw = dict(NEURONS[name], v_reset=v_reset, step_mode="m")
    ours = getattr(neuron, name)(surrogate_function=surrogate.ATan(), backend="torch", **kw)
    theirs = getattr(sj_neuron, name)(surrogate_function=sj_surrogate.ATan(), **kw)
    ours.double(), theirs.double()
    x = torch.rand(8, 3, 5, generator=torch.Generator().manual_seed(0), dtype=F64) * 1.5
    x.requires_grad_(True)
    s1, s2 = ours(x), theirs(x)
    assert torch.equal(s1, s2)
    torch.testing.assert_close(ours.v.to(F64), theirs.v, rtol=0, atol=1e-12)
    (g1,) = torch.autograd.grad(s1.sum() + ours.v.sum(), [x])
    (g2,) = torch.autograd.grad(s2.sum() + theirs.v.sum(), [x])
    torch.testing.assert_close(g1, g2, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "name", "Sigmoid ATan PiecewiseQuadratic PiecewiseExp SoftSign SuperSpike Erf Rect".split()
)
@pytest.mark.parametrize("alpha", [0.7, 3.0])
def test_surrogates_match_spikingjelly(name, alpha):
    if not hasattr(sj_surrogate, name):
        pytest.skip(f"this SpikingJelly has no surrogate.{name}")
    x = torch.linspace(-3, 3, 601, dtype=F64, requires_grad=True)
    (g1,) = torch.autograd.grad(getattr(surrogate, name)(alpha)(x).sum(), [x])
    (g2,) = torch.autograd.grad(getattr(sj_surrogate, name)(alpha)(x).sum(), [x])
    torch.testing.assert_close(g1, g2, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "name", "Sigmoid ATan PiecewiseQuadratic PiecewiseExp SoftSign SuperSpike Erf Rect".split()
)
@pytest.mark.parametrize("alpha", [0.7, 3.0])
def test_surrogate_static_methods_match_spikingjelly(name, alpha):
    """``spiking_function(x, alpha)``, ``backward(grad_output, x, alpha)`` and
    ``primitive_function(x, alpha)`` called on the class, as SpikingJelly's static methods."""
    ours, theirs = getattr(surrogate, name), getattr(sj_surrogate, name)
    x = torch.linspace(-3, 3, 601, dtype=F64)
    g = torch.rand(601, generator=torch.Generator().manual_seed(1), dtype=F64)
    torch.testing.assert_close(
        ours.backward(g, x, alpha), theirs.backward(g, x, alpha), rtol=0, atol=1e-12
    )
    grads = []
    for cls in (ours, theirs):
        xg = x.clone().requires_grad_(True)
        spikes = cls.spiking_function(xg, alpha)
        assert torch.equal(spikes, (x >= 0).to(F64))
        grads.append(torch.autograd.grad((spikes * g).sum(), [xg])[0])
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-12)
    if name == "SuperSpike":  # SpikingJelly's raises NotImplementedError: no primitive
        with pytest.raises(SpikefuseError, match="no primitive function"):
            ours.primitive_function(x, alpha)
        return
    primitive = ours.primitive_function(x, alpha)
    torch.testing.assert_close(primitive, theirs.primitive_function(x, alpha), rtol=0, atol=1e-12)
    torch.testing.assert_close(ours(alpha).primitive_function(x, alpha), primitive, rtol=0, atol=0)


@pytest.mark.parametrize("cls", ["Dropout", "Dropout2d"])
@pytest.mark.parametrize("step_mode", ["s", "m"])
def test_dropout_masks_match_spikingjelly(cls, step_mode):
    x = torch.rand(4, 3, 6, 5, 5, dtype=F64)
    outs = []
    for lib, fn in ((layer, functional), (sj_layer, sj_functional)):
        torch.manual_seed(1)
        drop = getattr(lib, cls)(p=0.4, step_mode=step_mode)
        y = drop(x) if step_mode == "m" else torch.stack([drop(x[t]) for t in range(4)])
        fn.reset_net(drop)
        outs.append(torch.cat([y, drop(x) if step_mode == "m" else drop(x[0])[None]]))
    assert torch.equal(*outs)


def test_stateful_layers_match_spikingjelly():
    s = (torch.rand(6, 2, 8, generator=torch.Generator().manual_seed(2)) > 0.5).to(F64)
    ours = layer.SynapseFilter(tau=3.0, step_mode="m")
    theirs = sj_layer.SynapseFilter(tau=3.0, step_mode="m")
    torch.testing.assert_close(ours(s), theirs(s), rtol=0, atol=1e-12)
    vote, sj_vote = layer.VotingLayer(4, step_mode="m"), sj_layer.VotingLayer(4, step_mode="m")
    assert torch.equal(vote(s), sj_vote(s))
    torch.manual_seed(3)
    sub = torch.nn.Sequential(torch.nn.Linear(8, 3), neuron.IFNode(backend="torch")).double()
    sj_sub = torch.nn.Sequential(torch.nn.Linear(8, 3), sj_neuron.IFNode()).double()
    sj_sub[0].load_state_dict(sub[0].state_dict())
    rec = layer.LinearRecurrentContainer(sub, 8, 3, step_mode="m").double()
    sj_rec = sj_layer.LinearRecurrentContainer(sj_sub, 8, 3, step_mode="m").double()
    sj_rec.rc.load_state_dict(rec.rc.state_dict())
    torch.testing.assert_close(rec(s), sj_rec(s), rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["SeqToANNContainer", "MultiStepContainer"])
def test_sequence_containers_take_step_modes_as_spikingjellys(name):
    for lib, lib_base, fn in ((layer, base, functional), (sj_layer, sj_base, sj_functional)):
        c = getattr(lib, name)(torch.nn.Linear(2, 2))
        assert isinstance(c, lib_base.MultiStepModule) and c.supported_step_mode() == ("m",)
        assert not hasattr(c, "step_mode")
        with pytest.raises(ValueError):
            c.step_mode = "s"
        net = torch.nn.Sequential(c, lib.Linear(2, 2))
        fn.set_step_mode(net, "s")  # passes over the container: it has no step_mode yet
        assert not hasattr(c, "step_mode") and net[1].step_mode == "s"
        c.step_mode = "m"
        with pytest.raises(ValueError):
            fn.set_step_mode(net, "s")
        assert c.step_mode == "m"


def test_memory_registration_and_deletion_match_spikingjelly():
    for lib_base in (base, sj_base):
        m = lib_base.MemoryModule()
        m.gain = 2.0
        m.register_memory("v", 0.5)
        for taken in ("gain", "v", "reset"):  # an attribute, a memory, a method
            with pytest.raises(AssertionError, match=f"{taken} has been set as a member variable"):
                m.register_memory(taken, 0.0)
        assert m.gain == 2.0 and m.v == 0.5
        m.register_memory("w", 1.0)
        m.v = 3.0
        del m.v
        assert not hasattr(m, "v") and [name for name, _ in m.named_memories()] == ["w"]
        m.reset()
        assert not hasattr(m, "v") and m.w == 1.0
        with pytest.raises(KeyError):
            m.get_reset_value("v")
        m.register_memory("v", 0.25)  # free again
        assert m.v == 0.25 and list(m.memories()) == [1.0, 0.25]
        del m.gain
        with pytest.raises(AttributeError):
            del m.gain


def test_encoders_match_spikingjelly():
    x = torch.rand(3, 7, generator=torch.Generator().manual_seed(4), dtype=F64)
    torch.manual_seed(5)
    a = encoding.PoissonEncoder()(x)
    torch.manual_seed(5)
    assert torch.equal(a, sj_encoding.PoissonEncoder()(x))
    for enc_function in ("linear", "log"):
        ours = encoding.LatencyEncoder(6, enc_function=enc_function)
        theirs = sj_encoding.LatencyEncoder(6, enc_function=enc_function)
        assert torch.equal(
            torch.stack([ours(x) for _ in range(8)]), torch.stack([theirs(x) for _ in range(8)])
        )
    y = x * (1 - 2.0**-5)
    ours, theirs = encoding.WeightedPhaseEncoder(5), sj_encoding.WeightedPhaseEncoder(5)
    assert torch.equal(
        torch.stack([ours(y) for _ in range(5)]), torch.stack([theirs(y) for _ in range(5)]).to(F64)
    )


def csnn(neuron, layer, surrogate, channels=4):
    """The Fashion-MNIST CSNN of SpikingJelly's conv_fashion_mnist.py, built from either library."""
    return torch.nn.Sequential(
        layer.Conv2d(1, channels, kernel_size=3, padding=1, bias=False),
        layer.BatchNorm2d(channels),
        neuron.IFNode(surrogate_function=surrogate.ATan()),
        layer.MaxPool2d(2, 2),
        layer.Conv2d(channels, channels, kernel_size=3, padding=1, bias=False),
        layer.BatchNorm2d(channels),
        neuron.IFNode(surrogate_function=surrogate.ATan()),
        layer.MaxPool2d(2, 2),
        layer.Flatten(),
        layer.Linear(channels * 7 * 7, channels * 4 * 4, bias=False),
        layer.Dropout(0.5),
        neuron.LIFNode(surrogate_function=surrogate.ATan(), detach_reset=True),
        layer.Linear(channels * 4 * 4, 10, bias=False),
        neuron.IFNode(surrogate_function=surrogate.ATan()),
    )


def test_csnn_training_step_matches_spikingjelly():
    ours = csnn(neuron, layer, surrogate).double()
    theirs = csnn(sj_neuron, sj_layer, sj_surrogate).double()
    theirs.load_state_dict(ours.state_dict())
    functional.set_step_mode(ours, "m")
    sj_functional.set_step_mode(theirs, "m")
    x = torch.rand(4, 3, 1, 28, 28, generator=torch.Generator().manual_seed(6), dtype=F64) * 3
    grads = []
    for net, fn in ((ours, functional), (theirs, sj_functional)):
        torch.manual_seed(7)  # the same dropout mask
        out = net(x).mean(0)
        out.square().sum().backward()
        grads.append((out.detach(), [p.grad for p in net.parameters()]))
        fn.reset_net(net)
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=0, atol=1e-12)
    for g1, g2 in zip(grads[0][1], grads[1][1], strict=True):
        torch.testing.assert_close(g1, g2, rtol=1e-10, atol=1e-12)


def test_torch_code_neuron_matches_spikingjelly():
    def square_if(base):
        class SquareIFNode(base):
            def neuronal_charge(self, x):
                self.v = self.v + x**2

        return SquareIFNode

    # SpikingJelly 2.0 writes such neurons on SimpleBaseNode (earlier versions on BaseNode)
    ours = square_if(neuron.SimpleBaseNode)(surrogate_function=surrogate.ATan(), step_mode="m")
    theirs = square_if(sj_neuron.SimpleBaseNode)(
        surrogate_function=sj_surrogate.ATan(), step_mode="m"
    )
    x = torch.rand(6, 2, 5, generator=torch.Generator().manual_seed(8), dtype=F64)
    x.requires_grad_(True)
    s1, s2 = ours(x), theirs(x)
    assert torch.equal(s1, s2)
    (g1,) = torch.autograd.grad(s1.sum() + ours.v.sum(), [x])
    (g2,) = torch.autograd.grad(s2.sum() + theirs.v.sum(), [x])
    torch.testing.assert_close(g1, g2, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", list(NEURONS))
def test_neuron_defaults_match_spikingjelly(name):
    ours = inspect.signature(getattr(neuron, name)).parameters
    theirs = inspect.signature(getattr(sj_neuron, name)).parameters
    skip = {"surrogate_function", "backend"}  # spikefuse: None -> Sigmoid(); 'auto'
    for key, param in theirs.items():
        if key in ours and key not in skip:
            assert ours[key].default == param.default, key
