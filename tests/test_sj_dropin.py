"""The drop-in harness ``scripts/sj_dropin.py``: its import rewriting and stand-ins without
SpikingJelly, and a few of SpikingJelly's own example and model files where it is importable."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.fixture(scope="module")
def harness() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("sj_dropin_harness", SCRIPTS / "sj_dropin.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


SOURCE = '''"""doc"""
import torch
from spikingjelly.activation_based import neuron, layer as L
from spikingjelly.activation_based.model import (
    parametric_lif_net,
    sew_resnet,
)
import spikingjelly.activation_based.functional as F
from spikingjelly.datasets.dvs128_gesture import DVS128Gesture
from spikingjelly import visualizing
from .. import surrogate
from ..base import MemoryModule  # keep this comment
from .ms_resnet import MSResNet


def f():
    from spikingjelly.activation_based import monitor
    return "from spikingjelly.activation_based import neuron"
'''


def test_rewrite_changes_only_import_lines_and_keeps_line_numbers(harness):
    out = harness.rewrite_imports(SOURCE, "spikingjelly.activation_based.model")
    lines, before = out.splitlines(), SOURCE.splitlines()
    assert len(lines) == len(before)
    assert lines[2] == "from spikefuse import neuron, layer as L"
    assert lines[3] == "from spikefuse.model import parametric_lif_net, sew_resnet"
    assert lines[4:7] == ["", "", ""]  # the rest of the multi-line import, kept as blank lines
    assert lines[7] == "import spikefuse.functional as F"
    assert lines[8] == "from spikefuse.datasets.dvs128_gesture import DVS128Gesture"
    assert lines[9] == "from spikingjelly import visualizing"  # not activation_based: kept
    assert lines[10] == "from spikefuse import surrogate"
    assert lines[11] == "from spikefuse.base import MemoryModule  # keep this comment"
    assert lines[12] == "from spikefuse.model.ms_resnet import MSResNet"
    assert lines[16] == "    from spikefuse import monitor"
    assert lines[17] == before[17]  # a string is not an import
    changed = [i for i, (a, b) in enumerate(zip(lines, before, strict=True)) if a != b]
    assert changed == [2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 16]


def test_relative_import_outside_a_package_is_refused(harness):
    with pytest.raises(ImportError, match="outside a package"):
        harness.rewrite_imports("from . import x\n", None)


def test_stand_ins_replace_only_missing_packages_and_go_away(harness):
    name = "sj_dropin_surely_missing_package"
    with harness.stand_ins(("json", name)) as missing:
        assert missing == (name,)
        stand_in = importlib.import_module(f"{name}.sub")
        cls = stand_in.Anything
        assert isinstance(cls(1, key=2), cls)  # inert: takes any arguments
        assert type("Sub", (cls,), {})  # and can be subclassed
    assert name not in sys.modules and f"{name}.sub" not in sys.modules
    with pytest.raises(ImportError):
        importlib.import_module(name)


def test_missing_names_are_named(harness):
    try:
        from spikefuse import no_such_name  # type: ignore[attr-defined]  # noqa: F401
    except ImportError as exc:
        assert harness.describe(exc) == "missing: spikefuse.no_such_name"
    import spikefuse.neuron

    try:
        spikefuse.neuron.NoSuchNode  # type: ignore[attr-defined]  # noqa: B018
    except AttributeError as exc:
        assert harness.describe(exc) == "missing: spikefuse.neuron.NoSuchNode"
    assert harness.describe(ValueError("bad\nmore")).startswith("ValueError: bad")


def test_max_difference_is_relative_above_one_and_flags_mismatches(harness):
    import torch

    a = [{"out0": torch.tensor([1e4, 0.5]), "g": torch.tensor([0.25])}]
    b = [{"out0": torch.tensor([1e4 + 1e-8, 0.5]), "g": torch.tensor([0.25 + 1e-12])}]
    assert harness.max_difference(a, b) == pytest.approx(1e-12, rel=1e-3)
    assert harness.max_difference(a, [{"out0": a[0]["out0"]}]) == float("inf")
    nan = [{"out0": torch.tensor([float("nan"), 0.5]), "g": a[0]["g"]}]
    assert harness.max_difference(a, nan) == float("inf")


# ---- on SpikingJelly's own files ------------------------------------------------------------------
def test_spikingjelly_files_run_as_drop_ins(harness, monkeypatch):
    sj = pytest.importorskip("spikingjelly.activation_based")
    root = Path(sj.__file__).resolve().parents[2]
    monkeypatch.syspath_prepend(str(SCRIPTS))
    from sj_dropin_units import UNITS

    wanted = ("examples/lif_fc_mnist.py", "examples/rsnn_sequential_fmnist.py", "model/spiking_vggws_ottt.py")  # fmt: skip
    rows = [row for unit in UNITS if unit.relpath in wanted for row in harness.run_unit(root, unit)]
    assert len(rows) == 5
    for row in rows:
        assert row.sj_runs and row.sf_runs and not row.cause, row
        assert row.difference is not None and row.difference < 1e-12, row
    table = harness.table(rows)
    assert table.count("\n") == 6 and "| examples/lif_fc_mnist.py:SNN | yes | yes |" in table
    assert harness.summary(rows).startswith("5 of 5 rows")


def test_dsqn_with_its_non_spiking_readout_is_a_drop_in(harness, monkeypatch):
    sj = pytest.importorskip("spikingjelly.activation_based")
    root = Path(sj.__file__).resolve().parents[2]
    monkeypatch.syspath_prepend(str(SCRIPTS))
    from sj_dropin_units import UNITS

    (unit,) = [u for u in UNITS if u.relpath == "examples/dsqn/utils/model.py"]
    (row,) = harness.run_unit(root, unit)
    assert row.sj_runs and row.sf_runs and not row.cause, row
    assert row.difference is not None and row.difference < 1e-12, row


def test_masnn_subclassing_ms_resnets_internals_is_a_drop_in(harness, monkeypatch):
    """SpikingJelly's MA-SNN file subclasses ``ms_resnet._MSBlock`` and calls ``_conv1x1``."""
    sj = pytest.importorskip("spikingjelly.activation_based")
    root = Path(sj.__file__).resolve().parents[2]
    monkeypatch.syspath_prepend(str(SCRIPTS))
    from sj_dropin_units import UNITS

    (unit,) = [u for u in UNITS if u.relpath == "model/masnn.py"]
    rows = harness.run_unit(root, unit)
    assert len(rows) == 2
    for row in rows:
        assert row.sj_runs and row.sf_runs and not row.cause, row
        assert row.difference is not None and row.difference < 1e-12, row
