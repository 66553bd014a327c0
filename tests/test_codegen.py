"""Code generation: every kernel variant compiles with nvcc (sm_80 and sm_90), source is readable,
and the hand-written-snippet extension path works. GPU execution is checked by
tests/gpu (``pytest -m gpu`` on a GPU machine)."""

from __future__ import annotations

import itertools
import shutil
import struct
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from spikefuse import neuron, surrogate
from spikefuse.cuda.codegen import NVRTC_OPTIONS, VEC, DefinitionKernel, NeuronKernel

NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH: compile test not run")
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
    (BatchNorm-folded) kernels of every one-state neuron, dtype and reset."""
    kernels = []
    for make, sur, dtype, hard, detach in itertools.product(
        NODES, surrogate.ALL, DTYPES, (True, False), (True, False)
    ):
        node = make(surrogate_function=sur(), v_reset=0.0 if hard else None, detach_reset=detach)
        kernels += [DefinitionKernel(node.program, dtype, vec) for vec in (1, VEC)]
        if sur is surrogate.Rect and not node.definition.adaptive:
            kernels += [DefinitionKernel(node.program, dtype, vec, affine=True) for vec in (1, VEC)]
    return kernels


def translation_unit(kernels: list[NeuronKernel]) -> str:
    """All variants in one file: each in its own namespace, with C++ (not extern "C") linkage so
    that equal kernel names in different namespaces do not clash. The fp16/bf16 headers are
    included first, at global scope (their include guards make the per-variant includes no-ops)."""
    parts = ["#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n"]
    for i, k in enumerate(kernels):
        body = k.full_codes.replace('extern "C" ', "")
        parts.append(f"namespace variant{i} {{\n{body}\n}}\n")
    return "".join(parts)


@needs_nvcc
def test_every_variant_compiles_with_nvcc(tmp_path):
    kernels = all_variants()
    # 8 neurons x every surrogate x 3 dtypes x 2 resets x 2 detach, scalar and vector width;
    # affine: 7 one-state neurons x 3 dtypes x 2 resets x 2 detach x 2 widths
    assert len(kernels) == 8 * len(surrogate.ALL) * 3 * 2 * 2 * 2 + 7 * 3 * 2 * 2 * 2
    source = tmp_path / "variants.cu"
    source.write_text(translation_unit(kernels))

    def compile_for(arch: str) -> subprocess.CompletedProcess:
        # Unoptimised: this test checks that every variant is valid CUDA that compiles to SASS;
        # optimisation only costs time here (the GPU check compiles optimised, with NVRTC).
        cmd = [NVCC, "-c", *NVRTC_OPTIONS, "-Xcicc", "-O0", "-Xptxas", "-O0", f"-arch=sm_{arch}",
               "-o", str(tmp_path / f"{arch}.o"), str(source)]  # fmt: skip
        return subprocess.run(cmd, capture_output=True, text=True, timeout=900)

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(compile_for, ("80", "90")))
    for arch, r in zip(("80", "90"), results, strict=True):
        errors = [line for line in r.stderr.splitlines() if "error" in line]
        assert r.returncode == 0, f"sm_{arch}: " + "\n".join(errors[:20])
        assert (tmp_path / f"{arch}.o").stat().st_size > 0


def test_generated_source_is_printable_and_names_the_variant():
    node = neuron.ParametricLIFNode(surrogate_function=surrogate.ATan(), v_reset=None)
    kernel = DefinitionKernel(node.program, torch.bfloat16, VEC)
    code = kernel.full_codes
    assert kernel.fptt_name in code and kernel.bptt_name in code
    assert (
        "plif" in kernel.fptt_name and "soft" in kernel.fptt_name and "bfloat16" in kernel.fptt_name
    )
    assert "a.learnable[0]" in code and "p.decay" in code  # decay read from the device array
    assert "atomicAdd" not in code  # the tau gradient is reduced deterministically
    assert code.count("__global__") == 2
    # backward recomputes H with the forward's own step function
    assert code.count("= step(") == 2


def test_argument_struct_matches_the_packed_bytes():
    """The Python packing and the generated struct agree on every field's order and size."""
    node = neuron.IzhikevichNode()
    kernel = DefinitionKernel(node.program, torch.float32, VEC)
    struct_src = kernel.full_codes.split("struct Args {")[1].split("};")[0]
    fields = [line.split("//")[0].strip().rstrip(";") for line in struct_src.strip().splitlines()]
    pointers = [f for f in fields if "*" in f]
    floats = [n.strip() for f in fields if f.startswith("float ") for n in f[6:].split(",")]
    assert len(pointers) == 26 and fields[len(pointers)] == "long long T, N, channels, inner"
    assert floats == ["v_init", "w_init", "inv_count", *kernel.constant_names]
    packed = kernel.pack_args(
        {"x_seq": 7, "grad_w0": 9}, 3, 5, 0.5, 0.25, [1.0] * 9, (6, 8), inv_count=0.125
    )
    assert len(packed) == 26 * 8 + 32 + 4 * 12  # 12 floats: an even count, no padding
    assert int.from_bytes(packed[:8], "little") == 7 and packed[8:16] == bytes(8)
    ints = [int.from_bytes(packed[208 + 8 * i : 216 + 8 * i], "little") for i in range(4)]
    assert ints == [3, 5, 6, 8]
    assert struct.unpack_from("<3f", packed, 240) == (0.5, 0.25, 0.125)


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
    r = subprocess.run([NVCC, "-c", "-arch=sm_90", "-o", str(tmp_path / "k.o"), str(tmp_path / "k.cu")],
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr
