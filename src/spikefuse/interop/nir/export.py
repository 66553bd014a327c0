"""Export of a whole model: :func:`export_nir` walks an ``nn.Sequential`` or a
:class:`~spikefuse.interop.nir.NIRGraphModule` leaf by leaf and connects their NIR nodes."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import nir
import numpy as np
from torch import nn

from ... import layer
from ...errors import NIRConversionError
from ...fused import FusedBlock, SpikePool
from ...fused.spec import SYNAPSES
from ..nir_input import check_sample_shape
from .export_nodes import BATCHNORM, NodeExporter
from .modules import NIRGraphModule
from .values import check_dt

# The containers whose children run one after another; spikefuse's are subclasses of torch's.
_CHAINS = (nn.Sequential, layer.SeqToANNContainer)


def export_nir(model: nn.Module, input_shape: Sequence[int], *, dt: float) -> nir.NIRGraph:
    """Convert a spikefuse model into an ``nir.NIRGraph`` (the math: ``spikefuse.interop.nir``).

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
    check_dt(dt)
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
    """Walks chains and graphs of leaves, converting each leaf with a :class:`NodeExporter`."""

    def __init__(self, dt: float) -> None:
        self.nodes = NodeExporter(dt)

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
                if isinstance(following, BATCHNORM):
                    bn = following
                    i += 1
            # the shape a neuron's arrays get: bounded before the next node allocates them
            shape = check_sample_shape(f"{name} ({type(module).__name__})", shape)
            node, shape = self.nodes.node(name, module, bn, shape)
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


def _common_shape(name: str, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    if any(s != shapes[0] for s in shapes):
        raise NIRConversionError(f"{name}: the inputs summed here have different shapes {shapes}")
    return shapes[0]
