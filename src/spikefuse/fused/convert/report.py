"""What :func:`~spikefuse.fused.fuse` did: the chains it fused, what it left and why."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

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
    ``pools``: pooling layers now :class:`SpikePool`; ``spike_max_pools``: those of them that
    max-pool with :func:`~spikefuse.fused.ops.spike_max_pool.spike_max_pool2d`, and the
    max poolings inside unfused ``SeqToANNContainer`` modules, now
    :class:`~spikefuse.fused.MaxPoolCodes`;
    ``unfolded_pools``: pooling layers right after a fused chain that were not folded into its
    block (name → why); ``traced``: modules whose forward was traced with torch.fx;
    ``untraced``: modules whose forward could not be traced (name → error), searched as a
    module tree instead; ``rewritten``: modules whose forward now runs a rewritten graph (they
    hold residual chains); ``recomputed_inputs``: unfused Conv/Linear layers that save a fused
    block's spikes as their recipe (see :class:`~spikefuse.fused.recompute.RecomputedInput`).
    The folded pools: :attr:`folded_pools`."""

    fused: list[FusedChain] = field(default_factory=list)
    skipped: list[SkippedCandidate] = field(default_factory=list)
    pools: list[str] = field(default_factory=list)
    spike_max_pools: list[str] = field(default_factory=list)
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
        if self.spike_max_pools:
            lines.append(f"  max pooling as spike_max_pool2d: {', '.join(self.spike_max_pools)}")
        lines += [f"  pooling not folded: {n}: {why}" for n, why in self.unfolded_pools.items()]
        if self.traced:
            lines.append(f"  traced with torch.fx: {', '.join(self.traced)}")
        if self.rewritten:
            rewritten = ", ".join(self.rewritten)
            lines.append(f"  forward rewritten (residual chains, T and B merged): {rewritten}")
        if self.recomputed_inputs:
            inputs = ", ".join(self.recomputed_inputs)
            lines.append(f"  unfused, recomputing a fused block's spikes they read: {inputs}")
        lines += [
            f"  not traceable, searched as a module tree: {name}: {error}"
            for name, error in self.untraced.items()
        ]
        return "\n".join(lines)


def _join(prefix: str, name: str) -> str:
    """The dotted name of ``name`` inside ``prefix`` (either may be empty: the model itself)."""
    return f"{prefix}.{name}" if prefix and name else prefix or name


def _display(name: str) -> str:
    return name or MODEL
