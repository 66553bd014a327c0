"""spike_matmul and spike_matmul_chain on CUDA tensor cores: the rules pick bfloat16 or float16
operands, and the outputs equal the float64 products bit for bit (rounded once to the output
dtype); gradients are the float32 reference's."""

from __future__ import annotations

import pytest
import torch

from spikefuse import spike_matmul as sm

pytestmark = [pytest.mark.gpu, pytest.mark.quick]


def spikes(*shape, p=0.5, seed=0, dtype=torch.float32):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.rand(*shape, generator=g, device="cuda") < p).to(dtype).requires_grad_()


def assert_grads_close(out, want, inputs):
    g = torch.randn(out.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(9))
    got = torch.autograd.grad(out, inputs, g.to(out.dtype))
    ref = torch.autograd.grad(want, inputs, g.to(want.dtype))
    for x, y in zip(got, ref, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k", [64, 4096])
def test_spike_matmul_is_exact_on_bf16_tensor_cores(k):
    a, b = spikes(4, 8, 96, k, p=0.9), spikes(4, 8, k, 80, seed=1, p=0.9)
    assert sm.spike_matmul_plan(a, b).operands is torch.bfloat16
    out = sm.spike_matmul(a, b)
    assert out.dtype is torch.float32
    assert torch.equal(out, (a.double() @ b.double()).float())
    assert_grads_close(out, sm.spike_matmul_naive(a, b), (a, b))


@pytest.mark.parametrize(
    ("tokens", "operands"), [(64, torch.bfloat16), (256, torch.bfloat16), (1024, torch.float16)]
)
def test_spikformer_attention_is_exact(tokens, operands):
    """((v @ kᵀ) @ q) * 0.125 on [T, B, heads, C/heads, L] spikes: the counts (up to L) on
    bf16 while L ≤ 256, on fp16 up to 2048; the float32 reference (no TF32) gives the same bits."""
    q, k, v = (spikes(2, 4, 8, 48, tokens, seed=s, p=0.8) for s in range(3))
    kt = k.transpose(-2, -1)
    assert sm.spike_matmul_chain_plan(v, kt, q)[1].operands is operands
    out = sm.spike_matmul_chain(v, kt, q, 0.125)
    exact = ((v.double() @ kt.double()) @ q.double() * 0.125).float()
    assert torch.equal(out, exact)
    want = sm.spike_matmul_chain_naive(v, kt, q, 0.125)
    assert torch.equal(out, want)  # the fused spikes' input equals the unfused one
    assert_grads_close(out, want, (q, k, v))


def test_counts_beyond_float16_run_the_plain_matmul():
    v, kt, q = spikes(2, 16, 4096), spikes(2, 4096, 16, seed=1), spikes(2, 16, 8, seed=2)
    plan = sm.spike_matmul_chain_plan(v, kt, q)[1]
    assert plan.operands is None and "2048" in plan.reason
    assert torch.equal(sm.spike_matmul_chain(v, kt, q), sm.spike_matmul_chain_naive(v, kt, q))


def test_bf16_inputs_and_autocast():
    """bf16 spikes give bf16 outputs rounded once from the exact sums; under autocast a float32
    call stays float32 and exact (a plain matmul would round counts above 256)."""
    a, b = spikes(8, 512, dtype=torch.bfloat16), spikes(512, 8, seed=1, dtype=torch.bfloat16)
    out = sm.spike_matmul(a, b)
    assert out.dtype is torch.bfloat16
    assert torch.equal(out, (a.double() @ b.double()).to(torch.bfloat16))
    a32, b32 = a.float(), b.float()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = sm.spike_matmul(a32, b32)
    assert out.dtype is torch.float32
    assert torch.equal(out, (a32.double() @ b32.double()).float())


def assert_gradient_close(got, qkv, heads, g):
    """dL/dqkv within float32 rounding of the float64 chain's gradient (bfloat16: within one
    rounding): sums in another order than cuBLAS's differ by about 1e-5 of the gradient's
    scale, so the absolute tolerance follows that scale."""
    double = qkv.detach().double().requires_grad_()
    want = sm.spike_matmul_chain_heads_naive(double, heads, 0.125)
    (ref,) = torch.autograd.grad(want, double, g.double())
    rtol = 1e-5 if got.dtype is torch.float32 else 2**-7
    torch.testing.assert_close(got.double(), ref, rtol=rtol, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens", [64, 1024])
def test_the_heads_chain_is_exact_and_returns_qkv_gradients_in_its_layout(dtype, tokens):
    """Spikformer's product of one qkv tensor [T, B, 3C, L] with the channels innermost (a fused
    block's spikes): out is the exact chain of its heads rounded once to the spikes' dtype; the
    gradient is the reference's, in qkv's layout."""
    rows = spikes(2, 4, tokens, 3 * 8 * 48, p=0.8, dtype=dtype).detach()
    qkv = rows.transpose(-2, -1).requires_grad_()  # [T, B, 3C, L], channels innermost
    out = sm.spike_matmul_chain_heads(qkv, 8, 0.125)
    exact = sm.spike_matmul_chain_heads_naive(qkv.detach().double(), 8, 0.125)
    assert torch.equal(out, exact.to(dtype))  # rounded once (bfloat16 counts above 256 too)
    g = torch.randn(out.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(9))
    (got,) = torch.autograd.grad(out, qkv, g.to(dtype))
    assert got.stride() == qkv.stride()
    assert_gradient_close(got, qkv, 8, g.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("heads", "head_dim", "tokens", "contiguous"),
    [(12, 32, 64, False), (8, 64, 196, False), (12, 32, 64, True), (3, 16, 37, False)],
)
def test_the_heads_chain_kernels_equal_the_tensor_core_matmuls(
    monkeypatch, dtype, heads, head_dim, tokens, contiguous
):
    """The one-launch kernels (Spikformer-4-384 on CIFAR, and ImageNet's 64-channel heads over
    196 tokens) against the same chain as tensor-core matmuls: forward bit for bit in float32
    (bfloat16: both round the exact value once where the scale is a power of two), channels
    innermost; dL/dqkv within float32 rounding, in qkv's layout; the attention LIF after them
    keeps that layout, so the projection block reads its spikes without a copy."""
    from spikefuse import neuron
    from spikefuse.spike_matmul import autograd as sm_autograd

    rows = spikes(4, 16, tokens, 3 * heads * head_dim, p=0.3, dtype=dtype).detach()
    qkv = rows.transpose(-2, -1)
    qkv = (qkv.contiguous() if contiguous else qkv).requires_grad_()
    g = torch.randn(4, 16, heads, head_dim, tokens, device="cuda", dtype=dtype)
    out = sm.spike_matmul_chain_heads(qkv, heads, 0.125)
    (grad,) = torch.autograd.grad(out, qkv, g)
    assert out.stride(-2) == 1 and out.stride(-1) == heads * head_dim
    assert grad.stride() == qkv.stride()
    with monkeypatch.context() as m:
        m.setattr(sm_autograd, "_heads_kernels", lambda *_: None)
        assert torch.equal(out, sm.spike_matmul_chain_heads(qkv, heads, 0.125))
    assert_gradient_close(grad, qkv, heads, g)
    lif = neuron.LIFNode(step_mode="m", v_threshold=0.5, detach_reset=True)
    attn = lif(out).flatten(2, 3)
    assert attn.stride(-2) == 1  # [T, B, C, L], channels innermost
