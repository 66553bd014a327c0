"""SpikingJelly's own ``lif_fc_mnist`` example, run unchanged but for its imports, against the
original in float64 (skipped when SpikingJelly is not importable).

The example's ``main()`` trains the FC-LIF network, saves checkpoints, then records the output
layer's V and spikes with ``node.v_seq = []`` and a forward hook. Its file is read from the
installed SpikingJelly; only this harness differs from a real run: MNIST is a tiny synthetic
data set (no downloads), given through a stand-in ``torchvision`` module, and tensorboard's
writer records nothing.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

sj = pytest.importorskip("spikingjelly.activation_based")

HARNESS = Path(__file__).resolve().parents[1] / "scripts" / "sj_dropin.py"
SJ_ROOT = Path(sj.__file__).resolve().parents[2]  # the folder holding spikingjelly/


def _harness() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("sj_dropin_harness", HARNESS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


class SyntheticMNIST(torch.utils.data.Dataset):
    """torchvision's MNIST signature; 12 train / 6 test float64 28 x 28 images."""

    def __init__(self, root, train=True, transform=None, download=False):
        rng = np.random.default_rng(0 if train else 1)
        n = 12 if train else 6
        self.images = rng.random((n, 28, 28, 1))
        self.labels = [int(v) for v in rng.integers(0, 10, n)]
        self.transform = transform

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.transform(self.images[i]), self.labels[i]


class ToTensor:
    """torchvision's ToTensor for an H x W x C float array: C x H x W, dtype kept."""

    def __call__(self, pic):
        return torch.from_numpy(np.ascontiguousarray(pic.transpose(2, 0, 1)))


class SummaryWriter:
    def __init__(self, *args, **kwargs):
        pass

    def add_scalar(self, *args, **kwargs):
        pass


def _stand_ins(monkeypatch):
    vision = types.ModuleType("torchvision")
    vision.datasets = types.SimpleNamespace(MNIST=SyntheticMNIST)
    vision.transforms = types.SimpleNamespace(ToTensor=ToTensor)
    board = types.ModuleType("torch.utils.tensorboard")
    board.SummaryWriter = SummaryWriter
    monkeypatch.setitem(sys.modules, "torchvision", vision)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", board)


def _run(harness, dropin: bool, workdir: Path, monkeypatch, capsys) -> dict:
    """main() of the example in ``workdir``: its checkpoint, saved arrays and printed lines."""
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    argv = ["lif_fc_mnist.py", "-T", "4", "-device", "cpu", "-b", "4", "-epochs", "2", "-j", "0"]
    argv += ["-out-dir", str(workdir / "logs"), "-opt", "sgd", "-lr", "0.5"]
    monkeypatch.setattr(sys, "argv", argv)
    side = harness.load_unit(SJ_ROOT, "examples/lif_fc_mnist.py", dropin=dropin)
    torch.manual_seed(0)
    side.module.main()
    printed = [line for line in capsys.readouterr().out.splitlines() if "speed" not in line]
    checkpoint = torch.load(next((workdir / "logs").glob("*/checkpoint_latest.pth")))
    return {
        "printed": [line for line in printed if line.startswith(("epoch", "Firing"))],
        "net": checkpoint["net"],
        "momentum": checkpoint["optimizer"]["state"],
        "v": np.load(workdir / "v_t_array.npy"),
        "s": np.load(workdir / "s_t_array.npy"),
        "module": side.module,
    }


def test_lif_fc_mnist_runs_unchanged_and_matches_spikingjelly(tmp_path, monkeypatch, capsys):
    harness = _harness()
    _stand_ins(monkeypatch)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # the example's net and Poisson spikes in float64
    try:
        theirs = _run(harness, False, tmp_path / "sj", monkeypatch, capsys)
        ours = _run(harness, True, tmp_path / "sf", monkeypatch, capsys)
    finally:
        torch.set_default_dtype(previous)
    assert ours["module"].neuron.__name__ == "spikefuse.neuron"
    assert theirs["module"].neuron.__name__ == "spikingjelly.activation_based.neuron"
    weight = ours["net"]["layer.1.weight"]
    assert weight.dtype == torch.float64
    torch.testing.assert_close(weight, theirs["net"]["layer.1.weight"], rtol=0, atol=1e-12)
    assert not torch.equal(weight, _initial_weight())  # it trained
    for key, state in theirs["momentum"].items():
        torch.testing.assert_close(ours["momentum"][key], state, rtol=0, atol=1e-12)
    # the recording hook: T = 4 steps of 10 output neurons, V and spikes
    assert ours["v"].shape == theirs["v"].shape == (4, 10)
    np.testing.assert_allclose(ours["v"], theirs["v"], rtol=0, atol=1e-12)
    assert np.array_equal(ours["s"], theirs["s"])
    assert ours["printed"] == theirs["printed"] and len(ours["printed"]) == 3


def _initial_weight() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.nn.Linear(784, 10, bias=False, dtype=torch.float64).weight.detach()
