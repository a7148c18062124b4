"""The client's leader/follower reader: whichever thread waits reads the socket, and
hands it on when it leaves. Many threads on one connection each get their own reply;
a follower or leader that times out hands the socket on and its late reply is undone;
an idle connection notices a daemon that went away."""

from __future__ import annotations

import threading
import time

import pytest
from support.client_worker import pattern
from support.itest_support import anonymous_stats, transport_load, transport_save, wait_for

from ems.client.remote import RemoteTransport
from ems.client.session import Timeout
from ems.protocol import messages as m

pytestmark = pytest.mark.integration


def _connect(server) -> RemoteTransport:
    return RemoteTransport.connect(server.socket_path, None, None, 3.0)


def test_many_threads_share_one_connection_and_get_their_own_replies(server):
    transport = _connect(server)
    errors: list[BaseException] = []
    n_threads, rounds = 8, 150

    def worker(t: int) -> None:
        try:
            for i in range(rounds):
                key, size = f"t{t}-{i}", 64 * (t + 1)
                assert transport_save(transport, [key], size) == 1
                n, data = transport_load(transport, [key], size)  # this thread's reply
                assert n == 1 and data[0] == pattern(key, size)
                assert transport.exists([key, "absent"], None) == 1
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert not any(th.is_alive() for th in threads)
        assert errors == []
        session = transport._session
        assert session is not None and session.outstanding()[:3] == (0, 0, False)
        wait_for(lambda: anonymous_stats(server)["pinned"] == 0, 5.0, "pins released")
        assert anonymous_stats(server)["objects"] == n_threads * rounds
    finally:
        transport.close()


def test_timed_out_waiters_hand_the_socket_on(server):
    transport = _connect(server)
    try:
        session = transport._live(1.0)
        assert session.request(lambda rid: m.Ping(rid), 1.0) == m.Pong(1)
        server.pause()
        results: dict[str, object] = {}

        def wait(name: str, wait_s: float) -> None:
            try:
                results[name] = session.request(lambda rid: m.Ping(rid), wait_s)
            except Timeout:
                results[name] = "timeout"

        # The first leads and gives up early; the second (a follower) must then take
        # over the socket and get its reply once the daemon answers again.
        short = threading.Thread(target=wait, args=("short", 0.2))
        long = threading.Thread(target=wait, args=("long", 5.0))
        short.start()
        time.sleep(0.05)
        long.start()
        short.join(2)
        assert results.get("short") == "timeout"
        server.resume()
        long.join(5)
        assert isinstance(results.get("long"), m.Pong)
        # the late Pong of the short wait was read and dropped by someone
        wait_for(lambda: session.outstanding().late == 0, 5.0, "late reply read")
        assert session.request(lambda rid: m.Ping(rid), 1.0) == m.Pong(4)
    finally:
        server.resume()
        transport.close()


def test_an_idle_connection_notices_the_daemon_going_away(server):
    transport = _connect(server)
    try:
        session = transport._live(1.0)
        assert transport.health()
        server.kill()
        wait_for(lambda: session.broken is not None, 5.0, "the watcher saw the hang-up")
        assert not transport.health()
    finally:
        transport.close()


def test_a_loads_pins_go_back_with_the_next_frame(server, monkeypatch):
    """The Release of a load rides in front of the connection's next request (one send):
    with the watcher's delay made long, the pin waits for exactly that."""
    from ems.client import session as session_module
    monkeypatch.setattr(session_module, "RELEASE_DELAY_S", 30.0)
    transport = _connect(server)
    try:
        assert transport_save(transport, ["lazy"], 4096) == 1
        session = transport._live(1.0)
        session.outstanding()  # (the watcher is parked: nothing waits)
        n, _ = transport_load(transport, ["lazy"], 4096)
        assert n == 1
        assert session.outstanding().unreleased == 1
        assert anonymous_stats(server)["pinned"] == 1  # held until the next frame
        assert transport.exists(["lazy"], None) == 1  # carries the Release
        assert session.outstanding().unreleased == 0
        assert anonymous_stats(server)["pinned"] == 0
    finally:
        transport.close()


def test_a_loads_pins_go_back_within_the_delay_when_nothing_follows(server, monkeypatch):
    from ems.client import session as session_module
    monkeypatch.setattr(session_module, "RELEASE_DELAY_S", 0.05)
    transport = _connect(server)
    try:
        for round_ in range(3):  # the watcher parked, then woken by the first pin
            key = f"idle-{round_}"
            assert transport_save(transport, [key], 4096) == 1
            time.sleep(0.2)  # the watcher parks
            assert transport_load(transport, [key], 4096)[0] == 1
            wait_for(lambda: anonymous_stats(server)["pinned"] == 0, 5.0,
                     "pins given back without another request")
            assert transport._live(1.0).outstanding().unreleased == 0
    finally:
        transport.close()
