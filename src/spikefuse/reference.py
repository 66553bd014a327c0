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
    f, d = program.torch_functions, program.definition
    h_seq = saved_v
    cd = h_seq.dtype
    params = program.param_values(learnable, constants, h_seq)
    vth, vreset = params[0], params[1]
    not_detached = 0.0 if program.detach_reset else 1.0
    zero = h_seq.new_zeros(())
    T = h_seq.shape[0]
    xs = x_seq.to(cd) if x_seq is not None and x_seq.numel() else None
    v_init, w_init = _initial(v0, init[0], h_seq), _initial(w0, init[1], h_seq)

    def x_at(t):
        return xs[t] if xs is not None else zero

    def w_at(t):  # W[t] (t = -1: initial state); only derivatives that need W read it
        return (saved_w[t] if t >= 0 else w_init) if saved_w is not None else zero

    def v_at(t):
        if t < 0:
            return v_init
        h = h_seq[t]
        return _reset(program, h, _fire(h, vth), vth, vreset)

    grad_x = torch.empty_like(h_seq)
    grad_learn = [h_seq.new_zeros(()) for _ in program.learnable]
    # dL/dH[t+1] and dL/dW[t+1]: None before the first step back
    grad_h_next: torch.Tensor | None = None
    grad_w_next: torch.Tensor | None = None
    for t in range(T - 1, -1, -1):
        h, v, v_prev = h_seq[t], v_at(t), v_at(t - 1)
        s = _fire(h, vth)
        sg = program.surrogate.derivative(h - vth)
        if program.hard_reset:
            dv_dh = (1 - s) + (vreset - h) * sg * not_detached
        else:
            dv_dh = 1 - vth * sg * not_detached

        grad_v = torch.zeros_like(h)
        if grad_v_seq is not None:
            grad_v = grad_v + grad_v_seq[t].to(cd)
        if t == T - 1 and grad_v_last is not None:
            grad_v = grad_v + grad_v_last.to(cd)
        if grad_h_next is not None:  # H[t+1] = f(V[t], X[t+1], W[t])
            args_next = (v, x_at(t + 1), w_at(t), h_seq[t + 1], *params)
            grad_v = grad_v + grad_h_next * f["dh_dv"](*args_next)
        grad_h = grad_spikes[t].to(cd) * sg + grad_v * dv_dh
        args = (v_prev, x_at(t), w_at(t - 1), h, *params)  # H[t] = f(V[t-1], X[t], W[t-1])

        if d.adaptive:
            grad_w = torch.zeros_like(h)
            if t == T - 1 and grad_w_last is not None:
                grad_w = grad_w + grad_w_last.to(cd)
            if grad_h_next is not None and grad_w_next is not None:  # both set at t + 1
                grad_w = grad_w + grad_h_next * f["dh_dw"](*args_next)
                grad_w = grad_w + grad_w_next * f["dz_dw"](*args_next)
            grad_h = grad_h + grad_w * (f["dz_dh"](*args) + f["jump"](*args) * sg)
            grad_w_next = grad_w

        grad_x[t] = grad_h * f["dh_dx"](*args)
        for i, name in enumerate(program.learnable):
            grad_learn[i] = grad_learn[i] + (grad_h * f[f"dh_d{name}"](*args)).sum()
        grad_h_next = grad_h

    if grad_h_next is None:
        raise SpikefuseError("reference bptt: the sequence has no time steps (T = 0)")
    args0 = (v_init, x_at(0), w_at(-1), h_seq[0], *params)

    def state_grad(grad, like):  # partials may be constants: a full [*] tensor of cd
        return torch.as_tensor(grad, dtype=cd).expand_as(like).clone()

    grad_v0 = grad_w0 = None
    if v0 is not None:
        grad_v0 = state_grad(grad_h_next * f["dh_dv"](*args0), v_init)
    if w0 is not None and grad_w_next is not None:  # grad_w_next: set iff adaptive
        grad_w0 = grad_h_next * f["dh_dw"](*args0) + grad_w_next * f["dz_dw"](*args0)
        grad_w0 = state_grad(grad_w0, w_init)
    return BPTTOut(
        grad_x=grad_x.to(grad_spikes.dtype),
        grad_v0=grad_v0,
        grad_w0=grad_w0,
        grad_learnable=torch.stack(grad_learn).view(learnable.shape)
        if learnable is not None and grad_learn
        else None,
    )
