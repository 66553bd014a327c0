"""Fused CUDA backend: kernels generated from neuron definitions, compiled with NVRTC via CuPy.

Importing this package is cheap and never imports CuPy; :func:`unavailable_reason` tells whether
the backend can run a given tensor.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@functools.cache
def _cupy_problem() -> str | None:
    if importlib.util.find_spec("cupy") is None:
        return (
            "CuPy is not installed; install it with `pip install spikefuse[cuda12]` or "
            "`pip install spikefuse[cuda13]` (matching your CUDA major version)"
        )
    return None


def unavailable_reason(x: torch.Tensor) -> str | None:
    """Why the cuda backend cannot run on ``x``, or None if it can."""
    if not x.is_cuda:
        return f"the input is on {x.device}, the cuda backend needs a CUDA tensor"
    if x.dtype not in SUPPORTED_DTYPES:
        return f"dtype {x.dtype} is not supported (float32, float16, bfloat16 are)"
    return _cupy_problem()
