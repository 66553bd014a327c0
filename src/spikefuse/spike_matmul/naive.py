"""The spike products as plain torch matmuls: the reference the fast path must equal.

Autograd differentiates them, so their gradients are what the hand-written backward of
:mod:`.autograd` must give::

    spike_matmul_naive(a, b)                = a @ b
    spike_matmul_chain_naive(a, b, c, s)    = ((a @ b) @ c) * s
    spike_matmul_chain_heads_naive(qkv, h, s) = the chain of v, kᵀ, q cut from qkv

Every intermediate is kept for backward (the counts ``a @ b`` too): for tests, never for
training.
"""

from __future__ import annotations

from torch import Tensor


def spike_matmul_naive(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` ([..., M, K] @ [..., K, N] → [..., M, N]) in the inputs' dtype."""
    return a @ b


def spike_matmul_chain_naive(a: Tensor, b: Tensor, c: Tensor, scale: float = 1.0) -> Tensor:
    """``((a @ b) @ c) * scale`` ([..., M, K] @ [..., K, P] @ [..., P, N] → [..., M, N]): the
    product Spikformer's self-attention takes of its value, key and query spikes."""
    return ((a @ b) @ c) * scale


def spike_matmul_chain_heads_naive(qkv: Tensor, num_heads: int, scale: float = 1.0) -> Tensor:
    """``spike_matmul_chain_naive(v, kᵀ, q, scale)`` of the heads [..., heads, C/heads, L] of
    q, k, v, the channels 0..C, C..2C and 2C..3C of qkv [..., 3C, L]."""
    q, k, v = qkv.unflatten(-2, (3 * num_heads, -1)).chunk(3, dim=-3)
    return spike_matmul_chain_naive(v, k.transpose(-2, -1), q, scale)
