"""Converting existing models: :func:`fuse` and the report it gives.

``fuse`` finds every ``Conv/Linear → [BatchNorm] → neuron`` chain in a model's data flow, whatever
the containers or custom ``forward`` methods, and replaces each by a :class:`FusedBlock`:

1. The forward of the model is traced with ``torch.fx`` (spikefuse neurons and layers, torch
   layers, :class:`FusedBlock` and :class:`SpikePool` are leaves), in training and in eval
   mode, and if the forward has optional arguments, also with them at their defaults; only
   chains that every variant agrees on are fused. A chain is a call of a synapse whose output
   is used only by a BatchNorm call whose output is used only by a neuron call (or the synapse
   directly followed by the neuron), or, a *residual chain*, only by an addition
   ``+ shortcut`` whose result is used only by a neuron call (Spiking ResNet's
   ``sn2(bn2(conv2(out)) + identity)``).
2. The traced graph is only evidence: the model is patched in place, keeping the user's
   classes. The synapse's attribute becomes the FusedBlock (which holds the original synapse,
   BatchNorm and neuron), the BatchNorm's and neuron's attributes become :class:`FusedAway`
   (an ``nn.Identity``); the forward still calls all three, which together compute what the
   chain did. A 2 x 2 average pooling that is the sole user of a Conv2d chain's spikes is folded
   into the block too (its attribute becomes :class:`FusedAway`; the report says which pools
   were folded and why others were not).
   A residual chain's addition cannot be patched that way: the lowest module whose own
   forward holds the chain gets, as its ``forward`` attribute, the code of its traced graph in
   which synapse, BatchNorm, addition and neuron are one call ``block(x, shortcut)`` (an
   ``fx.GraphModule`` sharing the module's children, parameters and buffers; its class and
   the class's ``forward`` stay). That needs the same graph in every traced variant.
3. Where tracing fails (data-dependent control flow, ...), each child is tried on its own and
   an ``nn.Sequential``'s children are searched in order (its forward is known).
4. State dict hooks on the module holding each chain save the chain's parameters and buffers
   under the unfused model's keys and load either naming, so ``state_dict``s of fused and
   unfused models load into each other with ``strict=True``.
"""

from __future__ import annotations

import copy
import inspect
import logging
import operator
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypeGuard, overload

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.utils import parametrize

from .. import layer
from ..errors import SpikefuseError
from ..neuron import BaseNode, MemoryModule
from .blocks import FusedBlock
from .memory import memory_modes
from .pooling import SpikePool
from .recompute import RecomputedInput, flatten_keeps_tags
from .spec import BN_FOR, EXACT, POOLS, SYNAPSES, hook_kinds, pool_fold_problem, synapse_kind

log = logging.getLogger("spikefuse.fuse")
MODEL = "<model>"  # how reports name the model itself


# ---- the report -----------------------------------------------------------------------------
@dataclass(frozen=True)
class FusedChain:
    """A chain replaced by a FusedBlock.

    ``modules``: the original modules' names (synapse, [BatchNorm], neuron); ``block``: where
    the FusedBlock is (the synapse's name; the others are now :class:`FusedAway`); ``pool``:
    the average pooling folded into the block (also a :class:`FusedAway` now), or None;
    ``residual``: whether a residual addition sits before the neuron (``neuron(BN(synapse(x))
    + shortcut)``; the forward holding it now runs a rewritten graph, see :func:`fuse`)."""

    block: str
    modules: tuple[str, ...]
    pool: str | None = None
    residual: bool = False


@dataclass(frozen=True)
class SkippedCandidate:
    """A Conv/Linear call that was not fused.

    ``modules``: the synapse and the modules after it that were examined; ``reason``: why;
    ``is_chain``: True if the data flow is a ``synapse → [BatchNorm] → neuron`` chain that a
    condition kept unfused (``store_v_seq``, single-step, two-state neuron, ...), False if the
    data flow is no such chain (e.g. Conv → BN → residual addition), None if unknown (the
    forward could not be traced)."""

    modules: tuple[str, ...]
    reason: str
    is_chain: bool | None


@dataclass
class FuseReport:
    """What :func:`fuse` did. ``str(report)`` is a readable summary.

    ``fused``: the chains now fused; ``skipped``: every other Conv/Linear call, with the reason;
    ``pools``: pooling layers now :class:`SpikePool`; ``unfolded_pools``: pooling layers right
    after a fused chain that were not folded into its block (name → why); ``traced``: modules
    whose forward was traced with torch.fx; ``untraced``: modules whose forward could not be
    traced (name → error), searched as a module tree instead; ``rewritten``: modules whose
    forward now runs a rewritten graph (they hold residual chains); ``recomputed_inputs``:
    unfused Conv/Linear layers that save a fused block's spikes as their recipe (see
    :class:`~spikefuse.fused.recompute.RecomputedInput`). The folded pools:
    :attr:`folded_pools`."""

    fused: list[FusedChain] = field(default_factory=list)
    skipped: list[SkippedCandidate] = field(default_factory=list)
    pools: list[str] = field(default_factory=list)
    unfolded_pools: dict[str, str] = field(default_factory=dict)
    traced: list[str] = field(default_factory=list)
    untraced: dict[str, str] = field(default_factory=dict)
    rewritten: list[str] = field(default_factory=list)
    recomputed_inputs: list[str] = field(default_factory=list)

    @property
    def chains(self) -> int:
        """The number of chains found, fused or not (unknown data flow counts as a chain)."""
        return len(self.fused) + sum(s.is_chain is not False for s in self.skipped)

    @property
    def folded_pools(self) -> list[str]:
        """The pooling layers folded into fused blocks, in call order."""
        return [c.pool for c in self.fused if c.pool is not None]

    @property
    def fused_fraction(self) -> float:
        """Fused chains / :attr:`chains` (1.0 when there are none)."""
        return len(self.fused) / self.chains if self.chains else 1.0

    def __str__(self) -> str:
        lines = [
            f"fuse: fused {len(self.fused)} of {self.chains} Conv/Linear -> BatchNorm -> neuron "
            f"chains ({100 * self.fused_fraction:.0f}%)"
        ]
        lines += [
            f"  fused: {' -> '.join(c.modules[:-1])}"
            + (" -> (+ shortcut)" if c.residual else "")
            + f" -> {c.modules[-1]}"
            + (f", pooling {c.pool} folded in" if c.pool is not None else "")
            for c in self.fused
        ]
        lines += [f"  not fused: {' -> '.join(s.modules)}: {s.reason}" for s in self.skipped]
        if self.pools:
            lines.append(f"  pooling as SpikePool: {', '.join(self.pools)}")
        lines += [f"  pooling not folded: {n}: {why}" for n, why in self.unfolded_pools.items()]
        if self.traced:
            lines.append(f"  traced with torch.fx: {', '.join(self.traced)}")
        if self.rewritten:
            lines.append(f"  forward rewritten (residual chains): {', '.join(self.rewritten)}")
        if self.recomputed_inputs:
            inputs = ", ".join(self.recomputed_inputs)
            lines.append(f"  unfused, recomputing a fused block's spikes they read: {inputs}")
        lines += [
            f"  not traceable, searched as a module tree: {name}: {error}"
            for name, error in self.untraced.items()
        ]
        return "\n".join(lines)


# ---- recognising modules --------------------------------------------------------------------
def _multi_step(module: nn.Module) -> bool:
    # Plain torch layers have no step_mode; only Linear accepts [T, B, F] as it is.
    mode = getattr(module, "step_mode", None)
    return mode == "m" or (mode is None and type(module) is nn.Linear)


def _as_synapse_bn(module: nn.Module) -> tuple[nn.Module, _BatchNorm | None] | None:
    """(synapse, bn or None) if ``module`` applies a synapse (then BN) to [T, B, ...] input."""
    if type(module) is layer.SeqToANNContainer and len(module) in (1, 2):
        synapse, *rest = module
        if synapse_kind(synapse) is None or getattr(synapse, "step_mode", "s") != "s":
            return None
        if not rest:
            return synapse, None
        bn = rest[0]
        return (synapse, bn) if _is_bn_for(bn, synapse, step_mode="s") else None
    if synapse_kind(module) is not None and _multi_step(module):
        return module, None
    return None


def _is_bn_for(bn: nn.Module, synapse: nn.Module, step_mode: str) -> TypeGuard[_BatchNorm]:
    kind = synapse_kind(synapse)
    # Inside SeqToANNContainer a layer must run single-step ('s' or a plain torch layer).
    mode = getattr(bn, "step_mode", "s")
    return kind is not None and type(bn) in EXACT[BN_FOR[kind]] and mode == step_mode


def _as_bn(module: nn.Module, synapse: nn.Module) -> _BatchNorm | None:
    if type(module) is layer.SeqToANNContainer and len(module) == 1:
        inner = module[0]
        return inner if _is_bn_for(inner, synapse, step_mode="s") else None
    return module if _is_bn_for(module, synapse, step_mode="m") else None


def _as_pool(module: nn.Module) -> nn.Module | None:
    """The pooling layer if ``module`` pools [T, B, C, H, W] input with a supported pool."""
    if type(module) is layer.SeqToANNContainer and len(module) == 1:
        module = module[0]  # the container merges T and B; the pool inside runs single-step
        multi_step = getattr(module, "step_mode", "s") == "s"
    else:
        multi_step = getattr(module, "step_mode", None) == "m"
    supported = any(type(module) in EXACT[k] for k in POOLS)
    if supported and multi_step and not getattr(module, "return_indices", False):
        return module
    return None


def _is_synapse_like(module: nn.Module) -> bool:
    """A Conv/Linear call, fusable or not (a candidate the report accounts for)."""
    if type(module) is layer.SeqToANNContainer:
        return len(module) > 0 and isinstance(module[0], SYNAPSES)
    return isinstance(module, SYNAPSES)


def _is_bn_like(module: nn.Module) -> bool:
    if type(module) is layer.SeqToANNContainer:
        return len(module) == 1 and isinstance(module[0], _BatchNorm)
    return isinstance(module, _BatchNorm)


def _subclass_problem(module: nn.Module) -> str:
    """Why a Conv/Linear/BatchNorm of another class than torch's and spikefuse's is unfused."""
    name = type(module).__name__
    if parametrize.is_parametrized(module):  # torch makes it a class of its own
        return f"{name}'s parameters are parametrized (torch.nn.utils.parametrize)"
    return f"{name} is a subclass with its own forward; only torch's and spikefuse's fuse"


def _synapse_problem(module: nn.Module) -> str:
    contained = type(module) is layer.SeqToANNContainer
    inner = module[0] if type(module) is layer.SeqToANNContainer else module
    name = type(inner).__name__
    if synapse_kind(inner) is None:
        return _subclass_problem(inner)
    if contained:
        if getattr(inner, "step_mode", "s") != "s":
            return f"the {name} inside SeqToANNContainer must be single-step"
        return "the SeqToANNContainer holds more than the synapse and its matching BatchNorm"
    if not hasattr(inner, "step_mode"):
        return f"a plain torch {name} is single-step; use layer.{name}(step_mode='m')"
    return "step_mode='s'; fused blocks take multi-step [T, B, ...] input (use step_mode='m')"


def _bn_problem(module: nn.Module, synapse: nn.Module) -> str:
    inner = module[0] if type(module) is layer.SeqToANNContainer else module
    kind = synapse_kind(synapse)
    assert kind is not None  # called for the synapse of a chain
    expected = BN_FOR[kind]
    if not isinstance(inner, expected):
        return f"a {type(synapse).__name__} needs {expected.__name__}, got {type(inner).__name__}"
    if type(inner) not in EXACT[expected]:
        return _subclass_problem(inner)
    return f"the {type(inner).__name__} has step_mode={getattr(inner, 'step_mode', None)!r}"


def _node_problem(node: BaseNode) -> str | None:
    if node.step_mode != "m":
        return f"the neuron has step_mode={node.step_mode!r}; fused blocks are multi-step"
    if node.torch_code is not None:
        return f"{type(node).__name__} runs torch code ({node.torch_code}); fused blocks run NeuronDefs"
    if node._overridden_forward:
        return f"{type(node).__name__} overrides {'/'.join(node._overridden_forward)}"
    if node.definition is not None and node.definition.adaptive:  # None: torch code, above
        return f"{type(node).__name__} has two states; only one-state neurons fuse"
    if node.store_v_seq:
        return "the neuron has store_v_seq=True; fused blocks never keep V"
    return None


def _sole_user(node: fx.Node) -> fx.Node | None:
    """The one call_module that takes ``node``'s output as its only argument, if that is the
    output's only use."""
    users = list(node.users)
    if len(users) != 1:
        return None
    user = users[0]
    plain = user.op == "call_module" and user.args == (node,) and not user.kwargs
    return user if plain else None


_ADDITIONS = {operator.add, operator.iadd, torch.add}


def _residual_addition(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(the addition, the shortcut) if ``node``'s output is used only by an addition of two
    tensors, ``node + shortcut`` (or ``shortcut + node``, ``torch.add``, ``+=``, ``.add``)."""
    users = list(node.users)
    if len(users) != 1:
        return None
    add = users[0]
    is_add = (add.op == "call_function" and add.target in _ADDITIONS) or (
        add.op == "call_method" and add.target in ("add", "add_")
    )
    if not is_add or add.kwargs or len(add.args) != 2:
        return None
    first, second = add.args  # node is one of them: it has no kwargs
    shortcut = second if first is node else first
    if shortcut is node or not isinstance(shortcut, fx.Node):  # x + x, or x + a constant
        return None
    return add, shortcut


# ---- examining one traced graph -------------------------------------------------------------
@dataclass(frozen=True)
class _Chain:
    synapse: str  # call targets, relative to the traced module
    bn: str | None  # a separate BatchNorm call (None: none, or inside the synapse's container)
    node: str
    pool: str | None = None  # an average pooling folded in
    addition: str | None = None  # the graph node adding a shortcut before the neuron

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n in (self.synapse, self.bn, self.node) if n is not None)


@dataclass
class _Findings:
    chains: dict[str, _Chain] = field(default_factory=dict)  # by synapse name
    skipped: dict[str, SkippedCandidate] = field(default_factory=dict)
    pools: dict[str, None] = field(default_factory=dict)  # an ordered set, in call order
    unfolded_pools: dict[str, str] = field(default_factory=dict)  # after a chain: name -> why


def _examine(graph: fx.Graph, root: nn.Module, path: str) -> _Findings:
    """Chains (names relative to ``root``) and skipped candidates (names from the model, the
    root being at ``path``) of one graph of ``root``'s forward."""
    modules = dict(root.named_modules())
    calls = Counter(n.target for n in graph.nodes if n.op == "call_module")
    attribute_reads = [n.target for n in graph.nodes if n.op == "get_attr"]
    names_of = defaultdict(list)
    for name, module in root.named_modules(remove_duplicate=False):
        names_of[id(module)].append(name)
    found = _Findings()

    def full(name: str) -> str:
        return _join(path, name)

    def shared(name: str) -> str | None:
        module = modules[name]
        if calls[name] > 1:
            return f"'{full(name)}' is called {calls[name]} times in the forward"
        if len(names_of[id(module)]) > 1:
            aliases = [full(n) for n in names_of[id(module)]]
            return f"'{full(name)}' is registered under several names {aliases}"
        read = next((a for a in attribute_reads if a.startswith(name + ".")), None)
        if read is not None:
            return f"the forward reads '{full(read)}' directly"
        hooks = hook_kinds(module)
        if hooks is not None:
            return f"'{full(name)}' has {hooks}, which fusing would bypass"
        return None

    def describe(user: fx.Node) -> str:
        if user.op == "call_module":
            return f"'{full(str(user.target))}'"
        if user.op == "output":
            return "the forward's return value" if not path else f"the return value of '{path}'"
        name = getattr(user.target, "__name__", str(user.target))
        return f"{name}()" if user.op == "call_function" else f".{name}()"

    for call in graph.nodes:
        if call.op != "call_module":
            continue
        module = modules[call.target]
        if _as_pool(module) is not None:
            found.pools[call.target] = None
        if not _is_synapse_like(module) or call.target in found.chains | found.skipped:
            continue  # a module called again is reported once (as called several times)
        chain_nodes, last, bn_call = [call], call, None
        inside = type(module) is layer.SeqToANNContainer and len(module) == 2
        nxt = _sole_user(last)
        if not inside and nxt is not None and _is_bn_like(modules[nxt.target]):
            bn_call, last = nxt, nxt
            chain_nodes.append(nxt)
            nxt = _sole_user(last)
        names = tuple(full(n.target) for n in chain_nodes)
        residual = _residual_addition(last) if nxt is None else None
        if residual is not None:
            nxt = _sole_user(residual[0])
        if nxt is None or not isinstance(modules[nxt.target], BaseNode):
            users = list(last.users)
            where = ", ".join(describe(u) for u in users) or "nothing"
            goes_to = f"the output of '{full(last.target)}' goes to {where}"
            reaches = any(
                u.op == "call_module" and isinstance(modules[u.target], BaseNode) for u in users
            )
            found.skipped[call.target] = SkippedCandidate(names, goes_to, reaches)
            continue
        chain_nodes.append(nxt)
        names = tuple(full(n.target) for n in chain_nodes)
        joined = next((c for c in found.chains.values() if c.node == nxt.target), None)
        if joined is not None:  # the addition's other operand is fused with the neuron
            shortcut = f"the shortcut of the residual chain at '{full(joined.synapse)}'"
            found.skipped[call.target] = SkippedCandidate(names[:-1], shortcut, False)
            continue
        reason: str | None
        synapse_bn = _as_synapse_bn(module)
        if synapse_bn is None:
            reason = _synapse_problem(module)
        elif bn_call is not None and _as_bn(modules[bn_call.target], synapse_bn[0]) is None:
            reason = _bn_problem(modules[bn_call.target], synapse_bn[0])
        else:
            reason = _node_problem(modules[nxt.target])
        targets = [n.target for n in chain_nodes]
        reason = reason or next(filter(None, map(shared, targets)), None)
        if reason is None and (len(call.args) != 1 or call.kwargs):
            reason = f"'{full(call.target)}' is called with more than one input"
        if reason is not None:
            found.skipped[call.target] = SkippedCandidate(names, reason, True)
            continue
        bn_name = None if bn_call is None else str(bn_call.target)
        pool = _folded_pool(nxt, synapse_bn, modules, shared, found, full)
        addition = None if residual is None else residual[0].name
        found.chains[call.target] = _Chain(call.target, bn_name, str(nxt.target), pool, addition)
    return found


def _folded_pool(
    node_call: fx.Node,
    synapse_bn: tuple[nn.Module, _BatchNorm | None] | None,
    modules: dict[str, nn.Module],
    shared: Callable[[str], str | None],
    found: _Findings,
    full: Callable[[str], str],
) -> str | None:
    """The pooling call to fold into a chain whose neuron call is ``node_call``: the sole user
    of its output, if it can be folded (else its reason is recorded in ``found``)."""
    user = _sole_user(node_call)
    pool = None if user is None else _as_pool(modules[str(user.target)])
    if user is None or pool is None:
        return None
    assert synapse_bn is not None  # a chain's synapse
    kind = synapse_kind(synapse_bn[0])
    assert kind is not None
    target = str(user.target)
    problem = pool_fold_problem(pool, kind) or shared(target)
    if problem is not None:
        found.unfolded_pools[full(target)] = problem
        return None
    return target


def _merge(findings: list[tuple[str, _Findings]], path: str) -> _Findings:
    """Fuse only what every traced variant agrees on (training and eval mode, and the root's
    optional arguments given or left at their defaults): the patch must hold for each."""
    merged = _Findings(pools=dict.fromkeys(p for _, f in findings for p in f.pools))
    for _, f in findings:
        merged.unfolded_pools = f.unfolded_pools | merged.unfolded_pools
    names = dict.fromkeys(n for _, f in findings for n in (*f.chains, *f.skipped))
    for name in names:
        chains = [(label, f.chains.get(name)) for label, f in findings]
        first = chains[0][1]
        if first is not None and all(chain == first for _, chain in chains):
            merged.chains[name] = first
            continue
        unpooled = {None if c is None else replace(c, pool=None) for _, c in chains}
        if first is not None and len(unpooled) == 1:  # they disagree about the pooling only
            merged.chains[name] = replace(first, pool=None)
            for label, chain in chains:
                if chain is not None and chain.pool is not None:
                    merged.unfolded_pools[_join(path, chain.pool)] = (
                        f"the forward uses it differently in {label} and in other variants"
                    )
            continue
        if all(chain is None for _, chain in chains):
            merged.skipped[name] = next(f.skipped[name] for _, f in findings if name in f.skipped)
            continue
        label, chain = next((label, chain) for label, chain in chains if chain is not None)
        odd_label, odd = next((lb, f) for lb, f in findings if f.chains.get(name) != chain)
        reason = f"the forward calls these modules differently in {label} and in {odd_label}"
        if name in odd.skipped:
            reason += f" ({odd.skipped[name].reason})"
        names_in_chain = tuple(_join(path, n) for n in chain.names)
        merged.skipped[name] = SkippedCandidate(names_in_chain, reason, True)
    return merged


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


# ---- keeping the unfused model's state dict keys --------------------------------------------
def _renamed(key: str, renames: list[tuple[str, str]]) -> str:
    for old, new in renames:
        if key.startswith(old):
            return new + key[len(old) :]
    return key


class _SaveUnderOriginalNames:
    """state_dict post-hook: the fused chains' entries under the unfused model's keys, in the
    unfused model's order.

    ``renames``: (fused prefix, original prefix) pairs relative to the hooked module, e.g.
    ``("conv1.bn.", "bn1.")``; ``order``: the unfused module's keys, relative to it (a block
    holds its BatchNorm and neuron next to its synapse, where the unfused module may have
    registered, say, every conv before every BatchNorm)."""

    # Hooks pickled by versions before the order was kept have none: their order stays.
    rank: dict[str, int] = {}

    def __init__(self, renames: tuple[tuple[str, str], ...], order: tuple[str, ...]) -> None:
        self.renames = renames
        self.rank = {key: i for i, key in enumerate(order)}

    def __call__(self, module, state_dict, prefix, local_metadata) -> None:
        renames = [(prefix + fused, prefix + original) for fused, original in self.renames]
        # Re-insert this module's entries (the dict's tail) renamed, those the unfused module
        # had in its order; the others (another chain's, not renamed yet; modules replaced
        # since fusing) keep their places.
        entries = [(k, state_dict.pop(k)) for k in [k for k in state_dict if k.startswith(prefix)]]
        renamed = [(_renamed(key, renames), value) for key, value in entries]
        known = [i for i, (key, _) in enumerate(renamed) if key[len(prefix) :] in self.rank]
        in_order = sorted((renamed[i] for i in known), key=lambda e: self.rank[e[0][len(prefix) :]])
        for i, entry in zip(known, in_order, strict=True):
            renamed[i] = entry
        for key, value in renamed:
            state_dict[key] = value
        metadata = getattr(state_dict, "_metadata", None)
        if metadata is not None:  # BatchNorm's version entry moves with its keys
            for key in [k for k in metadata if k.startswith(prefix)]:
                new = _renamed(key + ".", renames)[:-1]
                if new != key:
                    metadata[new] = metadata.pop(key)


_SIZE_MISMATCH = re.compile(r"^(size mismatch for )([^:]+)")  # torch's load_state_dict message


class _LoadOriginalNames:
    """load_state_dict pre-hook: entries under the unfused model's keys load into the fused
    chains; entries already under the fused keys load as they are. Its :meth:`name_keys` (the
    post-hook) reports missing and unexpected entries and size mismatches under the unfused
    keys too, the names the model's ``state_dict`` has."""

    # the load running now: the hooked module's prefix in it (post-hooks are given none) and
    # its error messages (a list torch raises from after the post-hooks; dropped by them)
    prefix = ""
    error_msgs: list[str] | None = None

    def __init__(self, renames: tuple[tuple[str, str], ...]) -> None:
        self.renames = renames

    def name_keys(self, module, incompatible_keys) -> None:
        renames = [(self.prefix + f, self.prefix + original) for f, original in self.renames]
        for keys in (incompatible_keys.missing_keys, incompatible_keys.unexpected_keys):
            keys[:] = [_renamed(key, renames) for key in keys]
        messages, self.error_msgs = self.error_msgs, None
        if messages:  # "size mismatch for <key>: ..." (torch's wording)
            messages[:] = [
                _SIZE_MISMATCH.sub(lambda m: m[1] + _renamed(m[2], renames), message)
                for message in messages
            ]

    # the post-hook's name in versions that renamed missing keys only (pickled models)
    name_missing_keys = name_keys

    def __call__(
        self, module, state_dict, prefix, local_metadata, strict, missing, unexpected, error_msgs
    ) -> None:
        self.prefix, self.error_msgs = prefix, error_msgs
        fused = [prefix + f for f, _ in self.renames]
        # Longest original prefix first: '0.0.' (in a container) before '0.'.
        renames = sorted(
            ((prefix + original, prefix + f) for f, original in self.renames),
            key=lambda pair: -len(pair[0]),
        )
        for key in list(state_dict):
            if key.startswith(prefix) and not any(key.startswith(f) for f in fused):
                new = _renamed(key, renames)
                if new != key:
                    state_dict[new] = state_dict.pop(key)


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
    """Make ``module``'s forward call each residual chain's FusedBlock with the shortcut.

    ``synapses``: the chains' synapse names, relative to ``module``. The forward is traced
    (training and eval mode, and its optional arguments at their defaults: all must give the
    same graph); in the graph, each chain's synapse, BatchNorm, addition and neuron calls become
    one call ``synapse(x, shortcut)``, and the module's ``forward`` becomes that graph's code
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
            "optional arguments; residual chains fuse where it does not",
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
    chains = [c for c in findings.chains.values() if c.addition is not None]
    chains = [c for c in chains if c.synapse in synapses]
    if len(chains) != len(synapses):
        return f"the forward of {_display(path)} does not hold the whole chain", []
    graph = graphs[0][1]
    nodes = {node.name: node for node in graph.nodes}
    for chain in chains:
        addition = nodes[chain.addition]
        (neuron,) = addition.users
        synapse = next(
            n for n in graph.nodes if n.op == "call_module" and n.target == chain.synapse
        )
        last = synapse if chain.bn is None else next(iter(synapse.users))
        residual = _residual_addition(last)
        assert residual is not None and residual[0] is addition  # _examine found it
        with graph.inserting_before(neuron):
            call = graph.call_module(chain.synapse, (synapse.args[0], residual[1]))
        neuron.replace_all_uses_with(call)
        for dead in dict.fromkeys((neuron, addition, last, synapse)):
            graph.erase_node(dead)
    for node in graph.nodes:  # string annotations (postponed evaluation) would not pickle
        node.type = None
    graph.lint()
    module.forward = _rewritten_forward(module, graph, type(module).__name__).forward
    return "", chains


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
    as unfused). ``role``: ``"bn"``, ``"node"`` or ``"pool"``, the block's attribute that now
    holds the module (``target``)."""

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
    synapse_bn = _as_synapse_bn(container)
    assert synapse_bn is not None  # _examine found it
    synapse, bn = synapse_bn
    contained = type(container) is layer.SeqToANNContainer
    originals = {"synapse": chain.synapse + (".0" if contained else "")}
    if bn is not None:
        originals["bn"] = chain.synapse + ".1"
    elif chain.bn is not None:
        separate = root.get_submodule(chain.bn)
        bn = _as_bn(separate, synapse)
        originals["bn"] = chain.bn + (".0" if type(separate) is layer.SeqToANNContainer else "")
    node = root.get_submodule(chain.node)
    assert isinstance(node, BaseNode)  # _examine found it
    originals["node"] = chain.node
    pool = None if chain.pool is None else _as_pool(root.get_submodule(chain.pool))
    residual = chain.addition is not None
    fused = FusedBlock(synapse, bn, node, process_group, memory, pool, residual)
    _set_submodule(root, chain.synapse, fused)
    block = _join(path, chain.synapse)
    roles = {chain.node: "node", chain.pool: "pool"}
    for name in (*chain.names[1:], *([chain.pool] if chain.pool is not None else [])):
        role = roles.get(name, "bn")
        away = FusedAway(_join(path, name), block, role, getattr(fused, role))
        away.training = fused.training
        _set_submodule(root, name, away)
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


# ---- fuse -----------------------------------------------------------------------------------
def _join(prefix: str, name: str) -> str:
    """The dotted name of ``name`` inside ``prefix`` (either may be empty: the model itself)."""
    return f"{prefix}.{name}" if prefix and name else prefix or name


def _display(name: str) -> str:
    return name or MODEL


class _Fuser:
    def __init__(
        self,
        process_group: dist.ProcessGroup | None,
        memory: str,
        fold_pools: bool,
        unfused_keys: list[str],
    ) -> None:
        self.process_group, self.memory, self.fold_pools = process_group, memory, fold_pools
        self.report = FuseReport()
        self.unfused_keys = unfused_keys  # the model's state dict keys before fusing

    def convert(self, module: nn.Module, path: str) -> None:
        if _Tracer().is_leaf_module(module, path):
            return  # nothing inside to search
        try:
            graphs = _trace(module)
        except Exception as error:  # any failure means: search the tree instead
            first_line = (str(error).strip().splitlines() or [""])[0]
            self.report.untraced[_display(path)] = f"{type(error).__name__}: {first_line}"
            for name, child in list(module.named_children()):
                self.convert(child, _join(path, name))
            if type(module) is nn.Sequential:
                graphs = [("the forward", _sequential_graph(module))]
            else:
                self._unknown_children(module, path)
                return
        else:
            self.report.traced.append(_display(path))
        findings = [(label, _examine(graph, module, path)) for label, graph in graphs]
        merged = _merge(findings, path)
        if not self.fold_pools:  # every pooling stays a layer of its own (a SpikePool)
            merged.chains = {n: replace(c, pool=None) for n, c in merged.chains.items()}
            merged.unfolded_pools = {}
        self._apply(module, path, merged)

    def _unknown_children(self, module: nn.Module, path: str) -> None:
        for name, child in module.named_children():
            if _is_synapse_like(child):
                reason = f"the forward of {_display(path)} could not be traced"
                self.report.skipped.append(SkippedCandidate((_join(path, name),), reason, None))

    def _apply(self, root: nn.Module, path: str, findings: _Findings) -> None:
        folded = {c.pool for c in findings.chains.values()}
        for name in findings.pools:
            if name in folded:
                continue
            pool = _as_pool(root.get_submodule(name))
            assert pool is not None  # _examine found it
            _set_submodule(root, name, SpikePool(pool))
            self.report.pools.append(_join(path, name))
        owners: dict[str, list[_Chain]] = defaultdict(list)
        for chain in findings.chains.values():
            if chain.addition is not None:  # fused by rewriting the forward that adds
                owners[".".join(_common_parent(chain.names))].append(chain)
                continue
            self._fuse(root, path, chain)
        self.report.skipped.extend(findings.skipped.values())
        self.report.unfolded_pools.update(findings.unfolded_pools)
        for name in findings.skipped:  # unfused synapses: their input may be fused spikes
            if RecomputedInput.attach(root.get_submodule(name)):
                self.report.recomputed_inputs.append(_join(path, name))
        for owner, chains in owners.items():
            self._rewrite(root, path, owner, chains)
        for module in root.modules():  # a flattened copy of fused spikes keeps their tags
            if (
                isinstance(module, nn.Flatten)
                and flatten_keeps_tags not in module._forward_hooks.values()
            ):
                module.register_forward_hook(flatten_keeps_tags)

    def _fuse(self, root: nn.Module, path: str, chain: _Chain) -> None:
        _replace(root, path, chain, self.process_group, self.memory, self.unfused_keys)
        names = tuple(_join(path, n) for n in chain.names)
        folded_pool = None if chain.pool is None else _join(path, chain.pool)
        residual = chain.addition is not None
        self.report.fused.append(FusedChain(names[0], names, folded_pool, residual))

    def _rewrite(self, root: nn.Module, path: str, owner: str, chains: list[_Chain]) -> None:
        """Fuse residual chains (relative to ``root``) by rewriting the forward that adds: the
        lowest module holding a chain's modules whose own forward holds the whole chain
        (``owner`` first, then its ancestors up to ``root``)."""
        parts = owner.split(".") if owner else []
        problem = ""
        for depth in range(len(parts), -1, -1):
            name = ".".join(parts[:depth])
            module, module_path = root.get_submodule(name), _join(path, name)
            synapses = {c.synapse[len(name) + 1 :] if name else c.synapse for c in chains}
            problem, found = _rewrite_forward(module, module_path, synapses)
            if problem:
                continue
            for chain in found:
                self._fuse(module, module_path, chain)
            self.report.rewritten.append(_display(module_path))
            return
        for chain in chains:
            names = tuple(_join(path, n) for n in chain.names)
            self.report.skipped.append(SkippedCandidate(names, problem, True))


@overload
def fuse(
    model: nn.Module,
    inplace: bool = ...,
    process_group: dist.ProcessGroup | None = ...,
    *,
    return_report: Literal[False] = ...,
    memory: str = ...,
    fold_pools: bool = ...,
) -> nn.Module: ...


@overload
def fuse(
    model: nn.Module,
    inplace: bool = ...,
    process_group: dist.ProcessGroup | None = ...,
    *,
    return_report: Literal[True],
    memory: str = ...,
    fold_pools: bool = ...,
) -> tuple[nn.Module, FuseReport]: ...


def fuse(
    model: nn.Module,
    inplace: bool = False,
    process_group: dist.ProcessGroup | None = None,
    *,
    return_report: bool = False,
    memory: str = "default",
    fold_pools: bool = True,
) -> nn.Module | tuple[nn.Module, FuseReport]:
    """Replace every multi-step ``synapse → [BN] → neuron`` chain of ``model`` by a FusedBlock.

    Chains are found in the data flow of the model's forward (traced with torch.fx), in any
    container or custom ``forward``: a call of

    * ``layer.Conv2d``/``layer.Linear``/``layer.Conv1d`` (``step_mode='m'``) or a plain
      ``nn.Linear``, or ``layer.SeqToANNContainer(conv_or_linear[, batchnorm])``,
    * whose output is used only by a matching ``layer.BatchNorm*d(step_mode='m')`` (or
      ``SeqToANNContainer(batchnorm)``), whose output is used only by
    * a one-state spikefuse neuron with ``step_mode='m'`` and ``store_v_seq=False``
      (the BatchNorm may be absent);
    * or, a residual chain, whose output is used only by an addition of a shortcut (``out +
      identity``, ``+=``, ``torch.add``) whose result is used only by such a neuron (Spiking
      ResNet's second half-block). The forward that adds is rewritten: it calls the FusedBlock
      as ``block(x, shortcut)`` (see :class:`FusedBlock`'s ``residual``); its traced graph must
      be the same in every variant below. Of two chains into one addition (a Conv → BN
      downsample branch), the first called is fused and the other is its shortcut.

    Each module of a chain must be called once per forward, the same way in training and eval
    mode and with the forward's optional arguments given or left at their defaults, be
    registered under one name, not be read as an attribute by the forward
    (``self.conv1.weight``) and have no forward hooks. Everything else (SEW connect functions,
    Conv → BN downsample branches, Dropout between layers, ...) stays as it is. A multi-step
    2 x 2 ``AvgPool2d`` (kernel = stride, no padding, ceil_mode or divisor_override) called
    once, right after a Conv2d chain's neuron as the sole user of its spikes, is folded into the
    block (``fold_pools``; the block's output is then the pooled map, which the cuda kernels
    compute without writing the full spikes); the report names the folded pools and says why a
    pooling after a chain was not folded. Other multi-step ``AvgPool2d``/``MaxPool2d`` layers
    become :class:`SpikePool` (same result; on fused-block spikes they save their input at 1
    bit per spike). Where a forward cannot be traced, its children are converted one by one
    and ``nn.Sequential`` children are searched in order; the report names those modules.

    The model is patched in place of the copy (its classes stay): the synapse's attribute
    becomes the FusedBlock, holding the original modules (parameters and buffers are shared,
    not copied), and the BatchNorm's and neuron's attributes become :class:`FusedAway`: an
    ``nn.Identity`` that raises :class:`FusedAttributeError` naming the block when the forward
    reads an attribute of the module that was there (fused blocks keep no per-step state, such
    as a neuron's ``.v``); a module whose forward adds a residual chain's shortcut gets the
    rewritten forward described above (the report's ``rewritten``). The state_dict keys stay
    those of the unfused model
    (``named_parameters`` shows the blocks' names, e.g. ``conv1.synapse.weight``), so state
    dicts of fused and unfused models load into each other with ``strict=True``; the fused
    naming loads too.

    ``process_group``: what the fused BatchNorms synchronise over (None: the default group).
    ``memory``: ``"default"`` (blocks keep their Conv/Linear output, as in the DATE'22 paper) or
    ``"min"`` (blocks keep only their input, 1-bit packed when it is spikes, and recompute the
    Conv/Linear in backward) or ``"auto"`` (each block chooses one of the two where it pays:
    narrow convolutions recompute, wide ones keep their output; see :class:`FusedBlock`).
    ``fold_pools``: fold pooling layers into the blocks as above (False: they all become
    :class:`SpikePool`). Returns the converted model (a deep copy unless ``inplace``), and with
    ``return_report`` also a :class:`FuseReport`;
    the report is logged (logger ``spikefuse.fuse``: INFO, WARNING when a chain was left
    unfused). The model computes the same function, but each forward call is
    an independent sequence (fused neurons start from their reset state).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fuse: model must be a torch.nn.Module, got {type(model).__name__}")
    flags = (
        ("inplace", inplace),
        ("return_report", return_report),
        ("fold_pools", fold_pools),
    )
    for name, flag in flags:
        if not isinstance(flag, bool):
            raise TypeError(f"fuse: {name} must be a bool, got {type(flag).__name__}")
    group_type = getattr(dist, "ProcessGroup", None)  # absent where torch lacks distributed
    if process_group is not None and (
        group_type is None or not isinstance(process_group, group_type)
    ):
        raise TypeError(
            "fuse: process_group must be a torch.distributed.ProcessGroup or None, got "
            f"{type(process_group).__name__}"
        )
    if memory not in memory_modes():
        raise SpikefuseError(f"fuse: memory must be one of {memory_modes()}, got {memory!r}")
    if not inplace:
        model = copy.deepcopy(model)
    unfused = model.state_dict(keep_vars=True)
    fuser = _Fuser(process_group, memory, fold_pools, list(unfused))
    before = _parameter_keys(model, unfused)
    fuser.convert(model, "")
    report = fuser.report
    log.info("%s", report)
    if _parameter_keys(model, model.state_dict(keep_vars=True)) != before:
        log.warning(
            "fuse: parameters() now lists the parameters in another order (a block holds its "
            "BatchNorm next to its synapse; this model registers them apart): an optimizer "
            "state_dict of the unfused model would load into the wrong parameters, since "
            "optimizers match them by position. Build optimizers after fuse and load only "
            "their own state"
        )
    if report.chains > len(report.fused):
        log.warning(
            "fuse: %d of %d chains were not fused:\n%s",
            report.chains - len(report.fused),
            report.chains,
            "\n".join(f"  {' -> '.join(s.modules)}: {s.reason}" for s in _chains_left(report)),
        )
    return (model, report) if return_report else model


def _parameter_keys(model: nn.Module, state: Mapping[str, torch.Tensor]) -> list[str]:
    """The key in ``state`` (the model's ``state_dict(keep_vars=True)``) of each parameter, in
    ``parameters()`` order (what optimizers number their state by)."""
    key_of = {id(t): key for key, t in state.items()}
    return [key_of.get(id(p), "") for p in model.parameters()]


def _chains_left(report: FuseReport) -> Iterator[SkippedCandidate]:
    return (s for s in report.skipped if s.is_chain is not False)
