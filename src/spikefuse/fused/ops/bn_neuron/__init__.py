"""The fused BatchNorm → neuron (→ pool) (+ residual) op of the fused blocks, in one folder.

- :mod:`.naive`: the reference, a plain torch composite (autograd differentiates it);
- :mod:`.passes`: the math of the forward and the two backward passes, which run the cuda
  backend's BN-folded kernels or torch composites of the reference neuron;
- :mod:`.autograd`: :class:`BNNeuronFunction` and its argument record :class:`BNNeuronArgs`;
- :mod:`.library`: the same passes as ``torch.library`` ops, which ``torch.compile`` traces.
"""

from .autograd import BNNeuronArgs, BNNeuronFunction
from .library import traced_bn_neuron
from .naive import bn_neuron_naive
from .passes import (
    bn_input_grad,
    bn_neuron_backward,
    bn_neuron_forward,
    bn_neuron_grads,
    kernel_pool,
    repeated,
)

__all__ = [
    "BNNeuronArgs",
    "BNNeuronFunction",
    "bn_input_grad",
    "bn_neuron_backward",
    "bn_neuron_forward",
    "bn_neuron_grads",
    "bn_neuron_naive",
    "kernel_pool",
    "repeated",
    "traced_bn_neuron",
]
