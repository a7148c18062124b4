"""Unit-test environment and fixtures.

Every unit test runs on the embedded pool with a modest capacity, whatever the
caller's environment says (integration tests, in ``tests/integration``, set their
own). A test that needs another capacity or worker count sets ``EMS_CAPACITY`` /
``EMS_WORKERS`` with ``monkeypatch.setenv`` before ``Ems.init``.
"""

from __future__ import annotations

import pytest

from ems import CcConfig, CcKvOption, Ems, EmsConfig
from ems.testing.leaks import check_embedded

_ENV_CLEARED = ("EMS_SOCKET_DIR", "EMS_WORKERS", "EMS_CONNECT_TIMEOUT_MS",
                "access_id", "access_key")


@pytest.fixture(autouse=True)
def _unit_env(monkeypatch):
    monkeypatch.setenv("EMS_POOL", "embedded")
    monkeypatch.setenv("EMS_CAPACITY", "64M")
    for name in _ENV_CLEARED:
        monkeypatch.delenv(name, raising=False)


def wait_idle(cc, timeout_s: float = 5.0) -> None:
    """Pins and reservations are given back just after a request is answered: wait
    for that, and fail if something leaked (pins, reservations, leases) or the
    allocator's own ``check()`` fails (``ems.testing.leaks.check_embedded``)."""
    check_embedded(cc, timeout_s)


@pytest.fixture
def idle():
    """``idle(cc)``: wait until ``cc`` holds nothing a finished request took (see
    wait_idle)."""
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
