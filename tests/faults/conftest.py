"""The fault suite: ems-server under a hostile or broken host.

Each test starts real daemons and clients (``tests/integration``'s fixtures, shared)
and stops them by PID, also on failure; loops are bounded in count and time; only unix
sockets in temp dirs. Figures a test measures (RSS, fds, latencies, times) are
recorded with the ``figures`` fixture and printed at the end of the run, so the
closing figures of a change come from the suite itself.
"""

from __future__ import annotations

import json
import os

import pytest
from support.itest_fixtures import *  # noqa: E402,F401,F403 - the integration fixtures

FIGURES: dict[str, dict] = {}


@pytest.fixture
def figures(request):
    """``figures["name"] = value``: a figure of this test, printed at the end."""
    mine: dict = {}
    yield mine
    if mine:
        FIGURES[request.node.name] = mine


def pytest_terminal_summary(terminalreporter):
    if not FIGURES:
        return
    terminalreporter.section("fault suite figures")
    for name, values in FIGURES.items():
        terminalreporter.write_line(f"{name}: {json.dumps(values, sort_keys=True)}")
    path = os.environ.get("EMS_FAULT_FIGURES")
    if path:
        with open(path, "w") as f:
            json.dump(FIGURES, f, indent=2, sort_keys=True)
