"""The connection to ``ems-server`` under RemoteTransport: handshake, requests by id,
and leader/follower reading.

One connection per process, shared by every thread. A thread waiting for its reply
reads the socket itself when no other thread is reading (a lone request never
switches threads) and hands replies that are not its own to their waiters; when it
is done it hands the socket to the oldest waiting thread. A watcher thread covers the
idle time: it notices a daemon that hung up, and reads and undoes replies that nobody
waits for any more (pins released, reservations aborted). It alone closes the socket.
The connection also holds this process's lease of pool space (small saves).

A synchronous call's leader polls for its reply for ``spin_s`` (``EMS_SPIN_US``)
before it sleeps in ``poll``: the reply is tens of microseconds away, and a sleeping
thread pays a wake-up and cold caches (on a VM, its vCPU halts).

Deadlines cover sending too. The socket is non-blocking: a request is written with
``send`` + ``poll(POLLOUT)`` until the request's deadline, and a thread waiting for
another sender waits for the send lock no longer than that (a frozen daemon stops
reading, its socket buffer fills, and a blocking ``sendall`` waited for the whole
freeze: a load of a few thousand keys with ``timeout=500`` returned after seconds, ~30
s for a daemon that never woke). A send that times out before its first byte leaves
the connection as it was; one that times out mid-frame has corrupted the stream, so
the connection is failed and the next call opens a new one. One-way messages (release,
abort, return) wait at most :data:`POST_WAIT_S`; one that cannot go out in that time
fails the connection, and the daemon then drops every pin and reservation of it
(nothing leaks; the slack of a call's deadline is this wait plus the copy step in
progress).

The connection's failure is stored once (``broken``) and every raise gets a fresh copy
of it: a raised exception collects a traceback whose frames hold the session, and a
client that keeps the exception would keep the session -- and its pool mapping --
alive.
"""

from __future__ import annotations

import itertools
import logging
import math
import mmap
import os
import select
import socket
import threading
import time
from typing import Any, Callable, Optional, Sequence

from ems.client.segment import Segment
from ems.errors import EmsErrorCode, EmsException
from ems.protocol import FrameDecoder, auth_mac, encode, encode_wire
from ems.protocol import messages as m
from ems.protocol.messages import GrantStatus

__all__ = ["LIVENESS_S", "probe"]

_monotonic = time.monotonic


logger = logging.getLogger(__name__)

#: A request without a deadline gives up (and drops the connection) after this long.
LIVENESS_S = 30.0
#: Longest a one-way message (release, abort, return) waits to be sent.
POST_WAIT_S = 0.1

#: The pool's allocation unit (``Allocator``'s default); the daemon checks every range.
_ALIGN = 64
#: Longest the watcher reads for replies nobody waits for before it looks again
#: whether a waiter could read instead.
_WATCH_SLICE_S = 0.05
_POLLRDHUP = getattr(select, "POLLRDHUP", 0x2000)  # Linux; elsewhere POLLHUP still wakes


def _io_error(message: str) -> EmsException:
    return EmsException(EmsErrorCode.EMS_IO_ERROR, message)


def fresh(exc: EmsException) -> EmsException:
    """A copy of ``exc`` without a traceback (see the module docstring)."""
    return type(exc)(exc.status_code(), exc.message())


def _not_yet(message: str) -> EmsException:
    """The daemon cannot be reached *yet*: a later ``Ems.init`` may succeed."""
    return EmsException(EmsErrorCode.EMS_RECOVERD_ERROR, message)


def probe(path: str, timeout_s: float) -> bool:
    """Whether a daemon answers on ``path`` within ``timeout_s`` (a Ping before any
    handshake, which the daemon answers in its HELLO phase). Never raises."""
    deadline = time.monotonic() + timeout_s
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(max(timeout_s, 0.001))
        sock.connect(path)
        sock.sendall(encode(m.Ping(1)))
        decoder = FrameDecoder(4096)
        while True:
            msg = decoder.next_message()
            if msg is not None:
                return isinstance(msg, m.Pong)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            sock.settimeout(remaining)
            data = sock.recv(4096)
            if not data:
                return False
            decoder.feed(data)
    except (OSError, EmsException):
        return False
    finally:
        sock.close()


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
        #: the daemon's limits (Welcome): batches are sent in slices of this many keys
        self.max_keys = max(1, welcome.max_keys)
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
        # The lease: [lease_cursor, lease_end) is not handed out yet; ranges handed out
        # belong to their save until its Put (or Return).
        self.lease_lock = threading.Lock()
        self.lease_cursor = self.lease_end = self.lease_size = 0
        self.lease_asked = False  # a Put with want_lease is in flight
        self.lease_refused_until = 0.0
        #: a save of at most this many bytes goes through the lease
        self._small_save_bytes = m.lease_bytes(segment.size) // 4 if segment else 0
        sock.setblocking(False)  # every wait is a poll bounded by a deadline
        self._read_poll = select.poll()  # the leader's
        self._read_poll.register(sock.fileno(), select.POLLIN)
        self._write_poll = select.poll()  # the sender's (under the send lock)
        self._write_poll.register(sock.fileno(), select.POLLOUT)
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
                raise _not_yet(f"no ems-server socket at {path} (start ems-server, or set "
                               f"EMS_SOCKET_DIR)") from None
            except ConnectionRefusedError:
                raise _not_yet(f"nothing listens on {path} (a stale socket: ems-server is "
                               f"not running)") from None
            except socket.timeout:
                raise _not_yet(f"ems-server at {path} did not accept within "
                               f"{timeout_s:.1f} s") from None
            except OSError as exc:
                raise _not_yet(f"cannot connect to {path}: {exc}") from exc
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
                raise _not_yet(f"ems-server at {path} did not answer within "
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
    def request(self, msg_for: Callable[[int], Any], wait_s: float,
                spin_s: float = 0.0) -> m.Message:
        """Send a request and wait up to ``wait_s`` for its reply (polling for it the
        first ``spin_s`` when this thread reads the socket itself).

        Raises ``socket.timeout`` when no reply came in time (a late reply is undone
        when it is read), ``EmsException`` for an error reply or a broken connection.
        """
        deadline = time.monotonic() + wait_s
        waiter = _Waiter()
        with self._lock:
            if self.broken is not None:
                raise fresh(self.broken)
            rid = next(self._rids)
            self._pending[rid] = waiter
        try:
            msg = msg_for(rid)  # a message, or its wire form (hot requests: no object)
            # (either may raise: a batch too big for a frame)
            data = encode_wire(msg) if type(msg) is list else encode(msg)
            self._send_bytes(data, deadline)
        except BaseException:
            with self._lock:
                self._pending.pop(rid, None)
            raise
        reply = self._await(rid, waiter, deadline, spin_s)
        if isinstance(reply, EmsException):
            raise fresh(reply)
        if isinstance(reply, m.Error):
            raise reply.exception()
        return reply

    def _await(self, rid: int, waiter: _Waiter, deadline: float, spin_s: float = 0.0) -> Any:
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
                    self._read(waiter, deadline, spin_s)
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

    def _read(self, waiter: Optional[_Waiter], deadline: float, spin_s: float = 0.0) -> None:
        """As the leader: read and deliver until ``waiter`` has its reply, or (the
        watcher, ``waiter`` None) until nothing is due, or until ``deadline``. A broken
        stream fails the session (every waiter gets the error). For ``spin_s`` it polls
        without sleeping (the reply is ~30-50 us away; a sleep costs a wake-up)."""
        spin_until = _monotonic() + spin_s if spin_s > 0 else 0.0
        poll, recv, decoder = self._read_poll.poll, self.sock.recv, self._decoder
        try:
            while True:
                if waiter is not None:
                    if waiter.reply is not None:
                        return
                elif self.broken is not None or self._pending or not (
                        self._orphans or self._hangup):
                    return
                remaining = deadline - _monotonic()
                if remaining <= 0:
                    return
                ready = False
                if spin_until:  # (poll(0) gives the GIL to other threads each time)
                    while not ready and _monotonic() < spin_until:
                        ready = bool(poll(0))
                    spin_until = 0.0
                if not ready and not poll(math.ceil(remaining * 1000)):
                    continue
                try:
                    data = recv(1 << 16)
                except (BlockingIOError, InterruptedError):  # a false positive of poll
                    continue
                if not data:
                    raise _io_error("ems-server closed the connection")
                for body in decoder.bodies(data):
                    self._deliver(m.from_wire(body))
                if decoder.failed is not None:  # a corrupt frame after good ones
                    raise decoder.failed
        except EmsException as exc:
            self.fail(exc)
        except OSError as exc:
            self.fail(_io_error(f"lost the connection to ems-server: {exc}"))
        except Exception as exc:  # noqa: BLE001 - a reader must always fail the waiters
            logger.exception("ems: reading from ems-server failed")
            self.fail(EmsException(EmsErrorCode.EMS_INTERNAL_ERROR, f"reader failed: {exc}"))

    def post(self, msg: m.Message) -> None:
        """A one-way message (abort, release, return), sent within :data:`POST_WAIT_S`;
        silently dropped on a broken connection. One that cannot be sent in time fails
        the connection: the daemon then drops what the message would have given back."""
        if self.broken is None:
            try:
                self._send_bytes(encode(msg), _monotonic() + POST_WAIT_S)
            except socket.timeout:
                self.fail(_io_error(f"ems-server did not take a {type(msg).__name__} "
                                    f"within {POST_WAIT_S * 1000:.0f} ms; the connection "
                                    f"is dropped (the daemon frees what it held)"))
            except EmsException:
                pass

    def _send_bytes(self, data: bytes, deadline: float) -> None:
        """Send one whole frame by ``deadline`` (a monotonic time), else raise
        ``socket.timeout``: with the connection as it was when no byte went out, failed
        when part of the frame did (see the module docstring)."""
        if not self._send_lock.acquire(timeout=max(0.0, deadline - _monotonic())):
            raise socket.timeout("another sender holds the socket")
        try:
            if self.broken is not None:
                raise fresh(self.broken)
            view, sent, total = memoryview(data), 0, len(data)
            send, wait = self.sock.send, self._write_poll.poll
            while True:
                try:
                    sent += send(view[sent:] if sent else view)
                except (BlockingIOError, InterruptedError):
                    pass
                except OSError as exc:
                    self.fail(_io_error(f"lost the connection to ems-server: {exc}"))
                    raise fresh(self.broken) from exc  # type: ignore[arg-type]
                if sent == total:
                    return
                remaining = deadline - _monotonic()
                if remaining > 0:  # wait for room (or the deadline), then try again
                    wait(math.ceil(remaining * 1000))
                    continue
                if sent:
                    self.fail(_io_error(f"a send to ems-server ran out of time after {sent} "
                                        f"of {total} bytes; the connection is replaced"))
                raise socket.timeout("ems-server does not read its socket")
        finally:
            self._send_lock.release()

    # ------------------------------------------------------------ lease
    def fits_lease(self, sizes: Sequence[int]) -> bool:
        """Whether a save of ``sizes`` is small enough to go through the lease (at most
        a quarter of it, counting each value's alignment, and one Put of keys)."""
        return (len(sizes) <= self.max_keys
                and sum(sizes) + _ALIGN * len(sizes) <= self._small_save_bytes)

    def take_ranges(self, sizes: Sequence[int], want: bool) -> Optional[tuple[list[int], bool]]:
        """Offsets of ranges for ``sizes`` cut from the lease (None when it is short),
        owned by the caller until it puts or returns them; and, when ``want``, whether
        its Put should ask for a fresh lease (see :meth:`want_lease_locked`)."""
        with self.lease_lock:
            offsets = self._cut_locked(sizes)
            if offsets is None:
                return None
            return offsets, want and self.want_lease_locked()

    def _cut_locked(self, sizes: Sequence[int]) -> Optional[list[int]]:
        offset = self.lease_cursor
        offsets = []
        for n in sizes:
            offsets.append(offset)
            offset += max(_ALIGN, -(-n // _ALIGN) * _ALIGN)
        if offset > self.lease_end:
            return None
        self.lease_cursor = offset
        return offsets

    def want_lease_locked(self) -> bool:
        """Whether the next Put should ask for a fresh lease (less than half left);
        called with ``lease_lock`` held."""
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
        exc = fresh(exc)  # never the raised one: its traceback holds this session
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
