"""Runtime shared by the cuda backend's launchers: NVRTC compilation through CuPy, caching,
launches, and the per-call checks and helpers of :mod:`.backend` and :mod:`.affine`.

Kernels are compiled once per (program, dtype, vector width, affine) and device: in memory here,
and on disk by CuPy's kernel cache (keyed by source, compiler options and GPU architecture, under
``CUPY_CACHE_DIR``; the source includes the template's text, so editing it recompiles). Launches
go to PyTorch's current stream on the tensor's device through the driver's ``cuLaunchKernel``
with one packed argument struct; the current device is switched only when the tensor lives
elsewhere, and restored. Hot path per call: output allocation, a dict lookup, one
``struct.pack``, one launch; no host sync.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any

import torch

from ..errors import BackendUnavailableError
from ..program import NeuronProgram
from . import unavailable_reason
from .codegen import NeuronKernel
from .definition_kernel import DefinitionKernel
from .kernel_spec import BLOCK_THREADS, NVRTC_OPTIONS

_ALIGN = 16  # bytes: the alignment a vector load or store of VEC elements needs at most


@functools.cache
def _cupy() -> ModuleType:
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
    program: NeuronProgram,
    dtype: torch.dtype,
    vec: int,
    affine: bool = False,
    pool: int = 1,
    residual: bool = False,
    chunk: int | None = None,
    wide_index: bool = False,
) -> NeuronKernel:
    """The generated kernel template of a program (cached; print ``.full_codes`` to read it;
    ``pool``: the pooled variant's window size; ``residual``: the variant adding R to X;
    ``chunk``: steps per backward chunk, default the longest; ``wide_index``: 64-bit indices,
    see :func:`~.kernel_spec.needs_wide_index`)."""
    return DefinitionKernel(program, dtype, vec, affine, pool, residual, chunk, wide_index)


@functools.cache
def _module(source: str) -> Any:  # a cupy.RawModule
    cp = _cupy()
    options = NVRTC_OPTIONS
    include = cp.cuda.get_cuda_path()
    if include:  # fp16/bf16 headers, where NVRTC does not ship them built in
        options += (f"-I{include}/include",)
    return cp.RawModule(code=source, options=options, backend="nvrtc")


def compiled(kernel: NeuronKernel, forward: bool, device_index: int) -> tuple[Any, int]:
    """(CuPy ``RawKernel``, CUfunction handle) of one direction, loaded on a device."""
    name = kernel.fptt_name if forward else kernel.bptt_name
    return compiled_function(kernel.full_codes, name, device_index)


def compiled_function(source: str, name: str, device_index: int) -> tuple[Any, int]:
    """(CuPy ``RawKernel``, CUfunction handle) of kernel ``name`` in ``source``, loaded on a
    device. The handle belongs to that device's context, so it is read with the device current.
    """
    with _cupy().cuda.Device(device_index):
        raw = _module(source).get_function(name)
        return raw, raw.kernel.ptr


def precompile(kernels: list[NeuronKernel], threads: int = 8) -> None:
    """Compile kernels ahead of use, in parallel (NVRTC runs outside the GIL); fills the caches."""
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda k: _module(k.full_codes).compile(), kernels))


# (source, kernel name, device index) -> (RawKernel, CUfunction handle)
_functions: dict[tuple[str, str, int], tuple[Any, int]] = {}
_raw_stream: Callable[[int], int] | None = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_OnePointer = ctypes.c_void_p * 1


@functools.cache
def _driver_launch() -> Callable[..., None]:
    return _cupy().cuda.driver.launchKernel  # cuLaunchKernel


# torch.cuda.current_device() without its lazy-init check (a CUDA tensor exists by now)
_current_device: Callable[[], int] = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)


def _current_stream(index: int) -> int:
    if _raw_stream is not None:
        return _raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream


def launch(
    kernel: NeuronKernel,
    forward: bool,
    device: torch.device,
    blocks: int | tuple[int, int],
    args: bytes,
) -> None:
    """Launch one direction's kernel with its packed ``Args`` struct on the current stream;
    ``blocks``: a count, or a 2-D grid (x, y)."""
    name = kernel.fptt_name if forward else kernel.bptt_name
    x, y = (blocks, 1) if isinstance(blocks, int) else blocks
    launch_named(kernel.full_codes, name, device, (x, y, 1), (BLOCK_THREADS, 1, 1), args)


def launch_named(
    source: str,
    name: str,
    device: torch.device,
    grid: tuple[int, int, int],
    block: tuple[int, int, int],
    args: bytes,
) -> None:
    """Launch kernel ``name`` of ``source`` (compiled and loaded once per device) with its packed
    argument struct on the current stream. The source string is the cache key: its hash is
    computed once (kernels cache their ``full_codes``), so a lookup costs no re-hashing."""
    current = _current_device()
    index = device.index if device.index is not None else current
    entry = _loaded(source, name, index)
    buffer = ctypes.create_string_buffer(args, len(args))
    params = _OnePointer(ctypes.addressof(buffer))  # kernelParams: one pointer, to the struct
    call = (entry[1], *grid, *block, 0, _current_stream(index), ctypes.addressof(params), 0)
    if current == index:
        _launch_in_context(call, index)
    else:  # the function belongs to that device's context
        with torch.cuda.device(index):
            _launch_in_context(call, index)


def load_named(source: str, name: str, device: torch.device) -> None:
    """Compile and load kernel ``name`` of ``source`` on ``device`` without launching it (once:
    later calls are a lookup), for a step whose eager run does not launch it but whose CUDA
    graph capture will, where nothing can be loaded."""
    _loaded(source, name, device.index if device.index is not None else _current_device())


def _loaded(source: str, name: str, index: int) -> tuple[Any, int]:
    """(RawKernel, CUfunction handle) of kernel ``name`` of ``source`` on device ``index``,
    compiled and loaded on first use."""
    key = (source, name, index)
    entry = _functions.get(key)
    if entry is None:
        if torch.cuda.is_current_stream_capturing():  # loading a module is not capturable
            raise BackendUnavailableError(
                f"spikefuse: kernel {name} is not loaded on cuda:{index} yet and cannot be "
                "compiled during CUDA graph capture; run the captured step once eagerly first "
                "(the usual warm-up before torch.cuda.graph)"
            )
        entry = _functions[key] = compiled_function(source, name, index)
    return entry


_CUDA_ERROR_INVALID_CONTEXT = 201


def _launch_in_context(call: tuple, index: int) -> None:
    """``cuLaunchKernel(*call)`` in device ``index``'s primary context. A thread that has made
    no CUDA runtime call yet has no current context (e.g. an autograd worker whose backward
    starts with a spikefuse kernel, as in ``out.sum().backward()`` into a block that unpacks
    its input): the launch fails there, so the device is set, which makes its primary context
    current as the runtime's first call would, and the launch is retried."""
    try:
        _driver_launch()(*call)
    except Exception as exc:  # CuPy's CUDADriverError, which carries the CUresult
        if getattr(exc, "status", None) != _CUDA_ERROR_INVALID_CONTEXT:
            raise
        _cupy().cuda.runtime.setDevice(index)
        _driver_launch()(*call)


def check_input(x: torch.Tensor) -> None:
    """Raise :class:`BackendUnavailableError` naming why the cuda backend cannot run ``x``."""
    reason = unavailable_reason(x)
    if reason is not None:
        raise BackendUnavailableError(f"cuda backend: {reason}")


def aligned(*tensors: torch.Tensor | None) -> bool:
    """Whether every tensor's address allows a vector load or store (16 bytes)."""
    for t in tensors:  # a loop, not any(generator): every forward launch asks
        if t is not None and t.data_ptr() % _ALIGN:
            return False
    return True


def vector_width(n: int, *tensors: torch.Tensor | None, vec: int) -> int:
    """``vec`` neurons per thread where N and every pointer's alignment allow, else 1."""
    return vec if n % vec == 0 and aligned(*tensors) else 1


def checkpoints_like(
    program: NeuronProgram, x_seq: torch.Tensor, save: bool, chunk: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Uninitialised tensors shaped like what forward saves: V (and W) at the end of every chunk
    of ``chunk`` steps but the last, float32 (None when not saving or T <= chunk: backward starts
    from V[-1])."""
    if not save or x_seq.shape[0] <= chunk:
        return None, None
    shape = ((x_seq.shape[0] + chunk - 1) // chunk - 1, *x_seq.shape[1:])
    v = x_seq.new_empty(shape, dtype=torch.float32)
    return v, (x_seq.new_empty(shape, dtype=torch.float32) if program.definition.adaptive else None)


def check_checkpoints(T: int, saved_v: torch.Tensor | None, chunk: int) -> None:
    if T > chunk and (saved_v is None or saved_v.shape[0] != (T + chunk - 1) // chunk - 1):
        raise RuntimeError("spikefuse cuda bptt: the forward's chunk checkpoints are missing")


def pointer(t: torch.Tensor | None) -> int:
    """The device address of ``t``, or null for None or an empty tensor."""
    return 0 if t is None or t.numel() == 0 else t.data_ptr()


def learnable_grad_buffers(
    program: NeuronProgram, learnable: torch.Tensor | None, blocks: int
) -> tuple[torch.Tensor | None, dict[str, int]]:
    """The learnable parameters' gradient of one backward launch of ``blocks`` blocks (in
    ``learnable``'s shape, float32; zeros if ``blocks`` is 0, i.e. nothing is launched) and the
    kernel's pointers for it: each block writes its partial sums, counts itself in a counter
    after them, and the last block sums the partials into the gradient (see
    ``sum_learnable_grads`` in neuron_kernels.cuh). (None, {}) without learnable parameters.

    The partials and the counter lie in the gradient's own buffer, after it (zeroed in one
    fill): the gradient the caller holds keeps them alive until the launch. A separate
    temporary would go back to the allocator on return, and an allocation made before the
    launch (a contiguous copy of a state's gradient) could take its memory and overwrite the
    counter, so that no block would sum the partials."""
    if not program.learnable or learnable is None:
        return None, {}
    P = len(program.learnable)
    if not blocks:
        return learnable.new_zeros(learnable.shape, dtype=torch.float32), {}
    n = learnable.numel()
    buffer = learnable.new_zeros(n + P * blocks + 1, dtype=torch.float32)  # + the counter
    start = buffer.data_ptr()
    pointers = {
        "grad_learnable": start,
        "grad_learnable_partial": start + 4 * n,
        "blocks_done": start + 4 * (n + P * blocks),
    }
    return buffer[:n].view(learnable.shape), pointers


def blocks_for(n: int, vec: int) -> int:
    """Thread blocks covering n neurons at vec per thread (at least one)."""
    return max(1, -(-n // (vec * BLOCK_THREADS)))
