"""Faults: eviction under pressure with readers pinned, writers that die or hang, a
daemon that hangs, dies mid-load or restarts. Nothing leaks, no byte lands in a
caller's buffer after its call returned or raised, and the client recovers alone."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from hostile import RawClient
from support.client_worker import Value, pattern
from support.itest_support import anonymous_stats, anonymous_stats_when, wait_for

from ems import CcConfig, CcKvOption, Ems, EmsConfig, EmsErrorCode, EmsException
from ems.client import copy as _copy
from ems.keys import v0_storage_keys as storage
from ems.protocol import encode
from ems.protocol import messages as m

pytestmark = pytest.mark.integration

SENTINEL = 0x5A


def sentinel_value(size: int) -> Value:
    return Value(size, bytes([SENTINEL]) * size)


def init_cc(server, client_env):
    client_env(server)
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="itest")))
    return Ems.get_cc()


def save_keys(cc, keys, size, timeout_ms=5000):
    vals = [Value(size, pattern(k, size)) for k in keys]
    return cc.save(CcKvOption(timeout=timeout_ms), keys, [v.wrappers() for v in vals])


class SlowCopies:
    """Make every copy of this process take ``delay_s`` (the product's copy path)."""

    def __init__(self, monkeypatch, delay_s: float) -> None:
        self.started = threading.Event()
        real = _copy.copy_bytes

        def slow(dst, src, n):
            self.started.set()
            time.sleep(delay_s)
            real(dst, src, n)
        monkeypatch.setattr(_copy, "copy_bytes", slow)


# ---------------------------------------------------------------- eviction

def test_eviction_never_takes_pinned_objects(make_server, client_env):
    server = make_server(capacity="1M")
    cc = init_cc(server, client_env)
    size = 128 << 10
    old = [f"old{i}" for i in range(8)]
    assert save_keys(cc, old, size).success == 8  # the pool is full

    reader = RawClient(server.socket_path, map_pool=True)
    try:
        # A reader of another process pins old0..old3 (as a load does while copying).
        pins = reader.request([m.Acquire.TYPE, 1, storage(old[:4]), [size] * 4])
        assert isinstance(pins, m.Pinned) and len(pins.tokens) == 4
        new = [f"new{i}" for i in range(8)]
        res = save_keys(cc, new, size)
        assert res.success == 4  # room only where unpinned objects were evicted
        stats = anonymous_stats(server)
        assert stats["evictions"] == 4 and stats["pinned"] == 4
        assert reader.pool is not None
        for key, offset in zip(old[:4], pins.offsets):  # the pinned bytes were not reused
            assert reader.pool[offset:offset + size] == pattern(key, size)
        reader.send(encode(m.Release(pins.tokens)))
        wait_for(lambda: anonymous_stats(server)["pinned"] == 0, 5.0, "pins released")
        assert save_keys(cc, new, size).success == 8  # now the old ones can go
        transport = cc._transport
        assert transport.exists(storage(old[:4]), None) == 0
        assert transport.exists(storage(new), [size] * 8) == 8
    finally:
        reader.close()


def test_a_value_bigger_than_the_pool_is_refused(make_server, client_env):
    server = make_server(capacity="1M")
    cc = init_cc(server, client_env)
    res = save_keys(cc, ["small", "huge"], 2 << 20)
    assert (res.success, res.total) == (0, 2)
    assert anonymous_stats(server)["used_bytes"] == 0


# ---------------------------------------------------------------- writers

def test_client_sigkill_mid_save_gives_the_space_back(make_server, workers):
    server = make_server(capacity="8M", reservation_ttl_s=2.0)
    proc = workers.start(server, "slow-save", keys=[f"w{i}" for i in range(4)], size=65536)
    workers.wait_line(proc, "copying")
    assert anonymous_stats(server)["reserved"] == 4
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    t0 = time.monotonic()
    stats = anonymous_stats_when(server, lambda s: s["used_bytes"] == 0, 2.0 + 1.0,
                                 "space back within the TTL")
    assert time.monotonic() - t0 <= 3.0
    assert stats["reserved"] == 0 and stats["objects"] == 0


def test_a_stuck_writer_loses_its_reservation_after_the_ttl(make_server, workers):
    server = make_server(capacity="8M", reservation_ttl_s=1.0)
    proc = workers.start(server, "slow-save", keys=[f"w{i}" for i in range(4)], size=65536)
    workers.wait_line(proc, "copying")
    os.kill(proc.pid, signal.SIGSTOP)  # connection open, writer frozen
    try:
        t0 = time.monotonic()
        stats = anonymous_stats_when(server, lambda s: s["reserved"] == 0, 5.0,
                                     "reservations expired")
        assert 0.5 <= time.monotonic() - t0 <= 4.0
        assert stats["used_bytes"] == 0 and stats["expired_reservations"] == 4
        assert "older than 1.0 s" in server.log()
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


def test_a_save_slower_than_the_ttl_stops_before_its_space_is_reused(make_server,
                                                                      client_env, monkeypatch):
    server = make_server(capacity="8M", reservation_ttl_s=2.0)
    cc = init_cc(server, client_env)
    SlowCopies(monkeypatch, 0.15)  # 16 buffers: 2.4 s, past the 2 s TTL
    keys = [f"s{i}" for i in range(8)]
    # 64 KiB in all: more than a quarter of the 128 KiB lease, so a real reservation
    # (a save through the lease has no TTL: the lease is the connection's until it ends)
    vals = [Value(8192, pattern(k, 8192)) for k in keys]
    t0 = time.monotonic()
    with pytest.raises(EmsException) as info:  # timeout=0: no deadline of its own
        cc.save(CcKvOption(timeout=0), keys, [v.wrappers() for v in vals])
    assert info.value.status_code() is EmsErrorCode.EMS_IO_TIMEOUT
    # it stopped copying at 80% of the TTL, before the daemon could reuse the space
    assert 1.6 <= time.monotonic() - t0 < 2.0
    stats = anonymous_stats_when(server, lambda s: s["reserved"] == 0, 3.0, "aborted")
    assert stats["objects"] == 0


# ---------------------------------------------------------------- the daemon

def test_daemon_killed_while_a_load_waits(server, client_env):
    cc = init_cc(server, client_env)
    size = 4096
    assert save_keys(cc, ["a", "b"], size).success == 2
    outs = [sentinel_value(size) for _ in range(2)]
    server.pause()  # the acquire will wait for an answer
    fut = cc.async_load(CcKvOption(timeout=5000), ["a", "b"], [o.wrappers() for o in outs])
    time.sleep(0.3)
    t0 = time.monotonic()
    server.kill()
    with pytest.raises(EmsException) as info:
        fut.result()
    assert info.value.status_code() is EmsErrorCode.EMS_IO_ERROR
    assert time.monotonic() - t0 < 2.0
    time.sleep(0.3)
    assert all(o.bytes() == bytes([SENTINEL]) * size for o in outs)
    assert not Ems.check_health()


def test_daemon_killed_mid_copy_no_late_writes(server, client_env, monkeypatch):
    cc = init_cc(server, client_env)
    size = 4096
    keys = [f"c{i}" for i in range(6)]
    assert save_keys(cc, keys, size).success == 6
    slow = SlowCopies(monkeypatch, 0.1)  # 12 buffers: about 1.2 s of copying
    outs = [sentinel_value(size) for _ in keys]
    t0 = time.monotonic()
    fut = cc.async_load(CcKvOption(timeout=4000), keys, [o.wrappers() for o in outs])
    assert slow.started.wait(5.0)
    server.kill()
    try:  # the copy reads this process's own mapping: it may finish, or stop cleanly
        res = fut.result()
    except EmsException as exc:
        assert exc.status_code() in (EmsErrorCode.EMS_IO_ERROR, EmsErrorCode.EMS_IO_TIMEOUT)
        done = 0
    else:
        done = res.success
    assert time.monotonic() - t0 < 4.0 + 0.5
    snapshot = [o.bytes() for o in outs]
    for k, got in zip(keys[:done], snapshot):
        assert got == pattern(k, size)
    time.sleep(0.5)
    assert [o.bytes() for o in outs] == snapshot  # nothing written after the call


def test_a_timed_out_load_writes_nothing_later(server, client_env, monkeypatch):
    cc = init_cc(server, client_env)
    size = 4096
    keys = [f"t{i}" for i in range(8)]
    assert save_keys(cc, keys, size).success == 8
    SlowCopies(monkeypatch, 0.15)
    outs = [sentinel_value(size) for _ in keys]
    t0 = time.monotonic()
    with pytest.raises(EmsException) as info:
        cc.load(CcKvOption(timeout=400), keys, [o.wrappers() for o in outs])
    assert info.value.status_code() is EmsErrorCode.EMS_IO_TIMEOUT
    assert time.monotonic() - t0 < 0.4 + 0.5
    snapshot = [o.bytes() for o in outs]
    # the client gives its pins back once its copy has stopped (RemoteTransport.load)
    wait_for(lambda: anonymous_stats(server)["pinned"] == 0, 5.0, "pins released")
    assert [o.bytes() for o in outs] == snapshot


def test_a_late_reply_after_a_timeout_is_undone(server, client_env):
    cc = init_cc(server, client_env)
    size = 4096
    assert save_keys(cc, ["late"], size).success == 1
    out = sentinel_value(size)
    server.pause()
    try:
        t0 = time.monotonic()
        with pytest.raises(EmsException) as info:
            cc.load(CcKvOption(timeout=300), ["late"], [out.wrappers()])
        assert info.value.status_code() is EmsErrorCode.EMS_IO_TIMEOUT
        assert time.monotonic() - t0 < 1.0
        # bigger than a quarter of the lease: a Reserve, whose late grant is aborted
        # (a Put that timed out may still store its key, whole: see test_lease.py)
        big = 512 << 10
        fut = cc.async_save(CcKvOption(timeout=300), ["late2"], [Value(big, b"x" * big)
                                                                .wrappers()])
        with pytest.raises(EmsException):
            fut.result()
    finally:
        server.resume()  # the daemon now answers both: the client must undo them
    stats = anonymous_stats_when(server, lambda s: not s["pinned"] and not s["reserved"], 5.0,
                                 "late pin and reservation undone")
    assert stats["objects"] == 1
    assert out.bytes() == bytes([SENTINEL]) * size
    assert Ems.check_health()


def test_daemon_restart_the_client_recovers_by_itself(server, client_env):
    cc = init_cc(server, client_env)
    size = 4096
    assert save_keys(cc, ["before"], size).success == 1
    server.pause()
    fut = cc.async_save(CcKvOption(timeout=5000), ["inflight"],
                        [Value(size, b"y" * size).wrappers()])
    time.sleep(0.2)
    server.kill()  # in flight: raises EMS_IO_ERROR
    with pytest.raises(EmsException) as info:
        fut.result()
    assert info.value.status_code() is EmsErrorCode.EMS_IO_ERROR
    assert not Ems.check_health()
    with pytest.raises(EmsException) as info:  # while it is down
        save_keys(cc, ["down"], size)
    assert info.value.status_code() is EmsErrorCode.EMS_IO_ERROR

    server.start()  # a new daemon on the same (stale) socket
    wait_for(Ems.check_health, 5.0, "health back")
    assert Ems.get_cc() is cc  # same process, same objects: no re-init
    assert save_keys(cc, ["after"], size).success == 1
    out = Value(size)
    assert cc.load(CcKvOption(), ["after"], [out.wrappers()]).success == 1
    assert out.bytes() == pattern("after", size)
    miss = Value(size)  # the old daemon's data died with it
    assert cc.load(CcKvOption(), ["before"], [miss.wrappers()]).success == 0
    assert cc.statistics().objects == 1


def test_hung_daemon_health_is_false_then_true(server, client_env):
    init_cc(server, client_env)
    assert Ems.check_health()
    server.pause()
    try:
        t0 = time.monotonic()
        assert not Ems.check_health()
        assert time.monotonic() - t0 < 2.0
    finally:
        server.resume()
    assert Ems.check_health()
