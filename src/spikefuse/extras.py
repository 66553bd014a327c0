"""Optional dependencies of the apps (``spikefuse train``, ``spikefuse bench``).

The library needs only torch, sympy and numpy. The training demo and the benchmarks use more
(scikit-learn's digits, matplotlib's plots, tqdm's progress bar), installed as the extras
``spikefuse[demo]`` and ``spikefuse[bench]``; they are imported only where used, after
:func:`require` has checked them, so that a missing one stops a run before it starts, with the
command that installs it.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping

from .errors import SpikefuseError

#: Import name -> the name pip installs it by.
DISTRIBUTIONS = {"sklearn": "scikit-learn", "matplotlib": "matplotlib", "tqdm": "tqdm"}


class MissingExtraError(SpikefuseError):
    """An optional dependency that this use needs is not installed."""


def require(who: str, extra: str, needs: Mapping[str, str]) -> None:
    """Raise :class:`MissingExtraError` unless every module of ``needs`` imports.

    ``needs`` maps import names to what ``who`` uses them for; the message names every missing
    one and ``pip install 'spikefuse[extra]'``, which installs them all.
    """
    missing = []
    for module, purpose in needs.items():
        try:
            importlib.import_module(module)
        except ImportError as exc:
            missing.append(f"{DISTRIBUTIONS.get(module, module)} for {purpose} ({exc})")
    if missing:
        raise MissingExtraError(
            f"{who} needs packages that cannot be imported: {'; '.join(missing)}. Install them "
            f"with: pip install 'spikefuse[{extra}]'"
        )
