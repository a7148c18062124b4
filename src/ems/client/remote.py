"""RemoteTransport: the SDK's side of ``ems-server``, over a unix socket.

Only control messages cross the socket (``ems.protocol``); the bytes do not. At
``Ems.init`` the daemon hands this process its tenant's memfd (SCM_RIGHTS) and the
client maps it once (a :class:`~ems.client.segment.Segment`); a save then copies the
caller's memory straight into the slots the daemon reserved, and a load copies the
pinned slots straight into the caller's memory: one copy per direction.

The verbs (see ``ems.client.transport``)::

    save(req)  small (<= a quarter of the lease): cut ranges from the lease -> copy -> Put
               (one round trip; the first small save of a connection asks for a Lease)
               large, or no lease to be had: Reserve -> copy -> Commit (_save_reserved;
               past max_keys in slices, the next Reserve in flight during a copy)
    load(req)  Acquire (pins the leading hits) -> copy -> Release (one-way)

The connection holds a LEASE of pool space (asked for on the first small save,
renewed with a ``Put`` reply before it runs out); a ``Put`` is answered once every key
is committed (visible to every process) or found stored (EXISTS/BUSY, its range
freed). A lease belongs to its connection, like reservation tokens and pins do: none
of them is ever sent on another connection. Batches go in slices of the daemon's
``max_keys`` (its Welcome).

Concurrency: one connection per process, shared by every worker thread. Requests
carry ids; the thread that waits for a reply reads the socket itself when no other
thread does, and routes the replies it reads to the threads that wait for them
(leader/follower, see :class:`Session`).

Deadlines: a request waits at most ``Task.remaining_s()`` for its reply, then raises
``EMS_IO_TIMEOUT``; a reply that arrives later is undone here (its pins released, its
reservations aborted), so nothing leaks and nothing is copied. A request without a
deadline (``timeout=0``) still gives up after :data:`LIVENESS_S`, when the daemon is
taken for hung and the connection is dropped (``EMS_IO_ERROR``).

Losing the daemon (it died, or restarted)::

    CONNECTED --(EOF / send error / liveness)--> BROKEN --(next call, health())--> CONNECTED
                                                   |             reconnect
                                                   +--(reconnect fails)--> stays BROKEN

* a request in flight when the connection broke raises ``EMS_IO_ERROR``, and so does
  a request made while the daemon cannot be reached;
* the next call (or ``Ems.check_health()``, which tries with a short timeout)
  reconnects by itself and authenticates again; the process never has to call
  ``Ems.init`` again (``EMS_RECOVERD_ERROR`` is raised only by an ``Ems.init`` that
  finds no daemon yet; a second ``Ems.init`` with the same config returns at once);
* reservations and pins belong to a connection: tokens of a broken connection are
  never sent on its successor (a commit of them raises ``EMS_IO_ERROR``), and the
  daemon dropped what that connection held;
* a save must finish copying within 80% of the daemon's reservation TTL (default
  60 s), also without a deadline: past it, the daemon may give the space to another
  key, so the copy stops at its next checkpoint with ``EMS_IO_TIMEOUT`` instead;
* a copy that is running when the daemon dies finishes from this process's own
  mapping of the old memfd, which stays valid (and whose pinned bytes nobody can
  reuse: the old daemon is gone); no byte is written after a call returned or raised.

After ``fork()`` the child never uses its parent's connection: it opens its own on
first use (and maps the tenant's memory again through it).
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import operator
import os
import threading
import time
import weakref
from typing import Any, Callable, NamedTuple, Optional, Sequence

from ems.client.session import (
    LIVENESS_S,
    Pending,
    Session,
    Timeout,
    bad_reply,
    io_error,
)
from ems.client.transport import GrantStatus, Transport, stored
from ems.config import CcKvOption
from ems.errors import EmsErrorCode, EmsException
from ems.futures import Cancelled, Task
from ems.keys import Request
from ems.protocol import messages as m
from ems.protocol.report import PoolStatistics, only_tenant

__all__ = ["LIVENESS_S", "RemoteTransport", "server_report"]

logger = logging.getLogger(__name__)

#: Bound of ``health()`` (a ping, or one reconnect attempt).
HEALTH_TIMEOUT_S = 1.0
#: Bound of requests that have no Task (``exists``, ``statistics``).
CONTROL_TIMEOUT_S = 5.0
#: Bytes of a load's part (:meth:`RemoteTransport.load`): a part is copied out while
#: the daemon pins the next ones. 16 MiB: its copy (~1.5-3 ms at the benchmark VM's
#: copy limit) hides behind the disk's read of the next part (~8 ms at 2 GB/s), and a
#: load of objects in shared memory pays one more round trip per 16 MiB (~0.1 ms).
LOAD_PART_BYTES = 16 << 20
#: Bytes of one load in flight at once, in parts of :data:`LOAD_PART_BYTES`: the disk
#: has the next part to read while the client copies one and sends the request for the
#: one after it. Counted in bytes, so the small parts at a load's end (:func:`_taper`)
#: go out together and keep the disk as deep as two whole parts do (the next part is
#: always in flight, also where one part is larger than the window).
LOAD_WINDOW = 2
#: The smallest part the last part of a load is cut into (:func:`_taper`).
LOAD_TAPER_MIN_BYTES = 2 << 20
#: Share of the daemon's reservation TTL a save may spend copying.
_TTL_SHARE = 0.8
_NEW = GrantStatus.NEW
#: the grant statuses a daemon may answer (their values on the wire)
_KNOWN_STATUSES = frozenset(int(g) for g in GrantStatus)
#: The hot requests go out in their wire form, built by name (``Cls.wire``): no object.
_put_wire, _acquire_wire = m.Put.wire, m.Acquire.wire


def _new_in(statuses: list[int], lo: int, hi: int) -> Sequence[int]:
    """The keys in ``[lo, hi)`` granted NEW: the range itself where all were (counted at
    C speed), else their indexes."""
    if statuses[lo:hi].count(_NEW) == hi - lo:
        return range(lo, hi)
    return [i for i in range(lo, hi) if statuses[i] == _NEW]


def _picked(values: list[int], which: Sequence[int]) -> list[int]:
    """``values[i]`` for each ``i`` of ``which`` (all of them, as they are, where
    ``which`` is every index)."""
    if type(which) is range and which.start == 0 and len(which) == len(values):
        return values
    return [values[i] for i in which]


def _chunks(n: int, max_keys: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` slices of ``n`` keys, ``max_keys`` each (the daemon's limit per
    request)."""
    return [(lo, min(n, lo + max_keys)) for lo in range(0, n, max_keys)]


def _slices(sizes: Sequence[int], max_keys: int, nbytes: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` slices of keys of ``sizes``: at most ``max_keys`` keys and, past the
    first key, at most ``nbytes`` bytes each (no key: none)."""
    out: list[tuple[int, int]] = []
    lo = 0
    n = len(sizes)
    while lo < n:
        hi, total = lo + 1, sizes[lo]
        end = min(n, lo + max_keys)
        while hi < end and total + sizes[hi] <= nbytes:
            total += sizes[hi]
            hi += 1
        out.append((lo, hi))
        lo = hi
    return out


def _parts(sizes: Sequence[int], max_keys: int, part_bytes: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` parts of a load of keys of ``sizes``: :func:`_slices` of
    ``part_bytes`` (an empty load: one part).

    The last part of a load of several is cut smaller (:func:`_taper`): it is the one
    copied after the disk's last read, so its copy is the load's tail."""
    out = _slices(sizes, max_keys, part_bytes)
    return _taper(out, sizes) if len(out) > 1 else out or [(0, 0)]


def _taper(parts: list[tuple[int, int]], sizes: Sequence[int]) -> list[tuple[int, int]]:
    """``parts`` with the last one cut in two by bytes, its second half again, and so
    on down to :data:`LOAD_TAPER_MIN_BYTES` or one key (16 MiB: 8, 4, 2, 2).

    Why: the daemon answers a part when its last read is done, and the client copies
    a part only once the one before is copied, so what it copies after the disk's last
    read is about the last part. Cut so, with the same bytes in flight
    (:data:`LOAD_WINDOW`), loads of 64 MiB from the disk tier (``ems-server --disk
    --huge-pages on``, one daemon, switched between alternating loads) went 1.70 ->
    1.78 GB/s at 1 MiB values (four pairs) and 1.66 -> 1.73 at 256 KiB (five pairs,
    each won); from shared memory alone they cost 1.5-1.8 % (6.73 -> 6.61 and 7.05 ->
    6.95 GB/s, medians of 30), three more round trips hidden behind the copies."""
    out = parts[:-1]
    lo, hi = parts[-1]
    while hi - lo > 1 and (total := sum(sizes[lo:hi])) > LOAD_TAPER_MIN_BYTES:
        half, filled, mid = total // 2, sizes[lo], lo + 1
        while mid < hi - 1 and filled + sizes[mid] <= half:
            filled += sizes[mid]
            mid += 1
        out.append((lo, mid))
        lo = mid
    out.append((lo, hi))
    return out


def _slice_of(make: Callable[[int, int, int], Any], lo: int, hi: int, rid: int) -> Any:
    return make(rid, lo, hi)


# A request's options travel with it (a cluster daemon acts on them, ems.server.
# cluster_tier; a single-host daemon ignores them).
def _write_rcache(option: Optional[CcKvOption]) -> bool:
    return True if option is None else bool(option.write_rcache)


def _write_out(option: Optional[CcKvOption]) -> bool:
    return True if option is None else bool(option.write_out)


#: the trailing fields of a Put and of a Reserve newer than ems 0.1.0's daemon (left off
#: while at their defaults: ``ems.protocol.messages.trimmed``)
_PUT_NEWER, _RESERVE_NEWER = 1, 2  # write_out; write_out and budget_ms


def _read_local_only(option: Optional[CcKvOption]) -> bool:
    return False if option is None else bool(option.read_local_only)


def _budget_ms(task: Optional[Task]) -> int:
    """What is left of the task's deadline, ms (0: no deadline)."""
    if task is None or task.deadline is None:
        return 0
    return max(1, int((task.deadline - time.monotonic()) * 1000))


class _Flight(NamedTuple):
    """A request on its way (``RemoteTransport._send``)."""

    session: Session
    pending: Optional[Pending]
    bounded: bool  # by a deadline (else by LIVENESS_S, which fails the connection)
    wait_s: float


# ---------------------------------------------------------------------- transport

class RemoteTransport(Transport):
    """The daemon's pool (see the module docstring)."""

    kind = "server"

    def __init__(self, path: str, access_id: Optional[str], access_key: Optional[str],
                 connect_timeout_s: float, session: Session, spin_s: float = 0.0) -> None:
        self.path = path
        #: synchronous calls poll this long for a reply before sleeping (EMS_SPIN_US)
        self.spin_s = spin_s
        self._access_id = access_id
        self._access_key = access_key
        self._connect_timeout_s = connect_timeout_s
        self._session: Optional[Session] = session
        self._gen = session.gen
        self._reconnect_lock = threading.Lock()
        self._closed = False
        _LIVE.add(self)

    @classmethod
    def connect(cls, sock_path: str, access_id: Optional[str], access_key: Optional[str],
                timeout_s: float, spin_s: float = 0.0) -> "RemoteTransport":
        """Connect and authenticate within ``timeout_s``; raises ``EMS_RECOVERD_ERROR``
        (no daemon answers yet), ``EMS_AUTH_FAILED``, ``EMS_IO_ERROR`` or
        ``EMS_PROTOCOL_ERROR``."""
        session = Session.open(sock_path, access_id, access_key, timeout_s, gen=1)
        return cls(sock_path, access_id, access_key, timeout_s, session, spin_s)

    # ------------------------------------------------------------ sessions
    def _live(self, timeout_s: float) -> Session:
        """The current connection, reconnecting (within ``timeout_s``) if it broke."""
        session = self._session
        if session is not None and session.broken is None:
            return session
        self._check_open()
        if not self._reconnect_lock.acquire(timeout=max(timeout_s, 0.0)):
            raise io_error("ems-server is unreachable (reconnecting)")
        try:
            self._check_open()
            session = self._session
            if session is not None and session.broken is None:
                return session
            try:
                session = Session.open(self.path, self._access_id, self._access_key,
                                        min(timeout_s, self._connect_timeout_s), self._gen + 1)
            except EmsException as exc:
                if exc.status_code() is EmsErrorCode.EMS_AUTH_FAILED:
                    raise
                raise io_error(f"ems-server is unreachable: {exc.message()}") from exc
            self._gen = session.gen
            old, self._session = self._session, session
            if old is not None and old.segment is not None:
                old.segment.retire()  # unmapped now, or when its last copy ends
            logger.info("ems: reconnected to ems-server at %s", self.path)
            return session
        finally:
            self._reconnect_lock.release()

    def _check_open(self) -> None:
        if self._closed:
            raise EmsException(EmsErrorCode.EMS_NOT_INITIALIZED,
                               "the ems-server client was closed (Ems.finalize)")

    def _call(self, msg_for: Callable[[int], Any], task: Optional[Task],
              session: Optional[Session] = None, spin: bool = False
              ) -> tuple[Session, m.Message]:
        """One request within the task's deadline (or the default bounds), polling for
        the reply first when ``spin`` (a synchronous call: ``EMS_SPIN_US``)."""
        flight = self._send(msg_for, task, session)
        return flight.session, self._reply(flight, task, spin)

    def _send(self, msg_for: Callable[[int], Any], task: Optional[Task],
              session: Optional[Session] = None) -> "_Flight":
        """The first half of :meth:`_call`: the request goes out; :meth:`_reply` waits
        for its answer (or ``flight.session.abandon(flight.pending)``)."""
        if self._closed:
            self._check_open()
        bounded = True  # by the task's deadline (or CONTROL_TIMEOUT_S without a task)
        if task is None:
            wait_s = CONTROL_TIMEOUT_S
        else:
            if task.deadline is None:
                wait_s, bounded = LIVENESS_S, False
            else:
                wait_s = task.deadline - time.monotonic()
        if wait_s <= 0:
            raise EmsException(EmsErrorCode.EMS_IO_TIMEOUT,
                               f"{task.what if task else 'request'} ran out of time")
        if session is None:
            session = self._session
            if session is None or session.broken is not None:
                start = time.monotonic()
                session = self._live(wait_s)
                wait_s = max(0.0, wait_s - (time.monotonic() - start))
        try:
            pending = session.send(msg_for, wait_s)
        except Timeout:
            raise self._timed_out(_Flight(session, None, bounded, wait_s), task) from None
        return _Flight(session, pending, bounded, wait_s)

    def _reply(self, flight: "_Flight", task: Optional[Task], spin: bool = False
               ) -> m.Message:
        try:
            return flight.session.reply_to(flight.pending,  # type: ignore[arg-type]
                                           self.spin_s if spin else 0.0)
        except Timeout:
            raise self._timed_out(flight, task) from None

    @staticmethod
    def _timed_out(flight: "_Flight", task: Optional[Task]) -> EmsException:
        if not flight.bounded:
            exc = io_error(f"ems-server did not answer within {LIVENESS_S:.0f} s")
            flight.session.fail(exc)
            return exc
        what = task.what if task is not None else "the request"
        return EmsException(EmsErrorCode.EMS_IO_TIMEOUT,
                            f"ems-server did not answer {what} within "
                            f"{flight.wait_s * 1000:.0f} ms")

    def _ready(self, task: Optional[Task]) -> Session:
        """The live connection for a batch of several requests (reconnecting within the
        task's time when it broke)."""
        session = self._session
        if session is not None and session.broken is None:
            return session
        if task is None:
            wait_s = CONTROL_TIMEOUT_S
        elif task.deadline is None:
            wait_s = LIVENESS_S
        else:
            wait_s = task.deadline - time.monotonic()
            if wait_s <= 0:
                raise EmsException(EmsErrorCode.EMS_IO_TIMEOUT, f"{task.what} ran out of time")
        return self._live(wait_s)

    def _sliced(self, n: int, make: Callable[[int, int, int], Any], cls: type,
                task: Optional[Task], more: Callable[[Any, int], bool], spin: bool = False
                ) -> list:
        """A batch of ``n`` entries as requests of at most the daemon's ``max_keys``
        entries each (``Limits.max_keys_per_request``), in order on one connection:
        ``make(rid, lo, hi)`` builds slice ``[lo, hi)``; ``more(reply, hi - lo)`` says
        whether the next slice is still wanted (an exists stops at its first miss).
        Their replies hold nothing to give back (a load, whose pins do, goes in parts:
        :meth:`load`)."""
        session = self._ready(task)
        replies: list = []
        for lo, hi in _chunks(n, session.max_keys) or [(0, 0)]:  # (empty: one request)
            _, reply = self._call(functools.partial(_slice_of, make, lo, hi), task,
                                  session, spin)
            if type(reply) is not cls:
                raise bad_reply(f"{type(reply).__name__} instead of {cls.__name__}")
            replies.append(reply)
            if hi >= n or not more(reply, hi - lo):
                break
        return replies

    # ------------------------------------------------------------ Transport
    def save(self, req: Request, task: Task, spin: bool = False) -> list[bool]:
        """A small save through the lease (cut ranges, copy, one Put: one round trip),
        asking for a lease when it is short; the others, and small ones when no lease
        can be had, as :meth:`_save_reserved` (Reserve, copy, Commit)."""
        session = self._ready(task)
        if session.lease.fits(req.sizes):
            stored = self._save_leased(session, req, task, spin)
            if stored is not None:
                return stored
        return self._save_reserved(session, req, task, spin)

    def _save_leased(self, session: Session, req: Request, task: Task, spin: bool
                     ) -> Optional[list[bool]]:
        """Per key whether it is stored; None when no lease can be had now."""
        lease = session.lease
        cut = lease.take(req.sizes)
        if cut is None:  # short: a fresh lease (one round trip), unless refused lately
            if lease.refused(time.monotonic()):
                return None
            _, reply = self._call(lambda rid: m.Lease(rid=rid), task, session, spin)
            if not isinstance(reply, m.Leased):
                raise bad_reply(f"{type(reply).__name__} for a Lease")
            if not reply.size:
                lease.refuse(time.monotonic())
                return None
            self._install(session, reply.offset, reply.size)
            cut = lease.take(req.sizes)
            if cut is None:  # other threads used it up first
                return None
        offsets, want = cut
        segment = session.segment
        sizes = list(req.sizes)
        try:
            req.mover.to_pool(range(len(offsets)), [(segment, offset) for offset in offsets],
                              task)
            if not task.decide():
                raise Cancelled
        except BaseException:
            if want:
                lease.asked_done()
            session.post(m.Return.wire(offsets=list(offsets), sizes=sizes))
            raise
        return self._put(session, list(req.keys), offsets, sizes, want, task, spin,
                         _write_rcache(req.option), req.hashes, _write_out(req.option))

    def _put(self, session: Session, keys: list[str], offsets: list[int], sizes: list[int],
             want: bool, task: Task, spin: bool, write_rcache: bool = True,
             hashes: Optional[list[int]] = None, write_out: bool = True) -> list[bool]:
        """One Put of written lease ranges (asking for a fresh lease when ``want``)."""
        try:
            _, reply = self._call(
                lambda rid: m.trimmed(_put_wire(
                    rid=rid, keys=keys, offsets=offsets, sizes=sizes, want_lease=want,
                    write_rcache=write_rcache, budget_ms=_budget_ms(task), hashes=hashes,
                    write_out=write_out), _PUT_NEWER),
                task, session, spin)
        except EmsException:
            # If the Put did reach the daemon, this comes after it and finds the ranges
            # carved already (and is ignored).
            session.post(m.Return.wire(offsets=offsets, sizes=sizes))
            raise
        finally:
            if want:
                session.lease.asked_done()
        if not isinstance(reply, m.Stored) or len(reply.ok) != len(keys):
            raise bad_reply(f"{type(reply).__name__} for a Put of {len(keys)} keys")
        if reply.lease_size:
            self._install(session, reply.lease_offset, reply.lease_size)
        return list(reply.ok)

    @staticmethod
    def _install(session: Session, offset: int, size: int) -> None:
        segment = session.segment
        try:
            if segment is None or offset + size > segment.size:
                raise ValueError("outside its segment")
            back = session.lease.install(offset, size)
        except ValueError as exc:
            session.post(m.Return.wire(offsets=[offset], sizes=[size]))
            raise bad_reply(f"a lease [{offset}, +{size}): {exc}") from None
        if back[1] > 0:
            session.post(m.Return.wire(offsets=[back[0]], sizes=[back[1]]))

    def _save_reserved(self, session: Session, req: Request, task: Task, spin: bool
                       ) -> list[bool]:
        """Reserve -> copy -> Commit. A save goes in slices of at most the daemon's
        ``max_keys`` and the request's ``save_slice_bytes`` (:func:`_slices`), slice k+1's
        Reserve in flight while slice k's values are copied (the daemon's reservation
        work runs beside the copy). The Commit of every key follows the task's last checkpoint
        (``decide``): nothing is visible before the call has decided to succeed. Per
        key whether it is stored (EXISTS and BUSY count).

        The grants stay the answers' columns (statuses, tokens, offsets), checked at C
        speed, not a ``Slot`` per key: where a slice is all NEW (a save of new blocks)
        nothing is built per key but the copy's places. Measured on the 2-vCPU VM, 1
        GiB of 16 KiB values saved through ``ems-server --disk``, six alternating pairs:
        the client's CPU 6.0-6.7 -> 5.3-6.1 us a value (medians 6.65 -> 5.65), CPU the
        caller's process no longer spends; the spill itself did not change (medians 65.4
        and 65.2 thousand values a second: the daemon bounds it,
        ``benchmarks/disk_spill_breakdown.py``)."""
        keys, sizes = list(req.keys), list(req.sizes)
        hashes = req.hashes
        wrc, out = _write_rcache(req.option), _write_out(req.option)
        slice_bytes = req.save_slice_bytes
        chunks = (_chunks(len(keys), session.max_keys) if slice_bytes is None
                  else _slices(sizes, session.max_keys, slice_bytes)) or [(0, 0)]

        def reserve(lo: int, hi: int) -> _Flight:
            return self._send(lambda rid: m.trimmed(m.Reserve.wire(
                rid=rid, keys=keys[lo:hi], sizes=sizes[lo:hi], write_rcache=wrc,
                hashes=None if hashes is None else hashes[lo:hi], write_out=out,
                budget_ms=_budget_ms(task)), _RESERVE_NEWER), task, session)
        # the grants of the slices answered so far, per key
        statuses: list[int] = []
        tokens: list[int] = []
        offsets: list[int] = []
        segment = session.segment
        sent_at = time.monotonic()  # before the daemon starts the reservations' TTL
        flight: Optional[_Flight] = reserve(*chunks[0])
        try:
            for k, (lo, hi) in enumerate(chunks):
                assert flight is not None
                reply, flight = self._reply(flight, task, spin), None
                granted = self._granted(session, reply, sizes[lo:hi])
                statuses += granted.statuses
                tokens += granted.tokens
                offsets += granted.offsets
                if k + 1 < len(chunks):
                    flight = reserve(*chunks[k + 1])
                new = _new_in(statuses, lo, hi)
                if new:
                    # The daemon frees a reservation after its TTL and may give the
                    # space to another key: the copy must stop (at its next checkpoint,
                    # EMS_IO_TIMEOUT) well before that, also without a deadline (from
                    # the first Reserve's sending: the earliest TTL of every slice).
                    task.tighten(sent_at + session.welcome.reservation_ttl_s * _TTL_SHARE)
                    places = (list(zip(itertools.repeat(segment), offsets[lo:hi]))
                              if type(new) is range else [(segment, offsets[i]) for i in new])
                    req.mover.to_pool(new, places, task)
            if not task.decide():  # the last checkpoint: publish, or give the space back
                raise Cancelled
        except BaseException:
            if flight is not None:  # its Granted is undone when it comes
                session.abandon(flight.pending)  # type: ignore[arg-type]
            mine = _picked(tokens, _new_in(statuses, 0, len(statuses)))
            if mine:
                self._abort(session, mine)
            raise
        new = _new_in(statuses, 0, len(statuses))
        return stored(statuses, new, self._commit(session, _picked(tokens, new), task, spin)
                      if new else [])

    def _granted(self, session: Session, reply: m.Message, sizes: list[int]) -> m.Granted:
        """``reply``, checked as the Granted of a Reserve of keys of ``sizes``: one entry
        per key, known statuses, every NEW range in the segment and of its size (at C
        speed, range by range only to name a bad one); else its reservations are
        aborted and it raises."""
        if type(reply) is not m.Granted or len(reply.statuses) != len(sizes):
            if type(reply) is m.Granted:
                self._undo_granted(session, reply)
            raise bad_reply(f"{type(reply).__name__} for a Reserve of {len(sizes)} keys")
        try:
            if not _KNOWN_STATUSES.issuperset(reply.statuses):
                unknown = next(s for s in reply.statuses if s not in _KNOWN_STATUSES)
                raise bad_reply(f"an unknown grant status: {unknown}")
            self._check_ranges(session, reply.offsets, reply.sizes, sizes, reply.statuses)
        except EmsException:
            self._undo_granted(session, reply)
            raise
        return reply

    def _commit(self, session: Session, tokens: list[int], task: Task,
                spin: bool = False) -> list[bool]:
        if session is not self._session or session.broken is not None:
            raise io_error("the connection to ems-server was lost during this save; "
                            "its reservations are gone")
        try:
            replies = self._sliced(
                len(tokens), lambda rid, lo, hi: m.Commit(rid=rid, tokens=tokens[lo:hi],
                                                          budget_ms=_budget_ms(task)),
                m.Committed, task, lambda r, n: True, spin)
        except EmsException:
            # Nobody aborts after a failed commit: do it here. If the commit did reach
            # the daemon, this comes after it on the same connection and is a no-op.
            self._post_list(session, tokens, m.Abort)
            raise
        done = [x for r in replies for x in r.ok]
        if len(done) != len(tokens):
            raise bad_reply(f"Committed of {len(done)} for a Commit of {len(tokens)} tokens")
        return done

    def _abort(self, session: Session, tokens: list[int]) -> None:
        """Best effort: tokens mean something only on the connection that got them."""
        if session is self._session and not self._closed:
            self._post_list(session, tokens, m.Abort)

    def _undo_granted(self, session: Session, reply: m.Granted) -> None:
        tokens = [t for s, t in zip(reply.statuses, reply.tokens) if s == GrantStatus.NEW]
        self._post_list(session, tokens, m.Abort)

    def _post_list(self, session: Session, tokens: Sequence[int],
                   kind: type[m.Abort] | type[m.Release]) -> None:
        """One-way messages of tokens, in slices the daemon takes."""
        step = session.max_keys
        for lo in range(0, len(tokens), step):
            session.post(kind.wire(tokens=list(tokens[lo:lo + step])))

    def load(self, req: Request, task: Task, spin: bool = False) -> int:
        """Pin the leading hits, copy them out, unpin: how many leading keys loaded.

        A load goes in parts (:func:`_parts`: at most ``max_keys`` keys and about
        :data:`LOAD_PART_BYTES` each, the last one cut smaller), :data:`LOAD_WINDOW`
        parts' worth in flight: part k is copied out while the daemon pins (and its
        disk tier reads) parts k + 1 and k + 2 (and the small parts of the tail with
        them), and released as soon as it is copied. A load of objects only the disk
        holds is then the disk's read plus the copy of its last part, instead of the
        read plus the copy of all of it (``ems bench --disk``). The first part that
        comes back short ends the load (its leading hits count); the parts still in
        flight are undone when their replies come, unread."""
        keys, sizes = list(req.keys), list(req.sizes)
        local_only = _read_local_only(req.option)
        session = self._ready(task)
        parts = _parts(sizes, session.max_keys, LOAD_PART_BYTES)
        flights: collections.deque[_Flight] = collections.deque()

        def acquire(lo: int, hi: int) -> _Flight:
            return self._send(lambda rid: _acquire_wire(
                rid=rid, keys=keys[lo:hi], sizes=sizes[lo:hi], local_only=local_only,
                budget_ms=_budget_ms(task)), task, session)
        loaded = 0
        # In flight: parts k .. k + LOAD_WINDOW - 1 always, more while they add up to
        # no more bytes and keys than LOAD_WINDOW whole parts (the tapered tail).
        part_bytes = [sum(sizes[lo:hi]) for lo, hi in parts]
        most_bytes, most_keys = LOAD_WINDOW * LOAD_PART_BYTES, LOAD_WINDOW * session.max_keys
        sent = bytes_held = keys_held = 0  # parts sent; of those not answered yet

        def send_from(k: int) -> None:  # part k's answer is the next one taken
            nonlocal sent, bytes_held, keys_held
            while sent < len(parts):
                lo, hi = parts[sent]
                if sent >= k + LOAD_WINDOW and (bytes_held + part_bytes[sent] > most_bytes
                                                or keys_held + hi - lo > most_keys):
                    return
                flights.append(acquire(lo, hi))
                bytes_held += part_bytes[sent]
                keys_held += hi - lo
                sent += 1
        try:
            send_from(0)
            for k, (lo, hi) in enumerate(parts):
                reply = self._reply(flights.popleft(), task, spin)
                bytes_held -= part_bytes[k]
                keys_held -= hi - lo
                pins = self._pins(session, reply, sizes[lo:hi])
                whole = len(pins.tokens) == hi - lo
                if whole:
                    send_from(k + 1)
                if pins.tokens:
                    try:
                        req.mover.from_pool(range(lo, lo + len(pins.tokens)),
                                            [(session.segment, offset)
                                             for offset in pins.offsets], task)
                    finally:
                        session.release(pins.tokens)  # with the next frame
                    loaded += len(pins.tokens)
                if not whole:
                    break
        finally:
            for flight in flights:  # their pins are released when they come
                session.abandon(flight.pending)  # type: ignore[arg-type]
        return loaded

    def _pins(self, session: Session, reply: m.Message, sizes: list[int]) -> m.Pinned:
        """``reply`` as the Pinned of an Acquire of keys of ``sizes``: the leading hits,
        every range inside the segment and of the expected size (else it unpins them
        and raises)."""
        if type(reply) is not m.Pinned:
            raise bad_reply(f"{type(reply).__name__} instead of Pinned")
        if len(reply.tokens) > len(sizes):
            self._post_list(session, reply.tokens, m.Release)
            raise bad_reply(f"{len(reply.tokens)} pins for an Acquire of {len(sizes)} keys")
        try:
            got = list(reply.sizes)
            self._check_ranges(session, reply.offsets, got, sizes[:len(got)])
        except EmsException:
            self._post_list(session, reply.tokens, m.Release)
            raise
        return reply

    def exists(self, keys: Sequence[str], sizes: Optional[Sequence[int]],
               option: Optional[CcKvOption] = None) -> int:
        keys = list(keys)
        want = None if sizes is None else list(sizes)
        local_only = _read_local_only(option)
        budget = int(CONTROL_TIMEOUT_S * 1000 * 0.8)  # bounds a cluster daemon's lookup
        replies = self._sliced(
            len(keys), lambda rid, lo, hi: m.Exists(rid=rid, keys=keys[lo:hi],
                                                    sizes=None if want is None else want[lo:hi],
                                                    local_only=local_only, budget_ms=budget),
            m.Count, None, lambda r, n: r.n == n)
        n = sum(r.n for r in replies)
        if n > len(keys) or any(r.n > len(keys) for r in replies):
            raise bad_reply(f"a Count of {n} for an Exists of {len(keys)} keys")
        return n

    def health(self) -> bool:
        try:
            session = self._live(HEALTH_TIMEOUT_S)
            return isinstance(session.request(lambda rid: m.Ping(rid=rid), HEALTH_TIMEOUT_S),
                              m.Pong)
        except EmsException:
            return False

    def statistics(self) -> PoolStatistics:
        """This tenant's pool, as the daemon counts it."""
        return only_tenant(self.server_report(all_tenants=False))

    def server_report(self, all_tenants: bool = False) -> dict[str, Any]:
        """The daemon's statistics report (``ems-server stats --json`` prints one)."""
        _, reply = self._call(lambda rid: m.Stats(rid=rid, all_tenants=all_tenants), None)
        if not isinstance(reply, m.StatsReply):
            raise bad_reply(f"{type(reply).__name__} for Stats")
        return reply.stats

    def close(self) -> None:
        with self._reconnect_lock:
            if self._closed:
                return
            self._closed = True
            session, self._session = self._session, None
        if session is not None:
            session.close()
            if session.segment is not None:
                session.segment.retire()

    # ------------------------------------------------------------ internals
    @classmethod
    def _check_ranges(cls, session: Session, offsets: list[int], sizes: list[int],
                      expected: list[int], statuses: Optional[list[int]] = None) -> None:
        """:meth:`_check_range` of every range (of the NEW grants only, where their
        ``statuses`` are given): for the whole batch at C speed (24 pins: ~5.4 -> ~2.5
        us; 2,048 grants with their slots ~0.9 -> ~0.4 us a key), then, only when that
        fails, range by range to name the first bad one."""
        seg = session.segment
        if seg is not None and sizes == expected and (
                not offsets or max(map(operator.add, offsets, sizes)) <= seg.size):
            return
        for i, (offset, size, want) in enumerate(zip(offsets, sizes, expected)):
            if statuses is None or statuses[i] == _NEW:
                cls._check_range(session, offset, size, want)

    @staticmethod
    def _check_range(session: Session, offset: int, size: int, expected: int) -> None:
        seg = session.segment
        if seg is None or size != expected or offset + size > seg.size:
            raise bad_reply(f"a slot [{offset}, +{size}) outside its segment or of the "
                             f"wrong size (expected {expected})")


#: Transports of this process, so a forked child can let go of its parent's connections.
_LIVE: "weakref.WeakSet[RemoteTransport]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """A forked child must not talk on its parent's socket (replies would go to whoever
    reads first): it reconnects on first use, with a connection of its own."""
    for transport in list(_LIVE):
        transport._reconnect_lock = threading.Lock()  # may have been held at fork time
        session = transport._session
        if session is not None:
            session.abandon_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


def server_report(sock_path: str, timeout_s: float = CONTROL_TIMEOUT_S,
                  access_id: Optional[str] = None, access_key: Optional[str] = None
                  ) -> dict[str, Any]:
    """Fetch the daemon's statistics: every tenant with an admin session (the daemon's
    user or root, no credentials), else only the tenant of ``access_id``."""
    admin = access_id is None
    session = Session.open(sock_path, access_id, access_key, timeout_s, gen=1, admin=admin)
    try:
        reply = session.request(lambda rid: m.Stats(rid=rid, all_tenants=True), timeout_s)
    except Timeout:
        raise EmsException(EmsErrorCode.EMS_IO_TIMEOUT,
                           f"ems-server at {sock_path} did not answer within "
                           f"{timeout_s:.1f} s") from None
    finally:
        session.close()
        if session.segment is not None:
            session.segment.close()
    if not isinstance(reply, m.StatsReply):
        raise bad_reply(f"{type(reply).__name__} for Stats")
    return reply.stats
