"""NIR input treated as possibly hostile: every edge's shapes and every node name checked by
spikefuse itself (nir's type check may be off), files checked from their headers before any
data is read, and export bounded on huge input shapes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from spikefuse import layer, neuron

nir = pytest.importorskip("nir", reason="NIR interop needs the 'nir' package ([nir] extra)")
from spikefuse.interop.nir import (  # noqa: E402
    NIRConversionError,
    export_nir,
    import_nir,
    read_nir,
)


def lif(n: int) -> nir.LIF:
    ones = np.ones(n)
    return nir.LIF(tau=2 * ones, r=ones, v_leak=0 * ones, v_threshold=ones, v_reset=0 * ones)


def unchecked(nodes: dict, edges: list[tuple[str, str]]) -> nir.NIRGraph:
    """A graph as nir builds it with its own type check off."""
    return nir.NIRGraph(nodes=nodes, edges=edges, type_check=False)


def test_a_branch_of_another_width_is_refused_not_broadcast() -> None:
    nodes = {
        "input": nir.Input(np.array([3])),
        "wide": nir.Affine(np.ones((4, 3)), np.zeros(4)),
        "narrow": nir.Affine(np.ones((1, 3)), np.zeros(1)),
        "spikes": lif(4),
        "output": nir.Output(np.array([4])),
    }
    edges = [("input", "wide"), ("input", "narrow"), ("wide", "spikes"), ("narrow", "spikes")]
    graph = unchecked(nodes, [*edges, ("spikes", "output")])
    with pytest.raises(NIRConversionError, match=r"'spikes'.*different per-sample shapes"):
        import_nir(graph, dt=1.0)


@pytest.mark.parametrize(
    "node, message",
    [
        (nir.Affine(np.ones((4, 5)), np.zeros(4)), r"takes vectors of 5 features.*\(3,\)"),
        (lif(5), r"tau has shape \(5,\).*\(3,\)"),
        (nir.Scale(np.ones(2)), r"scale has shape \(2,\)"),
        (nir.Flatten(np.array([3]), start_dim=2), r"cannot take per-sample shape \(3,\)"),
    ],
    ids=["affine", "neuron", "scale", "flatten"],
)
def test_a_node_that_cannot_take_its_input_is_named(node: nir.NIRNode, message: str) -> None:
    nodes = {"input": nir.Input(np.array([3])), "x": node, "output": nir.Output(np.array([3]))}
    with pytest.raises(NIRConversionError, match=rf"NIR node 'x'.*{message}"):
        import_nir(unchecked(nodes, [("input", "x"), ("x", "output")]), dt=1.0)


def test_a_conv_gets_the_channels_it_needs() -> None:
    conv = nir.Conv2d(None, np.ones((2, 3, 3, 3)), 1, 1, 1, 1, np.zeros(2))
    nodes = {
        "input": nir.Input(np.array([1, 8, 8])),
        "c": conv,
        "output": nir.Output(np.array([2])),
    }
    with pytest.raises(NIRConversionError, match=r"'c'.*takes \[3, \*2 spatial\].*\(1, 8, 8\)"):
        import_nir(unchecked(nodes, [("input", "c"), ("c", "output")]), dt=1.0)


def test_a_wrong_output_declaration_is_refused() -> None:
    nodes = {"input": nir.Input(np.array([4])), "n": lif(4), "output": nir.Output(np.array([5]))}
    with pytest.raises(NIRConversionError, match=r"declares shape \(5,\), but receives \(4,\)"):
        import_nir(unchecked(nodes, [("input", "n"), ("n", "output")]), dt=1.0)


@pytest.mark.parametrize("name", ["training", "update", "keys", "_modules", "forward", "a.b"])
@pytest.mark.parametrize("branched", [False, True], ids=["chain", "branches"])
def test_node_names_of_torch_attributes_import(name: str, branched: bool) -> None:
    nodes = {"input": nir.Input(np.array([4])), name: lif(4), "x": lif(4)}
    nodes["output"] = nir.Output(np.array([4]))
    if branched:
        edges = [("input", name), ("input", "x"), (name, "output"), ("x", "output")]
    else:
        edges = [("input", name), (name, "x"), ("x", "output")]
    model = import_nir(unchecked(nodes, edges), dt=1.0)
    assert model(torch.ones(2, 3, 4, dtype=torch.float64)).shape == (2, 3, 4)


def test_export_refuses_a_huge_input_shape_before_allocating() -> None:
    model = nn.Sequential(neuron.LIFNode(step_mode="m"))
    with pytest.raises(NIRConversionError, match=r"\(1000000, 1000000\) has 1000000000000 elem"):
        export_nir(model, (10**6, 10**6), dt=1.0)
    grown = nn.Sequential(layer.Conv2d(1, 1, 1, padding=10**4, step_mode="m"), neuron.IFNode())
    with pytest.raises(NIRConversionError, match=r"1 \(IFNode\).*elements"):
        export_nir(grown, (1, 4, 4), dt=1.0)
    with pytest.raises(NIRConversionError, match="positive ints"):
        export_nir(model, "44", dt=1.0)
    assert export_nir(model, 4, dt=1.0).nodes["0"].tau.shape == (4,)  # an int, as torch takes


h5py = pytest.importorskip("h5py", reason="NIR files need h5py")


def test_read_nir_round_trips_a_written_graph(tmp_path: Path) -> None:
    path = tmp_path / "net.nir"
    model = nn.Sequential(layer.Linear(3, 4, step_mode="m"), neuron.LIFNode(step_mode="m"))
    nir.write(path, export_nir(model, (3,), dt=1.0))
    imported = import_nir(read_nir(path), dt=1.0)
    x = torch.rand(2, 1, 3)
    assert torch.equal(imported(x), model(x))


def test_read_nir_refuses_datasets_declared_larger_than_the_limit(tmp_path: Path) -> None:
    path = tmp_path / "huge.nir"
    with h5py.File(path, "w") as f:
        node = f.create_group("node")
        node["type"] = "NIRGraph"
        # 8 TB declared, nothing stored: reading it whole is what nir.read would do
        node.create_dataset("bomb", shape=(10**6, 10**6), dtype="f8", chunks=(1, 1024))
    assert path.stat().st_size < 100_000
    with pytest.raises(NIRConversionError, match=r"declare more than max_bytes=.*'/node/bomb'"):
        read_nir(path)


@pytest.mark.parametrize(
    "content, message",
    [
        (b"not hdf5 at all", "is not an HDF5 file"),
        (b"\x89HDF\r\n\x1a\n" + bytes(2048), "max_bytes=1024"),
    ],
)
def test_read_nir_checks_size_and_signature_first(
    tmp_path: Path, content: bytes, message: str
) -> None:
    path = tmp_path / "x.nir"
    path.write_bytes(content)
    with pytest.raises(NIRConversionError, match=message):
        read_nir(path, max_bytes=1024)
    with pytest.raises(NIRConversionError, match="is not a regular file"):
        read_nir(tmp_path)


def test_read_nir_refuses_links(tmp_path: Path) -> None:
    path = tmp_path / "linked.nir"
    with h5py.File(path, "w") as f:
        node = f.create_group("node")
        node["loop"] = h5py.SoftLink("/node")
    with pytest.raises(NIRConversionError, match="'/node/loop' is a link"):
        read_nir(path)
