"""A daemon that lies: the handshake is honest (a real memfd segment), the replies are
not. Every lie must reach the caller as ``EMS_PROTOCOL_ERROR`` (or a plain miss), never
as a write outside the segment, a wrong byte in the caller's buffer, or a hang; and the
client gives back what the lie granted (Abort / Release / Return).

The daemon is ``ems.protocol.connection.ServerConnection`` driven by a thread of this
test over a unix socket in a temp dir; ``lie(cls, values)`` answers each request.
"""

from __future__ import annotations

import ctypes
import os
import socket
import threading
import time
from typing import Callable, Optional

import pytest
from support.itest_support import transport_load, transport_save

from ems import CcKvOption, EmsErrorCode, EmsException
from ems.client.movers import V0Mover
from ems.client.remote import RemoteTransport
from ems.futures import Task
from ems.keys import Request
from ems.protocol import messages as m
from ems.protocol.connection import Phase, ServerConnection

pytestmark = pytest.mark.integration

SEG = 1 << 20  # the segment the liar hands out
SIZE = 4096


class LyingDaemon:
    """One client at a time; what each request gets is ``lie(cls, values)`` (a wire
    reply, or None for no answer). One-way messages are recorded in ``got``."""

    def __init__(self, path: str, lie: Callable[[type, list], Optional[list]],
                 lease_size: int = 0) -> None:
        self.lie, self.lease_size = lie, lease_size
        self.got: list[tuple[type, list]] = []
        self.fd = os.memfd_create("ems-liar")
        os.ftruncate(self.fd, SEG)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(4)
        self.sock.settimeout(0.1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:  # (the accept timeout, or closed)
                continue
            with conn:
                self._session(conn)

    def _session(self, conn: socket.socket) -> None:
        proto = ServerConnection()
        conn.settimeout(0.1)
        while not self._stop.is_set():
            try:
                data = conn.recv(1 << 16)
            except socket.timeout:
                continue
            except OSError:
                return
            if not data:
                return
            for cls, v in proto.receive(data):
                if proto.phase is not Phase.READY:  # the Hello (anonymous)
                    welcome = m.Welcome(tenant="(anonymous)", segment_id=7, segment_size=SEG,
                                        reservation_ttl_s=30.0, server="liar", max_keys=64,
                                        align=64, lease_size=self.lease_size)
                    socket.send_fds(conn, [proto.welcome(welcome)], [self.fd])
                    continue
                self.got.append((cls, v))
                wire = self.lie(cls, v)
                if wire is not None:
                    conn.sendall(proto.reply(wire))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()
        os.close(self.fd)

    def sent(self, cls: type) -> list[list]:
        return [v for c, v in self.got if c is cls]

    def given_back(self, cls: type, want: list[int], at: int = 0) -> list[int]:
        """The entries (field ``at``) of the one-way ``cls`` messages received, once
        they are ``want`` or after 2 s (they may follow the caller's exception)."""
        deadline = time.monotonic() + 2.0
        while True:
            got = sorted(x for v in self.sent(cls) for x in v[at])
            if got == want or time.monotonic() > deadline:
                return got
            time.sleep(0.01)


@pytest.fixture
def liar(tmp_path):
    made: list[tuple[LyingDaemon, RemoteTransport]] = []

    def make(lie: Callable[[type, list], Optional[list]], lease_size: int = 0
             ) -> tuple[LyingDaemon, RemoteTransport]:
        path = str(tmp_path / f"liar{len(made)}.sock")
        daemon = LyingDaemon(path, lie, lease_size)
        try:
            transport = RemoteTransport.connect(path, None, None, 3.0)
        except BaseException:
            daemon.close()
            raise
        made.append((daemon, transport))
        return daemon, transport
    yield make
    for daemon, transport in made:
        transport.close()
        daemon.close()


def _protocol_error(exc: EmsException) -> None:
    assert exc.status_code() is EmsErrorCode.EMS_PROTOCOL_ERROR, exc


GRANTS = {
    # the last key's reservation: (status, offset, size) the liar answers for it, and
    # the first key's status (an EXISTS beside: the batch's ranges are checked key by key)
    "unknown status": (9, 0, SIZE, 0),
    "past the segment": (0, SEG - SIZE // 2, SIZE, 0),
    "wrong size": (0, 0, SIZE // 2, 0),
    "past the segment, after an EXISTS": (0, SEG - SIZE // 2, SIZE, 1),
    "wrong size, after an EXISTS": (0, 0, SIZE // 2, 1),
}


@pytest.mark.parametrize("case", list(GRANTS))
def test_a_lying_reservation_is_refused_and_given_back(liar, case):
    status, offset, size, first = GRANTS[case]

    def lie(cls: type, v: list) -> Optional[list]:
        if cls is m.Reserve:
            n = len(v[1])
            return m.Granted.wire(rid=v[0], statuses=[first] + [0] * (n - 2) + [status],
                                  tokens=list(range(1, n + 1)),
                                  offsets=[SIZE * i for i in range(n - 1)] + [offset],
                                  sizes=[SIZE] * (n - 1) + [size])
        return None
    daemon, transport = liar(lie)
    with pytest.raises(EmsException) as err:
        transport_save(transport, ["a", "b", "c"], SIZE)
    _protocol_error(err.value)
    want = ([1] if first == 0 else []) + [2] + ([3] if status == 0 else [])  # NEW: back
    assert daemon.given_back(m.Abort, want) == want
    assert not daemon.sent(m.Commit)


PINS = {"past the segment": (SEG - 100, SIZE), "wrong size": (0, SIZE * 2),
        "too many pins": None}


@pytest.mark.parametrize("case", list(PINS))
def test_a_lying_pin_writes_nothing_into_the_callers_buffer(liar, case):
    def lie(cls: type, v: list) -> Optional[list]:
        if cls is m.Acquire:
            if PINS[case] is None:
                return m.Pinned.wire(rid=v[0], tokens=[5, 6, 7], offsets=[0, 0, 0],
                                     sizes=[SIZE] * 3)
            offset, size = PINS[case]
            return m.Pinned.wire(rid=v[0], tokens=[5], offsets=[offset], sizes=[size])
        return None
    daemon, transport = liar(lie)
    with pytest.raises(EmsException) as err:
        transport_load(transport, ["a"], SIZE)
    _protocol_error(err.value)
    want = [5, 6, 7] if PINS[case] is None else [5]
    assert daemon.given_back(m.Release, want) == want


def test_a_lying_lease_and_put_are_refused(liar):
    """A Leased past the segment is given back; a Stored of the wrong length too."""
    def bad_lease(cls: type, v: list) -> Optional[list]:
        if cls is m.Lease:
            return m.Leased.wire(rid=v[0], offset=SEG - 4096, size=65536)
        return None
    daemon, transport = liar(bad_lease, lease_size=65536)
    with pytest.raises(EmsException) as err:
        transport_save(transport, ["a"], SIZE)
    _protocol_error(err.value)
    assert SEG - 4096 in daemon.given_back(m.Return, [SEG - 4096])

    def bad_put(cls: type, v: list) -> Optional[list]:
        if cls is m.Lease:
            return m.Leased.wire(rid=v[0], offset=0, size=65536)
        if cls is m.Put:
            return m.Stored.wire(rid=v[0], ok=[True, True], lease_offset=0, lease_size=0)
        return None
    daemon, transport = liar(bad_put, lease_size=65536)
    with pytest.raises(EmsException) as err:
        transport_save(transport, ["a"], SIZE)
    _protocol_error(err.value)
    assert daemon.sent(m.Put)


def test_a_daemon_that_never_answers_costs_the_deadline_only(liar):
    def silent(cls: type, v: list) -> Optional[list]:
        return None
    _, transport = liar(silent)
    buf = ctypes.create_string_buffer(b"\x01" * SIZE, SIZE)
    req = Request("load", ["a"], [SIZE], V0Mover([[(ctypes.addressof(buf), SIZE)]]),
                  CcKvOption(timeout=300))
    started = time.monotonic()
    with pytest.raises(EmsException) as err:
        transport.load(req, Task(300, "load"))
    assert err.value.status_code() is EmsErrorCode.EMS_IO_TIMEOUT
    assert time.monotonic() - started < 2.0  # (the deadline, not a hang; bounds only)
    assert buf.raw == b"\x01" * SIZE
