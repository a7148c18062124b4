"""A user-space link impairer: a TCP relay run in the switch namespace of a
:class:`~ems.testing.netns.NetBed` (``python -m ems.testing.relay``).

This kernel has no ``sch_netem`` (nor a tc classifier to drop packets at random), so
the bed impairs the links between hosts and Valkey nodes here instead: every
client connection to node ``j`` goes to the relay's address for ``j`` (the node
announces it to clients with ``cluster-announce-client-ipv4``), and the relay
forwards it to the node. The cluster bus does not go through it. Per pair (the
client's host ``i``, the node ``j``; ``0`` for "any") a rule says:

``block``
    data is held, not forwarded (a blackhole: connects succeed, nothing comes back);
``delay_ms``
    each chunk is forwarded that long after it arrived, in order (one way: a request
    and its reply cross the relay twice, so RTT = 2 x delay);
``loss``
    with this probability a chunk is held back 200 ms more (Linux's minimum TCP
    retransmission timeout: what losing the segment that ends a request or a reply
    costs the exchange), and every chunk after it waits behind it: the stalls add up,
    as retransmission timeouts do on a link that loses that much (30% turns a 64 MiB
    transfer into a trickle of well under 1 MB/s);
``rate_bps``
    bytes per second, sent in small pieces (a slow, trickling link).

What it is not: real packet loss (no congestion window, no fast retransmit), so its
figures are the application-visible shape of a fault, not a kernel's.

Control: one JSON object per line on stdin, ``{"rules": [[i, j, {...}], ...]}``
replaces every rule; the relay answers ``ok`` on stdout once they apply to every
connection, new and open. It listens on ``--listen ADDR:PORT=UPSTREAM:PORT`` (one per
node, repeated) and says ``ready`` on stdout once it accepts.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import socket
import sys
import threading
import time
from typing import Any, Optional, Sequence

__all__ = ["LOSS_STALL_S", "Rule", "main"]

#: What a lost chunk costs (Linux's TCP_RTO_MIN).
LOSS_STALL_S = 0.2
_CHUNK = 64 << 10
_PIECE_S = 0.01  # a rate-limited link sends a piece every this long
_QUEUE_BYTES = 8 << 20  # a direction's backlog before the relay stops reading


class Rule:
    """One pair's impairment (see the module docstring)."""

    __slots__ = ("block", "delay_s", "loss", "rate_bps")

    def __init__(self, block: bool = False, delay_ms: float = 0.0, loss: float = 0.0,
                 rate_bps: int = 0) -> None:
        self.block = block
        self.delay_s = delay_ms / 1000
        self.loss = loss
        self.rate_bps = rate_bps


_NONE = Rule()


class _Rules:
    def __init__(self, hosts: dict[str, int]) -> None:
        self.hosts = hosts  # client address -> host number
        self.cond = threading.Condition()
        self.table: dict[tuple[int, int], Rule] = {}
        self.version = 0

    def set(self, rules: Sequence[Any]) -> None:
        with self.cond:
            self.table = {(int(i), int(j)): Rule(**r) for i, j, r in rules}
            self.version += 1
            self.cond.notify_all()

    def get(self, host: int, node: int) -> Rule:
        t = self.table
        return (t.get((host, node)) or t.get((host, 0)) or t.get((0, node))
                or t.get((0, 0)) or _NONE)


class _Direction:
    """One direction of one connection: a reader thread queues chunks with the time
    each may leave; a writer thread sends them then."""

    def __init__(self, rules: _Rules, host: int, node: int, src: socket.socket,
                 dst: socket.socket, rng: random.Random) -> None:
        self.rules, self.host, self.node = rules, host, node
        self.src, self.dst, self.rng = src, dst, rng
        self.queue: collections.deque = collections.deque()
        self.queued = 0
        self.cond = threading.Condition()
        self.closed = False
        self.last_due = 0.0

    def start(self) -> None:
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._write, daemon=True).start()

    def _read(self) -> None:
        try:
            while True:
                with self.cond:
                    while self.queued > _QUEUE_BYTES and not self.closed:
                        self.cond.wait(0.1)
                data = self.src.recv(_CHUNK)
                if not data:
                    break
                rule = self.rules.get(self.host, self.node)
                stall = (LOSS_STALL_S if rule.loss and self.rng.random() < rule.loss
                         else 0.0)
                with self.cond:  # after the chunks before it, and their stalls
                    due = max(time.monotonic() + rule.delay_s, self.last_due) + stall
                    self.last_due = due
                    self.queue.append((due, data))
                    self.queued += len(data)
                    self.cond.notify_all()
        except OSError:
            pass
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def _write(self) -> None:
        try:
            while True:
                with self.cond:
                    while not self.queue and not self.closed:
                        self.cond.wait(0.1)
                    if not self.queue:
                        break
                    due, data = self.queue[0]
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                while self.rules.get(self.host, self.node).block:
                    with self.rules.cond:
                        self.rules.cond.wait(0.05)
                self._send(data)
                with self.cond:
                    self.queue.popleft()
                    self.queued -= len(data)
                    self.cond.notify_all()
        except OSError:
            pass
        for s in (self.src, self.dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _send(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            rate = self.rules.get(self.host, self.node).rate_bps
            if not rate:
                self.dst.sendall(view)
                return
            piece = max(1, int(rate * _PIECE_S))
            self.dst.sendall(view[:piece])
            view = view[piece:]
            time.sleep(_PIECE_S)


def _serve(rules: _Rules, listener: socket.socket, node: int,
           upstream: tuple[str, int]) -> None:
    rng = random.Random(node)
    while True:
        try:
            client, (peer, _) = listener.accept()
        except OSError:
            return
        try:
            server = socket.create_connection(upstream, timeout=2.0)
        except OSError:
            client.close()  # the node is down or cut off: the client sees a reset
            continue
        server.settimeout(None)
        for s in (client, server):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        host = rules.hosts.get(peer, 0)
        _Direction(rules, host, node, client, server, rng).start()
        _Direction(rules, host, node, server, client, rng).start()


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ems.testing.relay")
    p.add_argument("--listen", action="append", default=[],
                   help="NODE=ADDR:PORT=UPSTREAM:PORT, one per node")
    p.add_argument("--host", action="append", default=[],
                   help="N=ADDR: a client address and the host it belongs to")
    ns = p.parse_args(argv)
    hosts = {}
    for item in ns.host:
        n, _, addr = item.partition("=")
        hosts[addr] = int(n)
    rules = _Rules(hosts)
    for item in ns.listen:
        node, listen, upstream = item.split("=")
        ls = socket.socket()
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind(_addr(listen))
        ls.listen(128)
        threading.Thread(target=_serve, args=(rules, ls, int(node), _addr(upstream)),
                         daemon=True).start()
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip():
            rules.set(json.loads(line)["rules"])
            print("ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
