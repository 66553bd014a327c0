"""spike_matmul and spike_matmul_chain against their torch reference on CPU: exact outputs for
spikes, the reference's gradients, the exactness rules (which path, why) and the tensor-core
arithmetic itself (bfloat16/float16 operands, float32 sums) emulated on CPU."""

from __future__ import annotations

import pytest
import torch

from spikefuse.errors import SpikefuseError
from spikefuse.spike_matmul import (
    Plan,
    spike_gate,
    spike_matmul,
    spike_matmul_chain,
    spike_matmul_chain_heads,
    spike_matmul_chain_heads_naive,
    spike_matmul_chain_naive,
    spike_matmul_chain_plan,
    spike_matmul_naive,
    spike_matmul_plan,
)
from spikefuse.spike_matmul import autograd as sm_autograd
from spikefuse.spike_matmul.autograd import SpikeMatmulChainFunction, compact, product
from spikefuse.spike_matmul.rules import plan


def spikes(*shape, p=0.5, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(*shape, generator=g) < p).to(dtype).requires_grad_()


def grads(out, inputs, seed=1):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad(out, inputs, g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_spike_matmul_equals_the_reference(dtype):
    a, b = spikes(2, 3, 5, 7, dtype=dtype), spikes(2, 3, 7, 4, seed=1, dtype=dtype)
    out, want = spike_matmul(a, b), spike_matmul_naive(a, b)
    assert out.dtype == dtype and torch.equal(out, want)
    for got, ref in zip(grads(out, (a, b)), grads(want, (a, b)), strict=True):
        torch.testing.assert_close(got, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_chain_equals_the_reference(dtype):
    """Spikformer's ((v @ kᵀ) @ q) * scale on [T, B, heads, C/heads, L] spikes."""
    q, k, v = (spikes(2, 3, 2, 4, 9, seed=s, dtype=dtype) for s in range(3))
    kt = k.transpose(-2, -1)
    out = spike_matmul_chain(v, kt, q, 0.125)
    want = spike_matmul_chain_naive(v, kt, q, 0.125)
    assert torch.equal(out, want)
    for got, ref in zip(grads(out, (q, k, v)), grads(want, (q, k, v)), strict=True):
        torch.testing.assert_close(got, ref)


def test_the_chain_keeps_spikes_only():
    """Backward keeps the three operands as bool, not the float counts a @ b."""
    a, b, c = spikes(4, 6), spikes(6, 5, seed=1), spikes(5, 3, seed=2)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        SpikeMatmulChainFunction.apply(a, b, c, 1.0)
    assert [t.dtype for t in saved] == [torch.bool] * 3


def test_a_gradient_for_one_input_only():
    a, b = spikes(4, 6), spikes(6, 5, seed=1).detach()
    (grad_a,) = torch.autograd.grad(spike_matmul(a, b).sum(), (a,))
    torch.testing.assert_close(grad_a, torch.ones(4, 5, dtype=a.dtype) @ b.t())


def test_bf16_and_fp16_operands_are_exact_within_the_bounds():
    """The tensor-core arithmetic (operands rounded to bf16/fp16, float32 sums) equals the
    float32 matmul for counts up to 256 (bf16) and 2048 (fp16), and not beyond: the bounds of
    the rules are the real ones."""
    right = torch.ones(1, 3000, 1)
    for dtype, largest in ((torch.bfloat16, 256), (torch.float16, 2048)):
        for count, exact in ((largest, True), (largest + 1, False)):
            left = torch.full((1, 1, 3000), float(count))
            left[..., 1:] = 0
            got = product(left, right, Plan(dtype, ""))
            assert torch.equal(got, left @ right) is exact, (dtype, count)


def test_the_rules():
    assert spike_matmul_plan(spikes(2, 3), spikes(3, 2)).reason.startswith("on cpu")
    assert not plan(torch.empty(0, device="meta"), 8).fast

    class Like:  # what plan reads of a tensor
        def __init__(self, dtype):
            self.device, self.dtype = torch.device("cuda"), dtype

    like = Like(torch.float32)
    assert plan(like, 10_000).operands is torch.bfloat16  # spikes: any K up to 2^24
    assert plan(like, 2**24 + 1).operands is None
    assert plan(like, 100, count=256).operands is torch.bfloat16
    assert plan(like, 100, count=257).operands is torch.float16
    assert plan(like, 100, count=2048).operands is torch.float16
    assert "2048" in plan(like, 100, count=2049).reason
    assert "2^24" in plan(like, 2**14, count=2**11).reason
    assert plan(Like(torch.float64), 8).operands is None
    v, kt, q = spikes(2, 300, 1, seed=0), spikes(2, 1, 300), spikes(2, 300, 5)
    first, second = spike_matmul_chain_plan(v, kt, q)
    assert first.reason == second.reason  # on CPU: both plain


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((torch.ones(3), torch.ones(3, 2)), "rows, cols"),
        ((torch.ones(2, 3), torch.ones(4, 2)), "do not chain"),
        ((torch.ones(2, 2, 3), torch.ones(3, 3, 2)), "equal batch dims"),
        ((torch.ones(2, 3), torch.ones(3, 2, dtype=torch.float64)), "one dtype"),
        ((torch.ones(2, 3, dtype=torch.int64), torch.ones(3, 2, dtype=torch.int64)), "floating"),
    ],
)
def test_bad_operands_are_refused(args, match):
    with pytest.raises(SpikefuseError, match=match):
        spike_matmul(*args)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), True, "1"])
def test_a_bad_scale_is_refused(scale):
    a = torch.ones(2, 2)
    with pytest.raises(SpikefuseError, match="scale"):
        spike_matmul_chain(a, a, a, scale)


def test_double_backward_is_refused():
    a, b = spikes(3, 4), spikes(4, 2, seed=1)
    with pytest.raises(SpikefuseError, match="double backward"):
        torch.autograd.grad(spike_matmul(a, b).sum(), (a,), create_graph=True)


def test_heads_of_channels_innermost_tokens_are_copied_along_their_channels():
    """Spikformer's q, k, v cut from a fused block's output [T, B, 3C, L] with the channels at
    stride 1: each operand is copied once, column-major where its rows are the channels, and
    the tensor-core product (emulated) and the chain equal the reference."""
    t, b, heads, d, length = 2, 3, 2, 4, 9
    rows = spikes(t, b, length, 3 * heads * d, dtype=torch.float32).detach()
    qkv = rows.transpose(-2, -1).requires_grad_()  # [T, B, 3C, L], channels innermost
    q, k, v = qkv.unflatten(2, (3 * heads, d)).chunk(3, dim=2)
    dense = compact(v, torch.bfloat16)
    assert dense.stride()[-2:] == (1, d) and torch.equal(dense.float(), v)
    assert compact(k.transpose(-2, -1), torch.bfloat16).is_contiguous()
    got = product(v, k.transpose(-2, -1), Plan(torch.bfloat16, ""))
    assert torch.equal(got, v.detach() @ k.detach().transpose(-2, -1))
    out = spike_matmul_chain(v, k.transpose(-2, -1), q, 0.125)
    want = spike_matmul_chain_naive(v, k.transpose(-2, -1), q, 0.125)
    assert torch.equal(out, want)
    for got_g, ref in zip(grads(out, (qkv,)), grads(want, (qkv,)), strict=True):
        torch.testing.assert_close(got_g, ref)


def channels_innermost_qkv(heads: int, d: int, length: int, dtype=torch.float64) -> torch.Tensor:
    """qkv [T, B, 3C, L] as a fused block lays its spikes out: the channels at stride 1."""
    rows = spikes(2, 3, length, 3 * heads * d, dtype=dtype).detach()
    return rows.transpose(-2, -1).requires_grad_()


@pytest.mark.parametrize("layout", ["channels-innermost", "contiguous"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_heads_chain_equals_the_reference(layout, dtype):
    """One qkv tensor in, the chain of its heads out: the reference's values exactly, its
    gradient, and that gradient in qkv's own layout."""
    qkv = channels_innermost_qkv(2, 4, 9, dtype)
    if layout == "contiguous":
        qkv = qkv.detach().contiguous().requires_grad_()
    out = spike_matmul_chain_heads(qkv, 2, 0.125)
    want = spike_matmul_chain_heads_naive(qkv, 2, 0.125)
    assert out.shape == (2, 3, 2, 4, 9) and torch.equal(out, want)
    ((got,), (ref,)) = grads(out, (qkv,)), grads(want, (qkv,))
    torch.testing.assert_close(got, ref)
    assert got.stride() == qkv.stride()


def test_the_heads_chain_on_emulated_tensor_cores(monkeypatch):
    """The tensor-core path (bfloat16 operands converted from the saved bool spikes, float32
    sums; emulated on CPU) gives the reference's values and gradient."""
    bf16 = Plan(torch.bfloat16, "emulated")
    monkeypatch.setattr(sm_autograd, "plan_for", lambda *_, **__: bf16)
    monkeypatch.setattr(sm_autograd, "plan", lambda *_, **__: bf16)
    qkv = channels_innermost_qkv(2, 4, 9, torch.float32)
    out = spike_matmul_chain_heads(qkv, 2, 0.5)
    want = spike_matmul_chain_heads_naive(qkv, 2, 0.5)
    assert torch.equal(out, want)
    for got, ref in zip(grads(out, (qkv,)), grads(want, (qkv,)), strict=True):
        torch.testing.assert_close(got, ref)


def test_the_heads_chain_keeps_one_bool_tensor():
    qkv = channels_innermost_qkv(2, 4, 9)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        spike_matmul_chain_heads(qkv, 2, 0.125)
    assert [(t.dtype, t.stride()) for t in saved] == [(torch.bool, qkv.stride())]


@pytest.mark.parametrize(
    ("qkv", "heads", "scale", "match"),
    [
        (torch.zeros(2, 12, 5), 3, 1.0, "3 x num_heads must divide"),
        (torch.zeros(2, 12, 5), 0, 1.0, "num_heads must be an int"),
        (torch.zeros(12, 5, dtype=torch.int64), 2, 1.0, "floating spikes"),
        (torch.zeros(12), 2, 1.0, "floating spikes"),
        (torch.zeros(2, 12, 5), 2, float("nan"), "finite number"),
    ],
)
def test_bad_heads_chain_inputs_are_refused(qkv, heads, scale, match):
    with pytest.raises(SpikefuseError, match=match):
        spike_matmul_chain_heads(qkv, heads, scale)


def test_the_heads_chain_scales_before_summing_so_float16_gradients_stay_finite():
    """Large float16 output gradients (a GradScaler's) sum to the plain matmuls' magnitudes:
    the scale multiplies a factor of each sum, never an already overflowed sum."""
    qkv = torch.ones(1, 1, 12, 1024, dtype=torch.float16, requires_grad=True)
    g = torch.full((1, 1, 1, 4, 1024), 100.0, dtype=torch.float16)
    (got,) = torch.autograd.grad(spike_matmul_chain_heads(qkv, 1, 0.125), (qkv,), g)
    (ref,) = torch.autograd.grad(spike_matmul_chain_heads_naive(qkv, 1, 0.125), (qkv,), g)
    assert torch.isfinite(ref).all() and torch.equal(got, ref)


@pytest.mark.parametrize("needs", [(True, True), (True, False), (False, True)])
def test_the_gate_equals_mul_and_keeps_bytes(needs):
    """QKFormer's mask * K: mul's values and gradients bit for bit (broadcast summed back), with
    only the operands backward needs saved, as bool."""
    mask = spikes(2, 3, 4, 1, 9).detach().requires_grad_(needs[0])
    k = spikes(2, 3, 4, 6, 9, seed=2).detach().requires_grad_(needs[1])
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = spike_gate(mask, k)
    assert torch.equal(out, mask * k)
    assert [t.dtype for t in saved] == [torch.bool] * sum(needs)
    inputs = [t for t in (mask, k) if t.requires_grad]
    for got, ref in zip(grads(out, inputs), grads(mask * k, inputs), strict=True):
        assert torch.equal(got, ref)


def test_the_gate_traces_as_one_call_and_refuses_integers():
    traced = torch.fx.symbolic_trace(lambda a, b: spike_gate(a, b) + 1)
    assert [n.target for n in traced.graph.nodes if n.op == "call_function"][0] is spike_gate
    with pytest.raises(SpikefuseError, match="floating spikes"):
        spike_gate(torch.ones(2, dtype=torch.int64), torch.ones(2))
