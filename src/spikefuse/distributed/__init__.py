"""SpikingJelly's ``activation_based.distributed`` names, for code that imports them (its
model files import ``distributed.tensor_parallel`` and ``distributed.vision.config``: both
exist here, see those modules).

spikefuse has no tensor-, pipeline- or FSDP-parallel SNN runtime. Data-parallel training works
with torch's ``DistributedDataParallel`` (fused BatchNorms synchronise over
``spikefuse.fuse(..., process_group=...)``). Here the availability flags are False, so code
that checks them takes its single-device path, and every function or class raises a
:class:`~spikefuse.errors.SpikefuseError` saying so when used.
"""

from __future__ import annotations

from typing import Any, NoReturn

from ..errors import SpikefuseError

DTENSOR_AVAILABLE = False
FSDP2_AVAILABLE = False
PIPELINING_AVAILABLE = False
TENSOR_PARALLEL_AVAILABLE = False
ZERO_REDUNDANCY_OPTIMIZER_AVAILABLE = False
SNN_DISTRIBUTED_PREFERENCES: tuple[str, ...] = ()

INSTEAD = (
    "spikefuse has no tensor/pipeline/FSDP-parallel SNN runtime; train data-parallel with "
    "torch.nn.parallel.DistributedDataParallel (pass process_group to spikefuse.fuse for "
    "synchronised BatchNorm), or keep SpikingJelly for sharded models"
)
# SpikingJelly's distributed API (functions and classes); each raises when called
REFUSED = (
    "DistributedFeatureSet",
    "SNNDistributedAnalysis",
    "SNNDistributedConfig",
    "SNNDistributedPlan",
    "SNNDistributedRuntime",
    "SNNDistributedTopology",
    "TensorParallelStyle",
    "analyze",
    "apply",
    "apply_pipeline_stage_memopt",
    "build_device_mesh",
    "build_snn_optimizer",
    "configure_snn_distributed",
    "enable_tp_communication_debug",
    "ensure_distributed_initialized",
    "get_tp_communication_debug_stats",
    "make_tensor_shard_memory_module",
    "materialize_dtensor_output",
    "plan",
    "recommend_pipeline_memopt_stages",
    "recommend_snn_distributed_strategy",
    "recommended_pipeline_microbatches",
    "reset_tp_communication_debug_stats",
    "resolve_data_parallel_partition",
    "resolve_tensor_parallel_group_size",
    "unwrap_parallel_module",
)


def _refusing(name: str) -> Any:
    def refused(*args: Any, **kwargs: Any) -> NoReturn:
        raise SpikefuseError(f"spikefuse.distributed.{name}: {INSTEAD}")

    refused.__name__ = refused.__qualname__ = name
    refused.__doc__ = f"SpikingJelly's ``distributed.{name}``: raises ({INSTEAD})."
    return refused


def __getattr__(name: str) -> Any:
    if name in REFUSED:
        return _refusing(name)
    raise AttributeError(f"module 'spikefuse.distributed' has no attribute {name!r} ({INSTEAD})")
