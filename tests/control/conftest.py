"""Fixtures of the control-plane tests: a real ``ems-control`` subprocess, real
``ems-server`` daemons that take their tenants from it, and small helpers. Every
process is stopped by the fixtures (by its PID), also when a test fails."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Optional

import pytest

from ems.testing import run_server
from ems.testing.control import run_control
from ems.testing.leaks import check_server

#: the registry poll of the daemons in these tests (the default is 1.0 s)
POLL_S = "0.5"


@pytest.fixture
def control(tmp_path):
    d = tmp_path / "control"
    d.mkdir()
    with run_control(str(d)) as c:
        yield c


class Daemons:
    """``start(control, name, **run_server kwargs)``: a daemon under the control plane."""

    def __init__(self, base: str) -> None:
        self.base = base
        self._stack = contextlib.ExitStack()
        self._servers: list[Any] = []

    def start(self, control, name: str, *, capacity: str = "64M", poll_s: str = POLL_S,
              metrics_port: Optional[int] = None, extra: tuple = (), **kw: Any):
        directory = os.path.join(self.base, name)
        os.makedirs(directory, exist_ok=True)
        args = ["--control", control.url, "--control-token-file", control.token_file("daemon"),
                "--control-poll-s", poll_s, "--host-name", name, *extra]
        if metrics_port is not None:
            args += ["--metrics-addr", f"127.0.0.1:{metrics_port}"]
        kw.setdefault("anonymous", False)
        server = self._stack.enter_context(run_server(directory, capacity=capacity,
                                                      extra_args=args, **kw))
        self._servers.append(server)
        return server

    def close(self) -> None:
        """Stop every daemon; first, each one still running must hold nothing a
        finished request took (``ems.testing.leaks.check_server``)."""
        with self._stack:
            for server in self._servers:
                if server.running:
                    server.resume()
                    check_server(server)


@pytest.fixture
def daemons(tmp_path):
    d = Daemons(str(tmp_path))
    yield d
    d.close()
