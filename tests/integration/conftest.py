"""Integration fixtures (defined in ``itest_fixtures``, shared with ``tests/faults``)."""

from support.itest_fixtures import *  # noqa: F401,F403 - pytest collects the fixtures from here
