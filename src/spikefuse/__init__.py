"""spikefuse: fast, memory-lean BPTT training of spiking neural networks in PyTorch."""

from . import encoding, functional, layer, neuron, surrogate
from .definitions import NeuronDef
from .errors import BackendUnavailableError, SpikefuseError
from .fused import fuse
from .model_graphs import graph_model

__version__ = "0.1.0"
__all__ = [
    "BackendUnavailableError",
    "NeuronDef",
    "SpikefuseError",
    "encoding",
    "functional",
    "fuse",
    "graph_model",
    "layer",
    "neuron",
    "surrogate",
]
