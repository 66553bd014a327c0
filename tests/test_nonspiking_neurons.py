"""SpikingJelly's non-spiking neurons (``NonSpikingIFNode``, ``NonSpikingLIFNode``): hand-computed
potentials and decodings, input checks, and float64 equality with SpikingJelly where it is
importable."""

from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch
from torch import nn

from spikefuse import base, functional, neuron
from spikefuse.errors import SpikefuseError

DECODES = [None, "max-mem", "max-abs-mem", "mean-mem", "last_mem"]


def _seq(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)  # [T, N]


def test_if_node_integrates_and_returns_the_potentials():
    node = neuron.NonSpikingIFNode()
    out = node(_seq([1.0, -1.0], [2.0, -2.0], [3.0, 0.5]))
    assert isinstance(out, list) and len(out) == 3
    assert [v.tolist() for v in out] == [[1.0, -1.0], [3.0, -3.0], [6.0, -2.5]]
    assert node.v.tolist() == [6.0, -2.5]


def test_lif_node_leaks_towards_the_input():
    # V[t] = V[t-1] + (X[t] - V[t-1]) / tau from V = 0
    out = neuron.NonSpikingLIFNode(tau=2.0)(_seq([1.0], [1.0], [1.0]))
    assert [v.item() for v in out] == [0.5, 0.75, 0.875]
    out = neuron.NonSpikingLIFNode(tau=4.0)(_seq([4.0], [-8.0]))
    assert [v.item() for v in out] == [1.0, 1.0 + (-8.0 - 1.0) / 4.0]


@pytest.mark.parametrize(
    ("decode", "expected"),
    [
        ("last_mem", [6.0, -2.5, 1.0]),
        ("max-mem", [6.0, -1.0, 2.0]),
        ("mean-mem", [10.0 / 3.0, -6.5 / 3.0, 1.0 / 3.0]),
        # the larger magnitude of max and min; on a tie (2 vs -2) the minimum
        ("max-abs-mem", [6.0, -3.0, -2.0]),
    ],
)
def test_decodings_reduce_over_time(decode, expected):
    # potentials: [1, -1, 2], [3, -3, -2], [6, -2.5, 1]
    x = _seq([1.0, -1.0, 2.0], [2.0, -2.0, -4.0], [3.0, 0.5, 3.0])
    out = neuron.NonSpikingIFNode(decode=decode)(x)
    assert out.shape == (3,)
    assert out.tolist() == pytest.approx(expected, abs=1e-15)


def test_max_mem_gradient_reaches_the_maximal_step_only():
    x = _seq([1.0], [2.0], [-0.5]).requires_grad_()  # V = 1, 3, 2.5: the max is at t = 1
    neuron.NonSpikingIFNode(decode="max-mem")(x).sum().backward()
    assert x.grad.flatten().tolist() == [1.0, 1.0, 0.0]


def test_every_call_starts_from_zero_and_keeps_the_input_dtype():
    node = neuron.NonSpikingLIFNode(decode="last_mem")
    x = torch.ones(2, 3, 4)
    first = node(x)
    assert torch.equal(node(x), first) and first.dtype == torch.float32 and first.shape == (3, 4)
    assert node(x.double()).dtype == torch.float64


def test_multi_step_only_with_an_empty_state_dict():
    node = neuron.NonSpikingLIFNode(tau=3.0, decode="mean-mem")
    assert node.step_mode == "m" and isinstance(node, base.MultiStepModule)
    assert node.state_dict() == {} and list(node.parameters()) == []
    net = nn.Sequential(nn.Linear(2, 2), node)
    functional.set_step_mode(net, "m")
    with pytest.raises(SpikefuseError, match="supports step_mode"):
        functional.set_step_mode(net, "s")
    node(torch.ones(2, 1, 2))
    functional.reset_net(net)  # not a memory: left alone
    assert node.v.shape == (1, 2)
    assert repr(node) == "NonSpikingLIFNode(tau=3.0, decode='mean-mem')"
    assert repr(neuron.NonSpikingIFNode()) == "NonSpikingIFNode(decode=None)"


@pytest.mark.parametrize("bad", ["last-mem", "max", 1, ""])
def test_unknown_decodings_are_refused(bad):
    with pytest.raises(SpikefuseError, match="decode must be one of"):
        neuron.NonSpikingIFNode(decode=bad)
    node = neuron.NonSpikingLIFNode()
    with pytest.raises(SpikefuseError, match="decode must be one of"):
        node.decode = bad
    assert node.decode is None


@pytest.mark.parametrize("bad", [0.0, -2.0, math.nan, math.inf, True, "2"])
def test_tau_must_be_a_positive_finite_float(bad):
    with pytest.raises(SpikefuseError, match="tau must be a finite float > 0"):
        neuron.NonSpikingLIFNode(tau=bad)
    node = neuron.NonSpikingLIFNode(tau=5)
    with pytest.raises(SpikefuseError, match="tau"):
        node.tau = bad
    assert node.tau == 5


@pytest.mark.parametrize(
    ("x", "match"),
    [
        ([1.0, 2.0], "must be a torch.Tensor"),
        (torch.ones(2, 3, dtype=torch.int64), "floating point"),
        (torch.tensor(1.0), r"T >= 1"),
        (torch.ones(0, 3), r"T >= 1"),
    ],
)
def test_bad_input_is_refused(x, match):
    with pytest.raises(SpikefuseError, match=match):
        neuron.NonSpikingIFNode()(x)


def test_base_node_needs_a_charge_and_takes_a_subclass():
    with pytest.raises(NotImplementedError, match="neuronal_charge"):
        neuron.NonSpikingBaseNode()(torch.ones(2, 1))

    class Doubling(neuron.NonSpikingBaseNode):
        def neuronal_charge(self, x: torch.Tensor) -> None:
            self.v = 2.0 * self.v + x

    assert Doubling(decode="last_mem")(torch.ones(3, 1)).item() == 7.0


def test_a_trained_node_copies_and_pickles():
    net = nn.Sequential(nn.Linear(2, 2), neuron.NonSpikingLIFNode(decode="max-abs-mem"))
    net(torch.ones(3, 1, 2)).sum().backward()
    assert net[1].v.requires_grad
    for clone in (copy.deepcopy(net), pickle.loads(pickle.dumps(net))):
        assert not clone[1].v.requires_grad and clone[1].decode == "max-abs-mem"
        assert clone[1].tau == 2.0


# ---- against SpikingJelly -------------------------------------------------------------------------
@pytest.mark.parametrize("decode", DECODES)
@pytest.mark.parametrize("kind", ["IF", "LIF"])
def test_matches_spikingjelly_in_float64(kind, decode):
    sj_neuron = pytest.importorskip("spikingjelly.activation_based.neuron")
    kwargs = {"decode": decode} if kind == "IF" else {"tau": 3.0, "decode": decode}
    theirs = getattr(sj_neuron, f"NonSpiking{kind}Node")(**kwargs)
    ours = getattr(neuron, f"NonSpiking{kind}Node")(**kwargs)
    x = torch.randn(5, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    results = []
    for node in (theirs, ours):
        x_in = x.clone().requires_grad_()
        out = node(x_in)
        out_t = torch.stack(out) if decode is None else out
        (
            out_t * torch.linspace(-1, 1, out_t.numel(), dtype=torch.float64).view_as(out_t)
        ).sum().backward()
        results.append((out_t.detach(), x_in.grad, node.v.detach(), type(out)))
    (a, ga, va, ta), (b, gb, vb, tb) = results
    assert ta is tb
    assert torch.equal(a, b) and torch.equal(ga, gb) and torch.equal(va, vb)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
