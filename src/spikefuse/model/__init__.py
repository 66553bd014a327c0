"""SpikingJelly's model zoo paths (``activation_based.model``): ``model.parametric_lif_net``
(``DVSGestureNet``, ``CIFAR10DVSNet``, ...), ``model.ms_resnet``, ``model.spiking_resnet``,
``model.sew_resnet``, ``model.spiking_vgg``, ``model.spiking_vggws_ottt`` and the spiking
transformers ``model.spikformer``, ``model.spike_driven_transformer`` and ``model.qkformer``,
built from spikefuse's layers and neurons (and :mod:`spikefuse.models`); as in SpikingJelly the
transformers' and MS-ResNet's builders are also names of this package. Builders spikefuse lacks
raise a :class:`~spikefuse.errors.SpikefuseError` naming an alternative; so does reading
``model.Trainer`` (SpikingJelly's ImageNet training script: use ``spikefuse train``)."""

from __future__ import annotations

from typing import Any

from ..errors import SpikefuseError
from . import (
    ms_resnet,
    parametric_lif_net,
    qkformer,
    sew_resnet,
    spike_driven_transformer,
    spikformer,
    spiking_resnet,
    spiking_vgg,
    spiking_vggws_ottt,
)
from .ms_resnet import MaxResNet, MSResNet, max_resnet18, ms_resnet18, ms_resnet34
from .qkformer import QKFormer, qkformer_10_384
from .spike_driven_transformer import SpikeDrivenTransformer, sdt_8_384
from .spikformer import Spikformer, spikformer_cifar10, spikformer_s, spikformer_ti

__all__ = [
    "MSResNet",
    "MaxResNet",
    "QKFormer",
    "SpikeDrivenTransformer",
    "Spikformer",
    "max_resnet18",
    "ms_resnet",
    "ms_resnet18",
    "ms_resnet34",
    "parametric_lif_net",
    "qkformer",
    "qkformer_10_384",
    "sdt_8_384",
    "sew_resnet",
    "spike_driven_transformer",
    "spikformer",
    "spikformer_cifar10",
    "spikformer_s",
    "spikformer_ti",
    "spiking_resnet",
    "spiking_vgg",
    "spiking_vggws_ottt",
]

_TRANSFORMERS = "spikformer_cifar10, sdt_8_384 or qkformer_10_384"
_ELSEWHERE = {
    "Trainer": "SpikingJelly's ImageNet training script is not ported; use `spikefuse train`",
    **{
        name: f"MaxFormer is not ported; use {_TRANSFORMERS}"
        for name in ("MaxFormer", "maxformer_10_384", "maxformer_cifar", "maxformer")
    },
    **{
        name: "MA-SNN is not ported; use ms_resnet18 (or layer.MultiDimensionalAttention), or "
        "SpikingJelly's model/masnn.py with its imports changed (it runs on model.ms_resnet)"
        for name in ("MASNN", "AttMSResNet", "att_ms_resnet18", "masnn_dvs128_gesture", "masnn")
    },
}


def __getattr__(name: str) -> Any:
    if name in _ELSEWHERE:
        raise SpikefuseError(f"spikefuse.model.{name} is not available: {_ELSEWHERE[name]}")
    raise AttributeError(f"module 'spikefuse.model' has no attribute {name!r}")
