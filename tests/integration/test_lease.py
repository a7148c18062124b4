"""Small saves through the connection's lease: one round trip, visible to every
process when save() returns, write-once and BUSY as through a reservation, safe with
concurrent threads, freed with the connection, and fenced to the connection's own
lease."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from support.client_worker import Value, pattern
from support.itest_support import (
    anonymous_stats,
    anonymous_stats_when,
    record_sends,
    slow_copy,
    wait_for,
)

from ems import CcKvOption, Ems, EmsErrorCode, EmsException
from ems.client import copy as _copy
from ems.client.remote import RemoteTransport
from ems.client.session import Session
from ems.futures import Task
from ems.keys import v0_storage_keys
from ems.protocol import messages as m
from ems.server.handlers import lease_bytes

pytestmark = pytest.mark.integration

LEASE = 1 << 20  # the lease of a 64 MiB pool (min(1 MiB, capacity / 64))


def save(cc, keys, size, data=None):
    vals = [Value(size, pattern(k, size) if data is None else data) for k in keys]
    return cc.save(CcKvOption(timeout=5000), keys, [v.wrappers() for v in vals])


def test_lease_size_rule():
    assert lease_bytes(64 << 20) == LEASE
    assert lease_bytes(8 << 20) == 128 << 10
    assert lease_bytes(1000) == 0


def test_a_lease_save_is_visible_to_another_process_at_return(cc, server, workers):
    keys = [f"lease-{i}" for i in range(4)]
    for key in keys:  # one key per save: every one of them goes through the lease
        assert save(cc, [key], 4096).success == 1
        assert workers.run(server, "load", keys=[key], size=4096) == {"success": 1, "wrong": 0}
    stats = cc.statistics()
    assert stats.objects == 4 and stats.reserved == 0
    assert stats.leased_bytes == LEASE - 4 * 4096  # the keys were carved out of it
    assert stats.used_bytes == LEASE


def test_statistics_count_the_lease_and_disconnect_frees_it(server, client_env, workers):
    assert workers.run(server, "save", keys=["w1", "w2"], size=1000) == {"success": 2}
    stats = anonymous_stats(server)
    assert stats["leased_bytes"] == 0  # the worker's connection ended
    assert stats["used_bytes"] == 2 * 1024 and stats["objects"] == 2


def test_write_once_and_busy_through_the_lease(cc, server):
    assert save(cc, ["once"], 4096).success == 1
    assert save(cc, ["once"], 4096, data=b"\xee" * 4096).success == 1  # EXISTS: stored
    out = Value(4096)
    assert cc.load(CcKvOption(), ["once"], [out.wrappers()]).success == 1
    assert out.bytes() == pattern("once", 4096)  # the first value stays
    # Another connection holds a reservation of "held": the Put finds it BUSY.
    other = RemoteTransport.connect(server.socket_path, None, None, 3.0)
    try:
        held = v0_storage_keys(["held"])
        _, granted = other._call(lambda rid: m.Reserve(rid, held, [4096]), Task(0, "t"))
        assert granted.statuses == [0]
        before = cc.statistics()
        assert save(cc, ["held"], 4096).success == 1  # BUSY counts as stored
        after = cc.statistics()
        assert after.objects == before.objects and after.reserved == 1
        # the range went back to the free pool, not to the lease nor to an object
        assert after.used_bytes == before.used_bytes - 4096
        other._session.post(m.Abort([granted.tokens[0]]))
        wait_for(lambda: cc.statistics().reserved == 0, 5.0, "reservation aborted")
    finally:
        other.close()
        other._session = None


def test_concurrent_threads_share_one_lease(cc, server):
    n_threads, per_thread, size = 8, 150, 3000  # 1.2k saves: the lease renews often
    errors = []

    def run(t: int) -> None:
        try:
            for i in range(per_thread):
                key = f"t{t}-{i}"
                if save(cc, [key], size).success != 1:
                    errors.append(key)
        except Exception as exc:  # noqa: BLE001
            errors.append(repr(exc))
    threads = [threading.Thread(target=run, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    keys = [f"t{t}-{i}" for t in range(n_threads) for i in range(per_thread)]
    outs = [Value(size) for _ in keys]
    assert cc.load(CcKvOption(), keys, [o.wrappers() for o in outs]).success == len(keys)
    assert all(o.bytes() == pattern(k, size) for k, o in zip(keys, outs))
    stats = cc.statistics()
    assert stats.objects == len(keys)
    assert stats.leased_bytes <= 2 * LEASE
    assert stats.used_bytes == len(keys) * 3008 + stats.leased_bytes
    Ems.finalize()
    stats = anonymous_stats_when(server, lambda s: s["leased_bytes"] == 0, 5.0, "lease freed")
    assert stats["used_bytes"] == len(keys) * 3008


def test_small_saves_of_several_processes_with_eviction(make_server, workers):
    # a 1 MiB pool: 16 KiB leases, renewed every few saves while there is free space
    # (a lease evicts no 2 KiB objects for 16 KiB: then small saves reserve), while
    # keys are evicted
    server = make_server(capacity="1M")
    procs = [workers.start(server, "mixed", seed=seed, rounds=40, key_space=2000, size=2048,
                           batch=2) for seed in range(4)]
    results = [workers.result(p, timeout_s=90) for p in procs]
    assert sum(r["wrong"] for r in results) == 0
    assert sum(r["errors"] for r in results) == 0
    assert sum(r["saved"] for r in results) > 0
    stats = anonymous_stats(server)
    assert stats["leased_bytes"] == 0 and stats["reserved"] == 0
    assert stats["evictions"] > 0


def test_a_killed_writer_gives_its_lease_back(server, workers):
    proc = workers.start(server, "slow-save", keys=["k1", "k2"], size=4096)
    workers.wait_line(proc, "copying")
    assert anonymous_stats(server)["leased_bytes"] == LEASE
    assert anonymous_stats(server)["reserved"] == 0  # no reservation: the lease
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    stats = anonymous_stats_when(server, lambda s: s["used_bytes"] == 0, 5.0, "space back")
    assert stats["leased_bytes"] == 0 and stats["objects"] == 0


def test_an_aborted_lease_save_gives_its_range_back(cc, server, monkeypatch):
    real = _copy.copy_bytes

    def slow(dst, src, n):
        time.sleep(0.3)
        real(dst, src, n)
    monkeypatch.setattr(_copy, "copy_bytes", slow)
    with pytest.raises(EmsException) as info:
        cc.save(CcKvOption(timeout=100), ["gone"], [Value(4096, b"x" * 4096).wrappers()])
    assert info.value.status_code() is EmsErrorCode.EMS_IO_TIMEOUT
    monkeypatch.setattr(_copy, "copy_bytes", real)
    assert save(cc, ["kept"], 4096).success == 1
    # "gone"'s range went back to the pool: only the lease's rest and "kept" are used
    stats = wait_for(lambda: (lambda s: s if s.used_bytes == LEASE - 4096 else None)(
        cc.statistics()), 5.0, "the aborted range freed")
    assert stats.objects == 1 and stats.leased_bytes == LEASE - 2 * 4096


def _raw_session(server) -> Session:
    return Session.open(server.socket_path, None, None, 3.0, gen=1)


@pytest.mark.parametrize("where", ["no-lease", "outside", "overlap"])
def test_a_client_that_carves_outside_its_lease_is_cut_off(cc, server, where):
    assert save(cc, ["victim"], 4096).success == 1
    session = _raw_session(server)
    try:
        if where == "no-lease":
            put = lambda rid: m.Put(rid, ["evil"], [0], [4096], False)  # noqa: E731
        else:
            leased = session.request(lambda rid: m.Lease(rid), 3.0)
            assert isinstance(leased, m.Leased) and leased.size == LEASE
            if where == "outside":
                off = (leased.offset + LEASE) % (64 << 20)
                put = lambda rid: m.Put(rid, ["evil"], [off], [4096], False)  # noqa: E731
            else:
                o = leased.offset
                put = lambda rid: m.Put(rid, ["e1", "e2"], [o, o + 64], [4096, 64],  # noqa: E731
                                        False)
        with pytest.raises(EmsException) as info:
            session.request(put, 3.0)
        assert info.value.status_code() is EmsErrorCode.EMS_IO_ERROR
        assert "not a free range" in info.value.message()
    finally:
        session.close()
        if session.segment is not None:
            session.segment.close()
    # the offender's lease is freed, nothing was carved, the others go on
    stats = anonymous_stats_when(server, lambda s: s["leased_bytes"] == LEASE - 4096, 5.0,
                                 "the offender's lease freed")
    assert stats["objects"] == 1
    out = Value(4096)
    assert cc.load(CcKvOption(), ["victim"], [out.wrappers()]).success == 1
    assert out.bytes() == pattern("victim", 4096)


def test_after_fork_the_child_uses_a_lease_of_its_own(cc, server):
    assert save(cc, ["parent"], 4096).success == 1
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            # the first save reconnects and takes a lease of its own; both go through it
            ok = save(cc, ["child"], 4096).success == 1 and save(cc, ["child2"], 4096).success
            code = 0 if ok and cc.statistics().leased_bytes == 2 * LEASE - 3 * 4096 else 2
        finally:
            os.write(w, bytes([code]))
            os._exit(0)
    os.close(w)
    code = os.read(r, 1)
    os.close(r)
    os.waitpid(pid, 0)
    assert code == b"\0"
    assert save(cc, ["parent2"], 4096).success == 1
    out = Value(4096)
    assert cc.load(CcKvOption(), ["child"], [out.wrappers()]).success == 1
    assert out.bytes() == pattern("child", 4096)


def test_small_saves_go_in_one_step(cc, server, monkeypatch):
    """A small save cuts its range, copies and puts: one request (Put); only the first
    one of a connection, which finds no lease, asks for one (Lease) first. A save of
    more than a quarter of the lease goes Reserve + Commit."""
    session = cc._transport._session
    sent: list[str] = []
    send = session.send

    def recording(msg_for, wait_s):
        def build(rid):
            msg = msg_for(rid)
            code = msg[0] if type(msg) is list else msg.TYPE
            sent.append(m.MESSAGES[code].__name__)
            return msg
        return send(build, wait_s)
    monkeypatch.setattr(session, "send", recording)
    keys = [f"one-{i}" for i in range(5)]
    for key in keys:
        assert save(cc, [key], 4096).success == 1
    assert sent == ["Lease"] + ["Put"] * 5
    big = LEASE  # more than a quarter of the lease: reserve + commit
    assert save(cc, ["big"], big).success == 1
    assert sent[6:] == ["Reserve", "Commit"]
    outs = [Value(4096) for _ in keys]
    assert cc.load(CcKvOption(), keys, [o.wrappers() for o in outs]).success == 5
    assert all(o.bytes() == pattern(k, 4096) for k, o in zip(keys, outs))
    stats = cc.statistics()
    assert stats.objects == 6 and stats.reserved == 0


def test_slices_of_a_large_save():
    from ems.client.remote import _chunks, _slices
    assert _chunks(24, 8) == [(0, 8), (8, 16), (16, 24)]
    assert _chunks(10, 4096) == [(0, 10)]  # one request: one call of the mover
    assert _chunks(10, 3) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert _chunks(0, 10) == []
    mib = 1 << 20  # a V0 save: by bytes too (``Request.save_slice_bytes``)
    assert _slices([mib] * 40, 4096, 16 * mib) == [(0, 16), (16, 32), (32, 40)]
    assert _slices([mib] * 40, 10, 16 * mib) == [(0, 10), (10, 20), (20, 30), (30, 40)]
    assert _slices([20 * mib, mib], 4096, 16 * mib) == [(0, 1), (1, 2)]  # one too large
    assert _slices([], 4096, 16 * mib) == []


@pytest.mark.parametrize("max_keys, n, commits", [(8, 24, 3), (None, 40, 1)])
def test_a_large_save_pipelines_its_reserves(cc, server, monkeypatch, max_keys, n, commits):
    """24 x 1 MiB in slices of 8 keys (the daemon's max_keys, made small), or 40 x 1 MiB
    through V0 in slices of 16, 16 and 8 MiB (``SAVE_SLICE_BYTES``): three Reserves,
    each next one sent before the copy of the slice before it, then the Commits (of
    max_keys each) after the last copy; bit-exact."""
    from ems.client.movers import SAVE_SLICE_BYTES

    assert SAVE_SLICE_BYTES == 16 << 20
    session = cc._transport._session
    if max_keys is not None:
        monkeypatch.setattr(session, "max_keys", max_keys)
    sent = record_sends(monkeypatch, session)
    order: list[str] = []
    copy = _copy.copy_bytes

    def tracing(dst, src, size):
        if not order or order[-1] != f"copy after {len(sent)} sends":
            order.append(f"copy after {len(sent)} sends")
        return copy(dst, src, size)
    monkeypatch.setattr(_copy, "copy_bytes", tracing)
    keys = [f"big-{i}" for i in range(n)]
    assert save(cc, keys, 1 << 20).success == n
    assert sent == ["Reserve"] * 3 + ["Commit"] * commits
    # slice 1 copied with Reserve 2 out, slice 2 with Reserve 3 out, slice 3 after all
    assert order == ["copy after 2 sends", "copy after 3 sends"]
    monkeypatch.setattr(_copy, "copy_bytes", copy)
    outs = [Value(1 << 20) for _ in keys]
    assert cc.load(CcKvOption(), keys, [o.wrappers() for o in outs]).success == n
    assert all(o.bytes() == pattern(k, 1 << 20) for k, o in zip(keys, outs))
    assert anonymous_stats(server)["reserved"] == 0


def test_a_large_save_that_times_out_mid_copy_leaves_nothing(cc, server, monkeypatch):
    """The deadline passes while slice 2 is copied (Reserve 3 in flight): the call
    raises EMS_IO_TIMEOUT, no key becomes visible, every reservation is given back
    (slices 1-2 aborted, slice 3's late Granted undone when it is read)."""
    monkeypatch.setattr(cc._transport._session, "max_keys", 8)
    copy = _copy.copy_bytes
    slow_copy(monkeypatch, 10, 0.5)  # the 10th copy: in slice 2
    keys = [f"late-{i}" for i in range(24)]
    vals = [Value(1 << 20, pattern(k, 1 << 20)) for k in keys]
    with pytest.raises(EmsException) as err:
        cc.save(CcKvOption(timeout=300), keys, [v.wrappers() for v in vals])
    assert err.value.status_code() is EmsErrorCode.EMS_IO_TIMEOUT
    monkeypatch.setattr(_copy, "copy_bytes", copy)
    anonymous_stats_when(server, lambda s: s["reserved"] == 0, 5.0,
                         "every reservation given back")
    outs = [Value(1 << 20) for _ in keys]
    assert cc.load(CcKvOption(), keys, [o.wrappers() for o in outs]).success == 0


def test_every_slice_copies_within_the_reservation_ttl(cc, server, monkeypatch):
    """A save without a deadline (timeout 0) whose first slice is stored already: the
    NEW keys of a later slice still copy under the reservation TTL's bound (the task
    gets a deadline), so a stuck copy cannot outlive its reservations."""
    from ems.client.movers import V0Mover
    from ems.keys import Request

    session = cc._transport._session
    monkeypatch.setattr(session, "max_keys", 8)
    size = LEASE // 4  # a save of two values is past a quarter of the lease
    keys = [f"ttl-{i}" for i in range(16)]
    assert save(cc, keys[:8], size).success == 8  # slice 1: EXISTS only
    vals = [Value(size, pattern(k, size)) for k in keys]
    req = Request("save", v0_storage_keys(keys), [size] * 16,
                  V0Mover([[(w.data_ptr, w.length) for w in v.wrappers()] for v in vals]),
                  CcKvOption(timeout=0))
    task = Task(0, "save", 16)
    assert task.deadline is None
    before = time.monotonic()
    assert all(cc._transport.save(req, task))
    ttl = session.welcome.reservation_ttl_s
    assert task.deadline is not None and before < task.deadline <= before + ttl
