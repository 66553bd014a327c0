"""SpikingJelly's example networks and training loops, rewritten from its public examples and
tutorials with only the import changed, run for one training step on tiny synthetic data."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from spikefuse import encoding, functional, layer, neuron, surrogate


def train_step(net, loss_fn, *args) -> float:
    """One SGD step, as in SpikingJelly's training loops (reset after each batch)."""
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    before = [p.detach().clone() for p in net.parameters()]
    optimizer.zero_grad()
    loss = loss_fn(*args)
    loss.backward()
    optimizer.step()
    functional.reset_net(net)
    assert torch.isfinite(loss)
    assert any(not torch.equal(b, p) for b, p in zip(before, net.parameters(), strict=True))
    return loss.item()


# ---- conv_fashion_mnist.py: the Fashion-MNIST CSNN -----------------------------------------------
class CSNN(nn.Module):
    def __init__(self, T: int, channels: int, use_cupy=False):
        super().__init__()
        self.T = T

        self.conv_fc = nn.Sequential(
            layer.Conv2d(1, channels, kernel_size=3, padding=1, bias=False),
            layer.BatchNorm2d(channels),
            neuron.IFNode(surrogate_function=surrogate.ATan()),
            layer.MaxPool2d(2, 2),  # 14 * 14
            layer.Conv2d(channels, channels, kernel_size=3, padding=1, bias=False),
            layer.BatchNorm2d(channels),
            neuron.IFNode(surrogate_function=surrogate.ATan()),
            layer.MaxPool2d(2, 2),  # 7 * 7
            layer.Flatten(),
            layer.Linear(channels * 7 * 7, channels * 4 * 4, bias=False),
            neuron.IFNode(surrogate_function=surrogate.ATan()),
            layer.Linear(channels * 4 * 4, 10, bias=False),
            neuron.IFNode(surrogate_function=surrogate.ATan()),
        )

        functional.set_step_mode(self, step_mode="m")

        if use_cupy:
            functional.set_backend(self, backend="cupy")

    def forward(self, x: torch.Tensor):
        # x.shape = [N, C, H, W]
        x_seq = x.unsqueeze(0).repeat(self.T, 1, 1, 1, 1)  # [N, C, H, W] -> [T, N, C, H, W]
        x_seq = self.conv_fc(x_seq)
        fr = x_seq.mean(0)
        return fr


def test_fashion_mnist_csnn_trains():
    torch.manual_seed(0)
    net = CSNN(T=4, channels=8)
    img = torch.rand(4, 1, 28, 28) * 3
    label = torch.tensor([0, 3, 7, 9])

    def loss_fn(img, label):
        label_onehot = F.one_hot(label, 10).float()
        out_fr = net(img)
        return F.mse_loss(out_fr, label_onehot)

    train_step(net, loss_fn, img, label)
    net.eval()
    with torch.no_grad():
        assert net(img).shape == (4, 10)
    functional.reset_net(net)


# ---- lif_fc_mnist.py: one LIF layer with a Poisson encoder, single-step loop over T --------------
class SNN(nn.Module):
    def __init__(self, tau):
        super().__init__()

        self.layer = nn.Sequential(
            layer.Flatten(),
            layer.Linear(28 * 28, 10, bias=False),
            neuron.LIFNode(tau=tau, surrogate_function=surrogate.ATan()),
        )

    def forward(self, x: torch.Tensor):
        return self.layer(x)


def test_lif_fc_mnist_with_poisson_encoder_trains():
    torch.manual_seed(1)
    T = 6
    net = SNN(tau=2.0)
    encoder = encoding.PoissonEncoder()
    img = torch.rand(5, 1, 28, 28)
    label = torch.tensor([1, 2, 3, 4, 5])

    def loss_fn(img, label):
        label_onehot = F.one_hot(label, 10).float()
        out_fr = 0.0
        for _ in range(T):
            encoded_img = encoder(img)
            out_fr += net(encoded_img)
        out_fr = out_fr / T
        return F.mse_loss(out_fr, label_onehot)

    train_step(net, loss_fn, img, label)


# ---- parametric_lif_net.py: the DVS128 Gesture net (PLIF, per-sequence dropout, voting) ----------
class DVSGestureNet(nn.Module):
    def __init__(self, channels=128, spiking_neuron: callable = None, *args, **kwargs):
        super().__init__()

        conv = []
        for i in range(5):  # noqa: B007 (SpikingJelly's code as written)
            if conv.__len__() == 0:
                in_channels = 2
            else:
                in_channels = channels

            conv.append(layer.Conv2d(in_channels, channels, kernel_size=3, padding=1, bias=False))
            conv.append(layer.BatchNorm2d(channels))
            conv.append(spiking_neuron(*args, **kwargs))
            conv.append(layer.MaxPool2d(2, 2))

        self.conv_fc = nn.Sequential(
            *conv,
            layer.Flatten(),
            layer.Dropout(0.5),
            layer.Linear(channels * 4 * 4, 512),
            spiking_neuron(*args, **kwargs),
            layer.Dropout(0.5),
            layer.Linear(512, 110),
            spiking_neuron(*args, **kwargs),
            layer.VotingLayer(10),
        )

    def forward(self, x: torch.Tensor):
        return self.conv_fc(x)


def test_dvs_gesture_plif_net_trains():
    torch.manual_seed(2)
    net = DVSGestureNet(
        channels=4,
        spiking_neuron=neuron.ParametricLIFNode,
        surrogate_function=surrogate.ATan(),
        detach_reset=True,
    )
    functional.set_step_mode(net, "m")
    frame = (torch.rand(2, 3, 2, 128, 128) > 0.7).float()  # [N, T, C, H, W] from the dataset
    label = torch.tensor([0, 10])

    def loss_fn(frame, label):
        frame = frame.transpose(0, 1)  # [N, T, C, H, W] -> [T, N, C, H, W]
        label_onehot = F.one_hot(label, 11).float()
        out_fr = net(frame).mean(0)
        return F.mse_loss(out_fr, label_onehot)

    dropouts = [m for m in net.modules() if isinstance(m, layer.Dropout)]
    train_step(net, loss_fn, frame, label)
    assert all(d.mask is None for d in dropouts)  # reset_net drew them anew for the next batch
    plif = [m for m in net.modules() if isinstance(m, neuron.ParametricLIFNode)]
    assert len(plif) == 7 and all(m.w.grad is not None for m in plif)


# ---- rsnn_sequential_fmnist.py: the recurrent and stateful-synapse nets --------------------------
class StatefulSynapseNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Sequential(
            layer.Linear(28, 32),
            neuron.IFNode(surrogate_function=surrogate.ATan()),
            layer.SynapseFilter(tau=2.0, learnable=True),
            layer.Linear(32, 10),
            neuron.IFNode(surrogate_function=surrogate.ATan()),
        )

    def forward(self, x: torch.Tensor):
        return self.fc(x).mean(0)


class FeedBackNet(nn.Module):
    def __init__(self):
        super().__init__()

        self.fc = nn.Sequential(
            layer.Linear(28, 32),
            layer.LinearRecurrentContainer(
                neuron.IFNode(surrogate_function=surrogate.ATan(), detach_reset=True),
                in_features=32,
                out_features=32,
                bias=True,
            ),
            layer.Linear(32, 10),
            neuron.IFNode(surrogate_function=surrogate.ATan()),
        )

    def forward(self, x: torch.Tensor):
        return self.fc(x).mean(0)


def test_sequential_fmnist_recurrent_nets_train():
    for seed, cls in enumerate((StatefulSynapseNet, FeedBackNet)):
        torch.manual_seed(10 + seed)
        net = cls()
        functional.set_step_mode(net, "m")
        img = torch.rand(3, 1, 28, 28) * 2
        label = torch.tensor([2, 4, 6])

        def loss_fn(img, label, net=net):
            img = img.squeeze(1)  # [N, 1, H, W] -> [N, H, W]
            img = img.permute(2, 0, 1)  # [N, H, W] -> [W, N, H]
            label_onehot = F.one_hot(label, 10).float()
            out_fr = net(img)
            return F.mse_loss(out_fr, label_onehot)

        train_step(net, loss_fn, img, label)
