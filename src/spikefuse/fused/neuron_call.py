"""The fused blocks' view of a neuron: one call through the backend, from the reset state."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from torch import Tensor

from ..backends import AffineKernels, FPTTOut, NeuronBackend, affine_kernels, get_backend
from ..errors import SpikefuseError
from ..neuron import BaseNode
from ..ops import _bptt
from ..program import NeuronProgram
from .spike_bits import memory_order

#: What :meth:`NeuronCall.forward` keeps for backward: ``(checkpoints,)`` (the tensor may be
#: None: where T fits one chunk the cuda backend needs nothing), or None when nothing was kept.
Kept = tuple[Tensor | None] | None


@dataclass(frozen=True, eq=False)
class NeuronCall:
    """What the neuron ops need from a node, fixed for one forward/backward pair.

    Every call starts from the node's reset state (``v = v_reset``, or 0 for soft reset).
    """

    program: NeuronProgram
    backend: str  # resolved: 'torch' or 'cuda'
    constants: list[float]
    v_init: float
    # (node's backend setting, input device, input dtype) ``backend`` was resolved for: what
    # resolution reads (CuPy's availability is fixed per process), so a call with the same
    # key reuses it without resolving again
    resolved_for: tuple[object, ...] = ()

    # Looked up on first use, once per call (both lookups are cached; the registry imports
    # modules, which dynamo cannot trace, so ``torch.compile`` traces only the fields above).
    @functools.cached_property
    def kernels(self) -> NeuronBackend:
        """The backend's neuron kernels (``fptt``/``bptt``)."""
        return get_backend(self.backend)

    @functools.cached_property
    def affine(self) -> AffineKernels | None:
        """The backend's channel-affine kernels (BatchNorm folded into the neuron: the cuda
        backend), or None (BatchNorm then runs as torch ops before the plain neuron)."""
        return affine_kernels(self.backend)

    def __getstate__(self) -> dict[str, object]:
        """Pickles and deep-copies without the looked-up backends (modules; looked up again)
        and without ``resolved_for`` (another process may lack CuPy: the copy's next call
        resolves the backend again)."""
        state = self.__dict__.copy()
        state.pop("kernels", None)
        state.pop("affine", None)
        state.pop("resolved_for", None)
        return state

    @classmethod
    def from_node(cls, node: BaseNode, x: Tensor, previous: NeuronCall | None = None) -> NeuronCall:
        """The call for ``node`` on input ``x``; ``previous`` (the block's last call) is reused
        while the node's program, backend setting, constants and initial V and x's device and
        dtype are unchanged: a block's call then costs no new object, no backend resolution
        and no repeated backend lookups."""
        if node.store_v_seq:  # set since the block was made: it would be ignored
            raise SpikefuseError(
                f"a fused block keeps no V, but its {type(node).__name__} now has "
                "store_v_seq=True: set it back to False, or record V with the unfused model"
            )
        v_init = float(node.memory_default("v"))  # where reset() puts the unfused node's V
        resolved_for = (node.backend, x.device, x.dtype)
        if (
            previous is not None
            and previous.resolved_for == resolved_for
            and previous.program is node.program
            and previous.constants == node._constants
            and previous.v_init == v_init
        ):
            return previous
        backend = node.resolve_backend(x)
        program = node.program
        if not isinstance(program, NeuronProgram):  # e.g. a torch-code surrogate set since
            raise SpikefuseError(
                f"fused blocks run neurons in kernels; {type(node).__name__} runs torch code "
                f"({node.torch_code}): give it a spikefuse Surrogate in spiking mode"
            )
        if program.definition.adaptive:
            raise SpikefuseError(
                f"fused blocks support one-state neurons only; {type(node).__name__} has two states"
            )
        # the node validates its constants on assignment and caches them
        constants = list(node._constants or node.constants())
        return cls(program, backend, constants, v_init, resolved_for)

    def forward(self, x: Tensor, learnable: Tensor | None, save: bool) -> tuple[Tensor, Kept]:
        """Spikes [T, *] in x's dtype and memory layout, and what backward can reuse (None:
        nothing was kept).

        With ``save``, what the backend's forward saves is kept if it is small (the cuda
        backend's chunk checkpoints: one step per chunk of x's); a saved [T, N] sequence (the
        reference backend's H) would be as large as x, so it is recomputed in backward instead.
        """
        keep = save and not self.kernels.SAVES_SEQUENCE
        order = _kernel_order(x)
        out = self._fptt(x.permute(order), learnable, keep)
        return _unpermuted(out.spikes, order), ((out.saved_v,) if keep else None)

    def input_grad(
        self, x: Tensor, learnable: Tensor | None, grad_spikes: Tensor, saved: Kept
    ) -> tuple[Tensor, Tensor | None]:
        """BPTT from x: dL/dx [T, *] and dL/d(learnable), shaped like it (None without learnable
        params).

        ``saved`` is what :meth:`forward` kept; when None, the neuron's forward is recomputed
        first to get what the backend's BPTT needs. dL/dx has x's memory layout.
        """
        order = _kernel_order(x)
        x = x.permute(order)
        if saved is None:
            saved = (self._fptt(x, learnable, True).saved_v,)
        grad_x, _, _, grad_learnable = _bptt(
            program=self.program,
            backend=self.backend,
            grad_spikes=grad_spikes.permute(order).to(x.dtype),
            grad_v_seq=None,
            grad_v_last=None,
            grad_w_last=None,
            saved_v=saved[0],
            saved_w=None,
            x_seq=x if self.kernels.keeps_x(self.program) else None,
            v0=None,
            w0=None,
            learnable=learnable,
            constants=self.constants,
            init=[self.v_init, 0.0],
        )
        return _unpermuted(grad_x, order), grad_learnable

    def _fptt(self, x: Tensor, learnable: Tensor | None, save: bool) -> FPTTOut:
        """The backend's forward from the reset state, without V's sequence."""
        return self.kernels.fptt(
            program=self.program,
            x_seq=x,
            v0=None,
            w0=None,
            learnable=learnable,
            constants=self.constants,
            init=[self.v_init, 0.0],
            save_for_backward=save,
            store_v_seq=False,
        )


def _kernel_order(x: Tensor) -> tuple[int, ...]:
    """The dimension order the kernels read ``x`` [T, *] in: its memory order when that keeps
    T outermost (e.g. channels-last maps: the kernels treat neurons alike, so any order of
    them serves and no copy is made), else the logical order."""
    order = memory_order(x)
    return order if order[0] == 0 else tuple(range(x.dim()))


def _unpermuted(t: Tensor, order: tuple[int, ...]) -> Tensor:
    """``t``, computed on ``x.permute(order)``, in x's dimension order (and so x's layout); a
    tensor of its own on t's memory, not a view (fused blocks tag their spikes for
    recomputation, which views of an untagged base would not find)."""
    if order == tuple(range(t.dim())):
        return t
    view = t.permute(sorted(range(len(order)), key=order.__getitem__))
    return t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), view.shape, view.stride())
