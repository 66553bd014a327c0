"""Fused synapse → BatchNorm → neuron blocks that keep only the synapse output for backward.

Implements the dataflow of Liang et al., "Accelerating Spatiotemporal Supervised Training of
Large-Scale SNNs on GPU" (DATE'22): the forward pass stores the Conv/Linear output ``y`` (plus
per-channel statistics); backward recomputes BN output, membrane potentials and spikes, runs the
neuron's BPTT and BatchNorm's backward. Spikes that the next synapse saves for its weight
gradient are kept at 1 bit each. BatchNorm is synchronised across processes when
torch.distributed is initialised, so N processes with batch B train like one with batch N·B.

Build blocks directly (:class:`FusedConvBNNeuron`, :class:`FusedLinearBNNeuron`,
:class:`FusedBlock`) or convert a model made of spikefuse layers with :func:`fuse`.
"""

from .blocks import (
    FusedBlock,
    FusedConvBNNeuron,
    FusedLinearBNNeuron,
    SpikePool,
    fuse,
    paper_lif,
)
from .bn_neuron import BNNeuronFunction, bn_input_grad, bn_neuron_backward, bn_neuron_forward
from .packing import pack_bits, unpack_bits

__all__ = [
    "BNNeuronFunction",
    "FusedBlock",
    "FusedConvBNNeuron",
    "FusedLinearBNNeuron",
    "SpikePool",
    "bn_input_grad",
    "bn_neuron_backward",
    "bn_neuron_forward",
    "fuse",
    "pack_bits",
    "paper_lif",
    "unpack_bits",
]
