"""Optional: spikefuse's attention layers and spiking transformers against an installed
SpikingJelly 2.0 (skipped when it is not importable; e.g. ``pip install --no-deps --target
/tmp/sj spikingjelly==2.0.0 loguru`` and ``PYTHONPATH=src:/tmp/sj``). SpikingJelly's state dict
loads into ours; the same input then gives the same outputs, input gradients and parameter
gradients in float64 (within 1e-10 times the largest magnitude, at least 1: random weights give
gradients in the thousands; parameter gradients on the model's largest one)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

pytest.importorskip("spikingjelly.activation_based")
from spikingjelly.activation_based import functional as sj_functional  # noqa: E402
from spikingjelly.activation_based import neuron as sj_neuron  # noqa: E402
from spikingjelly.activation_based.layer import attention as sj_attention  # noqa: E402
from spikingjelly.activation_based.model import (  # noqa: E402
    qkformer as sj_qkformer,
)
from spikingjelly.activation_based.model import (  # noqa: E402
    spike_driven_transformer as sj_sdt,
)
from spikingjelly.activation_based.model import (  # noqa: E402
    spikformer as sj_spikformer,
)

from spikefuse import functional, neuron  # noqa: E402
from spikefuse.layer import attention  # noqa: E402
from spikefuse.model import qkformer, spike_driven_transformer, spikformer  # noqa: E402

TOLERANCE = 1e-10
NEURONS = {"default": (None, None), "if": (sj_neuron.IFNode, neuron.IFNode)}
NEURONS["plif"] = (sj_neuron.ParametricLIFNode, neuron.ParametricLIFNode)


def agree(make: Callable[..., nn.Module], kind: str, x: torch.Tensor, **kwargs) -> None:
    """``make(spiking_neuron=...)`` from each library, SpikingJelly's weights randomised and
    loaded into ours; a training-mode forward and backward, twice (state carried over)."""
    sj_class, ours_class = NEURONS[kind]
    torch.manual_seed(0)
    theirs = make("sj", spiking_neuron=sj_class, **kwargs).double()
    ours = make("ours", spiking_neuron=ours_class, **kwargs).double()
    assert list(ours.state_dict()) == list(theirs.state_dict())
    with torch.no_grad():
        for p in theirs.parameters():
            p.uniform_(-1, 1) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    ours.load_state_dict(theirs.state_dict())
    for _ in range(2):
        inputs = [x.clone().requires_grad_() for _ in range(2)]
        outputs = [module(i) for module, i in zip((theirs, ours), inputs, strict=True)]
        weight = torch.randn_like(outputs[0])
        for out in outputs:
            (out * weight).sum().backward()
        close(outputs[1], outputs[0])
        close(inputs[1].grad, inputs[0].grad)
        # a gradient that is 0 in exact arithmetic (a bias before a training-mode BatchNorm)
        # is rounding noise of the size of the terms it sums: compare on the largest gradient
        largest = max(p.grad.abs().max().item() for p in theirs.parameters())
        for a, b in zip(theirs.parameters(), ours.parameters(), strict=True):
            close(b.grad, a.grad, largest)
        sj_functional.reset_net(theirs)
        functional.reset_net(ours)
    for a, b in zip(theirs.state_dict().values(), ours.state_dict().values(), strict=True):
        close(b, a)


def close(actual: torch.Tensor | None, expected: torch.Tensor | None, scale: float = 0.0) -> None:
    assert actual is not None and expected is not None
    scale = max(1.0, scale, expected.abs().max().item() if expected.numel() else 0.0)
    torch.testing.assert_close(actual, expected, rtol=0, atol=TOLERANCE * scale)


def pick(sj_module, ours_module, name: str) -> Callable[..., nn.Module]:
    return lambda side, **kw: getattr(sj_module if side == "sj" else ours_module, name)(**kw)


def spike_input(*shape: int) -> torch.Tensor:
    return (torch.rand(*shape, dtype=torch.float64) > 0.5).double()


@pytest.mark.parametrize("kind", sorted(NEURONS))
@pytest.mark.parametrize(
    "name", ["SpikingSelfAttention", "QKAttention", "TokenQKAttention", "ChannelQKAttention"]
)
def test_token_attentions_agree(name: str, kind: str) -> None:
    torch.manual_seed(1)
    agree(pick(sj_attention, attention, name), kind, spike_input(2, 3, 16, 6), dim=16, num_heads=4)


@pytest.mark.parametrize("kind", sorted(NEURONS))
def test_spike_driven_self_attention_agrees(kind: str) -> None:
    torch.manual_seed(1)
    x = torch.randn(2, 3, 16, 2, 3, dtype=torch.float64) * 2
    agree(pick(sj_attention, attention, "SpikeDrivenSelfAttention"), kind, x, dim=16, num_heads=4)


@pytest.mark.parametrize("dimension", [2, 4])
def test_temporal_wise_attention_agrees(dimension: int) -> None:
    def make(side: str, spiking_neuron=None) -> nn.Module:
        return pick(sj_attention, attention, "TemporalWiseAttention")(
            side, T=4, reduction=2, dimension=dimension
        )

    shape = (4, 3, 8) if dimension == 2 else (4, 3, 8, 2, 2)
    agree(make, "default", torch.randn(*shape, dtype=torch.float64))


@pytest.mark.parametrize(
    "switches", [(True, True, True), (True, False, True), (False, True, False)]
)
@pytest.mark.parametrize("kernel_size", [3, 7])
def test_multi_dimensional_attention_agrees(switches, kernel_size: int) -> None:
    def make(side: str, spiking_neuron=None) -> nn.Module:
        build = pick(sj_attention, attention, "MultiDimensionalAttention")
        t, c, s = switches
        return build(
            side, T=4, C=8, reduction_t=2, reduction_c=2, kernel_size=kernel_size,
            use_temporal=t, use_channel=c, use_spatial=s,
        )  # fmt: skip

    agree(make, "default", torch.randn(4, 3, 8, 5, 5, dtype=torch.float64))


TINY = {
    "spikformer": (
        pick(sj_spikformer, spikformer, "Spikformer"),
        dict(T=2, img_size_h=8, img_size_w=8, patch_size=4, num_classes=5, embed_dims=32,
             num_heads=4, depths=2),
    ),
    "sdt": (
        pick(sj_sdt, spike_driven_transformer, "SpikeDrivenTransformer"),
        dict(T=2, num_classes=5, embed_dims=32, num_heads=4, depths=2, pooling_stat="0011"),
    ),
    "sdt-mlp-residual": (
        pick(sj_sdt, spike_driven_transformer, "SpikeDrivenTransformer"),
        dict(T=2, num_classes=5, embed_dims=16, num_heads=2, depths=1, mlp_ratio=1.0),
    ),
    "qkformer": (
        pick(sj_qkformer, qkformer, "QKFormer"),
        dict(T=2, num_classes=5, embed_dims=32, num_heads=(2, 2, 4), depths=(1, 1, 1)),
    ),
    "qkformer-channel": (
        pick(sj_qkformer, qkformer, "QKFormer"),
        dict(T=2, num_classes=5, embed_dims=16, num_heads=(1, 2, 2), depths=(1, 1, 1),
             qka_type="channel"),
    ),
}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(NEURONS))
@pytest.mark.parametrize("model", sorted(TINY))
def test_transformers_agree(model: str, kind: str) -> None:
    make, config = TINY[model]
    torch.manual_seed(2)
    agree(make, kind, torch.rand(2, 3, 8, 8, dtype=torch.float64), **config)


def test_spikformer_neuron_kwargs_reach_the_same_neurons() -> None:
    """With the default neurons, tau and detach_reset reach the MLP's, not the attention's."""
    make = pick(sj_spikformer, spikformer, "Spikformer")
    config = dict(TINY["spikformer"][1], tau=3.0, detach_reset=False, v_threshold=0.75)
    agree(make, "default", torch.rand(2, 3, 8, 8, dtype=torch.float64), **config)


@pytest.mark.parametrize(
    ("module_pair", "name"),
    [
        ((sj_spikformer, spikformer), "spikformer_cifar10"),
        ((sj_spikformer, spikformer), "spikformer_ti"),
        ((sj_sdt, spike_driven_transformer), "sdt_8_384"),
        ((sj_qkformer, qkformer), "qkformer_10_384"),
    ],
)
def test_builders_have_spikingjellys_parameters(module_pair, name: str) -> None:
    theirs, ours = (getattr(module, name)(num_classes=7) for module in module_pair)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {
        k: v.shape for k, v in theirs.state_dict().items()
    }
    assert list(ours.state_dict()) == list(theirs.state_dict())
