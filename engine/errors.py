"""Errors the engine raises to its callers."""


class InvalidRequest(ValueError):
    """A request that cannot run as asked; the message is meant for the user."""


class EngineDeadError(RuntimeError):
    """The engine-core process is gone."""
