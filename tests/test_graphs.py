"""spikefuse.graphs on the CPU: what ``capturing`` does around PyTorch's capture (the captures
themselves run in tests/gpu/test_graphs_compile.py)."""

from __future__ import annotations

import gc

import pytest
import torch

from spikefuse import graphs


@pytest.fixture
def fake_capture(monkeypatch) -> list[object]:
    """torch.cuda.graph replaced by a context that records where the capture begins and ends,
    and whether the garbage collector was on then."""
    events: list[object] = []

    class Capture:
        def __init__(self, graph, stream) -> None:
            pass

        def __enter__(self) -> None:
            events.append(("begin", gc.isenabled()))

        def __exit__(self, *exc) -> None:
            events.append(("end", gc.isenabled()))

    monkeypatch.setattr(torch.cuda, "graph", Capture)
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None, raising=False)
    return events


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
    with pytest.raises(RuntimeError, match="in the step"):
        with graphs.capturing(None, None):
            raise RuntimeError("in the step")
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
