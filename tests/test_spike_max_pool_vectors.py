"""The spike max pool's vector kernels (spikefuse.cuda.spike_max_pool) without a GPU: which
tensors take them (vector_width), and that nvcc turns their accesses into 16-byte loads and
stores. Their results against the scalar kernels: tests/test_spike_max_pool.py (the source run
on the CPU); on the GPU: tests/gpu/test_spike_max_pool_gpu.py."""

from __future__ import annotations

import re
import subprocess

import pytest
import torch

from spikefuse.cuda import spike_max_pool as kernels
from spikefuse.cuda.kernel_spec import NVRTC_OPTIONS
from test_codegen import NVCC, needs_nvcc


def channels_last_zeros(shape, dtype=torch.float32) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype).contiguous(memory_format=torch.channels_last)


def test_vector_width_picks_vectors_only_where_they_fit():
    """VEC (16 bytes of values) for channels-last tensors whose channels, strides and addresses
    allow aligned vectors, else 1 (the scalar kernels)."""
    out, x = channels_last_zeros((2, 16, 3, 3)), channels_last_zeros((2, 16, 6, 5))
    codes = channels_last_zeros((2, 16, 3, 3), torch.uint8)
    width = kernels.vector_width
    assert width(out, x, codes) == width(out, x, None) == 4
    assert width(out.bfloat16(), x.bfloat16(), codes) == width(out.half(), x.half(), None) == 8
    assert width(out, x[..., 1:], codes) == 4  # C elements further: still aligned
    assert width(out, x[:, :, ::2], codes) == 4  # strides still multiples of VEC
    assert width(out[:, :12], x[:, 4:], codes[:, :12]) == 1  # out and codes not dense
    c12 = channels_last_zeros((2, 12, 3, 3))
    assert width(c12, x[:, 4:], None) == 4  # 16 bytes further
    assert width(c12, x[:, 2:14], None) == 1  # 8 bytes further
    assert width(c12.bfloat16(), x[:, 4:].bfloat16(), None) == 1  # C = 12: no 8-wide vectors
    padded = channels_last_zeros((2, 18, 6, 5))[:, :16]  # W stride 18
    assert width(out, padded, codes) == 1
    assert width(out, x.contiguous(), codes) == 1  # NCHW input
    assert width(out.contiguous(), x, codes.contiguous()) == 1  # NCHW output
    shifted = torch.empty(codes.numel() + 1, dtype=torch.uint8)[1:]  # a byte further
    assert width(out, x, shifted.view(2, 3, 3, 16).permute(0, 3, 1, 2)) == 1
    assert width(out, x, codes.contiguous()) == 1  # NCHW codes
    one = torch.zeros(1, 16, 1, 1)  # NCHW and channels-last alike
    assert width(one, one, one.to(torch.uint8)) == 4


def entry_points(ptx: str) -> dict[str, str]:
    """Each kernel's PTX by name."""
    parts = re.split(r"\.entry\s+(\w+)", ptx)[1:]
    return dict(zip(parts[::2], parts[1::2], strict=True))


@needs_nvcc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_vector_kernels_access_memory_in_16_byte_vectors(tmp_path, dtype):
    """The stem's vector kernels (sm_90, NVRTC's options): every value load and store of the
    forward is 16 bytes wide and its codes one VEC-byte store; the backward loads VEC-byte
    code words and 16-byte gradients and stores 16 bytes. The scalar kernels stay scalar."""
    pair = kernels.kernels_for(dtype, (3, 3, 2, 2, 1, 1, 1, 1))
    unit = tmp_path / "pool.cu"
    unit.write_text(pair.source)
    cmd = [NVCC, "-ptx", *NVRTC_OPTIONS, "-arch=sm_90", str(unit), "-o", str(tmp_path / "p.ptx")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    ptx = entry_points((tmp_path / "p.ptx").read_text())
    word = {4: "u32", 8: "u64"}[pair.vec]

    def accesses(backward: bool, vec: int) -> set[str]:
        return set(re.findall(r"\b(?:ld|st)\.global\.[\w.]+", ptx[pair.name(backward, vec)]))

    # per-channel float vectors (a fused block's flip and BatchNorm terms) through the
    # read-only cache: ld.global.nc.f32
    vectors = "ld.global.nc.f32"
    forward, backward = accesses(False, pair.vec), accesses(True, pair.vec)
    assert {a for a in forward if ".v4." not in a} == {f"st.global.{word}", vectors}
    assert {a for a in backward if ".v4." not in a} == {f"ld.global.{word}", vectors}
    for direction in (forward, backward):
        assert {a[:12] for a in direction if ".v4." in a} == {"ld.global.v4", "st.global.v4"}
    assert not any(".v" in a for a in accesses(False, 1) | accesses(True, 1))
    assert vectors in accesses(False, 1) and vectors in accesses(True, 1)
