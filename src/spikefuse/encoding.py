"""Encoders that turn analog input into spikes, with SpikingJelly's names and semantics.

Stateless encoders (:class:`PoissonEncoder`) draw every call anew. Stateful encoders encode the
input once, at their first call after :meth:`reset`, into a spike train ``[T, *]`` and return
its step ``t % T`` at the t-th call (in multi-step mode one step per element of the input's
first dimension); :func:`spikefuse.functional.reset_net` resets them between samples.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .errors import SpikefuseError
from .layer import _StepMode
from .neuron import MemoryModule


def _precision(dtype: torch.dtype) -> int:
    """The significand bits of a floating-point dtype, the implicit one included (24 for
    float32): it holds every integer up to 2 ** precision exactly."""
    return 1 - int(math.log2(torch.finfo(dtype).eps))


class StatelessEncoder(_StepMode, nn.Module):
    """Base class of encoders without state: ``encoder(x)`` returns spikes shaped like ``x``
    (the same in both step modes)."""

    def __init__(self, step_mode: str = "s") -> None:
        super().__init__()
        self.step_mode = step_mode

    def forward(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"step_mode={self.step_mode}"


class PoissonEncoder(StatelessEncoder):
    """Spikes with firing probability ``x``: S = 1 where U <= x, U uniform on [0, 1)
    (SpikingJelly's rule; x is meant to lie in [0, 1]: above 1 always fires, below 0 never).
    NaN input gives NaN output (it is not turned into a valid spike)."""

    def forward(self, x: Tensor) -> Tensor:
        if not isinstance(x, Tensor) or not x.dtype.is_floating_point:
            raise SpikefuseError("PoissonEncoder: input must be a floating-point torch.Tensor")
        spikes = torch.rand_like(x).le(x).to(x.dtype)
        return torch.where(x.isnan(), x, spikes)


def _steps(owner: str, name: str, value: Any) -> int:
    """``value`` as a count of steps (an int >= 1), else a SpikefuseError naming ``name``."""
    # numpy integers count as ints, as in torch; bools do not
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise SpikefuseError(
            f"{owner}: {name} must be an int >= 1, got {value!r} ({type(value).__name__})"
        )
    return int(value)


class StatefulEncoder(MemoryModule):
    """Base class of encoders that encode once per sequence: subclasses implement
    :meth:`single_step_encode` (input -> spike train ``[T, *]``).

    Memories: ``spike`` (the train, None until the first call) and ``t`` (the next step)."""

    spike: Tensor | None
    t: int
    T: int

    def __init__(self, T: int, step_mode: str = "s") -> None:
        super().__init__(step_mode)
        self.T = _steps(type(self).__name__, "T", T)
        self.register_memory("spike", None)
        self.register_memory("t", 0)

    def single_step_encode(self, x: Tensor) -> Tensor:
        """The spike train ``[T, *x.shape]`` for input ``x``."""
        raise NotImplementedError

    def single_step_forward(self, x: Tensor | None = None) -> Tensor:
        spike = self.spike
        if spike is None:
            if x is None:
                raise SpikefuseError(f"{type(self).__name__}: the first call needs the input")
            spike = self.single_step_encode(x)
            self.set_memory("spike", spike)
        t = self.t
        self.set_memory("t", (t + 1) % self.T)
        return spike[t]

    def extra_repr(self) -> str:
        return f"T={self.T}, step_mode={self.step_mode}"


class PeriodicEncoder(StatefulEncoder):
    """Returns ``spike[t % T]`` at the t-th call for a given train ``spike`` [T, *]
    (T = ``spike.shape[0]``); the input is ignored. :meth:`reset` restarts at t = 0 and keeps
    the train."""

    spike: Tensor  # the constructor's train, which reset() restores

    def __init__(self, spike: Tensor, step_mode: str = "s") -> None:
        if not isinstance(spike, Tensor) or spike.dim() < 1:
            raise SpikefuseError("PeriodicEncoder: spike must be a tensor [T, *]")
        super().__init__(spike.shape[0], step_mode)
        self._memory_defaults["spike"] = spike
        self.set_memory("spike", spike)

    def single_step_encode(self, x: Tensor) -> Tensor:
        return self.spike


class LatencyEncoder(StatefulEncoder):
    """One spike per element, the earlier the larger x in [0, 1]: at step
    ``t_f = round((T - 1)(1 - x))`` ('linear') or ``round(T - 1 - ln(α x + 1))`` with
    α = e^(T-1) - 1 ('log'), so t_f(0) = T - 1 and t_f(1) = 0.

    The arithmetic is SpikingJelly's, in x's dtype, while that dtype holds it: T - 1 exactly
    and, for 'log', α. For longer sequences it runs in float64, 'log' as
    ``T - 1 - logaddexp(0, ln α + ln x)`` (α itself overflows float64 from T = 711 on; then
    ``alpha`` is ``inf``)."""

    def __init__(self, T: int, enc_function: str = "linear", step_mode: str = "s") -> None:
        super().__init__(T, step_mode)
        if enc_function not in ("linear", "log"):
            raise SpikefuseError(
                f"LatencyEncoder: enc_function must be 'linear' or 'log', got {enc_function!r}"
            )
        self.enc_function = enc_function
        if enc_function == "log":
            steps = self.T - 1.0
            self.alpha = math.exp(steps) - 1.0 if steps < 709 else math.inf
            # ln(e^s - 1) = s + ln(1 - e^-s), exact where e^s overflows
            self.log_alpha = steps + math.log1p(-math.exp(-steps)) if steps else -math.inf

    def single_step_encode(self, x: Tensor) -> Tensor:
        if not bool(((x >= 0) & (x <= 1)).all()):  # also rejects NaN
            raise SpikefuseError("LatencyEncoder: input must lie in [0, 1] (and not be NaN)")
        if self._fits(x.dtype):
            if self.enc_function == "log":
                t_f = (self.T - 1.0 - torch.log(self.alpha * x + 1.0)).round().long()
            else:
                t_f = ((self.T - 1.0) * (1.0 - x)).round().long()
        else:
            wide = x.double()
            if self.enc_function == "log":
                late = torch.logaddexp(torch.zeros_like(wide), self.log_alpha + wide.log())
            else:
                late = (self.T - 1.0) * wide
            t_f = (self.T - 1.0 - late).round().long()
        return F.one_hot(t_f, num_classes=self.T).to(x.dtype).movedim(-1, 0)

    def _fits(self, dtype: torch.dtype) -> bool:
        """Whether ``dtype`` holds T - 1 exactly and (for 'log') α x + 1 without overflow."""
        if self.T - 1 > 2 ** _precision(dtype):
            return False
        return self.enc_function != "log" or self.alpha + 1.0 < torch.finfo(dtype).max


class WeightedPhaseEncoder(StatefulEncoder):
    """Binary expansion over K phases (Kim et al. 2018): phase k (1..K) spikes if bit k of x
    is set, so ``x = Σ_k 2^-k S[k]`` for x in [0, 1 - 2^-K]. The spikes are in torch's default
    dtype (float32 unless changed), whatever x's is, as SpikingJelly's."""

    def __init__(self, K: int, step_mode: str = "s") -> None:
        super().__init__(_steps("WeightedPhaseEncoder", "K", K), step_mode)

    def single_step_encode(self, x: Tensor) -> Tensor:
        # 1 - 2^-K in x's dtype: for K beyond its precision, the largest value below 1
        limit = 1 - 2.0 ** -min(self.T, _precision(x.dtype))
        if not bool(((x >= 0) & (x <= limit)).all()):  # also rejects NaN
            raise SpikefuseError(
                f"WeightedPhaseEncoder: input must lie in [0, 1 - 2^-K] (K={self.T}), in "
                f"{x.dtype} [0, {limit}]"
            )
        # the smallest (subnormal) value of x's dtype: it has no smaller bit
        smallest = torch.finfo(x.dtype).smallest_normal * 2.0 ** (1 - _precision(x.dtype))
        rest = x.clone()
        spikes = []
        weight = 0.5
        for _ in range(self.T):
            # phase k spikes if bit k of x is set; bits below x's dtype are never set (a
            # weight that rounds to 0 there would make every later phase spike)
            spike = (rest >= weight).to(x.dtype) if weight >= smallest else torch.zeros_like(x)
            rest = rest - weight * spike
            spikes.append(spike)
            weight *= 0.5
        return torch.stack(spikes).to(torch.get_default_dtype())  # SpikingJelly's dtype
