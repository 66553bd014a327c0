"""SpikingSelfAttention on CUDA: its (V Kᵀ) Q product of spikes runs on tensor cores
(spike_matmul_chain) and equals the float64 product bit for bit (rounded once to the spikes'
dtype), in float32 and under bf16 autocast; the fused tiny Spikformer trains a step."""

from __future__ import annotations

import pytest
import torch

from spikefuse import functional
from spikefuse.fused import fuse
from spikefuse.layer import attention
from spikefuse.model import spikformer

pytestmark = [pytest.mark.gpu, pytest.mark.quick]


@pytest.mark.parametrize("amp", [False, True])
def test_spiking_self_attention_product_is_exact_on_cuda(amp: bool) -> None:
    torch.manual_seed(0)
    ssa = attention.SpikingSelfAttention(64, 4).cuda()
    seen: dict[str, torch.Tensor] = {}
    ssa.qkv_lif.register_forward_hook(lambda _, __, out: seen.__setitem__("qkv", out))
    ssa.attn_lif.register_forward_pre_hook(lambda _, args: seen.__setitem__("attn", args[0]))
    x = (torch.rand(2, 3, 64, 96, device="cuda") < 0.5).float()
    with torch.autocast("cuda", torch.bfloat16, enabled=amp):
        ssa(x)
    q, k, v = seen["qkv"].double().reshape(2, 3, 3, 4, 16, 96).unbind(2)
    want = ((v @ k.transpose(-2, -1)) @ q) * 0.125
    # in the spikes' dtype (bfloat16 under autocast when the BatchNorm gives it): rounded once
    assert seen["attn"].dtype == seen["qkv"].dtype
    assert torch.equal(seen["attn"], want.to(seen["attn"].dtype))
    assert want.abs().sum() > 0
    functional.reset_net(ssa)


def test_fused_tiny_spikformer_trains_a_step_on_cuda() -> None:
    torch.manual_seed(0)
    net = spikformer.Spikformer(
        T=2, img_size_h=32, img_size_w=32, patch_size=4, num_classes=10,
        embed_dims=64, num_heads=4, depths=2,
    ).cuda()  # fmt: skip
    fused, report = fuse(net, return_report=True)
    assert any(".attn." in c.block for c in report.fused), str(report)
    out = fused(torch.rand(4, 3, 32, 32, device="cuda")).mean(0)
    assert out.shape == (4, 10) and torch.isfinite(out).all()
    out.sum().backward()
    assert all(p.grad is not None for p in fused.parameters() if p.requires_grad)
