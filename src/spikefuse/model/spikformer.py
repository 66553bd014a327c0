"""SpikingJelly's ``activation_based.model.spikformer`` path. spikefuse has no spiking
self-attention layer yet (SpikingJelly's ``layer.attention``), so importing this module raises,
naming the alternative."""

from __future__ import annotations

from ..errors import SpikefuseError
from ._refuse import NO_SPIKFORMER

raise SpikefuseError(f"spikefuse.model.spikformer is not available: {NO_SPIKFORMER}")
