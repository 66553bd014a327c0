"""Surrogate gradients: Heaviside forward, SpikingJelly's derivative formulas (written out here by
hand), hyper-parameter validation and user-defined surrogates."""

from __future__ import annotations

import math

import pytest
import sympy as sp
import torch

from oracle import oracle
from spikefuse import SpikefuseError, neuron
from spikefuse import surrogate as sg


# SpikingJelly's formulas, in float64 torch, independent of the library's sympy expressions.
def sigmoid_d(x, alpha):
    s = torch.sigmoid(alpha * x)
    return alpha * s * (1 - s)


def atan_d(x, alpha):
    return alpha / 2 / (1 + (math.pi / 2 * alpha * x) ** 2)


def piecewise_quadratic_d(x, alpha):
    return torch.where(x.abs() > 1 / alpha, torch.zeros_like(x), -(alpha**2) * x.abs() + alpha)


def piecewise_exp_d(x, alpha):
    return alpha / 2 * torch.exp(-alpha * x.abs())


def soft_sign_d(x, alpha):
    return alpha / (2 * (1 + (alpha * x).abs()) ** 2)


def super_spike_d(x, alpha):
    return alpha / (x.abs() + 1) ** 2


def sj_rect_d(x, alpha):
    return torch.where(x.abs() < 0.5 / alpha, torch.full_like(x, alpha), torch.zeros_like(x))


def erf_d(x, alpha):
    return alpha / math.sqrt(math.pi) * torch.exp(-(alpha**2) * x**2)


def rect_d(x, eta, th_l, th_r):
    return torch.where((x > th_l) & (x < th_r), torch.full_like(x, eta), torch.zeros_like(x))


# class -> (hand formula, default alpha)
ALPHA_SURROGATES = {
    sg.Sigmoid: (sigmoid_d, 4.0),
    sg.ATan: (atan_d, 2.0),
    sg.PiecewiseQuadratic: (piecewise_quadratic_d, 1.0),
    sg.PiecewiseExp: (piecewise_exp_d, 1.0),
    sg.SoftSign: (soft_sign_d, 2.0),
    sg.SuperSpike: (super_spike_d, 1.0),
    sg.Erf: (erf_d, 2.0),
    sg.Rect: (sj_rect_d, 1.0),
}


def points(seed: int = 0) -> torch.Tensor:
    """Many float64 points: a dense grid, random values, zero and the window edges."""
    g = torch.Generator().manual_seed(seed)
    grid = torch.linspace(-4, 4, 1601, dtype=torch.float64)
    rnd = torch.randn(500, generator=g, dtype=torch.float64) * 2
    edges = torch.tensor(
        [0.0, -0.0, 0.5, -0.5, 1.0, -1.0, 0.25, -0.25, 1e-300, -1e-300, 30.0, -30.0],
        dtype=torch.float64,
    )
    return torch.cat([grid, rnd, edges])


def assert_abs_close(got, want, tol=1e-12):
    assert got.dtype == torch.float64
    assert got.shape == want.shape
    err = (got - want).abs().max().item()
    assert err <= tol, f"max abs error {err}"


def test_every_surrogate_is_covered():
    assert set(sg.ALL) == set(ALPHA_SURROGATES) | {sg.RectWindow}


@pytest.mark.parametrize("cls", list(ALPHA_SURROGATES), ids=lambda c: c.__name__)
def test_default_alpha_and_formula(cls):
    formula, alpha = ALPHA_SURROGATES[cls]
    s = cls()
    assert s.alpha == alpha
    assert s.hyperparameters() == {"alpha": alpha}
    x = points()
    assert_abs_close(s.derivative(x), formula(x, alpha))


@pytest.mark.parametrize("alpha", [0.3, 1.7, 5.0])
@pytest.mark.parametrize("cls", list(ALPHA_SURROGATES), ids=lambda c: c.__name__)
def test_custom_alpha_formula(cls, alpha):
    formula, _ = ALPHA_SURROGATES[cls]
    s = cls(alpha=alpha)
    x = points(seed=int(alpha * 10))
    assert_abs_close(s.derivative(x), formula(x, alpha))


@pytest.mark.parametrize("alpha", [0.3, 1.7])
@pytest.mark.parametrize("cls", list(ALPHA_SURROGATES), ids=lambda c: c.__name__)
def test_static_style_methods_take_alpha_per_call(cls, alpha):
    """SpikingJelly's static methods: ``cls.spiking_function(x, alpha)`` spikes with the
    derivative at alpha; ``cls.backward(grad_output, x, alpha)`` is that gradient."""
    formula, _ = ALPHA_SURROGATES[cls]
    x = points(seed=3)
    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(4), dtype=x.dtype)
    assert_abs_close(cls.backward(upstream, x, alpha), upstream * formula(x, alpha))
    xg = x.clone().requires_grad_(True)
    spikes = cls.spiking_function(xg, alpha)
    assert torch.equal(spikes, sg.heaviside(x))
    (grad,) = torch.autograd.grad((spikes * upstream).sum(), [xg])
    assert_abs_close(grad, upstream * formula(x, alpha))
    assert torch.equal(cls(alpha).spiking_function(x, alpha), spikes)
    with pytest.raises(SpikefuseError, match="alpha"):
        cls.spiking_function(x, 0.0)


def test_rect_default_and_custom():
    s = sg.RectWindow()
    assert s.hyperparameters() == {"eta": 1.0, "th_l": -0.5, "th_r": 0.5}
    x = points()
    assert_abs_close(s.derivative(x), rect_d(x, 1.0, -0.5, 0.5))
    # the window is open: exactly on an edge the derivative is 0
    assert s.derivative(torch.tensor([-0.5, 0.5], dtype=torch.float64)).tolist() == [0.0, 0.0]
    s = sg.RectWindow(eta=2.5, th_l=-0.25, th_r=0.75)  # the DATE'22 window around threshold 0.25
    assert_abs_close(s.derivative(x), rect_d(x, 2.5, -0.25, 0.75))


ALL_INSTANCES = [cls() for cls in sg.ALL] + [sg.Sigmoid(alpha=0.5), sg.RectWindow(eta=3.0)]


@pytest.mark.parametrize("surrogate", ALL_INSTANCES, ids=lambda s: repr(s))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16])
def test_forward_is_heaviside(surrogate, dtype):
    x = torch.tensor([-2.0, -1e-3, -0.0, 0.0, 1e-3, 0.7, 3.0], dtype=dtype)
    y = surrogate(x)
    assert y.dtype == dtype
    assert y.tolist() == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]  # Θ(0) = 1
    assert sg.heaviside(x).tolist() == y.tolist()


@pytest.mark.parametrize("surrogate", ALL_INSTANCES, ids=lambda s: repr(s))
def test_autograd_gives_derivative(surrogate):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(4, 7, generator=g, dtype=torch.float64) * 0.8).t()  # non-contiguous
    x.requires_grad_(True)
    upstream = torch.randn(x.shape, generator=g, dtype=torch.float64)
    (grad,) = torch.autograd.grad((surrogate(x) * upstream).sum(), [x])
    assert torch.equal(grad, upstream * surrogate.derivative(x.detach()))
    if isinstance(surrogate, sg.Sigmoid):  # and the formula (not just self-consistency)
        assert_abs_close(grad, upstream * sigmoid_d(x.detach(), surrogate.alpha))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_derivative_keeps_dtype(dtype):
    x = torch.linspace(-1, 1, 11, dtype=dtype)
    for cls in sg.ALL:
        d = cls().derivative(x)
        assert d.dtype == dtype and d.shape == x.shape


@pytest.mark.parametrize("cls", list(ALPHA_SURROGATES), ids=lambda c: c.__name__)
@pytest.mark.parametrize("alpha", [0.0, -1.0, float("nan"), float("inf"), -float("inf")])
def test_invalid_alpha_raises(cls, alpha):
    with pytest.raises(SpikefuseError, match="alpha"):
        cls(alpha=alpha)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"th_l": 0.5, "th_r": 0.5},
        {"th_l": 1.0, "th_r": -1.0},
        {"eta": float("nan")},
        {"th_l": -float("inf")},
        {"th_r": float("nan")},
    ],
)
def test_invalid_rect_raises(kwargs):
    with pytest.raises(SpikefuseError, match="RectWindow"):
        sg.RectWindow(**kwargs)


class Triangle(sg.Surrogate):
    """A user surrogate: Θ'(x) = γ / (1 + (γx)²)² (smooth, not shipped)."""

    def __init__(self, gamma: float = 1.5) -> None:
        super().__init__()
        self.gamma = gamma

    def hyperparameters(self):
        return {"gamma": self.gamma}

    def expression(self, x):
        return self.gamma / (1 + (self.gamma * x) ** 2) ** 2


def triangle_d(x, gamma):
    return gamma / (1 + (gamma * x) ** 2) ** 2


def test_user_surrogate_derivative_and_key():
    s = Triangle(1.5)
    x = points()
    assert_abs_close(s.derivative(x), triangle_d(x, 1.5))
    assert "Triangle" in s.key and s.key != Triangle(2.0).key
    assert "gamma=1.5" in repr(s)
    assert isinstance(s.derivative_expr, sp.Expr)


def test_base_surrogate_is_abstract():
    with pytest.raises(NotImplementedError):
        sg.Surrogate().derivative  # noqa: B018


@pytest.mark.parametrize("hard", [True, False])
def test_user_surrogate_in_neuron(hard):
    """One LIF step: dS/dX = Θ'(H - V_th) / tau with the user's Θ'."""
    g = torch.Generator().manual_seed(2)
    tau, vth = 2.0, 1.0
    node = neuron.LIFNode(
        tau=tau,
        v_reset=0.0 if hard else None,
        surrogate_function=Triangle(1.5),
        step_mode="m",
        backend="torch",
    )
    xs = (torch.randn(1, 9, generator=g, dtype=torch.float64) + 1.5).requires_grad_(True)
    s = node(xs)
    (gx,) = torch.autograd.grad(s.sum(), [xs])
    hh = xs.detach() / tau  # v0 = 0 (= v_reset for hard, 0 for soft reset)
    assert torch.equal(s.detach(), (hh >= vth).double())
    assert_abs_close(gx, triangle_d(hh - vth, 1.5) / tau)


def test_user_surrogate_bptt_matches_oracle():
    node = neuron.LIFNode(surrogate_function=Triangle(0.7), step_mode="m", backend="torch")
    g = torch.Generator().manual_seed(3)
    xs = (torch.randn(6, 5, generator=g, dtype=torch.float64) + 0.8).requires_grad_(True)
    s = node(xs)
    gs = torch.randn(s.shape, generator=g, dtype=s.dtype)
    (gx,) = torch.autograd.grad((s * gs).sum(), [xs])
    xo = xs.detach().clone().requires_grad_()
    so, *_ = oracle(
        node.program,
        xo,
        torch.zeros(5, dtype=xo.dtype),
        xo.new_empty(0),
        torch.empty(0),
        node.constants(),
    )
    (ox,) = torch.autograd.grad((so * gs).sum(), [xo])
    assert torch.equal(s.detach(), so.detach())
    assert (gx - ox).abs().max() <= 1e-12 * ox.abs().max()


def test_non_surrogate_rejected_by_neuron():
    with pytest.raises(
        SpikefuseError, match="surrogate_function must be a spikefuse.surrogate.Surrogate"
    ):
        neuron.LIFNode(surrogate_function=torch.nn.Sigmoid())


def test_float64_window_edges_are_exact():
    # 1/(2 alpha) printed with 15 digits lay one float64 step beyond 1/6: Rect(3) was 3 there
    x = torch.tensor([1 / 6, -1 / 6, 0.1], dtype=torch.float64)
    assert sg.Rect(3.0).derivative(x).tolist() == [0.0, 0.0, 3.0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sigmoid_derivative_of_16_bit_input_is_computed_in_float32(dtype):
    x = torch.tensor([2.0, -2.0, 1.5], dtype=dtype)
    want = sg.Sigmoid().derivative(x.double()).to(dtype)
    got = sg.Sigmoid().derivative(x)
    assert got.dtype == dtype and (got > 0).all()
    torch.testing.assert_close(got, want)


def test_piecewise_exp_primitive_has_its_gradient_at_zero():
    x = torch.tensor([0.0, 1e-30, -1e-30], requires_grad=True)
    sg.PiecewiseExp(alpha=2.0, spiking=False)(x).sum().backward()
    assert x.grad.tolist() == [1.0, 1.0, 1.0]  # alpha / 2, as SpikingJelly's
