"""Import of one NIR node: the spikefuse layer, neuron or module it becomes, with its parameters
checked (finite, the right shapes, one value per neuron layer) and loaded."""

from __future__ import annotations

import copy
from typing import TypedDict

import nir
import torch
from torch import Tensor, nn

from ... import layer
from ...errors import NIRConversionError
from ...neuron import IFNode, LIFNode
from ...surrogate import Surrogate
from .modules import LeakyIntegrator, Scale
from .values import close_to, describe, ints, to_tensor, uniform


class _NeuronOptions(TypedDict):
    """The keyword arguments every imported neuron gets."""

    detach_reset: bool
    step_mode: str
    backend: str


class NodeImporter:
    """Builds the spikefuse module of one NIR node for time step ``dt``."""

    def __init__(
        self, dt: float, surrogate_function: Surrogate | None, detach_reset: bool, backend: str
    ) -> None:
        self.dt = dt
        self.neuron_options = _NeuronOptions(
            detach_reset=detach_reset, step_mode="m", backend=backend
        )
        self.surrogate_function = surrogate_function

    def module(self, name: str, node: nir.NIRNode) -> nn.Module:
        """The module of node ``name``; refuses nodes without a spikefuse equivalent."""
        where = f"NIR node {name!r} ({type(node).__name__})"
        if isinstance(node, (nir.Affine, nir.Linear)):
            weight = to_tensor(where, "weight", node.weight)
            if weight.dim() != 2:
                raise NIRConversionError(f"{where}: weight must be 2-D, got {tuple(weight.shape)}")
            bias = to_tensor(where, "bias", node.bias) if isinstance(node, nir.Affine) else None
            linear = layer.Linear(
                weight.shape[1],
                weight.shape[0],
                bias=bias is not None,
                step_mode="m",
                dtype=weight.dtype,
            )
            return _load(where, linear, weight, bias)
        if isinstance(node, (nir.Conv1d, nir.Conv2d)):
            return self._conv(where, node)
        if isinstance(node, nir.Flatten):
            # NIR counts dimensions without the batch; the layer sees [T*N, *].
            start, end = (
                int(d) + 1 if int(d) >= 0 else int(d) for d in (node.start_dim, node.end_dim)
            )
            return layer.Flatten(start, end, step_mode="m")
        if isinstance(node, (nir.AvgPool2d, nir.SumPool2d)):
            sum_pool = isinstance(node, nir.SumPool2d)
            return layer.AvgPool2d(
                ints(node.kernel_size, True),
                ints(node.stride, True),
                ints(node.padding, True),
                divisor_override=1 if sum_pool else None,
                step_mode="m",
            )
        if isinstance(node, nir.Scale):
            return Scale(to_tensor(where, "scale", node.scale))
        if isinstance(node, nir.IF):
            if not close_to(node.r, 1.0 / self.dt):
                raise NIRConversionError(
                    f"{where}: spikefuse's IF adds its input unscaled, which needs dt * r = 1; "
                    f"got r = {describe(node.r)} with dt = {self.dt}"
                )
            return IFNode(
                v_threshold=uniform(where, "v_threshold", node.v_threshold),
                v_reset=uniform(where, "v_reset", node.v_reset),
                surrogate_function=self._surrogate(),
                **self.neuron_options,
            )
        if isinstance(node, nir.LIF):
            return self._lif(where, node)
        if isinstance(node, nir.LI):
            tau, decay_input, v_leak = self._leak(where, node)
            return LeakyIntegrator(tau, decay_input, v_leak, self.neuron_options["backend"])
        raise NIRConversionError(
            f"{where}: no spikefuse equivalent (supported: Affine, Linear, Conv1d, Conv2d, "
            "Flatten, AvgPool2d, SumPool2d, Scale, IF, LI, LIF)"
        )

    def _surrogate(self) -> Surrogate | None:
        return copy.deepcopy(self.surrogate_function)

    def _conv(self, where: str, node: nir.Conv1d | nir.Conv2d) -> nn.Module:
        two_d = isinstance(node, nir.Conv2d)
        weight = to_tensor(where, "weight", node.weight)
        if weight.dim() != (4 if two_d else 3):
            raise NIRConversionError(f"{where}: weight has shape {tuple(weight.shape)}")
        bias_values = to_tensor(where, "bias", node.bias)
        bias = bias_values if bool(bias_values.any()) else None  # exporters write 0 for no bias
        cls = layer.Conv2d if two_d else layer.Conv1d
        padding = node.padding if isinstance(node.padding, str) else ints(node.padding, two_d)
        conv = cls(
            weight.shape[1] * int(node.groups),
            weight.shape[0],
            tuple(weight.shape[2:]),
            stride=ints(node.stride, two_d),
            padding=padding,
            dilation=ints(node.dilation, two_d),
            groups=int(node.groups),
            bias=bias is not None,
            step_mode="m",
            dtype=weight.dtype,
        )
        return _load(where, conv, weight, bias)

    def _leak(self, where: str, node: nir.LIF | nir.LI) -> tuple[float, bool, float]:
        """(tau, decay_input, v_leak) of a spikefuse leak equal to the node's Euler step."""
        tau = uniform(where, "tau", node.tau) / self.dt
        if not tau > 1.0:
            raise NIRConversionError(
                f"{where}: tau / dt = {tau} must be > 1 for a discrete leak (dt = {self.dt}); "
                "pass the dt the graph was made for"
            )
        if close_to(node.r, 1.0):
            decay_input = True
        elif close_to(node.r, tau):
            decay_input = False
        else:
            raise NIRConversionError(
                f"{where}: r = {describe(node.r)} has no spikefuse equivalent: r = 1 is "
                f"decay_input=True, r = tau / dt = {tau} is decay_input=False"
            )
        return tau, decay_input, uniform(where, "v_leak", node.v_leak)

    def _lif(self, where: str, node: nir.LIF) -> LIFNode:
        tau, decay_input, v_leak = self._leak(where, node)
        v_reset = uniform(where, "v_reset", node.v_reset)
        if v_leak != v_reset:
            raise NIRConversionError(
                f"{where}: spikefuse's LIF leaks towards its reset potential, but v_leak = "
                f"{v_leak} differs from v_reset = {v_reset}"
            )
        return LIFNode(
            tau=tau,
            decay_input=decay_input,
            v_threshold=uniform(where, "v_threshold", node.v_threshold),
            v_reset=v_reset,
            surrogate_function=self._surrogate(),
            **self.neuron_options,
        )


def _load(
    where: str, module: nn.Linear | nn.Conv1d | nn.Conv2d, weight: Tensor, bias: Tensor | None
) -> nn.Module:
    if bias is not None and bias.shape != (weight.shape[0],):  # copy_ would broadcast it
        raise NIRConversionError(
            f"{where}: bias has shape {tuple(bias.shape)}; the weight {tuple(weight.shape)} "
            f"needs one value per output, shape ({weight.shape[0]},)"
        )
    with torch.no_grad():
        module.weight.copy_(weight)
        if bias is not None:
            assert module.bias is not None  # made with bias=True for a given bias
            module.bias.copy_(bias)
    return module
