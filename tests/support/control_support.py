"""Helpers of the control-plane tests (a module of its own name: ``conftest`` is
taken by every test directory)."""

from __future__ import annotations

import socket

from support.itest_support import wait_for  # noqa: E402,F401 - shared with the integration tests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def connect_when_registered(server, access_id: str, key: str, timeout_s: float = 5.0):
    """A transport of ``access_id`` to ``server``, once the daemon's registry has it."""
    from ems.client.remote import RemoteTransport
    from ems.errors import EmsException

    def connect():
        try:
            return RemoteTransport.connect(server.socket_path, access_id, key, 3.0)
        except EmsException:  # not in the registry yet
            return None
    return wait_for(connect, timeout_s, f"the tenant {access_id}")
