"""SpikingJelly's ``distributed.vision`` (see :mod:`spikefuse.distributed.vision.config`)."""

from .config import ModelBuilder, ModelConfig, NeuronConfig

__all__ = ["ModelBuilder", "ModelConfig", "NeuronConfig"]
