"""spikefuse.graphs on the CPU: what ``capturing`` does around PyTorch's capture (the captures
themselves run in tests/gpu/test_graphs_compile.py)."""

from __future__ import annotations

import gc

import pytest
import torch

from spikefuse import graphs


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
