"""The reference backend: golden trajectories computed by hand, explicit BPTT against the plain
autograd oracle for every neuron × surrogate × reset × detach_reset, and the module path."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from conftest import reldiff, seed_of
from oracle import oracle
from spikefuse import definitions as defs
from spikefuse import neuron
from spikefuse import reference as ref
from spikefuse import surrogate as sg
from spikefuse.program import NeuronProgram

F64 = torch.float64


# ================================================================================================
# (a) golden trajectories
# ================================================================================================
# Plain-float charge equations written from the specification (vr is V_reset, 0 under soft reset).
def _charge(name, v, x, w, p, vr):
    if name == "if":
        return v + x
    if name == "lif":
        return v + (x - (v - vr)) / p["tau"]
    if name == "lif_ndi":
        return v - (v - vr) / p["tau"] + x
    if name == "plif":
        return v + (x - (v - vr)) * p["decay"]
    if name == "plif_ndi":
        return v - (v - vr) * p["decay"] + x
    if name == "qif":
        return v + (x + p["a0"] * (v - p["v_rest"]) * (v - p["v_c"])) / p["tau"]
    if name == "eif":
        return (
            v
            + (x - (v - p["v_rest"]) + p["delta_T"] * math.exp((v - p["theta_rh"]) / p["delta_T"]))
            / p["tau"]
        )
    if name == "izh":
        return v + (x + p["a0"] * (v - p["v_rest"]) * (v - p["v_c"]) - w) / p["tau"]
    raise AssertionError(name)


def simulate(name, xs, p, vth, v_reset, v0, w0=0.0):
    """One neuron, plain Python floats. Returns spikes, v sequence, w sequence."""
    vr = 0.0 if v_reset is None else v_reset
    v, w, spikes, vs, ws = v0, w0, [], [], []
    for x in xs:
        h = _charge(name, v, x, w, p, vr)
        s = 1.0 if h >= vth else 0.0
        if name == "izh":
            w = w + (p["a"] * (h - p["v_rest"]) - w) / p["tau_w"] + p["b"] * s
        v = h * (1 - s) + v_reset * s if v_reset is not None else h - vth * s
        spikes.append(s)
        vs.append(v)
        ws.append(w)
    return spikes, vs, ws


# name -> (module constructor, parameter values in the charge equations)
MODULES = {
    "if": (lambda **kw: neuron.IFNode(**kw), {}),
    "lif": (lambda **kw: neuron.LIFNode(tau=1.7, **kw), {"tau": 1.7}),
    "lif_ndi": (lambda **kw: neuron.LIFNode(tau=2.3, decay_input=False, **kw), {"tau": 2.3}),
    # init_tau=2 -> decay = sigmoid(0) = 0.5 exactly
    "plif": (lambda **kw: neuron.ParametricLIFNode(init_tau=2.0, **kw), {"decay": 0.5}),
    "plif_ndi": (
        lambda **kw: neuron.ParametricLIFNode(init_tau=2.0, decay_input=False, **kw),
        {"decay": 0.5},
    ),
    "qif": (
        lambda **kw: neuron.QIFNode(tau=2.5, v_c=0.7, a0=0.8, v_rest=-0.1, **kw),
        {"tau": 2.5, "a0": 0.8, "v_rest": -0.1, "v_c": 0.7},
    ),
    "eif": (
        lambda **kw: neuron.EIFNode(tau=2.0, delta_T=0.7, theta_rh=0.6, v_rest=0.05, **kw),
        {"tau": 2.0, "v_rest": 0.05, "delta_T": 0.7, "theta_rh": 0.6},
    ),
    "izh": (
        lambda **kw: neuron.IzhikevichNode(
            tau=2.0, v_c=0.8, a0=0.9, v_rest=-0.1, tau_w=3.0, a=0.6, b=0.25, **kw
        ),
        {"tau": 2.0, "a0": 0.9, "v_rest": -0.1, "v_c": 0.8, "a": 0.6, "tau_w": 3.0, "b": 0.25},
    ),
}


@pytest.mark.parametrize("v_reset", [0.0, None], ids=["hard", "soft"])
def test_golden_if(v_reset):
    node = neuron.IFNode(v_reset=v_reset, step_mode="m", backend="torch", store_v_seq=True)
    s = node(torch.tensor([[0.6], [0.6], [0.6], [-0.3], [1.2]], dtype=F64))
    assert s.flatten().tolist() == [0, 1, 0, 0, 1]
    want_v = [0.6, 0.0, 0.6, 0.3, 0.0] if v_reset is not None else [0.6, 0.2, 0.8, 0.5, 0.7]
    assert reldiff(node.v_seq.flatten(), torch.tensor(want_v, dtype=F64)) < 1e-12


@pytest.mark.parametrize("v_reset", [0.0, None], ids=["hard", "soft"])
def test_golden_lif(v_reset):
    # tau = 2: h1 = 0.5; h2 = 0.5 + (1.5 - 0.5)/2 = 1.0 (spikes: Θ(0) = 1); h3 = 0.2; h4 = 1.1
    node = neuron.LIFNode(
        tau=2.0, v_reset=v_reset, step_mode="m", backend="torch", store_v_seq=True
    )
    s = node(torch.tensor([[1.0], [1.5], [0.4], [2.0]], dtype=torch.float32))
    assert s.flatten().tolist() == [0, 1, 0, 1]
    want_v = [0.5, 0.0, 0.2, 0.0] if v_reset is not None else [0.5, 0.0, 0.2, 0.1]
    assert reldiff(node.v_seq.flatten(), torch.tensor(want_v)) < 1e-6


@pytest.mark.parametrize("v_reset", [0.0, None], ids=["hard", "soft"])
def test_golden_izhikevich(v_reset):
    # tau=2, a0=1, v_rest=-0.1, v_c=0.8, tau_w=2, a=1, b=0.5, V0 = W0 = 0, x = 1, 2, 0
    # t1: h = (1 + 0.1*(-0.8))/2 = 0.46, w = (0.46 + 0.1)/2 = 0.28
    # t2: h = 0.46 + (2 + 0.56*(-0.34) - 0.28)/2 = 1.2248 -> spike,
    #     w = 0.28 + (1.3248 - 0.28)/2 + 0.5 = 1.3024
    # t3 hard: h = (0.1*(-0.8) - 1.3024)/2 = -0.6912, w = 1.3024 + (-0.5912 - 1.3024)/2 = 0.3556
    # t3 soft: v = 0.2248, h = 0.2248 + (0.3248*(-0.5752) - 1.3024)/2 = -0.51981248,
    #          w = 1.3024 + (-0.41981248 - 1.3024)/2 = 0.44129376
    node = neuron.IzhikevichNode(
        a=1.0, b=0.5, v_reset=v_reset, step_mode="m", backend="torch", store_v_seq=True
    )
    s = node(torch.tensor([[1.0], [2.0], [0.0]], dtype=F64))
    assert s.flatten().tolist() == [0, 1, 0]
    if v_reset is not None:
        want_v, want_w = [0.46, 0.0, -0.6912], 0.3556
    else:
        want_v, want_w = [0.46, 0.2248, -0.51981248], 0.44129376
    assert reldiff(node.v_seq.flatten(), torch.tensor(want_v, dtype=F64)) < 1e-12
    assert abs(node.w.item() - want_w) < 1e-12


@pytest.mark.parametrize("v_reset", [-0.1, None], ids=["hard", "soft"])
@pytest.mark.parametrize("name", list(MODULES))
def test_golden_every_neuron(name, v_reset):
    """Module forward (float64) against a plain-Python simulation, non-zero initial states."""
    make, p = MODULES[name]
    g = torch.Generator().manual_seed(seed_of(name, v_reset))
    T, N, vth = 5, 6, 0.9
    xs = torch.rand(T, N, generator=g, dtype=F64) * 2.4 - 0.3
    v0 = torch.rand(N, generator=g, dtype=F64) * 0.8 - 0.2
    w0 = torch.rand(N, generator=g, dtype=F64) * 0.4 - 0.2
    node = make(v_threshold=vth, v_reset=v_reset, step_mode="m", backend="torch", store_v_seq=True)
    node.v = v0.clone()
    if name == "izh":
        node.w = w0.clone()
    s = node(xs)
    for n in range(N):
        spikes, vs, ws = simulate(
            name, xs[:, n].tolist(), p, vth, v_reset, v0[n].item(), w0[n].item()
        )
        assert s[:, n].tolist() == spikes, n
        assert reldiff(node.v_seq[:, n], torch.tensor(vs, dtype=F64)) < 1e-12
        if name == "izh":
            assert abs(node.w[n].item() - ws[-1]) < 1e-12
    assert 0 < s.sum() < s.numel()


# ================================================================================================
# (b) fptt + bptt against the oracle, float64
# ================================================================================================
# name -> (definition, parameter values, learnable)
DEFINITIONS = {
    "if": (defs.IF, {}, ()),
    "lif": (defs.LIF, {"tau": 1.7}, ()),
    "lif_ndi": (defs.LIF_NO_DECAY_INPUT, {"tau": 2.3}, ()),
    "plif": (defs.PLIF, {"decay_logit": 0.4}, ("decay_logit",)),
    "plif_ndi": (defs.PLIF_NO_DECAY_INPUT, {"decay_logit": -0.6}, ("decay_logit",)),
    "qif": (defs.QIF, {"tau": 2.5, "a0": 0.8, "v_rest": -0.1, "v_c": 0.7}, ()),
    "eif": (defs.EIF, {"tau": 2.0, "v_rest": 0.05, "delta_T": 0.7, "theta_rh": 0.6}, ()),
    "izh": (
        defs.IZHIKEVICH,
        {"tau": 2.0, "a0": 0.9, "v_rest": -0.1, "v_c": 0.8, "a": 0.6, "tau_w": 3.0, "b": 0.25},
        (),
    ),
}
SURROGATES = {cls.__name__: cls for cls in sg.ALL}


@functools.cache
def program(name, surrogate, hard, detach, learnable=None):
    definition, _, default_learnable = DEFINITIONS[name]
    learnable = default_learnable if learnable is None else learnable
    return NeuronProgram(definition, SURROGATES[surrogate](), hard, detach, learnable)


def check_bptt_against_oracle(prog, params, hard, T, shape, seed, vth=0.9):
    d = prog.definition
    g = torch.Generator().manual_seed(seed)

    def randn(*size, scale=1.0, shift=0.0):
        return torch.randn(size, generator=g, dtype=F64) * scale + shift

    consts = [vth, -0.15 if hard else 0.0] + [
        params[k] for k in d.params if k not in prog.learnable
    ]
    lrn = torch.tensor([params[k] for k in prog.learnable], dtype=torch.float32)
    # non-contiguous x: [T, *shape] seen through a transpose of the last two dims
    xs = (
        randn(T, *shape[::-1], scale=0.8, shift=0.4).transpose(-1, -2)
        if len(shape) > 1
        else randn(T, *shape, scale=0.8, shift=0.4)
    )
    v0 = randn(*shape, scale=0.3)
    w0 = randn(*shape, scale=0.2) if d.adaptive else torch.empty(0, dtype=F64)

    w0_in = w0 if d.adaptive else None
    lrn_in = lrn if prog.learnable else None
    init = [0.0, 0.0]
    out = ref.fptt(
        prog, xs, v0, w0_in, lrn_in, consts, init, save_for_backward=True, store_v_seq=True
    )
    gs, gv, gvl = randn(*xs.shape), randn(*xs.shape), randn(*shape)
    gwl = randn(*shape) if d.adaptive else None
    keep_x = xs if ref.keeps_x(prog) else None
    back = ref.bptt(
        prog, gs, gv, gvl, gwl, out.saved_v, out.saved_w, keep_x, v0, w0_in, lrn_in, consts, init
    )

    xo, v0o, w0o = (t.clone().requires_grad_() for t in (xs, v0, w0))
    lo = lrn.to(F64).requires_grad_()
    s, vs, vl, wl = oracle(prog, xo, v0o, w0o, lo, consts)
    assert torch.equal(out.spikes, s.detach())
    assert reldiff(out.v_seq, vs.detach()) < 1e-12
    assert reldiff(out.v_last, vl.detach()) < 1e-12
    loss = (s * gs).sum() + (vs * gv).sum() + (vl * gvl).sum()
    if d.adaptive:
        assert reldiff(out.w_last, wl.detach()) < 1e-12
        loss = loss + (wl * gwl).sum()
    inputs = [xo, v0o] + ([w0o] if d.adaptive else []) + ([lo] if prog.learnable else [])
    grads = list(torch.autograd.grad(loss, inputs))
    assert reldiff(back.grad_x, grads.pop(0)) < 1e-10
    assert reldiff(back.grad_v0, grads.pop(0)) < 1e-10
    if d.adaptive:
        assert reldiff(back.grad_w0, grads.pop(0)) < 1e-10
    if prog.learnable:
        assert reldiff(back.grad_learnable, grads.pop(0)) < 1e-10
    return s


@pytest.mark.parametrize("detach", [False, True], ids=["attached", "detach"])
@pytest.mark.parametrize("hard", [True, False], ids=["hard", "soft"])
@pytest.mark.parametrize("surrogate", list(SURROGATES))
@pytest.mark.parametrize("name", list(DEFINITIONS))
def test_bptt_matches_oracle(name, surrogate, hard, detach):
    prog = program(name, surrogate, hard, detach)
    seed = seed_of(name, surrogate, hard, detach)
    s = check_bptt_against_oracle(prog, DEFINITIONS[name][1], hard, T=7, shape=(5, 3), seed=seed)
    assert 0 < s.sum() < s.numel()


@pytest.mark.parametrize("hard", [True, False], ids=["hard", "soft"])
@pytest.mark.parametrize("name", list(DEFINITIONS))
def test_bptt_matches_oracle_single_step(name, hard):
    """T = 1 and an odd 1-D shape."""
    prog = program(name, "Sigmoid", hard, False)
    check_bptt_against_oracle(prog, DEFINITIONS[name][1], hard, T=1, shape=(7,), seed=11)


@pytest.mark.parametrize(
    "name,learnable",
    [
        ("lif", ("tau",)),
        ("lif_ndi", ("tau",)),
        ("qif", ("tau", "a0", "v_rest", "v_c")),
        ("eif", ("tau", "v_rest", "delta_T", "theta_rh")),
        ("izh", ("tau", "a0", "v_c")),
    ],
)
def test_learnable_charge_parameters(name, learnable):
    """Any charge parameter can be learnable: its gradient is Σ dL/dH ∂H/∂p."""
    for hard in (True, False):
        prog = program(name, "ATan", hard, False, learnable)
        check_bptt_against_oracle(prog, DEFINITIONS[name][1], hard, T=6, shape=(4, 3), seed=5)


@pytest.mark.parametrize("learnable", [("a",), ("tau_w",), ("b",), ("v_rest",)])
def test_learnable_adaptation_parameter_is_rejected(learnable):
    """Gradients of adaptation parameters are not derived: such a learnable is refused."""
    from spikefuse import SpikefuseError

    with pytest.raises(SpikefuseError, match="only in the charge"):
        program("izh", "Sigmoid", True, False, learnable)


def test_bptt_without_upstream_v_grads():
    """grad_v_seq / grad_v_last / grad_w_last may be None (only spikes reach the loss)."""
    prog = program("izh", "ATan", True, False)
    d, params = prog.definition, DEFINITIONS["izh"][1]
    g = torch.Generator().manual_seed(8)
    consts = [1.0, 0.0] + [params[k] for k in d.params]
    xs = torch.randn(5, 4, generator=g, dtype=F64) + 0.5
    v0, w0 = torch.zeros(4, dtype=F64), torch.full((4,), 0.1, dtype=F64)
    out = ref.fptt(
        prog,
        xs,
        v0,
        w0,
        learnable=None,
        constants=consts,
        init=[0.0, 0.0],
        save_for_backward=True,
        store_v_seq=False,
    )
    assert out.v_seq is None
    gs = torch.randn(xs.shape, generator=g, dtype=F64)
    back = ref.bptt(
        prog,
        gs,
        grad_v_seq=None,
        grad_v_last=None,
        grad_w_last=None,
        saved_v=out.saved_v,
        saved_w=out.saved_w,
        x_seq=None,
        v0=v0,
        w0=w0,
        learnable=None,
        constants=consts,
        init=[0.0, 0.0],
    )
    xo, v0o, w0o = (t.clone().requires_grad_() for t in (xs, v0, w0))
    s, *_ = oracle(prog, xo, v0o, w0o, torch.empty(0), consts)
    gx, gv0, gw0 = torch.autograd.grad((s * gs).sum(), [xo, v0o, w0o])
    assert reldiff(back.grad_x, gx) < 1e-10
    assert reldiff(back.grad_v0, gv0) < 1e-10
    assert reldiff(back.grad_w0, gw0) < 1e-10


def test_fptt_float32_and_half_dtypes():
    """Arithmetic in float32 for float32/float16 input; outputs in the input dtype."""
    prog = program("lif", "Sigmoid", True, False)
    g = torch.Generator().manual_seed(9)
    x64 = torch.randn(4, 6, generator=g, dtype=F64) + 0.8
    no_w_or_learnable = dict(
        w0=None,
        learnable=None,
        constants=[1.0, 0.0, 1.7],
        init=[0.0, 0.0],
        save_for_backward=True,
        store_v_seq=True,
    )
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        xs = x64.to(dtype)
        out = ref.fptt(prog, xs, torch.zeros(6), **no_w_or_learnable)
        assert out.spikes.dtype == dtype and out.v_seq.dtype == dtype
        assert out.v_last.dtype == torch.float32 and out.saved_v.dtype == torch.float32
        out64 = ref.fptt(prog, xs.to(F64), torch.zeros(6, dtype=F64), **no_w_or_learnable)
        assert reldiff(out.saved_v, out64.saved_v) < 1e-6


@pytest.mark.parametrize("name", ["lif", "izh"])
def test_constant_initial_state_equals_filled_tensor(name):
    """v0/w0 None start every neuron at init's values: same as passing filled tensors, and no
    initial-state gradient is computed."""
    prog = program(name, "ATan", True, False)
    d, params = prog.definition, DEFINITIONS[name][1]
    consts = [1.0, 0.0] + [params[k] for k in d.params]
    g = torch.Generator().manual_seed(3)
    xs = torch.randn(5, 4, generator=g, dtype=F64) + 0.5
    init = [0.3, 0.2]
    v0 = torch.full((4,), init[0], dtype=F64)
    w0 = torch.full((4,), init[1], dtype=F64) if d.adaptive else None
    save_all = dict(save_for_backward=True, store_v_seq=True)
    a = ref.fptt(
        prog, xs, v0=None, w0=None, learnable=None, constants=consts, init=init, **save_all
    )
    b = ref.fptt(prog, xs, v0, w0, learnable=None, constants=consts, init=[0.0, 0.0], **save_all)
    assert torch.equal(a.spikes, b.spikes) and torch.equal(a.v_seq, b.v_seq)
    gs = torch.randn(xs.shape, generator=g, dtype=F64)
    spikes_only = dict(grad_v_seq=None, grad_v_last=None, grad_w_last=None, x_seq=xs)
    back_a = ref.bptt(
        prog,
        gs,
        saved_v=a.saved_v,
        saved_w=a.saved_w,
        v0=None,
        w0=None,
        learnable=None,
        constants=consts,
        init=init,
        **spikes_only,
    )
    back_b = ref.bptt(
        prog,
        gs,
        saved_v=b.saved_v,
        saved_w=b.saved_w,
        v0=v0,
        w0=w0,
        learnable=None,
        constants=consts,
        init=[0.0, 0.0],
        **spikes_only,
    )
    assert torch.equal(back_a.grad_x, back_b.grad_x)
    assert back_a.grad_v0 is None and back_a.grad_w0 is None and back_b.grad_v0 is not None


# ================================================================================================
# (c) the module path (custom op + autograd) against the oracle
# ================================================================================================
# name -> (definition, constant values by name), matching MODULES' constructors
def module_constants(name, vth, v_reset):
    definition = DEFINITIONS[name][0]
    p = MODULES[name][1]
    return [vth, 0.0 if v_reset is None else v_reset] + [
        p[k] for k in definition.params if k != "decay_logit"
    ]


@pytest.mark.parametrize("detach", [False, True], ids=["attached", "detach"])
@pytest.mark.parametrize("v_reset", [-0.1, None], ids=["hard", "soft"])
@pytest.mark.parametrize("name", list(MODULES))
def test_module_matches_oracle(name, v_reset, detach):
    make = MODULES[name][0]
    surrogate = sg.ALL[seed_of(name, v_reset, detach) % len(sg.ALL)]()
    vth = 0.9
    node = make(
        v_threshold=vth,
        v_reset=v_reset,
        detach_reset=detach,
        surrogate_function=surrogate,
        step_mode="m",
        backend="torch",
        store_v_seq=True,
    )
    if name.startswith("plif"):
        with torch.no_grad():
            node.w.fill_(0.4)  # decay = sigmoid(0.4), not a round number
    g = torch.Generator().manual_seed(seed_of(name, v_reset, detach, 1))
    T, N, C = 6, 3, 5
    xs = (torch.randn(T, C, N, generator=g, dtype=F64) * 0.8 + 0.4).transpose(1, 2)
    xs.requires_grad_(True)
    v0 = (torch.randn(N, C, generator=g, dtype=F64) * 0.3).requires_grad_(True)
    w0 = (torch.randn(N, C, generator=g, dtype=F64) * 0.2).requires_grad_(True)
    node.v = v0
    adaptive = name == "izh"
    if adaptive:
        node.w = w0

    s = node(xs)
    gs, gv = (
        torch.randn(s.shape, generator=g, dtype=F64),
        torch.randn(s.shape, generator=g, dtype=F64),
    )
    gvl, gwl = torch.randn(N, C, generator=g, dtype=F64), torch.randn(N, C, generator=g, dtype=F64)
    assert node.v_seq.shape == xs.shape
    loss = (s * gs).sum() + (node.v_seq * gv).sum() + (node.v * gvl).sum()
    if adaptive:
        loss = loss + (node.w * gwl).sum()
    loss.backward()

    # oracle: same program, plain autograd
    xo, v0o, w0o = (t.detach().clone().requires_grad_() for t in (xs, v0, w0))
    if name.startswith("plif"):
        wo = node.w.detach().clone().requires_grad_()
        learnable = wo
    else:
        learnable = torch.empty(0)
    consts = module_constants(name, vth, v_reset)
    so, vso, vlo, wlo = oracle(
        node.program, xo, v0o, w0o if adaptive else xo.new_empty(0), learnable, consts
    )
    assert torch.equal(s.detach(), so.detach())
    assert reldiff(node.v_seq.detach(), vso.detach()) < 1e-12
    loss_o = (so * gs).sum() + (vso * gv).sum() + (vlo * gvl).sum()
    if adaptive:
        loss_o = loss_o + (wlo * gwl).sum()
    loss_o.backward()
    assert reldiff(xs.grad, xo.grad) < 1e-10
    assert reldiff(v0.grad, v0o.grad) < 1e-10
    if adaptive:
        assert reldiff(w0.grad, w0o.grad) < 1e-10
    else:
        assert w0.grad is None
    if name.startswith("plif"):
        # w is a float32 parameter, so its gradient is rounded to float32: float32
        # precision, not 1e-10.
        assert node.w.grad is not None and node.w.grad.abs().item() > 0
        assert reldiff(node.w.grad, wo.grad) < 1e-6
    assert 0 < s.sum() < s.numel()
