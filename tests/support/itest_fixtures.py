"""Integration fixtures: a real ``ems-server`` subprocess per test, client processes.

Every process a test starts is stopped by the fixtures, also when the test fails:
the daemon by ``ems.testing.run_server``, client workers by ``workers``. At teardown
the daemon (when still running) must hold no pins and no reservations.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest

from ems import CcConfig, Ems, EmsConfig
from ems.testing import run_server
from ems.testing.leaks import check_stopped
from support.itest_support import assert_idle

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "client_worker.py")
@pytest.fixture
def make_server(tmp_path):
    """``make_server(**run_server_kwargs)``: start a daemon for this test."""
    stack = []

    def make(**kwargs: Any):
        directory = tmp_path / f"server{len(stack)}"
        directory.mkdir()
        cm = run_server(str(directory), **kwargs)
        server = cm.__enter__()
        stack.append((cm, server))
        return server
    yield make
    errors = []
    for cm, server in reversed(stack):
        try:
            if server.running:
                server.resume()
                assert_idle(server)
        except BaseException as exc:  # noqa: BLE001 - stop the daemon first, then fail
            errors.append(exc)
        finally:
            cm.__exit__(None, None, None)
        try:
            check_stopped(server)  # the daemon checked every pool's allocator at stop
        except AssertionError as exc:
            errors.append(exc)
    if errors:
        raise errors[0]


@pytest.fixture
def server(make_server):
    return make_server(capacity="64M")


@pytest.fixture
def client_env(monkeypatch):
    """``client_env(server)``: point this process's SDK at ``server``."""
    def use(server) -> None:
        for name, value in server.client_env().items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("EMS_CONNECT_TIMEOUT_MS", "3000")
    return use


@pytest.fixture
def cc(server, client_env):
    """A V0 ContextCaching of this process, on the daemon."""
    client_env(server)
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="itest")))
    yield Ems.get_cc()
    Ems.finalize()  # before the daemon stops


class Workers:
    """Client worker processes (``client_worker.py``); all killed at teardown."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, server, command: str, **args: Any) -> subprocess.Popen:
        env = dict(os.environ, **server.client_env())
        proc = subprocess.Popen([sys.executable, WORKER, command, json.dumps(args)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                text=True)
        self.procs.append(proc)
        return proc

    def result(self, proc: subprocess.Popen, timeout_s: float = 60.0) -> dict:
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(f"worker timed out; stderr:\n{err}") from None
        assert proc.returncode == 0, f"worker exited {proc.returncode}; stderr:\n{err}"
        return json.loads(out.strip().splitlines()[-1])

    def run(self, server, command: str, timeout_s: float = 60.0, **args: Any) -> dict:
        return self.result(self.start(server, command, **args), timeout_s)

    def wait_line(self, proc: subprocess.Popen, expected: str, timeout_s: float = 20.0
                  ) -> None:
        """Block until the worker prints ``expected`` (a line of its stdout)."""
        import selectors
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                remaining = deadline - time.monotonic()
                assert remaining > 0, f"worker did not print {expected!r} in time"
                if sel.select(remaining):
                    line = proc.stdout.readline()
                    assert line, f"worker exited early: {proc.stderr.read()}"
                    if line.strip() == expected:
                        return
        finally:
            sel.close()

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()


@pytest.fixture
def workers():
    w = Workers()
    yield w
    w.stop_all()
