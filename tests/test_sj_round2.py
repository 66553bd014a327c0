"""Real-script-style compatibility: user attributes on neurons, SpikingJelly module paths."""

from __future__ import annotations

import torch
from torch import nn

from spikefuse import encoding, functional, layer, neuron, surrogate

F64 = torch.float64


def _lif_reference(x_seq: torch.Tensor, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """SpikingJelly's LIFNode (decay_input, hard reset to 0): V after reset and S, per step."""
    v = torch.zeros_like(x_seq[0])
    vs, ss = [], []
    for x in x_seq:
        h = v + (x - v) / tau
        s = (h >= 1.0).to(x.dtype)
        v = h * (1 - s)
        vs.append(v)
        ss.append(s)
    return torch.stack(vs), torch.stack(ss)


def test_lif_fc_mnist_hook_records_v_seq_and_s_seq():
    """SpikingJelly's lif_fc_mnist example, after training: ``v_seq``/``s_seq`` set to lists on
    the output layer, a forward hook appends to them, then they are concatenated."""
    torch.manual_seed(0)
    net = nn.Sequential(
        layer.Flatten(),
        layer.Linear(28 * 28, 10, bias=False),
        neuron.LIFNode(tau=2.0, surrogate_function=surrogate.ATan()),
    ).to(F64)
    encoder = encoding.PoissonEncoder()
    output_layer = net[-1]
    output_layer.v_seq = []
    output_layer.s_seq = []

    def save_hook(m, x, y):
        m.v_seq.append(m.v.unsqueeze(0))
        m.s_seq.append(y.unsqueeze(0))

    output_layer.register_forward_hook(save_hook)
    img = torch.rand(1, 1, 28, 28, dtype=F64) * 3
    inputs = []
    with torch.no_grad():
        out_fr = 0.0
        for _ in range(8):
            encoded = encoder(img)
            inputs.append(net[1](net[0](encoded)))
            out_fr += net(encoded)
        output_layer.v_seq = torch.cat(output_layer.v_seq)
        output_layer.s_seq = torch.cat(output_layer.s_seq)
    want_v, want_s = _lif_reference(torch.stack(inputs), 2.0)
    assert output_layer.v_seq.shape == (8, 1, 10)
    torch.testing.assert_close(output_layer.v_seq, want_v, rtol=0, atol=1e-12)
    assert torch.equal(output_layer.s_seq, want_s)
    assert torch.equal(out_fr, want_s.sum(0))


def test_user_attributes_survive_forward_and_reset_as_in_spikingjelly():
    """store_v_seq=False: forward leaves ``v_seq`` alone; reset() sets it to None (SpikingJelly's
    BaseNode.reset) and leaves every attribute it does not manage."""
    for mode, x in (("s", torch.rand(2, 3)), ("m", torch.rand(4, 2, 3))):
        node = neuron.LIFNode(step_mode=mode)
        node.v_seq, node.s_seq, node.note = ["mine"], ["also mine"], 7
        node(x)
        assert node.v_seq == ["mine"] and node.s_seq == ["also mine"]
        node.step_mode = "m" if mode == "s" else "s"
        assert node.v_seq == ["mine"]  # SpikingJelly's step_mode setter leaves it
        functional.reset_net(node)
        assert node.v_seq is None and node.s_seq == ["also mine"] and node.note == 7


def test_simple_base_node_reset_leaves_v_seq():
    class Square(neuron.SimpleBaseNode):
        def neuronal_charge(self, x):
            self.v = self.v + x * x

    node = Square()
    node.v_seq = []
    node.register_forward_hook(lambda m, x, y: m.v_seq.append(m.v))
    node(torch.ones(2))
    node.reset()
    assert len(node.v_seq) == 1  # SimpleBaseNode has no v_seq of its own


def test_store_v_seq_assignment_drops_a_user_value_as_in_spikingjelly():
    node = neuron.IFNode(step_mode="m")
    node.v_seq = []
    node.store_v_seq = False
    assert node.v_seq is None
    node.store_v_seq = True
    node(torch.rand(3, 2))
    assert node.v_seq.shape == (3, 2)
