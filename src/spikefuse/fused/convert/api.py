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

The rules :func:`fuse` follows. Chains are found in the data flow of the model's forward
(traced with torch.fx), in any container or custom ``forward``: a call of

* ``layer.Conv2d``/``layer.Linear``/``layer.Conv1d`` (``step_mode='m'``) or a plain
  ``nn.Linear``, or ``layer.SeqToANNContainer(conv_or_linear[, batchnorm])``,
* whose output is used only by a matching ``layer.BatchNorm*d(step_mode='m')`` (or
  ``SeqToANNContainer(batchnorm)``), whose output is used only by
* a one-state spikefuse neuron with ``step_mode='m'`` and ``store_v_seq=False``
  (the BatchNorm may be absent); a Conv2d chain's BatchNorm output may first go only to a
  ``MaxPool2d`` (multi-step, or the third layer of ``SeqToANNContainer(conv, bn, pool)``):
  the block's ``input_pool``;
* on tokens ``[T, B, N, C]``, a Linear whose output goes only to ``bn(y.transpose(-1,
  -2)).transpose(-1, -2)`` (``permute``, ``torch.transpose`` and ``.contiguous()`` too), the
  BatchNorm1d normalising C, whose output goes only to such a neuron: a block with
  ``tokens=True``;
* or single-step layers on T and B merged by hand, ``neuron(bn(synapse(x.flatten(0,
  1))).reshape(T, ...))`` (the BatchNorm as above for a Linear on tokens), where ``T`` is
  ``x.shape[0]`` (or ``x.size(0)``) of that ``x``: the forward is rewritten to call
  ``block(x).reshape(T, ...)``, which equals the chain because a reshape keeping dim 0 commutes
  with the neuron;
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
bit per spike or recompute it; max pooling keeps a byte per output value, not indices).
Where a forward cannot be traced, its children are converted one by one and
``nn.Sequential`` children are searched in order; the report names those modules.

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
"""

from __future__ import annotations

import copy
import logging
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Literal, overload

import torch
import torch.distributed as dist
from torch import nn

from ... import layer
from ...errors import SpikefuseError
from ..memory import memory_modes
from ..pooling import MaxPoolCodes, SpikePool
from ..recompute import RecomputedInput, flatten_keeps_tags
from .find import _Chain, _examine, _Findings, _merge
from .modules import _as_pool, _is_synapse_like
from .report import FusedChain, FuseReport, SkippedCandidate, _display, _join
from .rewrite import _common_parent, _replace, _rewrite_forward, _rewritten, _set_submodule
from .trace import _sequential_graph, _trace, _Tracer

log = logging.getLogger("spikefuse.fuse")


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
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            # containers without a forward (a transformer's blocks): torch.fx counts them as
            # leaves, but each child is a module of its own to search
            for name, child in module.named_children():
                self.convert(child, _join(path, name))
            return
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

    def _max_pool_codes(self, container: nn.Module, path: str) -> None:
        """The max poolings inside an unfused SeqToANNContainer (which pools BatchNorm's
        output before its neuron) as :class:`MaxPoolCodes`: the same results, less kept."""
        if type(container) is not layer.SeqToANNContainer:
            return
        for name, child in container.named_children():
            codes = MaxPoolCodes.of(child)
            if codes is not None:
                setattr(container, name, codes)
                self.report.spike_max_pools.append(_join(path, name))

    def _unknown_children(self, module: nn.Module, path: str) -> None:
        for name, child in module.named_children():
            if _is_synapse_like(child):
                reason = f"the forward of {_display(path)} could not be traced"
                self.report.skipped.append(SkippedCandidate((_join(path, name),), reason, None))

    def _apply(self, root: nn.Module, path: str, findings: _Findings) -> None:
        folded = {p for c in findings.chains.values() for p in (c.pool, c.input_pool)}
        for name in findings.pools:
            if name in folded:
                continue
            pool = _as_pool(root.get_submodule(name))
            assert pool is not None  # _examine found it
            spike_pool = SpikePool(pool)
            _set_submodule(root, name, spike_pool)
            self.report.pools.append(_join(path, name))
            if spike_pool.spike_max is not None:
                self.report.spike_max_pools.append(_join(path, name))
        owners: dict[str, list[_Chain]] = defaultdict(list)
        for chain in findings.chains.values():
            if _rewritten(chain):  # fused by rewriting the forward that holds it
                owners[".".join(_common_parent(chain.names))].append(chain)
                continue
            self._fuse(root, path, chain)
        self.report.skipped.extend(findings.skipped.values())
        self.report.unfolded_pools.update(findings.unfolded_pools)
        for name in findings.skipped:  # unfused synapses: their input may be fused spikes
            if RecomputedInput.attach(root.get_submodule(name)):
                self.report.recomputed_inputs.append(_join(path, name))
            self._max_pool_codes(root.get_submodule(name), _join(path, name))
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

    Which chains fuse, how the model is patched and how its state-dict keys are kept: see
    :mod:`spikefuse.fused.convert.api` (the rules) and :class:`FusedBlock`. In short: a call
    of a multi-step Conv1d/Conv2d/Linear (or ``SeqToANNContainer``) whose output goes only to
    a matching BatchNorm (or none) whose output goes only to a one-state spikefuse neuron
    (``step_mode='m'``, ``store_v_seq=False``), or through an addition of a shortcut (Spiking
    ResNet's residual chain: the forward that adds is rewritten to call ``block(x,
    shortcut)``); a 2 x 2 ``AvgPool2d`` that is the sole user of a Conv2d chain's spikes is
    folded into its block (``fold_pools``); other multi-step pooling layers become
    :class:`SpikePool`. The BatchNorm's and neuron's attributes become :class:`FusedAway`,
    which names the block when the forward reads an attribute of the module that was there.
    State dicts of fused and unfused models load into each other with ``strict=True``.

    ``process_group``: what the fused BatchNorms synchronise over (None: the default group).
    ``memory``: a memory mode of :func:`~spikefuse.fused.memory_modes` (``"default"``: blocks
    keep their Conv/Linear output; ``"min"``: only their input, recomputing the Conv/Linear in
    backward; ``"auto"``: each block chooses where it pays). Returns the converted model (a
    deep copy unless ``inplace``; where fuse raises, an ``inplace`` model is left unchanged),
    and with ``return_report`` also a :class:`FuseReport`; the
    report is logged (logger ``spikefuse.fuse``: INFO, WARNING when a chain was left unfused).
    The model computes the same function, but each forward call is an independent sequence
    (fused neurons start from their reset state).
    """
    _check_arguments(model, inplace, process_group, return_report, memory, fold_pools)
    if inplace:
        _convert_a_copy_first(model, process_group, memory, fold_pools)
    else:
        model = copy.deepcopy(model)
    report, reordered = _convert(model, process_group, memory, fold_pools)
    _log_report(report, reordered)
    return (model, report) if return_report else model


def _convert(
    model: nn.Module, process_group: dist.ProcessGroup | None, memory: str, fold_pools: bool
) -> tuple[FuseReport, bool]:
    """Fuse ``model`` in place: the report, and whether ``parameters()`` changed order."""
    unfused = model.state_dict(keep_vars=True)
    fuser = _Fuser(process_group, memory, fold_pools, list(unfused))
    before = _parameter_keys(model, unfused)
    fuser.convert(model, "")
    reordered = _parameter_keys(model, model.state_dict(keep_vars=True)) != before
    return fuser.report, reordered


def _convert_a_copy_first(
    model: nn.Module, process_group: dist.ProcessGroup | None, memory: str, fold_pools: bool
) -> None:
    """Fuse a copy of ``model``'s modules that shares its parameters and buffers (no memory):
    a chain that cannot be fused raises only when its block is built, after earlier chains
    were patched, so an in-place fuse that fails must fail on the copy. A model that cannot
    be copied is fused without it, with a warning."""
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    try:
        copied = copy.deepcopy(model, memo=shared)
    except Exception as error:  # whatever an attribute's __deepcopy__ or pickling raises
        log.warning(
            "fuse: the model cannot be copied (%s: %s), so an error while fusing it in place "
            "may leave it partly fused",
            type(error).__name__,
            error,
        )
        return
    _convert(copied, process_group, memory, fold_pools)


def _check_arguments(
    model: object,
    inplace: object,
    process_group: object,
    return_report: object,
    memory: object,
    fold_pools: object,
) -> None:
    """Raise for an argument :func:`fuse` cannot take, before anything changes."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"fuse: model must be a torch.nn.Module, got {type(model).__name__}")
    flags = (("inplace", inplace), ("return_report", return_report), ("fold_pools", fold_pools))
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


def _log_report(report: FuseReport, reordered: bool) -> None:
    """Log the report (INFO), and warn where parameters changed order or chains stay."""
    log.info("%s", report)
    if reordered:
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


def _parameter_keys(model: nn.Module, state: Mapping[str, torch.Tensor]) -> list[str]:
    """The key in ``state`` (the model's ``state_dict(keep_vars=True)``) of each parameter, in
    ``parameters()`` order (what optimizers number their state by)."""
    key_of = {id(t): key for key, t in state.items()}
    return [key_of.get(id(p), "") for p in model.parameters()]


def _chains_left(report: FuseReport) -> Iterator[SkippedCandidate]:
    return (s for s in report.skipped if s.is_chain is not False)
