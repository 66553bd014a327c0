"""SpikingJelly's ``distributed.tensor_parallel`` layers, which its model files import for their
sharded builders: importable, and refusing when built (spikefuse has no tensor parallelism)."""

from __future__ import annotations

from typing import Any, NoReturn

from torch import nn

from ...errors import SpikefuseError
from .. import INSTEAD

__all__ = [
    "ChannelShardBatchNorm1d",
    "ChannelShardBatchNorm2d",
    "ChannelShardConv1d",
    "ChannelShardConv2d",
]

TENSOR_PARALLEL_AVAILABLE = False


class _ChannelShard(nn.Module):
    """A channel-sharded layer: raises when constructed."""

    def __init__(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise SpikefuseError(f"{type(self).__name__}: {INSTEAD}")


class ChannelShardConv1d(_ChannelShard):
    """SpikingJelly's channel-sharded Conv1d: refused (no tensor parallelism)."""


class ChannelShardConv2d(_ChannelShard):
    """SpikingJelly's channel-sharded Conv2d: refused (no tensor parallelism)."""


class ChannelShardBatchNorm1d(_ChannelShard):
    """SpikingJelly's channel-sharded BatchNorm1d: refused (no tensor parallelism)."""


class ChannelShardBatchNorm2d(_ChannelShard):
    """SpikingJelly's channel-sharded BatchNorm2d: refused (no tensor parallelism)."""
