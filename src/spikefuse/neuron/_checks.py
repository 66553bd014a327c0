"""Validation of neuron constructor arguments and constants (float32: the neurons' arithmetic)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..errors import SpikefuseError
from ..surrogate import is_finite_real


def float32_value(value: float) -> float:
    """``value`` as float32 holds it: the neurons compute in float32 (float64 only for float64
    input), so constants are checked in that arithmetic."""
    return float(torch.tensor(float(value), dtype=torch.float32))


def check_finite(owner: str, name: str, value: Any) -> None:
    if not is_finite_real(value):
        raise SpikefuseError(
            f"{owner}: {name} must be a finite float, got {value!r} ({type(value).__name__})"
        )
    if not math.isfinite(float32_value(value)):
        raise SpikefuseError(
            f"{owner}: {name}={value!r} overflows float32, the arithmetic the neurons use"
        )


def check_above(
    owner: str, name: str, value: float, bound: float, what: str, why: str = ""
) -> None:
    """``value`` > ``bound`` (``what`` names the bound; ``why`` says what breaks otherwise),
    also once both are float32: a value above the bound only in float64 is equal to it in the
    neurons' arithmetic."""
    if not value > bound:
        raise SpikefuseError(f"{owner}: {name} must be > {what}, got {value} <= {bound}{why}")
    if not float32_value(value) > float32_value(bound):
        raise SpikefuseError(
            f"{owner}: {name} must be > {what}, but {value!r} is so only in float64; in "
            f"float32, the arithmetic the neurons use, both are {float32_value(bound)!r}{why}"
        )


def check_threshold_and_reset(owner: str, v_threshold: Any, v_reset: Any) -> None:
    """Finite V_th and V_reset (None: soft reset), and V_th > V_reset under hard reset (else a
    neuron at rest would fire on every step), in float32 too."""
    check_finite(owner, "v_threshold", v_threshold)
    if v_reset is None:
        return
    check_finite(owner, "v_reset", v_reset)
    why = ": a neuron at rest would fire on every step"
    check_above(owner, "with hard reset v_threshold", v_threshold, v_reset, "v_reset", why)


def backend_and_store_v_seq(
    node: nn.Module, backend: Any, store_v_seq: bool, default: str
) -> tuple[Any, bool]:
    """(backend, store_v_seq) from a neuron's constructor arguments. SpikingJelly 2.0's neurons
    take ``store_v_seq`` right after ``step_mode`` (they have no ``backend``; earlier versions
    put ``backend`` there): a bool in ``backend``'s place is that flag, with the default
    backend."""
    if not isinstance(backend, bool):
        return backend, store_v_seq
    if store_v_seq is not False:
        raise SpikefuseError(
            f"{type(node).__name__}: backend={backend!r} and store_v_seq={store_v_seq!r}; the "
            "argument after step_mode is store_v_seq (SpikingJelly 2.0) or backend (earlier "
            "versions), not both: pass backend= by keyword"
        )
    return default, backend
