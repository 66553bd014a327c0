"""Spikformer's self-attention product on the GPU: the ``heads_chain`` capability's kernels.

:func:`heads_chain_forward` writes ``s (V Kᵀ) Q`` of every head of a qkv spike tensor and
:func:`heads_chain_backward` the gradient of qkv, one kernel each, a block per (row, head) with
the head's [D, D] counts in shared memory (``spike_attention.cuh`` next to this file says how;
:mod:`spikefuse.spike_matmul` computes the same with torch matmuls). Per head, forward reads v
and k once for the counts and q once, and writes the output once; backward reads the saved
spikes (a byte each) and dL/dout twice each and writes dL/dqkv once. Where the tensors lie
channels innermost, every access of a warp is contiguous.

Compiled once per storage dtype, head size and device with NVRTC through :mod:`.runtime`,
launched on PyTorch's current stream, no host sync: CUDA-graph capturable once loaded.
"""

from __future__ import annotations

import functools
import struct
from pathlib import Path

import torch

from .kernel_spec import BLOCK_THREADS, STORAGE
from .runtime import launch_named

SOURCE_PATH = Path(__file__).with_name("spike_attention.cuh")
SOURCE_NAME = "spikefuse/cuda/spike_attention.cuh"

#: The kernels' one argument, ``Args`` in spike_attention.cuh: five pointers, three sets of
#: three strides (row, channel, token), heads, tokens, scale, and the padding to its 8-byte
#: alignment (the launch reads the struct's whole size).
ARGS = struct.Struct("=5Q9q2if4x")
#: The largest head the kernels take: backward's two [D, D] matrices and tiles fit the 48 KiB
#: of shared memory a block has without opting in.
MAX_HEAD_DIM = 64
#: The most channels × tokens of a head: every sum stays an integer float32 holds exactly.
MAX_SUM = 2**24


def tile_tokens(head_dim: int) -> int:
    """Tokens per shared-memory tile: 64 (Spikformer's CIFAR heads, 32 channels over 64 tokens,
    in one tile), or 16 for heads of more than 32 channels (backward's two [D, D + 1] matrices
    and three [D, TILE + 4] tiles within 48 KiB)."""
    return 64 if head_dim <= 32 else 16


def unsupported(head_dim: int, tokens: int) -> str | None:
    """Why the kernels cannot run heads of ``head_dim`` channels over ``tokens``, or None."""
    if head_dim % 4:
        return f"heads of {head_dim} channels: the kernels take multiples of 4"
    if head_dim > MAX_HEAD_DIM:
        return f"heads of {head_dim} channels exceed the kernels' {MAX_HEAD_DIM}"
    if head_dim * tokens > MAX_SUM:
        return f"{head_dim} channels x {tokens} tokens exceed 2^24, what float32 sums exactly"
    return None


def _kernel_name(tag: str, backward: bool) -> str:
    return f"spikefuse_heads_chain_{'backward' if backward else 'forward'}_{tag}"


@functools.cache
def source(dtype: torch.dtype, head_dim: int) -> tuple[str, str]:
    """(the prelude, then ``spike_attention.cuh``; the tag of its kernels' names) of a storage
    dtype (float32, float16, bfloat16) and head size."""
    storage = STORAGE[dtype]
    tag = f"{storage.ctype.strip('_')}_d{head_dim}"
    prelude = "\n".join(
        [
            f"// spikefuse heads chain: {storage.ctype} storage, {head_dim} channels per head",
            *storage.declarations(),
            f"constexpr int BLOCK_THREADS = {BLOCK_THREADS};",
            f"constexpr int D = {head_dim};",
            f"constexpr int TILE = {tile_tokens(head_dim)};",
            f"#define FORWARD_KERNEL {_kernel_name(tag, False)}",
            f"#define BACKWARD_KERNEL {_kernel_name(tag, True)}",
        ]
    )
    template = SOURCE_PATH.read_text(encoding="utf-8")
    return f'{prelude}\n#line 1 "{SOURCE_NAME}"\n{template}', tag


def _launch(backward: bool, like: torch.Tensor, out_shape: torch.Size, heads: int, args: bytes):
    """Launch a block per (row, head) of ``out_shape`` [R, C, L] (``like``'s dtype, device)."""
    rows, channels, _ = out_shape
    if rows * heads == 0:
        return
    code, tag = source(like.dtype, channels // heads)
    grid = (rows * heads, 1, 1)
    launch_named(code, _kernel_name(tag, backward), like.device, grid, (BLOCK_THREADS, 1, 1), args)


def _check(qkv: torch.Tensor, out: torch.Tensor, heads: int) -> None:
    rows, channels, tokens = out.shape
    if qkv.shape != (rows, 3 * channels, tokens) or channels % heads:
        raise ValueError(
            f"spikefuse heads chain: qkv {tuple(qkv.shape)} and out {tuple(out.shape)} are not "
            f"[R, 3C, L] and [R, C, L] with C a multiple of {heads} heads"
        )
    reason = unsupported(channels // heads, tokens)
    if reason is not None:
        raise ValueError(f"spikefuse heads chain: {reason}")


def heads_chain_forward(qkv: torch.Tensor, out: torch.Tensor, heads: int, scale: float) -> None:
    """Write ``scale (V Kᵀ) Q`` of each of ``heads`` heads into ``out`` [R, C, L] (qkv's dtype,
    any strides) from spikes ``qkv`` [R, 3C, L] (CUDA, float32/float16/bfloat16, any strides)."""
    _check(qkv, out, heads)
    pointers = (qkv.data_ptr(), 0, 0, out.data_ptr(), 0)
    strides = (*qkv.stride(), *out.stride(), 0, 0, 0)
    args = ARGS.pack(*pointers, *strides, heads, out.shape[2], scale)
    _launch(False, qkv, out.shape, heads, args)


def heads_chain_backward(
    grad: torch.Tensor, spikes: torch.Tensor, grad_qkv: torch.Tensor, heads: int, scale: float
) -> None:
    """Write dL/dqkv into ``grad_qkv`` [R, 3C, L] (grad's dtype, any strides) from dL/dout
    ``grad`` [R, C, L] (any strides) and the forward's spikes as ``torch.bool`` [R, 3C, L]."""
    _check(spikes, grad, heads)
    if spikes.dtype != torch.bool or grad_qkv.shape != spikes.shape or grad_qkv.dtype != grad.dtype:
        raise ValueError("spikefuse heads chain: spikes must be bool, dL/dqkv shaped like them")
    pointers = (0, spikes.data_ptr(), grad.data_ptr(), 0, grad_qkv.data_ptr())
    strides = (*spikes.stride(), *grad.stride(), *grad_qkv.stride())
    args = ARGS.pack(*pointers, *strides, heads, grad.shape[2], scale)
    _launch(True, grad, grad.shape, heads, args)
