"""fuse() on spiking transformers' token-wise chains: Conv1d/Linear/Conv2d(1x1) → BatchNorm →
neuron on tokens [T, B, C, N] and [T, B, N, C] (the BatchNorm1d of a Linear between two
transposes), as SpikingJelly's Spikformer, Spike-driven Transformer and QKFormer write them:
fused equals unfused (float64: spikes equal, gradients within rounding) in every memory mode,
and the report says what fused and why the rest did not."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from spikefuse import functional, layer, neuron
from spikefuse import spike_matmul as sm
from spikefuse.errors import SpikefuseError
from spikefuse.fused import FusedBlock, MaxPoolCodes, SpikePool, fuse
from spikefuse.fused.recompute import is_spikes, mark_spikes

T, B, N, D = 3, 2, 6, 8
FP64_TOL = dict(rtol=1e-9, atol=1e-11)


def lif(**kw) -> neuron.LIFNode:
    return neuron.LIFNode(tau=2.0, detach_reset=True, step_mode="m", backend="torch", **kw)


def seq_conv1d_bn(c_in: int, c_out: int) -> layer.SeqToANNContainer:
    return layer.SeqToANNContainer(
        nn.Conv1d(c_in, c_out, kernel_size=1, bias=False), nn.BatchNorm1d(c_out)
    )


class SelfAttention(nn.Module):
    """Spikformer's spiking self-attention on [T, B, C, N]: SeqToANNContainer(Conv1d, BN1d) →
    LIF for q, k, v and the projection, ((v @ kᵀ) @ q) * 0.125 → LIF between them."""

    def __init__(self, dim: int = D, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv_conv_bn, self.qkv_lif = seq_conv1d_bn(dim, 3 * dim), lif()
        self.attn_lif = lif(v_threshold=0.5)
        self.proj_conv_bn, self.proj_lif = seq_conv1d_bn(dim, dim), lif()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, b, c, n = x.shape
        qkv = self.qkv_lif(self.qkv_conv_bn(x)).reshape(t, b, 3, self.heads, c // self.heads, n)
        q, k, v = qkv.unbind(2)
        x = sm.spike_matmul_chain(v, k.transpose(-2, -1), q, 0.125)  # one fx node, however called
        x = self.attn_lif(x).reshape(t, b, c, n)
        return self.proj_lif(self.proj_conv_bn(x))


class TokenMLP(nn.Module):
    """An MLP on tokens [T, B, N, C]: Linear → BatchNorm1d over C between two transposes →
    LIF, written three ways (transpose, permute with .contiguous(), torch.transpose)."""

    def __init__(self, dim: int = D, hidden: int = 2 * D) -> None:
        super().__init__()
        self.fc1 = layer.Linear(dim, hidden, step_mode="m")
        self.bn1, self.lif1 = layer.BatchNorm1d(hidden, step_mode="m"), lif()
        self.fc2 = layer.Linear(hidden, hidden, bias=False, step_mode="m")
        self.bn2, self.lif2 = layer.BatchNorm1d(hidden, step_mode="m"), lif()
        self.fc3 = nn.Linear(hidden, dim)
        self.bn3, self.lif3 = layer.SeqToANNContainer(nn.BatchNorm1d(dim)), lif()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.lif1(self.bn1(self.fc1(x).transpose(-1, -2)).transpose(-1, -2))
        y = self.bn2(self.fc2(x).permute(0, 1, 3, 2).contiguous())
        x = self.lif2(y.permute(0, 1, 3, 2).contiguous())
        y = self.bn3(torch.transpose(self.fc3(x), 2, 3))
        return self.lif3(torch.transpose(y, 2, 3))


class SDTBlock(nn.Module):
    """A Spike-driven Transformer's Conv2d 1x1 → BatchNorm2d → LIF on [T, B, C, H, W]."""

    def __init__(self, dim: int = D) -> None:
        super().__init__()
        self.conv = layer.Conv2d(dim, dim, 1, bias=False, step_mode="m")
        self.bn, self.lif = layer.BatchNorm2d(dim, step_mode="m"), lif()
        self.seq = layer.SeqToANNContainer(nn.Conv2d(dim, dim, 1, bias=False), nn.BatchNorm2d(dim))
        self.seq_lif = lif()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.seq_lif(self.seq(self.lif(self.bn(self.conv(x)))))


class Transformer(nn.Module):
    """Patch embedding (Conv2d → BN → LIF), an SDT block, flatten to tokens, self-attention
    and an MLP on [T, B, C, N], then the token MLP on [T, B, N, C], with residuals after the
    neurons (as the papers add them)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = layer.SeqToANNContainer(nn.Conv2d(3, D, 3, padding=1), nn.BatchNorm2d(D))
        self.embed_lif = lif()
        self.sdt = SDTBlock()
        self.attn = SelfAttention()
        self.mlp1, self.mlp1_lif = seq_conv1d_bn(D, 2 * D), lif()
        self.mlp2, self.mlp2_lif = seq_conv1d_bn(2 * D, D), lif()
        self.tokens = TokenMLP()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.sdt(self.embed_lif(self.embed(images))).flatten(3)  # [T, B, C, N]
        x = x + self.attn(x)
        x = x + self.mlp2_lif(self.mlp2(self.mlp1_lif(self.mlp1(x))))
        return self.tokens(x.transpose(-1, -2))  # [T, B, N, C]


def randomized(model: nn.Module) -> nn.Module:
    """float64, with BatchNorm affine parameters that make about a third of the neurons fire."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.weight.copy_(torch.rand(m.weight.shape, generator=g) + 0.5)
                m.bias.copy_(torch.rand(m.bias.shape, generator=g) * 1.2 + 0.5)
    return model.double()


def step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The output and the gradients (by state-dict key, the same fused and unfused) of a loss
    weighting every output differently."""
    x = x.detach().clone().requires_grad_()
    out = model(x)
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    (out * weights).sum().backward()
    functional.reset_net(model)
    grads = {k: p.grad for k, p in model.state_dict(keep_vars=True).items() if p.requires_grad}
    return out.detach(), {"input": x.grad, **grads}


def assert_same_step(ref: nn.Module, fused: nn.Module, x: torch.Tensor) -> None:
    out_r, grads_r = step(ref, x)
    out_f, grads_f = step(fused, x)
    assert torch.equal(out_f, out_r)  # spikes, bit for bit
    assert 0.05 < out_r.mean() < 0.95  # neither silent nor saturated
    assert grads_f.keys() == grads_r.keys()
    for key, grad in grads_r.items():
        torch.testing.assert_close(grads_f[key], grad, **FP64_TOL, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.parametrize("memory", ["default", "min"])
def test_a_spiking_transformer_fuses_every_chain_and_computes_the_same(memory):
    ref = randomized(Transformer())
    fused, report = fuse(ref, return_report=True, memory=memory)
    assert report.fused_fraction == 1.0 and len(report.fused) == 10, str(report)
    tokens = [b for b in fused.modules() if isinstance(b, FusedBlock) and b.spec.tokens]
    assert len(tokens) == 3
    images = torch.rand(T, B, 3, 4, 4, dtype=torch.float64)
    assert_same_step(ref, fused, images)
    ref.eval()
    fused.eval()
    assert_same_step(ref, fused, images)


@pytest.mark.parametrize("memory", ["default", "min", "min-chunked"])
def test_pointwise_conv1d_blocks_run_as_channels_last_conv2d_and_compute_the_same(
    memory, monkeypatch
):
    """On CUDA a pointwise Conv1d block runs as the channels-last Conv2d of its [N, C, 1, L]
    view; forced here on the CPU: spikes equal, gradients within rounding, outputs laid out
    channels innermost, in both memory modes (min also in batch chunks) and in eval."""
    from spikefuse.fused import chunked
    from spikefuse.fused.synapse import Synapse

    if memory == "min-chunked":  # every block in chunks of one sample
        monkeypatch.setattr(chunked, "CHUNKED_FROM", 0)
        monkeypatch.setattr(chunked, "CHUNK_BYTES", 1)
        memory = "min"

    cuda_layout = Synapse.runs_channels_last
    monkeypatch.setattr(
        Synapse, "runs_channels_last", lambda self, x: self.pointwise or cuda_layout(self, x)
    )
    planar = []
    run = Synapse._pointwise_run
    monkeypatch.setattr(
        Synapse, "_pointwise_run", lambda self, m, w: planar.append(m.shape) or run(self, m, w)
    )
    ref = randomized(Transformer())
    fused = fuse(ref, memory=memory)
    images = torch.rand(T, B, 3, 4, 4, dtype=torch.float64)
    assert_same_step(ref, fused, images)
    assert len(planar) >= 4  # qkv, proj, mlp1, mlp2 (and the recomputations of "min")
    ref.eval()
    fused.eval()
    assert_same_step(ref, fused, images)
    spikes = fused.mlp1(torch.rand(T, B, D, N, dtype=torch.float64).round())
    assert spikes.flatten(0, 1).transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("memory", ["default", "min"])
def test_token_linear_chains_on_tokens(memory):
    ref = randomized(TokenMLP())
    fused = fuse(ref, memory=memory)
    assert all(isinstance(getattr(fused, f"fc{i}"), FusedBlock) for i in (1, 2, 3))
    assert_same_step(ref, fused, (torch.rand(T, B, N, D) < 0.5).double())


class MergedByHand(nn.Module):
    """The original Spikformer/SDT code: plain single-step layers on T and B merged by hand,
    ``x.flatten(0, 1)`` before the synapse and ``.reshape(T, B, ...)`` before the neuron; on
    tokens [T, B, N, C] (Linear, BatchNorm1d between transposes), [T, B, C, N] (Conv1d) and
    [T, B, C, H, W] (Conv2d 1x1)."""

    def __init__(self) -> None:
        super().__init__()
        self.q_linear, self.q_bn, self.q_lif = nn.Linear(D, D), nn.BatchNorm1d(D), lif()
        self.k_linear, self.k_bn, self.k_lif = nn.Linear(D, D), nn.BatchNorm1d(D), lif()
        self.conv1d, self.bn1d, self.lif1d = nn.Conv1d(D, 2 * D, 1), nn.BatchNorm1d(2 * D), lif()
        self.conv2d = nn.Conv2d(2 * D, D, 1, bias=False)
        self.bn2d, self.lif2d = nn.BatchNorm2d(D), lif()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, b, n, c = x.shape
        x_for_qk = x.flatten(0, 1)
        q = self.q_bn(self.q_linear(x_for_qk).transpose(-1, -2)).transpose(-1, -2)
        q = self.q_lif(q.reshape(t, b, n, c).contiguous())
        k = self.k_linear(x_for_qk)
        k = self.k_lif(self.k_bn(k.transpose(-1, -2)).transpose(-1, -2).view(t, b, n, c))
        y = (q + k).transpose(2, 3).contiguous()  # [T, B, C, N]
        t, b, c, n = y.shape  # T read from the tensor flatten(0, 1) merges
        y = self.bn1d(self.conv1d(y.flatten(0, 1))).reshape(t, b, 2 * c, n).contiguous()
        image = self.lif1d(y).reshape(t, b, 2 * c, 2, n // 2)
        steps, batch, _, h, w = image.shape
        z = self.bn2d(self.conv2d(torch.flatten(image, 0, 1)))
        return self.lif2d(z.reshape(steps, batch, -1, h, w))


@pytest.mark.parametrize("memory", ["default", "min"])
def test_chains_on_time_and_batch_merged_by_hand(memory):
    ref = randomized(MergedByHand())
    fused, report = fuse(ref, return_report=True, memory=memory)
    assert report.fused_fraction == 1.0 and len(report.fused) == 4, str(report)
    assert report.rewritten == ["<model>"]
    assert fused.q_linear.spec.tokens and not fused.conv1d.spec.tokens
    assert_same_step(ref, fused, (torch.rand(T, B, N, D) < 0.5).double())
    ref.eval()
    fused.eval()
    assert_same_step(ref, fused, (torch.rand(T, B, N, D) < 0.5).double())


class UnprovenSteps(nn.Module):
    """A reshape whose first dim is not read from the merged input's shape."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn, self.lif = nn.Linear(D, D), nn.BatchNorm1d(D), lif()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lif(self.bn(self.fc(x.flatten(0, 1))).reshape(T, -1, D))


def test_a_reshape_fuse_cannot_prove_stays_unfused_and_counts_as_a_chain():
    _, report = fuse(UnprovenSteps(), return_report=True)
    assert report.chains == 1 and not report.fused
    assert "must start with T = x.shape[0]" in report.skipped[0].reason


class Untransposed(nn.Module):
    """Linear → transposes that do not bring C to the BatchNorm's channel dim."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = layer.Linear(D, D, step_mode="m")
        self.bn, self.lif = layer.BatchNorm1d(N, step_mode="m"), lif()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lif(self.bn(self.fc(x).transpose(1, 2)).transpose(1, 2))


def test_other_transposes_stay_unfused_with_a_reason():
    fused, report = fuse(Untransposed(), return_report=True)
    assert not report.fused
    (skipped,) = report.skipped
    assert skipped.modules == ("fc",) and ".transpose()" in skipped.reason


def pooled_stem(form: str, node: neuron.LIFNode | None = None) -> nn.Sequential:
    """Conv2d → BatchNorm2d → MaxPool2d(3, 2, 1) → LIF: Spikformer's stem ("container":
    SeqToANNContainer(Conv2d, BatchNorm2d, MaxPool2d), then the neuron) or QKFormer's patch
    embedding ("separate": four multi-step modules)."""
    node = lif() if node is None else node
    if form == "container":
        return nn.Sequential(
            layer.SeqToANNContainer(
                nn.Conv2d(3, D, 3, padding=1, bias=False),
                nn.BatchNorm2d(D),
                nn.MaxPool2d(3, 2, 1),
            ),
            node,
        )
    return nn.Sequential(
        layer.Conv2d(3, D, 3, padding=1, bias=False, step_mode="m"),
        layer.BatchNorm2d(D, step_mode="m"),
        layer.MaxPool2d(3, 2, 1, step_mode="m"),
        node,
    )


@pytest.mark.parametrize("memory", ["default", "min"])
@pytest.mark.parametrize("form", ["container", "separate"])
def test_a_stem_that_max_pools_the_neuron_input_fuses_and_computes_the_same(form, memory):
    """The pooling of the BatchNorm output joins the block: spikes equal, gradients and running
    statistics within rounding, in training and eval; channels with gamma < 0 (their windows
    take the smallest synapse output) included."""
    ref = randomized(pooled_stem(form))
    bn = next(m for m in ref.modules() if isinstance(m, nn.BatchNorm2d))
    with torch.no_grad():
        bn.weight[::3] *= -1
    fused, report = fuse(ref, return_report=True, memory=memory)
    names = ("0", "1") if form == "container" else ("0", "1", "2", "3")
    assert [c.modules for c in report.fused] == [names] and report.fused_fraction == 1.0
    assert isinstance(fused[0], FusedBlock) and fused[0].spec.input_pool is not None
    images = torch.rand(T, B, 3, 7, 6, dtype=torch.float64)
    assert_same_step(ref, fused, images)
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(fused.state_dict()[key], value, **FP64_TOL)
    ref.eval()
    fused.eval()
    assert_same_step(ref, fused, images)


def test_a_block_that_pools_the_neuron_input_compiles_whole_and_computes_the_same():
    """Under torch.compile the block runs torch's BatchNorm and max pooling before the
    neuron's op: no graph break, the eager block's spikes."""
    fused = fuse(randomized(pooled_stem("container")))
    images = torch.rand(T, B, 3, 7, 6, dtype=torch.float64)
    compiled = torch.compile(copy.deepcopy(fused), backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(images), fused(images))


def test_a_pooling_of_the_neuron_input_that_cannot_join_is_reported():
    """An average pooling between BatchNorm and the neuron stays unfused, with the reason."""
    stem = pooled_stem("separate")
    stem[2] = layer.AvgPool2d(2, step_mode="m")
    _, report = fuse(stem, return_report=True)
    assert (report.chains, report.fused_fraction) == (1, 0.0)
    (skipped,) = report.skipped
    assert skipped.is_chain and skipped.modules == ("0", "1", "2", "3")
    assert "'2': AvgPool2d pools the neuron's input" in skipped.reason
    with pytest.raises(SpikefuseError, match="only a block with BatchNorm pools"):
        FusedBlock(nn.Conv2d(3, D, 3), None, lif(), input_pool=nn.MaxPool2d(2))
    with pytest.raises(SpikefuseError, match="only Conv2d blocks pool the neuron's input"):
        FusedBlock(nn.Linear(D, D), nn.BatchNorm1d(D), lif(), input_pool=nn.MaxPool2d(2))
    with pytest.raises(SpikefuseError, match="neither pools its spikes nor adds a residual"):
        conv, bn = nn.Conv2d(3, D, 3), nn.BatchNorm2d(D)
        FusedBlock(conv, bn, lif(), pool=nn.AvgPool2d(2), input_pool=nn.MaxPool2d(2))


def test_a_stem_that_pools_twice_fuses_the_first_pooling_only():
    """A pooling of the spikes after a block that pools its neuron's input stays a SpikePool
    (a block pools one or the other), with the same output."""
    ref = randomized(nn.Sequential(*pooled_stem("container"), layer.AvgPool2d(2, step_mode="m")))
    fused, report = fuse(ref, return_report=True)
    assert report.fused_fraction == 1.0 and report.pools == ["2"], str(report)
    assert isinstance(fused[2], SpikePool) and fused[0].spec.pool is None
    assert_same_step(ref, fused, torch.rand(T, B, 3, 8, 8, dtype=torch.float64))


class PooledSum(nn.Module):
    """Conv2d → BatchNorm2d, plus a shortcut, then MaxPool2d → neuron: the pooling takes the
    sum, not BatchNorm's output."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = layer.Conv2d(3, D, 3, padding=1, bias=False, step_mode="m")
        self.bn = layer.BatchNorm2d(D, step_mode="m")
        self.pool = layer.MaxPool2d(3, 2, 1, step_mode="m")
        self.lif = lif()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lif(self.pool(self.bn(self.conv(x)) + x.mean(2, keepdim=True)))


def test_a_pooling_after_a_residual_addition_stays_unfused_with_the_reason():
    _, report = fuse(PooledSum(), return_report=True)
    (skipped,) = report.skipped
    assert skipped.is_chain and "a block pools or adds, not both" in skipped.reason


@pytest.mark.parametrize("train", [True, False])
def test_a_max_pooling_before_an_unfused_neuron_keeps_byte_codes_and_computes_the_same(train):
    """Where the chain stays unfused (a neuron that stores V), the stem's max pooling runs as
    spike_max_pool2d: values equal, gradients within rounding (the gather sums a window's
    gradients in another order than ATen's CPU scatter)."""
    stem = randomized(pooled_stem("container", lif(store_v_seq=True)))
    fused, report = fuse(stem, return_report=True)
    assert report.fused_fraction == 0.0
    assert isinstance(fused[0][2], MaxPoolCodes)
    assert report.spike_max_pools == ["0.2"], str(report)
    stem.train(train)
    fused.train(train)
    images = torch.rand(T, B, 3, 6, 6, dtype=torch.float64)
    out_r, grads_r = step(stem, images)
    out_f, grads_f = step(fused, images)
    assert torch.equal(out_f, out_r)
    assert grads_f.keys() == grads_r.keys()
    for key, grad in grads_r.items():
        torch.testing.assert_close(grads_f[key], grad, **FP64_TOL, msg=lambda m, k=key: f"{k}: {m}")


def test_a_tokens_block_takes_tokens_only():
    fc, bn = nn.Linear(D, D), nn.BatchNorm1d(D)
    block = FusedBlock(fc, bn, lif(), tokens=True)
    assert block(torch.rand(T, B, N, D)).shape == (T, B, N, D)
    with pytest.raises(SpikefuseError, match=r"tokens \[T, B, N, F\]"):
        block(torch.rand(T, B, D))
    with pytest.raises(SpikefuseError, match="tokens=True takes a Linear"):
        FusedBlock(nn.Conv1d(D, D, 1), nn.BatchNorm1d(D), lif(), tokens=True)
    with pytest.raises(SpikefuseError, match="tokens must be a bool"):
        FusedBlock(fc, bn, lif(), tokens=1)


def test_a_tokens_block_sees_its_input_as_spikes_and_tags_its_output():
    """The joined view [T, B·N, F] keeps the input's tag (spikes: 1-bit packable, bf16-exact
    for the Linear), and the output split back is tagged as spikes too."""
    seen = []
    block = FusedBlock(nn.Linear(D, D), nn.BatchNorm1d(D), lif(), tokens=True)
    x = mark_spikes((torch.rand(T, B, N, D) < 0.5).float())
    original = block._run
    block._run = lambda joined, residual=None: seen.append(is_spikes(joined)) or original(joined)
    out = block(x)
    assert seen == [True] and is_spikes(out)
