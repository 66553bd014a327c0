"""The neuron as two ``torch.library`` custom ops (forward through time, backward through time).

Both backends run behind the same ops, so autograd wiring, fake (meta) implementations and
``torch.compile`` support are written once: ``torch.compile`` sees an opaque op with known output
shapes and never graph-breaks around a neuron. The program is passed by its registry key.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch
from torch import Tensor

from . import reference
from .program import NeuronProgram, lookup


def backend_module(backend: str) -> ModuleType:
    """The module implementing ``fptt``/``bptt``/``saved_dtype`` for a backend name."""
    if backend == "torch":
        return reference
    if backend == "cuda":
        return importlib.import_module("spikefuse.cuda.backend")
    raise ValueError(f"unknown backend {backend!r}")


@torch.library.custom_op("spikefuse::neuron_fptt", mutates_args=())
def neuron_fptt(
    program: str,
    backend: str,
    x_seq: Tensor,
    v0: Tensor,
    w0: Tensor,
    learnable: Tensor,
    constants: list[float],
    save_for_backward: bool,
    store_v_seq: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(spikes, v_seq, v_last, w_last, h_seq, w_seq); see :class:`spikefuse.reference.FPTTOut`."""
    return _fptt(program, backend, x_seq, v0, w0, learnable, constants, save_for_backward,
                 store_v_seq)  # fmt: skip


def _fptt(program, backend, x_seq, v0, w0, learnable, constants, save_for_backward, store_v_seq):
    out = backend_module(backend).fptt(
        lookup(program), x_seq, v0, w0, learnable, constants, save_for_backward, store_v_seq
    )
    return tuple(out)


def _bptt(program, backend, grad_spikes, grad_v_seq, grad_v_last, grad_w_last, h_seq, w_seq,
          x_seq, v0, w0, learnable, constants):  # fmt: skip
    out = backend_module(backend).bptt(
        lookup(program), grad_spikes, grad_v_seq, grad_v_last, grad_w_last,
        h_seq, w_seq, x_seq, v0, w0, learnable, constants,
    )  # fmt: skip
    return out.grad_x, out.grad_v0, out.grad_w0, out.grad_learnable.to(learnable.dtype)


@neuron_fptt.register_fake
def _(program, backend, x_seq, v0, w0, learnable, constants, save_for_backward, store_v_seq):
    prog = lookup(program)
    saved = backend_module(backend).saved_dtype(x_seq.dtype)
    cd = reference.compute_dtype(x_seq.dtype)
    seq, state = x_seq.shape, x_seq.shape[1:]

    def maybe(cond: bool, shape, dtype) -> Tensor:
        return x_seq.new_empty(shape if cond else (0,), dtype=dtype)

    return (
        x_seq.new_empty(seq),  # backends return contiguous outputs whatever the input's strides
        maybe(store_v_seq, seq, x_seq.dtype),
        x_seq.new_empty(state, dtype=cd),
        maybe(prog.definition.adaptive, state, cd),
        maybe(save_for_backward, seq, saved),
        maybe(save_for_backward and prog.definition.partials.needs_w, seq, saved),
    )


@torch.library.custom_op("spikefuse::neuron_bptt", mutates_args=())
def neuron_bptt(
    program: str,
    backend: str,
    grad_spikes: Tensor,
    grad_v_seq: Tensor | None,
    grad_v_last: Tensor | None,
    grad_w_last: Tensor | None,
    h_seq: Tensor,
    w_seq: Tensor,
    x_seq: Tensor,
    v0: Tensor,
    w0: Tensor,
    learnable: Tensor,
    constants: list[float],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(grad_x, grad_v0, grad_w0, grad_learnable); see :class:`spikefuse.reference.BPTTOut`."""
    return _bptt(program, backend, grad_spikes, grad_v_seq, grad_v_last, grad_w_last, h_seq,
                 w_seq, x_seq, v0, w0, learnable, constants)  # fmt: skip


@neuron_bptt.register_fake
def _(program, backend, grad_spikes, grad_v_seq, grad_v_last, grad_w_last, h_seq, w_seq, x_seq,
      v0, w0, learnable, constants):  # fmt: skip
    return (torch.empty_like(grad_spikes), torch.empty_like(v0), torch.empty_like(w0),
            torch.empty_like(learnable))  # fmt: skip


def _setup_context(ctx, inputs, output) -> None:
    program, backend, x_seq, v0, w0, learnable, constants, save_for_backward, store_v_seq = inputs
    h_seq, w_seq = output[4], output[5]
    ctx.program, ctx.backend, ctx.constants, ctx.saved = (
        program,
        backend,
        constants,
        save_for_backward,
    )
    ctx.store_v_seq = store_v_seq
    keep_x = x_seq if lookup(program).definition.partials.needs_x else x_seq.new_empty(0)
    ctx.save_for_backward(h_seq, w_seq, keep_x, v0, w0, learnable)


def _input_grads(ctx, grad_spikes, grad_v_seq, grad_v_last, grad_w_last, bptt):
    """Gradients of (x_seq, v0, w0, learnable) from the saved context, via ``bptt``."""
    if not ctx.saved:
        raise RuntimeError("spikefuse: backward through a neuron whose forward saved nothing")
    h_seq, w_seq, x_seq, v0, w0, learnable = ctx.saved_tensors
    # Outputs that do not exist (empty placeholders) get no gradient.
    grad_v_seq = grad_v_seq if ctx.store_v_seq else None
    grad_w_last = grad_w_last if w0.numel() else None
    if grad_spikes is None:
        grad_spikes = torch.zeros(h_seq.shape, dtype=v0.dtype, device=h_seq.device)
    return bptt(ctx.program, ctx.backend, grad_spikes, grad_v_seq, grad_v_last, grad_w_last,
                h_seq, w_seq, x_seq, v0, w0, learnable, ctx.constants)  # fmt: skip


def _backward(ctx, grad_spikes, grad_v_seq, grad_v_last, grad_w_last, _grad_h, _grad_w):
    grads = _input_grads(ctx, grad_spikes, grad_v_seq, grad_v_last, grad_w_last, neuron_bptt)
    return None, None, *grads, None, None, None


neuron_fptt.register_autograd(_backward, setup_context=_setup_context)


class _EagerNeuron(torch.autograd.Function):
    """The same computation as the custom ops, without their Python dispatch cost (eager mode)."""

    @staticmethod
    def forward(ctx, x_seq, v0, w0, learnable, program, backend, constants, save, store_v_seq):
        out = _fptt(program, backend, x_seq, v0, w0, learnable, constants, save, store_v_seq)
        _setup_context(ctx, (program, backend, x_seq, v0, w0, learnable, constants, save,
                             store_v_seq), out)  # fmt: skip
        return out[:4]

    @staticmethod
    def backward(ctx, grad_spikes, grad_v_seq, grad_v_last, grad_w_last):
        grads = _input_grads(ctx, grad_spikes, grad_v_seq, grad_v_last, grad_w_last, _bptt)
        return *grads, None, None, None, None, None


def run_neuron(
    program: NeuronProgram,
    backend: str,
    x_seq: Tensor,
    v0: Tensor,
    w0: Tensor,
    learnable: Tensor,
    constants: list[float],
    store_v_seq: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Run a neuron over ``x_seq`` [T, *]; returns (spikes, v_seq or empty, v_last, w_last).

    Saves H (and W when needed) for backward only if autograd will need it.
    """
    save = torch.is_grad_enabled() and (
        x_seq.requires_grad or v0.requires_grad or w0.requires_grad or learnable.requires_grad
    )
    args = (program.key, backend, x_seq, v0, w0, learnable, constants, save, store_v_seq)
    if torch.compiler.is_compiling():  # the custom op: opaque to the compiler, no graph break
        out = torch.ops.spikefuse.neuron_fptt(*args)
        return out[0], out[1], out[2], out[3]
    if not save:
        return _fptt(*args)[:4]
    return _EagerNeuron.apply(x_seq, v0, w0, learnable, *args[:2], *args[6:])
