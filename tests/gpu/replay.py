"""A training step captured in a CUDA graph, against the same step run eagerly."""

from __future__ import annotations

import torch
from torch import nn

from spikefuse.graphs import capturing, run_on


def grads(net: nn.Module) -> list[torch.Tensor]:
    """Copies of the parameters' gradients."""
    return [p.grad.clone() for p in net.parameters()]


def step_grads(net: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """The parameter gradients of ``net(x).sum()``, from zeroed gradients."""
    net.zero_grad(set_to_none=False)
    net(x).sum().backward()
    return grads(net)


def eager_and_replayed_grads(
    net: nn.Module, x: torch.Tensor, replays: int = 1
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """:func:`step_grads` of an eager step (on a side stream, after one warm-up step: kernels
    compiled and the allocator warm before capture), and of each of ``replays`` replays of the
    captured step. ``x`` needs no gradient: a leaf's gradient would accumulate outside the
    capture's stream."""
    stream = torch.cuda.Stream()
    run_on(stream, lambda: step_grads(net, x))  # the warm-up step
    eager = run_on(stream, lambda: step_grads(net, x))
    graph = torch.cuda.CUDAGraph()
    with capturing(graph, stream):
        net(x).sum().backward()
    replayed = []
    for _ in range(replays):
        net.zero_grad(set_to_none=False)
        graph.replay()
        replayed.append(grads(net))
    return eager, replayed


def assert_close_but_for_sum_order(
    got: list[torch.Tensor], want: list[torch.Tensor], rtol: float = 1e-4
) -> None:
    """Gradients equal but for cuDNN's and cuBLAS's summation order, which can differ from one
    run to the next (algorithm choice, split-K): an element whose terms cancel moves by about
    1e-5, so each gradient is compared norm-wise."""
    for g, w in zip(got, want, strict=True):
        error = (g - w).norm()
        assert error <= rtol * w.norm() + 1e-5, (
            f"|got - want| = {error:.2e}, |want| = {w.norm():.2e}"
        )
