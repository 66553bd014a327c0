"""Fused Conv/Linear → BatchNorm → neuron modules and spike pooling (:func:`fuse`: ``convert.py``)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any, Generic, TypeVar, overload

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.conv import _ConvNd
from torch.nn.modules.utils import _pair

from .. import layer, surrogate
from ..backends import compute_dtype
from ..errors import SpikefuseError
from ..functional import repeat_over_time, repeated_over_time
from ..neuron import BaseNode, LIFNode
from ..ops import forbid_double_backward, run_neuron
from .bn_neuron import BNNeuronFunction, bn_neuron_forward, kernel_pool, repeated
from .low_memory import (
    ChunkedSynapseFunction,
    SynapseRecomputeFunction,
    batch_chunks,
    batch_parts,
    explicit_backward,
)
from .neuron_call import NeuronCall
from .recompute import Recipe, mark_recomputable, recipe_of, saving_recomputed
from .spike_bits import (
    PackedSpikes,
    compact,
    expand,
    is_spikes,
    mark_means,
    mark_packed,
    mark_spikes,
    means_window,
)
from .spike_linear import SpikeLinearFunction, takes_split_path
from .statistics import (
    BNSpec,
    BNStats,
    bn_statistics,
    bn_statistics_of_chunks,
    is_distributed,
    local_mean_var,
    refuse_join,
)
from .traced import traced_bn_neuron

SYNAPSES = (nn.Conv1d, nn.Conv2d, nn.Linear)
MEMORY_MODES = ("default", "min", "auto")
# memory="auto": a block recomputes its synapse in backward (as memory="min") where that costs
# at most this many multiply-adds per element of memory it saves. Recomputing adds one synapse
# forward, a third of the synapse's training work whatever its size, so the rule drops the
# outputs that save the most memory per recomputed multiply-add: roughly, a 3 x 3 convolution
# qualifies up to 227 input channels, a Linear up to 2048 inputs (the narrow early layers go,
# the wide deep ones whose recomputation costs the most stay).
AUTO_MAX_MACS_PER_SAVED_ELEMENT = 2048
log = logging.getLogger("spikefuse.fuse")
POOLS = (nn.AvgPool2d, nn.MaxPool2d)
# Windows (k x k) of the average pooling a Conv2d block folds in: the mean of 2 x 2 spikes is
# exact in every dtype, so folded and unfolded pooling give the same bits.
FOLDED_WINDOWS = (2,)
# The BatchNorm class that matches each synapse: channels are dim 1 of the merged [T*B, C, *].
_BN_FOR = {nn.Conv1d: nn.BatchNorm1d, nn.Conv2d: nn.BatchNorm2d, nn.Linear: nn.BatchNorm1d}
# The rank of each synapse's multi-step input [T, B, C, *spatial].
_INPUT_RANK: dict[type[nn.Module], int] = {nn.Conv1d: 4, nn.Conv2d: 5, nn.Linear: 3}
# Classes whose forward is exactly the torch layer's (plain or with spikefuse's step_mode); a
# subclass with its own forward is left unfused.
_EXACT = {
    nn.Conv1d: (nn.Conv1d, layer.Conv1d),
    nn.Conv2d: (nn.Conv2d, layer.Conv2d),
    nn.Linear: (nn.Linear, layer.Linear),
    nn.BatchNorm1d: (nn.BatchNorm1d, layer.BatchNorm1d),
    nn.BatchNorm2d: (nn.BatchNorm2d, layer.BatchNorm2d),
    nn.AvgPool2d: (nn.AvgPool2d, layer.AvgPool2d),
    nn.MaxPool2d: (nn.MaxPool2d, layer.MaxPool2d),
}


def paper_lif(**kwargs) -> LIFNode:
    """The DATE'22 paper's LIF: u[t] = 0.25 u[t-1] (1 - s[t-1]) + x[t], threshold 0.25, hard reset
    to 0, rectangular surrogate 1 on (-0.25, 0.75); multi-step. ``kwargs`` override (e.g.
    ``backend``)."""
    options: dict[str, Any] = dict(
        tau=4.0 / 3.0,  # 1 - 1/tau = 0.25
        decay_input=False,
        v_threshold=0.25,
        v_reset=0.0,
        surrogate_function=surrogate.RectWindow(eta=1.0, th_l=-0.5, th_r=0.5),
        step_mode="m",
    )
    options.update(kwargs)
    return LIFNode(**options)


class MultiStepOnly:
    """A module that runs whole sequences [T, B, ...] only: ``set_step_mode(model, "s")``
    refuses a model that holds one, changing nothing, and never switches the modules inside
    it to single-step (a fused block would otherwise go on running whole sequences, silently
    ignoring the mode)."""

    keeps_children_step_mode = True
    step_mode = "m"

    @staticmethod
    def supported_step_mode() -> tuple[str, ...]:
        return ("m",)


def hook_kinds(module: nn.Module) -> str | None:
    """'forward hooks', 'backward hooks' or both, where ``module`` has any (registered on it,
    not globally); else None. A fused block never calls its modules, so none of them run.
    Checked on every block call: attribute reads only, where there are none."""
    forward = module._forward_hooks or module._forward_pre_hooks
    backward = module._backward_hooks or module._backward_pre_hooks
    if not (forward or backward):
        return None
    kinds = [kind for kind, present in (("forward", forward), ("backward", backward)) if present]
    return " and ".join(kinds) + " hooks"


def _synapse_kind(module: nn.Module) -> type[nn.Module] | None:
    for base in SYNAPSES:
        if type(module) in _EXACT[base]:
            return base
    return None


def _broadcasts(shape: torch.Size, target: torch.Size) -> bool:
    """Whether a tensor of ``shape`` (not ``target`` itself) broadcasts to ``target``."""
    if shape == target or len(shape) > len(target):
        return False
    trailing = target[len(target) - len(shape) :]
    return all(size in (1, want) for size, want in zip(shape, trailing, strict=True))


Child = TypeVar("Child")


_ROLES = ("synapse", "bn", "node", "pool")  # a block's submodules, registered under these names


class _Submodule(Generic[Child]):
    """A registered child module (or None) read straight from the block's ``_modules``: the
    block's hot path reads its synapse, BatchNorm, neuron and pooling about a dozen times a call,
    and ``nn.Module.__getattr__`` (the fallback after a failed attribute lookup) costs several
    times a plain read each time. Assigning still goes through ``nn.Module.__setattr__``."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, block: None, owner: type | None = None) -> _Submodule[Child]: ...
    @overload
    def __get__(self, block: nn.Module, owner: type | None = None) -> Child: ...
    def __get__(self, block: nn.Module | None, owner: type | None = None) -> Any:
        if block is None:
            return self
        try:
            return block._modules[self.name]
        except KeyError:
            raise AttributeError(self.name) from None


class FusedBlock(MultiStepOnly, nn.Module):
    """``synapse → [BatchNorm] → neuron`` on multi-step input, keeping only the synapse output.

    Input ``[T, B, C_in, *]`` (Conv2d: ``[T, B, C_in, H, W]``, Linear: ``[T, B, F_in]``, or
    without BatchNorm tokens ``[T, B, *, F_in]``, whose token dims join B); output
    spikes ``[T, B, C_out, *]`` in the input's dtype (bf16 under bf16 autocast). The synapse runs
    once on the merged ``[T*B, ...]`` batch. BatchNorm normalises each channel over
    (T, B, spatial) — batch statistics in training (synchronised across processes when
    torch.distributed is initialised), running statistics in eval — exactly like the unfused
    ``layer.BatchNorm2d(step_mode='m')``. The neuron is any one-state :class:`BaseNode`; it runs
    from its reset state on every call, so each call is an independent sequence and the node's
    ``.v`` is neither read nor written.

    Memory: backward keeps the synapse output and per-channel vectors; BN output, membrane
    potentials and spikes are recomputed. A synapse input that is the spike output of another
    fused block (directly, or through a :class:`SpikePool`) is not stored either: backward
    recomputes it from that block's synapse output with one forward kernel launch (where it
    takes at least :data:`~.recompute.RECOMPUTE_MIN_BYTES`; a smaller one is stored).

    On CUDA a Conv2d runs channels-last (cuDNN's native layout: no transposes around each
    convolution), and its weight is kept channels-last (a block made or moved to CUDA converts
    it); the output spikes keep that memory layout, which the next fused block,
    :class:`SpikePool` and ``flatten`` all accept.

    An input that repeats one [B, ...] tensor over T as a view (``images.unsqueeze(0).expand(T,
    ...)``, needing no gradient: a static image) runs the synapse once on the B samples. With
    BatchNorm the block then keeps that one step's output [1, B, ...] (statistics from it with
    the count of all T steps; the kernels read it at every step and sum its gradient over T);
    otherwise the output is repeated to [T, B, ...] by one copy.

    Pooling: a Conv2d block may end with the 2 x 2 average pooling of its spikes (``pool``; what
    :func:`~spikefuse.fused.fuse` folds in where such a pooling is the sole user of the
    neuron's output). Its output is then the pooled map ``[T, B, C_out, H/2, W/2]``. With the
    cuda backend and BatchNorm the kernels pool themselves: forward writes only the pooled map
    (never the full spikes) and backward reads only its gradient. Otherwise (torch backend, no
    BatchNorm, odd H or W, ``memory="min"``, ``torch.compile``) the block pools its full spikes
    with torch ops (:class:`WindowAvgPool`): the same values either way.

    Args:
        synapse: ``nn.Conv1d``/``nn.Conv2d``/``nn.Linear`` (or spikefuse ``layer`` versions).
        bn: the matching ``BatchNorm1d``/``BatchNorm2d``, or None for no normalisation.
        node: the neuron (e.g. :func:`paper_lif`).
        process_group: the group BN synchronises over (None: the default group).
        memory: ``"default"`` keeps the synapse output y for backward (the DATE'22 blocks);
            ``"min"`` keeps only the block's input, 1-bit packed when it is the spike output
            of another fused block, and recomputes y in backward (one more synapse forward per
            block; the same gradients; see :mod:`spikefuse.fused.low_memory`); ``"auto"``
            chooses between the two on every training call (:meth:`recomputes`): "min" where
            recomputing costs at most :data:`AUTO_MAX_MACS_PER_SAVED_ELEMENT` multiply-adds
            per element of memory saved. ``memory_choice`` holds the last call's choice.
        pool: an ``nn.AvgPool2d`` (or ``layer.AvgPool2d``) averaging 2 x 2 windows with kernel =
            stride, no padding, ceil_mode or divisor_override, applied to the spikes; or None.
        residual: the block adds a residual to the BatchNorm output before the neuron (Spiking
            ResNet's ``sn2(bn2(conv2(x)) + shortcut)``): it is called as ``block(x, shortcut)``,
            with ``shortcut`` shaped like the synapse output ``[T, B, C_out, *]``.

    A residual block keeps the shortcut for backward at 1 bit per element when it is the spike
    output of a fused block, else as it is. With the cuda backend the BN-folded kernels add the
    shortcut themselves when it has y's dtype; otherwise (e.g. a float32 BatchNorm output under
    bf16 autocast, or the torch backend) BatchNorm runs as torch ops before the plain neuron
    kernels.
    """

    # The neuron starts from its reset state on every call (read by
    # functional.chunk_multi_step_forward, which must not split such a module's sequence).
    restarts_every_call = True
    # The last call's neuron call, reused while the node is unchanged (see NeuronCall.from_node).
    _neuron_call: NeuronCall | None = None
    synapse = _Submodule["nn.Linear | _ConvNd"]()
    bn = _Submodule["nn.modules.batchnorm._BatchNorm | None"]()
    node = _Submodule[BaseNode]()
    pool = _Submodule["nn.AvgPool2d | None"]()

    def __init__(
        self,
        synapse: nn.Module,
        bn: nn.modules.batchnorm._BatchNorm | None,
        node: BaseNode,
        process_group: dist.ProcessGroup | None = None,
        memory: str = "default",
        pool: nn.Module | None = None,
        residual: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(residual, bool):
            raise SpikefuseError(f"FusedBlock: residual must be a bool, got {residual!r}")
        if memory not in MEMORY_MODES:
            raise SpikefuseError(
                f"FusedBlock: memory must be one of {MEMORY_MODES}, got {memory!r}"
            )
        kind = _synapse_kind(synapse)
        if kind is None:
            raise SpikefuseError(
                "FusedBlock: synapse must be a Conv1d, Conv2d or Linear, got "
                f"{type(synapse).__name__}"
            )
        if bn is not None:
            expected = _BN_FOR[kind]
            if type(bn) not in _EXACT[expected]:
                raise SpikefuseError(
                    f"FusedBlock: a {kind.__name__} needs {expected.__name__}, "
                    f"got {type(bn).__name__}"
                )
            channels = synapse.out_channels if kind is not nn.Linear else synapse.out_features
            if bn.num_features != channels:
                raise SpikefuseError(
                    f"FusedBlock: BatchNorm has {bn.num_features} features, the {kind.__name__} "
                    f"produces {channels} channels"
                )
        if not isinstance(node, BaseNode):
            raise SpikefuseError(
                f"FusedBlock: node must be a spikefuse neuron, got {type(node).__name__}"
            )
        # A neuron's own torch code would be bypassed by the kernels.
        overridden = node._overridden_forward
        own_code = node.torch_code or (
            f"it overrides {'/'.join(overridden)}" if overridden else None
        )
        if own_code is not None:
            raise SpikefuseError(
                f"FusedBlock: {type(node).__name__} runs torch code ({own_code}); only neurons "
                "defined by a NeuronDef with a spikefuse Surrogate can be fused"
            )
        if node.definition is not None and node.definition.adaptive:  # None: torch code, above
            raise SpikefuseError(
                f"FusedBlock: only one-state neurons can be fused, {type(node).__name__} has two"
            )
        if node.store_v_seq:
            raise SpikefuseError(
                "FusedBlock: store_v_seq=True needs V, which fused blocks never keep"
            )
        if pool is not None:
            problem = pool_fold_problem(pool, kind)
            if problem is not None:
                raise SpikefuseError(f"FusedBlock: the pooling cannot be folded in: {problem}")
        assert isinstance(synapse, (nn.Linear, _ConvNd))  # what _synapse_kind accepts
        # registered even where None, so that the class's _Submodule reads find them
        self.register_module("synapse", synapse)
        self.register_module("bn", bn)
        self.register_module("node", node)
        # the mode of what it replaces (an eval model's blocks stay in eval); not train(),
        # which would also set the BatchNorm (one frozen with bn.eval() stays frozen)
        self.training = synapse.training
        self.register_module("pool", pool)  # pool_fold_problem checked it
        # k of the block's k x k average pooling (1: none)
        self._window = 1 if pool is None else _pair(pool.kernel_size)[0]
        self._kind = kind
        self.process_group = process_group
        self.memory = memory
        # the mode of the last training call: memory itself, or what "auto" chose
        self.memory_choice = memory
        # memory="auto": (multiply-adds, elements saved) of recomputing, by what they depend on
        # in the input, so that a training call does not redo the arithmetic
        self._recompute_terms_of: dict[tuple[Any, ...], tuple[float, float]] = {}
        self.residual = residual
        self._weight_in_run_layout()
        # load_state_dict(assign=True) replaces the weight without _apply (a module-level
        # function: the hook is pickled with the block)
        self.register_load_state_dict_post_hook(_weight_layout_after_load)

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> FusedBlock:
        """``.to()``, ``.cuda()``, ...; then the weight's layout (:meth:`_weight_in_run_layout`)."""
        super()._apply(fn, recurse)
        self._weight_in_run_layout()
        return self

    def _weight_in_run_layout(self) -> None:
        """A Conv2d on CUDA keeps its weight channels-last, the layout it runs in (see
        :meth:`_runs_channels_last`): cuDNN would otherwise copy the weight into that layout on
        every forward and backward, and its gradient back. Done when the block is made or
        moved, before an optimizer or DistributedDataParallel sees the parameter (DDP's
        gradient buckets follow the parameters' layout); the values are unchanged. Optimizer
        state made for the other layout (loaded from an unfused model's checkpoint, or made
        before ``fuse(model, inplace=True)``): see :func:`match_optimizer_state`. A
        parametrized weight (e.g. weight norm) or a tensor subclass is left as it is."""
        weight = self.synapse.weight
        plain = isinstance(weight, nn.Parameter) and type(weight.data) is torch.Tensor
        if self._kind is not nn.Conv2d or not weight.is_cuda or not plain:
            return
        layout = torch.channels_last
        if not weight.is_contiguous(memory_format=layout):
            weight.data = weight.data.contiguous(memory_format=layout)
        if weight.grad is not None and not weight.grad.is_contiguous(memory_format=layout):
            weight.grad = weight.grad.contiguous(memory_format=layout)

    def _check_input(self, x: Tensor) -> None:
        if not isinstance(x, Tensor):
            raise SpikefuseError(f"FusedBlock: input must be a tensor, got {type(x).__name__}")
        rank = _INPUT_RANK[self._kind]
        if x.dim() != rank:
            expected = "[T, B, F]" if self._kind is nn.Linear else "[T, B, C, ...]"
            tokens = self._kind is nn.Linear and x.dim() > rank  # a BatchNorm1d would take N as C
            raise SpikefuseError(
                f"FusedBlock({self._kind.__name__}): expected input {expected} of rank {rank}, "
                f"got shape {tuple(x.shape)}"
                + (
                    "; a Linear block with BatchNorm1d takes [T, B, F] only (on [T, B, N, F] "
                    "BatchNorm1d normalises dim N as its channels): use the unfused model"
                    if tokens
                    else ""
                )
            )
        if x.shape[0] == 0:
            raise SpikefuseError("FusedBlock: the input has T = 0 time steps")
        if not x.dtype.is_floating_point:
            raise SpikefuseError(f"FusedBlock: input dtype must be floating point, got {x.dtype}")

    def _check_no_hooks(self) -> None:
        """Refuse hooks registered on the block's modules after fusing (``fuse`` leaves chains
        with hooks unfused): the block never calls those modules, so their forward and
        backward hooks would silently not run (e.g. a monitor recording a neuron's spikes)."""
        for role in _ROLES:
            module = getattr(self, role)  # the _Submodule descriptor: a read of _modules
            hooks = None if module is None else hook_kinds(module)
            if hooks is not None:
                raise SpikefuseError(
                    f"FusedBlock: its {role} ({type(module).__name__}) has {hooks}, which "
                    "never run: the block runs its kernels instead of that module. Register the "
                    "hook on the block itself (its output is the neuron's spikes, pooled where "
                    "the block pools), or use the unfused model"
                )

    def _checked_residual(self, residual: Tensor | None, y: Tensor) -> Tensor | None:
        """The residual as the kernels add it: a floating-point tensor shaped like the synapse
        output y, or one that broadcasts to it (as the unfused addition would), expanded."""
        if residual is None:
            return None
        if isinstance(residual, Tensor) and _broadcasts(residual.shape, y.shape):
            # a dense copy (the kernels read dense memory); autograd sums its gradient back
            residual = residual.expand(y.shape).contiguous()
        if not isinstance(residual, Tensor) or residual.shape != y.shape:
            shape = tuple(residual.shape) if isinstance(residual, Tensor) else type(residual)
            raise SpikefuseError(
                f"FusedBlock: the residual must be shaped like the synapse output "
                f"{tuple(y.shape)} or broadcast to it, got {shape}"
            )
        if not residual.dtype.is_floating_point or residual.device != y.device:
            raise SpikefuseError(
                f"FusedBlock: the residual must be floating point on {y.device}, got "
                f"{residual.dtype} on {residual.device}"
            )
        return residual

    def _runs_channels_last(self, merged: Tensor) -> bool:
        """Whether the synapse runs channels-last: a Conv2d on CUDA (cuDNN's native layout, no
        transposes around the convolution; the kernels read that layout as it is)."""
        return self._kind is nn.Conv2d and merged.is_cuda

    def _merged(self, x: Tensor) -> Tensor:
        """[T, B, ...] as the synapse's [T*B, ...] batch, in the layout it runs in."""
        merged = x.flatten(0, 1)
        if self._runs_channels_last(merged):
            merged = merged.contiguous(memory_format=torch.channels_last)
        return merged

    def _merged_part(self, x: Tensor, part: slice) -> Tensor:
        """x[:, part] as the synapse's [T*b, ...] batch in the layout it runs in: a view of x
        where it is that already (the whole batch, dense), else a copy."""
        src = x[:, part]
        layout = torch.channels_last if self._runs_channels_last(x) else torch.contiguous_format
        if src.shape[1] == x.shape[1]:
            view = src.flatten(0, 1)  # a copy (of the logical order) where not viewable
            if view.is_contiguous(memory_format=layout):
                return view
        merged = torch.empty(
            (src.shape[0] * src.shape[1], *src.shape[2:]),
            dtype=x.dtype,
            device=x.device,
            memory_format=layout,
        )
        merged.unflatten(0, src.shape[:2]).copy_(src)
        return merged

    def _synapse_merged(self, merged: Tensor, steps: int) -> Tensor:
        """The synapse output [T, b, ...] of a merged batch [T*b, ...] of ``steps`` steps."""
        return self._kind.forward(self.synapse, merged).unflatten(0, (steps, -1))

    def _synapse_call(self, x: Tensor) -> Tensor:
        """y = synapse(x) on [T, B, ...] (memory="min" recomputes it in backward). The torch base
        class's forward: spikefuse layers would otherwise re-split T and B.

        An input repeated over T as a view (``images.expand(T, ...)``, stride 0 over T: a static
        image fed at every step) runs the synapse once per sample, on x[0], and repeats its
        output: T times less synapse work forward, and in backward autograd sums dL/dy over T
        before the synapse's backward. y is the same either way (up to the convolution's float
        rounding order)."""
        if repeated_over_time(x):
            return repeat_over_time(self._synapse_step(x)[0], x.shape[0])
        return self._kind.forward(self.synapse, self._merged(x)).unflatten(0, x.shape[:2])

    def _synapse_step(self, x: Tensor) -> Tensor:
        """The synapse output [1, B, ...] of one step of an input repeated over time."""
        return self._kind.forward(self.synapse, self._merged(x[:1])).unsqueeze(0)

    def _repeat(self, x: Tensor) -> int:
        """T where the block keeps one step of its synapse output for an input repeated over
        time (with BatchNorm: the BN-folded kernels read one step; a plain neuron would copy
        it), else 1."""
        return x.shape[0] if self.bn is not None and repeated_over_time(x) else 1

    def _synapse_kept(self, x: Tensor, repeat: int) -> Tensor:
        """The synapse output the block keeps: of one step [1, B, ...] (``repeat`` > 1), else
        [T, B, ...] (:meth:`_synapse_call`)."""
        return self._synapse_step(x) if repeat > 1 else self._synapse_call(x)

    def _synapse_forward(self, x: Tensor) -> Tensor:
        """:meth:`_synapse_call`, saving an input that is fused-block spikes as its recipe, or
        packed at 1 bit per element where it has none (a min-memory block's output), where it
        takes at least :data:`~.recompute.RECOMPUTE_MIN_BYTES` (see :func:`saving_recomputed`)."""
        merged = x.flatten(0, 1)
        # x's tags (a tag on x, a view, is not seen from merged, another view of its memory)
        x_recipe = recipe_of(x)
        recipe = None if x_recipe is None else lambda: x_recipe().flatten(0, 1)
        spikes = recipe is None and is_spikes(x)
        split = self._kind is nn.Linear and takes_split_path(x, self.synapse.weight)
        if recipe is None and not spikes and not split:  # nothing to recompute or split
            return self._synapse_call(x)
        if self._runs_channels_last(merged):  # recompute in the conv's layout
            recipe = None if recipe is None else _channels_last(recipe)
            merged = merged.contiguous(memory_format=torch.channels_last)
            if spikes:  # a copy, if one was made, holds the same spikes
                mark_spikes(merged)
        with saving_recomputed(merged, recipe):  # the very tensor the synapse saves
            if split:
                y = SpikeLinearFunction.apply(merged, self.synapse.weight, self.synapse.bias)
            else:
                y = self._kind.forward(self.synapse, merged)
            return y.unflatten(0, x.shape[:2])

    def _prepare(
        self, y: Tensor, statistics: bool = True
    ) -> tuple[NeuronCall, Tensor | None, BNSpec | None, BNStats | None]:
        """(neuron call, learnable values, BN spec, statistics) for this call's synapse output:
        everything is checked before BatchNorm counts the batch and updates its statistics
        (``statistics=False``: the caller takes them; None here)."""
        if torch.compiler.is_compiling():  # no module state written while tracing
            neuron = NeuronCall.from_node(self.node, y)
        else:
            neuron = self._neuron_call = NeuronCall.from_node(self.node, y, self._neuron_call)
        if self.bn is not None and is_distributed(self.process_group):
            refuse_join()
        self._check_anomaly(y)
        learnable = self.node.learnable_values(y.device, compute_dtype(y.dtype))
        bn = self._bn_spec()
        return neuron, learnable, bn, None if bn is None or not statistics else bn_statistics(y, bn)

    def _check_anomaly(self, y: Tensor) -> None:
        """The node's NaN check of its input (a host sync: eager anomaly mode only)."""
        if not torch.compiler.is_compiling() and torch.is_anomaly_enabled():
            self.node._check_no_nan(y, None)

    def recomputes(self, x: Tensor) -> bool:
        """Whether a training call on ``x`` keeps only the input and recomputes the synapse
        output in backward: always with ``memory="min"``, never with ``"default"``; with
        ``"auto"`` where it pays (:meth:`_recompute_terms`). Sets ``memory_choice``, and logs
        (logger ``spikefuse.fuse``, INFO) when "auto" changes its choice."""
        if self.memory != "auto":
            return self.memory == "min"
        has_recipe = recipe_of(x.flatten(0, 1)) is not None
        key = (x.shape, x.dtype, repeated_over_time(x), has_recipe, is_spikes(x))
        terms = self._recompute_terms_of.get(key)
        if terms is None:
            terms = self._recompute_terms_of[key] = self._recompute_terms(x)
        cost, saved = terms
        pays = saved > 0 and cost <= AUTO_MAX_MACS_PER_SAVED_ELEMENT * saved
        choice = "min" if pays else "default"
        if choice != self.memory_choice:
            log.info("FusedBlock(memory='auto', %r): %s", self.synapse, choice)
            self.memory_choice = choice
        return choice == "min"

    def _recompute_terms(self, x: Tensor) -> tuple[float, float]:
        """(multiply-adds, elements of memory saved) of recomputing the synapse on ``x``; it
        pays at up to :data:`AUTO_MAX_MACS_PER_SAVED_ELEMENT` multiply-adds per element.

        Saved: the synapse output the default mode keeps (one step of it for an input
        repeated over time), less what the minimal mode makes the network keep and the
        default mode does not: the block's input where the default mode recomputes it (fused-
        block spikes), and the block's output, which then has no recipe, so the next layer
        keeps it (its spikes packed, a pooled map whole). Packed spikes count 1 bit per
        element. Cost: one synapse forward on the steps it runs on. Where the pooling
        kernels pack their means (CUDA), both modes keep those bits instead, so the two
        pooled-map terms over-count what "min" adds: the rule then leans to the default mode
        (kept as measured, session 22, for lack of a GPU run of the exact terms). Spikes under
        :data:`~.recompute.RECOMPUTE_MIN_BYTES` are saved whole rather than recomputed or
        packed, which the terms do not model: a difference of at most a few MiB a block."""
        images = repeated_over_time(x)  # kept by the caller in either mode
        T = x.shape[0]
        steps = 1 if images else T
        kept_steps = 1 if self._repeat(x) > 1 else T
        per_step, fan_in = self._synapse_geometry(x.shape[1:])
        packed = 1 / (8 * x.element_size())  # elements per packed spike
        out = per_step * T
        saved = per_step * kept_steps - (out / self._window**2 if self.pool else out * packed)
        if not images and recipe_of(x.flatten(0, 1)) is not None:  # min keeps, default not
            saved -= x.numel() * (packed if is_spikes(x) else 1)
        return per_step * steps * fan_in, saved

    def _synapse_geometry(self, step_shape: torch.Size) -> tuple[int, int]:
        """(output elements of one step, multiply-adds per output element) of the synapse on
        one step's input [B, C_in, *] (Linear: [B, F_in])."""
        synapse = self.synapse
        if isinstance(synapse, nn.Linear):
            return step_shape[0] * synapse.out_features, synapse.in_features
        spatial = []
        for d, size in enumerate(step_shape[2:]):
            if isinstance(synapse.padding, str):  # "valid", or "same" (stride 1)
                pad = 0 if synapse.padding == "valid" else None
            else:
                pad = synapse.padding[d]
            reach = synapse.dilation[d] * (synapse.kernel_size[d] - 1)
            spatial.append(
                size if pad is None else (size + 2 * pad - reach - 1) // synapse.stride[d] + 1
            )
        fan_in = synapse.in_channels // synapse.groups * math.prod(synapse.kernel_size)
        return step_shape[0] * synapse.out_channels * math.prod(spatial), fan_in

    def _forward_min_memory(self, x: Tensor, residual: Tensor | None) -> Tensor:
        """memory="min": y is computed without autograd here and recomputed in backward (of
        an input repeated over time, as in :meth:`forward`, only one step)."""
        repeat = self._repeat(x)
        chunks = self._batch_chunks(x, repeat, residual)
        if chunks > 1:
            return self._forward_chunked(x, batch_parts(x.shape[1], chunks))
        with torch.no_grad():
            kept_y = self._synapse_kept(x, repeat)
        y = repeated(kept_y, repeat)
        residual = self._checked_residual(residual, y)
        neuron, learnable, bn, stats = self._prepare(y)
        weight, bias = (None, None) if bn is None else (bn.weight, bn.bias)
        pool = self._kernel_pool(y, stats, neuron, residual)
        spikes, packed = SynapseRecomputeFunction.apply(
            x,
            kept_y,
            weight,
            bias,
            learnable,
            stats,
            bn,
            neuron,
            residual,
            None if residual is None else compact(residual),
            self,
            pool,
            repeat,
            *self.synapse.parameters(),
        )
        # without bits the next layer keeps the spikes (packed where binary and 4 MiB or more)
        return self._tagged(self._pooled(self._with_bits(spikes, packed, pool), pool))

    def _batch_chunks(self, x: Tensor, repeat: int, residual: Tensor | None) -> int:
        """How many batch chunks memory="min" runs this call in (1: none; see
        :func:`~.low_memory.batch_chunks`): blocks with BatchNorm whose synapse backward is
        explicit, on an input that is not repeated over time, without a residual. Not with
        "auto", whose rule prices recomputing at one synapse forward (chunks take three)."""
        if self.memory != "min" or self.bn is None or repeat > 1 or residual is not None:
            return 1
        if not explicit_backward(self.synapse):
            return 1
        device = x.device.type
        autocast = torch.is_autocast_enabled(device)
        dtype = torch.get_autocast_dtype(device) if autocast else x.dtype
        per_step, _ = self._synapse_geometry(x.shape[1:])
        return batch_chunks(x.shape[1], per_step * x.shape[0] * dtype.itemsize)

    def _forward_chunked(self, x: Tensor, parts: list[slice]) -> Tensor:
        """memory="min" in equal batch chunks (:class:`~.low_memory.ChunkedSynapseFunction`):
        a first pass over the chunks takes the batch statistics (each chunk's y computed and
        dropped), then the Function recomputes each chunk for the neuron."""
        steps = x.shape[0]
        with torch.no_grad():
            y = self._synapse_merged(self._merged_part(x, parts[0]), steps)
        neuron, learnable, bn, _ = self._prepare(y, statistics=False)
        assert bn is not None  # chunked blocks have BatchNorm
        if bn.batch_stats:
            moments = [local_mean_var(y)]
            with torch.no_grad():
                for part in parts[1:]:
                    del y  # before the next chunk's
                    y = self._synapse_merged(self._merged_part(x, part), steps)
                    self._check_anomaly(y)
                    moments.append(local_mean_var(y))
            stats = bn_statistics_of_chunks(moments, bn, y)
        else:
            stats = bn_statistics(y, bn)
        pool = self._kernel_pool(y, stats, neuron, None)
        del y
        spikes, packed = ChunkedSynapseFunction.apply(
            x,
            bn.weight,
            bn.bias,
            learnable,
            stats,
            bn,
            neuron,
            self,
            pool,
            parts,
            *self.synapse.parameters(),
        )
        return self._tagged(self._pooled(self._with_bits(spikes, packed, pool), pool))

    def _kernel_pool(
        self, y: Tensor, stats: BNStats | None, neuron: NeuronCall, residual: Tensor | None
    ) -> int:
        """The window the kernels pool the spikes over: the block's, where they can pool
        themselves (:func:`kernel_pool`), else 1 (the block pools the full spikes)."""
        if self.pool is None or residual is not None:
            return 1
        return kernel_pool(y, stats, neuron, self._window)

    def _bn_spec(self) -> BNSpec | None:
        """This call's BatchNorm side (bn_statistics counts the batch and updates the running
        statistics, once the call is known to run)."""
        bn = self.bn
        if bn is None:
            return None
        update = bn.training and bn.track_running_stats
        return BNSpec(
            weight=bn.weight,
            bias=bn.bias,
            running_mean=bn.running_mean,
            running_var=bn.running_var,
            # torch's rule: batch statistics in eval too where there are no running ones
            batch_stats=bn.training or (bn.running_mean is None and bn.running_var is None),
            momentum=bn.momentum,
            eps=bn.eps,
            group=self.process_group,
            num_batches_tracked=bn.num_batches_tracked if update else None,
        )

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        if self._kind is nn.Linear and self.bn is None and residual is None:
            if isinstance(x, Tensor) and x.dim() > 3:  # tokens [T, B, *, F]: the Linear and
                # the neuron act on each token alike, so the token dims join the batch
                return self.forward(x.flatten(1, -2)).unflatten(1, x.shape[1:-1])
        self._check_input(x)
        self._check_no_hooks()
        if (residual is None) == self.residual:
            raise SpikefuseError(
                "FusedBlock: this block adds a residual: call it as block(x, shortcut) (its "
                "module's forward was rewritten by fuse())"
                if self.residual
                else "FusedBlock: a residual needs a block made with residual=True"
            )
        if torch.compiler.is_compiling():
            return self._traced_forward(x, residual)
        if torch.is_grad_enabled() and self.recomputes(x):
            return self._forward_min_memory(x, residual)
        # An input repeated over time: the synapse output of one step [1, B, ...], which the
        # block reads at every step (as y, its expanded view) and keeps alone for backward.
        repeat = self._repeat(x)
        kept_y = self._synapse_step(x) if repeat > 1 else self._synapse_forward(x)
        y = repeated(kept_y, repeat)
        residual = self._checked_residual(residual, y)
        neuron, learnable, bn, stats = self._prepare(y)
        weight, bias = (None, None) if bn is None else (bn.weight, bn.bias)
        grads = (kept_y, weight, bias, learnable, residual)
        save = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in grads)
        pool = self._kernel_pool(y, stats, neuron, residual)
        kept = None if residual is None or not save else compact(residual)
        out, packed = BNNeuronFunction.apply(
            kept_y, weight, bias, learnable, stats, bn, neuron, save, pool, residual, kept, repeat
        )
        if not save:
            return self._tagged(self._pooled(out, pool))
        if packed is not None:  # restored by unpacking (packed only where the kernels pooled)
            return self._tagged(self._with_bits(out, packed, pool))
        y, learnable = y.detach(), None if learnable is None else learnable.detach()

        def recipe() -> Tensor:  # the kernels' output, recomputed
            shortcut = None if kept is None else expand(kept)
            return bn_neuron_forward(y, stats, neuron, learnable, False, pool, shortcut)[0]

        return self._tagged(self._pooled(mark_recomputable(out, recipe), pool, recipe))

    @staticmethod
    def _with_bits(out: Tensor, packed: Tensor | None, pool: int) -> Tensor:
        """``out``, tagged with ``packed`` where the pooling kernels packed it (the spikes
        behind each mean): unpacking it is then out's recipe (the next layer's saved input,
        restored in backward), and a min-memory block keeps it as its input instead of the
        map (:func:`~.spike_bits.compact`)."""
        if packed is None:
            return out
        return mark_packed(out, PackedSpikes.written(packed, out, pool * pool))

    def _pooled(self, out: Tensor, kernel_pool: int, recipe: Recipe | None = None) -> Tensor:
        """The block's output from the neuron's: ``out`` as it is, or where the block pools and
        the kernels did not (``kernel_pool`` 1), the pooling of the full spikes with torch ops,
        tagged with the pooling of ``recipe`` (out's recipe) when given."""
        if self.pool is None or kernel_pool > 1:
            return out
        pooled = self._pool_merged(out.flatten(0, 1))
        if recipe is not None:  # views of the merged map (this unflatten, a flatten) read its tag
            mark_recomputable(pooled, lambda: self._pool_merged(recipe().flatten(0, 1)))
        return pooled.unflatten(0, out.shape[:2])

    def _pool_merged(self, merged: Tensor) -> Tensor:
        """The block's pooling of full spikes [T*B, C, H, W] with torch ops."""
        assert self.pool is not None  # called for pooling blocks only
        if torch.compiler.is_compiling():  # the compiler generates its own kernels
            return nn.AvgPool2d.forward(self.pool, merged)
        return WindowAvgPool.apply(merged, self._window, self._window)

    def _tagged(self, out: Tensor) -> Tensor:
        """The output, tagged as binary spikes (memory="min" packs a next block's binary input
        at 1 bit per element), or as the means of k x k spikes where the block pools."""
        return mark_spikes(out) if self.pool is None else mark_means(out, self._window**2)

    def _traced_forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """What ``torch.compile`` traces: the synapse, the eager block's statistics (and
        running-statistics update), then BatchNorm → neuron as the ``bn_neuron_fptt`` op of
        :mod:`spikefuse.fused.traced` (the BN-folded kernels with the cuda backend; opaque to
        the compiler, no graph break; its backward keeps only y and the per-channel vectors),
        which also pools where the block pools (in the kernels where they can, as in eager:
        no full spike map is written). Without BatchNorm, the neuron's own op. The eager
        path's recomputation of the next layer's input (autograd saved-tensor hooks) cannot be
        traced: compiled, the next synapse saves the spikes it reads.
        """
        if is_distributed(self.process_group):
            raise SpikefuseError(
                "FusedBlock: under torch.compile the fused BatchNorm is not synchronised across "
                "processes; run the fused model eagerly (or CUDA-graph it) under torch.distributed"
            )
        y = self._synapse_call(x)  # as in eager: the same layout
        residual = self._checked_residual(residual, y)
        if residual is not None:  # torch's BatchNorm (it updates the running statistics)
            normed = y
            if self.bn is not None:
                normed = (
                    _BN_FOR[self._kind].forward(self.bn, y.flatten(0, 1)).unflatten(0, x.shape[:2])
                )
            return self._traced_neuron(normed + residual).to(y.dtype)  # as eager: y's dtype
        neuron, learnable, bn, stats = self._prepare(y)
        if bn is not None and stats is not None:  # the eager block's functions, as ops (the
            # op pools: with the kernels where they can, which the compiler cannot trace)
            pool = 1 if self.pool is None else self._window
            return traced_bn_neuron(y, stats, bn, neuron, learnable, pool)
        return self._traced_neuron(y, neuron, learnable)

    def _traced_neuron(
        self, x: Tensor, neuron: NeuronCall | None = None, learnable: Tensor | None = None
    ) -> Tensor:
        """The neuron's own op on x (no BatchNorm left), pooled where the block pools."""
        if neuron is None:
            neuron = NeuronCall.from_node(self.node, x)
            learnable = self.node.learnable_values(x.device, compute_dtype(x.dtype))
        spikes, _, _, _ = run_neuron(
            program=neuron.program,
            backend=neuron.backend,
            x_seq=x,
            v0=None,
            w0=None,
            learnable=learnable,
            constants=neuron.constants,
            init=[neuron.v_init, 0.0],  # every call starts from the reset state, as in eager
            store_v_seq=False,
        )
        return self._pooled(spikes, 1)


def _channels_last(recipe: Recipe) -> Recipe:
    return lambda: recipe().contiguous(memory_format=torch.channels_last)


class WindowAvgPool(torch.autograd.Function):
    """Average pooling over non-overlapping k_h × k_w windows of [N, C, H, W] (kernel = stride,
    no padding; a remainder of rows/columns is dropped, as ``avg_pool2d`` does).

    Forward is one mean reduction, backward one broadcast write, both in the input's memory
    layout (NCHW or channels-last): on an H200 torch's ``avg_pool2d`` kernels ran 3-7× slower
    than memory bandwidth on these maps, both directions, both layouts.
    """

    @staticmethod
    def forward(ctx, x: Tensor, kh: int, kw: int) -> Tensor:
        n, c, h, w = x.shape
        ho, wo = h // kh, w // kw
        layout = _memory_format(x)
        out = torch.empty((n, c, ho, wo), dtype=x.dtype, device=x.device, memory_format=layout)
        torch.mean(_windows(x, kh, kw), dim=(3, 5), out=out)
        ctx.geometry = (x.shape, layout, kh, kw)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        forbid_double_backward("WindowAvgPool")
        shape, layout, kh, kw = ctx.geometry
        grad_x = torch.empty(shape, dtype=grad.dtype, device=grad.device, memory_format=layout)
        if shape[2] % kh or shape[3] % kw:  # the dropped rows/columns get no gradient
            grad_x.zero_()
        windows = _windows(grad_x, kh, kw)
        torch.mul(grad[:, :, :, None, :, None].expand(windows.shape), 1.0 / (kh * kw), out=windows)
        return grad_x, None, None


def _memory_format(x: Tensor) -> torch.memory_format:
    cl = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    return torch.channels_last if cl else torch.contiguous_format


def _windows(x: Tensor, kh: int, kw: int) -> Tensor:
    """[N, C, H, W] → the view [N, C, H/kh, kh, W/kw, kw] of its whole windows."""
    ho, wo = x.shape[2] // kh, x.shape[3] // kw
    return x[:, :, : ho * kh, : wo * kw].unflatten(3, (wo, kw)).unflatten(2, (ho, kh))


def pool_fold_problem(pool: nn.Module, synapse_kind: type[nn.Module]) -> str | None:
    """Why ``pool`` cannot be folded into a fused block of ``synapse_kind``, or None."""
    if synapse_kind is not nn.Conv2d:
        return f"only Conv2d blocks pool, not {synapse_kind.__name__} blocks"
    if type(pool) not in _EXACT[nn.AvgPool2d]:
        return f"{type(pool).__name__} is not an AvgPool2d; only average pooling folds"
    window = _window_size(pool)
    if window is None:
        return "its kernel differs from its stride, or it pads, uses ceil_mode or divisor_override"
    if window[0] != window[1] or window[0] not in FOLDED_WINDOWS:
        return (
            f"its windows are {window[0]}x{window[1]}; only 2x2 windows fold (their mean is "
            "exact in every dtype)"
        )
    return None


def _window_size(pool: nn.Module) -> tuple[int, int] | None:
    """(k_h, k_w) if ``pool`` averages non-overlapping windows exactly like :class:`WindowAvgPool`."""
    if not isinstance(pool, nn.AvgPool2d):
        return None
    size, stride = _pair(pool.kernel_size), _pair(pool.stride or pool.kernel_size)
    plain = _pair(pool.padding) == (0, 0) and not pool.ceil_mode and pool.divisor_override is None
    return size if plain and size == stride else None


class SpikePool(MultiStepOnly, nn.Module):
    """Average or max pooling of multi-step spikes ``[T, B, C, H, W]`` that stores no spikes.

    On the spike output of a fused block, what the pooling saves (max pooling: its input) is
    recomputed in backward, and its output is tagged so that the next fused block recomputes
    it too (the pooling applied to the recomputed spikes) instead of saving it; spikes of a
    block that keeps no synapse output (``memory="min"``) are saved at 1 bit per element, and
    max pooling tags its output as spikes; spikes under :data:`~.recompute.RECOMPUTE_MIN_BYTES`
    are saved as they are. Any other input is pooled plainly. ``pool``: an
    ``nn.AvgPool2d``/``nn.MaxPool2d`` (or spikefuse ``layer`` version); average pooling with
    kernel = stride and no padding runs as :class:`WindowAvgPool`.
    """

    def __init__(self, pool: nn.Module) -> None:
        super().__init__()
        kind = next((k for k in POOLS if type(pool) in _EXACT[k]), None)
        if kind is None:
            raise SpikefuseError(
                f"SpikePool: pool must be AvgPool2d or MaxPool2d, got {type(pool).__name__}"
            )
        if getattr(pool, "return_indices", False):
            raise SpikefuseError("SpikePool: return_indices=True is not supported")
        self.pool = pool
        self.training = pool.training  # the mode of the pooling it replaces
        self._kind: type[nn.Module] = kind
        self._window = _window_size(pool)

    def _pool(self, merged: Tensor) -> Tensor:
        if self._window is not None and not torch.compiler.is_compiling():
            return WindowAvgPool.apply(merged, *self._window)
        return self._kind.forward(self.pool, merged)  # the compiler generates its own kernels

    def forward(self, x: Tensor) -> Tensor:
        if not isinstance(x, Tensor) or x.dim() != 5:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise SpikefuseError(f"SpikePool: expected input [T, B, C, H, W], got {shape}")
        merged = x.flatten(0, 1)
        if torch.compiler.is_compiling():
            return self._pool(merged).unflatten(0, x.shape[:2])
        recipe = recipe_of(merged)
        with saving_recomputed(merged, recipe):  # without a recipe: spikes packed, if spikes
            out = self._pool(merged)
        if recipe is not None:
            mark_recomputable(out, lambda: self._pool(recipe()))
        window = means_window(merged)  # 1: spikes; k²: means of k² spikes
        if window is not None and self._kind is nn.MaxPool2d:  # the largest: the same kind
            mark_means(out, window)
        elif window is not None and self._window is not None:  # means of k x k of them
            mark_means(out, window * self._window[0] * self._window[1])
        return out.unflatten(0, x.shape[:2])


def _weight_layout_after_load(block: FusedBlock, incompatible_keys: Any) -> None:
    block._weight_in_run_layout()


def match_optimizer_state(optimizer: torch.optim.Optimizer) -> int:
    """Lay each per-parameter optimizer buffer (momentum, Adam's moments, ...) out like its
    parameter; returns how many were copied.

    Fused Conv2d blocks keep their weights channels-last on CUDA. Optimizer state loaded from
    a checkpoint of the unfused model (``optimizer.load_state_dict`` keeps the saved layout),
    or made before ``fuse(model, inplace=True)``, is then laid out differently from its
    parameter: foreach optimizers fall back to their slow path and ``fused=True`` Adam/AdamW
    refuse the mix. Call this after loading. Values are unchanged."""
    copied = 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            for name, buffer in state.items():
                if (
                    isinstance(buffer, Tensor)
                    and buffer.shape == param.shape
                    and buffer.dim() > 1
                    and buffer.stride() != param.stride()
                ):
                    state[name] = torch.empty_like(param, dtype=buffer.dtype).copy_(buffer)
                    copied += 1
    return copied


class FusedConvBNNeuron(FusedBlock):
    """Conv2d → BatchNorm2d → neuron on ``[T, B, C_in, H, W]`` (``bn=False``: no BatchNorm).

    Conv arguments as ``nn.Conv2d``; ``bias`` defaults to ``not bn`` (BN's shift makes a conv
    bias redundant); ``node`` defaults to :func:`paper_lif`.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] | str = 0,
        dilation: int | tuple[int, int] = 1,
        groups: int = 1,
        bias: bool | None = None,
        bn: bool = True,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        node: BaseNode | None = None,
    ) -> None:
        bias = not bn if bias is None else bias
        conv = nn.Conv2d(
            in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias
        )
        norm = nn.BatchNorm2d(out_channels, eps, momentum) if bn else None
        super().__init__(conv, norm, paper_lif() if node is None else node)


class FusedLinearBNNeuron(FusedBlock):
    """Linear → BatchNorm1d → neuron on ``[T, B, F_in]`` (``bn=False``: no BatchNorm).

    ``bias`` defaults to ``not bn``; ``node`` defaults to :func:`paper_lif`.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool | None = None,
        bn: bool = True,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        node: BaseNode | None = None,
    ) -> None:
        linear = nn.Linear(in_features, out_features, bias=not bn if bias is None else bias)
        norm = nn.BatchNorm1d(out_features, eps, momentum) if bn else None
        super().__init__(linear, norm, paper_lif() if node is None else node)
