"""SpikingJelly's monitors, used as its tutorials and examples use them."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from spikefuse import functional, layer, monitor, neuron
from spikefuse.errors import SpikefuseError

F64 = torch.float64


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(
        layer.Linear(8, 4), neuron.IFNode(), layer.Linear(4, 2), neuron.IFNode()
    ).to(F64)
    functional.set_step_mode(net, "m")
    return net


def test_output_monitor_records_firing_rates_per_layer():
    net = _net()
    spike_seq_monitor = monitor.OutputMonitor(net, neuron.IFNode)
    rate_monitor = monitor.OutputMonitor(net, neuron.IFNode, lambda s: s.mean().item())
    x = torch.rand(4, 3, 8, dtype=F64) * 2
    with torch.no_grad():
        out = net(x)
    assert spike_seq_monitor.monitored_layers == ["1", "3"]
    assert torch.equal(spike_seq_monitor["3"][0], out)
    assert torch.equal(spike_seq_monitor.records[1], out)
    assert rate_monitor["3"] == [out.mean().item()]
    spike_seq_monitor.disable()
    net(x)
    assert len(spike_seq_monitor.records) == 2 and len(rate_monitor.records) == 4
    spike_seq_monitor.enable()
    spike_seq_monitor.clear_recorded_data()
    assert spike_seq_monitor.records == [] and spike_seq_monitor["1"] == []
    spike_seq_monitor.remove_hooks()
    net(x)
    assert spike_seq_monitor.records == []


def test_input_and_attribute_monitors():
    net = _net()
    inputs = monitor.InputMonitor(net, neuron.IFNode)
    v_after = monitor.AttributeMonitor("v", False, net, neuron.IFNode)
    v_before = monitor.AttributeMonitor("v", True, net, instance=neuron.IFNode)
    x = torch.rand(4, 3, 8, dtype=F64)
    with torch.no_grad():
        net(x)
        h = net[0](x)
    torch.testing.assert_close(inputs["1"][0], h, rtol=0, atol=0)
    assert v_before["1"] == [0.0]  # the float V before the first call, as in SpikingJelly
    assert torch.equal(v_after["1"][0], net[1].v)


def test_grad_monitors():
    net = _net()
    grad_out = monitor.GradOutputMonitor(net, neuron.IFNode)
    grad_in = monitor.GradInputMonitor(net, neuron.IFNode)
    x = torch.rand(4, 3, 8, dtype=F64, requires_grad=True) * 3
    net(x).sum().backward()
    assert torch.equal(grad_out["3"][0], torch.ones(4, 3, 2, dtype=F64))
    assert grad_in["3"][0].shape == (4, 3, 2) and grad_in["1"][0].shape == (4, 3, 4)
    assert grad_out.monitored_layers == ["1", "3"]


def test_default_instance_is_the_net_type_and_bad_index_raises():
    net = _net()
    mon = monitor.OutputMonitor(net)
    assert mon.monitored_layers == [""]
    with pytest.raises(SpikefuseError, match="indexed by int or layer name"):
        mon[1.5]


def test_close_removes_the_hooks_and_keeps_the_records():
    net = _net()
    mon = monitor.OutputMonitor(net, neuron.IFNode)
    x = torch.rand(4, 3, 8, dtype=F64) * 2
    net(x)
    mon.close()
    assert not mon.is_enable() and mon.hooks == [] and len(mon.records) == 2
    assert not net[1]._forward_hooks and not net[3]._forward_hooks
    mon.close()  # idempotent
    mon.enable()  # no hooks left: nothing is recorded any more
    net(x)
    assert len(mon.records) == 2 and len(mon["3"]) == 1


def test_a_monitor_is_a_context_manager_that_closes_on_exit():
    net = _net()
    x = torch.rand(4, 3, 8, dtype=F64) * 2
    with monitor.AttributeMonitor("v", False, net, neuron.IFNode) as mon:
        net(x)
    assert len(mon.records) == 2 and mon.hooks == [] and not net[1]._forward_hooks
    with pytest.raises(RuntimeError, match="inside"), monitor.InputMonitor(net) as inputs:
        raise RuntimeError("raised inside the block")  # propagates, and the monitor closes
    assert inputs.hooks == [] and not net._forward_hooks


def test_garbage_collection_closes_and_leaves_the_records():
    net = _net()
    mon = monitor.OutputMonitor(net, neuron.IFNode)
    net(torch.rand(4, 3, 8, dtype=F64) * 2)
    records, collected = mon.records, weakref.ref(mon)
    del mon, net  # the hooks hold the monitor: it goes with the network
    gc.collect()
    assert collected() is None and len(records) == 2  # SpikingJelly's __del__ keeps them too
