"""Helpers of the control-plane tests (a module of its own name: ``conftest`` is
taken by every test directory)."""

from __future__ import annotations

import socket
import time
from typing import Any, Callable


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str,
             interval_s: float = 0.05) -> Any:
    """Poll ``predicate`` until it returns something true; return that."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(interval_s)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
