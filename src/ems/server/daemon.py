"""The ems-server event loop: one thread, one epoll, every pool owned by it.

The daemon only moves control messages; the bytes go through each tenant's memfd,
which clients map and copy into directly. The pool core is synchronous, so handling a
request is a few dictionary operations done inline; no request ever waits for another.
Requests are handled from their checked wire form (``[TYPE, fields...]``) by a table
of handlers, and answered with wire lists: no message object per request. After a
request the loop polls without sleeping for ``spin_us`` (yielding the CPU between
polls), so a client that sends its next request soon does not wait for a wake-up.

This module is the I/O: the loop, accepting, reading, writing, driving the handshake.
What a tenant's request does is ``ems.server.handlers``; a connection's state is a
:class:`~ems.server.session.Session`. Tiers beyond shared memory (the local disk with
``--disk``, a Valkey Cluster shared by every host with ``--cluster``) implement
``ems.server.tiers.Tier``; their worker threads hand completions back to the loop
(:meth:`Daemon.call_soon`, run when the wake socketpair fires), and the requests that
waited for them are answered then (by rid).

A connection's phases (HELLO -> [AUTH] -> READY -> CLOSED), which message each phase
accepts and what each reply moves, are ``ems.protocol.connection.ServerConnection``;
this module is its I/O driver: it reads the socket, hands the bytes to the connection,
acts on the events (the tenant registry decides Hello and Auth, a handler per request
does the pool's dictionary work) and writes the frames the connection returns.

Whatever closes a connection (EOF, a malformed or wrong-version frame, a client that
does not read its replies, a handshake not finished within ``handshake_timeout_s``),
``Pool.drop_owner`` then gives back its pins, reservations and lease, and the other
connections are not affected. A timer calls ``Pool.expire`` so a reservation whose
writer hangs is freed after the reservation TTL.

Every resource a client can make the daemon hold is bounded (``ServerConfig.limits``,
:class:`~ems.server.config.Limits`): here, bytes buffered in partial frames across all
connections (the connection that goes over is closed), connections per uid (at accept)
and per tenant (at hello); the per-request bounds (keys, pins, leases) are the
handlers'. Each refusal is counted (``statistics().server.refused``).

The listening socket (taking the path, accept under fd pressure with a backoff) is
``ems.server.listener``.
"""

from __future__ import annotations

import collections
import dataclasses
import fcntl
import heapq
import logging
import os
import secrets
import select
import signal
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

from ems.errors import EmsErrorCode, EmsException
from ems.protocol import PROTOCOL_VERSION
from ems.protocol import messages as m
from ems.protocol.connection import Phase, ServerConnection
from ems.protocol.framing import DecodeLimitExceeded
from ems.protocol.report import DaemonReport, ServerRow, TenantRow, TenantTiers, WireRow
from ems.server.config import Limits, ServerConfig
from ems.server.handlers import Handlers, lease_bytes
from ems.server.listener import Listener, ListenError
from ems.server.ratelimit import RateLimitedLog
from ems.server.session import Session
from ems.server.tenants import Tenant, TenantRegistry
from ems.server.tiers import Observer, Tier, TierEvents

if TYPE_CHECKING:
    from ems.server.control_sync import ControlSync
    from ems.server.kv_events import KvEventPublisher

__all__ = ["ALLOCATOR_BROKEN", "Daemon", "DaemonError"]

logger = logging.getLogger(__name__)

#: the log line's words when a pool's allocator fails its check at stop
ALLOCATOR_BROKEN = "the pool's allocator is inconsistent at stop, tenant"
MAX_PENDING_OUTPUT = 64 << 20  # a client that lets this much reply pile up is dropped
#: Bytes asked of one recv. Not more: CPython allocates that much for every recv, and
#: past malloc's mmap threshold (128 KiB) each call maps and unmaps it (~15 us).
_RECV_BYTES = 64 << 10
#: A readable connection: data, EOF or an error (recv tells which).
_READABLE = select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR


class DaemonError(Exception):
    """The daemon cannot start (message says why and what to do)."""


class Daemon:
    """Listen on ``config.socket_path`` and serve the pools of ``registry``."""

    def __init__(self, config: ServerConfig, registry: TenantRegistry) -> None:
        self.config = config
        self.registry = registry
        #: the one clock of the daemon's decisions, the registry's (its pools' TTLs):
        #: the handlers' deadlines, the tiers', the timers of :meth:`call_at`, the
        #: handshake timeout (``time.monotonic``; a test's ``FakeClock``)
        self.clock = clock = registry.clock
        self.path = config.socket_path
        self._epoll = select.epoll()
        self._by_fd: dict[int, Any] = {}  # fd -> "listen", "wake" or its Session
        self._conns: dict[int, Session] = {}
        self._ids = 0
        self._warnings = RateLimitedLog(logger)
        self._listener = Listener(self.path, config.socket_mode,
                                  lambda sock: self._watch(sock, "listen"), self._unwatch,
                                  self._warnings)
        self._lock_fd = -1
        self._wake_r: Optional[socket.socket] = None
        self._wake_w: Optional[socket.socket] = None
        self._stopping = False
        self._started = clock()
        self._tick_s = max(0.05, min(1.0, config.reservation_ttl_s / 4))
        #: called on the loop: after a :meth:`wake` / at each tick (control sync, metrics)
        self.wake_hooks: list[Callable[[], None]] = []
        #: the control plane's sync, when ``--control`` is set (it registers itself:
        #: ``/metrics`` shows its families)
        self.control_sync: Optional["ControlSync"] = None
        self.tick_hooks: list[Callable[[], None]] = []
        self.limits: Limits = config.limits
        #: refusals by limit name (``ems stats``: server.refused)
        self.refused: collections.Counter = collections.Counter()
        self._buffered = 0  # bytes of partial frames of every connection
        # Decoding is bounded too: a frame within max_frame_bytes may hold millions of
        # tiny elements (~60 ms of the loop per 1M); past 4x the request limits msgpack
        # stops at the element's header and the connection is closed, between them the
        # request is refused (EMS_INVALID_ARGUMENT) after a decode of a few ms.
        limits = config.limits
        self._unpack_limits = {"max_array_len": 4 * limits.max_keys_per_request + 16,
                               "max_str_len": 4 * limits.max_key_bytes,
                               "max_bin_len": 4096, "max_map_len": 64, "max_ext_len": 0}
        self._per_uid: collections.Counter = collections.Counter()
        #: what serves a request of a ready connection: :meth:`_request`, or that
        #: timed (:meth:`enable_request_timing`); chosen once, not tested per request
        self._serve: Callable[[Session, type[m.Message], list[Any]], None] = self._request
        #: the tiers beyond shared memory, in lookup order (started with the daemon)
        self.tiers: list[Tier] = []
        #: the KV events publisher (``--kv-events``), bound by ``main``; an observer
        #: watches the pools for it (``ems.server.events_observer``)
        self.kv_events: Optional[KvEventPublisher] = None
        #: what watches the pools' stores and evictions (started with the daemon)
        self.observers: list[Observer] = []
        self._soon: collections.deque[Callable[[], None]] = collections.deque()
        #: :meth:`call_at` callbacks, a heap of (monotonic time, sequence, callback);
        #: tiers' workers add to it, so it has a lock (the loop alone pops)
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._timers_lock = threading.Lock()
        self._timer_seq = 0
        self.handlers = Handlers(self.limits, (), self, self.refused, clock=clock)

    # ------------------------------------------------------------ start / stop
    def start(self) -> None:
        """Take the socket (refusing a live daemon, replacing a stale socket file)."""
        path = self.path
        if len(os.fsencode(path)) > 107:
            raise DaemonError(f"socket path {path} is longer than the 107 bytes a unix "
                              f"socket allows; use a shorter socket_dir")
        try:
            os.makedirs(self.config.socket_dir, mode=0o770, exist_ok=True)
        except OSError as exc:
            raise DaemonError(f"cannot create socket_dir {self.config.socket_dir}: "
                              f"{exc.strerror}") from exc
        # One daemon per directory: an flock on the directory itself (released by the
        # kernel when a daemon dies, and it leaves no file behind).
        self._lock_fd = os.open(self.config.socket_dir, os.O_RDONLY | os.O_DIRECTORY |
                                os.O_CLOEXEC)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._release_lock()
            raise DaemonError(f"another ems-server is running on {path}; stop it first "
                              f"(or give this one another socket_dir)") from None
        try:
            self._listener.take()
        except ListenError as exc:
            self._release_lock()
            raise DaemonError(str(exc)) from None
        except BaseException:
            self._release_lock()
            raise
        self._wake_r, self._wake_w = socket.socketpair()
        for s in (self._wake_r, self._wake_w):
            s.setblocking(False)
        self._watch(self._wake_r, "wake")
        if not self.tiers:  # last: a daemon that cannot serve starts no tier's threads
            events = None
            if self.kv_events is not None:
                from ems.server.events_observer import EventsObserver
                events = EventsObserver(self.kv_events)
            try:
                self.tiers = self._start_tiers(events)
            except DaemonError:
                self._listener.close()
                self._release_lock()
                raise
            if events is not None:
                self.observers = [events]
            self.handlers = Handlers(self.limits, self.tiers, self, self.refused,
                                     self.observers, clock=self.clock)
        self._started = self.clock()

    def _start_tiers(self, events: Optional[TierEvents]) -> list[Tier]:
        """The tiers of ``config``, in lookup order: disk, then cluster (``events``:
        told of their stores and removals, for KV events)."""
        tiers: list[Tier] = []
        try:
            if self.config.disk is not None:
                from ems.server import disk_tier
                tiers.append(disk_tier.start(self.config, self, lambda: iter(self.registry),
                                             events, clock=self.clock))
            if self.config.cluster:
                from ems.server import cluster_tier
                tiers.append(cluster_tier.start(self.config, self, events, clock=self.clock))
        except RuntimeError as exc:
            for tier in tiers:
                tier.close()
            raise DaemonError(str(exc)) from exc
        return tiers

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loop soon (any thread: the tiers' completions)."""
        self._soon.append(fn)
        self.wake()

    def call_at(self, when: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loop at monotonic time ``when`` (any thread: a tier's
        deadline). The loop's poll wakes by the earliest one, so a deadline costs no
        thread of its own; a callback due when the loop stops is dropped (the tiers'
        ``close`` finishes what they hold)."""
        with self._timers_lock:
            self._timer_seq += 1
            heapq.heappush(self._timers, (when, self._timer_seq, fn))
            first = self._timers[0][1] == self._timer_seq
        if first:  # the poll may be waiting past it
            self.wake()

    def _run_due(self, now: float) -> None:
        """Run the :meth:`call_at` callbacks due by ``now``, in time order."""
        timers = self._timers
        while timers and timers[0][0] <= now:
            with self._timers_lock:
                fn = heapq.heappop(timers)[2]
            self._run_hook(fn)

    def _run_soon(self) -> None:
        soon = self._soon
        while soon:
            self._run_hook(soon.popleft())

    def request_stop(self) -> None:
        """Ask the loop to stop (signal-safe)."""
        self._stopping = True
        if self._wake_w is not None:
            try:
                self._wake_w.send(b"\0")
            except OSError:
                pass

    def wake(self) -> None:
        """Make the loop run its ``wake_hooks`` soon (any thread)."""
        if self._wake_w is not None:
            try:
                self._wake_w.send(b"\1")
            except OSError:  # full (a wake is pending anyway) or closed
                pass

    def close_sessions(self, match: Callable[[Tenant, Optional[str]], bool],
                       why: str) -> int:
        """Close the tenant sessions for which ``match(tenant, key_id)`` holds (on the
        loop: a revoked key, a deleted tenant); how many."""
        doomed = [c for c in self._conns.values()
                  if c.tenant is not None and match(c.tenant, c.key_id)]
        for conn in doomed:
            self._fail(conn, EmsException(EmsErrorCode.EMS_AUTH_FAILED, why))
        return len(doomed)

    def delete_tenant(self, tenant: Tenant) -> None:
        """``tenant`` left the registry (the control plane deleted it; its sessions are
        closed already): every tier lets go of its memory and its queued work
        (``Tier.removed``), then its memory's descriptor is closed (on the loop)."""
        for tier in self.tiers:
            tier.removed(tenant)
        tenant.close()

    def enable_request_timing(self, observe: Callable[[type, float], None]) -> None:
        """Time each request: ``observe(message class, seconds)`` after it (metrics);
        off unless called, so the loop pays nothing for it by default."""
        serve = self._request

        def timed(conn: Session, cls: type[m.Message], v: list[Any]) -> None:
            t0 = time.perf_counter()
            try:
                serve(conn, cls, v)
            finally:
                observe(cls, time.perf_counter() - t0)
        self._serve = timed

    def serve_forever(self) -> None:
        """Run until SIGTERM/SIGINT or :meth:`request_stop`, then clean up."""
        previous = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda *_: self.request_stop())
        poll, spin_s = self._epoll.poll, self.config.spin_us / 1e6
        listener = self._listener
        try:
            # the tick is the loop's heartbeat, in real time; what it decides (expired
            # reservations, late handshakes) is on ``self.clock``
            next_tick = time.monotonic() + self._tick_s
            busy_until = 0.0  # busy-poll until then (``spin_us`` after the last event)
            while not self._stopping:
                events = poll(0) if spin_s else None
                while not events and time.monotonic() < busy_until:
                    os.sched_yield()  # anything else runnable on this CPU goes first
                    events = poll(0)
                if not events:
                    wake_at = next_tick
                    if listener.paused_until:
                        wake_at = min(wake_at, listener.paused_until)
                    if self._timers:  # (due on the daemon's clock: the time left)
                        wake_at = min(wake_at, time.monotonic() +
                                      self._timers[0][0] - self.clock())
                    events = poll(max(0.0, wake_at - time.monotonic()))
                if spin_s and events:
                    busy_until = time.monotonic() + spin_s
                for fd, mask in events:
                    data = self._by_fd.get(fd)
                    if data is not None:
                        self._dispatch(data, mask)
                if listener.paused_until:
                    listener.resume_if_due(time.monotonic())
                if self._timers:
                    self._run_due(self.clock())
                if time.monotonic() >= next_tick:
                    self._tick()
                    next_tick = time.monotonic() + self._tick_s
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.close()

    def close(self) -> None:
        """Close every connection, remove the socket, free the pools' memory."""
        for tier in self.tiers:  # first: their workers end by their deadlines
            try:
                tier.close()
            except Exception:  # noqa: BLE001 - the others still close
                logger.exception("ems-server: closing the %s tier failed", tier.name)
            self._run_soon()  # the completions they handed back
        self.tiers = []
        for conn in list(self._conns.values()):
            self._close(conn, "ems-server is stopping")
        self._listener.close()
        for s in (self._wake_r, self._wake_w):
            if s is not None:
                self._unwatch(s)
                s.close()
        self._wake_r = self._wake_w = None
        self._check_allocators()
        self.registry.close()
        self._release_lock()
        self._epoll.close()

    def _check_allocators(self) -> None:
        """At stop, every connection gone: each pool's allocator must still tile its
        arena exactly (``Allocator.check``). A break is logged as one ERROR line naming
        the tenant (the test kits' teardown fails on it, ``ems.testing.leaks``); it
        costs a sort of the extents, so it runs here and not per report."""
        for tenant in self.registry:
            try:
                tenant.pool.allocator.check()
            except AssertionError as exc:
                logger.error("ems-server: %s %s: %s", ALLOCATOR_BROKEN, tenant.name, exc)

    def _watch(self, sock: socket.socket, data: Any) -> None:
        self._by_fd[sock.fileno()] = data
        self._epoll.register(sock.fileno(), select.EPOLLIN)

    def _unwatch(self, sock: socket.socket) -> None:
        fd = sock.fileno()
        if self._by_fd.pop(fd, None) is not None:
            try:
                self._epoll.unregister(fd)
            except (OSError, ValueError):
                pass

    def _release_lock(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    # ------------------------------------------------------------ loop
    def _dispatch(self, data: Any, mask: int) -> None:
        if type(data) is Session:
            if mask & select.EPOLLOUT:
                self._flush(data)
            if mask & _READABLE and data.phase is not Phase.CLOSED:
                self._on_readable(data)
        elif data == "listen":
            self._accept()
        else:  # "wake"
            try:
                self._wake_r.recv(4096)  # type: ignore[union-attr]
            except OSError:
                pass
            if self._soon:
                self._run_soon()
            for hook in self.wake_hooks:
                self._run_hook(hook)

    def _run_hook(self, hook: Callable[[], None]) -> None:
        try:
            hook()
        except Exception:  # noqa: BLE001 - a hook's bug must not stop the daemon
            logger.exception("ems-server: hook %r failed", hook)

    def _tick(self) -> None:
        for hook in self.tick_hooks:
            self._run_hook(hook)
        freed = self.registry.expire()
        if freed:
            logger.info("ems-server: freed %d reservation(s) older than %.1f s (writer gone "
                        "or stuck)", freed, self.config.reservation_ttl_s)
        limit = self.clock() - self.limits.handshake_timeout_s
        for conn in list(self._conns.values()):
            if conn.phase in (Phase.HELLO, Phase.AUTH) and conn.opened_at < limit:
                self._fail(conn, EmsException(EmsErrorCode.EMS_IO_TIMEOUT,
                                              "handshake not finished in time"))

    def _accept(self) -> None:
        for sock, pid, uid in self._listener.accept(self._make_room, len(self._conns)):
            if self._per_uid[uid] >= self.limits.max_connections_per_uid:
                self._refuse_at_accept(sock, uid)
                continue
            self._per_uid[uid] += 1
            self._ids += 1
            conn = Session(self._ids, sock, pid, uid, self.clock())
            self._conns[conn.id] = conn
            self._watch(sock, conn)
            logger.debug("ems-server: %s opened", conn)

    def _refuse_at_accept(self, sock: socket.socket, uid: int) -> None:
        self.refused["max_connections_per_uid"] += 1
        message = (f"uid {uid} holds {self._per_uid[uid]} connections to this ems-server, "
                   f"its limit (max_connections_per_uid); retry once some have closed")
        self._warnings.warn(f"ems-server: refused a connection: {message}")
        try:
            sock.send(ServerConnection().refuse(EmsErrorCode.EMS_RECOVERD_ERROR, message))
        except OSError:
            pass
        sock.close()

    def _make_room(self) -> None:
        """No fd (or memory) for a new connection: the oldest one that never finished
        its handshake goes (``ems.server.listener``)."""
        self.refused["accept_fd_pressure"] += 1
        idle = [c for c in self._conns.values() if c.phase in (Phase.HELLO, Phase.AUTH)]
        if idle:
            oldest = min(idle, key=lambda c: c.opened_at)
            self._fail(oldest, EmsException(EmsErrorCode.EMS_RECOVERD_ERROR,
                                            "ems-server is out of file descriptors; "
                                            "connections that never finished their "
                                            "handshake go first"))

    def _on_readable(self, conn: Session) -> None:
        try:
            data = conn.sock.recv(_RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._close(conn, f"receive failed: {exc}")
            return
        if not data:
            self._close(conn, "closed by the client")
            return
        proto = conn.proto
        try:
            for cls, v in proto.receive(data):
                if proto.phase is Phase.READY:
                    self._serve(conn, cls, v)
                else:
                    self._handshake(conn, cls, v)
            if proto.phase is Phase.CLOSED:
                return
            held = proto.buffered
            self._buffered += held - conn.buffered
            conn.buffered = held
            if held and self._buffered > self.limits.max_buffered_bytes:
                self.refused["max_buffered_bytes"] += 1
                raise EmsException(EmsErrorCode.EMS_IO_ERROR,
                                   f"ems-server holds {self._buffered} bytes of partial "
                                   f"frames, more than max_buffered_bytes "
                                   f"({self.limits.max_buffered_bytes}); this connection's "
                                   f"{held} bytes are dropped")
        except DecodeLimitExceeded as exc:  # a body past _unpack_limits
            self.refused["decode_limits"] += 1
            self._fail(conn, exc)
        except EmsException as exc:
            self._fail(conn, exc)
        except Exception as exc:  # noqa: BLE001 - a bug must not stop the daemon
            logger.exception("ems-server: internal error on %s", conn)
            self._fail(conn, EmsException(EmsErrorCode.EMS_INTERNAL_ERROR,
                                          f"internal error: {type(exc).__name__}"))

    # ------------------------------------------------------------ output
    def _reply(self, conn: Session, wire: list[Any]) -> None:
        """Answer with a reply in its wire form (``Cls.wire(...)``: no object built);
        the connection says whether one may be sent now."""
        self._send_frame(conn, conn.proto.reply(wire))

    def reply(self, session: Session, wire: list[object]) -> None:
        """A handler's reply (``ems.server.handlers.Output``): only to a session still
        ready (a reply after a tier's round trip may find it closed)."""
        if session.proto.phase is Phase.READY:
            self._send_frame(session, session.proto.reply(wire))

    def _error(self, conn: Session, rid: int, code: EmsErrorCode, message: str) -> None:
        """Refuse one request (the connection stays)."""
        self._reply(conn, m.Error.wire(rid=rid, code=code.value, message=message))

    def _send_frame(self, conn: Session, data: bytes, fds: tuple[int, ...] = ()) -> None:
        if not conn.out and not fds:  # the usual case: straight out, nothing queued
            try:
                n = conn.sock.send(data)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError as exc:
                self._close(conn, f"send failed: {exc}")
                return
            if n == len(data):
                return
            data = data[n:]
        conn.out.append([memoryview(data), fds])
        conn.out_bytes += len(data)
        if conn.out_bytes > MAX_PENDING_OUTPUT:
            self._close(conn, "the client does not read its replies")
            return
        self._flush(conn)

    def _flush(self, conn: Session) -> None:
        while conn.out:
            item = conn.out[0]
            data, fds = item
            try:
                if fds:
                    n = socket.send_fds(conn.sock, [data], list(fds))
                else:
                    n = conn.sock.send(data)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self._close(conn, f"send failed: {exc}")
                return
            conn.out_bytes -= n
            if n < len(data):
                item[0], item[1] = data[n:], ()  # ancillary data went with the first byte
                break
            conn.out.popleft()
        want = bool(conn.out)
        if want != conn.writing and conn.phase is not Phase.CLOSED:
            self._epoll.modify(conn.sock.fileno(),
                               select.EPOLLIN | (select.EPOLLOUT if want else 0))
            conn.writing = want

    def _fail(self, conn: Session, exc: EmsException) -> None:
        """Tell the client why (best effort), then close its connection."""
        if conn.phase is Phase.CLOSED:
            return
        logger.warning("ems-server: closing %s: %s", conn, exc)
        try:
            conn.sock.send(conn.proto.refuse(exc.status_code(), exc.message()))
        except OSError:
            pass
        self._close(conn, exc.message())

    def _close(self, conn: Session, why: str) -> None:
        if conn.phase is Phase.CLOSED and conn.id not in self._conns:
            return
        conn.proto.closed()
        if self._conns.pop(conn.id, None) is not None:
            self._per_uid[conn.uid] -= 1
            if self._per_uid[conn.uid] <= 0:
                del self._per_uid[conn.uid]
        self._buffered -= conn.buffered
        conn.buffered = 0
        self._unwatch(conn.sock)
        conn.sock.close()
        conn.out.clear()
        if conn.tenant is not None:
            conn.tenant.pool.drop_owner(conn.id)
            conn.tenant.connections -= 1
            self.handlers.closed(conn)
        logger.debug("ems-server: %s closed: %s", conn, why)

    # ------------------------------------------------------------ messages
    def _handshake(self, conn: Session, cls: type[m.Message], v: list[Any]) -> None:
        """A message of the HELLO or AUTH phase (the connection let only those in)."""
        proto = conn.proto
        if cls is m.Ping:
            # A liveness probe before any handshake (``Ems.check_health()`` before a
            # successful init): answered, and the connection stays in HELLO.
            self._send_frame(conn, proto.pong(v[0]))
        elif cls is m.Hello:
            if proto.admin:
                if conn.uid not in (0, os.getuid()):
                    self._refuse(conn, "admin sessions are for the daemon's user and root")
                    return
                conn.admin = True
                self._welcome(conn, None)
            elif proto.access_id is None:
                tenant = self.registry.anonymous
                if tenant is None:
                    self._refuse(conn, "anonymous access is disabled on this ems-server; "
                                       "set EmsConfig.access_id/access_key")
                    return
                self._welcome(conn, tenant)
            else:
                self._send_frame(conn, proto.challenge(secrets.token_bytes(32)))
        else:  # Auth
            assert proto.access_id is not None
            found = self.registry.authenticate(proto.access_id, proto.nonce, v[0])
            if found is None:
                self._refuse(conn, f"access_id {proto.access_id!r} with this access_key is "
                                   f"refused by ems-server")
                return
            conn.key_id = found[1]
            self._welcome(conn, found[0])

    def _refuse(self, conn: Session, message: str,
                code: EmsErrorCode = EmsErrorCode.EMS_AUTH_FAILED) -> None:
        logger.warning("ems-server: refused %s: %s", conn, message)
        self._send_frame(conn, conn.proto.refuse(code, message))
        self._close(conn, message)

    def _welcome(self, conn: Session, tenant: Optional[Tenant]) -> None:
        if tenant is not None and tenant.connections >= self.limits.max_connections_per_tenant:
            self.refused["max_connections_per_tenant"] += 1
            message = (f"tenant {tenant.name} holds {tenant.connections} connections, its "
                       f"limit (max_connections_per_tenant); retry once some have closed")
            self._warnings.warn(f"ems-server: refused {conn}: {message}")
            self._send_frame(conn, conn.proto.refuse(EmsErrorCode.EMS_RECOVERD_ERROR, message))
            self._close(conn, message)
            return
        server = f"ems-server pid {os.getpid()} protocol {PROTOCOL_VERSION}"
        ttl, max_keys = self.config.reservation_ttl_s, self.limits.max_keys_per_request
        fds: tuple[int, ...] = ()
        if tenant is None:
            welcome = m.Welcome(tenant="", segment_id=0, segment_size=0,
                                reservation_ttl_s=ttl, server=server, max_keys=max_keys,
                                align=64, lease_size=0)
        else:
            conn.tenant = tenant
            tenant.connections += 1
            self.handlers.opened(tenant)
            pool = tenant.pool
            welcome = m.Welcome(tenant=tenant.name, segment_id=tenant.segment_id,
                                segment_size=tenant.segment_size, reservation_ttl_s=ttl,
                                server=server, max_keys=max_keys,
                                align=pool.allocator.alignment,
                                lease_size=lease_bytes(pool.capacity_bytes))
            fds = (tenant.fd,)
        self._send_frame(conn, conn.proto.welcome(welcome, self.limits.max_frame_bytes,
                                                  self._unpack_limits), fds)
        logger.debug("ems-server: %s ready", conn)

    def _request(self, conn: Session, cls: type[m.Message], v: list[Any]) -> None:
        """A checked request of a ready connection, its fields positional in ``v``
        (the order of the message's one definition): a tenant's request goes to
        ``ems.server.handlers``; Ping and Stats are answered here."""
        if self.handlers.serve(conn, cls, v):
            return
        if cls is m.Ping:
            self._reply(conn, m.Pong.wire(rid=v[0]))
        elif cls is m.Stats:
            rid, all_tenants = v
            self._reply(conn, m.StatsReply.wire(rid=rid, stats=self.report(conn, all_tenants)))
        elif "rid" in cls._NAMES:  # an admin session (one-way messages get no answer)
            self._error(conn, v[0], EmsErrorCode.EMS_INVALID_ARGUMENT,
                        "an admin session has no pool")

    # ------------------------------------------------------------ statistics
    def report(self, conn: Optional[Session] = None, all_tenants: bool = True) -> dict[str, Any]:
        """The wire form of :meth:`statistics` (``StatsReply.stats``)."""
        return self.statistics(conn, all_tenants).to_wire()

    def statistics(self, conn: Optional[Session] = None,
                   all_tenants: bool = True) -> DaemonReport:
        """Counters of the daemon and of each tenant (an admin sees every tenant,
        a tenant only itself), typed (:mod:`ems.protocol.report`)."""
        if conn is None or (conn.admin and all_tenants):
            tenants = list(self.registry)
        else:
            tenants = [conn.tenant] if conn.tenant is not None else []
        from ems._version import __version__
        server = ServerRow(
            pid=os.getpid(), version=__version__, protocol=PROTOCOL_VERSION,
            socket=self.path, uptime_s=round(self.clock() - self._started, 3),
            connections=len(self._conns), capacity_bytes=self.config.capacity_bytes,
            anonymous=self.registry.anonymous is not None,
            tenants=len(self.registry.named()),
            reservation_ttl_s=self.config.reservation_ttl_s, spin_us=self.config.spin_us,
            limits=dataclasses.asdict(self.limits), refused=dict(self.refused),
            buffered_bytes=self._buffered, accepting=not self._listener.paused_until)
        rows: dict[str, TenantRow] = {}
        for t in tenants:
            tiers = {}  # this tenant's lookups and writes in each tier
            for tier in self.tiers:
                tier_row = tier.tenant_report(t)
                if tier_row is not None:
                    tiers[tier.name] = tier_row
            rows[t.name] = TenantRow(**dataclasses.asdict(t.pool.statistics()),
                                     connections=t.connections, quota_bytes=t.quota_bytes,
                                     source=t.source, huge_pages=t.huge_pages,
                                     tiers=TenantTiers.of(tiers))
        parts: dict[str, WireRow] = {}
        members: list[Tier | Observer] = [*self.tiers, *self.observers]
        for part in members:
            part_report = part.report()
            if part_report is not None:
                parts[part.name] = part_report
        return DaemonReport.of(server, rows, parts)

