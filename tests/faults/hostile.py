"""Tools of the fault suite: raw protocol clients that lie, and /proc readings of a
daemon (CPU time, RSS, fds) and of this process (its pool mappings)."""

from __future__ import annotations

import mmap
import os
import socket
import time
from typing import Optional

from ems.protocol import FrameDecoder, encode, encode_wire
from ems.protocol import messages as m

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid``."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def pool_mappings() -> int:
    """Mappings of ems-server pool memfds in this process."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if "memfd:ems-pool" in line)


class RawClient:
    """A protocol client that does exactly what the test says (no SDK logic): connect,
    anonymous hello, then frames of the test's choosing."""

    def __init__(self, path: str, timeout_s: float = 5.0, hello: bool = True,
                 map_pool: bool = False) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout_s)
        self.sock.connect(path)
        self.decoder = FrameDecoder()
        self.welcome: Optional[m.Welcome] = None
        #: the tenant's pool memory, mapped (``map_pool``): to read pinned bytes
        self.pool: Optional[mmap.mmap] = None
        if hello:
            self.sock.sendall(encode(m.Hello(None, False)))
            data, fds_, _flags, _ = socket.recv_fds(self.sock, 1 << 16, 4)
            for fd in fds_:  # the pool's memfd
                if map_pool:
                    self.pool = mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED,
                                          mmap.PROT_READ)
                os.close(fd)
            self.decoder.feed(data)
            msg = self.next()
            assert isinstance(msg, m.Welcome), msg
            self.welcome = msg

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def request(self, wire: list) -> m.Message:
        self.sock.sendall(encode_wire(wire))
        return self.next()

    def next(self, timeout_s: float = 5.0) -> m.Message:
        deadline = time.monotonic() + timeout_s
        while True:
            msg = self.decoder.next_message()
            if msg is not None:
                return msg
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            data = self.sock.recv(1 << 16)
            if not data:
                raise ConnectionError("the daemon closed the connection")
            self.decoder.feed(data)

    def closed_by_daemon(self, timeout_s: float = 5.0) -> bool:
        """Whether the daemon closes this connection within ``timeout_s`` (frames it sent
        before, e.g. the Error that says why, are read and dropped)."""
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                self.sock.settimeout(max(0.01, deadline - time.monotonic()))
                if not self.sock.recv(1 << 16):
                    return True
        except socket.timeout:
            return False
        except OSError:
            return True
        return False

    def close(self) -> None:
        self.sock.close()
        if self.pool is not None:
            self.pool.close()
