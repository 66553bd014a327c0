"""Whole training steps captured in a CUDA graph with PyTorch's own ``torch.cuda.graph``."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

import torch

from .errors import SpikefuseError

R = TypeVar("R")
# What CUDA reports when a capture is ended after an operation invalidated it.
INVALIDATED = "operation failed due to a previous error during capture"


def require_cuda(what: str) -> None:
    """Raise a clear error where PyTorch sees no CUDA GPU (a CPU-only build, or no device),
    before torch's own failure deep inside a CUDA call."""
    if not torch.cuda.is_available():
        raise SpikefuseError(
            f"{what} needs a CUDA GPU, and PyTorch sees none (a CPU-only PyTorch build or no "
            "visible device); run the step eagerly instead"
        )


def run_on(stream: torch.cuda.Stream, fn: Callable[[], R]) -> R:
    """``fn()`` on ``stream``, after the current stream's queued work and before its later
    work: how a warm-up before a capture runs on the side stream."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        result = fn()
    torch.cuda.current_stream().wait_stream(stream)
    return result


@contextlib.contextmanager
def capturing(
    graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream, pool: object | None = None
) -> Iterator[None]:
    """``torch.cuda.graph(graph, pool=pool, stream=stream)`` after dropping cuBLAS's workspaces
    and collecting garbage, with Python's cyclic garbage collector off until the capture ends
    (``pool``: a memory pool shared with other graphs, as ``torch.cuda.graph`` takes it).

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
    require_cuda("capturing a CUDA graph")
    torch._C._cuda_clearCublasWorkspaces()
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    current = torch.cuda.current_stream()  # initialises CUDA, and so its generators
    generators = torch.cuda.default_generators
    before = [generator.clone_state() for generator in generators]
    try:
        shared: dict[str, Any] = {} if pool is None else {"pool": pool}
        with torch.cuda.graph(graph, stream=stream, **shared):
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

    require_cuda("capture_step")

    def warm_up() -> None:
        for _ in range(warmup):
            step()

    stream = torch.cuda.Stream()
    run_on(stream, warm_up)
    graph, _ = _captured(step, stream)
    return graph.replay


def _captured(step: Callable[[], R], stream: torch.cuda.Stream) -> tuple[torch.cuda.CUDAGraph, R]:
    """A new graph of ``step()`` captured through :func:`capturing` on ``stream``, and what
    ``step`` returned during the capture (tensors the graph's replays overwrite)."""
    graph = torch.cuda.CUDAGraph()
    with capturing(graph, stream):
        output = step()
    return graph, output


# What a graph is captured for: each input's shape and dtype (a GraphedStep runs on one GPU).
Signature = tuple[tuple[torch.Size, torch.dtype], ...]


class GraphedStep(Generic[R]):
    """``step(*inputs)`` replayed from CUDA graphs, one graph per input signature (the inputs'
    shapes and dtypes): a training loop's fastest mode, with no host work per kernel.

    ``step`` takes CUDA tensors (a batch) and does a whole training step: forward, loss,
    ``backward``, ``optimizer.step()``, and ``functional.reset_net`` at its end, so that
    nothing crosses steps. ::

        def train_step(images, labels):
            loss = F.cross_entropy(net(images.unsqueeze(0).expand(T, *images.shape)).mean(0),
                                   labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()  # Adam/AdamW: capturable=True
            functional.reset_net(net)
            return loss.detach()

        graphed = GraphedStep(train_step)
        for images, labels in loader:
            loss = graphed(images.cuda(), labels.cuda())

    The first ``warmup`` calls of a signature run ``step`` eagerly on a side stream: that
    compiles and loads the neuron kernels and creates cuDNN plans and optimizer state, none of
    which can happen during a capture. The next call captures ``step`` on static copies of its
    inputs (through :func:`capturing`, on the same stream) and replays it; from then on a call
    copies its inputs into those and replays the graph. A batch of another shape (the last,
    smaller one of an epoch) gets its own warm-up and graph, with its own memory.

    What a call returns after the warm-up is what ``step`` returned during the capture: the
    same tensors at every replay of that signature, overwritten by the next one (clone what
    you keep). A replay runs no Python: Python values that ``step`` reads (the learning rate
    in the optimizer's param groups, a flag) are those of the capture, and the graph keeps
    reading and writing the tensors it captured. Call :meth:`invalidate` after changing such a
    value or replacing such a tensor (a new optimizer), so that the next call captures again.
    A host read of a device value inside ``step`` (``loss.item()``) cannot be captured:
    :func:`capturing` raises and says so. A step that raises in its warm-up or capture counts
    for nothing (the next call warms up or captures again), but it may have left neuron states
    from the failed call behind: call ``functional.reset_net`` before going on. As with
    :func:`capture_step`, a captured step runs fused Linear blocks on spikes on bf16 terms,
    which the eager warm-up does not (float32 rounding apart, the same results).

    A GraphedStep runs on the GPU of its first inputs; later inputs must be there too.
    """

    def __init__(self, step: Callable[..., R], warmup: int = 3) -> None:
        if not callable(step):
            raise SpikefuseError(
                f"GraphedStep: step must be a function of the batch's tensors, got "
                f"{type(step).__name__}"
            )
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise SpikefuseError(
                f"GraphedStep: warmup must be an int >= 1 (eager steps before the capture), "
                f"got {warmup!r}"
            )
        self.step, self.warmup = step, warmup
        self._warmups: dict[Signature, int] = {}  # eager calls so far, per signature
        # signature -> (graph, static inputs, what step returned during the capture)
        self._graphs: dict[Signature, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...], R]]
        self._graphs = {}
        self._stream: torch.cuda.Stream | None = None  # warm-ups and captures share it

    def invalidate(self) -> None:
        """Drop the graphs: the next call of each signature captures ``step`` again (without
        another warm-up)."""
        self._graphs.clear()

    def __call__(self, *inputs: torch.Tensor) -> R:
        """``step(*inputs)``, run eagerly (the warm-up), captured or replayed."""
        signature = _signature(inputs)
        device = inputs[0].device
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        stream = self._stream
        if stream.device != device:
            raise SpikefuseError(
                f"GraphedStep: its graphs run on {stream.device}, the inputs are on {device}; "
                "use one GraphedStep per GPU"
            )
        with torch.cuda.device(device):  # run_on and the capture use this GPU's current stream
            done = self._warmups.get(signature, 0)
            if done < self.warmup:
                result = run_on(stream, lambda: self.step(*inputs))
                self._warmups[signature] = done + 1  # counted once it ran through
                return result
            entry = self._graphs.get(signature)
            if entry is None:  # the capture records the step without running it: replayed below
                static = tuple(x.detach().clone() for x in inputs)
                graph, output = _captured(lambda: self.step(*static), stream)
                entry = self._graphs[signature] = (graph, static, output)
            graph, static, output = entry
            with torch.no_grad():
                for into, x in zip(static, inputs, strict=True):
                    into.copy_(x)
            graph.replay()
            return output


def _signature(inputs: tuple[torch.Tensor, ...]) -> Signature:
    """The inputs' signature; raises for anything but CUDA tensors on one device."""
    if not inputs:
        raise SpikefuseError("GraphedStep: call it with the step's input tensors (the batch)")
    for i, x in enumerate(inputs):
        if not isinstance(x, torch.Tensor) or not x.is_cuda:
            what = f"a tensor on {x.device}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise SpikefuseError(
                f"GraphedStep: input {i} is {what}; a CUDA graph replays on the GPU, so pass "
                "CUDA tensors (e.g. images.cuda()); other arguments belong in the step itself"
            )
    if len({x.device for x in inputs}) > 1:
        raise SpikefuseError(
            "GraphedStep: the inputs are on "
            f"{sorted(str(x.device) for x in inputs)}; a graph runs on one GPU: move them there"
        )
    return tuple((x.shape, x.dtype) for x in inputs)
