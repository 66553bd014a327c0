"""Small constant tensors made once per device (and key), reused by every call."""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch
from torch import Tensor

_CONSTANTS: dict[tuple[Hashable, ...], Tensor] = {}


def device_constant(key: tuple[Hashable, ...], make: Callable[[], Tensor]) -> Tensor:
    """A small constant tensor made once per ``key`` (include the device): not cached while a
    CUDA graph is captured (it would live in the graph's pool) or the compiler traces."""
    value = _CONSTANTS.get(key)
    if value is None:
        value = make()
        capturing = value.is_cuda and torch.cuda.is_current_stream_capturing()
        if not capturing and not torch.compiler.is_compiling():
            _CONSTANTS[key] = value
    return value
