"""Export to and import from the Neuromorphic Intermediate Representation (NIR).

:func:`export_nir` turns a spikefuse model into an ``nir.NIRGraph``; :func:`import_nir` turns an
``nir.NIRGraph`` (e.g. from snnTorch, Norse, Sinabs, Rockpool) into a spikefuse model that runs
multi-step (``[T, N, *]``) on every backend and can be passed to :func:`spikefuse.fuse`.

Time. NIR describes neurons by continuous-time equations; a step of a discrete simulator is
forward Euler with step ``dt``. NIR graphs do not store ``dt``: every simulator picks its own
(Norse's ``from_nir`` defaults to 1e-3, snnTorch fixes 1e-4), so both functions take it as a
required argument. With NIR's

    LIF:  tau dv/dt = (v_leak - v) + r I       ->  v[t] = v[t-1] + dt/tau (v_leak - v[t-1] + r I[t])
    IF:       dv/dt = r I                      ->  v[t] = v[t-1] + dt r I[t]
    fire: z = 1 if v > v_threshold; reset: v = v_reset where z = 1

spikefuse's discrete neurons (V_reset is the hard-reset potential)

    LIFNode(decay_input=True):  H = V + (X - (V - V_reset)) / tau
    LIFNode(decay_input=False): H = V - (V - V_reset) / tau + X
    IFNode:                     H = V + X

map one to one, in both directions, as

    =====================  ================  ==============  =========  ============  ==========
    spikefuse              NIR node          tau             r          v_leak        v_reset
    =====================  ================  ==============  =========  ============  ==========
    LIF, decay_input=True  ``nir.LIF``       tau * dt        1          V_reset       V_reset
    LIF, decay_input=False ``nir.LIF``       tau * dt        tau        V_reset       V_reset
    IF                     ``nir.IF``        --              1 / dt     --            V_reset
    LeakyIntegrator        ``nir.LI``        tau * dt        1 or tau   v_leak        --
    =====================  ================  ==============  =========  ============  ==========

and ``v_threshold`` = V_th. Import inverts this: tau = tau_NIR / dt (must be > 1), r = 1 gives
``decay_input=True``, r = tau gives ``decay_input=False`` (both up to float32 rounding of the
stored values), and v_leak must equal v_reset because spikefuse's LIF leaks towards its reset
potential. :class:`LeakyIntegrator` is NIR's non-spiking ``LI`` (a LIF that never fires,
outputting V). With ``dt`` a power of two (e.g. 1) a round trip returns bit-identical parameters.
NIR stores parameters per neuron; spikefuse neurons have one value per layer, so import needs
them uniform. Differences that are not mapped:

* soft reset (``v_reset=None``, V -= V_th): NIR resets to v_reset only, so export refuses it;
* spikes: spikefuse fires at H >= V_th (SpikingJelly's Heaviside), NIR at v > v_threshold; they
  differ only when the potential equals the threshold exactly;
* the initial potential is not part of NIR; spikefuse starts at V_reset (Norse at v_leak,
  snnTorch at 0: the same whenever v_leak = v_reset = 0);
* surrogate gradients and ``detach_reset`` shape only training; they are not exported, and
  import takes them as arguments (default: ``surrogate.Sigmoid()``, ``detach_reset=False``);
* ``ParametricLIFNode`` exports its current tau = 1/sigmoid(w) and imports as a fixed LIFNode.

Other simulators read NIR their own way (checked in ``tests/test_nir.py``): snnTorch's import
fixes dt = 1e-4, maps r dt / tau = 1 to ``Leaky(beta = 1 - dt / tau)`` and resets to zero, which
is ``decay_input=False`` with ``v_reset=0``; Norse's ``from_nir`` ignores r and v_reset, adds
an IF's input unscaled and its export writes tau = dt / tau_mem_inv, so models move to and from
Norse with dt = 1, ``decay_input=True`` and ``v_reset=0``. Imported layers keep the dtype of the
graph's arrays (float64 arrays give float64 layers; ``model.float()`` converts).

Other nodes: Linear/Conv1d/Conv2d are ``nir.Affine``/``nir.Linear``/``nir.Conv1d``/
``nir.Conv2d`` (an eval-mode BatchNorm right after one, also inside a fused block, is folded into
its weight and bias: W' = W gamma / sqrt(var + eps), b' = (b - mean) gamma / sqrt(var + eps) +
beta); ``Flatten`` is ``nir.Flatten`` (NIR counts dimensions without the batch); ``AvgPool2d`` is
``nir.AvgPool2d`` and ``AvgPool2d(divisor_override=1)`` is ``nir.SumPool2d``; :class:`Scale` is
``nir.Scale``. A node with several incoming edges receives their sum. Import refuses with
:class:`NIRConversionError`, naming the node, what has no spikefuse equivalent: ``I``,
``CubaLI``, ``CubaLIF`` (two-state, current-based), ``Threshold`` (stateless), ``Delay``, nested
graphs, recurrent edges (spikefuse neurons run a whole sequence per call) and non-uniform neuron
parameters. Export refuses QIF/EIF/Izhikevich and custom neurons, soft reset, MaxPool, training-
mode BatchNorm and any module it does not know.

Input is checked as possibly hostile (:mod:`spikefuse.interop.nir_input`): import follows the
per-sample shapes along every edge itself (nir's type check may be off) and refuses a node that
cannot take its input or inputs that would broadcast; node names that are attributes of torch's
containers get the prefix ``node_``; :func:`read_nir` reads a file only after checking its size,
signature and declared dataset sizes; export refuses per-sample shapes whose per-neuron arrays
would exceed ``MAX_SAMPLE_ELEMENTS`` elements.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypedDict, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

try:
    import nir
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "spikefuse.interop.nir needs the 'nir' package: pip install 'spikefuse[nir]'"
    ) from exc

from .. import definitions as defs
from .. import layer
from ..errors import NIRConversionError
from ..fused import FusedBlock, SpikePool
from ..fused.spec import SYNAPSES
from ..neuron import BaseNode, IFNode, LIFNode
from ..surrogate import Rect, Surrogate, is_finite_real
from .nir_input import check_sample_shape, infer_shapes, module_keys, read_nir

__all__ = [
    "LeakyIntegrator",
    "NIRConversionError",
    "NIRGraphModule",
    "Scale",
    "export_nir",
    "import_nir",
    "read_nir",
]

# NIR stores parameters in float32 by many exporters: values within this relative distance of
# what a spikefuse neuron needs (r = 1, r = tau, dt r = 1) are taken as equal.
_REL_TOL = 1e-6
# The torch layers NIR can express; spikefuse's layer.Linear etc. are subclasses of them.
_BATCHNORM = (nn.BatchNorm1d, nn.BatchNorm2d)
_CHAINS = (nn.Sequential, layer.SeqToANNContainer)
_LIF_DEFS = {defs.LIF: True, defs.LIF_NO_DECAY_INPUT: False}  # definition -> decay_input
_PLIF_DEFS = {defs.PLIF: True, defs.PLIF_NO_DECAY_INPUT: False}


class Scale(nn.Module):
    """Element-wise scaling by a fixed per-sample array (NIR's ``Scale``): y = x * scale.

    ``scale`` has the per-sample shape ``[*]``; input ``[..., *]`` (any leading dimensions,
    e.g. ``[T, N, *]``) is broadcast against it.
    """

    scale: Tensor  # a buffer

    def __init__(self, scale: Tensor) -> None:
        super().__init__()
        self.register_buffer("scale", scale.detach().clone())

    def forward(self, x: Tensor) -> Tensor:
        return x * self.scale

    def extra_repr(self) -> str:
        return f"shape={tuple(self.scale.shape)}"


# A threshold no potential reaches: float32's largest value, the largest a neuron's constants
# may take (they are checked in float32).
_NEVER = float(torch.finfo(torch.float32).max)


class LeakyIntegrator(nn.Module):
    """Non-spiking leaky integrator (NIR's ``LI``) on multi-step input ``[T, N, *]``.

    Outputs the potential V[t] of ``LIFNode(tau, decay_input, v_reset=v_leak)`` with firing
    disabled (its threshold is float32's largest value, so H >= V_th never holds and the
    rectangular surrogate's derivative is 0): the same kernels on every backend. V starts at
    v_leak.

    decay_input=True:  V[t] = V[t-1] + (X[t] - (V[t-1] - v_leak)) / tau
    decay_input=False: V[t] = V[t-1] - (V[t-1] - v_leak) / tau + X[t]
    """

    def __init__(
        self, tau: float, decay_input: bool = True, v_leak: float = 0.0, backend: str = "auto"
    ) -> None:
        super().__init__()
        self.node = LIFNode(
            tau=tau,
            decay_input=decay_input,
            v_threshold=_NEVER,
            v_reset=v_leak,
            surrogate_function=Rect(),
            step_mode="m",
            backend=backend,
            store_v_seq=True,
        )

    def forward(self, x_seq: Tensor) -> Tensor:
        self.node(x_seq)
        v_seq = self.node.v_seq
        assert isinstance(v_seq, Tensor)  # store_v_seq=True, multi-step
        return v_seq


class NIRGraphModule(nn.Module):
    """A NIR graph with branches (e.g. residual additions), run on multi-step input ``[T, N, *]``.

    The graph is cut into chains (``nn.Sequential``, so :func:`spikefuse.fuse` finds the
    Conv→neuron runs inside them), run in topological order; a chain whose first node has several
    incoming edges receives the sum of their outputs, in edge order.

    Args:
        chains: chain name -> ``nn.Sequential``, in topological order.
        sources: chain name -> names of the chains feeding it (``""`` is the graph input).
        output_sources: names of the chains feeding the graph output.
    """

    def __init__(
        self,
        chains: Mapping[str, nn.Sequential],
        sources: Mapping[str, Sequence[str]],
        output_sources: Sequence[str],
    ) -> None:
        super().__init__()
        self.chains = nn.ModuleDict(chains)
        known = {""}
        for name in self.chains:
            missing = [s for s in sources.get(name, ()) if s not in known]
            if name not in sources or not sources[name] or missing:
                raise NIRConversionError(
                    f"NIRGraphModule: chain {name!r} needs sources among the earlier chains "
                    f"{sorted(known)}, got {list(sources.get(name, ()))}"
                )
            known.add(name)
        if not output_sources or any(s not in known for s in output_sources):
            raise NIRConversionError(
                f"NIRGraphModule: output sources {list(output_sources)} must be chains or ''"
            )
        self.sources = {name: tuple(sources[name]) for name in self.chains}
        self.output_sources = tuple(output_sources)

    def forward(self, x: Tensor) -> Tensor:
        values = {"": x}
        for name, chain in self.chains.items():
            values[name] = chain(_sum(values, self.sources[name]))
        return _sum(values, self.output_sources)


def _sum(values: dict[str, Tensor], names: Sequence[str]) -> Tensor:
    total = values[names[0]]
    for name in names[1:]:
        total = total + values[name]
    return total


# ---- export ----------------------------------------------------------------------------------
def export_nir(model: nn.Module, input_shape: Sequence[int], *, dt: float) -> nir.NIRGraph:
    """Convert a spikefuse model into an ``nir.NIRGraph`` (see the module docstring for the math).

    Args:
        model: an ``nn.Sequential`` (nested ones and ``layer.SeqToANNContainer`` included) of
            spikefuse or torch layers and spikefuse neurons, a model converted by
            :func:`spikefuse.fuse` (fused blocks export as their unfused equivalent, BatchNorm
            folded in), or a :class:`NIRGraphModule`. BatchNorm must be in eval mode.
        input_shape: the shape of one sample, without time and batch (e.g. ``(1, 28, 28)``).
        dt: the time step, in the time unit of the NIR time constants (e.g. 1e-3 for Norse's
            default, 1e-4 for snnTorch's import, 1.0 for exact round trips).

    Returns:
        a type-checked ``nir.NIRGraph`` with nodes ``input`` and ``output``.
    """
    _check_dt(dt)
    shape = check_sample_shape("export_nir: input_shape", input_shape)
    exporter = _Exporter(dt)
    if isinstance(model, NIRGraphModule):
        return exporter.graph_module(model, shape)
    if type(model) not in _CHAINS:
        raise NIRConversionError(
            f"export_nir: the model must be an nn.Sequential or a NIRGraphModule (the data flow "
            f"of another module's forward is unknown), got {type(model).__name__}"
        )
    nodes, out_shape = exporter.chain(list(_leaves(model, "")), shape)
    names = [name for name, _ in nodes]
    return _graph(nodes, _chain_edges(names, ["input"], "output"), shape, out_shape)


def _check_dt(dt: float) -> None:
    if not is_finite_real(dt) or dt <= 0:
        raise NIRConversionError(f"dt must be a positive finite float, got {dt!r}")


def _leaves(module: nn.Module, prefix: str) -> Iterator[tuple[str, nn.Module]]:
    """(dotted name, module) of every leaf in data-flow order; fused blocks are expanded."""
    if type(module) in _CHAINS:
        for child_name, child in module.named_children():
            yield from _leaves(child, f"{prefix}.{child_name}" if prefix else child_name)
    elif isinstance(module, FusedBlock):
        yield prefix, module.synapse
        if module.bn is not None:
            yield f"{prefix}.bn", module.bn
        yield f"{prefix}.node", module.node
        if module.pool is not None:  # pooling folded into the block: after the neuron
            yield f"{prefix}.pool", module.pool
    elif isinstance(module, SpikePool):
        yield prefix, module.pool
    elif not isinstance(module, nn.Identity):  # incl. what fuse() leaves at fused modules
        yield prefix, module


def _chain_edges(names: list[str], sources: list[str], sink: str | None) -> list[tuple[str, str]]:
    path = [*names, sink] if sink is not None else names
    if not names:
        return [(s, sink) for s in sources] if sink is not None else []
    edges = [(s, names[0]) for s in sources]
    return edges + [(a, b) for a, b in zip(path, path[1:], strict=False)]


def _graph(
    nodes: list[tuple[str, nir.NIRNode]],
    edges: list[tuple[str, str]],
    in_shape: tuple[int, ...],
    out_shape: tuple[int, ...],
) -> nir.NIRGraph:
    taken = {name for name, _ in nodes}
    if {"input", "output"} & taken:
        raise NIRConversionError(
            f"export_nir: module names {sorted({'input', 'output'} & taken)} are reserved for the "
            "graph's input and output nodes; rename those modules"
        )
    all_nodes = {"input": nir.Input(input_type=np.array(in_shape))}
    all_nodes.update(nodes)
    all_nodes["output"] = nir.Output(output_type=np.array(out_shape))
    return nir.NIRGraph(nodes=all_nodes, edges=edges)


class _Exporter:
    def __init__(self, dt: float) -> None:
        self.dt = float(dt)

    def chain(
        self, leaves: list[tuple[str, nn.Module]], shape: tuple[int, ...]
    ) -> tuple[list[tuple[str, nir.NIRNode]], tuple[int, ...]]:
        """NIR nodes of consecutive leaves (BatchNorm folded into the synapse before it)."""
        nodes = []
        i = 0
        while i < len(leaves):
            name, module = leaves[i]
            bn = None
            is_synapse = isinstance(module, SYNAPSES)
            if is_synapse and i + 1 < len(leaves):
                following = leaves[i + 1][1]
                if isinstance(following, _BATCHNORM):
                    bn = following
                    i += 1
            # the shape a neuron's arrays get: bounded before the next node allocates them
            shape = check_sample_shape(f"{name} ({type(module).__name__})", shape)
            node, shape = self.node(name, module, bn, shape)
            nodes.append((name, node))
            i += 1
        return nodes, shape

    def graph_module(self, model: NIRGraphModule, shape: tuple[int, ...]) -> nir.NIRGraph:
        nodes, edges = [], []
        out_names = {"": ["input"]}  # chain -> names of the NIR nodes whose output it yields
        shapes = {"": shape}
        for chain_name, chain in model.chains.items():
            sources = model.sources[chain_name]
            in_shape = _common_shape(chain_name, [shapes[s] for s in sources])
            chain_nodes, shapes[chain_name] = self.chain(list(_leaves(chain, "")), in_shape)
            names = [name for name, _ in chain_nodes]
            feeding = [n for s in sources for n in out_names[s]]
            edges += _chain_edges(names, feeding, None)
            out_names[chain_name] = names[-1:] or feeding
            nodes += chain_nodes
        out_shape = _common_shape("output", [shapes[s] for s in model.output_sources])
        edges += [(n, "output") for s in model.output_sources for n in out_names[s]]
        return _graph(nodes, edges, shape, out_shape)

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
        if isinstance(module, _BATCHNORM):
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
            return nir.Scale(scale=_array(module.scale)), shape
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
        padding = conv.padding if isinstance(conv.padding, str) else _ints(conv.padding, two_d)
        kwargs = dict(
            weight=weight,
            stride=_ints(conv.stride, two_d),
            padding=padding,
            dilation=_ints(conv.dilation, two_d),
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
        """NIR's tau, r and v_leak of a discrete leak towards v_leak (module docstring)."""
        values = {"tau": tau * self.dt, "r": 1.0 if decay_input else tau, "v_leak": v_leak}
        return {k: np.full(shape, float(v), dtype=np.float64) for k, v in values.items()}


def _common_shape(name: str, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    if any(s != shapes[0] for s in shapes):
        raise NIRConversionError(f"{name}: the inputs summed here have different shapes {shapes}")
    return shapes[0]


def _array(t: Tensor) -> np.ndarray:
    t = t.detach().cpu()
    # numpy has no bfloat16; float32 holds every bfloat16 value exactly
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy().copy()


def _ints(value: Any, pair: bool) -> int | tuple[int, int]:
    """An int (1-D) or an (int, int) pair (2-D) from a torch or NIR argument."""
    values = [int(v) for v in np.atleast_1d(np.asarray(value))]
    if pair and len(values) in (1, 2):
        return values[0], values[-1]
    if not pair and len(values) == 1:
        return values[0]
    raise NIRConversionError(f"expected {'a pair of ints' if pair else 'one int'}, got {value!r}")


def _folded(
    where: str, synapse: nn.Linear | nn.Conv1d | nn.Conv2d, bn: _BatchNorm | None
) -> tuple[np.ndarray, np.ndarray | None]:
    """Weight and bias of ``synapse`` with an eval-mode BatchNorm after it folded in."""
    weight = synapse.weight.detach()
    bias = None if synapse.bias is None else synapse.bias.detach()
    if bn is None:
        return _array(weight), None if bias is None else _array(bias)
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
    return _array(folded_weight), _array(centred * scale + shift)


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
    kernel, padding = _ints(pool.kernel_size, True), _ints(pool.padding, True)
    stride = _ints(pool.stride if pool.stride is not None else pool.kernel_size, True)
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


# ---- import ----------------------------------------------------------------------------------
def import_nir(
    graph: nir.NIRGraph,
    *,
    dt: float,
    surrogate_function: Surrogate | None = None,
    detach_reset: bool = False,
    backend: str = "auto",
) -> nn.Module:
    """Build a multi-step spikefuse model from an ``nir.NIRGraph``.

    Args:
        graph: the graph; one ``Input`` and one ``Output`` node.
        dt: the time step the graph's time constants are meant for (see the module docstring).
        surrogate_function: the surrogate of every neuron (a copy each; default Sigmoid()).
        detach_reset: ``detach_reset`` of every neuron.
        backend: ``backend`` of every neuron.

    Returns:
        an ``nn.Sequential`` (named after the NIR nodes, ``.`` replaced by ``_``) when the graph
        is a chain, else a :class:`NIRGraphModule`. Every layer has ``step_mode='m'``: input
        ``[T, N, *]``, output ``[T, N, *]``.
    """
    _check_dt(dt)
    if not isinstance(graph, nir.NIRGraph):
        raise NIRConversionError(
            f"import_nir: expected an nir.NIRGraph, got {type(graph).__name__}"
        )
    inputs = [n for n, node in graph.nodes.items() if isinstance(node, nir.Input)]
    outputs = [n for n, node in graph.nodes.items() if isinstance(node, nir.Output)]
    if len(inputs) != 1 or len(outputs) != 1:
        raise NIRConversionError(
            f"import_nir: the graph needs exactly one Input and one Output node, has inputs "
            f"{inputs} and outputs {outputs}"
        )
    source, sink = inputs[0], outputs[0]
    preds, succs = _adjacency(graph)
    order = _topological_order(graph, preds, succs, source, sink)
    keys = module_keys(order)
    infer_shapes(graph, [source, *order], preds, sink)  # before any module is built
    importer = _Importer(float(dt), surrogate_function, bool(detach_reset), backend)
    modules = OrderedDict((keys[n], importer.module(n, graph.nodes[n])) for n in order)
    if all(len(preds[n]) == 1 and len(succs[n]) == 1 for n in order) and len(succs[source]) == 1:
        return nn.Sequential(modules)
    return _graph_module(modules, keys, order, preds, succs, source, sink)


def _adjacency(graph: nir.NIRGraph) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    preds: dict[str, list[str]] = {name: [] for name in graph.nodes}
    succs: dict[str, list[str]] = {name: [] for name in graph.nodes}
    for a, b in graph.edges:
        for end in (a, b):
            if end not in graph.nodes:
                raise NIRConversionError(f"import_nir: edge {(a, b)} names unknown node {end!r}")
        if b in succs[a]:
            raise NIRConversionError(f"import_nir: duplicate edge {(a, b)}")
        succs[a].append(b)
        preds[b].append(a)
    return preds, succs


def _topological_order(graph, preds, succs, source: str, sink: str) -> list[str]:
    """Nodes other than input and output, in an order where every edge points forward."""
    if preds[source] or succs[sink]:
        raise NIRConversionError("import_nir: edges into the Input or out of the Output node")
    remaining = {name: len(p) for name, p in preds.items()}
    ready, order = [source], []
    while ready:
        name = ready.pop(0)
        order.append(name)
        for nxt in succs[name]:
            remaining[nxt] -= 1
            if remaining[nxt] == 0:
                ready.append(nxt)
    cyclic = [name for name, count in remaining.items() if count > 0]
    if cyclic:
        raise NIRConversionError(
            f"import_nir: nodes {cyclic} are on a recurrent loop; spikefuse neurons run a whole "
            "sequence per call, so recurrent edges cannot be imported"
        )
    stray = [n for n in graph.nodes if n != sink and (n not in order or not succs[n])]
    if stray or sink not in order:
        raise NIRConversionError(
            f"import_nir: nodes {stray or [sink]} are not on a path from the input to the output"
        )
    return [n for n in order if n not in (source, sink)]


def _graph_module(modules, keys, order, preds, succs, source, sink) -> NIRGraphModule:
    """Group the nodes into chains (a node joins its predecessor's chain when it is that
    predecessor's only successor and has no other input) and connect the chains."""
    chain_of: dict[str, str] = {source: ""}
    chains: OrderedDict[str, OrderedDict[str, nn.Module]] = OrderedDict()
    sources: dict[str, list[str]] = {}
    for name in order:
        (pred,) = preds[name] if len(preds[name]) == 1 else (None,)
        if pred is not None and pred != source and len(succs[pred]) == 1:
            chain_of[name] = chain_of[pred]
        else:
            chain_of[name] = keys[name]
            chains[keys[name]] = OrderedDict()
            sources[keys[name]] = [chain_of[p] for p in preds[name]]
        chains[chain_of[name]][keys[name]] = modules[keys[name]]
    return NIRGraphModule(
        OrderedDict((k, nn.Sequential(v)) for k, v in chains.items()),
        sources,
        [chain_of[p] for p in preds[sink]],
    )


class _NeuronOptions(TypedDict):
    """The keyword arguments every imported neuron gets."""

    detach_reset: bool
    step_mode: str
    backend: str


class _Importer:
    def __init__(
        self, dt: float, surrogate_function: Surrogate | None, detach_reset: bool, backend: str
    ) -> None:
        self.dt = dt
        self.neuron_options = _NeuronOptions(
            detach_reset=detach_reset, step_mode="m", backend=backend
        )
        self.surrogate_function = surrogate_function

    def module(self, name: str, node: nir.NIRNode) -> nn.Module:
        where = f"NIR node {name!r} ({type(node).__name__})"
        if isinstance(node, (nir.Affine, nir.Linear)):
            weight = _tensor(where, "weight", node.weight)
            if weight.dim() != 2:
                raise NIRConversionError(f"{where}: weight must be 2-D, got {tuple(weight.shape)}")
            bias = _tensor(where, "bias", node.bias) if isinstance(node, nir.Affine) else None
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
                _ints(node.kernel_size, True),
                _ints(node.stride, True),
                _ints(node.padding, True),
                divisor_override=1 if sum_pool else None,
                step_mode="m",
            )
        if isinstance(node, nir.Scale):
            return Scale(_tensor(where, "scale", node.scale))
        if isinstance(node, nir.IF):
            if not _close(node.r, 1.0 / self.dt):
                raise NIRConversionError(
                    f"{where}: spikefuse's IF adds its input unscaled, which needs dt * r = 1; "
                    f"got r = {_describe(node.r)} with dt = {self.dt}"
                )
            return IFNode(
                v_threshold=_uniform(where, "v_threshold", node.v_threshold),
                v_reset=_uniform(where, "v_reset", node.v_reset),
                surrogate_function=self._surrogate(),
                **self.neuron_options,
            )
        if isinstance(node, nir.LIF):
            return self._lif(where, node)
        if isinstance(node, nir.LI):
            tau, decay_input, v_leak = self._leak(where, node)
            return LeakyIntegrator(tau, decay_input, v_leak, self.neuron_options["backend"])
        raise NIRConversionError(
            f"{where}: no spikefuse equivalent (supported: Affine, Linear, Conv1d, Conv2d, Flatten, "
            "AvgPool2d, SumPool2d, Scale, IF, LI, LIF)"
        )

    def _surrogate(self) -> Surrogate | None:
        return copy.deepcopy(self.surrogate_function)

    def _conv(self, where: str, node: nir.Conv1d | nir.Conv2d) -> nn.Module:
        two_d = isinstance(node, nir.Conv2d)
        weight = _tensor(where, "weight", node.weight)
        if weight.dim() != (4 if two_d else 3):
            raise NIRConversionError(f"{where}: weight has shape {tuple(weight.shape)}")
        bias_values = _tensor(where, "bias", node.bias)
        bias = bias_values if bool(bias_values.any()) else None  # exporters write 0 for no bias
        cls = layer.Conv2d if two_d else layer.Conv1d
        padding = node.padding if isinstance(node.padding, str) else _ints(node.padding, two_d)
        conv = cls(
            weight.shape[1] * int(node.groups),
            weight.shape[0],
            tuple(weight.shape[2:]),
            stride=_ints(node.stride, two_d),
            padding=padding,
            dilation=_ints(node.dilation, two_d),
            groups=int(node.groups),
            bias=bias is not None,
            step_mode="m",
            dtype=weight.dtype,
        )
        return _load(where, conv, weight, bias)

    def _leak(self, where: str, node: nir.LIF | nir.LI) -> tuple[float, bool, float]:
        """(tau, decay_input, v_leak) of a spikefuse leak equal to the node's Euler step."""
        tau = _uniform(where, "tau", node.tau) / self.dt
        if not tau > 1.0:
            raise NIRConversionError(
                f"{where}: tau / dt = {tau} must be > 1 for a discrete leak (dt = {self.dt}); "
                "pass the dt the graph was made for"
            )
        if _close(node.r, 1.0):
            decay_input = True
        elif _close(node.r, tau):
            decay_input = False
        else:
            raise NIRConversionError(
                f"{where}: r = {_describe(node.r)} has no spikefuse equivalent: r = 1 is "
                f"decay_input=True, r = tau / dt = {tau} is decay_input=False"
            )
        return tau, decay_input, _uniform(where, "v_leak", node.v_leak)

    def _lif(self, where: str, node: nir.LIF) -> LIFNode:
        tau, decay_input, v_leak = self._leak(where, node)
        v_reset = _uniform(where, "v_reset", node.v_reset)
        if v_leak != v_reset:
            raise NIRConversionError(
                f"{where}: spikefuse's LIF leaks towards its reset potential, but v_leak = "
                f"{v_leak} differs from v_reset = {v_reset}"
            )
        return LIFNode(
            tau=tau,
            decay_input=decay_input,
            v_threshold=_uniform(where, "v_threshold", node.v_threshold),
            v_reset=v_reset,
            surrogate_function=self._surrogate(),
            **self.neuron_options,
        )


def _tensor(where: str, field: str, value: Any) -> Tensor:
    array = np.asarray(value)
    if not np.issubdtype(array.dtype, np.floating) and not np.issubdtype(array.dtype, np.integer):
        raise NIRConversionError(f"{where}: {field} must be numeric, got dtype {array.dtype}")
    if not np.all(np.isfinite(array)):
        raise NIRConversionError(f"{where}: {field} contains NaN or infinite values")
    if not np.issubdtype(array.dtype, np.floating):
        array = array.astype(np.float32)
    return torch.from_numpy(np.array(array))  # a copy: the graph keeps its own arrays


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


def _uniform(where: str, field: str, value: Any) -> float:
    array = np.asarray(value, dtype=np.float64)
    if array.size == 0 or not np.all(np.isfinite(array)):
        raise NIRConversionError(f"{where}: {field} must be finite and non-empty")
    first = array.flat[0]
    if not np.all(array == first):
        raise NIRConversionError(
            f"{where}: spikefuse neurons have one {field} per layer, but this node has "
            f"{np.unique(array).size} different values"
        )
    return float(first)


def _close(value: Any, target: float) -> bool:
    array = np.asarray(value, dtype=np.float64)
    return array.size > 0 and bool(np.all(np.abs(array - target) <= _REL_TOL * abs(target)))


def _describe(value: Any) -> str:
    array = np.asarray(value, dtype=np.float64)
    low, high = float(array.min()), float(array.max())
    return f"{low}" if low == high else f"{low}..{high}"
