"""Builders of SpikingJelly's zoo that spikefuse does not provide: they raise, saying what to
use instead."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

from ..errors import SpikefuseError


def refusing(name: str, why: str, instead: str) -> Callable[..., NoReturn]:
    """A builder named ``name`` that raises :class:`SpikefuseError` (``why``; use ``instead``)."""

    def builder(*args: Any, **kwargs: Any) -> NoReturn:
        raise SpikefuseError(f"{name} is not available in spikefuse: {why}; use {instead}")

    builder.__name__ = builder.__qualname__ = name
    builder.__doc__ = f"Not available in spikefuse ({why}): raises; use {instead}."
    return builder
