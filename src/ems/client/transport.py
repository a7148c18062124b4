"""The seam between ContextCaching and a pool: one call per verb.

A transport is asked to *save* or *load* a normalised request (``ems.keys.Request``:
storage keys, value sizes, a mover that copies item ``i`` between the caller's memory
and pool memory, the options) and owns how it does it::

    ContextCaching.save --> Transport.save(req, task) --> per key: stored?
                              embedded: reserve -> copy -> commit   (two_phase_save)
                              daemon:   small: cut from the lease -> copy -> Put
                                        large: Reserve -> copy -> Commit, in slices
                                               (the next Reserve in flight during a copy)
    ContextCaching.load --> Transport.load(req, task) --> leading keys loaded
                              pin the leading hits -> copy -> unpin

``ContextCaching`` normalises the input and counts leading successes, nothing more.
A transport is thread-safe and raises only :class:`~ems.errors.EmsException`
(``EMS_IO_*`` for a lost pool) or :class:`~ems.futures.Cancelled` (the task stopped at
a checkpoint: its deadline passed, or its caller gave up). ``spin`` asks a transport
that waits for replies to poll for them first (a synchronous call in its caller's
thread, ``EMS_SPIN_US``); asynchronous requests never spin.

:func:`two_phase_save` is the save that every pool can do with three operations
(reserve, commit, abort); the embedded pool saves this way. The daemon's transport
(``ems.client.remote``) does its own two phases for saves too large for its lease:
sliced by the daemon's key limit, one slice's Reserve overlapping the previous one's
copy, which a single reserve of every key cannot do.
"""

from __future__ import annotations

import abc
from typing import Any, Callable, NamedTuple, Optional, Sequence

from ems.client.segment import Segment
from ems.config import CcKvOption
from ems.futures import Cancelled, Task
from ems.keys import Request
from ems.protocol.messages import GrantStatus

__all__ = ["GrantStatus", "Slot", "Transport", "stored", "two_phase_save"]

_NEW, _EXISTS, _BUSY = GrantStatus.NEW, GrantStatus.EXISTS, GrantStatus.BUSY


class Slot(NamedTuple):
    """A reservation of one key (the answer of a transport's reserve operation).

    (A NamedTuple: immutable, and built per key on every call at a third of a frozen
    dataclass's cost.)"""

    status: GrantStatus
    token: int = 0
    segment: Optional[Segment] = None
    offset: int = 0
    size: int = 0


def two_phase_save(req: Request, task: Task,
                   reserve: Callable[[Sequence[str], Sequence[int], Task], tuple[Any, list[Slot]]],
                   commit: Callable[[Any, list[int], Task], list[bool]],
                   abort: Callable[[Any, list[int]], None]) -> list[bool]:
    """Reserve every key (one batch), copy the NEW ones into pool memory, commit them
    (one batch); per key whether it is stored. EXISTS (write-once) and BUSY (another
    writer's) count as stored without a copy. ``reserve`` returns a handle (what the
    reservations belong to, e.g. a connection) that ``commit``/``abort`` get back; a
    copy that fails or is cancelled aborts the reservations."""
    handle, slots = reserve(req.keys, req.sizes, task)
    new = [i for i, s in enumerate(slots) if s.status is _NEW]
    tokens = [slots[i].token for i in new]
    try:
        if new:
            req.mover.to_pool(new, [(slots[i].segment, slots[i].offset) for i in new], task)
        if not task.decide():  # the last checkpoint: publish, or give the space back
            raise Cancelled
    except BaseException:
        if tokens:
            abort(handle, tokens)
        raise
    return stored([s.status for s in slots], new,
                  commit(handle, tokens, task) if tokens else [])


def stored(statuses: Sequence[int], new: Sequence[int], committed: Sequence[bool]
           ) -> list[bool]:
    """Per key of a reserve-copy-commit save whether it is stored, from its grant's
    status (a :class:`GrantStatus` or its value on the wire): EXISTS and BUSY count; a
    NEW key (``statuses[new[j]]``) if its commit did (``committed[j]``)."""
    if len(new) == len(statuses) and all(committed):  # (a save of new blocks, all done)
        return [True] * len(statuses)
    done = dict(zip(new, committed))
    return [s == _EXISTS or s == _BUSY or done.get(i, False) for i, s in enumerate(statuses)]


class Transport(abc.ABC):
    """What ContextCaching needs from a pool (see the module docstring)."""

    #: "embedded" or "server", for logs and ``ems stats``
    kind: str = "?"

    @abc.abstractmethod
    def save(self, req: Request, task: Task, spin: bool = False) -> list[bool]:
        """Store each key of ``req``; per key whether it is stored. The task has
        decided (``task.decide()``) before anything became visible."""

    @abc.abstractmethod
    def load(self, req: Request, task: Task, spin: bool = False) -> int:
        """Copy the leading keys stored with exactly ``req.sizes`` into the caller's
        memory, stopping at the first miss; how many were loaded."""

    @abc.abstractmethod
    def exists(self, keys: Sequence[str], sizes: Optional[Sequence[int]],
               option: Optional[CcKvOption] = None) -> int:
        """How many leading keys are stored (with these sizes, where given)."""

    @abc.abstractmethod
    def health(self) -> bool:
        """Cheap liveness probe; never raises."""

    @abc.abstractmethod
    def statistics(self) -> Any:
        """A frozen dataclass of counters (``PoolStatistics`` or the daemon's)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release everything; later calls raise ``EMS_NOT_INITIALIZED``."""
