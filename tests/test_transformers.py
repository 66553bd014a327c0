"""The spiking transformers of spikefuse.model (SpikingJelly's ``model.spikformer``,
``model.spike_driven_transformer`` and ``model.qkformer``): names, signatures, configurations,
shapes, neurons and training, on tiny configurations (tests/test_attention_against_spikingjelly.py
compares their numbers with SpikingJelly's when it is installed)."""

from __future__ import annotations

import functools
import inspect

import pytest
import torch

from spikefuse import SpikefuseError, functional, model, neuron
from spikefuse.layer.attention import QKAttention, SpikeDrivenSelfAttention, SpikingSelfAttention
from spikefuse.model import qkformer, spike_driven_transformer, spikformer
from spikefuse.train import MODELS
from spikefuse.train.config import NEURONS

TINY_SPIKFORMER = dict(
    T=2, img_size_h=8, img_size_w=8, patch_size=4, num_classes=5, embed_dims=16, num_heads=2,
    depths=1,
)  # fmt: skip
TINY_SDT = dict(T=2, num_classes=5, embed_dims=16, num_heads=2, depths=1, pooling_stat="0011")
TINY_QKFORMER = dict(T=2, num_classes=5, embed_dims=16, num_heads=(1, 2, 2), depths=(1, 1, 1))


def test_names_are_where_spikingjelly_has_them() -> None:
    assert model.Spikformer is spikformer.Spikformer
    assert model.sdt_8_384 is spike_driven_transformer.sdt_8_384
    assert model.qkformer_10_384 is qkformer.qkformer_10_384
    assert model.ms_resnet18 is model.ms_resnet.ms_resnet18
    for missing, instead in [("MaxFormer", "spikformer_cifar10"), ("MASNN", "ms_resnet18")]:
        with pytest.raises(SpikefuseError, match=instead):
            getattr(model, missing)
    with pytest.raises(SpikefuseError, match="distributed model builder"):
        spikformer.SpikformerConfig  # noqa: B018
    with pytest.raises(AttributeError):
        model.spikformer_xl  # noqa: B018


@pytest.mark.parametrize(
    ("builder", "parameters"),
    [
        (spikformer.spikformer_ti, "T=4 in_channels=3 img_size_h=224 img_size_w=224 num_classes=1000"),
        (spikformer.spikformer_s, "T=4 in_channels=3 img_size_h=224 img_size_w=224 num_classes=1000"),
        (spikformer.spikformer_cifar10, "T=4 num_classes=10"),
        (spike_driven_transformer.sdt_8_384, "T=4 in_channels=3 num_classes=1000"),
        (qkformer.qkformer_10_384, "T=4 in_channels=3 num_classes=1000"),
    ],
)  # fmt: skip
def test_builders_take_spikingjellys_arguments(builder, parameters: str) -> None:
    signature = inspect.signature(builder).parameters
    expected = parameters.split() + ["spiking_neuron=None", "**kwargs"]
    shown = [
        f"{n}={p.default}" if p.default is not inspect.Parameter.empty else f"**{n}"
        for n, p in signature.items()
    ]
    assert shown == expected


def test_builders_build_the_papers_configurations(monkeypatch: pytest.MonkeyPatch) -> None:
    for init in ("trunc_normal_", "kaiming_uniform_", "uniform_"):  # the slow part, unused here
        monkeypatch.setattr(torch.nn.init, init, lambda tensor, *_, **__: tensor)
    built()


def built() -> None:
    cifar = spikformer.spikformer_cifar10()
    assert (cifar.embed_dims, cifar.num_heads, cifar.depths, cifar.num_classes) == (384, 12, 4, 10)
    assert cifar.patch_embed.patch_size == 4 and cifar.patch_embed.num_patches == 64
    assert isinstance(cifar.blocks[0].attn, SpikingSelfAttention)
    ti = spikformer.spikformer_ti()
    assert (ti.embed_dims, ti.num_heads, ti.depths, ti.patch_embed.num_patches) == (256, 8, 4, 196)
    sdt = spike_driven_transformer.sdt_8_384(num_classes=10)
    assert len(sdt.blocks) == 8 and isinstance(sdt.blocks[0].attn, SpikeDrivenSelfAttention)
    assert sdt.blocks[0].attn.num_heads == 8 and sdt.head.in_features == 384
    qkf = qkformer.qkformer_10_384(num_classes=10)
    assert [len(s) for s in (qkf.stage1, qkf.stage2, qkf.stage3)] == [1, 2, 7]
    assert isinstance(qkf.stage1[0].attn, QKAttention)
    assert isinstance(qkf.stage3[0].attn, SpikingSelfAttention)
    assert [s[0].attn.num_heads for s in (qkf.stage1, qkf.stage2, qkf.stage3)] == [6, 6, 6]


@pytest.mark.parametrize(
    ("cls", "config", "out"),
    [
        (spikformer.Spikformer, TINY_SPIKFORMER, (2, 3, 5)),
        (spike_driven_transformer.SpikeDrivenTransformer, TINY_SDT, (3, 5)),
        (qkformer.QKFormer, TINY_QKFORMER, (3, 5)),
    ],
)
def test_tiny_models_run_images_and_sequences_and_train(cls, config, out) -> None:
    torch.manual_seed(0)
    net = cls(**config)
    images = torch.rand(3, 3, 8, 8)
    y = net(images)
    assert y.shape == out
    functional.reset_net(net)
    torch.testing.assert_close(net(images.unsqueeze(0).repeat(2, 1, 1, 1, 1)), y)
    functional.reset_net(net)
    y.sum().backward()
    assert all(p.grad is not None for p in net.parameters())
    with pytest.raises(SpikefuseError, match="4D image input"):
        net(torch.rand(3, 8, 8))


@pytest.mark.parametrize(
    ("cls", "config"),
    [
        (spikformer.Spikformer, TINY_SPIKFORMER),
        (spike_driven_transformer.SpikeDrivenTransformer, TINY_SDT),
        (qkformer.QKFormer, TINY_QKFORMER),
    ],
)
def test_any_neuron_class_runs_every_neuron(cls, config) -> None:
    net = cls(**config, spiking_neuron=neuron.IFNode, v_threshold=0.75)
    neurons = [m for m in net.modules() if isinstance(m, neuron.BaseNode)]
    assert neurons and all(
        isinstance(m, neuron.IFNode) and m.v_threshold == 0.75 and m.step_mode == "m"
        for m in neurons
    )
    assert net(torch.rand(2, 3, 8, 8)).isfinite().all()


def test_default_neurons_follow_spikingjellys_positions() -> None:
    net = spikformer.Spikformer(**TINY_SPIKFORMER, tau=3.0)
    block = net.blocks[0]
    assert block.mlp.neuron1.tau == 3.0 and net.patch_embed.stages[0].neuron.tau == 3.0
    assert block.attn.qkv_lif.tau == 2.0  # the attention keeps its own tau (as there)
    assert block.attn.attn_lif.v_threshold == 0.5 and block.mlp.neuron1.detach_reset is True
    sdt = spike_driven_transformer.SpikeDrivenTransformer(**TINY_SDT)
    assert sdt.head_lif.detach_reset is False and sdt.blocks[0].attn.q_lif.detach_reset is True


def test_spikformer_initialises_as_spikingjelly_does() -> None:
    net = spikformer.Spikformer(**TINY_SPIKFORMER)
    with torch.no_grad():
        assert 0.01 < float(net.blocks[0].mlp.fc1[0].weight.std()) < 0.03  # truncated normal
        assert float(net.head.bias.abs().max()) == 0.0
        bn = net.blocks[0].attn.qkv_conv_bn[1]
        assert bool((bn.weight == 1).all()) and bool((bn.bias == 0).all())
    assert net.head.step_mode == "m"


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: spikformer.Spikformer(**{**TINY_SPIKFORMER, "patch_size": 8}), "patch_size=4 or 16"),
        (lambda: spike_driven_transformer.SpikeDrivenTransformer(pooling_stat="012"), "0/1 mask"),
        (lambda: qkformer.QKFormer(num_heads=(1, 2)), "three stage values"),
        (lambda: qkformer.QKFormer(embed_dims=30), "divisible by 4"),
        (lambda: spikformer.Spikformer(**{**TINY_SPIKFORMER, "num_heads": 3}), "num_heads"),
    ],
)  # fmt: skip
def test_bad_configurations_are_refused(build, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build()


@pytest.mark.parametrize(
    "name", ["spikformer-2-128-cifar", "sdt-2-128-cifar", "qkformer-3-128-cifar"]
)
def test_the_training_cli_builds_them_per_step(name: str) -> None:
    spec = MODELS[name]
    lif = spec.build(functools.partial(NEURONS["lif"], backend="torch"), 3, 32, 10)
    thresholds = {m.v_threshold for m in lif.modules() if isinstance(m, neuron.LIFNode)}
    assert thresholds == {0.5, 1.0}  # each position's default LIF
    out = lif(torch.rand(1, 2, 3, 32, 32))  # [T, N, C, H, W] as the loop feeds it
    assert out.dim() == 3 and out.shape[1:] == (2, 10)
    plif = spec.build(functools.partial(NEURONS["plif"], backend="torch"), 2, 32, 4)
    assert all(
        isinstance(m, neuron.ParametricLIFNode)
        for m in plif.modules()
        if isinstance(m, neuron.BaseNode)
    )


def test_the_token_mean_gives_the_means_gradient_dense_in_the_inputs_layout():
    """The transformers' pooling over tokens: the values and gradient of
    ``x.flatten(3).mean(-1)``, the gradient laid out as x (channels innermost) where autograd's
    would be an expanded view; fx traces it as one call."""
    from torch import fx

    from spikefuse.model._tokens import token_mean

    g = torch.randn(2, 3, 8, dtype=torch.float64)
    rows = torch.randn(2, 3, 4, 5, 8, dtype=torch.float64)
    for x in (rows.permute(0, 1, 4, 2, 3), rows.permute(0, 1, 4, 2, 3)[..., ::2]):
        x = x.detach().requires_grad_()
        (got,) = torch.autograd.grad(token_mean(x), x, g)
        (want,) = torch.autograd.grad(x.flatten(3).mean(-1), x, g)
        assert torch.equal(token_mean(x), x.flatten(3).mean(-1)) and torch.equal(got, want)
        if x.shape[-1] == 5:  # the whole permuted tensor (the slice has gaps)
            assert got.stride() == x.stride()
    traced = fx.symbolic_trace(lambda t: token_mean(t) * 2)
    assert [n.target for n in traced.graph.nodes if n.op == "call_function"][0] is token_mean
