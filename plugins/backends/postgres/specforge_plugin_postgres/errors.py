"""Exception types of the ``postgres`` control plane."""

from specforge_core.errors import ControlPlaneError

__all__ = ["PostgresNotReadyError", "PostgresUnavailableError", "StreamMismatchError"]


class PostgresUnavailableError(ControlPlaneError):
    """The server cannot be reached, refuses the login, or stayed away longer than the reconnect timeout."""


class PostgresNotReadyError(PostgresUnavailableError):
    """The server answered but does not take connections yet: it is starting up, shutting down or recovering."""


class StreamMismatchError(ControlPlaneError):
    """The schema holds something else: another program's tables, another schema version or another stream."""
