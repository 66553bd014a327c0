"""The BN-folded backward's element-wise pass 2 (spikefuse.cuda.affine_grad) on the CPU: its
launch plans, its Args layout, which calls take it, and that every variant compiles with nvcc
without spills. The GPU runs are in tests/gpu/test_affine_grad_gpu.py."""

from __future__ import annotations

import math
import types

import pytest
import torch

from spikefuse import neuron
from spikefuse.cuda import affine, affine_grad
from spikefuse.cuda.kernel_spec import BLOCK_THREADS, KEEPS_INPUT_GRAD
from spikefuse.cuda.runtime import kernel_for
from spikefuse.fused.ops.bn_neuron.passes import keeps_input_grad
from spikefuse.fused.statistics import BNStats
from test_codegen import NVCC, assert_compiles_without_spills, needs_nvcc

SMS = 132  # an H100's or H200's multiprocessors


@pytest.mark.parametrize("channels", [64, 384, 1000, 24, 5])
def test_plans_walk_whole_rows_of_channels(channels):
    """Past one wave, a thread's stride is a multiple of the channels (its coefficients load
    once); up to one wave, one pack per thread."""
    dtype = torch.bfloat16
    numel = channels * 8 * 1_000_000
    plan = affine_grad._plan(dtype, numel, (channels, 1), True, SMS)
    vec = 8 if channels % 8 == 0 else 1
    assert f"constexpr int VEC = {vec};" in plan.source
    assert f"#define GRAD_KERNEL {affine_grad.KERNEL_NAME}" in plan.source
    needed = -(-numel // (vec * BLOCK_THREADS))
    assert SMS * 8 <= plan.blocks <= needed
    assert plan.blocks * BLOCK_THREADS * vec % channels == 0 or plan.blocks == needed
    small = affine_grad._plan(dtype, channels * 64, (channels, 1), True, SMS)
    assert small.blocks == -(-channels * 64 // (vec * BLOCK_THREADS))


def test_plans_take_one_element_per_thread_where_packs_cannot():
    for layout, numel, vectors in [((64, 9), 64 * 9 * 8, True), ((64, 1), 64 * 8, False)]:
        plan = affine_grad._plan(torch.float16, numel, layout, vectors, SMS)
        assert "constexpr int VEC = 1;" in plan.source
        assert (plan.channels, plan.inner) == layout


@pytest.mark.parametrize("numel", [1 << 20, (1 << 31) - 1])
def test_args_are_packed_as_the_kernel_lays_them_out(numel):
    """8 pointers, three index_t, two floats, padded to the struct's 8-byte alignment."""
    plan = affine_grad._plan(torch.bfloat16, numel, (64, 1), True, SMS)
    wide = "typedef long long index_t;" in plan.source
    assert wide == (numel > 1 << 30)
    index_bytes = 8 if wide else 4
    assert plan.args.size == 8 * 8 + math.ceil((3 * index_bytes + 8) / 8) * 8


def test_16_bit_affine_kernels_and_only_they_keep_the_input_grad():
    lif = neuron.LIFNode().program
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        keeps = dtype in KEEPS_INPUT_GRAD
        assert kernel_for(lif, dtype, 1, True).keeps_input_grad == keeps
        assert f"constexpr bool KEEPS_INPUT_GRAD = {str(keeps).lower()};" in (
            kernel_for(lif, dtype, 1, True).prelude()
        )
        assert not kernel_for(lif, dtype, 1).keeps_input_grad  # plain kernels: no BatchNorm
    assert KEEPS_INPUT_GRAD == {torch.float16, torch.bfloat16}


def _call(keeps: bool) -> types.SimpleNamespace:
    """A neuron call whose BN-folded kernels answer as the cuda backend's (``keeps``) or
    keep nothing."""
    predicate = affine.keeps_input_grad if keeps else (lambda y, residual=None: False)
    return types.SimpleNamespace(affine=types.SimpleNamespace(keeps_input_grad=predicate))


def test_pass_one_keeps_the_input_grad_where_the_element_wise_pass_2_can_take_it():
    y = torch.zeros(4, 2, 8, 3, 3, dtype=torch.bfloat16)
    stats = BNStats(torch.zeros(8), torch.ones(8), None, None, 18)
    repeated = y[:1].expand(4, -1, -1, -1, -1)
    assert keeps_input_grad(y, stats, _call(True), None, False)
    assert keeps_input_grad(repeated, stats, _call(True), None, False)  # g summed over T
    assert keeps_input_grad(y, stats, _call(True), y, False)  # g is dL/dresidual
    assert not keeps_input_grad(repeated, stats, _call(True), repeated, False)
    assert not keeps_input_grad(y, stats, _call(False), None, False)  # float32: recomputed
    assert not keeps_input_grad(y, None, _call(True), None, False)  # no BatchNorm
    assert not keeps_input_grad(y, stats, _call(True), None, True)  # y is overwritten
    assert not keeps_input_grad(y, stats, types.SimpleNamespace(affine=None), None, False)


@needs_nvcc
def test_every_variant_compiles_without_spills(tmp_path):
    sources = [
        affine_grad.source(dtype, vec, wide)
        for dtype in (torch.float32, torch.float16, torch.bfloat16)
        for vec in (1, 16 // dtype.itemsize)
        for wide in (False, True)
    ]
    assert NVCC is not None
    assert_compiles_without_spills(tmp_path, sources, ("GRAD_KERNEL",))
