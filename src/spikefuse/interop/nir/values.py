"""Array and number conversions shared by NIR export and import: NIR stores numpy arrays (one
value per neuron), torch layers take tensors, ints and pairs, spikefuse neurons one float each."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from ...errors import NIRConversionError
from ...surrogate import is_finite_real

# NIR stores parameters in float32 by many exporters: values within this relative distance of
# what a spikefuse neuron needs (r = 1, r = tau, dt r = 1) are taken as equal.
_REL_TOL = 1e-6


def check_dt(dt: float) -> None:
    """Refuse a time step that is not a positive finite real."""
    if not is_finite_real(dt) or dt <= 0:
        raise NIRConversionError(f"dt must be a positive finite float, got {dt!r}")


def to_numpy(t: Tensor) -> np.ndarray:
    """A detached CPU copy of ``t`` as a numpy array (bfloat16 as float32)."""
    t = t.detach().cpu()
    # numpy has no bfloat16; float32 holds every bfloat16 value exactly
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy().copy()


def ints(value: Any, pair: bool) -> int | tuple[int, int]:
    """An int (1-D) or an (int, int) pair (2-D) from a torch or NIR argument."""
    values = [int(v) for v in np.atleast_1d(np.asarray(value))]
    if pair and len(values) in (1, 2):
        return values[0], values[-1]
    if not pair and len(values) == 1:
        return values[0]
    raise NIRConversionError(f"expected {'a pair of ints' if pair else 'one int'}, got {value!r}")


def to_tensor(where: str, field: str, value: Any) -> Tensor:
    """A finite numeric NIR array as a new tensor (integers as float32)."""
    array = np.asarray(value)
    if not np.issubdtype(array.dtype, np.floating) and not np.issubdtype(array.dtype, np.integer):
        raise NIRConversionError(f"{where}: {field} must be numeric, got dtype {array.dtype}")
    if not np.all(np.isfinite(array)):
        raise NIRConversionError(f"{where}: {field} contains NaN or infinite values")
    if not np.issubdtype(array.dtype, np.floating):
        array = array.astype(np.float32)
    return torch.from_numpy(np.array(array))  # a copy: the graph keeps its own arrays


def uniform(where: str, field: str, value: Any) -> float:
    """The one value of a per-neuron NIR array that must hold the same finite value everywhere."""
    array = np.asarray(value, dtype=np.float64)
    if array.size == 0 or not np.all(np.isfinite(array)):
        raise NIRConversionError(f"{where}: {field} must be finite and non-empty")
    first = array.flat[0]
    if not np.all(array == first):
        raise NIRConversionError(
            f"{where}: spikefuse neurons have one {field} per layer, but this node has "
            f"{np.unique(array).size} different values"
        )
    return float(first)


def close_to(value: Any, target: float) -> bool:
    """Whether every value is within relative distance ``_REL_TOL`` of ``target``."""
    array = np.asarray(value, dtype=np.float64)
    return array.size > 0 and bool(np.all(np.abs(array - target) <= _REL_TOL * abs(target)))


def describe(value: Any) -> str:
    """A NIR array's value, or its range ``low..high``, for error messages."""
    array = np.asarray(value, dtype=np.float64)
    low, high = float(array.min()), float(array.max())
    return f"{low}" if low == high else f"{low}..{high}"
