"""Fused CUDA backend: kernels generated from neuron definitions, compiled with NVRTC via CuPy.

Importing this package is cheap and never imports CuPy; :func:`unavailable_reason` tells whether
the backend can run a given tensor.
"""

from __future__ import annotations

import importlib.util

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _cupy_problem() -> str | None:
    if importlib.util.find_spec("cupy") is None:
        return (
            "CuPy is not installed; install it with `pip install spikefuse[cuda12]` or "
            "`pip install spikefuse[cuda13]` (matching your CUDA major version)"
        )
    return None


# Looked up once, at import (it only searches the module path, never imports CuPy): a plain
# constant is what torch.compile can trace without a guard or a graph break.
CUPY_PROBLEM = _cupy_problem()


def unavailable_reason(x: torch.Tensor) -> str | None:
    """Why the cuda backend cannot run on ``x``, or None if it can."""
    if not x.is_cuda:
        return f"the input is on {x.device}, the cuda backend needs a CUDA tensor"
    if x.dtype not in SUPPORTED_DTYPES:
        return f"dtype {x.dtype} is not supported (float32, float16, bfloat16 are)"
    return CUPY_PROBLEM
