"""The BN → neuron (→ pool) (+ residual) op as a plain torch composite: its reference.

Autograd differentiates every step, BatchNorm's statistics included, so the forward and the
gradients of this function are what the fused op (:mod:`.passes`, :mod:`.autograd`, the
``torch.library`` op of :mod:`.library` and the cuda backend's BN-folded kernels) must give::

    mean, var = per-channel batch statistics of y over every dim but C (biased var),
                or the running ones
    x         = (y - mean) / sqrt(var + eps) * gamma + beta  [+ residual]  [max-pooled]
    spikes    = neuron(x)                    (the reference backend, from the reset state)
    out       = spikes, or their k x k window means (kernel = stride = k, no padding)

Slow and memory-hungry (it keeps every intermediate): for tests, never for training.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from ....backends import compute_dtype
from ....ops import run_neuron
from ...neuron_call import NeuronCall
from ...statistics import reduce_dims
from ..spike_max_pool.geometry import MaxPoolGeometry


def _per_channel(v: Tensor, ndim: int) -> Tensor:
    """[C] → [1, 1, C, 1, ...] broadcastable against a [T, B, C, *spatial] tensor."""
    return v.view(1, 1, -1, *([1] * (ndim - 3)))


def bn_neuron_naive(
    y: Tensor,
    neuron: NeuronCall,
    learnable: Tensor | None = None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    running: tuple[Tensor, Tensor] | None = None,
    pool: int = 1,
    residual: Tensor | None = None,
    input_pool: MaxPoolGeometry | None = None,
) -> Tensor:
    """The op's output for the synapse output ``y`` [T, B, C, *] in y's dtype.

    ``weight``/``bias``: BatchNorm's gamma/beta (None: 1 and 0); ``running``: (mean, var) [C]
    to normalise with (eval), else the batch statistics; ``pool`` = k > 1: the spikes' means
    over k x k windows of [T, B, C, H, W] (a remainder dropped); ``residual``: added to the BN
    output, like y; ``input_pool``: max-pools the BN output (the neuron's input) of
    [T, B, C, H, W] with these windows. Arithmetic in y's compute dtype (float64 stays, else
    float32)."""
    cd, nd = compute_dtype(y.dtype), y.dim()
    yc = y.to(cd)
    if running is None:
        var, mean = torch.var_mean(yc, dim=reduce_dims(nd), correction=0)
    else:
        mean, var = running[0].to(cd), running[1].to(cd)
    x = (yc - _per_channel(mean, nd)) * _per_channel(torch.rsqrt(var + eps), nd)
    if weight is not None:
        x = x * _per_channel(weight.to(cd), nd)
    if bias is not None:
        x = x + _per_channel(bias.to(cd), nd)
    if residual is not None:
        x = x + residual.to(cd)
    if input_pool is not None:
        windows = (input_pool.kernel, input_pool.stride, input_pool.padding, input_pool.dilation)
        x = F.max_pool2d(x.flatten(0, 1), *windows, input_pool.ceil_mode).unflatten(0, x.shape[:2])
    spikes, _, _, _ = run_neuron(
        program=neuron.program,
        backend="torch",
        x_seq=x,
        v0=None,
        w0=None,
        learnable=learnable,
        constants=neuron.constants,
        init=[neuron.v_init, 0.0],
        store_v_seq=False,
    )
    spikes = spikes.to(y.dtype)
    if pool == 1:
        return spikes
    return F.avg_pool2d(spikes.flatten(0, 1), pool).unflatten(0, spikes.shape[:2])
