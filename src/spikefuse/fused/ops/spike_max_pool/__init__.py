"""Max pooling of a fused block's spikes that keeps a byte per output instead of int64 indices.

- :mod:`.geometry`: the window arguments, validated as ``max_pool2d`` validates them;
- :mod:`.naive`: the reference, ``F.max_pool2d``;
- :mod:`.passes`: the forward (values and each window's code) and the gather backward in torch
  ops, the algorithm the cuda backend's ``max_pool`` kernels run;
- :mod:`.autograd`: :class:`SpikeMaxPool2dFunction`, :func:`pool_spikes` (which runs it where a
  backward may follow) and :func:`spike_max_pool2d`.
"""

from .autograd import SpikeMaxPool2dFunction, pool_spikes, spike_max_pool2d
from .geometry import MAX_WINDOW, MaxPoolGeometry
from .naive import spike_max_pool2d_naive
from .passes import pool_backward, pool_forward

__all__ = [
    "MAX_WINDOW",
    "MaxPoolGeometry",
    "SpikeMaxPool2dFunction",
    "pool_backward",
    "pool_forward",
    "pool_spikes",
    "spike_max_pool2d",
    "spike_max_pool2d_naive",
]
