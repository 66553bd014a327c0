"""Hostile input and faults in the library (neurons, surrogates, definitions, fused
blocks). Each test failed on the code before the fix."""

from __future__ import annotations

import copy
import io
import math
import os
import pickle

import pytest
import sympy as sp
import torch
from torch import nn

from spikefuse import definitions as defs
from spikefuse import functional, layer, neuron
from spikefuse import surrogate as sg
from spikefuse.cuda.definition_kernel import DefinitionKernel
from spikefuse.errors import BackendUnavailableError, SpikefuseError
from spikefuse.fused import FusedBlock, FusedLinearBNNeuron, WindowAvgPool, fuse, paper_lif
from spikefuse.fused.statistics import batch_stats
from spikefuse.program import NeuronProgram, lookup

F64 = torch.float64
NAN, INF = math.nan, math.inf

# Every shipped neuron, torch backend, multi-step.
NODES = {
    "if": lambda **k: neuron.IFNode(**k),
    "lif": lambda **k: neuron.LIFNode(**k),
    "lif_ndi": lambda **k: neuron.LIFNode(decay_input=False, **k),
    "plif": lambda **k: neuron.ParametricLIFNode(**k),
    "qif": lambda **k: neuron.QIFNode(**k),
    "eif": lambda **k: neuron.EIFNode(**k),
    "izh": lambda **k: neuron.IzhikevichNode(**k),
}


def make(name: str, **kw) -> neuron.BaseNode:
    kw.setdefault("backend", "torch")
    kw.setdefault("step_mode", "m")
    return NODES[name](**kw)


# ---- 1. equations are parsed, never evaluated ---------------------------------------------------
INJECTIONS = [
    "__import__('os').system('touch owned')",
    "x + __import__('os').system('touch owned')",
    "().__class__.__bases__[0].__subclasses__()",
    "exec(\"open('owned', 'w')\")",
    "eval('1') + x",
    "open('owned', 'w')",
    "x.__class__",
    "x[0]",
    "(lambda: open('owned', 'w'))()",
    "exp(x, y=open('owned', 'w'))",
    "Symbol('owned') + x",
    "sympify(\"open('owned', 'w')\")",
    "[open('owned', 'w') for _ in 'a']",
    "x if open('owned', 'w') else v",
    "(o := open('owned', 'w'))",
    'f\'{open("owned", "w")}\'',
    "'owned'",
    "x @ v",
]


@pytest.mark.parametrize("field", ["charge", "adaptation", "adaptation_jump"])
@pytest.mark.parametrize("text", INJECTIONS)
def test_injected_code_is_rejected_and_not_run(text, field, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    kwargs = {"charge": "v + x - w", "adaptation": "w + h / 2", "adaptation_jump": "b"}
    kwargs[field] = text
    with pytest.raises(SpikefuseError, match=f"cannot parse {field}"):
        defs.NeuronDef("hostile", params=("b",), **kwargs)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "text,offending",
    [
        ("__import__('os').system('x')", r"the call \"__import__\('os'\)"),
        ("x.real", r"'x.real' \(Attribute"),
        ("x[0]", r"'x\[0\]' \(Subscript"),
        ("exp(x=1)", r"exp takes one argument"),
        ("v ^ 2 + x", r"write '\*\*'"),
        ("2**10**10 + x", r"number too large"),
        ("exp + x", r"function name 'exp' used without a call"),
        ("1j * x", r"only real numbers"),
        ("True + x", r"only real numbers"),
        ("v + x; 1", r"syntax error"),
        ("(" * 300 + "x" + ")" * 300, r"nested too deeply|syntax error"),
    ],
)
def test_rejection_names_the_offending_part(text, offending):
    with pytest.raises(SpikefuseError, match=offending):
        defs.NeuronDef("bad", charge=text)


def test_shipped_and_user_equations_parse_as_before():
    """The restricted parser builds exactly the expressions sympy's parser built from trusted text."""
    shipped = [d for d in vars(defs).values() if isinstance(d, defs.NeuronDef)]
    user = [
        defs.NeuronDef("cubic", charge="v + (x - k*v**3)/tau", params=("tau", "k")),
        defs.NeuronDef("tanh_in", charge="v + tanh(x)"),
        defs.NeuronDef(
            "mix", charge="v + 1e-3*x - 2**-1 + sqrt(abs(x)) + exp(-v/2) + pi*x - -3 + log(x + 2)"
        ),
    ]
    for d in shipped + user:
        for text in (d.charge, d.adaptation or "w", d.adaptation_jump):
            names = {**d.symbols, "sigmoid": defs.SigmoidFunction}
            trusted = sp.parse_expr(text, local_dict=names)
            assert sp.srepr(defs.parse_equation(text, d.symbols)) == sp.srepr(trusted), text


@pytest.mark.parametrize("kwargs", [{"name": 3}, {"params": "tau"}, {"params": ["tau"]}])
def test_definition_fields_type_checked(kwargs):
    fields = {"name": "n", "charge": "v + x / tau", "params": ("tau",), **kwargs}
    with pytest.raises(SpikefuseError, match="identifier|tuple of names"):
        defs.NeuronDef(**fields)


def test_whitelisted_functions():
    d = defs.NeuronDef("sig", charge="v + sigmoid(x) + cosh(x) - sinh(x) + sin(v) * cos(v)")
    h = sp.Symbol("h", real=True)
    assert d.charge_expr.has(defs.SigmoidFunction, sp.cosh, sp.sinh, sp.sin, sp.cos)
    assert d.partials.dh_dx is not None and h not in d.charge_expr.free_symbols
    assert d.partials.needs_x  # sympy cannot solve the charge for x: backward keeps x
    with pytest.raises(SpikefuseError, match="allowed functions: exp, log"):
        defs.NeuronDef("bad", charge="v + erf(x)")


# ---- 2. pickling and deepcopy at any time ---------------------------------------------------------
def _trained_forward(node: nn.Module, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(4, 3, 5, generator=g, dtype=F64) * 1.5).requires_grad_()
    out = node(x)
    out.sum().backward(retain_graph=True)
    return x


@pytest.mark.parametrize("decay_input", [True, False])
def test_plif_pickled_before_it_learned_the_logit_loads_as_the_current_plif(decay_input):
    """A PLIF pickled whole before its definition took sigmoid(decay_logit) (it learned
    decay = sigmoid(w) through autograd) carries that definition; loaded, it runs the current
    one on the same w (the old definition would read w as the decay itself)."""
    node = neuron.ParametricLIFNode(init_tau=3.0, decay_input=decay_input, step_mode="m")
    old_charge = (
        "v + (x - (v - v_reset)) * decay" if decay_input else "v - (v - v_reset) * decay + x"
    )
    old = defs.NeuronDef("plif", charge=old_charge, params=("decay",))
    state = node.__getstate__()
    state["definition"] = old
    state["program"] = NeuronProgram(old, node.surrogate_function, True, False, ("decay",))
    loaded = neuron.ParametricLIFNode.__new__(neuron.ParametricLIFNode)
    loaded.__setstate__(state)
    assert loaded.program is not None and loaded.program.learnable == ("decay_logit",)
    x = torch.rand(4, 5, generator=torch.Generator().manual_seed(0)) * 2
    assert torch.equal(loaded(x), node(x))


@pytest.mark.parametrize("name", list(NODES))
def test_neuron_pickles_and_deepcopies_after_a_training_forward(name):
    node = make(name).double()
    _trained_forward(node)
    assert node.v.grad_fn is not None  # .v is part of an autograd graph: no reset_net
    x2 = torch.rand(4, 3, 5, generator=torch.Generator().manual_seed(1), dtype=F64) * 1.5
    for clone in (
        pickle.loads(pickle.dumps(node)),
        copy.deepcopy(node),
        _torch_roundtrip(node),
    ):
        assert clone.v.grad_fn is None and torch.equal(clone.v, node.v.detach())
        # the copy continues from the same state, with its own program and surrogate
        assert torch.equal(clone(x2), copy.deepcopy(node)(x2))
        assert lookup(clone.program.key) is not None
        assert clone.program.surrogate is clone.surrogate_function


def _torch_roundtrip(module: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("cls", sg.ALL, ids=lambda c: c.__name__)
def test_surrogate_pickles_and_deepcopies_after_use(cls):
    s = cls()
    x = torch.linspace(-1, 1, 9, dtype=F64, requires_grad=True)
    s(x).sum().backward()
    expected = s.derivative(x.detach())
    for clone in (pickle.loads(pickle.dumps(s)), copy.deepcopy(s), _torch_roundtrip(s)):
        assert torch.equal(clone.derivative(x.detach()), expected)
        assert clone.key == s.key


def test_model_deepcopy_and_fuse_after_training_forward_without_reset():
    torch.manual_seed(0)
    model = nn.Sequential(
        layer.Linear(6, 8, bias=False, step_mode="m"),
        layer.BatchNorm1d(8, step_mode="m"),
        paper_lif(backend="torch"),
        layer.Linear(8, 3, step_mode="m"),
    ).double()
    x = torch.rand(3, 4, 6, dtype=F64)
    model(x).sum().backward()  # no functional.reset_net: the LIF's .v is a non-leaf tensor
    copied = copy.deepcopy(model)
    reloaded = pickle.loads(pickle.dumps(model))
    fused = fuse(model)
    assert isinstance(fused[0], FusedBlock)
    functional.reset_net(model)
    for other in (copied, reloaded, fused):
        functional.reset_net(other)
        torch.testing.assert_close(other(x), model(x), rtol=1e-12, atol=1e-12)
        functional.reset_net(model)


def test_unpickled_program_is_registered_for_the_custom_ops():
    node = make("lif", surrogate_function=sg.ATan(alpha=3.0))
    node(torch.rand(2, 3))  # builds the program's lambdified torch functions
    clone = pickle.loads(pickle.dumps(node.program))
    assert clone.key == node.program.key and "torch_functions" not in clone.__dict__
    assert lookup(clone.key).surrogate.alpha == 3.0
    assert torch.equal(clone.torch_functions["charge"](*[torch.ones(())] * 7), torch.tensor(2.0))


# ---- 3. NaN and Inf --------------------------------------------------------------------------------
def test_nan_input_gives_nan_spikes_not_silence():
    n = neuron.LIFNode(backend="torch")  # single-step
    s1 = n(torch.tensor([NAN, 0.0]))
    s2 = n(torch.tensor([5.0, 5.0]))
    assert s1[0].isnan() and s1[1] == 0
    assert s2[0].isnan() and s2[1] == 1  # a NaN potential never passes as "no spike"
    assert n.v[0].isnan() and n.v[1] == 0


@pytest.mark.parametrize("name", list(NODES))
@pytest.mark.parametrize("v_reset", [0.0, None], ids=["hard", "soft"])
def test_nan_policy_every_neuron(name, v_reset):
    kw = {"v_reset": v_reset} if name not in ("qif", "eif") or v_reset is None else {}
    node = make(name, store_v_seq=True, **kw)
    x = torch.tensor([[NAN, 0.1, 5.0], [5.0, 0.1, 5.0], [0.0, 0.0, 0.0]])
    spikes = node(x)
    assert spikes[:, 0].isnan().all()  # NaN H at every step of the first neuron
    assert not spikes[:, 1:].isnan().any()
    assert node.v_seq[:, 0].isnan().all() and node.v[0].isnan()  # hard reset keeps NaN
    assert spikes[0, 2] == 1 and spikes[1, 2] == 1


def test_positive_inf_fires_and_hard_reset_resets():
    node = make("lif", v_reset=0.0, store_v_seq=True)
    spikes = node(torch.tensor([[INF], [0.0], [3.0]]))
    assert spikes.flatten().tolist() == [1.0, 0.0, 1.0]
    assert node.v_seq.flatten().tolist() == [0.0, 0.0, 0.0]


def test_surrogate_spike_propagates_nan():
    for cls in sg.ALL:
        out = cls()(torch.tensor([NAN, -1.0, 0.0, INF]))
        assert out[0].isnan() and out[1:].tolist() == [0.0, 1.0, 1.0]
    assert sg.heaviside(torch.tensor([NAN], dtype=torch.float16)).isnan().all()


def test_nan_input_under_anomaly_detection_raises():
    node = make("lif")
    with torch.autograd.detect_anomaly(), pytest.raises(SpikefuseError, match="contains NaN"):
        node(torch.tensor([[NAN, 0.0]]))
    node(torch.tensor([[NAN, 0.0]]))  # without anomaly detection: NaN spikes, no host sync
    with torch.autograd.detect_anomaly(), pytest.raises(SpikefuseError, match="state v"):
        node(torch.tensor([[0.0, 0.0]]))  # the NaN now lives in the state


def test_fused_block_nan_under_anomaly_detection_raises_before_bn_changes():
    block = FusedLinearBNNeuron(3, 2, node=paper_lif(backend="torch"))
    x = torch.rand(2, 4, 3)
    x[0, 0, 0] = NAN
    with torch.autograd.detect_anomaly(), pytest.raises(SpikefuseError, match="contains NaN"):
        block(x)
    assert block.bn.num_batches_tracked == 0
    assert block(x).isnan().any()  # without anomaly detection: NaN spikes


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cuda_forward_writes_nan_spike_for_nan_h(dtype):
    source = DefinitionKernel(make("lif").program, dtype, 1).full_codes
    assert "h >= p.v_threshold ? 1.0f : (isnan(h) ? h : 0.0f)" in source


# ---- 4. double backward ---------------------------------------------------------------------------
def test_neuron_double_backward_raises():
    node = make("lif").double()
    x = torch.rand(3, 4, dtype=F64, requires_grad=True)
    (g,) = torch.autograd.grad(node(x).sum(), x, create_graph=False)  # first order: fine
    functional.reset_net(node)
    with pytest.raises(SpikefuseError, match="does not support double backward"):
        torch.autograd.grad(node(x).sum(), x, create_graph=True)


def test_custom_op_double_backward_raises():
    program = make("lif").program
    x = torch.rand(3, 4, dtype=F64, requires_grad=True)
    out = torch.ops.spikefuse.neuron_fptt(
        program.key, "torch", x, None, None, None, [1.0, 0.0, 2.0], [0.0, 0.0], True, False
    )
    with pytest.raises(SpikefuseError, match="does not support double backward"):
        torch.autograd.grad(out[0].sum(), x, create_graph=True)


def test_fused_block_and_window_pool_double_backward_raise():
    block = FusedLinearBNNeuron(4, 3, node=paper_lif(backend="torch")).double()
    x = torch.rand(2, 5, 4, dtype=F64, requires_grad=True)
    with pytest.raises(SpikefuseError, match="fused block.*does not support double backward"):
        torch.autograd.grad(block(x).sum(), x, create_graph=True)
    y = torch.rand(2, 3, 4, 4, dtype=F64, requires_grad=True)
    with pytest.raises(SpikefuseError, match="WindowAvgPool does not support double backward"):
        torch.autograd.grad(WindowAvgPool.apply(y, 2, 2).square().sum(), y, create_graph=True)


# ---- 5. float64 PLIF --------------------------------------------------------------------------------
@pytest.mark.parametrize("decay_input", [True, False])
def test_float64_plif_gradcheck_wrt_w(decay_input):
    # soft reset with detach_reset: V is differentiable in w (no surrogate term) between spikes
    node = neuron.ParametricLIFNode(
        init_tau=1.7,
        decay_input=decay_input,
        v_reset=None,
        detach_reset=True,
        step_mode="m",
        backend="torch",
    ).double()
    x = torch.rand(5, 6, dtype=F64, generator=torch.Generator().manual_seed(0)) * 0.9

    def run(w):
        functional.reset_net(node)
        torch.func.functional_call(node, {"w": w}, (x,))
        return node.v

    w = torch.tensor(0.3, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(run, (w,), eps=1e-6, atol=1e-9)


def test_float64_plif_matches_float64_formula():
    node = neuron.ParametricLIFNode(init_tau=1.7, step_mode="m", backend="torch").double()
    x = torch.rand(8, 5, dtype=F64, generator=torch.Generator().manual_seed(1)) * 1.2
    spikes = node(x)
    decay = 1.0 / (1.0 + math.exp(-node.w.item()))
    v, expected = torch.zeros(5, dtype=F64), []
    for t in range(8):
        h = v + (x[t] - v) * decay
        s = (h >= 1.0).to(F64)
        v = h * (1 - s)
        expected.append(s)
    assert torch.equal(spikes.detach(), torch.stack(expected))
    assert (node.v.detach() - v).abs().max() <= 1e-12
    assert node.learnable_values(x.device, F64).dtype == F64


# ---- 6. v_seq after switching to single-step --------------------------------------------------------
def test_v_seq_cleared_when_switching_to_single_step():
    node = make("lif", store_v_seq=True)
    node(torch.rand(3, 2))
    assert node.v_seq is not None
    node.step_mode = "s"
    assert node.v_seq is None
    node(torch.rand(2))  # single-step mode starts its own sequence (SpikingJelly 2.0)
    assert node.v_seq.shape == (1, 2)
    node.step_mode = "m"
    assert node.v_seq is None


# ---- 7. validation on every assignment; hyper-parameter changes take effect ------------------------
@pytest.mark.parametrize("value", [NAN, INF, "0"])
def test_izhikevich_w_rest_validated(value):
    with pytest.raises(SpikefuseError, match="w_rest must be a finite float"):
        neuron.IzhikevichNode(w_rest=value)
    node = neuron.IzhikevichNode(w_rest=0.5)
    with pytest.raises(SpikefuseError, match="w_rest must be a finite float"):
        node.w_rest = value
    assert node.w_rest == 0.5


def test_izhikevich_w_rest_change_takes_effect_at_reset():
    node = make("izh", w_rest=0.5)
    assert node.w == 0.5
    node(torch.rand(2, 3))
    node.w_rest = -0.25
    functional.reset_net(node)
    assert node.w == -0.25


@pytest.mark.parametrize("name", ["if", "lif", "plif", "qif", "eif", "izh"])
def test_threshold_not_above_hard_reset_rejected(name):
    with pytest.raises(SpikefuseError, match="v_threshold must be > v_reset"):
        make(name, v_threshold=0.0, v_reset=0.0)
    with pytest.raises(SpikefuseError, match="v_threshold must be > v_reset"):
        make(name, v_threshold=-0.5, v_reset=0.0)
    node = make(name, v_threshold=1.0, v_reset=0.0)
    with pytest.raises(SpikefuseError, match="v_threshold must be > v_reset"):
        node.v_threshold = -1.0
    with pytest.raises(SpikefuseError, match="v_threshold must be > v_reset"):
        node.v_reset = 2.0
    assert node.v_threshold == 1.0 and node.v_reset == 0.0 and node.program.hard_reset
    node.v_reset = None  # soft reset: any finite threshold
    node.v_threshold = -1.0
    assert node.constants()[:2] == [-1.0, 0.0]


def test_neuron_constants_validated_on_assignment_before_any_change():
    node = make("eif")
    x = torch.rand(2, 3)
    node(x)
    v = node.v.clone()
    for attr, value in [("tau", 0.5), ("delta_T", 0.0), ("theta_rh", NAN), ("v_threshold", "1")]:
        old = getattr(node, attr)
        with pytest.raises(SpikefuseError, match=attr):
            setattr(node, attr, value)
        assert getattr(node, attr) == old
    assert torch.equal(node.v, v)
    with pytest.raises(SpikefuseError, match="surrogate_function must be"):
        node.surrogate_function = torch.sigmoid
    assert isinstance(node.surrogate_function, sg.Sigmoid)


@pytest.mark.parametrize(
    "kwargs", [{"eta": -1.0}, {"eta": 0.0}, {"eta": True}, {"th_l": "0"}, {"th_r": -0.5}]
)
def test_rect_hyperparameters_validated(kwargs):
    with pytest.raises(SpikefuseError, match="Rect"):
        sg.RectWindow(**kwargs)
    s = sg.RectWindow()
    name, value = next(iter(kwargs.items()))
    with pytest.raises(SpikefuseError, match="Rect"):
        setattr(s, name, value)
    assert s.hyperparameters() == {"eta": 1.0, "th_l": -0.5, "th_r": 0.5}


@pytest.mark.parametrize(
    "cls", [c for c in sg.ALL if c is not sg.RectWindow], ids=lambda c: c.__name__
)
@pytest.mark.parametrize("value", [-1.0, 0.0, NAN, INF, "2"])
def test_alpha_validated_on_assignment_before_and_after_use(cls, value):
    s = cls()
    with pytest.raises(SpikefuseError, match="alpha"):
        s.alpha = value
    s(torch.zeros(3))
    with pytest.raises(SpikefuseError, match="alpha"):
        s.alpha = value
    assert s.alpha == cls.default_alpha


class Gamma(sg.Surrogate):
    """A user surrogate that validates nothing itself: the base class checks its values."""

    def __init__(self, gamma: float) -> None:
        super().__init__()
        self.gamma = gamma

    def hyperparameters(self):
        return {"gamma": self.gamma}

    def expression(self, x):
        return self.gamma / (1 + (self.gamma * x) ** 2)


def test_user_surrogate_values_checked():
    with pytest.raises(SpikefuseError, match="gamma must be a finite real number"):
        Gamma(NAN).derivative  # noqa: B018
    s = Gamma(1.0)
    with pytest.raises(SpikefuseError, match="gamma must be a finite real number"):
        s.gamma = INF


def _grad(node, x):
    functional.reset_net(node)
    x = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(node(x).sum(), x)
    return g


@pytest.mark.parametrize("cls", sg.ALL, ids=lambda c: c.__name__)
def test_hyperparameter_change_after_use_takes_effect(cls):
    x = torch.rand(4, 6, dtype=F64, generator=torch.Generator().manual_seed(0)) * 1.5
    name = "eta" if cls is sg.RectWindow else "alpha"
    s = cls()
    node = make("lif", surrogate_function=s).double()
    other = make("lif", surrogate_function=s).double()  # a second user of the same surrogate
    before, old_key = _grad(node, x), node.program.key
    setattr(s, name, 2.5 * getattr(s, name))
    fresh = make("lif", surrogate_function=cls(**{name: getattr(s, name)})).double()
    after = _grad(node, x)
    assert not torch.equal(after, before)
    assert torch.equal(after, _grad(fresh, x)) and torch.equal(_grad(other, x), after)
    assert node.program.key != old_key and node.program.key == fresh.program.key
    # the custom ops' registry keeps the old program with the old value
    assert lookup(old_key).surrogate.key != s.key


def test_shipped_program_registry_is_not_mutated_by_later_changes():
    s = sg.Sigmoid(alpha=4.321)  # a value no other test uses: this program registers the key
    program = NeuronProgram(defs.LIF, s, True, False)
    registered = lookup(program.key)
    assert registered.surrogate is not s
    s.alpha = 1.5
    assert registered.surrogate.alpha == 4.321


# ---- 8. a failing fused block changes no state ------------------------------------------------------
def test_fused_block_that_cannot_run_leaves_batchnorm_untouched():
    block = FusedLinearBNNeuron(4, 3, node=paper_lif(backend="cuda"))
    before = {k: v.clone() for k, v in block.bn.state_dict().items()}
    with pytest.raises(BackendUnavailableError):
        block(torch.rand(2, 5, 4))
    for k, v in block.bn.state_dict().items():
        assert torch.equal(v, before[k]), k


# ---- 9. statistics of an empty batch ---------------------------------------------------------------
def test_batch_stats_of_empty_batch_are_zero_not_nan():
    mean, var, count = batch_stats(torch.empty(3, 0, 4, dtype=F64))
    assert count == 0 and torch.equal(mean, torch.zeros(4, dtype=F64))
    assert torch.equal(var, torch.zeros(4, dtype=F64))


@pytest.mark.parametrize(
    "charge",
    ["v + x*sqrt(6)**(10**7)", "v + x*(sqrt(2)*sqrt(3))**(10**8)", "v + x*1e400", "v + x*-1e999"],
)
def test_equation_numbers_are_bounded(charge):
    """A numeric exponent on a non-number base used to build huge integers (or hang), and
    non-finite literals to be accepted as oo."""
    with pytest.raises(SpikefuseError, match="too large|not a finite number"):
        defs.NeuronDef("big", charge=charge)
