"""The neuron backend contract: what every backend provides, the registry, and the 'auto' rule.

A backend runs a neuron program through time, forward (``fptt``) and backward (``bptt``), on
``x_seq`` [T, *]; :mod:`spikefuse.ops` wraps it into custom ops and autograd. Backends are
registered here by name and imported lazily (the cuda backend imports CuPy only when it runs).
Result types and the dtype policy shared by all backends live here, so that no backend imports
another.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol, cast

import torch

from .cuda import unavailable_reason as cuda_unavailable_reason  # cheap: never imports CuPy
from .errors import BackendUnavailableError, SpikefuseError

if TYPE_CHECKING:
    from .program import NeuronProgram

#: Names a neuron's ``backend=`` accepts ('cupy' is an alias of 'cuda').
BACKEND_NAMES = ("auto", "torch", "cuda", "cupy")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Arithmetic dtype for a storage dtype: float64 stays, everything else computes in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def repeats_one_step(t: torch.Tensor) -> bool:
    """Whether ``t`` [T, ...] (T > 1) views one step at every step (stride 0 over T, as
    ``expand`` gives): an input image, or its synapse output, repeated over time."""
    return t.shape[0] > 1 and t.stride(0) == 0


def dense_in_order(shape: tuple[int, ...], stride: tuple[int, ...], order: tuple[int, ...]) -> bool:
    """Whether a tensor of this geometry permuted to ``order`` (outermost dimension first) is
    contiguous, as ``is_contiguous`` decides it (an empty tensor is), read from the geometry
    alone: no tensor op."""
    if 0 in shape:
        return True
    expected = 1
    for dim in reversed(order):
        if shape[dim] != 1 and stride[dim] != expected:
            return False
        expected *= shape[dim]
    return True


@functools.lru_cache(maxsize=1024)
def channels_innermost(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether a [T, B, C, *S] tensor of this geometry is dense with channels innermost in
    memory (the [T, B, C, H, W] view of a channels-last convolution output; a contiguous [T, B,
    C]), i.e. whether its permutation [T, B, *S, C] is contiguous. Once per geometry (the
    launch paths ask on every call)."""
    return dense_in_order(shape, stride, (0, 1, *range(3, len(shape)), 2))


def as_channels_innermost(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t [T, B, C, *S] in ``dtype``, dense with channels innermost (:func:`channels_innermost`):
    t itself where it is that already, else one copy."""
    if t.dtype == dtype and channels_innermost(t.shape, t.stride()):
        return t
    order = (0, 1, *range(3, t.dim()), 2)
    inverse = sorted(range(t.dim()), key=order.__getitem__)
    permuted = t.permute(order)
    dense = (  # one copy either way (.to with the same dtype would return the view itself)
        permuted.contiguous()
        if t.dtype == dtype
        else permuted.to(dtype, memory_format=torch.contiguous_format)
    )
    return dense.permute(inverse)


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
    grad_learnable: torch.Tensor | None  # learnable's shape, compute dtype; None without any


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
        saved_v: torch.Tensor | None,
        saved_w: torch.Tensor | None,
        x_seq: torch.Tensor | None,
        v0: torch.Tensor | None,
        w0: torch.Tensor | None,
        learnable: torch.Tensor | None,
        constants: list[float],
        init: list[float],
    ) -> BPTTOut: ...


class AffineKernels(Protocol):
    """Neuron kernels with a per-channel affine map (a folded BatchNorm) applied to their input,
    used by the fused Conv/Linear -> BatchNorm -> neuron blocks (:mod:`spikefuse.fused`)."""

    def affine_fptt(
        self,
        program: NeuronProgram,
        y: torch.Tensor,
        mean: torch.Tensor,
        invstd: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        learnable: torch.Tensor | None,
        constants: list[float],
        v_init: float,
        save_for_backward: bool,
        pool: int = 1,
        residual: torch.Tensor | None = None,
        pack_spikes: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(spikes, chunk checkpoints or None, packed spikes or None) of neuron(y * scale[c] +
        shift[c] [+ residual]); ``pool`` = k > 1: the spikes averaged over k x k windows
        instead (channels-last maps); ``residual``: y's shape and dtype, unpooled;
        ``pack_spikes``: also the pooled means' packing (:class:`spikefuse.fused.spike_bits.
        PackedSpikes`' bits, the k² spikes of each), where the kernels write it."""
        ...

    def can_pool(self, y: torch.Tensor, pool: int) -> bool:
        """Whether ``affine_fptt``/``affine_bptt`` can pool y's spikes over ``pool`` x ``pool``
        windows themselves (``pool`` > 1)."""
        ...

    def affine_saved_like(
        self, program: NeuronProgram, y: torch.Tensor, save: bool
    ) -> torch.Tensor | None:
        """An uninitialised tensor like the checkpoints :meth:`affine_fptt` returns (None
        where it returns None): what a compiled block's fake forward promises."""
        ...

    def laid_out_grad_spikes(
        self,
        program: NeuronProgram,
        y: torch.Tensor,
        grad_spikes: torch.Tensor,
        pool: int = 1,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """dL/dS as ``affine_bptt`` with these arguments reads it (itself where it is laid out
        so, else one copy): called once before the two passes, each of which would copy it."""
        ...

    def affine_bptt(
        self,
        program: NeuronProgram,
        y: torch.Tensor,
        grad_spikes: torch.Tensor,
        saved_v: torch.Tensor | None,
        learnable: torch.Tensor | None,
        constants: list[float],
        v_init: float,
        mean: torch.Tensor,
        invstd: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        totals: torch.Tensor | None = None,
        inv_count: float = 0.0,
        *,
        grad_y: bool,
        pool: int = 1,
        residual: torch.Tensor | None = None,
        overwrite_y: bool = False,
        keep_grad_input: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """Pass 1 (``grad_y=False``): (None, per-channel sums [2, C], dL/dlearnable or None),
        with ``keep_grad_input`` (where :meth:`keeps_input_grad`) g = dL/dX in y's dtype first
        instead of None; pass 2: (dL/dy, dL/dresidual or None, None). ``pool``, ``residual``:
        as the forward's (grad_spikes then pooled). ``overwrite_y``: pass 2 may write dL/dy
        over y's memory (y is then lost; a caller whose y is a temporary saves a buffer)."""
        ...

    def keeps_input_grad(self, y: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
        """Whether pass 1 on y (with this residual) can keep g = dL/dX, from which
        :meth:`affine_input_grad` gives dL/dy in place of pass 2 (where that is faster)."""
        ...

    def affine_input_grad(
        self,
        grad_input: torch.Tensor,
        y: torch.Tensor,
        mean: torch.Tensor,
        invstd: torch.Tensor,
        weight: torch.Tensor | None,
        totals: torch.Tensor | None,
        inv_count: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Pass 2's dL/dy from the g that pass 1 kept, element by element: scale g, plus the
        batch statistics' terms from ``totals`` (as pass 2's); written to ``out`` (which may
        be g or y's memory) or a new tensor."""
        ...


@dataclass(frozen=True)
class _Registered:
    """A registered backend: where it lives and how to ask whether it can run."""

    module: str  # implements NeuronBackend; imported on first use
    # Why the backend cannot run on x, or None; None here: it runs on every device and dtype.
    # Cheap (never imports the backend module or CuPy) and traceable by torch.compile: every
    # neuron call asks. A function of x's device type and dtype only (:func:`capability`
    # caches its answers by them).
    unavailable_reason: Callable[[torch.Tensor], str | None] | None
    affine_module: str | None = None  # implements AffineKernels (None: the backend has none)
    # Further kernels the fused blocks use where the backend runs x, by capability name
    # (:data:`CAPABILITIES`): the module implementing it, imported on first use.
    capabilities: tuple[tuple[str, str], ...] = ()


_REGISTRY: dict[str, _Registered] = {
    "torch": _Registered("spikefuse.reference", unavailable_reason=None),
    "cuda": _Registered(
        "spikefuse.cuda.backend",
        cuda_unavailable_reason,
        "spikefuse.cuda.affine",
        (
            ("spike_bits", "spikefuse.cuda.spike_bits"),
            ("channel_stats", "spikefuse.cuda.channel_stats"),
            ("bf16_split", "spikefuse.cuda.bf16_split"),
            ("max_pool", "spikefuse.cuda.spike_max_pool"),
            ("heads_chain", "spikefuse.cuda.spike_attention"),
        ),
    ),
}
_ALIASES = {"cupy": "cuda"}
_RUNS_ANYWHERE = frozenset(n for n, entry in _REGISTRY.items() if entry.unavailable_reason is None)


def canonical_name(name: str) -> str:
    """'cupy' -> 'cuda'; other names unchanged."""
    return _ALIASES.get(name, name)


def _registered(name: str) -> _Registered:
    try:
        return _REGISTRY[canonical_name(name)]
    except KeyError:
        raise SpikefuseError(
            f"unknown backend {name!r}; registered: {sorted(_REGISTRY)} ('auto' is resolved to "
            "one of them by resolve())"
        ) from None


@functools.cache  # the ops look their backend up on every call
def get_backend(name: str) -> NeuronBackend:
    """The registered backend module called ``name`` ('torch', 'cuda' or an alias)."""
    return cast("NeuronBackend", importlib.import_module(_registered(name).module))


@functools.cache  # looked up once per fused block call
def affine_kernels(name: str) -> AffineKernels | None:
    """Backend ``name``'s channel-affine kernels, or None if it has none (the fused blocks then
    apply BatchNorm with torch ops and call the plain neuron)."""
    module = _registered(name).affine_module
    return None if module is None else cast("AffineKernels", importlib.import_module(module))


#: The kernels a backend may offer the fused blocks besides its neuron kernels, by name, and the
#: Protocol the implementing module satisfies: ``spike_bits`` (:class:`SpikePacking`: 1-bit
#: packing of spikes), ``channel_stats`` (:class:`ChannelStatsKernels`: BatchNorm's
#: per-channel statistics), ``bf16_split`` (:class:`SplitKernels`: the split matmul's terms),
#: ``max_pool`` (:class:`MaxPoolKernels`: max pooling keeping a byte per window),
#: ``heads_chain`` (:class:`HeadsChainKernels`: Spikformer's attention product per head).
CAPABILITIES = ("spike_bits", "channel_stats", "bf16_split", "max_pool", "heads_chain")


class SpikePacking(Protocol):
    """Pack 0/1 values at 1 bit each (the layout of :func:`packed_bytes`) and unpack them."""

    def pack(self, flat: torch.Tensor) -> torch.Tensor: ...

    def unpack(self, packed: torch.Tensor, out: torch.Tensor, window: int = 1) -> torch.Tensor: ...


class ChannelStatsKernels(Protocol):
    """Per-channel (mean, invstd) of a [rows, C] matrix, updating running statistics."""

    def channel_stats(
        self, rows: torch.Tensor, eps: float, running: tuple | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class SplitKernels(Protocol):
    """float32 → three bf16 terms (hi, mid, lo), and loading that kernel ahead of capture."""

    def split(self, values: torch.Tensor) -> torch.Tensor: ...

    def load(self, device: torch.device) -> None: ...


class MaxPoolKernels(Protocol):
    """2-D max pooling of [N, C, H, W] (any strides) into a dense ``out`` [N, C, OH, OW]
    (NCHW or channels-last), writing each window's argmax code (uint8, out's layout; None:
    not kept), and its backward from those codes into a dense ``grad_x`` (see
    :mod:`spikefuse.fused.ops.spike_max_pool`). ``window``: (k_h, k_w, stride_h, stride_w,
    pad_h, pad_w, dilation_h, dilation_w). ``flip``: float32 [C], the channels where it is
    negative take their windows' minimum (None: none); ``terms``: (x, coef_x, coef_0), adding
    ``coef_x[c] x + coef_0[c]`` (float32 [C]) to every element of dL/dx (None: nothing)."""

    def max_pool_forward(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        codes: torch.Tensor | None,
        window: tuple[int, ...],
        flip: torch.Tensor | None = None,
    ) -> None: ...

    def max_pool_backward(
        self,
        grad: torch.Tensor,
        codes: torch.Tensor,
        grad_x: torch.Tensor,
        window: tuple[int, ...],
        terms: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> None: ...


class HeadsChainKernels(Protocol):
    """``scale (V Kᵀ) Q`` of the heads [D, L] of qkv spikes [R, 3C, L] into out [R, C, L], and
    dL/dqkv from dL/dout and the spikes kept as ``torch.bool`` (see
    :mod:`spikefuse.spike_matmul`); any strides. :func:`unsupported` names heads they cannot
    run (None: they can)."""

    def unsupported(self, head_dim: int, tokens: int) -> str | None: ...

    def heads_chain_forward(
        self, qkv: torch.Tensor, out: torch.Tensor, heads: int, scale: float
    ) -> None: ...

    def heads_chain_backward(
        self,
        grad: torch.Tensor,
        spikes: torch.Tensor,
        grad_qkv: torch.Tensor,
        heads: int,
        scale: float,
    ) -> None: ...


@functools.cache
def _capability_providers(capability: str) -> tuple[tuple[str, str], ...]:
    """(backend name, module) of every registered backend offering ``capability``."""
    if capability not in CAPABILITIES:
        raise SpikefuseError(f"unknown capability {capability!r}; known: {CAPABILITIES}")
    return tuple(
        (name, module)
        for name, entry in _REGISTRY.items()
        for offered, module in entry.capabilities
        if offered == capability
    )


# (capability, device type, dtype) -> what :func:`capability` answers for such a tensor: the
# fused blocks ask on every call, and the answer depends on these alone (see _Registered).
_CAPABLE: dict[tuple[str, str, torch.dtype], object | None] = {}
_UNKNOWN = object()


def capability(capability: str, x: torch.Tensor) -> object | None:
    """The module of a backend that offers ``capability`` (:data:`CAPABILITIES`) and runs
    ``x``, or None (the caller then uses torch ops). Never imports CuPy; the module is
    imported on first use, and the answer is kept per device type and dtype of ``x``."""
    key = (capability, x.device.type, x.dtype)
    found = _CAPABLE.get(key, _UNKNOWN)
    if found is _UNKNOWN:
        found = _CAPABLE[key] = _find_capability(capability, x)
    return found


def _find_capability(capability: str, x: torch.Tensor) -> object | None:
    for name, module in _capability_providers(capability):
        if unavailable_reason(name, x) is None:
            return importlib.import_module(module)
    return None


def packed_words(n: int, window: int = 1) -> int:
    """32-bit words that pack ``n`` values of ``window`` bits each (the spike packing layout
    every backend's ``spike_bits`` kernels and the torch composites share)."""
    return -(-n * window // 32)


def packed_bytes(n: int, window: int = 1) -> int:
    """Bytes of the packing of ``n`` values: the words, then a NaN flag byte per word."""
    return 5 * packed_words(n, window)


def flags_at(n: int, window: int = 1) -> int:
    """Where the flag bytes of the packing of ``n`` values start."""
    return 4 * packed_words(n, window)


def unavailable_reason(name: str, x: torch.Tensor) -> str | None:
    """Why backend ``name`` ('torch', 'cuda' or an alias) cannot run on ``x``, or None. Never
    imports CuPy."""
    check = _registered(name).unavailable_reason
    return None if check is None else check(x)


def resolve(requested: str, x: torch.Tensor, who: str = "") -> str:
    """The backend that runs ``x`` for a ``backend=requested`` setting.

    'auto' picks 'cuda' where it can run and 'torch' otherwise; an explicit backend that cannot
    run raises :class:`BackendUnavailableError` naming why (no silent fallback). Called on every
    neuron call (and traced by torch.compile): dictionary lookups and the availability check.
    """
    if requested in _RUNS_ANYWHERE:
        return requested
    if requested == "auto":
        return "cuda" if cuda_unavailable_reason(x) is None else "torch"
    name = canonical_name(requested)
    reason = unavailable_reason(name, x)
    if reason is not None:
        raise BackendUnavailableError(f"{who + ': ' if who else ''}backend {name!r}: {reason}")
    return name
