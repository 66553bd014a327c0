"""Import of a whole graph: :func:`import_nir` checks the edges and shapes, orders the nodes and
returns an ``nn.Sequential`` for a chain or a :class:`~spikefuse.interop.nir.NIRGraphModule`."""

from __future__ import annotations

from collections import OrderedDict

import nir
from torch import nn

from ...errors import NIRConversionError
from ...surrogate import Surrogate
from ..nir_input import infer_shapes, module_keys
from .import_nodes import NodeImporter
from .modules import NIRGraphModule
from .values import check_dt


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
        dt: the time step the graph's time constants are meant for (see ``spikefuse.interop.nir``).
        surrogate_function: the surrogate of every neuron (a copy each; default Sigmoid()).
        detach_reset: ``detach_reset`` of every neuron.
        backend: ``backend`` of every neuron.

    Returns:
        an ``nn.Sequential`` (named after the NIR nodes, ``.`` replaced by ``_``) when the graph
        is a chain, else a :class:`NIRGraphModule`. Every layer has ``step_mode='m'``: input
        ``[T, N, *]``, output ``[T, N, *]``.
    """
    check_dt(dt)
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
    importer = NodeImporter(float(dt), surrogate_function, bool(detach_reset), backend)
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
