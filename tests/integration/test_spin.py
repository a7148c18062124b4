"""Synchronous calls poll for the daemon's reply for EMS_SPIN_US before sleeping;
asynchronous ones never poll; either way the answers are the same, also when the
reply takes longer than the spin."""

from __future__ import annotations

import threading
import time

import pytest
from support.client_worker import Value, pattern

from ems import CcConfig, CcKvOption, Ems, EmsConfig

pytestmark = pytest.mark.integration

OPT = CcKvOption(timeout=5000)


def _record_spins(cc):
    """Wrap the session's wait for replies to record the spin each request asked for."""
    session = cc._transport._session
    spins: list[float] = []
    reply_to = session.reply_to

    def recording(pending, spin_s=0.0):
        spins.append(spin_s)
        return reply_to(pending, spin_s)
    session.reply_to = recording
    return spins


def _init(client_env, server, monkeypatch, spin_us=None):
    client_env(server)
    if spin_us is not None:
        monkeypatch.setenv("EMS_SPIN_US", str(spin_us))
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="spin")))
    return Ems.get_cc()


def test_sync_calls_spin_and_async_calls_do_not(server, client_env, monkeypatch):
    cc = _init(client_env, server, monkeypatch)
    try:
        assert cc._transport.spin_s == pytest.approx(200e-6)
        spins = _record_spins(cc)
        value = Value(4096, pattern("a", 4096))
        assert cc.save(OPT, ["a"], [value.wrappers()]).success == 1
        out = Value(4096)
        assert cc.load(OPT, ["a"], [out.wrappers()]).success == 1
        assert out.bytes() == value.bytes()
        assert spins and all(s == pytest.approx(200e-6) for s in spins)
        spins.clear()
        out2 = Value(4096)
        assert cc.async_load(OPT, ["a"], [out2.wrappers()]).result().success == 1
        assert cc.async_save(OPT, ["b"], [value.wrappers()]).result().success == 1
        assert out2.bytes() == value.bytes()
        assert spins and all(s == 0.0 for s in spins)
    finally:
        Ems.finalize()


def test_no_spin_when_set_to_zero(server, client_env, monkeypatch):
    cc = _init(client_env, server, monkeypatch, spin_us=0)
    try:
        assert cc._transport.spin_s == 0.0
        spins = _record_spins(cc)
        value = Value(4096, pattern("z", 4096))
        assert cc.save(OPT, ["z"], [value.wrappers()]).success == 1
        out = Value(4096)
        assert cc.load(OPT, ["z"], [out.wrappers()]).success == 1
        assert out.bytes() == value.bytes()
        assert spins and all(s == 0.0 for s in spins)
    finally:
        Ems.finalize()


def test_a_reply_later_than_the_spin_still_arrives(server, client_env, monkeypatch):
    """The daemon is stopped for 0.3 s, far past the 100 us spin: the call polls,
    then sleeps in poll, and gets its answer when the daemon goes on."""
    cc = _init(client_env, server, monkeypatch, spin_us=100)
    try:
        value = Value(4096, pattern("late", 4096))
        assert cc.save(OPT, ["late"], [value.wrappers()]).success == 1
        server.pause()
        timer = threading.Timer(0.3, server.resume)
        timer.start()
        try:
            out = Value(4096)
            assert cc.load(OPT, ["late"], [out.wrappers()]).success == 1
        finally:
            timer.join()
        assert out.bytes() == value.bytes()
    finally:
        Ems.finalize()


@pytest.mark.parametrize("spin_us", ["0", "1000"])
def test_the_daemon_serves_with_and_without_busy_polling(make_server, client_env,
                                                         monkeypatch, spin_us):
    """``--spin-us``: the daemon answers the same either way, a request that comes
    while it polls and one that wakes it from its sleep (after an idle pause)."""
    server = make_server(capacity="64M", extra_args=["--spin-us", spin_us])
    assert server.stats()["server"]["spin_us"] == int(spin_us)
    cc = _init(client_env, server, monkeypatch)
    try:
        for i in range(20):
            value = Value(4096, pattern(f"d{i}", 4096))
            assert cc.save(OPT, [f"d{i}"], [value.wrappers()]).success == 1
            if i % 5 == 0:
                time.sleep(0.01)  # past the spin window: the daemon sleeps meanwhile
            out = Value(4096)
            assert cc.load(OPT, [f"d{i}"], [out.wrappers()]).success == 1
            assert out.bytes() == value.bytes()
    finally:
        Ems.finalize()


def test_the_latency_ab_script_runs_both_variants(tmp_path):
    """benchmarks/latency_ab.py (structure only, never speed): both variants measured,
    each with its settings named."""
    import os
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks",
                          "latency_ab.py")
    r = subprocess.run([sys.executable, script, "--a", "--spin-us 0", "--b-env",
                        "EMS_SPIN_US=0", "--rounds", "2", "--ops", "20"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["A load", "A save", "B load", "B save"]
    assert "--spin-us 0" in lines[0] and "EMS_SPIN_US=0" in lines[2]
