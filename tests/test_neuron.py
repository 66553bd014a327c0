"""Neuron modules: single-step = multi-step, state semantics, SpikingJelly's constructor API,
backend selection on a CPU-only machine, input validation, and the layer wrappers."""

from __future__ import annotations

import copy
import inspect
import math

import numpy as np
import pytest
import torch
from torch import nn

from conftest import gen, reldiff
from spikefuse import BackendUnavailableError, SpikefuseError, functional, layer, neuron
from spikefuse import surrogate as sg

F64 = torch.float64

# name -> constructor taking the common keyword arguments
NODES = {
    "if": lambda **kw: neuron.IFNode(**kw),
    "lif": lambda **kw: neuron.LIFNode(tau=1.8, **kw),
    "lif_ndi": lambda **kw: neuron.LIFNode(tau=2.4, decay_input=False, **kw),
    "plif": lambda **kw: neuron.ParametricLIFNode(init_tau=2.5, **kw),
    "plif_ndi": lambda **kw: neuron.ParametricLIFNode(init_tau=3.0, decay_input=False, **kw),
    "qif": lambda **kw: neuron.QIFNode(tau=2.5, v_c=0.7, a0=0.8, v_rest=-0.1, **kw),
    "eif": lambda **kw: neuron.EIFNode(tau=2.0, delta_T=0.7, theta_rh=0.6, v_rest=0.05, **kw),
    "izh": lambda **kw: neuron.IzhikevichNode(a0=0.9, tau_w=3.0, a=0.6, b=0.25, w_rest=0.1, **kw),
}


# ---- single-step == multi-step --------------------------------------------------------------------
@pytest.mark.parametrize("v_reset", [-0.1, None], ids=["hard", "soft"])
@pytest.mark.parametrize("name", list(NODES))
def test_single_step_equals_multi_step(name, v_reset):
    g = gen(sum(map(ord, name)) + (v_reset is None))
    T, shape = 5, (3, 4)
    xs = torch.randn(T, *shape, generator=g, dtype=F64) * 0.8 + 0.5
    v0 = torch.randn(shape, generator=g, dtype=F64) * 0.3
    w0 = torch.randn(shape, generator=g, dtype=F64) * 0.2
    gs = torch.randn(T, *shape, generator=g, dtype=F64)
    gvl = torch.randn(shape, generator=g, dtype=F64)

    def run(step_mode):
        node = NODES[name](
            v_reset=v_reset, step_mode=step_mode, backend="torch", surrogate_function=sg.ATan()
        )
        node.v = v0.clone()
        if name == "izh":
            node.w = w0.clone()
        x = xs.clone().requires_grad_(True)
        s = node(x) if step_mode == "m" else torch.stack([node(x[t]) for t in range(T)])
        loss = (s * gs).sum() + (node.v * gvl).sum() + (node.w.sum() if name == "izh" else 0)
        params = list(node.parameters())
        grads = torch.autograd.grad(loss, [x, *params])
        return s.detach(), node, grads

    s_m, node_m, grads_m = run("m")
    s_s, node_s, grads_s = run("s")
    assert torch.equal(s_m, s_s)
    assert 0 < s_m.sum() < s_m.numel()
    assert reldiff(node_s.v.detach(), node_m.v.detach()) < 1e-12
    if name == "izh":
        assert reldiff(node_s.w.detach(), node_m.w.detach()) < 1e-12
    assert reldiff(grads_s[0], grads_m[0]) < 1e-10  # input gradient
    for a, b in zip(grads_s[1:], grads_m[1:], strict=True):  # PLIF's w (float32 parameter)
        assert reldiff(a, b) < 1e-5


# ---- state semantics ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(NODES))
def test_state_persists_across_calls(name):
    g = gen(1)
    xs = torch.randn(7, 5, generator=g) * 0.8 + 0.5
    whole = NODES[name](step_mode="m", backend="torch")
    parts = NODES[name](step_mode="m", backend="torch")
    with torch.no_grad():
        s_whole = whole(xs)
        s_parts = torch.cat([parts(xs[:3]), parts(xs[3:4]), parts(xs[4:])])
    assert torch.equal(s_whole, s_parts)
    torch.testing.assert_close(parts.v, whole.v)
    if name == "izh":
        torch.testing.assert_close(parts.w, whole.w)


@pytest.mark.parametrize("v_reset", [-0.2, None], ids=["hard", "soft"])
@pytest.mark.parametrize("name", list(NODES))
def test_reset_net_restores_state(name, v_reset):
    net = nn.Sequential(
        layer.Linear(4, 6, step_mode="m"),
        NODES[name](v_reset=v_reset, step_mode="m", store_v_seq=True),
    )
    node = net[1]
    x = torch.randn(3, 2, 4, generator=gen(2)) * 3
    with torch.no_grad():
        first = net(x)
        assert isinstance(node.v, torch.Tensor) and node.v_seq is not None
        functional.reset_net(net)
        assert node.v == (0.0 if v_reset is None else v_reset)
        assert node.v_seq is None
        if name == "izh":
            assert node.w == 0.1  # w_rest
        again = net(x)  # same input after reset: same output
    assert torch.equal(first, again)


def test_reset_izhikevich_w_rest():
    node = neuron.IzhikevichNode(w_rest=-0.3, v_reset=0.05, step_mode="m")
    assert node.w == -0.3 and node.v == 0.05
    node(torch.ones(2, 3))
    assert node.w.shape == (3,)
    node.reset()
    assert node.w == -0.3 and node.v == 0.05


@pytest.mark.parametrize("shape", [(4, 3), (1, 2, 3, 5), (3, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_store_v_seq(shape, dtype):
    node = neuron.LIFNode(step_mode="m", store_v_seq=True)
    x = torch.randn(shape, generator=gen(3)).to(dtype)
    node(x)
    assert node.v_seq.shape == x.shape and node.v_seq.dtype == dtype
    torch.testing.assert_close(node.v_seq[-1], node.v.to(dtype))
    plain = neuron.LIFNode(step_mode="m")
    plain(x)
    assert plain.v_seq is None


def test_set_step_mode_and_backend():
    net = nn.Sequential(layer.Linear(3, 4), neuron.LIFNode(), layer.Flatten(), neuron.IFNode())
    functional.set_step_mode(net, "m")
    assert all(m.step_mode == "m" for m in net)
    out = net(torch.randn(2, 5, 3, generator=gen(4)))
    assert out.shape == (2, 5, 4)
    functional.set_step_mode(net, "s")
    assert net(torch.randn(5, 3, generator=gen(4))).shape == (5, 4)
    with pytest.raises(SpikefuseError, match="step_mode must be 's' or 'm'"):
        functional.set_step_mode(net, "multi")
    functional.set_backend(net, "cupy")
    assert net[1].backend == "cuda" and net[3].backend == "cuda"
    functional.set_backend(net, "torch")
    assert net[1].backend == "torch"


# ---- SpikingJelly's constructor API -------------------------------------------------------------
SJ_SIGNATURES = {
    neuron.IFNode: dict(v_threshold=1.0, v_reset=0.0),
    neuron.LIFNode: dict(tau=2.0, decay_input=True, v_threshold=1.0, v_reset=0.0),
    neuron.ParametricLIFNode: dict(init_tau=2.0, decay_input=True, v_threshold=1.0, v_reset=0.0),
    neuron.QIFNode: dict(tau=2.0, v_c=0.8, a0=1.0, v_threshold=1.0, v_rest=0.0, v_reset=-0.1),
    neuron.EIFNode: dict(
        tau=2.0, delta_T=1.0, theta_rh=0.8, v_threshold=1.0, v_rest=0.0, v_reset=-0.1
    ),
    neuron.IzhikevichNode: dict(
        tau=2.0,
        v_c=0.8,
        a0=1.0,
        v_threshold=1.0,
        v_reset=0.0,
        v_rest=-0.1,
        w_rest=0.0,
        tau_w=2.0,
        a=0.0,  # SpikingJelly's default
        b=0.0,
    ),
}
SJ_TAIL = dict(
    surrogate_function=None, detach_reset=False, step_mode="s", backend="auto", store_v_seq=False
)


@pytest.mark.parametrize("cls", list(SJ_SIGNATURES), ids=lambda c: c.__name__)
def test_constructor_signature_and_defaults(cls):
    """Same argument names, order and defaults as SpikingJelly (positional calls keep working)."""
    params = inspect.signature(cls).parameters
    expected = {**SJ_SIGNATURES[cls], **SJ_TAIL}
    assert list(params) == list(expected)
    assert {k: p.default for k, p in params.items()} == expected
    node = cls()
    for k, value in SJ_SIGNATURES[cls].items():
        if k not in ("init_tau", "w_rest"):
            assert getattr(node, k) == value, k
    assert isinstance(node.surrogate_function, sg.Sigmoid) and node.surrogate_function.alpha == 4.0
    assert node.step_mode == "s" and node.detach_reset is False and node.store_v_seq is False
    assert node.v == SJ_SIGNATURES[cls]["v_reset"]


def test_lif_defaults():
    node = neuron.LIFNode()
    assert node.tau == 2.0 and node.decay_input is True
    assert neuron.LIFNode(decay_input=False).decay_input is False
    positional = neuron.LIFNode(3.0, False, 0.5, None)
    assert (positional.tau, positional.decay_input, positional.v_threshold, positional.v_reset) == (
        3.0,
        False,
        0.5,
        None,
    )
    assert positional.v == 0.0  # soft reset starts at 0


@pytest.mark.parametrize("init_tau", [2.0, 1.5, 4.0, 10.0])
def test_plif_init_tau(init_tau):
    node = neuron.ParametricLIFNode(init_tau=init_tau)
    assert isinstance(node.w, nn.Parameter) and node.w.requires_grad
    assert math.isclose(1.0 / node.w.sigmoid().item(), init_tau, rel_tol=1e-6)
    assert list(node.parameters()) == [node.w]
    assert f"tau={init_tau:.4f}" in repr(node)


def test_izhikevich_initial_w():
    assert neuron.IzhikevichNode().w == 0.0
    assert neuron.IzhikevichNode(w_rest=0.25).w == 0.25


# ---- backends ---------------------------------------------------------------------------------
def test_cupy_aliases_cuda():
    assert neuron.LIFNode(backend="cupy").backend == "cuda"
    node = neuron.IFNode()
    node.backend = "cupy"
    assert node.backend == "cuda"


@pytest.mark.parametrize("backend", ["cuda", "cupy"])
def test_cuda_backend_on_cpu_raises(backend):
    node = neuron.LIFNode(step_mode="m", backend=backend)
    with pytest.raises(BackendUnavailableError, match=r"backend 'cuda'.*cpu.*CUDA tensor"):
        node(torch.ones(2, 3))
    assert node.v == 0.0  # nothing ran
    assert issubclass(BackendUnavailableError, SpikefuseError)


def test_auto_backend_runs_torch():
    node = neuron.LIFNode(step_mode="m")
    assert node.backend == "auto" and "ran:" not in repr(node)
    node(torch.ones(2, 3))
    assert node.last_backend == "torch"
    assert "ran: torch" in repr(node)
    torch_node = neuron.LIFNode(step_mode="m", backend="torch")
    torch_node(torch.ones(2, 3))
    assert "backend=torch" in repr(torch_node) and "ran:" not in repr(torch_node)


# ---- validation: every bad input raises SpikefuseError before computing -----------------------------
def _assert_untouched(node, before):
    assert node.v is before or (isinstance(before, torch.Tensor) and torch.equal(node.v, before))


@pytest.mark.parametrize(
    "step_mode,x,match",
    [
        ("m", torch.ones(3), r"step_mode='m' needs input \[T, N, \*\], got shape \(3,\)"),
        ("m", torch.tensor(1.0), r"step_mode='m' needs input \[T, N, \*\]"),
        ("s", torch.tensor(1.0), r"step_mode='s' needs input \[N, \*\], got a scalar"),
        ("m", torch.ones(0, 3), "T = 0"),
        ("m", torch.ones(2, 3, dtype=torch.int64), "floating point, got torch.int64"),
        ("s", torch.ones(3, dtype=torch.int32), "floating point, got torch.int32"),
        ("m", torch.ones(2, 3, dtype=torch.bool), "floating point, got torch.bool"),
        ("m", torch.ones(2, 3, dtype=torch.complex64), "floating point, got torch.complex64"),
        ("m", [[1.0, 2.0]], "must be a torch.Tensor"),
    ],
)
@pytest.mark.parametrize("name", ["lif", "izh"])
def test_bad_input(name, step_mode, x, match):
    node = NODES[name](step_mode=step_mode)
    before = node.v
    with pytest.raises(SpikefuseError, match=match):
        node(x)
    _assert_untouched(node, before)


@pytest.mark.parametrize("name", list(NODES))
def test_state_shape_mismatch(name):
    node = NODES[name](step_mode="m")
    node(torch.ones(2, 3))
    before = node.v.clone()
    with pytest.raises(SpikefuseError, match=r"state v is \(3,\).*needs \(4,\).*reset_net"):
        node(torch.ones(2, 4))
    assert torch.equal(node.v, before)
    functional.reset_net(node)
    assert node(torch.ones(2, 4)).shape == (2, 4)


def test_learnable_parameter_on_other_device():
    node = neuron.ParametricLIFNode(step_mode="m").to("meta")
    with pytest.raises(
        SpikefuseError, match=r"parameters are on meta but the input is on cpu.*\.to"
    ):
        node(torch.ones(2, 3))
    assert node.v == 0.0


def test_state_shape_mismatch_single_step():
    node = neuron.LIFNode()
    node(torch.ones(5, 2))
    with pytest.raises(SpikefuseError, match=r"state v is \(5, 2\)"):
        node(torch.ones(2, 5))


@pytest.mark.parametrize("name", ["lif", "izh"])
def test_state_dtype_mismatch(name):
    node = NODES[name](step_mode="m")
    node(torch.ones(2, 3))
    before = node.v.clone()
    with pytest.raises(
        SpikefuseError, match=r"torch.float32.*needs \(3,\) torch.float64.*reset_net"
    ):
        node(torch.ones(2, 3, dtype=F64))
    assert torch.equal(node.v, before)
    functional.reset_net(node)
    assert node(torch.ones(2, 3, dtype=F64)).dtype == F64


def test_izhikevich_w_state_mismatch():
    node = neuron.IzhikevichNode(step_mode="m")
    node.w = torch.zeros(4)
    with pytest.raises(SpikefuseError, match=r"state w is \(4,\)"):
        node(torch.ones(2, 3))


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: neuron.LIFNode(tau=1.0), "tau must be > 1"),
        (lambda: neuron.LIFNode(tau=0.5, decay_input=False), "tau must be > 1"),
        (lambda: neuron.LIFNode(tau=-2.0), "tau must be > 1"),
        (lambda: neuron.QIFNode(tau=1.0), "tau must be > 1"),
        (lambda: neuron.EIFNode(tau=0.9), "tau must be > 1"),
        (lambda: neuron.EIFNode(delta_T=0.0), "delta_T must be > 0"),
        (lambda: neuron.IzhikevichNode(tau=1.0), "tau must be > 1"),
        (lambda: neuron.IzhikevichNode(tau_w=0.0), "tau_w must be > 0"),  # 1 or 0.8: valid
        # SpikingJelly's asserts: a0 > 0; QIF/EIF under hard reset v_rest >= v_reset
        (lambda: neuron.QIFNode(a0=-1.0), "a0 must be > 0"),
        (lambda: neuron.IzhikevichNode(a0=0.0), "a0 must be > 0"),
        (lambda: neuron.QIFNode(v_rest=-0.5), r"hard reset v_rest must be >= v_reset"),
        (lambda: neuron.EIFNode(v_rest=-0.5), r"hard reset v_rest must be >= v_reset"),
        # bool("no") is True: a string would silently switch the flag on
        (lambda: neuron.LIFNode(detach_reset="no"), "detach_reset must be True or False"),
        (lambda: neuron.LIFNode(decay_input="no"), "decay_input must be True or False"),
        (lambda: neuron.ParametricLIFNode(decay_input=0), "decay_input must be True or False"),
        (lambda: neuron.IFNode(store_v_seq="yes"), "store_v_seq must be True or False"),
        (lambda: neuron.ParametricLIFNode(init_tau=1.0), "init_tau must be finite and > 1"),
        (lambda: neuron.ParametricLIFNode(init_tau=0.3), "init_tau must be finite and > 1"),
        (lambda: neuron.ParametricLIFNode(init_tau=math.nan), "init_tau must be finite and > 1"),
        (lambda: neuron.ParametricLIFNode(init_tau=math.inf), "init_tau must be finite and > 1"),
        (lambda: neuron.LIFNode(tau=math.nan), "tau must be a finite float"),
        (lambda: neuron.LIFNode(tau=math.inf), "tau must be a finite float"),
        (lambda: neuron.QIFNode(v_c=math.nan), "v_c must be a finite float"),
        (lambda: neuron.IFNode(v_threshold=math.nan), "v_threshold must be a finite float"),
        (lambda: neuron.LIFNode(v_threshold=math.inf), "v_threshold must be a finite float"),
        (lambda: neuron.IFNode(v_reset=math.nan), "v_reset must be a finite float"),
        (lambda: neuron.IzhikevichNode(v_reset=-math.inf), "v_reset must be a finite float"),
        (lambda: neuron.LIFNode(tau="2"), "tau must be a finite float"),
        (lambda: neuron.LIFNode(backend="triton"), "unknown backend 'triton'"),
        (lambda: neuron.IFNode(surrogate_function=torch.sigmoid), "surrogate_function must be"),
        (lambda: neuron.IFNode(surrogate_function=nn.Sigmoid()), "surrogate_function must be"),
        (lambda: neuron.IFNode(step_mode="multi"), "step_mode must be 's' or 'm', got 'multi'"),
        (lambda: layer.Linear(2, 3, step_mode="x"), "step_mode must be 's' or 'm'"),
    ],
)
def test_bad_construction(make, match):
    with pytest.raises(SpikefuseError, match=match):
        make()


@pytest.mark.parametrize(
    "attr,value,match",
    [
        ("tau", 1.0, "tau must be > 1"),
        ("tau", math.nan, "tau must be a finite float"),
        ("v_threshold", math.inf, "v_threshold must be a finite float"),
        ("v_reset", math.nan, "v_reset must be a finite float"),
    ],
)
def test_parameter_changed_after_construction_is_checked_before_computing(attr, value, match):
    node = neuron.LIFNode(step_mode="m")
    node(torch.ones(2, 3))
    before = node.v.clone()
    old = getattr(node, attr)
    with pytest.raises(SpikefuseError, match=match):  # checked on assignment
        setattr(node, attr, value)
    assert getattr(node, attr) == old and torch.equal(node.v, before)


def test_bad_attribute_assignment():
    node = neuron.LIFNode()
    with pytest.raises(SpikefuseError, match="unknown backend 'gpu'"):
        node.backend = "gpu"
    with pytest.raises(SpikefuseError, match="step_mode must be 's' or 'm'"):
        node.step_mode = "t"
    assert node.backend == "auto" and node.step_mode == "s"


def test_changing_surrogate_and_reset_updates_program():
    node = neuron.LIFNode(step_mode="m", backend="torch")
    p1 = node.program
    node.surrogate_function = sg.ATan()
    assert node.program is not p1 and node.program.surrogate is node.surrogate_function
    node.v_reset = None
    assert node.program.hard_reset is False
    node.detach_reset = True
    assert node.program.detach_reset is True


# ---- layer wrappers -----------------------------------------------------------------------------
def per_step(module, x_seq):
    return torch.stack([module(x_seq[t]) for t in range(x_seq.shape[0])])


@pytest.mark.parametrize(
    "make,shape",
    [
        (lambda m: (layer.Linear(5, 3, step_mode=m), nn.Linear(5, 3)), (4, 3, 5)),
        (
            lambda m: (layer.Linear(5, 3, bias=False, step_mode=m), nn.Linear(5, 3, bias=False)),
            (1, 7, 5),
        ),
        (
            lambda m: (
                layer.Conv2d(2, 4, 3, padding=1, step_mode=m),
                nn.Conv2d(2, 4, 3, padding=1),
            ),
            (3, 2, 2, 5, 5),
        ),
        (lambda m: (layer.Conv1d(2, 3, 2, step_mode=m), nn.Conv1d(2, 3, 2)), (2, 3, 2, 6)),
        (lambda m: (layer.MaxPool2d(2, step_mode=m), nn.MaxPool2d(2)), (3, 2, 1, 4, 4)),
        (lambda m: (layer.AvgPool2d(2, step_mode=m), nn.AvgPool2d(2)), (3, 2, 1, 4, 4)),
        (
            lambda m: (layer.AdaptiveAvgPool2d(1, step_mode=m), nn.AdaptiveAvgPool2d(1)),
            (2, 3, 2, 5, 3),
        ),
        (lambda m: (layer.Flatten(step_mode=m), nn.Flatten()), (3, 2, 2, 3, 3)),
    ],
)
def test_layer_equals_per_step(make, shape):
    torch.manual_seed(0)
    ours, ref_layer = make("m")
    ref_layer.load_state_dict(ours.state_dict())
    x = (
        torch.randn(shape, generator=gen(5)).transpose(-1, -2)
        if len(shape) == 5
        else torch.randn(shape, generator=gen(5))
    )
    torch.testing.assert_close(ours(x), per_step(ref_layer, x))
    single, _ = make("s")
    single.load_state_dict(ours.state_dict())
    torch.testing.assert_close(single(x[0]), ref_layer(x[0]))
    assert "step_mode=m" in repr(ours)


def test_batchnorm2d():
    bn = layer.BatchNorm2d(3, step_mode="m")
    ref_bn = nn.BatchNorm2d(3)
    x = torch.randn(4, 2, 3, 5, 5, generator=gen(6)) * 2 + 1
    # training: statistics over T*N samples (SpikingJelly's multi-step BN)
    y = bn(x)
    torch.testing.assert_close(y, ref_bn(x.flatten(0, 1)).unflatten(0, (4, 2)))
    torch.testing.assert_close(bn.running_mean, ref_bn.running_mean)
    torch.testing.assert_close(bn.running_var, ref_bn.running_var)
    # eval: per time step
    bn.eval()
    ref_bn.eval()
    torch.testing.assert_close(bn(x), per_step(ref_bn, x))


def test_seq_to_ann_container():
    torch.manual_seed(1)
    conv, bn = nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3)
    container = layer.SeqToANNContainer(conv, bn).eval()
    x = torch.randn(3, 2, 2, 6, 6, generator=gen(7))
    torch.testing.assert_close(container(x), per_step(nn.Sequential(conv, bn), x))
    with pytest.raises(SpikefuseError, match=r"\[T, N, \*\]"):
        container(torch.randn(6))


def test_layer_wrong_rank_raises():
    with pytest.raises(SpikefuseError, match=r"multi-step input must be \[T, N, \*\]"):
        layer.Linear(3, 2, step_mode="m")(torch.randn(3))


def test_snn_in_layers_multi_vs_single_step():
    """A small network: multi-step with wrappers equals running it step by step."""
    torch.manual_seed(2)
    net_m = nn.Sequential(
        layer.Conv2d(1, 2, 3, padding=1),
        layer.BatchNorm2d(2),
        neuron.LIFNode(backend="torch"),
        layer.Flatten(),
        layer.Linear(32, 3),
        neuron.IFNode(backend="torch"),
    )
    net_m.eval()
    net_s = copy.deepcopy(net_m)
    functional.set_step_mode(net_m, "m")
    x = torch.randn(4, 2, 1, 4, 4, generator=gen(8)) * 2
    with torch.no_grad():
        out_m = net_m(x)
        out_s = per_step(net_s, x)
    torch.testing.assert_close(out_m, out_s)


@pytest.mark.parametrize("make", [neuron.LIFNode, neuron.ParametricLIFNode], ids=["LIF", "PLIF"])
def test_decay_input_assigned_after_construction_takes_effect(make):
    """SpikingJelly reads decay_input at every step; it used to be read once, at construction."""
    x = torch.full((3, 2), 0.8)
    node = make(step_mode="m")
    node.decay_input = False
    assert torch.equal(node(x), make(decay_input=False, step_mode="m")(x))
    assert "decay_input=False" in repr(node)
    node.decay_input = True
    functional.reset_net(node)
    assert torch.equal(node(x), make(step_mode="m")(x))


def test_a_node_pickled_with_decay_input_as_a_plain_attribute_loads():
    node = neuron.LIFNode(decay_input=False, step_mode="m")
    state = node.__getstate__()
    state["decay_input"] = state.pop("_decay_input")  # how versions before the property kept it
    old = neuron.LIFNode.__new__(neuron.LIFNode)
    old.__setstate__(state)
    assert old.decay_input is False and old.definition is node.definition


def test_init_tau_accepts_any_real_number():
    node = neuron.ParametricLIFNode(init_tau=np.float32(3.0))
    assert torch.isclose(node.w.sigmoid(), torch.tensor(1 / 3))
    with pytest.raises(SpikefuseError, match="init_tau"):
        neuron.ParametricLIFNode(init_tau=True)


def test_store_v_seq_may_follow_step_mode_positionally_as_in_spikingjelly_2():
    atan = sg.ATan()
    assert neuron.LIFNode(2.0, True, 1.0, 0.0, atan, False, "m", True).store_v_seq  # SJ 2.0
    node = neuron.IFNode(1.0, 0.0, atan, False, "m", "torch", True)  # earlier versions
    assert node.backend == "torch" and node.store_v_seq
    with pytest.raises(SpikefuseError, match="not both"):
        neuron.IFNode(1.0, 0.0, atan, False, "m", True, True)
    izhikevich = neuron.IzhikevichNode(tau_w=1.0, a=0.5, b=0.1, step_mode="m", backend="torch")
    assert izhikevich(torch.rand(3, 2)).shape == (3, 2)


def test_states_move_and_convert_with_the_module():
    node = neuron.LIFNode(step_mode="m", backend="torch")
    node(torch.rand(4, 2) * 2)
    node.double()
    assert node.v.dtype == torch.float64
    node(torch.rand(4, 2, dtype=torch.float64))  # continues, as SpikingJelly's does
    node.half()
    assert node.v.dtype == torch.float32  # the compute dtype of 16-bit input
    node(torch.rand(4, 2, dtype=torch.float16))


def test_half_keeps_a_neurondef_state_unrounded():
    node = neuron.LIFNode(step_mode="m", backend="torch")
    node(torch.rand(4, 2) * 2 + 0.0123456)
    v = node.v.clone()
    node.half()
    assert torch.equal(node.v, v)


def test_anomaly_mode_refuses_a_nan_second_state():
    node = neuron.IzhikevichNode(a=0.5, b=0.1, step_mode="m", backend="torch")
    node(torch.rand(2, 3))
    node.w = torch.full_like(node.w, float("nan"))
    with torch.autograd.detect_anomaly(), pytest.raises(SpikefuseError, match="state w"):
        node(torch.rand(2, 3))
