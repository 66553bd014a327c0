"""Whole training steps captured in a CUDA graph with PyTorch's own ``torch.cuda.graph``."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

R = TypeVar("R")
# What CUDA reports when a capture is ended after an operation invalidated it.
INVALIDATED = "operation failed due to a previous error during capture"


def run_on(stream: torch.cuda.Stream, fn: Callable[[], R]) -> R:
    """``fn()`` on ``stream``, after the current stream's queued work and before its later
    work: how a warm-up before a capture runs on the side stream."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        result = fn()
    torch.cuda.current_stream().wait_stream(stream)
    return result


@contextlib.contextmanager
def capturing(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream) -> Iterator[None]:
    """``torch.cuda.graph(graph, stream=stream)`` after dropping cuBLAS's workspaces and
    collecting garbage, with Python's cyclic garbage collector off until the capture ends.

    cuBLAS keeps one workspace per stream (32 MiB on Hopper) for the life of the process.
    Dropped first, the capture allocates its workspace in the graph's own pool. A later drop,
    such as torch.compile's CUDA graph trees make, then cannot hand memory the graph writes
    to other tensors. The warm-up's workspace is freed first, so a capture on the warm-up
    stream peaks at the eager step's memory. Captured on a fresh stream without the drop, it
    would peak 65 MiB above it on the medium network.

    Destroying a CUDA graph during another capture invalidates that capture (the destructor's
    calls are not permitted while a stream captures). A dropped graph that sits in a reference
    cycle (``torch.cuda.make_graphed_callables``' results do) is destroyed only when the
    collector runs, which can happen at any allocation, and PyTorch no longer collects before
    a capture. So the garbage is collected here first, and the collector waits for the end.

    A capture that fails leaves the process as it found it. An invalidated capture (e.g. a
    host sync such as ``loss.item()`` inside the step) makes ``torch.cuda.graph`` raise while
    ending it, before PyTorch takes the CUDA random generators out of capture mode and before
    it restores the current stream: every later random op would then fail ("Offset increment
    outside graph capture"), and work would stay queued on the capture stream. So on any error
    the generators get back their state from before the capture (randomness drawn inside the
    failed capture is not consumed) and the current stream is restored.
    """
    torch._C._cuda_clearCublasWorkspaces()
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    current = torch.cuda.current_stream()  # initialises CUDA, and so its generators
    generators = torch.cuda.default_generators
    before = [generator.clone_state() for generator in generators]
    try:
        with torch.cuda.graph(graph, stream=stream):
            yield
    except BaseException as error:
        for generator, state in zip(generators, before, strict=True):
            generator.graphsafe_set_state(state)
        torch.cuda.set_stream(current)
        if INVALIDATED in str(error):  # PyTorch's message names the consequence, not the cause
            error.add_note(
                "spikefuse: the CUDA graph capture was invalidated by an operation not "
                "permitted while capturing (the first error above names it), typically a host "
                "sync in the step: loss.item(), print(tensor), .cpu(), torch.cuda.synchronize(). "
                "The random generators and the current stream are as they were before it."
            )
        raise
    finally:
        if collecting:
            gc.enable()


def capture_step(step: Callable[[], object], warmup: int = 3) -> Callable[[], None]:
    """Capture ``step()`` (forward, backward, optimizer step: whatever it does on the current
    device) in a CUDA graph and return the graph's replay.

    ``step`` first runs ``warmup`` times on a side stream, as capture requires: that compiles
    and loads the neuron kernels and creates optimizer state and cuDNN plans, none of which
    can happen during capture. The replay reads and writes the same tensors the capture did:
    refill the step's inputs in place (``x.copy_(batch)``) before each replay. The step must
    leave the neurons reset (``functional.reset_net``) so that nothing crosses steps.

    The capture runs through :func:`capturing`, on the warm-up stream: its peak memory is the
    eager step's, except where a fused Linear block on spikes takes the bf16-split path, which
    it does only under capture (:func:`~spikefuse.fused.spike_linear.takes_split_path`): then
    the captured step also holds the weight's bf16 terms and the weight gradient's three
    float32 products, and its results differ from the eager step's by float32 rounding (and
    the rare spike that rounding flips).
    """

    def warm_up() -> None:
        for _ in range(warmup):
            step()

    stream = torch.cuda.Stream()
    run_on(stream, warm_up)
    graph = torch.cuda.CUDAGraph()
    with capturing(graph, stream):
        step()
    return graph.replay
