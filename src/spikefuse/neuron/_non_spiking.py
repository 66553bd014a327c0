"""SpikingJelly's non-spiking neurons: they integrate their input and return the membrane
potential (or a decoding of it over time) instead of spikes."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..errors import SpikefuseError
from ..surrogate import is_finite_real
from ._memory import MultiStepModule

NON_SPIKING_DECODES = (None, "max-mem", "max-abs-mem", "mean-mem", "last_mem")


def decode_membrane(v_seq: list[Tensor], decode: str | None) -> Tensor | list[Tensor]:
    """A non-spiking neuron's output from its membrane potentials ``v_seq`` (T tensors [N, *]).

    ``None``: ``v_seq`` itself (a list); ``'last_mem'``: V[T-1]; ``'max-mem'``: max_t V[t];
    ``'mean-mem'``: mean_t V[t]; ``'max-abs-mem'``: whichever of max_t V[t] and min_t V[t] is
    larger in magnitude (the minimum on a tie), each [N, *]. The maxima take SpikingJelly's
    ``torch.max(...).values``, so the gradient reaches one step per element as there."""
    if decode is None:
        return v_seq
    if decode == "last_mem":
        return v_seq[-1]
    stacked = torch.stack(v_seq)
    if decode == "mean-mem":
        return stacked.mean(0)
    high = stacked.max(0).values
    if decode == "max-mem":
        return high
    low = stacked.min(0).values
    # SpikingJelly adds high * mask + low * ~mask: the same values and gradients for finite V
    return torch.where(high.abs() > low.abs(), high, low)


class NonSpikingBaseNode(nn.Module, MultiStepModule):
    """A neuron that never fires: it integrates a sequence ``x_seq`` [T, N, *] into its
    membrane potential V, which starts at 0 on every call, and returns V (see
    :func:`decode_membrane` for ``decode``). Subclasses define the charge
    :meth:`neuronal_charge`, which updates ``self.v`` from one step of input.

    A plain torch module, as SpikingJelly's: with no threshold, spike or reset there is nothing
    for a :class:`~spikefuse.NeuronDef` and the fused kernels to do, and the decodings need the
    whole sequence. Multi-step only (``step_mode`` is 'm', as SpikingJelly's
    ``base.MultiStepModule``; ``set_step_mode(net, 's')`` refuses it where SpikingJelly skips
    it). No parameters or buffers, so the ``state_dict`` is empty; after a call ``v`` holds the
    last potential [N, *] (not a memory: ``reset_net`` leaves it, the next call starts over).
    Differences: ``decode`` other than those of :data:`NON_SPIKING_DECODES` is refused (there it
    returns the list), the input is checked, and the repr shows the arguments.
    """

    v: Tensor

    def __init__(self, decode: str | None = None) -> None:
        super().__init__()
        self.decode = decode

    @property
    def decode(self) -> str | None:
        """How :meth:`forward` decodes the potentials: one of :data:`NON_SPIKING_DECODES`."""
        return self._decode

    @decode.setter
    def decode(self, value: str | None) -> None:
        if value not in NON_SPIKING_DECODES:
            raise SpikefuseError(
                f"{type(self).__name__}: decode must be one of {NON_SPIKING_DECODES}, got {value!r}"
            )
        self._decode = value

    def neuronal_charge(self, x: Tensor) -> None:
        """Update ``self.v`` from one step of input ``x`` [N, *]."""
        raise NotImplementedError(f"{type(self).__name__} must implement neuronal_charge")

    def _check_input(self, x_seq: Tensor) -> None:
        name = type(self).__name__
        if not isinstance(x_seq, Tensor):
            raise SpikefuseError(
                f"{name}: input must be a torch.Tensor, got {type(x_seq).__name__}"
            )
        if not x_seq.dtype.is_floating_point:
            raise SpikefuseError(f"{name}: input dtype must be floating point, got {x_seq.dtype}")
        if x_seq.dim() < 1 or x_seq.shape[0] == 0:
            raise SpikefuseError(
                f"{name}: input must be a sequence [T, N, *] with T >= 1, got shape "
                f"{tuple(x_seq.shape)}"
            )

    def forward(self, x_seq: Tensor) -> Tensor | list[Tensor]:
        """``x_seq`` [T, N, *] -> the decoded potentials [N, *], or V[t] for each t (a list of
        T tensors [N, *]) when ``decode`` is None."""
        self._check_input(x_seq)
        self.v = torch.full_like(x_seq[0].data, fill_value=0.0)
        v_seq = []
        for t in range(x_seq.shape[0]):
            self.neuronal_charge(x_seq[t])
            v_seq.append(self.v)
        return decode_membrane(v_seq, self.decode)

    def __getstate__(self) -> dict[str, Any]:
        """As :meth:`MemoryModule.__getstate__`: ``v`` detached, so a trained model pickles."""
        state = self.__dict__.copy()
        if isinstance(state.get("v"), Tensor):
            state["v"] = state["v"].detach()
        return state

    def extra_repr(self) -> str:
        return f"decode={self.decode!r}"


class NonSpikingIFNode(NonSpikingBaseNode):
    """Non-spiking IF neuron: ``V[t] = V[t-1] + X[t]``, V[-1] = 0 (SpikingJelly's)."""

    def __init__(self, decode: str | None = None) -> None:
        super().__init__(decode)

    def neuronal_charge(self, x: Tensor) -> None:
        self.v = self.v + x


class NonSpikingLIFNode(NonSpikingBaseNode):
    """Non-spiking LIF neuron: ``V[t] = V[t-1] + (X[t] - V[t-1]) / tau``, V[-1] = 0
    (SpikingJelly's, computed in that order). ``tau`` is a finite float > 0 (checked: 0 would
    divide by zero; SpikingJelly takes any value)."""

    def __init__(self, tau: float = 2.0, decode: str | None = None) -> None:
        super().__init__(decode)
        self.tau = tau

    @property
    def tau(self) -> float:
        """The membrane time constant."""
        return self._tau

    @tau.setter
    def tau(self, value: float) -> None:
        if not (is_finite_real(value) and value > 0):
            raise SpikefuseError(
                f"{type(self).__name__}: tau must be a finite float > 0, got {value!r}"
            )
        self._tau = value

    def neuronal_charge(self, x: Tensor) -> None:
        self.v = self.v + (x - self.v) / self.tau

    def extra_repr(self) -> str:
        return f"tau={self.tau}, {super().extra_repr()}"
