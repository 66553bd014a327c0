"""The test oracle: an independent plain-autograd step loop, to check the backends' hand-written
backward (``bptt``) and the module path against.

Gradients come from autograd through the charge function and the surrogate; nothing here shares
code with :func:`spikefuse.reference.bptt` beyond the lambdified charge and surrogate derivative.
"""

from __future__ import annotations

import torch

from spikefuse.program import NeuronProgram


def oracle(
    program: NeuronProgram,
    x_seq: torch.Tensor,
    v0: torch.Tensor,
    w0: torch.Tensor,
    learnable: torch.Tensor,
    constants: list[float],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Spikes [T, *], v_seq [T, *], v_last [*], w_last [*] of ``program`` run on ``x_seq``
    from states ``v0``/``w0``, differentiable by plain autograd."""
    f, d = program.torch_functions, program.definition
    params = program.param_values(learnable, constants, x_seq)
    vth, vreset = params[0], params[1]
    v, w = v0, w0
    zero = x_seq.new_zeros(())
    spikes, vs = [], []
    for t in range(x_seq.shape[0]):
        h = f["charge"](v, x_seq[t], w, zero, *params)
        s = program.surrogate(h - vth)
        s_reset = s.detach() if program.detach_reset else s
        if d.adaptive:
            w = (
                f["adaptation"](v, x_seq[t], w, h, *params)
                + f["jump"](v, x_seq[t], w, h, *params) * s
            )
        v = h * (1 - s_reset) + vreset * s_reset if program.hard_reset else h - vth * s_reset
        spikes.append(s)
        vs.append(v)
    return torch.stack(spikes), torch.stack(vs), v, w
