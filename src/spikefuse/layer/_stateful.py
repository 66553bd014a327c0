"""Stateful layers (:class:`Dropout`, :class:`SynapseFilter`), which keep their state until
:func:`spikefuse.functional.reset_net` as SpikingJelly's do, the step-by-step and recurrent
containers, and the weight-standardised :class:`WSConv2d` and :class:`WSLinear`."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import SpikefuseError
from ..functional import check_sequence, multi_step_forward
from ..neuron import MemoryModule, StepModeMixin
from ._base import (
    Conv2d,
    Linear,
    _refuse_dtype,
    _require_single_step,
    _SequenceContainer,
    seq_to_ann,
)


class Dropout(MemoryModule):
    """Dropout whose mask is drawn once per sequence: the elements zeroed at the first step stay
    zeroed (and the others scaled by 1/(1-p)) at every later step, single- or multi-step, until
    :meth:`reset` (SpikingJelly's ``layer.Dropout``). In eval mode it is the identity.

    The mask is a memory: call :func:`spikefuse.functional.reset_net` between sequences.
    """

    mask: Tensor | None
    p: float

    def __init__(self, p: float = 0.5, step_mode: str = "s") -> None:
        super().__init__(step_mode)
        # numpy scalars count as numbers, as in torch; bools do not
        if not (isinstance(p, numbers.Real) and not isinstance(p, bool) and 0 <= p < 1):
            raise SpikefuseError(
                f"{type(self).__name__}: p must be in [0, 1) (a number), got {p!r} "
                f"({type(p).__name__})"
            )
        self.p = float(p)
        self.register_memory("mask", None)

    def create_mask(self, x: Tensor) -> Tensor:
        """A mask for one step shaped like ``x``: 0 with probability p, else 1/(1-p)."""
        return F.dropout(torch.ones_like(x), self.p, training=True)

    def _apply_mask(self, x: Tensor, step: Tensor) -> Tensor:
        if not x.is_floating_point():  # the mask's 1/(1-p) does not fit other dtypes
            _refuse_dtype(type(self).__name__, x)
        if not self.training:
            return x
        mask = self.mask
        if mask is None:
            mask = self.create_mask(step)
            self.set_memory("mask", mask)
        elif (mask.shape, mask.dtype, mask.device) != (step.shape, step.dtype, step.device):
            raise SpikefuseError(
                f"{type(self).__name__}: the mask is {tuple(mask.shape)} {mask.dtype} on "
                f"{mask.device}, but this input's steps are {tuple(step.shape)} {step.dtype} "
                f"on {step.device}; call spikefuse.functional.reset_net(net) between sequences"
            )
        return x * mask

    def single_step_forward(self, x: Tensor) -> Tensor:
        return self._apply_mask(x, x)

    def multi_step_forward(self, x_seq: Tensor) -> Tensor:
        check_sequence(x_seq, type(self).__name__)
        return self._apply_mask(x_seq, x_seq[0])

    def extra_repr(self) -> str:
        return f"p={self.p}, step_mode={self.step_mode}"


class Dropout2d(Dropout):
    """:class:`Dropout` that drops whole channels (``torch.nn.functional.dropout2d`` on one step
    ``[N, C, H, W]``), one mask per sequence until :meth:`reset`. SpikingJelly's default p=0.2."""

    def __init__(self, p: float = 0.2, step_mode: str = "s") -> None:
        super().__init__(p, step_mode)

    def create_mask(self, x: Tensor) -> Tensor:
        if x.dim() != 4:
            raise SpikefuseError(
                f"Dropout2d: one step must be [N, C, H, W] (a sequence [T, N, C, H, W]), got "
                f"shape {tuple(x.shape)}"
            )
        return F.dropout2d(torch.ones_like(x), self.p, training=True)


class SynapseFilter(MemoryModule):
    """Exponentially decaying synaptic current driven by input spikes S:
    ``I[t] = I[t-1] - (1 - S[t]) I[t-1] / tau + S[t]``, I[-1] = 0 (SpikingJelly's formula).

    ``learnable=True`` learns 1/tau = sigmoid(w), w initialised from ``tau``. Multi-step mode
    runs a Python loop over T (this layer is not a fused kernel).
    """

    out_i: Tensor | float  # the memory I[t-1]: 0.0 until the first step

    def __init__(self, tau: float = 100.0, learnable: bool = False, step_mode: str = "s") -> None:
        super().__init__(step_mode)
        real = isinstance(tau, numbers.Real) and not isinstance(tau, bool)
        if not (real and math.isfinite(tau) and tau > 1):
            raise SpikefuseError(
                f"SynapseFilter: tau must be a finite number > 1, got {tau!r} ({type(tau).__name__})"
            )
        self.learnable = learnable
        if learnable:
            self.w = nn.Parameter(torch.as_tensor(-math.log(tau - 1.0)))
        else:
            self.tau = float(tau)
        self.register_memory("out_i", 0.0)

    def single_step_forward(self, x: Tensor) -> Tensor:
        out_i = self.out_i
        if not isinstance(out_i, Tensor):
            out_i = torch.full_like(x, out_i)
        elif (out_i.shape, out_i.device) != (x.shape, x.device):  # broadcasting would be silent
            raise SpikefuseError(
                f"SynapseFilter: the current is {tuple(out_i.shape)} on {out_i.device}, but "
                f"this step is {tuple(x.shape)} on {x.device}; call "
                "spikefuse.functional.reset_net(net) between sequences"
            )
        inv_tau = self.w.sigmoid() if self.learnable else 1.0 / self.tau
        out_i = out_i - (1.0 - x) * out_i * inv_tau + x
        self.set_memory("out_i", out_i)
        return out_i

    def extra_repr(self) -> str:
        tau = 1.0 / self.w.detach().sigmoid().item() if self.learnable else self.tau
        return f"tau={tau}, learnable={self.learnable}, step_mode={self.step_mode}"


class MultiStepContainer(_SequenceContainer):
    """Runs single-step modules on ``[T, N, *]`` one step at a time (a Python loop over T), e.g.
    stateful modules without a multi-step mode (SpikingJelly's container of the same name)."""

    def __init__(self, *args: nn.Module) -> None:
        super().__init__(*args)
        _require_single_step("MultiStepContainer", self)

    def forward(self, x_seq: Tensor) -> Tensor:
        return multi_step_forward(x_seq, super().forward)


class StepModeContainer(StepModeMixin, nn.Sequential):
    """Gives single-step modules a ``step_mode``: in 'm' mode it runs them step by step if
    ``stateful`` (:class:`MultiStepContainer`), else on merged ``[T*N, *]``
    (:class:`SeqToANNContainer`). :func:`spikefuse.functional.set_step_mode` sets the
    container's mode and leaves the contained modules single-step."""

    keeps_children_step_mode = True

    def __init__(self, stateful: bool, step_mode: str = "s", *args: nn.Module) -> None:
        if isinstance(step_mode, nn.Module):
            raise SpikefuseError(
                "StepModeContainer(stateful, step_mode='s', *modules) takes the step mode "
                "second, as SpikingJelly's does; got a module there: pass "
                "StepModeContainer(stateful, 's', module, ...)"
            )
        super().__init__(*args)
        _require_single_step("StepModeContainer", self)
        self.stateful = stateful
        self.step_mode = step_mode

    def forward(self, x: Tensor) -> Tensor:
        if self.step_mode == "s":
            return super().forward(x)
        if self.stateful:
            return multi_step_forward(x, super().forward)
        return seq_to_ann(super().forward, x)


class ElementWiseRecurrentContainer(MemoryModule):
    """Element-wise self-connection around ``sub_module``: ``y[t] = sub_module(f(y[t-1], x[t]))``
    with y[-1] = 0, where ``f = element_wise_function`` is called as SpikingJelly's container
    calls it (previous output first). ``sub_module`` must keep the shape and run single-step."""

    keeps_children_step_mode = True
    y: Tensor | None  # the memory y[t-1]: None before the first step

    def __init__(
        self,
        sub_module: nn.Module,
        element_wise_function: Callable[[Tensor, Tensor], Tensor],
        step_mode: str = "s",
    ) -> None:
        super().__init__(step_mode)
        _require_single_step("ElementWiseRecurrentContainer", [sub_module])
        self.sub_module = sub_module
        self.element_wise_function = element_wise_function
        self.register_memory("y", None)

    def single_step_forward(self, x: Tensor) -> Tensor:
        y = torch.zeros_like(x) if self.y is None else self.y
        y = self.sub_module(self.element_wise_function(y, x))
        self.set_memory("y", y)
        return y

    def extra_repr(self) -> str:
        # SpikingJelly's wording
        return f"element-wise function={self.element_wise_function}, step_mode={self.step_mode}"


class LinearRecurrentContainer(MemoryModule):
    """Linear self-connection around ``sub_module``: ``i[t] = [x[t], y[t-1]] W^T + b``,
    ``y[t] = sub_module(i[t])``, y[-1] = 0; x[t] is ``[N, *, in_features]`` and y[t]
    ``[N, *, out_features]`` (``rc = nn.Linear(in_features + out_features, in_features)``)."""

    keeps_children_step_mode = True
    y: Tensor | None  # the memory y[t-1]: None before the first step

    def __init__(
        self,
        sub_module: nn.Module,
        in_features: int,
        out_features: int,
        bias: bool = True,
        step_mode: str = "s",
    ) -> None:
        super().__init__(step_mode)
        _require_single_step("LinearRecurrentContainer", [sub_module])
        self.sub_module_out_features = out_features
        self.rc = nn.Linear(in_features + out_features, in_features, bias)
        self.sub_module = sub_module
        self.register_memory("y", None)

    def single_step_forward(self, x: Tensor) -> Tensor:
        y = self.y
        if y is None:
            y = x.new_zeros(*x.shape[:-1], self.sub_module_out_features)
        y = self.sub_module(self.rc(torch.cat((x, y), dim=-1)))
        self.set_memory("y", y)
        return y

    def extra_repr(self) -> str:
        return f"step_mode={self.step_mode}"


def _standardised(weight: Tensor, gain: Tensor | None, eps: float) -> Tensor:
    """(W - mean) / sqrt(var * fan_in + eps) [* gain], mean and (unbiased) variance over each
    output unit's fan-in (SpikingJelly's weight standardisation)."""
    dims = list(range(1, weight.dim()))
    fan_in = math.prod(weight.shape[1:])
    mean = weight.mean(dim=dims, keepdim=True)
    var = weight.var(dim=dims, keepdim=True)
    standard = (weight - mean) / ((var * fan_in + eps) ** 0.5)
    return standard if gain is None else standard * gain


def _check_eps(who: str, eps: float) -> None:
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
        raise SpikefuseError(f"{who}: eps must be a finite float > 0, got {eps!r}")


class WSConv2d(Conv2d):  # type: ignore[misc,valid-type]  # Conv2d is made by _wrap
    """:class:`Conv2d` with weight standardisation (:func:`_standardised`) and a learnable gain
    [C_out, 1, 1, 1] (``gain=True``), as SpikingJelly's ``layer.WSConv2d``. Not fused by
    :func:`spikefuse.fuse` (its weight is not the layer's ``weight``)."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: Any,
        stride: Any = 1,
        padding: Any = 0,
        dilation: Any = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        step_mode: str = "s",
        gain: bool = True,
        eps: float = 1e-4,
    ) -> None:
        _check_eps("WSConv2d", eps)
        super().__init__(
            in_channels,
            out_channels,
            kernel_size,
            stride,
            padding,
            dilation,
            groups,
            bias,
            padding_mode,
            step_mode=step_mode,
        )
        self.gain = nn.Parameter(torch.ones(out_channels, 1, 1, 1)) if gain else None
        self.eps = eps

    def get_weight(self) -> Tensor:
        """The standardised weight the convolution uses."""
        return _standardised(self.weight, self.gain, self.eps)

    def _conv_forward(self, input: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return super()._conv_forward(input, self.get_weight(), bias)


class WSLinear(Linear):  # type: ignore[misc,valid-type]  # Linear is made by _wrap
    """:class:`Linear` with weight standardisation and a learnable gain [out_features, 1]
    (``gain=True``), as SpikingJelly's ``layer.WSLinear`` (whose gain=True fails there: it
    reads ``out_channels``, which a Linear lacks). Any ``[..., in_features]`` input, either
    step mode. Not fused by :func:`spikefuse.fuse`."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        step_mode: str = "s",
        gain: bool = True,
        eps: float = 1e-4,
    ) -> None:
        _check_eps("WSLinear", eps)
        super().__init__(in_features, out_features, bias, step_mode=step_mode)
        self.gain = nn.Parameter(torch.ones(out_features, 1)) if gain else None
        self.eps = eps

    def get_weight(self) -> Tensor:
        """The standardised weight the layer uses."""
        return _standardised(self.weight, self.gain, self.eps)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.get_weight(), self.bias)
