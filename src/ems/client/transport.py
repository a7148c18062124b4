"""The seam between ContextCaching and a pool: the embedded pool or the daemon.

A transport answers control questions (reserve, commit, acquire, release, exists) in
batches, and hands out :class:`~ems.client.segment.Segment` objects: pool memory
mapped into this process, into which the client copies directly. Transports are
thread-safe; every method may raise :class:`~ems.errors.EmsException` (``EMS_IO_*``
for a lost pool) and nothing else.
"""

from __future__ import annotations

import abc
from typing import Any, NamedTuple, Optional, Sequence

from ems.client.segment import Segment
from ems.futures import Task
from ems.pool.core import GrantStatus

__all__ = ["Slot", "Transport", "GrantStatus"]

_EXISTS, _BUSY = GrantStatus.EXISTS, GrantStatus.BUSY


class Slot(NamedTuple):
    """A reservation (save) or a pin (load) of one key: where its bytes are.

    (A NamedTuple: immutable, and built per key on every call at a third of a frozen
    dataclass's cost.)"""

    status: GrantStatus
    token: int = 0
    segment: Optional[Segment] = None
    offset: int = 0
    size: int = 0

    @property
    def stored(self) -> bool:
        """Counts as saved without a copy (write-once key, or another writer's)."""
        return self.status is _EXISTS or self.status is _BUSY


class Transport(abc.ABC):
    """What ContextCaching needs from a pool."""

    #: "embedded" or "server", for logs and ``ems stats``
    kind: str = "?"

    @abc.abstractmethod
    def reserve(self, keys: Sequence[str], sizes: Sequence[int], task: Task) -> list[Slot]:
        """One slot per key: NEW (copy, then commit), EXISTS/BUSY, FULL, TOO_LARGE."""

    def save_one_step(self, keys: Sequence[str], sizes: Sequence[int], mover: Any,
                      task: Task) -> Optional[list[bool]]:
        """Optionally, a whole save in one step (``mover.to_pool`` copies item ``i`` as
        key ``i``): per key, whether it is stored; None when this transport does not
        take it (then: reserve, copy, commit)."""
        return None

    def load_one_step(self, keys: Sequence[str], sizes: Sequence[int], mover: Any,
                      task: Task) -> Optional[int]:
        """Optionally, a whole load in one step (pin the leading hits, ``mover.from_pool``
        copies them out, unpin): how many leading keys were loaded; None when this
        transport does not take it (then: acquire, copy, release)."""
        return None

    @abc.abstractmethod
    def commit(self, tokens: Sequence[int], task: Task) -> list[bool]:
        """Make reserved keys visible; False for a reservation that was lost."""

    @abc.abstractmethod
    def abort(self, tokens: Sequence[int]) -> None:
        """Give back reservations (best effort: never raises)."""

    @abc.abstractmethod
    def acquire(self, keys: Sequence[str], sizes: Sequence[int], task: Task) -> list[Slot]:
        """Pin the leading keys stored with exactly these sizes; stop at the first miss."""

    @abc.abstractmethod
    def release(self, tokens: Sequence[int]) -> None:
        """Unpin (best effort: never raises)."""

    @abc.abstractmethod
    def exists(self, keys: Sequence[str], sizes: Optional[Sequence[int]],
               read_local_only: bool = False) -> int:
        """How many leading keys are stored (with these sizes, where given);
        ``read_local_only``: not asking other hosts (a cluster daemon)."""

    @abc.abstractmethod
    def health(self) -> bool:
        """Cheap liveness probe; never raises."""

    @abc.abstractmethod
    def statistics(self) -> Any:
        """A frozen dataclass of counters (``PoolStatistics`` or the daemon's)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release everything; later calls raise ``EMS_NOT_INITIALIZED``."""
