"""The torch modules NIR nodes without a spikefuse layer import as: :class:`Scale` (``Scale``),
:class:`LeakyIntegrator` (``LI``) and :class:`NIRGraphModule` (a graph with branches)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from ...errors import NIRConversionError
from ...neuron import LIFNode
from ...surrogate import Rect


class Scale(nn.Module):
    """Element-wise scaling by a fixed per-sample array (NIR's ``Scale``): y = x * scale.

    ``scale`` has the per-sample shape ``[*]``; input ``[..., *]`` (any leading dimensions,
    e.g. ``[T, N, *]``) is broadcast against it.
    """

    scale: Tensor  # a buffer

    def __init__(self, scale: Tensor) -> None:
        super().__init__()
        self.register_buffer("scale", scale.detach().clone())

    def forward(self, x: Tensor) -> Tensor:
        return x * self.scale

    def extra_repr(self) -> str:
        return f"shape={tuple(self.scale.shape)}"


# A threshold no potential reaches: float32's largest value, the largest a neuron's constants
# may take (they are checked in float32).
_NEVER = float(torch.finfo(torch.float32).max)


class LeakyIntegrator(nn.Module):
    """Non-spiking leaky integrator (NIR's ``LI``) on multi-step input ``[T, N, *]``.

    Outputs the potential V[t] of ``LIFNode(tau, decay_input, v_reset=v_leak)`` with firing
    disabled (its threshold is float32's largest value, so H >= V_th never holds and the
    rectangular surrogate's derivative is 0): the same kernels on every backend. V starts at
    v_leak.

    decay_input=True:  V[t] = V[t-1] + (X[t] - (V[t-1] - v_leak)) / tau
    decay_input=False: V[t] = V[t-1] - (V[t-1] - v_leak) / tau + X[t]
    """

    def __init__(
        self, tau: float, decay_input: bool = True, v_leak: float = 0.0, backend: str = "auto"
    ) -> None:
        super().__init__()
        self.node = LIFNode(
            tau=tau,
            decay_input=decay_input,
            v_threshold=_NEVER,
            v_reset=v_leak,
            surrogate_function=Rect(),
            step_mode="m",
            backend=backend,
            store_v_seq=True,
        )

    def forward(self, x_seq: Tensor) -> Tensor:
        self.node(x_seq)
        v_seq = self.node.v_seq
        assert isinstance(v_seq, Tensor)  # store_v_seq=True, multi-step
        return v_seq


class NIRGraphModule(nn.Module):
    """A NIR graph with branches (e.g. residual additions), run on multi-step input ``[T, N, *]``.

    The graph is cut into chains (``nn.Sequential``, so :func:`spikefuse.fuse` finds the
    Conv→neuron runs inside them), run in topological order; a chain whose first node has several
    incoming edges receives the sum of their outputs, in edge order.

    Args:
        chains: chain name -> ``nn.Sequential``, in topological order.
        sources: chain name -> names of the chains feeding it (``""`` is the graph input).
        output_sources: names of the chains feeding the graph output.
    """

    def __init__(
        self,
        chains: Mapping[str, nn.Sequential],
        sources: Mapping[str, Sequence[str]],
        output_sources: Sequence[str],
    ) -> None:
        super().__init__()
        self.chains = nn.ModuleDict(chains)
        known = {""}
        for name in self.chains:
            missing = [s for s in sources.get(name, ()) if s not in known]
            if name not in sources or not sources[name] or missing:
                raise NIRConversionError(
                    f"NIRGraphModule: chain {name!r} needs sources among the earlier chains "
                    f"{sorted(known)}, got {list(sources.get(name, ()))}"
                )
            known.add(name)
        if not output_sources or any(s not in known for s in output_sources):
            raise NIRConversionError(
                f"NIRGraphModule: output sources {list(output_sources)} must be chains or ''"
            )
        self.sources = {name: tuple(sources[name]) for name in self.chains}
        self.output_sources = tuple(output_sources)

    def forward(self, x: Tensor) -> Tensor:
        values = {"": x}
        for name, chain in self.chains.items():
            values[name] = chain(_sum(values, self.sources[name]))
        return _sum(values, self.output_sources)


def _sum(values: dict[str, Tensor], names: Sequence[str]) -> Tensor:
    total = values[names[0]]
    for name in names[1:]:
        total = total + values[name]
    return total
