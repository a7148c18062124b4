"""ClusterClient: batches of GET/SET/STRLEN on a Valkey Cluster, one pipeline per node.

A batch (:meth:`ClusterClient.run`) is grouped by the node that owns each key's slot;
each node's group goes out as one pipelined write and its replies are read in order,
all nodes in parallel. A GET's value goes from the socket straight into the memory the
caller gave for it (``ems.cluster.resp``); it counts as a hit only once its header
(magic, size, key) and its XXH3-64 checksum are verified (``ems.cluster.value``). A SET
sends the header and the caller's memory with ``sendmsg`` (gathered, never joined into
one ``bytes``).

Each node has two **lanes**, each a connection of its own and the one thread that uses
it: reads (GET, STRLEN, EXISTS) and writes (SET). A read never waits behind a write to
the same node: a write-behind of many MiB to a slow node, or one stuck on a hung node
until its own deadline, leaves that node's read lane free. (Strict priority on one
connection cannot give this: a pipeline already sent must be read to its end before
the next request's replies.)

One batch::

    refresh the slot map (when stale; at most every refresh_s)
      -> group by node and lane (a node whose breaker is open: its keys miss, no I/O)
      -> per node and lane, in parallel: connect (if needed), send all, read all
      -> MOVED: patch the slot map, retry on the new owner; ASK: retry there after
         ASKING (at most max_redirects rounds)
      -> per op: True (stored / verified hit) or False (miss, failure, past deadline)

Deadlines: every connect, send and ``recv`` waits at most what is left of the batch's
deadline (a connect at most ``connect_timeout_s``), per ``recv``, not per reply, so a
value that trickles in is cut off at the deadline (``ems.cluster.resp``) and its op
is a miss. A group still queued on its lane at the deadline (the lane busy with an
earlier batch) is given up without being sent: :meth:`ClusterClient.run` returns by
the deadline (+ ``resp.REARM_S``) whatever the nodes do, and no op is touched after it
returns. A failure drops that lane's connection and counts against the node's breaker
(``ems.cluster.topology``). Nothing here raises for a node's failure: the caller gets
misses.

A write group queued behind a **stuck** write (its lane's running batch has neither
sent nor received for :data:`WRITE_STUCK_S`: a hung or cut-off node) gives up at once
instead of at its deadline, so a run of saves to a hung node does not hold the
caller's threads for their whole bound (the node's breaker then skips it).

A group's life on its lane::

    QUEUED --(its lane's thread takes it, before the deadline)--> RUNNING --> DONE
       |                                                  (I/O bounded by the deadline)
       +--(the deadline passes first: run() gives it up)--> ABANDONED (never sent)
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional, Sequence

from ems.cluster import value
from ems.cluster.keys import hash_slot
from ems.cluster.resp import (
    NARROW_FILL,
    REARM_S,
    Deadline,
    ErrorReply,
    Reader,
    RespError,
    command,
    send_parts,
    set_parts,
)
from ems.cluster.topology import Addr, ClusterSettings, SlotMap, tls_context

__all__ = ["ClusterClient", "Op"]

logger = logging.getLogger(__name__)

_MAX_NODES = 256
#: GETs of values at least this large read with narrow fills (``ems.cluster.resp``)
_NARROW_FROM = 16 << 10
_BUFFER_ALL = 1 << 30  # no limit: each fill takes what the buffer has room for
#: The two lanes of a node (module docstring): an op's kind picks one.
READ, WRITE = "read", "write"
#: A write lane whose running batch has not sent or received for this long is stuck
#: (a hung or cut-off node): write groups queued behind it give up at once instead of
#: at their deadlines. The tier's worker threads are shared by reads and writes, and
#: each write batch holds one until run() returns: four saves to a hung node held all
#: four for their 2 s bound and a load behind them got EMS_IO_TIMEOUT (tests/netns).
#: A healthy lane arms a wait per sendmsg and per recv, far more often than this.
WRITE_STUCK_S = 0.25
_POLL_S = 0.05
_Lane = tuple[Addr, str]


class Op:
    """One key of a batch: ``kind`` "get" (into ``target``), "set" (``parts``: header
    and payload buffers), "len" (STRLEN equals ``size`` + header), "exists". ``ok`` is
    the outcome; ``absent``: the home node answered that it holds no such key (a nil
    GET, STRLEN 0, EXISTS 0), as opposed to a miss by an error, a timeout or a node
    that could not be asked."""

    __slots__ = ("kind", "key", "slot", "target", "parts", "size", "ok", "absent", "moved",
                 "ask")

    def __init__(self, kind: str, key: bytes, *, target: Optional[memoryview] = None,
                 parts: Sequence[Any] = (), size: int = 0) -> None:
        self.kind = kind
        self.key = key
        self.slot = hash_slot(key)
        self.target = target
        self.parts = parts
        self.size = size
        self.ok = False
        self.absent = False
        self.moved = False
        self.ask: Optional[Addr] = None


def lane_of(op: Op) -> str:
    """The lane an op goes on: SET writes, everything else reads."""
    return WRITE if op.kind == "set" else READ


class _Conn:
    __slots__ = ("sock", "reader")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = Reader(sock)


class _Group:
    """One node's and lane's ops of a batch: QUEUED -> RUNNING -> DONE, or QUEUED ->
    ABANDONED (module docstring). ``claim`` and ``abandon`` decide under the lock which
    of the lane's thread and :meth:`ClusterClient.run` owns the ops."""

    __slots__ = ("lock", "state")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.state = "queued"

    def claim(self, deadline: float) -> bool:
        with self.lock:
            if self.state != "queued" or time.monotonic() >= deadline:
                self.state = "abandoned"
                return False
            self.state = "running"
            return True

    def abandon(self) -> bool:
        """True when the group had not started (it never will)."""
        with self.lock:
            if self.state == "queued":
                self.state = "abandoned"
            return self.state == "abandoned"


class ClusterClient:
    """See the module docstring. Thread-safe; :meth:`close` ends every connection."""

    def __init__(self, settings: ClusterSettings) -> None:
        self.settings = settings
        self.slots = SlotMap(settings)
        self._lock = threading.Lock()
        self._refresh_lock = threading.Lock()
        self._executors: dict[_Lane, ThreadPoolExecutor] = {}
        self._conns: dict[_Lane, _Conn] = {}  # each used only by its lane's thread
        self._started: dict[_Lane, float] = {}  # lane -> when its running group began
        self._ssl: Optional[ssl.SSLContext] = tls_context(settings)
        self._closed = False
        self.down_logged = False
        #: MOVED and ASK answers followed (stats)
        self.redirects = {"moved": 0, "ask": 0}

    # ------------------------------------------------------------ batches
    def run(self, ops: Sequence[Op], deadline: float) -> None:
        """Run ``ops`` by ``deadline`` (``time.monotonic()``); sets each ``op.ok``.
        Returns by the deadline (+ ``resp.REARM_S``); no op is touched after."""
        pending = list(ops)
        for _ in range(self.settings.max_redirects + 1):
            self._maybe_refresh(deadline)
            groups: dict[tuple[Addr, bool, str], list[Op]] = {}
            now = time.monotonic()
            for op in pending:
                addr = op.ask or self.slots.node_of(op.slot)
                if addr is None or now >= deadline or not self.slots.usable(addr, now):
                    op.ok = False
                    continue
                groups.setdefault((addr, op.ask is not None, lane_of(op)), []).append(op)
                op.moved, op.ask, op.ok, op.absent = False, None, False, False
            if not groups:
                break
            running: list[tuple[Future, _Group, list[Op], _Lane]] = []
            for (addr, asking, lane), group in groups.items():
                ex = self._executor((addr, lane))
                if ex is None:
                    continue
                g = _Group()
                running.append((ex.submit(self._run_group, g, addr, lane, group, deadline,
                                          asking), g, group, (addr, lane)))
            for f, g, group, key in running:
                if not self._wait(f, key, deadline):
                    if g.abandon():
                        for op in group:
                            op.ok, op.moved, op.ask = False, False, None
                    else:  # running: its I/O ends by the deadline; the ops are its own
                        f.result()
            pending = [op for op in pending if op.moved or op.ask is not None]
            if not pending:
                break
        for op in pending:  # out of redirect rounds
            op.ok = False

    def _wait(self, f: Future, key: _Lane, deadline: float) -> bool:
        """Wait for a group: False when it is still queued at its deadline (its lane
        busy with an earlier batch) or, for a write, behind a stuck one."""
        while True:
            left = deadline - time.monotonic()
            step = left + REARM_S if key[1] == READ else min(left + REARM_S, _POLL_S)
            try:
                f.result(max(0.0, step))
                return True
            except TimeoutError:
                if left <= 0 or (key[1] == WRITE and self._stuck(key)):
                    return False

    def _stuck(self, key: _Lane) -> bool:
        started = self._started.get(key, 0.0)
        if not started:
            return False
        conn = self._conns.get(key)
        last = max(started, conn.reader.deadline.progressed if conn is not None else 0.0)
        return time.monotonic() - last > WRITE_STUCK_S

    def command(self, addr: Addr, *args: Any, timeout_s: float = 1.0) -> Any:
        """One control command on a fresh connection (stats, tests); raises OSError."""
        deadline = time.monotonic() + timeout_s
        sock = self._connect(addr, deadline)
        try:
            sock.sendall(command(*args))
            return Reader(sock, deadline=deadline).reply()
        finally:
            sock.close()

    # ------------------------------------------------------------ one node
    def _run_group(self, group: _Group, addr: Addr, lane: str, ops: list[Op],
                   deadline: float, asking: bool) -> None:
        if group.claim(deadline):
            self._started[(addr, lane)] = time.monotonic()
            try:
                self._run_node((addr, lane), ops, deadline, asking)
            finally:
                self._started[(addr, lane)] = 0.0

    def _run_node(self, key: _Lane, ops: list[Op], deadline: float, asking: bool) -> None:
        addr = key[0]
        h = self.slots.health(addr)
        try:
            conn = self._conns.get(key)
            if conn is None:
                conn = self._conns[key] = _Conn(self._connect(addr, deadline))
            sock, reader = conn.sock, conn.reader
            reader.deadline.set(deadline)  # every send and recv waits within it
            parts: list[Any] = []
            asking_cmd = command("ASKING") if asking else b""
            for op in ops:
                if asking:
                    parts.append(asking_cmd)
                if op.kind == "get":
                    parts.append(command("GET", op.key))
                elif op.kind == "len":
                    parts.append(command("STRLEN", op.key))
                elif op.kind == "exists":
                    parts.append(command("EXISTS", op.key))
                else:
                    parts.extend(set_parts(op.key, op.parts))
            sent = (send_parts(sock, parts, reader.deadline) if self._ssl is None
                    else _send_tls(sock, parts, reader.deadline))
            got = 0
            for op in ops:
                if asking:
                    reader.reply()  # +OK
                # a large value goes from the socket into its target, not via the buffer
                reader.fill_limit = (NARROW_FILL if op.kind == "get" and op.size >= _NARROW_FROM
                                     else _BUFFER_ALL)
                got += self._read_reply(reader, op, addr)
            reader.fill_limit = _BUFFER_ALL
            h.ops += len(ops)
            h.bytes_out += sent
            h.bytes_in += got
            self.slots.ok(addr)
        except (OSError, RespError, ValueError) as exc:
            for op in ops:
                op.ok, op.moved, op.ask = False, False, None
            self._drop(key)
            why = "timeout" if isinstance(exc, socket.timeout) else f"{type(exc).__name__}: {exc}"
            self.slots.failed(addr, why)
        except Exception:  # noqa: BLE001 - a bug: the node's keys miss, the daemon lives
            logger.exception("ems cluster: internal error talking to %s:%d", *addr)
            for op in ops:
                op.ok = False
            self._drop(key)

    def _read_reply(self, reader: Reader, op: Op, addr: Addr) -> int:
        """Read ``op``'s reply; the bytes of value read."""
        if op.kind == "get":
            n, other = reader.head()
            if n == -2:
                self._error(op, other)
                return 0
            if n < 0:
                op.absent = True  # nil: not stored
                return 0
            if n != value.HEADER + op.size:  # another size, or not ours: a miss
                reader.skip(n)
                reader.crlf()
                return n
            head = bytearray(value.HEADER)
            reader.read_into(memoryview(head))
            assert op.target is not None
            reader.read_into(op.target)
            reader.crlf()
            checksum = value.check_header(head, op.key, op.size)
            op.ok = checksum is not None and value.digest(op.target) == checksum
            if not op.ok:
                logger.warning("ems cluster: a corrupt or foreign value under %r on %s:%d "
                               "(a miss)", op.key[:80], *addr)
            return n
        reply = reader.reply()
        if isinstance(reply, ErrorReply):
            self._error(op, reply)
        elif op.kind == "len":
            op.ok = reply == value.HEADER + op.size
            op.absent = reply == 0  # (STRLEN of a missing key)
        elif op.kind == "exists":
            op.ok = reply == 1
            op.absent = reply == 0
        else:
            op.ok = reply == "OK"
        return 0

    def _error(self, op: Op, reply: Any) -> None:
        text = str(reply)
        kind, _, rest = text.partition(" ")
        if kind in ("MOVED", "ASK"):
            slot, _, target = rest.partition(" ")
            host, _, port = target.rpartition(":")
            if port.isdigit():
                addr = (host or self.settings.seeds[0][0], int(port))
                if kind == "MOVED":
                    self.slots.moved(int(slot), addr)
                    op.moved = True
                    self.redirects["moved"] += 1
                else:
                    op.ask = addr
                    self.redirects["ask"] += 1
                return
        op.ok = False
        if kind not in ("CLUSTERDOWN", "TRYAGAIN", "LOADING", "OOM"):
            logger.warning("ems cluster: %s on %r", text[:200], op.key[:80])

    # ------------------------------------------------------------ topology
    def _maybe_refresh(self, deadline: float) -> None:
        """A stale slot map is refreshed in the background (requests go on with the
        map they have, MOVED patches it); only without any map yet does a request
        wait for the refresh (within its deadline)."""
        s = self.slots
        now = time.monotonic()
        if not s.stale or now - s.refreshed_at < self.settings.refresh_s:
            return
        if not self._refresh_lock.acquire(blocking=False):
            if s.loaded:
                return  # another thread refreshes; use the map as it is
            # No map yet, and another thread is loading it (two writers at start):
            # going on would miss every key, so wait for it, within the deadline.
            if not self._refresh_lock.acquire(timeout=max(0.0, deadline - now)):
                return
            if s.loaded:
                self._refresh_lock.release()
                return
        if s.loaded:
            threading.Thread(target=self._refresh_in_background, daemon=True,
                             name="ems-cluster-refresh").start()
            return
        try:
            self.refresh(deadline)
        finally:
            self._refresh_lock.release()

    def _refresh_in_background(self) -> None:
        try:
            self.refresh(time.monotonic() + self.settings.op_timeout_s)
        except Exception:  # noqa: BLE001 - the next stale request tries again
            logger.exception("ems cluster: refreshing the slot map failed")
        finally:
            self._refresh_lock.release()

    def refresh(self, deadline: float) -> bool:
        """Load the slot map from the first node that answers ``CLUSTER SLOTS``."""
        s = self.slots
        candidates = [a for a in s.known() if s.usable(a, time.monotonic())]
        candidates += [a for a in self.settings.seeds if a not in candidates]
        why = "no node tried"
        for addr in candidates:
            if time.monotonic() >= deadline:
                break
            try:
                sock = self._connect(addr, deadline)
                try:
                    sock.sendall(command("CLUSTER", "SLOTS"))
                    reply = Reader(sock, deadline=deadline).reply()
                finally:
                    sock.close()
            except (OSError, RespError) as exc:
                why = f"CLUSTER SLOTS: {type(exc).__name__}: {exc}"
                logger.debug("ems cluster: %s:%d: %s", addr[0], addr[1], why)
                s.failed(addr, why)  # a failing node (a TLS or AUTH refusal: in its row)
                continue
            if isinstance(reply, list) and reply:
                covered = s.load(reply)
                if self.down_logged:
                    logger.info("ems cluster: reachable again (%d slots covered)", covered)
                    self.down_logged = False
                return True
        s.refreshed_at = time.monotonic()
        if not self.down_logged:
            logger.warning("ems cluster: no node answers (last: %s); the local tier serves "
                           "alone until one does", why)
            self.down_logged = True
        return False

    # ------------------------------------------------------------ connections
    def _executor(self, key: _Lane) -> Optional[ThreadPoolExecutor]:
        with self._lock:
            if self._closed:
                return None
            ex = self._executors.get(key)
            if ex is None:
                if len(self._executors) >= 2 * _MAX_NODES:
                    logger.warning("ems cluster: more than %d nodes; ignoring %s:%d",
                                   _MAX_NODES, *key[0])
                    return None
                ex = self._executors[key] = ThreadPoolExecutor(
                    1, thread_name_prefix=f"ems-cluster-{key[0][1]}-{key[1]}")
            return ex

    def _connect(self, addr: Addr, deadline: float) -> socket.socket:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise socket.timeout("the request's deadline passed before connecting")
        sock = socket.create_connection(addr, timeout=min(remaining,
                                                          self.settings.connect_timeout_s))
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._ssl is not None:
                sock = self._ssl.wrap_socket(sock, server_hostname=addr[0])
            if self.settings.password is not None:
                args = ["AUTH"] + ([self.settings.username] if self.settings.username else [])
                sock.sendall(command(*args, self.settings.password))
                reply = Reader(sock, 4096, deadline).reply()
                if reply != "OK":
                    raise ConnectionRefusedError(f"AUTH refused by {addr[0]}:{addr[1]}: "
                                                 f"{str(reply)[:80]}")
        except BaseException:
            sock.close()
            raise
        return sock

    def _drop(self, key: _Lane) -> None:
        conn = self._conns.pop(key, None)
        if conn is not None:
            try:
                conn.sock.close()
            except OSError:
                pass

    def close(self) -> None:
        with self._lock:
            self._closed = True
            executors, self._executors = list(self._executors.values()), {}
        for ex in executors:
            ex.shutdown(wait=True)
        for key in list(self._conns):
            self._drop(key)


def _send_tls(sock: socket.socket, parts: Sequence[Any], deadline: Deadline) -> int:
    """TLS sockets have no sendmsg: each part with sendall (still no join)."""
    total = 0
    for p in parts:
        deadline.arm()
        sock.sendall(p)
        total += len(p)
    return total
