"""Stateless layers with a ``step_mode``: torch's layers wrapped for multi-step ``[T, N, *]``
data (they merge T and N, run the torch layer once on ``[T*N, *]`` and split the result back),
:class:`Flatten`, :class:`VotingLayer` and :class:`SeqToANNContainer`."""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import SpikefuseError
from ..functional import (
    check_sequence,
    repeat_over_time,
    repeated_over_time,
    seq_to_ann_forward,
    split_time_batch,
)
from ..neuron import MultiStepModule, StepModeMixin


def seq_to_ann(module: Callable[[Tensor], Any], x_seq: Tensor) -> Any:
    """Apply ``module`` to ``[T, N, *]`` by merging T and N (tuple outputs are split too)."""
    return seq_to_ann_forward(x_seq, module)


class _SequenceContainer(nn.Sequential, MultiStepModule):
    """An ``nn.Sequential`` that is a ``base.MultiStepModule``, as SpikingJelly's sequence
    containers: ``supported_step_mode()`` is ``('m',)`` and assigning ``step_mode='s'`` raises.
    :func:`spikefuse.functional.set_step_mode` leaves the contained modules single-step.

    Unlike the other one-mode modules it has no ``step_mode`` until one is assigned, as there
    (SpikingJelly's containers never set it): ``set_step_mode(net, 's')`` passes over it, as
    SpikingJelly's does, and a container inside another one counts as single-step."""

    keeps_children_step_mode = True
    _reads_before_assigned = False


class SeqToANNContainer(_SequenceContainer):
    """Runs stateless modules on ``[T, N, *]`` input as if it were a batch of T*N samples."""

    def __init__(self, *args: nn.Module) -> None:
        super().__init__(*args)
        _require_single_step("SeqToANNContainer", self)

    def forward(self, x_seq: Tensor) -> Tensor:
        return seq_to_ann(super().forward, x_seq)


class _StepMode(StepModeMixin, nn.Module):
    """Mixin: ``step_mode='m'`` applies the wrapped torch layer (the next class in the MRO) to
    ``[T, N, *]`` input.

    ``_seq_dims`` are the input dimensions allowed in multi-step mode (``_seq_shape`` names them).
    The output is a tensor, or a tuple of tensors where the torch layer returns one (MaxPool's
    ``return_indices=True``).

    A synapse (``_synapse``: Linear, convolutions) given an input repeated over T as a view
    (``images.unsqueeze(0).expand(T, ...)``, needing no gradient) runs once on its [N, *] and
    repeats the output: the same values, T times less work (an extension; SpikingJelly runs
    all T*N samples).
    """

    _seq_dims: range = range(2, 64)
    _seq_shape: str = "[T, N, *]"
    _synapse: bool = False
    _float_input: bool = False  # the layer has float weights: integer input fails in torch

    def forward(self, x: Tensor) -> Tensor | tuple[Tensor, ...]:
        if self._float_input and isinstance(x, Tensor) and not x.is_floating_point():
            _refuse_dtype(type(self).__name__, x)
        if self.step_mode == "m":
            check_sequence(x, type(self).__name__, self._seq_shape, self._seq_dims)
            if self._synapse and repeated_over_time(x):
                return repeat_over_time(super().forward(x[0]), x.shape[0])
            return split_time_batch(super().forward(x.flatten(0, 1)), x.shape[:2])
        return super().forward(x)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, step_mode={self.step_mode}"


def _refuse_dtype(name: str, x: Tensor) -> None:
    raise SpikefuseError(
        f"{name}: input must be a floating-point tensor, got {x.dtype}; convert it first, "
        "e.g. x.float() (spikes are 0.0/1.0 floats)"
    )


def _wrap(
    base: type[nn.Module],
    seq_shape: str = "[T, N, *]",
    min_dim: int = 2,
    synapse: bool = False,
    float_input: bool = False,
) -> type:
    """``base`` with a ``step_mode``; multi-step input must have ``seq_shape`` (ndim from
    ``min_dim``; a shape without ``*`` has exactly that many dimensions); ``synapse``: see
    :class:`_StepMode`; ``float_input``: integer and bool input is refused."""

    def __init__(self, *args, step_mode: str | None = None, **kwargs) -> None:
        # SpikingJelly's layers take step_mode after torch's arguments, also positionally (no
        # torch argument takes 's' or 'm')
        if args and isinstance(args[-1], str) and args[-1] in ("s", "m"):
            if step_mode is not None:
                raise SpikefuseError(f"{base.__name__}: step_mode given twice")
            args, step_mode = args[:-1], args[-1]
        base.__init__(self, *args, **kwargs)
        self.step_mode = "s" if step_mode is None else step_mode

    exact = "*" not in seq_shape
    dims = range(min_dim, min_dim + 1) if exact else range(min_dim, 64)
    doc = (
        f"``torch.nn.{base.__name__}`` with a ``step_mode`` ('s': one step, 'm': a sequence "
        f"{seq_shape})."
    )
    namespace = {
        "__init__": __init__,
        "__doc__": doc,
        "_seq_dims": dims,
        "_seq_shape": seq_shape,
        "_synapse": synapse,
        "_float_input": synapse or float_input,
    }
    return type(base.__name__, (_StepMode, base), namespace)


Linear = _wrap(nn.Linear, "[T, N, *, in_features]", 3, synapse=True)
Conv1d = _wrap(nn.Conv1d, "[T, N, C, L]", 4, synapse=True)
Conv2d = _wrap(nn.Conv2d, "[T, N, C, H, W]", 5, synapse=True)
Conv3d = _wrap(nn.Conv3d, "[T, N, C, D, H, W]", 6, synapse=True)
ConvTranspose1d = _wrap(nn.ConvTranspose1d, "[T, N, C, L]", 4, synapse=True)
ConvTranspose2d = _wrap(nn.ConvTranspose2d, "[T, N, C, H, W]", 5, synapse=True)
ConvTranspose3d = _wrap(nn.ConvTranspose3d, "[T, N, C, D, H, W]", 6, synapse=True)
BatchNorm1d = _wrap(nn.BatchNorm1d, "[T, N, C, *]", 3, float_input=True)
BatchNorm2d = _wrap(nn.BatchNorm2d, "[T, N, C, H, W]", 5, float_input=True)
BatchNorm3d = _wrap(nn.BatchNorm3d, "[T, N, C, D, H, W]", 6, float_input=True)
GroupNorm = _wrap(nn.GroupNorm, "[T, N, C, *]", 3, float_input=True)
AvgPool1d = _wrap(nn.AvgPool1d, "[T, N, C, L]", 4)
AvgPool2d = _wrap(nn.AvgPool2d, "[T, N, C, H, W]", 5)
AvgPool3d = _wrap(nn.AvgPool3d, "[T, N, C, D, H, W]", 6)
MaxPool1d = _wrap(nn.MaxPool1d, "[T, N, C, L]", 4)
# With return_indices=True the multi-step output is (out, indices), both [T, N, C, H', W'].
MaxPool2d = _wrap(nn.MaxPool2d, "[T, N, C, H, W]", 5)
MaxPool3d = _wrap(nn.MaxPool3d, "[T, N, C, D, H, W]", 6)
AdaptiveAvgPool1d = _wrap(nn.AdaptiveAvgPool1d, "[T, N, C, L]", 4)
AdaptiveAvgPool2d = _wrap(nn.AdaptiveAvgPool2d, "[T, N, C, H, W]", 5)
AdaptiveAvgPool3d = _wrap(nn.AdaptiveAvgPool3d, "[T, N, C, D, H, W]", 6)
Upsample = _wrap(nn.Upsample, "[T, N, C, *]", 4)


class Flatten(_wrap(nn.Flatten)):  # type: ignore[misc]  # a class _wrap builds at run time
    """``torch.nn.Flatten`` with a ``step_mode`` ('s': one step, 'm': a sequence [T, N, *]);
    ``start_dim`` and ``end_dim`` count a step's batch dimension N as 0, in both modes (in
    multi-step mode N cannot be flattened: the output is split back into [T, N, *])."""

    def forward(self, x: Tensor) -> Tensor | tuple[Tensor, ...]:
        if isinstance(x, Tensor):
            rank = x.dim() - (self.step_mode == "m")  # of one step [N, *]
            dims = [d + rank if d < 0 else d for d in (self.start_dim, self.end_dim)]
            first = 1 if self.step_mode == "m" else 0  # merged [T*N, *] must keep T*N apart
            if rank >= 1 and not (first <= dims[0] <= dims[1] < rank):
                shape = "[T, N, *]" if first else "[N, *]"
                has = f"steps of {rank} dimension(s)"
                if first and dims[0] == 0:
                    has += ", and N cannot be flattened in multi-step mode"
                raise SpikefuseError(
                    f"Flatten(start_dim={self.start_dim}, end_dim={self.end_dim}) with "
                    f"step_mode={self.step_mode!r} needs dimensions {self.start_dim}.."
                    f"{self.end_dim} of each step [N, *], but input {shape} of shape "
                    f"{tuple(x.shape)} has {has}"
                )
        return super().forward(x)


class VotingLayer(_StepMode, nn.Module):
    """Average of each group of ``voting_size`` neighbours on the last dimension:
    ``[..., C * voting_size] -> [..., C]`` (SpikingJelly's ``avg_pool1d`` with kernel = stride =
    ``voting_size``; a remainder shorter than ``voting_size`` is dropped)."""

    def __init__(self, voting_size: int = 10, step_mode: str = "s") -> None:
        super().__init__()
        integral = isinstance(voting_size, numbers.Integral) and not isinstance(voting_size, bool)
        if not integral or voting_size < 1:
            raise SpikefuseError(
                f"VotingLayer: voting_size must be an int >= 1, got {voting_size!r} "
                f"({type(voting_size).__name__})"
            )
        self.voting_size = int(voting_size)
        self.step_mode = step_mode

    def forward(self, x: Tensor) -> Tensor:
        if self.step_mode == "m":
            check_sequence(x, "VotingLayer", "[T, N, *, C * voting_size]", range(3, 64))
        y = F.avg_pool1d(x.reshape(-1, 1, x.shape[-1]), self.voting_size, self.voting_size)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def extra_repr(self) -> str:
        return f"voting_size={self.voting_size}, step_mode={self.step_mode}"


def _require_single_step(container: str, modules) -> None:
    for module in modules:
        if getattr(module, "step_mode", "s") != "s":
            raise SpikefuseError(
                f"{container}: contained modules must be single-step (step_mode='s'), but "
                f"{type(module).__name__} has step_mode={module.step_mode!r}"
            )
