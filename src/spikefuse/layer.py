"""Stateless layers for multi-step ``[T, N, *]`` data, with SpikingJelly's names.

In multi-step mode the time and batch dimensions are merged, the torch layer runs once on
``[T*N, *]`` and the result is split back: one large call instead of a Python loop over T.
"""

from __future__ import annotations

from torch import Tensor, nn

from .errors import SpikefuseError


def seq_to_ann(module: nn.Module, x_seq: Tensor) -> Tensor:
    """Apply ``module`` to ``[T, N, *]`` by merging T and N."""
    if x_seq.dim() < 2:
        raise SpikefuseError(f"multi-step input must be [T, N, *], got shape {tuple(x_seq.shape)}")
    y = module(x_seq.flatten(0, 1))
    return y.unflatten(0, x_seq.shape[:2])


class SeqToANNContainer(nn.Sequential):
    """Runs stateless modules on ``[T, N, *]`` input as if it were a batch of T*N samples."""

    def forward(self, x_seq: Tensor) -> Tensor:
        return seq_to_ann(super().forward, x_seq)


class _StepMode:
    """Mixin: ``step_mode='m'`` applies the wrapped torch layer to ``[T, N, *]`` input."""

    def _init_step_mode(self, step_mode: str) -> None:
        if step_mode not in ("s", "m"):
            raise SpikefuseError(f"step_mode must be 's' or 'm', got {step_mode!r}")
        self.step_mode = step_mode

    def forward(self, x: Tensor) -> Tensor:
        if self.step_mode == "m":
            return seq_to_ann(super().forward, x)
        return super().forward(x)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, step_mode={self.step_mode}"


def _wrap(base: type[nn.Module]) -> type[nn.Module]:
    def __init__(self, *args, step_mode: str = "s", **kwargs) -> None:
        base.__init__(self, *args, **kwargs)
        self._init_step_mode(step_mode)

    doc = f"``torch.nn.{base.__name__}`` with a ``step_mode`` ('s': [N, *], 'm': [T, N, *])."
    return type(base.__name__, (_StepMode, base), {"__init__": __init__, "__doc__": doc})


Linear = _wrap(nn.Linear)
Conv1d = _wrap(nn.Conv1d)
Conv2d = _wrap(nn.Conv2d)
BatchNorm1d = _wrap(nn.BatchNorm1d)
BatchNorm2d = _wrap(nn.BatchNorm2d)
AvgPool2d = _wrap(nn.AvgPool2d)
MaxPool2d = _wrap(nn.MaxPool2d)
AdaptiveAvgPool2d = _wrap(nn.AdaptiveAvgPool2d)
Flatten = _wrap(nn.Flatten)
Dropout = _wrap(nn.Dropout)
