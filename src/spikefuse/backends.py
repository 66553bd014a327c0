"""The neuron backend contract: what every backend provides, the registry, and the 'auto' rule.

A backend runs a neuron program through time, forward (``fptt``) and backward (``bptt``), on
``x_seq`` [T, *]; :mod:`spikefuse.ops` wraps it into custom ops and autograd. Backends are
registered here by name and imported lazily (the cuda backend imports CuPy only when it runs).
Result types and the dtype policy shared by all backends live here, so that no backend imports
another.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, NamedTuple, Protocol, cast

import torch

from .errors import BackendUnavailableError

if TYPE_CHECKING:
    from .program import NeuronProgram

#: Names a neuron's ``backend=`` accepts ('cupy' is an alias of 'cuda').
BACKEND_NAMES = ("auto", "torch", "cuda", "cupy")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Arithmetic dtype for a storage dtype: float64 stays, everything else computes in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class FPTTOut(NamedTuple):
    spikes: torch.Tensor  # [T, *], x dtype
    v_seq: torch.Tensor | None  # [T, *], x dtype; None unless store_v_seq
    v_last: torch.Tensor  # [*], compute dtype
    w_last: torch.Tensor | None  # [*], compute dtype; None for one-state neurons
    # What the backend keeps for its backward (None when not saving): the reference backend
    # keeps H[t] and, when a derivative needs it, W[t]; the cuda backend V and W at chunk ends.
    saved_v: torch.Tensor | None
    saved_w: torch.Tensor | None


class BPTTOut(NamedTuple):
    grad_x: torch.Tensor  # [T, *], dtype of the spikes' gradient
    grad_v0: torch.Tensor | None  # [*]; None when V started from a constant
    grad_w0: torch.Tensor | None  # [*]; None when W started from a constant or does not exist
    grad_learnable: torch.Tensor | None  # [P] compute dtype; None without learnable parameters


class NeuronBackend(Protocol):
    """What a neuron backend module provides (a module satisfies it by its attributes)."""

    #: True when forward keeps a [T, N] sequence for backward (as large as x), False when it
    #: keeps only small checkpoints.
    SAVES_SEQUENCE: bool

    def unavailable_reason(self, x: torch.Tensor) -> str | None:
        """Why this backend cannot run on ``x`` (device, dtype, missing package), or None."""
        ...

    def keeps_x(self, program: NeuronProgram) -> bool:
        """Whether ``bptt`` needs ``x_seq``."""
        ...

    def saved_like(
        self, program: NeuronProgram, x_seq: torch.Tensor, save: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Uninitialised tensors shaped like ``FPTTOut.saved_v`` / ``saved_w``."""
        ...

    def fptt(
        self,
        program: NeuronProgram,
        x_seq: torch.Tensor,
        v0: torch.Tensor | None,
        w0: torch.Tensor | None,
        learnable: torch.Tensor | None,
        constants: list[float],
        init: list[float],
        save_for_backward: bool,
        store_v_seq: bool,
    ) -> FPTTOut: ...

    def bptt(
        self,
        program: NeuronProgram,
        grad_spikes: torch.Tensor,
        grad_v_seq: torch.Tensor | None,
        grad_v_last: torch.Tensor | None,
        grad_w_last: torch.Tensor | None,
        x_seq: torch.Tensor | None,
        saved_v: torch.Tensor | None,
        saved_w: torch.Tensor | None,
        v0: torch.Tensor | None,
        w0: torch.Tensor | None,
        learnable: torch.Tensor | None,
        constants: list[float],
        init: list[float],
    ) -> BPTTOut: ...


class AffineKernels(Protocol):
    """Neuron kernels with a per-channel affine map (a folded BatchNorm) applied to their input,
    used by the fused Conv/Linear -> BatchNorm -> neuron blocks (:mod:`spikefuse.fused`)."""

    def affine_fptt(self, *args: object, **kwargs: object) -> object: ...

    def affine_bptt(self, *args: object, **kwargs: object) -> object: ...


# name -> module implementing NeuronBackend; imported on first use.
_REGISTRY: dict[str, str] = {
    "torch": "spikefuse.reference",
    "cuda": "spikefuse.cuda.backend",
}
# name -> module implementing AffineKernels, for the backends that have them.
_AFFINE_REGISTRY: dict[str, str] = {"cuda": "spikefuse.cuda.affine"}
_ALIASES = {"cupy": "cuda"}


def canonical_name(name: str) -> str:
    """'cupy' -> 'cuda'; other names unchanged."""
    return _ALIASES.get(name, name)


def get_backend(name: str) -> NeuronBackend:
    """The registered backend module called ``name`` ('torch', 'cuda' or an alias)."""
    name = canonical_name(name)
    if name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; registered: {sorted(_REGISTRY)}")
    return cast("NeuronBackend", importlib.import_module(_REGISTRY[name]))


def affine_kernels(name: str) -> AffineKernels | None:
    """Backend ``name``'s channel-affine kernels, or None if it has none (the fused blocks then
    apply BatchNorm with torch ops and call the plain neuron)."""
    module = _AFFINE_REGISTRY.get(canonical_name(name))
    return None if module is None else cast("AffineKernels", importlib.import_module(module))


def unavailable_reason(name: str, x: torch.Tensor) -> str | None:
    """Why backend ``name`` cannot run on ``x``, or None. Never imports CuPy."""
    if canonical_name(name) == "cuda":
        from .cuda import unavailable_reason as cuda_reason  # cheap: does not import CuPy

        return cuda_reason(x)
    return None


def resolve(requested: str, x: torch.Tensor, who: str = "") -> str:
    """The backend that runs ``x`` for a ``backend=requested`` setting.

    'auto' picks 'cuda' where it can run and 'torch' otherwise; an explicit backend that cannot
    run raises :class:`BackendUnavailableError` naming why (no silent fallback).
    """
    requested = canonical_name(requested)
    if requested == "auto":
        return "cuda" if unavailable_reason("cuda", x) is None else "torch"
    reason = unavailable_reason(requested, x)
    if reason is not None:
        raise BackendUnavailableError(f"{who + ': ' if who else ''}backend {requested!r}: {reason}")
    return requested
