"""NIR input checked before anything is built from it: files (:func:`read_nir`), node names and
every edge's per-sample shapes.

A NIR graph may come from anywhere, with nir's own type check switched off
(``NIRGraph(..., type_check=False)``, ``nir.read(..., type_check=False)``). spikefuse does not
rely on it: :func:`infer_shapes` follows the shapes from the Input node along every edge and
refuses what torch would broadcast silently (a 1-feature branch summed with a 4-feature one) or
fail on deep inside a forward.
"""

from __future__ import annotations

import math
import os
import stat
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..errors import NIRConversionError

try:
    import nir
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "spikefuse.interop.nir needs the 'nir' package: pip install 'spikefuse[nir]'"
    ) from exc

# NIR stores parameters per neuron: per-sample shapes above this many elements would make
# arrays of gigabytes per node (export) or cannot be run (import).
MAX_SAMPLE_ELEMENTS = 2**26
# read_nir's default limit on the file's size and on the bytes its datasets declare.
MAX_FILE_BYTES = 2**32
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
_MAX_DEPTH = 32  # nested groups in a NIR file: graphs of graphs of nodes of arrays
# Names a submodule cannot take: attributes of the containers import builds (an instance's,
# so that instance attributes such as ``training`` count too).
_RESERVED = frozenset(dir(nn.Sequential()) + dir(nn.ModuleDict()))


def check_sample_shape(where: str, shape: Sequence[int]) -> tuple[int, ...]:
    """``shape`` (one sample's, without time and batch) as ints, refused when empty, not
    positive or above :data:`MAX_SAMPLE_ELEMENTS` elements."""
    values = list(shape) if isinstance(shape, (Sequence, np.ndarray)) else [shape]
    if not values or not all(
        isinstance(s, (int, np.integer)) and not isinstance(s, bool) and s > 0 for s in values
    ):
        raise NIRConversionError(
            f"{where}: a per-sample shape must be positive ints, got {tuple(values)}"
        )
    ints = tuple(int(s) for s in values)
    if math.prod(ints) > MAX_SAMPLE_ELEMENTS:
        raise NIRConversionError(
            f"{where}: per-sample shape {ints} has {math.prod(ints)} elements, more than the "
            f"{MAX_SAMPLE_ELEMENTS} NIR's per-neuron arrays are allowed here"
        )
    return ints


# ---- files -----------------------------------------------------------------------------------
def read_nir(
    path: str | os.PathLike[str], *, max_bytes: int = MAX_FILE_BYTES, type_check: bool = True
) -> nir.NIRGraph:
    """Read a NIR file (HDF5, as ``nir.write`` writes it) after checking it from its headers.

    ``nir.read`` reads every dataset whole; a file can declare datasets far larger than itself
    (compressed or unallocated). This refuses, before reading any data, a path that is not a
    regular file, a file over ``max_bytes``, one without HDF5's signature, links to other
    objects or files, and datasets declaring more than ``max_bytes`` in all.
    """
    where = f"NIR file '{path}'"
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise NIRConversionError(f"{where} is not a regular file")
        if info.st_size > max_bytes:
            raise NIRConversionError(
                f"{where} has {info.st_size} bytes, more than max_bytes={max_bytes}"
            )
        with open(path, "rb") as f:
            head = f.read(len(HDF5_SIGNATURE))
    except OSError as exc:
        raise NIRConversionError(f"cannot read {where}: {exc.strerror or exc}") from exc
    if head != HDF5_SIGNATURE:
        raise NIRConversionError(f"{where} is not an HDF5 file (no HDF5 signature at its start)")
    import h5py  # type: ignore[import-untyped]  # an optional dependency of nir, untyped
    from nir.serialization import hdf2dict

    with h5py.File(path, "r") as f:
        node = f.get("node", getlink=True)
        if not isinstance(node, h5py.HardLink) or not isinstance(f["node"], h5py.Group):
            raise NIRConversionError(f"{where} holds no NIR graph (no 'node' group)")
        _check_declared(where, f["node"], max_bytes, h5py)
        data = hdf2dict(f["node"])
    data["type_check"] = type_check
    try:
        graph = nir.dict2NIRNode(data)
    except Exception as exc:  # nir's own checks: KeyError, ValueError, AssertionError, ...
        raise NIRConversionError(f"{where} is not a NIR graph nir can read: {exc!r}") from exc
    if not isinstance(graph, nir.NIRGraph):
        raise NIRConversionError(f"{where} holds a {type(graph).__name__}, not a NIR graph")
    return graph


def _check_declared(where: str, root: Any, max_bytes: int, h5py: Any) -> None:
    """Refuse links and more than ``max_bytes`` of declared dataset contents under ``root``,
    from the HDF5 headers alone."""
    total = 0
    pending = [(root, 0)]
    while pending:
        group, depth = pending.pop()
        if depth > _MAX_DEPTH:
            raise NIRConversionError(f"{where}: groups nested deeper than {_MAX_DEPTH}")
        for key in group:
            if not isinstance(group.get(key, getlink=True), h5py.HardLink):
                raise NIRConversionError(f"{where}: '{group.name}/{key}' is a link; NIR has none")
            item = group[key]
            if isinstance(item, h5py.Group):
                pending.append((item, depth + 1))
                continue
            if item.external:
                raise NIRConversionError(f"{where}: '{item.name}' keeps its data in another file")
            total += (item.size or 0) * item.dtype.itemsize
            if total > max_bytes:
                raise NIRConversionError(
                    f"{where}: its datasets declare more than max_bytes={max_bytes} bytes "
                    f"(at '{item.name}', shape {item.shape})"
                )


# ---- node names ------------------------------------------------------------------------------
def module_keys(names: Sequence[Any]) -> dict[Any, str]:
    """Submodule names for NIR node names: '.' becomes '_' (torch forbids it), and a name that
    is an attribute of ``nn.Sequential`` or ``nn.ModuleDict`` (``forward``, ``training``,
    ``update``, ...) gets the prefix ``node_``."""
    keys = {}
    for name in names:
        if not isinstance(name, str):
            raise NIRConversionError(
                f"import_nir: node names must be strings, got {name!r} ({type(name).__name__})"
            )
        key = name.replace(".", "_") or "node"
        keys[name] = f"node_{key}" if key in _RESERVED else key
    if len(set(keys.values())) != len(keys):
        raise NIRConversionError(
            f"import_nir: node names {list(names)} collide once '.' is replaced by '_' and "
            "names of torch attributes are prefixed with 'node_'; rename them"
        )
    return keys


# ---- shapes ----------------------------------------------------------------------------------
def infer_shapes(
    graph: nir.NIRGraph, order: Sequence[str], preds: Mapping[str, Sequence[str]], sink: str
) -> dict[str, tuple[int, ...]]:
    """Every node's per-sample output shape, from the Input node (``order[0]``) on, checking
    that each node's inputs have one shape (no broadcasting) and that the node takes it.

    Some exporters (Norse) declare the Input and Output shapes with a leading batch
    dimension: when the graph does not take the declared shape, it is tried without its first
    dimension (and the Output's declaration likewise)."""
    declared = _declared(graph.nodes[order[0]], "input", f"Input node {order[0]!r}")
    try:
        return _follow(graph, order, preds, sink, declared, ())
    except NIRConversionError as first:
        if len(declared) < 2:
            raise
        try:
            return _follow(graph, order, preds, sink, declared[1:], declared[:1])
        except NIRConversionError:
            raise first from None


def _follow(
    graph: nir.NIRGraph,
    order: Sequence[str],
    preds: Mapping[str, Sequence[str]],
    sink: str,
    shape: tuple[int, ...],
    batch: tuple[int, ...],
) -> dict[str, tuple[int, ...]]:
    shapes = {order[0]: shape}
    for name in [*order[1:], sink]:
        incoming = {p: shapes[p] for p in preds[name]}
        if len(set(incoming.values())) > 1:
            raise NIRConversionError(
                f"NIR node {name!r}: its incoming edges carry different per-sample shapes "
                f"{incoming}; a sum of them would broadcast"
            )
        node = graph.nodes[name]
        where = f"NIR node {name!r} ({type(node).__name__})"
        shapes[name] = _output_shape(where, node, next(iter(incoming.values())), batch)
    return shapes


def _declared(node: Any, key: str, where: str) -> tuple[int, ...]:
    types = node.input_type if key == "input" else node.output_type
    value = types.get(key) if isinstance(types, Mapping) else None
    if value is None:
        raise NIRConversionError(f"{where}: declares no {key} shape")
    return check_sample_shape(where, np.atleast_1d(np.asarray(value)).tolist())


def _output_shape(
    where: str, node: Any, shape: tuple[int, ...], batch: tuple[int, ...]
) -> tuple[int, ...]:
    if isinstance(node, nir.Output):
        declared = node.output_type.get("output") if isinstance(node.output_type, dict) else None
        if declared is None or not np.asarray(declared).size:
            return shape
        declared = tuple(np.atleast_1d(np.asarray(declared)).tolist())
        if declared != shape and declared != batch + shape:
            raise NIRConversionError(f"{where}: declares shape {declared}, but receives {shape}")
        return shape
    if isinstance(node, (nir.Affine, nir.Linear)):
        weight = np.asarray(node.weight)
        if weight.ndim != 2 or shape != (weight.shape[1],):
            raise NIRConversionError(
                f"{where}: weight {weight.shape} takes vectors of {weight.shape[-1]} features, "
                f"but its input has per-sample shape {shape}"
            )
        return (weight.shape[0],)
    if isinstance(node, (nir.IF, nir.LIF, nir.LI, nir.Scale)):
        fields = ("scale",) if isinstance(node, nir.Scale) else _NEURON_FIELDS[type(node)]
        for field in fields:
            if np.shape(getattr(node, field)) != shape:
                raise NIRConversionError(
                    f"{where}: {field} has shape {np.shape(getattr(node, field))}, but its input "
                    f"has per-sample shape {shape}"
                )
        return shape
    return _computed_shape(where, node, shape)


_NEURON_FIELDS = {
    nir.IF: ("r", "v_threshold", "v_reset"),
    nir.LIF: ("tau", "r", "v_leak", "v_threshold", "v_reset"),
    nir.LI: ("tau", "r", "v_leak"),
}


def _computed_shape(where: str, node: Any, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shapes of the layers torch computes: on meta tensors, which allocate nothing."""
    x = torch.empty((1, *shape), device="meta")
    try:
        if isinstance(node, nir.Flatten):
            start, end = (
                int(d) + 1 if int(d) >= 0 else int(d) for d in (node.start_dim, node.end_dim)
            )
            out = x.flatten(start, end)
        elif isinstance(node, (nir.AvgPool2d, nir.SumPool2d)):
            if len(shape) != 3:
                raise NIRConversionError(f"{where}: takes [C, H, W], got per-sample shape {shape}")
            out = F.avg_pool2d(
                x,
                *(np.atleast_1d(v).tolist() for v in (node.kernel_size, node.stride, node.padding)),
            )
        elif isinstance(node, (nir.Conv1d, nir.Conv2d)):
            out = _conv_shape(where, node, x)
        else:
            return shape  # refused by the importer, which names what it supports
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:
        raise NIRConversionError(
            f"{where}: cannot take per-sample shape {shape}: {str(exc).splitlines()[0]}"
        ) from exc
    return tuple(out.shape[1:])


def _conv_shape(where: str, node: Any, x: torch.Tensor) -> torch.Tensor:
    weight = np.asarray(node.weight)
    rank = 4 if isinstance(node, nir.Conv2d) else 3
    groups = int(node.groups)
    if weight.ndim != rank or x.dim() != rank or x.shape[1] != weight.shape[1] * groups:
        raise NIRConversionError(
            f"{where}: weight {weight.shape} (groups={groups}) takes [{weight.shape[1] * groups}, "
            f"*{rank - 2} spatial] per sample, got {tuple(x.shape[1:])}"
        )
    convolve = F.conv2d if rank == 4 else F.conv1d
    padding = (
        node.padding if isinstance(node.padding, str) else np.atleast_1d(node.padding).tolist()
    )
    return convolve(
        x,
        torch.empty(weight.shape, device="meta"),
        None,
        np.atleast_1d(node.stride).tolist(),
        padding,
        np.atleast_1d(node.dilation).tolist(),
        groups,
    )
