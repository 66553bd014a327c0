class SpikefuseError(ValueError):
    pass


class BackendUnavailableError(SpikefuseError, RuntimeError):
    pass
