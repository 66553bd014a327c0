"""The math of BatchNorm → neuron (→ pool) (+ residual): forward and the two backward passes.

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

Residual blocks add a shortcut R to the BN output, x = y * scale[c] + shift[c] + R: the same
backward with dL/dR = g (the cuda kernels take R of y's dtype; the torch composites any).

Blocks that max-pool the BN output before the neuron (Spikformer's stem) run the neuron on the
pooled y (:func:`input_pooled`; BN is monotone per channel) with the statistics of the whole y,
and route the gradient back through the pooling (:func:`input_pool_grads`).

Pooled blocks (``pool`` = k > 1, see :func:`kernel_pool`): the kernels also average the spikes
over k x k windows, so forward returns the pooled map and backward takes its gradient, giving
each neuron of a window dL/dS = dL/d(pooled) / k² (the average pooling's backward).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ....backends import AffineKernels, compute_dtype, repeats_one_step
from ...neuron_call import Kept, NeuronCall
from ...statistics import BNSpec, BNStats, all_reduce_sums, is_distributed, reduce_dims
from ..spike_max_pool.autograd import max_pool_backward, max_pool_forward
from ..spike_max_pool.geometry import MaxPoolGeometry
from ..spike_max_pool.passes import memory_format_of


def _per_channel(v: Tensor, ndim: int) -> Tensor:
    """[C] → [1, 1, C, 1, ...] broadcastable against a [T, B, C, *spatial] tensor."""
    return v.view(1, 1, -1, *([1] * (ndim - 3)))


def _neuron_input(y: Tensor, stats: BNStats | None, residual: Tensor | None = None) -> Tensor:
    """x = y * scale + shift (+ residual) in float32 (float64 stays); y itself when there is
    neither BN nor a residual."""
    cd = compute_dtype(y.dtype)
    if stats is None:
        return y if residual is None else y.to(cd) + residual
    nd, scale = y.dim(), stats.scale
    x = torch.addcmul(_per_channel(stats.shift(scale), nd), y.to(cd), _per_channel(scale, nd))
    return x if residual is None else x.add_(residual)


def _affine(neuron: NeuronCall, y: Tensor, residual: Tensor | None) -> AffineKernels | None:
    """The BN-folded kernels for this call, or None (BatchNorm then runs as torch ops before the
    plain neuron kernels): they add a residual only of y's dtype (a residual of another dtype,
    e.g. a float32 BatchNorm output under bf16 autocast, would be rounded to it)."""
    return neuron.affine if residual is None or residual.dtype == y.dtype else None


def kernel_pool(y: Tensor, stats: BNStats | None, neuron: NeuronCall, pool: int) -> int:
    """The window the BN-folded kernels average y's spikes over: ``pool`` where they can
    (a backend with them (cuda), BatchNorm, and a map they take: channels-last, H and W
    multiples of ``pool``; see the backend's ``can_pool``), else 1 (the caller pools the full
    spikes)."""
    affine = neuron.affine
    pools = pool > 1 and stats is not None and affine is not None and affine.can_pool(y, pool)
    return pool if pools else 1


def _check_pool(stats: BNStats | None, neuron: NeuronCall, pool: int) -> None:
    """A pooled call needs the BN-folded kernels (the map itself is checked by the backend's
    launcher, which raises for a map it cannot pool)."""
    if pool > 1 and (stats is None or neuron.affine is None):
        raise ValueError(
            f"spikefuse: only BN-folded kernels pool a block's spikes ({pool} x {pool} windows); "
            f"backend {neuron.backend}, BatchNorm: {stats is not None}; pool the full spikes"
        )


def bn_neuron_forward(
    y: Tensor,
    stats: BNStats | None,
    neuron: NeuronCall,
    learnable: Tensor | None,
    save: bool,
    pool: int = 1,
    residual: Tensor | None = None,
    pack_spikes: bool = False,
    input_pool: MaxPoolGeometry | None = None,
) -> tuple[Tensor, Kept, Tensor | None]:
    """Spikes [T, B, C, *] in y's dtype (and layout, with the cuda backend) from the synapse
    output y (no BN when stats is None), the neuron state backward may reuse (see
    :meth:`NeuronCall.forward`), and with ``pack_spikes`` the pooled spikes' packing where the
    BN-folded kernels write it (see ``AffineKernels.affine_fptt``; else None). ``pool`` =
    k > 1 (where :func:`kernel_pool` says): the spikes averaged over k x k windows
    [T, B, C, H/k, W/k] instead. ``residual``: a tensor like y added to the BN output (a
    residual block's shortcut; such a call never pools). ``input_pool``: the max pooling of
    the BN output before the neuron (:func:`input_pooled`; needs BatchNorm): the spikes are then
    [T, B, C, OH, OW]."""
    if input_pool is not None:
        assert stats is not None  # a block pools the neuron's input only after BatchNorm
        y = input_pooled(y, stats, input_pool)
    _check_pool(stats, neuron, pool)
    affine = _affine(neuron, y, residual)
    if stats is not None and affine is not None:
        spikes, checkpoints, packed = affine.affine_fptt(
            program=neuron.program,
            y=y,
            mean=stats.mean,
            invstd=stats.invstd,
            weight=stats.weight,
            bias=stats.bias,
            learnable=learnable,
            constants=neuron.constants,
            v_init=neuron.v_init,
            save_for_backward=save,
            pool=pool,
            residual=residual,
            pack_spikes=pack_spikes,
        )
        return spikes, ((checkpoints,) if save else None), packed
    spikes, saved = neuron.forward(_neuron_input(y, stats, residual), learnable, save)
    return spikes.to(y.dtype), saved, None


def bn_neuron_backward(
    y: Tensor,
    stats: BNStats | None,
    neuron: NeuronCall,
    learnable: Tensor | None,
    grad_spikes: Tensor,
    saved: Kept,
    pool: int = 1,
    residual: Tensor | None = None,
    keep_grad_input: bool = False,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Backward pass 1 (the paper's Alg. 2): recompute the neuron from y, BPTT, per-channel sums.

    Returns ``(g, sums, grad_learnable)``: the local per-channel sums [2, C] of g and of
    g (y - mean) (None without BN), the gradient of the neuron's learnable parameters (shaped
    like them) and,
    optionally, g = dL/dx [T, B, C, *] for pass 2 to reuse. The torch composites give g in the
    compute dtype. The BN-folded kernels give g = None (pass 2 recomputes it: no [T, N] buffer
    is written), or with ``keep_grad_input`` where they can (:func:`keeps_input_grad`) g in
    y's dtype (for a y repeated over time: summed over T). Without BN g is always given, and
    so it is with a ``residual`` on the torch composites. ``pool``, ``residual``: the
    forward's (grad_spikes is then the pooled map's gradient).
    """
    _check_pool(stats, neuron, pool)
    affine = _affine(neuron, y, residual)
    if stats is not None and affine is not None:
        return _affine_backward(
            affine,
            neuron,
            y,
            grad_spikes,
            saved,
            learnable,
            stats,
            False,
            pool=pool,
            residual=residual,
            keep_grad_input=keep_grad_input,
        )
    x = _neuron_input(y, stats, residual)
    g, grad_learnable = neuron.input_grad(x, learnable, grad_spikes, saved)
    del x  # before the sums allocate
    if stats is None:
        return g, None, grad_learnable
    dims = reduce_dims(y.dim())
    yc = y.to(g.dtype) - _per_channel(stats.mean, y.dim())
    return g, torch.stack([g.sum(dims), yc.mul_(g).sum(dims)]), grad_learnable


def _affine_backward(
    affine: AffineKernels,
    neuron: NeuronCall,
    y: Tensor,
    grad_spikes: Tensor,
    saved: Kept,
    learnable: Tensor | None,
    stats: BNStats,
    grad_y: bool,
    totals: Tensor | None = None,
    inv_count: float = 0.0,
    pool: int = 1,
    residual: Tensor | None = None,
    overwrite_y: bool = False,
    keep_grad_input: bool = False,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """One of the BN-folded kernel's two backward passes: pass 1 (``grad_y=False``) returns
    (g with ``keep_grad_input``, else None; per-channel sums [2, C]; dL/dlearnable), pass 2
    (dL/dy, dL/dresidual or None, None); ``overwrite_y``: pass 2 may write dL/dy over y."""
    assert saved is not None  # affine forwards always keep their checkpoints (or None)
    return affine.affine_bptt(
        program=neuron.program,
        y=y,
        grad_spikes=grad_spikes,
        saved_v=saved[0],
        learnable=learnable,
        constants=neuron.constants,
        v_init=neuron.v_init,
        mean=stats.mean,
        invstd=stats.invstd,
        weight=stats.weight,
        bias=stats.bias,
        totals=totals,
        inv_count=inv_count,
        grad_y=grad_y,
        pool=pool,
        residual=residual,
        overwrite_y=overwrite_y,
        keep_grad_input=keep_grad_input,
    )


def keeps_input_grad(
    y: Tensor, stats: BNStats | None, neuron: NeuronCall, residual: Tensor | None, overwrite: bool
) -> bool:
    """Whether pass 1 keeps g for pass 2 (:func:`bn_neuron_backward`'s ``keep_grad_input``):
    where the BN-folded kernels run both passes and can keep it (their ``keeps_input_grad``),
    pass 2 is then one element-wise pass instead of a recompute of the neuron. Not where y is
    a temporary pass 2 may ``overwrite`` (the minimal memory modes: g would be a second buffer
    of its size)."""
    affine = _affine(neuron, y, residual)
    return (
        stats is not None
        and affine is not None
        and not overwrite
        and affine.keeps_input_grad(y, residual)
    )


def bn_input_grad(
    g: Tensor | None,
    y: Tensor,
    stats: BNStats,
    totals: Tensor | None,
    inv_count: float,
    neuron: NeuronCall,
    learnable: Tensor | None,
    grad_spikes: Tensor,
    saved: Kept,
    pool: int = 1,
    residual: Tensor | None = None,
    overwrite_y: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Backward pass 2 (the paper's Alg. 3): dL/dy in y's dtype, and with a residual
    dL/dresidual = g in the residual's (else None). ``overwrite_y``: y is a temporary of the
    caller's, which the BN-folded kernels may overwrite with dL/dy (one block-sized buffer less).

    dL/dy = g * scale[c], plus with batch statistics (``totals``: pass 1's sums over all
    processes, times ``inv_count`` their means) the terms coef_y[c] y + coef_0[c] of the
    module docstring. Uses pass 1's g when given, overwriting it (so float32 needs no new
    buffer) unless there is a residual (g is then dL/dresidual), else recomputes g from y:
    the BN-folded kernels take a g they kept (see :func:`bn_neuron_backward`) in one
    element-wise launch, else recompute the neuron. ``pool``, ``residual``: the forward's.
    """
    affine = _affine(neuron, y, residual)
    if affine is not None and g is not None:
        out = None if residual is not None else g
        kept_grad_y = affine.affine_input_grad(
            g, y, stats.mean, stats.invstd, stats.weight, totals, inv_count, out
        )
        return kept_grad_y, (None if residual is None else g)
    if affine is not None:
        recomputed, grad_residual, _ = _affine_backward(
            affine,
            neuron,
            y,
            grad_spikes,
            saved,
            learnable,
            stats,
            True,
            totals,
            inv_count,
            pool,
            residual,
            overwrite_y,
        )
        assert recomputed is not None  # pass 2 writes dL/dy
        return recomputed, grad_residual
    if g is None:
        g, _ = neuron.input_grad(_neuron_input(y, stats, residual), learnable, grad_spikes, saved)
    grad_residual = None if residual is None else g.to(residual.dtype)
    ndim, scale = y.dim(), stats.scale
    # g is dL/dresidual too: with a residual, dL/dy is a new tensor (else g is reused)
    grad_y = (
        g.mul_(_per_channel(scale, ndim)) if residual is None else g * _per_channel(scale, ndim)
    )
    if totals is not None:
        coef_y, coef_0 = _batch_coefficients(stats, totals, inv_count)
        grad_y.addcmul_(y, _per_channel(coef_y, ndim)).add_(_per_channel(coef_0, ndim))
    return grad_y.to(y.dtype), grad_residual


def _batch_coefficients(stats: BNStats, totals: Tensor, inv_count: float) -> tuple[Tensor, Tensor]:
    """(coef_y, coef_0) [C]: the batch statistics' terms coef_y[c] y + coef_0[c] of dL/dy (the
    module docstring; the kernels' formula, codegen's channel loads)."""
    scale = stats.scale
    mean_g = totals[0] * inv_count
    mean_gxhat = totals[1] * stats.invstd * inv_count
    coef_y = -scale * stats.invstd * mean_gxhat
    return coef_y, -scale * mean_g - stats.mean * coef_y


def bn_neuron_grads(
    y: Tensor,
    stats: BNStats | None,
    bn: BNSpec | None,
    neuron: NeuronCall,
    learnable: Tensor | None,
    grad_spikes: Tensor,
    saved: Kept,
    needs: tuple[bool, bool, bool],
    pool: int = 1,
    residual: Tensor | None = None,
    overwrite_y: bool = False,
    input_pool: MaxPoolGeometry | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """The whole backward of spikes = neuron(BN(y) [+ residual]): ``(dL/dy, dL/dgamma,
    dL/dbeta, dL/dlearnable, dL/dresidual)``; gamma's, beta's and learnable's None unless
    ``needs`` (gamma, beta, learnable) asks, the residual's None without one (it is g).

    Pass 1 (:func:`bn_neuron_backward`), the per-channel sums (all-reduced when distributed),
    pass 2 (:func:`bn_input_grad`); ``saved`` is what the forward kept (see
    :meth:`NeuronCall.forward`); ``pool``, ``residual``: the forward's (grad_spikes then of
    the pooled map); ``overwrite_y``: y is the caller's temporary, which pass 2 may overwrite
    with dL/dy (see :func:`bn_input_grad`). A y that repeats one step over time (see
    :func:`repeated`) gets the gradient of that step [1, B, C, *], summed over T.
    ``input_pool``: the forward's (:func:`input_pool_grads`)."""
    if input_pool is not None:
        assert stats is not None and bn is not None  # pooled inputs come with BatchNorm
        return input_pool_grads(
            y, stats, bn, neuron, learnable, grad_spikes, saved, needs, input_pool
        )
    affine = _affine(neuron, y, residual)
    if stats is not None and affine is not None:  # both BN-folded passes: at most one copy
        grad_spikes = affine.laid_out_grad_spikes(neuron.program, y, grad_spikes, pool, residual)
    keep = keeps_input_grad(y, stats, neuron, residual, overwrite_y)
    g, sums, grad_learnable = bn_neuron_backward(
        y, stats, neuron, learnable, grad_spikes, saved, pool, residual, keep
    )
    grad_learnable = grad_learnable if needs[2] else None
    if stats is None or bn is None or sums is None:  # no BN: pass 1 always gives g
        assert g is not None
        grad_residual = None if residual is None else g.to(residual.dtype)
        grad_y = g.to(y.dtype, copy=residual is not None)  # never the residual's tensor too
        return _summed_if_repeated(grad_y, y), None, None, grad_learnable, grad_residual
    grad_weight, grad_bias = bn_affine_grads(sums, stats, needs)
    totals, inv_count = batch_totals(sums, stats, bn)
    grad_y, grad_residual = bn_input_grad(
        g,
        y,
        stats,
        totals,
        inv_count,
        neuron,
        learnable,
        grad_spikes,
        saved,
        pool,
        residual,
        overwrite_y,
    )
    return _summed_if_repeated(grad_y, y), grad_weight, grad_bias, grad_learnable, grad_residual


def bn_affine_grads(
    sums: Tensor, stats: BNStats, needs: tuple[bool, ...]
) -> tuple[Tensor | None, Tensor | None]:
    """(dL/dgamma, dL/dbeta) from pass 1's local per-channel sums, each None unless ``needs``
    (gamma, beta) asks: DDP averages the local gradients."""
    return (sums[1] * stats.invstd if needs[0] else None), (sums[0] if needs[1] else None)


def batch_totals(sums: Tensor, stats: BNStats, bn: BNSpec) -> tuple[Tensor | None, float]:
    """(totals, inv_count) for pass 2 (:func:`bn_input_grad`): the per-channel sums over all
    processes and 1 / their count with batch statistics, else (None, 0)."""
    if not bn.batch_stats:
        return None, 0.0
    totals, count = sums, stats.count
    if is_distributed(bn.group):  # the local sums stay the local parameter gradients
        totals = all_reduce_sums(sums.clone(), bn.group)
    if isinstance(count, Tensor):  # the count over all processes stays on the device
        totals, count = totals / count, 1
    return totals, 1.0 / count


def _summed_if_repeated(grad_y: Tensor, y: Tensor) -> Tensor:
    """dL/dy of y's memory: for a y that repeats one step over time, the steps' gradients
    summed [1, B, C, *] (the BN-folded kernels sum them themselves; torch ops give them per
    step), else dL/dy as it is."""
    return grad_y.sum(0, keepdim=True) if repeats_one_step(y) and grad_y.shape[0] != 1 else grad_y


def repeated(y: Tensor, repeat: int) -> Tensor:
    """y [T, B, C, *] as it is (``repeat`` 1), or y [1, B, C, *] viewed at ``repeat`` steps."""
    return y if repeat == 1 else y.expand(repeat, *y.shape[1:])


def input_pooled(y: Tensor, stats: BNStats, pool: MaxPoolGeometry) -> Tensor:
    """q: the max pooling of the BN output taken on y, whose BN is that pooling.

    BatchNorm maps each channel by x = y * scale + shift, monotone: a window's largest x is the
    x of its largest y where scale >= 0 and of its smallest y where scale < 0 (only gamma's
    sign matters: invstd > 0). q [T, B, C, OH, OW] (y's dtype and memory layout) holds those
    elements of y (:func:`~..spike_max_pool.autograd.max_pool_forward`: the cuda backend's
    kernels or torch ops). y [T, B, C, H, W] may repeat one step over time."""
    # gamma itself marks the channels whose windows take their minimum: no sign vector made
    q, _ = max_pool_forward(y.flatten(0, 1), pool, False, stats.weight)
    return q.unflatten(0, y.shape[:2])


def input_pool_grads(
    y: Tensor,
    stats: BNStats,
    bn: BNSpec,
    neuron: NeuronCall,
    learnable: Tensor | None,
    grad_spikes: Tensor,
    saved: Kept,
    needs: tuple[bool, bool, bool],
    pool: MaxPoolGeometry,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None, None]:
    """:func:`bn_neuron_grads` of spikes = neuron(maxpool(BN(y))) (:func:`input_pooled`).

    With q the pooled y and g = dL/dx of the neuron's input x = BN(q), the unpooled BN output's
    gradient is g routed to each window's element (summed where windows overlap). Its
    per-channel sums over y's positions are g's sums over q's, so pass 1 on q gives them (and
    gamma's and beta's gradients); pass 2 on q without the batch terms gives scale g, which the
    pooling's backward routes to y, adding the batch statistics' terms coef_y y + coef_0 (over
    the count of y's elements, which ``stats`` holds) at every element of y in the same pass."""
    merged = y.flatten(0, 1)
    q, codes = max_pool_forward(merged, pool, True, stats.weight)  # as input_pooled, with codes
    assert codes is not None  # kept
    q = q.unflatten(0, y.shape[:2])
    affine = _affine(neuron, q, None)
    if affine is not None:  # both BN-folded passes: at most one copy
        grad_spikes = affine.laid_out_grad_spikes(neuron.program, q, grad_spikes, 1, None)
    g, sums, grad_learnable = bn_neuron_backward(q, stats, neuron, learnable, grad_spikes, saved)
    assert sums is not None  # with BatchNorm
    grad_weight, grad_bias = bn_affine_grads(sums, stats, needs)
    totals, inv_count = batch_totals(sums, stats, bn)
    grad_q, _ = bn_input_grad(
        g, q, stats, None, 0.0, neuron, learnable, grad_spikes, saved, overwrite_y=True
    )
    terms = None if totals is None else (merged, *_batch_coefficients(stats, totals, inv_count))
    layout = memory_format_of(merged)
    grad_y = max_pool_backward(grad_q.flatten(0, 1), codes, pool, merged.shape, layout, terms)
    grad_learnable = grad_learnable if needs[2] else None
    grad_y = _summed_if_repeated(grad_y.unflatten(0, y.shape[:2]), y)
    return grad_y, grad_weight, grad_bias, grad_learnable, None
