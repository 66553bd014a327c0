"""Binary spikes: the tag fused blocks put on their output, and 1-bit packing of tagged spikes.

A fused block's output holds only 0 and 1 (or NaN where the neuron's input was NaN); what keeps
such a tensor for backward (the minimal-memory mode's block input, a residual block's shortcut,
a layer's saved input where no recipe recomputes it: see :mod:`.recompute`) keeps it at 1 bit
per element (8 per byte: 1/32 of float32) as a :class:`PackedSpikes`, plus
one flag: a packed NaN comes back as NaN in every element, so backward sees it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..cuda import spike_bits as cuda_bits
from ..cuda import unavailable_reason
from .device_constants import device_constant

_SPIKES = "_spikefuse_spikes"  # tag: the tensor holds only 0 and 1 (a fused block's output)


def mark_spikes(t: Tensor) -> Tensor:
    """Tag ``t`` as binary spikes (until it is modified in place); returns t. Inference tensors
    (``torch.inference_mode``) have no version counter and stay untagged: nothing is kept for a
    backward there."""
    if not t.is_inference():
        setattr(t, _SPIKES, t._version)
    return t


def is_spikes(t: Tensor) -> bool:
    """Whether ``t`` (or the tensor it is a view of) is tagged as unmodified spikes."""
    for candidate in (t, t._base):
        if (
            candidate is not None
            and not candidate.is_inference()
            and getattr(candidate, _SPIKES, None) == candidate._version
        ):
            return True
    return False


def _bit_weights(device: torch.device) -> Tensor:
    return device_constant(
        ("bit weights", device),
        lambda: torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=device),
    )


def memory_order(t: Tensor) -> tuple[int, ...]:
    """The dimension order in which ``t``'s elements lie in memory (outermost first), when
    that order is dense (e.g. a channels-last map), else the logical order."""
    strides = t.stride()
    order = tuple(sorted(range(t.dim()), key=lambda d: -strides[d]))
    return order if t.permute(order).is_contiguous() else tuple(range(t.dim()))


# Elements the torch composites pack or unpack per step (a multiple of 8): their temporaries
# stay this size (16 MiB of bool) instead of growing with the block.
_PACK_STEP = 1 << 24


def pack_bits(spikes: Tensor, order: tuple[int, ...]) -> Tensor:
    """0/1 values → uint8 [4 ceil(n / 32) + 1], read in ``order`` (:func:`memory_order`: no
    copy): ceil(n / 32) little-endian 32-bit words (bit k of byte i: element 8 i + k), then a
    byte that is 1 when a value was NaN (a neuron's input was NaN): 1 bit cannot hold it, so
    :func:`unpack_bits` then gives NaN everywhere rather than a valid-looking 1 there. One
    kernel on CUDA (:mod:`spikefuse.cuda.spike_bits`), torch ops elsewhere: the same bytes."""
    flat = spikes.permute(order).reshape(-1)
    return cuda_bits.pack(flat) if unavailable_reason(flat) is None else _pack_torch(flat)


def unpack_bits(
    packed: Tensor, shape: torch.Size, dtype: torch.dtype, order: tuple[int, ...]
) -> Tensor:
    """The inverse of :func:`pack_bits` (NaN everywhere if a NaN was packed): a tensor of
    ``shape`` with the packed tensor's memory layout (a dense ``order``)."""
    flat = torch.empty(shape.numel(), dtype=dtype, device=packed.device)
    unpack = cuda_bits.unpack if unavailable_reason(flat) is None else _unpack_torch
    dense = unpack(packed, flat).view([shape[d] for d in order])
    inverse = sorted(range(len(order)), key=lambda d: order[d])
    return dense.permute(inverse)


def _pack_torch(flat: Tensor) -> Tensor:
    """:func:`pack_bits` of a 1-D tensor with torch ops, in steps of :data:`_PACK_STEP`."""
    n = flat.numel()
    packed = torch.empty(cuda_bits.packed_bytes(n), dtype=torch.uint8, device=flat.device)
    packed[-(-n // 8) : -1].zero_()  # the last word's bytes past the last value's
    weights = _bit_weights(flat.device)
    total = flat.new_zeros(())  # NaN when any value is (spikes hold no infinities)
    for start in range(0, n, _PACK_STEP):
        values = flat[start : start + _PACK_STEP]
        total += values.sum()
        bits = (values != 0).to(torch.uint8)
        pad = -bits.numel() % 8  # only in the last, partial byte
        if pad:
            bits = torch.cat([bits, bits.new_zeros(pad)])
        part = (bits.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)
        packed[start // 8 : start // 8 + part.shape[0]] = part
    packed[-1] = total.isnan()
    return packed


def _unpack_torch(packed: Tensor, flat: Tensor) -> Tensor:
    """:func:`unpack_bits`' values written into ``flat`` (1-D) with torch ops in steps of
    :data:`_PACK_STEP`; returns flat."""
    n, dtype = flat.numel(), flat.dtype
    weights = _bit_weights(packed.device)
    poison = torch.where(packed[-1] != 0, float("nan"), 0.0).to(dtype)  # NaN: a NaN was packed
    for start in range(0, n, _PACK_STEP):
        part = flat[start : start + _PACK_STEP]
        byte = packed[start // 8 : start // 8 + -(-part.numel() // 8)]
        bits = (byte[:, None] & weights) != 0
        torch.add(bits.view(-1)[: part.numel()], poison, out=part)
    return flat


@dataclass(frozen=True)
class PackedSpikes:
    """A binary tensor kept at 1 bit per element: :meth:`unpack` gives it back (same values,
    shape, dtype and memory layout)."""

    bits: Tensor  # uint8 [4 ceil(n / 32) + 1]: the bits, then whether a NaN was packed
    shape: torch.Size
    dtype: torch.dtype
    order: tuple[int, ...]  # the dimension order of the tensor's memory (memory_order)

    @classmethod
    def of(cls, spikes: Tensor) -> PackedSpikes:
        order = memory_order(spikes)
        return cls(pack_bits(spikes, order), spikes.shape, spikes.dtype, order)

    def unpack(self) -> Tensor:
        return unpack_bits(self.bits, self.shape, self.dtype, self.order)


#: A tensor kept for backward: itself, or its packing when it is spikes (:func:`compact`).
Compact = Tensor | PackedSpikes


def compact(t: Tensor) -> Compact:
    """``t`` packed at 1 bit per element when it is tagged spikes (:func:`is_spikes`), else
    ``t`` itself; :func:`expand` gives it back."""
    return PackedSpikes.of(t) if is_spikes(t) else t


def expand(kept: Compact) -> Tensor:
    """The tensor :func:`compact` kept."""
    return kept.unpack() if isinstance(kept, PackedSpikes) else kept


#: How a packing lays its bits out: (shape, dtype, memory order) of the packed tensor.
Packing = tuple[torch.Size, torch.dtype, tuple[int, ...]]


def split(kept: Compact) -> tuple[Tensor, Packing | None]:
    """``kept`` as the tensor an autograd Function saves (``ctx.save_for_backward``: checked
    against in-place edits, seen by saved-tensor hooks) and its packing (None: a plain tensor);
    :func:`join` puts them back together."""
    if isinstance(kept, PackedSpikes):
        return kept.bits, (kept.shape, kept.dtype, kept.order)
    return kept, None


def join(saved: Tensor, packing: Packing | None) -> Compact:
    """The :data:`Compact` that :func:`split` took apart."""
    return saved if packing is None else PackedSpikes(saved, *packing)
