"""spikefuse.layer.attention: SpikingJelly's attention layers, checked against its formulas
(written out here), its parameter names and its constructor contract, without SpikingJelly
(tests/test_attention_against_spikingjelly.py compares with it when it is installed)."""

from __future__ import annotations

import pytest
import torch

import spikefuse
from spikefuse import SpikefuseError, functional, layer, neuron
from spikefuse.layer import attention

BN1 = ["weight", "bias", "running_mean", "running_var", "num_batches_tracked"]
TOKEN_ATTENTIONS = ["SpikingSelfAttention", "QKAttention", "TokenQKAttention", "ChannelQKAttention"]


def spikes(*shape: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.rand(*shape, generator=generator, dtype=torch.float64) > 0.5).double()


def randomised(module: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """Weights in [-1, 1] and BatchNorm scales in [0.5, 1.5], so the neurons fire often."""
    torch.manual_seed(seed)
    module.double()
    with torch.no_grad():
        for p in module.parameters():
            p.uniform_(-1, 1) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return module


def capture(module: torch.nn.Module, *names: str) -> dict[str, torch.Tensor]:
    """Record the input (``name + '.in'``) and output of the named submodules."""
    seen: dict[str, torch.Tensor] = {}
    for name in names:

        def hook(_m, args, out, name=name):
            seen[name + ".in"], seen[name] = args[0].detach(), out.detach()

        module.get_submodule(name).register_forward_hook(hook)
    return seen


def test_the_module_and_its_names_are_where_spikingjelly_has_them() -> None:
    from spikefuse.layer import attention as imported

    assert imported is attention is spikefuse.layer.attention
    assert sorted(attention.__all__) == sorted(
        TOKEN_ATTENTIONS
        + ["SpikeDrivenSelfAttention", "TemporalWiseAttention", "MultiDimensionalAttention"]
    )
    for name in attention.__all__:
        assert getattr(layer, name) is getattr(attention, name)


def test_parameter_names_are_spikingjellys() -> None:
    conv_bn = lambda p: [f"{p}.0.weight"] + [f"{p}.1.{n}" for n in BN1]  # noqa: E731
    assert list(attention.SpikingSelfAttention(8, 2).state_dict()) == (
        conv_bn("qkv_conv_bn") + conv_bn("proj_conv_bn")
    )
    assert list(attention.ChannelQKAttention(8, 2).state_dict()) == (
        conv_bn("qk_conv_bn") + conv_bn("proj_conv_bn")
    )
    sdsa = [f"{q}_{part}" for q in "qkv" for part in ["conv.weight"] + [f"bn.{n}" for n in BN1]]
    sdsa += ["proj_conv.weight", "proj_conv.bias"] + [f"proj_bn.{n}" for n in BN1]
    assert list(attention.SpikeDrivenSelfAttention(8, 2).state_dict()) == sdsa
    assert list(attention.TemporalWiseAttention(4, 2).state_dict()) == [
        "sharedMLP.0.weight",
        "sharedMLP.2.weight",
    ]
    mda = attention.MultiDimensionalAttention(4, 8, 2, 2)
    assert list(mda.state_dict()) == [
        "ta.sharedMLP.0.weight",
        "ta.sharedMLP.2.weight",
        "ca.sharedMLP.0.weight",
        "ca.sharedMLP.2.weight",
        "sa.conv.weight",
    ]


def test_default_neurons_are_spikingjellys_lif_per_position() -> None:
    ssa = attention.SpikingSelfAttention(8, 2)
    for name in ("qkv_lif", "attn_lif", "proj_lif"):
        lif = getattr(ssa, name)
        assert isinstance(lif, neuron.LIFNode) and lif.step_mode == "m"
        assert lif.tau == 2.0 and lif.detach_reset is True
        assert lif.v_threshold == (0.5 if name == "attn_lif" else 1.0)
    assert (ssa.scale, ssa.head_dim, ssa.num_heads) == (0.125, 4, 2)
    assert attention.SpikeDrivenSelfAttention(8, 2).attn_lif.v_threshold == 0.5
    # kwargs override the defaults; a neuron class takes kwargs alone
    assert attention.QKAttention(8, 2, tau=3.0).attn_lif.tau == 3.0
    custom = attention.SpikeDrivenSelfAttention(8, 2, spiking_neuron=neuron.IFNode, v_threshold=2.0)
    assert all(
        isinstance(m, neuron.IFNode) and m.v_threshold == 2.0 and m.detach_reset is False
        for m in (custom.shortcut_lif, custom.q_lif, custom.attn_lif)
    )
    with pytest.raises(ValueError, match="step_mode='m'"):
        attention.SpikingSelfAttention(8, 2, step_mode="s")


@pytest.mark.parametrize("name", TOKEN_ATTENTIONS)
def test_token_attentions_keep_the_shape_and_train(name: str) -> None:
    module = randomised(getattr(attention, name)(8, 2))
    x = spikes(2, 3, 8, 5).requires_grad_()
    y = module(x)
    assert y.shape == x.shape and set(y.unique().tolist()) <= {0.0, 1.0}
    (y * torch.randn_like(y)).sum().backward()
    assert x.grad is not None and all(p.grad is not None for p in module.parameters())
    assert "dim=8, num_heads=2" in repr(module)


def test_spiking_self_attention_is_scaled_v_kt_q() -> None:
    """The attention neuron's input is 0.125 · (V Kᵀ) Q per head, [C/heads, L]."""
    ssa = randomised(attention.SpikingSelfAttention(8, 2))
    seen = capture(ssa, "qkv_lif", "attn_lif", "proj_conv_bn")
    ssa(spikes(2, 3, 8, 5))
    qkv = seen["qkv_lif"].reshape(2, 3, 3, 2, 4, 5)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    expected = torch.einsum("tnhcl,tnhdl,tnhdm->tnhcm", v, k, q) * 0.125
    torch.testing.assert_close(seen["attn_lif.in"], expected, rtol=0, atol=0)
    assert seen["attn_lif.in"].abs().sum() > 0
    torch.testing.assert_close(seen["proj_conv_bn.in"], seen["attn_lif"].reshape(2, 3, 8, 5))


def test_spiking_self_attention_multiplies_its_spikes_with_spike_matmul_chain_heads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Q, K, V are neuron outputs, so the product goes through the exact spike-product path
    (tensor cores on CUDA), on qkv_lif's spikes whole, with SpikingJelly's heads and scale."""
    calls = []

    def chain(qkv: torch.Tensor, num_heads: int, scale: float) -> torch.Tensor:
        calls.append((tuple(qkv.shape), num_heads, scale))
        assert set(qkv.unique().tolist()) <= {0.0, 1.0}
        q, k, v = qkv.unflatten(2, (3 * num_heads, -1)).chunk(3, dim=2)
        return ((v @ k.transpose(-2, -1)) @ q) * scale

    monkeypatch.setattr(attention, "spike_matmul_chain_heads", chain)
    randomised(attention.SpikingSelfAttention(8, 2))(spikes(2, 3, 8, 5))
    assert calls == [((2, 3, 24, 5), 2, 0.125)]


@pytest.mark.parametrize("qka_type", ["token", "channel"])
def test_qk_attention_gates_k_with_a_spiking_sum_of_q(qka_type: str) -> None:
    qka = randomised(attention.QKAttention(8, 2, qka_type=qka_type))
    assert qka.qka_type == qka_type and qka.sum_dim == (3 if qka_type == "token" else 4)
    with pytest.raises(AttributeError):
        qka.qka_type = "token"  # type: ignore[misc]
    seen = capture(qka, "qk_lif", "attn_lif", "proj_conv_bn")
    qka(spikes(2, 3, 8, 5))
    q, k = seen["qk_lif"].reshape(2, 3, 2, 2, 4, 5).unbind(2)
    axis = 3 if qka_type == "token" else 4  # the head's channels, or the tokens
    torch.testing.assert_close(seen["attn_lif.in"], q.sum(axis, keepdim=True), rtol=0, atol=0)
    gated = (seen["attn_lif"] * k).reshape(2, 3, 8, 5)
    torch.testing.assert_close(seen["proj_conv_bn.in"], gated, rtol=0, atol=0)


def test_spike_driven_self_attention_sums_k_times_v_over_tokens() -> None:
    sdsa = randomised(attention.SpikeDrivenSelfAttention(8, 2))
    seen = capture(sdsa, "q_lif", "k_lif", "v_lif", "attn_lif", "proj_conv")
    x = torch.randn(2, 3, 8, 2, 3, dtype=torch.float64) * 2
    y = sdsa(x)
    heads = [seen[n].reshape(2, 3, 2, 4, 6) for n in ("q_lif", "k_lif", "v_lif")]  # [.., c, L]
    q, k, v = heads
    torch.testing.assert_close(
        seen["attn_lif.in"], (k * v).sum(-1).unsqueeze(-2), rtol=0, atol=0
    )  # [T, N, heads, 1, C/heads]
    expected = (q * seen["attn_lif"].transpose(-1, -2)).reshape(2, 3, 8, 2, 3)
    torch.testing.assert_close(seen["proj_conv.in"], expected, rtol=0, atol=0)
    torch.testing.assert_close(y - x, sdsa.proj_bn(sdsa.proj_conv(expected)))


def test_temporal_wise_attention_weights_each_step() -> None:
    twa = attention.TemporalWiseAttention(4, reduction=2, dimension=2).double()
    assert twa.step_mode == "m" and twa.supported_step_mode() == ("m",)
    w1 = torch.tensor([[1.0, -1.0, 0.5, 0.0], [0.0, 1.0, 1.0, -2.0]], dtype=torch.float64)
    w2 = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, 2.0]], dtype=torch.float64)
    with torch.no_grad():
        twa.sharedMLP[0].weight.copy_(w1)
        twa.sharedMLP[2].weight.copy_(w2)
    x = torch.randn(4, 3, 6, dtype=torch.float64)
    mlp = lambda s: torch.relu(s @ w1.T) @ w2.T  # noqa: E731
    scores = torch.sigmoid(mlp(x.mean(-1).T) + mlp(x.amax(-1).T))  # [N, T]
    torch.testing.assert_close(twa(x), x * scores.T.unsqueeze(-1))
    images = attention.TemporalWiseAttention(4, 2)
    assert images(torch.randn(4, 3, 2, 5, 5)).shape == (4, 3, 2, 5, 5)
    with pytest.raises(SpikefuseError, match="built for T=4"):
        twa(torch.randn(3, 3, 6, dtype=torch.float64))
    with pytest.raises(SpikefuseError, match=r"\[T, N, L\]"):
        twa(torch.randn(4, 3, 2, 5, 5))
    with pytest.raises(SpikefuseError):
        functional.set_step_mode(images, "s")


def test_multi_dimensional_attention_applies_t_c_then_space() -> None:
    mda = randomised(attention.MultiDimensionalAttention(4, 6, 2, 3, use_channel=False))
    assert mda.ca is None and mda.step_mode == "m"
    x = torch.randn(4, 2, 6, 3, 3, dtype=torch.float64)
    out = x.transpose(0, 1)  # [N, T, C, H, W]
    w1, w2 = (mda.ta.sharedMLP[i].weight.flatten(1) for i in (0, 2))
    mlp = lambda s: torch.relu(s @ w1.T) @ w2.T  # noqa: E731
    t_scores = torch.sigmoid(mlp(out.mean((2, 3, 4))) + mlp(out.amax((2, 3, 4))))
    out = out * t_scores[:, :, None, None, None]
    flat = out.flatten(1, 2)
    maps = torch.cat((flat.mean(1, keepdim=True), flat.amax(1, keepdim=True)), 1)
    s_scores = torch.sigmoid(torch.nn.functional.conv2d(maps, mda.sa.conv.weight, padding=1))
    expected = torch.relu(out * s_scores.unsqueeze(1)).transpose(0, 1)
    torch.testing.assert_close(mda(x), expected)
    full = attention.MultiDimensionalAttention(4, 6, 2, 3, kernel_size=7)
    y = full(torch.randn(4, 2, 6, 5, 5, requires_grad=True))
    y.sum().backward()
    assert y.shape == (4, 2, 6, 5, 5) and full.sa.conv.weight.grad is not None


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: attention.SpikingSelfAttention(10, 4), "should be divided by num_heads"),
        (lambda: attention.SpikeDrivenSelfAttention(8, 0), "num_heads must be an int"),
        (lambda: attention.QKAttention(8, 2, qka_type="head"), "'token' or 'channel'"),
        (lambda: attention.TemporalWiseAttention(2), "reduction cannot be greater than T"),
        (lambda: attention.TemporalWiseAttention(4, 2, dimension=3), "dimension must be 4 or 2"),
        (lambda: attention.MultiDimensionalAttention(4, 8, 2, 16), "reduction_c cannot be"),
        (lambda: attention.MultiDimensionalAttention(4, 8, 2, 2, 5), "kernel size must be 3"),
        (
            lambda: attention.MultiDimensionalAttention(4, 8, 2, 2, 3, False, False, False),
            "at least one of",
        ),
    ],
)
def test_bad_arguments_are_refused_as_value_errors(build, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build()


def test_input_that_does_not_fit_is_refused_before_any_state_changes() -> None:
    ssa = attention.SpikingSelfAttention(8, 2)
    with pytest.raises(SpikefuseError, match=r"expected 4D input with shape \[T, N, C, L\]"):
        ssa(torch.zeros(2, 3, 8))
    with pytest.raises(SpikefuseError, match="C=6 channels.*dim=8"):
        ssa(torch.zeros(2, 3, 6, 5))
    assert isinstance(ssa.qkv_lif.v, float)  # no step ran
    with pytest.raises(SpikefuseError, match=r"\[T, N, C, H, W\]"):
        attention.SpikeDrivenSelfAttention(8, 2)(torch.zeros(2, 3, 8, 5))
    with pytest.raises(SpikefuseError, match=r"\[T, N, C, H, W\]"):
        attention.MultiDimensionalAttention(4, 8, 2, 2)(torch.zeros(4, 3, 8, 5))
