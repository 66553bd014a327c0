"""The neuron as two ``torch.library`` custom ops (forward through time, backward through time).

Both backends run behind the same ops, so autograd wiring, fake (meta) implementations and
``torch.compile`` support are written once: ``torch.compile`` sees an opaque op with known output
shapes and never graph-breaks around a neuron. The program is passed by its registry key.
In eager mode an ``autograd.Function`` calls the backends directly, skipping the ops' dispatch.

Optional inputs (``v0``, ``w0``, ``learnable``) are None when absent: an initial state that is
the same constant for every neuron (``init``) or a neuron without learnable parameters. Op
outputs that do not exist are empty tensors; the eager path returns None for them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .backends import compute_dtype, get_backend
from .errors import SpikefuseError
from .program import NeuronProgram, lookup

# What a neuron call fixes besides its tensors: (program, backend, constants, init, store_v_seq).
# A plain tuple: it is built on every eager call, and autograd.Function.apply takes it as one
# argument.
CallConfig = tuple[NeuronProgram, str, list[float], list[float], bool]
# grad_x, grad_v0, grad_w0, grad_learnable (see spikefuse.backends.BPTTOut)
InputGrads = tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]


def _or_empty(t: Tensor | None, like: Tensor) -> Tensor:
    return like.new_empty(0) if t is None else t  # distinct objects: op outputs must not alias


# The ops are defined with torch.library's low-level API, not ``torch.library.custom_op``: its
# Python wrapper checks every call's outputs for aliasing, which costs host time on every call
# (compiled models call the ops once per neuron and step); these implementations return
# fresh tensors only (tests/test_ops.py runs torch.library.opcheck on them).
_LIB = torch.library.Library("spikefuse", "DEF")
_LIB.define(
    "neuron_fptt(str program, str backend, Tensor x_seq, Tensor? v0, Tensor? w0, "
    "Tensor? learnable, float[] constants, float[] init, bool save_for_backward, "
    "bool store_v_seq) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
)
_LIB.define(
    "neuron_bptt(str program, str backend, Tensor grad_spikes, Tensor? grad_v_seq, "
    "Tensor? grad_v_last, Tensor? grad_w_last, Tensor saved_v, Tensor? saved_w, Tensor? x_seq, "
    "Tensor? v0, Tensor? w0, Tensor? learnable, float[] constants, float[] init) "
    "-> (Tensor, Tensor, Tensor, Tensor)"
)


def neuron_fptt(
    program: str,
    backend: str,
    x_seq: Tensor,
    v0: Tensor | None,
    w0: Tensor | None,
    learnable: Tensor | None,
    constants: list[float],
    init: list[float],
    save_for_backward: bool,
    store_v_seq: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(spikes, v_seq, v_last, w_last, saved_v, saved_w); see :class:`spikefuse.backends.FPTTOut`."""
    out = get_backend(backend).fptt(
        lookup(program), x_seq, v0, w0, learnable, constants, init, save_for_backward, store_v_seq
    )
    return tuple(_or_empty(t, x_seq) for t in out)  # type: ignore[return-value]  # 6 outputs


def _neuron_fptt_fake(
    program: str,
    backend: str,
    x_seq: Tensor,
    v0: Tensor | None,
    w0: Tensor | None,
    learnable: Tensor | None,
    constants: list[float],
    init: list[float],
    save_for_backward: bool,
    store_v_seq: bool,
) -> tuple[Tensor, ...]:
    prog = lookup(program)
    state = x_seq.new_empty(x_seq.shape[1:], dtype=compute_dtype(x_seq.dtype))
    contiguous = torch.contiguous_format  # the outputs, whatever x's strides
    out = (
        torch.empty_like(x_seq, memory_format=contiguous),
        torch.empty_like(x_seq, memory_format=contiguous) if store_v_seq else None,
        state,
        torch.empty_like(state) if prog.definition.adaptive else None,
        *get_backend(backend).saved_like(prog, x_seq, save_for_backward),
    )
    return tuple(_or_empty(t, x_seq) for t in out)


def neuron_bptt(
    program: str,
    backend: str,
    grad_spikes: Tensor,
    grad_v_seq: Tensor | None,
    grad_v_last: Tensor | None,
    grad_w_last: Tensor | None,
    saved_v: Tensor,
    saved_w: Tensor | None,
    x_seq: Tensor | None,
    v0: Tensor | None,
    w0: Tensor | None,
    learnable: Tensor | None,
    constants: list[float],
    init: list[float],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(grad_x, grad_v0, grad_w0, grad_learnable); see :class:`spikefuse.backends.BPTTOut`."""
    out = _bptt(
        lookup(program),
        backend,
        grad_spikes,
        grad_v_seq,
        grad_v_last,
        grad_w_last,
        saved_v,
        saved_w,
        x_seq,
        v0,
        w0,
        learnable,
        constants,
        init,
    )
    return tuple(_or_empty(t, grad_spikes) for t in out)  # type: ignore[return-value]  # 4 outputs


def _neuron_bptt_fake(
    program: str,
    backend: str,
    grad_spikes: Tensor,
    grad_v_seq: Tensor | None,
    grad_v_last: Tensor | None,
    grad_w_last: Tensor | None,
    saved_v: Tensor,
    saved_w: Tensor | None,
    x_seq: Tensor | None,
    v0: Tensor | None,
    w0: Tensor | None,
    learnable: Tensor | None,
    constants: list[float],
    init: list[float],
) -> tuple[Tensor, ...]:
    adaptive = lookup(program).definition.adaptive
    out = (
        torch.empty_like(grad_spikes, memory_format=torch.contiguous_format),
        None if v0 is None else torch.empty_like(v0, memory_format=torch.contiguous_format),
        None
        if w0 is None or not adaptive
        else torch.empty_like(w0, memory_format=torch.contiguous_format),
        None if learnable is None else torch.empty_like(learnable),
    )
    return tuple(_or_empty(t, grad_spikes) for t in out)


def _bptt(
    program: NeuronProgram,
    backend: str,
    grad_spikes: Tensor,
    grad_v_seq: Tensor | None,
    grad_v_last: Tensor | None,
    grad_w_last: Tensor | None,
    saved_v: Tensor | None,
    saved_w: Tensor | None,
    x_seq: Tensor | None,
    v0: Tensor | None,
    w0: Tensor | None,
    learnable: Tensor | None,
    constants: list[float],
    init: list[float],
) -> InputGrads:
    """The backend's bptt; an empty ``saved_w`` (a placeholder from the ops) counts as absent;
    the learnable gradient comes back in the learnable tensor's dtype and shape ([P] or, for
    one value, 0-dim)."""
    if saved_w is not None and not saved_w.numel():
        saved_w = None
    # Positional (a hot path): every argument is the variable named like the parameter, and
    # every backend's bptt has the protocol's parameter order (tests/test_backends.py).
    out = get_backend(backend).bptt(
        program,
        grad_spikes,
        grad_v_seq,
        grad_v_last,
        grad_w_last,
        saved_v,
        saved_w,
        x_seq,
        v0,
        w0,
        learnable,
        constants,
        init,
    )
    grad_learnable = out.grad_learnable
    if grad_learnable is not None and learnable is not None:  # a no-op in the compute dtype
        grad_learnable = grad_learnable.to(learnable.dtype)
    return out.grad_x, out.grad_v0, out.grad_w0, grad_learnable


def forbid_double_backward(what: str) -> None:
    """Raise if a backward runs with grad mode on, i.e. under ``create_graph=True``: the
    hand-written backwards are not differentiable, so a second-order term would be dropped."""
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        raise SpikefuseError(
            f"{what} does not support double backward (create_graph=True): its backward is not "
            "differentiable, so higher-order gradients would be silently wrong; for higher-order "
            "derivatives write the neuron as torch code (a BaseNode subclass overriding "
            "neuronal_charge runs with plain autograd on the torch backend)"
        )


def _save_context(
    ctx: Any,
    config: CallConfig,
    saved: bool,
    x_seq: Tensor,
    v0: Tensor | None,
    w0: Tensor | None,
    learnable: Tensor | None,
    saved_v: Tensor | None,
    saved_w: Tensor | None,
) -> None:
    """Keep what backward needs: the call's configuration, whether forward saved anything, the
    backend's saved tensors, the optional inputs and x (only if the backend's bptt reads it)."""
    ctx.config, ctx.saved = config, saved
    program, backend = config[0], config[1]
    keep_x = x_seq if get_backend(backend).keeps_x(program) else None
    ctx.save_for_backward(saved_v, saved_w, keep_x, v0, w0, learnable)


def _input_grads(
    ctx: Any,
    grad_spikes: Tensor | None,
    grad_v_seq: Tensor | None,
    grad_v_last: Tensor | None,
    grad_w_last: Tensor | None,
    bptt: Callable[..., InputGrads],
) -> InputGrads:
    """Gradients of (x_seq, v0, w0, learnable) from the saved context, via ``bptt`` (called
    like :func:`_bptt`)."""
    if not ctx.saved:
        raise RuntimeError("spikefuse: backward through a neuron whose forward saved nothing")
    program, backend, constants, init, store_v_seq = ctx.config
    saved_v, saved_w, x_seq, v0, w0, learnable = ctx.saved_tensors
    if grad_spikes is None:
        like = x_seq if x_seq is not None else saved_v
        grad_spikes = torch.zeros(like.shape, dtype=like.dtype, device=like.device)
    if not store_v_seq:  # outputs that do not exist: no gradient
        grad_v_seq = None
    if not program.definition.adaptive:
        grad_w_last = None
    return bptt(
        program,
        backend,
        grad_spikes,
        grad_v_seq,
        grad_v_last,
        grad_w_last,
        saved_v,
        saved_w,
        x_seq,
        v0,
        w0,
        learnable,
        constants,
        init,
    )


def _setup_op_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    program, backend, x_seq, v0, w0, learnable, constants, init, save, store_v_seq = inputs
    config = (lookup(program), backend, constants, init, store_v_seq)
    _save_context(ctx, config, save, x_seq, v0, w0, learnable, output[4], output[5])


def _op_bptt(program: NeuronProgram, backend: str, *tensors_and_constants: Any) -> InputGrads:
    """:func:`_bptt` through the ``neuron_bptt`` op (what torch.compile traces)."""
    return torch.ops.spikefuse.neuron_bptt.default(program.key, backend, *tensors_and_constants)


def _op_backward(
    ctx: Any,
    grad_spikes: Tensor | None,
    grad_v_seq: Tensor | None,
    grad_v_last: Tensor | None,
    grad_w_last: Tensor | None,
    _grad_saved_v: Tensor | None,
    _grad_saved_w: Tensor | None,
) -> tuple[Tensor | None, ...]:
    forbid_double_backward("a spikefuse neuron")
    grads = _input_grads(ctx, grad_spikes, grad_v_seq, grad_v_last, grad_w_last, _op_bptt)
    _, v0, w0, learnable = ctx.saved_tensors[2:]
    present = (True, v0 is not None, w0 is not None, learnable is not None)  # else: empty grads
    input_grads = (g if keep else None for g, keep in zip(grads, present, strict=True))
    # program, backend, *grads (x_seq, v0, w0, learnable), constants, init, save, store_v_seq
    return None, None, *input_grads, None, None, None, None


def register_op_pair(
    lib: torch.library.Library,
    forward: tuple[Callable[..., Any], Callable[..., Any]],
    backward: tuple[Callable[..., Any], Callable[..., Any]],
    autograd: tuple[Callable[..., Any], Callable[..., Any]],
) -> None:
    """Register a forward op and its backward op, both defined in ``lib`` and named like their
    implementations: (implementation, fake) each, and the forward's autograd formula
    (backward, setup_context)."""
    for impl, fake in (forward, backward):
        lib.impl(impl.__name__, impl, "CompositeExplicitAutograd")
        torch.library.register_fake(f"spikefuse::{impl.__name__}", fake, lib=lib)
    formula, setup_context = autograd
    op = f"spikefuse::{forward[0].__name__}"
    torch.library.register_autograd(op, formula, setup_context=setup_context, lib=lib)


register_op_pair(
    _LIB,
    (neuron_fptt, _neuron_fptt_fake),
    (neuron_bptt, _neuron_bptt_fake),
    (_op_backward, _setup_op_context),
)


class _EagerNeuron(torch.autograd.Function):
    """The same computation as the custom ops, without their Python dispatch cost (eager mode)."""

    @staticmethod
    def forward(
        ctx: Any,
        x_seq: Tensor,
        v0: Tensor | None,
        w0: Tensor | None,
        learnable: Tensor | None,
        config: CallConfig,  # one argument, not five: apply is cheaper
    ) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
        program, backend, constants, init, store_v_seq = config
        ctx.set_materialize_grads(False)  # unused outputs get None, not a zero-filled tensor
        out = get_backend(backend).fptt(
            program,
            x_seq,
            v0,
            w0,
            learnable,
            constants,
            init,
            save_for_backward=True,
            store_v_seq=store_v_seq,
        )
        _save_context(ctx, config, True, x_seq, v0, w0, learnable, out.saved_v, out.saved_w)
        return out.spikes, out.v_seq, out.v_last, out.w_last

    @staticmethod
    def backward(
        ctx: Any,
        grad_spikes: Tensor | None,
        grad_v_seq: Tensor | None,
        grad_v_last: Tensor | None,
        grad_w_last: Tensor | None,
    ) -> tuple[Tensor | None, ...]:
        forbid_double_backward("a spikefuse neuron")
        return *_input_grads(ctx, grad_spikes, grad_v_seq, grad_v_last, grad_w_last, _bptt), None


def run_neuron(
    program: NeuronProgram,
    backend: str,
    x_seq: Tensor,
    v0: Tensor | None,
    w0: Tensor | None,
    learnable: Tensor | None,
    constants: list[float],
    init: list[float],
    store_v_seq: bool,
) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
    """Run a neuron over ``x_seq`` [T, *]; returns (spikes, v_seq, v_last, w_last).

    ``v_seq`` is None unless ``store_v_seq``, ``w_last`` None for one-state neurons (empty
    tensors instead while ``torch.compile`` traces). Saves state for backward only if autograd
    will need it.

    The outputs keep x's memory layout where it is a dense permutation with time outermost
    (e.g. channels-last maps, or tokens with the channels innermost), as torch's pointwise ops
    keep it; the states ``v0``, ``w0`` and ``v_last``, ``w_last`` lie as one step of x does.
    Other layouts are run as a contiguous copy, outputs contiguous.
    """
    order = memory_order(x_seq)
    if order is not None:  # the contiguous view of x's memory (and the states' views)
        state_order = [d - 1 for d in order[1:]]
        outputs = run_neuron(
            program,
            backend,
            x_seq.permute(order),
            _permuted(v0, state_order),
            _permuted(w0, state_order),
            learnable,
            constants,
            init,
            store_v_seq,
        )
        return _permuted_back(outputs, order)
    save = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x_seq, v0, w0, learnable)
    )
    if torch.compiler.is_compiling():  # the custom op: opaque to the compiler, no graph break
        op_out = torch.ops.spikefuse.neuron_fptt(
            program.key, backend, x_seq, v0, w0, learnable, constants, init, save, store_v_seq
        )
        return op_out[0], op_out[1], op_out[2], op_out[3]
    if not save:
        out = get_backend(backend).fptt(
            program,
            x_seq,
            v0,
            w0,
            learnable,
            constants,
            init,
            save_for_backward=False,
            store_v_seq=store_v_seq,
        )
        return out.spikes, out.v_seq, out.v_last, out.w_last
    config = (program, backend, constants, init, store_v_seq)
    return _EagerNeuron.apply(x_seq, v0, w0, learnable, config)


def memory_order(x: Tensor) -> tuple[int, ...] | None:
    """The order of x's dimensions, time (0) first, in which x's memory is contiguous, where it
    is not x's own order: ``x.permute(order)`` is then a contiguous view. None where x is
    contiguous, or dense in no such order (gaps, overlaps, time not outermost)."""
    if x.dim() < 3 or x.is_contiguous():
        return None
    rest = sorted(range(1, x.dim()), key=x.stride, reverse=True)
    order = (0, *rest)
    return order if x.permute(order).is_contiguous() else None


def _permuted(t: Tensor | None, dims: list[int]) -> Tensor | None:
    """t.permute(dims); None, or the empty placeholder of an absent output while torch.compile
    traces, as it is."""
    return t if t is None or t.dim() != len(dims) else t.permute(dims)


def _permuted_back(
    out: tuple[Tensor, Tensor | None, Tensor, Tensor | None], order: tuple[int, ...]
) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
    """(spikes, v_seq, v_last, w_last) of the run on ``x_seq.permute(order)``, in x's
    dimension order: views, no copy."""
    back = sorted(range(len(order)), key=order.__getitem__)
    state_back = [d - 1 for d in back[1:]]
    spikes, v_seq, v_last, w_last = out
    return (
        spikes.permute(back),
        _permuted(v_seq, back),
        v_last.permute(state_back),
        _permuted(w_last, state_back),
    )
