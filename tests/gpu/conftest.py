"""Compiles, once per session and in parallel, every kernel the selected GPU tests launch."""

from __future__ import annotations

import time

import pytest

from .variants import Variant


@pytest.fixture(scope="session", autouse=True)
def precompiled_kernels(request: pytest.FixtureRequest) -> None:
    """NVRTC compiles one module per variant; in parallel (it runs outside the GIL) the whole
    set takes about a minute instead of many."""
    from spikefuse.cuda import backend as cuda_backend

    kernels = {}
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        for value in callspec.params.values() if callspec else ():
            if isinstance(value, Variant):
                kernels.update((id(k), k) for k in value.kernels())
    start = time.perf_counter()
    cuda_backend.precompile(list(kernels.values()), threads=16)
    print(f"\ncompiled {len(kernels)} kernel modules in {time.perf_counter() - start:.1f} s")


@pytest.fixture
def no_tf32():
    """cuDNN without TF32, whose rounding flips spikes by itself (both sides of a comparison
    then run the same float32 convolutions)."""
    import torch

    allowed = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = allowed


@pytest.fixture
def deterministic_cudnn():
    """cuDNN restricted to deterministic algorithms. By default it may pick a weight-gradient
    algorithm whose sums run in a different order from run to run: a small network's first
    convolution (3 input channels) got weight gradients 1e-8 apart in 2 of 8 identical eager
    runs, which flipped a spike some steps later. Tests that compare two training runs then
    measure cuDNN rather than the code under test."""
    import torch

    deterministic, benchmark = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    yield
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = deterministic, benchmark
