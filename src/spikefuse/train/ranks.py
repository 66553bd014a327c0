"""A process's place in a ``torchrun`` job, and what the ranks must agree on."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from spikefuse.errors import SpikefuseError
from spikefuse.train.config import TrainConfig


@dataclass(frozen=True)
class Ranks:
    """This process's place in a ``torchrun`` job (rank 0 of 1 without one)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def main(self) -> bool:
        """Whether this process writes the checkpoint and log and prints (rank 0)."""
        return self.rank == 0


ONE_PROCESS = Ranks()  # a run without torchrun


def ranks_from_env(environ: dict[str, str] | None = None) -> Ranks:
    """Read ``WORLD_SIZE``, ``RANK`` and ``LOCAL_RANK`` as ``torchrun`` sets them.

    Without ``WORLD_SIZE`` (or with 1) the run is a single process. Raises
    :class:`SpikefuseError` for values that are no whole numbers or out of range.
    """
    env = os.environ if environ is None else environ
    if env.get("WORLD_SIZE", "1") == "1":
        return Ranks()
    values = {}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        text = env.get(name)
        if text is None or not text.isdigit():
            raise SpikefuseError(
                f"distributed run (WORLD_SIZE={env['WORLD_SIZE']!r}): {name} is {text!r}, not a "
                f"whole number >= 0; start the run with torchrun, which sets it"
            )
        values[name] = int(text)
    ranks = Ranks(values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"])
    if not 0 <= ranks.rank < ranks.world_size:
        raise SpikefuseError(f"RANK={ranks.rank} is outside 0..WORLD_SIZE-1={ranks.world_size - 1}")
    return ranks


def agree(ranks: Ranks, error: SpikefuseError | None) -> None:
    """Raise on every rank when any rank failed (``error``) at this point of the run.

    A rank that failed alone (rank 0's checkpoint and log checks and writes, a rank that
    cannot read the data or checkpoint) would otherwise leave the others waiting forever in
    their next collective. The failed rank raises its ``error``; the others raise one that
    quotes the first failed rank's message.
    """
    if ranks.distributed:
        messages: list[str | None] = [None] * ranks.world_size
        torch.distributed.all_gather_object(messages, None if error is None else str(error))
        failed = [(rank, message) for rank, message in enumerate(messages) if message]
        if error is None and failed:
            raise SpikefuseError(f"rank {failed[0][0]} stopped the run: {failed[0][1]}")
    if error is not None:
        raise error


def agree_on_work(ranks: Ranks, work: dict[str, int]) -> None:
    """Raise on every rank unless all ranks have the same ``work`` (sample counts, epochs,
    batch size, ...): ranks that run different numbers of batches wait forever for each other
    in their first unmatched collective. Call it before the first collective of training."""
    if not ranks.distributed:
        return
    seen: list[dict[str, int] | None] = [None] * ranks.world_size
    torch.distributed.all_gather_object(seen, work)
    first = seen[0] or {}
    for rank, other in enumerate(seen):
        other = other or {}
        differing = [key for key in first if other.get(key) != first[key]]
        if differing:
            details = "; ".join(
                f"{key}: {other.get(key)} on rank {rank}, {first[key]} on rank 0"
                for key in differing
            )
            raise SpikefuseError(
                f"the ranks would run different work and wait for each other forever ({details}); "
                "every rank must read the same data and checkpoint (on several nodes: a "
                "complete copy on each)"
            )


def epoch_order(config: TrainConfig, epoch: int, count: int, ranks: Ranks) -> torch.Tensor:
    """This rank's training sample indices for ``epoch``, in batch order.

    The permutation is seeded by (seed, epoch), so a resumed run sees the same batches as an
    uninterrupted one. Rank r of W takes every W-th sample from the r-th on, and every rank
    the same number, ``count // W`` (the rest of the permutation is dropped this epoch): all
    ranks run the same batches count and sizes, so their gradient and fused-BatchNorm
    all-reduces pair up.
    """
    order = np.random.default_rng([config.seed, epoch]).permutation(count)
    per_rank = count // ranks.world_size
    return torch.from_numpy(order[ranks.rank :: ranks.world_size][:per_rank])
