"""Unit-test environment and fixtures.

Every unit test runs on the embedded pool with a modest capacity, whatever the
caller's environment says (integration tests, in ``tests/integration``, set their
own). A test that needs another capacity or worker count sets ``EMS_CAPACITY`` /
``EMS_WORKERS`` with ``monkeypatch.setenv`` before ``Ems.init``.
"""

from __future__ import annotations

import time

import pytest

from ems import CcConfig, CcKvOption, Ems, EmsConfig

_ENV_CLEARED = ("EMS_SOCKET_DIR", "EMS_WORKERS", "EMS_CONNECT_TIMEOUT_MS",
                "access_id", "access_key")


@pytest.fixture(autouse=True)
def _unit_env(monkeypatch):
    monkeypatch.setenv("EMS_POOL", "embedded")
    monkeypatch.setenv("EMS_CAPACITY", "64M")
    for name in _ENV_CLEARED:
        monkeypatch.delenv(name, raising=False)


def wait_idle(cc, timeout_s: float = 5.0) -> None:
    """Pins and reservations are given back just after a request is answered:
    wait for that, and fail if something leaked."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = cc.statistics()
        if stats.pinned == 0 and stats.reserved == 0:
            assert stats.used_bytes <= stats.capacity_bytes
            return
        assert time.monotonic() < deadline, f"leaked pins/reservations: {stats}"
        time.sleep(0.01)


@pytest.fixture
def idle():
    """``idle(cc)``: wait until ``cc`` holds no pins or reservations (see wait_idle)."""
    return wait_idle


@pytest.fixture
def make_cc():
    """``make_cc(cc_config=..., cc_config_v1=...)``: ``Ems.init`` and return the
    ContextCaching; at teardown, check that nothing leaked."""
    def make(cc_config=None, cc_config_v1=None, **kwargs):
        Ems.init(EmsConfig(cc_config=cc_config, cc_config_v1=cc_config_v1, **kwargs))
        return Ems.get_cc()
    yield make
    got = Ems.get_cc()
    if got is not None:
        wait_idle(got)


@pytest.fixture
def cc(make_cc):
    """A ContextCaching (V0) on a fresh embedded pool."""
    return make_cc(cc_config=CcConfig(rank_id=0, device_id=0, model_id="test-model"))


@pytest.fixture
def option() -> CcKvOption:
    return CcKvOption(timeout=5000)
