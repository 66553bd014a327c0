"""Spiking recurrent layers with SpikingJelly's names (``activation_based.rnn``).

Cells take one step ``x [N, input_size]`` and their state; the layers take a sequence
``x [T, N, input_size]`` and ``states`` (None: zeros; a tensor ``[layers * directions, N,
hidden]`` for one-state cells, a tuple ``(h, c)`` of such tensors for the LSTM) and return
``(y [T, N, hidden * directions], final states)`` in the same form. Gates are spikes: the
surrogate functions' forward is the Heaviside step (``surrogate_function2`` for the candidate
gate when given). The LSTM's cell state is clamped at 1 without gradient, as in SpikingJelly.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .errors import SpikefuseError
from .surrogate import Erf

__all__ = [
    "SpikingGRU",
    "SpikingGRUCell",
    "SpikingLSTM",
    "SpikingLSTMCell",
    "SpikingRNNBase",
    "SpikingRNNCellBase",
    "SpikingVanillaRNN",
    "SpikingVanillaRNNCell",
    "bidirectional_rnn_cell_forward",
    "directional_rnn_cell_forward",
]


def _check_same_mode(first: Any, second: Any) -> None:
    if second is not None and getattr(first, "spiking", True) != getattr(second, "spiking", True):
        raise SpikefuseError(
            "surrogate_function1 and surrogate_function2 must both be spiking or both not"
        )


def directional_rnn_cell_forward(cell: nn.Module, x: Tensor, states: Any) -> tuple[Tensor, Any]:
    """Run ``cell`` over ``x [T, N, *]`` from ``states`` ([N, H], or [S, N, H] for S states):
    (outputs [T, N, H], the final states)."""
    if states.dim() not in (2, 3):
        raise SpikefuseError(f"states must be 2-D or 3-D, got shape {tuple(states.shape)}")
    single_state = states.dim() == 2
    ss, output = states, []
    for t in range(x.shape[0]):
        ss = cell(x[t], ss)
        output.append(ss if single_state else ss[0])
    return torch.stack(output), ss


def bidirectional_rnn_cell_forward(
    cell: nn.Module, cell_reverse: nn.Module, x: Tensor, states: Any, states_reverse: Any
) -> tuple[Tensor, Any, Any]:
    """Both directions: (outputs [T, N, 2H] (forward then reversed), states, reverse states)."""
    if states.dim() not in (2, 3) or states_reverse.dim() != states.dim():
        raise SpikefuseError("states and states_reverse must have the same rank, 2 or 3")
    y, ss = directional_rnn_cell_forward(cell, x, states)
    y_r, ss_r = directional_rnn_cell_forward(cell_reverse, x.flip(0), states_reverse)
    return torch.cat((y, y_r.flip(0)), dim=-1), ss, ss_r


class SpikingRNNCellBase(nn.Module):
    """Base of the cells: ``linear_ih``/``linear_hh`` and uniform(-1/sqrt(H), 1/sqrt(H)) init."""

    linear_ih: nn.Linear  # set by the subclasses
    linear_hh: nn.Linear

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True) -> None:
        super().__init__()
        for name, value in (("input_size", input_size), ("hidden_size", hidden_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise SpikefuseError(
                    f"{type(self).__name__}: {name} must be an int > 0, got {value!r}"
                )
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.bias = bias

    def reset_parameters(self) -> None:
        sqrt_k = math.sqrt(1 / self.hidden_size)
        for param in self.parameters():
            nn.init.uniform_(param, -sqrt_k, sqrt_k)

    def weight_ih(self) -> Tensor:
        return self.linear_ih.weight

    def weight_hh(self) -> Tensor:
        return self.linear_hh.weight

    def bias_ih(self) -> Tensor | None:
        return self.linear_ih.bias

    def bias_hh(self) -> Tensor | None:
        return self.linear_hh.bias

    def _zeros(self, x: Tensor) -> Tensor:
        return torch.zeros(x.shape[0], self.hidden_size, dtype=x.dtype, device=x.device)


class _GatedCell(SpikingRNNCellBase):
    """A cell with ``gates`` gate blocks in ``linear_ih``/``linear_hh`` and two surrogates."""

    gates: int

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        bias: bool = True,
        surrogate_function1: Any = None,
        surrogate_function2: Any = None,
    ) -> None:
        super().__init__(input_size, hidden_size, bias)
        self.linear_ih = nn.Linear(input_size, self.gates * hidden_size, bias=bias)
        self.linear_hh = nn.Linear(hidden_size, self.gates * hidden_size, bias=bias)
        self.surrogate_function1 = Erf() if surrogate_function1 is None else surrogate_function1
        self.surrogate_function2 = surrogate_function2
        _check_same_mode(self.surrogate_function1, surrogate_function2)
        self.reset_parameters()


class SpikingLSTMCell(_GatedCell):
    """i, f, o = sg1(...), g = sg2(...) (sg1 without sg2); c = c f + i g (clamped at 1, no
    gradient through the clamp); h = c o. Returns (h, c)."""

    gates = 4

    def forward(self, x: Tensor, hc: Any = None) -> tuple[Tensor, Tensor]:
        h, c = (self._zeros(x), self._zeros(x)) if hc is None else (hc[0], hc[1])
        pre = self.linear_ih(x) + self.linear_hh(h)
        sg1, sg2 = self.surrogate_function1, self.surrogate_function2
        if sg2 is None:
            i, f, g, o = torch.split(sg1(pre), self.hidden_size, dim=1)
        else:
            i, f, g, o = torch.split(pre, self.hidden_size, dim=1)
            i, f, g, o = sg1(i), sg1(f), sg2(g), sg1(o)
        c = c * f + i * g
        with torch.no_grad():
            torch.clamp_max_(c, 1.0)
        return c * o, c


class SpikingVanillaRNNCell(SpikingRNNCellBase):
    """h = sg(W_ih x + W_hh h)."""

    def __init__(
        self, input_size: int, hidden_size: int, bias: bool = True, surrogate_function: Any = None
    ) -> None:
        super().__init__(input_size, hidden_size, bias)
        self.linear_ih = nn.Linear(input_size, hidden_size, bias=bias)
        self.linear_hh = nn.Linear(hidden_size, hidden_size, bias=bias)
        self.surrogate_function = Erf() if surrogate_function is None else surrogate_function
        self.reset_parameters()

    def forward(self, x: Tensor, h: Tensor | None = None) -> Tensor:
        h = self._zeros(x) if h is None else h
        return self.surrogate_function(self.linear_ih(x) + self.linear_hh(h))


class SpikingGRUCell(_GatedCell):
    """r, z = sg1(...); n = sg2(W_in x + r (W_hn h)) (sg1 without sg2); h = (1 - z) n + z h."""

    gates = 3

    def forward(self, x: Tensor, h: Tensor | None = None) -> Tensor:
        h = self._zeros(x) if h is None else h
        y_ih = torch.split(self.linear_ih(x), self.hidden_size, dim=1)
        y_hh = torch.split(self.linear_hh(h), self.hidden_size, dim=1)
        r = self.surrogate_function1(y_ih[0] + y_hh[0])
        z = self.surrogate_function1(y_ih[1] + y_hh[1])
        sg_n = (
            self.surrogate_function1
            if self.surrogate_function2 is None
            else self.surrogate_function2
        )
        n = sg_n(y_ih[2] + r * y_hh[2])
        return (1.0 - z) * n + z * h


class SpikingRNNBase(nn.Module):
    """Stacked (optionally bidirectional) spiking RNN over ``[T, N, input_size]``.

    ``dropout_p``: dropout on the outputs of every layer but the last in training;
    ``invariant_dropout_mask``: one mask per layer for all T steps."""

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int,
        bias: bool = True,
        dropout_p: float = 0,
        invariant_dropout_mask: bool = False,
        bidirectional: bool = False,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        if not isinstance(num_layers, int) or num_layers <= 0:
            raise SpikefuseError(f"num_layers must be an int > 0, got {num_layers!r}")
        if not (isinstance(dropout_p, (int, float)) and 0 <= dropout_p < 1):
            raise SpikefuseError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.bias = bias
        self.dropout_p = dropout_p
        self.invariant_dropout_mask = invariant_dropout_mask
        self.bidirectional = bidirectional
        self.cells = self._make_cells(*args, **kwargs)
        if bidirectional:
            self.cells_reverse = self._make_cells(*args, **kwargs)

    def _make_cells(self, *args: Any, **kwargs: Any) -> nn.Sequential:
        recurrent = self.hidden_size * (2 if self.bidirectional else 1)
        sizes = [self.input_size] + [recurrent] * (self.num_layers - 1)
        cell = self.base_cell()
        return nn.Sequential(
            *(cell(n, self.hidden_size, self.bias, *args, **kwargs) for n in sizes)
        )

    @staticmethod
    def base_cell() -> type[nn.Module]:
        raise NotImplementedError

    @staticmethod
    def states_num() -> int:
        raise NotImplementedError

    def _initial_states(self, x: Tensor, states: Any) -> Tensor:
        """States as one tensor [S, layers * directions, N, H]."""
        count, layers = self.states_num(), self.num_layers * (2 if self.bidirectional else 1)
        if states is None:
            return x.new_zeros(count, layers, x.shape[1], self.hidden_size)
        if isinstance(states, tuple):
            states = torch.stack(states)
        elif isinstance(states, Tensor) and states.dim() == 3:
            states = states.unsqueeze(0)
        else:
            raise SpikefuseError(
                f"states must be None, a 3-D tensor or a tuple of tensors, got {type(states).__name__}"
            )
        if states.dim() != 4 or states.shape[:2] != (count, layers):
            raise SpikefuseError(
                f"states must have shape [{count}, {layers}, N, hidden_size], got {tuple(states.shape)}"
            )
        return states

    def _layer(self, index: int, y: Tensor, states: Tensor, out: Tensor) -> Tensor:
        """Run layer ``index`` (both directions), writing its final states into ``out``."""
        one = self.states_num() == 1
        given = states[0, index] if one else states[:, index]
        if self.bidirectional:
            r = index + self.num_layers
            given_r = states[0, r] if one else states[:, r]
            y, final, final_r = bidirectional_rnn_cell_forward(
                self.cells[index], self.cells_reverse[index], y, given, given_r
            )
            out[:, r] = final_r.unsqueeze(0) if one else torch.stack(tuple(final_r))
        else:
            y, final = directional_rnn_cell_forward(self.cells[index], y, given)
        out[:, index] = final.unsqueeze(0) if one else torch.stack(tuple(final))
        return y

    def forward(self, x: Tensor, states: Any = None) -> tuple[Tensor, Any]:
        if not isinstance(x, Tensor) or x.dim() != 3:
            raise SpikefuseError(
                f"{type(self).__name__}: x must be [T, N, input_size], got {getattr(x, 'shape', x)!r}"
            )
        states_tensor = self._initial_states(x, states)
        dropout = self.training and self.dropout_p > 0
        masks = None
        if dropout and self.invariant_dropout_mask and self.num_layers > 1:
            width = self.hidden_size * (2 if self.bidirectional else 1)
            ones = x.new_ones(self.num_layers - 1, x.shape[1], width)
            masks = F.dropout(ones, p=self.dropout_p, training=True)
        y, out = x, torch.empty_like(states_tensor)
        for index in range(self.num_layers):
            y = self._layer(index, y, states_tensor, out)
            if dropout and index < self.num_layers - 1:
                y = (
                    F.dropout(y, p=self.dropout_p, training=True)
                    if masks is None
                    else y * masks[index]
                )
        return (y, out[0]) if self.states_num() == 1 else (y, tuple(out))


class _TwoSurrogateRNN(SpikingRNNBase):
    """Stacked cells taking ``surrogate_function1`` and ``surrogate_function2``."""

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int,
        bias: bool = True,
        dropout_p: float = 0,
        invariant_dropout_mask: bool = False,
        bidirectional: bool = False,
        surrogate_function1: Any = None,
        surrogate_function2: Any = None,
    ) -> None:
        super().__init__(
            input_size, hidden_size, num_layers, bias, dropout_p, invariant_dropout_mask,
            bidirectional, surrogate_function1, surrogate_function2,
        )  # fmt: skip


class SpikingLSTM(_TwoSurrogateRNN):
    """Stacked :class:`SpikingLSTMCell` layers; states ``(h, c)``."""

    @staticmethod
    def base_cell() -> type[nn.Module]:
        return SpikingLSTMCell

    @staticmethod
    def states_num() -> int:
        return 2


class SpikingVanillaRNN(SpikingRNNBase):
    """Stacked :class:`SpikingVanillaRNNCell` layers; state ``h``."""

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int,
        bias: bool = True,
        dropout_p: float = 0,
        invariant_dropout_mask: bool = False,
        bidirectional: bool = False,
        surrogate_function: Any = None,
    ) -> None:
        super().__init__(
            input_size,
            hidden_size,
            num_layers,
            bias,
            dropout_p,
            invariant_dropout_mask,
            bidirectional,
            surrogate_function,
        )

    @staticmethod
    def base_cell() -> type[nn.Module]:
        return SpikingVanillaRNNCell

    @staticmethod
    def states_num() -> int:
        return 1


class SpikingGRU(_TwoSurrogateRNN):
    """Stacked :class:`SpikingGRUCell` layers; state ``h``."""

    @staticmethod
    def base_cell() -> type[nn.Module]:
        return SpikingGRUCell

    @staticmethod
    def states_num() -> int:
        return 1
