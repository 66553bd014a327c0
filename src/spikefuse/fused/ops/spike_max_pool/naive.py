"""The spike max pooling's reference: ``torch.nn.functional.max_pool2d`` itself.

Its forward and its gradient (through ATen's int64 indices) are what the op (:mod:`.passes`,
:mod:`.autograd` and the cuda backend's ``max_pool`` kernels) must give, element for element.
"""

from __future__ import annotations

from torch import Tensor
from torch.nn import functional as F

from .geometry import MaxPoolGeometry


def spike_max_pool2d_naive(x: Tensor, geometry: MaxPoolGeometry) -> Tensor:
    """``F.max_pool2d`` of ``x`` [N, C, H, W] with ``geometry``'s arguments."""
    return F.max_pool2d(
        x,
        geometry.kernel,
        geometry.stride,
        geometry.padding,
        geometry.dilation,
        ceil_mode=geometry.ceil_mode,
    )
