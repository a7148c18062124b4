"""The pool core: an index of objects over one arena, with reservations, pins and LRU.

Plain synchronous code with no I/O and an injectable clock: the embedded transport
calls it under a lock, the daemon calls it from its event loop, and the unit tests
(including a Hypothesis state machine against a dict model) call it directly.

An object moves through these states::

      reserve()             commit()              (no pins, LRU victim)
    ------------> RESERVED -----------> COMMITTED ---------------------> evicted
                    |  abort() / TTL         |  ^
                    v  / owner gone          |  | release() (last pin)
                  freed                      v  |   release_held() (last pin)
                                            PINNED (acquire(): a reader copies;
                                                    hold(): a tier's fill or write-out)

* Keys are write-once: reserving a COMMITTED key answers ``EXISTS`` without a copy
  (keys are content hashes, and MLA clients save the same hash from every TP rank);
  reserving a key that another writer holds answers ``BUSY``.
* A key becomes visible (to ``acquire``/``exists``) only at ``commit``, after all its
  bytes were written: a reader sees nothing or the whole value.
* A connection may hold a LEASE (``lease``): pool space that is its own until it
  gives it back (``unlease``) or goes (``drop_owner``); never evicted, never expired.
  It writes values there without asking, then ``carve`` turns each written range into
  a committed object in one step (or gives the range back when the key is already
  stored or reserved: EXISTS/BUSY). The lease is a set of pieces, not a cursor: the
  ranges of concurrent writers arrive in any order.
* ``acquire`` pins an object so its bytes cannot be evicted or reused while a reader
  copies them; ``release`` unpins. Pinned and reserved objects are never evicted. A
  pin is a count on the object, not a move in the LRU order: eviction skips a pinned
  victim (parks it, ``_pop_victim``) and a parked object comes back, the most recently
  used, with its last release. Measured (2-vCPU VM): a write-out's hold and release
  took every value of a 16 KiB spill out of the order and back, on the daemon's loop;
  without that, ``ems-server --disk`` spilled 48-53 -> 44-55 thousand values a second
  (medians 50 -> 54, five of six alternating pairs won), the daemon's CPU a value 18.4
  -> 16.9 us (medians), and an acquire and release of 2,048 keys cost 0.83 -> 0.67 us
  a key.
* A reservation expires ``reservation_ttl_s`` after it was made (``expire``), and
  ``drop_owner`` ends everything a disconnected client held, so a crashed writer or
  reader leaks no space.

How space is handed out (``_alloc``), and what it may cost. Making room for an object
of N bytes (rounded up) evicts at most **N + S** bytes, S the largest object in the
pool, plus what a lowered limit is exceeded by (a quota lowered under pinned bytes),
whatever the pool's history; a lease at most the LRU victim alone::

    free extent fits, under the limit ----------------------------> take it
    the LRU victim has the same size ------------------------------> take its extent
    a free extent fits, over the limit ---> evict LRU victims until the limit allows
    no free extent fits ---> WINDOW: the free extent before one of the next 8 LRU
        victims, then rightwards free extents and evictable objects until N bytes
        (else the cheapest such window of the whole arena); evict the objects in it
        (the victim: a capacity eviction, its neighbours: fragmentation evictions);
        then LRU victims while the limit is exceeded
    no window (pins, reservations, leases everywhere) --------------> FULL

A failed window search evicts nothing; a FULL after evictions only happens when the
limit cannot be met at all (every evictable object went, fewer than N bytes).

A window ends at most one object past N bytes, hence the bound. With one value size
(every V1 block of a layout) no window is ever needed: each allocation takes exactly
its LRU victim's extent, and the pool is exact LRU. Mixed V0 sizes (16 KiB-4 MiB)
evict the victim's neighbours for large objects (7 in 8 evictions in a uniform mix of
16 KiB-4 MiB: LRU-anchored, not exact LRU); what a window leaves beyond the object is
free space the next smaller ones take (99% of such a pool live). Pinned objects
(readers, the disk tier's write-behind), reservations and leases are never in a
window.

Objects a tier behind the pool has yet to write (``mark_unwritten``) are the policy's
last victims (``ems.pool.eviction``), and a reserve or lease with ``spare_unwritten``
takes none of them (FULL instead: the daemon's save then waits for the writer).

A lease is drawn from free space, or from the place of the LRU victim when that one
object (with the free space beside it) is as large as a lease (``lease``): the victim
the next reservation would evict, so LRU stays exact. On a pool full of objects
smaller than a lease it is refused (``leases_refused``) and the connection's small
saves reserve instead. Measured
(issue 26): before, a lease evicted LRU victims until a contiguous extent formed; on
a full 64 MiB pool of 16 KiB objects in random LRU order one 1 MiB lease evicted
3,677 objects (90% of the pool), one 1 MiB object 58,832 KiB; a daemon replaying a
prefix-caching trace held 46% of the blocks that fit and lost up to 31% of LRU's
hits. Now the same 1 MiB object evicts 1 MiB to 1 MiB + 16 KiB, and the daemon's
replay is exact LRU with the pool 100% live (``tests/unit/test_pool_allocation.py``,
``tests/integration/test_trace_replay.py``; the bound is checked against a model of
the arena in ``tests/unit/test_pool_stateful.py``).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import enum
import itertools
import time
from typing import Callable, Hashable, NamedTuple, Optional, Sequence

from ems.pool.allocator import Allocator
from ems.pool.eviction import LruPolicy

__all__ = ["Grant", "GrantStatus", "Held", "Pin", "Pool", "PoolStatistics"]

#: victims whose place is tried for a window before the whole arena is searched
_ANCHORS = 8


class GrantStatus(enum.IntEnum):
    """Outcome of reserving one key."""

    NEW = 0  #: space reserved; write the bytes, then commit the token
    EXISTS = 1  #: already committed (write-once): nothing to copy, counts as stored
    BUSY = 2  #: another writer holds a reservation for this key
    FULL = 3  #: no room even after evicting every evictable object
    TOO_LARGE = 4  #: bigger than the whole pool


class Grant(NamedTuple):
    """The answer to reserving one key (NamedTuples: built per key, cheaply; on the
    hot paths through :data:`_new`)."""

    status: GrantStatus
    token: int = 0
    offset: int = 0
    size: int = 0


class Pin(NamedTuple):
    """One pinned object: where its bytes are, and the token that unpins it."""

    token: int
    offset: int
    size: int


class Held(NamedTuple):
    """What one :meth:`Pool.hold` pinned, as columns: the keys (each once, in the order
    asked), where each one's bytes are, and the one token that unpins them all (0:
    nothing was pinned)."""

    token: int
    keys: list[Hashable]
    offsets: list[int]
    sizes: list[int]


@dataclasses.dataclass(frozen=True)
class PoolStatistics:
    """A snapshot of one pool."""

    capacity_bytes: int
    used_bytes: int
    objects: int
    reserved: int
    pinned: int
    hits: int
    misses: int
    evictions: int
    expired_reservations: int
    #: pool space held by connections' leases (part of ``used_bytes``)
    leased_bytes: int = 0
    #: bytes of the objects pinned by hits / made visible by commits and carves
    hit_bytes: int = 0
    stored_bytes: int = 0
    #: why lookups missed: no such key, a key of another size, a key still being written
    miss_absent: int = 0
    miss_size_mismatch: int = 0
    miss_pending: int = 0
    #: reservations refused: no room after evicting all it could / bigger than the pool
    refused_full: int = 0
    refused_too_large: int = 0
    #: the arena (the tenant's memory); ``capacity_bytes`` is the usage limit within it
    arena_bytes: int = 0
    #: connections holding a lease
    leases: int = 0
    #: where ``used_bytes`` goes: committed objects / reservations being written (each
    #: rounded up to the allocation unit); ``leased_bytes`` is the rest
    live_bytes: int = 0
    reserved_bytes: int = 0
    #: bytes the pool may still allocate before it must evict (``capacity_bytes`` minus
    #: ``used_bytes``; 0 while a lowered quota is exceeded)
    free_bytes: int = 0
    #: ``evictions`` split by cause: the policy's own victims (the pool needed the
    #: bytes) and neighbours of a victim evicted only because a larger object needed
    #: contiguous space (fragmentation); and the bytes evicted in all
    evictions_capacity: int = 0
    evictions_fragmentation: int = 0
    evicted_bytes: int = 0
    #: leases refused: no free extent of a lease's size and the LRU victim's place too
    #: small (a lease evicts at most that victim: the connection's saves reserve)
    leases_refused: int = 0

    @property
    def hit_rate(self) -> float:
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else 0.0


class _State(enum.Enum):
    RESERVED = "reserved"
    COMMITTED = "committed"


_RESERVED, _COMMITTED = _State.RESERVED, _State.COMMITTED
_NEW, _EXISTS, _BUSY = GrantStatus.NEW, GrantStatus.EXISTS, GrantStatus.BUSY
_FULL, _TOO_LARGE = GrantStatus.FULL, GrantStatus.TOO_LARGE
#: the answers without a place (immutable: one of each serves every key)
_BUSY_GRANT, _FULL_GRANT, _TOO_LARGE_GRANT = Grant(_BUSY), Grant(_FULL), Grant(_TOO_LARGE)
#: a named tuple made from a tuple of all its fields, without the call of its
#: ``__new__`` (a Python function): ~0.4 -> ~0.15 us a Grant or Pin on the 2-vCPU VM,
#: where a save of 16 KiB values through ``ems-server --disk`` makes two per value
#: (a reservation, the write-out's pin) and ~1 us of its ~13 us of the daemon's loop
#: were named tuples' calls (py-spy)
_new = tuple.__new__


class _Object:
    """One key's entry in the index (a slotted class: made per reserve, ~0.3 us
    cheaper than a dataclass)."""

    __slots__ = ("key", "offset", "size", "need", "state", "owner", "expires_at", "pins",
                 "parked")

    def __init__(self, key: Hashable, offset: int, size: int, need: int, state: _State,
                 owner: Hashable, expires_at: float = 0.0) -> None:
        self.key = key
        self.offset = offset
        self.size = size
        #: the bytes its extent takes (``size`` rounded up to the allocation unit)
        self.need = need
        self.state = state
        self.owner = owner
        self.expires_at = expires_at
        self.pins = 0
        #: pinned, and out of the policy since eviction met it (``Pool._pop_victim``)
        self.parked = False


class _Lease:
    """One owner's lease: allocated extents (pieces), sorted by start."""

    __slots__ = ("sizes", "starts")

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.sizes: dict[int, int] = {}

    def add(self, start: int, size: int) -> None:
        bisect.insort(self.starts, start)
        self.sizes[start] = size

    def find(self, offset: int, size: int) -> int:
        """Index of the piece that holds ``[offset, offset + size)`` entirely, or -1."""
        i = bisect.bisect_right(self.starts, offset) - 1
        if i >= 0:
            start = self.starts[i]
            if offset + size <= start + self.sizes[start]:
                return i
        return -1


class Pool:
    """Index + allocator + eviction policy over an arena of ``capacity_bytes``."""

    def __init__(self, capacity_bytes: int, *, reservation_ttl_s: float = 60.0,
                 alignment: int = 64, clock: Callable[[], float] = time.monotonic,
                 policy: Callable[[], LruPolicy] = LruPolicy) -> None:
        self.allocator = Allocator(capacity_bytes, alignment)
        self.capacity_bytes = self.allocator.capacity_bytes
        self.reservation_ttl_s = reservation_ttl_s
        self._clock = clock
        self._policy = policy()  # (a factory: each pool its own)
        self._objects: dict[Hashable, _Object] = {}
        self._reservations: dict[int, _Object] = {}
        self._pins: dict[int, tuple[_Object, Hashable]] = {}
        self._holds: dict[int, tuple[list[_Object], Hashable]] = {}  # hold(): one token each
        self._tokens = itertools.count(1)
        self._leases: dict[Hashable, _Lease] = {}
        self._leased = 0
        self._committed = 0
        #: committed objects by offset: what a window search (``_window_at``) finds there
        self._live_at: dict[int, _Object] = {}
        self._live_bytes = self._reserved_bytes = 0
        self._evict_capacity = self._evict_fragmentation = self._evicted_bytes = 0
        self._leases_refused = 0
        self._hits = self._misses = self._expired = 0
        self._hit_bytes = self._stored_bytes = 0
        self._miss_absent = self._miss_size = self._miss_pending = 0
        self._refused_full = self._refused_too_large = 0
        #: told of each LRU eviction (key, size): the daemon's tiers listen here
        self.on_evict: Optional[Callable[[Hashable, int], None]] = None

    # ------------------------------------------------------------------ writes
    def reserve(self, keys: Sequence[Hashable], sizes: Sequence[int],
                owner: Hashable = None, *, spare_unwritten: bool = False,
                leading: bool = False) -> list[Grant]:
        """Reserve space for each key (all or nothing per key, never per batch);
        ``spare_unwritten``: evict no object marked unwritten (:meth:`mark_unwritten`),
        FULL instead (the daemon then waits for its disk writer and asks again).
        ``leading``: stop at the first key not granted NEW (its grant is the list's
        last): a tier fetching a load's run of misses, which ends there, reserves the
        run in one call and evicts nothing for the keys after it."""
        policy = self._policy
        policy.spare = spare_unwritten
        try:
            return self._reserve(keys, sizes, owner, leading)
        finally:
            policy.spare = False

    def _reserve(self, keys: Sequence[Hashable], sizes: Sequence[int],
                 owner: Hashable, leading: bool = False) -> list[Grant]:
        """:meth:`reserve`'s loop. On a full pool (the steady state of a cache) every
        key evicts, and a victim of the same rounded size (every V1 block of one
        layout) hands its extent over as it is, without a free, a merge and a fit
        search (reserve + commit of 256 keys of 256 KiB on a full pool: ~7.6 -> ~3.8
        us per key); that hand-over is made here, in the loop, its counts added up once
        a batch, and :meth:`_alloc` does the rest (measured on the 2-vCPU VM, a full
        pool of 16 KiB values, 1,024 keys a batch, best of 80: 1.51-1.58 -> 1.26-1.27 us
        a key; a 16 KiB spill through ``ems-server --disk`` reserves every value so, and
        did not move measurably with it: medians 82.0 and 82.7 thousand values a
        second, six alternating pairs). The victim's object, unpinned and out of every
        table by then, is the new key's too (a new object cost ~0.3 us of a ~1.3 us
        key: reserve + commit + a write-out's hold of 1,024 keys on a full pool, best of
        100, 1.33-1.46 -> 0.95-1.04 us a key with :meth:`commit`'s counting below)."""
        expires_at = self._clock() + self.reservation_ttl_s
        grants = []
        # Keys of this batch answered EXISTS count as stored: a later key of the same
        # batch must not evict them to make room (it gets FULL instead), so they leave
        # the policy until the batch is done, like the batch's own reservations.
        held: list[Hashable] = []
        objects, round_up, limit = self._objects, self.allocator.round_up, self.capacity_bytes
        alloc, reservations, tokens = self._alloc, self._reservations, self._tokens
        allocator, live_at, policy = self.allocator, self._live_at, self._policy
        pop_key, forget, on_evict = policy.pop_victim, policy.forget, self.on_evict
        handed = handed_bytes = reserved_bytes = 0  # (counted once, at the end)
        last_size = need = 0  # (a batch's values are mostly of one size: rounded once)
        try:
            for key, size in zip(keys, sizes):
                obj = objects.get(key)
                if obj is not None:
                    if obj.state is _COMMITTED:
                        if obj.pins == 0:  # (pinned keys are out of the policy already)
                            policy.remove(key)
                            held.append(key)
                        grants.append(_new(Grant, (_EXISTS, 0, 0, obj.size)))
                    else:
                        grants.append(_BUSY_GRANT)
                    if leading:
                        break
                    continue
                if size != last_size:
                    need, last_size = round_up(size), size
                if need > limit:
                    self._refused_too_large += 1
                    grants.append(_TOO_LARGE_GRANT)
                    if leading:
                        break
                    continue
                offset: Optional[int] = None
                obj = None
                if allocator.used_bytes + need > limit:  # full: the LRU victim first
                    victim_key = pop_key()
                    victim = None if victim_key is None else objects[victim_key]
                    if victim is not None and victim.pins:  # (parked: ``_pop_victim``)
                        victim.parked = True
                        victim = self._pop_victim()
                    if victim is not None:
                        if victim.need == need and allocator.used_bytes <= limit:
                            offset, victim_key = victim.offset, victim.key  # handed over
                            del live_at[offset]
                            del objects[victim_key]
                            forget(victim_key)
                            handed += 1
                            handed_bytes += need
                            if on_evict is not None:
                                on_evict(victim_key, victim.size)
                            # its object, unpinned and nowhere else now, is the new one
                            obj = victim
                            obj.key, obj.size, obj.state = key, size, _RESERVED
                            obj.owner, obj.expires_at = owner, expires_at
                        else:
                            policy.unpop(victim.key)
                            offset = alloc(need)
                else:
                    offset = alloc(need)
                if offset is None:
                    if not policy.spare:  # (else the daemon waits and asks again)
                        self._refused_full += 1
                    grants.append(_FULL_GRANT)
                    if leading:
                        break
                    continue
                if obj is None:
                    obj = _Object(key, offset, size, need, _RESERVED, owner, expires_at)
                reserved_bytes += need
                token = next(tokens)
                objects[key] = obj
                reservations[token] = obj
                grants.append(_new(Grant, (_NEW, token, offset, size)))
        finally:
            self._reserved_bytes += reserved_bytes
            self._committed -= handed
            self._live_bytes -= handed_bytes
            self._evict_capacity += handed
            self._evicted_bytes += handed_bytes
            for key in held:  # back in, most recently used, in batch order
                policy.insert(key)
        return grants

    def commit(self, tokens: Sequence[int], owner: Hashable = None,
               stored: Optional[tuple[list[Hashable], list[int]]] = None) -> list[bool]:
        """Make reserved objects visible. False for a token that expired or is foreign.
        ``stored``: two lists that get the key and the size of each object committed, in
        the order of ``tokens`` (the daemon's tiers are told of them).

        The pool's counts are added up once a call and the keys enter the policy in
        one call (``LruPolicy.insert_all``): per key four counters and a method call
        cost a commit of 1,024 keys 0.52-0.57 us a key, now 0.34-0.36 (pool alone,
        best of 100, the 2-vCPU VM)."""
        out = []
        keys: list[Hashable] = []
        sizes: list[int] = []
        reservations, live_at = self._reservations, self._live_at
        need = nbytes = 0  # (counted once, at the end)
        for token in tokens:
            obj = reservations.get(token)
            if obj is None or obj.owner != owner:
                out.append(False)
                continue
            del reservations[token]
            obj.state = _COMMITTED
            live_at[obj.offset] = obj
            need += obj.need
            nbytes += obj.size
            keys.append(obj.key)
            sizes.append(obj.size)
            out.append(True)
        self._reserved_bytes -= need
        self._live_bytes += need
        self._committed += len(keys)
        self._stored_bytes += nbytes
        self._policy.insert_all(keys)
        if stored is not None:
            stored[0].extend(keys)
            stored[1].extend(sizes)
        return out

    def abort(self, tokens: Sequence[int], owner: Hashable = None) -> None:
        """Give back reservations that will not be committed."""
        for token in tokens:
            obj = self._reservations.get(token)
            if obj is not None and obj.owner == owner:
                del self._reservations[token]
                self._drop(obj)

    # ------------------------------------------------------------------ leases
    def lease(self, size: int, owner: Hashable, *, spare_unwritten: bool = False
              ) -> Optional[int]:
        """Give ``owner`` an extent of ``size`` bytes: free space, or the place of the
        LRU victim alone when it (with the free space beside it) is that large; its
        offset, or None (nothing evicted) otherwise.

        A lease never evicts more than the one object a reservation would have evicted
        next (module docstring: it is one extent, many values long, and making it from
        scattered victims evicted up to 90% of a pool of small objects); on a pool full
        of objects smaller than a lease the connection's small saves reserve instead.
        """
        need = self.allocator.round_up(size)
        offset = None
        if self.allocator.used_bytes + need <= self.capacity_bytes:
            offset = self.allocator.alloc_rounded(need)
        if offset is None:
            self._policy.spare = spare_unwritten
            try:
                offset = self._lease_from_victim(need)
            finally:
                self._policy.spare = False
        if offset is None:
            self._leases_refused += 1
            return None
        self._leases.setdefault(owner, _Lease()).add(offset, need)
        self._leased += need
        return offset

    def leased_by(self, owner: Hashable) -> int:
        """Bytes of ``owner``'s lease not carved into objects yet."""
        lease = self._leases.get(owner)
        return sum(lease.sizes.values()) if lease is not None else 0

    @property
    def leased_bytes(self) -> int:
        """Bytes of every owner's leases not carved into objects yet."""
        return self._leased

    def carve(self, keys: Sequence[Hashable], offsets: Sequence[int], sizes: Sequence[int],
              owner: Hashable) -> list[GrantStatus]:
        """Commit values that ``owner`` wrote into its lease, one range per key.

        A new key becomes a committed object of exactly its range at once (NEW); for a
        key that is stored already (EXISTS) or reserved by a writer (BUSY) the range is
        freed. Raises ValueError, changing nothing, when a range is not inside the
        owner's lease (or ranges overlap): that owner is broken or hostile.
        """
        lease = self._checked_lease(offsets, sizes, owner)
        out = []
        for key, offset, size in zip(keys, offsets, sizes):
            assert lease is not None
            need = self.allocator.round_up(size)
            self._cut(lease, offset, need)
            obj = self._objects.get(key)
            if obj is None:
                obj = _Object(key, offset, size, need, _State.COMMITTED, owner)
                self._objects[key] = obj
                self._live_at[offset] = obj
                self._live_bytes += need
                self._committed += 1
                self._stored_bytes += size
                self._policy.insert(key)
                out.append(GrantStatus.NEW)
            else:
                self.allocator.free(offset)
                out.append(GrantStatus.EXISTS if obj.state is _State.COMMITTED
                           else GrantStatus.BUSY)
        return out

    def owns(self, offsets: Sequence[int], sizes: Sequence[int], owner: Hashable) -> bool:
        """Whether every range is a free, non-overlapping range of ``owner``'s lease
        (what ``carve`` would accept)."""
        try:
            self._checked_lease(offsets, sizes, owner)
        except ValueError:
            return False
        return True

    def unlease(self, offsets: Sequence[int], sizes: Sequence[int], owner: Hashable) -> None:
        """Free ranges of ``owner``'s lease (unwritten, or aborted); ranges that are not
        in it any more (carved meanwhile) are ignored."""
        lease = self._leases.get(owner)
        if lease is None:
            return
        round_up = self.allocator.round_up
        for offset, size in zip(offsets, sizes):
            if size <= 0 or offset % self.allocator.alignment:
                continue
            need = round_up(size)
            if lease.find(offset, need) >= 0:
                self._cut(lease, offset, need)
                self.allocator.free(offset)

    def _checked_lease(self, offsets: Sequence[int], sizes: Sequence[int],
                       owner: Hashable) -> Optional[_Lease]:
        lease = self._leases.get(owner)
        ranges = sorted(zip(offsets, sizes)) if len(offsets) > 1 else zip(offsets, sizes)
        end = -1
        for offset, size in ranges:
            need = self.allocator.round_up(size)
            if (lease is None or size <= 0 or offset % self.allocator.alignment or offset < end
                    or lease.find(offset, need) < 0):
                raise ValueError(f"[{offset}, +{size}) is not a free range of this "
                                 f"connection's lease")
            end = offset + need
        return lease

    def _cut(self, lease: _Lease, offset: int, need: int) -> None:
        """Take ``[offset, offset + need)`` out of ``lease`` as an extent of its own
        (what is left of its piece stays in the lease, in place: pieces are sorted)."""
        i = lease.find(offset, need)
        assert i >= 0
        starts, sizes = lease.starts, lease.sizes
        start = starts[i]
        size = sizes.pop(start)
        end = offset + need
        if offset > start:
            self.allocator.split(start, offset)
            sizes[start] = offset - start
        if end < start + size:
            self.allocator.split(offset, end)
            sizes[end] = start + size - end
            if offset > start:
                starts.insert(i + 1, end)
            else:
                starts[i] = end
        elif offset == start:
            del starts[i]
        self._leased -= need

    # ------------------------------------------------------------------ reads
    def acquire(self, keys: Sequence[Hashable], sizes: Optional[Sequence[Optional[int]]] = None,
                owner: Hashable = None, count: bool = True) -> list[Pin]:
        """Pin the leading run of keys that are committed (and of the expected size).

        Stops at the first miss: blocks after a hole cannot be used by a prefix cache,
        so they are neither pinned nor counted. Returns one :class:`Pin` per leading hit.
        ``count`` False: not a lookup of a reader (the cluster tier pins what it sends,
        or what it has just fetched): hits and misses are not counted.
        """
        pins = []
        touch = self._policy.touch
        for i, key in enumerate(keys):
            obj = self._objects.get(key)
            want = None if sizes is None else sizes[i]
            if obj is None or obj.state is not _State.COMMITTED or (
                    want is not None and want != obj.size):
                if count:
                    self._misses += 1
                    if obj is None:
                        self._miss_absent += 1
                    elif obj.state is not _State.COMMITTED:
                        self._miss_pending += 1
                    else:
                        self._miss_size += 1
                break
            if count:
                self._hits += 1
                self._hit_bytes += obj.size
            touch(key)
            obj.pins += 1
            token = next(self._tokens)
            self._pins[token] = (obj, owner)
            pins.append(_new(Pin, (token, obj.offset, obj.size)))
        return pins

    def hold(self, keys: Sequence[Hashable], owner: Hashable = None) -> Held:
        """Pin every committed key of ``keys`` once (not only a leading run; no hit or
        miss counted), all under one token for :meth:`release_held`.

        A load whose misses a tier brings into shared memory holds the request's
        later blocks that are here already, so the tier's reservations cannot evict
        them: a load right after an exists then finds what the exists counted. A
        tier's write-out holds a chunk of a save's objects while it writes them (those
        evicted before their turn are not there to hold), and lets them go together.
        One token, not one per key: with a token, a table entry and a ``Pin`` per key,
        holding and releasing 2,048 keys at a time cost 1.9-2.8 us a key (pool alone,
        the 2-vCPU VM, three alternating pairs), with one token 1.1-1.5 (about 0.35
        since a pin no longer moves its key in the LRU order); a 16 KiB spill holds and
        releases every value on the daemon's loop (35-38 -> 39-44 thousand values a
        second through ``ems-server --disk``, for the token).
        """
        if len(set(keys)) < len(keys):  # (rare) each key once, the first place kept
            keys = list(dict.fromkeys(keys))
        objects = self._objects
        objs: list[_Object] = []
        for key in keys:
            obj = objects.get(key)
            if obj is None or obj.state is not _COMMITTED:
                continue
            obj.pins += 1
            objs.append(obj)
        if not objs:
            return _new(Held, (0, [], [], []))
        token = next(self._tokens)
        self._holds[token] = (objs, owner)
        return _new(Held, (token, [o.key for o in objs], [o.offset for o in objs],
                           [o.size for o in objs]))

    def release_held(self, token: int, owner: Hashable = None) -> int:
        """Unpin what one :meth:`hold` pinned; how many objects (0 for a token that is
        not ``owner``'s hold, or was released already)."""
        entry = self._holds.get(token)
        if entry is None or entry[1] != owner:
            return 0
        del self._holds[token]
        for obj in entry[0]:
            obj.pins -= 1
            if obj.parked and obj.pins == 0:
                self._unpark(obj)
        return len(entry[0])

    def release(self, tokens: Sequence[int], owner: Hashable = None) -> int:
        """Unpin what :meth:`acquire` pinned; how many pins were released (tokens that
        are not ``owner``'s pins are ignored)."""
        released = 0
        for token in tokens:
            entry = self._pins.get(token)
            if entry is None or entry[1] != owner:
                continue
            del self._pins[token]
            released += 1
            obj = entry[0]
            obj.pins -= 1
            if obj.parked and obj.pins == 0:
                self._unpark(obj)
        return released

    def mark_unwritten(self, keys: Sequence[Hashable]) -> None:
        """A tier behind shared memory is to write ``keys`` (committed ones): evict
        them only when no written object can be (``ems.pool.eviction``), until
        :meth:`mark_written`. Marks count: each call is undone by one of those."""
        objects = self._objects
        self._policy.mark_all([key for key in keys if (obj := objects.get(key)) is not None
                               and obj.state is _COMMITTED], True)

    def mark_written(self, keys: Sequence[Hashable]) -> None:
        """Undo one :meth:`mark_unwritten` of each of ``keys`` (written, or given up:
        evictable as any other object again); a key not marked is left as it is."""
        self._policy.mark_all(keys, False)

    def unwritten(self, key: Hashable) -> bool:
        """Whether ``key`` is marked unwritten."""
        return self._policy.unwritten(key)

    def exists(self, keys: Sequence[Hashable], sizes: Optional[Sequence[Optional[int]]] = None
               ) -> int:
        """How many leading keys are committed (no pin, no copy, no hit counting)."""
        n = 0
        for i, key in enumerate(keys):
            obj = self._objects.get(key)
            want = None if sizes is None else sizes[i]
            if obj is None or obj.state is not _State.COMMITTED or (
                    want is not None and want != obj.size):
                break
            n += 1
        return n

    # ------------------------------------------------------------------ lifecycle
    def expire(self, now: Optional[float] = None) -> int:
        """Free reservations older than the TTL; returns how many."""
        now = self._clock() if now is None else now
        stale = [t for t, o in self._reservations.items() if o.expires_at <= now]
        for token in stale:
            self._drop(self._reservations.pop(token))
        self._expired += len(stale)
        return len(stale)

    def drop_owner(self, owner: Hashable) -> None:
        """A client is gone: abort its reservations, release its pins, free its lease."""
        lease = self._leases.pop(owner, None)
        if lease is not None:
            for start in lease.starts:
                self._leased -= lease.sizes[start]
                self.allocator.free(start)
        self.abort([t for t, o in self._reservations.items() if o.owner == owner], owner)
        self.release([t for t, (_, o) in self._pins.items() if o == owner], owner)
        for token in [t for t, (_, o) in self._holds.items() if o == owner]:
            self.release_held(token, owner)

    def delete(self, key: Hashable) -> bool:
        """Remove a committed, unpinned object (False when absent or in use)."""
        obj = self._objects.get(key)
        if obj is None or obj.state is not _State.COMMITTED or obj.pins:
            return False
        self._policy.remove(key)
        self._drop(obj)
        return True

    def statistics(self) -> PoolStatistics:
        return PoolStatistics(
            capacity_bytes=self.capacity_bytes,
            used_bytes=self.allocator.used_bytes,
            objects=self._committed,
            reserved=len(self._reservations),
            pinned=sum(1 for o in self._objects.values() if o.pins),
            hits=self._hits,
            misses=self._misses,
            evictions=self._evict_capacity + self._evict_fragmentation,
            expired_reservations=self._expired,
            leased_bytes=self._leased,
            hit_bytes=self._hit_bytes,
            stored_bytes=self._stored_bytes,
            miss_absent=self._miss_absent,
            miss_size_mismatch=self._miss_size,
            miss_pending=self._miss_pending,
            refused_full=self._refused_full,
            refused_too_large=self._refused_too_large,
            arena_bytes=self.allocator.capacity_bytes,
            leases=len(self._leases),
            live_bytes=self._live_bytes,
            reserved_bytes=self._reserved_bytes,
            free_bytes=max(0, self.capacity_bytes - self.allocator.used_bytes),
            evictions_capacity=self._evict_capacity,
            evictions_fragmentation=self._evict_fragmentation,
            evicted_bytes=self._evicted_bytes,
            leases_refused=self._leases_refused,
        )

    def set_capacity(self, capacity_bytes: int) -> int:
        """Change the usage limit live (a tenant's quota): at most the arena, whose
        memory is fixed (a sealed memfd); returns the limit now in force.

        Raising it only lets the pool use more of its arena. Lowering it evicts LRU
        objects until the used bytes fit (the rest of the cache stays); pinned, reserved
        and leased bytes cannot be evicted, so the pool may stay over its limit until
        they are released, and meanwhile every new allocation evicts first (or is FULL).
        Lowering never moves objects: offsets that clients hold stay valid.
        """
        a = self.allocator.alignment
        limit = max(0, min(int(capacity_bytes), self.allocator.capacity_bytes)) // a * a
        self.capacity_bytes = limit
        allocator = self.allocator
        while allocator.used_bytes > limit:
            obj = self._pop_victim()
            if obj is None:
                break
            self._evict(obj, capacity=True)
            allocator.free(obj.offset)
        return limit

    def keys(self) -> list[Hashable]:
        """Committed keys (tests and ``ems stats`` use it)."""
        return [k for k, o in self._objects.items() if o.state is _State.COMMITTED]

    # ------------------------------------------------------------------ internals
    def _alloc(self, need: int) -> Optional[int]:
        """Space for ``need`` bytes (a size rounded up by the allocator), evicting at
        most ``need`` bytes plus one object's size (plus what a lowered limit is
        exceeded by): see the module docstring. None: no room (FULL). Over the limit,
        only where the policy has a victim and it does not simply hand its extent over
        (:meth:`_reserve` made sure of both)."""
        allocator = self.allocator
        limit = self.capacity_bytes  # the usage limit (the arena itself, unless lowered)
        if allocator.used_bytes + need <= limit:
            offset = allocator.alloc_rounded(need)
            if offset is not None:
                return offset
            return self._alloc_window(need)  # room, but not in one piece
        if not allocator.fits(need):
            return self._alloc_window(need)
        # A free extent fits: evict the policy's victims until the limit allows it
        # (freeing only merges, so the fit stays).
        while True:
            obj = self._pop_victim()
            if obj is None:
                return None
            self._evict(obj, capacity=True)
            if obj.need == need and allocator.used_bytes <= limit:
                return obj.offset
            allocator.free(obj.offset)
            if allocator.used_bytes + need <= limit:
                return allocator.alloc_rounded(need)

    def _alloc_window(self, need: int) -> Optional[int]:
        """``need`` contiguous bytes where no free extent is large enough: free the
        window at the first of the policy's next victims where one can be made, else
        the cheapest window of the whole arena; then evict the policy's victims while
        the limit is exceeded. None (nothing evicted) when no window can be made."""
        objects, policy = self._objects, self._policy
        window = None
        for key in policy.candidates(_ANCHORS):
            obj = objects[key]
            if obj.pins:  # (not a victim: parked, as ``_pop_victim`` would)
                policy.remove(key)
                obj.parked = True
                continue
            window = self._window_at(obj.offset, need)
            if window is not None:
                break
        if window is None:
            window = self._window_sweep(need)
            if window is None:
                return None
        return self._take_window(window[0], window[1], need)

    def _lease_from_victim(self, need: int) -> Optional[int]:
        """A lease of ``need`` bytes at the LRU victim's place when that victim alone
        (with the free extents beside it) makes room under the limit, else None (no
        eviction). Exact LRU stays: the victim is the one the next reserve evicts.
        (Measured: without it, a full pool refused every lease and the 1-key save
        round trip of ``ems bench`` took reserve + commit: p50 69 -> 128 us.)"""
        obj = self._peek_victim()
        if obj is None:
            return None
        window = self._window_at(obj.offset, need)
        if window is None or len(window[1]) != 1 or (
                self.allocator.used_bytes - obj.need + need > self.capacity_bytes):
            return None
        return self._take_window(window[0], window[1], need)

    def _take_window(self, start: int, victims: list[_Object], need: int) -> Optional[int]:
        """Evict ``victims`` (the objects of the window at ``start``), take ``need``
        bytes there, then evict LRU victims while the limit is exceeded."""
        policy, allocator = self._policy, self.allocator
        before = allocator.free_ending_at(start)  # merges in when the window is freed
        for obj in victims:
            capacity = self._peek_victim() is obj
            policy.remove(obj.key)
            self._evict(obj, capacity)
            allocator.free(obj.offset)
        offset = start if before is None else before
        allocator.alloc_at(offset, need)
        while allocator.used_bytes > self.capacity_bytes:  # a limit lowered under quota
            victim = self._pop_victim()
            if victim is None:
                allocator.free(offset)
                return None
            self._evict(victim, capacity=True)
            obj = victim
            allocator.free(obj.offset)
        return offset

    def _window_at(self, offset: int, need: int) -> Optional[tuple[int, list[_Object]]]:
        """The window that starts with the free extent before ``offset`` (a victim's)
        and goes right over free extents and evictable objects until ``need`` bytes:
        (its start, the objects to evict), or None when something that cannot be
        evicted (pinned, reserved, leased) or the arena's end comes first."""
        allocator, live_at, policy = self.allocator, self._live_at, self._policy
        start = allocator.free_ending_at(offset)
        if start is None:
            start = offset
        pos, end = start, allocator.capacity_bytes
        victims = []
        while pos - start < need:
            if pos >= end:
                return None
            size = allocator.free_at(pos)
            if not size:
                obj = live_at.get(pos)
                if obj is None or obj.pins or obj.key not in policy:
                    return None
                victims.append(obj)
                size = allocator.size_of(pos)
            pos += size
        return start, victims

    def _window_sweep(self, need: int) -> Optional[tuple[int, list[_Object]]]:
        """The window of the whole arena that evicts the fewest bytes (O(n log n): only
        when pins, reservations or leases sit next to each of the next victims)."""
        live_at, policy = self._live_at, self._policy
        run: collections.deque[tuple[int, int, Optional[_Object]]] = collections.deque()
        length = evict = 0
        best: Optional[tuple[int, int, list[_Object]]] = None
        for start, size, free in self.allocator.extents():
            obj = None
            if not free:
                obj = live_at.get(start)
                if obj is None or obj.pins or obj.key not in policy:
                    run.clear()
                    length = evict = 0
                    continue
            run.append((start, size, obj))
            length += size
            evict += 0 if free else size
            while length - run[0][1] >= need:
                _, first, first_obj = run.popleft()
                length -= first
                evict -= 0 if first_obj is None else first
            if length >= need and (best is None or evict < best[0]):
                best = (evict, run[0][0], [o for _, _, o in run if o is not None])
        return None if best is None else (best[1], best[2])

    def _pop_victim(self) -> Optional[_Object]:
        """The policy's next victim that nothing pins, taken out of the policy (None:
        nothing can be evicted). Pins leave an object in the policy (a pin and its
        release are a counter each, no reordering); a pinned object that comes up as
        the victim is PARKED here instead: out of the policy until its last pin goes
        (:meth:`_unpark`), so each pin costs eviction at most one step."""
        policy, objects = self._policy, self._objects
        while True:
            key = policy.pop_victim()
            if key is None:
                return None
            obj = objects[key]
            if not obj.pins:
                return obj
            obj.parked = True

    def _peek_victim(self) -> Optional[_Object]:
        """:meth:`_pop_victim` left in the policy (the pinned ones before it parked)."""
        obj = self._pop_victim()
        if obj is not None:
            self._policy.unpop(obj.key)
        return obj

    def _unpark(self, obj: _Object) -> None:
        """The last pin of a parked object went: evictable again, the most recently
        used (where a pin's release put every object before pins stayed listed)."""
        obj.parked = False
        self._policy.insert(obj.key)

    def _evict(self, obj: _Object, capacity: bool) -> None:
        """Count and announce the eviction of ``obj`` (out of the policy already) and
        forget it; its extent stays allocated (the caller frees or reuses it)."""
        self._forget(obj)
        if capacity:
            self._evict_capacity += 1
        else:
            self._evict_fragmentation += 1
        self._evicted_bytes += obj.need
        if self.on_evict is not None:
            self.on_evict(obj.key, obj.size)

    def _forget(self, obj: _Object) -> None:
        """Remove ``obj`` from the index; its extent stays allocated (the caller's)."""
        if obj.state is _COMMITTED:
            self._policy.forget(obj.key)
            self._committed -= 1
            self._live_bytes -= obj.need
            del self._live_at[obj.offset]
        else:
            self._reserved_bytes -= obj.need
        del self._objects[obj.key]

    def _drop(self, obj: _Object) -> None:
        self._forget(obj)
        self.allocator.free(obj.offset)
