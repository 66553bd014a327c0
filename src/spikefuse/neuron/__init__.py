"""Spiking neuron modules with SpikingJelly's conventions.

``step_mode='s'`` takes one step ``[N, *]``; ``step_mode='m'`` takes a sequence ``[T, N, *]``.
State (``.v``, and ``.w`` for Izhikevich) persists across calls until
:func:`spikefuse.functional.reset_net`. ``backend`` is ``'torch'`` (reference), ``'cuda'`` (alias
``'cupy'``: fused NVRTC kernels) or ``'auto'`` (cuda for CUDA tensors when it can run them,
else torch; the repr shows which one ran).

The classes live in private submodules but belong to this module (their ``__module__`` is
``spikefuse.neuron``), so pickled models name them by this path whatever the layout inside.
"""

from __future__ import annotations

from ._base import TORCH_CODE_BACKENDS, TORCH_CODE_HOOKS, BaseNode, SimpleBaseNode, log
from ._builtin import (
    EIFNode,
    IFNode,
    IzhikevichNode,
    LIFNode,
    ParametricLIFNode,
    QIFNode,
    SimpleLIFNode,
)
from ._memory import MemoryModule, MultiStepModule, SingleStepModule, StepModeMixin
from ._non_spiking import (
    NON_SPIKING_DECODES,
    NonSpikingBaseNode,
    NonSpikingIFNode,
    NonSpikingLIFNode,
    decode_membrane,
)
from ._online import OTTTLIFNode, SLTTLIFNode

# in the order of the API reference (docs/api.md orders by __all__)
__all__ = [
    "StepModeMixin",
    "SingleStepModule",
    "MultiStepModule",
    "MemoryModule",
    "BaseNode",
    "SimpleBaseNode",
    "IFNode",
    "LIFNode",
    "ParametricLIFNode",
    "QIFNode",
    "EIFNode",
    "IzhikevichNode",
    "SimpleLIFNode",
    "SLTTLIFNode",
    "OTTTLIFNode",
    "NonSpikingBaseNode",
    "NonSpikingIFNode",
    "NonSpikingLIFNode",
    "decode_membrane",
    "NON_SPIKING_DECODES",
    "TORCH_CODE_HOOKS",
    "TORCH_CODE_BACKENDS",
    "log",
]

for _name in __all__:
    _value = globals()[_name]
    if isinstance(_value, type):
        _value.__module__ = __name__
del _name, _value
