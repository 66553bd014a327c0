"""Converting existing models: :func:`fuse` (``api``) and the report it gives (``report``).

``find`` recognises the chains in a traced graph (``trace``) of the modules ``modules``
recognises, ``rewrite`` patches the model,
``names`` keeps the unfused model's state-dict keys.
"""

from .api import fuse
from .names import _LoadOriginalNames, _SaveUnderOriginalNames
from .report import FusedChain, FuseReport, SkippedCandidate
from .rewrite import FusedAttributeError, FusedAway, _RewrittenForward

# Models pickled whole name the hooks and forwards that fuse attached by this module's path.
_PICKLED = (_LoadOriginalNames, _SaveUnderOriginalNames, _RewrittenForward)

__all__ = [
    "FuseReport",
    "FusedAttributeError",
    "FusedAway",
    "FusedChain",
    "SkippedCandidate",
    "fuse",
]
