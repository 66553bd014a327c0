"""Rewriting a model in place: a :class:`FusedBlock` at each chain's synapse, :class:`FusedAway`
at its other modules, and a residual chain's forward rewritten to call ``block(x, shortcut)``."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, cast

import torch.distributed as dist
from torch import fx, nn
from torch.nn.modules.batchnorm import _BatchNorm

from ... import layer
from ...errors import SpikefuseError
from ...neuron import BaseNode
from ..blocks import FusedBlock
from .find import _Chain, _examine, _merge, _residual_addition
from .modules import _as_bn, _as_pool, _as_synapse_bn, _contained_pool
from .names import _LoadOriginalNames, _SaveUnderOriginalNames
from .report import _display, _join
from .trace import _plain_attributes, _trace, _Tracer


def _set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent), leaf, module)


def _common_parent(names: tuple[str, ...]) -> list[str]:
    """The path (as parts) of the lowest module holding all the modules ``names``."""
    common = []
    for parts in zip(*(name.split(".")[:-1] for name in names), strict=False):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return common


def _rewrite_forward(module: nn.Module, path: str, synapses: set[str]) -> tuple[str, list[_Chain]]:
    """Make ``module``'s forward call each residual chain's FusedBlock with the shortcut, and
    each chain on T and B merged by hand with the unmerged input.

    ``synapses``: the chains' synapse names, relative to ``module``. The forward is traced
    (training and eval mode, and its optional arguments at their defaults: all must give the
    same graph); in the graph, each chain's synapse, BatchNorm, addition and neuron calls become
    one call ``synapse(x, shortcut)`` (:func:`_call_with_shortcut`), or its calls from
    ``x.flatten(0, 1)`` on become ``synapse(x).reshape(T, ...)`` (:func:`_call_unmerged`), and
    the module's ``forward`` becomes that graph's code
    (an ``fx.GraphModule`` running on the module's own children, parameters and buffers; the
    class's forward stays). Returns ("", the chains) once rewritten, or (why not, [])."""
    if _Tracer().is_leaf_module(module, path):
        return f"'{_display(path)}' is called as one module", []
    try:
        graphs = _trace(module)
    except Exception as error:  # any failure: no rewrite here
        return f"the forward of {_display(path)} could not be traced ({type(error).__name__})", []
    if len({graph.python_code("self").src for _, graph in graphs}) > 1:
        return (
            f"the forward of {_display(path)} differs between training and eval mode or with its "
            "optional arguments; residual chains and chains on T and B merged by hand fuse where "
            "it does not",
            [],
        )
    plain = _plain_attributes(graphs[0][1], module)
    if plain:
        return (
            f"the forward of {_display(path)} reads tensors that are no parameter, buffer or "
            f"submodule ({', '.join(map(str, plain))}: a plain attribute, or a constant it makes); "
            "register them as buffers for residual chains to fuse",
            [],
        )
    findings = _merge([(label, _examine(graph, module, path)) for label, graph in graphs], path)
    chains = [c for c in findings.chains.values() if _rewritten(c) and c.synapse in synapses]
    if len(chains) != len(synapses):
        return f"the forward of {_display(path)} does not hold the whole chain", []
    graph = graphs[0][1]
    for chain in chains:
        synapse = next(
            n for n in graph.nodes if n.op == "call_module" and n.target == chain.synapse
        )
        if chain.addition is not None:
            _call_with_shortcut(graph, chain, synapse)
        else:
            _call_unmerged(graph, chain, synapse)
    for node in graph.nodes:  # string annotations (postponed evaluation) would not pickle
        node.type = None
    graph.lint()
    module.forward = _rewritten_forward(module, graph, type(module).__name__).forward
    return "", chains


def _rewritten(chain: _Chain) -> bool:
    """Whether fusing ``chain`` rewrites the forward that holds it (a residual addition before
    its neuron, or time and batch merged by hand around it)."""
    return chain.addition is not None or chain.reshape is not None


def _call_with_shortcut(graph: fx.Graph, chain: _Chain, synapse: fx.Node) -> None:
    """The chain's synapse, BatchNorm, addition and neuron calls become ``synapse(x, shortcut)``."""
    addition = next(n for n in graph.nodes if n.name == chain.addition)
    (neuron,) = addition.users
    last = synapse if chain.bn is None else next(iter(synapse.users))
    residual = _residual_addition(last)
    assert residual is not None and residual[0] is addition  # _examine found it
    with graph.inserting_before(neuron):
        call = graph.call_module(chain.synapse, (synapse.args[0], residual[1]))
    neuron.replace_all_uses_with(call)
    for dead in dict.fromkeys((neuron, addition, last, synapse)):
        graph.erase_node(dead)


def _call_unmerged(graph: fx.Graph, chain: _Chain, synapse: fx.Node) -> None:
    """``neuron(reshape(bn(synapse(x.flatten(0, 1))), T, ...))`` (transposes and copies between)
    becomes ``reshape(block(x), T, ...)``: the block merges T and B itself, and a reshape
    that keeps dim 0 (T) commutes with the neuron, which runs each element along T alike."""
    flat = synapse.args[0]
    assert isinstance(flat, fx.Node)  # merged_input found it
    neuron = next(n for n in graph.nodes if n.op == "call_module" and n.target == chain.node)
    reshape = next(n for n in graph.nodes if n.name == chain.reshape)
    with graph.inserting_before(neuron):
        call = graph.call_module(chain.synapse, (flat.args[0],))
        out = graph.call_method("reshape", (call, *reshape.args[1:]))
    neuron.replace_all_uses_with(out)
    dead = neuron  # the path back to the synapse: each node the only user of the one before
    while dead is not synapse:
        before = dead.args[0]
        assert isinstance(before, fx.Node)
        graph.erase_node(dead)
        dead = before
    graph.erase_node(synapse)
    if not flat.users:
        graph.erase_node(flat)


class _RewrittenForward(fx.GraphModule):
    """The GraphModule whose code a rewritten module's ``forward`` is, running on that module's
    own children, parameters and buffers (the same dicts, in copies too).

    A GraphModule and its graph refer to each other (``graph.owning_module``): that cycle would
    keep the module's children alive after the model is dropped, until a full garbage
    collection. The generated forward does not use the owner, so it is dropped
    (``graph.eliminate_dead_code()`` needs it: nothing here calls it). Copies and pickles
    (``torch.save`` of a whole model) rebuild the graph from its nodes (:func:`_node_list`):
    fx's own pickling traces the code again on load, through a tracer left in a reference cycle
    that holds the children, and its deep copy gives the forward dicts of its own."""

    def __reduce__(self) -> tuple[Any, ...]:
        shared = tuple(self.__dict__[attribute] for attribute in _SHARED)
        return _rebuilt_forward, (*shared, _node_list(self.graph), type(self).__name__)

    def __deepcopy__(self, memo: dict[int, Any]) -> _RewrittenForward:
        # what pickling keeps, with the module's dicts as its own deep copy has them (memo)
        rebuild, (*shared, nodes, class_name) = self.__reduce__()
        copied = rebuild(*copy.deepcopy(shared, memo), nodes, class_name)
        memo[id(self)] = copied
        return copied


#: The module's own dicts that its rewritten forward's GraphModule shares.
_SHARED = ("_modules", "_parameters", "_buffers")


def _rewritten_forward(module: nn.Module, graph: fx.Graph, class_name: str) -> _RewrittenForward:
    """A :class:`_RewrittenForward` of ``graph`` on ``module``'s own dicts."""
    rewritten = _RewrittenForward(module, graph, class_name=class_name)
    for attribute in _SHARED:
        rewritten.__dict__[attribute] = module.__dict__[attribute]
    rewritten.graph.owning_module = None
    return rewritten


@dataclass(frozen=True)
class _NodeRef:
    """A graph node named in another node's arguments, in :func:`_node_list`."""

    name: str


#: (op, name, target, args, kwargs) of each node of a graph, in order.
_NodeList = list[tuple[str, str, Any, Any, Any]]


def _node_list(graph: fx.Graph) -> _NodeList:
    """``graph``'s nodes as a flat list, the nodes in their arguments as :class:`_NodeRef`:
    what a rewritten forward pickles and copies (the Graph itself would pickle fx's internals,
    and recursively along its linked nodes: a few hundred exceed Python's recursion limit)."""

    def ref(node: fx.Node) -> Any:  # a _NodeRef
        return _NodeRef(node.name)

    return [
        (n.op, n.name, n.target, fx.node.map_arg(n.args, ref), fx.node.map_arg(n.kwargs, ref))
        for n in graph.nodes
    ]


def _rebuilt_forward(
    modules: dict[str, Any],
    parameters: dict[str, Any],
    buffers: dict[str, Any],
    nodes: _NodeList,
    class_name: str,
) -> _RewrittenForward:
    """A :class:`_RewrittenForward` rebuilt from :func:`_node_list` on the module's dicts
    (unpickled or deep-copied as the very dicts the module has), without tracing."""
    graph: fx.Graph = fx.Graph()
    made: dict[str, fx.Node] = {}

    def node(argument: Any) -> Any:
        return made[argument.name] if isinstance(argument, _NodeRef) else argument

    for op, name, target, args, kwargs in nodes:
        args, kwargs = fx.node.map_aggregate(args, node), fx.node.map_aggregate(kwargs, node)
        made[name] = graph.create_node(op, target, args, kwargs, name=name)
    root = nn.Module()
    root.__dict__.update(_modules=modules, _parameters=parameters, _buffers=buffers)
    return _rewritten_forward(root, graph, class_name)


class FusedAttributeError(SpikefuseError, AttributeError):
    """An attribute of a module that :func:`fuse` absorbed into a FusedBlock was read."""


class FusedAway(nn.Identity):
    """What stands at a fused BatchNorm's, neuron's or folded pooling's place: passes its input
    through (the FusedBlock at the synapse's place did the work). When the model reads an
    attribute of the module that was here (e.g. a neuron's ``.v``), it raises
    :class:`FusedAttributeError` naming that module and the block (an AttributeError:
    ``hasattr`` stays False); setting one of that module's attributes raises too (it would
    change nothing; other attributes, e.g. a quantization tag, are stored). ``train()`` /
    ``eval()`` on it reach the module in the block (``model.bn1.eval()`` freezes that BatchNorm,
    as unfused). ``role``: ``"bn"``, ``"node"``, ``"pool"`` or ``"input_pool"``, the block's
    attribute that now holds the module (``target``)."""

    # the module in the block (kept out of the module tree: it is registered in the block) and
    # its attributes when fused (those a write here would miss); unset in placeholders pickled
    # by versions without them
    _target: nn.Module | None = None
    _guarded: frozenset[str] = frozenset()

    def __init__(self, name: str, block: str, role: str, target: nn.Module | None = None) -> None:
        super().__init__()
        self.fused_name, self.block, self.role = name, block, role
        self.__dict__["_target"] = target
        if target is not None:
            kind = type(target)
            properties = {n for n in dir(kind) if isinstance(getattr(kind, n, None), property)}
            names = {*vars(target), *target._parameters, *target._buffers, *properties}
            self.__dict__["_guarded"] = frozenset(n for n in names if not n.startswith("_"))

    def train(self, mode: bool = True) -> FusedAway:
        super().train(mode)
        if self._target is not None:
            self._target.train(mode)
        return self

    def _where(self) -> str:
        return f"'{self.fused_name}' was fused into the FusedBlock at '{self.block}' (fuse())"

    def __setattr__(self, attribute: str, value: Any) -> None:
        own = attribute.startswith("_") or attribute in ("training", "fused_name", "block", "role")
        if own or attribute not in self._guarded:
            super().__setattr__(attribute, value)  # its own, or a tag (e.g. a qconfig)
            return
        raise FusedAttributeError(
            f"{self._where()}: setting '{self.fused_name}.{attribute}' would change nothing; "
            f"set '{self.block}.{self.role}.{attribute}'"
        )

    def __getattr__(self, attribute: str) -> Any:
        try:
            return super().__getattr__(attribute)
        except AttributeError:
            if attribute.startswith("_"):  # Python's and torch's own probes
                raise
        where = self._where()
        if self.role == "node":
            raise FusedAttributeError(
                f"{where}, which runs the neuron from its reset state on every call and keeps no "
                f"neuron state: fused blocks do not expose per-step potentials, so "
                f"'{self.fused_name}.{attribute}' does not exist; read it from the unfused model"
            )
        what = "BatchNorm" if self.role == "bn" else "pooling"
        raise FusedAttributeError(
            f"{where}: '{self.fused_name}.{attribute}' does not exist; the {what} is "
            f"'{self.block}.{self.role}'"
        )


def _replace(
    root: nn.Module,
    path: str,
    chain: _Chain,
    process_group: dist.ProcessGroup | None,
    memory: str,
    unfused_keys: list[str],
) -> None:
    """Put a FusedBlock at the synapse's place, :class:`FusedAway` at the BN's and neuron's,
    and hook the lowest module holding all three so that state dicts keep the unfused keys and
    their order (``path``: root's name in the model; ``unfused_keys``: the model's state dict
    keys before fusing)."""
    container = root.get_submodule(chain.synapse)
    merged = chain.reshape is not None  # single-step layers on T and B merged by hand
    synapse_bn = (container, None) if merged else _as_synapse_bn(container)
    assert synapse_bn is not None  # _examine found it
    synapse, bn = synapse_bn
    contained = type(container) is layer.SeqToANNContainer
    originals = {"synapse": chain.synapse + (".0" if contained else "")}
    if bn is not None:
        originals["bn"] = chain.synapse + ".1"
    elif chain.bn is not None:
        separate = root.get_submodule(chain.bn)
        bn = cast("_BatchNorm", separate) if merged else _as_bn(separate, synapse)
        originals["bn"] = chain.bn + (".0" if type(separate) is layer.SeqToANNContainer else "")
    node = root.get_submodule(chain.node)
    assert isinstance(node, BaseNode)  # _examine found it
    originals["node"] = chain.node
    pool = None if chain.pool is None else _as_pool(root.get_submodule(chain.pool))
    input_pool = _contained_pool(container)
    if chain.input_pool is not None:
        input_pool = _as_pool(root.get_submodule(chain.input_pool))
    residual = chain.addition is not None
    fused = FusedBlock(
        synapse, bn, node, process_group, memory, pool, residual, chain.tokens, input_pool
    )
    _set_submodule(root, chain.synapse, fused)
    block = _join(path, chain.synapse)
    roles = {chain.node: "node", chain.pool: "pool", chain.input_pool: "input_pool"}
    placeholders = []
    for name in (*chain.names[1:], *([chain.pool] if chain.pool is not None else [])):
        role = roles.get(name, "bn")
        away = FusedAway(_join(path, name), block, role, getattr(fused, role))
        away.training = fused.training
        _set_submodule(root, name, away)
        placeholders.append(role)
    fused.placeholder_roles = frozenset(placeholders)
    holder = ".".join(_common_parent(chain.names))
    skip = len(holder) + 1 if holder else 0
    renames = tuple(
        (f"{chain.synapse}.{attribute}."[skip:], f"{original}."[skip:])
        for attribute, original in originals.items()
    )
    owner = root.get_submodule(holder)
    owner_prefix = f"{_join(path, holder)}." if _join(path, holder) else ""
    order = tuple(k[len(owner_prefix) :] for k in unfused_keys if k.startswith(owner_prefix))
    owner.register_state_dict_post_hook(_SaveUnderOriginalNames(renames, order))
    loader = _LoadOriginalNames(renames)
    owner.register_load_state_dict_pre_hook(loader)
    owner.register_load_state_dict_post_hook(loader.name_keys)
