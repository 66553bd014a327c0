"""Every generated kernel variant against the reference backend, through the neuron modules
(``backend='cuda'`` vs ``backend='torch'``), and the kernels' NaN policy, determinism, device
placement and register use.

Variants: neuron × surrogate × dtype (float32, float16, bfloat16) × reset (hard, soft) ×
detach_reset, each on awkward shapes. Compared against a float32 reference run on the same
(16-bit-rounded) input and upstream gradients: spikes (exactly equal in float32, at most 1%
differing in 16-bit), v_seq, final states and the gradients of x, the initial states and PLIF's
tau, by normalised error max|cuda - ref| / max|ref| (conftest.TOLERANCE).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from conftest import TOLERANCE, differ, gen, reldiff, seed_of
from spikefuse import neuron, surrogate

from .variants import CHUNK, DTYPES, NODES, Variant, params

pytestmark = pytest.mark.gpu

VARIANTS = [
    Variant(name, sur, dtype, hard, detach)
    for name, sur, dtype, hard, detach in itertools.product(
        NODES, surrogate.ALL, DTYPES, (True, False), (False, True)
    )
]
SHAPES = [  # (T, state shape, non-contiguous input, tensor initial state, store_v_seq)
    (1, (1,), False, True, False),  # T = 1, N = 1
    (5, (3, 37), True, True, False),  # odd N, non-contiguous input
    (CHUNK + 5, (2, 66), False, True, True),  # a partial last chunk, v_seq stored
    (2 * CHUNK, (1, 4099), False, False, False),  # N not a multiple of the vector width,
]  # the constant initial state


def run(make, backend, x, v0, w0, store_v_seq, grads):
    """Outputs, final states and gradients of one multi-step call of ``make``'s neuron."""
    node = make(step_mode="m", backend=backend, store_v_seq=store_v_seq).cuda()
    x = x.detach().clone().requires_grad_()
    init = {}  # without v0 the node starts from its constant reset state
    if v0 is not None:
        init["v"] = node.v = v0.detach().clone().requires_grad_()
    if w0 is not None:
        init["w"] = node.w = w0.detach().clone().requires_grad_()
    s = node(x)
    outs = {"spikes": s, "v_last": node.v}
    if store_v_seq:
        outs["v_seq"] = node.v_seq
    if w0 is not None:
        outs["w_last"] = node.w
    loss = sum((outs[k].float() * grads[k]).sum() for k in outs if k in grads)
    loss.backward()
    res = {k: t.detach() for k, t in outs.items()}
    res["grad_x"] = x.grad
    res.update({f"grad_{k}0": t.grad for k, t in init.items()})
    if isinstance(node, neuron.ParametricLIFNode):
        res["grad_w_param"] = node.w.grad.reshape(1)
    return res


def compare_on_shape(
    variant: Variant, shape_case, g: torch.Generator, worst: dict[str, float]
) -> list[str]:
    """Problems of the cuda backend against the reference on one shape (empty: none); raises
    ``worst``'s errors ('spike_mismatch', 'value', 'grad') to those seen."""
    T, shape, non_contig, tensor_init, store = shape_case
    dtype = variant.dtype
    if non_contig:
        x = torch.randn((T, *shape[::-1]), generator=g, device="cuda").transpose(1, 2)
    else:
        x = torch.randn((T, *shape), generator=g, device="cuda")
    # Moderate drive: stronger input makes the soft-reset QIF/EIF/Izhikevich trajectories
    # diverge to inf within 16 steps, which tests float16's range rather than the kernels.
    x = (x * 0.6 + 0.5).to(dtype)
    v0 = torch.randn(shape, generator=g, device="cuda") * 0.5 if tensor_init else None
    adaptive = variant.node == "Izhikevich"
    w0 = torch.randn(shape, generator=g, device="cuda") * 0.5 if tensor_init and adaptive else None
    # Upstream gradients of the sequence outputs arrive in their storage dtype: round them for
    # the reference too, so both see the same inputs (as x).
    grads = {
        "spikes": torch.randn((T, *shape), generator=g, device="cuda").to(dtype).float(),
        "v_last": torch.randn(shape, generator=g, device="cuda"),
        "v_seq": torch.randn((T, *shape), generator=g, device="cuda").to(dtype).float(),
        "w_last": torch.randn(shape, generator=g, device="cuda"),
    }
    got = run(variant.make, "cuda", x, v0, w0, store, grads)
    ref = run(variant.make, "torch", x.float(), v0, w0, store, grads)
    where = f"T={T} shape={shape}"
    mismatch = differ(got["spikes"], ref["spikes"]).float().mean().item()
    worst["spike_mismatch"] = max(worst["spike_mismatch"], mismatch)
    if (dtype == torch.float32 and mismatch > 0) or mismatch > 0.01:
        # diverged trajectories make the remaining comparisons meaningless
        return [f"{where}: spike mismatch {mismatch:.4f}"]
    value_tol, grad_tol = TOLERANCE[dtype]
    problems = []
    for key, want in ref.items():
        if key == "spikes":
            continue
        if key in ("v_seq", "grad_x"):  # stored in the storage dtype: round the reference
            want = want.to(dtype)  # too (a V beyond float16's range is inf in both)
        err = reldiff(got[key], want)
        kind = "grad" if key.startswith("grad") else "value"
        worst[kind] = max(worst[kind], err)
        if err > (grad_tol if kind == "grad" else value_tol):
            problems.append(f"{where}: {key} normalised error {err:.2e}")
    return problems


@pytest.mark.parametrize("variant", params(VARIANTS))
def test_kernel_matches_reference(variant: Variant, record_property):
    """The worst errors go into the test report (scripts/gpu_check.py sums them up by dtype)."""
    g = gen(seed_of(variant.id), device="cuda")
    worst = {"spike_mismatch": 0.0, "value": 0.0, "grad": 0.0}
    problems = [p for case in SHAPES for p in compare_on_shape(variant, case, g, worst)]
    for kind, err in worst.items():
        record_property(f"worst_{kind}", err)
    assert not problems, "; ".join(problems)


# ---- NaN and ±inf ------------------------------------------------------------------------------
@pytest.mark.quick
@pytest.mark.parametrize(
    "variant",
    [
        pytest.param(v, id=v.id)
        for v in (
            Variant(name, surrogate.Sigmoid, dtype, hard)
            for name, dtype, hard in itertools.product(
                ("LIF", "EIF", "Izhikevich"), DTYPES, (True, False)
            )
        )
    ],
)
def test_nan_and_inf_inputs_match_reference(variant: Variant):
    """NaN and ±inf inputs give the same spikes, V and gradients on both backends (NaN spikes
    where H is NaN, V stays NaN; +inf fires and resets)."""
    x = torch.rand(6, 3, 40, device="cuda") + 0.3
    x[1, 0, :5] = float("nan")
    x[2, 1, :5] = float("inf")
    x[3, 2, :5] = float("-inf")
    x = x.to(variant.dtype)
    results = {}
    for backend in ("cuda", "torch"):
        node = variant.make(step_mode="m", backend=backend)
        xs = (x if backend == "cuda" else x.float()).clone().requires_grad_()
        spikes = node(xs)
        spikes.float().nan_to_num(0.0).sum().backward()
        results[backend] = (spikes.detach(), node.v.detach(), xs.grad)
    (s_cuda, v_cuda, g_cuda), (s_ref, v_ref, g_ref) = results["cuda"], results["torch"]
    assert not differ(s_cuda, s_ref).any(), "spikes differ"
    assert not differ(v_cuda, v_ref).any(), "V differs"
    assert s_cuda[1, 0, :5].isnan().all(), "NaN input did not give NaN spikes"
    assert not differ(g_cuda.float().isnan(), g_ref.float().isnan()).any(), (
        "NaN gradients in different places"
    )


# ---- determinism, placement, registers ----------------------------------------------------------
@pytest.mark.quick
def test_plif_tau_gradient_is_bit_identical_across_runs():
    x = torch.randn(8, 64, 4097, device="cuda")
    grads = []
    for _ in range(3):
        node = neuron.ParametricLIFNode(step_mode="m", backend="cuda").cuda()
        xs = x.clone().requires_grad_()
        node(xs).sum().backward()
        grads.append(node.w.grad.clone())
    assert all(torch.equal(g, grads[0]) for g in grads)


@pytest.mark.quick
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU (cuda:1)")
def test_tensor_on_second_gpu_runs_there():
    """A tensor on cuda:1 runs on cuda:1 while cuda:0 stays the current device."""
    torch.cuda.set_device(0)
    x = torch.randn(4, 8, 33, device="cuda:1", requires_grad=True)
    node = neuron.LIFNode(step_mode="m", backend="cuda")
    s = node(x)
    s.sum().backward()
    ref = neuron.LIFNode(step_mode="m", backend="torch")(x.detach())
    assert s.device == torch.device("cuda:1") and x.grad.device == s.device
    assert torch.equal(s, ref)
    assert torch.cuda.current_device() == 0


@pytest.mark.quick
@pytest.mark.parametrize("affine", [False, True], ids=["plain", "affine"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_lif_kernel_registers(dtype, affine, record_property):
    """Registers and local-memory spills of the LIF kernels that run on aligned input
    (recorded in the test report, not checked)."""
    from spikefuse.cuda import backend as cuda_backend
    from spikefuse.cuda.kernel_spec import AFFINE_BPTT_VEC, BPTT_VEC, VEC

    bptt_vec = AFFINE_BPTT_VEC if affine else BPTT_VEC[dtype]
    for forward, vec in ((True, VEC), (False, bptt_vec)):
        kernel = cuda_backend.kernel_for(neuron.LIFNode().program, dtype, vec, affine)
        raw, _ = cuda_backend.compiled(kernel, forward, torch.cuda.current_device())
        direction = "fptt" if forward else "bptt"
        record_property(f"{direction}_vec{vec}_registers", raw.num_regs)
        record_property(f"{direction}_vec{vec}_local_bytes", raw.local_size_bytes)
        print(f"{direction} VEC={vec}: {raw.num_regs} registers, {raw.local_size_bytes} B local")


# ---- 64-bit indices ----------------------------------------------------------------------------
@pytest.mark.quick
@pytest.mark.parametrize(
    "variant",
    [
        Variant("LIF", surrogate.ATan, torch.float32, True, False),
        Variant("Izhikevich", surrogate.Sigmoid, torch.bfloat16, False, True),
        Variant("PLIF", surrogate.ATan, torch.float16, True, True),
    ],
    ids=lambda v: v.id,
)
def test_64_bit_index_kernels_match_reference(variant: Variant, monkeypatch):
    """The variants the launchers take for calls past 32-bit indices, forced on small shapes
    (every call counted as too large for int)."""
    from spikefuse.cuda import kernel_spec

    monkeypatch.setattr(kernel_spec, "INDEX32_MAX", 0)
    assert kernel_spec.needs_wide_index(1, 1)
    g = gen(seed_of(variant.id), device="cuda")
    worst = {"spike_mismatch": 0.0, "value": 0.0, "grad": 0.0}
    problems = [p for case in SHAPES for p in compare_on_shape(variant, case, g, worst)]
    assert not problems, "; ".join(problems)
