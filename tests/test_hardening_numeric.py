"""Numeric edges and unclear errors: constants checked in the float32 arithmetic the neurons
use, encoders exact for long sequences, numpy scalars accepted as numbers (as torch does), and
integer tensors or wrong ranks refused by the layers with errors that say so."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from spikefuse import SpikefuseError, encoding, layer, neuron


# ---- constants in the neurons' arithmetic -------------------------------------------------------
@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: neuron.IFNode(v_threshold=1.0 + 1e-9, v_reset=1.0),
            r"v_threshold must be > v_reset, but 1.000000001 is so only in float64; in float32.*"
            r"fire on every step",
        ),
        (lambda: neuron.LIFNode(tau=1.0 + 1e-9), r"tau must be > 1.0, but .* only in float64"),
        (lambda: neuron.IFNode(v_threshold=1e39), r"v_threshold=1e\+39 overflows float32"),
        (lambda: neuron.LIFNode(v_reset=-1e39), r"v_reset=-1e\+39 overflows float32"),
    ],
    ids=["threshold-equals-reset", "tau-equals-1", "threshold-overflows", "reset-overflows"],
)
def test_constants_are_checked_in_float32(make, message: str) -> None:
    with pytest.raises(SpikefuseError, match=message):
        make()


def test_a_constant_change_is_checked_in_float32_too() -> None:
    node = neuron.IFNode(v_threshold=2.0, v_reset=1.0)
    with pytest.raises(SpikefuseError, match="only in float64"):
        node.v_threshold = 1.0 + 1e-12
    assert node.v_threshold == 2.0  # left as it was


# ---- encoders on long sequences ---------------------------------------------------------------
def latency_steps(encoder: encoding.LatencyEncoder, x: torch.Tensor) -> torch.Tensor:
    return encoder.single_step_encode(x).argmax(0)


@pytest.mark.parametrize("T", [100, 800])
def test_the_log_latency_encoder_is_exact_for_long_sequences(T: int) -> None:
    x = torch.tensor([0.0, 1e-30, 0.5, 1.0])
    steps = latency_steps(encoding.LatencyEncoder(T, "log"), x)
    # T - 1 - ln(alpha x + 1), alpha = e^(T-1) - 1, in exact arithmetic
    log_alpha = T - 1 + math.log1p(-math.exp(1 - T))
    expected = [T - 1, round(T - 1 - np.logaddexp(0, log_alpha + math.log(1e-30))), 1, 0]
    assert steps.tolist() == expected
    assert torch.equal(latency_steps(encoding.LatencyEncoder(T, "log"), x.double()), steps)


def test_the_linear_latency_encoder_is_exact_beyond_float32_integers() -> None:
    T = 2**24 + 2  # T - 1 = 2^24 + 1 rounds to 2^24 in float32
    encoder = encoding.LatencyEncoder(T)
    assert latency_steps(encoder, torch.tensor([0.0])).tolist() == [T - 1]


def test_short_sequences_keep_spikingjellys_float32_arithmetic() -> None:
    x = torch.rand(1000, generator=torch.Generator().manual_seed(0))
    alpha = math.exp(7.0) - 1.0
    expected = (8 - 1.0 - torch.log(alpha * x + 1.0)).round().long()
    assert torch.equal(latency_steps(encoding.LatencyEncoder(8, "log"), x), expected)


def test_the_weighted_phase_encoder_never_spikes_below_the_inputs_precision() -> None:
    x = torch.tensor([0.75, 2.0**-149, 0.0])  # 2^-149: float32's smallest value
    spikes = encoding.WeightedPhaseEncoder(200).single_step_encode(x)
    assert spikes.sum(0).tolist() == [2.0, 1.0, 0.0]
    assert spikes[148, 1] == 1  # phase 149 carries 2^-149


def test_the_weighted_phase_bound_is_checked_in_the_inputs_dtype() -> None:
    # 1 - 2^-30 rounds to 1.0 in float32: x = 1.0 would spike in every phase, sum 1 - 2^-30
    with pytest.raises(SpikefuseError, match=r"\[0, 1 - 2\^-K\] \(K=30\), in torch.float32"):
        encoding.WeightedPhaseEncoder(30).single_step_encode(torch.tensor([1.0]))
    below_one = torch.tensor([1 - 2.0**-24])  # float32's largest value below 1
    spikes = encoding.WeightedPhaseEncoder(30).single_step_encode(below_one)
    assert spikes.sum().item() == 24


# ---- numpy scalars are numbers --------------------------------------------------------------
@pytest.mark.parametrize(
    "make",
    [
        lambda: encoding.LatencyEncoder(np.int64(8)),
        lambda: encoding.WeightedPhaseEncoder(np.int32(8)),
        lambda: layer.Dropout(np.float32(0.5)),
        lambda: layer.Dropout2d(np.float64(0.2)),
        lambda: layer.VotingLayer(np.int64(2)),
        lambda: layer.SynapseFilter(np.float32(5.0)),
        lambda: layer.Linear(np.int64(8), np.int64(4)),
    ],
    ids=["latency", "phase", "dropout", "dropout2d", "voting", "synapse", "linear"],
)
def test_numpy_scalars_are_taken_as_numbers(make) -> None:
    neuron.LIFNode(tau=np.float32(2.0), v_threshold=np.float64(0.5))  # as before
    module = make()
    for name in ("T", "p", "voting_size", "tau"):
        value = getattr(module, name, None)
        assert value is None or type(value) in (int, float), (name, type(value))


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: encoding.LatencyEncoder(8.0), r"T must be an int >= 1, got 8.0 \(float\)"),
        (lambda: encoding.LatencyEncoder(True), r"got True \(bool\)"),
        (lambda: encoding.WeightedPhaseEncoder(0), r"K must be an int >= 1, got 0 \(int\)"),
        (lambda: layer.Dropout("0.5"), r"p must be in \[0, 1\) \(a number\), got '0.5' \(str\)"),
        (lambda: layer.VotingLayer(2.0), r"voting_size must be an int >= 1, got 2.0 \(float\)"),
        (lambda: layer.SynapseFilter(True), r"got True \(bool\)"),
    ],
)
def test_a_wrong_type_is_named_as_the_problem(make, message: str) -> None:
    with pytest.raises(SpikefuseError, match=message):
        make()


# ---- integer tensors and wrong ranks at the layers ----------------------------------------------
@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
@pytest.mark.parametrize(
    "make, shape",
    [
        (lambda: layer.Dropout(0.5), (2, 3)),
        (lambda: layer.Dropout(0.5, step_mode="m"), (2, 3, 4)),
        (lambda: layer.Dropout2d(0.5, step_mode="m"), (2, 1, 3, 4, 4)),
        (lambda: layer.Linear(4, 2, step_mode="m"), (2, 3, 4)),
        (lambda: layer.Conv2d(3, 2, 3, step_mode="m"), (2, 1, 3, 5, 5)),
        (lambda: layer.BatchNorm2d(3, step_mode="m"), (2, 1, 3, 5, 5)),
    ],
    ids=["dropout", "dropout-m", "dropout2d-m", "linear-m", "conv2d-m", "batchnorm2d-m"],
)
def test_integer_input_is_refused_with_a_clear_error(make, shape, dtype) -> None:
    with pytest.raises(SpikefuseError, match=f"input must be a floating-point tensor, got {dtype}"):
        make()(torch.ones(shape, dtype=dtype))


@pytest.mark.parametrize(
    "flatten, shape",
    [
        (layer.Flatten(step_mode="m"), (3, 4)),
        (layer.Flatten(2, step_mode="m"), (3, 4, 5)),
        (layer.Flatten(0, step_mode="m"), (3, 4, 5)),
        (layer.Flatten(), (4,)),
    ],
    ids=["m-no-sample-dims", "m-start-beyond", "m-batch", "s-no-sample-dims"],
)
def test_flatten_names_the_dimensions_it_needs(flatten: layer.Flatten, shape) -> None:
    with pytest.raises(
        SpikefuseError, match=rf"needs dimensions .* of shape {re.escape(str(shape))}"
    ):
        flatten(torch.ones(shape))


def test_flatten_still_flattens() -> None:
    x = torch.arange(2 * 3 * 4 * 5.0).reshape(2, 3, 4, 5)
    assert layer.Flatten(step_mode="m")(x).shape == (2, 3, 20)
    assert layer.Flatten(step_mode="m")(x[..., 0]).shape == (2, 3, 4)
    assert layer.Flatten(-2, step_mode="m")(x).shape == (2, 3, 20)
    assert torch.equal(layer.Flatten()(x), torch.nn.Flatten()(x))


def test_a_training_config_takes_numpy_numbers_as_python_numbers() -> None:
    from spikefuse.train import TrainConfig

    config = TrainConfig(
        epochs=np.int64(3), lr=np.float32(0.5), seed=np.uint32(5), limit=np.int16(50)
    )
    values = (config.epochs, config.lr, config.seed, config.limit)
    assert values == (3, 0.5, 5, 50) and [type(v) for v in values] == [int, float, int, int]
    assert type(config.model_config()["seed"]) is int  # what the checkpoint records
    with pytest.raises(SpikefuseError, match="--epochs must be a whole number >= 1, got np.True_"):
        TrainConfig(epochs=np.bool_(True))


@pytest.mark.parametrize("num_classes", [0, -1, 10.0, True])
@pytest.mark.parametrize("zoo", ["spiking_resnet18", "spiking_resnet19", "spiking_vgg11_bn"])
def test_the_zoo_refuses_a_class_count_that_is_not_a_count(zoo: str, num_classes) -> None:
    from spikefuse import models

    make = getattr(models, zoo)
    with pytest.raises(
        SpikefuseError, match=rf"num_classes must be an int >= 1, got {num_classes}"
    ):
        make(spiking_neuron=neuron.IFNode, num_classes=num_classes)


def test_the_zoo_takes_numpy_counts() -> None:
    from spikefuse import models

    net = models.spiking_vgg11_bn(
        spiking_neuron=neuron.IFNode, num_classes=np.int64(3), classifier_features=np.int32(8)
    )
    assert net.classifier[-1].out_features == 3 and net.classifier[0].out_features == 8
