"""One error vocabulary for the SDK, the daemon and the wire.

Clients compare ``e.status_code()`` against :class:`EmsErrorCode` members and log
``e.status_code().name``; the daemon sends the member's ``value`` on the wire and the
client rebuilds the same :class:`EmsException`.
"""

from __future__ import annotations

import enum

__all__ = ["EmsErrorCode", "EmsException", "ERROR_MEANINGS"]


class EmsErrorCode(enum.Enum):
    """Status codes of :class:`EmsException` (values are stable on the wire)."""

    EMS_SUCCESS = 0
    EMS_INVALID_ARGUMENT = 1
    EMS_INTERNAL_ERROR = 2
    EMS_IO_ERROR = 3
    EMS_IO_TIMEOUT = 4
    EMS_RECOVERD_ERROR = 5  # (sic) the spelling real clients compare against
    EMS_NOT_INITIALIZED = 6
    EMS_UNAVAILABLE = 7
    EMS_AUTH_FAILED = 8
    EMS_NO_SPACE = 9
    EMS_PROTOCOL_ERROR = 10
    EMS_ALREADY_INITIALIZED = 11


#: What each code means and what a caller should do about it.
ERROR_MEANINGS: dict[EmsErrorCode, str] = {
    EmsErrorCode.EMS_SUCCESS: "no error",
    EmsErrorCode.EMS_INVALID_ARGUMENT: (
        "the caller passed bad input; nothing was stored or changed, the pool is healthy"
    ),
    EmsErrorCode.EMS_INTERNAL_ERROR: "a bug or an unexpected state inside ems",
    EmsErrorCode.EMS_IO_ERROR: "the pool could not be reached or the connection broke",
    EmsErrorCode.EMS_IO_TIMEOUT: (
        "the request did not finish within CcKvOption.timeout; no byte is written "
        "into the caller's buffers after the call raised"
    ),
    EmsErrorCode.EMS_RECOVERD_ERROR: (
        "the pool is not available yet (no daemon socket, connection refused, no answer "
        "within the connect timeout, or the connection dropped during the handshake): "
        "retry Ems.init when Ems.check_health() is True"
    ),
    EmsErrorCode.EMS_NOT_INITIALIZED: "Ems.init has not succeeded in this process",
    EmsErrorCode.EMS_UNAVAILABLE: (
        "retired: not raised by this version (a daemon that cannot be reached yet is "
        "EMS_RECOVERD_ERROR); kept so that code naming it still runs"
    ),
    EmsErrorCode.EMS_AUTH_FAILED: "access_id/access_key were refused by the pool",
    EmsErrorCode.EMS_NO_SPACE: "the pool (or the tenant's quota) has no room",
    EmsErrorCode.EMS_PROTOCOL_ERROR: "a malformed or incompatible wire message",
    EmsErrorCode.EMS_ALREADY_INITIALIZED: (
        "Ems.init was already called with a different config; call Ems.finalize first"
    ),
}


class EmsException(Exception):
    """The only exception type the SDK raises to its callers."""

    def __init__(self, status_code: EmsErrorCode, message: str) -> None:
        super().__init__(status_code, message)
        self._status_code = EmsErrorCode(status_code)
        self._message = message

    def message(self) -> str:
        """The human-readable description (names the field and the rule for bad input)."""
        return self._message

    def status_code(self) -> EmsErrorCode:
        """The :class:`EmsErrorCode` member."""
        return self._status_code

    def __str__(self) -> str:
        return f"{self._status_code.name}: {self._message}"

    def __repr__(self) -> str:
        return f"EmsException({self._status_code.name}, {self._message!r})"

    def __reduce__(self):  # picklable across processes
        return (EmsException, (self._status_code, self._message))


def invalid(message: str) -> EmsException:
    """Shorthand for an ``EMS_INVALID_ARGUMENT`` exception."""
    return EmsException(EmsErrorCode.EMS_INVALID_ARGUMENT, message)
