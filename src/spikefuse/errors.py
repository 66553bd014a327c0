"""spikefuse's exceptions: :class:`SpikefuseError` (a ``ValueError``) and its subclasses, and
:func:`os_reason`, the wording of an OS error in their messages."""


class SpikefuseError(ValueError):
    """An input spikefuse refuses; the message names the problem and the fix."""


class BackendUnavailableError(SpikefuseError, RuntimeError):
    """A backend (e.g. ``cuda``) cannot run here: no GPU, no CuPy, or a CPU-only build."""


class NIRConversionError(SpikefuseError):
    """A model or graph part that has no faithful NIR (or spikefuse) equivalent."""


def os_reason(exc: OSError) -> str:
    """The OS's reason for a failed file operation, for an error message."""
    return exc.strerror or str(exc) or type(exc).__name__
