"""A warning that a fault repeats, logged at most once per ``WARN_EVERY_S``.

A fault that lasts (a full disk, a cluster past its write-behind bound, accept failing
with EMFILE) hits on every request; logging each one wrote megabytes of log per second.
One :class:`RateLimitedLog` per kind of fault logs the first, holds the next back for
``WARN_EVERY_S`` and then says how many it held back. Used by the listener and by the
tier driver (``ems.server.tier_driver``), which keeps one per reason.
"""

from __future__ import annotations

import logging
import time

__all__ = ["RateLimitedLog", "WARN_EVERY_S"]

WARN_EVERY_S = 10.0


class RateLimitedLog:
    """A warning on ``log`` at most once per ``WARN_EVERY_S`` (with how many were held
    back). Called on one thread (the event loop)."""

    def __init__(self, log: logging.Logger) -> None:
        self._log = log
        self._warned_at = -WARN_EVERY_S
        self._unwarned = 0

    def warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self._warned_at < WARN_EVERY_S:
            self._unwarned += 1
            return
        if self._unwarned:
            message += f" ({self._unwarned} similar message(s) suppressed)"
        self._log.warning("%s", message)
        self._warned_at, self._unwarned = now, 0
