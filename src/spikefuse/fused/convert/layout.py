"""Layout operations :func:`~spikefuse.fused.fuse` sees through inside a chain: the transposes
a spiking transformer wraps a Linear's BatchNorm1d in (tokens ``[T, B, N, C]``: the BatchNorm
wants the features at dim 2), ``.contiguous()`` copies, which change no value, and time and
batch merged by hand around single-step layers (``x.flatten(0, 1)`` before the synapse,
``.reshape(T, B, ...)`` before the neuron)."""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
from torch import fx


def _only_user(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def through_copies(node: fx.Node) -> fx.Node:
    """``node``, or the last of the ``.contiguous()`` calls that follow it, each the only user
    of the one before (the value is the same)."""
    while (user := _only_user(node)) is not None:
        copy = user.op == "call_method" and user.target == "contiguous"
        if not copy or user.args != (node,) or user.kwargs:
            break
        node = user
    return node


def _dims(node: fx.Node, source: fx.Node, rank: int) -> list[int] | None:
    """The dims (in 0..rank-1) of a transpose or permute of ``source``, or None."""
    if node.kwargs or not node.args or node.args[0] is not source:
        return None
    method = node.op == "call_method" and node.target in ("transpose", "permute")
    function = node.op == "call_function" and node.target in (torch.transpose, torch.permute)
    if not (method or function):
        return None
    dims = list(node.args[1:])
    if len(dims) == 1 and isinstance(dims[0], (tuple, list)):  # permute((0, 1, 3, 2))
        dims = list(dims[0])
    plain = all(isinstance(d, int) and not isinstance(d, bool) and -rank <= d < rank for d in dims)
    return [d % rank for d in dims if isinstance(d, int)] if plain else None


def swaps_last_two(node: fx.Node, source: fx.Node, rank: int) -> bool:
    """Whether ``node`` is ``source.transpose(i, j)`` (or ``torch.transpose``, or a ``permute``)
    that exchanges the last two dims of a rank-``rank`` tensor and nothing else."""
    dims = _dims(node, source, rank)
    if dims is None:
        return False
    if node.target in ("transpose", torch.transpose):
        return sorted(dims) == [rank - 2, rank - 1]
    return dims == [*range(rank - 2), rank - 1, rank - 2]


def transposed_bn(
    synapse: fx.Node, rank: int, is_bn: Callable[[fx.Node], bool]
) -> tuple[fx.Node, fx.Node] | None:
    """(the BatchNorm call, the node after it whose value goes on) if ``synapse``'s output
    [..., N, F] (rank ``rank``) is used only by ``bn(y.transpose(-1, -2)).transpose(-1, -2)``
    (``.contiguous()`` anywhere between): the BatchNorm then normalises the features F of every
    token. ``is_bn``: whether a module call is a BatchNorm that fits the synapse."""
    start = through_copies(synapse)
    opening = _only_user(start)
    if opening is None or not swaps_last_two(opening, start, rank):
        return None
    opened = through_copies(opening)
    bn = _only_user(opened)
    if bn is None or bn.op != "call_module" or bn.args != (opened,) or bn.kwargs or not is_bn(bn):
        return None
    normalised = through_copies(bn)
    closing = _only_user(normalised)
    if closing is None or not swaps_last_two(closing, normalised, rank):
        return None
    return bn, through_copies(closing)


# ---- a synapse run on T and B merged: x.flatten(0, 1) → ... → .reshape(T, B, ...) ----------
_LAYOUT_METHODS = ("contiguous", "transpose", "permute", "reshape", "view", "flatten")


def merged_input(synapse: fx.Node) -> fx.Node | None:
    """x where ``synapse`` is called on ``x.flatten(0, 1)`` (or ``torch.flatten(x, 0, 1)``):
    time and batch merged by hand, as the original spiking transformers' code does."""
    if len(synapse.args) != 1 or synapse.kwargs or not isinstance(synapse.args[0], fx.Node):
        return None
    flat = synapse.args[0]
    method = flat.op == "call_method" and flat.target == "flatten"
    function = flat.op == "call_function" and flat.target is torch.flatten
    if not (method or function) or flat.kwargs or tuple(flat.args[1:]) != (0, 1):
        return None
    x = flat.args[0]
    return x if isinstance(x, fx.Node) else None


def reshape_args(node: fx.Node, source: fx.Node) -> tuple[object, ...] | None:
    """The target shape of ``source.reshape(*shape)`` / ``.view(*shape)`` /
    ``torch.reshape(source, shape)`` that ``node`` is, or None."""
    method = node.op == "call_method" and node.target in ("reshape", "view")
    function = node.op == "call_function" and node.target is torch.reshape
    if not (method or function) or node.kwargs or len(node.args) < 2 or node.args[0] is not source:
        return None
    shape = node.args[1:]
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    return tuple(shape)


def is_size(node: object, x: fx.Node, dim: int) -> bool:
    """Whether ``node`` is ``x.shape[dim]`` or ``x.size(dim)`` (``T, B, ... = x.shape`` too)."""
    if not isinstance(node, fx.Node) or node.kwargs:
        return False
    if node.op == "call_method" and node.target == "size":
        return node.args == (x, dim)
    if node.op != "call_function" or node.target is not operator.getitem or node.args[1] != dim:
        return False
    shape = node.args[0]
    if not isinstance(shape, fx.Node) or shape.kwargs:
        return False
    attribute = shape.op == "call_function" and shape.target is getattr
    return (attribute and shape.args == (x, "shape")) or (
        shape.op == "call_method" and shape.target == "size" and shape.args == (x,)
    )


def layout_users(node: fx.Node) -> list[fx.Node]:
    """Where ``node``'s value goes through reshapes, transposes and copies only: the first
    users that are none of these (``node``'s users if it has several)."""
    users = list(node.users)
    while len(users) == 1 and users[0].op == "call_method" and users[0].target in _LAYOUT_METHODS:
        users = list(users[0].users)
    return users
