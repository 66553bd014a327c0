"""A model's forward and backward replayed from CUDA graphs inside the user's own training loop.

:func:`graph_model` switches a multi-step model to CUDA graphs in place: ``net(x)`` copies
``x`` into a static input, replays a captured forward and returns fresh output tensors;
``loss.backward()`` replays the captured backward and hands the gradients to autograd. The
loss, ``zero_grad``, the optimizer, GradScaler, gradient clipping, lr schedulers, logging
(``loss.item()``), ``functional.reset_net`` and DDP's gradient all-reduce stay eager and
unchanged::

    net = spikefuse.fuse(net)
    spikefuse.graph_model(net)          # the one added line
    for images, labels in loader:
        x = images.cuda().unsqueeze(0).repeat(T, 1, 1, 1, 1)
        loss = F.cross_entropy(net(x).mean(0), labels.cuda())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        functional.reset_net(net)
        print(loss.item())

Each call signature (the inputs' shapes, dtypes, device and ``requires_grad``; autocast, grad
mode, every submodule's ``training``; which parameters train; the storage of the parameters and
buffers) gets its own graphs and memory pool after ``warmup`` eager calls (real calls, whose
backward must have run), at most ``max_graphs`` of them (the least recently used is dropped).
The rules that keep a replay equal to the eager call, and what happens otherwise:

- The neurons start every call from their reset state (``functional.reset_net`` after each
  step, as SpikingJelly's examples do). A call that finds a memory not at its reset value
  (single-step loops, state carried across calls) runs eagerly: the graph starts from reset.
- After a replay the plain attributes the captured forward set (the neurons' ``v``, a
  recorded ``v_seq``) are what it set: tensors that the next replay of that signature
  overwrites, outside the autograd graph.
- Python in the forward and backward runs only during the capture: module hooks that are not
  spikefuse's own (monitors, forward or backward, per module or global), a module with
  memories whose default is a tensor, keyword or non-tensor arguments, CPU inputs and a
  capture that fails (a host sync such as ``.item()`` inside the forward) make the call run
  eagerly, with one warning per cause.
- A second forward of a signature while the autograd graph of its previous replay is alive and
  its backward has not run (an evaluation loop without ``torch.no_grad()``) runs eagerly: the
  replay would overwrite what that backward reads.
- Under ``torch.compile`` or inside another CUDA graph capture (:class:`~spikefuse.graphs.
  GraphedStep`) the model runs its plain forward.

Outputs and gradients are fresh tensors copied out of the graphs' memory (each output cloned,
the gradients with one multi-tensor kernel), so they can be kept across steps and accumulated.
BatchNorm's running statistics, dropout's random numbers (PyTorch's graph-safe generator),
PLIF's learnable decay and the fused blocks' recomputation and memory modes are part of the
captured work. Captures go through :func:`spikefuse.graphs.capturing` on a side stream, after
the caching allocator's free blocks are released, so that the eager warm-ups' cached memory and
the graph's pool are not both held.
"""

from __future__ import annotations

import warnings
import weakref
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules import module as torch_module
from torch.utils import _pytree as pytree

from . import graphs, model_scan
from .errors import SpikefuseError

# What a call is graphed for (see the module docstring); equal signatures share graphs.
Signature = tuple[Hashable, ...]


@dataclass(frozen=True)
class _Replayable:
    """One signature's captured forward (and backward, when it was captured with grad)."""

    forward: torch.cuda.CUDAGraph
    backward: torch.cuda.CUDAGraph | None
    inputs: tuple[Tensor, ...]  # static copies the forward graph reads
    repeated: tuple[bool, ...]  # which inputs repeat one step over T as a view (see _repeated)
    copy_into: tuple[Tensor, ...]  # where each input is copied: its static copy, or its step
    params: tuple[Tensor, ...]  # the trainable parameters, in the backward graph's order
    outputs: tuple[Tensor, ...]  # the forward graph's outputs, flattened
    output_spec: pytree.TreeSpec
    differentiable: tuple[int, ...]  # indices of the outputs that carry gradients
    grad_outputs: tuple[Tensor, ...]  # static dL/d(output) the backward graph reads
    grads: tuple[Tensor | None, ...]  # the backward graph's dL/d(inputs needing it, params)
    attributes: tuple[tuple[nn.Module, str, Any], ...]  # what the forward sets: set after replays


class _Entry:
    """A signature's state: eager warm-up calls so far, then its graphs (or why it runs
    eagerly), and a weak reference to the autograd node of its last replay (alive while that
    replay's backward may still come)."""

    def __init__(self) -> None:
        self.warmed = 0
        self.graphs: _Replayable | None = None
        self.eager_because: str | None = None
        self.pending: weakref.ref[Any] | None = None


class ModelGraphs:
    """The call of a model switched to CUDA graphs by :func:`graph_model` (its
    ``nn.Module.__call__`` replacement); ``invalidate()`` drops every graph."""

    def __init__(self, net: nn.Module, warmup: int, max_graphs: int) -> None:
        self._net = weakref.ref(net)  # the module holds this object: no reference cycle
        self.warmup, self.max_graphs = warmup, max_graphs
        self._entries: OrderedDict[Signature, _Entry] = OrderedDict()
        self._warned: set[str] = set()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}  # captures' side streams
        self._layout: model_scan.Layout | None = None
        self._last: tuple[Signature, _Entry] | None = None  # the last call's signature and entry

    def invalidate(self) -> None:
        """Forget every signature: the next calls warm up and capture again (after replacing a
        tensor the forward reads that is neither a parameter nor a buffer, or changing a Python
        value it reads)."""
        self._entries.clear()
        self._last = None
        self._layout = None

    @property
    def captured(self) -> int:
        """How many signatures have graphs now."""
        return sum(entry.graphs is not None for entry in self._entries.values())

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        return None  # a copy of the model is a plain module (as a pickled one is)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        net = self._net()
        if net is None:
            raise SpikefuseError("graph_model: the model this call belongs to no longer exists")
        if torch.compiler.is_compiling() or _capturing():
            return net._call_impl(*args, **kwargs)
        why = _uncapturable(net, args, kwargs)
        if why is None:
            found = self._layout = model_scan.current(net, self._layout)
            why = found.why or model_scan.not_reset(found.memories)
        if why is not None:
            return self._eager(net, why, args, kwargs)
        signature = _signature(found, args)
        entry = self._entry(signature)
        if entry.eager_because is not None:
            return self._eager(net, entry.eager_because, args, kwargs)
        if entry.graphs is None:
            if entry.warmed < self.warmup:
                return self._warm_up(net, entry, args)
            self._capture(net, entry, args)
            if entry.graphs is None:
                return self._eager(net, entry.eager_because or "", args, kwargs)
        if entry.pending is not None and entry.pending() is not None:
            return self._eager(net, _PENDING, args, kwargs)
        return _replay(entry, args, net)

    def _entry(self, signature: Signature) -> _Entry:
        last = self._last
        if last is not None and last[0] == signature:  # the common case: compared, not hashed
            return last[1]
        entry = self._entry_of(signature)
        self._last = (signature, entry)
        return entry

    def _entry_of(self, signature: Signature) -> _Entry:
        entry = self._entries.get(signature)
        if entry is None:
            entry = self._entries[signature] = _Entry()
            while len(self._entries) > self.max_graphs:
                self._entries.popitem(last=False)  # graphs in use stay alive through autograd
        else:
            self._entries.move_to_end(signature)
        return entry

    def _eager(self, net: nn.Module, why: str, args: tuple[Any, ...], kwargs: dict) -> Any:
        if why and why not in self._warned:
            self._warned.add(why)
            warnings.warn(f"graph_model: ran {type(net).__name__} eagerly: {why}", stacklevel=3)
        return net._call_impl(*args, **kwargs)

    def _warm_up(self, net: nn.Module, entry: _Entry, args: tuple[Tensor, ...]) -> Any:
        """An eager call; it counts once its backward ran (which loads the backward's kernels),
        or at once without grad."""
        output = net._call_impl(*args)
        differentiable = [t for t in pytree.tree_leaves(output) if _needs_grad(t)]
        if not differentiable:
            entry.warmed += 1
        else:
            differentiable[0].register_hook(lambda grad: _count(entry, grad))
        return output

    def _capture(self, net: nn.Module, entry: _Entry, args: tuple[Tensor, ...]) -> None:
        device = args[0].device
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        try:
            with torch.cuda.device(device):
                entry.graphs = _capture(net, args, stream)
        except Exception as error:  # the call runs eagerly; the signature stays eager
            first = (str(error).strip().splitlines() or [""])[0][:300]
            entry.eager_because = f"its CUDA graph capture failed ({type(error).__name__}: {first})"


_PENDING = (
    "a forward ran while the autograd graph of the previous replay of the same call signature "
    "was alive without its backward (e.g. evaluation without torch.no_grad()); the replay "
    "would overwrite what that backward reads. Wrap evaluation in torch.no_grad()"
)


def graph_model(net: nn.Module, *, warmup: int = 2, max_graphs: int = 4) -> nn.Module:
    """Switch ``net`` (in place; returned for chaining) to CUDA-graph replays of its forward
    and backward, one pair per call signature, inside an unchanged training loop.

    Args:
        net: a multi-step model (``[T, N, *]`` input), fused or not, on one CUDA device.
        warmup: eager calls per signature before its capture (each with its backward, which
            loads the kernels a capture cannot load).
        max_graphs: signatures kept at once; the least recently used one's graphs are dropped.

    See :mod:`spikefuse.model_graphs` for the rules. :func:`ungraph_model` switches back.
    A deep copy or pickle of ``net`` is a plain module. ``net.compile()`` replaces the switch.
    """
    if not isinstance(net, nn.Module):
        raise SpikefuseError(f"graph_model: net must be an nn.Module, got {type(net).__name__}")
    for name, value, least in (("warmup", warmup, 1), ("max_graphs", max_graphs, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise SpikefuseError(f"graph_model: {name} must be an int >= {least}, got {value!r}")
    if not hasattr(nn.Module, "_compiled_call_impl"):
        raise SpikefuseError("graph_model needs torch >= 2.2 (nn.Module's in-place call switch)")
    model_scan.watch_registrations()
    net._compiled_call_impl = ModelGraphs(net, warmup, max_graphs)
    return net


def ungraph_model(net: nn.Module) -> nn.Module:
    """Undo :func:`graph_model`: ``net`` runs its plain forward again (graphs dropped)."""
    if isinstance(getattr(net, "_compiled_call_impl", None), ModelGraphs):
        net._compiled_call_impl = None
    return net


def model_graphs(net: nn.Module) -> ModelGraphs | None:
    """The :class:`ModelGraphs` that :func:`graph_model` installed on ``net``, or None."""
    call = getattr(net, "_compiled_call_impl", None)
    return call if isinstance(call, ModelGraphs) else None


def _capturing() -> bool:
    # is_initialized() is a flag read; is_available() would query the driver on every call
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def _needs_grad(value: object) -> bool:
    return isinstance(value, Tensor) and value.requires_grad


def _count(entry: _Entry, grad: Tensor) -> Tensor:
    entry.warmed += 1
    return grad


def _uncapturable(net: nn.Module, args: tuple[Any, ...], kwargs: dict) -> str | None:
    """Why this call cannot replay a graph, as far as its arguments tell, or None."""
    if kwargs or not args or not all(isinstance(a, Tensor) for a in args):
        return "only calls with positional tensor arguments are graphed"
    if not _on_one_gpu(args):
        return "CUDA graphs need all inputs on one CUDA device"
    if _global_hooks():
        return "a global module hook is registered, which a replay would not run"
    return None


def _on_one_gpu(args: tuple[Tensor, ...]) -> bool:
    device = args[0].device
    return device.type == "cuda" and all(a.device == device for a in args)


def _global_hooks() -> bool:
    return any(_GLOBAL_HOOKS)


# torch's tables of global module hooks (mutated in place, never replaced)
_GLOBAL_HOOKS = (
    torch_module._global_forward_hooks,
    torch_module._global_forward_pre_hooks,
    torch_module._global_backward_hooks,
    torch_module._global_backward_pre_hooks,
)


def _signature(found: model_scan.Layout, args: tuple[Tensor, ...]) -> Signature:
    device = args[0].device
    autocast = torch.is_autocast_enabled(device.type)
    return (
        tuple((a.shape, a.dtype, a.requires_grad, _repeated(a)) for a in args),
        device,
        autocast,
        torch.get_autocast_dtype(device.type) if autocast else None,
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        *model_scan.state_key(found),
    )


Attributes = list[tuple[nn.Module, dict[str, Any]]]  # each module's __dict__, copied
_MISSING = object()


def _attributes(net: nn.Module) -> Attributes:
    return [(module, dict(module.__dict__)) for module in net.modules()]


def _set_since(before: Attributes) -> tuple[tuple[nn.Module, str, Any], ...]:
    """The plain attributes added or replaced since ``before`` (memories such as ``v``, a
    recorded ``v_seq``, the blocks' per-shape caches): what a replay sets again."""
    return tuple(
        (module, name, value)
        for module, old in before
        for name, value in module.__dict__.items()
        if old.get(name, _MISSING) is not value
    )


def _restore(before: Attributes) -> None:
    for module, old in before:
        for name in [name for name in module.__dict__ if name not in old]:
            del module.__dict__[name]
        module.__dict__.update(old)


def _capture(net: nn.Module, args: tuple[Tensor, ...], stream: torch.cuda.Stream) -> _Replayable:
    """Capture ``net``'s forward on static copies of ``args`` (and, with grad, its backward
    into the same pool); the modules' attributes are left as they were before."""
    before = _attributes(net)
    inputs = tuple(_static_input(a) for a in args)
    torch.cuda.empty_cache()  # the warm-ups' cached blocks back to the driver, for the pool
    pool = torch.cuda.graph_pool_handle()
    forward = torch.cuda.CUDAGraph()
    named = [(name, p) for name, p in net.named_parameters() if p.requires_grad]
    # Fresh leaves on the parameters' storage: autograd creates their gradient accumulators on
    # the capture stream. The parameters' own may be older (the previous step's graph, which a
    # loop's `loss` keeps alive), bound to the default stream, which a capture cannot wait on.
    aliases: dict[str, Tensor] = {
        name: nn.Parameter(p.detach(), requires_grad=True) for name, p in named
    }
    try:
        with _autocast_without_cache(inputs[0].device), graphs.capturing(forward, stream, pool):
            output = torch.func.functional_call(net, aliases, inputs)
        left = _set_since(before)
    finally:
        _restore(before)
    outputs, spec = pytree.tree_flatten(output)
    if not all(isinstance(o, Tensor) for o in outputs):
        raise SpikefuseError("the forward returned something other than tensors")
    differentiable = tuple(i for i, o in enumerate(outputs) if o.requires_grad)
    backward: torch.cuda.CUDAGraph | None = None
    grad_outputs: tuple[Tensor, ...] = ()
    grads: tuple[Tensor | None, ...] = ()
    if differentiable:
        grad_outputs = tuple(torch.empty_like(outputs[i]) for i in differentiable)
        wrt = [x for x in inputs if x.requires_grad] + list(aliases.values())
        backward = torch.cuda.CUDAGraph()
        with graphs.capturing(backward, stream, pool):
            grads = torch.autograd.grad(
                [outputs[i] for i in differentiable], wrt, grad_outputs, allow_unused=True
            )
    repeated = tuple(map(_repeated, args))
    copy_into = tuple(
        x[:1] if one_step else x for x, one_step in zip(inputs, repeated, strict=True)
    )
    return _Replayable(
        forward, backward, inputs, repeated, copy_into, tuple(p for _, p in named),
        tuple(outputs), spec, differentiable, grad_outputs, tuple(grads), left,
    )  # fmt: skip


def _repeated(x: Tensor) -> bool:
    """Whether ``x`` repeats one step over T as a view (``images.expand(T, ...)``, stride 0),
    which fused blocks exploit (one synapse step for all T): kept so in the static input."""
    return x.dim() > 1 and x.stride(0) == 0 and x.shape[0] > 1 and not x.requires_grad


def _static_input(x: Tensor) -> Tensor:
    """The tensor a graph reads ``x`` from: a copy, of one step if ``x`` repeats it."""
    if _repeated(x):
        return x.detach()[:1].clone().expand(x.shape)
    return x.detach().clone().requires_grad_(x.requires_grad)


def _autocast_without_cache(device: torch.device) -> torch.autocast:
    """The caller's autocast state with the weight-cast cache off: cached casts made during a
    capture would be freed when the caller's autocast exits, while the graph still uses them."""
    enabled = torch.is_autocast_enabled(device.type)
    dtype = torch.get_autocast_dtype(device.type)
    return torch.autocast(device.type, dtype=dtype, enabled=enabled, cache_enabled=False)


def _fresh(grads: list[Tensor]) -> list[Tensor]:
    """New copies of floating-point ``grads``, one multi-tensor kernel for the lot (x * 1 is
    exact) instead of a launch per parameter."""
    return list(torch._foreach_mul(grads, 1)) if grads else []


def _output_copies(graphs_: _Replayable) -> tuple[Tensor, ...]:
    """The forward graph's outputs copied out of its memory (which the next replay overwrites)."""
    return tuple(o.clone() for o in graphs_.outputs)


def _replay(entry: _Entry, args: tuple[Tensor, ...], net: nn.Module) -> Any:
    graphs_ = entry.graphs
    assert graphs_ is not None
    # The forward graph is launched before autograd's bookkeeping (a node with an edge per
    # parameter: a tenth of a millisecond of host time on a ResNet-18), which then runs while
    # the GPU works instead of before.
    with torch.no_grad():  # static inputs may be leaves that require grad
        for into, a, one_step in zip(graphs_.copy_into, args, graphs_.repeated, strict=True):
            into.copy_(a[:1] if one_step else a)
    graphs_.forward.replay()
    if graphs_.backward is None:
        outputs = _output_copies(graphs_)
    else:
        outputs = _ReplayFunction.apply(entry, *args, *graphs_.params)
        for out in outputs:
            if out.requires_grad:
                entry.pending = weakref.ref(out.grad_fn)
                break
    for module, name, value in graphs_.attributes:
        module.__dict__[name] = value
    return pytree.tree_unflatten(list(outputs), graphs_.output_spec)


class _ReplayFunction(torch.autograd.Function):
    """Autograd's view of a replay whose forward graph ran: inputs and trainable parameters
    in, copies of the graph's outputs out; its backward replays the backward graph."""

    @staticmethod
    def forward(ctx: Any, entry: _Entry, *tensors: Tensor) -> tuple[Tensor, ...]:
        graphs_ = entry.graphs
        assert graphs_ is not None
        ctx.entry, ctx.graphs = entry, graphs_
        outputs = _output_copies(graphs_)
        differentiable = set(graphs_.differentiable)
        ctx.mark_non_differentiable(*(o for i, o in enumerate(outputs) if i not in differentiable))
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        graphs_: _Replayable = ctx.graphs
        ctx.entry.pending = None
        for into, i in zip(graphs_.grad_outputs, graphs_.differentiable, strict=True):
            into.copy_(grads[i])
        assert graphs_.backward is not None
        graphs_.backward.replay()
        computed = [g for g in graphs_.grads if g is not None]
        fresh = iter(_fresh(computed))
        result = [next(fresh) if g is not None else None for g in graphs_.grads]
        needing = iter(result)
        inputs = [next(needing) if x.requires_grad else None for x in graphs_.inputs]
        return (None, *inputs, *needing)
