"""``spikefuse.neuron`` as a package: every public name at its old path, and whole models that
pickle by that path (so pickles of either layout load)."""

from __future__ import annotations

import importlib
import io
import pickle
import pickletools

import pytest
import torch
from torch import nn

from spikefuse import definitions, neuron

STEP = torch.rand(2, 3, generator=torch.Generator().manual_seed(0)) * 2  # [N, C]
SEQUENCE = torch.rand(4, 2, 3, generator=torch.Generator().manual_seed(1)) * 2  # [T, N, C]

# (class name, constructor, input; None: an abstract class, pickled without a call)
NEURONS = [
    ("BaseNode", lambda: neuron.BaseNode(definitions.LIF, {"tau": 2.0}), STEP),
    ("SimpleBaseNode", lambda: neuron.SimpleBaseNode(), None),
    ("IFNode", lambda: neuron.IFNode(v_threshold=0.5), STEP),
    ("LIFNode", lambda: neuron.LIFNode(step_mode="m"), SEQUENCE),
    ("ParametricLIFNode", lambda: neuron.ParametricLIFNode(init_tau=3.0), STEP),
    ("QIFNode", lambda: neuron.QIFNode(), STEP),
    ("EIFNode", lambda: neuron.EIFNode(), STEP),
    ("IzhikevichNode", lambda: neuron.IzhikevichNode(step_mode="m"), SEQUENCE),
    ("SimpleLIFNode", lambda: neuron.SimpleLIFNode(2.0, True), STEP),
    ("SLTTLIFNode", lambda: neuron.SLTTLIFNode(), STEP),
    ("OTTTLIFNode", lambda: neuron.OTTTLIFNode(), STEP),
    ("NonSpikingBaseNode", lambda: neuron.NonSpikingBaseNode(), None),
    ("NonSpikingIFNode", lambda: neuron.NonSpikingIFNode(decode="max-abs-mem"), SEQUENCE),
    ("NonSpikingLIFNode", lambda: neuron.NonSpikingLIFNode(), SEQUENCE),
]


def test_every_public_name_is_at_the_module_path():
    # the public names of the single-file module, and the non-spiking neurons
    names = {name for name, _, _ in NEURONS} | {
        "StepModeMixin",
        "SingleStepModule",
        "MultiStepModule",
        "MemoryModule",
        "TORCH_CODE_HOOKS",
        "TORCH_CODE_BACKENDS",
        "NON_SPIKING_DECODES",
        "decode_membrane",
        "log",
    }
    assert set(neuron.__all__) == names
    module = importlib.import_module("spikefuse.neuron")
    for name in names:
        value = getattr(module, name)  # what ``from spikefuse.neuron import name`` reads
        if isinstance(value, type):
            assert value.__module__ == "spikefuse.neuron", name


def _outputs(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    out = model(x)
    return list(out) if isinstance(out, list) else [out]


def _neuron_paths(data: bytes) -> set[str]:
    """The strings in a pickle that name ``spikefuse.neuron`` or a module under it."""
    return {
        arg
        for op, arg, _ in pickletools.genops(data)
        if isinstance(arg, str) and arg.startswith("spikefuse.neuron")
    }


@pytest.mark.parametrize(("name", "make", "x"), NEURONS, ids=[n for n, _, _ in NEURONS])
def test_a_model_with_each_neuron_pickles_by_the_module_path(name, make, x):
    torch.manual_seed(0)
    width = 3 if x is None else x.shape[-1]
    model = nn.Sequential(nn.Linear(width, width), make()).eval()
    if x is not None:
        _outputs(model, x)  # the states are tensors now
    data = pickle.dumps(model)
    assert _neuron_paths(data) == {"spikefuse.neuron"}
    buffer = io.BytesIO()
    torch.save(model, buffer)
    clones = [pickle.loads(data), torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)]
    expected = _outputs(model, x) if x is not None else []
    for clone in clones:
        assert type(clone[1]) is getattr(neuron, name)
        assert clone.state_dict().keys() == model.state_dict().keys()
        if x is not None:  # the same next step from the same states
            for a, b in zip(_outputs(clone, x), expected, strict=True):
                assert torch.equal(a, b)
