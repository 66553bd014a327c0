"""spikefuse: fast, memory-lean BPTT training of spiking neural networks in PyTorch."""

from . import functional, layer, neuron, surrogate
from .definitions import NeuronDef
from .errors import BackendUnavailableError, SpikefuseError

__version__ = "0.1.0"
__all__ = [
    "BackendUnavailableError",
    "NeuronDef",
    "SpikefuseError",
    "functional",
    "layer",
    "neuron",
    "surrogate",
]
