"""The reference backend: pure PyTorch, any device; the specification in code.

``fptt`` runs the dynamics through time; ``bptt`` is the explicit backward of the specification's
dL/dH[t] recurrence (the tests check it against an independent plain-autograd step loop,
``tests/oracle.py``). Implements :class:`spikefuse.backends.NeuronBackend`. Arithmetic runs
in float32 (float64 for float64 input); outputs are cast to the input dtype, states stay in the
compute dtype.

Shapes: ``x_seq`` [T, *], states [*]; ``learnable`` [P] (0-dim for P = 1) float32; ``constants`` floats (see
:mod:`spikefuse.program`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .backends import BPTTOut, FPTTOut, compute_dtype
from .errors import SpikefuseError
from .program import NeuronProgram

SAVES_SEQUENCE = True  # forward keeps H[t] (and W[t]) for every step


def unavailable_reason(x: torch.Tensor) -> str | None:
    """Always None: the reference backend runs on every device and floating dtype."""
    return None


def keeps_x(program: NeuronProgram) -> bool:
    """Whether backward needs X (only if a derivative could not be written without it)."""
    return program.definition.partials.needs_x


def saved_like(
    program: NeuronProgram, x_seq: torch.Tensor, save: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Uninitialised tensors shaped like ``FPTTOut.saved_v`` / ``saved_w`` (for fake tensors)."""
    if not save:
        return None, None
    h = x_seq.new_empty(x_seq.shape, dtype=compute_dtype(x_seq.dtype))
    return h, (torch.empty_like(h) if program.definition.partials.needs_w else None)


def _fire(h: torch.Tensor, vth: torch.Tensor) -> torch.Tensor:
    """S = Θ(H - V_th) in H's dtype, NaN where H is NaN (the NaN policy: a NaN membrane
    potential is never a valid "no spike"; the cuda kernels do the same)."""
    return torch.where(h.isnan(), h, (h >= vth).to(h.dtype))


def _reset(program: NeuronProgram, h, s, vth, vreset):
    """V from H and S: hard reset H(1 - S) + V_reset S, written as a select (as the cuda kernels
    do) so that H = +inf resets to V_reset; NaN H stays NaN. Soft reset H - V_th S."""
    return torch.where(h >= vth, vreset, h) if program.hard_reset else h - vth * s


def _initial(state: torch.Tensor | None, value: float, like: torch.Tensor) -> torch.Tensor:
    """The initial state in the compute dtype: the given tensor, or ``value`` everywhere."""
    return like.new_full(like.shape[1:], value) if state is None else state.to(like.dtype)


def fptt(
    program: NeuronProgram,
    x_seq: torch.Tensor,
    v0: torch.Tensor | None,
    w0: torch.Tensor | None,
    learnable: torch.Tensor | None,
    constants: list[float],
    init: list[float],
    save_for_backward: bool,
    store_v_seq: bool,
) -> FPTTOut:
    """Forward through time: S[t], V[t] from X[t] and V[-1] (and W[-1]).

    ``v0``/``w0`` [*] are the initial states; where None, every neuron starts at ``init[0]`` /
    ``init[1]``.
    """
    f, d = program.torch_functions, program.definition
    cd = compute_dtype(x_seq.dtype)
    xs = x_seq.to(cd)
    params = program.param_values(learnable, constants, xs)
    vth, vreset = params[0], params[1]
    v, w = _initial(v0, init[0], xs), _initial(w0, init[1], xs)
    zero = xs.new_zeros(())
    spikes, hs, vs, ws = [], [], [], []
    for t in range(xs.shape[0]):
        h = f["charge"](v, xs[t], w, zero, *params)
        s = _fire(h, vth)
        if d.adaptive:
            z = f["adaptation"](v, xs[t], w, h, *params)
            # the jump as the cuda kernels apply it: where H >= V_th (NaN H: Z decides)
            w = z + f["jump"](v, xs[t], w, h, *params) * (h >= vth).to(cd)
            ws.append(w)
        v = _reset(program, h, s, vth, vreset)
        spikes.append(s)
        hs.append(h)
        vs.append(v)
    save_w = save_for_backward and d.partials.needs_w
    return FPTTOut(
        spikes=torch.stack(spikes).to(x_seq.dtype),
        v_seq=torch.stack(vs).to(x_seq.dtype) if store_v_seq else None,
        v_last=v.clone(),
        w_last=w.clone() if d.adaptive else None,
        saved_v=torch.stack(hs) if save_for_backward else None,
        saved_w=torch.stack(ws) if save_w else None,
    )


@dataclass(frozen=True)
class _Saved:
    """What the forward left for backward, in the compute dtype: H[t] ``h_seq`` [T, *], W[t]
    ``w_seq`` [T, *] (None unless a derivative needs W), X[t] ``xs`` [T, *] (None unless one
    needs X), the initial states [*], the parameter values and a zero (0-dim tensors)."""

    program: NeuronProgram
    h_seq: torch.Tensor
    w_seq: torch.Tensor | None
    xs: torch.Tensor | None
    v_init: torch.Tensor
    w_init: torch.Tensor
    params: tuple[torch.Tensor, ...]
    zero: torch.Tensor

    @property
    def vth(self) -> torch.Tensor:
        return self.params[0]

    @property
    def vreset(self) -> torch.Tensor:
        return self.params[1]

    def x_at(self, t: int) -> torch.Tensor:
        return self.xs[t] if self.xs is not None else self.zero

    def w_at(self, t: int) -> torch.Tensor:
        """W[t] (t = -1: initial state); only derivatives that need W read it."""
        if self.w_seq is None:
            return self.zero
        return self.w_seq[t] if t >= 0 else self.w_init

    def v_at(self, t: int) -> torch.Tensor:
        """V[t] recomputed from H[t] (t = -1: initial state)."""
        if t < 0:
            return self.v_init
        h = self.h_seq[t]
        return _reset(self.program, h, _fire(h, self.vth), self.vth, self.vreset)

    def args(self, t: int) -> tuple[torch.Tensor, ...]:
        """The arguments of the derivatives of H[t] = f(V[t-1], X[t], W[t-1])."""
        return (self.v_at(t - 1), self.x_at(t), self.w_at(t - 1), self.h_seq[t], *self.params)


@dataclass(frozen=True)
class _OutputGrads:
    """dL/dS [T, *], dL/dV[t] [T, *] (None: V[t] unused), dL/dV[T-1] and dL/dW[T-1] [*]."""

    spikes: torch.Tensor
    v_seq: torch.Tensor | None
    v_last: torch.Tensor | None
    w_last: torch.Tensor | None


@dataclass(frozen=True)
class _Step:
    """Step t of the walk back: H[t]'s derivative arguments, dL/dH[t] and dL/dW[t] (None for a
    neuron without W)."""

    args: tuple[torch.Tensor, ...]
    grad_h: torch.Tensor
    grad_w: torch.Tensor | None


def _dv_dh(saved: _Saved, h: torch.Tensor, sg: torch.Tensor) -> torch.Tensor:
    """dV[t]/dH[t] through the reset (sg: the surrogate's Θ'; a detached reset passes none)."""
    not_detached = 0.0 if saved.program.detach_reset else 1.0
    if saved.program.hard_reset:
        return (1 - _fire(h, saved.vth)) + (saved.vreset - h) * sg * not_detached
    return 1 - saved.vth * sg * not_detached


def _grad_v(saved: _Saved, grads: _OutputGrads, t: int, later: _Step | None) -> torch.Tensor:
    """dL/dV[t] = ∂L/∂V[t] + dL/dH[t+1] ∂H[t+1]/∂V[t]."""
    cd = saved.h_seq.dtype
    grad_v = torch.zeros_like(saved.h_seq[t])
    if grads.v_seq is not None:
        grad_v = grad_v + grads.v_seq[t].to(cd)
    if later is None and grads.v_last is not None:
        grad_v = grad_v + grads.v_last.to(cd)
    if later is not None:
        grad_v = grad_v + later.grad_h * saved.program.torch_functions["dh_dv"](*later.args)
    return grad_v


def _grad_w(saved: _Saved, grads: _OutputGrads, t: int, later: _Step | None) -> torch.Tensor:
    """dL/dW[t] = dL/dH[t+1] ∂H[t+1]/∂W[t] + dL/dW[t+1] ∂Z[t+1]/∂W[t] (+ ∂L/∂W at T-1)."""
    f = saved.program.torch_functions
    grad_w = torch.zeros_like(saved.h_seq[t])
    if later is None and grads.w_last is not None:
        grad_w = grad_w + grads.w_last.to(saved.h_seq.dtype)
    if later is not None and later.grad_w is not None:  # both set at t + 1
        grad_w = grad_w + later.grad_h * f["dh_dw"](*later.args)
        grad_w = grad_w + later.grad_w * f["dz_dw"](*later.args)
    return grad_w


def _step_back(saved: _Saved, grads: _OutputGrads, t: int, later: _Step | None) -> _Step:
    """Step t from step t + 1 (``later``; None at t = T-1):
    dL/dH[t] = ∂L/∂S[t] Θ' + dL/dV[t] dV[t]/dH[t] + dL/dW[t] (∂Z[t]/∂H[t] + jump Θ')."""
    program, h = saved.program, saved.h_seq[t]
    sg = program.surrogate.derivative(h - saved.vth)
    dv_dh = _dv_dh(saved, h, sg)
    grad_v = _grad_v(saved, grads, t, later)
    grad_h = grads.spikes[t].to(h.dtype) * sg + grad_v * dv_dh
    args = saved.args(t)
    if not program.definition.adaptive:
        return _Step(args, grad_h, None)
    f = program.torch_functions
    grad_w = _grad_w(saved, grads, t, later)
    grad_h = grad_h + grad_w * (f["dz_dh"](*args) + f["jump"](*args) * sg)
    return _Step(args, grad_h, grad_w)


def _state_grads(
    saved: _Saved, first: _Step, v0_given: bool, w0_given: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """dL/dV[-1] and dL/dW[-1] [*] from step 0 (None for a state that started constant)."""
    f, cd = saved.program.torch_functions, saved.h_seq.dtype

    def state_grad(grad, like):  # partials may be constants: a full [*] tensor of cd
        return torch.as_tensor(grad, dtype=cd).expand_as(like).clone()

    grad_v0 = grad_w0 = None
    if v0_given:
        grad_v0 = state_grad(first.grad_h * f["dh_dv"](*first.args), saved.v_init)
    if w0_given and first.grad_w is not None:  # grad_w: set iff adaptive
        grad_w0 = first.grad_h * f["dh_dw"](*first.args) + first.grad_w * f["dz_dw"](*first.args)
        grad_w0 = state_grad(grad_w0, saved.w_init)
    return grad_v0, grad_w0


def bptt(
    program: NeuronProgram,
    grad_spikes: torch.Tensor,
    grad_v_seq: torch.Tensor | None,
    grad_v_last: torch.Tensor | None,
    grad_w_last: torch.Tensor | None,
    saved_v: torch.Tensor,
    saved_w: torch.Tensor | None,
    x_seq: torch.Tensor | None,
    v0: torch.Tensor | None,
    w0: torch.Tensor | None,
    learnable: torch.Tensor | None,
    constants: list[float],
    init: list[float],
) -> BPTTOut:
    """Backward through time, walking t = T-1 .. 0, from the saved H (and W).

    dL/dV[t] = ∂L/∂V[t] + dL/dH[t+1] ∂H[t+1]/∂V[t]
    dL/dW[t] = dL/dH[t+1] ∂H[t+1]/∂W[t] + dL/dW[t+1] ∂Z[t+1]/∂W[t]
    dL/dH[t] = ∂L/∂S[t] Θ' + dL/dV[t] dV[t]/dH[t] + dL/dW[t] (∂Z[t]/∂H[t] + jump Θ')
    dL/dX[t] = dL/dH[t] ∂H[t]/∂X[t]
    """
    f, h_seq = program.torch_functions, saved_v
    saved = _Saved(
        program=program,
        h_seq=h_seq,
        w_seq=saved_w,
        xs=x_seq.to(h_seq.dtype) if x_seq is not None and x_seq.numel() else None,
        v_init=_initial(v0, init[0], h_seq),
        w_init=_initial(w0, init[1], h_seq),
        params=tuple(program.param_values(learnable, constants, h_seq)),
        zero=h_seq.new_zeros(()),
    )
    grads = _OutputGrads(grad_spikes, grad_v_seq, grad_v_last, grad_w_last)
    grad_x = torch.empty_like(h_seq)
    grad_learn = [h_seq.new_zeros(()) for _ in program.learnable]
    step: _Step | None = None  # step t + 1: None before the first step back
    for t in range(h_seq.shape[0] - 1, -1, -1):
        step = _step_back(saved, grads, t, step)
        grad_x[t] = step.grad_h * f["dh_dx"](*step.args)
        for i, name in enumerate(program.learnable):
            grad_learn[i] = grad_learn[i] + (step.grad_h * f[f"dh_d{name}"](*step.args)).sum()
    if step is None:
        raise SpikefuseError("reference bptt: the sequence has no time steps (T = 0)")
    grad_v0, grad_w0 = _state_grads(saved, step, v0 is not None, w0 is not None)
    return BPTTOut(
        grad_x=grad_x.to(grad_spikes.dtype),
        grad_v0=grad_v0,
        grad_w0=grad_w0,
        grad_learnable=torch.stack(grad_learn).view(learnable.shape)
        if learnable is not None and grad_learn
        else None,
    )
