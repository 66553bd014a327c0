"""Export to and import from the Neuromorphic Intermediate Representation (NIR).

:func:`export_nir` turns a spikefuse model into an ``nir.NIRGraph``; :func:`import_nir` turns an
``nir.NIRGraph`` (e.g. from snnTorch, Norse, Sinabs, Rockpool) into a spikefuse model that runs
multi-step (``[T, N, *]``) on every backend and can be passed to :func:`spikefuse.fuse`.

Time. NIR describes neurons by continuous-time equations; a step of a discrete simulator is
forward Euler with step ``dt``. NIR graphs do not store ``dt``: every simulator picks its own
(Norse's ``from_nir`` defaults to 1e-3, snnTorch fixes 1e-4), so both functions take it as a
required argument. With NIR's

    LIF:  tau dv/dt = (v_leak - v) + r I       ->  v[t] = v[t-1] + dt/tau (v_leak - v[t-1] + r I[t])
    IF:       dv/dt = r I                      ->  v[t] = v[t-1] + dt r I[t]
    fire: z = 1 if v > v_threshold; reset: v = v_reset where z = 1

spikefuse's discrete neurons (V_reset is the hard-reset potential)

    LIFNode(decay_input=True):  H = V + (X - (V - V_reset)) / tau
    LIFNode(decay_input=False): H = V - (V - V_reset) / tau + X
    IFNode:                     H = V + X

map one to one, in both directions, as

    =====================  ================  ==============  =========  ============  ==========
    spikefuse              NIR node          tau             r          v_leak        v_reset
    =====================  ================  ==============  =========  ============  ==========
    LIF, decay_input=True  ``nir.LIF``       tau * dt        1          V_reset       V_reset
    LIF, decay_input=False ``nir.LIF``       tau * dt        tau        V_reset       V_reset
    IF                     ``nir.IF``        --              1 / dt     --            V_reset
    LeakyIntegrator        ``nir.LI``        tau * dt        1 or tau   v_leak        --
    =====================  ================  ==============  =========  ============  ==========

and ``v_threshold`` = V_th. Import inverts this: tau = tau_NIR / dt (must be > 1), r = 1 gives
``decay_input=True``, r = tau gives ``decay_input=False`` (both up to float32 rounding of the
stored values), and v_leak must equal v_reset because spikefuse's LIF leaks towards its reset
potential. :class:`LeakyIntegrator` is NIR's non-spiking ``LI`` (a LIF that never fires,
outputting V). With ``dt`` a power of two (e.g. 1) a round trip returns bit-identical parameters.
NIR stores parameters per neuron; spikefuse neurons have one value per layer, so import needs
them uniform. Differences that are not mapped:

* soft reset (``v_reset=None``, V -= V_th): NIR resets to v_reset only, so export refuses it;
* spikes: spikefuse fires at H >= V_th (SpikingJelly's Heaviside), NIR at v > v_threshold; they
  differ only when the potential equals the threshold exactly;
* the initial potential is not part of NIR; spikefuse starts at V_reset (Norse at v_leak,
  snnTorch at 0: the same whenever v_leak = v_reset = 0);
* surrogate gradients and ``detach_reset`` shape only training; they are not exported, and
  import takes them as arguments (default: ``surrogate.Sigmoid()``, ``detach_reset=False``);
* ``ParametricLIFNode`` exports its current tau = 1/sigmoid(w) and imports as a fixed LIFNode.

Other simulators read NIR their own way (checked in ``tests/test_nir.py``): snnTorch's import
fixes dt = 1e-4, maps r dt / tau = 1 to ``Leaky(beta = 1 - dt / tau)`` and resets to zero, which
is ``decay_input=False`` with ``v_reset=0``; Norse's ``from_nir`` ignores r and v_reset, adds
an IF's input unscaled and its export writes tau = dt / tau_mem_inv, so models move to and from
Norse with dt = 1, ``decay_input=True`` and ``v_reset=0``. Imported layers keep the dtype of the
graph's arrays (float64 arrays give float64 layers; ``model.float()`` converts).

Other nodes: Linear/Conv1d/Conv2d are ``nir.Affine``/``nir.Linear``/``nir.Conv1d``/
``nir.Conv2d`` (an eval-mode BatchNorm right after one, also inside a fused block, is folded into
its weight and bias: W' = W gamma / sqrt(var + eps), b' = (b - mean) gamma / sqrt(var + eps) +
beta); ``Flatten`` is ``nir.Flatten`` (NIR counts dimensions without the batch); ``AvgPool2d`` is
``nir.AvgPool2d`` and ``AvgPool2d(divisor_override=1)`` is ``nir.SumPool2d``; :class:`Scale` is
``nir.Scale``. A node with several incoming edges receives their sum. Import refuses with
:class:`NIRConversionError`, naming the node, what has no spikefuse equivalent: ``I``,
``CubaLI``, ``CubaLIF`` (two-state, current-based), ``Threshold`` (stateless), ``Delay``, nested
graphs, recurrent edges (spikefuse neurons run a whole sequence per call) and non-uniform neuron
parameters. Export refuses QIF/EIF/Izhikevich and custom neurons, soft reset, MaxPool, training-
mode BatchNorm and any module it does not know.

Input is checked as possibly hostile (:mod:`spikefuse.interop.nir_input`): import follows the
per-sample shapes along every edge itself (nir's type check may be off) and refuses a node that
cannot take its input or inputs that would broadcast; node names that are attributes of torch's
containers get the prefix ``node_``; :func:`read_nir` reads a file only after checking its size,
signature and declared dataset sizes; export refuses per-sample shapes whose per-neuron arrays
would exceed ``MAX_SAMPLE_ELEMENTS`` elements.
"""

from __future__ import annotations

try:
    import nir  # noqa: F401  (here, before the submodules that use it)
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "spikefuse.interop.nir needs the 'nir' package: pip install 'spikefuse[nir]'"
    ) from exc

from ...errors import NIRConversionError
from ..nir_input import read_nir
from .export import export_nir
from .import_graph import import_nir
from .modules import LeakyIntegrator, NIRGraphModule, Scale

__all__ = [
    "LeakyIntegrator",
    "NIRConversionError",
    "NIRGraphModule",
    "Scale",
    "export_nir",
    "import_nir",
    "read_nir",
]
