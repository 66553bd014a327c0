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

import functools
import importlib
from types import ModuleType

import torch
from torch import Tensor

from . import reference
from .backends import compute_dtype
from .errors import SpikefuseError
from .program import NeuronProgram, lookup


@functools.cache
def backend_module(backend: str) -> ModuleType:
    """The module implementing ``fptt``/``bptt``/``saved_like``/``keeps_x`` for a backend."""
    if backend == "torch":
        return reference
    if backend == "cuda":
        return importlib.import_module("spikefuse.cuda.backend")
    raise ValueError(f"unknown backend {backend!r}")


def _or_empty(t: Tensor | None, like: Tensor) -> Tensor:
    return like.new_empty(0) if t is None else t  # distinct objects: op outputs must not alias


@torch.library.custom_op("spikefuse::neuron_fptt", mutates_args=())
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
    out = backend_module(backend).fptt(
        lookup(program), x_seq, v0, w0, learnable, constants, init, save_for_backward, store_v_seq
    )
    return tuple(_or_empty(t, x_seq) for t in out)


@neuron_fptt.register_fake
def _(program, backend, x_seq, v0, w0, learnable, constants, init, save_for_backward, store_v_seq):
    prog = lookup(program)
    cd = compute_dtype(x_seq.dtype)
    state = x_seq.new_empty(x_seq.shape[1:], dtype=cd)
    out = (
        torch.empty_like(x_seq, memory_format=torch.contiguous_format),  # whatever x's strides
        torch.empty_like(x_seq, memory_format=torch.contiguous_format) if store_v_seq else None,
        state,
        torch.empty_like(state) if prog.definition.adaptive else None,
        *backend_module(backend).saved_like(prog, x_seq, save_for_backward),
    )
    return tuple(_or_empty(t, x_seq) for t in out)


@torch.library.custom_op("spikefuse::neuron_bptt", mutates_args=())
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
    out = _bptt(lookup(program), backend, grad_spikes, grad_v_seq, grad_v_last, grad_w_last,
                saved_v, saved_w, x_seq, v0, w0, learnable, constants, init)  # fmt: skip
    return tuple(_or_empty(t, grad_spikes) for t in out)


@neuron_bptt.register_fake
def _(program, backend, grad_spikes, grad_v_seq, grad_v_last, grad_w_last, saved_v, saved_w,
      x_seq, v0, w0, learnable, constants, init):  # fmt: skip
    adaptive = lookup(program).definition.adaptive
    out = (
        torch.empty_like(grad_spikes, memory_format=torch.contiguous_format),
        None if v0 is None else torch.empty_like(v0),
        None if w0 is None or not adaptive else torch.empty_like(w0),
        None if learnable is None else torch.empty_like(learnable),
    )
    return tuple(_or_empty(t, grad_spikes) for t in out)


def _bptt(program: NeuronProgram, backend, grad_spikes, grad_v_seq, grad_v_last, grad_w_last,
          saved_v, saved_w, x_seq, v0, w0, learnable, constants, init):  # fmt: skip
    """The backend's bptt; empty placeholders (from the ops) count as absent; the learnable
    gradient comes back in the learnable tensor's dtype."""

    def present(t):
        return t if t is not None and t.numel() else None

    out = backend_module(backend).bptt(
        program, grad_spikes, grad_v_seq, grad_v_last, grad_w_last, saved_v, present(saved_w),
        x_seq, v0, w0, learnable, constants, init,
    )  # fmt: skip
    grad_learnable = out.grad_learnable
    if grad_learnable is not None:
        grad_learnable = grad_learnable.to(learnable.dtype)
    return out.grad_x, out.grad_v0, out.grad_w0, grad_learnable


def forbid_double_backward(what: str) -> None:
    """Raise if a backward runs with grad mode on, i.e. under ``create_graph=True``: the
    hand-written backwards are not differentiable, so a second-order term would be dropped."""
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        raise SpikefuseError(
            f"{what} does not support double backward (create_graph=True): its backward is not "
            "differentiable, so higher-order gradients would be silently wrong; use the plain "
            "autograd oracle (spikefuse.reference.oracle) for higher-order derivatives"
        )


def _setup_context(ctx, program: NeuronProgram, backend, inputs, saved, save, store_v_seq):
    x_seq, v0, w0, learnable, constants, init = inputs
    ctx.program, ctx.backend, ctx.constants, ctx.init = program, backend, constants, init
    ctx.saved, ctx.store_v_seq = save, store_v_seq
    keep_x = x_seq if backend_module(backend).keeps_x(program) else None
    ctx.save_for_backward(*saved, keep_x, v0, w0, learnable)


def _input_grads(ctx, grad_spikes, grad_v_seq, grad_v_last, grad_w_last, bptt):
    """Gradients of (x_seq, v0, w0, learnable) from the saved context, via ``bptt``."""
    if not ctx.saved:
        raise RuntimeError("spikefuse: backward through a neuron whose forward saved nothing")
    saved_v, saved_w, x_seq, v0, w0, learnable = ctx.saved_tensors
    grad_v_seq = grad_v_seq if ctx.store_v_seq else None  # outputs that do not exist: no grad
    grad_w_last = grad_w_last if ctx.program.definition.adaptive else None
    if grad_spikes is None:
        like = x_seq if x_seq is not None else saved_v
        grad_spikes = torch.zeros(like.shape, dtype=like.dtype, device=like.device)
    return bptt(ctx.program, ctx.backend, grad_spikes, grad_v_seq, grad_v_last, grad_w_last,
                saved_v, saved_w, x_seq, v0, w0, learnable, ctx.constants, ctx.init)  # fmt: skip


def _setup_op_context(ctx, inputs, output) -> None:
    program, backend, x_seq, v0, w0, learnable, constants, init, save, store_v_seq = inputs
    _setup_context(ctx, lookup(program), backend, (x_seq, v0, w0, learnable, constants, init),
                   output[4:], save, store_v_seq)  # fmt: skip


def _op_backward(ctx, grad_spikes, grad_v_seq, grad_v_last, grad_w_last, _grad_sv, _grad_sw):
    forbid_double_backward("a spikefuse neuron")

    def op_bptt(program, backend, *args):
        return neuron_bptt(program.key, backend, *args)

    grads = _input_grads(ctx, grad_spikes, grad_v_seq, grad_v_last, grad_w_last, op_bptt)
    _, v0, w0, learnable = ctx.saved_tensors[2:]
    present = (True, v0 is not None, w0 is not None, learnable is not None)
    grads = [g if keep else None for g, keep in zip(grads, present, strict=True)]
    return None, None, *grads, None, None, None, None


neuron_fptt.register_autograd(_op_backward, setup_context=_setup_op_context)


class _EagerNeuron(torch.autograd.Function):
    """The same computation as the custom ops, without their Python dispatch cost (eager mode)."""

    @staticmethod
    def forward(ctx, x_seq, v0, w0, learnable, config):
        program, backend, constants, init, store_v_seq = config  # one argument: apply is cheaper
        ctx.set_materialize_grads(False)  # unused outputs get None, not a zero-filled tensor
        out = backend_module(backend).fptt(
            program, x_seq, v0, w0, learnable, constants, init, True, store_v_seq
        )
        _setup_context(ctx, program, backend, (x_seq, v0, w0, learnable, constants, init),
                       out[4:], True, store_v_seq)  # fmt: skip
        return out[:4]

    @staticmethod
    def backward(ctx, grad_spikes, grad_v_seq, grad_v_last, grad_w_last):
        forbid_double_backward("a spikefuse neuron")
        grads = _input_grads(ctx, grad_spikes, grad_v_seq, grad_v_last, grad_w_last, _bptt)
        return *grads, None


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
    """
    save = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x_seq, v0, w0, learnable)
    )
    if torch.compiler.is_compiling():  # the custom op: opaque to the compiler, no graph break
        out = torch.ops.spikefuse.neuron_fptt(program.key, backend, x_seq, v0, w0, learnable,
                                              constants, init, save, store_v_seq)  # fmt: skip
        return out[0], out[1], out[2], out[3]
    if not save:
        out = backend_module(backend).fptt(
            program, x_seq, v0, w0, learnable, constants, init, False, store_v_seq
        )
        return out[0], out[1], out[2], out[3]
    return _EagerNeuron.apply(x_seq, v0, w0, learnable,
                              (program, backend, constants, init, store_v_seq))  # fmt: skip
