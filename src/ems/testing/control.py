"""Start and stop a real ``ems-control`` subprocess (tests, benchmarks), and call it.

``run_control(directory)`` starts the service on 127.0.0.1 at a free port with its
state in ``directory`` and always stops it (by its PID) when the block ends.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Iterator, Optional, Sequence

from ems.control.client import http_json
from ems.testing.process import ChildProcess

__all__ = ["ControlProcess", "run_control"]


class ControlProcess(ChildProcess):
    """An ``ems-control`` subprocess with its state in ``directory``."""

    def __init__(self, directory: str, args: Sequence[str] = ()) -> None:
        super().__init__("ems.control", os.path.join(directory, "ems-control.log"))
        self.directory = directory
        self.port_file = os.path.join(directory, "port")
        self.args = list(args)
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def token(self, name: str) -> str:
        """``admin`` or ``daemon``: the token the service made in its state dir."""
        with open(self.token_file(name)) as f:
            return f.read().strip()

    def token_file(self, name: str) -> str:
        return os.path.join(self.directory, f"{name}.token")

    def start(self, timeout_s: float = 20.0) -> "ControlProcess":
        if os.path.exists(self.port_file):
            os.unlink(self.port_file)
        port = str(self.port) if self.port else "0"  # a restart keeps its port
        proc = self.spawn(["--state-dir", self.directory, "--host", "127.0.0.1",
                           "--port", port, "--port-file", self.port_file, *self.args])
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                self._close_log()
                raise RuntimeError(f"ems-control exited with {proc.returncode}:\n"
                                   f"{self.log()}")
            if os.path.exists(self.port_file):
                with open(self.port_file) as f:
                    self.port = int(f.read())
                try:
                    if http_json("GET", self.url + "/healthz", timeout_s=1.0)[0] == 200:
                        return self
                except OSError:  # not answering yet (a busy machine): ask again
                    pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"ems-control did not listen within {timeout_s} s:\n"
                                   f"{self.log()}")
            time.sleep(0.05)

    def call(self, method: str, path: str, body: Any = None, token: Optional[str] = "admin"
             ) -> tuple[int, Any]:
        """One admin (or ``token="daemon"``, or None: none) request to ``path``."""
        tok = None if token is None else self.token(token)
        return http_json(method, self.url + path, tok, body)


@contextlib.contextmanager
def run_control(directory: str, args: Sequence[str] = ()) -> Iterator[ControlProcess]:
    control = ControlProcess(directory, args)
    try:
        control.start()
        yield control
    finally:
        control.stop()
