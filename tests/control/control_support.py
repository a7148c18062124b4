"""Helpers of the control-plane tests (a module of its own name: ``conftest`` is
taken by every test directory)."""

from __future__ import annotations

import socket

from itest_support import wait_for  # noqa: E402,F401 - shared with the integration tests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
