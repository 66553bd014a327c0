"""Keep the spikes that layers save for backward at 1 bit per spike.

A Conv/Linear saves its input for ``dL/dW``, a pooling layer saves its input too. When that
input is the spike output of a fused block (exactly 0 or 1), :func:`saving_packed` intercepts
the save and stores 8 spikes per byte; backward unpacks them into a temporary tensor of the
original dtype. Tensors computed from packed spikes by a cheap function (average pooling of
spikes) are tagged with that function and saved as a reference to the same bits; backward
recomputes them.

Fused blocks tag their output with :func:`mark_binary`, :class:`~spikefuse.fused.SpikePool`
tags its output with :func:`mark_derived`. Views that cover the same memory (flatten, reshape)
keep the tag of their base; anything else derived from a tagged tensor (dropout, arithmetic,
an in-place edit) has no valid tag and is saved as it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

_TAG = "_spikefuse_saved_as"
_BIT_WEIGHTS: dict[torch.device, Tensor] = {}


def _bit_weights(device: torch.device) -> Tensor:
    w = _BIT_WEIGHTS.get(device)
    if w is None:
        w = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=device)
        _BIT_WEIGHTS[device] = w
    return w


def pack_bits(spikes: Tensor) -> Tensor:
    """uint8 [ceil(numel / 8)]: bit i of byte k is ``spikes.flatten()[8k + i] != 0``."""
    flat = (spikes.reshape(-1) != 0).view(torch.uint8)
    pad = -flat.numel() % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, 8).mul_(_bit_weights(flat.device)).sum(1, dtype=torch.uint8)


def unpack_bits(bits: Tensor, shape: torch.Size, dtype: torch.dtype) -> Tensor:
    """Inverse of :func:`pack_bits`: a tensor of ``shape`` and ``dtype`` with values 0/1."""
    out = (bits.unsqueeze(1) & _bit_weights(bits.device)).ne_(0).view(-1)[: shape.numel()]
    return out.to(dtype).view(shape)


class PackedSpikes:
    """A binary tensor stored at 1 bit per element; :meth:`unpack` restores it."""

    __slots__ = ("bits", "shape", "dtype")

    def __init__(self, spikes: Tensor) -> None:
        self.bits, self.shape, self.dtype = pack_bits(spikes), spikes.shape, spikes.dtype

    def unpack(self) -> Tensor:
        return unpack_bits(self.bits, self.shape, self.dtype)


@dataclass(frozen=True)
class _Derived:
    """``fn(source.unpack())``: how to recompute a saved tensor from packed spikes."""

    source: PackedSpikes
    fn: Callable[[Tensor], Tensor]

    def unpack(self) -> Tensor:
        return self.fn(self.source.unpack())


@dataclass(frozen=True)
class _Tag:
    version: int  # the tensor's _version when tagged: an in-place edit invalidates the tag
    derived: _Derived | None  # None: the tensor itself is binary


def _set_tag(t: Tensor, derived: _Derived | None) -> Tensor:
    tag = _Tag(t._version, derived)  # views share their base's version counter
    setattr(t, _TAG, tag)
    # Views of t (e.g. a later flatten) know only the root base: tag it too when it is t's memory.
    if t._base is not None and _same_memory(t, t._base):
        setattr(t._base, _TAG, tag)
    return t


def mark_binary(spikes: Tensor) -> Tensor:
    """Tag ``spikes`` (values exactly 0 or 1) as safe to bit-pack; returns it."""
    return _set_tag(spikes, None)


def mark_derived(t: Tensor, source: PackedSpikes, fn: Callable[[Tensor], Tensor]) -> Tensor:
    """Tag ``t`` as ``fn(source.unpack())`` (same numel and layout as t); returns it."""
    return _set_tag(t, _Derived(source, fn))


def _valid_tag(t: Tensor) -> _Tag | None:
    tag = getattr(t, _TAG, None)
    return tag if tag is not None and tag.version == t._version else None


def tag_of(t: Tensor) -> _Tag | None:
    """The valid tag of ``t``, or of the tensor it is a same-memory view of (e.g. flatten)."""
    tag = _valid_tag(t)
    if tag is None and t._base is not None and _same_memory(t, t._base):
        tag = _valid_tag(t._base)
    return tag


def is_marked_binary(t: Tensor) -> bool:
    """True when ``t`` (or its same-memory base) is tagged binary and unmodified since."""
    tag = tag_of(t)
    return tag is not None and tag.derived is None


def _same_memory(a: Tensor, b: Tensor) -> bool:
    """Whether a and b are contiguous views of exactly the same elements (any shape)."""
    return (
        a.numel() == b.numel()
        and a.dtype == b.dtype
        and a.is_contiguous()
        and b.is_contiguous()
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() == b.storage_offset()
    )


@contextlib.contextmanager
def saving_packed(x: Tensor, packed: PackedSpikes | _Derived | None = None) -> Iterator[None]:
    """While active, autograd saves ``x`` (or a same-memory view of it) as ``packed``.

    ``packed`` defaults to what x's tag says: its bits (binary tag) or its recipe (derived
    tag); without a valid tag the context does nothing. Other saved tensors (weights) and
    copies made by an op (e.g. an autocast cast) are saved as they are.
    """
    if packed is None:
        tag = tag_of(x)
        if tag is None:
            yield
            return
        packed = tag.derived
    cache: list[PackedSpikes | _Derived] = [] if packed is None else [packed]

    def pack(t: Tensor) -> object:
        if not _same_memory(t, x):
            return t
        if not cache:  # pack lazily, once, and only if the op saves x at all
            cache.append(PackedSpikes(x))
        return _Restore(cache[0], t.shape)

    with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
        yield


@dataclass(frozen=True)
class _Restore:
    saved: PackedSpikes | _Derived
    shape: torch.Size  # the saved view's shape


def _unpack(saved: object) -> Tensor:
    if isinstance(saved, _Restore):
        return saved.saved.unpack().view(saved.shape)
    return saved
