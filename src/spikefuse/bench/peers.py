"""SpikingJelly 2.0 as a benchmark peer: the benchmark's networks built from its own layers,
neurons and model zoo (:mod:`spikingjelly.activation_based`), when it is installed.

SpikingJelly is not a dependency of spikefuse: ``pip install spikingjelly==2.0.0`` to measure it.
Its ``LIFNode`` picks its own multi-step implementation (it has no ``backend`` argument), so the
variant measures SpikingJelly as its users run it by default.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

from torch import nn

from .networks import SDT_CIFAR, SJ_LIF, ZOO, layered_model

# The SpikingJelly model-zoo function (or class) of each zoo network (module, name, kwargs).
SJ_ZOO: dict[str, tuple[str, str, dict[str, object]]] = {
    "sew-resnet18": ("sew_resnet", "sew_resnet18", {"cnf": "ADD"}),
    "sew-resnet34": ("sew_resnet", "sew_resnet34", {"cnf": "ADD"}),
    "spiking-resnet18": ("spiking_resnet", "spiking_resnet18", {}),
    "spiking-resnet34": ("spiking_resnet", "spiking_resnet34", {}),
    "spikformer-4-384-cifar": ("spikformer", "spikformer_cifar10", {}),
    "qkformer-10-384-cifar": ("qkformer", "qkformer_10_384", {"num_classes": 10}),
    "sdt-2-512-cifar": ("spike_driven_transformer", "SpikeDrivenTransformer", SDT_CIFAR),
}


def spikingjelly() -> SimpleNamespace:
    """SpikingJelly's ``functional``, ``layer``, ``neuron`` and ``surrogate`` modules, or a
    RuntimeError saying how to install it."""
    try:
        return SimpleNamespace(
            **{
                name: importlib.import_module(f"spikingjelly.activation_based.{name}")
                for name in ("functional", "layer", "neuron", "surrogate")
            }
        )
    except ImportError as error:
        raise RuntimeError(
            f"the spikingjelly variant needs SpikingJelly 2.0 ({error}); "
            "pip install spikingjelly==2.0.0"
        ) from error


def spikingjelly_model(model: str, T: int | None = None) -> nn.Module:
    """Benchmark network ``model`` made of SpikingJelly's modules, multi-step, with the LIF
    options of :data:`~.networks.SJ_LIF` and SpikingJelly's default surrogate (Sigmoid); ``T``:
    the time steps of a static zoo network (None: its builder's default)."""
    sj = spikingjelly()
    options = {key: value for key, value in SJ_LIF.items() if key != "step_mode"}

    def make_neuron() -> nn.Module:
        return sj.neuron.LIFNode(
            **options, surrogate_function=sj.surrogate.Sigmoid(), step_mode="m"
        )

    if model not in ZOO:
        return layered_model(model, sj.layer, make_neuron)
    if model not in SJ_ZOO:
        raise RuntimeError(f"SpikingJelly's model zoo has no {model!r}")
    module, name, kwargs = SJ_ZOO[model]
    if T is not None and ZOO[model].static:
        kwargs = {**kwargs, "T": T}
    zoo = importlib.import_module(f"spikingjelly.activation_based.model.{module}")
    net = getattr(zoo, name)(
        spiking_neuron=sj.neuron.LIFNode,
        surrogate_function=sj.surrogate.Sigmoid(),
        **options,
        **kwargs,
    )
    sj.functional.set_step_mode(net, "m")
    return net
