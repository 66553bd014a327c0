"""Which path a spike product takes, and why: the exactness rules of :mod:`spikefuse.spike_matmul`.

A product of integer matrices is exact in floating point while every operand value and
every sum is an integer the format holds exactly. bfloat16 holds the integers 0..256 (8
significant bits), float16 0..2048 (11 bits), float32 0..2^24 (24 bits). Tensor cores multiply
bf16/fp16 operands exactly and, with a float32 output (``torch.mm``/``torch.bmm`` with
``out_dtype=torch.float32``), accumulate in float32; so for operands of at most ``count`` and
an inner dimension K:

* binary operands (spikes, count 1): bf16, exact while K ≤ 2^24;
* counts ≤ 256 times spikes: bf16, exact while K · count ≤ 2^24;
* counts ≤ 2048 times spikes: fp16, exact while K · count ≤ 2^24.

Both bounds are read from shapes (the count of ``a @ b`` is at most its inner dimension), never
from the data: no host sync. Where a rule fails, or off CUDA, the plain matmul in the inputs'
dtype runs: what the unfused model computes (exact in float32 while the sums stay ≤ 2^24).
:func:`plan` names the path and the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

#: The largest integer each operand format holds exactly, together with all below it.
EXACT_INTEGERS = {torch.bfloat16: 256, torch.float16: 2048}
#: The largest integer float32 accumulates exactly (and all below it).
FLOAT32_EXACT_SUM = 2**24


@dataclass(frozen=True)
class Plan:
    """How one spike product runs: on ``operands`` (bfloat16 or float16) tensor cores with a
    float32 output, or (None) as the plain matmul in the inputs' dtype; ``reason`` says why."""

    operands: torch.dtype | None
    reason: str

    @property
    def fast(self) -> bool:
        """Whether the product runs on tensor cores."""
        return self.operands is not None


def plan(like: Tensor, inner: int, count: int = 1) -> Plan:
    """The path of a product whose left operand holds integers 0..``count`` (1: spikes) and
    whose right operand holds spikes, with inner dimension ``inner``, on ``like``'s device and
    dtype (both operands share them)."""
    return plan_for(like.device, like.dtype, inner, count)


def plan_for(device: torch.device, dtype: torch.dtype, inner: int, count: int = 1) -> Plan:
    """:func:`plan` of operands in ``dtype`` on ``device``."""
    if device.type != "cuda":
        return Plan(None, f"on {device.type}, not CUDA: the plain matmul")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return Plan(None, f"{dtype} inputs: the plain matmul keeps their precision")
    if inner * count > FLOAT32_EXACT_SUM:
        return Plan(
            None,
            f"sums up to {inner} x {count} exceed 2^24, which float32 accumulates exactly: "
            "the plain matmul (the unfused model's rounding)",
        )
    for dtype, largest in EXACT_INTEGERS.items():
        if count <= largest:
            return Plan(dtype, f"counts up to {count} are exact in {dtype}")
    return Plan(
        None,
        f"counts up to {count} exceed 2048, the largest integers float16 holds with all below "
        "them: the plain matmul",
    )
