"""Memory modes of the fused blocks: one policy class each, in a registry.

A block holds one policy (its ``memory`` setting, :func:`memory_policy`); on every training call
:meth:`MemoryPolicy.plan` picks the call path (:mod:`.paths`). ``fuse(memory=...)``, the
training command line, the benchmark and NIR read the modes from :func:`memory_modes`, so a new
mode is one class here, registered with :func:`register_memory`.

- ``"default"``: keep the synapse output y (the DATE'22 blocks), except in a stem, where
  recomputing y is nearly free (:class:`DefaultMemory`);
- ``"min"``: keep only the block's input and recompute y in backward, in batch chunks where y
  is large (:mod:`.chunked`);
- ``"auto"``: "min" where recomputing costs at most :data:`AUTO_MAX_MACS_PER_SAVED_ELEMENT`
  multiply-adds per element of memory it saves, else "default".
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import torch
from torch import Tensor

from ..errors import SpikefuseError
from ..functional import repeated_over_time
from .chunked import batch_chunks, batch_parts
from .paths import DEFAULT_PLAN, MIN_MEMORY_PLAN, Block, Plan, chunked_path
from .recompute import is_spikes, recipe_of

# memory="auto": a block recomputes its synapse in backward (as memory="min") where that costs
# at most this many multiply-adds per element of memory it saves. Recomputing adds one synapse
# forward, a third of the synapse's training work whatever its size, so the rule drops the
# outputs that save the most memory per recomputed multiply-add: roughly, a 3 x 3 convolution
# qualifies up to 227 input channels, a Linear up to 2048 inputs (the narrow early layers go,
# the wide deep ones whose recomputation costs the most stay).
AUTO_MAX_MACS_PER_SAVED_ELEMENT = 2048
# memory="default": a stem recomputes its synapse in backward where that costs at most this many
# multiply-adds per byte of memory it saves. Convolutions of 3-channel images run far below the
# tensor cores' peak: on an H100, recomputing the medium DATE'22 network's first 3 x 3
# convolution on RGB (27 multiply-adds an element) for 640 images of 32 x 32 took 0.2 ms of a
# 13.5 ms float32 step and saved 314 MiB (7 a byte: recomputes); in bf16, 0.37 ms of 6.9 ms for
# 150 MiB (14 a byte: keeps y). A ResNet's 7 x 7 RGB stem (147 an element, 37 a float32 byte)
# keeps y.
DEFAULT_MAX_MACS_PER_SAVED_BYTE = 8
# ... and where it saves at least this many bytes: below, the memory is not worth the
# recomputation's host work and launches.
DEFAULT_RECOMPUTE_MIN_BYTES = 32 << 20
log = logging.getLogger("spikefuse.fuse")

_POLICIES: dict[str, type[MemoryPolicy]] = {}


def register_memory(cls: type[MemoryPolicy]) -> type[MemoryPolicy]:
    """Class decorator: make ``cls`` the policy of memory mode ``cls.name``."""
    _POLICIES[cls.name] = cls
    return cls


def memory_modes() -> tuple[str, ...]:
    """The registered memory modes ("default" first)."""
    return tuple(_POLICIES)


def memory_policy(name: object) -> MemoryPolicy:
    """A new policy of memory mode ``name`` (one per block: it may remember its choices)."""
    policy = _POLICIES.get(name) if isinstance(name, str) else None
    if policy is None:
        raise SpikefuseError(f"FusedBlock: memory must be one of {memory_modes()}, got {name!r}")
    return policy()


class MemoryPolicy:
    """A memory mode: which path a training call of a block takes (:mod:`.paths`)."""

    name: ClassVar[str]

    @property
    def choice(self) -> str:
        """The mode of the last training call (itself, or what a choosing mode chose)."""
        return self.name

    def plan(self, block: Block, x: Tensor, residual: Tensor | None) -> Plan:
        """The plan of a training call (autograd on) of ``block`` on ``x``."""
        raise NotImplementedError


class RecomputeTerms:
    """:func:`recompute_terms` of a block by what they depend on in the input, so that a
    training call does not redo the arithmetic."""

    def __init__(self) -> None:
        self._of: dict[tuple[Any, ...], tuple[float, float]] = {}

    def __call__(self, block: Block, x: Tensor, recipe: bool) -> tuple[float, float]:
        """The terms of x (``recipe``: :func:`has_recipe` of x, which the caller asked)."""
        key = (x.shape, x.dtype, repeated_over_time(x), recipe, is_spikes(x))
        terms = self._of.get(key)
        if terms is None:
            terms = self._of[key] = recompute_terms(block, x, recipe)
        return terms


@register_memory
class DefaultMemory(MemoryPolicy):
    """Keep the synapse output y and the per-channel vectors for backward; a stem recomputes y
    as memory="min" does, unchunked. A stem here: its input is kept for the weight gradient in
    both modes (no recipe: images, an unfused layer's output; not a fused block's spikes, which
    this mode recomputes), recomputing costs at most
    :data:`DEFAULT_MAX_MACS_PER_SAVED_BYTE` multiply-adds per byte saved, and saves at
    least :data:`DEFAULT_RECOMPUTE_MIN_BYTES`. Its backward then runs at the end of the
    network's, after the other blocks' kept outputs are freed, so the recomputed y does not
    add to the peak."""

    name = "default"

    def __init__(self) -> None:
        self._terms = RecomputeTerms()
        self._choice = "default"

    @property
    def choice(self) -> str:
        """ "min" where the last training call recomputed a stem, else "default"."""
        return self._choice

    def plan(self, block: Block, x: Tensor, residual: Tensor | None) -> Plan:
        stem = self._is_stem(block, x)
        self._choice = "min" if stem else "default"
        return MIN_MEMORY_PLAN if stem else DEFAULT_PLAN

    def _is_stem(self, block: Block, x: Tensor) -> bool:
        if has_recipe(x):
            return False
        cost, saved = self._terms(block, x, False)
        saved_bytes = saved * stored_itemsize(x)
        if saved_bytes < DEFAULT_RECOMPUTE_MIN_BYTES:
            return False
        if cost > DEFAULT_MAX_MACS_PER_SAVED_BYTE * saved_bytes:
            return False
        # no synapse gradient (a frozen network run with grad on): the default path saves
        # nothing for a frozen block, where the minimal one would still keep its input
        return x.requires_grad or any(p.requires_grad for p in block.synapse_op().params())


def has_recipe(x: Tensor) -> bool:
    """Whether x [T, B, ...] is a fused block's output the default mode recomputes (asked of x
    itself: flattening an input repeated over time by ``expand`` would copy it)."""
    return recipe_of(x) is not None


def stored_itemsize(x: Tensor) -> int:
    """Bytes per element of a synapse output on x: autocast's dtype where it is on."""
    device = x.device.type
    autocast = torch.is_autocast_enabled(device)
    return (torch.get_autocast_dtype(device) if autocast else x.dtype).itemsize


@register_memory
class MinMemory(MemoryPolicy):
    """Keep only the input (1-bit packed where it is spikes) and recompute y in backward; in
    equal batch chunks where y is large (blocks with BatchNorm whose synapse backward is
    explicit, on an input not repeated over time, without a residual or a pooling of the
    neuron's input)."""

    name = "min"

    def plan(self, block: Block, x: Tensor, residual: Tensor | None) -> Plan:
        chunks = self._chunks(block, x, residual)
        if chunks > 1:
            return Plan(chunked_path, tuple(batch_parts(x.shape[1], chunks)))
        return MIN_MEMORY_PLAN

    @staticmethod
    def _chunks(block: Block, x: Tensor, residual: Tensor | None) -> int:
        spec = block.spec
        if not spec.has_bn or spec.input_pool or block.repeat_of(x) > 1 or residual is not None:
            return 1
        synapse = block.synapse_op()
        if not synapse.explicit_backward():
            return 1
        per_step, _ = synapse.geometry(x.shape[1:])
        return batch_chunks(x.shape[1], per_step * x.shape[0] * stored_itemsize(x))


@register_memory
class AutoMemory(MemoryPolicy):
    """ "min" (never in chunks: the rule prices recomputing at one synapse forward, chunks take
    three) where it pays, else "default"; logs (logger ``spikefuse.fuse``, INFO) when its
    choice changes."""

    name = "auto"

    def __init__(self) -> None:
        self._choice = "auto"
        self._terms = RecomputeTerms()

    @property
    def choice(self) -> str:
        return self._choice

    def plan(self, block: Block, x: Tensor, residual: Tensor | None) -> Plan:
        cost, saved = self._terms(block, x, has_recipe(x))
        pays = saved > 0 and cost <= AUTO_MAX_MACS_PER_SAVED_ELEMENT * saved
        choice = "min" if pays else "default"
        if choice != self._choice:
            log.info("FusedBlock(memory='auto', %r): %s", block.synapse_op().module, choice)
            self._choice = choice
        return MIN_MEMORY_PLAN if pays else DEFAULT_PLAN


def recompute_terms(block: Block, x: Tensor, recipe: bool) -> tuple[float, float]:
    """(multiply-adds, elements of memory saved) of recomputing the synapse on ``x``
    (``recipe``: whether x has one, :func:`has_recipe`); it pays at up to
    :data:`AUTO_MAX_MACS_PER_SAVED_ELEMENT` multiply-adds per element.

    Saved: the synapse output the default mode keeps (one step of it for an input repeated
    over time), less what the minimal mode makes the network keep and the default mode does
    not: the block's input where the default mode recomputes it (fused-block spikes), and the
    block's output, which then has no recipe, so the next layer keeps it (its spikes packed, a
    pooled map whole). Packed spikes count 1 bit per element. Cost: one synapse forward on the
    steps it runs on. Where the pooling kernels pack their means (CUDA), both modes keep those
    bits instead, so the two pooled-map terms over-count what "min" adds: the rule then leans
    to the default mode. Spikes under :data:`~.recompute.RECOMPUTE_MIN_BYTES` are saved whole
    rather than recomputed or packed, which the terms do not model: a difference of at most a
    few MiB a block."""
    images = repeated_over_time(x)  # kept by the caller in either mode
    T = x.shape[0]
    steps = 1 if images else T
    kept_steps = 1 if block.repeat_of(x) > 1 else T
    per_step, fan_in = block.synapse_op().geometry(x.shape[1:])
    packed = 1 / (8 * x.element_size())  # elements per packed spike
    out = per_step * T
    pool = block.spec.pool
    saved = per_step * kept_steps - (out / pool.area if pool is not None else out * packed)
    if not images and recipe:  # min keeps, default not
        saved -= x.numel() * (packed if is_spikes(x) else 1)
    return per_step * steps * fan_in, saved
