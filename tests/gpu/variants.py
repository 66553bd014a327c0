"""The kernel variants the GPU tests check, and the kernels each one launches.

A variant is one generated kernel: neuron × surrogate × storage dtype × reset × detach_reset,
plain or with the channel-affine (BatchNorm-folded) input. ``quick`` variants are the subset
``scripts/gpu_check.py --quick`` runs (LIF and Izhikevich, two surrogates).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from spikefuse import neuron, surrogate
from spikefuse.cuda.kernel_spec import AFFINE_CHUNK, CHUNK, VEC

__all__ = ["AFFINE_CHUNK", "CHUNK", "DTYPES", "NODES", "Variant", "params"]

NODES = {
    "IF": lambda **k: neuron.IFNode(**k),
    "LIF": lambda **k: neuron.LIFNode(tau=2.0, **k),
    "LIF(decay_input=False)": lambda **k: neuron.LIFNode(tau=3.0, decay_input=False, **k),
    "PLIF": lambda **k: neuron.ParametricLIFNode(init_tau=2.5, **k),
    "PLIF(decay_input=False)": lambda **k: neuron.ParametricLIFNode(decay_input=False, **k),
    "QIF": lambda **k: neuron.QIFNode(**k),
    "EIF": lambda **k: neuron.EIFNode(**k),
    # a = 1: the adaptation keeps soft-reset trajectories bounded over the checked steps (with
    # SpikingJelly's default a = 0 they reach inf, which tests float16's range, not the kernels)
    "Izhikevich": lambda **k: neuron.IzhikevichNode(a=1.0, b=0.2, **k),
}
ONE_STATE = tuple(name for name in NODES if name != "Izhikevich")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
QUICK_NODES = ("LIF", "Izhikevich")
QUICK_SURROGATES = (surrogate.Sigmoid, surrogate.Rect)


@dataclass(frozen=True)
class Variant:
    """One generated kernel (both directions) of a neuron configuration."""

    node: str  # a key of NODES
    surrogate: type[surrogate.Surrogate]
    dtype: torch.dtype
    hard: bool  # hard reset to 0, else soft reset
    detach: bool = False  # detach_reset
    affine: bool = False  # the channel-affine (BatchNorm-folded) kernels

    def make(self, **kwargs) -> neuron.BaseNode:
        """The neuron module of this variant (``kwargs``: step_mode, backend, ...)."""
        return NODES[self.node](
            surrogate_function=self.surrogate(),
            v_reset=0.0 if self.hard else None,
            detach_reset=self.detach,
            **kwargs,
        )

    @property
    def id(self) -> str:
        reset = "hard" if self.hard else "soft"
        parts = [self.node, self.surrogate.__name__, str(self.dtype)[6:], reset]
        return "-".join(parts + ["detach"] * self.detach)

    @property
    def quick(self) -> bool:
        return self.node in QUICK_NODES and self.surrogate in QUICK_SURROGATES

    def kernels(self) -> list:
        """The kernel modules it launches: scalar and vectorised (by the input's alignment)."""
        from spikefuse.cuda import backend as cuda_backend  # imports CuPy where it is used

        program = self.make().program
        return [cuda_backend.kernel_for(program, self.dtype, v, self.affine) for v in (1, VEC)]


def params(variants: list[Variant]) -> list:
    """``pytest.param`` per variant, named by it and marked ``quick`` where it is quick."""
    return [
        pytest.param(v, id=v.id, marks=[pytest.mark.quick] if v.quick else []) for v in variants
    ]
