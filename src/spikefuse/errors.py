"""spikefuse's exceptions: :class:`SpikefuseError` (a ``ValueError``) and its subclasses."""


class SpikefuseError(ValueError):
    """An input spikefuse refuses; the message names the problem and the fix."""


class BackendUnavailableError(SpikefuseError, RuntimeError):
    """A backend (e.g. ``cuda``) cannot run here: no GPU, no CuPy, or a CPU-only build."""


class NIRConversionError(SpikefuseError):
    """A model or graph part that has no faithful NIR (or spikefuse) equivalent."""
