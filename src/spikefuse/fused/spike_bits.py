"""1-bit packing of binary spikes (the tags that say a tensor holds spikes: :mod:`.recompute`).

A fused block's output holds only 0 and 1 (or NaN where the neuron's input was NaN); what keeps
such a tensor for backward (the minimal-memory mode's block input, a residual block's shortcut,
a layer's saved input where no recipe recomputes it and it takes 4 MiB or more: see
:mod:`.recompute`) keeps it at 1 bit per element (8 per byte: 1/32 of float32) as a
:class:`PackedSpikes`, plus a flag byte per 32 elements: a packed NaN comes back as NaN in the elements of its 32-bit word, so backward sees
it. The pooling BN-folded neuron kernels write the same packing of their output, the k² spikes
behind each k x k mean at 1 bit each (a word: 8 means of 2 x 2), which a fused block then keeps
to restore its output in backward instead of recomputing it (see :mod:`.recompute`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor

from ..backends import (
    SpikePacking,
    capability,
    dense_in_order,
    flags_at,
    packed_bytes,
    packed_words,
)
from .device_constants import device_constant


def _bit_weights(device: torch.device) -> Tensor:
    return device_constant(
        ("bit weights", device),
        lambda: torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=device),
    )


def memory_order(t: Tensor) -> tuple[int, ...]:
    """The dimension order in which ``t``'s elements lie in memory (outermost first), when
    that order is dense (e.g. a channels-last map), else the logical order."""
    order = dense_order(t.shape, t.stride())
    return tuple(range(t.dim())) if order is None else order


def strides_in_order(like: Tensor, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a dense tensor of ``shape`` whose dimensions lie in memory in the order
    of ``like``'s strides (outermost first; e.g. channels-last like a channels-last map)."""
    like_strides = like.stride()
    outermost_first = tuple(sorted(range(like.dim()), key=lambda d: -like_strides[d]))
    sizes = tuple(shape)
    if all(type(n) is int for n in sizes):  # symbolic sizes (torch.compile) cannot be hashed
        return _dense_strides(sizes, outermost_first)
    return _dense_strides.__wrapped__(sizes, outermost_first)


@functools.lru_cache(maxsize=1024)
def _dense_strides(shape: tuple[int, ...], order: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a dense tensor of ``shape`` whose dimensions lie in memory in ``order``
    (outermost first). Once per geometry: every unpacking asks."""
    strides, step = [0] * len(shape), 1
    for d in reversed(order):
        strides[d], step = step, step * shape[d]
    return tuple(strides)


def empty_in_order(
    like: Tensor, shape: tuple[int, ...], dtype: torch.dtype | None = None
) -> Tensor:
    """An uninitialised dense tensor of ``shape`` laid out as :func:`strides_in_order` says."""
    strides = strides_in_order(like, shape)
    return torch.empty_strided(shape, strides, dtype=dtype or like.dtype, device=like.device)


@functools.lru_cache(maxsize=1024)
def dense_order(shape: torch.Size, strides: tuple[int, ...]) -> tuple[int, ...] | None:
    """The order (outermost first) in which a tensor of this geometry fills its memory span
    exactly once, or None where it does not (a strided slice, an expanded view). Once per
    geometry: fused blocks ask on every call."""
    order = tuple(sorted(range(len(shape)), key=lambda d: -strides[d]))
    return order if dense_in_order(shape, strides, order) else None


# Elements the torch composites pack or unpack per step (a multiple of 32: a step's words are its
# own): their temporaries stay this size (16 MiB of bool) instead of growing with the block.
_PACK_STEP = 1 << 24


def pack_bits(spikes: Tensor, order: tuple[int, ...]) -> Tensor:
    """0/1 values → uint8 [5 W], W = ceil(n / 32), read in ``order`` (:func:`memory_order`: no
    copy): W little-endian 32-bit words (bit k of byte i: element 8 i + k), then W bytes, byte w
    1 when a value of word w was NaN (a neuron's input was NaN): 1 bit cannot hold it, so
    :func:`unpack_bits` then gives NaN in that word's elements rather than a valid-looking 1.
    One kernel where a backend offers the ``spike_bits`` capability (CUDA), torch ops
    elsewhere: the same bytes."""
    flat = spikes.permute(order).reshape(-1)
    kernels = cast(SpikePacking | None, capability("spike_bits", flat))
    return _pack_torch(flat) if kernels is None else kernels.pack(flat)


def unpack_bits(
    packed: Tensor,
    shape: torch.Size,
    dtype: torch.dtype,
    order: tuple[int, ...],
    window: int = 1,
) -> Tensor:
    """The inverse of :func:`pack_bits` (NaN in the elements of a word that held a NaN): a
    tensor of ``shape`` with the packed tensor's memory layout (a dense ``order``).
    ``window`` = k² > 1: the packing the pooled neuron kernels write of k x k window means
    (k² bits per value, on CUDA)."""
    # the tensor itself laid out in ``order``, written through a flat view of its memory
    out = torch.empty_strided(
        shape, _dense_strides(shape, order), dtype=dtype, device=packed.device
    )
    flat = out.as_strided((shape.numel(),), (1,))
    kernels = cast(SpikePacking | None, capability("spike_bits", flat))
    if kernels is not None:
        kernels.unpack(packed, flat, window)
    elif window == 1:
        _unpack_torch(packed, flat)
    else:  # only the CUDA neuron kernels write such a packing
        raise ValueError(f"spikefuse: a packing of {window}-bit values unpacks on CUDA only")
    return out


def _pack_torch(flat: Tensor) -> Tensor:
    """:func:`pack_bits` of a 1-D tensor with torch ops, in steps of :data:`_PACK_STEP`."""
    n = flat.numel()
    packed = torch.empty(packed_bytes(n), dtype=torch.uint8, device=flat.device)
    flags = packed[flags_at(n) :]
    weights = _bit_weights(flat.device)
    for start in range(0, n, _PACK_STEP):
        values = flat[start : start + _PACK_STEP]
        bits, nans = (values != 0).to(torch.uint8), values.isnan()
        pad = -values.numel() % 32  # only in the last, partial word
        if pad:
            bits, nans = (
                torch.cat([bits, bits.new_zeros(pad)]),
                torch.cat([nans, nans.new_zeros(pad)]),
            )
        part = (bits.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)
        packed[start // 8 : start // 8 + part.shape[0]] = part
        flags[start // 32 : start // 32 + part.shape[0] // 4] = nans.view(-1, 32).any(dim=1)
    return packed


def _unpack_torch(packed: Tensor, flat: Tensor) -> Tensor:
    """:func:`unpack_bits`' values written into ``flat`` (1-D) with torch ops in steps of
    :data:`_PACK_STEP`; returns flat."""
    n, dtype = flat.numel(), flat.dtype
    weights = _bit_weights(packed.device)
    flags = packed[flags_at(n) :]
    for start in range(0, n, _PACK_STEP):
        part = flat[start : start + _PACK_STEP]
        size = part.numel()
        byte = packed[start // 8 : start // 8 + -(-size // 8)]
        bits = (byte[:, None] & weights) != 0
        # NaN in the elements of a word that held a NaN, 0 elsewhere
        word_flags = flags[start // 32 : start // 32 + -(-size // 32)]
        poison = torch.where(word_flags != 0, float("nan"), 0.0).to(dtype)
        torch.add(bits.view(-1)[:size], poison.repeat_interleave(32)[:size], out=part)
    return flat


@dataclass(frozen=True)
class PackedSpikes:
    """A binary tensor kept at 1 bit per element (or a tensor of k x k window means of spikes at
    ``window`` = k² bits per element): :meth:`unpack` gives it back (same values, shape, dtype
    and memory layout)."""

    bits: Tensor  # uint8 [5 W]: W words of bits, then per word whether a NaN was packed
    shape: torch.Size
    dtype: torch.dtype
    order: tuple[int, ...]  # the dimension order of the tensor's memory (memory_order)
    window: int = 1  # bits per element

    @classmethod
    def of(cls, spikes: Tensor) -> PackedSpikes:
        order = memory_order(spikes)
        return cls(pack_bits(spikes, order), spikes.shape, spikes.dtype, order)

    @classmethod
    def written(cls, bits: Tensor, like: Tensor, window: int) -> PackedSpikes:
        """The packing ``bits`` that a neuron kernel wrote of its output ``like`` (in like's
        memory order) at ``window`` bits per element."""
        return cls(bits, like.shape, like.dtype, memory_order(like), window)

    def unpack(self) -> Tensor:
        return unpack_bits(self.bits, self.shape, self.dtype, self.order, self.window)

    def viewed_as(self, view: Tensor) -> PackedSpikes:
        """The packing of ``view``, a dense view of the packed tensor's memory in another
        shape (e.g. unflattened): the same bits, as a packing lies in memory order."""
        return PackedSpikes(self.bits, view.shape, view.dtype, memory_order(view), self.window)


def joined_batch_chunks(parts: list[Tensor], steps: int) -> Tensor:
    """The packing of a [T, B, ...] tensor from the packings the kernels wrote of its equal
    batch chunks [T, B / K, ...] in batch order (each of a step's words whole: the kernels pack
    only such chunks): per step, the chunks' words one after another, then their flags
    likewise (a packing is in memory order, steps outermost, then the batch)."""
    words = parts[0].numel() // 5  # 4 bytes of bits and a flag byte per word

    def joined(lo: int, hi: int) -> Tensor:  # [T, K, bytes per chunk and step], flattened
        return torch.stack([p[lo:hi].view(steps, -1) for p in parts], 1).flatten()

    return torch.cat([joined(0, 4 * words), joined(4 * words, 5 * words)])


def batch_chunk_rows(packing: PackedSpikes, chunks: int, row_bytes: int) -> Tensor | None:
    """The packings of all ``chunks`` equal batch chunks [T, B / K, ...] of the tensor
    ``packing`` holds, as rows of a [chunks, row_bytes] tensor (each row: the chunk's words,
    then its flags, then padding), in two copies; None where the chunks do not lie in whole
    words of their own (see :func:`packing_part`, which cuts one such chunk). A row is the
    packing of its chunk, as :func:`pack_bits` would write it in the same memory order."""
    shape, window = packing.shape, packing.window
    if not can_cut(shape, packing.order, window, chunks):
        return None
    steps, words = shape[0], packed_words(shape.numel(), window)
    chunk_words = words // chunks
    rows = packing.bits.new_empty((chunks, row_bytes))
    # (source bytes, where in a row, width): the words, then the flags
    spans = (
        (0, 4 * words, 0, 4 * chunk_words),
        (4 * words, 5 * words, 4 * chunk_words, chunk_words),
    )
    for lo, hi, at, width in spans:
        source = packing.bits[lo:hi].view(steps, chunks, -1).transpose(0, 1)
        rows[:, at : at + width].view(chunks, steps, -1).copy_(source)
    return rows


def can_cut(shape: torch.Size, order: tuple[int, ...], window: int, chunks: int) -> bool:
    """Whether the equal batch chunks of a packed tensor of ``shape`` (memory ``order``,
    ``window`` bits per element) lie in whole words of their own: steps and then the batch
    outermost in memory, a chunk's step whole words."""
    steps, batch = shape[0], shape[1]
    step_bits = shape.numel() // max(steps, 1) * window
    return order[:2] == (0, 1) and batch % chunks == 0 and step_bits % (32 * chunks) == 0


def packing_part(packing: PackedSpikes, index: int, chunks: int) -> PackedSpikes | None:
    """The packing of batch chunk ``index`` of ``chunks`` equal ones [T, B / K, ...] of the
    tensor ``packing`` holds (a copy of 1/K of its bytes; the inverse of
    :func:`joined_batch_chunks`), or None where they do not lie in whole words of their own:
    the steps and then the batch outermost in memory, each chunk's step a whole number of
    words."""
    shape, window = packing.shape, packing.window
    if not can_cut(shape, packing.order, window, chunks):
        return None
    steps, batch = shape[0], shape[1]
    words = packed_words(shape.numel(), window)

    def part(lo: int, hi: int) -> Tensor:  # chunk index's bytes of every step, in step order
        return packing.bits[lo:hi].view(steps, chunks, -1)[:, index].flatten()

    bits = torch.cat([part(0, 4 * words), part(4 * words, 5 * words)])
    chunk_shape = torch.Size((steps, batch // chunks, *shape[2:]))
    return PackedSpikes(bits, chunk_shape, packing.dtype, packing.order, window)


#: How a packing lays its bits out: (shape, dtype, memory order, bits per element) of the
#: packed tensor.
Packing = tuple[torch.Size, torch.dtype, tuple[int, ...], int]
