"""spikefuse.encoding against SpikingJelly's encoder semantics (written from its docs)."""

from __future__ import annotations

import math

import pytest
import torch

from spikefuse import SpikefuseError, encoding, functional

F64 = torch.float64


def test_poisson_encoder_rate_and_binary():
    torch.manual_seed(0)
    enc = encoding.PoissonEncoder()
    x = torch.tensor([0.0, 0.2, 0.5, 0.9, 1.0]).expand(20000, 5)
    s = enc(x)
    assert s.dtype == x.dtype and set(s.unique().tolist()) <= {0.0, 1.0}
    assert s[:, 0].sum() == 0 and s[:, 4].sum() == 20000
    torch.testing.assert_close(s.mean(0), x[0], atol=0.02, rtol=0)


def test_poisson_encoder_rule_and_step_modes():
    x = torch.rand(3, 4, generator=torch.Generator().manual_seed(1), dtype=F64)
    torch.manual_seed(2)
    s = encoding.PoissonEncoder(step_mode="m")(x)
    torch.manual_seed(2)
    assert torch.equal(s, (torch.rand_like(x) <= x).to(F64))  # SpikingJelly's rand_like(x).le(x)


def test_poisson_encoder_keeps_nan():
    s = encoding.PoissonEncoder()(torch.tensor([0.5, math.nan]))
    assert math.isnan(s[1].item())


@pytest.mark.parametrize("enc_function", ["linear", "log"])
def test_latency_encoder(enc_function):
    T = 5
    x = torch.tensor([[0.0, 0.3, 0.5, 1.0]], dtype=F64)
    enc = encoding.LatencyEncoder(T, enc_function=enc_function)
    spikes = torch.stack([enc(x) for _ in range(T)])
    assert spikes.shape == (T, 1, 4) and torch.equal(spikes.sum(0), torch.ones(1, 4, dtype=F64))
    if enc_function == "linear":
        t_f = ((T - 1) * (1 - x)).round()
    else:
        alpha = math.exp(T - 1) - 1
        t_f = (T - 1 - torch.log(alpha * x + 1)).round()
    assert torch.equal(spikes.argmax(0).to(F64), t_f)
    # the t-th call returns spike[t % T]: the period restarts
    assert torch.equal(enc(x), spikes[0])
    functional.reset_net(enc)
    assert enc.spike is None and enc.t == 0


def test_latency_encoder_validates():
    with pytest.raises(SpikefuseError, match="enc_function"):
        encoding.LatencyEncoder(4, enc_function="exp")
    with pytest.raises(SpikefuseError, match=r"\[0, 1\]"):
        encoding.LatencyEncoder(4)(torch.tensor([1.5]))
    with pytest.raises(SpikefuseError, match="T must be"):
        encoding.LatencyEncoder(0)


def test_weighted_phase_encoder_paper_table():
    enc = encoding.WeightedPhaseEncoder(K=8)
    x = torch.tensor([192 / 256, 1 / 256, 128 / 256, 255 / 256])
    spikes = torch.stack([enc(x) for _ in range(8)])
    assert spikes[:, 0].tolist() == [1, 1, 0, 0, 0, 0, 0, 0]
    assert spikes[:, 1].tolist() == [0, 0, 0, 0, 0, 0, 0, 1]
    assert spikes[:, 2].tolist() == [1, 0, 0, 0, 0, 0, 0, 0]
    assert spikes[:, 3].tolist() == [1] * 8
    weights = torch.tensor([2.0**-k for k in range(1, 9)])
    torch.testing.assert_close((spikes * weights[:, None]).sum(0), x)
    with pytest.raises(SpikefuseError, match="WeightedPhaseEncoder"):
        encoding.WeightedPhaseEncoder(K=2)(torch.tensor([0.8]))


def test_periodic_encoder_multi_step_and_reset():
    train = (torch.rand(3, 2, 4, generator=torch.Generator().manual_seed(3)) > 0.5).float()
    enc = encoding.PeriodicEncoder(train, step_mode="m")
    out = enc(torch.zeros(7, 2, 4))
    assert torch.equal(out, train[torch.arange(7) % 3])
    functional.reset_net(enc)
    assert torch.equal(enc(torch.zeros(2, 2, 4)), train[:2])


def test_weighted_phase_spikes_are_in_the_default_dtype_and_periodic_train_moves():
    x = torch.tensor([0.75, 0.25], dtype=torch.float64)
    spikes = encoding.WeightedPhaseEncoder(K=2).single_step_encode(x)
    assert spikes.dtype == torch.float32 and spikes.tolist() == [[1.0, 0.0], [1.0, 1.0]]
    periodic = torch.nn.Sequential(encoding.PeriodicEncoder(torch.ones(3, 2))).double()
    assert periodic[0](x).dtype == torch.float64
    functional.reset_net(periodic)
    assert periodic[0](x).dtype == torch.float64
