"""Eviction policies: small strategies that observe the index and choose victims.

A policy only tracks *evictable* keys (committed, unpinned); the pool removes a key
from the policy while it is pinned or reserved, so :meth:`victim` is O(1) and never
returns something a reader is copying.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Hashable, Optional

__all__ = ["LruPolicy"]


class LruPolicy:
    """Least recently used first; every operation O(1)."""

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, key: Hashable) -> None:
        """``key`` became evictable (committed, or its last pin was released)."""
        order = self._order
        if key in order:
            order.move_to_end(key)
        else:  # (a new key goes to the end by itself)
            order[key] = None

    def touch(self, key: Hashable) -> None:
        """``key`` was used; keep it longer."""
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        """``key`` is no longer evictable (pinned or deleted)."""
        self._order.pop(key, None)

    def victim(self) -> Optional[Hashable]:
        """The key to evict next, or None when nothing can be evicted."""
        return next(iter(self._order), None)

    def pop_victim(self) -> Optional[Hashable]:
        """:meth:`victim`, removed from the policy (one call where every reserve on a
        full pool evicts)."""
        try:
            return self._order.popitem(last=False)[0]
        except KeyError:
            return None

    def unpop(self, key: Hashable) -> None:
        """Put back the key :meth:`pop_victim` just took, as the next victim again."""
        self._order[key] = None
        self._order.move_to_end(key, last=False)

    def candidates(self, n: int) -> list[Hashable]:
        """The next ``n`` victims in order (not removed)."""
        return list(itertools.islice(self._order, n))

    def __contains__(self, key: Hashable) -> bool:
        """Whether ``key`` is evictable now."""
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)
