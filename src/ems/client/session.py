"""The connection to ``ems-server`` under RemoteTransport: who reads the socket, who
waits for which reply. A thin driver: the connection's state (handshake, rids, what a
late reply means) is ``ems.protocol.connection.ClientConnection``; the socket and its
errors are ``ems.client.channel``; the lease is ``ems.client.lease``.

One connection per process, shared by every thread. A thread waiting for its reply
reads the socket itself when no other thread is reading (a lone request never
switches threads) and hands replies that are not its own to their waiters; when it
is done it hands the socket to the oldest waiting thread. A watcher thread covers the
idle time: it notices a daemon that hung up, and reads and undoes replies that nobody
waits for any more (pins released, reservations aborted). It alone closes the socket.

A synchronous call's leader polls for its reply for ``spin_s`` (``EMS_SPIN_US``)
before it sleeps in ``poll``: the reply is tens of microseconds away, and a sleeping
thread pays a wake-up and cold caches (on a VM, its vCPU halts).

Deadlines cover sending (``Channel.send``): a thread waiting for another sender waits
for the send lock no longer than its deadline. A send that times out before its first
byte leaves the connection as it was; one that times out mid-frame has corrupted the
stream, so the connection is failed and the next call opens a new one. One-way
messages (release, abort, return) wait at most :data:`POST_WAIT_S`; one that cannot
go out in that time fails the connection, and the daemon then drops every pin and
reservation of it (nothing leaks; the slack of a call's deadline is this wait plus the
copy step in progress).

A load's pins are given back LAZILY: :meth:`Session.release` keeps the tokens, and
the next frame this connection sends carries the ``Release`` right behind it (one
``send``, one wake of the daemon, instead of a one-way frame of its own after every
load: 4-9 us of a ~45 us load p50 here, A/B in one run). Nothing waits longer than
:data:`RELEASE_DELAY_S` for that: the watcher sends what no request took by then (it
sleeps with that timeout while tokens wait, and without one when none do). A pin held
that long only keeps its object from being evicted; the bytes were copied before the
load returned.

The connection's failure is stored once (``broken``) and every raise gets a fresh copy
of it: a raised exception collects a traceback whose frames hold the session, and a
client that keeps the exception would keep the session -- and its pool mapping --
alive.
"""

from __future__ import annotations

import logging
import math
import os
import select
import threading
import time
from typing import Any, Callable, NamedTuple, Optional

from ems.client.channel import Channel, Timeout, bad_reply, io_error, probe
from ems.client.lease import Lease
from ems.client.segment import Segment
from ems.errors import EmsErrorCode, EmsException
from ems.protocol import encode, encode_wire
from ems.protocol import messages as m
from ems.protocol.connection import LATE, ClientConnection, undo_late

__all__ = ["LIVENESS_S", "POST_WAIT_S", "RELEASE_DELAY_S", "Outstanding", "Pending", "Session",
           "Timeout", "bad_reply", "fresh", "io_error", "probe"]

_monotonic = time.monotonic
_yield = os.sched_yield

logger = logging.getLogger(__name__)

#: A request without a deadline gives up (and drops the connection) after this long.
LIVENESS_S = 30.0
#: Longest a one-way message (release, abort, return) waits to be sent.
POST_WAIT_S = 0.1
#: Longest a load's pins wait to be given back with a later frame (then the watcher
#: sends them alone).
RELEASE_DELAY_S = 0.002
#: Longest the watcher reads for replies nobody waits for before it looks again
#: whether a waiter could read instead.
_WATCH_SLICE_S = 0.05
_POLLRDHUP = getattr(select, "POLLRDHUP", 0x2000)  # Linux; elsewhere POLLHUP still wakes


def fresh(exc: EmsException) -> EmsException:
    """A copy of ``exc`` without a traceback (see the module docstring)."""
    return type(exc)(exc.status_code(), exc.message())


class Pending(NamedTuple):
    """A request sent and not yet answered (``Session.send``)."""

    rid: int
    waiter: _Waiter
    deadline: float


class Outstanding(NamedTuple):
    waiting: int  #: requests waited for
    late: int  #: requests given up on whose replies are still due
    reading: bool  #: a thread reads the socket now
    unreleased: int  #: pins to give back with the next frame


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


class Session:
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

    def __init__(self, channel: Channel, proto: ClientConnection, welcome: m.Welcome,
                 segment: Optional[Segment], gen: int) -> None:
        self.channel = channel
        self.welcome = welcome
        self.segment = segment
        self.gen = gen
        self.broken: Optional[EmsException] = None
        #: the daemon's limits (Welcome): batches are sent in slices of this many keys
        self.max_keys = max(1, welcome.max_keys)
        #: this connection's lease of pool space (small saves), per the Welcome
        self.lease = Lease(welcome.align, welcome.lease_size if segment else 0,
                           self.max_keys)
        self._proto = proto
        self._lock = threading.Lock()
        self._lead_free = threading.Condition(self._lock)
        self._send_lock = threading.Lock()
        self._reading = False  # a leader reads the socket (only it may)
        self._hangup = False  # the watcher saw the daemon hang up
        self._watcher_waits = False  # for _lead_free
        # Pins to give back with the next frame (see the module docstring), under
        # _send_lock; since when the oldest waits; whether the watcher sleeps untimed.
        self._unreleased: list[int] = []
        self._unreleased_at = 0.0
        self._watcher_parked = False
        self._wake_r, self._wake_w = os.pipe()  # wakes the watcher (O_CLOEXEC)
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        try:
            self._deliver(b"")  # what arrived together with the Welcome
        except EmsException as exc:
            self.fail(exc)  # (the watcher then closes the socket at once)
        self._watcher = threading.Thread(target=self._watch, daemon=True,
                                         name=f"ems-remote-watcher-{gen}")
        self._watcher.start()

    @classmethod
    def open(cls, path: str, access_id: Optional[str], access_key: Optional[str],
             timeout_s: float, gen: int, admin: bool = False) -> "Session":
        """Connect, authenticate and map the tenant's memory, all within ``timeout_s``."""
        proto = ClientConnection(access_id, access_key)
        channel, welcome, segment = Channel.open(path, proto, timeout_s, admin)
        return cls(channel, proto, welcome, segment, gen)

    # ------------------------------------------------------------ requests
    def request(self, msg_for: Callable[[int], Any], wait_s: float,
                spin_s: float = 0.0) -> m.Message:
        """Send a request (``msg_for(rid)``: a message, or its wire form ``Cls.wire``)
        and wait up to ``wait_s`` for its reply, polling for it the first ``spin_s``
        when this thread reads the socket itself.

        Raises :class:`Timeout` when no reply came in time (a late reply is undone
        when it is read), ``EmsException`` for an error reply or a broken connection.
        """
        return self.reply_to(self.send(msg_for, wait_s), spin_s)

    def send(self, msg_for: Callable[[int], Any], wait_s: float) -> Pending:
        """The first half of :meth:`request`: the request goes out (within ``wait_s``,
        which also bounds its reply); :meth:`reply_to` waits for the answer, or
        :meth:`abandon` gives it up. Several may be in flight from one thread."""
        deadline = _monotonic() + wait_s
        waiter = _Waiter()
        with self._lock:
            if self.broken is not None:
                raise fresh(self.broken)
            rid = self._proto.start(waiter)
        try:
            msg = msg_for(rid)  # (may raise: a batch too big for a frame)
            self._send(encode_wire(msg) if type(msg) is list else encode(msg), deadline)
        except BaseException:
            with self._lock:
                self._proto.cancel(rid)
            raise
        return Pending(rid, waiter, deadline)

    def reply_to(self, pending: Pending, spin_s: float = 0.0) -> m.Message:
        """The second half of :meth:`request` (see there)."""
        reply = self._await(pending.rid, pending.waiter, pending.deadline, spin_s)
        if isinstance(reply, EmsException):
            raise fresh(reply)
        if isinstance(reply, m.Error):
            raise reply.exception()
        return reply

    def abandon(self, pending: Pending) -> None:
        """Nobody will wait for ``pending``: its reply is undone (now, if it came
        already; when it is read, otherwise)."""
        with self._lock:
            reply = pending.waiter.reply
            if reply is None:
                self._proto.give_up(pending.rid)
                if not self._reading:  # nobody reads: the watcher reads it and undoes it
                    self._hand_off_locked()
        if isinstance(reply, m.Message):
            for undo in undo_late(reply):
                self.post(undo)

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
                            self._proto.give_up(rid)
                        self._hand_off_locked()
                if reply is None:
                    raise Timeout("no reply within the deadline")
                return reply
            remaining = deadline - _monotonic()
            if remaining <= 0 or not waiter.event.wait(remaining):  # type: ignore[union-attr]
                with self._lock:
                    reply = waiter.reply
                    if reply is None:
                        self._proto.give_up(rid)
                        if not self._reading:  # a hand-off to us may have crossed
                            self._hand_off_locked()
                if reply is None:
                    raise Timeout("no reply within the deadline")
                return reply  # came just as the wait ended

    def outstanding(self) -> Outstanding:
        """What this connection has in flight (all zero / False when it is idle)."""
        with self._lock:
            waiting, late, reading = (len(self._proto.pending), len(self._proto.orphans),
                                      self._reading)
        return Outstanding(waiting, late, reading, len(self._unreleased))

    def _hand_off_locked(self) -> None:
        """Nobody reads now: give the socket to the oldest waiter, or to the watcher
        when only replies nobody waits for are due (or the daemon hung up)."""
        if self._watcher_waits:
            self._lead_free.notify_all()
        if self.broken is not None:
            return
        for waiter in self._proto.pending.values():
            if waiter.event is not None:  # a follower (a request sent and not yet
                waiter.wake()             # waited for, e.g. a pipelined Reserve, is
                return                    # read by its thread when it waits)
        if self._proto.orphans or self._hangup:
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
        channel, proto = self.channel, self._proto
        recv, poll_in = channel.recv, channel.poll_in
        try:
            while True:
                if waiter is not None:
                    if waiter.reply is not None:
                        return
                elif self.broken is not None or proto.pending or not (
                        proto.orphans or self._hangup):
                    return
                remaining = deadline - _monotonic()
                if remaining <= 0:
                    return
                ready: Any = False
                if spin_until:  # (poll(0) gives the GIL to other threads each time)
                    ready = poll_in(0)
                    while not ready and _monotonic() < spin_until:
                        _yield()  # a runnable daemon on this CPU goes first
                        ready = poll_in(0)
                    spin_until = 0.0
                if not ready and not poll_in(math.ceil(remaining * 1000)):
                    continue
                data = recv()
                if data is not None:
                    self._deliver(data)
        except EmsException as exc:
            self.fail(exc)
        except Exception as exc:  # noqa: BLE001 - a reader must always fail the waiters
            logger.exception("ems: reading from ems-server failed")
            self.fail(EmsException(EmsErrorCode.EMS_INTERNAL_ERROR, f"reader failed: {exc}"))

    def _deliver(self, data: bytes) -> None:
        """Hand the replies in ``data`` to their waiters; undo the late ones; raise
        what ended the connection (after delivering the replies before it)."""
        late = []
        with self._lock:
            for tag, msg in self._proto.receive(data):
                if tag is LATE:
                    late.append(msg)
                else:
                    tag.reply = msg
                    tag.wake()
            error = self._proto.error
        for msg in late:
            for undo in undo_late(msg):
                self.post(undo)
        if error is not None:
            raise error

    def post(self, msg: m.Message | list[Any]) -> None:
        """A one-way message (abort, release, return; or its wire form), sent within
        :data:`POST_WAIT_S`; silently dropped on a broken connection. One that cannot
        be sent in time fails the connection: the daemon then drops what the message
        would have given back."""
        if self.broken is None:
            try:
                data = encode_wire(msg) if isinstance(msg, list) else encode(msg)
                self._send(data, _monotonic() + POST_WAIT_S)
            except Timeout:
                name = m.MESSAGES[msg[0]].__name__ if type(msg) is list else type(msg).__name__
                self.fail(io_error(f"ems-server did not take a {name} "
                                   f"within {POST_WAIT_S * 1000:.0f} ms; the connection "
                                   f"is dropped (the daemon frees what it held)"))
            except EmsException:
                pass

    def release(self, tokens: list[int]) -> None:
        """Give back a load's pins with the next frame, within :data:`RELEASE_DELAY_S`
        (at once when a request's worth is waiting)."""
        if not tokens or self.broken is not None:
            return
        wake = False
        with self._send_lock:
            if not self._unreleased:
                self._unreleased_at = _monotonic()
                wake = self._watcher_parked
            self._unreleased += tokens
            now = len(self._unreleased) >= self.max_keys
        if now:
            self.flush_releases()
        elif wake:  # (only after an idle time: a timed watcher looks by itself)
            self._wake_watcher()

    def flush_releases(self) -> None:
        """Send the waiting releases now (a frame of their own)."""
        while True:
            with self._send_lock:
                if not self._unreleased:
                    return
                tokens = self._unreleased[:self.max_keys]
                del self._unreleased[:self.max_keys]
            self.post(m.Release.wire(tokens=tokens))

    def _send(self, data: bytes, deadline: float) -> None:
        """Send one whole frame by ``deadline`` (a monotonic time), else raise
        :class:`Timeout`: with the connection as it was when no byte went out, failed
        when part of the frame did (see the module docstring). Waiting releases go
        right behind it, in the same ``send`` (the daemon answers the frame first)."""
        lock = self._send_lock
        if not lock.acquire(False) and \
                not lock.acquire(timeout=max(0.0, deadline - _monotonic())):
            raise Timeout("another sender holds the socket")
        carried: list[int] = []
        try:
            if self.broken is not None:
                raise fresh(self.broken)
            if self._unreleased and len(self._unreleased) <= self.max_keys:
                # after the frame: the daemon answers it first, then releases
                carried, self._unreleased = self._unreleased, []
                data += encode_wire(m.Release.wire(tokens=carried))
            self.channel.send(data, deadline)
        except Timeout as exc:
            if exc.partial:
                self.fail(io_error(exc.message()))
            elif carried:  # nothing went out: they wait for the next frame
                self._unreleased[:0] = carried
            raise
        except EmsException as exc:
            self.fail(exc)
            raise fresh(exc) from None
        finally:
            self._send_lock.release()

    # ------------------------------------------------------------ watcher
    def _watch(self) -> None:
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        # Not POLLIN: replies are the leaders' business; this wakes on a hang-up only
        # (POLLHUP and POLLERR are always reported).
        poller.register(self.channel.fileno, _POLLRDHUP)
        proto = self._proto
        try:
            while True:
                with self._lock:
                    while self._reading:  # the leader sees a hang-up by itself
                        self._watcher_waits = True
                        self._lead_free.wait()
                        self._watcher_waits = False
                    if self.broken is not None:
                        return
                    lead = (bool(proto.orphans) and not proto.pending) or self._hangup
                    if lead:
                        self._reading = True
                timeout_ms = -1
                # (the send lock is never taken under the session lock; a sender that
                # holds it, waiting for a frozen daemon, only makes this look again)
                if not lead and self._send_lock.acquire(timeout=RELEASE_DELAY_S):
                    try:
                        if self._unreleased:
                            due = self._unreleased_at + RELEASE_DELAY_S - _monotonic()
                            timeout_ms = max(0, math.ceil(due * 1000))
                        self._watcher_parked = timeout_ms < 0
                    finally:
                        self._send_lock.release()
                elif not lead:
                    timeout_ms = math.ceil(RELEASE_DELAY_S * 1000)
                if lead:
                    try:
                        self._read(None, _monotonic() + _WATCH_SLICE_S)
                    finally:
                        with self._lock:
                            self._reading = False
                            self._hand_off_locked()
                    continue
                if timeout_ms == 0:
                    self.flush_releases()
                    continue
                for fd, _events in poller.poll(timeout_ms):
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
            with self._send_lock:  # no sender may be inside send on a closed fd
                self.channel.close()
            os.close(self._wake_r)
            os.close(self._wake_w)

    def fail(self, exc: EmsException, quiet: bool = False) -> None:
        """Mark the connection broken: every waiter gets ``exc``; idempotent.
        ``quiet``: a deliberate close (not logged as a loss)."""
        exc = fresh(exc)  # never the raised one: its traceback holds this session
        with self._lock:
            if self.broken is not None:
                return
            self.broken = exc
            waiters = self._proto.close()
            self._lead_free.notify_all()
            for waiter in waiters:
                waiter.reply = exc
                waiter.wake()
        self.channel.shutdown()  # wakes the leader and the watcher, which closes it
        if not quiet:
            logger.warning("ems: connection to ems-server lost: %s", exc.message())

    def abandon_after_fork(self) -> None:
        """In a forked child: this connection is the parent's. Drop our copy of the fd
        without ``shutdown`` (which would cut the parent off too)."""
        self.broken = io_error("connection inherited through fork")
        self._proto.close()
        self.channel.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def close(self) -> None:
        self.fail(EmsException(EmsErrorCode.EMS_NOT_INITIALIZED,
                               "the ems-server client was closed"), quiet=True)
        if threading.current_thread() is not self._watcher:
            self._watcher.join(timeout=1.0)
