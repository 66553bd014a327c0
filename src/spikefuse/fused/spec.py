"""What a fused block is, fixed when it is made: :class:`BlockSpec` and its validation.

A block is ``synapse → [BatchNorm] [→ max pooling] → neuron [→ pooling] [+ residual]``;
:meth:`BlockSpec.of` checks every part once (the synapse's and BatchNorm's classes, the channel
counts, a neuron the kernels can run, poolings the block can take) and records what the block's
call paths read: the synapse's kind, the input rank, whether there is BatchNorm, the poolings'
kinds and windows, the residual. :func:`fuse` asks the same questions of a model's modules
through the helpers here (:func:`synapse_kind`, :func:`pool_fold_problem`,
:func:`input_pool_problem`).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.nn.modules.utils import _pair

from .. import layer
from ..errors import SpikefuseError
from ..neuron import BaseNode
from .ops.spike_max_pool.geometry import MaxPoolGeometry

# Why a pooling between the BatchNorm and the neuron keeps a chain unfused.
POOLS_NEURON_INPUT = "pools the neuron's input, not spikes"

SYNAPSES = (nn.Conv1d, nn.Conv2d, nn.Linear)
POOLS = (nn.AvgPool2d, nn.MaxPool2d)
# Windows (k x k) of the average pooling a Conv2d block folds in: the mean of 2 x 2 spikes is
# exact in every dtype, so folded and unfolded pooling give the same bits.
FOLDED_WINDOWS = (2,)
# The BatchNorm class that matches each synapse: channels are dim 1 of the merged [T*B, C, *].
BN_FOR = {nn.Conv1d: nn.BatchNorm1d, nn.Conv2d: nn.BatchNorm2d, nn.Linear: nn.BatchNorm1d}
# The rank of each synapse's multi-step input [T, B, C, *spatial].
INPUT_RANK: dict[type[nn.Module], int] = {nn.Conv1d: 4, nn.Conv2d: 5, nn.Linear: 3}
# Classes whose forward is exactly the torch layer's (plain or with spikefuse's step_mode); a
# subclass with its own forward is left unfused.
EXACT = {
    nn.Conv1d: (nn.Conv1d, layer.Conv1d),
    nn.Conv2d: (nn.Conv2d, layer.Conv2d),
    nn.Linear: (nn.Linear, layer.Linear),
    nn.BatchNorm1d: (nn.BatchNorm1d, layer.BatchNorm1d),
    nn.BatchNorm2d: (nn.BatchNorm2d, layer.BatchNorm2d),
    nn.AvgPool2d: (nn.AvgPool2d, layer.AvgPool2d),
    nn.MaxPool2d: (nn.MaxPool2d, layer.MaxPool2d),
}


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


def synapse_kind(module: nn.Module) -> type[nn.Module] | None:
    """The torch class (Conv1d, Conv2d, Linear) ``module`` runs exactly as, or None."""
    for base in SYNAPSES:
        if type(module) in EXACT[base]:
            return base
    return None


def window_size(pool: nn.Module) -> tuple[int, int] | None:
    """(k_h, k_w) if ``pool`` averages non-overlapping windows (kernel = stride, no padding,
    ceil_mode or divisor_override), else None."""
    if not isinstance(pool, nn.AvgPool2d):
        return None
    size, stride = _pair(pool.kernel_size), _pair(pool.stride or pool.kernel_size)
    plain = _pair(pool.padding) == (0, 0) and not pool.ceil_mode and pool.divisor_override is None
    return size if plain and size == stride else None


def pool_fold_problem(pool: nn.Module, kind: type[nn.Module]) -> str | None:
    """Why ``pool`` cannot be folded into a fused block of synapse ``kind``, or None."""
    if kind is not nn.Conv2d:
        return f"only Conv2d blocks pool, not {kind.__name__} blocks"
    if type(pool) not in EXACT[nn.AvgPool2d]:
        return f"{type(pool).__name__} is not an AvgPool2d; only average pooling folds"
    window = window_size(pool)
    if window is None:
        return "its kernel differs from its stride, or it pads, uses ceil_mode or divisor_override"
    if window[0] != window[1] or window[0] not in FOLDED_WINDOWS:
        return (
            f"its windows are {window[0]}x{window[1]}; only 2x2 windows fold (their mean is "
            "exact in every dtype)"
        )
    return None


def input_pool_problem(pool: nn.Module, kind: type[nn.Module], has_bn: bool) -> str | None:
    """Why ``pool``, between a block's BatchNorm and its neuron (a max pooling of the neuron's
    input), cannot join a block of synapse ``kind``, or None."""
    if kind is not nn.Conv2d:
        return f"only Conv2d blocks pool the neuron's input, not {kind.__name__} blocks"
    if not has_bn:
        return "only a block with BatchNorm pools the neuron's input"
    if type(pool) not in EXACT[nn.MaxPool2d] or pool.return_indices:
        return (
            f"{type(pool).__name__} {POOLS_NEURON_INPUT}; of the poolings before a neuron, "
            "only max pooling without return_indices joins a block"
        )
    try:
        input_pool_geometry(pool)
    except SpikefuseError as error:
        return str(error).removeprefix("spike_max_pool2d: ")
    return None


def input_pool_geometry(pool: nn.Module) -> MaxPoolGeometry:
    """The windows of a max pooling of a block's BN output (raises for what max_pool2d refuses
    and windows of more than 256 elements)."""
    return MaxPoolGeometry.of(
        pool.kernel_size, pool.stride, pool.padding, pool.dilation, pool.ceil_mode
    )


@dataclass(frozen=True)
class PoolSpec:
    """The pooling a block folds in: its ``kind`` ("avg": the mean of each window) over
    ``window`` x ``window`` windows with stride ``window``."""

    kind: str
    window: int

    @property
    def area(self) -> int:
        """Spikes per output value (k²)."""
        return self.window * self.window

    @property
    def means_window(self) -> int:
        """What the pooled output is tagged as (:func:`~.recompute.mark_means`): the means of
        k² spikes each."""
        return self.area


def _check_bn(bn: nn.Module, synapse: nn.Module, kind: type[nn.Module]) -> None:
    expected = BN_FOR[kind]
    if type(bn) not in EXACT[expected]:
        raise SpikefuseError(
            f"FusedBlock: a {kind.__name__} needs {expected.__name__}, got {type(bn).__name__}"
        )
    channels = synapse.out_channels if kind is not nn.Linear else synapse.out_features
    if bn.num_features != channels:
        raise SpikefuseError(
            f"FusedBlock: BatchNorm has {bn.num_features} features, the {kind.__name__} "
            f"produces {channels} channels"
        )


def _check_node(node: object) -> None:
    if not isinstance(node, BaseNode):
        raise SpikefuseError(
            f"FusedBlock: node must be a spikefuse neuron, got {type(node).__name__}"
        )
    # A neuron's own torch code would be bypassed by the kernels.
    overridden = node._overridden_forward
    own_code = node.torch_code or (f"it overrides {'/'.join(overridden)}" if overridden else None)
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
        raise SpikefuseError("FusedBlock: store_v_seq=True needs V, which fused blocks never keep")


def _input_pool(
    pool: nn.Module, kind: type[nn.Module], bn: object, folded: PoolSpec | None, residual: object
) -> MaxPoolGeometry:
    """The checked windows of a block's max pooling of its neuron's input."""
    problem = input_pool_problem(pool, kind, bn is not None)
    if problem is None and (folded is not None or residual):
        problem = (
            "a block that pools its neuron's input neither pools its spikes nor adds a residual"
        )
    if problem is not None:
        raise SpikefuseError(f"FusedBlock: the input pooling cannot join the block: {problem}")
    return input_pool_geometry(pool)


@dataclass(frozen=True)
class BlockSpec:
    """A fused block's fixed shape: built once by :meth:`of`, which validates the parts.

    ``kind``: the synapse's torch class; ``input_rank``: the rank of its multi-step input
    [T, B, C, *] as the block's paths run it; ``has_bn``: whether BatchNorm normalises the
    synapse output; ``pool``: the folded pooling (None: none); ``residual``: the block adds a
    shortcut before the neuron; ``tokens``: a Linear block on tokens [T, B, N, F] whose
    BatchNorm1d normalises each feature over all T·B·N tokens (the unfused
    ``bn(linear(x).transpose(-1, -2)).transpose(-1, -2)``): the paths run it on [T, B·N, F];
    ``input_pool``: the windows of a max pooling of the BN output before the neuron (None: none).
    """

    kind: type[nn.Module]
    input_rank: int
    has_bn: bool
    pool: PoolSpec | None
    residual: bool
    tokens: bool = False
    input_pool: MaxPoolGeometry | None = None

    @classmethod
    def of(
        cls,
        synapse: nn.Module,
        bn: nn.Module | None,
        node: object,
        pool: nn.Module | None,
        residual: object,
        tokens: object = False,
        input_pool: nn.Module | None = None,
    ) -> BlockSpec:
        """The spec of a block of these parts; raises :class:`SpikefuseError` naming the first
        part a fused block cannot take."""
        for name, flag in (("residual", residual), ("tokens", tokens)):
            if not isinstance(flag, bool):
                raise SpikefuseError(f"FusedBlock: {name} must be a bool, got {flag!r}")
        kind = synapse_kind(synapse)
        if kind is None:
            raise SpikefuseError(
                "FusedBlock: synapse must be a Conv1d, Conv2d or Linear, got "
                f"{type(synapse).__name__}"
            )
        if tokens and (kind is not nn.Linear or residual):
            raise SpikefuseError(
                "FusedBlock: tokens=True takes a Linear synapse and no residual, got a "
                f"{kind.__name__}" + (" with a residual" if residual else "")
            )
        if bn is not None:
            _check_bn(bn, synapse, kind)
        _check_node(node)
        folded = None
        if pool is not None:
            problem = pool_fold_problem(pool, kind)
            if problem is not None:
                raise SpikefuseError(f"FusedBlock: the pooling cannot be folded in: {problem}")
            folded = PoolSpec("avg", _pair(pool.kernel_size)[0])
        pooled = None if input_pool is None else _input_pool(input_pool, kind, bn, folded, residual)
        return cls(
            kind, INPUT_RANK[kind], bn is not None, folded, bool(residual), bool(tokens), pooled
        )

    @property
    def window(self) -> int:
        """k of the block's k x k pooling (1: none)."""
        return 1 if self.pool is None else self.pool.window
