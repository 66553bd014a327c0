"""Layers for single-step ``[N, *]`` and multi-step ``[T, N, *]`` data, with SpikingJelly's names.

Stateless layers in multi-step mode merge the time and batch dimensions, run the torch layer once
on ``[T*N, *]`` and split the result back: one large call instead of a Python loop over T.
Stateful layers (:class:`Dropout`, :class:`SynapseFilter`, the recurrent containers) keep their
state until :func:`spikefuse.functional.reset_net`, as SpikingJelly's do. The spiking
transformers' attention layers are in :mod:`spikefuse.layer.attention` (and, as in SpikingJelly,
here too).
"""

from __future__ import annotations

# SpikingJelly's layer names for online training through time (explicit re-exports)
from ..online import GradwithTrace as GradwithTrace
from ..online import OTTTSequential as OTTTSequential
from ..online import ReplaceforGrad as ReplaceforGrad
from ..online import SpikeTraceOp as SpikeTraceOp
from . import attention
from ._base import (
    AdaptiveAvgPool1d,
    AdaptiveAvgPool2d,
    AdaptiveAvgPool3d,
    AvgPool1d,
    AvgPool2d,
    AvgPool3d,
    BatchNorm1d,
    BatchNorm2d,
    BatchNorm3d,
    Conv1d,
    Conv2d,
    Conv3d,
    ConvTranspose1d,
    ConvTranspose2d,
    ConvTranspose3d,
    Flatten,
    GroupNorm,
    Linear,
    MaxPool1d,
    MaxPool2d,
    MaxPool3d,
    SeqToANNContainer,
    Upsample,
    VotingLayer,
    seq_to_ann,
)
from ._base import _StepMode as _StepMode  # the fusing tracer and the encoders subclass it
from ._stateful import (
    Dropout,
    Dropout2d,
    ElementWiseRecurrentContainer,
    LinearRecurrentContainer,
    MultiStepContainer,
    StepModeContainer,
    SynapseFilter,
    WSConv2d,
    WSLinear,
)
from .attention import (
    ChannelQKAttention,
    MultiDimensionalAttention,
    QKAttention,
    SpikeDrivenSelfAttention,
    SpikingSelfAttention,
    TemporalWiseAttention,
    TokenQKAttention,
)

__all__ = [
    "AdaptiveAvgPool1d",
    "AdaptiveAvgPool2d",
    "AdaptiveAvgPool3d",
    "AvgPool1d",
    "AvgPool2d",
    "AvgPool3d",
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
    "ChannelQKAttention",
    "Conv1d",
    "Conv2d",
    "Conv3d",
    "ConvTranspose1d",
    "ConvTranspose2d",
    "ConvTranspose3d",
    "Dropout",
    "Dropout2d",
    "ElementWiseRecurrentContainer",
    "Flatten",
    "GradwithTrace",
    "GroupNorm",
    "Linear",
    "LinearRecurrentContainer",
    "MaxPool1d",
    "MaxPool2d",
    "MaxPool3d",
    "MultiDimensionalAttention",
    "MultiStepContainer",
    "OTTTSequential",
    "QKAttention",
    "ReplaceforGrad",
    "SeqToANNContainer",
    "SpikeDrivenSelfAttention",
    "SpikeTraceOp",
    "SpikingSelfAttention",
    "StepModeContainer",
    "SynapseFilter",
    "TemporalWiseAttention",
    "TokenQKAttention",
    "Upsample",
    "VotingLayer",
    "WSConv2d",
    "WSLinear",
    "attention",
    "seq_to_ann",
]
