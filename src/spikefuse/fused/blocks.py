"""Fused Conv/Linear → BatchNorm → neuron modules (:func:`fuse`: the ``convert`` package).

:class:`FusedBlock` holds its parts and a :class:`~.spec.BlockSpec` built once; its forward
checks the call, asks its memory policy (:mod:`.memory`) for a plan and runs that plan's path
(:mod:`.paths`), which calls the fused op (:mod:`.ops.bn_neuron`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar, overload

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.conv import _ConvNd

from .. import surrogate
from ..backends import compute_dtype
from ..errors import SpikefuseError
from ..functional import repeated_over_time
from ..neuron import BaseNode, LIFNode
from .memory import MemoryPolicy, memory_modes, memory_policy
from .neuron_call import NeuronCall
from .paths import DEFAULT_PLAN, TRACED_PLAN
from .pooling import SpikePool, WindowAvgPool
from .recompute import same_kind
from .spec import BlockSpec, MultiStepOnly, hook_kinds
from .statistics import BNSpec, BNStats, bn_statistics, is_distributed, refuse_join
from .synapse import Synapse

# Models pickled whole name the pooling classes by this module's path.
_PICKLED = (SpikePool, WindowAvgPool)

#: The memory modes a block takes (read by the training command line; the registry is
#: :func:`~.memory.memory_modes`).
MEMORY_MODES = memory_modes()


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


def _broadcasts(shape: torch.Size, target: torch.Size) -> bool:
    """Whether a tensor of ``shape`` (not ``target`` itself) broadcasts to ``target``."""
    if shape == target or len(shape) > len(target):
        return False
    trailing = target[len(target) - len(shape) :]
    return all(size in (1, want) for size, want in zip(shape, trailing, strict=True))


Child = TypeVar("Child")


# a block's submodules, registered under these names
_ROLES = ("synapse", "bn", "node", "pool", "input_pool")


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
    tokens ``[T, B, *, F_in]`` without BatchNorm and ``[T, B, N, F_in]`` with ``tokens=True``,
    whose token dims join B); output
    spikes ``[T, B, C_out, *]`` in the input's dtype (bf16 under bf16 autocast). The synapse runs
    once on the merged ``[T*B, ...]`` batch. BatchNorm normalises each channel over
    (T, B, spatial) — batch statistics in training (synchronised across processes when
    torch.distributed is initialised), running statistics in eval — exactly like the unfused
    ``layer.BatchNorm2d(step_mode='m')``. The neuron is any one-state :class:`BaseNode`; it runs
    from its reset state on every call, so each call is an independent sequence and the node's
    ``.v`` is neither read nor written.

    Memory (the default mode): backward keeps the synapse output (a stem: its input, see
    :class:`~spikefuse.fused.memory.DefaultMemory`) and per-channel vectors; BN output, membrane
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
    with torch ops (:class:`~.pooling.WindowAvgPool`): the same values either way.

    Args:
        synapse: ``nn.Conv1d``/``nn.Conv2d``/``nn.Linear`` (or spikefuse ``layer`` versions).
        bn: the matching ``BatchNorm1d``/``BatchNorm2d``, or None for no normalisation.
        node: the neuron (e.g. :func:`paper_lif`).
        process_group: the group BN synchronises over (None: the default group).
        memory: ``"default"`` keeps the synapse output y for backward (the DATE'22 blocks;
            a stem, where recomputing y is nearly free, keeps only its input: see
            :class:`~spikefuse.fused.memory.DefaultMemory`);
            ``"min"`` keeps only the block's input, 1-bit packed when it is the spike output
            of another fused block, and recomputes y in backward (one more synapse forward per
            block; the same gradients; see :mod:`spikefuse.fused.low_memory`); ``"auto"``
            chooses between the two on every training call: "min" where recomputing costs
            at most :data:`~spikefuse.fused.memory.AUTO_MAX_MACS_PER_SAVED_ELEMENT`
            multiply-adds per element of memory saved. ``memory_choice`` holds the last
            call's choice. Any mode registered in :mod:`spikefuse.fused.memory`.
        pool: an ``nn.AvgPool2d`` (or ``layer.AvgPool2d``) averaging 2 x 2 windows with kernel =
            stride, no padding, ceil_mode or divisor_override, applied to the spikes; or None.
        residual: the block adds a residual to the BatchNorm output before the neuron (Spiking
            ResNet's ``sn2(bn2(conv2(x)) + shortcut)``): it is called as ``block(x, shortcut)``,
            with ``shortcut`` shaped like the synapse output ``[T, B, C_out, *]``.
        tokens: a Linear block on tokens ``[T, B, N, F_in]`` (a spiking transformer's
            ``[T, B, N, C]`` layout) whose BatchNorm1d normalises each output feature over all
            tokens, as the unfused ``sn(bn(linear(x).transpose(-1, -2)).transpose(-1, -2))``
            does (``bn`` multi-step on ``[T, B, F_out, N]``); output ``[T, B, N, F_out]``.
        input_pool: an ``nn.MaxPool2d`` of the BatchNorm output before the neuron (Spikformer's
            stem; Conv2d blocks with BatchNorm, no ``pool`` or residual): the neuron runs on
            the pooled map only, and backward keeps no more than without it.

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
    # The parts whose place in the user's model a FusedAway holds (set by fuse; see train()).
    placeholder_roles: frozenset[str] = frozenset()
    synapse = _Submodule["nn.Linear | _ConvNd"]()
    bn = _Submodule["nn.modules.batchnorm._BatchNorm | None"]()
    node = _Submodule[BaseNode]()
    pool = _Submodule["nn.AvgPool2d | None"]()
    input_pool = _Submodule["nn.MaxPool2d | None"]()

    def __init__(
        self,
        synapse: nn.Module,
        bn: nn.modules.batchnorm._BatchNorm | None,
        node: BaseNode,
        process_group: dist.ProcessGroup | None = None,
        memory: str = "default",
        pool: nn.Module | None = None,
        residual: bool = False,
        tokens: bool = False,
        input_pool: nn.Module | None = None,
    ) -> None:
        super().__init__()
        policy = memory_policy(memory)
        spec = BlockSpec.of(synapse, bn, node, pool, residual, tokens, input_pool)
        assert isinstance(synapse, (nn.Linear, _ConvNd))  # what BlockSpec.of accepts
        # registered even where None, so that the class's _Submodule reads find them
        self.register_module("synapse", synapse)
        self.register_module("bn", bn)
        self.register_module("node", node)
        # the mode of what it replaces (an eval model's blocks stay in eval); not train(),
        # which would also set the BatchNorm (one frozen with bn.eval() stays frozen)
        self.training = synapse.training
        self.register_module("pool", pool)  # BlockSpec.of checked them
        self.register_module("input_pool", input_pool)
        self.spec = spec
        # made here, not on the first call: a call under torch.compile writes no module state
        self._synapse_op = Synapse(synapse, spec.kind)
        self.process_group = process_group
        self._memory, self._policy = memory, policy
        self.residual = residual
        self._weight_in_run_layout()
        # load_state_dict(assign=True) replaces the weight without _apply (a module-level
        # function: the hook is pickled with the block)
        self.register_load_state_dict_post_hook(_weight_layout_after_load)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickles blocks pickled before the spec, the memory policies or the input pooling
        existed too."""
        super().__setstate__(state)
        self._modules.setdefault("input_pool", None)
        if "spec" in self.__dict__:
            # a new policy of the same mode: another version's may lack fields (its caches
            # refill on the next call)
            self.memory = self._memory
            return
        synapse, bn, node = self.synapse, self.bn, self.node
        residual = state.get("residual", False)
        self.spec = BlockSpec.of(synapse, bn, node, self._modules.get("pool"), residual)
        self._synapse_op = Synapse(synapse, self.spec.kind)
        self.memory = self.__dict__.pop("memory", "default")
        for stale in ("_kind", "_window", "memory_choice", "_recompute_terms_of"):
            self.__dict__.pop(stale, None)

    @property
    def memory(self) -> str:
        """The memory mode (:mod:`.memory`); setting it gives the block that mode's policy."""
        return self._memory

    @memory.setter
    def memory(self, memory: str) -> None:
        self._policy, self._memory = memory_policy(memory), memory

    @property
    def memory_policy(self) -> MemoryPolicy:
        """This block's policy of its memory mode (:mod:`.memory`)."""
        return self._policy

    @property
    def memory_choice(self) -> str:
        """The mode of the last training call: ``memory`` itself, what "auto" chose, or "min"
        where the default mode recomputed a stem."""
        return self._policy.choice

    def train(self, mode: bool = True) -> FusedBlock:
        """Sets the block's mode and its parts', except the parts that stand in the user's
        model as a :class:`FusedAway` of their own (:attr:`placeholder_roles`): those follow
        their placeholder's ``train()``, so that ``model.conv1.eval()`` leaves the BatchNorm
        training, as it did unfused."""
        if not isinstance(mode, bool):
            raise ValueError("training mode is expected to be boolean")  # torch's check
        self.training = mode
        for name, child in self.named_children():
            if name not in self.placeholder_roles:
                child.train(mode)
        return self

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> FusedBlock:
        """``.to()``, ``.cuda()``, ...; then the weight's layout (:meth:`_weight_in_run_layout`)."""
        super()._apply(fn, recurse)
        self._weight_in_run_layout()
        return self

    def _weight_in_run_layout(self) -> None:
        """A Conv2d on CUDA keeps its weight channels-last, the layout it runs in (see
        :meth:`Synapse.runs_channels_last`): cuDNN would otherwise copy the weight into that layout on
        every forward and backward, and its gradient back. Done when the block is made or
        moved, before an optimizer or DistributedDataParallel sees the parameter (DDP's
        gradient buckets follow the parameters' layout); the values are unchanged. Optimizer
        state made for the other layout (loaded from an unfused model's checkpoint, or made
        before ``fuse(model, inplace=True)``): see :func:`~.synapse.match_optimizer_state`. A
        parametrized weight (e.g. weight norm) or a tensor subclass is left as it is."""
        weight = self.synapse.weight
        plain = isinstance(weight, nn.Parameter) and type(weight.data) is torch.Tensor
        if self.spec.kind is not nn.Conv2d or not weight.is_cuda or not plain:
            return
        layout = torch.channels_last
        if not weight.is_contiguous(memory_format=layout):
            weight.data = weight.data.contiguous(memory_format=layout)
        if weight.grad is not None and not weight.grad.is_contiguous(memory_format=layout):
            weight.grad = weight.grad.contiguous(memory_format=layout)

    def _check_input(self, x: Tensor) -> None:
        if not isinstance(x, Tensor):
            raise SpikefuseError(f"FusedBlock: input must be a tensor, got {type(x).__name__}")
        kind, rank = self.spec.kind, self.spec.input_rank
        if x.dim() != rank:
            expected = "[T, B, F]" if kind is nn.Linear else "[T, B, C, ...]"
            tokens = kind is nn.Linear and x.dim() > rank  # a BatchNorm1d would take N as C
            raise SpikefuseError(
                f"FusedBlock({kind.__name__}): expected input {expected} of rank {rank}, "
                f"got shape {tuple(x.shape)}"
                + (
                    "; a Linear block with BatchNorm1d takes [T, B, F] only (on [T, B, N, F] "
                    "BatchNorm1d normalises dim N as its channels), or tokens [T, B, N, F] when "
                    "made with tokens=True (BatchNorm1d over F: the unfused "
                    "bn(linear(x).transpose(-1, -2)).transpose(-1, -2))"
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

    def checked_residual(self, residual: Tensor | None, y: Tensor) -> Tensor | None:
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

    def synapse_op(self) -> Synapse:
        """The synapse as the call paths and Functions run it (:class:`~.synapse.Synapse`)."""
        op, module = self._synapse_op, self._modules["synapse"]
        if op.module is not module:  # the synapse was replaced since
            op = self._synapse_op = Synapse(module, self.spec.kind)  # type: ignore[arg-type]
        return op

    def repeat_of(self, x: Tensor) -> int:
        """T where the block keeps one step of its synapse output for an input repeated over
        time (with BatchNorm: the BN-folded kernels read one step; a plain neuron would copy
        it), else 1."""
        return x.shape[0] if self.bn is not None and repeated_over_time(x) else 1

    def prepare(
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
        self.check_anomaly(y)
        learnable = self.node.learnable_values(y.device, compute_dtype(y.dtype))
        bn = self._bn_spec()
        return neuron, learnable, bn, None if bn is None or not statistics else bn_statistics(y, bn)

    def check_anomaly(self, y: Tensor) -> None:
        """The node's NaN check of its input (a host sync: eager anomaly mode only)."""
        if not torch.compiler.is_compiling() and torch.is_anomaly_enabled():
            self.node._check_no_nan(y, None)

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
        spec = self.spec
        if spec.kind is nn.Linear and isinstance(x, Tensor) and residual is None:
            if spec.tokens and x.dim() != 4:
                raise SpikefuseError(
                    f"FusedBlock(Linear, tokens=True): expected tokens [T, B, N, F], got shape "
                    f"{tuple(x.shape)}"
                )
            if x.dim() > 3 and (self.bn is None or spec.tokens):
                # tokens [T, B, *, F]: the Linear and the neuron act on each token alike, and
                # BatchNorm (tokens=True) normalises F over all of them: they join the batch
                return _tokens_joined(self._run, x)
        return self._run(x, residual)

    def _run(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
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
            plan = TRACED_PLAN
        elif torch.is_grad_enabled():
            plan = self._policy.plan(self, x, residual)
        else:
            plan = DEFAULT_PLAN
        return plan.path(self, x, residual, plan)


def _tokens_joined(run: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """``run`` on tokens [T, B, *N, F] as [T, B·N, F], its output split back to [T, B, *N, F']
    (both views tagged as what their tensor holds: spikes stay packable and bf16-exact)."""
    out = run(same_kind(x, x.flatten(1, -2)))
    return same_kind(out, out.unflatten(1, x.shape[1:-1]))


def _weight_layout_after_load(block: FusedBlock, incompatible_keys: Any) -> None:
    block._weight_in_run_layout()


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
