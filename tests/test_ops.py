"""The custom ops: torch.compile without graph breaks, opcheck, and what the forward saves."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from conftest import gen
from oracle import oracle
from spikefuse import definitions as defs
from spikefuse import layer, neuron
from spikefuse import reference as ref
from spikefuse import surrogate as sg
from spikefuse.program import NeuronProgram

FPTT = torch.ops.spikefuse.neuron_fptt.default
BPTT = torch.ops.spikefuse.neuron_bptt.default


# ---- torch.compile ------------------------------------------------------------------------------
def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        layer.Linear(5, 7, step_mode="m"), neuron.LIFNode(step_mode="m", backend="torch")
    )


def _forward_backward(model, x, gs, inner=None):
    inner = model if inner is None else inner  # the nn.Sequential behind a compiled module
    x = x.clone().requires_grad_(True)
    s = model(x)
    (s * gs).sum().backward()
    return s.detach(), x.grad, inner[0].weight.grad.clone(), inner[1].v.detach().clone()


def test_compile_fullgraph_matches_eager():
    """fullgraph=True fails on any graph break: the neuron is one opaque op to dynamo.

    backend="aot_eager" traces forward and backward through AOTAutograd (so the fake impls and
    the autograd registration are exercised) without inductor's C++ build, which is slow on
    a small CPU.
    """
    torch._dynamo.reset()
    eager = small_model()
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, fullgraph=True, backend="aot_eager")
    x = torch.randn(4, 3, 5, generator=gen(0)) * 2
    gs = torch.randn(4, 3, 7, generator=gen(1))
    want = _forward_backward(eager, x, gs)
    got = _forward_backward(compiled, x, gs, inner=compiled_model)
    assert 0 < want[0].sum() < want[0].numel()
    assert torch.equal(got[0], want[0])
    for a, b in zip(got[1:], want[1:], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ---- the custom op's own autograd (eager modules use an autograd.Function instead) ----------------
@pytest.mark.parametrize("name", ["izh", "plif", "tanh"])
def test_custom_op_autograd_matches_oracle(name):
    """torch.ops.spikefuse.neuron_fptt called directly: its registered backward (neuron_bptt)
    gives the oracle's gradients for x, v0, w0 and the learnable tensor."""
    g = gen(10)
    T, N = 5, 6
    f64 = torch.float64
    if name == "izh":
        p = _program(defs.IZHIKEVICH, sg.SuperSpike(), True, False)
        consts = [1.0, 0.0, 2.0, 0.9, -0.1, 0.8, 0.6, 3.0, 0.25]
        learnable = None
    elif name == "plif":
        p = _program(defs.PLIF, sg.Sigmoid(), False, False, ("decay_logit",))
        consts = [1.0, 0.0]
        learnable = torch.tensor([0.4], requires_grad=True)
    else:
        p = _program(defs.NeuronDef("tanh_in_ops", charge="v + tanh(x)"), sg.ATan(), True, True)
        consts = [1.0, -0.1]
        learnable = None
    adaptive = p.definition.adaptive
    x = (torch.randn(T, N, generator=g, dtype=f64) + 0.6).requires_grad_(True)
    v0 = (0.3 * torch.randn(N, generator=g, dtype=f64)).requires_grad_(True)
    w0 = (0.2 * torch.randn(N, generator=g, dtype=f64)).requires_grad_(True) if adaptive else None
    spikes, v_seq, v_last, w_last, _, _ = FPTT(
        p.key, "torch", x, v0, w0, learnable, consts, [0.0, 0.0], True, True
    )
    ups = [torch.randn(t.shape, generator=g, dtype=f64) for t in (spikes, v_seq, v_last)]
    loss = sum((a * b).sum() for a, b in zip((spikes, v_seq, v_last), ups, strict=True))
    if adaptive:
        gw = torch.randn(N, generator=g, dtype=f64)
        loss = loss + (w_last * gw).sum()
    inputs = [x, v0] + ([w0] if adaptive else []) + ([learnable] if learnable is not None else [])
    got = torch.autograd.grad(loss, inputs)

    clones = [t.detach().clone().requires_grad_(True) for t in inputs]
    xo, vo = clones[0], clones[1]
    wo = clones[2] if adaptive else torch.empty(0, dtype=f64)
    lo = clones[-1] if learnable is not None else torch.empty(0)
    so, vso, vlo, wlo = oracle(p, xo, vo, wo, lo, consts)
    assert torch.equal(spikes.detach(), so.detach())
    loss_o = sum((a * b).sum() for a, b in zip((so, vso, vlo), ups, strict=True))
    if adaptive:
        loss_o = loss_o + (wlo * gw).sum()
    want = torch.autograd.grad(loss_o, clones)
    for a, b in zip(got, want, strict=True):
        tol = 1e-6 if a.dtype == torch.float32 else 1e-10  # the learnable tensor is float32
        assert (a - b).abs().max() <= tol * b.abs().max()


# ---- opcheck ------------------------------------------------------------------------------------
def _program(definition, surrogate, hard, detach, learnable=()):
    return NeuronProgram(definition, surrogate, hard, detach, learnable)


def _fptt_args(case: str):
    """(program, backend, x, v0, w0, learnable, constants, init, save, store_v_seq)."""
    g = gen(3)
    f64 = torch.float64
    if case == "lif_f32_save_store":
        p = _program(defs.LIF, sg.Sigmoid(), True, False)
        x = torch.randn(3, 4, generator=g, requires_grad=True)
        v0, w0, lrn, consts, save, store = (
            torch.zeros(4, requires_grad=True),
            None,
            None,
            [1.0, 0.0, 2.0],
            True,
            True,
        )
    elif case == "izh_f64_soft_detach":
        p = _program(defs.IZHIKEVICH, sg.ATan(), False, True)
        x = torch.randn(2, 5, 3, generator=g, dtype=f64, requires_grad=True)
        v0 = (0.3 * torch.randn(5, 3, generator=g, dtype=f64)).requires_grad_()
        w0 = (0.2 * torch.randn(5, 3, generator=g, dtype=f64)).requires_grad_()
        lrn, consts, save, store = None, [1.0, 0.0, 2.0, 1.0, -0.1, 0.8, 1.0, 2.0, 0.3], True, False
    elif case == "izh_constant_init":
        p = _program(defs.IZHIKEVICH, sg.ATan(), True, False)
        x = torch.randn(3, 4, generator=g, requires_grad=True)
        v0, w0, lrn, consts, save, store = (
            None,
            None,
            None,
            [1.0, 0.0, 2.0, 1.0, -0.1, 0.8, 1.0, 2.0, 0.3],
            True,
            True,
        )
    elif case == "plif_learnable":
        p = _program(defs.PLIF, sg.PiecewiseQuadratic(), True, False, ("decay_logit",))
        x = torch.randn(4, 3, generator=g, requires_grad=True)
        v0, w0, lrn, consts, save, store = (
            torch.zeros(3),
            None,
            torch.tensor([0.4], requires_grad=True),
            [1.0, -0.1],
            True,
            True,
        )
    elif case == "eif_no_save_T1":
        p = _program(defs.EIF, sg.Erf(), True, False)
        x = torch.randn(1, 7, generator=g)
        v0, w0, lrn, consts, save, store = (
            None,
            None,
            None,
            [1.0, -0.1, 2.0, 0.0, 1.0, 0.8],
            False,
            False,
        )
    elif case == "qif_f16_store":
        p = _program(defs.QIF, sg.Rect(), True, False)
        x = torch.randn(3, 5, generator=g).half().requires_grad_()
        v0, w0, lrn, consts, save, store = (
            torch.zeros(5),
            None,
            None,
            [1.0, -0.1, 2.0, 1.0, 0.0, 0.8],
            True,
            True,
        )
    elif case == "tanh_needs_x":
        p = _program(
            defs.NeuronDef("tanh_in_ops", charge="v + tanh(x)"), sg.SoftSign(), False, False
        )
        x = torch.randn(3, 4, generator=g, requires_grad=True)
        v0, w0, lrn, consts, save, store = None, None, None, [1.0, 0.0], True, False
    elif case == "non_contiguous":
        p = _program(defs.LIF, sg.Sigmoid(), True, False)
        x = torch.randn(4, 3, 5, generator=g).transpose(1, 2).requires_grad_()
        v0, w0, lrn, consts, save, store = (
            torch.zeros(5, 3),
            None,
            None,
            [1.0, 0.0, 2.0],
            True,
            True,
        )
    elif case == "bf16_no_store":
        p = _program(defs.LIF, sg.Sigmoid(), True, False)
        x = torch.randn(2, 3, generator=g).bfloat16().requires_grad_()
        v0, w0, lrn, consts, save, store = None, None, None, [1.0, 0.0, 2.0], True, False
    else:
        raise AssertionError(case)
    init = [0.2, 0.1]
    return (p.key, "torch", x, v0, w0, lrn, consts, init, save, store)


# opcheck's default test_utils (test_schema, test_autograd_registration, test_faketensor,
# test_aot_dispatch_dynamic) all apply to these ops, so none are left out.
@pytest.mark.parametrize(
    "case",
    [
        "lif_f32_save_store",
        "izh_f64_soft_detach",
        "izh_constant_init",
        "plif_learnable",
        "eif_no_save_T1",
        "qif_f16_store",
        "tanh_needs_x",
        "non_contiguous",
        "bf16_no_store",
    ],
)
def test_opcheck_fptt(case):
    torch.library.opcheck(FPTT, _fptt_args(case))


@pytest.mark.parametrize(
    "case",
    [
        "lif_f32",
        "izh_f64",
        "lif_f16_no_w0",
    ],
)
def test_opcheck_bptt(case):
    g = gen(4)
    T, N = 3, 4
    if case.startswith("lif"):
        p = _program(defs.LIF, sg.Sigmoid(), True, False)
        dtype = torch.float16 if case == "lif_f16_no_w0" else torch.float32
        consts = [1.0, 0.0, 2.0]
        x = (torch.randn(T, N, generator=g) + 0.8).to(dtype)
        v0, w0 = torch.zeros(N), None
    else:
        p = _program(defs.IZHIKEVICH, sg.ATan(), True, False)
        dtype = torch.float64
        consts = [1.0, 0.0, 2.0, 1.0, -0.1, 0.8, 1.0, 2.0, 0.3]
        x = torch.randn(T, N, generator=g, dtype=dtype) + 0.8
        v0, w0 = torch.zeros(N, dtype=dtype), torch.full((N,), 0.1, dtype=dtype)
    init = [0.0, 0.0]
    out = ref.fptt(
        p,
        x,
        v0,
        w0,
        learnable=None,
        constants=consts,
        init=init,
        save_for_backward=True,
        store_v_seq=False,
    )
    gs = torch.randn(T, N, generator=g).to(dtype)
    gvl = torch.randn(N, generator=g).to(v0.dtype)
    gwl = torch.randn(N, generator=g).to(dtype) if w0 is not None else None
    grad_v_seq = x_seq = learnable = None
    args = (
        p.key,
        "torch",
        gs,
        grad_v_seq,
        gvl,
        gwl,
        out.saved_v,
        out.saved_w,
        x_seq,
        v0,
        w0,
        learnable,
        consts,
        init,
    )
    torch.library.opcheck(BPTT, args)


# ---- what the forward saves ---------------------------------------------------------------------
class SavedTensors:
    """Records every tensor autograd saves for backward."""

    def __init__(self) -> None:
        self.saved: list[torch.Tensor] = []
        self._hooks = saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t):
        self.saved.append(t)
        return t

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)

    def nonempty(self):
        return [t for t in self.saved if t.numel() > 0]


@pytest.fixture
def fptt_calls(monkeypatch):
    """(save_for_backward, FPTTOut) of every reference fptt call made by the op."""
    calls = []
    original = ref.fptt
    signature = inspect.signature(original)

    def recording(*args, **kwargs):
        out = original(*args, **kwargs)
        save = signature.bind(*args, **kwargs).arguments["save_for_backward"]
        calls.append((save, out))
        return out

    monkeypatch.setattr(ref, "fptt", recording)
    return calls


@pytest.mark.parametrize("mode", ["no_grad", "inputs_without_grad", "inference_mode"])
@pytest.mark.parametrize("name", ["lif", "izh"])
def test_forward_without_autograd_saves_nothing(fptt_calls, mode, name):
    node = (neuron.LIFNode if name == "lif" else neuron.IzhikevichNode)(
        step_mode="m", backend="torch", store_v_seq=True
    )
    x = torch.randn(5, 3, generator=gen(5)) * 2
    if mode == "no_grad":
        x.requires_grad_(True)
        ctx = torch.no_grad()
    elif mode == "inference_mode":
        ctx = torch.inference_mode()
    else:
        ctx = torch.enable_grad()
    with SavedTensors() as rec, ctx:
        s = node(x)
    assert rec.saved == []
    assert not s.requires_grad
    [(save, out)] = fptt_calls
    assert save is False
    assert out.saved_v is None and out.saved_w is None
    assert node.v_seq.shape == x.shape  # store_v_seq still works


def test_lif_forward_saves_only_h(fptt_calls):
    T, N, C = 6, 3, 5
    node = neuron.LIFNode(step_mode="m", backend="torch", store_v_seq=True)
    x = (torch.randn(T, N, C, generator=gen(6)) * 2).requires_grad_(True)
    with SavedTensors() as rec:
        s = node(x)
    [(save, out)] = fptt_calls
    assert save is True
    big = [t for t in rec.nonempty() if t.dim() == 3]
    small = [t for t in rec.nonempty() if t.dim() < 3]
    assert len(big) == 1 and big[0].shape == (T, N, C)  # one [T, *] tensor: H
    assert big[0] is out.saved_v
    # H, not the spikes nor V: check against the LIF charge by hand (tau = 2, v_reset = 0)
    v, hs = torch.zeros(N, C), []
    for t in range(T):
        hh = v + (x.detach()[t] - v) / 2
        hs.append(hh)
        v = torch.where(hh >= 1, torch.zeros_like(hh), hh)
    torch.testing.assert_close(big[0], torch.stack(hs))
    assert not torch.equal(big[0], s.detach()) and not torch.equal(big[0], node.v_seq.detach())
    assert small == []  # V[0] is the constant V_reset; LIF has no learnable tensor
    assert rec.saved == big  # nothing else, not even placeholders
    (s.sum() + node.v_seq.sum()).backward()  # and backward works from what was saved
    assert x.grad is not None and x.grad.shape == x.shape


def test_plif_forward_saves_h_state_and_learnable():
    T, N = 4, 7
    node = neuron.ParametricLIFNode(step_mode="m", backend="torch")
    x = torch.randn(T, N, generator=gen(7)) * 2  # no grad on x: only w needs it
    with SavedTensors() as rec:
        node(x).sum().backward()
    shapes = sorted(tuple(t.shape) for t in rec.nonempty())
    # [T, N] H and () the learnable w itself (the neuron computes its sigmoid: no autograd
    # op of its own); V[0] is the constant V_reset
    assert shapes == sorted([(T, N), ()])
    assert node.w.grad is not None


def test_half_input_saves_float32_h(fptt_calls):
    node = neuron.LIFNode(step_mode="m", backend="torch")
    x = torch.randn(3, 4, generator=gen(8)).half().requires_grad_(True)
    with SavedTensors() as rec:
        s = node(x)
    assert s.dtype == torch.float16
    [h] = [t for t in rec.nonempty() if t.dim() == 2]
    assert h.dtype == torch.float32
    s.float().sum().backward()
    assert x.grad.dtype == torch.float16


# ---- memory layout ------------------------------------------------------------------------------
def _permuted_inputs():
    """[T, B, C, H, W] laid out channels-last, [T, B, C, L] with the channels innermost, and two
    layouts no permutation makes dense with time outermost (run as contiguous copies)."""
    x = torch.randn(3, 2, 4, 5, 6, generator=gen(2)) * 2
    tokens = torch.randn(3, 2, 7, 4, generator=gen(3)).transpose(-2, -1) * 2
    return [
        ("channels-last", x.permute(0, 1, 3, 4, 2).contiguous().permute(0, 1, 4, 2, 3), True),
        ("channels-innermost", tokens, True),
        ("time-inside", x.transpose(0, 1).contiguous().transpose(0, 1), False),
        ("gaps", x[..., ::2], False),
    ]


@pytest.mark.parametrize(("name", "x", "kept"), _permuted_inputs(), ids=lambda v: str(v)[:20])
@pytest.mark.parametrize("node", [neuron.LIFNode, neuron.ParametricLIFNode, neuron.IzhikevichNode])
def test_outputs_keep_a_dense_layout_and_equal_the_contiguous_run(name, x, kept, node):
    """As torch's pointwise ops: the spikes, V and the gradients lie as x does where x is a
    dense permutation with time outermost, and equal what a contiguous x gives."""
    del name
    outputs = []
    for inp in (x, x.contiguous()):
        torch.manual_seed(0)
        n = node(step_mode="m", backend="torch", store_v_seq=True)
        inp = inp.detach().clone(memory_format=torch.preserve_format).requires_grad_()
        s = n(inp)
        second = n(inp)  # V carried over from the first call, in its layout
        (s + second).sum().backward()
        outputs.append((s, second, n.v, n.v_seq, inp.grad))
    for got, want in zip(*outputs, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    s, second, v, v_seq, grad = outputs[0]
    if kept:
        assert s.stride() == x.stride() and v_seq.stride() == x.stride()
        assert v.stride() == x[0].stride() and grad.stride() == x.stride()
    else:
        assert s.is_contiguous() and v.is_contiguous()


def test_a_permuted_input_compiles_without_graph_breaks():
    """The permutation around the op traces: fullgraph, equal to eager."""
    torch._dynamo.reset()
    lif = neuron.LIFNode(step_mode="m", backend="torch")

    def step(x):
        lif.reset()
        return lif(x.transpose(-2, -1)) * 2

    x = (torch.randn(3, 2, 5, 4, generator=gen(4)) * 2).requires_grad_()
    want = step(x)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(x)
    assert torch.equal(got, want) and got.stride() == want.stride()
    g = torch.randn(want.shape, generator=gen(5))
    torch.testing.assert_close(torch.autograd.grad(got, x, g), torch.autograd.grad(want, x, g))
