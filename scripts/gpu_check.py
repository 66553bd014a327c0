"""GPU check: every generated kernel variant against the reference backend.

Variants: neuron x surrogate x dtype (float32, float16, bfloat16) x reset (hard, soft) x
detach_reset, each on awkward shapes (T=1/N=1; odd N with non-contiguous input and non-zero
initial states; vector-aligned N with store_v_seq). Compared: spikes (exactly equal in float32;
mismatch fraction reported for 16-bit), v_seq, final states and the gradients of x, the initial
states and PLIF's tau, by normalised error max|cuda - ref| / max|ref|, against a float32 reference
run on the same (16-bit-rounded) input. Also: a tensor on cuda:1 runs on cuda:1 (if present), and
gradients of PLIF's tau are bit-identical across runs.

Usage: python scripts/gpu_check.py [--quick] [--out DIR]. Exit code 1 if anything fails.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch

from spikefuse import neuron, surrogate
from spikefuse.cuda import backend as cuda_backend
from spikefuse.cuda.codegen import vector_width

# Normalised error bounds per storage dtype (value outputs / gradients).
TOLERANCE = {torch.float32: (1e-5, 1e-4), torch.float16: (2e-3, 2e-2), torch.bfloat16: (1e-2, 6e-2)}
NODES = {
    "IF": lambda **k: neuron.IFNode(**k),
    "LIF": lambda **k: neuron.LIFNode(tau=2.0, **k),
    "LIF(decay_input=False)": lambda **k: neuron.LIFNode(tau=3.0, decay_input=False, **k),
    "PLIF": lambda **k: neuron.ParametricLIFNode(init_tau=2.5, **k),
    "PLIF(decay_input=False)": lambda **k: neuron.ParametricLIFNode(decay_input=False, **k),
    "QIF": lambda **k: neuron.QIFNode(**k),
    "EIF": lambda **k: neuron.EIFNode(**k),
    "Izhikevich": lambda **k: neuron.IzhikevichNode(b=0.2, **k),
}
SHAPES = [  # (T, state shape, non-contiguous input, non-zero initial state, store_v_seq)
    (1, (1,), False, False, False),
    (5, (3, 37), True, True, False),
    (6, (2, 64), False, False, True),
]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    scale = b.abs().max().item() if b.numel() else 0.0
    return (a - b).abs().max().item() / scale if scale > 0 else (a - b).abs().max().item()


def run(make, backend, x, v0, w0, store_v_seq, grads):
    node = make(step_mode="m", backend=backend, store_v_seq=store_v_seq).cuda()
    x = x.detach().clone().requires_grad_()
    init = {"v": v0.detach().clone().requires_grad_()}
    node.v = init["v"]
    if w0 is not None:
        init["w"] = w0.detach().clone().requires_grad_()
        node.w = init["w"]
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


def check_variant(name, make, sur_cls, dtype, hard, detach, gen) -> tuple[bool, list[str], dict]:
    kwargs = dict(surrogate_function=sur_cls(), v_reset=0.0 if hard else None, detach_reset=detach)
    adaptive = name == "Izhikevich"
    problems, worst = [], {"value": 0.0, "grad": 0.0, "spike_mismatch": 0.0}
    for T, shape, non_contig, nonzero_init, store in SHAPES:
        if non_contig:
            x = torch.randn((T, *shape[::-1]), generator=gen, device="cuda").transpose(1, 2)
        else:
            x = torch.randn((T, *shape), generator=gen, device="cuda")
        x = (x * 1.2 + 0.6).to(dtype)
        scale = 0.5 if nonzero_init else 0.0
        v0 = torch.randn(shape, generator=gen, device="cuda") * scale
        w0 = torch.randn(shape, generator=gen, device="cuda") * scale if adaptive else None
        grads = {
            "spikes": torch.randn((T, *shape), generator=gen, device="cuda"),
            "v_last": torch.randn(shape, generator=gen, device="cuda"),
            "v_seq": torch.randn((T, *shape), generator=gen, device="cuda"),
            "w_last": torch.randn(shape, generator=gen, device="cuda"),
        }
        mk = lambda **k: make(**kwargs, **k)  # noqa: E731
        got = run(mk, "cuda", x, v0, w0, store, grads)
        ref = run(mk, "torch", x.float(), v0, w0, store, grads)
        value_tol, grad_tol = TOLERANCE[dtype]
        mismatch = (got["spikes"].float() != ref["spikes"]).float().mean().item()
        worst["spike_mismatch"] = max(worst["spike_mismatch"], mismatch)
        if (dtype == torch.float32 and mismatch > 0) or mismatch > 0.01:
            problems.append(f"T={T} shape={shape}: spike mismatch {mismatch:.4f}")
            continue  # diverged trajectories make the remaining comparisons meaningless
        for key, r in ref.items():
            if key == "spikes":
                continue
            e = rel_err(got[key], r)
            kind = "grad" if key.startswith("grad") else "value"
            worst[kind] = max(worst[kind], e)
            if e > (grad_tol if kind == "grad" else value_tol):
                problems.append(f"T={T} shape={shape}: {key} rel err {e:.2e}")
    return not problems, problems, worst


def check_device_placement(log) -> bool:
    if torch.cuda.device_count() < 2:
        log("cuda:1 placement: SKIPPED (only one GPU visible)")
        return True
    torch.cuda.set_device(0)
    x = torch.randn(4, 8, 33, device="cuda:1", requires_grad=True)
    node = neuron.LIFNode(step_mode="m", backend="cuda")
    s = node(x)
    s.sum().backward()
    ref = neuron.LIFNode(step_mode="m", backend="torch")(x.detach())
    ok = (s.device == torch.device("cuda:1") and x.grad.device == s.device
          and torch.equal(s, ref) and torch.cuda.current_device() == 0)  # fmt: skip
    log(f"cuda:1 placement: {'PASS' if ok else 'FAIL'} (outputs on {s.device}, current device "
        f"still {torch.cuda.current_device()})")  # fmt: skip
    return ok


def check_determinism(log) -> bool:
    x = torch.randn(8, 64, 4097, device="cuda")
    grads = []
    for _ in range(3):
        node = neuron.ParametricLIFNode(step_mode="m", backend="cuda").cuda()
        xs = x.clone().requires_grad_()
        node(xs).sum().backward()
        grads.append(node.w.grad.clone())
    ok = all(torch.equal(g, grads[0]) for g in grads)
    log(f"PLIF tau gradient bit-identical over 3 runs: {'PASS' if ok else 'FAIL'}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="LIF and Izhikevich, two surrogates")
    parser.add_argument("--out", type=Path, default=Path("gpu_check_results"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    log_file = (args.out / "gpu_check.log").open("w")

    def log(msg: str) -> None:
        print(msg, flush=True)
        log_file.write(msg + "\n")

    log(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    nodes = {k: NODES[k] for k in ("LIF", "Izhikevich")} if args.quick else NODES
    surrogates = (surrogate.Sigmoid, surrogate.Rect) if args.quick else surrogate.ALL
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    variants = list(
        itertools.product(nodes.items(), surrogates, dtypes, (True, False), (False, True))
    )

    t0 = time.perf_counter()
    kernels = []
    for (_, make), sur, dtype, hard, detach in variants:
        program = make(surrogate_function=sur(), v_reset=0.0 if hard else None,
                       detach_reset=detach).program  # fmt: skip
        kernels += [
            cuda_backend.kernel_for(program, dtype, vec) for vec in (1, vector_width(dtype))
        ]
    cuda_backend.precompile(kernels, threads=16)
    log(f"compiled {len(kernels)} kernel modules in {time.perf_counter() - t0:.1f} s")

    gen = torch.Generator(device="cuda").manual_seed(0)
    passed = failed = 0
    worst_by_dtype: dict[str, dict[str, float]] = {}
    for (name, make), sur, dtype, hard, detach in variants:
        label = (f"{name} {sur.__name__} {str(dtype)[6:]} {'hard' if hard else 'soft'}"
                 f"{' detach' if detach else ''}")  # fmt: skip
        try:
            ok, problems, worst = check_variant(name, make, sur, dtype, hard, detach, gen)
        except Exception as exc:  # noqa: BLE001 - report and continue with the other variants
            ok, problems, worst = False, [f"{type(exc).__name__}: {exc}"], {}
        w = worst_by_dtype.setdefault(
            str(dtype)[6:], {"value": 0.0, "grad": 0.0, "spike_mismatch": 0.0}
        )
        for k, v in worst.items():
            w[k] = max(w[k], v)
        passed += ok
        failed += not ok
        if not ok:
            log(f"FAIL {label}: " + "; ".join(problems))
    for dtype, w in worst_by_dtype.items():
        log(
            f"worst normalised error vs float32 reference, {dtype}: values {w['value']:.2e}, "
            f"gradients {w['grad']:.2e}, spike mismatch fraction {w['spike_mismatch']:.2e}"
        )
    extra_ok = check_device_placement(log) & check_determinism(log)
    log(f"GPU check on {torch.cuda.get_device_name(0)}: {passed} variants passed, {failed} failed "
        f"({len(SHAPES)} shapes each), extra checks {'PASS' if extra_ok else 'FAIL'}, "
        f"{time.perf_counter() - t0:.0f} s")  # fmt: skip
    return 0 if failed == 0 and extra_ok else 1


if __name__ == "__main__":
    sys.exit(main())
