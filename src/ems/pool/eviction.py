"""Eviction policies: small strategies that observe the index and choose victims.

A policy tracks the *committed* keys that eviction may consider: a key enters at
commit and leaves when it is evicted or deleted. A pin (a reader's copy, a tier's
write-out) leaves it listed: the pool skips a pinned victim and takes it out of the
policy then (it is *parked*, ``Pool._pop_victim``), and puts it back when its last pin
goes. So a pin and its release cost a counter each, and :meth:`victim` may name a
pinned key: the pool checks. (Before, every pin took its key out and put it back: a
16 KiB spill through ``ems-server --disk`` paid that on the daemon's loop for every
value it wrote out.)

Written objects first. A key can be marked *unwritten* (:meth:`LruPolicy.mark_all`): a
tier behind shared memory (the disk) has been asked to write it and has not yet. Such
a key is evicted only when no written one is evictable: evicting a written object
loses nothing (a later load finds it on the disk), evicting an unwritten one loses
it. The policy keeps two LRU orders, written and unwritten; a key moves to the end of
the written order when its write is done (it was saved moments ago: its LRU place
is near the end anyway), so with nothing marked the policy is exact LRU, as before.
With :attr:`LruPolicy.spare` set, unwritten keys are not evictable at all: a save the
daemon lets wait for its writer (``ems.server.handlers``; measured in
``benchmarks/disk_backpressure.py``, docs/tiers/disk.md "Back-pressure").
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Hashable, Iterable, Optional, Sequence

__all__ = ["LruPolicy"]


class LruPolicy:
    """Least recently used first, written before unwritten; every operation O(1)."""

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()  # written
        self._unwritten: OrderedDict[Hashable, None] = OrderedDict()
        #: keys marked unwritten, with how many writers wait for each (in the policy
        #: or not: a key being written is pinned, hence out of both orders)
        self._marks: dict[Hashable, int] = {}
        #: True: unwritten keys are not evictable now (a save that may wait for the
        #: writer instead: ``Pool.reserve(spare_unwritten=True)``)
        self.spare = False

    def insert(self, key: Hashable) -> None:
        """``key`` became evictable (committed, or unparked), the most recently used."""
        order = self._unwritten if key in self._marks else self._order
        if key in order:
            order.move_to_end(key)
        else:  # (a new key goes to the end by itself)
            order[key] = None

    def insert_all(self, keys: Sequence[Hashable]) -> None:
        """:meth:`insert` of each of ``keys``, in order: one ``update`` at C speed where
        none is marked or listed (a commit's fresh keys, the usual case)."""
        order = self._order
        if not self._marks and order.keys().isdisjoint(keys):
            order.update(dict.fromkeys(keys))
            return
        for key in keys:
            self.insert(key)

    def touch(self, key: Hashable) -> None:
        """``key`` was used (a hit); keep it longer (a key not listed is left out)."""
        try:
            self._order.move_to_end(key)
        except KeyError:
            if key in self._unwritten:
                self._unwritten.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        """``key`` leaves the policy (deleted, parked, or kept by a batch)."""
        if self._order.pop(key, 0) == 0:
            self._unwritten.pop(key, None)

    def mark_all(self, keys: Iterable[Hashable], unwritten: bool) -> None:
        """One more (``unwritten``) or one fewer writer waits for each of ``keys``; a
        key moves between the orders when its first comes or its last is done (a key
        not marked is left as it is). One call a batch, the marks counted in a plain
        dict: a write-out marks and unmarks each value of a save once (measured on the
        2-vCPU VM, per value: 1.7 us both ways through a method call each and a
        ``Counter``, whose ``__delitem__`` is Python)."""
        marks, order, unwritten_order = self._marks, self._order, self._unwritten
        if unwritten:
            for key in keys:
                n = marks.get(key, 0)
                marks[key] = n + 1
                if not n and order.pop(key, 0) is None:
                    unwritten_order[key] = None
            return
        for key in keys:
            n = marks.get(key, 0)
            if n > 1:
                marks[key] = n - 1
            elif n:
                del marks[key]
                if unwritten_order.pop(key, 0) is None:
                    order[key] = None

    def forget(self, key: Hashable) -> None:
        """``key`` left the index (evicted or deleted, so out of the orders already):
        its marks go with it. (Every eviction calls it: nothing to do without marks.)"""
        if self._marks:
            self._marks.pop(key, None)

    def unwritten(self, key: Hashable) -> bool:
        """Whether a writer waits for ``key``."""
        return key in self._marks

    def victim(self) -> Optional[Hashable]:
        """The key to evict next (unless the pool finds it pinned), or None when
        nothing can be evicted."""
        if self._order or self.spare:
            return next(iter(self._order), None)
        return next(iter(self._unwritten), None)

    def pop_victim(self) -> Optional[Hashable]:
        """:meth:`victim`, removed from the policy (one call where every reserve on a
        full pool evicts)."""
        try:
            return self._order.popitem(last=False)[0]
        except KeyError:
            if self.spare:
                return None
        try:
            return self._unwritten.popitem(last=False)[0]
        except KeyError:
            return None

    def unpop(self, key: Hashable) -> None:
        """Put back the key :meth:`pop_victim` just took, as the next victim again."""
        order = self._unwritten if key in self._marks else self._order
        order[key] = None
        order.move_to_end(key, last=False)

    def candidates(self, n: int) -> list[Hashable]:
        """The next ``n`` victims in order (not removed)."""
        if self.spare:
            return list(itertools.islice(self._order, n))
        return list(itertools.islice(itertools.chain(self._order, self._unwritten), n))

    def __contains__(self, key: Hashable) -> bool:
        """Whether ``key`` is listed and may be evicted now (``spare``), pins aside."""
        return key in self._order or (not self.spare and key in self._unwritten)

    def __len__(self) -> int:
        return len(self._order) + (0 if self.spare else len(self._unwritten))
