"""The heads-chain kernels (``spikefuse/cuda/spike_attention.cuh``) on the CPU: their source
compiled by g++ and run one thread per block (the kernels step by ``blockDim.x``, so one thread
does every thread's share and ``__syncthreads`` has nothing to wait for), through the autograd
Function, against the torch reference; and compiled by nvcc without spills. Concurrency itself
is covered by the GPU check (``tests/gpu/test_spike_matmul_gpu.py``)."""

from __future__ import annotations

import pytest
import torch

from spikefuse.cuda import spike_attention as kernels
from spikefuse.spike_matmul import autograd as sm_autograd
from spikefuse.spike_matmul import spike_matmul_chain_heads, spike_matmul_chain_heads_naive
from test_codegen import assert_compiles_without_spills, needs_nvcc
from test_spike_max_pool import emulation_compiler

EMULATION = r"""
#include <cmath>
#include <cstdint>
#include <cstring>
struct Dim3 { int x, y, z; };
static Dim3 threadIdx, blockIdx, blockDim;
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
template <typename T> inline T __ldg(const T* p) { return *p; }
#define __align__(n) __attribute__((aligned(n)))
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __syncthreads()
#include KERNEL_SOURCE

extern "C" int args_size() { return sizeof(Args); }

extern "C" void launch(int backward, const void* packed, int blocks)
{
    Args a;
    std::memcpy(&a, packed, sizeof(Args));
    blockDim = {1, 1, 1};
    threadIdx = {0, 0, 0};
    for (int b = 0; b < blocks; ++b) {
        blockIdx = {b, 0, 0};
        if (backward) BACKWARD_KERNEL(a);
        else FORWARD_KERNEL(a);
    }
}
"""


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """A ``launch_named`` stand-in running the kernels' source on the CPU."""
    library = emulation_compiler(
        tmp_path_factory, "heads_chain_emulation", EMULATION, kernels.ARGS.size
    )

    def launch_named(source, name, device, grid, block, args):
        assert block == (256, 1, 1) and grid[1:] == (1, 1) and len(args) == kernels.ARGS.size
        library(source).launch(int("_backward_" in name), args, grid[0])

    return launch_named


@pytest.fixture
def on_kernels(emulated, monkeypatch):
    """The autograd Function on the emulated kernels (CPU tensors: their addresses are the
    host's)."""
    monkeypatch.setattr(kernels, "launch_named", emulated)
    monkeypatch.setattr(sm_autograd, "capability", lambda name, t: kernels)


def qkv_spikes(lead, heads, d, tokens, dtype, layout, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = (torch.rand(*lead, tokens, 3 * heads * d, generator=g) < 0.4).to(dtype)
    qkv = rows.transpose(-2, -1)  # [..., 3C, L], channels innermost (a fused block's spikes)
    if layout == "contiguous":
        qkv = qkv.contiguous()
    elif layout == "strided":  # every other row of a larger tensor
        qkv = torch.cat([qkv, qkv], dim=0)[::2]
    return qkv.requires_grad_()


def strides(t: torch.Tensor) -> list[int]:
    """The strides of t's dimensions of more than one element (the layout; others never step)."""
    return [s for s, n in zip(t.stride(), t.shape, strict=True) if n > 1]


SHAPES = [  # (lead, heads, channels per head, tokens): whole and partial tiles, both tile sizes
    ((2, 3), 2, 4, 9),
    ((2, 1), 3, 32, 64),
    ((1, 2), 2, 32, 37),
    ((2,), 1, 40, 23),
    ((1, 1), 2, 64, 33),
    ((1, 1), 2, 64, 196),
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("layout", ["channels-innermost", "contiguous", "strided"])
def test_the_kernels_equal_the_reference_in_float32(on_kernels, shape, layout):
    """Values bit for bit (integer sums, then the scale), in the channels-innermost layout;
    dL/dqkv within float32 rounding, in qkv's layout."""
    lead, heads, d, tokens = shape
    qkv = qkv_spikes(lead, heads, d, tokens, torch.float32, layout)
    out = spike_matmul_chain_heads(qkv, heads, 0.125)
    want = spike_matmul_chain_heads_naive(qkv, heads, 0.125)
    assert torch.equal(out, want)
    assert out.stride(-2) == 1 and out.stride(-1) == heads * d  # channels innermost
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (got,) = torch.autograd.grad(out, qkv, g)
    (ref,) = torch.autograd.grad(want, qkv, g)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    if layout != "strided":
        assert strides(got) == strides(qkv)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_kernels_round_once_in_16_bit_storage(on_kernels, dtype):
    """16-bit spikes: forward rounds the exact float32 value once; backward sums in float32."""
    qkv = qkv_spikes((2, 2), 2, 32, 40, dtype, "channels-innermost")
    out = spike_matmul_chain_heads(qkv, 2, 0.3)
    exact = spike_matmul_chain_heads_naive(qkv.detach().double(), 2, 0.3)
    assert out.dtype == dtype and torch.equal(out, exact.to(dtype))
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    (got,) = torch.autograd.grad(out, qkv, g)
    double = qkv.detach().double().requires_grad_()
    (ref,) = torch.autograd.grad(spike_matmul_chain_heads_naive(double, 2, 0.3), double, g.double())
    torch.testing.assert_close(got.double(), ref, rtol=1e-2, atol=1e-2)


def test_heads_the_kernels_cannot_run_take_the_matmuls():
    """Wider heads than the kernels' shared memory holds, or sums past 2^24, are named."""
    assert kernels.unsupported(64, 196) is None
    assert "exceed the kernels' 64" in kernels.unsupported(96, 64)
    assert "2^24" in kernels.unsupported(64, 2**18 + 1)
    assert "multiples of 4" in kernels.unsupported(30, 64)


@needs_nvcc
def test_every_heads_chain_kernel_compiles_with_nvcc(tmp_path):
    """Every storage dtype and both tile sizes compile for sm_80 and sm_90 without spills."""
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    sources = [kernels.source(dt, d)[0] for dt in dtypes for d in (32, 64)]
    assert_compiles_without_spills(tmp_path, sources, ("FORWARD_KERNEL", "BACKWARD_KERNEL"))
