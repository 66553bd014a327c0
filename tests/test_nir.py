"""NIR export/import: exact spikefuse round trips, and snnTorch/Norse cross-checks."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from spikefuse import functional, fuse, layer, neuron
from spikefuse.fused import FusedBlock

nir = pytest.importorskip("nir", reason="NIR interop needs the 'nir' package ([nir] extra)")
from spikefuse.interop.nir import (  # noqa: E402
    LeakyIntegrator,
    NIRConversionError,
    NIRGraphModule,
    Scale,
    export_nir,
    import_nir,
)

T, N = 8, 3
NORSE_MISSING = (
    "Norse is not installed (pip install --no-deps norse: its torchvision requirement is unused "
    "by norse.torch, and torchvision's PyPI wheel does not load next to a CPU-only torch)"
)


def conv_net(node, dtype=torch.float64) -> nn.Sequential:
    """Conv -> neuron -> avg pool -> conv (no bias) -> neuron -> flatten -> linear -> neuron."""
    torch.manual_seed(0)
    net = nn.Sequential(
        layer.Conv2d(1, 4, 3, padding=1, step_mode="m"),
        node(),
        layer.AvgPool2d(2, step_mode="m"),
        layer.Conv2d(4, 6, 3, stride=2, padding=1, bias=False, step_mode="m"),
        node(),
        layer.Flatten(step_mode="m"),
        layer.Linear(24, 5, step_mode="m"),
        node(),
    )
    return scaled(net).to(dtype)


def fc_net(node, dtype=torch.float64) -> nn.Sequential:
    torch.manual_seed(1)
    net = nn.Sequential(
        layer.Linear(12, 16, step_mode="m"),
        node(),
        layer.Linear(16, 4, bias=False, step_mode="m"),
        node(),
    )
    return scaled(net).to(dtype)


def scaled(net: nn.Sequential) -> nn.Sequential:
    """Larger weights, so that every layer spikes at a moderate rate."""
    with torch.no_grad():
        for p in net.parameters():  # Norse cells hold no parameters
            p.mul_(3.0)
    return net


def run(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    functional.reset_net(model)
    with torch.no_grad():
        out = model(x)
    functional.reset_net(model)
    return out


def spike_rates(model: nn.Sequential, x: torch.Tensor) -> list[float]:
    rates = []
    functional.reset_net(model)
    with torch.no_grad():
        for module in model:
            x = module(x)
            if isinstance(module, neuron.BaseNode):
                rates.append(x.mean().item())
    functional.reset_net(model)
    return rates


def conv_input(dtype=torch.float64) -> torch.Tensor:
    torch.manual_seed(2)
    return torch.rand(T, N, 1, 8, 8, dtype=dtype)


def fc_input(dtype=torch.float64) -> torch.Tensor:
    torch.manual_seed(3)
    return torch.rand(T, N, 12, dtype=dtype)


def lif(decay_input=True, v_reset=0.2):
    # decay_input=True divides the input by tau: a lower threshold keeps the rates similar
    v_threshold = 0.3 if decay_input else 0.6
    return lambda: neuron.LIFNode(
        tau=2.5, decay_input=decay_input, v_threshold=v_threshold, v_reset=v_reset, step_mode="m"
    )


def if_node(v_reset=-0.1):
    return lambda: neuron.IFNode(v_threshold=0.7, v_reset=v_reset, step_mode="m")


def assert_exact_round_trip(model: nn.Sequential, x: torch.Tensor, shape, dt=1.0):
    rates = spike_rates(model, x)
    assert all(0.02 < r < 0.98 for r in rates), rates  # the comparison is not vacuous
    graph = export_nir(model, shape, dt=dt)
    imported = import_nir(graph, dt=dt, backend="torch")
    assert isinstance(imported, nn.Sequential)
    expected, got = model.state_dict(), imported.state_dict()
    assert expected.keys() == got.keys()
    for key in expected:
        assert expected[key].dtype == got[key].dtype and torch.equal(expected[key], got[key]), key
    for a, b in zip(model, imported, strict=True):
        assert type(a) is type(b)
        if isinstance(a, neuron.BaseNode):
            assert a.definition is b.definition and a.constants() == b.constants()
    assert torch.equal(run(model, x), run(imported, x))
    return graph


# ---- exact round trips -----------------------------------------------------------------------
@pytest.mark.parametrize("decay_input", [True, False])
def test_round_trip_conv_lif_is_exact(decay_input):
    model = conv_net(lif(decay_input))
    graph = assert_exact_round_trip(model, conv_input(), (1, 8, 8))
    kinds = [type(n).__name__ for n in graph.nodes.values()]
    assert kinds == "Input Conv2d LIF AvgPool2d Conv2d LIF Flatten Affine LIF Output".split()
    node = graph.nodes["1"]
    assert node.tau.shape == (4, 8, 8) and np.all(node.tau == 2.5)
    assert np.all(node.r == (1.0 if decay_input else 2.5))
    assert np.all(node.v_leak == 0.2) and np.all(node.v_reset == 0.2)
    assert np.all(node.v_threshold == (0.3 if decay_input else 0.6))


def test_round_trip_conv_if_is_exact():
    graph = assert_exact_round_trip(conv_net(if_node()), conv_input(), (1, 8, 8))
    assert isinstance(graph.nodes["4"], nir.IF) and np.all(graph.nodes["4"].r == 1.0)


def test_copied_and_fused_if_models_export():
    """A deep copy (what fuse and torch.load make) holds an equal, not the same, definition."""
    model = conv_net(if_node())
    reference = export_nir(model, (1, 8, 8), dt=1.0)
    for other in (copy.deepcopy(model), fuse(model)):
        graph = export_nir(other, (1, 8, 8), dt=1.0)
        assert [type(n) for n in graph.nodes.values()] == [
            type(n) for n in reference.nodes.values()
        ]


def test_round_trip_fc_is_exact_with_dt():
    # tau * dt / dt == tau for these values, so dt != 1 is exact too
    graph = assert_exact_round_trip(fc_net(lif(False)), fc_input(), (12,), dt=0.5)
    assert isinstance(graph.nodes["2"], nir.Linear)
    assert np.all(graph.nodes["1"].tau == 1.25) and np.all(graph.nodes["1"].r == 2.5)


def test_parametric_lif_exports_its_current_tau():
    torch.manual_seed(12)
    model = nn.Sequential(
        layer.Linear(12, 8, step_mode="m"),
        neuron.ParametricLIFNode(init_tau=3.0, decay_input=False, v_threshold=0.6, step_mode="m"),
    )
    model = scaled(model).double()
    with torch.no_grad():
        model[1].w.fill_(-0.9)  # as if trained: tau = 1 / sigmoid(-0.9)
    tau = 1.0 / torch.sigmoid(torch.tensor(-0.9)).item()
    graph = export_nir(model, (12,), dt=1.0)
    node = graph.nodes["1"]
    assert np.allclose(node.tau, tau) and np.allclose(node.r, tau)
    imported = import_nir(graph, dt=1.0)
    assert isinstance(imported[1], neuron.LIFNode) and not imported[1].decay_input
    x = fc_input()
    assert 0 < run(model, x).mean() < 1
    # PLIF multiplies by sigmoid(w) in float32, LIFNode divides by tau: the potentials agree up
    # to rounding, the spikes here exactly
    assert torch.equal(run(imported, x), run(model, x))


def test_round_trip_through_an_hdf5_file(tmp_path):
    pytest.importorskip("h5py", reason="nir.write needs h5py")
    model = conv_net(lif(True))
    path = tmp_path / "net.nir"
    nir.write(path, export_nir(model, (1, 8, 8), dt=1.0))
    imported = import_nir(nir.read(path), dt=1.0)
    x = conv_input()
    assert torch.equal(run(model, x), run(imported, x))


def test_sum_pool_and_scale_round_trip():
    torch.manual_seed(4)
    model = nn.Sequential(
        layer.Conv2d(1, 2, 3, padding=1, step_mode="m"),
        neuron.LIFNode(v_threshold=0.5, step_mode="m"),
        layer.AvgPool2d(2, divisor_override=1, step_mode="m"),
        Scale(torch.rand(2, 4, 4, dtype=torch.float64)),
        layer.Flatten(step_mode="m"),
        layer.Linear(32, 3, step_mode="m"),
        neuron.IFNode(v_threshold=0.5, step_mode="m"),
    )
    model = scaled(model).double()
    graph = export_nir(model, (1, 8, 8), dt=1.0)
    assert isinstance(graph.nodes["2"], nir.SumPool2d) and isinstance(graph.nodes["3"], nir.Scale)
    imported = import_nir(graph, dt=1.0)
    x = conv_input()
    assert run(model, x).sum() > 0
    assert torch.equal(run(model, x), run(imported, x))


@pytest.mark.parametrize("decay_input", [True, False])
def test_leaky_integrator_is_nir_li_and_round_trips(decay_input):
    torch.manual_seed(11)
    model = nn.Sequential(
        layer.Linear(12, 6, step_mode="m"),
        neuron.IFNode(v_threshold=0.5, step_mode="m"),
        layer.Linear(6, 3, step_mode="m"),
        LeakyIntegrator(tau=3.0, decay_input=decay_input, v_leak=0.25, backend="torch"),
    ).double()
    x = fc_input()
    out = run(model, x)
    # V[t] of the leaky integrator, step by step (spikefuse evaluates the charge equation in
    # sympy's arrangement, so equal up to float64 rounding)
    with torch.no_grad():
        y = model[2](model[1](model[0](x)))
    v, expected = torch.full_like(y[0], 0.25), []
    for t in range(T):
        if decay_input:
            v = v + (y[t] - (v - 0.25)) / 3.0
        else:
            v = v - (v - 0.25) / 3.0 + y[t]
        expected.append(v)
    torch.testing.assert_close(out, torch.stack(expected), rtol=1e-14, atol=1e-14)
    functional.reset_net(model)
    model(x).sum().backward()  # no spikes, no NaN: the surrogate is 0 far below the threshold
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert model[2].weight.grad.abs().sum() > 0
    graph = export_nir(model, (12,), dt=0.25)
    li = graph.nodes["3"]
    assert isinstance(li, nir.LI) and np.all(li.tau == 0.75)
    assert np.all(li.r == (1.0 if decay_input else 3.0)) and np.all(li.v_leak == 0.25)
    imported = import_nir(graph, dt=0.25)
    assert isinstance(imported[3], LeakyIntegrator)
    assert imported[3].node.decay_input == decay_input
    assert torch.equal(run(imported, x), out)


def residual_graph() -> nir.NIRGraph:
    """input -> conv1 -> lif1 -> block.conv2 -> block.lif2 -> flat -> fc -> lif3 -> output,
    plus the residual edge lif1 -> flat: flat receives lif1 + block.lif2."""
    rng = np.random.default_rng(5)

    def lif_node(shape, tau, r):
        full = lambda v: np.full(shape, v)  # noqa: E731
        return nir.LIF(
            tau=full(tau), r=full(r), v_leak=full(0.0), v_threshold=full(0.5), v_reset=full(0.0)
        )

    def conv(c_in, c_out):
        return nir.Conv2d(
            input_shape=(6, 6),
            weight=rng.normal(0, 1.0, (c_out, c_in, 3, 3)),
            stride=1,
            padding=1,
            dilation=1,
            groups=1,
            bias=rng.normal(0, 0.2, c_out),
        )

    nodes = {
        "input": nir.Input(input_type=np.array([2, 6, 6])),
        "conv1": conv(2, 3),
        "lif1": lif_node((3, 6, 6), 2.0, 1.0),
        "block.conv2": conv(3, 3),
        "block.lif2": lif_node((3, 6, 6), 3.0, 3.0),
        "flat": nir.Flatten(input_type=np.array([3, 6, 6]), start_dim=0, end_dim=-1),
        "fc": nir.Affine(weight=rng.normal(0, 0.3, (4, 108)), bias=np.zeros(4)),
        "lif3": lif_node((4,), 2.0, 1.0),
        "output": nir.Output(output_type=np.array([4])),
    }
    edges = [
        ("input", "conv1"),
        ("conv1", "lif1"),
        ("lif1", "block.conv2"),
        ("block.conv2", "block.lif2"),
        ("block.lif2", "flat"),
        ("lif1", "flat"),
        ("flat", "fc"),
        ("fc", "lif3"),
        ("lif3", "output"),
    ]
    return nir.NIRGraph(nodes=nodes, edges=edges)


def test_residual_graph_imports_runs_fuses_and_round_trips():
    graph = residual_graph()
    model = import_nir(graph, dt=1.0, backend="torch")
    assert isinstance(model, NIRGraphModule)
    assert list(model.chains) == ["conv1", "block_conv2", "flat"]
    assert model.sources == {
        "conv1": ("",),
        "block_conv2": ("conv1",),
        "flat": ("block_conv2", "conv1"),
    }
    torch.manual_seed(6)
    x = torch.rand(T, N, 2, 6, 6, dtype=torch.float64)
    c = model.chains
    # what the graph means, computed by hand from the imported layers
    h1 = c["conv1"].lif1(c["conv1"].conv1(x))
    h2 = c["block_conv2"].block_lif2(c["block_conv2"].block_conv2(h1))
    expected = c["flat"].lif3(c["flat"].fc(c["flat"].flat(h1 + h2)))
    assert 0 < h1.mean() < 1 and 0 < h2.mean() < 1 and 0 < expected.mean() < 1
    out = run(model, x)
    assert torch.equal(out, expected)
    # fuse finds Conv -> neuron inside the chains and computes the same
    fused = fuse(model)
    assert sum(isinstance(m, FusedBlock) for m in fused.modules()) == 3
    assert torch.equal(run(fused, x), out)
    # and back: the same graph, which imports to the same model
    again = export_nir(model, (2, 6, 6), dt=1.0)
    assert sorted(again.edges) == sorted(
        [(a.replace(".", "_"), b.replace(".", "_")) for a, b in graph.edges]
    )
    for name, node in graph.nodes.items():
        other = again.nodes[name.replace(".", "_")]
        assert type(other) is type(node)
        for field in ("weight", "bias", "tau", "r", "v_threshold", "v_reset"):
            if hasattr(node, field):
                assert np.array_equal(getattr(node, field), getattr(other, field)), (name, field)
    assert torch.equal(run(import_nir(again, dt=1.0), x), out)
    fused_round_trip = import_nir(export_nir(fused, (2, 6, 6), dt=1.0), dt=1.0)
    assert torch.equal(run(fused, x), run(fused_round_trip, x))


def test_imported_model_fuses_and_runs_on_every_backend():
    model = conv_net(lif(False, v_reset=0.0), dtype=torch.float32)
    imported = import_nir(export_nir(model, (1, 8, 8), dt=1.0), dt=1.0)
    x = conv_input(torch.float32)
    expected = run(model, x)
    for backend in ("torch", "auto"):
        functional.set_backend(imported, backend)
        assert torch.equal(run(imported, x), expected)
    fused = fuse(imported)
    assert sum(isinstance(m, FusedBlock) for m in fused.modules()) == 3
    assert torch.equal(run(fused, x), expected)


def test_fused_model_exports_with_batchnorm_folded():
    torch.manual_seed(7)
    node = lambda: neuron.LIFNode(tau=2.0, v_threshold=0.3, step_mode="m")  # noqa: E731
    model = nn.Sequential(
        layer.Conv2d(1, 4, 3, padding=1, bias=False, step_mode="m"),
        layer.BatchNorm2d(4, step_mode="m"),
        node(),
        layer.AvgPool2d(2, step_mode="m"),
        layer.Flatten(step_mode="m"),
        layer.Linear(64, 5, step_mode="m"),
        layer.BatchNorm1d(5, step_mode="m"),
        node(),
    ).double()
    with torch.no_grad():
        for bn in (model[1], model[6]):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.2, 0.2)
    model.eval()
    fused = fuse(model)
    assert sum(isinstance(m, FusedBlock) for m in fused.modules()) == 2
    graph = export_nir(fused, (1, 8, 8), dt=1.0)
    kinds = [type(n).__name__ for n in graph.nodes.values()]
    assert kinds == ["Input", "Conv2d", "LIF", "AvgPool2d", "Flatten", "Affine", "LIF", "Output"]
    assert list(graph.nodes)[1:3] == ["0", "0.node"]
    assert graph.nodes["0"].bias.any()  # the BatchNorm shift became the conv bias
    x = conv_input()
    expected = run(model, x)
    assert 0 < expected.mean() < 1
    assert torch.equal(run(import_nir(graph, dt=1.0), x), expected)
    assert torch.equal(run(import_nir(export_nir(model, (1, 8, 8), dt=1.0), dt=1.0), x), expected)
    model.train()
    with pytest.raises(NIRConversionError, match=r"0 \(Conv2d\) \+ BatchNorm2d.*model.eval"):
        export_nir(model, (1, 8, 8), dt=1.0)


# ---- refusals --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("module", "match"),
    [
        (neuron.LIFNode(v_reset=None), r"2 \(LIFNode\): soft reset"),
        (neuron.IFNode(v_reset=None), r"2 \(IFNode\): soft reset"),
        (neuron.QIFNode(), r"2 \(QIFNode\): neuron 'qif' has no NIR equivalent"),
        (neuron.EIFNode(), r"EIFNode.*no NIR equivalent"),
        (neuron.IzhikevichNode(), r"IzhikevichNode.*no NIR equivalent"),
        (layer.Dropout(0.5), r"2 \(Dropout\): no NIR equivalent"),
        (layer.BatchNorm1d(4), r"2 \(BatchNorm1d\): NIR has no BatchNorm"),
    ],
)
def test_export_refuses_what_nir_cannot_express(module, match):
    model = nn.Sequential(layer.Linear(3, 4), neuron.IFNode(), module)
    with pytest.raises(NIRConversionError, match=match):
        export_nir(model, (3,), dt=1.0)


def test_export_refuses_bad_arguments():
    model = nn.Sequential(layer.Linear(3, 4), neuron.IFNode())
    with pytest.raises(NIRConversionError, match="dt must be a positive"):
        export_nir(model, (3,), dt=0.0)
    with pytest.raises(NIRConversionError, match="dt must be a positive"):
        export_nir(model, (3,), dt=True)
    grouped = nn.Sequential(layer.Conv2d(2, 4, 3, groups=2), neuron.IFNode())
    with pytest.raises(NIRConversionError, match=r"0 \(Conv2d\): a grouped convolution"):
        export_nir(grouped, (2, 8, 8), dt=1.0)
    with pytest.raises(NIRConversionError, match="input_shape"):
        export_nir(model, (), dt=1.0)
    with pytest.raises(NIRConversionError, match="per-sample shape"):
        export_nir(model, (2, 3), dt=1.0)
    with pytest.raises(NIRConversionError, match="nn.Sequential or a NIRGraphModule"):
        export_nir(layer.Linear(3, 4), (3,), dt=1.0)
    pool = nn.Sequential(layer.MaxPool2d(2))
    with pytest.raises(NIRConversionError, match=r"0 \(MaxPool2d\): no NIR equivalent"):
        export_nir(pool, (1, 4, 4), dt=1.0)
    flat = nn.Sequential(layer.Flatten(start_dim=0))
    with pytest.raises(NIRConversionError, match="batch dimension"):
        export_nir(flat, (1, 4, 4), dt=1.0)


def small_graph(neuron_node: nir.NIRNode, edges=None) -> nir.NIRGraph:
    nodes = {
        "input": nir.Input(input_type=np.array([2])),
        "fc": nir.Affine(weight=np.eye(2), bias=np.zeros(2)),
        "n": neuron_node,
        "output": nir.Output(output_type=np.array([2])),
    }
    edges = edges or [("input", "fc"), ("fc", "n"), ("n", "output")]
    return nir.NIRGraph(nodes=nodes, edges=edges, type_check=False)


def lif_params(**overrides):
    params = dict(tau=2.0, r=1.0, v_leak=0.0, v_threshold=1.0, v_reset=0.0)
    params.update(overrides)
    return {k: np.broadcast_to(np.asarray(v, dtype=float), (2,)).copy() for k, v in params.items()}


@pytest.mark.parametrize(
    ("node", "match"),
    [
        (nir.LIF(**lif_params(v_leak=0.5)), r"'n' \(LIF\).*v_leak = 0.5 differs from v_reset"),
        (nir.LIF(**lif_params(r=1.7)), r"'n' \(LIF\): r = 1.7 has no spikefuse equivalent"),
        (nir.LIF(**lif_params(tau=0.5)), r"'n' \(LIF\): tau / dt = 0.5 must be > 1"),
        (nir.LIF(**lif_params(v_threshold=[1.0, 2.0])), r"one v_threshold per layer"),
        (nir.LIF(**lif_params(tau=np.nan)), r"tau must be finite"),
        (nir.IF(r=np.full(2, 2.0), v_threshold=np.ones(2)), r"'n' \(IF\).*dt \* r = 1"),
        (nir.I(r=np.ones(2)), r"'n' \(I\): no spikefuse"),
        (nir.Threshold(threshold=np.ones(2)), r"'n' \(Threshold\): no spikefuse"),
        (
            nir.CubaLIF(
                tau_syn=np.ones(2),
                tau_mem=np.ones(2),
                r=np.ones(2),
                v_leak=np.zeros(2),
                v_threshold=np.ones(2),
            ),
            r"'n' \(CubaLIF\): no spikefuse",
        ),
    ],
)
def test_import_refuses_what_spikefuse_cannot_express(node, match):
    with pytest.raises(NIRConversionError, match=match):
        import_nir(small_graph(node), dt=1.0)


@pytest.mark.parametrize("bias", [np.array([5.0]), np.array(5.0), np.zeros(3)])
def test_import_refuses_a_bias_of_the_wrong_shape(bias):
    """copy_ would broadcast a 1-element or 0-d bias to every output."""
    affine = nir.Affine(weight=np.ones((2, 2)), bias=bias)
    graph = small_graph(nir.IF(r=np.ones(2), v_threshold=np.ones(2)))
    graph.nodes["fc"] = affine
    with pytest.raises(NIRConversionError, match=r"'fc' \(Affine\): bias has shape"):
        import_nir(graph, dt=1.0)
    conv = nir.Conv2d(
        input_shape=(4, 4),
        weight=np.ones((2, 1, 3, 3)),
        stride=1,
        padding=1,
        dilation=1,
        groups=1,
        bias=np.array([1.0]),
    )
    with pytest.raises(NIRConversionError, match=r"\(Conv2d\): bias has shape"):
        import_nir(nir.NIRGraph.from_list(conv), dt=1.0)


def test_import_refuses_recurrent_graphs_and_bad_arguments():
    lif_node = nir.LIF(**lif_params())
    loop = [("input", "fc"), ("fc", "n"), ("n", "fc"), ("n", "output")]
    with pytest.raises(NIRConversionError, match="recurrent loop"):
        import_nir(small_graph(lif_node, loop), dt=1.0)
    dead_end = [("input", "fc"), ("fc", "n"), ("fc", "output")]
    with pytest.raises(NIRConversionError, match=r"nodes \['n'\] are not on a path"):
        import_nir(small_graph(lif_node, dead_end), dt=1.0)
    with pytest.raises(NIRConversionError, match="dt must be a positive"):
        import_nir(small_graph(lif_node), dt=float("nan"))
    with pytest.raises(NIRConversionError, match="expected an nir.NIRGraph"):
        import_nir(lif_node, dt=1.0)


def test_import_reads_decay_input_from_r_and_surrogate_options():
    from spikefuse import surrogate

    options = dict(dt=1e-3, surrogate_function=surrogate.ATan(), detach_reset=True)
    model = import_nir(small_graph(nir.LIF(**lif_params(tau=4e-3, r=4.0))), **options)
    node = model.n
    assert isinstance(node, neuron.LIFNode) and not node.decay_input
    assert node.tau == pytest.approx(4.0) and node.detach_reset
    assert isinstance(node.surrogate_function, surrogate.ATan)
    model = import_nir(small_graph(nir.LIF(**lif_params(tau=4e-3))), **options)
    assert model.n.decay_input


# ---- snnTorch and Norse ------------------------------------------------------------------------
def per_sample_steps(step, x: torch.Tensor, reset) -> torch.Tensor:
    """Run a one-step-at-a-time simulator sample by sample (their Flatten nodes drop the batch
    dimension), returning [T, N, *] spikes."""
    outs = []
    with torch.no_grad():
        for n in range(x.shape[1]):
            reset()
            outs.append(torch.stack([step(x[t, n]) for t in range(x.shape[0])]))
    return torch.stack(outs, 1)


def cross_nets():
    def lif_ndi():
        return neuron.LIFNode(tau=2.5, decay_input=False, v_threshold=0.6, step_mode="m")

    def lif_di():
        return neuron.LIFNode(tau=2.5, decay_input=True, v_threshold=0.25, step_mode="m")

    return {
        "snntorch": [
            (conv_net(lif_ndi, torch.float32), conv_input(torch.float32), (1, 8, 8)),
            (fc_net(lif_ndi, torch.float32), fc_input(torch.float32), (12,)),
        ],
        "norse": [
            (conv_net(lif_di, torch.float32), conv_input(torch.float32), (1, 8, 8)),
            (fc_net(if_node(v_reset=0.0), torch.float32), fc_input(torch.float32), (12,)),
        ],
    }


def conv_net_without_pool(node, dtype=torch.float32) -> nn.Sequential:
    """Norse's NIR import has no AvgPool2d."""
    torch.manual_seed(8)
    net = nn.Sequential(
        layer.Conv2d(1, 4, 3, padding=1, step_mode="m"),
        node(),
        layer.Conv2d(4, 6, 3, stride=2, step_mode="m"),
        node(),
        layer.Flatten(step_mode="m"),
        layer.Linear(54, 5, step_mode="m"),
        node(),
    )
    return scaled(net).to(dtype)


@pytest.mark.parametrize("kind", ["conv", "fc"])
def test_spikefuse_to_snntorch_gives_the_same_spikes(kind):
    snn_utils = pytest.importorskip("snntorch.utils", reason="snnTorch is not installed")
    pytest.importorskip("nirtorch", reason="snnTorch's NIR import needs nirtorch")
    from snntorch.import_nir import import_from_nir

    model, x, shape = cross_nets()["snntorch"][0 if kind == "conv" else 1]
    assert all(0.02 < r < 0.98 for r in spike_rates(model, x))
    # snnTorch's import fixes dt = 1e-4 and maps r * dt / tau = 1 to beta = 1 - dt / tau
    snn_model = import_from_nir(export_nir(model, shape, dt=1e-4))
    got = per_sample_steps(lambda x_t: snn_model(x_t)[0], x, lambda: snn_utils.reset(snn_model))
    assert torch.equal(got, run(model, x))


@pytest.mark.parametrize("kind", ["conv", "fc"])
def test_snntorch_to_spikefuse_gives_the_same_spikes(kind):
    snn = pytest.importorskip("snntorch", reason="snnTorch is not installed")
    pytest.importorskip("nirtorch", reason="snnTorch's NIR export needs nirtorch")
    from snntorch.export_nir import export_to_nir
    from snntorch.utils import reset

    def leaky(beta, threshold, shape):
        # snnTorch exports per-neuron parameters only when given per neuron (type check)
        return snn.Leaky(
            beta=torch.full(shape, beta),
            threshold=torch.full(shape, threshold),
            reset_mechanism="zero",
            init_hidden=True,
        )

    torch.manual_seed(9)
    if kind == "conv":
        net = nn.Sequential(
            nn.Conv2d(1, 3, 3),
            leaky(0.8, 0.5, (3, 6, 6)),
            nn.Flatten(),
            nn.Linear(108, 4),
            leaky(0.7, 0.5, (4,)),
        )
        x = torch.rand(T, N, 1, 8, 8) * 2
        graph = export_to_nir(net, x[0, :1], ignore_dims=[0])
    else:
        net = nn.Sequential(
            nn.Linear(12, 10), leaky(0.8, 0.5, (10,)), nn.Linear(10, 4), leaky(0.6, 0.3, (4,))
        )
        x = torch.rand(T, N, 12) * 2
        graph = export_to_nir(net, x[0, :1], ignore_dims=[0])
    model = import_nir(graph, dt=1e-4)
    lifs = [m for m in model.modules() if isinstance(m, neuron.LIFNode)]
    assert [m.decay_input for m in lifs] == [False, False]
    assert all(0.02 < r < 0.98 for r in spike_rates(model, x))

    def step(x_t):
        with torch.no_grad():
            return net(x_t.unsqueeze(0))[0]

    expected = per_sample_steps(step, x, lambda: reset(net))
    assert torch.equal(run(model, x), expected)


@pytest.mark.parametrize("kind", ["conv", "fc"])
def test_spikefuse_to_norse_gives_the_same_spikes(kind):
    norse = pytest.importorskip("norse.torch", reason=NORSE_MISSING)

    if kind == "conv":
        node = lambda: neuron.LIFNode(tau=2.5, v_threshold=0.2, step_mode="m")  # noqa: E731
        model, x, shape = conv_net_without_pool(node), conv_input(torch.float32), (1, 8, 8)
    else:
        model, x, shape = (
            fc_net(if_node(v_reset=0.0), torch.float32),
            fc_input(torch.float32),
            (12,),
        )
    assert all(0.02 < r < 0.98 for r in spike_rates(model, x))
    # Norse reads r as 1 and IF as v += I (no dt), which is NIR's meaning at dt = 1
    norse_model = norse.from_nir(export_nir(model, shape, dt=1.0), dt=1.0)
    state = {}

    def step(x_t):
        out, state["s"] = norse_model(x_t, state["s"])
        return out

    got = per_sample_steps(step, x, lambda: state.update(s=None))
    assert torch.equal(got, run(model, x))


def test_norse_to_spikefuse_gives_the_same_spikes():
    norse = pytest.importorskip("norse.torch", reason=NORSE_MISSING)
    from norse.torch.utils.export_nir import to_nir

    torch.manual_seed(10)

    def cell(n, v_th):
        # per-neuron parameters, so that Norse's export gives NIR arrays of one shape
        params = norse.LIFBoxParameters(
            tau_mem_inv=torch.full((n,), 0.4), v_leak=torch.zeros(n), v_th=torch.full((n,), v_th)
        )
        return norse.LIFBoxCell(params, dt=1.0)

    net = scaled(
        norse.SequentialState(nn.Linear(12, 10), cell(10, 0.3), nn.Linear(10, 4), cell(4, 0.3))
    )
    with torch.no_grad():
        net[2].weight.abs_()  # excitatory, so that the second layer fires too
    x = torch.rand(T, N, 12)
    # Norse writes tau = dt / tau_mem_inv: NIR's time constant at dt = 1
    model = import_nir(to_nir(net, x[0], dt=1.0), dt=1.0)
    assert all(0.02 < r < 0.98 for r in spike_rates(model, x))
    with torch.no_grad():
        expected, state = [], None
        for t in range(T):
            out, state = net(x[t], state)
            expected.append(out)
    assert torch.equal(run(model, x), torch.stack(expected))


def test_a_torch_code_neuron_is_refused():
    """A LIFNode subclass with its own neuronal_charge is not exported as a plain LIF."""

    class MyLIF(neuron.LIFNode):
        def neuronal_charge(self, x):
            self.v = self.v + 2 * x

    model = nn.Sequential(layer.Linear(3, 4, step_mode="m"), MyLIF(step_mode="m"))
    with pytest.raises(NIRConversionError, match="runs torch code"):
        export_nir(model, (3,), dt=1.0)
