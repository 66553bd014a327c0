"""Network-level helpers with SpikingJelly's names and semantics."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn

from .backends import BACKEND_NAMES, repeats_one_step
from .errors import SpikefuseError

#: The step modes of SpikingJelly's modules: one step ('s') or a whole sequence ('m').
STEP_MODES = ("s", "m")

Steps = nn.Module | Sequence[nn.Module] | Callable[[Tensor], Any]


def check_sequence(x_seq: Tensor, who: str, shape: str = "[T, N, *]", dims: range | None = None):
    """Raise unless ``x_seq`` is a tensor with a time and a batch dimension (ndim in ``dims``)."""
    if not isinstance(x_seq, Tensor):
        raise SpikefuseError(f"{who}: input must be a torch.Tensor, got {type(x_seq).__name__}")
    if x_seq.dim() not in (dims or range(2, 64)):
        raise SpikefuseError(
            f"{who}: multi-step input must be [T, N, *] (here {shape}: T time steps, N "
            f"samples), got shape {tuple(x_seq.shape)}; pass a sequence, or use step_mode='s' "
            "for one step"
        )


def split_time_batch(y: Tensor | tuple, time_batch: torch.Size) -> Tensor | tuple:
    """Split the merged first dimension of ``y`` (or of every tensor of a tuple) into [T, N]."""
    if isinstance(y, tuple):
        return tuple(split_time_batch(item, time_batch) for item in y)
    return y.unflatten(0, time_batch)


def repeated_over_time(x: Tensor) -> bool:
    """Whether ``x`` [T, B, ...] (T > 1) is one [B, ...] tensor viewed at every step (stride 0
    over T, as ``images.unsqueeze(0).expand(T, ...)`` gives) that needs no gradient (a gradient
    asked of the view itself must keep its T slices apart)."""
    return repeats_one_step(x) and not x.requires_grad


def repeat_over_time(y0: Tensor, steps: int) -> Tensor:
    """y0 [B, ...] (a synapse's output on one step) copied to a dense [steps, B, ...] tensor of
    its own (not a view: in-place ops on it work), every step laid out in memory like y0 when y0
    is contiguous or a 4-D channels-last map (as the fused kernels and their pooling read it),
    else contiguous; its gradient is the sum over the steps."""
    return _RepeatOverTime.apply(y0, steps)


class _RepeatOverTime(torch.autograd.Function):
    """:func:`repeat_over_time` on y0's memory as a flat vector: one batched copy forward and a
    sum over the leading dimension of [steps, numel] backward (torch's expand + copy would
    run a strided copy and, for channels-last maps, a transposing reduction, both slower)."""

    @staticmethod
    def forward(ctx: Any, y0: Tensor, steps: int) -> Tensor:
        channels_last = y0.dim() == 4 and y0.is_contiguous(memory_format=torch.channels_last)
        order = (0, 2, 3, 1) if channels_last and not y0.is_contiguous() else None
        y0 = y0 if order is not None else y0.contiguous()
        ctx.order = order
        strides = (y0.numel(), *y0.stride())
        out = torch.empty_strided((steps, *y0.shape), strides, dtype=y0.dtype, device=y0.device)
        # both in memory order: one batched copy of the flat step into each of the steps
        flat = y0 if order is None else y0.permute(order)
        into = out if order is None else out.permute(0, 1, 3, 4, 2)
        torch.cat([flat.reshape(1, -1)] * steps, out=into.view(steps, -1))
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        order = ctx.order
        dense = grad if order is None else grad.permute(0, 1, 3, 4, 2)  # out's memory order
        total = dense.reshape(grad.shape[0], -1).sum(0).view(dense.shape[1:])
        return (total if order is None else total.permute(0, 3, 1, 2)), None


def _apply_modules(x: Tensor | tuple[Tensor, ...], modules: Steps) -> Any:
    """``modules`` on x, as SpikingJelly applies them: a list or tuple one after the other, any
    other module (an ``nn.Sequential`` too: its own forward and hooks run) or function called;
    a tuple x is the first call's positional arguments."""
    args: tuple[Any, ...] = x if isinstance(x, tuple) else (x,)
    if isinstance(modules, (list, tuple)):
        out: Any = x
        for module in modules:
            out = module(*args)
            args = (out,)
        return out
    return cast("Callable[..., Any]", modules)(*args)


def multi_step_forward(x_seq: Tensor, single_step_module: Steps) -> Tensor:
    """Run single-step module(s) (a module, a list/tuple of them, or any callable) on
    ``x_seq`` [T, N, *] one step at a time and stack the outputs to [T, N, *].

    A Python loop over T: for modules without a multi-step mode (neurons and layers in
    ``step_mode='m'`` take the whole sequence at once)."""
    check_sequence(x_seq, "multi_step_forward")
    return torch.stack([_apply_modules(x, single_step_module) for x in x_seq])


def seq_to_ann_forward(x_seq: Tensor | tuple[Tensor, ...], stateless_module: Steps) -> Any:
    """Run stateless module(s) on ``x_seq`` [T, N, *] as one batch of T*N samples and split the
    result back to [T, N, *] (tuple outputs are split element-wise). ``x_seq`` may be a tuple
    of such tensors with the same [T, N], passed to the first module as its arguments (e.g.
    ``MaxUnpool2d``'s input and indices)."""
    items = x_seq if isinstance(x_seq, tuple) else (x_seq,)
    for item in items:
        check_sequence(item, "seq_to_ann_forward")
    time_batch = items[0].shape[:2]
    if any(item.shape[:2] != time_batch for item in items):
        shapes = [tuple(item.shape) for item in items]
        raise SpikefuseError(
            f"seq_to_ann_forward: the tensors of a tuple input must share [T, N], got {shapes}"
        )
    merged = tuple(item.flatten(0, 1) for item in items)
    y = _apply_modules(merged if isinstance(x_seq, tuple) else merged[0], stateless_module)
    return split_time_batch(y, time_batch)


def chunk_multi_step_forward(split_size: int, x_seq: Tensor, multi_step_module: nn.Module):
    """Run a multi-step module on ``x_seq`` [T, *] in chunks of ``split_size`` steps (the state
    carries over) and concatenate the outputs: less memory for long inference sequences."""
    if not isinstance(split_size, int) or split_size < 1:
        raise SpikefuseError(
            f"chunk_multi_step_forward: split_size must be an int >= 1, got {split_size!r}"
        )
    check_sequence(x_seq, "chunk_multi_step_forward")
    if split_size < x_seq.shape[0] and any(
        getattr(m, "restarts_every_call", False) for m in multi_step_module.modules()
    ):
        raise SpikefuseError(
            "chunk_multi_step_forward: fused blocks start every call from the reset state, so "
            "their neurons would restart at every chunk; run the sequence whole, or chunk the "
            "unfused model"
        )
    return torch.cat([multi_step_module(chunk) for chunk in torch.split(x_seq, split_size)])


def reset_net(net: nn.Module) -> None:
    """Call ``reset()`` on every module of ``net`` that has one (spikefuse's, SpikingJelly's or
    your own stateful modules): call between independent sequences."""
    for module in net.modules():
        # the class first: for a module without the attribute, getattr(module, ...) would go
        # through nn.Module.__getattr__ and raise (slow, and it runs on every training step)
        if callable(getattr(type(module), "reset", None)) or callable(module.__dict__.get("reset")):
            cast("Callable[[], object]", module.reset)()


def detach_net(net: nn.Module) -> None:
    """Call ``detach()`` on every module of ``net`` that has one: the state is kept but cut from
    the autograd graph of earlier steps (truncated BPTT)."""
    for module in net.modules():
        detach = getattr(module, "detach", None)
        if callable(detach):
            detach()


def _keep_step_mode(net: nn.Module) -> set[int]:
    """ids of modules inside containers that keep their children's step mode (SpikingJelly 2.0's
    list: the step-mode, sequence and recurrent containers); the containers themselves are set."""
    kept: set[int] = set()
    for module in net.modules():
        if getattr(module, "keeps_children_step_mode", False):
            kept.update(id(m) for m in module.modules() if m is not module)
    return kept


def set_step_mode(net: nn.Module, step_mode: str) -> None:
    """Set ``step_mode`` ('s' or 'm') on every module of ``net`` that has one, except inside
    ``SeqToANNContainer``, ``MultiStepContainer``, ``StepModeContainer``,
    ``ElementWiseRecurrentContainer`` and ``LinearRecurrentContainer`` (their contents stay
    single-step). Nothing changes unless every such module accepts the mode."""
    if step_mode not in STEP_MODES:
        raise SpikefuseError(f"step_mode must be 's' or 'm', got {step_mode!r}")
    kept = _keep_step_mode(net)
    targets = [m for m in net.modules() if hasattr(m, "step_mode") and id(m) not in kept]
    for module in targets:
        supported = getattr(module, "supported_step_mode", None)
        if callable(supported) and step_mode not in supported():
            raise SpikefuseError(
                f"set_step_mode: {type(module).__name__} supports step_mode {supported()}, not "
                f"{step_mode!r}; nothing was changed"
            )
    for module in targets:
        # torch types Module.__setattr__'s value as Tensor | Module; modules take any value
        module.step_mode = step_mode  # type: ignore[assignment]


def set_backend(
    net: nn.Module,
    backend: str,
    instance: type[nn.Module] | tuple[type[nn.Module], ...] | None = None,
) -> None:
    """Set ``backend`` on every module of ``net`` that is an ``instance`` (default: any module)
    and has a ``backend``. A module whose ``supported_backends`` lacks ``backend`` keeps its own
    and a warning names it (SpikingJelly's behaviour); a name that no module supports raises.

    spikefuse neurons support 'auto', 'torch', 'cuda' and 'cupy' (alias of cuda)."""
    instance = nn.Module if instance is None else instance
    targets = [m for m in net.modules() if isinstance(m, instance) and hasattr(m, "backend")]
    known = set(BACKEND_NAMES)
    for module in targets:
        known.update(getattr(module, "supported_backends", ()))
    if backend not in known:
        raise SpikefuseError(f"unknown backend {backend!r}; choose one of {sorted(known)}")
    for module in targets:
        supported = getattr(module, "supported_backends", None)
        if supported is not None and backend not in supported:
            warnings.warn(
                f"set_backend: {type(module).__name__} does not support backend={backend!r} "
                f"(supported: {tuple(supported)}); it keeps backend={module.backend!r}",
                stacklevel=2,
            )
            continue
        module.backend = backend  # type: ignore[assignment]  # as for step_mode above


def lif_charge(
    x: Tensor, v: Tensor, tau: float, decay_input: bool, v_reset: float | None
) -> Tensor:
    """LIF charge without fire or reset (SpikingJelly's ``functional.lif_charge``), with
    V_r = ``v_reset`` (0 when None):

    decay_input=True:  H = V + (X - (V - V_r)) / tau
    decay_input=False: H = V - (V - V_r) / tau + X
    """
    v_r = 0.0 if v_reset is None else v_reset
    if decay_input:
        return v + (x - (v - v_r)) / tau
    return v - (v - v_r) / tau + x


def voltage_reset(
    v: Tensor, spike: Tensor, v_threshold: float, v_reset: float | None, detach_reset: bool
) -> Tensor:
    """The reset after a spike (SpikingJelly's ``functional.voltage_reset``), S detached when
    ``detach_reset``: hard (``v_reset`` a float) S V_reset + (1 - S) V; soft (None) V - S V_th."""
    spike_d = spike.detach() if detach_reset else spike
    if v_reset is None:
        return v - spike_d * v_threshold
    return spike_d * v_reset + (1.0 - spike_d) * v


def if_step(
    x: Tensor,
    v: Tensor,
    v_threshold: float,
    v_reset: float | None,
    surrogate_function: Callable[[Tensor], Tensor],
    detach_reset: bool = False,
) -> tuple[Tensor, Tensor]:
    """One IF step (SpikingJelly's ``functional.if_step``): H = V + X, S = sg(H - V_th), then
    :func:`voltage_reset`; returns (S, V)."""
    h = v + x
    spike = surrogate_function(h - v_threshold)
    return spike, voltage_reset(h, spike, v_threshold, v_reset, detach_reset)


def lif_step(
    x: Tensor,
    v: Tensor,
    tau: float,
    decay_input: bool,
    v_threshold: float,
    v_reset: float | None,
    surrogate_function: Callable[[Tensor], Tensor],
    detach_reset: bool = False,
) -> tuple[Tensor, Tensor]:
    """One LIF step (SpikingJelly's ``functional.lif_step``): H = :func:`lif_charge`,
    S = sg(H - V_th), then :func:`voltage_reset`; returns (S, V)."""
    h = lif_charge(x, v, tau, decay_input, v_reset)
    spike = surrogate_function(h - v_threshold)
    return spike, voltage_reset(h, spike, v_threshold, v_reset, detach_reset)
