"""Code generation: every kernel variant compiles with nvcc (sm_80 and sm_90), source is readable
(the checked-in template plus a generated prelude), the argument structs match the packed bytes,
and the hand-written-snippet extension path works. GPU execution is checked by
tests/gpu (``pytest -m gpu`` on a GPU machine)."""

from __future__ import annotations

import ctypes
import itertools
import re
import shutil
import struct
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from spikefuse import NeuronDef, backends, neuron, surrogate
from spikefuse import definitions as defs
from spikefuse.cuda import affine, affine_plan, backend
from spikefuse.cuda.codegen import NeuronKernel
from spikefuse.cuda.definition_kernel import DefinitionKernel
from spikefuse.cuda.kernel_spec import (
    BLOCK_THREADS,
    NVRTC_OPTIONS,
    TEMPLATE_NAME,
    TEMPLATE_PATH,
    VEC,
    chunk_steps,
)
from spikefuse.cuda.printer import cuda_body
from spikefuse.program import NeuronProgram

NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH: compile test not run")


def assert_compiles_without_spills(
    tmp_path: Path, sources: list[str], macros: tuple[str, ...]
) -> None:
    """One translation unit of kernel sources (each prelude + template, in its own namespace,
    its ``macros`` undefined after it) compiles for sm_80 and sm_90, optimised as NVRTC
    compiles it, without spilling registers (a spill in a streaming loop costs bandwidth)."""
    parts = ["#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n"]
    undefine = "".join(f"#undef {m}\n" for m in macros)  # each prelude defines them
    for i, source in enumerate(sources):
        body = source.replace('extern "C" ', "")
        parts.append(f"namespace variant{i} {{\n{body}\n}}\n{undefine}")
    unit = tmp_path / "variants.cu"
    unit.write_text("".join(parts))
    for arch in ("80", "90"):
        cmd = [NVCC, "-c", *NVRTC_OPTIONS, f"-arch=sm_{arch}", "-Xptxas", "-v", str(unit)]
        r = subprocess.run(
            [*cmd, "-o", str(tmp_path / f"{arch}.o")], capture_output=True, text=True, timeout=600
        )
        assert r.returncode == 0, f"sm_{arch}: {r.stderr[-3000:]}"
        spills = re.findall(r"(\d+) bytes spill stores", r.stderr)
        assert spills and all(s == "0" for s in spills), f"sm_{arch} spills registers: {r.stderr}"


DTYPES = (torch.float32, torch.float16, torch.bfloat16)
NODES = (
    neuron.IFNode,
    neuron.LIFNode,
    lambda **k: neuron.LIFNode(decay_input=False, **k),
    neuron.ParametricLIFNode,
    lambda **k: neuron.ParametricLIFNode(decay_input=False, **k),
    neuron.QIFNode,
    neuron.EIFNode,
    neuron.IzhikevichNode,
)


def all_variants() -> list[NeuronKernel]:
    """Every neuron, surrogate, dtype and reset at both vector widths; and the channel-affine
    (BatchNorm-folded) kernels of every one-state neuron, dtype and reset, unpooled at both
    widths and with 2 x 2 average pooling folded in (vec 1); and the residual affine kernels
    (their own lines of the template do not depend on the neuron) of LIF and PLIF."""
    kernels = []
    for make, sur, dtype, hard, detach in itertools.product(
        NODES, surrogate.ALL, DTYPES, (True, False), (True, False)
    ):
        node = make(surrogate_function=sur(), v_reset=0.0 if hard else None, detach_reset=detach)
        kernels += [DefinitionKernel(node.program, dtype, vec) for vec in (1, VEC)]
        if sur is surrogate.Rect and not node.definition.adaptive:
            kernels += [DefinitionKernel(node.program, dtype, vec, affine=True) for vec in (1, VEC)]
            kernels.append(DefinitionKernel(node.program, dtype, 1, affine=True, pool=2))
            if make in (neuron.LIFNode, neuron.ParametricLIFNode):
                kernels += [
                    DefinitionKernel(node.program, dtype, vec, affine=True, residual=True)
                    for vec in (1, VEC)
                ]
    return kernels


def translation_unit(kernels: list[NeuronKernel]) -> str:
    """All variants in one file: each in its own namespace, with C++ (not extern "C") linkage so
    that equal kernel names in different namespaces do not clash. The fp16/bf16 headers are
    included first, at global scope (their include guards make the per-variant includes no-ops)."""
    parts = ["#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n"]
    for i, k in enumerate(kernels):
        body = k.full_codes.replace('extern "C" ', "")
        # each prelude names itself: after a variant's template, lines would count on in it
        parts.append(
            f'namespace variant{i} {{\n#line 1 "variant{i}: {k.kernel_prefix}"\n{body}\n}}\n'
        )
    return "".join(parts)


def sample_variants() -> list[NeuronKernel]:
    """A sample of :func:`all_variants` in which every neuron, surrogate, dtype, reset, detach
    choice and vector width occurs at least once, and each kind of channel-affine kernel
    (unpooled at both widths, pooled, residual) once: what a change to the template or the
    printer most likely breaks, compiled in seconds instead of the full set's half hour. Plus
    a plain, a pooled and a residual kernel with 64-bit indices, which the full set leaves out
    (launchers take them for calls past 32-bit indices; the index type is one typedef)."""
    kernels = []
    for i in range(max(len(NODES), len(surrogate.ALL))):
        node = NODES[i % len(NODES)](
            surrogate_function=surrogate.ALL[i % len(surrogate.ALL)](),
            v_reset=0.0 if i % 2 else None,
            detach_reset=bool(i // 2 % 2),
        )
        kernels.append(DefinitionKernel(node.program, DTYPES[i % 3], (1, VEC)[i // 4 % 2]))
    lif = neuron.LIFNode(surrogate_function=surrogate.Rect(), v_reset=None).program
    plif = neuron.ParametricLIFNode(surrogate_function=surrogate.Rect()).program
    kernels += [
        DefinitionKernel(lif, torch.float16, 1, affine=True),
        DefinitionKernel(plif, torch.float32, VEC, affine=True),
        DefinitionKernel(lif, torch.bfloat16, 1, affine=True, pool=2),
        DefinitionKernel(plif, torch.float16, VEC, affine=True, residual=True),
        DefinitionKernel(plif, torch.float32, VEC, wide_index=True),
        DefinitionKernel(lif, torch.bfloat16, 1, affine=True, pool=2, wide_index=True),
        DefinitionKernel(plif, torch.float16, 1, affine=True, residual=True, wide_index=True),
    ]
    return kernels


def compile_unoptimised(tmp_path: Path, kernels: list[NeuronKernel]) -> None:
    """The kernels, as one translation unit, compile for sm_80 and sm_90 (in parallel).

    Unoptimised: this checks that every variant is valid CUDA that compiles to SASS;
    optimisation only costs time here (the GPU check compiles optimised, with NVRTC)."""
    source = tmp_path / "variants.cu"
    source.write_text(translation_unit(kernels))

    def compile_for(arch: str) -> subprocess.CompletedProcess:
        unoptimised = ["-Xcicc", "-O0", "-Xptxas", "-O0"]
        output = str(tmp_path / f"{arch}.o")
        cmd = [NVCC, "-c", *NVRTC_OPTIONS, *unoptimised, f"-arch=sm_{arch}", "-o", output]
        return subprocess.run([*cmd, str(source)], capture_output=True, text=True, timeout=3600)

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(compile_for, ("80", "90")))
    for arch, r in zip(("80", "90"), results, strict=True):
        errors = [line for line in r.stderr.splitlines() if "error" in line]
        assert r.returncode == 0, f"sm_{arch}: " + "\n".join(errors[:20])
        assert (tmp_path / f"{arch}.o").stat().st_size > 0


@pytest.mark.slow
@needs_nvcc
def test_every_variant_compiles_with_nvcc(tmp_path):
    kernels = all_variants()
    # 8 neurons x every surrogate x 3 dtypes x 2 resets x 2 detach, scalar and vector width;
    # affine: 7 one-state neurons x 3 dtypes x 2 resets x 2 detach x (2 widths + pooled);
    # residual: 2 neurons x 3 dtypes x 2 resets x 2 detach x 2 widths
    assert len(kernels) == 8 * len(surrogate.ALL) * 3 * 2 * 2 * 2 + 7 * 3 * 2 * 2 * 3 + 48
    compile_unoptimised(tmp_path, kernels)


def test_the_sample_covers_every_choice_of_the_full_set():
    """Every value each kernel choice takes in :func:`all_variants` occurs in the sample."""
    sample = sample_variants()
    both = (False, True)
    full = {
        "name": {make().program.definition.name for make in NODES},
        "surrogate": {sur.__name__ for sur in surrogate.ALL},
        "dtype": set(DTYPES),
        "vec": {1, VEC},
        "hard_reset": set(both),
        "detach_reset": set(both),
        "affine": set(both),
        "pool": {1, 2},
        "residual": set(both),
    }
    for attribute, values in full.items():
        got = {
            type(k.surrogate).__name__ if attribute == "surrogate" else getattr(k, attribute)
            for k in sample
        }
        assert got == values, attribute


@needs_nvcc
def test_a_sample_of_variants_compiles_with_nvcc(tmp_path):
    """:func:`sample_variants` compiles (the full set: the slow test above)."""
    compile_unoptimised(tmp_path, sample_variants())


def test_generated_source_is_printable_and_names_the_variant():
    node = neuron.ParametricLIFNode(surrogate_function=surrogate.ATan(), v_reset=None)
    kernel = DefinitionKernel(node.program, torch.bfloat16, VEC)
    code = kernel.full_codes
    assert kernel.fptt_name in code and kernel.bptt_name in code
    assert (
        "plif" in kernel.fptt_name and "soft" in kernel.fptt_name and "bfloat16" in kernel.fptt_name
    )
    assert "p.decay_logit = a.learnable[0];" in code  # the logit, read from the device array
    # the tau gradient is reduced deterministically: the one atomic counts the finished blocks
    assert code.count("atomicAdd") == 1 and "atomicAdd(a.blocks_done, 1u)" in code
    assert code.count("__global__") == 2
    # backward recomputes H with the forward's own step function
    assert code.count("= step(") == 2


def _struct_fields(code: str) -> list[tuple[str, str]]:
    """(C type, name) of every field of the generated ``struct Args``, in order."""
    body = code.split("struct Args {")[1].split("};")[0]
    fields = []
    for line in body.strip().splitlines():
        declaration = line.split("//")[0].strip().rstrip(";")
        ctype, names = re.fullmatch(r"(.*?[\s*])(\w+(?:, \w+)*)", declaration).groups()
        fields += [(ctype.strip(), name) for name in names.split(", ")]
    return fields


_FORMAT = {"float": "f"}  # any pointer: "Q"; index_t: "i" or, in 64-bit kernels, "q"


@pytest.mark.parametrize(
    "make, affine, residual",
    [
        (neuron.IzhikevichNode, False, False),
        (neuron.LIFNode, False, False),
        (neuron.ParametricLIFNode, True, False),
        (neuron.ParametricLIFNode, True, True),
    ],
)
@pytest.mark.parametrize("wide_index", [False, True], ids=["int32", "int64"])
def test_argument_struct_matches_the_packed_bytes(make, affine, residual, wide_index):
    """The Python packing and the generated struct agree on every field's order and size, for
    plain kernels of two-state and one-state neurons and for the channel-affine kernels (also
    the residual ones), with 32-bit and 64-bit indices."""
    kernel = DefinitionKernel(
        make().program, torch.float32, VEC, affine=affine, residual=residual, wide_index=wide_index
    )
    index = "long long" if wide_index else "int"
    assert f"typedef {index} index_t;" in kernel.full_codes
    assert kernel.fptt_name.endswith("_v4_i64_fptt" if wide_index else "_v4_fptt")
    fields = _struct_fields(kernel.full_codes)
    formats = {**_FORMAT, "index_t": "q" if wide_index else "i"}
    codes = "".join("Q" if ctype.endswith("*") else formats[ctype] for ctype, _ in fields)
    layout = struct.Struct("<" + codes)
    layout = struct.Struct("<" + codes + f"{-layout.size % 8}x")  # padded to 8 bytes
    pointers = {f.name: 1000 + i for i, f in enumerate(kernel.pointers)}
    constants = [1.5 + i for i in range(len(kernel.constant_names))]
    packed = kernel.pack_args(
        pointers, 3, 5, 0.5, 0.25, constants, (6, 8), inv_count=0.125, channel_tiles=7, x_step=0
    )
    assert len(packed) == layout.size
    values = dict(zip([name for _, name in fields], layout.unpack(packed), strict=True))
    expected = {**pointers, "T": 3, "N": 5, "v_init": 0.5}
    expected |= dict(zip(kernel.constant_names, constants, strict=True))
    if kernel.adaptive:
        expected["w_init"] = 0.25
    if affine:
        expected |= {"channels": 6, "inner": 8, "inv_count": 0.125, "channel_tiles": 7}
        if kernel.pool == 1:
            expected["x_step"] = 0  # a Y repeated over time (None: N)
    assert values == expected


@pytest.mark.parametrize(
    "rows, channels, inner",
    [
        (1, 32, 1),
        (9, 64, 1),
        (17, 96, 1),
        (640 * 4, 512, 1),
        (140_001, 32, 1),
        (5, 10, 1),
        (4, 32, 16),
    ],
)
def test_backward_channel_tiles_cover_every_neuron_once(rows, channels, inner):
    """The backward's thread -> neuron map (the template's bptt_first_neuron and
    bptt_next_slot, replayed here) gives every neuron to exactly one thread, and pass 1's
    block_channel_sums writes each block's sums where _per_channel_sum reads that channel: the
    per-channel totals equal per-neuron ones."""
    n = rows * channels * inner
    tiles, (grid_x, grid_y), per_sum = affine_plan.bptt_grid(n, (channels, inner), vec=1)
    values = torch.rand(n, dtype=torch.float64)
    expected = affine.per_channel_sum(values[None], (channels, inner))
    block_x, block_y, thread = torch.meshgrid(
        torch.arange(grid_x), torch.arange(grid_y), torch.arange(BLOCK_THREADS), indexing="ij"
    )
    if not tiles:  # consecutive threads own consecutive neurons, each writing its own sum
        assert (channels % 32 or inner != 1) and per_sum == n and grid_y == 1
        owned = (block_x * BLOCK_THREADS + thread).flatten()
        assert torch.equal(owned[owned < n], torch.arange(n))
        return
    assert (
        tiles == channels // 32 == grid_x
    )  # block (x, y): channel tile x, row groups y + k grid_y
    walks = -(-rows // (affine_plan.TILE_ROWS * grid_y))
    assert walks <= affine_plan.GROUPS_PER_BLOCK
    row = (block_y + grid_y * torch.arange(walks)[:, None, None, None]) * affine_plan.TILE_ROWS
    row = row + thread // 32
    channel = (block_x * 32 + thread % 32).expand_as(row)
    neuron_of = row * channels + channel
    owns = row * channels < n
    assert torch.equal(neuron_of[owns].sort().values, torch.arange(n))
    out = (block_y * channels + channel)[owns]
    assert out.max() < per_sum
    partial = torch.zeros(per_sum, dtype=torch.float64).index_add_(0, out, values[neuron_of[owns]])
    assert torch.allclose(affine.per_channel_sum(partial[None], (channels, inner)), expected)


def test_backward_blocks_walk_few_row_groups_and_keep_the_gpu_busy():
    """A block walks at most GROUPS_PER_BLOCK row groups, fewer where the grid would otherwise
    have fewer than GRID_BLOCKS blocks (a small map keeps one group per block)."""
    groups = affine_plan.GROUPS_PER_BLOCK * affine_plan.GRID_BLOCKS * 4
    _, (_, grid_y), _ = affine_plan.bptt_grid(groups * affine_plan.TILE_ROWS * 32, (32, 1), 1)
    assert grid_y == groups // affine_plan.GROUPS_PER_BLOCK
    _, (grid_x, grid_y), _ = affine_plan.bptt_grid(784 * affine_plan.TILE_ROWS * 512, (512, 1), 1)
    assert grid_x * grid_y == affine_plan.GRID_BLOCKS  # 784 groups over 128 rows of blocks
    assert affine_plan.bptt_grid(9 * 64, (64, 1), 1)[1] == (2, 2)


def test_kernels_index_in_32_bits_unless_a_call_may_pass_them():
    """Indices stay 32-bit up to the largest [T, N] whose indices fit, counting a thread's
    neurons past N and a channel-tiled backward's slot past the last one; the launch plans of
    larger maps take the 64-bit variant."""
    from spikefuse.cuda.kernel_spec import BLOCK_THREADS as THREADS
    from spikefuse.cuda.kernel_spec import INDEX32_MAX, needs_wide_index

    fits = (INDEX32_MAX - THREADS * VEC) // 4
    assert not needs_wide_index(4, fits) and needs_wide_index(4, fits + 1)
    assert not needs_wide_index(1, 2**29) and needs_wide_index(1, 2**30)  # 2 N: next slot
    assert needs_wide_index(2, 2**29, channels=2**22)  # rows of channels past 2 N
    small = torch.empty(4, 32, 64, 56, 56, device="meta")
    huge = torch.empty(4, 256, 64, 224, 224, device="meta")  # 822 M neurons per step
    for y, wide in ((small, False), (huge, True)):
        for forward in (True, False):
            assert _plan_of(y, forward=forward).kernel.wide_index is wide


def test_backward_grid_stays_within_cuda_grid_rows():
    """More rows of blocks than a grid's 65535: one row of blocks, every neuron its own sums."""
    rows = affine_plan.TILE_ROWS * affine_plan.GROUPS_PER_BLOCK * affine_plan.MAX_GRID_ROWS
    assert affine_plan.bptt_grid(rows * 32, (32, 1), vec=1)[:2] == (
        1,
        (1, affine_plan.MAX_GRID_ROWS),
    )
    n = (rows + affine_plan.TILE_ROWS) * 32
    assert affine_plan.bptt_grid(n, (32, 1), vec=1) == (0, (affine_plan.blocks_for(n, 1), 1), n)


def test_parameter_only_derivatives_are_computed_once_per_thread():
    """LIF's dH/dV depends on tau only: load_params computes it, the device function returns
    it (the unrolled backward could not share one computation between its conditional steps);
    QIF's depends on V and stays a function of the step. The backward's exp and division are
    the fast ones."""
    lif = DefinitionKernel(neuron.LIFNode(tau=2.0).program, torch.float32)
    assert lif.constant_derivatives() == ("dh_dx", "dh_dv")
    code = lif.full_codes
    assert "p.dh_dv = constant_dh_dv(p);" in code
    body = code.split("\ndh_dv(const float v, const float x, const float w, const float h")[1]
    assert body.split("\n}")[0].endswith("return p.dh_dv;")
    assert "fast_div(" in code and "__fdividef" not in code and "__expf" not in code
    qif = DefinitionKernel(neuron.QIFNode().program, torch.float32)
    assert "dh_dv" not in qif.constant_derivatives()


def test_functions_of_parameters_only_are_computed_once_per_thread(tmp_path):
    """PLIF's sigmoid(decay_logit), and any call on parameters only, is one Params field that
    load_params computes (after the reciprocals an exact division in it reads) and the
    equations read; the user-defined neuron's kernels compile without spills."""
    plif = DefinitionKernel(neuron.ParametricLIFNode().program, torch.float32, vec=4)
    assert plif.parameter_functions() == {
        "sigmoid_decay_logit": "(1.0f / (1.0f + expf(-p.decay_logit)))"
    }
    code = plif.full_codes
    assert "p.sigmoid_decay_logit = (1.0f / (1.0f + expf(-p.decay_logit)));" in code
    assert "return v + (-v + p.v_reset + x)*p.sigmoid_decay_logit;" in code
    user = NeuronDef("expleak", charge="v * exp(-1 / tau) + x / (1 + exp(a))", params=("tau", "a"))
    kernel = DefinitionKernel(NeuronProgram(user, surrogate.Sigmoid(), True, False), torch.float32)
    assert kernel.parameter_functions() == {
        "exp": "expf(exact_div(-1.0f, p.tau, p.rcp_tau))",
        "exp_a": "expf(p.a)",
    }
    loads = kernel.full_codes.split("load_params(const Args& a)")[1].split("\n}")[0]
    assert loads.index("p.rcp_tau = ") < loads.index("p.exp = ")
    if NVCC is None:
        pytest.skip("nvcc not found on PATH: not compiled")
    # (PLIF's kernels compile in the nvcc tests above, not here: its float32 backward at VEC 4
    # spills 8 bytes at the 128-register bound since sigmoid(decay_logit) is computed, not
    # loaded, a cost within the noise of `spikefuse bench neuron`)
    assert_compiles_without_spills(tmp_path, [kernel.full_codes], ("FPTT_KERNEL", "BPTT_KERNEL"))


HOISTING = NeuronDef(
    "hoisting",
    charge="0.5 * v + x + 0.1 * exp(a) - v * sigmoid(a) * exp(-1 / tau)",
    params=("a", "tau"),
)


@pytest.mark.parametrize(
    "definition",
    [d for d in vars(defs).values() if isinstance(d, NeuronDef)] + [HOISTING],
    ids=lambda d: d.name,
)
def test_computed_once_calls_keep_the_forward_operation_order(definition):
    """The forward equations print as they would with every call in place (the order torch
    evaluates, for bit-identical H), each call on parameters only read from its field."""
    kernel = DefinitionKernel(
        NeuronProgram(definition, surrogate.Sigmoid(), True, False), torch.float32
    )
    names = {definition.symbols[n]: f"p.{n}" for n in definition.all_params}
    fields = sorted(kernel.parameter_functions().items(), key=lambda item: -len(item[0]))
    equations = ("charge", "adaptation", "adaptation_jump") if definition.adaptive else ("charge",)
    for equation in equations:
        printed = "\n".join(kernel.body(equation))
        for field, value in fields:  # longest first: p.exp_a before p.exp
            printed = printed.replace(f"p.{field}", value)
        inline = cuda_body(kernel._expression(equation)[0], names)
        assert printed == "\n".join(inline), equation
    if definition is HOISTING:
        assert [f for f, _ in fields] == ["sigmoid_a", "exp_a", "exp"]


def test_plain_and_affine_kernels_have_their_own_arguments():
    """Plain kernels carry no BatchNorm fields, one-state neurons no W fields, and the affine
    kernels none of the state inputs and outputs they never use."""

    def field_names(node: neuron.BaseNode, affine: bool = False) -> set[str]:
        kernel = DefinitionKernel(node.program, torch.float16, 1, affine=affine)
        return {name for _, name in _struct_fields(kernel.full_codes)}

    plain, two_state = field_names(neuron.LIFNode()), field_names(neuron.IzhikevichNode())
    with_bn = field_names(neuron.LIFNode(), affine=True)
    residual = DefinitionKernel(neuron.LIFNode().program, torch.float16, 1, True, residual=True)
    residual_fields = {name for _, name in _struct_fields(residual.full_codes)}
    assert residual_fields - with_bn == {"residual_seq", "grad_residual_seq"}
    assert not {"residual_seq", "grad_residual_seq"} & (plain | two_state | with_bn)
    with pytest.raises(ValueError, match="unpooled affine"):
        DefinitionKernel(neuron.LIFNode().program, torch.float16, 1, True, 2, residual=True)
    assert not {n for n in plain | two_state if n.startswith("bn_")} and "inv_count" not in plain
    w_fields = {"w0", "w_init", "w_last", "w_ckpt", "grad_w_last", "grad_w0"}
    assert w_fields <= two_state and not w_fields & plain
    assert {"bn_mean", "bn_invstd", "grad_sum", "bn_total_g", "channels", "inv_count"} <= with_bn
    assert not {"v0", "v_seq", "v_last", "grad_v_seq", "grad_v_last", "grad_v0"} & with_bn


def test_kernel_source_is_the_template_behind_a_line_directive():
    """The loops come from the checked-in template, verbatim, and compiler messages name it;
    the generated prelude holds no loop."""
    kernel = backend.kernel_for(neuron.LIFNode().program, torch.float16, VEC)
    code = kernel.full_codes
    assert TEMPLATE_PATH.parent == Path(backend.__file__).parent
    assert TEMPLATE_NAME == "spikefuse/cuda/" + TEMPLATE_PATH.name
    prelude, template = code.split(f'#line 1 "{TEMPLATE_NAME}"\n')
    assert template == TEMPLATE_PATH.read_text(encoding="utf-8")
    assert "for (" not in prelude and "__global__" not in prelude
    assert f"#define FPTT_KERNEL {kernel.fptt_name}" in prelude


def test_printed_lif_kernel_reads_like_hand_written_code():
    """The README's recipe prints a kernel with lines of at most 100 columns, no whitespace-only
    lines, one float-literal style, and the surrogate's exp computed once."""
    code = backend.kernel_for(neuron.LIFNode().program, torch.float16, 4).full_codes
    lines = code.splitlines()
    assert max(len(line) for line in lines) <= 100
    assert not [line for line in lines if line and not line.strip()]
    assert code.count("fast_exp(") == 2  # its definition, and Sigmoid: sigma(4x) computed once
    assert not re.search(r"\d[.\d]*F\b", code)  # literals are written 4.0f, never 4.0F
    assert "? j - 1 : 0" not in code


@pytest.mark.parametrize("sur", surrogate.ALL)
def test_surrogates_print_with_lowercase_literals_on_one_line(sur):
    code = backend.kernel_for(neuron.LIFNode(surrogate_function=sur()).program, torch.float32, 1)
    body = code.full_codes.split("surrogate_grad(const float x)\n{\n")[1].split("\n}")[0]
    assert body.strip().startswith(("return", "const float e0 = "))
    assert all(line.endswith(";") for line in body.splitlines())  # no statement spans lines
    assert not re.search(r"\d[.\d]*F\b", body)


def test_affine_kernels_are_their_own_module():
    """The fused blocks find the channel-affine launchers through the registry, apart from the
    generic neuron backend."""
    assert backends.affine_kernels("cuda") is affine
    assert backends.affine_kernels("torch") is None
    assert not hasattr(backend, "affine_fptt")
    assert affine_plan.channel_layout(torch.zeros(2, 3, 4, 5, 6))[1] == (4, 30)
    channels_last = torch.zeros(2, 3, 5, 6, 4).permute(0, 1, 4, 2, 3)  # [T, B, C, H, W] view
    y, channels = affine_plan.channel_layout(channels_last)
    assert channels == (4, 1) and y is channels_last  # used as it is, not copied


LIF_PROGRAM = neuron.LIFNode().program


def _plan_of(y: torch.Tensor, pool: int = 1, forward: bool = True, aligned: bool = True):
    shape, strides = y.shape, y.stride()
    return affine_plan.plan(LIF_PROGRAM, y.dtype, shape, strides, pool, False, forward, aligned)


def test_launch_plans_read_the_layout_once_per_geometry():
    """A launch plan (what the affine launchers work out once per call signature) reads y's
    memory as the launchers' layout helpers do: as it is where the kernels read that layout
    (contiguous, channels innermost), one step of a y repeated over time, else a copy."""
    contiguous = torch.zeros(10, 4, 8, 6, 6)
    plan = _plan_of(contiguous)
    assert (plan.T, plan.N, plan.layout, plan.x_step, plan.copy) == (10, 1152, (8, 36), None, False)
    assert plan.memory == plan.steps == (contiguous.shape, contiguous.stride())
    assert plan.kernel.vec == 4 and _plan_of(contiguous, aligned=False).kernel.vec == 1
    assert _plan_of(contiguous) is plan  # cached
    assert plan.channel_tiles == 0  # forward: the packed Args are those the old call packed
    constants = [0.25] * len(plan.kernel.constant_names)
    want = plan.kernel.pack_args({"x_seq": 16}, 10, 1152, 0.5, 0.0, constants, (8, 36))
    assert plan.args({"x_seq": 16}, 0.5, constants) == want
    channels_last = torch.zeros(10, 4, 6, 6, 8).permute(0, 1, 4, 2, 3)
    plan = _plan_of(channels_last)
    assert (plan.layout, plan.copy, plan.steps[1]) == ((8, 1), False, channels_last.stride())
    repeated = torch.zeros(1, 4, 8, 6, 6).expand(10, -1, -1, -1, -1)
    plan = _plan_of(repeated)
    assert (plan.x_step, plan.copy, plan.memory[0][0], plan.steps[0][0]) == (0, False, 1, 10)
    repeated_strided = torch.zeros(1, 8, 4, 6, 6).transpose(1, 2).expand(10, -1, -1, -1, -1)
    assert _plan_of(repeated_strided).copy  # neither layout: its one step is copied
    strided = torch.zeros(10, 8, 4, 6, 6).transpose(1, 2)
    plan = _plan_of(strided)
    assert plan.copy and plan.memory == (strided.shape, strided.contiguous().stride())
    pooled = _plan_of(channels_last, pool=2, forward=False)
    assert (pooled.pool_width, pooled.steps[0], pooled.kernel.pool) == (3, (10, 4, 8, 3, 3), 2)
    assert pooled.per_sum == 4 * 9 * 8  # one partial sum per window (channels not in warps)
    with pytest.raises(ValueError, match="pooled affine kernels"):
        _plan_of(contiguous, pool=2)
    memory, layout, _ = affine_plan.unpooled_memory(strided)
    assert layout == plan.layout and memory.stride() == plan.memory[1]


def test_launch_plans_do_not_depend_on_the_grad_mode():
    """Under inference_mode views have no _base: a repeated channels-innermost step is still
    read as it is (and the plan, cached, is the same one training then uses)."""
    affine_plan.plan.cache_clear()
    step = torch.zeros(1, 4, 6, 6, 8).permute(0, 1, 4, 2, 3)
    with torch.inference_mode():
        plan = _plan_of(step.expand(10, -1, -1, -1, -1))
    assert not plan.copy and plan.layout == (8, 1) and plan.memory[1][1:] == step.stride()[1:]


def test_grad_spikes_are_laid_out_once_as_the_backward_kernels_read_them():
    """dL/dS in y's dtype and the layout each variant reads (the steps of y's memory; pooled:
    channels innermost), one copy where it differs; what is laid out so already is returned as
    it is, so the two passes' own lay-out copies nothing."""
    channels_last = torch.zeros(10, 4, 6, 6, 8).permute(0, 1, 4, 2, 3)  # y [T, B, C, H, W]
    grad = torch.randn(10, 4, 8, 6, 6, dtype=torch.float64)  # contiguous
    out = affine.laid_out_grad_spikes(LIF_PROGRAM, channels_last, grad)
    assert out.dtype == torch.float32 and out.stride() == channels_last.stride()
    assert torch.equal(out, grad.float())
    assert affine.laid_out_grad_spikes(LIF_PROGRAM, channels_last, out) is out
    repeated = torch.zeros(1, 4, 8, 6, 6).expand(10, -1, -1, -1, -1)  # steps are dense
    contiguous_grad = grad.float()
    assert affine.laid_out_grad_spikes(LIF_PROGRAM, repeated, contiguous_grad) is contiguous_grad
    pooled_grad = grad.float()[..., :3, :3]
    out = affine.laid_out_grad_spikes(LIF_PROGRAM, channels_last, pooled_grad, pool=2)
    assert backends.channels_innermost(out.shape, out.stride()) and torch.equal(out, pooled_grad)


def test_launch_plans_vectorise_what_is_aligned_or_copied():
    flat = torch.zeros(10 * 4 * 8 * 36 + 1)
    unaligned = flat[1:].view(10, 4, 8, 6, 6)  # 4 bytes past an aligned address
    assert affine_plan.plan_for(LIF_PROGRAM, unaligned, 1, None, True).kernel.vec == 1
    strided = flat[1:].view(10, 8, 4, 6, 6).transpose(1, 2)  # copied by the call: aligned
    assert affine_plan.plan_for(LIF_PROGRAM, strided, 1, None, True).kernel.vec == 4
    aligned = torch.zeros(10, 4, 8, 6, 6)
    assert affine_plan.plan_for(LIF_PROGRAM, aligned, 1, None, True, unaligned).kernel.vec == 1


def test_reserved_parameter_names_are_refused():
    with pytest.raises(ValueError, match="reserved"):
        HandWrittenIF("bad", ("N",), (), surrogate.Sigmoid(), True, False, torch.float32)


class HandWrittenIF(NeuronKernel):
    """The low-level extension path: CUDA snippets written by hand (here an IF neuron)."""

    def charge(self) -> str:
        return "v + x"

    def dh_dx(self) -> str:
        return "1.0f"

    def dh_dv(self) -> str:
        return "1.0f"


def test_hand_written_snippets_produce_a_complete_kernel(tmp_path):
    kernel = HandWrittenIF("my_if", (), (), surrogate.Sigmoid(), True, False, torch.float32, 4)
    code = kernel.full_codes
    assert "return v + x;" in code
    if NVCC is None:
        pytest.skip("nvcc not found on PATH: hand-written kernel not compiled")
    (tmp_path / "k.cu").write_text(code)
    cmd = [NVCC, "-c", *NVRTC_OPTIONS, "-arch=sm_90", "-o", str(tmp_path / "k.o")]
    r = subprocess.run([*cmd, str(tmp_path / "k.cu")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_chunk_follows_the_sequence_length():
    """Backward chunks are 4 or 8 steps where that holds all T steps, else the longest: a chunk
    longer than T holds registers it never uses, and one chunk needs no checkpoint. The
    launchers size the checkpoints with the same length the kernel is compiled for."""
    assert [chunk_steps(T, 10) for T in (1, 4, 5, 8, 9, 10, 11, 32)] == [4, 4, 8, 8, 10, 10, 10, 10]
    assert [chunk_steps(T, 8) for T in (1, 4, 5, 8, 9, 32)] == [4, 4, 8, 8, 8, 8]
    assert [chunk_steps(T, 12) for T in (3, 8, 10, 12, 13)] == [4, 8, 12, 12, 12]
    program = neuron.LIFNode().program
    kernel = backend.kernel_for(program, torch.float32, 1, True, chunk=chunk_steps(10, 10))
    assert "constexpr int CHUNK = 10;" in kernel.prelude()
    y = torch.zeros(10, 2, 3)
    assert affine.affine_saved_like(program, y, True) is None  # T = 10: one chunk
    assert affine.affine_saved_like(program, torch.zeros(11, 2, 3), True).shape == (1, 2, 3)
    assert backend.saved_like(program, torch.zeros(9, 2, 3), True)[0].shape == (1, 2, 3)
    assert backend.saved_like(program, torch.zeros(4, 2, 3), True)[0] is None
    with pytest.raises(ValueError, match="chunk must be in 1..10"):
        DefinitionKernel(program, torch.float32, 1, affine=True, chunk=12)


def test_a_launch_passes_the_packed_struct_as_its_one_parameter(monkeypatch):
    """launch_named gives cuLaunchKernel one kernelParams entry: the address of a copy of the
    packed Args bytes (all of them, none added), on the current stream."""
    from spikefuse.cuda import runtime

    args = bytes(range(40)) + b"\x00\x07"
    seen = []

    def launch_in_context(call, index):
        params = ctypes.cast(call[9], ctypes.POINTER(ctypes.c_void_p))
        seen.append((call[:9], call[10], index, ctypes.string_at(params[0], len(args))))

    monkeypatch.setattr(runtime, "_loaded", lambda source, name, index: (None, 1234))
    monkeypatch.setattr(runtime, "_current_device", lambda: 0)
    monkeypatch.setattr(runtime, "_current_stream", lambda index: 99)
    monkeypatch.setattr(runtime, "_launch_in_context", launch_in_context)
    runtime.launch_named("source", "k", torch.device("cuda", 0), (3, 2, 1), (256, 1, 1), args)
    assert seen == [((1234, 3, 2, 1, 256, 1, 1, 0, 99), 0, 0, args)]


def test_the_learnable_partials_live_in_the_gradients_buffer():
    """The kernel's partial sums and block counter lie after the gradient in one zeroed buffer,
    which the returned gradient holds: nothing allocated before the launch can take them."""
    from spikefuse.cuda.runtime import learnable_grad_buffers

    program = neuron.ParametricLIFNode(step_mode="m").program
    grad, pointers = learnable_grad_buffers(program, torch.zeros(()), blocks=3)
    start = grad.untyped_storage().data_ptr()
    assert grad.shape == () and pointers["grad_learnable"] == start == grad.data_ptr()
    assert pointers["grad_learnable_partial"] == start + 4
    assert pointers["blocks_done"] == start + 4 * (1 + 3)
    assert grad.untyped_storage().nbytes() == 4 * (1 + 3 + 1)
