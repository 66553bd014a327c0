"""Export of one leaf module: the NIR node of a synapse (with an eval-mode BatchNorm folded in),
neuron, pooling, flatten or scaling layer, and the per-sample shape it outputs."""

from __future__ import annotations

from typing import cast

import nir
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ... import definitions as defs
from ...errors import NIRConversionError
from ...neuron import BaseNode
from .modules import LeakyIntegrator, Scale
from .values import ints, to_numpy

# The BatchNorm layers a synapse can fold in; spikefuse's are subclasses of them.
BATCHNORM = (nn.BatchNorm1d, nn.BatchNorm2d)
_LIF_DEFS = {defs.LIF: True, defs.LIF_NO_DECAY_INPUT: False}  # definition -> decay_input
_PLIF_DEFS = {defs.PLIF: True, defs.PLIF_NO_DECAY_INPUT: False}


class NodeExporter:
    """Converts leaf modules into NIR nodes for time step ``dt``."""

    def __init__(self, dt: float) -> None:
        self.dt = float(dt)

    def node(
        self, name: str, module: nn.Module, bn: _BatchNorm | None, shape: tuple[int, ...]
    ) -> tuple[nir.NIRNode, tuple[int, ...]]:
        """The NIR node for one leaf and its per-sample output shape."""
        where = f"{name} ({type(module).__name__})"
        if isinstance(module, nn.Linear):
            if shape != (module.in_features,):
                raise NIRConversionError(
                    f"{where}: NIR's Affine takes a vector of {module.in_features} features, "
                    f"but this layer gets per-sample shape {shape}; add a Flatten before it"
                )
            weight, bias = _folded(where, module, bn)
            node = nir.Linear(weight=weight) if bias is None else nir.Affine(weight, bias)
            return node, (module.out_features,)
        if isinstance(module, (nn.Conv1d, nn.Conv2d)):
            return self._conv(where, module, bn, shape)
        if isinstance(module, BATCHNORM):
            raise NIRConversionError(
                f"{where}: NIR has no BatchNorm; it can only be folded into a Conv/Linear that "
                "directly precedes it"
            )
        if isinstance(module, nn.Flatten):
            return _flatten(where, module, shape)
        if isinstance(module, nn.AvgPool2d):
            return _avg_pool(where, module, shape)
        if isinstance(module, Scale):
            if tuple(module.scale.shape) != shape:
                raise NIRConversionError(
                    f"{where}: scale shape {tuple(module.scale.shape)} differs from the "
                    f"per-sample input shape {shape}"
                )
            return nir.Scale(scale=to_numpy(module.scale)), shape
        if isinstance(module, BaseNode):
            return self._neuron(where, module, shape), shape
        if isinstance(module, LeakyIntegrator):
            lif = module.node
            tau = cast(float, lif.tau)  # LIF's parameter, a float attribute
            v_leak = lif.constants()[1]  # v_reset (a LeakyIntegrator resets hard)
            return nir.LI(**self._leaky(tau, lif.decay_input, v_leak, shape)), shape
        raise NIRConversionError(f"{where}: no NIR equivalent is known for this module")

    def _conv(
        self,
        where: str,
        conv: nn.Conv1d | nn.Conv2d,
        bn: _BatchNorm | None,
        shape: tuple[int, ...],
    ) -> tuple[nir.NIRNode, tuple[int, ...]]:
        two_d = isinstance(conv, nn.Conv2d)
        rank = 3 if two_d else 2
        if len(shape) != rank or shape[0] != conv.in_channels:
            raise NIRConversionError(
                f"{where}: expects per-sample input [{conv.in_channels}, *{rank - 1} spatial], "
                f"got {shape}"
            )
        if conv.padding_mode != "zeros":
            raise NIRConversionError(
                f"{where}: padding_mode={conv.padding_mode!r} has no NIR equivalent (only zeros)"
            )
        if conv.groups != 1:  # nir's graph check takes the weight's dim 1 as the input channels
            raise NIRConversionError(
                f"{where}: a grouped convolution (groups={conv.groups}) does not pass nir's "
                f"graph type check, which reads in_channels / groups = {conv.weight.shape[1]} "
                f"as the input's channels; only groups=1 exports"
            )
        weight, bias = _folded(where, conv, bn)
        if bias is None:  # NIR's Conv needs a bias; import turns an all-zero one into none
            bias = np.zeros(weight.shape[0], dtype=weight.dtype)
        convolve = F.conv2d if two_d else F.conv1d
        out = convolve(  # on meta tensors: only the output shape is computed
            torch.empty((1, *shape), device="meta"),
            torch.empty(conv.weight.shape, device="meta"),
            None,
            stride=conv.stride,
            padding=conv.padding,
            dilation=conv.dilation,
            groups=conv.groups,
        )
        padding = conv.padding if isinstance(conv.padding, str) else ints(conv.padding, two_d)
        kwargs = dict(
            weight=weight,
            stride=ints(conv.stride, two_d),
            padding=padding,
            dilation=ints(conv.dilation, two_d),
            groups=conv.groups,
            bias=bias,
        )
        if two_d:
            node = nir.Conv2d(input_shape=shape[1:], **kwargs)
        else:
            node = nir.Conv1d(input_shape=shape[1], **kwargs)
        return node, tuple(out.shape[1:])

    def _neuron(self, where: str, node: BaseNode, shape: tuple[int, ...]) -> nir.NIRNode:
        definition = node.definition  # None only for a neuron whose charge is torch code
        if node.torch_code is not None or definition is None:  # not LIF's charge
            raise NIRConversionError(
                f"{where}: {type(node).__name__} runs torch code ({node.torch_code}); only "
                "spikefuse's IF/LIF/PLIF definitions have a NIR equivalent"
            )
        # compared by value: a deep copy (fuse, torch.load) holds an equal, not the same, definition
        if definition != defs.IF and definition not in {**_LIF_DEFS, **_PLIF_DEFS}:
            raise NIRConversionError(
                f"{where}: neuron {definition.name!r} has no NIR equivalent (NIR has IF and LIF; "
                "QIF, EIF, Izhikevich and custom charge equations cannot be expressed)"
            )
        if node.v_reset is None:
            raise NIRConversionError(
                f"{where}: soft reset (v_reset=None, V -= V_th on a spike) has no NIR "
                "equivalent: NIR neurons reset to v_reset; use a hard reset"
            )
        v_threshold, v_reset = node.constants()[:2]  # validated finite floats
        fire = {
            "v_threshold": np.full(shape, v_threshold, dtype=np.float64),
            "v_reset": np.full(shape, v_reset, dtype=np.float64),
        }
        if definition == defs.IF:
            return nir.IF(r=np.full(shape, 1.0 / self.dt, dtype=np.float64), **fire)
        if definition in _LIF_DEFS:
            tau, decay_input = float(cast(float, node.tau)), _LIF_DEFS[definition]
        else:  # PLIF exports its current tau = 1 / sigmoid(w) as a fixed LIF
            learned = node.learnable_values(torch.device("cpu"))
            assert learned is not None  # PLIF learns its decay's logit
            tau, decay_input = 1.0 / float(learned.detach().sigmoid()), _PLIF_DEFS[definition]
        return nir.LIF(**self._leaky(tau, decay_input, v_reset, shape), **fire)

    def _leaky(
        self, tau: float, decay_input: bool, v_leak: float, shape: tuple[int, ...]
    ) -> dict[str, np.ndarray]:
        """NIR's tau, r and v_leak of a discrete leak towards v_leak (package docstring)."""
        values = {"tau": tau * self.dt, "r": 1.0 if decay_input else tau, "v_leak": v_leak}
        return {k: np.full(shape, float(v), dtype=np.float64) for k, v in values.items()}


def _folded(
    where: str, synapse: nn.Linear | nn.Conv1d | nn.Conv2d, bn: _BatchNorm | None
) -> tuple[np.ndarray, np.ndarray | None]:
    """Weight and bias of ``synapse`` with an eval-mode BatchNorm after it folded in."""
    weight = synapse.weight.detach()
    bias = None if synapse.bias is None else synapse.bias.detach()
    if bn is None:
        return to_numpy(weight), None if bias is None else to_numpy(bias)
    bn_where = f"{where} + {type(bn).__name__}"
    if bn.training or bn.running_mean is None or bn.running_var is None:
        raise NIRConversionError(
            f"{bn_where}: BatchNorm is folded with its running statistics, but it is in training "
            "mode or tracks none; call model.eval() (with track_running_stats=True) first"
        )
    if bn.num_features != weight.shape[0]:
        raise NIRConversionError(
            f"{bn_where}: {bn.num_features} BatchNorm features for {weight.shape[0]} channels"
        )
    dtype = weight.dtype
    inv_std = torch.rsqrt(bn.running_var.to(dtype) + bn.eps)
    scale = inv_std * bn.weight.detach().to(dtype) if bn.affine else inv_std
    shift = bn.bias.detach().to(dtype) if bn.affine else torch.zeros_like(scale)
    centred = -bn.running_mean.to(dtype) if bias is None else bias - bn.running_mean.to(dtype)
    folded_weight = weight * scale.reshape(-1, *[1] * (weight.dim() - 1))
    return to_numpy(folded_weight), to_numpy(centred * scale + shift)


def _flatten(
    where: str, module: nn.Flatten, shape: tuple[int, ...]
) -> tuple[nir.NIRNode, tuple[int, ...]]:
    # torch counts the batch dimension, NIR does not; negative dimensions mean the same in both.
    rank = len(shape) + 1
    if module.start_dim % rank == 0:
        raise NIRConversionError(
            f"{where}: flattening the batch dimension (start_dim={module.start_dim}) has no NIR "
            "equivalent"
        )
    start, end = (d - 1 if d > 0 else d for d in (module.start_dim, module.end_dim))
    out = torch.empty((1, *shape), device="meta").flatten(module.start_dim, module.end_dim)
    node = nir.Flatten(input_type=np.array(shape), start_dim=start, end_dim=end)
    return node, tuple(out.shape[1:])


def _avg_pool(
    where: str, pool: nn.AvgPool2d, shape: tuple[int, ...]
) -> tuple[nir.NIRNode, tuple[int, ...]]:
    if len(shape) != 3:
        raise NIRConversionError(f"{where}: expects per-sample input [C, H, W], got {shape}")
    kernel, padding = ints(pool.kernel_size, True), ints(pool.padding, True)
    stride = ints(pool.stride if pool.stride is not None else pool.kernel_size, True)
    if pool.ceil_mode:
        raise NIRConversionError(f"{where}: ceil_mode=True has no NIR equivalent")
    if pool.divisor_override == 1:
        kind = nir.SumPool2d
    elif pool.divisor_override is None and (pool.count_include_pad or padding == (0, 0)):
        kind = nir.AvgPool2d
    else:
        raise NIRConversionError(
            f"{where}: only plain averages (count_include_pad=True or no padding) and sums "
            f"(divisor_override=1) have NIR equivalents; got divisor_override="
            f"{pool.divisor_override}, count_include_pad={pool.count_include_pad}"
        )
    out = F.avg_pool2d(torch.empty((1, *shape), device="meta"), kernel, stride, padding)
    node = kind(kernel_size=np.array(kernel), stride=np.array(stride), padding=np.array(padding))
    return node, tuple(out.shape[1:])
