"""Single-step LIF neurons for online training through time (SLTT, OTTT)."""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor

from ..errors import SpikefuseError
from ..surrogate import Surrogate
from ._base import BaseNode
from ._builtin import LIFNode


class _OnlineLIFNode(LIFNode):
    """A single-step LIFNode for online training through time: in training, V is detached
    from the earlier steps before each step, so backward never reaches back in time and the
    memory of a training step does not grow with T (call ``loss.backward()`` and the optimiser
    at every step). In eval mode it is a plain LIFNode. Only ``step_mode='s'``."""

    def __init__(
        self,
        tau: float,
        decay_input: bool,
        v_threshold: float,
        v_reset: float | None,
        surrogate_function: Surrogate | None,
        detach_reset: bool,
        step_mode: str,
        backend: str,
        store_v_seq: bool,
    ) -> None:
        if step_mode != "s":
            raise SpikefuseError(
                f"{type(self).__name__}: step_mode must be 's' (online training runs one step "
                f"at a time to keep memory constant in T), got {step_mode!r}"
            )
        super().__init__(
            tau,
            decay_input,
            v_threshold,
            v_reset,
            surrogate_function,
            detach_reset,
            step_mode,
            backend,
            store_v_seq,
        )

    def supported_step_mode(self) -> tuple[str, ...]:
        return ("s",)

    def _online_step(self, x: Tensor) -> Tensor:
        if self.training and isinstance(self.v, Tensor):
            self.set_memory("v", self.v.detach())  # no gradient path to earlier steps
        return BaseNode.forward(self, x)


class SLTTLIFNode(_OnlineLIFNode):
    """SLTT's LIF: a LIFNode whose V is detached from earlier steps in training (see
    :class:`_OnlineLIFNode`); returns the spikes [N, *]. SpikingJelly's defaults
    (``decay_input=True``, ``v_reset=0``, ``detach_reset=True``)."""

    def __init__(
        self,
        tau: float = 2.0,
        decay_input: bool = True,
        v_threshold: float = 1.0,
        v_reset: float | None = 0.0,
        surrogate_function: Surrogate | None = None,
        detach_reset: bool = True,
        step_mode: str = "s",
        backend: str = "auto",
        store_v_seq: bool = False,
    ) -> None:
        super().__init__(
            tau,
            decay_input,
            v_threshold,
            v_reset,
            surrogate_function,
            detach_reset,
            step_mode,
            backend,
            store_v_seq,
        )

    def forward(self, x: Tensor) -> Tensor:
        return self._online_step(x)


class OTTTLIFNode(_OnlineLIFNode):
    """OTTT's LIF (SpikingJelly's defaults: ``decay_input=False``, soft reset,
    ``detach_reset=True``). In training V is detached from earlier steps and the neuron also
    keeps a presynaptic trace, ``trace[t] = trace[t-1] (1 - 1/tau) + S[t]`` (no gradient); it
    returns ``[spike, trace]`` (a list, which :class:`spikefuse.layer.OTTTSequential` passes
    on: the next layer's weights get their gradient from the trace). In eval mode it returns
    the spikes only and leaves the trace alone."""

    trace: Tensor | None

    def __init__(
        self,
        tau: float = 2.0,
        decay_input: bool = False,
        v_threshold: float = 1.0,
        v_reset: float | None = None,
        surrogate_function: Surrogate | None = None,
        detach_reset: bool = True,
        step_mode: str = "s",
        backend: str = "auto",
        store_v_seq: bool = False,
    ) -> None:
        super().__init__(
            tau,
            decay_input,
            v_threshold,
            v_reset,
            surrogate_function,
            detach_reset,
            step_mode,
            backend,
            store_v_seq,
        )
        self.register_memory("trace", None)

    @staticmethod
    def track_trace(spike: Tensor, trace: Tensor, tau: float) -> Tensor:
        """trace (1 - 1/tau) + spike, without gradient."""
        with torch.no_grad():
            return trace * (1.0 - 1.0 / tau) + spike

    def forward(self, x: Tensor) -> Tensor | list[Tensor]:  # type: ignore[override]
        spike = self._online_step(x)
        if not self.training:
            return spike
        trace = torch.zeros_like(spike) if self.trace is None else self.trace
        self.set_memory("trace", self.track_trace(spike, trace, cast(float, self.tau)))
        return [spike, cast(Tensor, self.trace)]
