"""Saved-tensor metadata: the tags on a fused block's output and the hooks that read them.

Every tag a tensor carries is one :class:`SavedTags` record under one attribute, valid while
the tensor is unmodified: whether it holds spikes (or the means of k x k spikes), a recipe that
recomputes it, the packing a kernel wrote of it. The layers that keep such a tensor for backward
read it through :func:`saving_recomputed` (a saved-tensor hook) and :func:`compact`.

A Conv/Linear saves its input for ``dL/dW``; a pooling layer may save its input too. When that
input is the spike output of a fused block, it is a function of what the block keeps anyway
(its synapse output and per-channel vectors), so, as in the DATE'22 paper, it is recomputed in
backward (one forward kernel launch) instead of being stored; a pooled block whose kernels
packed the spikes behind its means restores them by unpacking those bits instead.
:func:`saving_recomputed` intercepts the save; the tensor's *recipe* (a function returning a
tensor equal to it, element for element and with the same strides) is set by
:func:`mark_recomputable`, or is unpacking the packing tagged by
:func:`mark_packed`. Spikes without a recipe (the output of an unpooled block in the
minimal-memory mode, which keeps no synapse output) are saved packed at 1 bit per element
instead (:mod:`.spike_bits`). Tensors under :data:`RECOMPUTE_MIN_BYTES` (4 MiB: e.g. the
Linear blocks' spikes) are saved as they are: neither recomputed nor packed.

Fused blocks tag their spikes; :class:`~spikefuse.fused.SpikePool` tags its output with the
pooling applied to the recipe. Views that cover the same memory (flatten, unflatten) use the
recipe of their base; anything else derived from a tagged tensor (arithmetic, a copy, an
in-place edit) has no valid recipe and is saved as it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from .spike_bits import PackedSpikes, Packing, dense_order

Recipe = Callable[[], Tensor]
_TAGS = "_spikefuse_tags"  # the one attribute a tagged tensor carries (a SavedTags)

#: Smaller inputs are saved as they are. Recomputing or unpacking one in backward would save a
#: few MiB against a peak of hundreds at the price of a launch and its host work, and the small
#: tensors (the Linear blocks' spikes) sit in the host-bound part of an eager step: the
#: forward and the head of backward. Every convolution map of the DATE'22 networks is larger.
RECOMPUTE_MIN_BYTES = 4 << 20


class SavedTags(NamedTuple):
    """What a tensor carries for the layers that save it for backward, valid while the tensor
    is unmodified (``version``: its ``_version`` when tagged; an in-place edit invalidates
    every field).

    ``window``: 1 where it holds binary spikes (a fused block's output), k² where it holds the
    means of k x k spikes (a pooled block's), None where neither; ``recipe``: a function that
    recomputes it (same values and strides); ``packing``: the packing a kernel wrote of it
    (the spikes behind each mean), whose unpacking restores it."""

    version: int
    window: int | None = None
    recipe: Recipe | None = None
    packing: PackedSpikes | None = None


def tags_of(t: Tensor) -> SavedTags | None:
    """``t``'s own valid tags (not those of a tensor it is a view of), or None. Inference
    tensors have no version counter and are never tagged: nothing is saved for a backward."""
    if t.is_inference():
        return None
    tags = getattr(t, _TAGS, None)
    return tags if tags is not None and tags.version == t._version else None


def _tagged(
    t: Tensor,
    window: int | None = None,
    recipe: Recipe | None = None,
    packing: PackedSpikes | None = None,
) -> Tensor:
    """``t`` with the given fields set in its tags (the others kept while valid)."""
    if t.is_inference():
        return t
    old = tags_of(t)
    if old is not None:
        window = old.window if window is None else window
        recipe = old.recipe if recipe is None else recipe
        packing = old.packing if packing is None else packing
    setattr(t, _TAGS, SavedTags(t._version, window, recipe, packing))
    return t


def mark_spikes(t: Tensor) -> Tensor:
    """Tag ``t`` as binary spikes (until it is modified in place); returns t."""
    return _tagged(t, window=1)


def mark_means(t: Tensor, window: int) -> Tensor:
    """Tag ``t`` as the means of ``window`` = k² spikes each (a k x k average pooling of
    spikes; a window of 1: spikes, what :func:`means_window` gives back, so a layer that keeps
    its input's kind of values passes ``means_window(x)`` on as it is); returns t."""
    return _tagged(t, window=window)


def mark_recomputable(t: Tensor, recipe: Recipe) -> Tensor:
    """Tag ``t`` with a function that recomputes it (same values and strides); returns t."""
    return _tagged(t, recipe=recipe)


def mark_packed(t: Tensor, packing: PackedSpikes) -> Tensor:
    """Tag ``t`` with the packing a kernel wrote of it (a pooled block's output: the spikes
    behind each mean): :func:`compact` then keeps the packing instead of t, and unpacking it
    is t's recipe; returns t."""
    return _tagged(t, packing=packing)


def same_kind(source: Tensor, view: Tensor) -> Tensor:
    """Tag ``view``, a reshaped view of ``source``, as holding what ``source`` holds (spikes or
    means of spikes; a tag on one view is not seen from another); returns ``view``."""
    window = means_window(source)
    return view if window is None else mark_means(view, window)


def _windows(t: Tensor) -> tuple[int | None, int | None]:
    """The windows tagged on ``t`` and on the tensor it is a view of."""
    base = t._base
    own, of_base = tags_of(t), None if base is None else tags_of(base)
    return (None if own is None else own.window), (None if of_base is None else of_base.window)


def is_spikes(t: Tensor) -> bool:
    """Whether ``t`` (or the tensor it is a view of) is tagged as unmodified spikes."""
    return 1 in _windows(t)


def means_window(t: Tensor) -> int | None:
    """k² of a tensor tagged as means of k x k spikes (or of the tensor it is a view of), 1 of
    tagged spikes, else None."""
    own, of_base = _windows(t)
    if 1 in (own, of_base):
        return 1
    return own if own is not None else of_base


def packing_of(t: Tensor) -> PackedSpikes | None:
    """The packing a kernel wrote of ``t`` itself (not of a view of it), while t is
    unmodified, else None."""
    tags = tags_of(t)
    return None if tags is None else tags.packing


def pack_now(t: Tensor) -> PackedSpikes | None:
    """Tag spikes ``t`` with their packing at 1 bit per element, written now, where autograd
    may save t and would save it compactly at all (dense, :data:`RECOMPUTE_MIN_BYTES` or
    more): what keeps t (or a same-memory view of it) for backward then keeps those bits, and
    unpacking them is t's recipe. For spikes whose recipe costs more than the packing's two
    passes (a max pooling's output, which it recomputes from k² times as many neurons).
    Returns the packing, or None where it packed nothing."""
    if not (torch.is_grad_enabled() and t.requires_grad and is_spikes(t)):
        return None
    if t.numel() * t.element_size() < RECOMPUTE_MIN_BYTES or not _dense(t):
        return None
    packing = PackedSpikes.of(t)
    mark_packed(t, packing)
    return packing


def _valid_recipe(t: Tensor) -> Recipe | None:
    """t's own recipe: its tag, or unpacking the packing a kernel wrote of it."""
    tags = tags_of(t)
    if tags is None:
        return None
    if tags.recipe is not None:
        return tags.recipe
    return None if tags.packing is None else tags.packing.unpack


def recipe_of(t: Tensor) -> Recipe | None:
    """The recipe of ``t``, or of the tagged tensor it is a same-memory view of, or None."""
    recipe = _valid_recipe(t)
    if recipe is not None:
        return recipe
    base = t._base
    if base is None or not _same_memory(t, base):
        return None
    base_recipe = _valid_recipe(base)
    if base_recipe is None:
        return None
    shape, stride = t.shape, t.stride()  # not t itself: that would keep its memory alive
    return lambda: _strided(base_recipe(), shape, stride)


def _dense(t: Tensor) -> bool:
    """Whether t's elements fill its memory span exactly once, in any dimension order."""
    return dense_order(t.shape, t.stride()) is not None


def _memory_key(t: Tensor) -> tuple:
    return t.data_ptr(), t.numel(), t.dtype


def _same_memory(a: Tensor, b: Tensor) -> bool:
    """Whether a and b are dense views of exactly the same elements (any shape or order)."""
    return _memory_key(a) == _memory_key(b) and _dense(a) and _dense(b)


def _strided(source: Tensor, shape: torch.Size, stride: tuple[int, ...]) -> Tensor:
    """A view of ``source``'s memory with another geometry over the same elements."""
    return source.as_strided(shape, stride, source.storage_offset())


def saving_recomputed(
    x: Tensor, recipe: Recipe | None = None
) -> contextlib.AbstractContextManager[None]:
    """A context in which autograd saves ``x`` (or a same-memory view of it) as ``recipe``.

    ``recipe`` defaults to x's own (see :func:`recipe_of`); without one, x is saved packed at
    1 bit per element if it is tagged spikes (:func:`is_spikes`), else the context
    does nothing; so it does for an x under :data:`RECOMPUTE_MIN_BYTES`. Other saved tensors
    (weights) and copies made by an op (e.g. an autocast cast) are saved as they are. PyTorch
    applies only the innermost saved-tensor hooks, so while this context is active a caller's
    own (``torch.autograd.graph.save_on_cpu``, ...) do not see what the layer inside saves. Returns torch's hooks context itself (no
    generator-based wrapper: this runs in every fused block's forward).
    """
    if x.numel() * x.element_size() < RECOMPUTE_MIN_BYTES:
        return contextlib.nullcontext()
    recipe = recipe or recipe_of(x)
    if not _dense(x) or (recipe is None and not is_spikes(x)):
        return contextlib.nullcontext()
    # Autograd keeps the pack hook as long as what it saved: it must not hold x itself.
    memory = _memory_key(x)

    def pack(t: Tensor) -> object:
        if not (_memory_key(t) == memory and _dense(t)):
            return t
        return PackedSpikes.of(t) if recipe is None else _Restore(recipe, t)

    return torch.autograd.graph.saved_tensors_hooks(pack, _unpack)


class _Restore:
    """A saved tensor replaced by its recipe; keeps only the view's geometry."""

    __slots__ = ("recipe", "shape", "stride")

    def __init__(self, recipe: Recipe, t: Tensor) -> None:
        self.recipe, self.shape, self.stride = recipe, t.shape, t.stride()

    def unpack(self) -> Tensor:
        return _strided(self.recipe(), self.shape, self.stride)


def _unpack(saved: _Restore | PackedSpikes | Tensor) -> Tensor:
    return saved.unpack() if isinstance(saved, (_Restore, PackedSpikes)) else saved


class RecomputedInput:
    """Forward hooks that make a module save its input as its recipe, when the input is
    recomputable (the spike output of a fused block): what :func:`~spikefuse.fused.fuse` puts
    on the Conv/Linear layers it leaves unfused, such as a ResNet's downsample convolution,
    which would otherwise keep a fused block's spikes for its weight gradient."""

    def __init__(self) -> None:
        self._active: list[contextlib.AbstractContextManager] = []  # one per call in progress

    @staticmethod
    def attach(module: torch.nn.Module) -> bool:
        """Hook ``module`` (once); returns whether it was hooked now."""
        hooks = module._forward_pre_hooks.values()
        if any(isinstance(getattr(h, "__self__", None), RecomputedInput) for h in hooks):
            return False
        hooked = RecomputedInput()
        module.register_forward_pre_hook(hooked._enter)
        module.register_forward_hook(hooked._exit, always_call=True)
        return True

    def _enter(self, module: torch.nn.Module, args: tuple) -> None:
        if torch.compiler.is_compiling():  # compiled, nothing is tagged (see FusedBlock)
            return
        x = args[0] if args else None
        context = saving_recomputed(x) if isinstance(x, Tensor) else contextlib.nullcontext()
        context.__enter__()
        self._active.append(context)

    def _exit(self, module: torch.nn.Module, args: tuple, output: object) -> None:
        if not torch.compiler.is_compiling():
            self._active.pop().__exit__(None, None, None)


def flatten_keeps_tags(module: torch.nn.Module, args: tuple, out: object) -> None:
    """A forward hook for ``nn.Flatten`` (what :func:`~spikefuse.fused.fuse` puts on them): the
    output gets the input's tags, that it holds spikes or means of spikes (which lets a Linear
    block run on bf16 terms, :mod:`.spike_linear`), and the flattening of its recipe, without
    which the next layer would keep the output for backward where flattening copied the input
    (a channels-last map, the layout of a Conv block's output). A tag on a view is not seen
    from another view of the same memory, so a flattening view is tagged too."""
    if torch.compiler.is_compiling() or not args:
        return
    x = args[0]
    if not isinstance(x, Tensor) or not isinstance(out, Tensor):
        return
    window = means_window(x)
    if window is not None:
        mark_means(out, window)
    recipe = recipe_of(x)
    if recipe is not None:
        mark_recomputable(out, lambda: module.forward(recipe()))


#: A tensor kept for backward: itself, or its packing when it is spikes (:func:`compact`).
Compact = Tensor | PackedSpikes


def compact(t: Tensor) -> Compact:
    """``t`` as kept for backward: the packing a kernel wrote of it (:func:`packing_of`), its
    packing at 1 bit per element when it is tagged spikes (:func:`is_spikes`), else ``t``
    itself; :func:`expand` gives it back."""
    packing = packing_of(t)
    if packing is not None:
        return packing
    return PackedSpikes.of(t) if is_spikes(t) else t


def expand(kept: Compact) -> Tensor:
    """The tensor :func:`compact` kept."""
    return kept.unpack() if isinstance(kept, PackedSpikes) else kept


def split(kept: Compact) -> tuple[Tensor, Packing | None]:
    """``kept`` as the tensor an autograd Function saves (``ctx.save_for_backward``: checked
    against in-place edits, seen by saved-tensor hooks) and its packing (None: a plain tensor);
    :func:`join` puts them back together."""
    if isinstance(kept, PackedSpikes):
        return kept.bits, (kept.shape, kept.dtype, kept.order, kept.window)
    return kept, None


def join(saved: Tensor, packing: Packing | None) -> Compact:
    """The :data:`Compact` that :func:`split` took apart."""
    return saved if packing is None else PackedSpikes(saved, *packing)
