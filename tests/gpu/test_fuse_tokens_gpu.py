"""Spiking transformers' token-wise chains fused on the GPU (cuda kernels): a Linear block on
tokens [T, B, N, C] runs exactly as a Linear block on the [T, B·N, C] view, chains on T and
B merged by hand exactly as their multi-step form, and a small transformer (self-attention on
spike_matmul_chain) matches the unfused model in float32."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from conftest import reldiff
from spikefuse import functional, layer, neuron
from spikefuse.fused import FusedBlock, fuse
from spikefuse.spike_matmul import spike_matmul_chain

pytestmark = [pytest.mark.gpu, pytest.mark.quick]

T, B, N, D = 4, 4, 16, 32


def lif(**kw) -> neuron.LIFNode:
    return neuron.LIFNode(tau=2.0, detach_reset=True, step_mode="m", backend="cuda", **kw)


def step(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Output and gradients (input, and parameters by state-dict key) of one step."""
    x = x.detach().clone().requires_grad_()
    out = model(x)
    weights = torch.linspace(-1, 1, out.numel(), device="cuda").view_as(out)
    (out * weights).sum().backward()
    functional.reset_net(model)
    state = model.state_dict(keep_vars=True)
    grads = {k: p.grad.clone() for k, p in state.items() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return {"out": out.detach(), "input": x.grad, **grads}


def batchnorm_fires(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.bias.fill_(1.0)
    return model


class Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # no bias: BatchNorm removes it, its gradient is rounding noise around 0
        self.fc = layer.Linear(D, D, bias=False, step_mode="m")
        self.bn, self.lif = layer.BatchNorm1d(D, step_mode="m"), lif()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lif(self.bn(self.fc(x).transpose(-1, -2)).transpose(-1, -2))


def test_a_tokens_block_runs_as_a_linear_block_on_the_joined_view():
    torch.manual_seed(0)
    tokens = fuse(batchnorm_fires(Tokens()).cuda())
    assert tokens.fc.spec.tokens
    plain = FusedBlock(copy.deepcopy(tokens.fc.synapse), copy.deepcopy(tokens.fc.bn), lif())
    x = (torch.rand(T, B, N, D, device="cuda") < 0.3).float()
    got = step(tokens, x)
    want = step(plain, x.flatten(1, 2))
    assert torch.equal(got["out"], want["out"].unflatten(1, (B, N)))
    assert 0 < got["out"].mean() < 1
    assert torch.equal(got["input"], want["input"].unflatten(1, (B, N)))
    for key in ("fc.weight", "bn.weight", "bn.bias"):
        block_key = key.replace("fc.", "synapse.")
        assert torch.equal(got[key], want[block_key]), key


class Merged(nn.Module):
    """The papers' code: Conv1d → BN1d on T and B merged by hand, then the neuron."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.lif = nn.Conv1d(D, D, 1, bias=False), nn.BatchNorm1d(D), lif()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, b, c, n = x.shape
        return self.lif(self.bn(self.conv(x.flatten(0, 1))).reshape(t, b, c, n).contiguous())


class MultiStep(nn.Module):
    """The same chain with multi-step layers (the same state-dict keys)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = layer.Conv1d(D, D, 1, bias=False, step_mode="m")
        self.bn, self.lif = layer.BatchNorm1d(D, step_mode="m"), lif()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lif(self.bn(self.conv(x)))


def test_a_chain_merged_by_hand_runs_as_its_multi_step_form():
    torch.manual_seed(0)
    merged = batchnorm_fires(Merged()).cuda()
    multi = MultiStep().cuda()
    multi.load_state_dict(merged.state_dict())
    merged, multi = fuse(merged), fuse(multi)
    assert isinstance(merged.conv, FusedBlock) and isinstance(multi.conv, FusedBlock)
    x = (torch.rand(T, B, D, N, device="cuda") < 0.3).float()
    got, want = step(merged, x), step(multi, x)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key


class Transformer(nn.Module):
    """Self-attention (SeqToANNContainer(Conv1d, BN1d) → LIF, spike_matmul_chain) on
    [T, B, C, N], then a token MLP on [T, B, N, C] and a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = layer.SeqToANNContainer(
            nn.Conv1d(D, 3 * D, 1, bias=False), nn.BatchNorm1d(3 * D)
        )
        self.qkv_lif, self.attn_lif = lif(), lif(v_threshold=0.5)
        self.mlp = Tokens()
        self.head = layer.Linear(D, 10, step_mode="m")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, b, c, n = x.shape
        q, k, v = self.qkv_lif(self.qkv(x)).reshape(t, b, 3, 4, c // 4, n).unbind(2)
        x = x + self.attn_lif(spike_matmul_chain(v, k.transpose(-2, -1), q, 0.125)).reshape(
            t, b, c, n
        )
        return self.head(self.mlp(x.transpose(-1, -2)).mean(2))


def test_a_fused_transformer_matches_unfused(no_tf32):
    """float32 within 1e-4 (normalised) over the output and every gradient, as the fused CNNs."""
    torch.manual_seed(0)
    model = batchnorm_fires(Transformer()).cuda()
    fused, report = fuse(model, return_report=True)
    assert report.fused_fraction == 1.0 and len(report.fused) == 2, str(report)
    x = (torch.rand(T, B, D, N, device="cuda") < 0.3).float()
    want, got = step(model, x), step(fused, x)
    errors = {k: reldiff(got[k], w) for k, w in want.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-4, f"{worst}: normalised error {errors[worst]:.2e}"


@pytest.mark.parametrize("separate", [False, True], ids=["container", "separate"])
def test_a_stem_that_max_pools_the_neuron_input_matches_unfused(no_tf32, separate):
    """Spikformer's stem (SeqToANNContainer(Conv2d, BatchNorm2d, MaxPool2d) → LIF) and
    QKFormer's (four modules), channels with gamma < 0 included: the fused block (pooling
    kernel with the flip and BatchNorm's terms) within 1e-4 of cuDNN's BatchNorm and ATen's
    max pooling, float32, training."""
    torch.manual_seed(0)
    layers = [
        layer.Conv2d(3, D, 3, padding=1, bias=False, step_mode="m"),
        layer.BatchNorm2d(D, step_mode="m"),
        layer.MaxPool2d(3, 2, 1, step_mode="m"),
    ]
    if not separate:
        layers = [
            layer.SeqToANNContainer(
                nn.Conv2d(3, D, 3, 1, 1, bias=False), nn.BatchNorm2d(D), nn.MaxPool2d(3, 2, 1)
            )
        ]
    model = batchnorm_fires(nn.Sequential(*layers, lif())).cuda()
    with torch.no_grad():
        next(m for m in model.modules() if isinstance(m, nn.BatchNorm2d)).weight[::3] *= -1
    fused, report = fuse(model, return_report=True)
    assert report.fused_fraction == 1.0 and fused[0].spec.input_pool is not None, str(report)
    x = torch.rand(T, B, 3, 17, 16, device="cuda")
    want, got = step(model, x), step(fused, x)
    assert got["out"].shape == (T, B, D, 9, 8)
    errors = {k: reldiff(got[k], w) for k, w in want.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-4, f"{worst}: normalised error {errors[worst]:.2e}"
