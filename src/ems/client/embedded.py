"""The embedded pool: the pool core in this process, over an anonymous memory map.

A fresh install works with nothing started. The pool lives as long as the
``Ems.init`` that created it (``Ems.finalize`` drops it); it is shared by every
ContextCaching call of the process, and by nothing outside it: use ``ems-server``
to share a pool between processes.
"""

from __future__ import annotations

import mmap
import threading
from typing import Optional, Sequence

from ems.client.segment import Segment
from ems.client.transport import GrantStatus, Slot, Transport, two_phase_save
from ems.config import CcKvOption
from ems.errors import EmsErrorCode, EmsException
from ems.futures import Task
from ems.keys import Request
from ems.pool.core import GrantStatus as PoolGrant
from ems.pool.core import Pool, PoolStatistics

__all__ = ["EmbeddedTransport"]

#: the pool's grant statuses in the vocabulary of the transports (same values)
_STATUS = {g: GrantStatus(int(g)) for g in PoolGrant}


class EmbeddedTransport(Transport):
    kind = "embedded"

    def __init__(self, capacity_bytes: int, namespace: str = "") -> None:
        # MAP_NORESERVE: pages are only taken when written.
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)
        self._mm = mmap.mmap(-1, capacity_bytes, flags=flags)
        # Transparent huge pages where the host allows them on request (THP "madvise",
        # the common default): 512x fewer page faults on the first pass over the pool
        # (what numpy does for its own large arrays), and fewer TLB misses after.
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._mm.madvise(mmap.MADV_HUGEPAGE)
            except OSError:  # THP disabled or not supported: plain pages
                pass
        self.segment = Segment(0, self._mm)
        self.pool = Pool(capacity_bytes)
        self._ns = namespace
        self._lock = threading.Lock()
        self._closed = False

    def _check(self) -> None:
        if self._closed:
            raise EmsException(EmsErrorCode.EMS_NOT_INITIALIZED,
                               "the embedded pool was finalized")

    def _key(self, key: str) -> str:
        return self._ns + key

    def save(self, req: Request, task: Task, spin: bool = False) -> list[bool]:
        """Reserve -> copy (outside the lock) -> commit (:func:`two_phase_save`)."""
        return two_phase_save(req, task, self._reserve, self._commit, self._abort)

    def _reserve(self, keys: Sequence[str], sizes: Sequence[int], task: Task
                 ) -> tuple[None, list[Slot]]:
        with self._lock:
            self._check()
            ns = self._ns
            grants = self.pool.reserve([ns + k for k in keys], sizes)
        status, segment, new = _STATUS, self.segment, PoolGrant.NEW
        return None, [Slot(status[g.status], g.token, segment if g.status is new else None,
                           g.offset, g.size) for g in grants]

    def _commit(self, _handle: None, tokens: list[int], task: Task) -> list[bool]:
        with self._lock:
            self._check()
            return self.pool.commit(tokens)

    def _abort(self, _handle: None, tokens: list[int]) -> None:
        with self._lock:
            if not self._closed:
                self.pool.abort(tokens)

    def load(self, req: Request, task: Task, spin: bool = False) -> int:
        """Pin the leading hits -> copy them out (outside the lock) -> unpin."""
        with self._lock:
            self._check()
            pins = self.pool.acquire([self._key(k) for k in req.keys], req.sizes)
        if not pins:
            return 0
        try:
            req.mover.from_pool(range(len(pins)), [(self.segment, p.offset) for p in pins],
                                task)
        finally:
            with self._lock:
                if not self._closed:
                    self.pool.release([p.token for p in pins])
        return len(pins)

    def exists(self, keys: Sequence[str], sizes: Optional[Sequence[int]],
               option: Optional[CcKvOption] = None) -> int:
        with self._lock:
            self._check()
            return self.pool.exists([self._key(k) for k in keys], sizes)

    def health(self) -> bool:
        return not self._closed

    def statistics(self) -> PoolStatistics:
        with self._lock:
            return self.pool.statistics()

    def verify(self) -> PoolStatistics:
        """The pool's own invariants (``Allocator.check``: extents tile the arena, free
        neighbours merged, the used bytes add up) checked under the lock, then its
        statistics. For leak checks (``ems.testing.leaks``); raises AssertionError."""
        with self._lock:
            self.pool.allocator.check()
            return self.pool.statistics()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.segment.close()
