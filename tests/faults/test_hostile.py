"""More of a hostile or broken host: slow-loris clients, connection churn (fds and RSS
back to their baseline), and a soak of several processes with evictions and short
timeouts that checks every loaded byte and that nothing lands after a call raised."""

from __future__ import annotations

import threading
import time

import pytest
from hostile import RawClient, fds, rss_bytes
from support.itest_support import anonymous_stats, anonymous_stats_when

from ems.client.remote import RemoteTransport
from ems.protocol import HEADER, PROTOCOL_VERSION, encode
from ems.protocol import messages as m

pytestmark = pytest.mark.integration


def test_slow_loris_clients_do_not_slow_the_others(make_server, figures):
    server = make_server(capacity="16M", extra_args=["--limit", "handshake_timeout_s=1"])
    hello = encode(m.Hello(None, False))
    pre_auth = [RawClient(server.socket_path, hello=False) for _ in range(8)]
    post_auth = [RawClient(server.socket_path) for _ in range(8)]
    frame = HEADER.pack(b"EM", PROTOCOL_VERSION, 0, 4096) + b"\x90" * 4096
    other = RemoteTransport.connect(server.socket_path, None, None, 3.0)
    stop = threading.Event()

    def trickle() -> None:  # one byte per connection every 20 ms
        i = 0
        while not stop.is_set() and i < len(hello) - 1:
            for c in pre_auth:
                c.send(hello[i:i + 1])
            for c in post_auth:
                c.send(frame[i:i + 1])
            i += 1
            time.sleep(0.02)
    t = threading.Thread(target=trickle)
    t.start()
    try:
        pings = []
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.5:
            p0 = time.monotonic()
            assert other.health()
            pings.append(time.monotonic() - p0)
            time.sleep(0.01)
    finally:
        stop.set()
        t.join()
    figures.update(ping_p50_ms=round(1000 * sorted(pings)[len(pings) // 2], 2),
                   ping_max_ms=round(1000 * max(pings), 2))
    assert max(pings) < 0.2
    # handshakes never finished: closed after handshake_timeout_s (the timer's tick)
    assert all(c.closed_by_daemon(3.0) for c in pre_auth)
    for c in [*pre_auth, *post_auth]:
        c.close()
    other.close()


def test_connection_churn_returns_fds_and_rss_to_baseline(make_server, figures):
    server = make_server(capacity="16M")
    pid = server.pid
    warm = [RemoteTransport.connect(server.socket_path, None, None, 3.0) for _ in range(20)]
    for t in warm:
        t.close()
    time.sleep(0.2)
    fds0, rss0 = fds(pid), rss_bytes(pid)
    t0 = time.monotonic()
    for _ in range(15):  # 300 sessions: opened in bursts of 20, closed, again
        batch = [RemoteTransport.connect(server.socket_path, None, None, 3.0)
                 for _ in range(20)]
        peak = fds(pid)
        for t in batch:
            t.close()
    churn_s = time.monotonic() - t0
    deadline = time.monotonic() + 5
    while fds(pid) > fds0 and time.monotonic() < deadline:
        time.sleep(0.05)
    fds1, rss1 = fds(pid), rss_bytes(pid)
    figures.update(sessions=300, churn_s=round(churn_s, 2), fds_before=fds0, fds_peak=peak,
                   fds_after=fds1, rss_before_mib=round(rss0 / 2**20, 1),
                   rss_after_mib=round(rss1 / 2**20, 1))
    assert fds1 == fds0
    assert rss1 - rss0 < 4 << 20, (rss0, rss1)
    assert server.stats()["server"]["connections"] <= 1  # (this stats session)


def test_soak_several_processes_evictions_and_timeouts(make_server, workers, figures):
    """Random batches from three processes over a pool a third the size of the key
    space; one of them copies slower than its 8 ms deadline (timeouts mid-copy): every
    loaded byte is the key's pattern, and no byte lands in a load's buffers after it
    raised."""
    server = make_server(capacity="1M")
    procs = [workers.start(server, "mixed", seed=seed, rounds=10, key_space=96, size=32768,
                           batch=6, **(dict(timeout_ms=8, slow_copy_ms=1) if seed == 2
                                       else dict(timeout_ms=20000)))
             for seed in range(3)]
    results = [workers.result(p, timeout_s=120) for p in procs]
    stats = server.stats()["tenants"]["(anonymous)"]
    figures.update(saved=sum(r["saved"] for r in results),
                   loaded=sum(r["loaded"] for r in results),
                   errors=sum(r["errors"] for r in results),
                   codes=[r.get("codes", {}) for r in results],
                   evictions=stats["evictions"])
    assert sum(r["wrong"] for r in results) == 0
    assert sum(r["late"] for r in results) == 0
    assert sum(r["errors"] for r in results[:2]) == 0  # the patient ones never fail
    for r in results:  # the hasty one fails only by its deadline
        assert set(r.get("codes", {})) <= {"EMS_IO_TIMEOUT"}, r
    assert results[2]["errors"] > 0  # its deadlines did strike mid-copy
    assert sum(r["loaded"] for r in results) > 0 and stats["evictions"] > 0


def test_client_sigkill_mid_load_gives_its_pins_back(make_server, workers):
    server = make_server(capacity="16M")
    keys = [f"pinned{i}" for i in range(4)]
    assert workers.run(server, "save", keys=keys, size=65536)["success"] == 4
    proc = workers.start(server, "slow-load", keys=keys, size=65536)
    workers.wait_line(proc, "copying")
    assert anonymous_stats(server)["pinned"] == 4  # pinned while it copies
    proc.kill()
    proc.wait()
    anonymous_stats_when(server, lambda s: s["pinned"] == 0, 5.0, "pins given back")
    assert workers.run(server, "load", keys=keys, size=65536) == {"success": 4, "wrong": 0}
