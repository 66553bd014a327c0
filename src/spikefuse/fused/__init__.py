"""Fused synapse → BatchNorm → neuron blocks that keep only the synapse output for backward.

Implements the dataflow of Liang et al., "Accelerating Spatiotemporal Supervised Training of
Large-Scale SNNs on GPU" (DATE'22): the forward pass stores the Conv/Linear output ``y`` (plus
per-channel statistics); backward recomputes BN output, membrane potentials and spikes, runs the
neuron's BPTT and BatchNorm's backward. Spikes that the next synapse needs for its weight
gradient are recomputed too, not stored. On CUDA, BatchNorm's affine map and its backward's
per-channel sums run inside the neuron kernels. BatchNorm is synchronised across processes when
torch.distributed is initialised, so N processes with batch B train like one with batch N·B.

Build blocks directly (:class:`FusedConvBNNeuron`, :class:`FusedLinearBNNeuron`,
:class:`FusedBlock`) or convert a model made of spikefuse layers with :func:`fuse`.
"""

from .blocks import FusedBlock, FusedConvBNNeuron, FusedLinearBNNeuron, paper_lif
from .convert import FusedChain, FuseReport, SkippedCandidate, fuse
from .memory import MemoryPolicy, memory_modes, register_memory
from .ops.bn_neuron import (
    BNNeuronArgs,
    BNNeuronFunction,
    bn_input_grad,
    bn_neuron_backward,
    bn_neuron_forward,
    bn_neuron_naive,
)
from .ops.spike_max_pool import spike_max_pool2d
from .pooling import MaxPoolCodes, SpikePool, WindowAvgPool
from .synapse import match_optimizer_state

__all__ = [
    "BNNeuronArgs",
    "BNNeuronFunction",
    "FuseReport",
    "FusedBlock",
    "FusedChain",
    "FusedConvBNNeuron",
    "FusedLinearBNNeuron",
    "MemoryPolicy",
    "SkippedCandidate",
    "MaxPoolCodes",
    "SpikePool",
    "WindowAvgPool",
    "bn_input_grad",
    "bn_neuron_backward",
    "bn_neuron_forward",
    "bn_neuron_naive",
    "fuse",
    "match_optimizer_state",
    "memory_modes",
    "paper_lif",
    "register_memory",
    "spike_max_pool2d",
]
