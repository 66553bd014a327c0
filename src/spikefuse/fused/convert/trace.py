"""Tracing a module's forward with ``torch.fx`` (spikefuse layers, neurons and blocks are
leaves), in every variant :func:`~spikefuse.fused.fuse` must agree on."""

from __future__ import annotations

import copy
import inspect
from typing import Any

from torch import fx, nn
from torch.nn.modules.batchnorm import _BatchNorm

from ... import layer
from ...neuron import MemoryModule
from ..blocks import FusedBlock
from ..pooling import SpikePool
from ..spec import SYNAPSES

# ---- tracing --------------------------------------------------------------------------------
_LEAVES = (
    MemoryModule,  # neurons and stateful layers (per-sequence Dropout, SynapseFilter, ...)
    FusedBlock,
    SpikePool,
    layer.SeqToANNContainer,
    layer._StepMode,
    *SYNAPSES,
    _BatchNorm,
)


class _Tracer(fx.Tracer):
    """Keeps spikefuse modules, synapses and BatchNorms (also subclasses) as single calls."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, _LEAVES) or super().is_leaf_module(m, module_qualified_name)


def _traced(module: nn.Module, **kwargs: Any) -> fx.Graph:
    """``module``'s forward graph, by a tracer that lets go of the module afterwards.

    fx's tracer ends up in reference cycles of its own (recursive closures, proxies), so only
    a full garbage collection frees it. It refers to the module, its submodules and their
    tensors. Left as it is, the tracer would keep a model that the user has dropped alive, with
    its parameters and any CUDA graph captured from it, until that collection.

    fx stores each tensor the forward makes itself (``torch.tensor(2.0)``) on the module as a
    ``_tensor_constant<i>`` attribute; those are removed again: the model stays as it was (a
    graph that reads them is not run: see :func:`_plain_attributes`). So is whatever the
    forward itself wrote while traced (a counter incremented, proxies appended to a list, a new
    attribute): every module's plain attributes are put back as they were, with the contents of
    its lists, dicts and sets, and attributes added to any module are removed.
    """
    tracer = _Tracer()
    before = [(m, dict(vars(m))) for m in module.modules()]
    containers = {  # the contents of plain list, dict and set attributes, by identity
        id(value): copy.copy(value)
        for _, attributes in before
        for name, value in attributes.items()
        if not name.startswith("_") and isinstance(value, (list, dict, set))
    }
    try:
        return tracer.trace(module, **kwargs)
    finally:
        tracer.__dict__.clear()
        for owner, attributes in before:
            for name in set(vars(owner)) - set(attributes):
                delattr(owner, name)
            for name, value in attributes.items():
                if name.startswith("_"):
                    continue
                owner.__dict__[name] = value
                contents: Any = containers.get(id(value))
                if isinstance(value, list):
                    value[:] = contents
                elif isinstance(value, (dict, set)):
                    value.clear()
                    value.update(contents)


def _plain_attributes(graph: fx.Graph, module: nn.Module) -> list[str]:
    """The attributes of ``module`` that ``graph`` reads (``get_attr``) and that are no
    parameter, buffer or submodule: a plain tensor attribute, or a constant the forward made.
    A rewritten forward runs on the module's parameters, buffers and submodules only."""
    names = {
        *(name for name, _ in module.named_parameters()),
        *(name for name, _ in module.named_buffers()),
        *(name for name, _ in module.named_modules()),
    }
    return [n.target for n in graph.nodes if n.op == "get_attr" and n.target not in names]


def _trace(module: nn.Module) -> list[tuple[str, fx.Graph]]:
    """The forward's graphs in training and in eval mode (``training`` flags are restored),
    each also with the forward's optional arguments at their defaults if it has any (traced
    symbolically, ``if mask is not None`` takes the branch of a given mask)."""
    parameters = inspect.signature(module.forward).parameters.values()
    defaults = {p.name: p.default for p in parameters if p.default is not p.empty}
    flags = [(m, m.training) for m in module.modules()]
    graphs = []
    try:
        for training in (True, False):
            for m, _ in flags:
                m.training = training
            mode = "training mode" if training else "eval mode"
            graphs.append((mode, _traced(module)))
            if defaults:
                graph = _traced(module, concrete_args=defaults)
                graphs.append((f"{mode} with default arguments", graph))
    finally:
        for m, was_training in flags:
            m.training = was_training
    return graphs


def _sequential_graph(seq: nn.Sequential) -> fx.Graph:
    """The data flow of ``nn.Sequential.forward``: each child on the previous child's output."""
    graph = fx.Graph()
    value = graph.placeholder("input")
    for name in seq._modules:
        value = graph.call_module(name, (value,))
    graph.output(value)
    return graph
