"""SpikingJelly's ``distributed.tensor_parallel.channel``: the names its Spikformer file imports."""

from __future__ import annotations

from typing import Any, NoReturn

from ...errors import SpikefuseError
from .. import INSTEAD
from . import (
    ChannelShardBatchNorm1d,
    ChannelShardBatchNorm2d,
    ChannelShardConv1d,
    ChannelShardConv2d,
)

__all__ = [
    "ChannelShardBatchNorm1d",
    "ChannelShardBatchNorm2d",
    "ChannelShardConv1d",
    "ChannelShardConv2d",
    "_ColwiseBackwardAllReduce",
]


class _ColwiseBackwardAllReduce:
    """SpikingJelly's all-reduce in backward of column-sharded layers: refused when applied."""

    @staticmethod
    def apply(*args: Any, **kwargs: Any) -> NoReturn:
        raise SpikefuseError(f"_ColwiseBackwardAllReduce: {INSTEAD}")
