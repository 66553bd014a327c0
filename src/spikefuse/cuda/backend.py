"""Runtime of the cuda backend: NVRTC compilation through CuPy, caching, launches.

Kernels are compiled once per (program, dtype, vector width) and device: in memory here, and on
disk by CuPy's kernel cache (keyed by source, compiler options and GPU architecture, under
``CUPY_CACHE_DIR``). Launches go to PyTorch's current stream on the tensor's device through the
driver's ``cuLaunchKernel`` with one packed argument struct; the current device is switched only
when the tensor lives elsewhere, and restored. Hot path per call: output allocation, a dict
lookup, one ``struct.pack``, one launch; no host sync.
"""

from __future__ import annotations

import ctypes
import functools
import math

import torch

from ..backends import BPTTOut, FPTTOut
from ..errors import BackendUnavailableError
from ..program import NeuronProgram
from . import unavailable_reason
from .codegen import (
    AFFINE_BPTT_VEC,
    AFFINE_CHUNK,
    BLOCK_THREADS,
    BPTT_VEC,
    CHUNK,
    NVRTC_OPTIONS,
    VEC,
    DefinitionKernel,
    NeuronKernel,
)

_ALIGN = 16


SAVES_SEQUENCE = False  # forward keeps only chunk-end states, not a [T, N] sequence


def keeps_x(program: NeuronProgram) -> bool:
    """Backward recomputes H from X, so X is always kept."""
    return True


def saved_like(
    program: NeuronProgram, x_seq: torch.Tensor, save: bool, chunk: int = CHUNK
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Uninitialised tensors shaped like what forward saves: V (and W) at the end of every chunk
    but the last, float32 (None when not saving or T <= chunk: backward starts from V[-1])."""
    if not save or x_seq.shape[0] <= chunk:
        return None, None
    shape = ((x_seq.shape[0] + chunk - 1) // chunk - 1, *x_seq.shape[1:])
    v = x_seq.new_empty(shape, dtype=torch.float32)
    return v, (x_seq.new_empty(shape, dtype=torch.float32) if program.definition.adaptive else None)


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
def kernel_for(
    program: NeuronProgram, dtype: torch.dtype, vec: int, affine: bool = False
) -> NeuronKernel:
    """The generated kernel template of a program (cached; print ``.full_codes`` to read it)."""
    return DefinitionKernel(program, dtype, vec, affine)


@functools.cache
def _module(source: str):
    cp = _cupy()
    options = NVRTC_OPTIONS
    include = cp.cuda.get_cuda_path()
    if include:  # fp16/bf16 headers, where NVRTC does not ship them built in
        options += (f"-I{include}/include",)
    return cp.RawModule(code=source, options=options, backend="nvrtc")


def compiled(kernel: NeuronKernel, forward: bool, device_index: int):
    """(CuPy ``RawKernel``, CUfunction handle) of one direction, loaded on a device.

    The handle belongs to that device's context, so it is read with the device current.
    """
    with _cupy().cuda.Device(device_index):
        raw = _module(kernel.full_codes).get_function(
            kernel.fptt_name if forward else kernel.bptt_name
        )
        return raw, raw.kernel.ptr


def precompile(kernels: list[NeuronKernel], threads: int = 8) -> None:
    """Compile kernels ahead of use, in parallel (NVRTC runs outside the GIL); fills the caches."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda k: _module(k.full_codes).compile(), kernels))


# (kernel, forward, device index) -> (RawKernel, CUfunction handle)
_functions: dict[tuple, tuple[object, int]] = {}
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_OnePointer = ctypes.c_void_p * 1


@functools.cache
def _driver_launch():
    return _cupy().cuda.driver.launchKernel  # cuLaunchKernel


def _current_stream(index: int) -> int:
    if _raw_stream is not None:
        return _raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream


def _launch(kernel: NeuronKernel, forward: bool, device: torch.device, blocks: int,
            pointers: dict[str, int], T: int, N: int, init: list[float],
            constants: list[float], channels: tuple[int, int] = (1, 1),
            inv_count: float = 0.0) -> None:  # fmt: skip
    """Launch one direction's kernel with its ``Args`` struct on the current stream."""
    args = kernel.pack_args(pointers, T, N, init[0], init[1], constants, channels, inv_count)
    current = torch.cuda.current_device()
    index = device.index if device.index is not None else current
    key = (kernel, forward, index)
    entry = _functions.get(key)
    if entry is None:
        if torch.cuda.is_current_stream_capturing():  # loading a module is not capturable
            raise BackendUnavailableError(
                f"spikefuse: kernel {kernel.kernel_prefix} is not loaded on cuda:{index} yet and "
                "cannot be compiled during CUDA graph capture; run the captured step once "
                "eagerly first (the usual warm-up before torch.cuda.graph)"
            )
        entry = _functions[key] = compiled(kernel, forward, index)
    buffer = ctypes.create_string_buffer(args, len(args))
    params = _OnePointer(ctypes.addressof(buffer))  # kernelParams: one pointer, to the struct
    launch = _driver_launch()
    call = (entry[1], blocks, 1, 1, BLOCK_THREADS, 1, 1, 0, _current_stream(index),
            ctypes.addressof(params), 0)  # fmt: skip
    if current == index:
        launch(*call)
    else:  # the function belongs to that device's context
        with torch.cuda.device(index):
            launch(*call)


def _check(x: torch.Tensor) -> None:
    reason = unavailable_reason(x)
    if reason is not None:
        raise BackendUnavailableError(f"cuda backend: {reason}")


def _vec(n: int, *tensors: torch.Tensor | None, vec: int = VEC) -> int:
    """``vec`` neurons per thread where N and every pointer's alignment allow, else 1."""
    if n % vec or any(t is not None and t.data_ptr() % _ALIGN for t in tensors):
        return 1
    return vec


def _check_checkpoints(T: int, saved_v: torch.Tensor | None, chunk: int) -> None:
    if T > chunk and (saved_v is None or saved_v.shape[0] != (T + chunk - 1) // chunk - 1):
        raise RuntimeError("spikefuse cuda bptt: the forward's chunk checkpoints are missing")


def _contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    """A float32 contiguous state tensor (or None): what the kernels read as ``float*``."""
    return None if t is None else t.float().contiguous()


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None or t.numel() == 0 else t.data_ptr()


def _blocks(n: int, vec: int) -> int:
    return max(1, -(-n // (vec * BLOCK_THREADS)))


def fptt(
    program: NeuronProgram,
    x_seq: torch.Tensor,
    v0: torch.Tensor | None,
    w0: torch.Tensor | None,
    learnable: torch.Tensor | None,
    constants: list[float],
    init: list[float],
    save_for_backward: bool,
    store_v_seq: bool,
) -> FPTTOut:
    """Forward through time with one fused kernel; same contract as the reference ``fptt``,
    except what is saved: V (and W) at chunk ends (see :func:`saved_like`)."""
    _check(x_seq)
    adaptive = program.definition.adaptive
    x = x_seq.contiguous()
    T, N = x.shape[0], math.prod(x.shape[1:])
    spikes = torch.empty_like(x)
    v_seq = torch.empty_like(x) if store_v_seq else None
    v_last = x.new_empty(x.shape[1:], dtype=torch.float32)
    w_last = torch.empty_like(v_last) if adaptive else None
    v_ckpt, w_ckpt = saved_like(program, x, save_for_backward)
    if N:
        vec = _vec(N, x)
        kernel = kernel_for(program, x.dtype, vec)
        v0, w0 = _contiguous(v0), _contiguous(w0)  # bound: alive until the launch
        pointers = {
            "x_seq": x.data_ptr(),
            "v0": _ptr(v0),
            "w0": _ptr(w0),
            "spike_seq": spikes.data_ptr(),
            "v_seq": _ptr(v_seq),
            "v_last": v_last.data_ptr(),
            "w_last": _ptr(w_last),
            "v_ckpt": _ptr(v_ckpt),
            "w_ckpt": _ptr(w_ckpt),
            "learnable": _ptr(learnable),
        }
        _launch(kernel, True, x.device, _blocks(N, vec), pointers, T, N, init, constants)
    return FPTTOut(spikes, v_seq, v_last, w_last, v_ckpt, w_ckpt)


def bptt(
    program: NeuronProgram,
    grad_spikes: torch.Tensor,
    grad_v_seq: torch.Tensor | None,
    grad_v_last: torch.Tensor | None,
    grad_w_last: torch.Tensor | None,
    saved_v: torch.Tensor | None,
    saved_w: torch.Tensor | None,
    x_seq: torch.Tensor,
    v0: torch.Tensor | None,
    w0: torch.Tensor | None,
    learnable: torch.Tensor | None,
    constants: list[float],
    init: list[float],
) -> BPTTOut:
    """Backward through time with one fused kernel (recomputing H from X chunk by chunk).

    T >= 1, as for the reference backend (the modules reject T = 0 before any kernel runs)."""
    _check(x_seq)
    adaptive = program.definition.adaptive
    x = x_seq.contiguous()
    dtype = x.dtype
    T, N = x.shape[0], math.prod(x.shape[1:])
    _check_checkpoints(T, saved_v, CHUNK)
    grad_spikes = grad_spikes.to(dtype).contiguous()
    grad_v_seq = None if grad_v_seq is None else grad_v_seq.to(dtype).contiguous()
    grad_x = torch.empty_like(x)
    grad_v0 = None if v0 is None else torch.empty_like(v0)
    grad_w0 = None if w0 is None or not adaptive else torch.empty_like(w0)
    vec = _vec(N, x, grad_spikes, grad_v_seq, vec=BPTT_VEC[dtype])
    blocks = _blocks(N, vec)
    partial = None
    if program.learnable:  # every block writes its column; without a launch (N = 0) it sums to 0
        shape = (len(program.learnable), blocks)
        partial = x.new_empty(shape, dtype=torch.float32) if N else x.new_zeros(shape)
    if N:
        kernel = kernel_for(program, dtype, vec)
        v0, w0 = _contiguous(v0), _contiguous(w0)
        grad_v_last, grad_w_last = _contiguous(grad_v_last), _contiguous(grad_w_last)
        pointers = {
            "x_seq": x.data_ptr(),
            "v0": _ptr(v0),
            "w0": _ptr(w0),
            "v_ckpt": _ptr(saved_v),
            "w_ckpt": _ptr(saved_w),
            "learnable": _ptr(learnable),
            "grad_spike_seq": grad_spikes.data_ptr(),
            "grad_v_seq": _ptr(grad_v_seq),
            "grad_v_last": _ptr(grad_v_last),
            "grad_w_last": _ptr(grad_w_last),
            "grad_x_seq": grad_x.data_ptr(),
            "grad_v0": _ptr(grad_v0),
            "grad_w0": _ptr(grad_w0),
            "grad_learnable_partial": _ptr(partial),
        }
        _launch(kernel, False, x.device, blocks, pointers, T, N, init, constants)
    return BPTTOut(grad_x, grad_v0, grad_w0, None if partial is None else partial.sum(dim=1))


# ---- BatchNorm folded in: channel-affine kernels --------------------------------------------
def channel_layout(y: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
    """y [T, B, C, *S] as dense memory with T outermost, and (channels, inner) such that the
    channel of element n of a step is (n // inner) % channels.

    Contiguous y has inner = prod(S); y with channels innermost (the [T, B, C, H, W] view of a
    channels-last convolution output) has inner = 1 and is used as it is; anything else is
    made contiguous.
    """
    channels, spatial = y.shape[2], math.prod(y.shape[3:])
    if y.is_contiguous():
        return y, (channels, spatial)
    if y.permute(0, 1, *range(3, y.dim()), 2).is_contiguous():
        return y, (channels, 1)
    return y.contiguous(), (channels, spatial)


def _laid_out_like(t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """t (same shape as y) with y's strides and dtype, copied only if they differ."""
    if t.stride() == y.stride() and t.dtype == y.dtype:
        return t
    return torch.empty_like(y).copy_(t)


def _per_channel_sum(per_neuron: torch.Tensor, channels: tuple[int, int]) -> torch.Tensor:
    """[K, N] per-neuron values → [K, C] sums over the neurons of each channel (one launch)."""
    c, inner = channels
    return per_neuron.view(per_neuron.shape[0], -1, c, inner).sum(dim=(1, 3))


def _bn_pointers(mean: torch.Tensor, invstd: torch.Tensor, weight: torch.Tensor | None,
                 bias: torch.Tensor | None) -> dict[str, int]:  # fmt: skip
    return {
        "bn_mean": mean.data_ptr(),
        "bn_invstd": invstd.data_ptr(),
        "bn_weight": _ptr(weight),
        "bn_bias": _ptr(bias),
    }


def affine_fptt(
    program: NeuronProgram,
    y: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    learnable: torch.Tensor | None,
    constants: list[float],
    v_init: float,
    save_for_backward: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """spikes = neuron(BN(y)) for y [T, B, C, *] in one launch.

    BN(y) = y * scale[c] + shift[c] with scale = invstd * weight, shift = bias - mean * scale
    (weight None: 1, bias None: 0); the vectors are float32 [C]. The neuron starts from the
    constant ``v_init``. Returns the spikes (y's dtype and layout) and, with
    ``save_for_backward``, the chunk checkpoints (see :func:`saved_like`; chunks of
    ``AFFINE_CHUNK[dtype]`` steps).
    """
    _check(y)
    y, channels = channel_layout(y)
    T, N = y.shape[0], y.numel() // y.shape[0]
    spikes = torch.empty_like(y)
    v_ckpt, _ = saved_like(program, y, save_for_backward, AFFINE_CHUNK[y.dtype])
    if N:
        vec = _vec(N, y)
        pointers = {
            "x_seq": y.data_ptr(),
            "spike_seq": spikes.data_ptr(),
            "v_ckpt": _ptr(v_ckpt),
            "learnable": _ptr(learnable),
            **_bn_pointers(mean, invstd, weight, bias),
        }
        kernel = kernel_for(program, y.dtype, vec, affine=True)
        _launch(kernel, True, y.device, _blocks(N, vec), pointers, T, N, [v_init, 0.0],
                constants, channels)  # fmt: skip
    return spikes, v_ckpt


def affine_bptt(
    program: NeuronProgram,
    y: torch.Tensor,
    grad_spikes: torch.Tensor,
    saved_v: torch.Tensor | None,
    learnable: torch.Tensor | None,
    constants: list[float],
    v_init: float,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    totals: torch.Tensor | None = None,
    inv_count: float = 0.0,
    *,
    grad_y: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """BPTT of :func:`affine_fptt` in one launch, recomputing the neuron from y chunk by chunk.

    With g = dL/dX (X = BN(y)), returns ``(dL/dy, sums, grad_learnable)``:

    * ``grad_y=False`` (pass 1): ``sums`` [2, C] float32, the per-channel sums over (T, B, *S)
      of g and of g (y - mean[c]), and dL/d(learnable) [P] (or None); dL/dy is None.
    * ``grad_y=True`` (pass 2): dL/dy in y's dtype and layout, = scale g with running
      statistics (``totals`` None), or with batch statistics BatchNorm's full backward
      scale g + coef_y y + coef_0, coef_y = -scale invstd m_gy invstd, coef_0 = -scale m_g -
      mean coef_y, from ``totals`` [2, C] (pass 1's sums over all processes) times
      ``inv_count`` (m_g, m_gy). The other two are None.
    """
    _check(y)
    y, channels = channel_layout(y)
    T, N = y.shape[0], y.numel() // y.shape[0]
    _check_checkpoints(T, saved_v, AFFINE_CHUNK[y.dtype])
    grad_spikes = _laid_out_like(grad_spikes, y)
    out = torch.empty_like(y) if grad_y else None
    sums = None if grad_y else y.new_empty((2, N), dtype=torch.float32)
    vec = _vec(N, y, grad_spikes, vec=AFFINE_BPTT_VEC)
    blocks = _blocks(N, vec)
    partial = None
    if program.learnable and not grad_y:  # every block writes its column
        shape = (len(program.learnable), blocks)
        partial = y.new_empty(shape, dtype=torch.float32) if N else y.new_zeros(shape)
    if N:
        pointers = {
            "x_seq": y.data_ptr(),
            "v_ckpt": _ptr(saved_v),
            "learnable": _ptr(learnable),
            "grad_spike_seq": grad_spikes.data_ptr(),
            "grad_x_seq": _ptr(out),
            "grad_learnable_partial": _ptr(partial),
            "grad_sum": 0 if sums is None else sums[0].data_ptr(),
            "grad_dot": 0 if sums is None else sums[1].data_ptr(),
            "bn_total_g": 0 if totals is None else totals[0].data_ptr(),
            "bn_total_gy": 0 if totals is None else totals[1].data_ptr(),
            **_bn_pointers(mean, invstd, weight, bias),
        }
        kernel = kernel_for(program, y.dtype, vec, affine=True)
        _launch(kernel, False, y.device, blocks, pointers, T, N, [v_init, 0.0], constants,
                channels, inv_count)  # fmt: skip
    if grad_y:
        return out, None, None
    return None, _per_channel_sum(sums, channels), None if partial is None else partial.sum(dim=1)
