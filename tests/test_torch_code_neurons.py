"""Neurons and surrogates written the SpikingJelly way, in torch code: subclasses of BaseNode that
override ``neuronal_charge``, SurrogateFunctionBase subclasses, the functional forms and plain
functions as ``surrogate_function``. They run on the torch backend as a per-step loop with
autograd; an explicit cuda backend raises."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from conftest import gen
from spikefuse import BackendUnavailableError, NeuronDef, SpikefuseError, functional, neuron
from spikefuse import surrogate as sg

F64 = torch.float64


class SigmoidSpike(torch.autograd.Function):
    """The test's own Heaviside with SpikingJelly's sigmoid surrogate, α σ(αx)(1 - σ(αx))."""

    @staticmethod
    def forward(ctx, x, alpha):
        ctx.save_for_backward(x)
        ctx.alpha = alpha
        return (x >= 0).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(ctx.alpha * x)
        return grad * ctx.alpha * s * (1 - s), None


# ---- a neuron by its charge in torch code (SpikingJelly's tutorial neuron) -----------------------
class SquareIFNode(neuron.BaseNode):
    def neuronal_charge(self, x: torch.Tensor):
        self.v = self.v + x**2


def square_if_reference(x_seq, v_threshold=1.0, v_reset=0.0, alpha=4.0):
    v = torch.full_like(x_seq[0], v_reset)
    spikes, vs = [], []
    for x in x_seq:
        v = v + x**2
        s = SigmoidSpike.apply(v - v_threshold, alpha)
        v = (1 - s) * v + s * v_reset
        spikes.append(s)
        vs.append(v)
    return torch.stack(spikes), torch.stack(vs)


@pytest.mark.parametrize("step_mode", ["s", "m"])
def test_square_if_node_forward_and_autograd(step_mode):
    x = (torch.rand(7, 3, 4, generator=gen(1), dtype=F64) * 1.2).requires_grad_(True)
    node = SquareIFNode(step_mode=step_mode, store_v_seq=True)
    assert node.backend == "torch" and node.torch_code is not None
    if step_mode == "m":
        s = node(x)
    else:
        s = torch.stack([node(x[t]) for t in range(7)])
    want_s, want_v = square_if_reference(x)
    assert torch.equal(s, want_s) and 0 < s.sum() < s.numel()
    torch.testing.assert_close(node.v, want_v[-1], rtol=0, atol=1e-12)
    torch.testing.assert_close(node.v_seq, want_v, rtol=0, atol=1e-12)  # 's': appended
    g = torch.randn(s.shape, generator=gen(2), dtype=F64)
    (grad,) = torch.autograd.grad((s * g).sum(), [x])
    (want,) = torch.autograd.grad((want_s * g).sum(), [x])
    torch.testing.assert_close(grad, want, rtol=0, atol=1e-12)
    functional.reset_net(node)
    assert node.v == 0.0


def test_square_if_node_single_step_forward_called_directly_appends_v_seq():
    x = torch.rand(5, 3, 4, generator=gen(3), dtype=F64) * 1.2
    node = SquareIFNode(step_mode="m", store_v_seq=True)  # SpikingJelly appends in any mode
    for x_t in x:
        node.single_step_forward(x_t)
    torch.testing.assert_close(node.v_seq, square_if_reference(x)[1], rtol=0, atol=1e-12)


class LeakyNode(neuron.BaseNode):
    """A SpikingJelly-style neuron with its own __init__ calling BaseNode positionally."""

    def __init__(
        self,
        tau=2.0,
        v_threshold=1.0,
        v_reset=0.0,
        surrogate_function=None,
        detach_reset=False,
        step_mode="s",
        backend="torch",
        store_v_seq=False,
    ):
        super().__init__(
            v_threshold, v_reset, surrogate_function, detach_reset, step_mode, backend, store_v_seq
        )
        self.tau = tau

    def neuronal_charge(self, x):
        v_reset = 0.0 if self.v_reset is None else self.v_reset
        self.v = self.v + (x - (self.v - v_reset)) / self.tau


@pytest.mark.parametrize("v_reset", [0.0, None], ids=["hard", "soft"])
@pytest.mark.parametrize("detach_reset", [False, True])
def test_positional_init_subclass_equals_lif(v_reset, detach_reset):
    x = (torch.rand(6, 2, 5, generator=gen(3), dtype=F64) * 2).requires_grad_(True)
    kw = dict(v_reset=v_reset, detach_reset=detach_reset, step_mode="m")
    custom = LeakyNode(tau=1.7, surrogate_function=sg.ATan(), **kw)
    builtin = neuron.LIFNode(tau=1.7, surrogate_function=sg.ATan(), backend="torch", **kw)
    s1, s2 = custom(x), builtin(x)
    assert torch.equal(s1, s2)
    torch.testing.assert_close(custom.v, builtin.v, rtol=0, atol=1e-12)
    (g1,) = torch.autograd.grad(s1.sum() + custom.v.sum(), [x])
    (g2,) = torch.autograd.grad(s2.sum() + builtin.v.sum(), [x])
    torch.testing.assert_close(g1, g2, rtol=0, atol=1e-12)


def test_torch_code_neuron_backends():
    node = SquareIFNode()
    assert node.supported_backends == ("auto", "torch")
    with pytest.raises(BackendUnavailableError, match="Only the torch backend runs torch code"):
        SquareIFNode(backend="cuda")
    with pytest.raises(BackendUnavailableError, match="NeuronDef"):
        node.backend = "cupy"
    assert node.backend == "torch"
    net = nn.Sequential(SquareIFNode(), neuron.IFNode())
    with pytest.warns(UserWarning, match="SquareIFNode does not support backend='cuda'"):
        functional.set_backend(net, "cuda")
    assert net[0].backend == "torch" and net[1].backend == "cuda"
    auto = SquareIFNode(backend="auto")
    auto(torch.ones(2, 3))
    assert auto.last_backend == "torch" and "torch code" in repr(auto)


def test_torch_code_neuron_state_mismatch_raises():
    node = SquareIFNode()
    node(torch.ones(2, 3))
    with pytest.raises(SpikefuseError, match="reset_net"):
        node(torch.ones(4, 3))


def test_base_node_without_definition_or_charge():
    with pytest.raises(TypeError):
        neuron.BaseNode()


# ---- surrogates in torch code --------------------------------------------------------------------
class SJSigmoid(sg.SurrogateFunctionBase):
    """Written as in SpikingJelly (old-style positional super().__init__)."""

    def __init__(self, alpha=4.0, spiking=True):
        super().__init__(alpha, spiking)

    @staticmethod
    def spiking_function(x, alpha):
        return SigmoidSpike.apply(x, alpha)

    @staticmethod
    def primitive_function(x, alpha):
        return (x * alpha).sigmoid()


class SJAtanNewStyle(sg.SurrogateFunctionBase):
    """New-style keyword super().__init__ and a functional form."""

    def __init__(self, alpha=2.0, spiking=True):
        super().__init__(spiking, alpha=alpha)  # SpikingJelly 2.0: spiking first
        assert self.spiking is spiking and self.alpha == alpha

    @staticmethod
    def spiking_function(x, alpha):
        return sg.atan.apply(x, alpha)


def node_pair(name, surrogate_torch, surrogate_kernel):
    makers = {
        "lif": lambda s: neuron.LIFNode(tau=2.3, surrogate_function=s, step_mode="m"),
        "plif": lambda s: neuron.ParametricLIFNode(
            init_tau=2.5, surrogate_function=s, step_mode="m"
        ),
        "izh": lambda s: neuron.IzhikevichNode(a=0.5, b=0.2, surrogate_function=s, step_mode="m"),
    }
    a, b = makers[name](surrogate_torch), makers[name](surrogate_kernel)
    a.double(), b.double()
    b.backend = "torch"
    return a, b


@pytest.mark.parametrize("name", ["lif", "plif", "izh"])
@pytest.mark.parametrize(
    "torch_sg,kernel_sg",
    [
        (SJSigmoid(), sg.Sigmoid()),
        (SJAtanNewStyle(alpha=3.0), sg.ATan(3.0)),
        (lambda x: SigmoidSpike.apply(x, 4.0), sg.Sigmoid()),
    ],
    ids=["sj-class", "sj-new-style", "function"],
)
def test_torch_code_surrogate_equals_expression_surrogate(name, torch_sg, kernel_sg):
    x = (torch.rand(6, 2, 4, generator=gen(4), dtype=F64) * 1.5).requires_grad_(True)
    a, b = node_pair(name, torch_sg, kernel_sg)
    assert a.torch_code is not None and b.torch_code is None
    s1, s2 = a(x), b(x)
    assert torch.equal(s1, s2)
    torch.testing.assert_close(a.v.to(F64), b.v.to(F64), rtol=0, atol=1e-12)
    params_a = [x, *a.parameters()]
    params_b = [x, *b.parameters()]
    ga = torch.autograd.grad((s1 * 1.3).sum() + a.v.sum(), params_a)
    gb = torch.autograd.grad((s2 * 1.3).sum() + b.v.sum(), params_b)
    torch.testing.assert_close(ga[0], gb[0], rtol=0, atol=1e-12)  # dL/dx
    for u, w in zip(ga[1:], gb[1:], strict=True):  # PLIF's w
        torch.testing.assert_close(u.to(F64), w.to(F64), rtol=1e-12, atol=0)


def test_torch_code_surrogate_cuda_raises_at_forward():
    node = neuron.LIFNode(surrogate_function=SJSigmoid(), backend="cuda", step_mode="m")
    with pytest.raises(BackendUnavailableError, match="surrogate_function .* is torch code"):
        node(torch.ones(2, 3))


def test_surrogate_function_base_spiking_mode():
    s = SJSigmoid(alpha=2.0, spiking=False)
    x = torch.linspace(-2, 2, 9, dtype=F64)
    torch.testing.assert_close(s(x), torch.sigmoid(2 * x))
    s.set_spiking_mode(True)
    assert s(x).tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 1]
    assert repr(s) == "SJSigmoid(alpha=2.0, spiking=True)"


@pytest.mark.parametrize(
    "fn,cls",
    [
        (sg.sigmoid, sg.Sigmoid),
        (sg.atan, sg.ATan),
        (sg.piecewise_quadratic, sg.PiecewiseQuadratic),
        (sg.piecewise_exp, sg.PiecewiseExp),
        (sg.soft_sign, sg.SoftSign),
        (sg.super_spike, sg.SuperSpike),
        (sg.erf, sg.Erf),
        (sg.rect, sg.Rect),
    ],
)
def test_functional_forms(fn, cls):
    x = torch.linspace(-3, 3, 301, dtype=F64).requires_grad_(True)
    y = fn.apply(x, 1.7)
    assert torch.equal(y, (x >= 0).to(F64))
    (grad,) = torch.autograd.grad(y.sum(), [x])
    torch.testing.assert_close(grad, cls(1.7).derivative(x.detach()), rtol=0, atol=0)


@pytest.mark.parametrize("bad", [torch.sigmoid, nn.Sigmoid(), 3.0, "sigmoid"])
def test_non_surrogates_rejected(bad):
    with pytest.raises(SpikefuseError, match="surrogate_function must be"):
        neuron.LIFNode(surrogate_function=bad)
    with pytest.raises(SpikefuseError, match="surrogate_function must be"):
        SquareIFNode(surrogate_function=bad)


def test_switching_back_to_a_kernel_surrogate():
    node = neuron.LIFNode(surrogate_function=SJSigmoid(), step_mode="m")
    assert node.program is None and node.torch_code is not None
    node.surrogate_function = sg.Sigmoid()
    assert node.program is not None and node.torch_code is None
    assert math.isfinite(node(torch.ones(2, 3)).sum().item())


def test_subclass_of_a_builtin_neuron_with_torch_charge():
    class NoLeakInputLIF(neuron.LIFNode):
        def neuronal_charge(self, x):
            self.v = self.v - (self.v - self.v_reset) / self.tau + x

    x = torch.rand(5, 2, 3, generator=gen(5), dtype=F64) * 1.5
    custom = NoLeakInputLIF(tau=2.5, step_mode="m")
    builtin = neuron.LIFNode(tau=2.5, decay_input=False, step_mode="m", backend="torch")
    assert custom.supported_backends == ("auto", "torch")
    assert torch.equal(custom(x), builtin(x))
    torch.testing.assert_close(custom.v, builtin.v.to(F64), rtol=0, atol=1e-12)


def test_the_same_neuron_as_a_neuron_def_gets_every_backend():
    """The README's porting route: SquareIFNode's charge as a NeuronDef, same numbers."""
    square_if = NeuronDef("square_if", charge="v + x**2")
    x = (torch.rand(6, 2, 3, generator=gen(6), dtype=F64) * 1.2).requires_grad_(True)
    kernel_node = neuron.BaseNode(square_if, step_mode="m", backend="torch")
    assert kernel_node.torch_code is None and "cuda" in kernel_node.supported_backends
    torch_node = SquareIFNode(step_mode="m")
    s1, s2 = kernel_node(x), torch_node(x)
    assert torch.equal(s1, s2)
    (g1,) = torch.autograd.grad(s1.sum() + kernel_node.v.sum(), [x])
    (g2,) = torch.autograd.grad(s2.sum() + torch_node.v.sum(), [x])
    torch.testing.assert_close(g1, g2, rtol=0, atol=1e-12)


class SquareSimpleNode(neuron.SimpleBaseNode):
    def neuronal_charge(self, x):
        self.v = self.v + x**2


def test_simple_base_node_spikingjelly_2():
    node = SquareSimpleNode(v_reset=0.3, step_mode="m")
    assert node.v == 0.0  # SpikingJelly 2.0: V starts at 0, not at V_reset
    x = torch.rand(5, 2, 3, generator=gen(7), dtype=F64) * 1.2
    s = node(x)
    v, want = torch.zeros_like(x[0]), []
    for t in range(5):
        v = v + x[t] ** 2
        spike = (v >= 1.0).to(F64)
        v = (1 - spike) * v + spike * 0.3
        want.append(spike)
    assert torch.equal(s, torch.stack(want))
    torch.testing.assert_close(node.v, v, rtol=0, atol=1e-12)
    functional.reset_net(node)
    assert node.v == 0.0 and node.supported_backends == ("auto", "torch")
    with pytest.raises(NotImplementedError, match="neuronal_charge"):
        neuron.SimpleBaseNode()(torch.ones(2))


def test_surrogate_spiking_mode_switch_reaches_its_neurons():
    """Switching a surrogate back to spiking mode gives its neurons their program back."""
    s = sg.ATan(spiking=False)
    node = neuron.LIFNode(surrogate_function=s, step_mode="m", backend="torch")
    x = torch.rand(3, 4, generator=gen(7))
    node(x)
    node.reset()
    assert node.program is None and node.torch_code is not None
    s.set_spiking_mode(True)
    spikes = node(x)
    assert node.program is not None and node.torch_code is None
    assert set(spikes.unique().tolist()) <= {0.0, 1.0}
    node.reset()
    s.set_spiking_mode(False)
    assert node.program is None
    node(x)


def test_torch_code_neurons_are_never_fused():
    """fuse() keeps a subclass's own neuronal_charge (never the LIF kernels)."""
    from spikefuse import fuse, layer
    from spikefuse.fused import FusedBlock

    class MyLIF(neuron.LIFNode):
        def neuronal_charge(self, x):
            self.v = self.v + 2 * x

    model = torch.nn.Sequential(layer.Linear(3, 4, step_mode="m"), MyLIF(step_mode="m"))
    fused, report = fuse(model, return_report=True)
    assert not report.fused and "runs torch code" in report.skipped[0].reason
    x = torch.rand(3, 2, 3, generator=gen(8))
    assert torch.equal(fused(x), model(x))
    with pytest.raises(SpikefuseError, match="runs torch code"):
        FusedBlock(torch.nn.Linear(3, 4), None, MyLIF(step_mode="m"))


def test_overridden_step_methods_run_as_in_spikingjelly():
    """forward runs a subclass's single_step_forward (SpikingJelly dispatches to it)."""

    class Boosted(neuron.LIFNode):
        def single_step_forward(self, x):
            return super().single_step_forward(x + 10)

    node = Boosted(backend="torch")
    assert torch.equal(node(torch.zeros(4)), torch.ones(4))
    node.reset()
    assert torch.equal(node.single_step_forward(torch.zeros(4)), torch.ones(4))


def test_torch_code_neuron_supports_double_backward():
    """What the kernels' double-backward error recommends: a torch-code neuron is plain
    autograd, so second derivatives exist (and agree with a finite difference of the first)."""

    class TorchLIF(neuron.BaseNode):
        def neuronal_charge(self, x):
            self.v = self.v + (x - self.v) / 2.0

    def first_grad(x):
        node = TorchLIF(step_mode="m", surrogate_function=sg.Sigmoid())
        (g,) = torch.autograd.grad(node(x * 3).sum(), x, create_graph=True)
        return g

    x = torch.randn(4, 3, dtype=F64, generator=torch.Generator().manual_seed(0)).requires_grad_()
    (second,) = torch.autograd.grad(first_grad(x).sum(), x)
    eps = 1e-6
    bump = torch.zeros_like(x)
    bump[1, 2] = eps
    numeric = (first_grad(x + bump).sum() - first_grad(x - bump).sum()) / (2 * eps)
    torch.testing.assert_close(second[1, 2], numeric.detach(), rtol=1e-5, atol=1e-7)
    with pytest.raises(SpikefuseError, match="write the neuron as torch code"):
        node = neuron.LIFNode(step_mode="m", backend="torch")
        (g,) = torch.autograd.grad(node(x * 3).sum(), x, create_graph=True)
        torch.autograd.grad(g.sum(), x)


def test_spikingjelly_2_functional_neuron_api_is_refused_clearly():
    class Functional(neuron.BaseNode):
        def single_step_functional_forward(self, inputs, states, **kwargs):
            return inputs, states

    with pytest.raises(SpikefuseError, match="single_step_functional_forward"):
        Functional(step_mode="m")


class AddIF(neuron.BaseNode):
    def neuronal_charge(self, x):
        self.v = self.v + x


class HalvedIF(AddIF):
    def single_step_forward(self, x):
        return super().single_step_forward(x) * 0.5


def test_an_overridden_single_step_forward_runs_in_multi_step_mode():
    x = torch.ones(3, 2) * 1.5
    assert torch.equal(HalvedIF(step_mode="m")(x), torch.full((3, 2), 0.5))


def test_torch_code_state_keeps_the_input_dtype_when_moved():
    node = neuron.LIFNode(surrogate_function=SJSigmoid(), step_mode="m")
    x = torch.rand(3, 2, dtype=torch.float16) * 2
    node(x)
    node.cpu()
    assert node.v.dtype == torch.float16
    node(x)


def test_torch_code_neurons_check_threshold_and_reset():
    with pytest.raises(SpikefuseError, match="v_threshold must be > v_reset"):
        AddIF(v_threshold=-1.0, v_reset=0.0)
    node = AddIF()
    with pytest.raises(SpikefuseError, match="finite"):
        node.v_threshold = float("nan")
    with pytest.raises(SpikefuseError, match="v_threshold must be > v_reset"):
        node.v_reset = 5.0
    node.v_reset = None  # soft reset: any threshold
    node.v_threshold = -1.0
