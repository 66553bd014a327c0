"""The backend contract (spikefuse.backends): every registered backend module provides the
protocol's attributes with its parameter order, and the one 'auto' rule."""

from __future__ import annotations

import dataclasses
import importlib
import inspect

import pytest
import torch

from spikefuse import backends
from spikefuse.errors import BackendUnavailableError, SpikefuseError

PROTOCOL = backends.NeuronBackend
MEMBERS = sorted(
    {name for name in vars(PROTOCOL) if not name.startswith("_")} | set(PROTOCOL.__annotations__)
)


@pytest.mark.parametrize("name", ["torch", "cuda"])
def test_backend_modules_satisfy_the_protocol(name):
    module = backends.get_backend(name)
    assert MEMBERS == [
        "SAVES_SEQUENCE",
        "bptt",
        "fptt",
        "keeps_x",
        "saved_like",
        "unavailable_reason",
    ]
    for member in MEMBERS:
        assert hasattr(module, member), f"{module.__name__} lacks {member}"
    assert isinstance(module.SAVES_SEQUENCE, bool)
    for member in MEMBERS:
        if member == "SAVES_SEQUENCE":
            continue
        # the ops call fptt/bptt positionally: the parameter order is part of the contract
        expected = list(inspect.signature(getattr(PROTOCOL, member)).parameters)[1:]  # no self
        actual = list(inspect.signature(getattr(module, member)).parameters)
        assert actual[: len(expected)] == expected, f"{module.__name__}.{member}"
        extra = inspect.signature(getattr(module, member)).parameters
        assert all(extra[p].default is not inspect.Parameter.empty for p in actual[len(expected) :])
    assert backends.get_backend("cupy" if name == "cuda" else name) is module


def test_resolve_is_the_auto_rule():
    x = torch.zeros(3)
    assert backends.resolve("auto", x) == "torch"  # no CUDA tensor: the torch backend
    assert backends.resolve("torch", x) == "torch"
    for explicit in ("cuda", "cupy"):
        with pytest.raises(BackendUnavailableError, match=r"^LIFNode: backend 'cuda': .*cpu"):
            backends.resolve(explicit, x, who="LIFNode")
    assert backends.unavailable_reason("torch", x) is None
    assert "CUDA tensor" in backends.unavailable_reason("cuda", x)
    assert backends.get_backend("torch").unavailable_reason(x) is None
    with pytest.raises(SpikefuseError, match="unknown backend 'tpu'"):
        backends.resolve("tpu", x)


def test_affine_kernels_capability():
    assert backends.affine_kernels("torch") is None
    kernels = backends.affine_kernels("cuda")
    assert kernels is not None and callable(kernels.affine_fptt) and callable(kernels.affine_bptt)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.zeros(2, 3, 4, 5, 6),  # contiguous: channels outside the map
        lambda: torch.zeros(6, 4, 5, 6).contiguous(memory_format=torch.channels_last),
        lambda: torch.zeros(2, 3, 4),  # [T, B, C]: channels innermost
        lambda: torch.zeros(2, 3, 1, 5, 6),  # one channel: both layouts at once
        lambda: torch.zeros(2, 3, 8, 5, 6).permute(0, 1, 2, 4, 3),  # transposed map
        lambda: torch.zeros(2, 3, 0, 5, 6),  # empty
        lambda: torch.zeros(2, 3, 5, 6, 8)[..., :4].permute(0, 1, 4, 2, 3),  # not dense
    ],
)
def test_channels_innermost_reads_the_geometry_as_is_contiguous_does(make):
    y = make()
    if y.dim() == 4:  # the [T*B, C, H, W] channels-last map as [T, B, C, H, W]
        y = y.unflatten(0, (2, 3))
    want = y.permute(0, 1, *range(3, y.dim()), 2).is_contiguous()
    assert backends.channels_innermost(y.shape, y.stride()) == want


@pytest.mark.parametrize("shape", [(2, 3, 4, 5, 6), (2, 3, 4, 5), (2, 3, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_as_channels_innermost_copies_once_into_the_kernels_layout(shape, dtype):
    t = torch.randn(shape)  # contiguous: channels innermost only for [T, B, C]
    out = backends.as_channels_innermost(t, dtype)
    assert backends.channels_innermost(out.shape, out.stride())
    assert out.shape == t.shape and out.dtype == dtype
    assert torch.equal(out, t.to(dtype))
    assert backends.as_channels_innermost(out, dtype) is out  # already laid out: no copy


def test_capability_is_looked_up_once_per_device_type_and_dtype(monkeypatch):
    """The fused blocks ask for a capability on every call: the backend's availability check and
    the import run once per (capability, device type, dtype), later calls read the answer."""
    asked = []

    def runs_float32(x):
        asked.append((x.device.type, x.dtype))
        return None if x.dtype == torch.float32 else "float32 only"

    entry = dataclasses.replace(backends._REGISTRY["cuda"], unavailable_reason=runs_float32)
    monkeypatch.setitem(backends._REGISTRY, "cuda", entry)
    monkeypatch.setattr(backends, "_CAPABLE", {})
    for _ in range(3):
        module = backends.capability("spike_bits", torch.zeros(3))
        assert module is importlib.import_module("spikefuse.cuda.spike_bits")
        assert backends.capability("spike_bits", torch.zeros(2, dtype=torch.float64)) is None
    assert asked == [("cpu", torch.float32), ("cpu", torch.float64)]
    with pytest.raises(SpikefuseError, match="unknown capability"):
        backends.capability("bogus", torch.zeros(3))
