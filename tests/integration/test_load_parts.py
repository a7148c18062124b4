"""A load in parts (``RemoteTransport.load``): a real daemon pins part k + 1 and
k + 2 while the client copies part k; the first part that comes back short ends the
load with its leading hits; the parts still in flight are undone when they come; a
deadline that passes during a copy leaves no pin behind; a disk tier's misses come
back in parts too, byte for byte. The fixtures check at teardown that the daemon
holds no pin and no reservation."""

from __future__ import annotations

import time

import pytest
from support.client_worker import Value, pattern
from support.itest_support import anonymous_stats_when, record_sends, slow_copy

from ems import CcConfig, CcKvOption, Ems, EmsConfig, EmsErrorCode, EmsException
from ems.client import remote
from ems.client.movers import V0Mover
from ems.client.remote import _parts

pytestmark = pytest.mark.integration

MIB = 1 << 20


def test_parts_of_a_load():
    # the last part of several cut in halves down to 2 MiB (the load's tail)
    assert _parts([MIB] * 24, 4096, 8 * MIB) == [(0, 8), (8, 16), (16, 20), (20, 22),
                                                 (22, 24)]
    assert _parts([MIB] * 64, 4096, 16 * MIB)[3:] == [(48, 56), (56, 60), (60, 62), (62, 64)]
    assert _parts([MIB] * 10, 4, 8 * MIB) == [(0, 4), (4, 8), (8, 10)]  # max_keys too
    assert _parts([20 * MIB, MIB, MIB], 4096, 8 * MIB) == [(0, 1), (1, 3)]  # one too large
    assert _parts([MIB] * 9, 4096, 8 * MIB) == [(0, 8), (8, 9)]  # a last key stays whole
    assert _parts([MIB] * 8, 4096, 8 * MIB) == [(0, 8)]  # one part: not cut
    assert _parts([100] * 5, 4096, 8 * MIB) == [(0, 5)]  # small: one request, one copy
    assert _parts([], 4096, 8 * MIB) == [(0, 0)]  # an empty load still asks once


def _save(cc, keys, size=MIB):
    vals = [Value(size, pattern(k, size)) for k in keys]
    assert cc.save(CcKvOption(timeout=5000), keys, [v.wrappers() for v in vals]).success \
        == len(keys)


def _load(cc, keys, size=MIB, timeout_ms=5000):
    outs = [Value(size) for _ in keys]
    got = cc.load(CcKvOption(timeout=timeout_ms), keys, [o.wrappers() for o in outs]).success
    return got, outs


def _trace(monkeypatch, session) -> list[str]:
    """What the client did, in order: each request sent, and each call of the mover
    that copies a part out (``copy``)."""
    events = record_sends(monkeypatch, session)
    from_pool = V0Mover.from_pool

    def tracing(self, items, locs, task):
        events.append("copy")
        return from_pool(self, items, locs, task)
    monkeypatch.setattr(V0Mover, "from_pool", tracing)
    return events


def test_a_load_pins_the_next_parts_while_it_copies_one(cc, server, monkeypatch):
    """24 x 1 MiB in parts of 8, 8, 4, 2 and 2 MiB, two parts' worth (16 MiB) in
    flight: Acquire 1 and 2 go out, then the first reply sends the three small parts
    of the tail (together no more than the part answered) before its copy; bit-exact;
    nothing stays pinned."""
    keys = [f"part-{i}" for i in range(24)]
    _save(cc, keys)
    monkeypatch.setattr(remote, "LOAD_PART_BYTES", 8 * MIB)
    events = _trace(monkeypatch, cc._transport._session)
    got, outs = _load(cc, keys)
    assert got == 24
    assert events == ["Acquire"] * 2 + ["Acquire"] * 3 + ["copy"] * 5
    assert all(o.bytes() == pattern(k, MIB) for k, o in zip(keys, outs))
    anonymous_stats_when(server, lambda s: s["pinned"] == 0, 5.0, "every pin released")


def test_small_values_keep_two_parts_in_flight(make_server, client_env, monkeypatch):
    """Parts cut by the daemon's max_keys (4 keys of 4 KiB each): their bytes would let
    every part fly at once, their keys keep two in flight, as two whole parts of
    max_keys do: Acquire 1 and 2, then one per reply, before its copy."""
    server = make_server(extra_args=["--limit", "max_keys_per_request=4"])
    client_env(server)
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="few")))
    try:
        cc = Ems.get_cc()
        keys = [f"few-{i}" for i in range(16)]
        _save(cc, keys, size=4096)
        events = _trace(monkeypatch, cc._transport._session)
        got, outs = _load(cc, keys, size=4096)
        assert got == 16
        assert events == ["Acquire", "Acquire", "Acquire", "copy", "Acquire", "copy",
                          "copy", "copy"]
        assert all(o.bytes() == pattern(k, 4096) for k, o in zip(keys, outs))
    finally:
        Ems.finalize()


def test_a_part_that_comes_back_short_ends_the_load(cc, server, monkeypatch):
    """The 12th key is missing: part 2 pins 3 of its 8, the load returns 11 (its leading
    hits), the bytes of those 11 are exact, the part in flight after it is released
    when its reply comes, and nothing stays pinned."""
    keys = [f"short-{i}" for i in range(24)]
    _save(cc, keys[:11] + keys[12:])
    monkeypatch.setattr(remote, "LOAD_PART_BYTES", 8 * MIB)
    got, outs = _load(cc, keys)
    assert got == 11
    assert all(o.bytes() == pattern(k, MIB) for k, o in zip(keys[:11], outs))
    assert all(o.bytes() == bytes(MIB) for o in outs[11:])  # nothing after the hole
    anonymous_stats_when(server, lambda s: s["pinned"] == 0, 5.0, "every pin released")


def test_a_deadline_during_a_copy_leaves_no_pin(cc, server, monkeypatch):
    """The deadline passes while part 2 is copied (part 3 pinned and in flight): the
    call raises EMS_IO_TIMEOUT, no byte lands after it returned, and every pin of
    every part is released."""
    keys = [f"late-{i}" for i in range(24)]
    _save(cc, keys)
    monkeypatch.setattr(remote, "LOAD_PART_BYTES", 8 * MIB)
    calls = slow_copy(monkeypatch, 10, 0.5)  # the 10th copy: in part 2
    outs = [Value(MIB) for _ in keys]
    with pytest.raises(EmsException) as err:
        cc.load(CcKvOption(timeout=300), keys, [o.wrappers() for o in outs])
    assert err.value.status_code() is EmsErrorCode.EMS_IO_TIMEOUT
    returned = calls[0]
    time.sleep(0.2)
    assert calls[0] == returned  # no copy after the call returned
    assert all(o.bytes() == bytes(MIB) for o in outs[16:])  # part 3 never copied
    anonymous_stats_when(server, lambda s: s["pinned"] == 0, 5.0, "every pin released")


def test_a_load_from_disk_comes_back_in_parts(make_server, client_env, tmp_path,
                                              monkeypatch):
    """48 MiB through 16 MiB of shared memory: the evicted objects come back from the
    disk tier in parts of 4 MiB, each part's fetch beside the copy of the one before;
    every byte exact, the disk's hits counted."""
    server = make_server(capacity="16M", extra_args=[
        "--disk", str(tmp_path / "disk"), "--disk-checkpoint-s", "60"])
    client_env(server)
    Ems.init(EmsConfig(cc_config=CcConfig(rank_id=0, device_id=0, model_id="parts")))
    try:
        cc = Ems.get_cc()
        keys = [f"disk-{i}" for i in range(48)]
        for lo in range(0, 48, 4):
            _save(cc, keys[lo:lo + 4])

        def settled(stats):
            d = stats["disk"]
            return d["objects"] >= 48 and not d["queued_write_bytes"] and \
                not d["inflight_write_bytes"]
        deadline = time.monotonic() + 30
        while not settled(server.stats()):
            assert time.monotonic() < deadline, "the disk tier never settled"
            time.sleep(0.05)
        monkeypatch.setattr(remote, "LOAD_PART_BYTES", 4 * MIB)
        got, outs = _load(cc, keys[:12], timeout_ms=20000)  # evicted long ago: on disk
        assert got == 12
        assert all(o.bytes() == pattern(k, MIB) for k, o in zip(keys, outs))
        assert server.stats()["tenants"]["(anonymous)"]["tiers"]["disk"]["hits"] >= 12
    finally:
        Ems.finalize()
