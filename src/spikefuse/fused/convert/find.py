"""Finding chains: the ``synapse → [BatchNorm] [→ max pooling] → neuron`` chains in one traced
graph, of the modules :mod:`.modules` recognises."""

from __future__ import annotations

import operator
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import fx, nn
from torch.nn.modules.batchnorm import _BatchNorm

from ... import layer
from ...neuron import BaseNode
from ..spec import (
    hook_kinds,
    input_pool_problem,
    pool_fold_problem,
    synapse_kind,
)
from .layout import (
    is_size,
    layout_users,
    merged_input,
    reshape_args,
    through_copies,
    transposed_bn,
)
from .modules import (
    _as_bn,
    _as_pool,
    _as_synapse_bn,
    _bn_problem,
    _contained_pool,
    _is_bn_for,
    _is_bn_like,
    _is_synapse_like,
    _node_problem,
    _synapse_problem,
)
from .report import SkippedCandidate, _join


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


@dataclass(frozen=True)
class _Chain:
    synapse: str  # call targets, relative to the traced module
    bn: str | None  # a separate BatchNorm call (None: none, or inside the synapse's container)
    node: str
    pool: str | None = None  # an average pooling folded in
    addition: str | None = None  # the graph node adding a shortcut before the neuron
    tokens: bool = False  # a Linear on [T, B, N, C], its BatchNorm1d between two transposes
    reshape: str | None = None  # T and B merged by hand: the graph node of .reshape(T, B, ...)
    input_pool: str | None = None  # a separate max pooling of the BatchNorm output

    @property
    def names(self) -> tuple[str, ...]:
        parts = (self.synapse, self.bn, self.input_pool, self.node)
        return tuple(n for n in parts if n is not None)


@dataclass
class _Findings:
    chains: dict[str, _Chain] = field(default_factory=dict)  # by synapse name
    skipped: dict[str, SkippedCandidate] = field(default_factory=dict)
    pools: dict[str, None] = field(default_factory=dict)  # an ordered set, in call order
    unfolded_pools: dict[str, str] = field(default_factory=dict)  # after a chain: name -> why


def _examine(graph: fx.Graph, root: nn.Module, path: str) -> _Findings:
    """Chains (names relative to ``root``) and skipped candidates (names from the model, the
    root being at ``path``) of one graph of ``root``'s forward."""
    examiner = _Examiner(graph, root, path)
    for call in graph.nodes:
        if call.op == "call_module":
            examiner.examine(call)
    return examiner.found


class _Examiner:
    """What :func:`_examine` knows of one graph while it walks its module calls."""

    def __init__(self, graph: fx.Graph, root: nn.Module, path: str) -> None:
        self.path = path
        self.modules = dict(root.named_modules())
        self.calls = Counter(n.target for n in graph.nodes if n.op == "call_module")
        self.attribute_reads = [n.target for n in graph.nodes if n.op == "get_attr"]
        self.names_of: defaultdict[int, list[str]] = defaultdict(list)
        for name, module in root.named_modules(remove_duplicate=False):
            self.names_of[id(module)].append(name)
        self.found = _Findings()

    def full(self, name: str) -> str:
        return _join(self.path, name)

    def shared(self, name: str) -> str | None:
        """Why the module called ``name`` cannot be fused away, or None."""
        module, full = self.modules[name], self.full
        if self.calls[name] > 1:
            return f"'{full(name)}' is called {self.calls[name]} times in the forward"
        if len(self.names_of[id(module)]) > 1:
            aliases = [full(n) for n in self.names_of[id(module)]]
            return f"'{full(name)}' is registered under several names {aliases}"
        read = next((a for a in self.attribute_reads if a.startswith(name + ".")), None)
        if read is not None:
            return f"the forward reads '{full(read)}' directly"
        hooks = hook_kinds(module)
        if hooks is not None:
            return f"'{full(name)}' has {hooks}, which fusing would bypass"
        return None

    def describe(self, user: fx.Node) -> str:
        if user.op == "call_module":
            return f"'{self.full(str(user.target))}'"
        if user.op == "output":
            path = self.path
            return "the forward's return value" if not path else f"the return value of '{path}'"
        name = getattr(user.target, "__name__", str(user.target))
        return f"{name}()" if user.op == "call_function" else f".{name}()"

    def examine(self, call: fx.Node) -> None:
        """Record the chain starting at the module call ``call``, or why there is none."""
        modules, found, target = self.modules, self.found, str(call.target)
        module = modules[target]
        if _as_pool(module) is not None:
            found.pools[target] = None
        if not _is_synapse_like(module) or target in found.chains | found.skipped:
            return  # a module called again is reported once (as called several times)
        if self.examine_merged(call):
            return
        chain_nodes, last, bn_call = [call], call, None
        inside = type(module) is layer.SeqToANNContainer and len(module) > 1
        nxt = _sole_user(last)
        tokens = None if inside or nxt is not None else self.tokens_bn(call)
        if tokens is not None:  # a Linear on [T, B, N, C], BatchNorm1d over C between transposes
            bn_call, last = tokens
            chain_nodes.append(bn_call)
            nxt = _sole_user(last)
        elif not inside and nxt is not None and _is_bn_like(modules[str(nxt.target)]):
            bn_call, last = nxt, nxt
            chain_nodes.append(nxt)
            nxt = _sole_user(last)
        residual = _residual_addition(last) if nxt is None and tokens is None else None
        if residual is not None:
            nxt = _sole_user(residual[0])
        pool_call = self.input_pool(nxt) if tokens is None else None
        if pool_call is not None:  # a pooling of the neuron's input (QKFormer's patch embedding)
            chain_nodes.append(pool_call)
            nxt = _sole_user(pool_call)
        if nxt is None or not isinstance(modules[str(nxt.target)], BaseNode):
            self._no_neuron(call, chain_nodes, last)
            return
        chain_nodes.append(nxt)
        names = tuple(self.full(str(n.target)) for n in chain_nodes)
        joined = next((c for c in found.chains.values() if c.node == nxt.target), None)
        if joined is not None:  # the addition's other operand is fused with the neuron
            shortcut = f"the shortcut of the residual chain at '{self.full(joined.synapse)}'"
            found.skipped[target] = SkippedCandidate(names[:-1], shortcut, False)
            return
        synapse_bn = _as_synapse_bn(module)
        reason = self._problem(call, chain_nodes, bn_call, nxt, synapse_bn)
        # the pooling of the neuron's input: a separate call, or the container's third layer
        input_pool = (
            _contained_pool(module) if pool_call is None else _as_pool(self.node_of(pool_call))
        )
        if reason is None and input_pool is not None:
            where = "its pooling" if pool_call is None else f"'{self.full(str(pool_call.target))}'"
            reason = _input_pool_problem(input_pool, where, synapse_bn, bn_call, residual)
        if reason is not None:
            found.skipped[target] = SkippedCandidate(names, reason, True)
            return
        bn_name = None if bn_call is None else str(bn_call.target)
        pool = None  # a block pools its neuron's input or its spikes (then as a SpikePool)
        if input_pool is None:
            pool = _folded_pool(nxt, synapse_bn, modules, self.shared, found, self.full)
        addition = None if residual is None else residual[0].name
        chain = _Chain(target, bn_name, str(nxt.target), pool, addition, tokens is not None)
        if pool_call is not None:
            chain = replace(chain, input_pool=str(pool_call.target))
        found.chains[target] = chain

    def input_pool(self, call: fx.Node | None) -> fx.Node | None:
        """``call`` where it is a pooling whose output goes to a neuron alone, else None."""
        if call is None or _as_pool(self.node_of(call)) is None:
            return None
        user = _sole_user(call)
        return call if user is not None and isinstance(self.node_of(user), BaseNode) else None

    def examine_merged(self, call: fx.Node) -> bool:
        """Record the chain ``neuron(reshape(bn(synapse(x.flatten(0, 1))), T, ...))`` (single-step
        synapse and BatchNorm; ``.contiguous()`` anywhere, a Linear's BatchNorm1d between two
        transposes) starting at ``call``, or why it is not fused; False: no such data flow."""
        x, module = merged_input(call), self.modules[str(call.target)]
        kind = synapse_kind(module)
        if x is None or kind is None or getattr(module, "step_mode", "s") != "s":
            return False
        is_bn = lambda n: _is_bn_like(self.node_of(n))  # noqa: E731
        transposed = transposed_bn(call, 3, is_bn) if kind is nn.Linear else None
        bn_call, last = transposed or (None, through_copies(call))
        user = _sole_user(last)  # a BatchNorm called on the synapse output as it is
        if transposed is None and user is not None and is_bn(user):
            bn_call, last = user, through_copies(user)
        if len(last.users) != 1:
            return False
        reshape = next(iter(last.users))
        shape, node_call = reshape_args(reshape, last), _sole_user(through_copies(reshape))
        node = None if node_call is None else self.node_of(node_call)
        if shape is None or node_call is None or not isinstance(node, BaseNode):
            return False
        chain_nodes = [n for n in (call, bn_call, node_call) if n is not None]
        names = tuple(self.full(str(n.target)) for n in chain_nodes)
        reason = _node_problem(node)
        bn = None if bn_call is None else self.node_of(bn_call)
        if bn is not None and not _is_bn_for(bn, module, step_mode="s"):
            reason = f"the {type(bn).__name__} after a flatten(0, 1) must be single-step"
        if not shape or not is_size(shape[0], x, 0):
            reason = (
                f"the {getattr(reshape.target, '__name__', reshape.target)}() before "
                f"'{names[-1]}' must start with T = x.shape[0] of the "
                "x that flatten(0, 1) merged (T, B, N, C = x.shape; ....reshape(T, B, ...))"
            )
        reason = reason or next(
            filter(None, (self.shared(str(n.target)) for n in chain_nodes)), None
        )
        if reason is not None:
            self.found.skipped[str(call.target)] = SkippedCandidate(names, reason, True)
            return True
        bn_name = None if bn_call is None else str(bn_call.target)
        chain = _Chain(
            str(call.target),
            bn_name,
            str(node_call.target),
            tokens=bool(transposed),
            reshape=reshape.name,
        )
        self.found.chains[str(call.target)] = chain
        return True

    def node_of(self, call: fx.Node) -> nn.Module:
        return self.modules[str(call.target)]

    def tokens_bn(self, call: fx.Node) -> tuple[fx.Node, fx.Node] | None:
        """(the BatchNorm call, the closing transpose) where the multi-step Linear call ``call``
        on tokens [T, B, N, C] feeds ``bn(y.transpose(-1, -2)).transpose(-1, -2)``."""
        synapse_bn = _as_synapse_bn(self.modules[str(call.target)])
        if synapse_bn is None or synapse_kind(synapse_bn[0]) is not nn.Linear:
            return None
        return transposed_bn(call, 4, lambda n: _is_bn_like(self.modules[str(n.target)]))

    def _no_neuron(self, call: fx.Node, chain_nodes: list[fx.Node], last: fx.Node) -> None:
        """Record a synapse call whose data flow reaches no neuron as a chain would."""
        names = tuple(self.full(str(n.target)) for n in chain_nodes)
        users = list(last.users)
        where = ", ".join(self.describe(u) for u in users) or "nothing"
        goes_to = f"the output of '{self.full(str(last.target))}' goes to {where}"
        reaches = any(  # through reshapes and transposes too: a chain fuse did not prove
            u.op == "call_module" and isinstance(self.modules[str(u.target)], BaseNode)
            for u in layout_users(last)
        )
        self.found.skipped[str(call.target)] = SkippedCandidate(names, goes_to, reaches)

    def _problem(
        self,
        call: fx.Node,
        chain_nodes: list[fx.Node],
        bn_call: fx.Node | None,
        node_call: fx.Node,
        synapse_bn: tuple[nn.Module, _BatchNorm | None] | None,
    ) -> str | None:
        """Why a chain in the data flow cannot be fused, or None."""
        modules = self.modules
        reason: str | None
        if synapse_bn is None:
            reason = _synapse_problem(modules[str(call.target)])
        elif bn_call is not None and _as_bn(modules[str(bn_call.target)], synapse_bn[0]) is None:
            reason = _bn_problem(modules[str(bn_call.target)], synapse_bn[0])
        else:
            reason = _node_problem(modules[str(node_call.target)])
        targets = [str(n.target) for n in chain_nodes]
        reason = reason or next(filter(None, map(self.shared, targets)), None)
        if reason is None and (len(call.args) != 1 or call.kwargs):
            reason = f"'{self.full(str(call.target))}' is called with more than one input"
        return reason


def _input_pool_problem(
    pool: nn.Module,
    where: str,
    synapse_bn: tuple[nn.Module, _BatchNorm | None] | None,
    bn_call: fx.Node | None,
    residual: object,
) -> str | None:
    """Why ``pool`` (named ``where`` in the reason), which pools a chain's neuron input, cannot
    join the block, or None."""
    assert synapse_bn is not None  # a chain's synapse (its problem was checked first)
    kind = synapse_kind(synapse_bn[0])
    assert kind is not None
    has_bn = synapse_bn[1] is not None or bn_call is not None
    problem = input_pool_problem(pool, kind, has_bn)
    if problem is None and residual is not None:
        problem = "a residual is added before the neuron; a block pools or adds, not both"
    return None if problem is None else f"{where}: {problem}"


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
