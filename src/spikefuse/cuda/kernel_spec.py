"""What the neuron kernels, their generator (:mod:`.codegen`) and their launchers share: launch
constants (threads per block, chunk lengths, vector widths, pooling windows), the storage types,
the template's text, and the pointer fields of the kernels' one ``Args`` struct in struct order.

Chunks: forward saves V (and W) in float32 at the end of every chunk of steps; backward
recomputes a chunk's H[t] into registers and walks it backwards, so a chunk's length trades
registers against checkpoint memory (:func:`chunk_steps`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

BLOCK_THREADS = 256
CHUNK = 8  # the longest chunk: steps whose H stays in registers while backward walks them
# Longest chunk of the channel-affine kernels (one neuron per thread in backward). With 16-bit
# storage a float32 checkpoint costs 2/CHUNK of Y's bytes, so they take 12 steps (no checkpoint
# at all for T <= 12): 16 steps' registers held backward to 2 resident blocks per SM, which ran
# both passes slower than 12 steps at 4 blocks. float32 takes 10, which still fits 4 blocks
# and ran faster at T = 10 than chunks of 8 and 2 (see benchmarks/).
AFFINE_CHUNK = {torch.float32: 10, torch.float16: 12, torch.bfloat16: 12}
#: Shorter chunks for short sequences (see :func:`chunk_steps`).
SHORT_CHUNKS = (4, 8)


def chunk_steps(T: int, longest: int) -> int:
    """The chunk length of kernels for T-step sequences: the first of :data:`SHORT_CHUNKS`
    shorter than ``longest`` that holds all T steps, else ``longest``.

    A chunk longer than T holds registers it never uses (a short sequence runs faster with a
    short chunk), and one that holds all T steps needs no checkpoint. Few lengths, so that a
    model compiles few variants.
    """
    return next((c for c in SHORT_CHUNKS if T <= c < longest), longest)


LOAD_STEPS = 8  # forward: steps of input loaded ahead at once (a CHUNK's worth at most)
VEC = 4  # neurons per thread when N and the pointers allow (16-byte fp32 / 8-byte 16-bit access)
# Backward with 16-bit storage is bound by instruction issue, not memory: one neuron per thread
# and more resident blocks ran it fastest (see benchmarks/).
BPTT_VEC = {torch.float32: VEC, torch.float16: 1, torch.bfloat16: 1}
# The channel-affine backward holds 7 more values per neuron (its channel's vectors and sums):
# with VEC = 4 it spills registers, with one neuron per thread it fits in 64. Two neighbouring
# channels per thread (16-bit, channel-tiled) ran no faster on an H200 at T = 4 (SEW-ResNet-18's
# 112² map: 517 µs both ways) and half as fast at T = 8 (two resident blocks instead of four).
AFFINE_BPTT_VEC = 1
# Storage dtypes whose BN-folded backward pass 1 also writes dL/dX, so that pass 2 reads it and
# Y element by element (cuda/affine_grad.cuh) instead of recomputing the neuron: with 16-bit
# storage the recompute is bound by instruction issue, and the element-wise pass by memory at
# the same bytes. float32's recompute already runs near memory bandwidth, and the extra write
# and read of dL/dX would cost it more than the recompute does.
KEEPS_INPUT_GRAD = frozenset((torch.float16, torch.bfloat16))
# Largest index the kernels compute in 32-bit integers (int's maximum).
INDEX32_MAX = 2**31 - 1


def needs_wide_index(T: int, N: int, channels: int = 0) -> bool:
    """Whether kernels over [T, N] need 64-bit indices: whether an index they compute may pass
    :data:`INDEX32_MAX`. The largest are an element t * N + n of a sequence, a thread's first
    neuron past the last one (a block's neurons past N at most), and a channel-tiled
    backward's slot past its last (under 2 N plus 8 rows of ``channels``, the affine kernels'
    channels per step, see affine_plan.bptt_grid; counted here as BLOCK_THREADS rows)."""
    tiled_next_slot = 2 * N + BLOCK_THREADS * channels
    return max(T * N, tiled_next_slot) + BLOCK_THREADS * VEC > INDEX32_MAX


#: Window sizes k of the pooled kernels (k x k average pooling folded in; 1: none).
POOLS = (1, 2)
NVRTC_OPTIONS: tuple[str, ...] = (
    "--std=c++17",
    "--fmad=false",
)  # no FMA contraction: H matches torch's bitwise

#: The loop structure every kernel shares, and the name compiler messages give it.
TEMPLATE_PATH = Path(__file__).with_name("neuron_kernels.cuh")
TEMPLATE_NAME = "spikefuse/cuda/neuron_kernels.cuh"


@functools.cache
def template_source() -> str:
    """The text of ``neuron_kernels.cuh``, read once."""
    return TEMPLATE_PATH.read_text(encoding="utf-8")


@dataclass(frozen=True)
class Storage:
    """How a storage dtype appears in CUDA: its type, header and conversions from/to float."""

    ctype: str
    include: str
    to_float: str
    from_float: str

    def declarations(self) -> list[str]:
        """The prelude lines that define ``scalar_t``, ``to_float`` and ``from_float``."""
        lines = [f"#include <{self.include}>"] if self.include else []
        return [
            *lines,
            f"typedef {self.ctype} scalar_t;",
            "__device__ __forceinline__ float to_float(const scalar_t x) "
            f"{{ return {self.to_float}; }}",
            "__device__ __forceinline__ scalar_t from_float(const float x) "
            f"{{ return {self.from_float}; }}",
        ]


STORAGE = {
    torch.float32: Storage("float", "", "x", "x"),
    torch.float16: Storage("__half", "cuda_fp16.h", "__half2float(x)", "__float2half_rn(x)"),
    torch.bfloat16: Storage(
        "__nv_bfloat16", "cuda_bf16.h", "__bfloat162float(x)", "__float2bfloat16_rn(x)"
    ),
}


@dataclass(frozen=True)
class ArgPointer:
    """A pointer field of ``Args``: C type, name, what it holds (null where optional), and which
    kernels have it: ``plain`` (all neurons), ``two_state`` (plain kernels of two-state
    neurons), ``affine`` (BatchNorm folded in), or ``both`` (plain and affine)."""

    ctype: str
    name: str
    doc: str
    kernels: str  # or "residual": affine kernels that add a residual to X


# In struct order. The affine kernels' x_seq holds Y; their neuron input is X = Y * scale[c] +
# shift[c] with c = (n / inner) % channels. Backward pass 1 writes the per-neuron (or, channel-
# tiled, per-block) sums; pass 2 reads their per-channel totals (divided by the count through
# inv_count) and writes dL/dY.
ARG_POINTERS = (
    ArgPointer("const scalar_t*", "x_seq", "X [T, N]; Y in the affine kernels", "both"),
    ArgPointer("const float*", "v0", "V[-1] [N], or null: every neuron starts at v_init", "plain"),
    ArgPointer(
        "const float*", "w0", "W[-1] [N], or null: every neuron starts at w_init", "two_state"
    ),
    ArgPointer("scalar_t*", "spike_seq", "S [T, N] (pooled: the windows' means)", "both"),
    ArgPointer(
        "unsigned int*",
        "spike_words",
        "pooled: each mean's WINDOW spikes, 1 bit each, or null",
        "affine",
    ),
    ArgPointer(
        "unsigned char*", "spike_nan", "per word of spike_words: a NaN spike in it", "affine"
    ),
    ArgPointer("scalar_t*", "v_seq", "V [T, N], or null", "plain"),
    ArgPointer("float*", "v_last", "V[T-1] [N], or null", "plain"),
    ArgPointer("float*", "w_last", "W[T-1] [N], or null", "two_state"),
    ArgPointer("float*", "v_ckpt", "V at each chunk's end but the last's, or null", "both"),
    ArgPointer("float*", "w_ckpt", "W likewise", "two_state"),
    ArgPointer("const float*", "learnable", "learnable parameter values [P]", "both"),
    ArgPointer("const scalar_t*", "grad_spike_seq", "dL/dS [T, N] (pooled: of means)", "both"),
    ArgPointer("const scalar_t*", "grad_v_seq", "dL/dV [T, N], or null", "plain"),
    ArgPointer("const float*", "grad_v_last", "dL/dV[T-1] [N], or null", "plain"),
    ArgPointer("const float*", "grad_w_last", "dL/dW[T-1] [N], or null", "two_state"),
    ArgPointer("scalar_t*", "grad_x_seq", "dL/dX [T, N] (affine: dL/dY, or null)", "both"),
    ArgPointer("float*", "grad_v0", "dL/dV[-1] [N], or null", "plain"),
    ArgPointer("float*", "grad_w0", "dL/dW[-1] [N], or null", "two_state"),
    ArgPointer("float*", "grad_learnable_partial", "dL/dp per block [P, blocks], or null", "both"),
    ArgPointer("unsigned int*", "blocks_done", "blocks that wrote their partial (zeroed)", "both"),
    ArgPointer("float*", "grad_learnable", "dL/dp [P], from the last block", "both"),
    ArgPointer("const float*", "bn_mean", "[C] per-channel mean of Y", "affine"),
    ArgPointer("const float*", "bn_invstd", "[C] 1 / sqrt(var + eps)", "affine"),
    ArgPointer("const float*", "bn_weight", "[C] gamma, or null (1)", "affine"),
    ArgPointer("const float*", "bn_bias", "[C] beta, or null (0)", "affine"),
    ArgPointer(
        "float*", "grad_sum", "sum of dL/dX per neuron [N] (window, tile), or null", "affine"
    ),
    ArgPointer("float*", "grad_dot", "sum of dL/dX (Y - bn_mean[c]) likewise, or null", "affine"),
    ArgPointer(
        "scalar_t*",
        "grad_input_seq",
        "pass 1: dL/dX [T, N] too (x_step 0: summed over T, [N]), or null",
        "affine",
    ),
    ArgPointer("const float*", "bn_total_g", "[C] channel total of grad_sum, or null", "affine"),
    ArgPointer("const float*", "bn_total_gy", "[C] channel total of grad_dot", "affine"),
    ArgPointer(
        "const scalar_t*", "residual_seq", "R [T, N]: X = Y * scale + shift + R", "residual"
    ),
    ArgPointer(
        "scalar_t*", "grad_residual_seq", "dL/dR = dL/dX [T, N] (pass 2), or null", "residual"
    ),
)
POINTER_NAMES = tuple(f.name for f in ARG_POINTERS)
# Names a parameter may not take: they are Args fields of some kernel.
RESERVED_NAMES = {
    *POINTER_NAMES,
    *("T", "N", "channels", "inner", "channel_tiles", "x_step", "pool_width"),
    *("v_init", "w_init", "inv_count"),
}
