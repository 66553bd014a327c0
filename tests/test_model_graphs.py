"""spikefuse.model_graphs on the CPU: the call switch, signatures, warm-ups, the eager causes,
and replays through autograd, with the CUDA capture replaced by a stand-in whose "graphs" rerun
the captured forward and backward into the same static tensors (the real captures run in
tests/gpu/test_model_graphs_gpu.py)."""

from __future__ import annotations

import contextlib
import copy
import pickle
import warnings

import pytest
import torch
from torch import nn

from spikefuse import functional, layer, model_graphs, model_scan, neuron
from spikefuse.errors import SpikefuseError
from spikefuse.model_graphs import graph_model, ungraph_model


def small_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        layer.Linear(4, 8, step_mode="m"),
        layer.BatchNorm1d(8, step_mode="m"),
        neuron.LIFNode(step_mode="m", store_v_seq=True),
        layer.Linear(8, 3, step_mode="m"),
    ).double()


class FakeGraph:
    """A 'graph' that reruns what it recorded (a function writing into static tensors)."""

    def __init__(self) -> None:
        self.run = None
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        self.run()


def fake_capture(net: nn.Module, args, stream) -> model_graphs._Replayable:
    """model_graphs._capture's contract on the CPU: static inputs, outputs, grad outputs and
    gradients, graphs that refill them, the memories the forward leaves."""
    before = model_graphs._attributes(net)
    inputs = tuple(model_graphs._static_input(a) for a in args)
    live: dict[str, object] = {}

    def forward_run() -> list[torch.Tensor]:
        with torch.enable_grad():
            out = net._call_impl(*inputs)
        flat, spec = torch.utils._pytree.tree_flatten(out)
        live["flat"], live["spec"] = flat, spec
        return flat

    buffers = [b.clone() for b in net.buffers()]
    flat = forward_run()  # a capture records without running: BatchNorm's statistics restored
    with torch.no_grad():
        for b, saved in zip(net.buffers(), buffers, strict=True):
            b.copy_(saved)
    left = model_graphs._set_since(before)
    model_graphs._restore(before)
    outputs = tuple(o.detach().clone() for o in flat)
    differentiable = tuple(i for i, o in enumerate(flat) if o.requires_grad)
    grad_outputs = tuple(torch.empty_like(outputs[i]) for i in differentiable)
    params = [p for p in net.parameters() if p.requires_grad]
    wrt = [x for x in inputs if x.requires_grad] + params
    grads = tuple(torch.zeros_like(w) for w in wrt)
    forward, backward = FakeGraph(), FakeGraph()

    def forward_replay() -> None:
        for into, got in zip(outputs, forward_run(), strict=True):
            into.copy_(got.detach())
        model_graphs._restore(before)  # a replay runs no Python: attributes untouched

    def backward_replay() -> None:
        flat_now = live["flat"]
        got = torch.autograd.grad(
            [flat_now[i] for i in differentiable], wrt, grad_outputs, allow_unused=True
        )
        for into, g in zip(grads, got, strict=True):
            into.copy_(g if g is not None else torch.zeros_like(into))

    forward.run, backward.run = forward_replay, backward_replay
    repeated = tuple(map(model_graphs._repeated, args))
    copy_into = tuple(x[:1] if r else x for x, r in zip(inputs, repeated, strict=True))
    return model_graphs._Replayable(
        forward, backward if differentiable else None, inputs, repeated, copy_into,
        tuple(params), outputs, live["spec"], differentiable, grad_outputs, grads, left,
    )  # fmt: skip


@pytest.fixture
def fake_gpu(monkeypatch):
    """CPU tensors count as one GPU's and captures are :func:`fake_capture`s."""
    captures: list[object] = []

    def capture(net, args, stream):
        captures.append(args[0].shape)
        return fake_capture(net, args, stream)

    monkeypatch.setattr(model_graphs, "_on_one_gpu", lambda args: True)
    monkeypatch.setattr(model_graphs, "_capture", capture)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: "side stream")
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    return captures


def train(net: nn.Module, batches, *, accumulate: bool = False) -> list[float]:
    """SpikingJelly-style steps: loss, zero_grad, backward, SGD, reset_net."""
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, labels in batches:
        out = net(x)
        loss = torch.nn.functional.cross_entropy(out.mean(0), labels)
        if not accumulate:
            optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        functional.reset_net(net)
        losses.append(loss.item())
    return losses


def batches(sizes):
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.rand(3, b, 4, generator=gen, dtype=torch.float64), torch.randint(0, 3, (b,)))
        for b in sizes
    ]


@pytest.mark.parametrize("accumulate", [False, True], ids=["zero_grad", "accumulated"])
def test_replayed_training_equals_eager_training(fake_gpu, accumulate):
    sizes = [5, 5, 5, 5, 2, 5, 2, 2, 5, 5]
    data = batches(sizes)
    eager, graphed = small_net(), graph_model(small_net(), warmup=2)
    want = train(eager, data, accumulate=accumulate)
    got = train(graphed, data, accumulate=accumulate)
    assert fake_gpu == [torch.Size([3, 5, 4]), torch.Size([3, 2, 4])]  # one capture per size
    assert got == pytest.approx(want, rel=1e-12)
    for (name, p), q in zip(graphed.state_dict().items(), eager.state_dict().values(), strict=True):
        assert torch.allclose(p.double(), q.double(), rtol=1e-12, atol=1e-14), name


def test_an_input_repeated_as_a_view_stays_one_in_the_graph(fake_gpu):
    """``images.expand(T, ...)`` (stride 0 over T, which fused blocks convolve once) is kept a
    view of one step in the static input; ``repeat`` (a copy) is another signature."""
    data = [(x[0].expand(3, -1, -1), labels) for x, labels in batches([5] * 6)]
    eager, graphed = small_net(), graph_model(small_net(), warmup=1)
    assert train(graphed, data) == pytest.approx(train(eager, data), rel=1e-12)
    (entry,) = model_graphs.model_graphs(graphed)._entries.values()
    assert entry.graphs.inputs[0].stride(0) == 0
    train(graphed, [(x.contiguous(), labels) for x, labels in data[:2]])
    assert len(model_graphs.model_graphs(graphed)._entries) == 2


def test_a_changed_model_gets_new_graphs(fake_gpu):
    """Storage moved (``p.data = ...``, as ``.to()`` does), a parameter replaced, a module
    inserted without ``setattr``: each is a new signature, never a stale graph's replay."""
    net = graph_model(small_net(), warmup=1)
    data = batches([4] * 2)
    for change in (
        lambda: setattr(net[0].weight, "data", net[0].weight.data.clone()),
        lambda: setattr(net[3], "bias", nn.Parameter(net[3].bias.detach().clone())),
        lambda: net.insert(3, nn.Identity()),
    ):
        before = len(fake_gpu)
        change()
        eager = copy.deepcopy(net)
        model_graphs.ungraph_model(eager)
        assert train(net, data) == pytest.approx(train(eager, data), rel=1e-12)
        assert len(fake_gpu) == before + 1  # warmed up and captured again


def test_outputs_and_gradients_are_fresh_tensors(fake_gpu):
    net = graph_model(small_net(), warmup=1)
    (x, labels), (x2, _) = batches([4, 4])
    train(net, [(x, labels)])  # the warm-up
    first = net(x)
    kept = first.detach().clone()
    first.sum().backward()
    grads = [p.grad for p in net.parameters()]
    kept_grads = [g.clone() for g in grads]
    functional.reset_net(net)
    net.zero_grad()  # the next gradients are new tensors, not accumulated into these
    net(x2).sum().backward()  # replays into the same static tensors
    assert torch.equal(first.detach(), kept)
    for g, k in zip(grads, kept_grads, strict=True):
        assert torch.equal(g, k)


def test_memories_after_a_replay_are_the_captured_forwards(fake_gpu):
    net = graph_model(small_net(), warmup=1)
    (x, labels), (x2, _) = batches([4, 4])
    train(net, [(x, labels)])
    net(x).sum().backward()  # capture + replay
    lif = net[2]
    assert isinstance(lif.v, torch.Tensor) and lif.v_seq.shape == (3, 4, 8)
    functional.reset_net(net)
    assert lif.v == 0.0 and lif.v_seq is None


def test_a_signature_captures_after_warm_ups_whose_backward_ran(fake_gpu):
    net = graph_model(small_net(), warmup=2)
    ((x, _),) = batches([4])
    for _ in range(3):  # forwards without backward: never warm
        net(x)
        functional.reset_net(net)
    assert fake_gpu == []
    for _ in range(3):
        net(x).sum().backward()
        functional.reset_net(net)
    assert fake_gpu == [torch.Size([3, 4, 4])]
    with torch.no_grad():  # another signature: counts without backward
        for _ in range(3):
            net(x)
            functional.reset_net(net)
    assert len(fake_gpu) == 2


def test_eval_mode_and_autocast_are_signatures_and_lru_bounds_them(fake_gpu):
    net = graph_model(small_net(), warmup=1, max_graphs=2)
    ((x, _),) = batches([4])
    with torch.no_grad():
        for mode in (True, False, True):
            net.train(mode)
            for _ in range(2):
                net(x)
                functional.reset_net(net)
    assert len(fake_gpu) == 2
    assert model_graphs.model_graphs(net).captured == 2
    net.train(False)
    with torch.no_grad():
        net(x.float().double()[:, :2])  # a third signature drops the least recently used
    assert len(model_graphs.model_graphs(net)._entries) == 2


def test_state_not_reset_hooks_and_pending_backward_run_eagerly(fake_gpu):
    net = graph_model(small_net(), warmup=1)
    ((x, labels),) = batches([4])
    train(net, [(x, labels)] * 2)
    with pytest.warns(UserWarning, match="not at its reset value"):
        net(x)
        net(x)  # the state of the first call carried over
    functional.reset_net(net)
    out = net(x)  # a replay, its backward pending
    functional.reset_net(net)
    with pytest.warns(UserWarning, match="torch.no_grad"):
        net(x)
    functional.reset_net(net)
    del out
    handle = net[0].register_forward_hook(lambda module, args, output: None)
    with pytest.warns(UserWarning, match="forward hook"):
        net(x)
    handle.remove()
    functional.reset_net(net)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        net(x)


@pytest.mark.parametrize(
    "register",
    [
        lambda net, hook: net[1].register_full_backward_hook(hook),
        lambda net, hook: net[1].register_full_backward_pre_hook(hook),
        lambda net, hook: torch.nn.modules.module.register_module_full_backward_hook(hook),
    ],
    ids=["module", "module-pre", "global"],
)
def test_backward_hooks_run_eagerly_and_are_called(fake_gpu, register):
    net = graph_model(small_net(), warmup=1)
    data = batches([4] * 3)
    train(net, data[:2])  # warmed up and captured
    calls: list[str] = []
    handle = register(net, lambda module, *grads: calls.append(type(module).__name__))
    try:
        with pytest.warns(UserWarning, match="graph_model: .*(backward hook|global module hook)"):
            train(net, data[2:])
    finally:
        handle.remove()
    assert calls and len(fake_gpu) == 1


def test_the_forward_graph_runs_before_autograd_records_the_replay(fake_gpu, monkeypatch):
    """The replay is launched first, so that building autograd's node (an edge per parameter)
    overlaps the GPU's work instead of delaying it."""
    net = graph_model(small_net(), warmup=1)
    data = batches([4] * 3)
    train(net, data[:2])  # warmed up and captured
    (entry,) = model_graphs.model_graphs(net)._entries.values()
    replays_at_apply: list[int] = []
    apply = model_graphs._ReplayFunction.apply

    def spy(*args):
        replays_at_apply.append(entry.graphs.forward.replays)
        return apply(*args)

    monkeypatch.setattr(model_graphs._ReplayFunction, "apply", spy)
    before = entry.graphs.forward.replays
    train(net, data[2:])
    assert replays_at_apply == [before + 1]


def test_a_failed_capture_warns_once_and_runs_eagerly(fake_gpu, monkeypatch):
    def failing(net, args, stream):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(model_graphs, "_capture", failing)
    net, eager = graph_model(small_net(), warmup=1), small_net()
    data = batches([4] * 4)
    with pytest.warns(UserWarning, match="capture failed .*not permitted") as record:
        got = train(net, data)
    assert len([w for w in record if "graph_model" in str(w.message)]) == 1
    assert got == pytest.approx(train(eager, data), rel=1e-12)


def test_cpu_inputs_run_eagerly_with_one_warning():
    net, plain = graph_model(small_net()), small_net()
    ((x, labels),) = batches([4])
    with pytest.warns(UserWarning, match="one CUDA device") as record:
        got = train(net, [(x, labels)] * 3)
    assert len(record) == 1
    assert got == pytest.approx(train(plain, [(x, labels)] * 3), rel=1e-12)


def test_copies_are_plain_modules_and_ungraph_switches_back():
    net = graph_model(small_net())
    assert model_graphs.model_graphs(copy.deepcopy(net)) is None
    assert model_graphs.model_graphs(pickle.loads(pickle.dumps(net))) is None
    assert list(net.state_dict()) == list(small_net().state_dict())  # no prefix
    assert model_graphs.model_graphs(ungraph_model(net)) is None


@pytest.mark.parametrize(
    "kwargs", [{"warmup": 0}, {"warmup": True}, {"max_graphs": 0}, {"max_graphs": 1.5}]
)
def test_bad_arguments_are_refused(kwargs):
    net = small_net()
    with pytest.raises(SpikefuseError, match=next(iter(kwargs))):
        graph_model(net, **kwargs)
    assert model_graphs.model_graphs(net) is None
    with pytest.raises(SpikefuseError, match="nn.Module"):
        graph_model(lambda x: x)  # type: ignore[arg-type]


def test_layouts_follow_hooks_on_the_model_and_ignore_hooks_elsewhere():
    net = small_net()
    known = model_scan.current(net, None)
    assert known.why is None and model_scan.current(net, known) is known
    torch.zeros(1, requires_grad=True).register_hook(lambda grad: grad)  # a handle elsewhere
    kept = model_scan.current(net, known)
    assert kept.modules is known.modules and model_scan.current(net, kept) is kept
    for register in (nn.Module.register_forward_hook, nn.Module.register_full_backward_hook):
        handle = register(net[2], lambda module, *args: None)
        hooked = model_scan.current(net, kept)
        assert hooked.why is not None and "hook" in hooked.why
        handle.remove()
        kept = model_scan.current(net, hooked)
        assert kept.why is None
