"""Neuron definitions: sympy's partials equal the specification's hand-written derivatives;
user-defined neurons get a correct forward and backward; bad definitions fail with a clear
SpikefuseError."""

from __future__ import annotations

import math

import pytest
import sympy as sp
import torch

from conftest import reldiff
from oracle import oracle
from spikefuse import SpikefuseError, functional, neuron
from spikefuse import definitions as defs
from spikefuse import reference as ref
from spikefuse.program import NeuronProgram
from spikefuse.surrogate import ATan, Sigmoid

# The symbols the definitions use (sympy symbols compare by name and assumptions).
v, x, w, h = sp.symbols("v x w h", real=True)
(tau, a0, v_rest, v_c, delta_T, theta_rh, decay_logit, v_reset, a, tau_w, b, k) = sp.symbols(
    "tau a0 v_rest v_c delta_T theta_rh decay_logit v_reset a tau_w b k", real=True
)
decay = defs.SigmoidFunction(decay_logit)  # PLIF's 1/tau


def same(expr_a, expr_b) -> bool:
    return sp.simplify(sp.sympify(expr_a) - sp.sympify(expr_b)) == 0


# ---- shipped neurons: the specification's derivatives --------------------------------------------
# name -> (definition, {partial: the specification's hand-written expression})
SEED_PARTIALS = {
    "if": (defs.IF, {"dh_dx": 1, "dh_dv": 1}),
    "lif": (
        defs.LIF,
        {"dh_dx": 1 / tau, "dh_dv": 1 - 1 / tau, ("dh_dparam", "tau"): (v - h) / tau},
    ),
    "lif_ndi": (
        defs.LIF_NO_DECAY_INPUT,
        {"dh_dx": 1, "dh_dv": 1 - 1 / tau, ("dh_dparam", "tau"): (v - v_reset) / tau**2},
    ),
    # seed: dL/d(1/tau) = sum dL/dH[t] (H[t] - V[t-1]) tau, i.e. (h - v) / decay; times
    # d(1/tau)/dw = decay (1 - decay) for the logit w
    "plif": (
        defs.PLIF,
        {
            "dh_dx": decay,
            "dh_dv": 1 - decay,
            ("dh_dparam", "decay_logit"): (h - v) / decay * decay * (1 - decay),
        },
    ),
    # seed: dL/d(1/tau) = sum dL/dH[t] (V_reset - V[t-1])
    "plif_ndi": (
        defs.PLIF_NO_DECAY_INPUT,
        {
            "dh_dx": 1,
            "dh_dv": 1 - decay,
            ("dh_dparam", "decay_logit"): (v_reset - v) * decay * (1 - decay),
        },
    ),
    "qif": (
        defs.QIF,
        {"dh_dx": 1 / tau, "dh_dv": 1 + a0 / tau * (2 * v - v_rest - v_c)},
    ),
    "eif": (
        defs.EIF,
        {
            "dh_dx": 1 / tau,
            "dh_dv": 1 - 1 / tau + sp.exp((v - theta_rh) / delta_T) / tau,
        },
    ),
    "izhikevich": (
        defs.IZHIKEVICH,
        {
            "dh_dx": 1 / tau,
            "dh_dv": 1 + a0 / tau * (2 * v - v_c - v_rest),
            "dh_dw": -1 / tau,
            "dz_dh": a / tau_w,
            "dz_dw": 1 - 1 / tau_w,
        },
    ),
}
SHIPPED = [d for d, _ in SEED_PARTIALS.values()]


@pytest.mark.parametrize("name", list(SEED_PARTIALS))
def test_partials_equal_seed_003(name):
    definition, expected = SEED_PARTIALS[name]
    partials = definition.partials
    for key, want in expected.items():
        got = partials.dh_dparam[key[1]] if isinstance(key, tuple) else getattr(partials, key)
        assert same(got, want), f"{name} {key}: sympy gives {got}, the specification says {want}"


@pytest.mark.parametrize("definition", SHIPPED, ids=lambda d: d.name)
def test_shipped_partials_need_only_h(definition):
    """X is eliminated: backward of every shipped neuron needs only the saved H (and no W seq)."""
    p = definition.partials
    exprs = [p.dh_dx, p.dh_dv, p.dh_dw, p.dz_dh, p.dz_dw, *p.dh_dparam.values()]
    assert all(x not in sp.sympify(e).free_symbols for e in exprs)
    assert not p.needs_x
    assert not p.needs_w
    if not definition.adaptive:  # one-state neurons: W plays no role
        assert same(p.dh_dw, 0) and same(p.dz_dh, 0) and definition.num_states == 1


def test_izhikevich_adaptation_and_jump():
    d = defs.IZHIKEVICH
    assert d.adaptive and d.num_states == 2
    assert same(d.jump_expr, b)
    assert same(d.adaptation_expr, w + (a * (h - v_rest) - w) / tau_w)
    assert same(d.charge_expr, v + (x + a0 * (v - v_rest) * (v - v_c) - w) / tau)


def test_plif_partial_is_derivative_with_x_eliminated():
    """(h - v)(1 - decay) is ∂H/∂decay_logit = (x - (v - v_reset)) decay (1 - decay) once x is
    solved from the charge; the sigmoid's derivative is its own, σ (1 - σ), and equals that of
    the expanded 1 / (1 + exp(-decay_logit))."""
    f = defs.PLIF.charge_expr
    direct = sp.diff(f, decay_logit)
    x_of_h = sp.solve(sp.Eq(h, f), x)[0]
    assert same(direct.subs(x, x_of_h), defs.PLIF.partials.dh_dparam["decay_logit"])
    expanded = sp.diff(1 / (1 + sp.exp(-decay_logit)), decay_logit)
    assert same(sp.diff(decay, decay_logit).subs(decay, 1 / (1 + sp.exp(-decay_logit))), expanded)


# ---- user-defined neurons -----------------------------------------------------------------------
CUBIC = defs.NeuronDef("cubic", charge="v + (x - k*v**3)/tau", params=("tau", "k"))
TANH = defs.NeuronDef("tanh_in", charge="v + tanh(x)")


def test_cubic_partials():
    p = CUBIC.partials
    assert same(p.dh_dx, 1 / tau)
    assert same(p.dh_dv, 1 - 3 * k * v**2 / tau)
    assert same(p.dh_dparam["k"], -(v**3) / tau)
    assert same(p.dh_dparam["tau"], (v - h) / tau)
    assert not p.needs_x and not p.needs_w


def test_nonlinear_in_x_needs_x():
    p = TANH.partials
    assert p.needs_x
    assert same(p.dh_dx, 1 - sp.tanh(x) ** 2)


# A conductance-like charge: dH/dX = e_rev - v vanishes at v = e_rev, where X(H) would divide
# by zero (an input of exactly 1 drives v there)
COND = defs.NeuronDef("cond", charge="v + x * (e_rev - v)", params=("e_rev",))


def test_x_stays_where_eliminating_it_divides_by_a_state():
    p = COND.partials
    assert p.needs_x and same(p.dh_dv, 1 - x)
    node = neuron.BaseNode(COND, params={"e_rev": -0.5}, step_mode="m", backend="torch")
    xs = torch.tensor([[1.0], [0.3], [2.0]], dtype=torch.float64, requires_grad=True)
    spikes = node(xs)
    (grad,) = torch.autograd.grad(spikes.sum() + node.v.sum(), xs)
    v, expected = torch.zeros(1, dtype=torch.float64), []  # the recurrence, by autograd
    xo = xs.detach().clone().requires_grad_()
    for t in range(3):
        h = v + xo[t] * (-0.5 - v)
        s = node.surrogate_function(h - 1.0)
        v = h * (1 - s)
        expected.append(s)
    (reference,) = torch.autograd.grad(torch.stack(expected).sum() + v.sum(), xo)
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(grad, reference)


def _bptt_vs_oracle(definition, params, learnable=(), hard=True, detach=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    T, shape = 5, (3, 7)
    program = NeuronProgram(
        definition, ATan(), hard_reset=hard, detach_reset=detach, learnable=learnable
    )
    vr = -0.1 if hard else 0.0
    consts = [1.0, vr] + [params[p] for p in definition.params if p not in learnable]
    lrn = torch.tensor([params[p] for p in learnable], dtype=torch.float32)
    xs = torch.randn((T, *shape), generator=g, dtype=torch.float64) + 0.5
    v0 = 0.4 * torch.randn(shape, generator=g, dtype=torch.float64)
    w0 = torch.empty(0, dtype=torch.float64)
    lrn_in = lrn if learnable else None
    out = ref.fptt(
        program,
        xs,
        v0,
        w0=None,
        learnable=lrn_in,
        constants=consts,
        init=[0.0, 0.0],
        save_for_backward=True,
        store_v_seq=True,
    )
    gs, gv = (
        torch.randn(xs.shape, generator=g, dtype=xs.dtype),
        torch.randn(xs.shape, generator=g, dtype=xs.dtype),
    )
    gl = torch.randn(shape, generator=g, dtype=xs.dtype)
    keep_x = xs if ref.keeps_x(program) else None
    back = ref.bptt(
        program,
        gs,
        gv,
        gl,
        grad_w_last=None,
        saved_v=out.saved_v,
        saved_w=out.saved_w,
        x_seq=keep_x,
        v0=v0,
        w0=None,
        learnable=lrn_in,
        constants=consts,
        init=[0.0, 0.0],
    )

    xo, vo = xs.clone().requires_grad_(), v0.clone().requires_grad_()
    lo = lrn.double().requires_grad_()
    s, vs, vl, _ = oracle(program, xo, vo, w0, lo, consts)
    assert torch.equal(out.spikes, s.detach())
    assert torch.allclose(out.v_seq, vs.detach(), rtol=0, atol=1e-12)
    loss = (s * gs).sum() + (vs * gv).sum() + (vl * gl).sum()
    inputs = [xo, vo] + ([lo] if learnable else [])
    grads = torch.autograd.grad(loss, inputs)
    assert reldiff(back.grad_x, grads[0]) < 1e-10
    assert reldiff(back.grad_v0, grads[1]) < 1e-10
    if learnable:
        assert reldiff(back.grad_learnable, grads[2]) < 1e-10
    assert 0 < s.sum() < s.numel()  # the test exercised both spiking and silent steps


@pytest.mark.parametrize("hard", [True, False])
@pytest.mark.parametrize("detach", [False, True])
def test_cubic_bptt_matches_oracle(hard, detach):
    _bptt_vs_oracle(CUBIC, {"tau": 2.5, "k": 0.3}, learnable=("k",), hard=hard, detach=detach)
    _bptt_vs_oracle(CUBIC, {"tau": 2.5, "k": 0.3}, learnable=(), hard=hard, detach=detach, seed=1)


@pytest.mark.parametrize("hard", [True, False])
def test_tanh_bptt_matches_oracle(hard):
    _bptt_vs_oracle(TANH, {}, hard=hard)


def _python_cubic(xs, tau_, k_, vth, vr):
    """Plain-float simulation of the cubic neuron (hard reset), one neuron."""
    vv, spikes = vr, []
    for xt in xs:
        hh = vv + (xt - k_ * vv**3) / tau_
        s = 1.0 if hh >= vth else 0.0
        vv = hh * (1 - s) + vr * s
        spikes.append(s)
    return spikes, vv


def test_cubic_in_base_node_forward():
    g = torch.Generator().manual_seed(3)
    node = neuron.BaseNode(
        CUBIC, params={"tau": 2.0, "k": 0.1}, v_reset=-0.05, step_mode="m", backend="torch"
    )
    xs = torch.rand(6, 5, generator=g, dtype=torch.float64) * 1.5
    spikes = node(xs)
    assert spikes.shape == xs.shape and spikes.dtype == torch.float64
    for n in range(5):
        want, v_last = _python_cubic(xs[:, n].tolist(), 2.0, 0.1, 1.0, -0.05)
        assert spikes[:, n].tolist() == want
        assert math.isclose(node.v[n].item(), v_last, rel_tol=0, abs_tol=1e-12)
    functional.reset_net(node)
    assert node.v == -0.05


@pytest.mark.parametrize(
    "definition,params", [(CUBIC, {"tau": 2.0, "k": 0.2}), (TANH, {})], ids=["cubic", "tanh"]
)
def test_user_neuron_module_gradients(definition, params):
    """The module path (custom op + autograd) matches the oracle, x kept for needs_x neurons."""
    g = torch.Generator().manual_seed(4)
    node = neuron.BaseNode(
        definition,
        params=params,
        v_reset=None,
        step_mode="m",
        backend="torch",
        surrogate_function=Sigmoid(alpha=3.0),
    )
    xs = (torch.randn(4, 3, 5, generator=g, dtype=torch.float64) + 0.6).transpose(1, 2)
    xs.requires_grad_(True)
    v0 = (0.3 * torch.randn(5, 3, generator=g, dtype=torch.float64)).requires_grad_(True)
    node.v = v0
    s = node(xs)
    gs = torch.randn(s.shape, generator=g, dtype=s.dtype)
    gl = torch.randn(v0.shape, generator=g, dtype=s.dtype)
    gx, gv0 = torch.autograd.grad((s * gs).sum() + (node.v * gl).sum(), [xs, v0])

    consts = [1.0, 0.0] + [params[p] for p in definition.params]
    xo, vo = xs.detach().clone().requires_grad_(), v0.detach().clone().requires_grad_()
    so, _, vl, _ = oracle(node.program, xo, vo, xo.new_empty(0), torch.empty(0), consts)
    assert torch.equal(s.detach(), so.detach())
    ox, ov = torch.autograd.grad((so * gs).sum() + (vl * gl).sum(), [xo, vo])
    assert reldiff(gx, ox) < 1e-10
    assert reldiff(gv0, ov) < 1e-10


def test_base_node_param_validation():
    with pytest.raises(SpikefuseError, match="missing params.*'k'"):
        neuron.BaseNode(CUBIC, params={"tau": 2.0})
    with pytest.raises(SpikefuseError, match="unknown.*'zeta'"):
        neuron.BaseNode(CUBIC, params={"tau": 2.0, "k": 1.0, "zeta": 3.0})
    with pytest.raises(SpikefuseError, match="k must be a finite float"):
        neuron.BaseNode(CUBIC, params={"tau": 2.0, "k": float("nan")})


def test_user_adaptive_neuron_matches_oracle():
    """A two-state neuron whose ∂H/∂V depends on W (so W is saved) and whose Z is nonlinear."""
    d = defs.NeuronDef(
        "adapt_w",
        charge="v + (x - v*w)/tau",
        params=("tau", "a", "tau_w", "b"),
        adaptation="w + (a*h**2 - w)/tau_w",
        adaptation_jump="b",
    )
    assert d.partials.needs_w and not d.partials.needs_x
    params = {"tau": 2.0, "a": 0.5, "tau_w": 2.5, "b": 0.1}
    g = torch.Generator().manual_seed(5)
    node = neuron.BaseNode(d, params=params, step_mode="m", backend="torch", w_init=0.2)
    xs = (torch.randn(5, 7, generator=g, dtype=torch.float64) + 0.7).requires_grad_(True)
    s = node(xs)
    gs = torch.randn(s.shape, generator=g, dtype=s.dtype)
    gw = torch.randn(7, generator=g, dtype=s.dtype)
    (gx,) = torch.autograd.grad((s * gs).sum() + (node.w * gw).sum(), [xs])
    xo = xs.detach().clone().requires_grad_()
    consts = [1.0, 0.0] + list(params.values())
    v0, w0 = torch.zeros(7, dtype=xs.dtype), torch.full((7,), 0.2, dtype=xs.dtype)
    so, _, _, wl = oracle(node.program, xo, v0, w0, torch.empty(0), consts)
    assert torch.equal(s.detach(), so.detach())
    (ox,) = torch.autograd.grad((so * gs).sum() + (wl * gw).sum(), [xo])
    assert reldiff(gx, ox) < 1e-10


# ---- bad definitions ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"charge": "v + x * y"}, r"unknown symbols \['y'\]"),
        ({"charge": "v + x + tau"}, r"unknown symbols \['tau'\].*params="),
        ({"charge": "v * 0.5"}, "must depend on x"),
        ({"charge": "v + x - w"}, r"unknown symbols \['w'\]"),  # w only for adaptive neurons
        ({"charge": "v + x - h"}, r"unknown symbols \['h'\]"),
        ({"charge": "v + x", "params": ("v",)}, "reserved/repeated"),
        ({"charge": "v + x", "params": ("v_threshold",)}, "reserved/repeated"),
        ({"charge": "v + x", "params": ("v_reset",)}, "reserved/repeated"),
        ({"charge": "v + x", "params": ("h",)}, "reserved/repeated"),
        ({"charge": "v + x/tau", "params": ("tau", "tau")}, "reserved/repeated"),
        ({"charge": "v + x", "params": ("not an id",)}, "not an identifier"),
        ({"charge": "v + (x"}, "cannot parse charge"),
        ({"charge": "v +* x"}, "cannot parse charge"),
        ({"charge": "v + x", "adaptation_jump": "1"}, "needs an adaptation"),
        ({"charge": "v + x - w", "adaptation": "w + x"}, r"unknown symbols \['x'\]"),
        ({"charge": "v + x - w", "adaptation": "w + (h"}, "cannot parse adaptation"),
        ({"charge": "v + x - w", "adaptation": "w/2", "adaptation_jump": "h"}, "unknown symbols"),
        # sympy folds a division by zero into zoo, which absorbs x ("must depend on x" misled)
        ({"charge": "v + x/0"}, r"divides by zero .* v \+ zoo\*x"),
        ({"charge": "v + x + 1/(v - v)"}, "cannot parse charge .* divides by zero"),
        ({"charge": "v + x/(tau - tau)", "params": ("tau",)}, "divides by zero"),
        ({"charge": "v + x - w", "adaptation": "w/0"}, "cannot parse adaptation .* divides"),
    ],
)
def test_bad_definitions_raise(kwargs, match):
    with pytest.raises(SpikefuseError, match=match):
        defs.NeuronDef("bad", **kwargs)


def test_bad_name_raises():
    with pytest.raises(SpikefuseError, match="identifier"):
        defs.NeuronDef("my neuron", charge="v + x")


def test_learnable_must_be_a_param():
    with pytest.raises(SpikefuseError, match="learnable"):
        NeuronProgram(defs.LIF, Sigmoid(), True, False, learnable=("alpha",))


@pytest.mark.parametrize("charge", ["v + x*exp(-1)", "v + x*sqrt(2)", "v + x*log(2)"])
def test_functions_of_numbers_become_their_values(charge):
    node = neuron.BaseNode(defs.NeuronDef("n", charge=charge), step_mode="m", backend="torch")
    x = torch.full((1, 2), 0.5, dtype=torch.float64)
    node(x)
    scale = {"exp": math.exp(-1), "sqr": math.sqrt(2), "log": math.log(2)}[charge[6:9]]
    torch.testing.assert_close(node.v, x[0] * scale, rtol=1e-15, atol=0)


@pytest.mark.parametrize(
    "charge, message",
    [
        ("v + x + log(-1)", "complex value"),
        ("v + x*sqrt(-1)", "complex value"),
        ("v + x*exp(1000)", r"exp\(1000\) is infinite"),
    ],
)
def test_complex_or_infinite_constants_are_refused(charge, message):
    with pytest.raises(SpikefuseError, match=message):
        defs.NeuronDef("n", charge=charge)


@pytest.mark.parametrize("charge", ["v + x*exp(x)", "v + sqrt(x + sqrt(x + sqrt(x)))"])
def test_charges_with_x_more_than_once_keep_x_and_run(charge):
    definition = defs.NeuronDef("n", charge=charge)
    assert definition.partials.needs_x  # no LambertW to print, no minutes in sympy's solve
    node = neuron.BaseNode(definition, step_mode="m", backend="torch")
    x = torch.rand(3, 2, dtype=torch.float64, requires_grad=True)
    node(x).sum().backward()
    assert torch.isfinite(x.grad).all()


def test_parameter_names_may_not_be_function_names():
    with pytest.raises(SpikefuseError, match=r"\['exp'\] are reserved"):
        defs.NeuronDef("n", "v + x*exp(k)", params=("exp", "k"))
