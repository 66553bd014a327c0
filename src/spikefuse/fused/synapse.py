"""A fused block's synapse (Conv1d, Conv2d or Linear) as its call paths and Functions run it.

:class:`Synapse` wraps the block's synapse module: it runs it on multi-step input [T, B, ...]
merged into one [T*B, ...] batch in the layout it runs in (channels-last for a Conv2d on CUDA),
once per sample for an input repeated over time, saving its input as a recipe or 1-bit packed
where that input is fused-block spikes; and it differentiates it explicitly for the
minimal-memory Functions (weight gradient, input gradient), which receive this object, not the
block.
"""

from __future__ import annotations

import math
from typing import cast

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.modules.conv import _ConvNd

from ..functional import repeat_over_time, repeated_over_time
from .recompute import Recipe, is_spikes, mark_spikes, recipe_of, saving_recomputed
from .spike_linear import SpikeLinearFunction, takes_split_path


def channels_last(t: Tensor) -> Tensor:
    """A merged batch [N, C, H, W] or [N, C, L] with channels innermost in memory (channels-last;
    for [N, C, L] the layout of its [N, C, 1, L] view): t itself where it is so already, else
    one copy."""
    if t.dim() == 4:
        return t.contiguous(memory_format=torch.channels_last)
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def is_channels_last(t: Tensor) -> bool:
    """Whether a merged batch is laid out as :func:`channels_last` makes it."""
    if t.dim() == 4:
        return t.is_contiguous(memory_format=torch.channels_last)
    return t.transpose(1, 2).is_contiguous()


def _empty(shape: tuple[int, ...], like: Tensor, cl: bool) -> Tensor:
    """Uninitialised merged batch of ``shape`` in like's dtype and device, laid out as
    :func:`channels_last` makes it (``cl``), else contiguous."""
    if cl and len(shape) == 3:
        n, c, length = shape
        return torch.empty((n, length, c), dtype=like.dtype, device=like.device).transpose(1, 2)
    layout = torch.channels_last if cl else torch.contiguous_format
    return torch.empty(shape, dtype=like.dtype, device=like.device, memory_format=layout)


def _channels_last(recipe: Recipe) -> Recipe:
    return lambda: channels_last(recipe())


def _pointwise(module: _ConvNd) -> bool:
    """Whether a Conv1d is pointwise (kernel 1, stride 1, no padding): a matrix product per
    position, which cuDNN runs far faster as a channels-last Conv2d over [N, C, 1, L] than as
    a Conv1d on [N, C, L] (whose weight gradient it reduces in a separate pass, with a
    workspace about as large as the output)."""
    return (
        tuple(module.kernel_size) == (1,)
        and tuple(module.stride) == (1,)
        and module.padding in ((0,), 0, "valid")
        and module.padding_mode == "zeros"
    )


class Synapse:
    """The synapse ``module`` of torch class ``kind`` (what :func:`~.spec.synapse_kind` says)."""

    __slots__ = ("kind", "module", "pointwise")

    def __init__(self, module: nn.Linear | _ConvNd, kind: type[nn.Module]) -> None:
        self.module, self.kind = module, kind
        self.pointwise = isinstance(module, _ConvNd) and kind is nn.Conv1d and _pointwise(module)

    def runs_channels_last(self, x: Tensor) -> bool:
        """Whether it runs channels-last (:func:`channels_last`): a Conv2d on CUDA (cuDNN's
        native layout, no transposes around the convolution; the kernels read that layout as
        it is), and a pointwise Conv1d on CUDA, as the Conv2d of its [N, C, 1, L] view."""
        return (self.kind is nn.Conv2d or self.pointwise) and x.is_cuda

    def merged(self, x: Tensor) -> Tensor:
        """[T, B, ...] as the synapse's [T*B, ...] batch, in the layout it runs in."""
        merged = x.flatten(0, 1)
        if self.runs_channels_last(merged):
            merged = channels_last(merged)
        return merged

    def merged_part(self, x: Tensor, part: slice) -> Tensor:
        """x[:, part] as the synapse's [T*b, ...] batch in the layout it runs in: a view of x
        where it is that already (the whole batch, dense), else a copy."""
        src = x[:, part]
        cl = self.runs_channels_last(x)
        if src.shape[1] == x.shape[1]:
            view = src.flatten(0, 1)  # a copy (of the logical order) where not viewable
            if is_channels_last(view) if cl else view.is_contiguous():
                return view
        shape = (src.shape[0] * src.shape[1], *src.shape[2:])
        merged = _empty(shape, x, cl)
        merged.unflatten(0, src.shape[:2]).copy_(src)
        return merged

    def params(self) -> tuple[nn.Parameter, ...]:
        """The module's parameters as ``parameters()`` gives them (weight, then a bias), read
        from the module itself where it has no submodules (e.g. a parametrization's): no
        generator over the module tree on every call."""
        module = self.module
        if module._modules:
            return tuple(module.parameters())
        return tuple(p for p in module._parameters.values() if p is not None)

    def weight_in(self, dtype: torch.dtype) -> Tensor:
        """The weight, detached, in ``dtype`` (itself where it has that dtype): one cast that
        a backward's recomputation (:meth:`kept`) and both gradients share, where autocast
        would cast it for each."""
        return self.module.weight.detach().to(dtype)

    def autocast_weight(self, x: Tensor) -> Tensor | None:
        """:meth:`weight_in` the autocast dtype of x's device where autocast is on, else
        None (a synapse with an explicit backward: see :meth:`_run`)."""
        device = x.device.type
        if not torch.is_autocast_enabled(device):
            return None
        return self.weight_in(torch.get_autocast_dtype(device))

    def _run(self, merged: Tensor, weight: Tensor | None = None) -> Tensor:
        """The torch base class's forward on a merged batch (spikefuse layers would otherwise
        re-split T and B); with ``weight``, the same call on that weight (a cast of the
        module's, :meth:`weight_in`; a synapse with an explicit backward only): under
        autocast, the same operands, so the same output."""
        module = self.module
        if self._planar(merged):
            return self._pointwise_run(merged, module.weight if weight is None else weight)
        if weight is None:
            return self.kind.forward(module, merged)
        if isinstance(module, nn.Linear):
            return F.linear(merged, weight, module.bias)
        assert not isinstance(module.padding, str)  # explicit_backward: zeros padding
        conv = F.conv1d if self.kind is nn.Conv1d else F.conv2d
        return conv(
            merged,
            weight,
            module.bias,
            module.stride,
            module.padding,
            module.dilation,
            module.groups,
        )

    def _planar(self, t: Tensor) -> bool:
        """Whether a call on merged ``t`` runs as :meth:`_pointwise_run` (and its gradients on
        the same [N, C, 1, L] view)."""
        return self.pointwise and self.runs_channels_last(t)

    def _pointwise_run(self, merged: Tensor, weight: Tensor) -> Tensor:
        """A pointwise Conv1d on [N, C, L] as the Conv2d of its [N, C, 1, L] view: channels-last
        in, channels-last out (cuDNN's implicit matrix product), the same products and sums
        per output as the Conv1d, so equal to it up to the order of the sums."""
        module = cast("_ConvNd", self.module)
        planar = F.conv2d(
            merged.unsqueeze(2), weight.unsqueeze(2), module.bias, 1, 0, 1, module.groups
        )
        return planar.squeeze(2)

    def on_merged(self, merged: Tensor, steps: int, weight: Tensor | None = None) -> Tensor:
        """The output [T, b, ...] of a merged batch [T*b, ...] of ``steps`` steps (``weight``:
        as :meth:`_run`)."""
        return self._run(merged, weight).unflatten(0, (steps, -1))

    def step(self, x: Tensor, weight: Tensor | None = None) -> Tensor:
        """The output [1, B, ...] of one step of an input repeated over time."""
        return self._run(self.merged(x[:1]), weight).unsqueeze(0)

    def __call__(self, x: Tensor, weight: Tensor | None = None) -> Tensor:
        """y = synapse(x) on [T, B, ...] (``weight``: as :meth:`_run`). An input repeated over
        T as a view (stride 0 over T: a static image fed at every step) runs the synapse once
        per sample, on x[0], and repeats its output: T times less synapse work forward, and in
        backward autograd sums dL/dy over T before the synapse's backward (y is the same up to
        rounding order)."""
        if repeated_over_time(x):
            return repeat_over_time(self.step(x, weight)[0], x.shape[0])
        return self._run(self.merged(x), weight).unflatten(0, x.shape[:2])

    def kept(self, x: Tensor, repeat: int, weight: Tensor | None = None) -> Tensor:
        """The output a block keeps: of one step [1, B, ...] (``repeat`` > 1), else all
        (``weight``: as :meth:`_run`)."""
        return self.step(x, weight) if repeat > 1 else self(x, weight)

    def saving_input(self, x: Tensor) -> Tensor:
        """``self(x)``, saving an input that is fused-block spikes as its recipe, or packed at
        1 bit per element where it has none (a min-memory block's output), where it takes at
        least :data:`~.recompute.RECOMPUTE_MIN_BYTES` (:func:`saving_recomputed`); a Linear on
        spikes takes the split bf16 path where it pays (:func:`takes_split_path`)."""
        merged = x.flatten(0, 1)
        # x's tags (a tag on x, a view, is not seen from merged, another view of its memory)
        x_recipe = recipe_of(x)
        recipe = None if x_recipe is None else lambda: x_recipe().flatten(0, 1)
        spikes = recipe is None and is_spikes(x)
        split = self.kind is nn.Linear and takes_split_path(x, self.module.weight)
        if recipe is None and not spikes and not split:  # nothing to recompute or split
            return self(x)
        if self.runs_channels_last(merged):  # recompute in the conv's layout
            recipe = None if recipe is None else _channels_last(recipe)
            merged = channels_last(merged)
            if spikes:  # a copy, if one was made, holds the same spikes
                mark_spikes(merged)
        with saving_recomputed(merged, recipe):  # the very tensor the synapse saves
            if split:
                y = SpikeLinearFunction.apply(merged, self.module.weight, self.module.bias)
            else:
                y = self._run(merged)
            return y.unflatten(0, x.shape[:2])

    def geometry(self, step_shape: torch.Size) -> tuple[int, int]:
        """(output elements of one step, multiply-adds per output element) on one step's
        input [B, C_in, *] (Linear: [B, F_in])."""
        module = self.module
        if isinstance(module, nn.Linear):
            return step_shape[0] * module.out_features, module.in_features
        spatial = []
        for d, size in enumerate(step_shape[2:]):
            if isinstance(module.padding, str):  # "valid", or "same" (stride 1)
                pad = 0 if module.padding == "valid" else None
            else:
                pad = module.padding[d]
            reach = module.dilation[d] * (module.kernel_size[d] - 1)
            spatial.append(
                size if pad is None else (size + 2 * pad - reach - 1) // module.stride[d] + 1
            )
        fan_in = module.in_channels // module.groups * math.prod(module.kernel_size)
        return step_shape[0] * module.out_channels * math.prod(spatial), fan_in

    def explicit_backward(self) -> bool:
        """Whether :meth:`param_grads` and :meth:`input_grad` differentiate it (a Linear, or
        a Conv whose padding is numbers and zeros); else autograd differentiates a recomputed
        synapse."""
        module = self.module
        if isinstance(module, nn.Linear):
            return True
        return module.padding_mode == "zeros" and not isinstance(module.padding, str)

    def param_grads(
        self, x: Tensor, grad_y: Tensor, weight: Tensor, need_b: bool
    ) -> tuple[Tensor, Tensor | None]:
        """(dL/dweight, dL/dbias or None) of ``y = synapse(x)`` on merged [T*B, ...] tensors,
        computed in the dtype of ``weight`` (:meth:`weight_in` of the forward's autocast dtype,
        else the weight itself) and returned in the parameters' dtypes."""
        module, dtype = self.module, weight.dtype
        grad_y, x = grad_y.to(dtype), x.to(dtype)
        if isinstance(module, nn.Linear):
            g = grad_y.flatten(0, -2)
            grad_w, grad_b = g.t() @ x.flatten(0, -2), (g.sum(0) if need_b else None)
        else:
            planar = self._planar(x)
            if planar:
                grad_y, x, weight = grad_y.unsqueeze(2), x.unsqueeze(2), weight.unsqueeze(2)
            _, grad_w, grad_b = torch.ops.aten.convolution_backward(
                grad_y,
                x,
                weight,
                [weight.shape[0]] if need_b else None,
                (1, 1) if planar else module.stride,
                (0, 0) if planar else module.padding,
                (1, 1) if planar else module.dilation,
                False,
                [0] * (grad_y.dim() - 2),
                module.groups,
                [False, True, need_b],
            )
            if planar:
                grad_w = grad_w.squeeze(2)
        bias = module.bias
        grad_b = None if grad_b is None or bias is None else grad_b.to(bias.dtype)
        return grad_w.to(module.weight.dtype), grad_b

    def input_grad(self, x_shape: torch.Size, grad_y: Tensor, weight: Tensor) -> Tensor:
        """dL/dx of ``y = synapse(x)`` on merged [T*B, ...] tensors, in the dtype of ``weight``
        (as :meth:`param_grads`). A Conv's is
        the transposed convolution of dL/dy (cuDNN's data-gradient kernels, in dL/dy's memory
        layout; x's values are not needed), with the output padding that restores x's size.
        Not ``torch.nn.grad.conv2d_input``: its stand-in input (a broadcast scalar) has no
        channels-last layout, so cuDNN would transpose dL/dy and its result."""
        module = self.module
        grad_y = grad_y.to(weight.dtype)
        if isinstance(module, nn.Linear):
            return grad_y @ weight
        if self._planar(grad_y):
            planar = grad_y.unsqueeze(2)
            return F.conv_transpose2d(planar, weight.unsqueeze(2), groups=module.groups).squeeze(2)
        assert not isinstance(module.padding, str)  # explicit_backward
        output_padding = [
            x_shape[2 + d]
            - (
                (grad_y.shape[2 + d] - 1) * module.stride[d]
                - 2 * module.padding[d]
                + module.dilation[d] * (module.kernel_size[d] - 1)
                + 1
            )
            for d in range(grad_y.dim() - 2)
        ]
        transposed = F.conv_transpose1d if grad_y.dim() == 3 else F.conv_transpose2d
        return transposed(
            grad_y,
            weight,
            None,
            module.stride,
            module.padding,
            output_padding,
            module.groups,
            module.dilation,
        )


def match_optimizer_state(optimizer: torch.optim.Optimizer) -> int:
    """Lay each per-parameter optimizer buffer (momentum, Adam's moments, ...) out like its
    parameter; returns how many were copied.

    Fused Conv2d blocks keep their weights channels-last on CUDA. Optimizer state loaded from
    a checkpoint of the unfused model (``optimizer.load_state_dict`` keeps the saved layout),
    or made before ``fuse(model, inplace=True)``, is then laid out differently from its
    parameter: foreach optimizers fall back to their slow path and ``fused=True`` Adam/AdamW
    refuse the mix. Call this after loading. Values are unchanged."""
    copied = 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            for name, buffer in state.items():
                if (
                    isinstance(buffer, Tensor)
                    and buffer.shape == param.shape
                    and buffer.dim() > 1
                    and buffer.stride() != param.stride()
                ):
                    state[name] = torch.empty_like(param, dtype=buffer.dtype).copy_(buffer)
                    copied += 1
    return copied
