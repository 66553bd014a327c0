"""The units ``sj_dropin.py`` runs: SpikingJelly 2.0's example scripts and model files, and how
to build and feed the model(s) each defines (small sizes; the same code builds both sides, from
each side's own loaded file and package)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sj_dropin import Build, Forward, Side


def plain(side: Side, net: torch.nn.Module, x: torch.Tensor) -> Any:
    return net(x)


def poisson_rate(side: Side, net: torch.nn.Module, x: torch.Tensor) -> Any:
    """lif_fc_mnist's loop: T = 4 single steps of Poisson-encoded input, the mean output."""
    encoder = side.sub("encoding").PoissonEncoder()
    return sum(net(encoder(x)) for _ in range(4)) / 4


def repeated(side: Side, net: torch.nn.Module, x: torch.Tensor) -> Any:
    """T = 2 single steps of the same input (online-training nets and custom-node nets)."""
    return [net(x) for _ in range(2)]


@dataclass(frozen=True)
class Case:
    """One model of a unit: its builder, its input shape and how its forward is called."""

    label: str
    build: Build
    shape: tuple[int, ...]
    forward: Forward = plain
    dtype: torch.dtype = torch.float64  # float32 only where the original forces it


@dataclass(frozen=True)
class Unit:
    """A file under ``activation_based/`` and the models built from it (none: import only)."""

    relpath: str
    cases: tuple[Case, ...] = ()
    note: str = ""


def multi_step(net: torch.nn.Module, side: Side) -> torch.nn.Module:
    side.sub("functional").set_step_mode(net, "m")
    return net


def _lif(side: Side) -> dict[str, Any]:
    return {
        "spiking_neuron": side.sub("neuron").LIFNode,
        "surrogate_function": side.sub("surrogate").ATan(),
        "detach_reset": True,
    }


def _plif_net(name: str) -> Build:
    return lambda s: multi_step(getattr(s.module, name)(channels=4, **_lif(s)), s)


def _zoo(name: str, **kwargs: Any) -> Build:
    return lambda s: multi_step(
        getattr(s.module, name)(spiking_neuron=s.sub("neuron").IFNode, num_classes=3, **kwargs), s
    )


EXAMPLES = (
    Unit("examples/lif_fc_mnist.py", (Case("SNN", lambda s: s.module.SNN(tau=2.0), (2, 1, 28, 28), poisson_rate),)),
    Unit("examples/conv_fashion_mnist.py", (Case("CSNN", lambda s: s.module.CSNN(T=2, channels=4), (2, 1, 28, 28)),)),
    Unit(
        "examples/rsnn_sequential_fmnist.py",
        tuple(
            Case(name, lambda s, n=name: multi_step(getattr(s.module, n)(), s), (6, 2, 28))
            for name in ("PlainNet", "StatefulSynapseNet", "FeedBackNet")
        ),
    ),
    Unit("examples/spiking_lstm_sequential_mnist.py", (Case("Net", lambda s: s.module.Net(), (6, 2, 28)),)),
    Unit(
        "examples/cifar10_r11_enabling_spikebased_backpropagation.py",
        (Case("ResNet11 (eval, float32)", lambda s: s.module.ResNet11().eval(), (2, 3, 32, 32), repeated, torch.float32),),
        "its nodes cast spikes with .float(); training needs its own loop (new_grad)",
    ),
    Unit(
        "examples/classify_dvsg.py",
        (Case("DVSGestureNet", lambda s: multi_step(s.module.parametric_lif_net.DVSGestureNet(channels=4, **_lif(s)), s), (2, 1, 2, 128, 128)),),
    ),
    Unit("examples/spiking_dqn_state.py", (Case("DQSN", lambda s: s.module.DQSN(4, 8, 2, T=3), (2, 4)),)),
    Unit("examples/spiking_a2c.py", (Case("ActorCritic", lambda s: s.module.ActorCritic(4, 2, 8, T=3), (2, 4)),)),
    Unit("examples/spiking_ppo.py", note="its ActorCritic is defined under __main__"),
    Unit("examples/memopt/models.py", (Case("CIFAR10DVSVGG", lambda s: s.module.CIFAR10DVSVGG(), (2, 1, 2, 48, 48)),)),
    Unit("examples/dsqn/utils/model.py", (Case("DSQN", lambda s: s.module.DSQN((4, 84, 84), 2, T=2), (1, 4, 84, 84)),)),
    Unit("examples/ilc_san/ilc_san.py", note="import only"),
    Unit("examples/noisy_san/noisy_san.py", note="import only"),
    Unit("examples/spiking_lstm_text.py", note="its Net is defined inside main()"),
    Unit("examples/speech_commands.py", note="import only"),
    Unit("examples/lava_mnist.py", note="import only"),
    Unit("examples/lynxi_fmnist_inference.py", note="import only"),
    Unit("examples/train_imagenet.py", note="import only"),
    Unit("examples/train_flexsn_compile.py", note="import only"),
    Unit("examples/common/train_classify.py", note="import only"),
    Unit("examples/plasticity/stdp_trace.py", note="import only"),
    Unit("examples/plasticity/mstdp.py", note="import only"),
    Unit("examples/plasticity/mstdpet.py", note="import only"),
    Unit("examples/plasticity/stdp_mnist.py", note="import only"),
    Unit("examples/profiling/nsys_lif.py", note="import only"),
)  # fmt: skip

MODELS = (
    Unit(
        "model/parametric_lif_net.py",
        tuple(
            Case(name, _plif_net(name), (2, 1, c, hw, hw))
            for name, c, hw in (
                ("MNISTNet", 1, 28),
                ("FashionMNISTNet", 1, 28),
                ("NMNISTNet", 2, 34),
                ("CIFAR10Net", 3, 32),
                ("CIFAR10DVSNet", 2, 128),
                ("DVSGestureNet", 2, 128),
            )
        ),
    ),
    Unit(
        "model/ms_resnet.py",
        (
            Case("MSResNet", lambda s: s.module.MSResNet(T=2, num_classes=3, layers=(1, 1, 1), base_channels=4), (2, 3, 16, 16)),
            Case("max_resnet18", lambda s: s.module.max_resnet18(T=2, num_classes=3), (1, 3, 32, 32)),
        ),
    ),
    Unit(
        "model/masnn.py",
        (
            Case("att_ms_resnet18", lambda s: s.module.att_ms_resnet18(T=1, num_classes=3), (2, 3, 32, 32)),
            Case("MASNN", lambda s: s.module.MASNN(T=5, num_classes=3, channels=(8, 8, 8), fc_hidden=16), (2, 2, 32, 32)),
        ),
    ),
    Unit("model/sew_resnet.py", (Case("sew_resnet18", _zoo("sew_resnet18", cnf="ADD"), (2, 1, 3, 32, 32)),)),
    Unit("model/spiking_resnet.py", (Case("spiking_resnet18", _zoo("spiking_resnet18"), (2, 1, 3, 32, 32)),)),
    Unit("model/spiking_vgg.py", (Case("spiking_vgg11_bn", _zoo("spiking_vgg11_bn"), (2, 1, 3, 32, 32)),)),
    Unit(
        "model/spiking_vggws_ottt.py",
        (Case("ottt_spiking_vggws", lambda s: s.module.ottt_spiking_vggws(num_classes=4), (2, 3, 16, 16), repeated),),
    ),
    Unit("model/snas_net.py", note="import only"),
    Unit("model/spike_dhs.py", note="import only"),
    Unit(
        "model/spikformer.py",
        (Case("Spikformer", lambda s: s.module.Spikformer(T=2, img_size_h=8, img_size_w=8, patch_size=4, num_classes=5, embed_dims=32, num_heads=4, depths=2), (2, 3, 8, 8)),),
    ),
    Unit(
        "model/qkformer.py",
        (Case("QKFormer", lambda s: s.module.QKFormer(T=2, num_classes=5, embed_dims=32, num_heads=(2, 2, 4), depths=(1, 1, 1)), (2, 3, 8, 8)),),
    ),
    Unit("model/maxformer.py", note="import only"),
    Unit(
        "model/spike_driven_transformer.py",
        (Case("SpikeDrivenTransformer", lambda s: s.module.SpikeDrivenTransformer(T=2, num_classes=5, embed_dims=32, num_heads=4, depths=2, pooling_stat="0011"), (2, 3, 8, 8)),),
    ),
)  # fmt: skip

UNITS = EXAMPLES + MODELS
