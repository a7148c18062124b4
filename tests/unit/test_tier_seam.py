"""The tier seam (``ems.server.tiers``) driven by the request handlers, with two tiers
of this test's own that keep their values in dicts: a load walks shared memory, then
each tier in order; ``read_local_only`` walks only the local ones; counts add up; new
objects are told to the tiers that want them; saves through go to the tier that takes
them and leave no local copy; evictions reach the tiers that listen."""

from __future__ import annotations

import collections
import socket
from typing import Callable, ClassVar, Optional, Sequence

import pytest
from support.replies import Replies

from ems.protocol import messages as m
from ems.server.config import Limits
from ems.server.handlers import Handlers
from ems.server.memory import SegmentMaps
from ems.server.session import Session
from ems.server.tenants import Tenant, TenantSpec
from ems.server.tiers import Extent, Tier


class DictTier(Tier):
    """A tier holding values in a dict; fills the pool synchronously, or later."""

    wants_stored: ClassVar[bool] = True
    wants_evicted: ClassVar[bool] = True

    def __init__(self, name: str, local: bool, maps: SegmentMaps, defer: bool = False):
        self.tier_name, self.is_local, self.maps, self.defer = name, local, maps, defer
        self.values: dict[str, bytes] = {}
        self.stored_keys: list[str] = []
        self.evicted_keys: list[str] = []
        self.pending: list[Callable[[], None]] = []
        self.asked: list[list[str]] = []

    @property
    def local(self) -> bool:  # type: ignore[override]
        return self.is_local

    def fill(self, tenant, keys, sizes, deadline, done) -> bool:
        self.asked.append(list(keys))
        got = []
        for key in keys:
            if key not in self.values:
                break
            got.append(key)
        if not got:
            return False
        for key in got:
            value = self.values[key]
            grant = tenant.pool.reserve([key], [len(value)], "fill")[0]
            view = self.maps.view(tenant, grant.offset, grant.size)
            view[:] = value
            view.release()
            tenant.pool.commit([grant.token], "fill")
        (self.pending.append if self.defer else lambda f: f())(done)
        return True

    def count(self, tenant, keys, sizes, deadline, done) -> bool:
        n = 0
        while n < len(keys) and keys[n] in self.values:
            n += 1
        done(n)
        return True

    def stored(self, tenant, keys, sizes, hashes=None, *, write_out=True) -> None:
        self.stored_keys += keys

    def evicted(self, tenant, key, size) -> None:
        self.evicted_keys.append(key)


class ThroughTier(DictTier):
    takes_saves_through: ClassVar[bool] = True

    def save_through(self, tenant, keys: Sequence[str], extents: Sequence[Extent],
                     deadline: Optional[float], done, hashes=None) -> bool:
        self.hashes = hashes
        for key, e in zip(keys, extents):
            view = self.maps.view(tenant, e.offset, e.size)
            self.values[key] = bytes(view)
            view.release()
        done([True] * len(keys))
        return True


@pytest.fixture
def world():
    tenant = Tenant(TenantSpec(None, None, 1 << 20), 60.0)
    maps = SegmentMaps()
    a, b = socket.socketpair()
    session = Session(1, a, 0, 0, 0.0)
    session.proto.phase = session.proto.phase.READY  # past the handshake
    session.tenant = tenant
    yield tenant, maps, session
    maps.close()
    a.close()
    b.close()
    tenant.close()


def _handlers(tiers, out):
    return Handlers(Limits(), tiers, out, collections.Counter())


def _value(key: str, size: int = 1000) -> bytes:
    return (key.encode() * size)[:size]


def test_a_load_walks_shared_memory_then_each_tier_in_order(world):
    tenant, maps, session = world
    disk, cluster = DictTier("disk", True, maps), DictTier("cluster", False, maps)
    disk.values = {k: _value(k) for k in ("b", "c")}
    cluster.values = {k: _value(k) for k in ("d",)}
    out = Replies()
    h = _handlers([disk, cluster], out)
    h.serve(session, m.Reserve, [1, ["a"], [1000], True, None])
    grant = out.wires[-1]
    view = maps.view(tenant, grant[4][0], 1000)  # its offset
    view[:] = _value("a")
    view.release()
    h.serve(session, m.Commit, [2, [grant[3][0]], 0])  # its token
    h.serve(session, m.Acquire, [3, ["a", "b", "c", "d", "e"], [1000] * 5, False, 0])
    pinned = out.wires[-1]
    assert pinned[0] == m.Pinned.TYPE and len(pinned[2]) == 4  # a local, b c disk, d cluster
    assert disk.asked == [["b", "c", "d", "e"]] and cluster.asked == [["d", "e"]]
    for key, offset, size in zip("abcd", pinned[3], pinned[4]):
        view = maps.view(tenant, offset, size)
        assert bytes(view) == _value(key)
        view.release()
    assert session.pins == 4
    # the save told both; what the cluster brought is kept by the local tier only
    assert disk.stored_keys == ["a", "d"] and cluster.stored_keys == ["a"]


def test_read_local_only_walks_only_the_local_tiers(world):
    tenant, maps, session = world
    disk, cluster = DictTier("disk", True, maps), DictTier("cluster", False, maps)
    cluster.values = {"a": _value("a")}
    out = Replies()
    h = _handlers([disk, cluster], out)
    h.serve(session, m.Acquire, [1, ["a"], [1000], True, 0])
    assert out.wires[-1][2] == [] and cluster.asked == []
    h.serve(session, m.Exists, [2, ["a"], None, True, 0])
    assert out.wires[-1] == m.Count.wire(rid=2, n=0)
    h.serve(session, m.Exists, [3, ["a"], None, False, 0])
    assert out.wires[-1] == m.Count.wire(rid=3, n=1)


def test_a_deferred_fill_answers_when_done_and_counts_add_up(world):
    tenant, maps, session = world
    disk = DictTier("disk", True, maps, defer=True)
    disk.values = {"a": _value("a"), "b": _value("b")}
    out = Replies()
    h = _handlers([disk], out)
    h.serve(session, m.Acquire, [1, ["a", "b", "x"], [1000] * 3, False, 0])
    assert out.wires == []  # waits for the tier
    disk.pending.pop()()
    assert len(out.wires[-1][2]) == 2
    h.serve(session, m.Exists, [2, ["a", "b", "x"], None, False, 0])
    assert out.wires[-1] == m.Count.wire(rid=2, n=2)


def test_a_closed_session_gets_no_late_pins(world):
    tenant, maps, session = world
    disk = DictTier("disk", True, maps, defer=True)
    disk.values = {"a": _value("a")}
    out = Replies()
    h = _handlers([disk], out)
    h.serve(session, m.Acquire, [1, ["a"], [1000], False, 0])
    session.proto.closed()
    disk.pending.pop()()
    assert session.pins == 0
    assert tenant.pool.statistics().pinned == 0


def test_saves_through_leave_no_local_copy(world):
    tenant, maps, session = world
    cluster = ThroughTier("cluster", False, maps)
    out = Replies()
    h = _handlers([cluster], out)
    h.serve(session, m.Reserve, [1, ["k"], [1000], False, [77]])
    granted = out.wires[-1]
    view = maps.view(tenant, granted[4][0], 1000)  # its offset
    view[:] = _value("k")
    view.release()
    h.serve(session, m.Commit, [2, [granted[3][0]], 0])
    assert out.wires[-1] == m.Committed.wire(rid=2, ok=[True])
    assert cluster.values["k"] == _value("k") and tenant.pool.keys() == []
    assert cluster.stored_keys == [] and session.reservations == {}
    assert cluster.hashes == [77]  # the engine's hash goes with it (KV events)


def test_evictions_reach_the_tiers_that_listen(world):
    tenant, maps, session = world
    disk = DictTier("disk", True, maps)
    out = Replies()
    h = _handlers([disk], out)
    h.opened(tenant)
    for i in range(3):  # 3 x 400 KiB in a 1 MiB pool: the first is evicted
        h.serve(session, m.Reserve, [i, [f"k{i}"], [400 << 10], True, None])
        h.serve(session, m.Commit, [i, [out.wires[-1][3][0]], 0])
    assert disk.evicted_keys == ["k0"]


def test_commits_tell_the_tiers_each_key_with_its_size_and_hash(world):
    """A save of the defaults is not remembered per key (its Commit takes the keys and
    sizes from the pool); one with hashes is. Commits of either, alone, side by side
    or in one request, tell the tiers every committed key once, in order, with its
    size and its hash; a token that does not commit tells nothing."""
    tenant, maps, session = world

    class Recording(DictTier):
        def __init__(self, *args):
            super().__init__(*args)
            self.calls: list[tuple[list[str], list[int], Optional[list], bool]] = []

        def stored(self, tenant, keys, sizes, hashes=None, *, write_out=True) -> None:
            self.calls.append((list(keys), list(sizes),
                               None if hashes is None else list(hashes), write_out))

    disk = Recording("disk", True, maps)
    out = Replies()
    h = _handlers([disk], out)

    def reserve(rid, keys, sizes, hashes=None):
        h.serve(session, m.Reserve, [rid, keys, sizes, True, hashes])
        return out.wires[-1][3]  # the tokens

    plain = reserve(1, ["a1", "a2"], [1000, 2000])
    assert session.reservations == {}  # the defaults: nothing remembered
    hashed = reserve(2, ["b1", "b2"], [3000, 4000], [7, 8])
    assert len(session.reservations) == 2
    h.serve(session, m.Commit, [3, plain, 0])  # beside the hashed save's reservations
    assert out.wires[-1] == m.Committed.wire(rid=3, ok=[True, True])
    assert [(k, n) for k, n, _, _ in disk.calls] == [(["a1", "a2"], [1000, 2000])]
    h.serve(session, m.Commit, [4, hashed, 0])
    assert disk.calls[-1] == (["b1", "b2"], [3000, 4000], [7, 8], True)
    disk.calls.clear()
    plain = reserve(5, ["c1"], [500])
    hashed = reserve(6, ["d1"], [600], [9])
    h.serve(session, m.Commit, [7, [hashed[0], 999, plain[0]], 0])  # one request, mixed
    assert out.wires[-1] == m.Committed.wire(rid=7, ok=[True, False, True])
    assert disk.calls == [(["d1", "c1"], [600, 500], [9, None], True)]
    assert session.reservations == {}
    disk.calls.clear()
    plain = reserve(8, ["e1", "e2"], [700, 800])
    h.serve(session, m.Commit, [9, plain, 0])  # nothing remembered at all: the pool's
    assert disk.calls == [(["e1", "e2"], [700, 800], None, True)]
