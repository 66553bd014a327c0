"""Whole training steps captured in a CUDA graph with PyTorch's own ``torch.cuda.graph``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

R = TypeVar("R")


def run_on(stream: torch.cuda.Stream, fn: Callable[[], R]) -> R:
    """``fn()`` on ``stream``, after the current stream's queued work and before its later
    work: how a warm-up before a capture runs on the side stream."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        result = fn()
    torch.cuda.current_stream().wait_stream(stream)
    return result


def capturing(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream) -> torch.cuda.graph:
    """``torch.cuda.graph(graph, stream=stream)`` after dropping cuBLAS's workspaces.

    cuBLAS keeps one workspace per stream (32 MiB on Hopper) for the life of the process.
    Dropped first, the capture allocates its workspace in the graph's own pool. A later drop,
    such as torch.compile's CUDA graph trees make, then cannot hand memory the graph writes
    to other tensors. The warm-up's workspace is freed first, so a capture on the warm-up
    stream peaks at the eager step's memory. Captured on a fresh stream without the drop, it
    would peak 65 MiB above it on the medium network.
    """
    torch._C._cuda_clearCublasWorkspaces()
    return torch.cuda.graph(graph, stream=stream)


def capture_step(step: Callable[[], object], warmup: int = 3) -> Callable[[], None]:
    """Capture ``step()`` (forward, backward, optimizer step: whatever it does on the current
    device) in a CUDA graph and return the graph's replay.

    ``step`` first runs ``warmup`` times on a side stream, as capture requires: that compiles
    and loads the neuron kernels and creates optimizer state and cuDNN plans, none of which
    can happen during capture. The replay reads and writes the same tensors the capture did:
    refill the step's inputs in place (``x.copy_(batch)``) before each replay. The step must
    leave the neurons reset (``functional.reset_net``) so that nothing crosses steps.

    The capture runs through :func:`capturing`, on the warm-up stream: its peak memory is the
    eager step's.
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
