"""Integration fixtures (defined in ``itest_fixtures``, shared with ``tests/faults``)."""

from support.itest_fixtures import *  # noqa: F401,F403 - pytest collects the fixtures from here
from support.kv_events_support import subscriber  # noqa: E402,F401 - a fixture
