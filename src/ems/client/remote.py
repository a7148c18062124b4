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
(``Reserve`` + ``Commit``). A lease belongs to its connection, like tokens do.

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
  ``Ems.init`` again, so ``EMS_RECOVERD_ERROR`` is never raised (clients that re-init
  on it keep working: a second ``Ems.init`` with the same config returns at once);
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
import itertools
import logging
import math
import mmap
import os
import select
import socket
import threading
import time
import weakref
from typing import Any, Callable, Optional, Sequence

from ems.client.segment import Segment
from ems.client.transport import GrantStatus, Slot, Transport
from ems.errors import EmsErrorCode, EmsException
from ems.futures import Task
from ems.pool.core import PoolStatistics
from ems.protocol import FrameDecoder, auth_mac, encode
from ems.protocol import messages as m

__all__ = ["LIVENESS_S", "RemoteTransport", "server_report"]

logger = logging.getLogger(__name__)

#: A request without a deadline gives up (and drops the connection) after this long.
LIVENESS_S = 30.0
#: Bound of ``health()`` (a ping, or one reconnect attempt).
HEALTH_TIMEOUT_S = 1.0
#: Bound of requests that have no Task (``exists``, ``statistics``).
CONTROL_TIMEOUT_S = 5.0

#: Share of the daemon's reservation TTL a save may spend copying.
_TTL_SHARE = 0.8
_GEN_SHIFT = 56  # client token = connection generation << 56 | daemon token
_TOKEN_MASK = (1 << _GEN_SHIFT) - 1
_LOCAL = 1 << (_GEN_SHIFT - 1)  # a slot of the lease (its key is kept here)
_LOCAL_MASK = _LOCAL - 1
#: The pool's allocation unit (``Allocator``'s default); the daemon checks every range.
_ALIGN = 64
#: After the daemon had no room for a lease, small saves go the usual way this long.
_LEASE_RETRY_S = 1.0
#: Longest the watcher reads for replies nobody waits for before it looks again
#: whether a waiter could read instead.
_WATCH_SLICE_S = 0.05
_POLLRDHUP = getattr(select, "POLLRDHUP", 0x2000)  # Linux; elsewhere POLLHUP still wakes


def _io_error(message: str) -> EmsException:
    return EmsException(EmsErrorCode.EMS_IO_ERROR, message)


def _bad_reply(message: str) -> EmsException:
    return EmsException(EmsErrorCode.EMS_PROTOCOL_ERROR, f"ems-server sent {message}")


class _Waiter:
    """One request's slot: ``reply`` is set (under the session lock) by whoever reads
    it; ``event`` is set for that, or to hand this waiter the socket (leader/follower).
    A leader never waits on an event, so it is made only when the waiter follows."""

    __slots__ = ("event", "reply")

    def __init__(self) -> None:
        self.event: Optional[threading.Event] = None
        self.reply: Any = None

    def wake(self) -> None:  # under the session lock
        if self.event is not None:
            self.event.set()


class _Session:
    """One authenticated connection: socket, mapped segment, and who reads the socket.

    Leader/follower: a thread that waits for a reply reads the socket itself when no
    other thread does (it leads), delivering whatever replies it reads to their
    waiters; the others (followers) wait on their event. A lone request is therefore
    sent and answered in its caller's thread, with no hand-off to a reader thread (two
    thread switches, ~60 us of a ~110 us ping on a 2-core host). A leader that got its
    reply, or gave up, hands the socket to the oldest waiter left::

        request --(no leader)--> LEADER --(own reply / deadline)--> done, hand off
           |                       ^
           +--(a leader reads)--> FOLLOWER --(reply delivered)--> done
                                   |  (woken: the leader left)
                                   +-----------------------------> LEADER

    A watcher thread covers the time nobody waits: it sleeps in ``poll`` until the
    daemon hangs up (``POLLRDHUP``: not woken by replies) or until replies that
    nobody waits for any more (their request timed out) must be read and undone, and
    then leads like any waiter. It alone closes the socket, once the session broke and
    nobody reads.
    """

    def __init__(self, sock: socket.socket, decoder: FrameDecoder, welcome: m.Welcome,
                 segment: Optional[Segment], gen: int) -> None:
        self.sock = sock
        self.welcome = welcome
        self.segment = segment
        self.gen = gen
        self.broken: Optional[EmsException] = None
        self._decoder = decoder
        self._lock = threading.Lock()
        self._lead_free = threading.Condition(self._lock)
        self._send_lock = threading.Lock()
        self._pending: dict[int, _Waiter] = {}
        self._orphans: set[int] = set()  # gave up waiting: undo their replies
        self._reading = False  # a leader reads the socket (only it may)
        self._hangup = False  # the watcher saw the daemon hang up
        self._watcher_waits = False  # for _lead_free
        self._rids = itertools.count(1)
        # The lease: [lease_cursor, lease_end) is not handed out yet; slots handed out
        # wait in ``local`` (id -> key, offset, size) for their Put or Return.
        self.lease_lock = threading.Lock()
        self.lease_cursor = self.lease_end = self.lease_size = 0
        self.lease_asked = False  # a Put with want_lease is in flight
        self.lease_refused_until = 0.0
        self.local: dict[int, tuple[str, int, int]] = {}
        self._local_ids = itertools.count(1)
        sock.settimeout(LIVENESS_S)  # bounds sendall to a daemon that stopped reading
        self._read_poll = select.poll()  # the leader's
        self._read_poll.register(sock.fileno(), select.POLLIN)
        self._wake_r, self._wake_w = os.pipe()  # wakes the watcher (O_CLOEXEC)
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        try:
            for msg in decoder:  # what arrived together with the Welcome
                self._deliver(msg)
        except EmsException as exc:
            self.fail(exc)
        self._watcher = threading.Thread(target=self._watch, daemon=True,
                                         name=f"ems-remote-watcher-{gen}")
        self._watcher.start()

    # ------------------------------------------------------------ handshake
    @classmethod
    def open(cls, path: str, access_id: Optional[str], access_key: Optional[str],
             timeout_s: float, gen: int, admin: bool = False) -> "_Session":
        """Connect, authenticate and map the tenant's memory, all within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        fds: list[int] = []
        try:
            sock.settimeout(max(timeout_s, 0.001))
            try:
                sock.connect(path)
            except FileNotFoundError:
                raise EmsException(EmsErrorCode.EMS_UNAVAILABLE,
                                   f"no ems-server socket at {path}; start ems-server or "
                                   f"set EMS_SOCKET_DIR") from None
            except ConnectionRefusedError:
                raise EmsException(EmsErrorCode.EMS_UNAVAILABLE,
                                   f"nothing listens on {path} (a stale socket: "
                                   f"ems-server is not running)") from None
            except socket.timeout:
                raise EmsException(EmsErrorCode.EMS_UNAVAILABLE,
                                   f"ems-server at {path} did not accept within "
                                   f"{timeout_s:.1f} s") from None
            except OSError as exc:
                raise EmsException(EmsErrorCode.EMS_UNAVAILABLE,
                                   f"cannot connect to {path}: {exc}") from exc
            decoder = FrameDecoder()
            sock.sendall(encode(m.Hello(access_id, admin)))
            msg = cls._handshake_reply(sock, decoder, fds, deadline, path, timeout_s)
            if isinstance(msg, m.Challenge):
                if access_id is None or access_key is None:
                    raise _bad_reply("a challenge to an anonymous client")
                sock.sendall(encode(m.Auth(auth_mac(access_key, msg.nonce, access_id))))
                msg = cls._handshake_reply(sock, decoder, fds, deadline, path, timeout_s)
            if isinstance(msg, m.Error):
                raise msg.exception()
            if not isinstance(msg, m.Welcome):
                raise _bad_reply(f"{type(msg).__name__} instead of Welcome")
            segment = None
            if msg.segment_size:
                if len(fds) != 1:
                    raise _bad_reply(f"{len(fds)} file descriptors with Welcome, not 1")
                segment = _map(fds[0], msg.segment_id, msg.segment_size)
            elif fds:
                raise _bad_reply("file descriptors with an admin Welcome")
            return cls(sock, decoder, msg, segment, gen)
        except EmsException:
            sock.close()
            raise
        except OSError as exc:
            sock.close()
            raise _io_error(f"ems-server at {path} broke the handshake: {exc}") from exc
        finally:
            for fd in fds:
                os.close(fd)

    @staticmethod
    def _handshake_reply(sock: socket.socket, decoder: FrameDecoder, fds: list[int],
                         deadline: float, path: str, timeout_s: float) -> m.Message:
        while True:
            msg = decoder.next_message()
            if msg is not None:
                return msg
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise EmsException(EmsErrorCode.EMS_UNAVAILABLE,
                                   f"ems-server at {path} did not answer within "
                                   f"{timeout_s:.1f} s")
            sock.settimeout(remaining)
            try:
                data, got, flags, _ = socket.recv_fds(sock, 1 << 16, 4)
            except socket.timeout:
                continue
            fds.extend(got)
            if flags & socket.MSG_CTRUNC:
                raise _bad_reply("more file descriptors than expected")
            if not data:
                raise _io_error(f"ems-server at {path} closed the connection during the "
                                f"handshake")
            decoder.feed(data)

    # ------------------------------------------------------------ requests
    def request(self, msg_for: Callable[[int], m.Message], wait_s: float) -> m.Message:
        """Send a request and wait up to ``wait_s`` for its reply.

        Raises ``socket.timeout`` when no reply came in time (a late reply is undone
        when it is read), ``EmsException`` for an error reply or a broken connection.
        """
        deadline = time.monotonic() + wait_s
        waiter = _Waiter()
        with self._lock:
            if self.broken is not None:
                raise self.broken
            rid = next(self._rids)
            self._pending[rid] = waiter
        try:
            data = encode(msg_for(rid))  # may raise (a batch too big for a frame)
        except BaseException:
            with self._lock:
                self._pending.pop(rid, None)
            raise
        self._send_bytes(data)
        reply = self._await(rid, waiter, deadline)
        if isinstance(reply, EmsException):
            raise reply
        if isinstance(reply, m.Error):
            raise reply.exception()
        return reply

    def _await(self, rid: int, waiter: _Waiter, deadline: float) -> Any:
        """The reply (or the ``EmsException`` that broke the session) of ``rid``."""
        while True:
            with self._lock:
                reply = waiter.reply
                lead = reply is None and not self._reading
                if lead:
                    self._reading = True
                elif reply is None:  # follow; under the lock: a later wake is not lost
                    if waiter.event is None:
                        waiter.event = threading.Event()
                    else:
                        waiter.event.clear()
            if reply is not None:
                return reply
            if lead:
                try:
                    self._read(waiter, deadline)
                finally:
                    with self._lock:
                        self._reading = False
                        reply = waiter.reply
                        if reply is None:  # out of time (or broke: then it is set)
                            self._give_up_locked(rid)
                        self._hand_off_locked()
                if reply is None:
                    raise socket.timeout
                return reply
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not waiter.event.wait(remaining):  # type: ignore[union-attr]
                with self._lock:
                    reply = waiter.reply
                    if reply is None:
                        self._give_up_locked(rid)
                        if not self._reading:  # a hand-off to us may have crossed
                            self._hand_off_locked()
                if reply is None:
                    raise socket.timeout
                return reply  # came just as the wait ended

    def _give_up_locked(self, rid: int) -> None:
        if self._pending.pop(rid, None) is not None:
            self._orphans.add(rid)

    def _hand_off_locked(self) -> None:
        """Nobody reads now: give the socket to the oldest waiter, or to the watcher
        when only replies nobody waits for are due (or the daemon hung up)."""
        if self._watcher_waits:
            self._lead_free.notify_all()
        if self.broken is not None:
            return
        for waiter in self._pending.values():
            waiter.wake()
            return
        if self._orphans or self._hangup:
            self._wake_watcher()

    def _wake_watcher(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except OSError:  # full (it is awake anyway) or closed (it is gone)
            pass

    def _read(self, waiter: Optional[_Waiter], deadline: float) -> None:
        """As the leader: read and deliver until ``waiter`` has its reply, or (the
        watcher, ``waiter`` None) until nothing is due, or until ``deadline``. A broken
        stream fails the session (every waiter gets the error)."""
        try:
            while True:
                if waiter is not None:
                    if waiter.reply is not None:
                        return
                elif self.broken is not None or self._pending or not (
                        self._orphans or self._hangup):
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                if not self._read_poll.poll(math.ceil(remaining * 1000)):
                    continue
                try:
                    data = self.sock.recv(1 << 16)
                except socket.timeout:  # a false positive of poll
                    continue
                if not data:
                    raise _io_error("ems-server closed the connection")
                self._decoder.feed(data)
                for msg in self._decoder:
                    self._deliver(msg)
        except EmsException as exc:
            self.fail(exc)
        except OSError as exc:
            self.fail(_io_error(f"lost the connection to ems-server: {exc}"))
        except Exception as exc:  # noqa: BLE001 - a reader must always fail the waiters
            logger.exception("ems: reading from ems-server failed")
            self.fail(EmsException(EmsErrorCode.EMS_INTERNAL_ERROR, f"reader failed: {exc}"))

    def post(self, msg: m.Message) -> None:
        """A one-way message (abort, release); silently dropped on a broken connection."""
        if self.broken is None:
            try:
                self._send_bytes(encode(msg))
            except EmsException:
                pass

    def _send_bytes(self, data: bytes) -> None:
        with self._send_lock:
            if self.broken is not None:
                raise self.broken
            try:
                self.sock.sendall(data)
            except OSError as exc:  # includes a timeout: the stream is now corrupt
                self.fail(_io_error(f"lost the connection to ems-server: {exc}"))
                raise self.broken from exc  # type: ignore[misc]

    # ------------------------------------------------------------ lease
    def take(self, keys: Sequence[str], sizes: Sequence[int]
             ) -> Optional[list[tuple[int, int]]]:
        """(local id, offset) of slots for ``keys`` cut from the lease, or None when it
        is short."""
        needs = [max(_ALIGN, (n + _ALIGN - 1) // _ALIGN * _ALIGN) for n in sizes]
        with self.lease_lock:
            offset = self.lease_cursor
            if offset + sum(needs) > self.lease_end:
                return None
            ids = []
            for key, size, need in zip(keys, sizes, needs):
                lid = next(self._local_ids)
                self.local[lid] = (key, offset, size)
                ids.append((lid, offset))
                offset += need
            self.lease_cursor = offset
        return ids

    def want_lease(self) -> bool:
        """Whether the next Put should ask for a fresh lease (less than half left)."""
        with self.lease_lock:
            if self.lease_asked or 2 * (self.lease_end - self.lease_cursor) >= self.lease_size:
                return False
            self.lease_asked = True
            return True

    def install_lease(self, offset: int, size: int) -> None:
        """Use a fresh lease, giving back the unused tail of the old one; or give back
        the fresh one when another thread renewed the lease first."""
        with self.lease_lock:
            if 2 * (self.lease_end - self.lease_cursor) >= max(self.lease_size, 1):
                back = (offset, size)
            else:
                back = (self.lease_cursor, self.lease_end - self.lease_cursor)
                self.lease_cursor, self.lease_end, self.lease_size = offset, offset + size, size
        if back[1] > 0:
            self.post(m.Return([back[0]], [back[1]]))

    def _undo(self, reply: Any) -> None:
        """Give back what a reply nobody waits for any more granted."""
        if isinstance(reply, (m.Leased, m.Stored)):
            offset, size = ((reply.offset, reply.size) if isinstance(reply, m.Leased)
                            else (reply.lease_offset, reply.lease_size))
            if size:
                self.post(m.Return([offset], [size]))
        elif isinstance(reply, m.Granted):
            tokens = [t for s, t in zip(reply.statuses, reply.tokens) if s == GrantStatus.NEW]
            if tokens:
                self.post(m.Abort(tokens))
        elif isinstance(reply, m.Pinned) and reply.tokens:
            self.post(m.Release(reply.tokens))

    # ------------------------------------------------------------ watcher
    def _watch(self) -> None:
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        # Not POLLIN: replies are the leaders' business; this wakes on a hang-up only
        # (POLLHUP and POLLERR are always reported).
        poller.register(self.sock.fileno(), _POLLRDHUP)
        try:
            while True:
                with self._lock:
                    while self._reading:  # the leader sees a hang-up by itself
                        self._watcher_waits = True
                        self._lead_free.wait()
                        self._watcher_waits = False
                    if self.broken is not None:
                        return
                    lead = (bool(self._orphans) and not self._pending) or self._hangup
                    if lead:
                        self._reading = True
                if lead:
                    try:
                        self._read(None, time.monotonic() + _WATCH_SLICE_S)
                    finally:
                        with self._lock:
                            self._reading = False
                            self._hand_off_locked()
                    continue
                for fd, _events in poller.poll():
                    if fd == self._wake_r:
                        try:
                            os.read(self._wake_r, 4096)
                        except OSError:
                            pass
                    else:
                        self._hangup = True
        except Exception:  # noqa: BLE001 - never die silently with the socket open
            logger.exception("ems: the ems-server watcher failed")
            self.fail(EmsException(EmsErrorCode.EMS_INTERNAL_ERROR, "watcher failed"))
        finally:
            with self._send_lock:  # no sender may be inside sendall on a closed fd
                self.sock.close()
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _deliver(self, msg: m.Message) -> None:
        rid = getattr(msg, "rid", 0)
        if rid == 0:  # about the whole connection, sent before the daemon closes it
            if isinstance(msg, m.Error):
                exc = msg.exception()
                raise _io_error(f"ems-server closed the connection: {exc}")
            raise _bad_reply(f"an unsolicited {type(msg).__name__}")
        with self._lock:
            waiter = self._pending.pop(rid, None)
            if waiter is not None:
                waiter.reply = msg
                waiter.wake()
                return
            self._orphans.discard(rid)
        self._undo(msg)

    def fail(self, exc: EmsException) -> None:
        """Mark the connection broken: every waiter gets ``exc``; idempotent."""
        with self._lock:
            if self.broken is not None:
                return
            self.broken = exc
            waiters, self._pending = list(self._pending.values()), {}
            self._orphans.clear()
            self._lead_free.notify_all()
            for waiter in waiters:
                waiter.reply = exc
                waiter.wake()
        try:  # wakes the leader and the watcher, which closes the socket
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if not isinstance(exc, _Closed):
            logger.warning("ems: connection to ems-server lost: %s", exc.message())

    def abandon_after_fork(self) -> None:
        """In a forked child: this connection is the parent's. Drop our copy of the fd
        without ``shutdown`` (which would cut the parent off too)."""
        self.broken = _Closed(EmsErrorCode.EMS_IO_ERROR, "connection inherited through fork")
        self._pending = {}
        self.sock.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def close(self) -> None:
        self.fail(_Closed(EmsErrorCode.EMS_NOT_INITIALIZED, "the ems-server client was closed"))
        if threading.current_thread() is not self._watcher:
            self._watcher.join(timeout=1.0)


class _Closed(EmsException):
    """A deliberate close (not logged as a loss)."""


def _map(fd: int, segment_id: int, size: int) -> Segment:
    st = os.fstat(fd)
    if st.st_size < size:
        raise _bad_reply(f"a segment of {st.st_size} bytes announced as {size}")
    # MAP_POPULATE: fill the page tables now (~20-50 ms per 512 MiB of pages the daemon
    # already has) instead of one minor fault per 4 KiB page on this process's first
    # pass over the pool, which caps its first saves at ~2.5-3 GB/s against ~9-10.
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    mm = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return Segment(segment_id, mm)


def _pack(gen: int, token: int) -> int:
    return (gen << _GEN_SHIFT) | token


# ---------------------------------------------------------------------- transport

class RemoteTransport(Transport):
    """The daemon's pool (see the module docstring)."""

    kind = "server"

    def __init__(self, path: str, access_id: Optional[str], access_key: Optional[str],
                 connect_timeout_s: float, session: _Session) -> None:
        self.path = path
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
                timeout_s: float) -> "RemoteTransport":
        """Connect and authenticate within ``timeout_s``; raises ``EMS_UNAVAILABLE`` (no
        daemon answers), ``EMS_AUTH_FAILED``, ``EMS_IO_ERROR`` or
        ``EMS_PROTOCOL_ERROR``."""
        session = _Session.open(sock_path, access_id, access_key, timeout_s, gen=1)
        return cls(sock_path, access_id, access_key, timeout_s, session)

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
            self._session = session
            logger.info("ems: reconnected to ems-server at %s", self.path)
            return session
        finally:
            self._reconnect_lock.release()

    def _check_open(self) -> None:
        if self._closed:
            raise EmsException(EmsErrorCode.EMS_NOT_INITIALIZED,
                               "the ems-server client was closed (Ems.finalize)")

    def _call(self, msg_for: Callable[[int], m.Message], task: Optional[Task],
              session: Optional[_Session] = None) -> tuple[_Session, m.Message]:
        """One request within the task's deadline (or the default bounds)."""
        self._check_open()
        remaining = task.remaining_s() if task is not None else None
        if task is None:
            wait_s = CONTROL_TIMEOUT_S
        else:
            wait_s = LIVENESS_S if remaining is None else remaining
        if wait_s <= 0:
            raise EmsException(EmsErrorCode.EMS_IO_TIMEOUT,
                               f"{task.what if task else 'request'} ran out of time")
        start = time.monotonic()
        if session is None:
            session = self._live(wait_s)
        try:
            reply = session.request(msg_for, max(0.0, wait_s - (time.monotonic() - start)))
        except socket.timeout:
            if task is not None and remaining is None:
                session.fail(_io_error(f"ems-server did not answer within {LIVENESS_S:.0f} s"))
                raise session.broken from None  # type: ignore[misc]
            what = task.what if task is not None else "the request"
            raise EmsException(EmsErrorCode.EMS_IO_TIMEOUT,
                               f"ems-server did not answer {what} within "
                               f"{wait_s * 1000:.0f} ms") from None
        return session, reply

    # ------------------------------------------------------------ Transport
    def reserve(self, keys: Sequence[str], sizes: Sequence[int], task: Task) -> list[Slot]:
        session = self._session
        if session is not None and session.broken is None and session.segment is not None:
            slots = self._reserve_local(session, keys, sizes, task)
            if slots is not None:
                return slots
        sent_at = time.monotonic()  # before the daemon starts the reservations' TTL
        session, reply = self._call(lambda rid: m.Reserve(rid, list(keys), list(sizes)), task)
        if not isinstance(reply, m.Granted) or len(reply.statuses) != len(keys):
            raise _bad_reply(f"{type(reply).__name__} for a Reserve of {len(keys)} keys")
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
            session.post(m.Abort([t for s, t in zip(reply.statuses, reply.tokens)
                                  if s == GrantStatus.NEW]))
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

    def _reserve_local(self, session: _Session, keys: Sequence[str], sizes: Sequence[int],
                       task: Task) -> Optional[list[Slot]]:
        """Slots of the lease for a small save (None: go the usual way)."""
        segment = session.segment
        assert segment is not None
        limit = m.lease_bytes(segment.size) // 4
        if not keys or sum(max(_ALIGN, n) for n in sizes) > limit:
            return None
        self._check_open()
        remaining = task.remaining_s()
        if remaining is not None and remaining <= 0:
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
        return [Slot(GrantStatus.NEW, base | lid, segment, offset, size)
                for (lid, offset), size in zip(ids, sizes)]

    def commit(self, tokens: Sequence[int], task: Task) -> list[bool]:
        if not tokens:
            return []
        session = self._session
        gens = {t >> _GEN_SHIFT for t in tokens}
        if session is None or session.broken is not None or gens != {session.gen}:
            raise _io_error("the connection to ems-server was lost during this save; "
                            "its reservations are gone")
        if any(t & _LOCAL for t in tokens):
            if all(t & _LOCAL for t in tokens):
                return self._put(session, tokens, task)
            ok = dict(zip([t for t in tokens if t & _LOCAL],
                          self._put(session, [t for t in tokens if t & _LOCAL], task)))
            ok.update(zip([t for t in tokens if not t & _LOCAL],
                          self.commit([t for t in tokens if not t & _LOCAL], task)))
            return [ok[t] for t in tokens]
        raw = [t & _TOKEN_MASK for t in tokens]
        try:
            _, reply = self._call(lambda rid: m.Commit(rid, raw), task, session)
        except EmsException:
            # Nobody aborts after a failed commit: do it here. If the commit did reach
            # the daemon, this comes after it on the same connection and is a no-op.
            session.post(m.Abort(raw))
            raise
        if not isinstance(reply, m.Committed) or len(reply.ok) != len(tokens):
            raise _bad_reply(f"{type(reply).__name__} for a Commit of {len(tokens)} tokens")
        return list(reply.ok)

    def _put(self, session: _Session, tokens: Sequence[int], task: Task) -> list[bool]:
        """Commit slots of the lease: one Put, one round trip."""
        with session.lease_lock:
            entries = [session.local.pop(t & _LOCAL_MASK, None) for t in tokens]
        if any(e is None for e in entries):
            self._give_back(session, [e for e in entries if e is not None])
            raise _io_error("slots of this save were given back already")
        keys = [e[0] for e in entries]  # type: ignore[index]
        offsets = [e[1] for e in entries]  # type: ignore[index]
        sizes = [e[2] for e in entries]  # type: ignore[index]
        want = session.want_lease()
        try:
            _, reply = self._call(lambda rid: m.Put(rid, keys, offsets, sizes, want), task,
                                  session)
        except EmsException:
            # As for a failed commit: if the Put did reach the daemon, this comes after
            # it and finds the ranges carved already (and is ignored).
            session.post(m.Return(offsets, sizes))
            raise
        finally:
            if want:
                session.lease_asked = False
        if not isinstance(reply, m.Stored) or len(reply.ok) != len(tokens):
            raise _bad_reply(f"{type(reply).__name__} for a Put of {len(tokens)} keys")
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
        session, reply = self._call(lambda rid: m.Acquire(rid, list(keys), list(sizes)), task)
        if not isinstance(reply, m.Pinned) or len(reply.tokens) > len(keys):
            raise _bad_reply(f"{type(reply).__name__} for an Acquire of {len(keys)} keys")
        try:
            for i in range(len(reply.tokens)):
                self._check_range(session, reply.offsets[i], reply.sizes[i], sizes[i])
        except EmsException:
            session.post(m.Release(reply.tokens))
            raise
        return [Slot(GrantStatus.EXISTS, _pack(session.gen, t), session.segment, off, size)
                for t, off, size in zip(reply.tokens, reply.offsets, reply.sizes)]

    def release(self, tokens: Sequence[int]) -> None:
        self._post_tokens(tokens, m.Release)

    def exists(self, keys: Sequence[str], sizes: Optional[Sequence[int]]) -> int:
        want = None if sizes is None else list(sizes)
        _, reply = self._call(lambda rid: m.Exists(rid, list(keys), want), None)
        if not isinstance(reply, m.Count) or reply.n > len(keys):
            raise _bad_reply(f"{type(reply).__name__} for an Exists of {len(keys)} keys")
        return reply.n

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
                session.segment.close()

    # ------------------------------------------------------------ internals
    def _post_tokens(self, tokens: Sequence[int], kind: Callable[[list], m.Message]) -> None:
        """Best effort: only tokens of the live connection mean anything to the daemon."""
        session = self._session
        if session is None or self._closed:
            return
        raw = [t & _TOKEN_MASK for t in tokens if t >> _GEN_SHIFT == session.gen]
        if raw:
            session.post(kind(raw))

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
