"""SpikingJelly's ``memopt.memory_optimization`` (alias ``optimize_memory``), mapped onto
spikefuse's memory modes.

SpikingJelly lowers training memory by wrapping layers in gradient-checkpointing containers,
chosen by profiling. spikefuse reaches the same end through :func:`spikefuse.fuse`: every
multi-step Conv/Linear → BatchNorm → neuron chain becomes a fused block whose ``memory`` mode
decides what it keeps for backward:

* level 0 (SpikingJelly's default without ``profile``/``prefer``): nothing is changed;
* level 1 (``profile='safe'``, ``prefer='speed'``): ``memory='auto'`` (each block recomputes
  its Conv/Linear in backward where that pays, else keeps its output);
* level 2 and above, or ``compress_x=True``: ``memory='min'`` (blocks keep only their input,
  1-bit packed when it is spikes, and recompute: checkpointing plus spike compression).

The returned model is ``net`` itself, fused in place. The summary (``return_summary=True``)
says what was done, including what did not apply (``instance``: spikefuse fuses every chain,
whatever its classes; profiling options: nothing is profiled). Models must be multi-step
(``functional.set_step_mode(net, 'm')``) for any chain to fuse.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from torch import nn

from .errors import SpikefuseError
from .fused import FuseReport, fuse

__all__ = ["MemOptSummary", "memory_optimization", "optimize_memory"]

log = logging.getLogger("spikefuse.memopt")
PROFILE_LEVELS = {"safe": 1, "balanced": 2, "memory": 3, "exhaustive": 4}
PREFER_PROFILES = {"speed": "safe", "balanced": "balanced", "memory": "memory"}
# SpikingJelly's search and profiling options: accepted, reported as not applying
PROFILING_OPTIONS = (
    "temporal_split_factor",
    "max_split_rounds",
    "max_candidates_per_round",
    "warmup_in_main_process",
    "warmup_in_profile_workers",
    "allow_expensive_profiling",
    "checkpoint_budget",
    "max_gc_wrapped_modules",
    "gc_target_budget_ratio",
)


@dataclass(frozen=True)
class MemOptSummary:
    """What :func:`memory_optimization` did: the resolved ``level``, the spikefuse ``memory``
    mode (None: nothing changed), the :class:`~spikefuse.fused.FuseReport` and ``notes``."""

    level: int
    memory: str | None
    report: FuseReport | None
    notes: tuple[str, ...]

    def __str__(self) -> str:
        head = f"memory_optimization: level {self.level} -> "
        head += "unchanged" if self.memory is None else f"spikefuse.fuse(memory={self.memory!r})"
        lines = [head, *(f"  {note}" for note in self.notes)]
        if self.report is not None:
            lines.append(str(self.report))
        return "\n".join(lines)


def _resolve_level(level: int | None, prefer: str | None, profile: str | None) -> int:
    if prefer is not None and prefer not in PREFER_PROFILES:
        raise SpikefuseError(f"prefer must be one of {tuple(PREFER_PROFILES)}, got {prefer!r}")
    if profile is not None and profile not in PROFILE_LEVELS:
        raise SpikefuseError(f"profile must be one of {tuple(PROFILE_LEVELS)}, got {profile!r}")
    if level is not None:
        if not isinstance(level, int) or isinstance(level, bool) or not 0 <= level <= 4:
            raise SpikefuseError(f"level must be an int in 0..4, got {level!r}")
        return level
    if profile is None and prefer is not None:
        profile = PREFER_PROFILES[prefer]
    return PROFILE_LEVELS.get(profile, 0) if profile is not None else 0


def _check_instance(instance: Any) -> None:
    kinds = instance if isinstance(instance, tuple) else (instance,)
    if not kinds or not all(isinstance(k, type) for k in kinds):
        raise SpikefuseError(f"instance must be a class or a tuple of classes, got {instance!r}")


def memory_optimization(
    net: nn.Module,
    instance: type | tuple[type, ...],
    dummy_input: tuple | None = None,
    compress_x: bool | None = None,
    level: int | None = None,
    *,
    prefer: str | None = None,
    profile: str | None = None,
    return_summary: bool = False,
    **profiling: Any,
) -> nn.Module | tuple[nn.Module, MemOptSummary]:
    """Lower ``net``'s training memory with spikefuse's memory modes (see the module docs);
    returns ``net`` (fused in place), with a :class:`MemOptSummary` if ``return_summary``."""
    if not isinstance(net, nn.Module):
        raise SpikefuseError(f"net must be an nn.Module, got {type(net).__name__}")
    _check_instance(instance)
    unknown = sorted(set(profiling) - set(PROFILING_OPTIONS))
    if unknown:
        raise TypeError(f"memory_optimization got unexpected keyword arguments {unknown}")
    if dummy_input is not None and not isinstance(dummy_input, tuple):
        raise SpikefuseError("dummy_input must be a tuple of the model's inputs")
    resolved = _resolve_level(level, prefer, profile)
    notes = ["instance is not used to select layers: spikefuse fuses every chain it finds"]
    ignored = [name for name, value in profiling.items() if value is not None]
    if dummy_input is not None:
        ignored.insert(0, "dummy_input")
    if ignored:
        notes.append(f"not applicable (nothing is profiled): {', '.join(ignored)}")
    if resolved == 0 and not compress_x:
        summary = MemOptSummary(0, None, None, (*notes, "level 0: no optimisation"))
    else:
        memory = "min" if resolved >= 2 or compress_x else "auto"
        _, report = fuse(net, inplace=True, return_report=True, memory=memory)
        if not report.fused:
            notes.append("no chain was fused: is the model multi-step (step_mode='m')?")
        summary = MemOptSummary(resolved, memory, report, tuple(notes))
    log.info("%s", summary)
    return (net, summary) if return_summary else net


optimize_memory = memory_optimization
