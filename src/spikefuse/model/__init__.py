"""SpikingJelly's model zoo paths (``activation_based.model``): ``model.parametric_lif_net``
(``DVSGestureNet``, ``CIFAR10DVSNet``, ...), ``model.ms_resnet``, ``model.spiking_resnet``, ``model.sew_resnet``,
``model.spiking_vgg`` and ``model.spiking_vggws_ottt``, built from spikefuse's layers and neurons
(and :mod:`spikefuse.models`). Builders spikefuse lacks raise a
:class:`~spikefuse.errors.SpikefuseError` naming an alternative; so does importing
``model.spikformer`` (no spiking self-attention) and reading ``model.Spikformer`` or
``model.Trainer`` (SpikingJelly's ImageNet training script: use ``spikefuse train``)."""

from __future__ import annotations

from typing import Any

from ..errors import SpikefuseError
from . import (
    ms_resnet,
    parametric_lif_net,
    sew_resnet,
    spiking_resnet,
    spiking_vgg,
    spiking_vggws_ottt,
)
from ._refuse import NO_SPIKFORMER

__all__ = [
    "ms_resnet",
    "parametric_lif_net",
    "sew_resnet",
    "spiking_resnet",
    "spiking_vgg",
    "spiking_vggws_ottt",
]

_ELSEWHERE = {
    "Trainer": "SpikingJelly's ImageNet training script is not ported; use `spikefuse train`",
}


def __getattr__(name: str) -> Any:
    if name in _ELSEWHERE:
        raise SpikefuseError(f"spikefuse.model.{name} is not available: {_ELSEWHERE[name]}")
    if name.lower().startswith("spikformer") and name != "spikformer":
        raise SpikefuseError(f"spikefuse.model.{name} is not available: {NO_SPIKFORMER}")
    raise AttributeError(f"module 'spikefuse.model' has no attribute {name!r}")
