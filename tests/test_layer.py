"""spikefuse.layer against SpikingJelly's semantics (written out from its documentation):
per-sequence dropout masks, step-mode validation, shapes in multi-step mode, the added layers
and containers."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from conftest import gen
from spikefuse import SpikefuseError, base, functional, layer, neuron

F64 = torch.float64


# ---- Dropout: one mask per sequence until reset() ------------------------------------------------
def test_dropout_multi_step_keeps_one_mask_per_sequence():
    torch.manual_seed(0)
    drop = layer.Dropout(0.5, step_mode="m")
    x = torch.ones(6, 4, 50)
    y = drop(x)
    # every step has the same zero pattern, the kept elements are scaled by 1 / (1 - p)
    assert torch.equal(y, y[:1].expand_as(y))
    assert set(y.unique().tolist()) == {0.0, 2.0}
    # a second call before reset() reuses the mask (the sequence goes on)
    assert torch.equal(drop(x), y)
    functional.reset_net(drop)
    assert drop.mask is None
    y2 = drop(x)
    assert not torch.equal(y2, y)  # a new mask after reset (2^200 patterns)
    assert torch.equal(y2, y2[:1].expand_as(y2))


def test_dropout_single_step_keeps_mask_across_calls():
    torch.manual_seed(1)
    drop = layer.Dropout(0.3)
    x = torch.ones(4, 40)
    first = drop(x)
    for _ in range(3):
        assert torch.equal(drop(x * 3.0), first * 3.0)
    functional.reset_net(drop)
    assert not torch.equal(drop(x), first)


def test_dropout_single_and_multi_step_agree():
    x = torch.randn(5, 3, 8, generator=gen(2))
    torch.manual_seed(3)
    multi = layer.Dropout(0.4, step_mode="m")(x)
    torch.manual_seed(3)
    single = layer.Dropout(0.4)
    assert torch.equal(torch.stack([single(x[t]) for t in range(5)]), multi)


def test_dropout_eval_is_identity_and_draws_no_mask():
    drop = layer.Dropout(0.5, step_mode="m").eval()
    x = torch.randn(3, 2, 5, generator=gen(4))
    assert drop(x) is x and drop.mask is None


def test_dropout_mask_shape_change_needs_reset():
    drop = layer.Dropout(0.5, step_mode="m")
    drop(torch.ones(2, 3, 4))
    with pytest.raises(SpikefuseError, match="reset_net"):
        drop(torch.ones(2, 5, 4))


def test_dropout2d_drops_whole_channels_per_sequence():
    torch.manual_seed(5)
    drop = layer.Dropout2d(p=0.5, step_mode="m")
    assert layer.Dropout2d().p == 0.2  # SpikingJelly's default
    y = drop(torch.ones(4, 3, 16, 5, 5))
    per_channel = y.flatten(3)
    assert torch.equal(per_channel.amin(-1), per_channel.amax(-1))  # a channel is all 0 or all 2
    assert torch.equal(y, y[:1].expand_as(y))
    with pytest.raises(SpikefuseError, match=r"\[N, C, H, W\]"):
        layer.Dropout2d(step_mode="m")(torch.ones(4, 3, 16))


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5, math.nan, "0.5"])
def test_dropout_bad_p(p):
    with pytest.raises(SpikefuseError, match="p must be in"):
        layer.Dropout(p)


# ---- step mode and shapes ------------------------------------------------------------------------
def test_step_mode_assignment_is_validated():
    lin = layer.Linear(3, 2)
    with pytest.raises(SpikefuseError, match="step_mode must be 's' or 'm', got 'z'"):
        lin.step_mode = "z"
    assert lin.step_mode == "s"
    lin.step_mode = "m"
    assert lin.step_mode == "m"


def test_linear_multi_step_rejects_two_dims():
    lin = layer.Linear(4, 2, step_mode="m")
    with pytest.raises(SpikefuseError, match=r"\[T, N, \*\].*got shape \(5, 4\)"):
        lin(torch.randn(5, 4))
    assert lin(torch.randn(5, 3, 4)).shape == (5, 3, 2)


@pytest.mark.parametrize(
    "make,shape",
    [
        (lambda: layer.Conv3d(2, 3, 3, padding=1), (2, 4, 4, 4)),
        (lambda: layer.BatchNorm3d(2), (2, 3, 3, 3)),
        (lambda: layer.GroupNorm(2, 4), (4, 5, 5)),
        (lambda: layer.AvgPool1d(2), (2, 6)),
        (lambda: layer.MaxPool1d(2), (2, 6)),
        (lambda: layer.AvgPool3d(2), (2, 4, 4, 4)),
        (lambda: layer.MaxPool3d(2), (2, 4, 4, 4)),
        (lambda: layer.AdaptiveAvgPool1d(3), (2, 7)),
        (lambda: layer.AdaptiveAvgPool3d(2), (2, 5, 5, 5)),
        (lambda: layer.ConvTranspose1d(2, 3, 3, stride=2), (2, 5)),
        (lambda: layer.ConvTranspose2d(2, 3, 3, stride=2), (2, 5, 5)),
        (lambda: layer.ConvTranspose3d(2, 3, 3, stride=2), (2, 3, 3, 3)),
        (lambda: layer.Upsample(scale_factor=2, mode="nearest"), (2, 3, 3)),
    ],
)
def test_wrapped_layers_multi_step_equals_per_step(make, shape):
    torch.manual_seed(6)
    single, multi = make().eval(), make().eval()
    multi.load_state_dict(single.state_dict())
    multi.step_mode = "m"
    x = torch.randn(3, 2, *shape, generator=gen(7), dtype=F64)
    single.double(), multi.double()
    want = torch.stack([single(x[t]) for t in range(3)])
    torch.testing.assert_close(multi(x), want, rtol=0, atol=1e-12)
    with pytest.raises(SpikefuseError, match=r"multi-step input must be \[T, N, \*\]"):
        multi(torch.randn(4, dtype=F64))


def test_maxpool2d_return_indices_multi_step():
    pool = layer.MaxPool2d(2, return_indices=True, step_mode="m")
    x = torch.randn(3, 2, 4, 6, 6, generator=gen(8))
    out, idx = pool(x)
    want = [nn.MaxPool2d(2, return_indices=True)(x[t]) for t in range(3)]
    assert out.shape == (3, 2, 4, 3, 3) and idx.shape == (3, 2, 4, 3, 3)
    assert torch.equal(out, torch.stack([w[0] for w in want]))
    assert torch.equal(idx, torch.stack([w[1] for w in want]))
    assert torch.equal(nn.MaxUnpool2d(2)(out[0], idx[0]), nn.MaxUnpool2d(2)(*want[0]))


def test_voting_layer():
    vote = layer.VotingLayer(voting_size=3)
    x = torch.arange(14.0).reshape(2, 7)  # remainder 1 is dropped
    torch.testing.assert_close(vote(x), torch.tensor([[1.0, 4.0], [8.0, 11.0]]))
    assert layer.VotingLayer().voting_size == 10
    multi = layer.VotingLayer(2, step_mode="m")
    xs = torch.randn(4, 3, 10, generator=gen(9))
    torch.testing.assert_close(multi(xs), xs.unflatten(-1, (5, 2)).mean(-1))
    with pytest.raises(SpikefuseError, match="voting_size"):
        layer.VotingLayer(0)


# ---- stateful layers and containers --------------------------------------------------------------
@pytest.mark.parametrize("learnable", [False, True])
def test_synapse_filter_formula(learnable):
    T, tau = 6, 3.0
    s = (torch.rand(T, 2, 5, generator=gen(10)) > 0.5).to(F64)
    syn = layer.SynapseFilter(tau=tau, learnable=learnable, step_mode="m").double()
    out = syn(s)
    # learnable: 1/tau = sigmoid(w), w = -ln(tau - 1) rounded to the parameter's float32
    inv_tau = syn.w.detach().sigmoid() if learnable else 1 / tau
    i, want = torch.zeros(2, 5, dtype=F64), []
    for t in range(T):  # I[t] = I[t-1] - (1 - S[t]) I[t-1] / tau + S[t]
        i = i - (1 - s[t]) * i * inv_tau + s[t]
        want.append(i)
    torch.testing.assert_close(out, torch.stack(want), rtol=0, atol=1e-12)
    functional.reset_net(syn)
    assert syn.out_i == 0.0
    assert layer.SynapseFilter().tau == 100.0
    if learnable:
        out.sum().backward()
        assert syn.w.grad is not None


def test_multi_step_container_runs_single_step_modules():
    torch.manual_seed(11)
    node = neuron.LIFNode()
    container = layer.MultiStepContainer(nn.Linear(3, 4), node)
    x = torch.randn(5, 2, 3, generator=gen(12))
    out = container(x)
    functional.reset_net(container)
    ref = neuron.LIFNode(step_mode="m")
    want = ref(container[0](x))
    assert torch.equal(out, want)
    with pytest.raises(SpikefuseError, match="single-step"):
        layer.MultiStepContainer(neuron.IFNode(step_mode="m"))


@pytest.mark.parametrize("stateful", [False, True])
def test_step_mode_container(stateful):
    torch.manual_seed(13)
    inner = [nn.Linear(3, 4), neuron.IFNode()] if stateful else [nn.Linear(3, 4), nn.ReLU()]
    container = layer.StepModeContainer(stateful, "s", *inner)
    net = nn.Sequential(container)
    functional.set_step_mode(net, "m")
    assert container.step_mode == "m" and all(getattr(m, "step_mode", "s") == "s" for m in inner)
    x = torch.randn(4, 2, 3, generator=gen(14))
    out = net(x)
    functional.reset_net(net)
    functional.set_step_mode(net, "s")
    want = torch.stack([net(x[t]) for t in range(4)])
    # the merged [T*B, 3] matmul may round apart from the per-step [B, 3] ones (the CPU's BLAS
    # blocks them differently); the containers' semantics are what this compares
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-7)


def test_element_wise_recurrent_container():
    # SpikingJelly's example: an IF neuron fed back its own spikes, x[0] = 1.5 then 0
    net = layer.ElementWiseRecurrentContainer(
        neuron.IFNode(v_reset=None), element_wise_function=lambda y, x: x + y
    )
    x = torch.zeros(8, 1)
    x[0] = 1.5
    out = [net(x[t]).item() for t in range(8)]
    # v: 1.5 -> spike, v = 0.5; then input = previous spike (1): v = 1.5 -> spike again ...
    assert out == [1.0] * 8
    functional.reset_net(net)
    assert net.y is None
    multi = layer.ElementWiseRecurrentContainer(
        neuron.IFNode(v_reset=None), lambda y, x: x + y, step_mode="m"
    )
    assert multi(x).flatten().tolist() == out


def test_linear_recurrent_container():
    torch.manual_seed(15)
    sub = nn.Sequential(nn.Linear(4, 2), neuron.LIFNode())
    net = layer.LinearRecurrentContainer(sub, in_features=4, out_features=2, step_mode="m")
    x = torch.rand(6, 3, 4, generator=gen(16))
    out = net(x)
    functional.reset_net(net)
    y, want = torch.zeros(3, 2), []
    for t in range(6):  # i[t] = [x[t], y[t-1]] W^T + b, y[t] = sub(i[t])
        y = sub(net.rc(torch.cat([x[t], y], -1)))
        want.append(y)
    assert torch.equal(out, torch.stack(want))
    assert net.rc.in_features == 6 and net.rc.out_features == 4


def test_set_step_mode_keeps_container_contents():
    inner = neuron.IFNode()
    rec = layer.ElementWiseRecurrentContainer(inner, lambda y, x: x + y)
    net = nn.Sequential(layer.Linear(2, 2), rec)
    functional.set_step_mode(net, "m")
    assert net[0].step_mode == "m" and rec.step_mode == "m" and inner.step_mode == "s"


def test_set_step_mode_keeps_sequence_container_contents():
    conv = layer.Conv2d(2, 3, 3, padding=1)
    net = nn.Sequential(
        layer.SeqToANNContainer(conv, layer.BatchNorm2d(3)),
        layer.MultiStepContainer(neuron.IFNode()),
    )
    functional.set_step_mode(net, "m")
    assert conv.step_mode == "s" and net[1][0].step_mode == "s"
    assert net(torch.rand(4, 2, 2, 5, 5, generator=gen(17))).shape == (4, 2, 3, 5, 5)


@pytest.mark.parametrize("container", [layer.SeqToANNContainer, layer.MultiStepContainer])
def test_sequence_containers_are_multi_step_modules(container):
    c = container(nn.Linear(2, 2))
    assert isinstance(c, base.MultiStepModule) and c.supported_step_mode() == ("m",)
    assert not hasattr(c, "step_mode")  # as SpikingJelly's: none until one is assigned
    with pytest.raises(SpikefuseError, match="step_mode must be 'm'"):
        c.step_mode = "s"
    c.step_mode = "m"
    assert c.step_mode == "m"
    with pytest.raises(SpikefuseError, match="step_mode must be 'm'"):
        c.step_mode = "s"
    assert c.step_mode == "m"


def test_set_step_mode_passes_over_a_sequence_container_until_it_has_a_step_mode():
    """SpikingJelly sets only modules that have a ``step_mode``: a fresh container has none."""
    net = nn.Sequential(layer.SeqToANNContainer(nn.Linear(2, 2)), neuron.IFNode(step_mode="m"))
    functional.set_step_mode(net, "s")
    assert net[1].step_mode == "s" and not hasattr(net[0], "step_mode")
    functional.set_step_mode(net, "m")
    assert net[1].step_mode == "m" and not hasattr(net[0], "step_mode")
    net[0].step_mode = "m"
    with pytest.raises(SpikefuseError, match="supports step_mode"):
        functional.set_step_mode(net, "s")
    assert net[0].step_mode == net[1].step_mode == "m"  # nothing changed
    # inside another container a fresh one counts as single-step, as there
    assert len(layer.MultiStepContainer(layer.SeqToANNContainer(nn.ReLU()))) == 1


# ---- Synapses on an input repeated over T ---------------------------------------------------------
class _SynapseBatchSizes(torch.overrides.TorchFunctionMode):
    """Records the batch size of every linear map's or convolution's input."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name == "linear" or name.startswith("conv"):
            self.batches.append(args[0].shape[0])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    ("make", "sample_shape"),
    [
        (lambda: layer.Linear(6, 5, step_mode="m"), (3, 6)),
        (lambda: layer.Conv1d(2, 4, 3, padding=1, step_mode="m"), (3, 2, 7)),
        (lambda: layer.Conv2d(2, 4, 3, padding=1, step_mode="m"), (3, 2, 5, 6)),
        (lambda: layer.ConvTranspose2d(2, 4, 2, stride=2, step_mode="m"), (3, 2, 4, 4)),
    ],
)
def test_synapse_on_an_input_repeated_over_time_runs_once_per_sample(make, sample_shape):
    """images.expand(T, ...) (stride 0 over T): the synapse runs on the N samples once and the
    output is the same dense [T, N, *] sequence, with the same weight gradient."""
    torch.manual_seed(0)
    synapse = make().double()
    sample = torch.randn(sample_shape, dtype=F64, generator=gen(1))
    static = sample.unsqueeze(0).expand(4, *sample_shape)
    with _SynapseBatchSizes() as calls:
        out = synapse(static)
    assert calls.batches == [sample_shape[0]] and out.is_contiguous()  # one call, N samples
    want = synapse(static.contiguous())
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    weights = torch.randn(out.shape, dtype=F64, generator=gen(2))
    (grad,) = torch.autograd.grad((out * weights).sum(), synapse.weight)
    (grad_want,) = torch.autograd.grad((want * weights).sum(), synapse.weight)
    torch.testing.assert_close(grad, grad_want, rtol=1e-12, atol=1e-12)


def test_step_mode_container_takes_the_step_mode_second():
    container = layer.StepModeContainer(False, "m", nn.Flatten(), nn.Linear(4, 2))
    assert container.step_mode == "m" and container(torch.ones(3, 2, 2, 2)).shape == (3, 2, 2)
    with pytest.raises(SpikefuseError, match="takes the step mode second"):
        layer.StepModeContainer(False, nn.Flatten())


def test_seq_to_ann_container_refuses_multi_step_modules():
    with pytest.raises(SpikefuseError, match="SeqToANNContainer: contained modules must be single"):
        layer.SeqToANNContainer(layer.Flatten(step_mode="m"))
    with pytest.raises(SpikefuseError, match="single-step"):
        layer.SeqToANNContainer(neuron.IFNode(step_mode="m"))


class Residual(nn.Sequential):
    def forward(self, x):
        return super().forward(x) + x


@pytest.mark.parametrize("forward", [functional.multi_step_forward, functional.seq_to_ann_forward])
def test_sequence_helpers_call_a_sequential_with_its_own_forward_and_hooks(forward):
    torch.manual_seed(0)
    block, calls = Residual(nn.Linear(3, 3)), []
    block.register_forward_hook(lambda *_: calls.append(1))
    x = torch.randn(2, 4, 3)
    want = torch.stack([block[0](x_t) + x_t for x_t in x])
    calls.clear()
    torch.testing.assert_close(forward(x, block), want)
    assert calls  # the Sequential itself was called
    torch.testing.assert_close(forward(x, [block[0], nn.Identity()]), want - x)  # a list: in turn


def test_seq_to_ann_forward_takes_a_tuple_of_sequences():
    x = torch.randn(3, 2, 1, 4, 4)
    pooled, indices = functional.seq_to_ann_forward(x, nn.MaxPool2d(2, return_indices=True))
    out = functional.seq_to_ann_forward((pooled, indices), nn.MaxUnpool2d(2))
    assert out.shape == x.shape
    want = nn.MaxUnpool2d(2)(*nn.MaxPool2d(2, return_indices=True)(x.flatten(0, 1)))
    torch.testing.assert_close(out, want.unflatten(0, (3, 2)))
    with pytest.raises(SpikefuseError, match="must share"):
        functional.seq_to_ann_forward((pooled, indices[:1]), nn.MaxUnpool2d(2))


def test_wrapped_layers_take_step_mode_positionally_as_spikingjelly():
    assert layer.Linear(3, 4, True, "m").step_mode == "m"
    assert layer.Conv2d(1, 2, 3, 1, 0, 1, 1, True, "zeros", "m").step_mode == "m"
    assert layer.BatchNorm2d(3, 1e-5, 0.1, True, True, "m").step_mode == "m"
    assert layer.MaxPool2d(2, 2, 0, 1, False, False, "m").step_mode == "m"
    assert layer.Flatten(1, -1, "m").step_mode == "m" and layer.Flatten().step_mode == "s"
    with pytest.raises(SpikefuseError, match="step_mode given twice"):
        layer.Linear(3, 4, True, "m", step_mode="m")


def test_synapse_filter_refuses_a_stale_current_of_another_shape():
    filt = layer.SynapseFilter(tau=2.0)
    filt(torch.ones(4, 3))
    with pytest.raises(SpikefuseError, match="reset_net"):
        filt(torch.ones(1, 3))
    functional.reset_net(filt)
    assert filt(torch.ones(1, 3)).shape == (1, 3)
