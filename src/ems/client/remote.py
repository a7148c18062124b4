"""RemoteTransport: the SDK's side of ``ems-server``, over a unix socket.

Only control messages cross the socket (``ems.protocol``); the bytes do not. At
``Ems.init`` the daemon hands this process its tenant's memfd (SCM_RIGHTS) and the
client maps it once (a :class:`~ems.client.segment.Segment`); a save then copies the
caller's memory straight into the slots the daemon reserved, and a load copies the
pinned slots straight into the caller's memory: one copy per direction.

Small saves take one round trip: the connection holds a LEASE of pool space (asked
for on the first small save, renewed with a ``Put`` reply before it runs out), and
``reserve`` hands out slots of it here, with no request (bump allocation under a
lock, "local" tokens); ``commit`` then sends one ``Put`` that the daemon answers once
every key is committed (visible to every process) or found stored (EXISTS/BUSY, its
range freed). A save whose bytes exceed a quarter of the lease goes the usual way
(``Reserve`` + ``Commit``). A lease belongs to its connection, like tokens do. A
small save takes it in one step (:meth:`RemoteTransport.save_one_step`: cut ranges,
copy, Put, without slots or tokens), and a load another
(:meth:`RemoteTransport.load_one_step`: pin, copy, unpin).

Concurrency: one connection per process, shared by every worker thread. Requests
carry ids; the thread that waits for a reply reads the socket itself when no other
thread does, and routes the replies it reads to the threads that wait for them
(leader/follower, see :class:`_Session`).

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

import dataclasses
import logging
import os
import socket
import threading
import time
import weakref
from typing import Any, Callable, Optional, Sequence

from ems.client.session import (
    _ALIGN,
    _GEN_SHIFT,
    _LOCAL,
    LIVENESS_S,
    _bad_reply,
    _io_error,
    _Session,
    fresh,
)
from ems.client.transport import GrantStatus, Slot, Transport
from ems.errors import EmsErrorCode, EmsException
from ems.futures import Cancelled, Task
from ems.pool.core import PoolStatistics
from ems.protocol import messages as m

__all__ = ["LIVENESS_S", "RemoteTransport", "server_report"]

logger = logging.getLogger(__name__)

#: Bound of ``health()`` (a ping, or one reconnect attempt).
HEALTH_TIMEOUT_S = 1.0
#: Bound of requests that have no Task (``exists``, ``statistics``).
CONTROL_TIMEOUT_S = 5.0
#: Share of the daemon's reservation TTL a save may spend copying.
_TTL_SHARE = 0.8
_TOKEN_MASK = (1 << _GEN_SHIFT) - 1
#: After the daemon had no room for a lease, small saves go the usual way this long.
_LEASE_RETRY_S = 1.0
_LOCAL_MASK = _LOCAL - 1
_NEW, _EXISTS = GrantStatus.NEW, GrantStatus.EXISTS
#: The hot requests go out in their wire form (``[TYPE, fields...]``), no object built.
_PUT, _ACQUIRE = m.Put.TYPE, m.Acquire.TYPE


def _pack(gen: int, token: int) -> int:
    return (gen << _GEN_SHIFT) | token


# ---------------------------------------------------------------------- transport

class RemoteTransport(Transport):
    """The daemon's pool (see the module docstring)."""

    kind = "server"

    def __init__(self, path: str, access_id: Optional[str], access_key: Optional[str],
                 connect_timeout_s: float, session: _Session, spin_s: float = 0.0) -> None:
        self.path = path
        #: synchronous calls poll this long for a reply before sleeping (EMS_SPIN_US)
        self.spin_s = spin_s
        self._access_id = access_id
        self._access_key = access_key
        self._connect_timeout_s = connect_timeout_s
        self._session: Optional[_Session] = session
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
        session = _Session.open(sock_path, access_id, access_key, timeout_s, gen=1)
        return cls(sock_path, access_id, access_key, timeout_s, session, spin_s)

    # ------------------------------------------------------------ sessions
    def _live(self, timeout_s: float) -> _Session:
        """The current connection, reconnecting (within ``timeout_s``) if it broke."""
        session = self._session
        if session is not None and session.broken is None:
            return session
        self._check_open()
        if not self._reconnect_lock.acquire(timeout=max(timeout_s, 0.0)):
            raise _io_error("ems-server is unreachable (reconnecting)")
        try:
            self._check_open()
            session = self._session
            if session is not None and session.broken is None:
                return session
            try:
                session = _Session.open(self.path, self._access_id, self._access_key,
                                        min(timeout_s, self._connect_timeout_s), self._gen + 1)
            except EmsException as exc:
                if exc.status_code() is EmsErrorCode.EMS_AUTH_FAILED:
                    raise
                raise _io_error(f"ems-server is unreachable: {exc.message()}") from exc
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
              session: Optional[_Session] = None) -> tuple[_Session, m.Message]:
        """One request within the task's deadline (or the default bounds)."""
        if self._closed:
            self._check_open()
        bounded = True  # by the task's deadline (or CONTROL_TIMEOUT_S without a task)
        spin_s = 0.0
        if task is None:
            wait_s = CONTROL_TIMEOUT_S
        else:
            if task.inline:
                spin_s = self.spin_s
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
            reply = session.request(msg_for, wait_s, spin_s)
        except socket.timeout:
            if not bounded:
                session.fail(_io_error(f"ems-server did not answer within {LIVENESS_S:.0f} s"))
                raise fresh(session.broken) from None  # type: ignore[arg-type]
            what = task.what if task is not None else "the request"
            raise EmsException(EmsErrorCode.EMS_IO_TIMEOUT,
                               f"ems-server did not answer {what} within "
                               f"{wait_s * 1000:.0f} ms") from None
        return session, reply

    def _ready(self, task: Optional[Task]) -> _Session:
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
                task: Optional[Task], more: Callable[[Any, int], bool],
                undo: Callable[[_Session, list], None]) -> tuple[_Session, list]:
        """A batch of ``n`` entries as requests of at most the daemon's ``max_keys``
        entries each (``Limits.max_keys_per_request``), in order on one connection:
        ``make(rid, lo, hi)`` builds slice ``[lo, hi)``; ``more(reply, hi - lo)`` says
        whether the next slice is still wanted (a load stops at its first miss). If a
        slice fails, ``undo(session, replies)`` gives back what the earlier ones got."""
        session = self._ready(task)
        step, replies, lo = session.max_keys, [], 0
        try:
            while True:
                hi = min(n, lo + step)
                _, reply = self._call(lambda rid, lo=lo, hi=hi: make(rid, lo, hi), task, session)
                if type(reply) is not cls:
                    raise _bad_reply(f"{type(reply).__name__} instead of {cls.__name__}")
                replies.append(reply)
                if hi >= n or not more(reply, hi - lo):
                    return session, replies
                lo = hi
        except BaseException:
            if replies:
                undo(session, replies)
            raise

    # ------------------------------------------------------------ Transport
    def reserve(self, keys: Sequence[str], sizes: Sequence[int], task: Task) -> list[Slot]:
        session = self._session
        if session is not None and session.broken is None and session.segment is not None:
            slots = self._reserve_local(session, keys, sizes, task)
            if slots is not None:
                return slots
        sent_at = time.monotonic()  # before the daemon starts the reservations' TTL
        keys, sizes = list(keys), list(sizes)

        def undo(session: _Session, replies: list) -> None:
            for r in replies:
                self._undo_granted(session, r)
        session, replies = self._sliced(
            len(keys), lambda rid, lo, hi: m.Reserve(rid, keys[lo:hi], sizes[lo:hi]),
            m.Granted, task, lambda r, n: len(r.statuses) == n, undo)
        reply = replies[0] if len(replies) == 1 else m.Granted(
            replies[0].rid, *([x for r in replies for x in getattr(r, f)]
                              for f in ("statuses", "tokens", "offsets", "sizes")))
        if len(reply.statuses) != len(keys):
            undo(session, replies)
            raise _bad_reply(f"Granted of {len(reply.statuses)} for a Reserve of "
                             f"{len(keys)} keys")
        slots = []
        try:
            for i, status_value in enumerate(reply.statuses):
                status = GrantStatus(status_value)
                if status is GrantStatus.NEW:
                    self._check_range(session, reply.offsets[i], reply.sizes[i], sizes[i])
                    slots.append(Slot(status, _pack(session.gen, reply.tokens[i]),
                                      session.segment, reply.offsets[i], reply.sizes[i]))
                else:
                    slots.append(Slot(status))
        except (ValueError, EmsException) as exc:
            self._undo_granted(session, reply)
            if isinstance(exc, EmsException):
                raise
            raise _bad_reply(f"an unknown grant status: {exc}") from None
        if any(slot.segment is not None for slot in slots):
            # The daemon frees a reservation after its TTL and may give the space to
            # another key: the copy must stop (at its next checkpoint, EMS_IO_TIMEOUT)
            # well before that, also when the request itself has no deadline.
            cutoff = sent_at + session.welcome.reservation_ttl_s * _TTL_SHARE
            if task.deadline is None or task.deadline > cutoff:
                task.deadline = cutoff
        return slots

    def _undo_granted(self, session: _Session, reply: m.Granted) -> None:
        tokens = [t for s, t in zip(reply.statuses, reply.tokens) if s == GrantStatus.NEW]
        self._post_list(session, tokens, m.Abort)

    def _post_list(self, session: _Session, tokens: Sequence[int],
                   kind: Callable[[list], m.Message]) -> None:
        """One-way messages of raw tokens, in slices the daemon takes."""
        step = session.max_keys
        for lo in range(0, len(tokens), step):
            session.post(kind(list(tokens[lo:lo + step])))

    def _reserve_local(self, session: _Session, keys: Sequence[str], sizes: Sequence[int],
                       task: Task) -> Optional[list[Slot]]:
        """Slots of the lease for a small save (None: go the usual way)."""
        segment = session.segment
        assert segment is not None
        if not keys or not session.fits_lease(sizes):
            return None
        if self._closed:
            self._check_open()
        deadline = task.deadline
        if deadline is not None and deadline <= time.monotonic():
            raise EmsException(EmsErrorCode.EMS_IO_TIMEOUT, f"{task.what} ran out of time")
        ids = session.take(keys, sizes)
        if ids is None:
            if time.monotonic() < session.lease_refused_until:
                return None
            _, reply = self._call(lambda rid: m.Lease(rid), task, session)
            if not isinstance(reply, m.Leased):
                raise _bad_reply(f"{type(reply).__name__} for a Lease")
            if not reply.size:
                session.lease_refused_until = time.monotonic() + _LEASE_RETRY_S
                return None
            self._install(session, reply.offset, reply.size)
            ids = session.take(keys, sizes)
            if ids is None:  # other threads used it up first
                return None
        base = _pack(session.gen, _LOCAL)
        return [Slot(_NEW, base | lid, segment, offset, size)
                for (lid, offset), size in zip(ids, sizes)]

    def commit(self, tokens: Sequence[int], task: Task) -> list[bool]:
        if not tokens:
            return []
        session = self._session
        if session is None or session.broken is not None or any(
                t >> _GEN_SHIFT != session.gen for t in tokens):
            raise _io_error("the connection to ems-server was lost during this save; "
                            "its reservations are gone")
        local = [t for t in tokens if t & _LOCAL]
        if local:
            if len(local) == len(tokens):
                return self._put(session, tokens, task)
            ok = dict(zip(local, self._put(session, local, task)))
            ok.update(zip([t for t in tokens if not t & _LOCAL],
                          self.commit([t for t in tokens if not t & _LOCAL], task)))
            return [ok[t] for t in tokens]
        raw = [t & _TOKEN_MASK for t in tokens]
        try:
            _, replies = self._sliced(
                len(raw), lambda rid, lo, hi: m.Commit(rid, raw[lo:hi]), m.Committed, task,
                lambda r, n: True, lambda s, r: None)
        except EmsException:
            # Nobody aborts after a failed commit: do it here. If the commit did reach
            # the daemon, this comes after it on the same connection and is a no-op.
            self._post_list(session, raw, m.Abort)
            raise
        ok = [x for r in replies for x in r.ok]
        if len(ok) != len(tokens):
            raise _bad_reply(f"Committed of {len(ok)} for a Commit of {len(tokens)} tokens")
        return ok

    def save_one_step(self, keys: Sequence[str], sizes: Sequence[int], mover: Any,
                      task: Task) -> Optional[list[bool]]:
        """A small save in one call: ranges cut from the lease, ``mover`` copies into
        them, one Put (the steps of reserve + copy + commit, without their per-key
        slots and tokens). None: not through the lease (the caller goes the usual way,
        which also renews a lease that ran out)."""
        session = self._session
        if (session is None or session.broken is not None or session.segment is None
                or not session.fits_lease(sizes)):
            return None
        if self._closed:
            self._check_open()
        cut = session.take_ranges(sizes, want=True)
        if cut is None:
            return None
        offsets, want = cut
        segment = session.segment
        try:
            mover.to_pool(range(len(offsets)), [(segment, offset) for offset in offsets],
                          task)
            if not task.decide():
                raise Cancelled
        except BaseException:
            if want:
                session.lease_asked = False
            session.post(m.Return(list(offsets), list(sizes)))
            raise
        return self._put_ranges(session, list(keys), offsets, list(sizes), want, task)

    def _put(self, session: _Session, tokens: Sequence[int], task: Task) -> list[bool]:
        """Commit slots of the lease: one Put, one round trip."""
        local = session.local
        with session.lease_lock:
            entries = [local.pop(t & _LOCAL_MASK, None) for t in tokens]
            want = session.want_lease_locked()
        if None in entries:
            if want:
                session.lease_asked = False
            self._give_back(session, [e for e in entries if e is not None])
            raise _io_error("slots of this save were given back already")
        keys, offsets, sizes = (list(column) for column in zip(*entries))
        return self._put_ranges(session, keys, offsets, sizes, want, task)

    def _put_ranges(self, session: _Session, keys: list[str], offsets: list[int],
                    sizes: list[int], want: bool, task: Task) -> list[bool]:
        """One Put of written lease ranges (asking for a fresh lease when ``want``)."""
        try:
            _, reply = self._call(lambda rid: [_PUT, rid, keys, offsets, sizes, want], task,
                                  session)
        except EmsException:
            # As for a failed commit: if the Put did reach the daemon, this comes after
            # it and finds the ranges carved already (and is ignored).
            session.post(m.Return(offsets, sizes))
            raise
        finally:
            if want:
                session.lease_asked = False
        if not isinstance(reply, m.Stored) or len(reply.ok) != len(keys):
            raise _bad_reply(f"{type(reply).__name__} for a Put of {len(keys)} keys")
        if reply.lease_size:
            self._install(session, reply.lease_offset, reply.lease_size)
        return list(reply.ok)

    @staticmethod
    def _install(session: _Session, offset: int, size: int) -> None:
        segment = session.segment
        if segment is None or offset % _ALIGN or offset + size > segment.size:
            session.post(m.Return([offset], [size]))
            raise _bad_reply(f"a lease [{offset}, +{size}) outside its segment")
        session.install_lease(offset, size)

    @staticmethod
    def _give_back(session: _Session, entries: Sequence[tuple[str, int, int]]) -> None:
        if entries:
            session.post(m.Return([e[1] for e in entries], [e[2] for e in entries]))

    def abort(self, tokens: Sequence[int]) -> None:
        session = self._session
        local = [t for t in tokens if t & _LOCAL]
        if local and session is not None and not self._closed:
            with session.lease_lock:
                entries = [session.local.pop(t & _LOCAL_MASK, None) for t in local
                           if t >> _GEN_SHIFT == session.gen]
            self._give_back(session, [e for e in entries if e is not None])
            tokens = [t for t in tokens if not t & _LOCAL]
        self._post_tokens(tokens, m.Abort)

    def acquire(self, keys: Sequence[str], sizes: Sequence[int], task: Task) -> list[Slot]:
        session, reply = self._pin(keys, sizes, task)
        segment, gen = session.segment, session.gen << _GEN_SHIFT
        return [Slot(_EXISTS, gen | token, segment, offset, size)
                for token, offset, size in zip(reply.tokens, reply.offsets, reply.sizes)]

    def load_one_step(self, keys: Sequence[str], sizes: Sequence[int], mover: Any,
                      task: Task) -> Optional[int]:
        """A load in one call: pin the leading hits, ``mover`` copies them out, unpin;
        how many leading keys were loaded."""
        session, reply = self._pin(keys, sizes, task)
        if not reply.tokens:
            return 0
        segment = session.segment
        try:
            mover.from_pool(range(len(reply.tokens)),
                            [(segment, offset) for offset in reply.offsets], task)
        finally:
            self._post_list(session, reply.tokens, m.Release)
        return len(reply.tokens)

    def _pin(self, keys: Sequence[str], sizes: Sequence[int], task: Task
             ) -> tuple[_Session, m.Pinned]:
        """Acquire, and check that every pinned range is in the segment and of the
        expected size (else unpin and raise)."""
        keys, sizes = list(keys), list(sizes)
        session = self._session
        if (session is not None and session.broken is None
                and len(keys) <= session.max_keys):  # the usual case: one request
            session, reply = self._call(lambda rid: [_ACQUIRE, rid, keys, sizes], task)
            if type(reply) is not m.Pinned:
                raise _bad_reply(f"{type(reply).__name__} for an Acquire of {len(keys)} keys")
        else:
            def release(session: _Session, replies: list) -> None:
                self._post_list(session, [t for r in replies for t in r.tokens], m.Release)
            session, replies = self._sliced(
                len(keys), lambda rid, lo, hi: [_ACQUIRE, rid, keys[lo:hi], sizes[lo:hi]],
                m.Pinned, task, lambda r, n: len(r.tokens) == n, release)
            reply = replies[0] if len(replies) == 1 else m.Pinned(
                replies[0].rid, *([x for r in replies for x in getattr(r, f)]
                                  for f in ("tokens", "offsets", "sizes")))
        if len(reply.tokens) > len(keys):
            self._post_list(session, reply.tokens, m.Release)
            raise _bad_reply(f"{len(reply.tokens)} pins for an Acquire of {len(keys)} keys")
        try:
            for offset, size, want in zip(reply.offsets, reply.sizes, sizes):
                self._check_range(session, offset, size, want)
        except EmsException:
            self._post_list(session, reply.tokens, m.Release)
            raise
        return session, reply  # type: ignore[return-value]

    def release(self, tokens: Sequence[int]) -> None:
        self._post_tokens(tokens, m.Release)

    def exists(self, keys: Sequence[str], sizes: Optional[Sequence[int]]) -> int:
        keys = list(keys)
        want = None if sizes is None else list(sizes)
        _, replies = self._sliced(
            len(keys), lambda rid, lo, hi: m.Exists(rid, keys[lo:hi],
                                                    None if want is None else want[lo:hi]),
            m.Count, None, lambda r, n: r.n == n, lambda s, r: None)
        n = sum(r.n for r in replies)
        if n > len(keys) or any(r.n > len(keys) for r in replies):
            raise _bad_reply(f"a Count of {n} for an Exists of {len(keys)} keys")
        return n

    def health(self) -> bool:
        try:
            session = self._live(HEALTH_TIMEOUT_S)
            return isinstance(session.request(lambda rid: m.Ping(rid), HEALTH_TIMEOUT_S),
                              m.Pong)
        except (EmsException, socket.timeout):
            return False

    def statistics(self) -> PoolStatistics:
        """This tenant's pool, as the daemon counts it."""
        report = self.server_report(all_tenants=False)
        rows = list(report["tenants"].values())
        if len(rows) != 1:
            raise _bad_reply(f"statistics of {len(rows)} tenants, expected 1")
        names = {f.name for f in dataclasses.fields(PoolStatistics)}
        return PoolStatistics(**{k: v for k, v in rows[0].items() if k in names})

    def server_report(self, all_tenants: bool = False) -> dict[str, Any]:
        """The daemon's statistics report (``ems-server stats --json`` prints one)."""
        _, reply = self._call(lambda rid: m.Stats(rid, all_tenants), None)
        if not isinstance(reply, m.StatsReply):
            raise _bad_reply(f"{type(reply).__name__} for Stats")
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
    def _post_tokens(self, tokens: Sequence[int], kind: Callable[[list], m.Message]) -> None:
        """Best effort: only tokens of the live connection mean anything to the daemon."""
        session = self._session
        if session is None or self._closed:
            return
        raw = [t & _TOKEN_MASK for t in tokens if t >> _GEN_SHIFT == session.gen]
        if raw:
            self._post_list(session, raw, kind)

    @staticmethod
    def _check_range(session: _Session, offset: int, size: int, expected: int) -> None:
        seg = session.segment
        if seg is None or size != expected or offset + size > seg.size:
            raise _bad_reply(f"a slot [{offset}, +{size}) outside its segment or of the "
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
    session = _Session.open(sock_path, access_id, access_key, timeout_s, gen=1, admin=admin)
    try:
        reply = session.request(lambda rid: m.Stats(rid, True), timeout_s)
    except socket.timeout:
        raise EmsException(EmsErrorCode.EMS_IO_TIMEOUT,
                           f"ems-server at {sock_path} did not answer within "
                           f"{timeout_s:.1f} s") from None
    finally:
        session.close()
        if session.segment is not None:
            session.segment.close()
    if not isinstance(reply, m.StatsReply):
        raise _bad_reply(f"{type(reply).__name__} for Stats")
    return reply.stats
