"""Runtime of the cuda backend: NVRTC compilation through CuPy, caching, launches.

Kernels are compiled once per (program, dtype, vector width) and device: in memory here, and on
disk by CuPy's kernel cache (keyed by source, compiler options and GPU architecture, under
``CUPY_CACHE_DIR``). Launches go to PyTorch's current stream on the tensor's device; the device
CuPy sees is switched only around a launch and restored, so PyTorch's current device is untouched.
Hot path per call: a dict lookup, output allocation, one kernel launch; no host sync.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from ..errors import BackendUnavailableError
from ..program import NeuronProgram
from ..reference import BPTTOut, FPTTOut
from . import unavailable_reason
from .codegen import BLOCK_THREADS, DefinitionKernel, NeuronKernel, vector_width

_ALIGN = 16


def saved_dtype(dtype: torch.dtype) -> torch.dtype:
    """H (and W) are saved in the storage dtype (rounded consistently with the spikes)."""
    return dtype


@functools.cache
def _cupy():
    try:
        import cupy
    except Exception as exc:  # ImportError, or a CuPy that cannot find its CUDA libraries
        raise BackendUnavailableError(
            f"the cuda backend needs CuPy with NVRTC ({exc}); install `spikefuse[cuda12]` or "
            "`spikefuse[cuda13]` to match your CUDA version"
        ) from exc
    return cupy


@functools.cache
def kernel_for(program: NeuronProgram, dtype: torch.dtype, vec: int) -> NeuronKernel:
    """The generated kernel template of a program (cached; print ``.full_codes`` to read it)."""
    return DefinitionKernel(program, dtype, vec)


@functools.cache
def _module(source: str):
    cp = _cupy()
    options = ("--std=c++17",)
    include = cp.cuda.get_cuda_path()
    if include:  # fp16/bf16 headers, where NVRTC does not ship them built in
        options += (f"-I{include}/include",)
    return cp.RawModule(code=source, options=options, backend="nvrtc")


def precompile(kernels: list[NeuronKernel], threads: int = 8) -> None:
    """Compile kernels ahead of use, in parallel (NVRTC runs outside the GIL); fills the caches."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda k: _module(k.full_codes).compile(), kernels))


_functions: dict[tuple, object] = {}
_streams: dict[tuple[int, int], object] = {}


def _launch(kernel: NeuronKernel, forward: bool, device: torch.device, blocks: int, args) -> None:
    cp = _cupy()
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (id(kernel), forward, index)
    stream_ptr = torch.cuda.current_stream(index).cuda_stream
    previous = cp.cuda.runtime.getDevice()
    if previous != index:
        cp.cuda.runtime.setDevice(index)
    try:
        fn = _functions.get(key)
        if fn is None:
            name = kernel.fptt_name if forward else kernel.bptt_name
            fn = _functions[key] = _module(kernel.full_codes).get_function(name)
        stream = _streams.get((index, stream_ptr))
        if stream is None:
            stream = _streams[(index, stream_ptr)] = cp.cuda.ExternalStream(stream_ptr, index)
        fn((blocks,), (BLOCK_THREADS,), args, stream=stream)
    finally:
        if previous != index:
            cp.cuda.runtime.setDevice(previous)


def _check(x: torch.Tensor) -> None:
    reason = unavailable_reason(x)
    if reason is not None:
        raise BackendUnavailableError(f"cuda backend: {reason}")


def _vec(dtype: torch.dtype, n: int, *tensors: torch.Tensor | None) -> int:
    """Widest vector access that N and every pointer's alignment allow."""
    vec = vector_width(dtype)
    if n % vec or any(t is not None and t.data_ptr() % _ALIGN for t in tensors):
        return 1
    return vec


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None or t.numel() == 0 else t.data_ptr()


def _scalars(constants: list[float], T: int, N: int) -> list:
    return [np.float32(c) for c in constants] + [np.int64(T), np.int64(N)]


def fptt(
    program: NeuronProgram,
    x_seq: torch.Tensor,
    v0: torch.Tensor,
    w0: torch.Tensor,
    learnable: torch.Tensor,
    constants: list[float],
    save_for_backward: bool,
    store_v_seq: bool,
) -> FPTTOut:
    """Forward through time with one fused kernel; same contract as the reference ``fptt``."""
    _check(x_seq)
    adaptive = program.definition.adaptive
    x = x_seq.contiguous()
    T, N = x.shape[0], math.prod(x.shape[1:])
    state = x.shape[1:]
    spikes = torch.empty_like(x)
    h_seq = torch.empty_like(x) if save_for_backward else x.new_empty(0)
    v_seq = torch.empty_like(x) if store_v_seq else x.new_empty(0)
    keep_w = save_for_backward and adaptive and program.definition.partials.needs_w
    w_seq = torch.empty_like(x) if keep_w else x.new_empty(0)
    v_last = torch.empty(state, dtype=torch.float32, device=x.device)
    w_last = torch.empty_like(v_last) if adaptive else v_last.new_empty(0)
    if N:
        vec = _vec(x.dtype, N, x)
        kernel = kernel_for(program, x.dtype, vec)
        v0c = v0.contiguous()
        w_args = [_ptr(w0.contiguous()), _ptr(w_last), _ptr(w_seq)] if adaptive else []
        args = [_ptr(x), _ptr(v0c), *w_args, _ptr(spikes), _ptr(h_seq), _ptr(v_seq), _ptr(v_last),
                _ptr(learnable.contiguous())]  # fmt: skip
        args += _scalars(constants, T, N)
        _launch(kernel, True, x.device, -(-N // (vec * BLOCK_THREADS)), args)
    return FPTTOut(spikes, v_seq, v_last, w_last, h_seq, w_seq)


def bptt(
    program: NeuronProgram,
    grad_spikes: torch.Tensor,
    grad_v_seq: torch.Tensor | None,
    grad_v_last: torch.Tensor | None,
    grad_w_last: torch.Tensor | None,
    h_seq: torch.Tensor,
    w_seq: torch.Tensor,
    x_seq: torch.Tensor,
    v0: torch.Tensor,
    w0: torch.Tensor,
    learnable: torch.Tensor,
    constants: list[float],
) -> BPTTOut:
    """Backward through time with one fused kernel; same contract as the reference ``bptt``."""
    _check(h_seq)
    d = program.definition
    dtype = h_seq.dtype
    T, N = h_seq.shape[0], math.prod(h_seq.shape[1:])
    grad_spikes = grad_spikes.to(dtype).contiguous()
    grad_v_seq = None if grad_v_seq is None else grad_v_seq.to(dtype).contiguous()
    grad_x = torch.empty_like(h_seq)
    grad_v0 = torch.empty_like(v0)
    grad_w0 = torch.empty_like(w0) if d.adaptive else w0.new_empty(0)
    vec = _vec(dtype, N, grad_spikes, grad_v_seq, h_seq)
    blocks = max(1, -(-N // (vec * BLOCK_THREADS)))
    partial = torch.empty(
        (len(program.learnable), blocks), dtype=torch.float32, device=h_seq.device
    )
    if N:
        kernel = kernel_for(program, dtype, vec)
        v_last_g = None if grad_v_last is None else grad_v_last.float().contiguous()
        args = [_ptr(grad_spikes), _ptr(grad_v_seq), _ptr(v_last_g), _ptr(h_seq)]
        if d.partials.needs_x:
            args.append(_ptr(x_seq.contiguous()))
        args.append(_ptr(v0.contiguous()))
        if d.adaptive:
            w_last_g = None if grad_w_last is None else grad_w_last.float().contiguous()
            args += [_ptr(w0.contiguous()), _ptr(w_last_g), _ptr(w_seq), _ptr(grad_w0)]
        args += [_ptr(grad_x), _ptr(grad_v0), _ptr(partial), _ptr(learnable.contiguous())]
        args += _scalars(constants, T, N)
        _launch(kernel, False, h_seq.device, blocks, args)
    else:
        partial.zero_()
    return BPTTOut(grad_x, grad_v0, grad_w0, partial.sum(dim=1))
