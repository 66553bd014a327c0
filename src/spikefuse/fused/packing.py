"""Keep binary spikes that a synapse saves for its weight gradient at 1 bit per spike.

A Conv/Linear saves its input for ``dL/dW``. When that input is the output of a fused block
(exactly 0 or 1), :func:`saving_spikes_packed` intercepts the save and stores 8 spikes per byte;
backward unpacks them into a temporary tensor of the original dtype. Fused blocks tag their
output with :func:`mark_binary`; anything that derives a new tensor from it (pooling, dropout,
an in-place edit) loses the tag, and such tensors are saved as they are.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

_TAG = "_spikefuse_binary_version"
_BIT_WEIGHTS: dict[torch.device, Tensor] = {}


def mark_binary(spikes: Tensor) -> Tensor:
    """Tag ``spikes`` (values exactly 0 or 1) as safe to bit-pack; returns it."""
    setattr(spikes, _TAG, spikes._version)
    return spikes


def is_marked_binary(t: Tensor) -> bool:
    """True when ``t`` was tagged and has not been modified in place since."""
    return getattr(t, _TAG, None) == t._version


def _bit_weights(device: torch.device) -> Tensor:
    w = _BIT_WEIGHTS.get(device)
    if w is None:
        w = _BIT_WEIGHTS[device] = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8,
                                                device=device)  # fmt: skip
    return w


def pack_bits(spikes: Tensor) -> Tensor:
    """uint8 [ceil(numel / 8)]: bit i of byte k is ``spikes.flatten()[8k + i] != 0``."""
    flat = (spikes.reshape(-1) != 0).view(torch.uint8)
    pad = -flat.numel() % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return (flat.view(-1, 8) * _bit_weights(flat.device)).sum(1, dtype=torch.uint8)


def unpack_bits(bits: Tensor, shape: torch.Size, dtype: torch.dtype) -> Tensor:
    """Inverse of :func:`pack_bits`: a tensor of ``shape`` and ``dtype`` with values 0/1."""
    numel = shape.numel()
    out = (bits.unsqueeze(1) & _bit_weights(bits.device)).ne_(0).view(-1)[:numel]
    return out.to(dtype).view(shape)


class _PackedSpikes:
    __slots__ = ("bits", "shape", "dtype")

    def __init__(self, t: Tensor) -> None:
        self.bits, self.shape, self.dtype = pack_bits(t), t.shape, t.dtype


def _same_memory(a: Tensor, b: Tensor) -> bool:
    """Whether a and b are contiguous views of exactly the same elements (any shape)."""
    return (
        a.numel() == b.numel()
        and a.is_contiguous()
        and b.is_contiguous()
        and a.dtype == b.dtype
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() == b.storage_offset()
    )


@contextlib.contextmanager
def saving_spikes_packed(spikes: Tensor) -> Iterator[None]:
    """While active, autograd saves ``spikes`` (or a reshaped view of it) as packed bits.

    Other saved tensors (weights) pass through unchanged. Only the input tensor's own memory is
    matched, so a copy made by the op (e.g. an autocast cast) is saved as it is.
    """

    def pack(t: Tensor) -> Tensor | _PackedSpikes:
        return _PackedSpikes(t) if _same_memory(t, spikes) else t

    def unpack(saved: Tensor | _PackedSpikes) -> Tensor:
        if isinstance(saved, _PackedSpikes):
            return unpack_bits(saved.bits, saved.shape, saved.dtype)
        return saved

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
