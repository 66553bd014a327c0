"""Products of spike tensors, exact on tensor cores: attention on spikes.

Spiking self-attention multiplies binary matrices: ``q @ kᵀ`` counts coincident spikes, and
Spikformer's ``((v @ kᵀ) @ q) * scale`` multiplies those counts by spikes again. Every value is
an integer, so bfloat16 or float16 tensor cores with float32 accumulation compute them exactly,
bit for bit what the float32 matmul computes, while

* the operands are spikes (0 or 1) or counts the operand format holds: at most 256 for
  bfloat16, at most 2048 for float16 (the count of ``a @ b`` is at most its inner dimension);
* every sum stays at most 2^24 (float32 holds every integer up to it).

Both are read from shapes (:mod:`.rules`), no data is inspected: no host sync, and CUDA graph
capture works. On CUDA in float32, bfloat16 or float16 a product that meets them runs on
tensor cores; otherwise (another device, float64, a bound exceeded) the plain matmul in the
inputs' dtype runs, which is what the unfused model computes. :func:`spike_matmul_plan` and
:func:`spike_matmul_chain_plan` say which path a call takes and why. On tensor cores the output
has the inputs' dtype, also under autocast (where a plain matmul would round counts above 256
to bfloat16); the plain matmul follows autocast, as in the unfused model.

The inputs must hold only 0 and 1 (a neuron's spikes); that is the caller's promise, not
checked (checking would read the data). Under torch.fx symbolic tracing (what
:func:`~spikefuse.fused.fuse` does to find chains) a call is one graph node. Backward keeps the operands as ``torch.bool``, one
byte per spike, and the chain recomputes its counts instead of keeping them. On CUDA the
heads' chain (Spikformer's form) runs as one kernel each way, exact with float32 sums
(:class:`~.autograd.SpikeHeadsChainFunction`). :func:`spike_gate`, QKFormer's element-wise
gate, only keeps its operands as ``torch.bool``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from numbers import Real
from typing import Any

from torch import Tensor, fx

from ..errors import SpikefuseError
from .autograd import (
    SpikeGateFunction,
    SpikeHeadsChainFunction,
    SpikeMatmulChainFunction,
    SpikeMatmulFunction,
)
from .naive import spike_matmul_chain_heads_naive, spike_matmul_chain_naive, spike_matmul_naive
from .rules import Plan, plan

__all__ = [
    "Plan",
    "spike_gate",
    "spike_matmul",
    "spike_matmul_chain",
    "spike_matmul_chain_heads",
    "spike_matmul_chain_heads_naive",
    "spike_matmul_chain_naive",
    "spike_matmul_chain_plan",
    "spike_matmul_naive",
    "spike_matmul_plan",
]


def _check(name: str, *operands: Tensor) -> None:
    """Raise unless ``operands`` chain as matrices [..., M, K] @ [..., K, N] @ ... with equal
    batch dims, one floating dtype and one device."""
    for i, t in enumerate(operands):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: operand {i} must be a tensor, got {type(t).__name__}")
        if t.dim() < 2:
            raise SpikefuseError(
                f"{name}: operand {i} must be [..., rows, cols], got {tuple(t.shape)}"
            )
    first = operands[0]
    if not first.dtype.is_floating_point:
        raise SpikefuseError(f"{name}: spikes must be floating point (0.0/1.0), got {first.dtype}")
    shapes = [tuple(t.shape) for t in operands]
    for left, right in zip(operands, operands[1:], strict=False):
        if right.dtype != first.dtype or right.device != first.device:
            raise SpikefuseError(
                f"{name}: the operands must share one dtype and device, got "
                f"{[(t.dtype, t.device.type) for t in operands]}"
            )
        if left.shape[:-2] != right.shape[:-2] or left.shape[-1] != right.shape[-2]:
            raise SpikefuseError(
                f"{name}: shapes {shapes} do not chain as [..., M, K] @ [..., K, N] with equal "
                "batch dims (expand or reshape them first)"
            )


def _traced(function: Callable[..., Any], *args: Any) -> Any:
    """One call node where ``args`` are torch.fx proxies (``fuse`` reading a forward that calls
    a spike product; its autograd Function cannot run on proxies), else None."""
    proxy = next((a for a in args if isinstance(a, fx.Proxy)), None)
    return None if proxy is None else proxy.tracer.create_proxy("call_function", function, args, {})


def spike_matmul(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` of spike tensors: [..., M, K] @ [..., K, N] → [..., M, N] (equal batch dims),
    each output the count of k with a[m, k] = b[k, n] = 1; exact on CUDA tensor cores while
    K ≤ 2^24 (module docstring). Gradients flow to both inputs, as through ``a @ b``."""
    traced = _traced(spike_matmul, a, b)
    if traced is not None:
        return traced
    _check("spike_matmul", a, b)
    return SpikeMatmulFunction.apply(a, b)


def spike_matmul_chain(a: Tensor, b: Tensor, c: Tensor, scale: float = 1.0) -> Tensor:
    """``((a @ b) @ c) * scale`` of spike tensors: [..., M, K] @ [..., K, P] @ [..., P, N] →
    [..., M, N]. The counts ``a @ b`` (at most K) multiply ``c`` on bfloat16 tensor cores while
    K ≤ 256, on float16 ones while K ≤ 2048, and while K · P ≤ 2^24 (module docstring);
    otherwise as the plain matmul. Spikformer's self-attention is
    ``spike_matmul_chain(v, k.transpose(-2, -1), q, scale)`` on [T, B, heads, C/heads, L]
    spikes."""
    traced = _traced(spike_matmul_chain, a, b, c, scale)
    if traced is not None:
        return traced
    _check("spike_matmul_chain", a, b, c)
    if isinstance(scale, bool) or not isinstance(scale, Real) or not math.isfinite(scale):
        raise SpikefuseError(f"spike_matmul_chain: scale must be a finite number, got {scale!r}")
    return SpikeMatmulChainFunction.apply(a, b, c, float(scale))


def spike_matmul_chain_heads(qkv: Tensor, num_heads: int, scale: float = 1.0) -> Tensor:
    """Spikformer's self-attention product of one Q/K/V spike tensor: ``qkv`` [..., 3C, L]
    holds q, k and v in its channels 0..C, C..2C, 2C..3C, each split into ``num_heads`` heads
    [..., heads, C/heads, L]; returns ``spike_matmul_chain(v, kᵀ, q, scale)`` [..., heads,
    C/heads, L] (the same values) and, in backward, one gradient of qkv in qkv's own layout:
    where qkv is a fused block's spikes (channels innermost) the block reads it without a
    copy, and no concatenation of three head gradients runs."""
    traced = _traced(spike_matmul_chain_heads, qkv, num_heads, scale)
    if traced is not None:
        return traced
    _check_heads(qkv, num_heads)
    if isinstance(scale, bool) or not isinstance(scale, Real) or not math.isfinite(scale):
        raise SpikefuseError(
            f"spike_matmul_chain_heads: scale must be a finite number, got {scale!r}"
        )
    return SpikeHeadsChainFunction.apply(qkv, num_heads, float(scale))


def spike_gate(mask: Tensor, spikes: Tensor) -> Tensor:
    """``mask * spikes`` of spike tensors that broadcast (QKFormer's gate of K by its spiking
    attention mask): the same values and gradients, but backward keeps the operands as
    ``torch.bool`` (a byte per spike) where ``mul`` keeps them as they are, e.g. a float32 view
    that holds a whole Q/K block's output alive."""
    traced = _traced(spike_gate, mask, spikes)
    if traced is not None:
        return traced
    for name, t in (("mask", mask), ("spikes", spikes)):
        if not isinstance(t, Tensor) or not t.dtype.is_floating_point:
            got = t.dtype if isinstance(t, Tensor) else type(t).__name__
            raise SpikefuseError(f"spike_gate: {name} must be floating spikes, got {got}")
    return SpikeGateFunction.apply(mask, spikes)


def _check_heads(qkv: Tensor, num_heads: int) -> None:
    if not isinstance(qkv, Tensor) or qkv.dim() < 2 or not qkv.dtype.is_floating_point:
        got = f"{tuple(qkv.shape)} {qkv.dtype}" if isinstance(qkv, Tensor) else type(qkv)
        raise SpikefuseError(
            f"spike_matmul_chain_heads: qkv must be floating spikes [..., 3C, L], got {got}"
        )
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise SpikefuseError(
            f"spike_matmul_chain_heads: num_heads must be an int >= 1, got {num_heads!r}"
        )
    if qkv.shape[-2] % (3 * num_heads):
        raise SpikefuseError(
            f"spike_matmul_chain_heads: {qkv.shape[-2]} channels do not split into q, k, v of "
            f"{num_heads} heads each (3 x num_heads must divide them)"
        )


def spike_matmul_plan(a: Tensor, b: Tensor) -> Plan:
    """How :func:`spike_matmul` runs on these inputs, and why."""
    _check("spike_matmul_plan", a, b)
    return plan(a, a.shape[-1])


def spike_matmul_chain_plan(a: Tensor, b: Tensor, c: Tensor) -> tuple[Plan, Plan]:
    """How :func:`spike_matmul_chain` runs its two products (``a @ b``, then the counts times
    ``c``) on these inputs, and why."""
    _check("spike_matmul_chain_plan", a, b, c)
    return plan(a, a.shape[-1]), plan(a, c.shape[-2], count=a.shape[-1])
