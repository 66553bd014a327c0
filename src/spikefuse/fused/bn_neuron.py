"""BatchNorm → spiking neuron as one autograd function that keeps only its input for backward.

For the synapse output ``y`` of shape ``[T, B, C, *spatial]`` (Conv: ``[T, B, C, H, W]``,
Linear: ``[T, B, C]``) with per-channel statistics over every dimension except C (tdBN)::

    mean[c], var[c] = batch (or running) statistics of y[:, :, c]
    invstd          = 1 / sqrt(var + eps)
    scale           = gamma * invstd,  shift = beta - mean * scale
    x               = y * scale[c] + shift[c]                      (BN output)
    spikes          = neuron(x)                                    (BPTT through T)

Saved for backward: ``y`` and the per-channel vectors only. Backward recomputes x and the
neuron's forward, runs the neuron's BPTT to get ``g = dL/dx`` and finishes BatchNorm's backward
with two per-channel sums (all-reduced across processes when torch.distributed is initialised)::

    sum_g[c]    = Σ g,       sum_gxh[c] = Σ g * xhat,      xhat = (y - mean) * invstd
    dL/dgamma   = sum_gxh,   dL/dbeta   = sum_g             (local sums: DDP averages them)
    dL/dy       = scale * (g - Σ_all g / n - xhat * Σ_all g xhat / n)    (batch statistics)
    dL/dy       = scale * g                                              (running statistics)

with n the number of elements per channel over all processes. All element-wise work sits in
three functions, the places where kernels plug in: :func:`bn_neuron_forward` (affine + neuron
forward), :func:`bn_neuron_backward` (pass 1: affine + neuron recompute + BPTT + the two
per-channel sums; the affine belongs in a kernel's prologue, the sums in its epilogue) and
:func:`bn_input_grad` (pass 2: dL/dy from g, which it may recompute).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ..errors import SpikefuseError
from ..neuron import BaseNode
from ..ops import _bptt, backend_module
from ..program import NeuronProgram
from ..reference import compute_dtype


@dataclass(frozen=True)
class NeuronCall:
    """What the neuron ops need from a node, fixed for one forward/backward pair.

    Every call starts from the node's reset state (``v = v_reset``, or 0 for soft reset).
    """

    program: NeuronProgram
    backend: str  # resolved: 'torch' or 'cuda'
    constants: tuple[float, ...]
    v_init: float

    @classmethod
    def from_node(cls, node: BaseNode, x: Tensor) -> NeuronCall:
        if node.definition.adaptive:
            raise SpikefuseError(
                f"fused blocks support one-state neurons only; {type(node).__name__} has two states"
            )
        v_init = 0.0 if node.v_reset is None else float(node.v_reset)
        backend = node.resolve_backend(x)
        return cls(node.program, backend, tuple(node.constants()), v_init)

    def forward(
        self, x: Tensor, learnable: Tensor | None, save: bool
    ) -> tuple[Tensor, tuple | None]:
        """Spikes [T, *] in x's dtype, and what backward can reuse (None: nothing was kept).

        With ``save``, what the backend's forward saves is kept if it is small (the cuda
        backend's chunk checkpoints: 1/CHUNK of x's elements); a saved [T, N] sequence (the
        reference backend's H) would be as large as x, so it is recomputed in backward instead.
        """
        backend = backend_module(self.backend)
        keep = save and not backend.SAVES_SEQUENCE
        out = backend.fptt(self.program, x, None, None, learnable, list(self.constants),
                           [self.v_init, 0.0], keep, False)  # fmt: skip
        return out.spikes, ((out.saved_v,) if keep else None)

    def input_grad(
        self, x: Tensor, learnable: Tensor | None, grad_spikes: Tensor, saved: tuple | None
    ) -> tuple[Tensor, Tensor | None]:
        """BPTT from x: dL/dx [T, *] and dL/d(learnable) [P] (None without learnable params).

        ``saved`` is what :meth:`forward` kept (its tensor may be None: for T <= CHUNK the cuda
        backend needs nothing); when None, the neuron's forward is recomputed first to get what
        the backend's BPTT needs.
        """
        backend = backend_module(self.backend)
        init = [self.v_init, 0.0]
        constants = list(self.constants)
        if saved is None:
            out = backend.fptt(self.program, x, None, None, learnable, constants, init, True, False)
            saved = (out.saved_v,)
        keep_x = x if backend.keeps_x(self.program) else None
        grad_x, _, _, grad_learnable = _bptt(
            self.program, self.backend, grad_spikes.to(x.dtype), None, None, None, saved[0], None,
            keep_x, None, None, learnable, constants, init,
        )  # fmt: skip
        return grad_x, grad_learnable


def _per_channel(v: Tensor, ndim: int) -> Tensor:
    """[C] → [1, 1, C, 1, ...] broadcastable against a [T, B, C, *spatial] tensor."""
    return v.view(1, 1, -1, *([1] * (ndim - 3)))


def _reduce_dims(ndim: int) -> list[int]:
    return [0, 1, *range(3, ndim)]


def _neuron_input(y: Tensor, scale: Tensor | None, shift: Tensor | None) -> Tensor:
    """x = y * scale + shift in float32 (float64 stays); y itself when there is no BN."""
    if scale is None:
        return y
    cd = compute_dtype(y.dtype)
    return torch.addcmul(_per_channel(shift, y.dim()), y.to(cd), _per_channel(scale, y.dim()))


def bn_neuron_forward(
    y: Tensor,
    scale: Tensor | None,
    shift: Tensor | None,
    neuron: NeuronCall,
    learnable: Tensor | None,
    save: bool,
) -> tuple[Tensor, tuple | None]:
    """Spikes [T, B, C, *] in y's dtype from the synapse output y (no BN when scale is None),
    and the neuron state backward may reuse (see :meth:`NeuronCall.forward`)."""
    spikes, saved = neuron.forward(_neuron_input(y, scale, shift), learnable, save)
    return spikes.to(y.dtype), saved


def bn_neuron_backward(
    y: Tensor,
    scale: Tensor | None,
    shift: Tensor | None,
    mean: Tensor | None,
    invstd: Tensor | None,
    neuron: NeuronCall,
    learnable: Tensor | None,
    grad_spikes: Tensor,
    saved: tuple | None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """Backward pass 1 (the paper's Alg. 2): recompute the neuron from y, BPTT, per-channel sums.

    Returns ``(g, sum_g, sum_gxhat, grad_learnable)``: the two local per-channel sums [C]
    (None without BN), the gradient of the neuron's learnable parameters [P] and, optionally,
    g = dL/dx [T, B, C, *] in the compute dtype for pass 2 to reuse. An implementation may
    return g = None (pass 2 then recomputes it) to avoid holding a float32 buffer next to
    half-precision activations; without BN it must return g.
    """
    x = _neuron_input(y, scale, shift)
    g, grad_learnable = neuron.input_grad(x, learnable, grad_spikes, saved)
    if scale is None:
        return g, None, None, grad_learnable
    dims = _reduce_dims(y.dim())
    sum_g = g.sum(dims)
    xc = y.to(g.dtype) - _per_channel(mean, y.dim())
    sum_gxhat = xc.mul_(g).sum(dims) * invstd
    return g, sum_g, sum_gxhat, grad_learnable


def bn_input_grad(
    g: Tensor | None,
    y: Tensor,
    scale: Tensor,
    shift: Tensor,
    coef_y: Tensor | None,
    coef_0: Tensor | None,
    neuron: NeuronCall,
    learnable: Tensor | None,
    grad_spikes: Tensor,
    saved: tuple | None,
) -> Tensor:
    """Backward pass 2 (the paper's Alg. 3): dL/dy in y's dtype.

    dL/dy = g * scale[c] + y * coef_y[c] + coef_0[c] (the last two terms only with batch
    statistics). Uses pass 1's g when given, overwriting it (so float32 needs no new buffer),
    else recomputes g from y.
    """
    if g is None:
        g, _ = neuron.input_grad(_neuron_input(y, scale, shift), learnable, grad_spikes, saved)
    ndim = y.dim()
    grad_y = g.mul_(_per_channel(scale, ndim))
    if coef_y is not None:
        grad_y.addcmul_(y, _per_channel(coef_y, ndim)).add_(_per_channel(coef_0, ndim))
    return grad_y.to(y.dtype)


# ---- statistics, synchronised across processes ------------------------------------------------
def _distributed(group: dist.ProcessGroup | None) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def batch_stats(
    y: Tensor, group: dist.ProcessGroup | None = None
) -> tuple[Tensor, Tensor, int | Tensor]:
    """Per-channel (mean, biased var) over all dims but C, across processes; and the count n.

    Each process computes its local mean/var in one pass; processes then all-reduce
    (n·mean, n·(var + mean²), n) in float64 so recombining the moments loses nothing. Across
    processes n stays a 0-dim tensor: reading it on the host would stall the GPU stream.
    """
    cd = compute_dtype(y.dtype)
    dims = _reduce_dims(y.dim())
    var, mean = torch.var_mean(y.to(cd), dim=dims, correction=0)
    count = y.numel() // y.shape[2]
    if not _distributed(group):
        return mean, var, count
    n = float(count)
    packed = torch.cat(
        [
            mean.double() * n,
            (var.double() + mean.double() ** 2) * n,
            mean.new_full((1,), n, dtype=torch.float64),
        ]
    )
    dist.all_reduce(packed, group=group)
    c = mean.numel()
    total = packed[-1]
    g_mean = packed[:c] / total
    g_var = (packed[c : 2 * c] / total - g_mean**2).clamp_(min=0)
    return g_mean.to(cd), g_var.to(cd), total


def all_reduce_sums(sums: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """Sum a small per-channel tensor over processes, in place (no-op when not distributed)."""
    if _distributed(group):
        dist.all_reduce(sums, group=group)
    return sums


@dataclass
class BNSpec:
    """The BatchNorm side of a fused call (None weight/bias: affine=False).

    ``batch_stats`` says whether statistics come from the batch (training, or no running
    statistics) or from ``running_mean``/``running_var``; ``momentum`` is the running-average
    factor of this call (None: do not update the running statistics).
    """

    weight: Tensor | None
    bias: Tensor | None
    running_mean: Tensor | None
    running_var: Tensor | None
    batch_stats: bool
    momentum: float | None
    eps: float
    group: dist.ProcessGroup | None = None


class BNNeuronFunction(torch.autograd.Function):
    """spikes = neuron(BN(y)); saves y and per-channel vectors only (see the module docstring).

    ``apply(y, weight, bias, learnable, bn, neuron, save)``: ``weight``/``bias`` are BN's
    gamma/beta (or None), passed separately from ``bn`` so autograd tracks them; ``bn`` None
    means no BN; ``save`` whether a backward will follow (keep the neuron's checkpoints).
    """

    @staticmethod
    def forward(ctx, y, weight, bias, learnable, bn: BNSpec | None, neuron: NeuronCall,
                save: bool = True):  # fmt: skip
        scale = shift = mean = invstd = None
        count = 0
        if bn is not None:
            mean, invstd, count = _bn_affine_stats(y, bn)
            scale = invstd * weight.to(invstd.dtype) if weight is not None else invstd
            shift = -mean * scale
            if bias is not None:
                shift = shift + bias.to(scale.dtype)
        spikes, saved = bn_neuron_forward(y, scale, shift, neuron, learnable, save)
        ctx.save_for_backward(y, scale, shift, mean, invstd, learnable, *(saved or ()))
        ctx.kept = saved is not None
        ctx.neuron, ctx.bn, ctx.count = neuron, bn, count
        ctx.param_dtypes = (
            None if weight is None else weight.dtype,
            None if bias is None else bias.dtype,
        )
        return spikes

    @staticmethod
    def backward(ctx, grad_spikes):
        y, scale, shift, mean, invstd, learnable, *saved = ctx.saved_tensors
        saved = tuple(saved) if ctx.kept else None
        bn: BNSpec | None = ctx.bn
        g, sum_g, sum_gxhat, grad_learnable = bn_neuron_backward(
            y, scale, shift, mean, invstd, ctx.neuron, learnable, grad_spikes, saved
        )
        grad_learnable = grad_learnable if ctx.needs_input_grad[3] else None
        if bn is None:
            return g.to(y.dtype), None, None, grad_learnable, None, None, None
        weight_dtype, bias_dtype = ctx.param_dtypes
        grad_weight = sum_gxhat.to(weight_dtype) if ctx.needs_input_grad[1] else None
        grad_bias = sum_g.to(bias_dtype) if ctx.needs_input_grad[2] else None
        coef_y = coef_0 = None
        if bn.batch_stats:
            # The mean and variance terms of BN's backward, from the sums over all processes:
            # dL/dy = scale*g - scale*mean(g) - xhat*scale*mean(g*xhat)
            #       = scale*g + coef_y*y + coef_0
            c = scale.numel()
            totals = all_reduce_sums(torch.cat([sum_g, sum_gxhat]), bn.group)
            mean_g, mean_gxhat = totals[:c] / ctx.count, totals[c:] / ctx.count
            coef_y = -scale * invstd * mean_gxhat
            coef_0 = -scale * mean_g - mean * coef_y
        grad_y = bn_input_grad(
            g, y, scale, shift, coef_y, coef_0, ctx.neuron, learnable, grad_spikes, saved
        )
        return grad_y, grad_weight, grad_bias, grad_learnable, None, None, None


def _bn_affine_stats(y: Tensor, bn: BNSpec) -> tuple[Tensor, Tensor, int | Tensor]:
    """(mean, invstd, n) to normalise with; updates the running statistics in training."""
    cd = compute_dtype(y.dtype)
    if not bn.batch_stats:
        return bn.running_mean.to(cd), torch.rsqrt(bn.running_var.to(cd) + bn.eps), 0
    mean, var, count = batch_stats(y, bn.group)
    if isinstance(count, int) and count <= 1:
        raise SpikefuseError(
            f"BatchNorm in training needs more than 1 value per channel, got {count} "
            f"(input shape {tuple(y.shape)})"
        )
    if bn.momentum is not None and bn.running_mean is not None:
        unbiased = var * (count / (count - 1))
        bn.running_mean.lerp_(mean.to(bn.running_mean.dtype), bn.momentum)
        bn.running_var.lerp_(unbiased.to(bn.running_var.dtype), bn.momentum)
    return mean, torch.rsqrt(var + bn.eps), count
