"""Online training through time (OTTT): layers that carry ``[spike, trace]`` pairs.

:class:`spikefuse.neuron.OTTTLIFNode` returns ``[spike, trace]`` in training. In an
:class:`OTTTSequential`, a layer with parameters given such a pair computes its output from the
spikes, but its weights get the gradient they would get from the trace (the presynaptic
eligibility trace); a parameter-free layer (pooling, flatten) is applied to both. With one
``backward`` per time step, memory stays constant in T. These are SpikingJelly's
``layer.OTTTSequential``, ``GradwithTrace``, ``SpikeTraceOp`` and ``ReplaceforGrad``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .errors import SpikefuseError

__all__ = ["GradwithTrace", "OTTTSequential", "ReplaceforGrad", "SpikeTraceOp"]


class ReplaceforGrad(torch.autograd.Function):
    """Forward: ``x_r``; backward: the incoming gradient to both ``x`` and ``x_r``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, x_r: Tensor) -> Tensor:
        return x_r

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        return grad, grad


def _pair(x: Any, who: str) -> tuple[Tensor, Tensor]:
    if not (isinstance(x, (list, tuple)) and len(x) == 2):
        raise SpikefuseError(f"{who}: expected [spike, trace], got {type(x).__name__}")
    return x[0], x[1]


def grad_with_trace(module: nn.Module, x: Any) -> Tensor:
    """``module(spike)`` as the value, the gradient of ``module(trace)`` for its parameters."""
    spike, trace = _pair(x, "GradwithTrace")
    with torch.no_grad():
        out = module(spike)
    out_for_grad = module(ReplaceforGrad.apply(spike, trace))
    return ReplaceforGrad.apply(out_for_grad, out)


def spike_and_trace(module: nn.Module, x: Any) -> list[Tensor]:
    """``[module(spike), module(trace)]``, the latter without gradient."""
    spike, trace = _pair(x, "SpikeTraceOp")
    spike = module(spike)
    with torch.no_grad():
        trace = module(trace)
    return [spike, trace]


class GradwithTrace(nn.Module):
    """Wraps a layer with parameters for ``[spike, trace]`` input (see :func:`grad_with_trace`)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: Any) -> Tensor:
        return grad_with_trace(self.module, x)


class SpikeTraceOp(nn.Module):
    """Wraps a parameter-free layer for ``[spike, trace]`` input (applied to both)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: Any) -> list[Tensor]:
        return spike_and_trace(self.module, x)


class OTTTSequential(nn.Sequential):
    """``nn.Sequential`` that passes ``[spike, trace]`` lists on: a module given one is run
    as :class:`GradwithTrace` if it has parameters, else as :class:`SpikeTraceOp`; tensors go
    through modules unchanged."""

    def forward(self, input: Any) -> Any:
        for module in self:
            if isinstance(input, list):
                if next(module.parameters(), None) is None:
                    input = spike_and_trace(module, input)
                else:
                    input = grad_with_trace(module, input)
                continue
            input = module(input)
        return input
