"""Errors the engine raises to its callers."""


class InvalidRequest(ValueError):
    """A request that cannot run as asked; the message is meant for the user."""


class EngineSleeping(InvalidRequest):
    """A request reached an engine put to sleep (sleep mode): it may run once
    the engine wakes up (a 503 over HTTP, not a 400)."""


class EngineDeadError(RuntimeError):
    """The engine-core process is gone."""


class RequestFailed(RuntimeError):
    """The engine ended a request it had accepted (finish_reason "error"), e.g.
    because its LoRA adapter's files went; the message says why. Other
    requests are not affected."""
