"""spikefuse.graphs on the CPU: what ``capturing`` does around PyTorch's capture (the captures
themselves run in tests/gpu/test_graphs_compile.py)."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch

from spikefuse import graphs
from spikefuse.errors import SpikefuseError


class FakeGenerator:
    """A CUDA generator's state swaps: ``clone_state`` gives the state, ``graphsafe_set_state``
    installs one."""

    def __init__(self, state: str) -> None:
        self.state = state

    def clone_state(self) -> str:
        return self.state

    def graphsafe_set_state(self, state: str) -> None:
        self.state = state


class FakeCUDA:
    """What a capture touches: the current stream and the generators, which a capture that
    fails while ending (an invalidated capture) leaves switched, as PyTorch does."""

    def __init__(self) -> None:
        self.events: list[object] = []
        self.stream = "default stream"
        self.generators = (FakeGenerator("state before"),)
        self.invalidated = False

    def capture(self, graph, stream) -> FakeCUDA.Capture:
        return FakeCUDA.Capture(self, stream)

    class Capture:
        def __init__(self, cuda: FakeCUDA, stream: object) -> None:
            self.cuda, self.capture_stream = cuda, stream

        def __enter__(self) -> None:
            self.cuda.events.append(("begin", gc.isenabled()))
            self.cuda.stream = self.capture_stream
            for generator in self.cuda.generators:
                generator.state = "capturing"

        def __exit__(self, *exc) -> None:
            self.cuda.events.append(("end", gc.isenabled()))
            if self.cuda.invalidated:  # raised before the generators and stream are restored
                raise RuntimeError(graphs.INVALIDATED)
            self.cuda.stream = "default stream"
            for generator in self.cuda.generators:
                generator.state = "state after"


@pytest.fixture
def fake_cuda(monkeypatch) -> FakeCUDA:
    """torch.cuda.graph replaced by a context that records where the capture begins and ends,
    and whether the garbage collector was on then; the generators and the current stream by
    :class:`FakeCUDA`'s."""
    cuda = FakeCUDA()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "graph", cuda.capture)
    monkeypatch.setattr(torch.cuda, "default_generators", cuda.generators)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: cuda.stream)
    monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: setattr(cuda, "stream", stream))
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None, raising=False)
    return cuda


@pytest.fixture
def fake_capture(fake_cuda) -> list[object]:
    return fake_cuda.events


class DeadGraph:
    """Stands for a dropped graph in a reference cycle: only the collector destroys it."""

    def __init__(self, events: list[object]) -> None:
        self.events = events
        self.cycle = self

    def __del__(self) -> None:
        self.events.append("destroyed")


def test_capturing_destroys_dead_graphs_first_and_defers_the_collector(fake_capture):
    """Destroying a graph during another capture invalidates that capture: the garbage goes
    before the capture begins, and the collector stays off until it ends."""
    DeadGraph(fake_capture)
    with graphs.capturing(None, None):
        fake_capture.append("step")
    assert fake_capture == ["destroyed", ("begin", False), "step", ("end", False)]
    assert gc.isenabled()


def test_capturing_turns_the_collector_back_on_after_an_error(fake_capture):
    with pytest.raises(RuntimeError, match="in the step") as raised:
        with graphs.capturing(None, None):
            raise RuntimeError("in the step")
    assert not hasattr(raised.value, "__notes__")  # no host-sync hint for other errors
    assert fake_capture == [("begin", False), ("end", False)]
    assert gc.isenabled()


def test_capturing_leaves_a_disabled_collector_disabled(fake_capture):
    gc.disable()
    try:
        with graphs.capturing(None, None):
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_failed_capture_leaves_the_random_generators_and_the_stream_as_they_were(fake_cuda):
    """PyTorch raises while ending an invalidated capture (e.g. a host sync inside the step)
    before it takes the CUDA generators out of capture mode and restores the current stream:
    every later random op failed ("Offset increment outside graph capture")."""
    fake_cuda.invalidated = True
    with pytest.raises(RuntimeError, match="previous error during capture") as raised:
        with graphs.capturing(None, "capture stream"):
            raise RuntimeError("operation not permitted when stream is capturing")
    assert "typically a host sync in the step: loss.item()" in raised.value.__notes__[0]
    assert fake_cuda.stream == "default stream"
    assert [g.state for g in fake_cuda.generators] == ["state before"]
    assert gc.isenabled()


def test_a_capture_that_ends_keeps_the_generators_state(fake_cuda):
    with graphs.capturing(None, "capture stream"):
        pass
    assert [g.state for g in fake_cuda.generators] == ["state after"]
    assert fake_cuda.stream == "default stream"


class FakeStream:
    def __init__(self, device: object = None) -> None:
        self.device = torch.device("cpu")


class FakeGraph:
    """Counts its replays (a real replay reruns the captured kernels on the static inputs)."""

    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


@pytest.fixture
def fake_graphing(monkeypatch) -> list[tuple[str, object]]:
    """GraphedStep's CUDA calls replaced by recorders on the CPU: warm-ups (``run_on``) and
    captures (``capturing``) are logged in order; inputs may be CPU tensors."""
    events: list[tuple[str, object]] = []

    def run_on(stream, fn):
        events.append(("eager", stream))
        return fn()

    @contextlib.contextmanager
    def capturing(graph, stream):
        events.append(("capture", graph))
        yield

    monkeypatch.setattr(graphs, "run_on", run_on)
    monkeypatch.setattr(graphs, "capturing", capturing)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(
        graphs, "_signature", lambda inputs: tuple((x.shape, x.dtype) for x in inputs)
    )
    return events


def test_graphed_step_warms_up_captures_once_then_replays_per_signature(fake_graphing):
    seen: list[torch.Tensor] = []

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        seen.append(x)
        return x.sum() + y.sum()

    graphed = graphs.GraphedStep(step, warmup=2)
    batch = [torch.full((4, 3), float(i)) for i in range(5)]
    labels = torch.zeros(4)
    eager = [graphed(batch[i], labels) for i in range(2)]  # the warm-ups: step's own results
    assert [float(e) for e in eager] == [0.0, 12.0]
    assert [kind for kind, _ in fake_graphing] == ["eager", "eager"]
    out = graphed(batch[2], labels)  # captured on static copies, then replayed
    assert [kind for kind, _ in fake_graphing] == ["eager", "eager", "capture"]
    graph = fake_graphing[-1][1]
    static_x = seen[-1]
    assert static_x is not batch[2] and torch.equal(static_x, batch[2])
    assert graph.replays == 1
    again = graphed(batch[3], labels)  # a replay: the batch copied in, the same output tensor
    assert again is out and graph.replays == 2 and torch.equal(static_x, batch[3])
    assert len(seen) == 3  # the step ran twice eagerly and once in the capture, never again
    graphed(torch.ones(2, 3), torch.zeros(2))  # another batch shape: its own warm-up
    assert fake_graphing[-1][0] == "eager"


def test_graphed_step_captures_again_after_invalidate_without_warming_up(fake_graphing):
    graphed = graphs.GraphedStep(lambda x: x * 2, warmup=1)
    x = torch.ones(3)
    graphed(x)
    first = graphed(x)
    graphed.invalidate()  # e.g. a new learning rate, which a capture bakes in
    second = graphed(x)
    assert [kind for kind, _ in fake_graphing] == ["eager", "capture", "capture"]
    assert second is not first


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ((), "call it with the step's input tensors"),
        ((torch.ones(2),), "input 0 is a tensor on cpu"),
        ((3.0,), "input 0 is float"),
    ],
    ids=["nothing", "cpu-tensor", "not-a-tensor"],
)
def test_graphed_step_refuses_inputs_a_graph_cannot_replay(inputs, message):
    calls: list[object] = []
    graphed = graphs.GraphedStep(lambda *args: calls.append(args))
    with pytest.raises(SpikefuseError, match=message):
        graphed(*inputs)
    assert not calls  # refused before the step ran


@pytest.mark.parametrize("warmup", [0, -1, 1.5, True])
def test_graphed_step_needs_at_least_one_warm_up(warmup):
    with pytest.raises(SpikefuseError, match="warmup must be an int >= 1"):
        graphs.GraphedStep(lambda: None, warmup=warmup)


def test_graphed_step_keeps_a_signature_per_dtype(fake_graphing):
    graphed = graphs.GraphedStep(lambda x: x.sum(), warmup=1)
    graphed(torch.ones(3))
    graphed(torch.ones(3, dtype=torch.float64))  # same shape, another dtype: a warm-up
    assert [kind for kind, _ in fake_graphing] == ["eager", "eager"]


def test_a_step_that_raises_counts_for_nothing(fake_graphing):
    """A warm-up or a capture that raises leaves no count and no graph: the next call warms up
    or captures again (a capture after a warm-up that never finished would fail on work
    that cannot run in a capture, such as loading a kernel)."""
    fail = [True]

    def step(x: torch.Tensor) -> torch.Tensor:
        if fail[0]:
            raise RuntimeError("out of memory")
        return x * 2

    graphed = graphs.GraphedStep(step, warmup=1)
    x = torch.ones(3)
    with pytest.raises(RuntimeError, match="out of memory"):
        graphed(x)  # the warm-up
    fail[0] = False
    graphed(x)  # warms up again
    fail[0] = True
    with pytest.raises(RuntimeError, match="out of memory"):
        graphed(x)  # the capture
    fail[0] = False
    graphed(x)  # captures again
    assert [kind for kind, _ in fake_graphing] == ["eager", "eager", "capture", "capture"]


def test_graphed_step_stays_on_the_gpu_of_its_first_inputs(fake_graphing):
    graphed = graphs.GraphedStep(lambda x: x, warmup=1)
    graphed(torch.ones(3))  # its stream: FakeStream, on "cpu"
    graphed._stream.device = torch.device("cuda", 1)  # as if the first call ran on cuda:1
    with pytest.raises(SpikefuseError, match="its graphs run on cuda:1, the inputs are on cpu"):
        graphed(torch.ones(3))


def test_graphed_step_needs_a_function():
    with pytest.raises(SpikefuseError, match="step must be a function of the batch's tensors"):
        graphs.GraphedStep(None)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where there is no GPU")
def test_gpu_only_helpers_say_they_need_a_gpu():
    with pytest.raises(SpikefuseError, match="capture_step needs a CUDA GPU"):
        graphs.capture_step(lambda: None)
    with pytest.raises(SpikefuseError, match="needs a CUDA GPU"):
        with graphs.capturing(None, None):
            pass
