"""The end-to-end benchmark's spiking transformer rows: each network builds and trains one step
in the variants that run on CPU, fed the static images SpikingJelly's transformer builders take
(they repeat them over T themselves) and with the time-averaged logits of those that average."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from spikefuse.bench import e2e
from spikefuse.bench.networks import ZOO

TRANSFORMERS = ["spikformer-4-384-cifar", "qkformer-10-384-cifar", "sdt-2-512-cifar"]
VARIANTS = ["vanilla", "spikefuse", "fused"]
if importlib.util.find_spec("spikingjelly") is not None:
    VARIANTS.append("spikingjelly")


@pytest.fixture(autouse=True)
def _fast_init(monkeypatch: pytest.MonkeyPatch) -> None:
    """The 384-wide models' weight initialisation is the slow part on CPU, and unused here."""
    monkeypatch.setattr(torch.nn.init, "trunc_normal_", lambda tensor, *_, **__: tensor)


@pytest.mark.parametrize("model", TRANSFORMERS)
def test_transformer_rows_are_static_zoo_nets_at_cifar_size(model: str) -> None:
    zoo = ZOO[model]
    assert (zoo.static, zoo.image_size, zoo.num_classes, zoo.T, zoo.batch) == (True, 32, 10, 4, 64)
    assert e2e.build("spikefuse", model, torch.device("cpu"), T=2).T == 2


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("model", TRANSFORMERS)
def test_transformer_rows_train_one_step(model: str, variant: str) -> None:
    torch.manual_seed(0)
    step = e2e.setup_variant(variant, model, torch.device("cpu"), T=1, batch=2, amp=None)
    step()
