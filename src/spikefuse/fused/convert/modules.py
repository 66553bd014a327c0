"""Recognising modules: which are synapses, BatchNorms, neurons and poolings a fused block
takes (and why one is not), as :mod:`.find` meets them in a traced graph."""

from __future__ import annotations

from typing import TypeGuard

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.utils import parametrize

from ... import layer
from ...neuron import BaseNode
from ..spec import BN_FOR, EXACT, POOLS, SYNAPSES, synapse_kind


def _multi_step(module: nn.Module) -> bool:
    # Plain torch layers have no step_mode; only Linear accepts [T, B, F] as it is.
    mode = getattr(module, "step_mode", None)
    return mode == "m" or (mode is None and type(module) is nn.Linear)


def _as_synapse_bn(module: nn.Module) -> tuple[nn.Module, _BatchNorm | None] | None:
    """(synapse, bn or None) if ``module`` applies a synapse (then BN) to [T, B, ...] input."""
    if type(module) is layer.SeqToANNContainer and len(module) in (1, 2, 3):
        synapse, *rest = module
        if synapse_kind(synapse) is None or getattr(synapse, "step_mode", "s") != "s":
            return None
        if not rest:
            return synapse, None
        if len(rest) == 2 and _contained_pool(module) is None:
            return None
        bn = rest[0]
        return (synapse, bn) if _is_bn_for(bn, synapse, step_mode="s") else None
    if synapse_kind(module) is not None and _multi_step(module):
        return module, None
    return None


def _contained_pool(module: nn.Module) -> nn.Module | None:
    """The pooling of ``SeqToANNContainer(synapse, BatchNorm, pooling)`` (Spikformer's stem),
    which pools BatchNorm's output: the neuron's input. Else None."""
    if type(module) is not layer.SeqToANNContainer or len(module) != 3:
        return None
    pool = module[2]
    return pool if isinstance(pool, POOLS) and getattr(pool, "step_mode", "s") == "s" else None


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
        return (
            "the SeqToANNContainer holds more than the synapse, its matching BatchNorm and a "
            "pooling of BatchNorm's output"
        )
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
