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

    sum_g[c]    = Σ g,       sum_gy[c] = Σ g * (y - mean)
    dL/dgamma   = sum_gy * invstd,   dL/dbeta = sum_g           (local sums: DDP averages them)
    dL/dy       = scale g + coef_y y + coef_0                    (batch statistics)
        coef_y  = -scale invstd m_gy invstd,  coef_0 = -scale m_g - mean coef_y
        m_g     = Σ_all g / n,  m_gy = Σ_all g (y - mean) / n
    dL/dy       = scale * g                                      (running statistics)

with n the number of elements per channel over all processes. All element-wise work sits in
three functions: :func:`bn_neuron_forward` (affine + neuron forward), :func:`bn_neuron_backward`
(pass 1, the paper's Alg. 2: affine + neuron recompute + BPTT + the two per-channel sums) and
:func:`bn_input_grad` (pass 2, Alg. 3: dL/dy). With the cuda backend each is one launch of a
channel-affine kernel, which computes scale, shift and the coefficients per thread from the
per-channel vectors (so a block costs no small per-channel torch ops beyond the statistics);
with the torch backend they are composed from the reference neuron and torch ops.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ..backends import compute_dtype, get_backend
from ..errors import SpikefuseError
from ..neuron import BaseNode
from ..ops import _bptt, forbid_double_backward
from ..program import NeuronProgram


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
        # the node validates its constants on assignment and caches them
        return cls(node.program, backend, tuple(node._constants or node.constants()), v_init)

    @property
    def affine_backend(self):
        """The backend module if it has channel-affine kernels (BatchNorm folded into the
        neuron: ``affine_fptt``/``affine_bptt``, the cuda backend), else None."""
        backend = get_backend(self.backend)
        return backend if hasattr(backend, "affine_fptt") else None

    def forward(
        self, x: Tensor, learnable: Tensor | None, save: bool
    ) -> tuple[Tensor, tuple | None]:
        """Spikes [T, *] in x's dtype, and what backward can reuse (None: nothing was kept).

        With ``save``, what the backend's forward saves is kept if it is small (the cuda
        backend's chunk checkpoints: 1/CHUNK of x's elements); a saved [T, N] sequence (the
        reference backend's H) would be as large as x, so it is recomputed in backward instead.
        """
        backend = get_backend(self.backend)
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
        backend = get_backend(self.backend)
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


@dataclass(frozen=True)
class BNStats:
    """Per-channel vectors [C] (compute dtype) of one BatchNorm call: x = y * scale + shift with
    scale = invstd * weight and shift = bias - mean * scale.

    ``weight``/``bias`` are gamma/beta in the compute dtype (None: 1 and 0). ``count`` is the
    number of elements per channel the statistics were taken over (all processes; a 0-dim
    tensor when distributed), 0 for running statistics.
    """

    mean: Tensor
    invstd: Tensor
    weight: Tensor | None
    bias: Tensor | None
    count: int | Tensor

    @property
    def scale(self) -> Tensor:
        return self.invstd if self.weight is None else self.invstd * self.weight

    def shift(self, scale: Tensor) -> Tensor:
        shift = -self.mean * scale
        return shift if self.bias is None else shift + self.bias

    @property
    def vectors(self) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        """(mean, invstd, weight, bias): what the channel-affine kernels read."""
        return self.mean, self.invstd, self.weight, self.bias


def _per_channel(v: Tensor, ndim: int) -> Tensor:
    """[C] → [1, 1, C, 1, ...] broadcastable against a [T, B, C, *spatial] tensor."""
    return v.view(1, 1, -1, *([1] * (ndim - 3)))


def _reduce_dims(ndim: int) -> list[int]:
    return [0, 1, *range(3, ndim)]


def _neuron_input(y: Tensor, stats: BNStats | None) -> Tensor:
    """x = y * scale + shift in float32 (float64 stays); y itself when there is no BN."""
    if stats is None:
        return y
    cd = compute_dtype(y.dtype)
    nd, scale = y.dim(), stats.scale
    return torch.addcmul(_per_channel(stats.shift(scale), nd), y.to(cd), _per_channel(scale, nd))


def bn_neuron_forward(
    y: Tensor,
    stats: BNStats | None,
    neuron: NeuronCall,
    learnable: Tensor | None,
    save: bool,
) -> tuple[Tensor, tuple | None]:
    """Spikes [T, B, C, *] in y's dtype (and layout, with the cuda backend) from the synapse
    output y (no BN when stats is None), and the neuron state backward may reuse (see
    :meth:`NeuronCall.forward`)."""
    affine = neuron.affine_backend
    if stats is not None and affine is not None:
        spikes, ckpt = affine.affine_fptt(
            neuron.program, y, *stats.vectors, learnable, neuron.constants, neuron.v_init, save
        )
        return spikes, ((ckpt,) if save else None)
    spikes, saved = neuron.forward(_neuron_input(y, stats), learnable, save)
    return spikes.to(y.dtype), saved


def bn_neuron_backward(
    y: Tensor,
    stats: BNStats | None,
    neuron: NeuronCall,
    learnable: Tensor | None,
    grad_spikes: Tensor,
    saved: tuple | None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Backward pass 1 (the paper's Alg. 2): recompute the neuron from y, BPTT, per-channel sums.

    Returns ``(g, sums, grad_learnable)``: the local per-channel sums [2, C] of g and of
    g (y - mean) (None without BN), the gradient of the neuron's learnable parameters [P] and,
    optionally, g = dL/dx [T, B, C, *] in the compute dtype for pass 2 to reuse. The cuda
    backend returns g = None (pass 2 recomputes it: no [T, N] buffer is written); without BN
    g is always given.
    """
    affine = neuron.affine_backend
    if stats is not None and affine is not None:
        # saved is (checkpoints,): affine forwards always keep theirs (None for short T)
        _, sums, grad_learnable = affine.affine_bptt(
            neuron.program, y, grad_spikes, saved[0], learnable, neuron.constants,
            neuron.v_init, *stats.vectors, grad_y=False,
        )  # fmt: skip
        return None, sums, grad_learnable
    x = _neuron_input(y, stats)
    g, grad_learnable = neuron.input_grad(x, learnable, grad_spikes, saved)
    if stats is None:
        return g, None, grad_learnable
    dims = _reduce_dims(y.dim())
    yc = y.to(g.dtype) - _per_channel(stats.mean, y.dim())
    return g, torch.stack([g.sum(dims), yc.mul_(g).sum(dims)]), grad_learnable


def bn_input_grad(
    g: Tensor | None,
    y: Tensor,
    stats: BNStats,
    totals: Tensor | None,
    inv_count: float,
    neuron: NeuronCall,
    learnable: Tensor | None,
    grad_spikes: Tensor,
    saved: tuple | None,
) -> Tensor:
    """Backward pass 2 (the paper's Alg. 3): dL/dy in y's dtype.

    dL/dy = g * scale[c], plus with batch statistics (``totals``: pass 1's sums over all
    processes, times ``inv_count`` their means) the terms coef_y[c] y + coef_0[c] of the
    module docstring. Uses pass 1's g when given, overwriting it (so float32 needs no new
    buffer), else recomputes g from y.
    """
    affine = neuron.affine_backend
    if affine is not None:
        grad_y, _, _ = affine.affine_bptt(
            neuron.program, y, grad_spikes, saved[0], learnable, neuron.constants,
            neuron.v_init, *stats.vectors, totals, inv_count, grad_y=True,
        )  # fmt: skip
        return grad_y
    if g is None:
        g, _ = neuron.input_grad(_neuron_input(y, stats), learnable, grad_spikes, saved)
    ndim, scale = y.dim(), stats.scale
    grad_y = g.mul_(_per_channel(scale, ndim))
    if totals is not None:  # the kernels' formula (codegen's channel loads), per channel
        mean_g = totals[0] * inv_count
        mean_gxhat = totals[1] * stats.invstd * inv_count
        coef_y = -scale * stats.invstd * mean_gxhat
        coef_0 = -scale * mean_g - stats.mean * coef_y
        grad_y.addcmul_(y, _per_channel(coef_y, ndim)).add_(_per_channel(coef_0, ndim))
    return grad_y.to(y.dtype)


# ---- statistics, synchronised across processes ------------------------------------------------
def is_distributed(group: dist.ProcessGroup | None) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _local_mean_var(y: Tensor) -> tuple[Tensor, Tensor]:
    """Per-channel mean and biased variance of y [T, B, C, *] in the compute dtype, one pass."""
    if y.is_cuda:
        # Welford in float32 over the [T*B, C, *] view, any storage dtype, NCHW or channels-last,
        # without a float32 copy of y. It returns 1/sqrt(var) (0 where var is 0).
        mean, invstd = torch.batch_norm_stats(y.flatten(0, 1), 0.0)
        return mean, torch.where(invstd > 0, invstd.reciprocal().square(), 0.0)
    var, mean = torch.var_mean(
        y.to(compute_dtype(y.dtype)), dim=_reduce_dims(y.dim()), correction=0
    )
    return mean, var


def batch_stats(
    y: Tensor, group: dist.ProcessGroup | None = None
) -> tuple[Tensor, Tensor, int | Tensor]:
    """Per-channel (mean, biased var) over all dims but C, across processes; and the count n.

    Each process computes its local mean/var in one pass; processes then all-reduce
    (n·mean, n·(var + mean²), n) in float64 so recombining the moments loses nothing. A process
    with no samples (n = 0) contributes zeros instead of the NaN moments of an empty tensor. Across
    processes n stays a 0-dim tensor: reading it on the host would stall the GPU stream.
    """
    count = y.numel() // y.shape[2]
    if count == 0:  # no samples here: contribute nothing (n = 0) to the statistics of the rest
        mean = var = y.new_zeros(y.shape[2], dtype=compute_dtype(y.dtype))
    else:
        mean, var = _local_mean_var(y)
    if not is_distributed(group):
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
    return g_mean.to(mean.dtype), g_var.to(mean.dtype), total


def refuse_join() -> None:
    """Raise inside a ``torch.distributed.algorithms.Join`` context that would let ranks run out
    of batches silently: the fused BatchNorm all-reduces (statistics in forward, sums in
    backward) are collectives that Join cannot shadow, so the remaining ranks would hang or
    pair them with other collectives. With ``throw_on_early_termination=True`` torch stops every
    rank once one runs out, before any fused block runs, which is safe.

    Reads the DDP module whose forward is running (PyTorch records it, with its join settings).
    """
    from torch.nn.parallel import DistributedDataParallel

    ddp = getattr(DistributedDataParallel, "_active_ddp_module", None)
    config = getattr(ddp, "_join_config", None)
    if config is not None and config.enable and not config.throw_on_early_termination:
        raise SpikefuseError(
            "fused blocks synchronise BatchNorm across processes with their own all-reduces, "
            "which torch.distributed.algorithms.Join cannot shadow for ranks that ran out of "
            "batches: give every rank the same number of batches (e.g. DistributedSampler("
            "drop_last=True)), use Join(..., throw_on_early_termination=True), or train unfused"
        )


def all_reduce_sums(sums: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """Sum a small per-channel tensor over processes, in place (no-op when not distributed)."""
    if is_distributed(group):
        dist.all_reduce(sums, group=group)
    return sums


@dataclass
class BNSpec:
    """The BatchNorm side of a fused call (None weight/bias: affine=False).

    ``batch_stats`` says whether statistics come from the batch (training, or no running
    statistics) or from ``running_mean``/``running_var``; ``momentum`` is the running-average
    factor of this call: a float, a 0-dim tensor (torch's cumulative average, 1 /
    num_batches_tracked, kept on the device) or None (do not update the running statistics).
    """

    weight: Tensor | None
    bias: Tensor | None
    running_mean: Tensor | None
    running_var: Tensor | None
    batch_stats: bool
    momentum: float | Tensor | None
    eps: float
    group: dist.ProcessGroup | None = None


# counts tensors for batch_norm_gather_stats_with_counts, by (device, count, dtype)
_CONSTANTS: dict[tuple, Tensor] = {}


def device_constant(key: tuple, make: Callable[[], Tensor]) -> Tensor:
    """A small constant tensor made once per ``key`` (include the device): not cached while a
    CUDA graph is captured (it would live in the graph's pool) or the compiler traces."""
    value = _CONSTANTS.get(key)
    if value is None:
        value = make()
        capturing = value.is_cuda and torch.cuda.is_current_stream_capturing()
        if not capturing and not torch.compiler.is_compiling():
            _CONSTANTS[key] = value
    return value


def _count_tensor(count: int, like: Tensor) -> Tensor:
    """[count] for batch_norm_gather_stats_with_counts."""
    key = ("count", like.device, count, like.dtype)
    return device_constant(key, lambda: like.new_full((1,), float(count)))


def _check_count(count: int, y: Tensor) -> None:
    if count <= 1:
        raise SpikefuseError(
            f"BatchNorm in training needs more than 1 value per channel, got {count} "
            f"(input shape {tuple(y.shape)})"
        )


@torch.no_grad()
def bn_statistics(y: Tensor, bn: BNSpec) -> BNStats:
    """The per-channel vectors to normalise y with; updates the running statistics in training.

    No autograd here: BNNeuronFunction's backward carries the gradient through the statistics.
    On one CUDA process this is two launches: ``batch_norm_stats`` (Welford, any storage dtype
    and layout) and, when the running statistics are updated, the running-average update of
    ``batch_norm_gather_stats_with_counts`` (unbiased variance, torch's BatchNorm formula).
    """
    cd = compute_dtype(y.dtype)
    weight = None if bn.weight is None else bn.weight.detach().to(cd)
    bias = None if bn.bias is None else bn.bias.detach().to(cd)
    if not bn.batch_stats:
        mean, var = bn.running_mean.to(cd), bn.running_var.to(cd)
        return BNStats(mean, torch.rsqrt(var + bn.eps), weight, bias, 0)
    update = bn.momentum is not None and bn.running_mean is not None
    if y.is_cuda and not isinstance(bn.momentum, Tensor) and not is_distributed(bn.group):
        count = y.numel() // y.shape[2]
        _check_count(count, y)
        flat = y.flatten(0, 1)
        mean, invstd = torch.batch_norm_stats(flat, bn.eps)
        if update:
            torch.batch_norm_gather_stats_with_counts(
                flat, mean[None], invstd[None], bn.running_mean, bn.running_var, bn.momentum,
                bn.eps, _count_tensor(count, mean),
            )  # fmt: skip
        return BNStats(mean, invstd, weight, bias, count)
    mean, var, count = batch_stats(y, bn.group)
    if isinstance(count, int):
        _check_count(count, y)
    if update:
        unbiased = var * (count / (count - 1))
        bn.running_mean.lerp_(mean.to(bn.running_mean.dtype), bn.momentum)
        bn.running_var.lerp_(unbiased.to(bn.running_var.dtype), bn.momentum)
    return BNStats(mean, torch.rsqrt(var + bn.eps), weight, bias, count)


def bn_neuron_grads(
    y: Tensor,
    stats: BNStats | None,
    bn: BNSpec | None,
    neuron: NeuronCall,
    learnable: Tensor | None,
    grad_spikes: Tensor,
    saved: tuple | None,
    needs: tuple[bool, bool, bool],
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """The whole backward of spikes = neuron(BN(y)): ``(dL/dy, dL/dgamma, dL/dbeta,
    dL/dlearnable)``, the last three None unless ``needs`` (gamma, beta, learnable) asks.

    Pass 1 (:func:`bn_neuron_backward`), the per-channel sums (all-reduced when distributed),
    pass 2 (:func:`bn_input_grad`); ``saved`` is what the forward kept (see
    :meth:`NeuronCall.forward`)."""
    g, sums, grad_learnable = bn_neuron_backward(y, stats, neuron, learnable, grad_spikes, saved)
    grad_learnable = grad_learnable if needs[2] else None
    if stats is None:
        return g.to(y.dtype), None, None, grad_learnable
    grad_weight = sums[1] * stats.invstd if needs[0] else None
    grad_bias = sums[0] if needs[1] else None
    totals, inv_count = None, 0.0
    if bn.batch_stats:
        totals, count = sums, stats.count
        if is_distributed(bn.group):  # the local sums stay the local parameter gradients
            totals = all_reduce_sums(sums.clone(), bn.group)
        if isinstance(count, Tensor):  # the count over all processes stays on the device
            totals, count = totals / count, 1
        inv_count = 1.0 / count
    grad_y = bn_input_grad(g, y, stats, totals, inv_count, neuron, learnable, grad_spikes, saved)
    return grad_y, grad_weight, grad_bias, grad_learnable


def _as_dtype(grad: Tensor | None, dtype: torch.dtype | None) -> Tensor | None:
    return None if grad is None or dtype is None else grad.to(dtype)


def param_dtypes(*params: Tensor | None) -> tuple[torch.dtype | None, ...]:
    """The parameters' dtypes (None for absent ones): what their gradients are cast to."""
    return tuple(None if p is None else p.dtype for p in params)


def save_bn_context(ctx, first: Tensor, learnable: Tensor | None, stats: BNStats | None,
                    saved: tuple | None, weight: Tensor | None, bias: Tensor | None,
                    neuron: NeuronCall, bn: BNSpec | None) -> None:  # fmt: skip
    """Keep for backward ``first`` (what the synapse output is recomputed from), the learnable
    values, the per-channel vectors and what the neuron's forward kept; see
    :func:`load_bn_context`."""
    vectors = () if stats is None else stats.vectors
    ctx.save_for_backward(first, learnable, *vectors, *(saved or ()))
    ctx.kept = saved is not None
    ctx.count = None if stats is None else stats.count
    ctx.neuron, ctx.bn = neuron, bn
    ctx.param_dtypes = param_dtypes(weight, bias)


def load_bn_context(ctx) -> tuple[Tensor, Tensor | None, BNStats | None, tuple | None]:
    """(first, learnable, stats, saved) as :func:`save_bn_context` kept them."""
    first, learnable, *rest = ctx.saved_tensors
    stats = None
    if ctx.count is not None:
        stats, rest = BNStats(*rest[:4], ctx.count), rest[4:]
    return first, learnable, stats, tuple(rest) if ctx.kept else None


def bn_param_grads(ctx, grad_weight: Tensor | None, grad_bias: Tensor | None) -> tuple:
    """BatchNorm's gamma/beta gradients in the parameters' dtypes."""
    weight_dtype, bias_dtype = ctx.param_dtypes
    return _as_dtype(grad_weight, weight_dtype), _as_dtype(grad_bias, bias_dtype)


class BNNeuronFunction(torch.autograd.Function):
    """spikes = neuron(BN(y)); saves y and per-channel vectors only (see the module docstring).

    ``apply(y, weight, bias, learnable, stats, bn, neuron, save)``: ``stats`` from
    :func:`bn_statistics` (None: no BN); ``weight``/``bias`` are BN's gamma/beta (or None),
    inputs so that autograd tracks them (``stats`` already holds their values); ``save`` whether
    a backward will follow (keep the neuron's checkpoints).
    """

    @staticmethod
    def forward(ctx, y, weight, bias, learnable, stats: BNStats | None, bn: BNSpec | None,
                neuron: NeuronCall, save: bool = True):  # fmt: skip
        spikes, saved = bn_neuron_forward(y, stats, neuron, learnable, save)
        save_bn_context(ctx, y, learnable, stats, saved, weight, bias, neuron, bn)
        return spikes

    @staticmethod
    def backward(ctx, grad_spikes):
        forbid_double_backward("a fused block (BNNeuronFunction)")
        y, learnable, stats, saved = load_bn_context(ctx)
        grad_y, grad_weight, grad_bias, grad_learnable = bn_neuron_grads(
            y, stats, ctx.bn, ctx.neuron, learnable, grad_spikes, saved, ctx.needs_input_grad[1:4]
        )
        grad_weight, grad_bias = bn_param_grads(ctx, grad_weight, grad_bias)
        return grad_y, grad_weight, grad_bias, grad_learnable, None, None, None, None
