"""SpikingJelly 2.0's ``memopt.optimize_memory``, mapped onto spikefuse's memory modes.

SpikingJelly lowers training memory in place by wrapping ``targets`` modules in gradient
checkpoints (level 1), splitting them in space (2) and time (3) and greedily unwrapping (4),
probing with ``example_forward`` and compressing binary inputs (``compress``). spikefuse reaches
the same end through :func:`spikefuse.fuse`: every multi-step Conv/Linear → BatchNorm → neuron
chain becomes a fused block whose ``memory`` mode decides what it keeps for backward:

* ``level=0``: nothing changes (as in SpikingJelly);
* ``level >= 1`` with ``compress=True`` (the default) or ``level >= 2``: ``memory='min'``
  (blocks keep only their input, 1-bit packed when it is spikes, and recompute: checkpointing
  with spike compression);
* ``level=1`` with ``compress=False``: ``memory='auto'`` (each block recomputes where that
  pays, else keeps its output).

The model is fused in place and returned (as SpikingJelly returns the same object). What was
done is logged (logger ``spikefuse.memopt``, INFO) and, with the extension
``return_summary=True``, returned as a :class:`MemOptSummary`, including what does not apply:
``targets`` (spikefuse fuses every chain, whatever its classes), ``example_forward`` (nothing is
probed; it is required for ``level > 0`` and checked to be callable, as there, but not run),
``split_fn``, ``can_chunk``. Only multi-step models (``step_mode='m'``) have chains to fuse.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn

from .errors import SpikefuseError
from .fused import FuseReport, fuse

__all__ = ["MemOptSummary", "optimize_memory"]

log = logging.getLogger("spikefuse.memopt")
LEVELS = (0, 1, 2, 3, 4)
CHECKPOINT_BUDGETS = ("speed", "balanced", "memory")


@dataclass(frozen=True)
class MemOptSummary:
    """What :func:`optimize_memory` did: the ``level``, the spikefuse ``memory`` mode (None:
    nothing changed), the :class:`~spikefuse.fused.FuseReport` and ``notes``."""

    level: int
    memory: str | None
    report: FuseReport | None
    notes: tuple[str, ...]

    def __str__(self) -> str:
        head = f"optimize_memory: level {self.level} -> "
        head += "unchanged" if self.memory is None else f"spikefuse.fuse(memory={self.memory!r})"
        lines = [head, *(f"  {note}" for note in self.notes)]
        if self.report is not None:
            lines.append(str(self.report))
        return "\n".join(lines)


def _check(model: Any, targets: Any, example_forward: Any, level: Any, budget: Any) -> None:
    """SpikingJelly's argument checks (ValueError: SpikefuseError is one)."""
    if not isinstance(model, nn.Module):
        raise SpikefuseError(f"model must be an nn.Module, got {type(model).__name__}")
    kinds = targets if isinstance(targets, tuple) else (targets,)
    if not kinds or not all(isinstance(k, type) for k in kinds):
        raise SpikefuseError(f"targets must be a class or a tuple of classes, got {targets!r}")
    if isinstance(level, bool) or level not in LEVELS:
        raise SpikefuseError(f"level must be one of 0, 1, 2, 3, 4; got {level!r}")
    if budget not in CHECKPOINT_BUDGETS:
        raise SpikefuseError(
            f"checkpoint_budget must be one of {CHECKPOINT_BUDGETS}, got {budget!r}"
        )
    if level and not callable(example_forward):
        raise SpikefuseError("example_forward is required when level > 0 (a callable of the model)")
    if level and isinstance(model, kinds):
        raise SpikefuseError("optimize_memory cannot replace the root model in place")


def optimize_memory(
    model: nn.Module,
    targets: type | tuple[type, ...],
    example_forward: Callable[[nn.Module], object] | None = None,
    *,
    level: int,
    checkpoint_budget: str = "memory",
    compress: bool = True,
    split_fn: Callable[[nn.Module], Any] | None = None,
    can_chunk: Callable[[nn.Module], bool] | None = None,
    process_group: dist.ProcessGroup | None = None,
    return_summary: bool = False,
) -> nn.Module | tuple[nn.Module, MemOptSummary]:
    """Lower ``model``'s training memory with spikefuse's memory modes (see the module docs);
    returns ``model`` itself, fused in place (with a :class:`MemOptSummary` if
    ``return_summary``)."""
    _check(model, targets, example_forward, level, checkpoint_budget)
    if process_group is not None and not dist.is_initialized():
        raise RuntimeError("process_group requires initialized torch.distributed.")
    if level == 0:
        summary = MemOptSummary(0, None, None, ("level 0: the model is unchanged",))
    else:
        notes = [
            "targets do not select layers: spikefuse fuses every chain it finds",
            "example_forward is not run: nothing is probed",
        ]
        ignored = [n for n, v in (("split_fn", split_fn), ("can_chunk", can_chunk)) if v]
        if ignored:
            notes.append(f"not applicable: {', '.join(ignored)}")
        memory = "min" if compress or level >= 2 else "auto"
        _, report = fuse(
            model, inplace=True, process_group=process_group, return_report=True, memory=memory
        )
        if not report.fused:
            notes.append("no chain was fused: is the model multi-step (step_mode='m')?")
        summary = MemOptSummary(level, memory, report, tuple(notes))
    log.info("%s", summary)
    return (model, summary) if return_summary else model
