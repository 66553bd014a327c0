"""SpikingJelly semantics that user code relies on, checked against formulas and rules written
out here from SpikingJelly's documentation (SpikingJelly itself is not needed)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from conftest import gen
from spikefuse import SpikefuseError, functional, layer, neuron
from spikefuse import surrogate as sg

F64 = torch.float64


def max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.dtype == F64 and got.shape == want.shape
    return (got - want).abs().max().item()


# ---- surrogates ----------------------------------------------------------------------------------
@pytest.mark.parametrize("alpha", [0.25, 1.0, 2.0, 7.5])
def test_super_spike_is_spikingjellys_for_any_alpha(alpha):
    x = torch.linspace(-4, 4, 2001, dtype=F64)
    want = alpha / (1 + x.abs()) ** 2  # g'(x) = α / (1 + |x|)²
    assert max_err(sg.SuperSpike(alpha).derivative(x), want) <= 1e-12
    assert sg.SuperSpike().alpha == 1.0


@pytest.mark.parametrize("alpha", [0.25, 1.0, 4.0])  # window edges exact in binary
def test_rect_is_spikingjellys(alpha):
    x = torch.cat([torch.linspace(-3, 3, 2001, dtype=F64), torch.tensor([0.5 / alpha], dtype=F64)])
    # g'(x) = α for |x| < 0.5 / α, else 0 (the edge itself is outside)
    want = torch.where(x.abs() < 0.5 / alpha, torch.full_like(x, alpha), torch.zeros_like(x))
    assert max_err(sg.Rect(alpha).derivative(x), want) <= 1e-12
    assert sg.Rect().alpha == 1.0
    # the DATE'22 window is still there under its own name
    window = sg.RectWindow(eta=1.0, th_l=-0.5, th_r=0.5)
    assert max_err(window.derivative(x), sg.Rect().derivative(x)) == 0.0


# SpikingJelly's primitive functions g (spiking=False), written from its documentation.
PRIMITIVES = {
    sg.Sigmoid: lambda x, a: torch.sigmoid(a * x),
    sg.ATan: lambda x, a: torch.atan(math.pi / 2 * a * x) / math.pi + 0.5,
    sg.PiecewiseQuadratic: lambda x, a: torch.where(
        x.abs() <= 1 / a,
        -0.5 * a**2 * x.abs() * x + a * x + 0.5,
        (x > 0).to(x.dtype),
    ),
    sg.PiecewiseExp: lambda x, a: torch.where(
        x < 0, torch.exp(a * x) / 2, 1 - torch.exp(-a * x) / 2
    ),
    sg.SoftSign: lambda x, a: 0.5 * (a * x / (1 + (a * x).abs()) + 1),
    sg.Erf: lambda x, a: 0.5 * torch.special.erfc(-a * x),
    sg.Rect: lambda x, a: torch.clamp(a * x + 0.5, 0, 1),
}


@pytest.mark.parametrize("alpha", [0.7, 3.0])
@pytest.mark.parametrize("cls", list(PRIMITIVES), ids=lambda c: c.__name__)
def test_spiking_false_gives_the_primitive(cls, alpha):
    s = cls(alpha=alpha, spiking=False)
    x = torch.linspace(-3, 3, 1201, dtype=F64).requires_grad_(True)
    y = s(x)
    assert max_err(y.detach(), PRIMITIVES[cls](x.detach(), alpha)) <= 1e-12
    assert torch.equal(cls.primitive_function(x.detach(), alpha), y.detach())  # on the class
    # its autograd derivative is the surrogate (away from kinks)
    (grad,) = torch.autograd.grad(y.sum(), [x])
    keep = (x.detach().abs() * alpha - 0.5).abs() > 1e-6  # Rect's window edges
    keep &= (x.detach().abs() * alpha - 1).abs() > 1e-6  # PiecewiseQuadratic's
    assert max_err(grad[keep], s.derivative(x.detach())[keep]) <= 1e-12
    s.set_spiking_mode(True)
    assert torch.equal(s(x.detach()), (x.detach() >= 0).to(F64))


def test_spiking_mode_in_a_neuron_runs_torch_code():
    node = neuron.IFNode(surrogate_function=sg.Sigmoid(spiking=False), step_mode="m")
    assert node.torch_code is not None and node.program is None
    x = torch.rand(3, 2, 4, generator=gen(9), dtype=F64)
    out = node(x)  # analog outputs g(H - V_th), as in SpikingJelly
    h = x[0]
    torch.testing.assert_close(out[0], torch.sigmoid(4 * (h - 1)), rtol=0, atol=1e-12)
    with pytest.raises(SpikefuseError, match="no primitive function"):
        sg.SuperSpike(spiking=False)(x)
    with pytest.raises(SpikefuseError, match="spiking must be a bool"):
        sg.ATan(spiking="yes")


# ---- Izhikevich: SpikingJelly's default a = 0 and its update order -------------------------------
def izhikevich_reference(
    x_seq,
    v_reset,
    tau=2.0,
    v_c=0.8,
    a0=1.0,
    v_th=1.0,
    v_rest=-0.1,
    w_rest=0.0,
    tau_w=2.0,
    a=0.0,
    b=0.0,
):
    """SpikingJelly's IzhikevichNode, step by step: charge, adaptation, fire, reset."""
    v = torch.full_like(x_seq[0], 0.0 if v_reset is None else v_reset)
    w = torch.full_like(x_seq[0], w_rest)
    spikes = []
    for x in x_seq:
        v = v + (x + a0 * (v - v_rest) * (v - v_c) - w) / tau
        w = w + (a * (v - v_rest) - w) / tau_w
        s = (v - v_th >= 0).to(x.dtype)
        v = v - s * v_th if v_reset is None else (1 - s) * v + s * v_reset
        w = w + b * s
        spikes.append(s)
    return torch.stack(spikes), v, w


@pytest.mark.parametrize("v_reset", [0.0, None], ids=["hard", "soft"])
@pytest.mark.parametrize("kwargs", [{}, {"a": 0.4, "b": 0.2, "tau_w": 3.0}], ids=["default", "a"])
def test_izhikevich_default_a_and_formula(v_reset, kwargs):
    assert neuron.IzhikevichNode().a == 0.0
    x = torch.rand(12, 3, 5, generator=gen(1), dtype=F64) * 1.5
    node = neuron.IzhikevichNode(v_reset=v_reset, step_mode="m", backend="torch", **kwargs)
    s = node(x)
    want_s, want_v, want_w = izhikevich_reference(x, v_reset, **kwargs)
    assert torch.equal(s, want_s) and s.sum() > 0
    assert max_err(node.v, want_v) <= 1e-12 and max_err(node.w, want_w) <= 1e-12


# ---- functional ----------------------------------------------------------------------------------
class Counter(nn.Module):
    """A stateful module that is not a spikefuse module (a user's own, or SpikingJelly's)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.detached = 0

    def forward(self, x):
        self.count += 1
        return x

    def reset(self) -> None:
        self.count = 0

    def detach(self) -> None:
        self.detached += 1


def test_reset_net_resets_every_module_with_reset():
    counter = Counter()
    net = nn.Sequential(layer.Linear(2, 2), neuron.IFNode(), nn.Sequential(counter))
    net(torch.ones(3, 2))
    assert counter.count == 1 and isinstance(net[1].v, torch.Tensor)
    functional.reset_net(net)
    assert counter.count == 0 and net[1].v == 0.0


def test_detach_net_and_node_detach():
    counter = Counter()
    node = neuron.LIFNode(step_mode="m", backend="torch")
    net = nn.Sequential(node, counter)
    x = torch.rand(3, 2, 4, requires_grad=True)
    net(x * 3)
    assert node.v.requires_grad
    value = node.v.clone()
    functional.detach_net(net)
    assert counter.detached == 1 and not node.v.requires_grad and torch.equal(node.v, value)
    # truncated BPTT: the next chunk's graph stops at the detached state
    (grad,) = torch.autograd.grad(node(x).sum(), [x])
    assert grad.shape == x.shape


class SingleStepOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.step_mode = "s"

    def supported_step_mode(self):
        return ("s",)


def test_set_step_mode_validates_before_changing_anything():
    net = nn.Sequential(layer.Linear(2, 3), neuron.LIFNode(), layer.Dropout())
    with pytest.raises(SpikefuseError, match="step_mode must be 's' or 'm', got 'q'"):
        functional.set_step_mode(net, "q")
    assert all(m.step_mode == "s" for m in net)
    net.append(SingleStepOnly())
    with pytest.raises(SpikefuseError, match="nothing was changed"):
        functional.set_step_mode(net, "m")
    assert all(m.step_mode == "s" for m in net)


class PlainStepMode(nn.Module):
    """A user's module with a plain ``step_mode`` attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.step_mode = "s"


def test_set_step_mode_sets_every_module_with_the_attribute():
    net = nn.Sequential(layer.Linear(2, 3), neuron.LIFNode(), nn.Sequential(PlainStepMode()))
    functional.set_step_mode(net, "m")
    assert net[0].step_mode == net[1].step_mode == net[2][0].step_mode == "m"


def test_set_backend_signature_and_instance():
    net = nn.Sequential(neuron.LIFNode(), neuron.IFNode(), layer.Linear(2, 2))
    functional.set_backend(net, "torch", instance=neuron.LIFNode)
    assert net[0].backend == "torch" and net[1].backend == "auto"
    functional.set_backend(net, "cupy", instance=(neuron.LIFNode, neuron.IFNode))
    assert net[0].backend == net[1].backend == "cuda"
    functional.set_backend(net, "auto")
    assert net[0].backend == net[1].backend == "auto"
    with pytest.raises(SpikefuseError, match="unknown backend 'triton'"):
        functional.set_backend(net, "triton")
    assert neuron.LIFNode().supported_backends == ("auto", "torch", "cuda", "cupy")


def test_set_backend_warns_and_keeps_an_unsupported_backend():
    class TorchOnly(nn.Module):
        supported_backends = ("torch",)
        backend = "torch"

    net = nn.Sequential(TorchOnly(), neuron.IFNode())
    with pytest.warns(UserWarning, match="TorchOnly does not support backend='cuda'"):
        functional.set_backend(net, "cuda")
    assert net[0].backend == "torch" and net[1].backend == "cuda"


def test_multi_step_and_seq_to_ann_forward():
    torch.manual_seed(2)
    x = torch.randn(4, 3, 5, generator=gen(3))
    lin = nn.Linear(5, 2)
    node = neuron.IFNode()
    out = functional.multi_step_forward(x, [lin, node])
    functional.reset_net(node)
    want = neuron.IFNode(step_mode="m")(lin(x))
    assert torch.equal(out, want)
    torch.testing.assert_close(functional.seq_to_ann_forward(x, lin), lin(x))
    torch.testing.assert_close(functional.seq_to_ann_forward(x, (lin, nn.ReLU())), lin(x).relu())
    with pytest.raises(SpikefuseError, match=r"\[T, N, \*\]"):
        functional.multi_step_forward(torch.ones(3), node)


def test_node_single_and_multi_step_forward_methods():
    x = torch.rand(5, 2, 3, generator=gen(4), dtype=F64) * 2
    node = neuron.LIFNode(backend="torch")  # step_mode 's'
    multi = node.multi_step_forward(x)
    assert node.step_mode == "s"
    functional.reset_net(node)
    single = torch.stack([node.single_step_forward(x[t]) for t in range(5)])
    assert torch.equal(multi, single)
    node_m = neuron.LIFNode(step_mode="m", backend="torch")
    assert torch.equal(torch.stack([node_m.single_step_forward(x[t]) for t in range(5)]), multi)
    assert node_m.step_mode == "m"


def test_no_warning_for_supported_backend():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        functional.set_backend(nn.Sequential(neuron.LIFNode()), "torch")


def test_neuron_math_is_unchanged_for_plif_threshold_edge():
    # Θ(0) = 1 as in SpikingJelly's heaviside: a potential exactly at threshold spikes
    node = neuron.IFNode(step_mode="m", backend="torch")
    assert node(torch.tensor([[1.0]], dtype=F64)).item() == 1.0
    assert math.isclose(neuron.ParametricLIFNode(init_tau=2.0).w.sigmoid().item(), 0.5)


class Accumulator(neuron.MemoryModule):
    """A stateful module written as in SpikingJelly: a memory and a single_step_forward."""

    def __init__(self):
        super().__init__()
        self.register_memory("acc", 0.0)

    def single_step_forward(self, x):
        self.acc = self.acc + x
        return self.acc


def test_user_memory_module_the_spikingjelly_way():
    acc = Accumulator()
    x = torch.rand(4, 2, 3, generator=gen(10), dtype=F64, requires_grad=True)
    assert torch.equal(acc(x[0]), x[0])
    functional.reset_net(acc)
    assert acc.acc == 0.0
    acc.step_mode = "m"
    out = acc(x)
    torch.testing.assert_close(out, x.cumsum(0), rtol=0, atol=1e-12)
    functional.detach_net(acc)
    assert not acc.acc.requires_grad
    functional.set_step_mode(acc, "s")
    assert acc.step_mode == "s"


def test_register_memory_refuses_a_name_the_module_has():
    acc = Accumulator()
    acc.gain = nn.Parameter(torch.ones(1))
    acc.sub = nn.Linear(1, 1)
    for taken in ("acc", "gain", "sub", "forward", "step_mode"):
        with pytest.raises(AssertionError, match=f"^{taken} has been set as a member variable!"):
            acc.register_memory(taken, 0.0)
    assert acc.acc == 0.0 and isinstance(acc.gain, nn.Parameter)
    assert [name for name, _ in acc.named_memories()] == ["acc"]


def test_deleting_a_memory_unregisters_it():
    acc = Accumulator()
    acc.register_memory("count", 0)
    acc(torch.ones(2))
    del acc.acc
    assert not hasattr(acc, "acc") and dict(acc.named_memories()) == {"count": 0}
    acc.reset()  # does not bring it back
    assert not hasattr(acc, "acc")
    acc.register_memory("acc", 5.0)
    assert acc.acc == 5.0 and acc.memory_default("acc") == 5.0
    acc.other = 1.0
    del acc.other  # other attributes as before
    with pytest.raises(AttributeError):
        del acc.other


def test_chunk_multi_step_forward_carries_state():
    x = torch.rand(10, 2, 3, generator=gen(11), dtype=F64) * 2
    node = neuron.LIFNode(step_mode="m", backend="torch")
    chunked = functional.chunk_multi_step_forward(3, x, node)
    functional.reset_net(node)
    assert torch.equal(chunked, node(x))
    with pytest.raises(SpikefuseError, match="split_size"):
        functional.chunk_multi_step_forward(0, x, node)


class TorchCodeLIF(neuron.LIFNode):
    """A neuron written the SpikingJelly way (its own neuronal_charge)."""

    def neuronal_charge(self, x):
        self.v = self.v + (x - self.v) / self.tau


@pytest.mark.parametrize("make", [neuron.LIFNode, neuron.IzhikevichNode, TorchCodeLIF])
def test_single_step_store_v_seq_appends_each_step(make):
    """SpikingJelly 2.0: in 's' mode each step's V (after the reset) is appended to v_seq
    until reset(); detach() detaches it; changing store_v_seq drops it."""
    node = make(store_v_seq=True)
    xs = torch.rand(4, 2, 3, generator=torch.Generator().manual_seed(0)) * 2
    steps = []
    for x in xs:
        node(x)
        steps.append(node.v.clone())
    assert torch.equal(node.v_seq, torch.stack(steps))
    multi = make(store_v_seq=True, step_mode="m")
    multi(xs)
    torch.testing.assert_close(node.v_seq, multi.v_seq)
    node.reset()
    assert node.v_seq is None
    node(xs[0].requires_grad_())
    node.detach()
    assert node.v_seq.shape == (1, 2, 3) and not node.v_seq.requires_grad
    node.store_v_seq = False
    assert node.v_seq is None
